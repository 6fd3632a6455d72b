"""A MOSS-VL request keeps its pixel values until it finishes, so a retracted request can be prefilled again.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch


def _newly_encoded_media(forward_batch) -> list:
    """(mm_input, [(item, feature)], vision_position_ids) of every request whose encoder this forward runs."""
    if forward_batch.forward_mode.is_decode() or not forward_batch.mm_inputs:
        return []
    kept = []
    for i, mm_input in enumerate(forward_batch.mm_inputs):
        if mm_input is None or forward_batch.encoder_cached[i]:
            continue
        kept.append((mm_input, [(item, item.feature) for item in mm_input.mm_items], mm_input.vision_position_ids))
    return kept


def keep_media_until_finish(original, model, input_ids, positions, forward_batch, *args, **kwargs):
    """AROUND hook: run the stock forward, then give back the media it released."""
    kept = _newly_encoded_media(forward_batch)
    try:
        return original(model, input_ids, positions, forward_batch, *args, **kwargs)
    finally:
        for mm_input, features, vision_position_ids in kept:
            for item, feature in features:
                item.feature = feature
            mm_input.vision_position_ids = vision_position_ids


PATCHES = (
    Patch(
        title="A request keeps its pixel values until it finishes (retraction re-encodes)",
        target="sglang.srt.models.moss_vl.MossVLForConditionalGeneration.forward",
        kind=HookType.AROUND,
        hook=keep_media_until_finish,
        platforms=ON_NPU_AND_CPU,
        why=(
            "right after the vision encoder runs, stock MOSS-VL drops each newly encoded request's pixel values "
            "(`release_features`) and `vision_position_ids`. Retraction breaks the assumption that they are never "
            "needed again: under KV pressure `ScheduleBatch.retract_decode` frees a running request's KV, encoder "
            "included, and the request is prefilled again from scratch, which re-runs the vision encoder on the "
            "released (`None`) features and fails in `torch.cat`."
        ),
        how=(
            "the features and vision positions of the requests this forward encodes are put back after the stock "
            "forward returns; stock's request-finish path (`release_features` when the request finishes or aborts) "
            "still frees them. Cost: a request's pixel values stay allocated while it decodes."
        ),
        upstream="open in 0.5.23",
        remove_when="stock MOSS-VL keeps the features of requests that may be retracted",
    ),
)
