"""Frame-causal cross-attention over per-row encoder boundaries, blocks merged by log-sum-exp (math layer).

MOSS-VL's cross-attention visibility is prefix-causal over frames: a text row sees the encoder prefix
``[0, boundary)``, boundary = end of the last frame it may see. One int32 per row is the only visibility format
off CUDA (the stock packed uint8 mask is converted once, at the edge).

Rows are sorted by boundary, so the visible region is a staircase, cut into *blocks* (rows x key range) by
halving the rows recursively: the upper half of the rows all see the keys up to the middle row's boundary, one
unmasked rectangle; each half's remaining staircase is cut the same way, down to small leaves that carry a mask
of their own size. Each block is one call of the device primitive
(:func:`mossvl_ascend.attention.primitives.attention_with_lse`), which returns the block's output and each
row's log-sum-exp; a row's blocks are merged in fp32 with weights ``exp(lse_block - lse_row)``. Exact in every
dtype (each block is rounded once, like a single attention), no extra head dim, no overflow window; softcapped
logits go through the same merge (the primitive computes those blocks in plain torch).

Pure torch, no sglang imports. Tensor conventions: one request's query ``[num_heads, q_len, head_dim]``,
key/value ``[num_kv_heads, kv_len, head_dim | v_head_dim]``.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import torch

from mossvl_ascend.attention.primitives import accumulate_by_lse, attention_with_lse

# A staircase of at most this many rows is one masked leaf instead of being halved further:
# below it an attention call is too small to run near peak and the mask costs less than more calls.
# Chosen with benchmarks/bench_cross_attention.py on the 2-core CPU; any value is exact.
LEAF_ROWS = 192

# At or above this visible share of its bounding box, a request is one masked block: the merge's
# fixed costs would outweigh the few keys it skips.
DENSE_VISIBLE_FRACTION = 0.9


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


def encoder_boundaries_from_packed_mask(mask_slice: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """Per-row boundaries of one request's slice of a stock packed mask (uint8, 1 = visible).

    Raises ValueError when a row is not a prefix ``[0, boundary)``: no MOSS-VL producer makes such a mask, and
    a boundary cannot express it.
    """
    if mask_slice.numel() != q_len * kv_len:
        raise ValueError(
            f"packed mask slice has {mask_slice.numel()} entries, expected q_len*kv_len = {q_len}*{kv_len}"
        )
    visible = mask_slice.reshape(q_len, kv_len) != 0
    boundaries = visible.sum(dim=1)
    prefix = torch.arange(kv_len, device=visible.device)[None, :] < boundaries[:, None]
    not_prefix = (prefix != visible).any(dim=1)
    if bool(not_prefix.any()):
        rows = not_prefix.nonzero().flatten()[:5].tolist()
        raise ValueError(
            f"packed cross-attention mask rows {rows} are not encoder prefixes [0, boundary): MOSS-VL "
            "visibility is prefix-causal over frames and the attention core accepts only that"
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
    ``largest_boundary`` is the last sorted boundary as a host int (layers check it without a device read).
    """

    order: torch.Tensor | None
    sorted_boundaries: torch.Tensor
    blocks: tuple[Block, ...]
    largest_boundary: int = 0

    @property
    def uniform_boundary(self) -> int | None:
        """The boundary every row sees when they all see the same one (0: no row sees a frame), else None; from
        the host-side blocks, no device read."""
        if not self.blocks:
            return 0
        first = self.blocks[0]
        if len(self.blocks) == 1 and not first.masked and first.row_start == 0:
            return first.key_end
        return None


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
    return FrameCausalPlan(order, sorted_boundaries, tuple(blocks), largest)


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

    q ``[Hq, L, D]``; k ``[Hk, S, D]``; v ``[Hk, S, Dv]`` (Hq a multiple of Hk, GQA); boundaries ``[L]`` ints
    in ``[0, S]``, any order. Returns ``[Hq, L, Dv]`` in q's dtype; rows with boundary 0 are zero.
    ``logit_cap > 0`` applies ``cap * tanh(scale * q k^T / cap)`` before the softmax. Pass ``plan`` (from
    :func:`plan_frame_causal_blocks` on the same boundaries) to reuse it across layers.
    """
    num_heads, q_len, _ = q.shape
    if boundaries.numel() != q_len:
        raise ValueError(f"{boundaries.numel()} boundaries for {q_len} query rows")
    if plan is None:
        plan = plan_frame_causal_blocks(boundaries)
    if plan.largest_boundary > k.shape[1]:
        raise ValueError(f"boundary {plan.largest_boundary} beyond encoder length {k.shape[1]}")
    order = None if plan.order is None else plan.order.to(q.device)
    q_sorted = q if order is None else q.index_select(1, order)
    sorted_boundaries = plan.sorted_boundaries.to(q.device)
    if len(plan.blocks) == 1:
        out_sorted = _single_block(q_sorted, k, v, sorted_boundaries, plan.blocks[0], scale, logit_cap)
    else:
        out_sorted = _lse_merged_blocks(q_sorted, k, v, sorted_boundaries, plan.blocks, scale, logit_cap)
    if order is None:
        return out_sorted
    return torch.empty_like(out_sorted).index_copy_(1, order, out_sorted)


def _block_attention(q, k, v, sorted_boundaries, block: Block, scale: float, logit_cap: float):
    """One block through the device primitive: (out ``[Hq, rows, Dv]``, lse fp32 ``[Hq, rows]``)."""
    rows = slice(block.row_start, block.row_end)
    visible = None
    if block.masked:
        keys = torch.arange(block.key_start, block.key_end, device=q.device)
        visible = (keys[None, :] < sorted_boundaries[rows, None])[None, None]
    out, lse = attention_with_lse(
        q[None, :, rows],
        k[None, :, block.key_start : block.key_end],
        v[None, :, block.key_start : block.key_end],
        scale,
        visible=visible,
        logit_cap=logit_cap,
    )
    return out[0], lse[0]


def _single_block(q, k, v, sorted_boundaries, block: Block, scale: float, logit_cap: float) -> torch.Tensor:
    """One block covers every visible pair (an image, one run, a short prompt): no merge."""
    block_out, _ = _block_attention(q, k, v, sorted_boundaries, block, scale, logit_cap)
    if block.row_start == 0:
        return block_out
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    out[:, block.row_start : block.row_end] = block_out
    return out


def _lse_merged_blocks(q, k, v, sorted_boundaries, blocks, scale: float, logit_cap: float) -> torch.Tensor:
    """Every block through the primitive; each row's blocks merged in fp32 by ``exp(lse_block - lse_row)``.

    Running form: the accumulator holds the merge of the blocks seen so far, normalised to their combined
    log-sum-exp; a new block rescales it in place. A block whose rows no earlier block covered is written as it
    is (a row's first block: about half the merge work at 256 frames). Rows in no block (boundary 0) keep lse
    -inf and output 0.
    """
    num_heads, rows, _ = q.shape
    acc = torch.zeros(num_heads, rows, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((num_heads, rows), float("-inf"), device=q.device)
    covered = bytearray(rows)  # host-side: rows some earlier block has written
    for block in blocks:
        rows_slice = slice(block.row_start, block.row_end)
        block_out, block_lse = _block_attention(q, k, v, sorted_boundaries, block, scale, logit_cap)
        if not any(covered[rows_slice]):
            acc[:, rows_slice] = block_out
            lse[:, rows_slice] = block_lse
            covered[rows_slice] = b"\x01" * (block.row_end - block.row_start)
            continue
        accumulate_by_lse(acc[:, rows_slice], lse[:, rows_slice], block_out, block_lse)
    return acc.to(q.dtype)
