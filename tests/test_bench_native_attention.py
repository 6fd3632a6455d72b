"""The batched-attention benchmark's kernel floor does the layer call's work (its ``bound`` column rests on that).

Oracle: the suite's dense reference attention per request, over the keys read from the benchmark's pool and slot
table (``support.attention``).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_native_attention import PRESETS, Shape, kernel_floor_calls, layer_call_args
from support.attention import causal_with_prefix, reference_attention

# The tiny preset, and an encoder longer than every text context (cross rows must still see the whole encoder).
SHAPES = {"tiny": PRESETS["tiny"], "long-encoder": Shape(4, 2, 32, 40, (8, 24), 6)}


def dense_reference(shape, mode, kind, args, contexts):
    """[rows, heads, head_dim]: each request's rows over its keys (causal over the text for self-attention)."""
    query, k_cache, v_cache, req_to_token, pool_rows, _, layer = args
    rows = 1 if mode == "decode" else shape.extend_rows
    outputs = []
    for index, context in enumerate(contexts):
        slots = req_to_token[pool_rows[index]].long()
        if kind == "cross":
            keys = slots[: shape.encoder_len]
            visible = torch.ones(rows, len(keys), dtype=torch.bool)
        else:
            keys = slots[shape.encoder_len : shape.encoder_len + context]
            visible = causal_with_prefix(rows, context - rows)
        q = query[index * rows : (index + 1) * rows]
        outputs.append(reference_attention(q, k_cache[keys], v_cache[keys], visible, layer.scale))
    return torch.cat(outputs)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("kind", ["self", "cross"])
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_both_kernel_floors_compute_the_layer_call(mode, kind, shape):
    args, contexts = layer_call_args(shape, mode, 5, "fp32", kind)
    expected = dense_reference(shape, mode, kind, args, contexts)
    one_call_per_request, one_padded_call = kernel_floor_calls(shape, mode, kind, args, contexts)
    per_request = torch.cat([out[0].transpose(0, 1) for out, _ in one_call_per_request()])
    padded, _ = one_padded_call()
    padded = padded.transpose(1, 2).reshape(expected.shape)
    torch.testing.assert_close(per_request, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded, expected, atol=1e-5, rtol=1e-5)
