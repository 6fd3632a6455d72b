"""Chunked prefill never cuts inside a request's encoder (vision) span.

Catalog entry
-------------
**target**: ``sglang.srt.managers.schedule_policy.PrefillAdder._select_prefill_admission`` (AROUND).

**why**: an encoder-decoder request (MOSS-VL) carries its encoder tokens as the first
    ``multimodal_inputs.num_image_tokens`` slots of its prompt; ``ScheduleBatch.prepare_encoder_info_extend``
    writes the encoder K/V once, in the extend whose cached prefix is 0, and asserts that a cached prefix is
    either 0 or at least the encoder length. Stock sglang avoids the question by turning chunked prefill off
    for MOSS-VL (``server_args`` turns it back on for npu / cpu); the stock chunk cut
    (``chunk budget // page_size * page_size``) knows nothing of encoders and would end a first chunk inside
    the vision span (the encoder would be stripped from the chunk, its K/V never written, the next chunk's
    prefix would fail the assertion), or right at its end (a chunk with no text row: the model forward has no
    rows for the cross-attention layers and the logits).

**how**: the stock selection runs unchanged; only a chunked first admission of a request with encoder tokens
    (cached prefix below the encoder length) is checked. If the cut leaves at least one text row after the
    encoder, it stands. Otherwise the request waits for a later round (``AddReqResult.OTHER``) when other
    requests already share this prefill batch; alone in the batch (the budget is smaller than its encoder),
    it is admitted with its whole encoder and the first text row(s) up to the next page boundary, with one
    log line saying why. Later chunks (``add_chunked_req``) start at a prefix >= the encoder length and cut
    freely (page-aligned by stock).

**upstream status / when to remove**: open; remove when sglang's PrefillAdder keeps encoder spans whole
    (and ``is_multimodal_chunked_prefill_supported`` lists MOSS-VL).

Second hook: the decode rows of a mixed batch, for encoder-decoder requests
--------------------------------------------------------------------------
**target**: ``sglang.srt.managers.schedule_batch.ScheduleBatch.mix_with_running`` (AFTER).

**why**: ``--enable-mixed-chunk`` appends the running decode requests to a prefill batch. Two things go wrong
    for encoder-decoder requests: ``merge_batch`` concatenates ``encoder_lens`` but not ``encoder_cached``, and
    MOSS-VL's forward indexes ``encoder_cached`` for every request of the batch (which encoders to run, which
    media to release), so a mixed batch whose prefill part runs an encoder fails with ``IndexError``; and each
    decode row's ``req.extend_end`` is set from the batch's ``seq_lens``, which for these requests count text
    only (``prepare_encoder_info_extend`` stripped the encoder), so it lands ``encoder_len`` tokens short of the
    request's KV and the radix cache's checkpoint of that request asserts
    (``cache_protected_len <= len(new_indices)``).

**how**: after mixing, the decode rows get ``encoder_cached = True`` (their encoder K/V is in the pool, exactly
    what ``prepare_encoder_info_decode`` set on the running batch), and their ``extend_end`` is moved past the
    encoder (request coordinates count the encoder, as for every prefill row).

**upstream status / when to remove**: open; remove when ``merge_batch`` concatenates ``encoder_cached`` and
    ``mix_with_running`` counts the encoder in a decode row's ``extend_end``.
"""

from __future__ import annotations

import dataclasses
import logging

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder._select_prefill_admission"
MIX_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.mix_with_running"


def request_encoder_len(req) -> int:
    """Encoder tokens at the start of ``req``'s prompt (0 without any), as ``prepare_encoder_info_extend`` reads it."""
    mm_inputs = req.multimodal_inputs
    if mm_inputs is None or mm_inputs.num_image_tokens is None:
        return 0
    return int(mm_inputs.num_image_tokens)


def first_chunk_end(encoder_len: int, page_size: int, prompt_len: int) -> int:
    """Smallest page-aligned end that holds the whole encoder and one text row (capped at the prompt)."""
    min_end = encoder_len + 1
    return min(-(-min_end // page_size) * page_size, prompt_len)


def keep_encoder_whole(original, adder, req, **kwargs):
    """AROUND hook: reject or widen a first chunk that would end inside (or right at) the encoder span."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS, AddReqResult

    admission = original(adder, req, **kwargs)
    if isinstance(admission, AddReqResult) or not admission.is_chunked:
        return admission
    encoder_len = request_encoder_len(req)
    end = admission.prefix_len + admission.extend_len
    if admission.prefix_len >= encoder_len or end > encoder_len:
        return admission
    if adder.can_run_list:
        return AddReqResult.OTHER
    prompt_len = len(req.full_untruncated_fill_ids)
    end = first_chunk_end(encoder_len, adder.page_size, prompt_len)
    logger.info(
        "Request %s: chunk budget %d is smaller than its encoder span (%d tokens) plus one text row; "
        "admitting %d tokens in one chunk (an encoder is never split).",
        req.rid,
        admission.extend_len,
        encoder_len,
        end - admission.prefix_len,
    )
    is_chunked = end < prompt_len
    max_new_tokens = 0 if is_chunked else min(req.sampling_params.max_new_tokens, CLIP_MAX_NEW_TOKENS)
    return dataclasses.replace(
        admission, extend_len=end - admission.prefix_len, is_chunked=is_chunked, max_new_tokens=max_new_tokens
    )


def fix_decode_rows_of_mixed_batch(result, batch, running_batch) -> None:
    """AFTER hook: the decode rows appended by ``mix_with_running`` have their encoders cached, and their
    ``extend_end`` counts the encoder."""
    if batch.encoder_cached is None:
        return
    first_decode_row = len(batch.encoder_cached)
    batch.encoder_cached = batch.encoder_cached + [True] * (len(batch.reqs) - first_decode_row)
    for req, encoder_len in zip(batch.reqs[first_decode_row:], batch.encoder_lens_cpu[first_decode_row:]):
        req.extend_end += encoder_len


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.utils import is_cuda

    if is_cuda():
        logger.debug("chunked_prefill: CUDA keeps stock scheduling (MOSS-VL chunked prefill stays off there)")
        return
    HookRegistry.register(TARGET, keep_encoder_whole, HookType.AROUND)
    HookRegistry.register(MIX_TARGET, fix_decode_rows_of_mixed_batch, HookType.AFTER)
