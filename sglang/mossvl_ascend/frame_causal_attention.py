"""Frame-causal cross-attention from one int per text row, without a dense mask (issue 7).

MOSS-VL's cross-attention visibility is prefix-causal over frames: a text row sees the encoder
prefix ``[0, boundary)`` where ``boundary`` is the end of the last frame it may see. Stock sglang
describes it with a packed ``[extend_seq_len x encoder_len]`` uint8 mask per request (1 =
visible); for a long video that is tens to hundreds of MB and the dense SDPA still spends its
FLOPs on frames that are masked out. Here the visibility is an int32 boundary per row, and the
attention of one request is computed in *tiles*: rows sorted by boundary, consecutive rows grouped
so that each tile is one SDPA over keys ``[0, largest boundary in the tile)``. A tile whose rows
share one boundary (a run: the question after a video, a single image) needs no mask at all;
other tiles carry a mask only of their own ``rows x keys`` size. The grouping is chosen by a
small dynamic programme over the runs of equal boundaries that trades the keys a tile computes
for rows it masks out (band waste) against the cost of many small SDPA calls (a CPU/NPU SDPA
runs far below peak with a handful of rows).

Pure torch, no sglang imports: the same code runs on CPU and, through plain torch ops
(``scaled_dot_product_attention``, ``matmul``, ``softmax``), on an Ascend NPU.
Tensor conventions: a request's query ``[num_heads, q_len, head_dim]``, key/value
``[num_kv_heads, kv_len, head_dim | v_head_dim]``; torch SDPA bool masks are True = attend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention

# Default cost model of one SDPA call over R rows and K keys: (R + ROW_OVERHEAD) * K *
# (MASKED_COST if the tile carries a mask else 1). ROW_OVERHEAD expresses the fixed and
# low-occupancy cost of a call in "rows"; MASKED_COST the extra work of reading and applying a
# mask. Chosen with benchmarks/bench_cross_attention.py on the 2-core CPU; the result is exact
# whatever the constants, they only decide how fast it is (an NPU may want others).
ROW_OVERHEAD = 256.0
MASKED_COST = 1.3

# The softcap path materialises scores; bound one chunk to this many fp32 elements (64 MiB).
_SOFTCAP_SCORE_ELEMENTS = 1 << 24


def frame_ends_from_grid_thw(grid_thw: torch.Tensor, spatial_merge_size: int) -> torch.Tensor:
    """End offset in the encoder sequence of every frame, int64 ``[num_frames]``.

    ``grid_thw`` is ``[num_media, 3]`` (or ``[3]``) of (t, h, w) in patches. Every frame of a
    medium holds ``h*w / merge**2`` vision tokens plus one separator, frames in medium order.
    """
    grid = torch.as_tensor(grid_thw, dtype=torch.int64).reshape(-1, 3)
    frame_spans = grid[:, 1] * grid[:, 2] // (spatial_merge_size**2) + 1
    return torch.repeat_interleave(frame_spans, grid[:, 0]).cumsum(0)


def encoder_boundaries_from_visible_frames(
    visible_frame_counts: torch.Tensor,
    frame_ends: torch.Tensor,
    encoder_len: int | None = None,
) -> torch.Tensor:
    """Per-row encoder boundary, int32: a row that sees ``c`` frames sees keys ``[0, frame_ends[c-1])``.

    Counts beyond the number of frames see every frame; ``encoder_len`` (when given) clamps the
    boundary as the stock mask builder clamps frame ranges to the request's encoder length.
    """
    counts = torch.as_tensor(visible_frame_counts).to(torch.int64)
    frame_ends = torch.as_tensor(frame_ends, dtype=torch.int64).to(counts.device)
    if frame_ends.numel() == 0:
        return torch.zeros_like(counts, dtype=torch.int32)
    # A zero-length prefix in front of the frame ends makes "sees no frame" index 0.
    ends_with_zero = torch.cat([frame_ends.new_zeros(1), frame_ends])
    boundaries = ends_with_zero[counts.clamp(0, frame_ends.numel())]
    if encoder_len is not None:
        boundaries = boundaries.clamp(max=encoder_len)
    return boundaries.to(torch.int32)


def encoder_boundaries_from_packed_mask(
    mask_slice: torch.Tensor, q_len: int, kv_len: int
) -> torch.Tensor:
    """Per-row boundaries of one request's slice of a stock packed mask (uint8, 1 = visible).

    Raises ValueError when a row is not a prefix ``[0, boundary)``: a boundary cannot express it,
    so such a mask must go through the dense path.
    """
    if mask_slice.numel() != q_len * kv_len:
        raise ValueError(
            f"packed mask slice has {mask_slice.numel()} entries, expected q_len*kv_len = "
            f"{q_len}*{kv_len}"
        )
    visible = mask_slice.reshape(q_len, kv_len) != 0
    boundaries = visible.sum(dim=1)
    prefix = torch.arange(kv_len, device=visible.device)[None, :] < boundaries[:, None]
    not_prefix = (prefix != visible).any(dim=1)
    if bool(not_prefix.any()):
        rows = not_prefix.nonzero().flatten()[:5].tolist()
        raise ValueError(
            f"packed cross-attention mask rows {rows} are not encoder prefixes; the frame-causal "
            "boundary path cannot represent them"
        )
    return boundaries.to(torch.int32)


@dataclass(frozen=True)
class Tile:
    """Rows ``[row_start, row_end)`` of the boundary-sorted order, attending to keys ``[0, key_len)``."""

    row_start: int
    row_end: int
    key_len: int
    needs_mask: bool


@dataclass(frozen=True)
class FrameCausalPlan:
    """How one request's rows are computed; depends on the boundaries only, so one plan serves
    every cross-attention layer of a forward pass.

    ``order`` sorts rows by boundary (stable); ``sorted_boundaries`` is ``boundaries[order]``
    (int64, on the query device); rows with boundary 0 are in no tile and stay zero.
    """

    order: torch.Tensor
    sorted_boundaries: torch.Tensor
    tiles: tuple[Tile, ...]


def _group_runs_into_tiles(
    run_boundaries: list[int], run_rows: list[int], row_overhead: float, masked_cost: float
) -> list[tuple[int, int]]:
    """Optimal split of the sorted runs into tiles ``[first_run, end_run)`` under the cost model.

    ``cost[j]`` is the cheapest way to compute runs ``[0, j)``; the last tile of that split
    covers runs ``[i, j)``: ``rows(i..j) + row_overhead`` rows over ``run_boundaries[j-1]`` keys,
    masked unless it is a single run. O(runs**2) arithmetic in ``runs`` vector steps.
    """
    num_runs = len(run_boundaries)
    rows_before = torch.tensor([0] + run_rows, dtype=torch.float64).cumsum(0)
    cost = torch.zeros(num_runs + 1, dtype=torch.float64)
    tile_start = [0] * (num_runs + 1)
    for end in range(1, num_runs + 1):
        tile_rows = rows_before[end] - rows_before[:end]
        mask_factor = torch.full((end,), masked_cost, dtype=torch.float64)
        mask_factor[end - 1] = 1.0
        candidates = cost[:end] + (tile_rows + row_overhead) * run_boundaries[end - 1] * mask_factor
        best = int(torch.argmin(candidates))
        cost[end] = candidates[best]
        tile_start[end] = best
    tiles = []
    end = num_runs
    while end > 0:
        tiles.append((tile_start[end], end))
        end = tile_start[end]
    return tiles[::-1]


def plan_frame_causal_tiles(
    boundaries: torch.Tensor,
    row_overhead: float = ROW_OVERHEAD,
    masked_cost: float = MASKED_COST,
) -> FrameCausalPlan:
    """Sort rows by boundary and group the runs of equal boundaries into SDPA tiles
    (cost model: see ``ROW_OVERHEAD`` / ``MASKED_COST``)."""
    boundaries = torch.as_tensor(boundaries).to(torch.int64)
    sorted_boundaries, order = torch.sort(boundaries, stable=True)
    run_values, run_lengths = torch.unique_consecutive(sorted_boundaries.cpu(), return_counts=True)
    run_values, run_lengths = run_values.tolist(), run_lengths.tolist()
    first_row = [0]
    for length in run_lengths:
        first_row.append(first_row[-1] + length)
    # Rows that see nothing form the leading run (boundaries are >= 0); they get no tile.
    first_visible_run = 1 if run_values and run_values[0] == 0 else 0
    visible_values = run_values[first_visible_run:]
    groups = _group_runs_into_tiles(
        visible_values, run_lengths[first_visible_run:], row_overhead, masked_cost
    )
    tiles = tuple(
        Tile(
            row_start=first_row[first_visible_run + first_run],
            row_end=first_row[first_visible_run + end_run],
            key_len=visible_values[end_run - 1],
            needs_mask=end_run - first_run > 1,
        )
        for first_run, end_run in groups
    )
    return FrameCausalPlan(order=order, sorted_boundaries=sorted_boundaries, tiles=tiles)


def _softcapped_tile_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
    logit_cap: float,
) -> torch.Tensor:
    """``softmax(cap * tanh(scale * q k^T / cap) | visible) v`` for one tile, in row chunks.

    SDPA has no softcap, so scores are materialised; the query heads are folded onto their KV
    head (``[kv_heads, group * rows, dim]``) so GQA needs no copy of K/V.
    """
    num_heads, rows, _ = q.shape
    kv_heads, key_len, _ = k.shape
    group = num_heads // kv_heads
    out = q.new_empty(num_heads, rows, v.shape[-1])
    chunk = max(1, _SOFTCAP_SCORE_ELEMENTS // (num_heads * key_len))
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        q_chunk = q[:, start:stop].reshape(kv_heads, group * (stop - start), -1)
        scores = torch.matmul(q_chunk, k.transpose(1, 2)).mul_(scale / logit_cap)
        scores = scores.tanh_().mul_(logit_cap)
        if visible is not None:
            scores = scores.view(kv_heads, group, stop - start, key_len)
            scores.masked_fill_(~visible[start:stop], float("-inf"))
            scores = scores.view(kv_heads, group * (stop - start), key_len)
        probs = torch.softmax(scores, dim=-1)
        out[:, start:stop] = torch.matmul(probs, v).view(num_heads, stop - start, -1)
    return out


def frame_causal_cross_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    boundaries: torch.Tensor,
    scale: float,
    logit_cap: float = 0.0,
    plan: FrameCausalPlan | None = None,
) -> torch.Tensor:
    """Cross-attention of ONE request where text row ``r`` sees encoder keys ``[0, boundaries[r])``.

    q ``[Hq, L, D]``; k ``[Hk, S, D]``; v ``[Hk, S, Dv]`` (Hq a multiple of Hk, GQA);
    boundaries ``[L]`` ints in ``[0, S]``, any order. Returns ``[Hq, L, Dv]``; rows with
    boundary 0 are zero. ``logit_cap > 0`` applies ``cap * tanh(scale * q k^T / cap)`` before the
    softmax. Pass ``plan`` (from :func:`plan_frame_causal_tiles` on the same boundaries) to
    reuse it across layers.
    """
    num_heads, q_len, _ = q.shape
    if boundaries.numel() != q_len:
        raise ValueError(f"{boundaries.numel()} boundaries for {q_len} query rows")
    if plan is None:
        plan = plan_frame_causal_tiles(boundaries)
    if plan.tiles and plan.tiles[-1].key_len > k.shape[1]:
        raise ValueError(f"boundary {plan.tiles[-1].key_len} beyond encoder length {k.shape[1]}")
    order = plan.order.to(q.device)
    sorted_boundaries = plan.sorted_boundaries.to(q.device)
    out = q.new_zeros(num_heads, q_len, v.shape[-1])
    enable_gqa = num_heads != k.shape[0]
    key_positions = torch.arange(k.shape[1], device=q.device)
    for tile in plan.tiles:
        rows = order[tile.row_start : tile.row_end]
        q_tile = q.index_select(1, rows)
        k_tile, v_tile = k[:, : tile.key_len], v[:, : tile.key_len]
        visible = None
        if tile.needs_mask:
            tile_boundaries = sorted_boundaries[tile.row_start : tile.row_end]
            visible = key_positions[None, : tile.key_len] < tile_boundaries[:, None]
        if logit_cap > 0:
            o_tile = _softcapped_tile_attention(q_tile, k_tile, v_tile, visible, scale, logit_cap)
        else:
            o_tile = scaled_dot_product_attention(
                q_tile, k_tile, v_tile, attn_mask=visible, scale=scale, enable_gqa=enable_gqa
            )
        out.index_copy_(1, rows, o_tile)
    return out
