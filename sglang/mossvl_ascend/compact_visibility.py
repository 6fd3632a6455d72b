"""MOSS-VL frame visibility as one int per text row instead of a dense packed mask (issue 7).

Catalog entry
-------------
**target**: ``sglang.srt.models.moss_vl.MossVLForConditionalGeneration.prepare_forward_batch`` (AROUND).

**why**: stock builds ``cross_attention_custom_mask`` before every extend: a uint8
    ``[extend_seq_len x encoder_len]`` block per request, filled by a Python loop over frames. FlashInfer needs
    that layout; the Ascend native path does not. Visibility is prefix-causal over frames, so each text row is
    fully described by the end of the encoder prefix it sees; for a long video the dense mask is tens to hundreds
    of MB per request and the attention it feeds spends its FLOPs on masked-out frames.

**how**: off CUDA, extends get ``forward_batch.cross_attention_row_boundaries`` (int32, one entry per new text
    row of every request with encoder tokens, batch order; row ``r`` sees encoder keys ``[0, boundary_r)``),
    computed per request without a loop over frames, and no packed mask. The native backend
    (:mod:`mossvl_ascend.native_attention`) computes cross-attention from the boundaries with
    :func:`mossvl_ascend.frame_causal_attention.frame_causal_cross_attention`; a packed mask from any other
    producer still works (converted to boundaries). Same semantics as the stock builder: a request without
    visibility data sees every frame; decode sees every frame. CUDA keeps the stock packed mask for flashinfer.

**upstream status / when to remove**: an optimisation, not a bug fix. Remove if sglang ships a compact
    visibility format for non-flashinfer backends.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from mossvl_ascend.frame_causal_attention import encoder_boundaries_from_visible_frames, frame_ends_from_grid_thw

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.models.moss_vl.MossVLForConditionalGeneration.prepare_forward_batch"


def visible_frames_of_rows(visible_frame_counts: torch.Tensor, text_offset: int, q_len: int) -> torch.Tensor:
    """Visible-frame count of text rows ``[text_offset, text_offset + q_len)`` of one request.

    Rows past the end of ``visible_frame_counts`` see its last entry: generated tokens (decode rows of a mixed
    batch, a retracted request's outputs prefilled again) inherit the last prompt row's visibility, as HF copies
    the previous row's ``cross_attention_mask`` to each new token; a tensor stock shrank to its last element
    therefore means "every row sees that many frames".
    """
    rows = torch.arange(text_offset, text_offset + q_len, device=visible_frame_counts.device)
    return visible_frame_counts[rows.clamp_(max=visible_frame_counts.numel() - 1)]


def request_row_boundaries(mm_input, text_offset: int, q_len: int, encoder_len: int, spatial_merge_size: int, device) -> torch.Tensor:
    """Boundaries of one request's ``q_len`` new rows (text rows ``[text_offset, text_offset + q_len)``)."""
    counts = getattr(mm_input, "visible_frame_counts", None) if mm_input is not None else None
    item = mm_input.mm_items[0] if mm_input is not None and mm_input.mm_items else None
    grid_thw = getattr(item, "grid_thw", None) if item is not None else None
    if counts is None or grid_thw is None:
        return torch.full((q_len,), encoder_len, dtype=torch.int32, device=device)
    frame_ends = frame_ends_from_grid_thw(grid_thw, spatial_merge_size)
    rows = visible_frames_of_rows(counts, text_offset, q_len).to(device)
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


def prepare_compact_visibility(original, model, forward_batch) -> None:
    """AROUND hook: boundaries instead of the stock packed mask (see the module docstring)."""
    forward_batch.cross_attention_custom_mask = None
    forward_batch.cross_attention_row_boundaries = batch_row_boundaries(forward_batch, model.spatial_merge_size)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.utils import is_cuda

    if is_cuda():
        logger.debug("compact_visibility: CUDA keeps the stock packed mask for flashinfer")
        return
    HookRegistry.register(TARGET, prepare_compact_visibility, HookType.AROUND)
