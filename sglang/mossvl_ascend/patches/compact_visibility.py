"""MOSS-VL frame visibility as one int per text row, in attention metadata built once per forward.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.attention.metadata import attach, metadata_from_visible_frames
from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch


def prepare_attention_metadata(model, forward_batch) -> None:
    """REPLACE hook: this forward's attention metadata instead of the stock packed mask (see ``PATCHES``)."""
    forward_batch.cross_attention_custom_mask = None
    if forward_batch.encoder_lens is None:
        return
    attach(forward_batch, metadata_from_visible_frames(forward_batch, model.spatial_merge_size))


PATCHES = (
    Patch(
        title="Frame visibility as per-row encoder boundaries, in per-forward attention metadata",
        target="sglang.srt.models.moss_vl.MossVLForConditionalGeneration.prepare_forward_batch",
        kind=HookType.REPLACE,
        hook=prepare_attention_metadata,
        platforms=ON_NPU_AND_CPU,
        why=(
            "stock builds `cross_attention_custom_mask` before every extend: a uint8 `[extend_seq_len x encoder_len]` "
            "block per request, filled by a Python loop over frames. FlashInfer needs that layout; the Ascend native "
            "path does not. Visibility is prefix-causal over frames, so one int per text row describes it; for a long "
            "video the dense mask is tens to hundreds of MB per request and masked attention spends its FLOPs on "
            "frames nobody sees. The native path also needs per-forward batch data (slot tables, block plans) that "
            "every layer would otherwise rebuild."
        ),
        how=(
            "the hook builds this forward's `attention.metadata.ForwardAttentionMetadata` (per request: lengths, "
            "int32 boundaries of its new text rows — row r sees encoder keys `[0, boundary_r)` — and their block "
            "plan) from each request's `visible_frame_counts` and `grid_thw` without a loop over frames, attaches it "
            "to the ForwardBatch and builds no packed mask. Every attention layer of the forward reuses it. Same "
            "semantics as the stock builder: a request without visibility data sees every frame; decode (and a "
            "mixed batch's decode rows) sees every frame. The one-request builder is "
            "`attention.metadata.request_row_boundaries`."
        ),
        upstream="an optimisation, not a bug fix (CUDA keeps the packed mask for flashinfer)",
        remove_when="sglang ships a compact visibility format for non-flashinfer backends",
    ),
)
