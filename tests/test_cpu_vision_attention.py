"""The CPU vision tower attends per frame (``patches.cpu_vision_attention``): each ``cu_seqlens`` segment sees only
itself, checked against a dense fp64 computation per segment; no batch-wide mask is built (stock keeps each one in
an ``lru_cache``); a call the hook does not handle reaches stock. Served through the realtime and media tests, whose
frames go through the patched tower."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.layers.attention.vision import VisionSdpaAttention

from mossvl_ascend.patches.cpu_vision_attention import per_segment_on_cpu

HEADS, HEAD_SIZE = 4, 16


def dense_per_segment(q, k, v, lengths, scale):
    """The oracle: for every segment alone, softmax(q k^T * scale) v in fp64."""
    outs, start = [], 0
    for length in lengths:
        rows = slice(start, start + length)
        qs, ks, vs = (t[rows].double().transpose(0, 1) for t in (q, k, v))  # [h, L, d]
        weights = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        outs.append((weights @ vs).transpose(0, 1))
        start += length
    return torch.cat(outs)


def refuse(*args, **kwargs):
    raise AssertionError("stock's masked attention was called")


@pytest.mark.parametrize("lengths", [[64, 64, 64], [64, 16, 36], [49]], ids=["equal", "unequal", "one"])
def test_each_segment_attends_within_itself(lengths):
    backend = VisionSdpaAttention(head_dim=HEAD_SIZE, num_heads=HEADS, num_kv_heads=HEADS, flatten_batch=True)
    generator = torch.Generator().manual_seed(sum(lengths))
    q, k, v = (torch.randn(sum(lengths), HEADS, HEAD_SIZE, generator=generator) for _ in range(3))
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    masks_before = VisionSdpaAttention._generate_mask_cache.cache_info().currsize

    out = per_segment_on_cpu(refuse, backend, q, k, v, 1, cu_seqlens=cu_seqlens)

    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), dense_per_segment(q, k, v, lengths, backend.scale), atol=1e-5, rtol=0)
    assert VisionSdpaAttention._generate_mask_cache.cache_info().currsize == masks_before
    if len(lengths) > 1:  # attention across the whole batch (a mask of the wrong polarity or none) is far from it
        whole = dense_per_segment(q, k, v, [sum(lengths)], backend.scale)
        assert (out.double() - whole).abs().max() > 1e-2


def test_a_call_it_does_not_handle_reaches_stock():
    backend = VisionSdpaAttention(head_dim=HEAD_SIZE, num_heads=HEADS, num_kv_heads=HEADS, flatten_batch=True)
    q = k = v = torch.randn(8, HEADS, HEAD_SIZE)
    seen = []

    def stock(*args, **kwargs):
        seen.append(kwargs)
        return "stock"

    mask = torch.ones(1, 8, 8, dtype=torch.bool)
    cu_seqlens = torch.tensor([0, 8], dtype=torch.int32)
    assert per_segment_on_cpu(stock, backend, q, k, v, 1, cu_seqlens=cu_seqlens, attention_mask=mask) == "stock"
    assert per_segment_on_cpu(stock, backend, q, k, v, 1) == "stock"
    not_flattened = VisionSdpaAttention(head_dim=HEAD_SIZE, num_heads=HEADS, num_kv_heads=HEADS, flatten_batch=False)
    assert per_segment_on_cpu(stock, not_flattened, q, k, v, 1, cu_seqlens=cu_seqlens) == "stock"
    assert len(seen) == 3 and seen[0]["attention_mask"] is mask
