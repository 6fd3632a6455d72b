"""Attention that also returns each row's log-sum-exp, one implementation per device (math layer, pure torch).

Every attention the core runs goes through :func:`attention_with_lse`:

- CPU: ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` (the kernel behind CPU SDPA; it returns
  the fp32 logsumexp next to the output, at SDPA speed, and handles GQA itself);
- NPU: ``torch_npu.npu_fused_infer_attention_score`` with ``softmax_lse_flag=True`` (layout BNSD,
  ``num_key_value_heads`` for GQA, the LSE comes back as ``[B, N, S, 1]`` fp32). It takes per-entry lengths
  (``actual_seq_lengths`` / ``actual_seq_lengths_kv``) and a causal limit after each entry's cached prefix
  (``sparse_mode=3`` with the op's compressed 2048 x 2048 mask, one per device, as stock sglang passes it), so
  padded and causal calls send no rows x keys mask; only visibility lengths cannot express (per-row frame
  boundaries) goes as ``atten_mask`` (True = masked out). Written to the torch_npu documentation and checked on
  CPU against the STAND-IN in ``tests/fake_torch_npu.py`` only: it has not run on an Ascend card;
- anything else, softcapped logits (no fused op has a softcap and an LSE) and value dims unequal to the query
  dim: plain torch with explicit fp32 scores, in row chunks so the score matrix stays bounded.

Conventions: q ``[B, Hq, L, D]``; k ``[B, Hk, S, D]``; v ``[B, Hk, S, Dv]`` (Hq a multiple of Hk, query head h
reads KV head ``h // (Hq / Hk)``); ``visible`` bool broadcastable to ``[B, 1, L, S]``, **True = attend** (torch
SDPA's convention; the NPU call inverts it); ``lengths`` (:class:`BatchLengths`, host ints) the real rows and keys
of each batch entry. Returns (out ``[B, Hq, L, Dv]`` in q's dtype, lse fp32 ``[B, Hq, L]``). A row that sees no key
gets out 0 and lse -inf, on every device, so an LSE merge gives it zero weight.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

# The plain path materialises fp32 scores; bound one chunk to this many elements (64 MiB).
_PLAIN_SCORE_ELEMENTS = 1 << 24
# The CPU kernel folds GQA query heads into rows (``cpu_attention_with_lse``) for calls of up to this many rows
# (decode: each KV head's K/V is streamed once instead of once per query head); at 32 masked rows (extend) it
# measured even, and a masked call pays for repeating its mask per folded head.
_FOLD_MAX_ROWS = 16
# ... and for unmasked calls below this many rows: the kernel picks its query tile from a call's rows (256 from
# 768 rows on, 64 or 32 below), so a 192-767-row block of the frame-causal plan reaches the large tile when
# folded (512 x 5590 block, 8:2 heads: 27 -> 23 ms, benchmarks/bench_cross_attention.py); above it, no gain.
_KERNEL_LARGE_TILE_ROWS = 768
# The side of the compressed causal mask the Ascend fused op takes with sparse_mode 2/3/4 (torch_npu docs).
NPU_COMPRESSED_MASK_SIZE = 2048


@dataclass(frozen=True)
class BatchLengths:
    """Per batch entry, host ints: its real query rows (the first ``queries[b]``; later rows are padding, with any
    output) and the keys it may see (the first ``keys[b]``, at least one; with ``causal``, ``keys[b] >=
    queries[b]``). An entry that would see no key belongs in no call (its output is 0)."""

    queries: tuple[int, ...]
    keys: tuple[int, ...]


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    visible: torch.Tensor | None = None,
    lengths: BatchLengths | None = None,
    logit_cap: float = 0.0,
    every_row_sees_a_key: bool = False,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over k/v with its per-row log-sum-exp; the device picks the implementation (module doc).

    ``every_row_sees_a_key``: the caller guarantees no row of ``visible`` is all False (causal self-attention,
    where a row sees at least itself), which skips the blind-row fix-up: fewer ops per layer call.
    ``causal``: each entry's rows end at its last key, row r of L sees keys ``<= r + S - L`` (S, L: the entry's
    keys and rows from ``lengths``, else the call's), so rows after a cached prefix see it; ``visible`` must be
    None. With rows == keys it is the top-left causal mask, which the CPU kernel applies itself (skipping the key
    blocks above the diagonal); the NPU op takes it as its compressed causal mode; elsewhere it becomes a mask.
    ``lengths``: devices whose primitive takes them (:func:`takes_lengths`) get them as they are; elsewhere they
    become part of the ``visible`` mask.
    """
    batch, num_heads, rows, _ = q.shape
    if k.shape[2] == 0 or rows == 0:
        out = q.new_zeros(batch, num_heads, rows, v.shape[-1])
        return out, torch.full((batch, num_heads, rows), float("-inf"), device=q.device)
    fused = FUSED_ATTENTION_BY_DEVICE.get(q.device.type)
    if fused is not None and fused.takes_lengths and not logit_cap and q.shape[-1] == v.shape[-1]:
        out, lse = fused.attend(q, k, v, scale, visible=visible, lengths=lengths, causal=causal)
        return _zero_blind_rows(out, lse, visible, every_row_sees_a_key)
    if lengths is not None:
        visible = _visible_within(lengths, rows, k.shape[2], causal, q.device, visible)
        causal, every_row_sees_a_key = False, every_row_sees_a_key or causal
    if causal:
        if q.device.type == "cpu" and not logit_cap and q.shape[-1] == v.shape[-1] and rows == k.shape[2]:
            return cpu_attention_with_lse(q, k, v, scale, causal=True)
        visible, every_row_sees_a_key = _bottom_right_causal(rows, k.shape[2], q.device), True
    if logit_cap > 0 or q.shape[-1] != v.shape[-1] or fused is None:
        return plain_attention_with_lse(q, k, v, scale, visible=visible, logit_cap=logit_cap)
    out, lse = fused.attend(q, k, v, scale, visible=visible)
    return _zero_blind_rows(out, lse, visible, every_row_sees_a_key)


def _zero_blind_rows(out, lse, visible, every_row_sees_a_key):
    """Rows of ``visible`` that see no key: out 0, lse -inf (a fused op leaves them unspecified)."""
    if visible is None or every_row_sees_a_key:
        return out, lse
    blind = ~visible.any(dim=-1)  # [B or 1, 1, L]
    return out.masked_fill(blind[..., None], 0.0), lse.masked_fill(blind, float("-inf"))


def _bottom_right_causal(rows: int, keys: int, device) -> torch.Tensor:
    """``[1, 1, rows, keys]`` True where key <= row + keys - rows."""
    limit = torch.arange(rows, device=device)[:, None] + (keys - rows)
    return (torch.arange(keys, device=device) <= limit)[None, None]


def _visible_within(lengths: BatchLengths, rows: int, keys: int, causal: bool, device, visible=None):
    """``lengths`` (and ``causal`` after each entry's prefix) as a ``[B, 1, rows, keys]`` mask, and ``visible``."""
    per_entry = torch.tensor([lengths.queries, lengths.keys], device=device)
    query_lens, key_lens = per_entry[0].view(-1, 1, 1, 1), per_entry[1].view(-1, 1, 1, 1)
    key = torch.arange(keys, device=device).view(1, 1, 1, keys)
    within = key < key_lens
    if causal:
        within = within & (key <= torch.arange(rows, device=device).view(1, 1, rows, 1) + key_lens - query_lens)
    return within if visible is None else within & visible


def cpu_attention_with_lse(q, k, v, scale, *, visible=None, causal=False):
    """The CPU flash kernel; it takes an additive mask of the query's dtype (0 = attend, -inf = masked), or
    ``causal`` (its own top-left causal mask, which skips the key blocks above the diagonal).

    With GQA and few rows (decode, or an unmasked block below the kernel's large query tile), the query heads that
    share a KV head are folded into the rows of one head (``[B, Hk, group * L, D]``): the kernel then streams each
    KV head's K/V once instead of once per query head (decode: about 3x faster, memory-bound) and runs larger
    query tiles; the math per row is unchanged.
    """
    batch, num_heads, rows, dim = q.shape
    group = num_heads // k.shape[1]
    # Folded rows are ``g * L + r``: the kernel's causal mask would compare those indices, so causal calls never fold.
    small = rows <= _FOLD_MAX_ROWS or (visible is None and rows < _KERNEL_LARGE_TILE_ROWS)
    fold = group > 1 and not causal and small
    if fold:
        q = q.reshape(batch, k.shape[1], group * rows, dim)  # query head h = kv head h // group, row g * L + r
        if visible is not None and visible.shape[-2] > 1:
            visible = visible.repeat(1, 1, group, 1)
    mask = None
    if visible is not None:
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, is_causal=causal, attn_mask=mask, scale=scale
    )
    if fold:
        out, lse = out.reshape(batch, num_heads, rows, -1), lse.reshape(batch, num_heads, rows)
    return out, lse


def npu_attention_with_lse(q, k, v, scale, *, visible=None, lengths=None, causal=False):
    """``torch_npu.npu_fused_infer_attention_score``, BNSD, with its softmax LSE (not run on hardware here).

    ``lengths`` go as ``actual_seq_lengths`` / ``actual_seq_lengths_kv`` (host lists: no device read); ``causal``
    with more than one row as ``sparse_mode=3`` (right-down causal: each entry's rows end at its last key) with the
    compressed mask; one row sees all of its keys anyway (the op ignores sparse_mode then). ``visible`` becomes the
    full mask, inverted per call: only calls with per-row frame boundaries carry one.
    """
    import torch_npu

    options = {}
    if lengths is not None:
        options["actual_seq_lengths_kv"] = list(lengths.keys)
        if q.shape[2] > 1:  # the op ignores query lengths at one row; stock and vllm-ascend decode pass none
            options["actual_seq_lengths"] = list(lengths.queries)
    if causal and q.shape[2] > 1:
        options.update(atten_mask=npu_compressed_causal_mask(q.device), sparse_mode=3)
    elif visible is not None:
        options["atten_mask"] = (~visible).contiguous()  # Ascend: True = masked out
    out, lse = torch_npu.npu_fused_infer_attention_score(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        num_heads=q.shape[1],
        num_key_value_heads=k.shape[1],
        input_layout="BNSD",
        scale=scale,
        softmax_lse_flag=True,
        **options,
    )
    return out, lse.squeeze(-1).float()


@functools.cache
def npu_compressed_causal_mask(device: torch.device) -> torch.Tensor:
    """The Ascend op's compressed causal mask, ``[2048, 2048]`` bool True (masked out) above the diagonal: built
    once per device and shared by every causal call (stock sglang's ``fia_mask``)."""
    size = NPU_COMPRESSED_MASK_SIZE
    return torch.ones(size, size, dtype=torch.bool, device=device).triu_(1)


def npu_paged_attention(q, k_pages, v_pages, scale, *, block_table, block_size, kv_ends, masked_out=None):
    """Attention straight from the paged KV pool: ``npu_fused_infer_attention_score`` with ``block_table``, no LSE.

    q ``[B, Hq, rows, D]``; k/v_pages ``[num_blocks, block_size, Hk * D]`` (the pool, no copy); block_table
    int32 ``[B, max_blocks]``; kv_ends host ints, keys at positions ``>= kv_ends[b]`` unseen
    (``actual_seq_lengths_kv``), each > 0; masked_out bool ``[B, 1, rows, max_blocks * block_size]`` or None, True
    where a position is hidden (the encoder in front of a request's text, which a block table cannot skip); every
    row must see a key. All built once per forward by the caller: no device read or copy here. Returns out
    ``[B, Hq, rows, D]`` in q's dtype. Written to the torch_npu documentation; not run on an Ascend card.

    ``softmax_lse_flag=False``: no caller merges this call's LSE, and inside an NPU decode graph torch_npu records the
    call's ``.out`` form with an LSE buffer of its own making, one element in torch_npu 7.1-7.2 whatever the flag
    says (``torch_npu/npu/graphs.py``, ``_GraphDispatchMode.__torch_dispatch__``): with the flag the kernel would write
    a ``[B, Hq, rows, 1]`` LSE past it.
    """
    import torch_npu

    out, _ = torch_npu.npu_fused_infer_attention_score(
        q.contiguous(),
        k_pages,
        v_pages,
        num_heads=q.shape[1],
        num_key_value_heads=k_pages.shape[-1] // q.shape[-1],
        input_layout="BNSD",
        scale=scale,
        block_table=block_table,
        block_size=block_size,
        actual_seq_lengths_kv=kv_ends,
        atten_mask=masked_out,
        softmax_lse_flag=False,
    )
    return out


@dataclass(frozen=True)
class FusedAttention:
    """A device's fused attention-with-LSE: ``attend(q, k, v, scale, *, visible, [lengths, causal])``, and whether
    it takes :class:`BatchLengths` and the prefix-causal limit itself (else they become a mask)."""

    attend: Callable
    takes_lengths: bool = False


# The fused attention-with-LSE of each device type; other devices take the plain path.
FUSED_ATTENTION_BY_DEVICE = {
    "cpu": FusedAttention(cpu_attention_with_lse),
    "npu": FusedAttention(npu_attention_with_lse, takes_lengths=True),
}


def takes_lengths(device_type: str) -> bool:
    """Whether the device's fused primitive takes per-entry lengths and the causal limit without a mask."""
    fused = FUSED_ATTENTION_BY_DEVICE.get(device_type)
    return fused is not None and fused.takes_lengths


def plain_attention_with_lse(q, k, v, scale, *, visible=None, logit_cap=0.0):
    """Explicit fp32 scores (optionally ``cap * tanh(s / cap)``), masked, ``logsumexp`` and ``softmax``.

    The query heads are folded onto their KV head (``[B, Hk, group * rows, D]``) so GQA needs no copy of K/V;
    rows are processed in chunks bounded by ``_PLAIN_SCORE_ELEMENTS``.
    """
    batch, num_heads, rows, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = num_heads // kv_heads
    k32, v32 = k.float(), v.float()
    out = q.new_empty(batch, num_heads, rows, v.shape[-1])
    lse = torch.empty(batch, num_heads, rows, device=q.device)
    chunk = max(1, _PLAIN_SCORE_ELEMENTS // max(1, batch * num_heads * keys))
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        q_chunk = q[:, :, start:stop].float().reshape(batch, kv_heads, group * (stop - start), dim)
        scores = torch.matmul(q_chunk, k32.transpose(-1, -2)).mul_(scale)
        if logit_cap > 0:
            scores = scores.div_(logit_cap).tanh_().mul_(logit_cap)
        scores = scores.view(batch, num_heads, stop - start, keys)
        if visible is not None:
            scores = scores.masked_fill(~visible[..., start:stop, :], float("-inf"))
        chunk_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - chunk_lse.masked_fill(chunk_lse == float("-inf"), 0.0)[..., None])
        chunk_out = torch.matmul(probs.view(batch, kv_heads, group * (stop - start), keys), v32)
        out[:, :, start:stop] = chunk_out.view(batch, num_heads, stop - start, -1).to(q.dtype)
        lse[:, :, start:stop] = chunk_lse
    return out, lse


def accumulate_by_lse(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor) -> None:
    """Merge in place a partial result over other keys (``out``, ``out_lse``) into the fp32 accumulator ``acc``
    normalised to ``acc_lse``: both weighted by ``exp(lse - combined lse)``. A row that sees no key on either side
    (lse -inf on both) keeps output 0 and lse -inf, where the weights alone would be NaN."""
    combined = torch.logaddexp(acc_lse, out_lse)
    acc.mul_(torch.exp(acc_lse - combined).nan_to_num_(0.0)[..., None])
    acc.add_(out.float().mul_(torch.exp(out_lse - combined).nan_to_num_(0.0)[..., None]))
    acc_lse.copy_(combined)
