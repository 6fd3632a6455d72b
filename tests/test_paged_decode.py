"""Paged decode allocation of encoder-decoder requests: each decoded token gets the slot after its whole row.

Real sglang objects drive stock ``alloc_for_decode`` (``ReqToTokenPool``, ``PagedTokenToKVPoolAllocator``) the way
``ScheduleBatch.prepare_for_decode`` does: ``seq_lens`` holds the text length only (the encoder was stripped at
extend) and the row of request slots is ``[encoder | text]``. The oracle is the paging rule itself, computed here
independently: a row's next slot is its last slot + 1 while the row's length is not a multiple of the page size,
else the first slot of a page that nobody owns; a decode slot is never one the row (or another row) already holds.
Control cases run stock's function without the hook to show the scenario is real.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mossvl_ascend.patches import paged_decode
from support.hooks import patches_applied

PAGE = 128
# (encoder length, text length): text longer than the encoder; an encoder across a page boundary whose row ends
# exactly on one; an encoder longer than the text (stock's case that happens to work); a text-only request.
ROWS = [(5, 40), (130, 126), (300, 20), (0, 60)]


def _alloc_for_decode():
    from sglang.srt.mem_cache import allocation

    return allocation.alloc_for_decode


def prefilled_batch(rows, page_size=PAGE, pool_pages=64):
    """A decode batch after stock extend allocation: every row's slots taken on its full length (encoder + text)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    allocator = PagedTokenToKVPoolAllocator(
        pool_pages * page_size, page_size, torch.float32, "cpu", kvcache=None, need_sort=False
    )
    req_to_token_pool = ReqToTokenPool(
        size=len(rows) + 1, max_context_len=2048, device="cpu", enable_memory_saver=False
    )
    row_lens = torch.tensor([e + t for e, t in rows])
    slots = allocator.alloc_extend(
        prefix_lens=torch.zeros(len(rows), dtype=torch.int64),
        prefix_lens_cpu=torch.zeros(len(rows), dtype=torch.int64),
        seq_lens=row_lens,
        seq_lens_cpu=row_lens,
        last_loc=torch.full((len(rows),), -1, dtype=torch.int64),
        extend_num_tokens=int(row_lens.sum()),
    )
    pool_rows = torch.arange(1, len(rows) + 1)
    start = 0
    for pool_row, length in zip(pool_rows.tolist(), row_lens.tolist()):
        req_to_token_pool.write((pool_row, slice(0, length)), slots[start : start + length].to(torch.int32))
        start += length
    tree_cache = SimpleNamespace(
        page_size=page_size, token_to_kv_pool_allocator=allocator, supports_prefix_sharing=lambda: False
    )
    reqs = [SimpleNamespace(kv=SimpleNamespace(kv_allocated_len=e + t, kv_committed_len=e + t)) for e, t in rows]
    return SimpleNamespace(
        model_config=SimpleNamespace(is_encoder_decoder=True),
        tree_cache=tree_cache,
        req_to_token_pool=req_to_token_pool,
        req_pool_indices=pool_rows,
        req_pool_indices_cpu=pool_rows,
        reqs=reqs,
        device="cpu",
        encoder_lens=torch.tensor([e for e, _ in rows]),
        encoder_lens_cpu=[e for e, _ in rows],
        seq_lens=torch.tensor([t for _, t in rows]),
        seq_lens_cpu=torch.tensor([t for _, t in rows]),
        maybe_evict_swa=lambda: None,
    )


def expected_next_slots(batch) -> list:
    """The paging rule: last slot + 1 inside a page; at a page boundary, a slot whose page nobody owns yet."""
    expected = []
    for i, (encoder_len, text_len) in enumerate(zip(batch.encoder_lens_cpu, batch.seq_lens_cpu.tolist())):
        row_len = encoder_len + text_len
        last = int(batch.req_to_token_pool.req_to_token[batch.req_pool_indices[i], row_len - 1])
        expected.append(None if row_len % PAGE == 0 else last + 1)
    return expected


def decode_steps(batch, steps: int, alloc) -> list:
    """Run ``steps`` decode allocations as ``prepare_for_decode`` does; returns the slots of each step."""
    history = []
    for _ in range(steps):
        owned = {int(s) for i, row in enumerate(batch.req_pool_indices) for s in row_slots(batch, i)}
        expected = expected_next_slots(batch)
        out = alloc(batch, 1)
        for i, slot in enumerate(out.tolist()):
            assert slot not in owned, f"request {i}: decode slot {slot} overwrites a slot already in use"
            if expected[i] is None:
                assert slot % PAGE == 0 and all(s // PAGE != slot // PAGE for s in owned), (i, slot)
            else:
                assert slot == expected[i], (i, slot, expected[i])
        assert len(set(out.tolist())) == len(out)
        history.append(out.tolist())
        batch.seq_lens = batch.seq_lens + 1
        batch.seq_lens_cpu = batch.seq_lens_cpu + 1
    return history


def row_slots(batch, i):
    row_len = batch.encoder_lens_cpu[i] + int(batch.seq_lens_cpu[i])
    return batch.req_to_token_pool.req_to_token[batch.req_pool_indices[i], :row_len]


def test_decoded_tokens_follow_the_whole_row_at_page_128():
    batch = prefilled_batch(ROWS)
    with patches_applied(*paged_decode.PATCHES):
        history = decode_steps(batch, steps=3, alloc=_alloc_for_decode())
    for step, slots in enumerate(history):
        for i, slot in enumerate(slots):
            # The row records the new slot at its true end, where the attention reads it back.
            encoder_len, text_len = ROWS[i]
            assert (
                int(batch.req_to_token_pool.req_to_token[batch.req_pool_indices[i], encoder_len + text_len + step])
                == slot
            )
    assert batch.encoder_lens.tolist() == [e for e, _ in ROWS], "the encoder lengths are restored after the call"
    assert batch.seq_lens.tolist() == [t + 3 for _, t in ROWS]


def test_stock_overwrites_the_prompt_when_the_text_is_longer_than_the_encoder():
    batch = prefilled_batch(ROWS[:1])
    with pytest.raises(AssertionError, match="overwrites a slot already in use"):
        decode_steps(batch, steps=1, alloc=_alloc_for_decode())


def test_an_encoder_longer_than_the_text_is_where_stock_happens_to_agree():
    batch = prefilled_batch(ROWS[2:3])
    stock_slot = _alloc_for_decode()(prefilled_batch(ROWS[2:3]), 1).tolist()
    with patches_applied(*paged_decode.PATCHES):
        fixed_slot = decode_steps(batch, steps=1, alloc=_alloc_for_decode())[0]
    # Stock lands inside the encoder's slots (whose self-attention K/V nothing reads), the fix after the row.
    assert stock_slot != fixed_slot


def test_page_size_1_and_text_only_batches_call_stock_unchanged():
    page_one = prefilled_batch(ROWS, page_size=1, pool_pages=4096)
    text_only = prefilled_batch([(0, 60), (0, 7)])
    assert not paged_decode.needs_row_lengths(page_one)
    assert not paged_decode.needs_row_lengths(text_only)
    with patches_applied(*paged_decode.PATCHES):
        decode_steps(text_only, steps=2, alloc=_alloc_for_decode())
