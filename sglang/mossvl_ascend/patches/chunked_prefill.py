"""Chunked prefill and mixed batches for encoder-decoder requests: never cut inside an encoder span.

Catalog entries: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import dataclasses
import logging

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch
from mossvl_ascend.side_channel import encoder_len_of

logger = logging.getLogger(__name__)


def first_chunk_end(encoder_len: int, page_size: int, prompt_len: int) -> int:
    """Smallest page-aligned end that holds the whole encoder and one text row (capped at the prompt)."""
    min_end = encoder_len + 1
    return min(-(-min_end // page_size) * page_size, prompt_len)


def _log_whole_encoder_admission(req, budget: int, encoder_len: int, admitted: int) -> None:
    """The one log line of both admission paths when a request alone gets a chunk wider than the budget."""
    logger.info(
        "Request %s: chunk budget %d is smaller than its encoder span (%d tokens) plus one text row; "
        "admitting %d tokens in one chunk (an encoder is never split).",
        req.rid,
        budget,
        encoder_len,
        admitted,
    )


def keep_encoder_whole(original, adder, req, **kwargs):
    """AROUND hook: reject or widen a first chunk that would end inside (or right at) the encoder span."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS, AddReqResult

    admission = original(adder, req, **kwargs)
    if isinstance(admission, AddReqResult) or not admission.is_chunked:
        return admission
    encoder_len = encoder_len_of(req)
    end = admission.prefix_len + admission.extend_len
    if admission.prefix_len >= encoder_len or end > encoder_len:
        return admission
    if adder.can_run_list:
        return AddReqResult.OTHER
    prompt_len = len(req.full_untruncated_fill_ids)
    end = first_chunk_end(encoder_len, adder.page_size, prompt_len)
    _log_whole_encoder_admission(req, admission.extend_len, encoder_len, end - admission.prefix_len)
    is_chunked = end < prompt_len
    max_new_tokens = 0 if is_chunked else min(req.sampling_params.max_new_tokens, CLIP_MAX_NEW_TOKENS)
    return dataclasses.replace(
        admission, extend_len=end - admission.prefix_len, is_chunked=is_chunked, max_new_tokens=max_new_tokens
    )


def keep_encoder_whole_on_the_ignore_eos_path(original, adder, req):
    """AROUND hook: the same rule for the admission stock uses for ``ignore_eos`` requests without a prefix cache.

    That path cuts a first chunk at the remaining chunk budget, so for a request whose encoder the cut would
    not clear, the budget is widened to the smallest encoder-safe chunk for this one admission (its chunk and
    memory checks and its budget charge then see the tokens really admitted), or the request waits when other
    requests already share the batch.
    """
    from sglang.srt.managers.schedule_policy import AddReqResult

    encoder_len = encoder_len_of(req)
    budget = adder.rem_chunk_tokens
    if budget is None or budget <= 0 or req.prefix_len >= encoder_len:
        return original(adder, req)
    prompt_len = len(req.full_untruncated_fill_ids)
    stock_end = req.prefix_len + adder.floor_chunked_tokens(budget, prompt_len - req.prefix_len)
    if stock_end > encoder_len:
        return original(adder, req)
    if adder.can_run_list:
        return AddReqResult.OTHER
    widened = first_chunk_end(encoder_len, adder.page_size, prompt_len) - req.prefix_len
    _log_whole_encoder_admission(req, budget, encoder_len, widened)
    adder.rem_chunk_tokens = widened
    try:
        return original(adder, req)
    finally:
        # What the admission charged stays charged against the real budget.
        adder.rem_chunk_tokens += budget - widened


def fix_decode_rows_of_mixed_batch(result, batch, running_batch) -> None:
    """AFTER hook: the decode rows appended by ``mix_with_running`` have their encoders cached, and their
    ``extend_end`` counts the encoder."""
    if batch.encoder_cached is None:
        return
    first_decode_row = len(batch.encoder_cached)
    batch.encoder_cached = batch.encoder_cached + [True] * (len(batch.reqs) - first_decode_row)
    for req, encoder_len in zip(batch.reqs[first_decode_row:], batch.encoder_lens_cpu[first_decode_row:]):
        req.extend_end += encoder_len


PATCHES = (
    Patch(
        title="Chunked prefill never cuts inside a request's encoder span",
        target="sglang.srt.managers.schedule_policy.PrefillAdder._select_prefill_admission",
        kind=HookType.AROUND,
        hook=keep_encoder_whole,
        platforms=ON_NPU_AND_CPU,
        why=(
            "an encoder-decoder request (MOSS-VL) carries its encoder tokens as the first "
            "`multimodal_inputs.num_image_tokens` slots of its prompt; `ScheduleBatch.prepare_encoder_info_extend` "
            "writes the encoder K/V once, in the extend whose cached prefix is 0, and asserts that a cached prefix "
            "is either 0 or at least the encoder length. Stock avoids the question by turning chunked prefill off "
            "for MOSS-VL (`server_args` turns it back on for npu / cpu); the stock cut (`chunk budget // page_size "
            "* page_size`) knows nothing of encoders and would end a first chunk inside the vision span (encoder "
            "K/V never written, the next chunk failing the assertion) or right at its end (a chunk with no text "
            "row for the cross-attention layers and the logits)."
        ),
        how=(
            "the stock selection runs unchanged; only a chunked first admission of a request with encoder tokens "
            "(cached prefix below the encoder length) is checked. If the cut leaves at least one text row after the "
            "encoder, it stands. Otherwise the request waits for a later round (`AddReqResult.OTHER`) when other "
            "requests already share this prefill batch; alone in the batch (the budget is smaller than its encoder) "
            "it is admitted with its whole encoder and the first text row(s) up to the next page boundary, with one "
            "log line saying why. Later chunks start at a prefix >= the encoder length and cut freely (page-aligned "
            "by stock)."
        ),
        upstream="open in 0.5.23",
        remove_when="sglang's PrefillAdder keeps encoder spans whole and lists MOSS-VL as chunked-prefill capable",
    ),
    Patch(
        title="Chunked prefill never cuts inside an encoder span on the ignore-EOS admission path",
        target="sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req_ignore_eos",
        kind=HookType.AROUND,
        hook=keep_encoder_whole_on_the_ignore_eos_path,
        platforms=ON_NPU_AND_CPU,
        why=(
            "with the prefix cache disabled (`--disable-radix-cache`), `PrefillAdder.add_one_req` "
            "admits every `ignore_eos` request through `add_one_req_ignore_eos`, which never calls "
            "`_select_prefill_admission` (hooked above): it cuts a first chunk at the remaining chunk budget. For a "
            "MOSS-VL request whose encoder is longer than that budget the chunk ends inside the encoder span, and "
            "`ScheduleBatch.prepare_encoder_info_extend` strips the whole encoder from a chunk that holds only part "
            "of it (`Expected 0, got -4` with a 1-token budget and a 5-token encoder; `Expected 11, got 4` when such "
            "a chunk shares the batch with other requests). The disabled tree itself is not the cause: a chunked "
            "request's next chunk resumes at `checkpoint_kv_cache`'s `prefix_len = extend_end` either way."
        ),
        how=(
            "only a first admission of a request with encoder tokens is checked, against the cut stock would make "
            "(`floor_chunked_tokens` of the remaining budget). A cut past the encoder stands. Otherwise the request "
            "waits (`AddReqResult.OTHER`) when other requests already share this prefill batch; alone, the chunk "
            "budget is raised to the smallest encoder-safe chunk (`first_chunk_end`) for that one stock call, so "
            "stock's memory check, chunk bookkeeping and budget charge all see the tokens really admitted, and then "
            "lowered by what the call charged. Same rule, same log line as the other admission path."
        ),
        upstream="open in 0.5.23",
        remove_when="sglang's PrefillAdder keeps encoder spans whole on both admission paths",
    ),
    Patch(
        title="Decode rows of a mixed batch keep their encoder bookkeeping",
        target="sglang.srt.managers.schedule_batch.ScheduleBatch.mix_with_running",
        kind=HookType.AFTER,
        hook=fix_decode_rows_of_mixed_batch,
        platforms=ON_NPU_AND_CPU,
        why=(
            "`--enable-mixed-chunk` appends the running decode requests to a prefill batch. `merge_batch` "
            "concatenates `encoder_lens` but not `encoder_cached`, and MOSS-VL's forward indexes `encoder_cached` "
            "for every request (which encoders to run, which media to release), so a mixed batch whose prefill part "
            "runs an encoder fails with `IndexError`; and each decode row's `req.extend_end` is set from the batch's "
            "`seq_lens`, which count text only for these requests, so it lands `encoder_len` short of the request's "
            "KV and the radix cache's checkpoint asserts (`cache_protected_len <= len(new_indices)`)."
        ),
        how=(
            "after mixing, the decode rows get `encoder_cached = True` (their encoder K/V is in the pool, as "
            "`prepare_encoder_info_decode` set on the running batch), and their `extend_end` moves past the encoder "
            "(request coordinates count the encoder, as for every prefill row)."
        ),
        upstream="open in 0.5.23",
        remove_when="`merge_batch` concatenates `encoder_cached` and `mix_with_running` counts the encoder",
    ),
)
