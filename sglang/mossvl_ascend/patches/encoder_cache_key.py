"""Radix-cache key of a MOSS-VL encoder prefix: the media *and* where they sit in the text.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import hashlib
from array import array

import torch
from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch


def media_identity(item) -> bytes:
    """The bytes sglang itself keys an item by: its full identity digest, else its 64-bit hash."""
    if getattr(item, "identity", None):
        return bytes(item.identity)
    if item.hash is None:
        item.set_pad_value()
    return int(item.hash).to_bytes(8, byteorder="big")


def position_aware_pad_value(item, vision_position_ids: torch.Tensor) -> int:
    from sglang.srt.managers.schedule_batch import _compute_pad_values

    positions = vision_position_ids.detach().to("cpu", torch.int64).contiguous()
    digest = hashlib.sha256(media_identity(item) + str(tuple(positions.shape)).encode() + positions.numpy().tobytes())
    return _compute_pad_values(digest.digest())[0]


def encoder_prefix_pad_ids_keyed_by_position(original, model, mm_inputs) -> array:
    pad_ids = original(model, mm_inputs)
    positions = getattr(mm_inputs, "vision_position_ids", None)
    if len(pad_ids) == 0 or not isinstance(positions, torch.Tensor):
        return pad_ids
    return array("q", [position_aware_pad_value(mm_inputs.mm_items[0], positions)]) * len(pad_ids)


PATCHES = (
    Patch(
        title="Encoder-prefix radix keys include the vision positions",
        target="sglang.srt.models.moss_vl.MossVLForConditionalGeneration._build_encoder_prefix_pad_ids",
        kind=HookType.AROUND,
        hook=encoder_prefix_pad_ids_keyed_by_position,
        platforms=ON_NPU_AND_CPU,
        why=(
            "sglang keys a request's encoder prefix in the radix tree by the media hash alone, but the cached "
            "cross-attention keys are XRoPE-rotated with `vision_position_ids`, which depend on where each "
            "`<|image|>` sits in the text. The same images after a different amount of text hit the cache and reuse "
            "keys rotated for the old positions: silently wrong cross-attention (observed on the CPU server: a "
            "two-image request followed by a multi-turn request with the same images gave tokens that differ from "
            "the reference model; found by the serving parity tests, not in the source PR)."
        ),
        how=(
            "when the request carries `vision_position_ids`, the placeholder id is derived from a SHA-256 over the "
            "media identity and those positions (through sglang's own `_compute_pad_values`), so a cache hit implies "
            "identical rotated keys; requests without positions keep stock keys."
        ),
        upstream="open in 0.5.23 (the same bug exists on CUDA, which this project leaves stock)",
        remove_when="MossVL's `pad_input_ids` hashes vision positions itself, or encoder keys are cached unrotated",
    ),
)
