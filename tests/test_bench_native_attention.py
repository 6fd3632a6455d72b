"""The batched-attention benchmark's kernel floor does the layer call's work (its ``bound`` column rests on that).

Oracle: dense fp64 attention per request, written out here from the benchmark's pool and slot table.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_native_attention import PRESETS, kernel_floor_calls, layer_call_args


def dense_reference(shape, mode, kind, args, contexts):
    """[rows, heads, head_dim]: each request's rows over its keys (causal over the text for self-attention)."""
    query, k_cache, v_cache, req_to_token, pool_rows, _, layer = args
    rows = 1 if mode == "decode" else shape.extend_rows
    group = shape.num_heads // shape.num_kv_heads
    outputs = []
    for index, context in enumerate(contexts):
        slots = req_to_token[pool_rows[index]].long()
        keys = slots[: shape.encoder_len] if kind == "cross" else slots[shape.encoder_len : shape.encoder_len + context]
        k = k_cache[keys].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, keys, dim]
        v = v_cache[keys].double().repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[index * rows : (index + 1) * rows].double().transpose(0, 1)  # [heads, rows, dim]
        scores = q @ k.transpose(1, 2) * layer.scale
        if kind == "self":  # row r is the text position context - rows + r and sees the keys up to itself
            hidden = torch.arange(len(keys)) > torch.arange(context - rows, context)[:, None]
            scores = scores.masked_fill(hidden, float("-inf"))
        outputs.append((scores.softmax(-1) @ v).transpose(0, 1))
    return torch.cat(outputs)


@pytest.mark.parametrize("kind", ["self", "cross"])
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_both_kernel_floors_compute_the_layer_call(mode, kind):
    shape = PRESETS["tiny"]
    args, contexts = layer_call_args(shape, mode, 5, "fp32", kind)
    expected = dense_reference(shape, mode, kind, args, contexts).float()
    one_call_per_request, one_padded_call = kernel_floor_calls(shape, mode, kind, args, contexts)
    per_request = torch.cat([out[0].transpose(0, 1) for out, _ in one_call_per_request()])
    padded, _ = one_padded_call()
    padded = padded.transpose(1, 2).reshape(expected.shape)
    torch.testing.assert_close(per_request, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded, expected, atol=1e-5, rtol=1e-5)
