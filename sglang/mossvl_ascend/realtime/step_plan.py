"""A realtime step's plan, as pure functions: the positions and frame visibility of the rows one step adds to its
session's sequence (the scheduler applies it: :mod:`.sessions`).

A step's rows are the token generated last, then the drained prompts and frames; a frame is one ``<|image_pad|>``
row whose vision tokens go to the encoder. MRoPE positions continue from the session's last one; every row sees the
frames whose pad is at or before it, from the first frame still in the frame window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def frame_block_positions(start: int, rows: int, cols: int) -> tuple[torch.Tensor, int]:
    """MOSS-VL's XRoPE block for a frame opened at position ``start`` on a ``rows x cols`` merged grid: its vision
    tokens at (start, start + y, start + x) row-major, then its separator and its ``<|image_pad|>`` text token at
    ``start + max(rows, cols)``; the next text token takes one more."""
    last = start + max(rows, cols)
    ys = torch.arange(rows).repeat_interleave(cols)
    xs = torch.arange(cols).repeat(rows)
    block = torch.stack((torch.full_like(ys, start), start + ys, start + xs))
    return torch.cat((block, torch.full((3, 1), last)), dim=1), last


def frame_ends_after(frame_ends: list[int], frame_lens: list[int]) -> list[int]:
    """Every frame's encoder end once frames of ``frame_lens`` vision tokens follow the frames ending at
    ``frame_ends`` (cumulative: a frame ends where the next one starts)."""
    ends = list(frame_ends)
    for length in frame_lens:
        ends.append((ends[-1] if ends else 0) + length)
    return ends


@dataclass
class StepPlan:
    """What one step adds: its rows (token ids), their positions and visible frames (the frames from
    ``first_frames`` to ``visible_frames``), its new vision tokens."""

    rows: list[int]
    positions: torch.Tensor  # int64 [3, rows]
    visible_frames: torch.Tensor  # int32 [rows]
    first_frames: torch.Tensor  # int32 [rows]
    window_start: int  # the first frame in the window after the step
    vision_positions: Optional[torch.Tensor]  # int64 [3, new vision tokens]
    frame_lens: list[int]  # vision tokens (separator included) of each new frame
    next_position: int


def plan_step(
    rows: list[int],
    grids: list[tuple[int, int]],
    image_token_id: int,
    start_position: int,
    frames_before: int,
    window_start: int = 0,
    window_starts: Optional[list[int]] = None,
) -> StepPlan:
    """Positions and visibility of a step's rows. ``grids``: merged (rows, cols) of each new frame, in the order of
    the ``<|image_pad|>`` tokens in ``rows``; a row sees every frame whose pad is at or before it, from the window's
    first frame (``window_start`` before the step, ``window_starts[j]`` from new frame j's pad on)."""
    if sum(token == image_token_id for token in rows) != len(grids):
        raise ValueError(f"{len(grids)} frames for a step with a different number of <|image_pad|> tokens")
    starts = list(window_starts) if window_starts is not None else [window_start] * len(grids)
    if len(starts) != len(grids) or any(
        not (earlier <= start <= frames_before + j)
        for j, (earlier, start) in enumerate(zip([window_start, *starts], starts))
    ):
        raise ValueError(
            f"window starts {starts} for {len(grids)} new frames after {frames_before} (window at {window_start}): "
            "each must keep its own frame and never move back"
        )
    positions, visible, first, vision, lens = [], [], [], [], []
    position, frames, pending, window = start_position, frames_before, iter(grids), iter(starts)
    for token in rows:
        if token == image_token_id:
            block, last = frame_block_positions(position, *next(pending))
            vision.append(block)
            lens.append(block.shape[1])
            positions.append(last)
            position, frames, window_start = last + 1, frames + 1, next(window)
        else:
            positions.append(position)
            position += 1
        visible.append(frames)
        first.append(window_start)
    return StepPlan(
        rows=list(rows),
        positions=torch.tensor(positions, dtype=torch.int64).expand(3, -1).clone(),
        visible_frames=torch.tensor(visible, dtype=torch.int32),
        first_frames=torch.tensor(first, dtype=torch.int32),
        window_start=window_start,
        vision_positions=torch.cat(vision, dim=1) if vision else None,
        frame_lens=lens,
        next_position=position,
    )
