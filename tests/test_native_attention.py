"""MOSS-VL math in the (patched) AscendTorchNativeAttnBackend against a dense fp32 reference.

Real: ``AscendTorchNativeAttnBackend`` and its hooked ``run_sdpa_forward_extend`` (applied through
sglang's ``HookRegistry`` exactly as ``load_plugins`` does), stock ``run_sdpa_forward_decode``,
stock ``MossVLForConditionalGeneration.prepare_forward_batch`` (the mask producer).
Oracle and builders: :mod:`support.attention` (dense reference, explicit per-row softmax).
"""

from __future__ import annotations

import pytest
import torch
from sglang.srt.hardware_backend.npu.attention.ascend_torch_native_backend import (
    AscendTorchNativeAttnBackend,
)
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from support.attention import (
    SCALE,
    Request,
    build_batch,
    causal_with_prefix,
    decode_batch,
    example_requests,
    moss_vl_extend_batch,
    patched_native,  # noqa: F401  (fixture)
    reference_attention,
    reference_cross_extend,
    reference_self_extend,
    run_native_extend,
)

BATCH_SHAPES = {
    "1req": [0],
    "2req-enc0": [1, 2],
    "3req": [2, 1, 0],
    "4req": [0, 1, 2, 3],
}
HEADS = {"gqa": (4, 2), "mha": (2, 2)}


# ----------------------------------------------------------------------------- extend


@pytest.mark.parametrize("logit_cap", [0.0, 1.5], ids=["plain", "softcap"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("shape", BATCH_SHAPES.values(), ids=BATCH_SHAPES.keys())
def test_cross_extend_matches_reference(patched_native, shape, heads, logit_cap):
    requests = [example_requests()[i] for i in shape]
    batch = build_batch(requests, *heads)
    out = run_native_extend(
        patched_native, batch, cross=True, mask=batch.packed_mask(), scale=SCALE, logit_cap=logit_cap
    )
    expected = reference_cross_extend(batch, SCALE, logit_cap)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("logit_cap", [0.0, 1.5], ids=["plain", "softcap"])
def test_cross_and_self_extend_in_bf16(patched_native, logit_cap):
    """The NPU serves bf16: same math, bf16 rounding only (reference in fp32 on the rounded inputs)."""
    batch = build_batch(example_requests())
    for name in ("query", "k_cache", "v_cache"):
        setattr(batch, name, getattr(batch, name).bfloat16())
    batch.encoder_k = [k.bfloat16() for k in batch.encoder_k]
    batch.encoder_v = [v.bfloat16() for v in batch.encoder_v]
    batch.text_k = [k.bfloat16() for k in batch.text_k]
    batch.text_v = [v.bfloat16() for v in batch.text_v]
    for cross, reference in ((True, reference_cross_extend), (False, reference_self_extend)):
        out = run_native_extend(
            patched_native, batch, cross=cross, mask=batch.packed_mask(), scale=SCALE, logit_cap=logit_cap
        )
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        expected = reference(batch, SCALE, logit_cap)
        torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


def test_cross_extend_without_mask_sees_all_frames(patched_native):
    batch = build_batch(example_requests())
    out = run_native_extend(patched_native, batch, cross=True, mask=None, scale=SCALE)
    for i, req in enumerate(batch.requests):
        all_visible = torch.ones(req.extend_len, req.encoder_len, dtype=torch.bool)
        expected = reference_attention(
            batch.query[batch.query_rows(i)], batch.encoder_k[i], batch.encoder_v[i], all_visible, SCALE
        )
        torch.testing.assert_close(out[batch.query_rows(i)], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("logit_cap", [0.0, 1.5], ids=["plain", "softcap"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_self_extend_reads_cached_prefix_with_shifted_diagonal(patched_native, heads, logit_cap):
    batch = build_batch(example_requests(), *heads)
    out = run_native_extend(
        patched_native, batch, cross=False, mask=batch.packed_mask(), scale=SCALE, logit_cap=logit_cap
    )
    torch.testing.assert_close(out, reference_self_extend(batch, SCALE, logit_cap), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("logit_cap", [0.0, 1.5], ids=["plain", "softcap"])
def test_rows_that_see_no_frame_are_zero_not_nan(patched_native, logit_cap):
    batch = build_batch(example_requests())
    out = run_native_extend(
        patched_native, batch, cross=True, mask=batch.packed_mask(), scale=SCALE, logit_cap=logit_cap
    )
    blind_rows = 0
    for i, req in enumerate(batch.requests):
        rows = out[batch.query_rows(i)]
        sees_nothing = (
            ~req.new_token_visibility().any(dim=1) if req.encoder_len else torch.ones(req.extend_len, dtype=torch.bool)
        )
        blind_rows += int(sees_nothing.sum())
        assert torch.equal(rows[sees_nothing], torch.zeros_like(rows[sees_nothing]))
        assert rows[~sees_nothing].abs().sum(dim=(1, 2)).gt(0).all()
    assert blind_rows >= 5  # blind new-token rows in two requests plus the encoder-less request


def test_cross_output_does_not_depend_on_cached_prefix(patched_native):
    """The same text tokens give the same cross-attention rows whether the prefix is cached or not."""
    counts = [0, 1, 1, 2, 2, 3, 3, 3]
    full = Request(spans=[3, 6, 2], prefix_len=0, extend_len=8, visible_frame_counts=counts)
    batch = build_batch([full])
    out_full = run_native_extend(patched_native, batch, cross=True, mask=batch.packed_mask(), scale=SCALE)
    for prefix_len in (1, 4, 7):
        chunk = Request(spans=full.spans, prefix_len=prefix_len, extend_len=8 - prefix_len, visible_frame_counts=counts)
        chunk_batch = build_batch([chunk])
        chunk_batch.query = batch.query[prefix_len:].clone()
        chunk_batch.k_cache[chunk_batch.slots[0][: full.encoder_len]] = batch.encoder_k[0]
        chunk_batch.v_cache[chunk_batch.slots[0][: full.encoder_len]] = batch.encoder_v[0]
        out_chunk = run_native_extend(
            patched_native, chunk_batch, cross=True, mask=chunk_batch.packed_mask(), scale=SCALE
        )
        torch.testing.assert_close(out_chunk, out_full[prefix_len:], atol=1e-6, rtol=1e-6)


def test_mask_too_short_names_request_and_lengths(patched_native):
    batch = build_batch([example_requests()[i] for i in (1, 0, 2)])
    mask = batch.packed_mask()[:-1]
    with pytest.raises(ValueError, match=r"request 2.*extend_seq_len 5 x encoder_len 12"):
        run_native_extend(patched_native, batch, cross=True, mask=mask, scale=SCALE)


def test_mask_too_long_is_rejected(patched_native):
    batch = build_batch([example_requests()[0]])
    mask = torch.cat([batch.packed_mask(), torch.ones(3, dtype=torch.uint8)])
    with pytest.raises(ValueError, match=r"63 entries.*sum to 60"):
        run_native_extend(patched_native, batch, cross=True, mask=mask, scale=SCALE)


def test_batch_without_encoder_lens_runs_stock(patched_native):
    """Text-only models keep the stock path: prefix-free causal attention over [0, seq_len)."""
    req = Request(spans=[], prefix_len=0, extend_len=5)
    batch = build_batch([req])
    out = run_native_extend(patched_native, batch, cross=False, mask=None, scale=SCALE, with_encoder_lens=False)
    expected = reference_attention(batch.query, batch.text_k[0], batch.text_v[0], causal_with_prefix(5, 0), SCALE)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="without encoder_lens"):
        mask = torch.ones(5, dtype=torch.uint8)
        run_native_extend(patched_native, batch, cross=False, mask=mask, scale=SCALE, with_encoder_lens=False)


# ----------------------------------------------------------------------------- decode (stock)


@pytest.mark.parametrize("logit_cap", [0.0, 1.5], ids=["plain", "softcap"])
@pytest.mark.parametrize("cross", [True, False], ids=["cross", "self"])
def test_stock_decode_already_reads_the_right_windows(cross, logit_cap):
    """Item 5 regression: 0.5.23's native decode needs no hook (cross sees all frames)."""
    batch = decode_batch()
    out = AscendTorchNativeAttnBackend().run_sdpa_forward_decode(
        batch.query,
        torch.empty_like(batch.query),
        batch.k_cache,
        batch.v_cache,
        batch.req_to_token,
        batch.req_pool_indices,
        batch.seq_lens,
        batch.encoder_lens,
        is_cross_attention=cross,
        scaling=SCALE,
        enable_gqa=True,
        causal=False,
        logit_cap=logit_cap,
    )
    for i, req in enumerate(batch.requests):
        keys, values = (batch.encoder_k[i], batch.encoder_v[i]) if cross else (batch.text_k[i], batch.text_v[i])
        expected = reference_attention(
            batch.query[i : i + 1], keys, values, torch.ones(1, keys.shape[0], dtype=torch.bool), SCALE, logit_cap
        )
        torch.testing.assert_close(out[i : i + 1], expected, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------- item 2: mask producer


def test_stock_mask_builder_feeds_the_native_backend(patched_native):
    """Item 2 regression: 0.5.23 builds the packed mask with no backend check; end to end to the reference.

    Frames of grid (t, h, w) with spatial merge m have h*w/m^2 vision tokens plus one separator.
    """
    from sglang.srt.models.moss_vl import MossVLForConditionalGeneration

    merge = 2
    grids = [[[2, 4, 4]], None, [[1, 4, 4], [2, 2, 4]]]
    requests = [
        Request(spans=[5, 5], prefix_len=0, extend_len=6, visible_frame_counts=[0, 1, 1, 2, 2, 2]),
        Request(spans=[], prefix_len=2, extend_len=3),
        Request(spans=[5, 3, 3], prefix_len=4, extend_len=5, visible_frame_counts=[0, 0, 1, 1, 1, 2, 2, 3, 3]),
    ]
    model = object.__new__(MossVLForConditionalGeneration)
    model.spatial_merge_size = merge
    forward_batch = moss_vl_extend_batch(requests, grids, merge)
    model.prepare_forward_batch(forward_batch)
    mask = forward_batch.cross_attention_custom_mask
    assert mask is not None and mask.dtype == torch.uint8

    batch = build_batch(requests)
    out = run_native_extend(patched_native, batch, cross=True, mask=mask, scale=SCALE)
    torch.testing.assert_close(out, reference_cross_extend(batch, SCALE), atol=1e-5, rtol=1e-5)

    forward_batch.forward_mode = ForwardMode.DECODE
    model.prepare_forward_batch(forward_batch)
    assert forward_batch.cross_attention_custom_mask is None
