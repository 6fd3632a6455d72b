"""MOSS-VL frame visibility as one int per text row instead of a dense packed mask (issue 7).

Catalog entry
-------------
**target**: ``sglang.srt.models.moss_vl.MossVLForConditionalGeneration.prepare_forward_batch`` (AROUND).

**why**: stock builds ``cross_attention_custom_mask`` before every extend: a uint8
    ``[extend_seq_len x encoder_len]`` block per request, filled by a Python loop over frames. FlashInfer needs
    that layout; the Ascend native path does not. Visibility is prefix-causal over frames, so each text row is
    fully described by the end of the encoder prefix it sees; for a long video the dense mask is tens to hundreds
    of MB per request and the attention it feeds spends its FLOPs on masked-out frames.

**how**: off CUDA, the hook builds this forward's
    :class:`mossvl_ascend.attention.metadata.ForwardAttentionMetadata` (per request: lengths, int32 boundaries
    of its new text rows — row ``r`` sees encoder keys ``[0, boundary_r)`` — and their block plan) from each
    request's ``visible_frame_counts`` and ``grid_thw`` without a loop over frames, and attaches it to the
    ForwardBatch; no packed mask is built. Every attention layer of the forward reuses it (the Ascend and CPU
    hooks, :mod:`mossvl_ascend.attention.sglang_layer`). Same semantics as the stock builder: a request without
    visibility data sees every frame; decode (and a mixed batch's decode rows) sees every frame. The one-request
    builder is :func:`mossvl_ascend.attention.metadata.request_row_boundaries`. CUDA keeps the stock packed mask
    for flashinfer.

**upstream status / when to remove**: an optimisation, not a bug fix. Remove if sglang ships a compact
    visibility format for non-flashinfer backends.
"""

from __future__ import annotations

import logging

from mossvl_ascend.attention.metadata import attach, metadata_from_visible_frames

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.models.moss_vl.MossVLForConditionalGeneration.prepare_forward_batch"


def prepare_attention_metadata(original, model, forward_batch) -> None:
    """AROUND hook: this forward's attention metadata instead of the stock packed mask (see the module docstring)."""
    forward_batch.cross_attention_custom_mask = None
    if forward_batch.encoder_lens is None:
        return
    attach(forward_batch, metadata_from_visible_frames(forward_batch, model.spatial_merge_size))


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.utils import is_cuda

    if is_cuda():
        logger.debug("compact_visibility: CUDA keeps the stock packed mask for flashinfer")
        return
    HookRegistry.register(TARGET, prepare_attention_metadata, HookType.AROUND)
