"""The compact frame-visibility path (issue 7) end to end through the real hooks.

Oracles: stock sglang's own packed-mask builder (what the boundaries must describe) and the dense fp32
reference attention of tests/support/attention.py (what the native backend must compute from them).
"""

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models.moss_vl import MossVLForConditionalGeneration

from mossvl_ascend.attention.core import AttentionLayer, attention
from mossvl_ascend.attention.metadata import attached
from mossvl_ascend.patches import compact_visibility, native_attention
from support.attention import (
    SCALE,
    Request,
    build_batch,
    example_requests,
    moss_vl_extend_batch,
    reference_cross_extend,
    run_native_extend,
)
from support.hooks import patches_applied

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
    with patches_applied(*native_attention.PATCHES, *compact_visibility.PATCHES):
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
    metadata = attached(forward_batch)
    assert metadata.extend_lens == [r.extend_len for r in REQUESTS]

    packed, offset = stock_packed_mask(forward_batch), 0
    for req, boundaries in zip(REQUESTS, metadata.cross_boundaries):
        if not req.encoder_len:
            assert boundaries is None
            continue
        dense = packed[offset : offset + req.extend_len * req.encoder_len].view(req.extend_len, req.encoder_len).bool()
        offset += req.extend_len * req.encoder_len
        if boundaries is None:  # every row sees every frame
            assert dense.all()
            continue
        assert boundaries.dtype == torch.int32 and boundaries.numel() == req.extend_len  # O(rows)
        assert torch.equal(dense, torch.arange(req.encoder_len)[None, :] < boundaries[:, None])
    assert offset == packed.numel()
    assert sum(b is not None for b in metadata.cross_boundaries) == 2


def test_decode_and_text_only_batches_see_every_frame(hooked):
    forward_batch = moss_vl_extend_batch(REQUESTS, GRIDS, MERGE)
    forward_batch.forward_mode = ForwardMode.DECODE
    hooked.prepare_forward_batch(forward_batch)
    metadata = attached(forward_batch)
    assert metadata.extend_lens == [1] * len(REQUESTS)
    assert metadata.prefix_lens == [r.text_len - 1 for r in REQUESTS]
    assert metadata.cross_boundaries == [None] * len(REQUESTS)
    text_only = moss_vl_extend_batch([Request(spans=[], prefix_len=0, extend_len=4)], [None], MERGE)
    hooked.prepare_forward_batch(text_only)
    assert attached(text_only).cross_boundaries == [None]


@pytest.mark.parametrize("logit_cap", [0.0, 1.5], ids=["plain", "softcap"])
def test_core_from_the_hook_metadata_equals_the_dense_reference(hooked, logit_cap):
    forward_batch = moss_vl_extend_batch(REQUESTS, GRIDS, MERGE)
    hooked.prepare_forward_batch(forward_batch)
    batch = build_batch(REQUESTS)
    out = attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.req_to_token,
        batch.req_pool_indices,
        attached(forward_batch),
        AttentionLayer(True, SCALE, False, logit_cap),
    )
    torch.testing.assert_close(out, reference_cross_extend(batch, SCALE, logit_cap), atol=1e-5, rtol=1e-5)


def test_a_packed_mask_that_is_not_prefix_shaped_is_refused(hooked):
    """No MOSS-VL producer makes one; the core accepts only prefix visibility and says so."""
    requests = [example_requests()[0], example_requests()[2]]
    batch = build_batch(requests)
    gen = torch.Generator().manual_seed(3)
    masks = [torch.rand(r.extend_len, r.encoder_len, generator=gen) < 0.5 for r in requests]
    packed = torch.cat([m.to(torch.uint8).flatten() for m in masks])
    with pytest.raises(ValueError, match="not encoder prefixes"):
        run_native_extend(hooked_native(), batch, cross=True, mask=packed, scale=SCALE)


def hooked_native():
    from sglang.srt.hardware_backend.npu.attention.ascend_torch_native_backend import AscendTorchNativeAttnBackend

    return AscendTorchNativeAttnBackend()
