"""Keep a request's encoder (vision) prefix whole across prefix-cache matches.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch
from mossvl_ascend.side_channel import encoder_len_of

logger = logging.getLogger(__name__)


def ends_inside_encoder(matched_len: int, encoder_len: int) -> bool:
    return 0 < matched_len < encoder_len


def match_whole_encoder_or_nothing(original: Callable, req: Any, tree_cache: Any, *args: Any, **kwargs: Any):
    """AROUND hook on ``match_kv_cache``: drop a match that would split the encoder span."""
    result = original(req, tree_cache, *args, **kwargs)
    encoder_len = encoder_len_of(req)
    matched_len = req.prefix_len + req.host_hit_length
    if not ends_inside_encoder(matched_len, encoder_len):
        return result
    logger.debug(
        "request %s: prefix match of %d tokens ends inside its %d encoder tokens; recomputing the encoder whole",
        req.rid,
        matched_len,
        encoder_len,
    )
    kwargs["max_prefix_len"] = 0
    return original(req, tree_cache, *args, **kwargs)


PATCHES = (
    Patch(
        title="A prefix-cache match never ends inside a request's encoder span",
        target="sglang.srt.mem_cache.common.match_kv_cache",
        kind=HookType.AROUND,
        hook=match_whole_encoder_or_nothing,
        platforms=ON_NPU_AND_CPU,
        why=(
            "an encoder-decoder request's KV slots start with its encoder (vision) tokens, and "
            "`ScheduleBatch.prepare_encoder_info_extend` needs the encoder cached whole or recomputed whole "
            "(`assert req.prefix_len == 0` when `prefix_len < encoder_len`). The radix cache cuts a match to a page "
            "boundary (NPU pages are 128 tokens) or where two requests' vision tokens diverge, so a match can end "
            "inside the encoder span and the scheduler's assertion aborts the batch (reproduced with the real "
            "`RadixCache`)."
        ),
        how=(
            "`match_kv_cache` is the one function that adopts a cache hit (`Req.init_next_round_input` and the "
            "cache-aware `SchedulePolicy` call it; the HookRegistry rebinds their imported copies, disaggregation "
            "decode's included). When the stock match ends strictly inside the encoder span "
            "(`0 < prefix_len + host_hit_length < encoder_len`) it is redone with a zero-token key limit, so stock "
            "code adopts an ordinary miss; nothing was locked by the first match. The source PR threaded "
            "`model_config` through every `init_next_round_input` caller instead; reading the encoder length from "
            "the request makes those edits unnecessary."
        ),
        upstream=(
            "open in 0.5.23 (stock CUDA servers can hit the same assertion with per-image encoder items, e.g. mllama)"
        ),
        remove_when=(
            "sglang truncates prefix matches to encoder boundaries itself, or `prepare_encoder_info_extend` accepts a "
            "partial encoder prefix"
        ),
    ),
)
