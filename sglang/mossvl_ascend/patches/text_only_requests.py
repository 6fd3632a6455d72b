"""A text-only MOSS-VL request gets no encoder: the processor's placeholder frame is not a medium.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch

logger = logging.getLogger(__name__)

# What the HF processor returns about media; none of it describes a frame when no image token is in the text.
MEDIA_FIELDS = ("pixel_values", "grid_thw", "media_nums_per_sample", "cross_attention_mask")


def without_unreferenced_media(original: Callable, mm_processor: Any, *args: Any, **kwargs: Any):
    """AROUND hook on MOSS-VL's ``process_mm_data``: drop media fields when no ``<|image_pad|>`` token is in the
    text (the real processor's placeholder frame for a text-only prompt)."""
    output = original(mm_processor, *args, **kwargs)
    if output.get("pixel_values") is None:
        return output
    input_ids = torch.as_tensor(output["input_ids"])
    if bool((input_ids == mm_processor.image_token_id).any()):
        return output
    logger.debug("text-only MOSS-VL request: the processor's placeholder frame is dropped (no image token)")
    for field in MEDIA_FIELDS:
        output.pop(field, None)
    return output


PATCHES = (
    Patch(
        title="A text-only request's placeholder frame gives it no encoder tokens",
        target="sglang.srt.multimodal.processors.moss_vl.MossVLImageProcessor.process_mm_data",
        kind=HookType.AROUND,
        hook=without_unreferenced_media,
        platforms=ON_NPU_AND_CPU,
        why=(
            "the real MOSS-VL checkpoints' processor returns a blank placeholder frame (`pixel_values` of 8 x 8 "
            "patches, `grid_thw [[1, 8, 8]]`, `media_nums_per_sample [1]`, an all-masked `cross_attention_mask`) "
            "for a prompt with no image, and stock 0.5.23 runs the multimodal processor for every MOSS-VL request "
            "(`is_mossvl` in `TokenizerManager`). Stock then fails the request: `_build_vision_token_info` counts "
            "the placeholder as a medium, as the processor does, and `_compute_vision_position_ids` raises "
            "'found 1 frame(s) and 0 token(s)' (reproduced: `/health` never turns healthy, its probe is such a "
            "request). Past that, `_build_mm_items` turns any `pixel_values` into an image item: a 17-slot encoder "
            "of junk (16 merged patches + 1 separator) that the text attends to (an earlier NPU port of MOSS-VL saw "
            "outputs collapse into early EOS)."
        ),
        how=(
            "MOSS-VL's `process_mm_data` (the base processor's HF call, wrapped for MOSS-VL only) drops "
            "`pixel_values`, `grid_thw`, `media_nums_per_sample` and `cross_attention_mask` from the HF output when "
            "its `input_ids` hold no `<|image_pad|>` token (`image_token_id`): stock then treats the request as a "
            "processor output without media (no item, no vision positions, no encoder). Outputs with frames pass "
            "unchanged."
        ),
        upstream="open in 0.5.23 (the sglang fork of the MOSS-VL Realtime demo guards `_build_mm_items` instead)",
        remove_when="stock ignores pixel values that no image token refers to, in its positions and its items",
    ),
)
