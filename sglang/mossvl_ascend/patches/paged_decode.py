"""Paged decode slots of encoder-decoder requests: the next slot follows the whole row, encoder included.

At page size > 1 (the NPU default is 128) stock's decode allocator reads a request's last slot and counts its pages
on ``seq_lens``, which for an encoder-decoder batch is the text length alone, while the request's slot row is
``[encoder slots | text slots]``. Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch

logger = logging.getLogger(__name__)


def needs_row_lengths(batch: Any) -> bool:
    """True when stock's paged decode allocation would address this batch's rows by their text length alone."""
    return bool(
        batch.model_config.is_encoder_decoder and batch.tree_cache.page_size > 1 and any(batch.encoder_lens_cpu or ())
    )


@contextlib.contextmanager
def rows_presented_as_decoder_only(batch: Any):
    """For the duration of the block, each request's ``seq_lens`` is its whole slot row (encoder + text) and its
    ``encoder_lens`` is 0: the layout stock's decoder-only allocation arithmetic is right for. Restored on exit."""
    saved = batch.seq_lens, batch.seq_lens_cpu, batch.encoder_lens
    batch.seq_lens = batch.encoder_lens + batch.seq_lens
    batch.seq_lens_cpu = torch.tensor(batch.encoder_lens_cpu, dtype=batch.seq_lens_cpu.dtype) + batch.seq_lens_cpu
    batch.encoder_lens = torch.zeros_like(batch.encoder_lens)
    try:
        yield
    finally:
        batch.seq_lens, batch.seq_lens_cpu, batch.encoder_lens = saved


def alloc_decode_after_the_whole_row(original: Callable, batch: Any, token_per_req: int, *args: Any, **kwargs: Any):
    """AROUND hook on ``alloc_for_decode``: paged encoder-decoder batches allocate at ``encoder_len + text_len``."""
    if not needs_row_lengths(batch):
        return original(batch, token_per_req, *args, **kwargs)
    with rows_presented_as_decoder_only(batch):
        return original(batch, token_per_req, *args, **kwargs)


PATCHES = (
    Patch(
        title="Paged decode allocation of an encoder-decoder request continues its whole slot row",
        target="sglang.srt.mem_cache.allocation.alloc_for_decode",
        kind=HookType.AROUND,
        hook=alloc_decode_after_the_whole_row,
        platforms=ON_NPU_AND_CPU,
        why=(
            "at page size > 1 `alloc_for_decode_default` takes `last_loc = req_to_token[row, seq_lens - 1]` and "
            "counts pages on `seq_lens + 1`, but for an encoder-decoder batch `seq_lens` is the text length only "
            "(`prepare_encoder_info_extend` strips the encoder) while the request's slots are "
            "`[encoder | text]`; the same function writes the new slot at `encoder_lens + seq_lens`. Once the text "
            "is longer than the encoder, every decoded token's K/V lands on a slot of its own prompt (and a page "
            "boundary is decided at the wrong length, so a token can spill into a page the request does not own). "
            "Measured on a CPU server at `--page-size 128` against `--page-size 1`: logprobs off from the first "
            "decode step (up to 1.12) and greedy tokens diverging at token 7. The NPU's default page size is 128."
        ),
        how=(
            "for an encoder-decoder batch with encoder tokens at page size > 1, stock's allocator runs with the "
            "batch presented as decoder-only rows: `seq_lens` (device and host) become `encoder_lens + seq_lens` "
            "and `encoder_lens` 0 for the call, then all three are restored. Stock's own arithmetic then reads the "
            "last slot, counts pages and writes the new slot at the row's true end. Page size 1 and batches "
            "without encoder tokens call stock unchanged. The extend paths (`alloc_for_extend`, chunked "
            "continuations) already allocate on the full row: they run before the encoder is stripped; mixed "
            "chunks and retraction go through this decode allocation or free the whole row (`kv_allocated_len`)."
        ),
        upstream="open in 0.5.23 (`alloc_for_decode_default`; the non-paged branch is unaffected)",
        remove_when="stock's paged decode allocation adds `encoder_lens` to the last-slot index and the page count",
    ),
)
