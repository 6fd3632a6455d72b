"""A MOSS-VL decode step as an NPU graph records it: one fused attention call per layer, reading K/V in place from
the paged pool through block tables and masks derived on the device from the step's static inputs (batch layer).

Everything the recorded step reads is a tensor: stock's static ``req_pool_indices`` and ``seq_lens``, the pool's
``req_to_token`` and K/V, and the step's :class:`~mossvl_ascend.attention.decode_step.DecodeView`. The tables are
built inside the recording (:func:`step_tables`, once per step, shared by every layer of a kind); their widths are
static (the pool's pages per request row), so one recording serves every step of its bucket. The only host values
are the fused op's KV lengths (``actual_seq_lengths_kv``, which the op takes as a host list only): the recording
freezes the capture-time lists, and every replay replaces them per recorded call through ``NPUGraph.update``
(:func:`host_kv_lengths`; self- and cross-attention layers differ, so one dict per record, in capture order).

Key positions of one row (``P`` the page size, ``R`` its encoder slots, ``E`` its vision tokens):

- self-attention: the table starts at the page holding its first text slot (column ``R``); position ``p`` is column
  ``(R // P) * P + p``, the first ``R % P`` positions are encoder slots (masked out), KV length ``R % P + seq_len``;
- cross-attention: ``bands`` runs of ``ceil(R / P)`` pages, band ``b``'s run the same pages ``b * band_stride``
  slots further into the storage; position ``p`` holds encoder entry ``e`` (``< R``) of band ``b``, vision token
  ``b * R + e`` (band-major) or ``e * bands + b`` (a realtime session's slot-major encoder); it is visible iff that
  token lies in ``[lower, E)``. Key order does not matter to attention, so nothing is gathered.

A row that sees no vision token (a text-only request, a bucket's padding row) gets KV length 1 and a mask hiding
it: the op's output for such a row is unspecified (NaN on the stand-in), so the row's output is replaced by zeros
with ``torch.where``. Multiplying by a 0/1 gate would keep the NaN (``0 * NaN``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mossvl_ascend.attention.decode_step import DecodeRows, DecodeView
from mossvl_ascend.attention.kv_layout import EncoderAddressing
from mossvl_ascend.attention.primitives import npu_paged_attention


@dataclass(frozen=True)
class KindTables:
    """One attention kind's tables for a step: ``block_table`` int32 ``[bs, blocks]``, ``masked_out`` bool
    ``[bs, 1, 1, blocks * page]`` (True = hidden), ``sees_a_key`` bool ``[bs]`` or None (every row sees one),
    ``kv_lengths`` host ints (frozen at capture, replaced at replay by the graph's update)."""

    block_table: torch.Tensor
    masked_out: torch.Tensor
    sees_a_key: torch.Tensor | None
    kv_lengths: list[int]


@dataclass(frozen=True)
class StepTables:
    self_attention: KindTables
    cross_attention: KindTables

    def of(self, is_cross_attention: bool) -> KindTables:
        return self.cross_attention if is_cross_attention else self.self_attention


def row_pages(req_to_token: torch.Tensor, page_size: int) -> int:
    """Pages of one request row of the pool: the static width of every table."""
    return -(-req_to_token.shape[1] // page_size)


def host_kv_lengths(
    rows: DecodeRows, seq_lens: list[int], bs: int, page_size: int, addressing: EncoderAddressing
) -> tuple[list[int], list[int]]:
    """The fused op's KV lengths per row of a bucket of ``bs`` (self-attention, cross-attention), computed on the
    host from the same values the static buffers receive; a padding row decodes one text token and sees no vision."""
    padding = bs - rows.batch_size
    self_lengths = [r % page_size + s for r, s in zip(rows.encoder_rows, seq_lens)] + [1] * padding
    cross_lengths = [
        addressing.bands * -(-r // page_size) * page_size if e > lo else 1
        for r, e, lo in zip(rows.encoder_rows, rows.vision, rows.lower)
    ] + [1] * padding
    return self_lengths, cross_lengths


def capture_kv_lengths(bs: int) -> tuple[list[int], list[int]]:
    """The lengths a capture records (every row one key, as stock captures text decode with its small fill value):
    each replay replaces them, and a capture-time length never exceeds what the pool's blocks can hold."""
    return [1] * bs, [1] * bs


def per_record_update(cross_layers: list[bool], kv_lengths: tuple[list[int], list[int]]) -> list[dict]:
    """``NPUGraph.update``'s input for a replay: one dict per recorded fused-attention call, in capture order
    (``cross_layers``: whether each recorded call is a cross-attention layer's)."""
    self_lengths, cross_lengths = kv_lengths
    return [{"actual_seq_lengths_kv": cross_lengths if cross else self_lengths} for cross in cross_layers]


def step_tables(
    view: DecodeView,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    page_size: int,
    addressing: EncoderAddressing,
    kv_lengths: tuple[list[int], list[int]],
) -> StepTables:
    """Both kinds' tables of one decode step, derived on the device (no host read, static shapes)."""
    pool_rows = req_pool_indices.long()
    encoder_rows = view.encoder_rows.long()
    self_lengths, cross_lengths = kv_lengths
    return StepTables(
        _self_tables(req_to_token, pool_rows, encoder_rows, page_size, self_lengths),
        _cross_tables(view, req_to_token, pool_rows, encoder_rows, page_size, addressing, cross_lengths),
    )


def _self_tables(req_to_token, pool_rows, encoder_rows, page_size: int, lengths: list[int]) -> KindTables:
    pages = row_pages(req_to_token, page_size)
    first_page = encoder_rows // page_size
    columns = ((first_page[:, None] + torch.arange(pages, device=pool_rows.device)) * page_size).clamp_(
        max=req_to_token.shape[1] - 1
    )
    block_table = (req_to_token[pool_rows[:, None], columns] // page_size).to(torch.int32)
    positions = torch.arange(pages * page_size, device=pool_rows.device)
    masked_out = positions[None, :] < (encoder_rows % page_size)[:, None]
    return KindTables(block_table, masked_out[:, None, None, :], None, lengths)


def _cross_tables(
    view: DecodeView, req_to_token, pool_rows, encoder_rows, page_size: int, addressing, lengths: list[int]
) -> KindTables:
    device = pool_rows.device
    bands = addressing.bands
    pages = row_pages(req_to_token, page_size)
    band_pages = ((encoder_rows + page_size - 1) // page_size).clamp_(min=1)  # a run per band; >= 1 for E = 0
    column = torch.arange(bands * pages, device=device)[None, :]
    band, page_in_band = column // band_pages[:, None], column % band_pages[:, None]
    in_a_band = band < bands
    slots = req_to_token[pool_rows[:, None], (page_in_band * page_size).clamp_(max=req_to_token.shape[1] - 1)]
    block_table = torch.where(in_a_band, slots // page_size + band * (addressing.band_stride // page_size), 0)

    position = torch.arange(bands * pages * page_size, device=device)[None, :]
    key_page, offset = position // page_size, position % page_size
    key_band = key_page // band_pages[:, None]
    entry = (key_page % band_pages[:, None]) * page_size + offset
    token = torch.where(
        view.slot_major[:, None] != 0, entry * bands + key_band, key_band * encoder_rows[:, None] + entry
    )
    vision, lower = view.vision.long()[:, None], view.lower.long()[:, None]
    visible = (entry < encoder_rows[:, None]) & (key_band < bands) & (token >= lower) & (token < vision)
    sees_a_key = (view.vision > view.lower) & (view.gate != 0)
    return KindTables(block_table.to(torch.int32), (~visible)[:, None, None, :], sees_a_key, lengths)


def graph_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: KindTables,
    scale: float,
    page_size: int,
) -> torch.Tensor:
    """One layer's decode attention for the bucket: query ``[bs, heads, dim]``, the pool's ``[slots, kv_heads, dim]``
    K/V; returns ``[bs, heads, v_dim]``, zero on a row that sees no key."""
    out = npu_paged_attention(
        query[:, :, None, :],
        k_cache.view(-1, page_size, k_cache.shape[1] * k_cache.shape[2]),
        v_cache.view(-1, page_size, v_cache.shape[1] * v_cache.shape[2]),
        scale,
        block_table=tables.block_table,
        block_size=page_size,
        kv_ends=tables.kv_lengths,
        masked_out=tables.masked_out,
    )
    out = out[:, :, 0]
    if tables.sees_a_key is None:
        return out
    return zero_rows_without_keys(out, tables.sees_a_key)


def zero_rows_without_keys(out: torch.Tensor, sees_a_key: torch.Tensor) -> torch.Tensor:
    """``out`` ``[bs, heads, dim]`` with the rows that see no key set to 0 (their op output may be NaN)."""
    return torch.where(sees_a_key[:, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
