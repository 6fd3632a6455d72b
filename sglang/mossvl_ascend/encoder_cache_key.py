"""Radix-cache key of a MOSS-VL encoder prefix: the media *and* where they sit in the text.

Catalog entry
-------------
**target**: ``sglang.srt.models.moss_vl.MossVLForConditionalGeneration._build_encoder_prefix_pad_ids`` (AROUND).

**why**: sglang keys a request's encoder (vision) prefix in the radix tree by placeholder ids derived from the
    media hash alone. But the cached cross-attention keys are XRoPE-rotated with ``vision_position_ids``, which
    depend on the text position of each ``<|image|>`` token. The same images after a different amount of text
    (another system prompt, another turn layout) hit the cache and reuse keys rotated for the old positions:
    silently wrong cross-attention. Observed on the CPU server: a two-image request followed by a multi-turn
    request with the same two images produced different greedy tokens than the reference model (and than the
    same multi-turn request on a fresh server).

**how**: when the request carries ``vision_position_ids``, the placeholder id is derived from a SHA-256 over the
    media identity and those positions (through sglang's own ``_compute_pad_values``), so a cache hit implies
    identical rotated keys. Requests without positions keep stock behaviour. Not applied on CUDA, whose path this
    project leaves exactly as stock (the same upstream bug exists there).

**upstream status / when to remove**: open upstream (sglang 0.5.23). Remove when MossVL's ``pad_input_ids``
    hashes vision positions itself, or stores unrotated encoder keys and rotates at attention time.
"""

from __future__ import annotations

import hashlib
import logging
from array import array

import torch

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.models.moss_vl.MossVLForConditionalGeneration._build_encoder_prefix_pad_ids"


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


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.utils import is_cuda

    if is_cuda():
        logger.debug("encoder_cache_key: CUDA keeps stock MossVL encoder-prefix keys")
        return
    HookRegistry.register(TARGET, encoder_prefix_pad_ids_keyed_by_position, HookType.AROUND)
