"""Keep a request's encoder (vision) prefix whole across prefix-cache matches.

Catalog entry
-------------
**target**: ``sglang.srt.mem_cache.common.match_kv_cache`` (AROUND). It is the one function
    that adopts a prefix-cache hit into a request (``Req.init_next_round_input`` and the
    cache-aware ``SchedulePolicy`` both call it; the HookRegistry rebinds their
    ``from ... import`` copies too).

**why**: an encoder-decoder request's KV slots start with its encoder tokens
    (``multimodal_inputs.num_image_tokens``), and ``ScheduleBatch.prepare_encoder_info_extend``
    requires the encoder part to be cached whole or recomputed whole
    (``assert req.prefix_len == 0`` when ``prefix_len < encoder_len``). The radix cache cuts a
    match to a page boundary (NPU pages are 128 tokens) or stops where two requests' vision
    tokens diverge (different images after a shared first one), so the match can end inside
    the encoder span and the scheduler's assertion aborts the batch. 0.5.23 still behaves
    this way (the tests reproduce it with the real ``RadixCache``).

**how**: when the stock match ends strictly inside the request's encoder span
    (``0 < prefix_len + host_hit_length < encoder_len``), the match is redone with a zero-token
    key limit, so stock code adopts an ordinary miss (prefix 0, root nodes, no host hit). The
    encoder and the text after it are recomputed; nothing was locked by the first match
    (``match_prefix`` only refreshes LRU), so nothing leaks. A match that covers the whole
    encoder, or a request without encoder tokens, passes through untouched. The source PR
    threaded ``model_config`` through every ``init_next_round_input`` caller (scheduler,
    disaggregation decode, dLLM scheduler) for this check; reading the encoder length from
    the request makes those caller edits unnecessary.

**upstream status / when to remove**: open. Remove when sglang truncates prefix matches to
    encoder boundaries itself (or lets ``prepare_encoder_info_extend`` take a partial
    encoder prefix). Not applied on CUDA, whose path this project leaves exactly as stock (stock CUDA
    servers can hit the same assertion with per-image encoder items, e.g. mllama).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

logger = logging.getLogger(__name__)

_TARGET = "sglang.srt.mem_cache.common.match_kv_cache"


def encoder_len_of(req: Any) -> int:
    """Number of encoder (vision) tokens at the start of ``req``'s KV slots (0 if none)."""
    mm_inputs = getattr(req, "multimodal_inputs", None)
    return (getattr(mm_inputs, "num_image_tokens", None) or 0) if mm_inputs else 0


def ends_inside_encoder(matched_len: int, encoder_len: int) -> bool:
    return 0 < matched_len < encoder_len


def match_whole_encoder_or_nothing(
    original: Callable, req: Any, tree_cache: Any, *args: Any, **kwargs: Any
):
    """AROUND hook on ``match_kv_cache``: drop a match that would split the encoder span."""
    result = original(req, tree_cache, *args, **kwargs)
    encoder_len = encoder_len_of(req)
    matched_len = req.prefix_len + req.host_hit_length
    if not ends_inside_encoder(matched_len, encoder_len):
        return result
    logger.debug(
        "request %s: prefix match of %d tokens ends inside its %d encoder tokens; recomputing "
        "the encoder whole",
        req.rid,
        matched_len,
        encoder_len,
    )
    kwargs["max_prefix_len"] = 0
    return original(req, tree_cache, *args, **kwargs)


def register() -> None:
    from sglang.srt.utils import is_cuda

    if is_cuda():
        logger.debug("radix_prefix: CUDA keeps stock prefix matching")
        return
    HookRegistry.register(_TARGET, match_whole_encoder_or_nothing, HookType.AROUND)
