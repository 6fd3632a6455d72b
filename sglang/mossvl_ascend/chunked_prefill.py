"""Chunked prefill and mixed batches for encoder-decoder requests: never cut inside an encoder span.

Catalog entries: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import dataclasses
import logging

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.radix_prefix import encoder_len_of
from mossvl_ascend.registry import ON_NPU_AND_CPU, Patch

logger = logging.getLogger(__name__)


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
    encoder_len = encoder_len_of(req)
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
