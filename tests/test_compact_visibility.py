"""The compact frame-visibility path (issue 7) end to end through the real hooks.

Oracles: stock sglang's own packed-mask builder (what the boundaries must describe) and the dense fp32
reference attention of tests/support/attention.py (what the native backend must compute from them).
"""

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models.moss_vl import MossVLForConditionalGeneration

from mossvl_ascend import compact_visibility, native_attention
from support.attention import (
    SCALE,
    Request,
    moss_vl_extend_batch,
    build_batch,
    example_requests,
    hooks_applied,
    reference_attention,
    reference_cross_extend,
    run_native_extend,
)

MERGE = 2
# Frames of grid (t, h, w) hold h*w/MERGE^2 vision tokens + 1 separator.
GRIDS = [[[2, 4, 4]], None, [[1, 4, 4], [2, 2, 4]], None]
REQUESTS = [
    Request(spans=[5, 5], prefix_len=0, extend_len=6, visible_frame_counts=[0, 1, 1, 2, 2, 2]),
    Request(spans=[], prefix_len=2, extend_len=3),
    Request(spans=[5, 3, 3], prefix_len=4, extend_len=5, visible_frame_counts=[0, 0, 1, 1, 1, 2, 2, 3, 3]),
    # encoder tokens but no multimodal visibility data (no mm_input): stock makes it see every frame
    Request(spans=[3], prefix_len=1, extend_len=2, visible_frame_counts=[1, 1, 1]),  # the reference: all visible
]


@pytest.fixture(scope="module")
def hooked():
    with hooks_applied(native_attention.register, compact_visibility.register):
        model = object.__new__(MossVLForConditionalGeneration)
        model.spatial_merge_size = MERGE
        yield model


def stock_packed_mask(forward_batch):
    """The unhooked 0.5.23 builder on the same batch (uint8, 1 = visible)."""
    model = object.__new__(MossVLForConditionalGeneration)
    model.spatial_merge_size = MERGE
    return MossVLForConditionalGeneration._build_cross_attention_custom_mask(model, forward_batch)


def test_boundaries_describe_exactly_the_stock_mask(hooked):
    forward_batch = moss_vl_extend_batch(REQUESTS, GRIDS, MERGE)
    hooked.prepare_forward_batch(forward_batch)
    assert forward_batch.cross_attention_custom_mask is None  # no dense mask is built
    boundaries = forward_batch.cross_attention_row_boundaries
    assert boundaries.dtype == torch.int32
    assert boundaries.numel() == sum(r.extend_len for r in REQUESTS if r.encoder_len)  # O(rows)

    packed, offset, row = stock_packed_mask(forward_batch), 0, 0
    for req in REQUESTS:
        if not req.encoder_len:
            continue
        dense = packed[offset : offset + req.extend_len * req.encoder_len].view(req.extend_len, req.encoder_len).bool()
        offset += req.extend_len * req.encoder_len
        expected = torch.arange(req.encoder_len)[None, :] < boundaries[row : row + req.extend_len, None]
        assert torch.equal(dense, expected)
        row += req.extend_len
    assert offset == packed.numel()


def test_decode_and_text_only_batches_carry_no_visibility(hooked):
    forward_batch = moss_vl_extend_batch(REQUESTS, GRIDS, MERGE)
    forward_batch.forward_mode = ForwardMode.DECODE
    hooked.prepare_forward_batch(forward_batch)
    assert forward_batch.cross_attention_row_boundaries is None
    text_only = moss_vl_extend_batch([Request(spans=[], prefix_len=0, extend_len=4)], [None], MERGE)
    hooked.prepare_forward_batch(text_only)
    assert text_only.cross_attention_row_boundaries is None


@pytest.mark.parametrize("logit_cap", [0.0, 1.5], ids=["plain", "softcap"])
def test_native_extend_from_boundaries_equals_the_dense_reference(hooked, logit_cap):
    forward_batch = moss_vl_extend_batch(REQUESTS, GRIDS, MERGE)
    hooked.prepare_forward_batch(forward_batch)
    batch = build_batch(REQUESTS)
    output = torch.full_like(batch.query, float("nan"))
    out = hooked_native().run_sdpa_forward_extend(
        batch.query, output, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices,
        batch.seq_lens, batch.extend_prefix_lens, batch.extend_seq_lens, batch.encoder_lens,
        is_cross_attention=True, scaling=SCALE, enable_gqa=True, causal=False, logit_cap=logit_cap,
        cross_attention_row_boundaries=forward_batch.cross_attention_row_boundaries,
    )
    torch.testing.assert_close(out, reference_cross_extend(batch, SCALE, logit_cap), atol=1e-5, rtol=1e-5)


def test_boundaries_of_the_wrong_length_name_the_request(hooked):
    batch = build_batch(REQUESTS)
    boundaries = torch.tensor([0, 5, 5, 10, 10, 10, 0, 0, 5, 5], dtype=torch.int32)  # request 2 lacks 1 row
    with pytest.raises(ValueError, match=r"too short at request 2"):
        hooked_native().run_sdpa_forward_extend(
            batch.query, torch.empty_like(batch.query), batch.k_cache, batch.v_cache, batch.req_to_token,
            batch.req_pool_indices, batch.seq_lens, batch.extend_prefix_lens, batch.extend_seq_lens,
            batch.encoder_lens, is_cross_attention=True, scaling=SCALE, enable_gqa=True, causal=False,
            cross_attention_row_boundaries=boundaries,
        )


def test_a_packed_mask_that_is_not_prefix_shaped_still_works(hooked):
    """Producers other than stock's builder may send any mask: it takes the dense path, same answer."""
    requests = [example_requests()[0], example_requests()[2]]
    batch = build_batch(requests)
    gen = torch.Generator().manual_seed(3)
    masks = [torch.rand(r.extend_len, r.encoder_len, generator=gen) < 0.5 for r in requests]
    packed = torch.cat([m.to(torch.uint8).flatten() for m in masks])
    out = run_native_extend(hooked_native(), batch, cross=True, mask=packed, scale=SCALE)
    for i, mask in enumerate(masks):
        rows = batch.query_rows(i)
        expected = reference_attention(batch.query[rows], batch.encoder_k[i], batch.encoder_v[i], mask, SCALE)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)


def hooked_native():
    from sglang.srt.hardware_backend.npu.attention.ascend_torch_native_backend import AscendTorchNativeAttnBackend

    return AscendTorchNativeAttnBackend()
