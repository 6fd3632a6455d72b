"""MOSS-VL frame visibility as one int per text row instead of a dense packed mask.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

from typing import Optional

import torch
from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.frame_causal_attention import encoder_boundaries_from_visible_frames, frame_ends_from_grid_thw
from mossvl_ascend.registry import ON_NPU_AND_CPU, Patch


def request_row_boundaries(mm_input, text_offset: int, q_len: int, encoder_len: int, spatial_merge_size: int, device) -> torch.Tensor:
    """Boundaries of one request's ``q_len`` new rows (text rows ``[text_offset, text_offset + q_len)``)."""
    counts = getattr(mm_input, "visible_frame_counts", None) if mm_input is not None else None
    item = mm_input.mm_items[0] if mm_input is not None and mm_input.mm_items else None
    grid_thw = getattr(item, "grid_thw", None) if item is not None else None
    if counts is None or grid_thw is None:
        return torch.full((q_len,), encoder_len, dtype=torch.int32, device=device)
    frame_ends = frame_ends_from_grid_thw(grid_thw, spatial_merge_size)
    rows = counts[text_offset : text_offset + q_len].to(device)
    return encoder_boundaries_from_visible_frames(rows, frame_ends, encoder_len)


def batch_row_boundaries(forward_batch, spatial_merge_size: int) -> Optional[torch.Tensor]:
    """Concatenated boundaries of every request with encoder tokens and new rows, or None (no vision)."""
    if forward_batch.forward_mode.is_decode():
        return None
    if forward_batch.encoder_lens is None or forward_batch.encoder_lens.max() == 0:
        return None
    device = forward_batch.seq_lens.device
    parts = []
    for i in range(forward_batch.batch_size):
        encoder_len = forward_batch.encoder_lens_cpu[i]
        q_len = forward_batch.extend_seq_lens_cpu[i]
        if encoder_len == 0 or q_len == 0:
            continue
        mm_input = forward_batch.mm_inputs[i] if forward_batch.mm_inputs else None
        parts.append(
            request_row_boundaries(
                mm_input, forward_batch.extend_prefix_lens_cpu[i], q_len, encoder_len, spatial_merge_size, device
            )
        )
    return torch.cat(parts) if parts else None


def prepare_compact_visibility(model, forward_batch) -> None:
    """REPLACE hook: per-row boundaries instead of the stock packed mask (see ``PATCHES``)."""
    forward_batch.cross_attention_custom_mask = None
    forward_batch.cross_attention_row_boundaries = batch_row_boundaries(forward_batch, model.spatial_merge_size)


PATCHES = (
    Patch(
        title="Frame visibility as per-row encoder boundaries",
        target="sglang.srt.models.moss_vl.MossVLForConditionalGeneration.prepare_forward_batch",
        kind=HookType.REPLACE,
        hook=prepare_compact_visibility,
        platforms=ON_NPU_AND_CPU,
        why=(
            "stock builds `cross_attention_custom_mask` before every extend: a uint8 `[extend_seq_len x encoder_len]` "
            "block per request, filled by a Python loop over frames. FlashInfer needs that layout; the Ascend native "
            "path does not. Visibility is prefix-causal over frames, so one int per text row describes it; for a long "
            "video the dense mask is tens to hundreds of MB per request and masked attention spends its FLOPs on "
            "frames nobody sees."
        ),
        how=(
            "extends get `forward_batch.cross_attention_row_boundaries` (int32, one entry per new text row of every "
            "request with encoder tokens, batch order; row r sees encoder keys `[0, boundary_r)`), computed per "
            "request without a loop over frames, and no packed mask; the native backend computes cross-attention "
            "from them with the frame-causal kernel. Same semantics as the stock builder: a request without "
            "visibility data sees every frame; decode sees every frame."
        ),
        upstream="an optimisation, not a bug fix (CUDA keeps the packed mask for flashinfer)",
        remove_when="sglang ships a compact visibility format for non-flashinfer backends",
    ),
)
