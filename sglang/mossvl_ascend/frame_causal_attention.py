"""Frame-causal cross-attention from one int per text row, without a dense mask (issue 7).

MOSS-VL's cross-attention visibility is prefix-causal over frames: a text row sees the encoder
prefix ``[0, boundary)`` where ``boundary`` is the end of the last frame it may see. Stock sglang
describes it with a packed ``[extend_seq_len x encoder_len]`` uint8 mask per request (1 =
visible); for a long video that is tens to hundreds of MB, and a dense masked SDPA still spends
its FLOPs on the frames that are masked out.

Here visibility is an int32 boundary per row. Rows are sorted by boundary, so the visible region
is a staircase, and it is cut into *blocks* (rows x key range), halving the rows recursively: the
upper half of the rows all see the keys up to the middle row's boundary, which is one unmasked
rectangle; each half's remaining staircase is cut the same way, down to small leaves that carry a
mask of their own size. Every rectangle is one SDPA call with many rows and no mask, so almost all
the work runs at unmasked-SDPA speed on visible keys only.

A row's blocks are merged exactly with log-sum-exp weights, obtained from stock SDPA by *sink*
keys: a sink has logit ``c`` for row ``r`` (an extra query column holding ``c / scale`` against a
key that is 1 in that column and 0 elsewhere) and a value that is 1 in an extra value column. A
block holding ``n`` sinks returns ``w = n e^c / (Z + n e^c)`` in that column, ``Z`` being its
softmax normaliser over real keys, so ``Z / e^c = n / w - n`` and its unnormalised output is
``out * n / w``; summing those over a row's blocks and dividing gives exact attention. ``c`` is
the row's largest logit over its first keys less a margin, so ``e^c`` is well below the row's
total ``Z`` (no cancellation); a row whose logits exceed ``c`` by more than fp32's exp range
(about 88) would overflow the weights, and is detected (non-finite) and recomputed densely.
Long rows with few distinct boundaries, e.g. one image, need none of this: one plain SDPA block.

Pure torch, no sglang imports: the same code runs on CPU and, through plain torch ops
(``scaled_dot_product_attention``, ``matmul``, ``softmax``), on an Ascend NPU.
Tensor conventions: a request's query ``[num_heads, q_len, head_dim]``, key/value
``[num_kv_heads, kv_len, head_dim | v_head_dim]``; torch SDPA bool masks are True = attend.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention

# A staircase of at most this many rows is one masked leaf instead of being halved further:
# below it an SDPA call is too small to run near peak and the mask costs less than more calls.
# Chosen with benchmarks/bench_cross_attention.py on the 2-core CPU; any value is exact.
LEAF_ROWS = 192

# At or above this visible share of its bounding box, a request is one masked SDPA block: the
# merge's fixed costs (sink keys, wider K/V copies) would outweigh the few keys it skips.
DENSE_VISIBLE_FRACTION = 0.9

# The sink logit is the row's largest logit over its first visible keys (up to this many), less
# a margin so that even a block holding many sinks leaves most of the weight to real keys.
_SINK_PROBE_KEYS = 64
_SINK_MARGIN = 10.0

# The dense path materialises scores; bound one chunk to this many elements (64 MiB in fp32).
_DENSE_SCORE_ELEMENTS = 1 << 24


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
class Block:
    """Rows ``[row_start, row_end)`` of the boundary-sorted order against keys ``[key_start, key_end)``.

    Unmasked blocks are seen whole by every row; masked ones (leaves) need ``key < boundary``.
    """

    row_start: int
    row_end: int
    key_start: int
    key_end: int
    masked: bool


@dataclass(frozen=True)
class FrameCausalPlan:
    """How one request's rows are computed; depends on the boundaries only, so one plan serves
    every cross-attention layer of a forward pass.

    ``order`` sorts rows by boundary (stable), None when they already are (the usual prompt, no
    gather needed); ``sorted_boundaries`` is ``boundaries[order]`` (int64); rows with boundary 0
    are in no block and stay zero. The blocks cover every visible (row, key) pair exactly once.
    """

    order: torch.Tensor | None
    sorted_boundaries: torch.Tensor
    blocks: tuple[Block, ...]


def _cover_staircase(
    boundaries: list[int], row_start: int, row_end: int, key_start: int, leaf_rows: int, blocks: list
) -> None:
    """Append blocks covering ``{(r, k): key_start <= k < boundaries[r]}`` for sorted rows."""
    while row_start < row_end and boundaries[row_start] <= key_start:
        row_start += 1  # these rows see nothing beyond key_start
    if row_start == row_end:
        return
    if boundaries[row_start] == boundaries[row_end - 1]:
        blocks.append(Block(row_start, row_end, key_start, boundaries[row_start], masked=False))
        return
    if row_end - row_start <= leaf_rows:
        blocks.append(Block(row_start, row_end, key_start, boundaries[row_end - 1], masked=True))
        return
    middle = (row_start + row_end) // 2
    if boundaries[middle] > key_start:
        blocks.append(Block(middle, row_end, key_start, boundaries[middle], masked=False))
    _cover_staircase(boundaries, row_start, middle, key_start, leaf_rows, blocks)
    _cover_staircase(boundaries, middle, row_end, boundaries[middle], leaf_rows, blocks)


def plan_frame_causal_blocks(boundaries: torch.Tensor, leaf_rows: int = LEAF_ROWS) -> FrameCausalPlan:
    """Sort rows by boundary and cut the visible staircase into SDPA blocks (see module doc).

    When nearly the whole bounding box is visible (``DENSE_VISIBLE_FRACTION``), one masked block
    is cheaper than merging several.
    """
    boundaries = torch.as_tensor(boundaries).to(torch.int64)
    sorted_boundaries, order = torch.sort(boundaries, stable=True)
    if torch.equal(sorted_boundaries, boundaries):
        order = None
    sorted_list = sorted_boundaries.tolist()
    first_seen = bisect_right(sorted_list, 0)
    rows, largest = len(sorted_list) - first_seen, (sorted_list[-1] if sorted_list else 0)
    blocks: list[Block] = []
    if rows and sum(sorted_list[first_seen:]) >= DENSE_VISIBLE_FRACTION * rows * largest:
        masked = sorted_list[first_seen] != largest
        blocks.append(Block(first_seen, len(sorted_list), 0, largest, masked=masked))
    else:
        _cover_staircase(sorted_list, first_seen, len(sorted_list), 0, max(1, leaf_rows), blocks)
    return FrameCausalPlan(order=order, sorted_boundaries=sorted_boundaries, blocks=tuple(blocks))


def _dense_rows_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    boundaries: torch.Tensor,
    scale: float,
    logit_cap: float,
) -> torch.Tensor:
    """Explicitly masked attention of rows ``q [Hq, R, D]`` over keys ``[0, boundaries[r])``.

    The softcap path (SDPA has no softcap) and the fallback for rows whose merge weights left
    fp32's range. Scores are materialised in row chunks; the query heads are folded onto their KV
    head (``[kv_heads, group * rows, dim]``) so GQA needs no copy of K/V. Rows with boundary 0
    are zero.
    """
    num_heads, rows, _ = q.shape
    kv_heads = k.shape[0]
    group = num_heads // kv_heads
    out = q.new_zeros(num_heads, rows, v.shape[-1])
    key_len = int(boundaries.max()) if rows else 0
    if key_len == 0:
        return out
    k, v = k[:, :key_len], v[:, :key_len]
    key_positions = torch.arange(key_len, device=q.device)
    chunk = max(1, _DENSE_SCORE_ELEMENTS // (num_heads * key_len))
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        q_chunk = q[:, start:stop].reshape(kv_heads, group * (stop - start), -1)
        scores = torch.matmul(q_chunk, k.transpose(1, 2)).mul_(scale)
        if logit_cap > 0:
            scores = scores.div_(logit_cap).tanh_().mul_(logit_cap)
        visible = key_positions[None, :] < boundaries[start:stop, None]
        scores = scores.view(kv_heads, group, stop - start, key_len).masked_fill_(~visible, float("-inf"))
        probs = torch.softmax(scores.view(kv_heads, group * (stop - start), key_len), dim=-1)
        chunk_out = torch.matmul(probs, v).view(num_heads, stop - start, -1)
        out[:, start:stop] = torch.where(visible.any(dim=1)[None, :, None], chunk_out, 0.0)
    return out


def _grouped_by_kv_head(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[Hq, L, d] -> [Hk, L, group, d]`` (query head ``h`` serves KV head ``h // group``), so
    that any row range ``[:, a:b]`` views as ``[Hk, (b - a) * group, d]``: GQA as one SDPA per KV
    head with more rows and no copy of K/V."""
    num_heads, rows, dim = x.shape
    return x.view(kv_heads, num_heads // kv_heads, rows, dim).transpose(1, 2)


def _sink_logits(
    q_grouped: torch.Tensor, k: torch.Tensor, boundaries: torch.Tensor, scale: float
) -> torch.Tensor:
    """``[Hk, L, group]``: each row's largest logit over its first visible keys, a lower bound of
    its log-sum-exp. ``-inf`` if it sees none."""
    kv_heads, rows, group, dim = q_grouped.shape
    probe = min(k.shape[1], _SINK_PROBE_KEYS)
    logits = torch.matmul(q_grouped.reshape(kv_heads, rows * group, dim), k[:, :probe].transpose(1, 2))
    logits = logits.view(kv_heads, rows, group, probe) * scale
    visible = torch.arange(probe, device=k.device)[None, :] < boundaries[:, None]
    return logits.masked_fill(~visible[None, :, None, :], float("-inf")).amax(dim=-1)


def _with_sinks(x: torch.Tensor, key_positions: torch.Tensor, sink_positions: torch.Tensor) -> torch.Tensor:
    """``x [H, S, d]`` laid out as ``[H, S + m, d + 1]``: key ``j`` at ``key_positions[j]`` with 0
    in the extra column, a sink (1 in the extra column, 0 elsewhere) at each ``sink_positions``."""
    heads, _, dim = x.shape
    out = x.new_zeros(heads, key_positions.numel() + sink_positions.numel(), dim + 1)
    out[:, key_positions, :dim] = x
    out[:, sink_positions, dim] = 1.0
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
    softmax (dense path: SDPA has no softcap). Pass ``plan`` (from :func:`plan_frame_causal_blocks`
    on the same boundaries) to reuse it across layers.
    """
    num_heads, q_len, _ = q.shape
    if boundaries.numel() != q_len:
        raise ValueError(f"{boundaries.numel()} boundaries for {q_len} query rows")
    if plan is None:
        plan = plan_frame_causal_blocks(boundaries)
    if q_len and int(plan.sorted_boundaries[-1]) > k.shape[1]:
        raise ValueError(f"boundary {int(plan.sorted_boundaries[-1])} beyond encoder length {k.shape[1]}")
    sorted_boundaries = plan.sorted_boundaries.to(q.device)
    order = None if plan.order is None else plan.order.to(q.device)
    q_sorted = q if order is None else q.index_select(1, order)
    if logit_cap > 0:
        out_sorted = _dense_rows_attention(q_sorted, k, v, sorted_boundaries, scale, logit_cap)
    elif len(plan.blocks) == 1:
        out_sorted = _single_block_attention(q_sorted, k, v, sorted_boundaries, plan.blocks[0], scale)
    else:
        out_sorted = _merged_blocks_attention(q_sorted, k, v, sorted_boundaries, plan.blocks, scale)
    if order is None:
        return out_sorted
    return torch.empty_like(out_sorted).index_copy_(1, order, out_sorted)


def _single_block_attention(q, k, v, sorted_boundaries, block: Block, scale: float) -> torch.Tensor:
    """One block covers every visible pair (an image, one run, a short prompt): plain SDPA."""
    rows = slice(block.row_start, block.row_end)
    visible = None
    if block.masked:
        visible = torch.arange(block.key_end, device=q.device)[None, :] < sorted_boundaries[rows, None]
    block_out = scaled_dot_product_attention(
        q[:, rows],
        k[:, : block.key_end],
        v[:, : block.key_end],
        attn_mask=visible,
        scale=scale,
        enable_gqa=q.shape[0] != k.shape[0],
    )
    if block.row_start == 0:
        return block_out
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    out[:, rows] = block_out
    return out


def _merged_blocks_attention(q, k, v, sorted_boundaries, blocks, scale: float) -> torch.Tensor:
    """Every block through SDPA with sink keys; blocks merged by their log-sum-exp weights.

    K and V are laid out once with a sink in front of every key where some block starts, so each
    block is a view ``[its first sink, its last key]``; the ``n`` sinks inside a block all have
    logit ``c`` and their extra value column sums to ``w = n e^c / (Z + n e^c)``.
    """
    num_heads, rows, _ = q.shape
    kv_heads, key_len, v_dim = k.shape[0], k.shape[1], v.shape[-1]
    group = num_heads // kv_heads
    q_grouped = _grouped_by_kv_head(q, kv_heads)
    sink = _sink_logits(q_grouped, k, sorted_boundaries, scale) - _SINK_MARGIN
    # Rows that see nothing are in no block; any finite sink keeps their arithmetic quiet.
    sink = torch.where(torch.isfinite(sink), sink, 0.0)
    q_with_sink = torch.cat([q_grouped, (sink / scale).unsqueeze(-1).to(q.dtype)], dim=-1)

    starts = sorted({block.key_start for block in blocks})
    starts_tensor = torch.tensor(starts, dtype=torch.int64, device=q.device)
    keys = torch.arange(key_len, device=q.device)
    key_positions = keys + torch.searchsorted(starts_tensor, keys, right=True)
    sink_positions = starts_tensor + torch.arange(len(starts), device=q.device)
    k_with_sinks = _with_sinks(k, key_positions, sink_positions)
    v_with_sinks = _with_sinks(v, key_positions, sink_positions)
    key_at_position = torch.full((key_len + len(starts),), -1, dtype=torch.int64, device=q.device)
    key_at_position[key_positions] = keys  # sinks stay -1: below every boundary, always visible

    numerator = q.new_zeros(kv_heads, rows, group, v_dim, dtype=torch.float32)
    weight = q.new_zeros(kv_heads, rows, group, dtype=torch.float32)
    for block in blocks:
        row_range = slice(block.row_start, block.row_end)
        block_rows = block.row_end - block.row_start
        first_sink = bisect_left(starts, block.key_start)
        sinks = bisect_left(starts, block.key_end) - first_sink
        positions = slice(block.key_start + first_sink, block.key_end + first_sink + sinks)
        visible = None
        if block.masked:
            visible = key_at_position[None, positions] < sorted_boundaries[row_range, None]
            visible = visible[:, None, :].expand(-1, group, -1).reshape(block_rows * group, -1)
        out = scaled_dot_product_attention(
            q_with_sink[:, row_range].reshape(kv_heads, block_rows * group, -1),
            k_with_sinks[:, positions],
            v_with_sinks[:, positions],
            attn_mask=visible,
            scale=scale,
        ).view(kv_heads, block_rows, group, v_dim + 1).float()
        # In units of e^c: the block's output times Z is out * n / w, and Z is n / w - n.
        sinks_over_share = out[..., v_dim:].reciprocal().mul_(sinks)
        numerator[:, row_range].addcmul_(out[..., :v_dim], sinks_over_share)
        weight[:, row_range].add_(sinks_over_share.squeeze(-1)).sub_(sinks)
    # A seen row's weight is >= e^margin (the sink logit is below its log-sum-exp); unseen rows are 0/0.
    seen = sorted_boundaries > 0
    result = torch.where(seen[None, :, None, None], numerator / weight.unsqueeze(-1), 0.0)
    result = result.transpose(1, 2).reshape(num_heads, rows, v_dim).to(q.dtype)
    out_of_range = (~torch.isfinite(weight)).any(dim=2).any(dim=0) & seen
    if bool(out_of_range.any()):
        rows_to_redo = out_of_range.nonzero().flatten()
        result[:, rows_to_redo] = _dense_rows_attention(
            q[:, rows_to_redo], k, v, sorted_boundaries[rows_to_redo], scale, 0.0
        )
    return result
