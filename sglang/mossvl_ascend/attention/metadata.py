"""Per-forward attention metadata of a MOSS-VL batch, built once and read by every layer (batch layer).

One :class:`ForwardAttentionMetadata` per forward pass holds, per request, the lengths the attention needs (new
text rows, cached text prefix, encoder tokens), the cross-attention visibility as per-row encoder boundaries
with its block plan, and — built on first use, then cached for the remaining layers — padded KV-pool slot
tables and padded query positions for the batched attention of :mod:`mossvl_ascend.attention.core`.

Decode is an extend of one row whose text prefix is ``seq_len - 1`` tokens and that sees every frame; a mixed
batch (decode rows appended as one-row extends with ``prefix_len = seq_len - 1``) is an extend like any other.

KV layout (``ScheduleBatch.prepare_encoder_info_extend``): a request's slots are
``req_to_token[req, :encoder_len]`` for its vision encoder tokens followed by its text tokens; sglang's
``seq_lens`` / ``extend_prefix_lens`` / ``extend_seq_lens`` count text tokens only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from mossvl_ascend import side_channel
from mossvl_ascend.attention.blocks import (
    FrameCausalPlan,
    encoder_boundaries_from_packed_mask,
    encoder_boundaries_from_visible_frames,
    frame_ends_from_grid_thw,
    plan_frame_causal_blocks,
)


def visible_frames_of_rows(visible_frame_counts: torch.Tensor, text_offset: int, q_len: int) -> torch.Tensor:
    """Visible-frame count of text rows ``[text_offset, text_offset + q_len)`` of one request.

    Rows past the end of ``visible_frame_counts`` see its last entry: generated tokens (decode rows of a mixed
    batch, a retracted request's outputs prefilled again) inherit the last prompt row's visibility, as HF copies
    the previous row's ``cross_attention_mask`` to each new token; a tensor stock shrank to its last element
    therefore means "every row sees that many frames".
    """
    rows = torch.arange(text_offset, text_offset + q_len, device=visible_frame_counts.device)
    return visible_frame_counts[rows.clamp_(max=visible_frame_counts.numel() - 1)]


def request_row_boundaries(mm_input, text_offset: int, q_len: int, encoder_len: int, spatial_merge_size: int, device):
    """Boundaries (int32 ``[q_len]``) of one request's new rows, text rows ``[text_offset, text_offset + q_len)``.

    ``mm_input.visible_frame_counts`` (per text token, how many frames it sees) and the first item's
    ``grid_thw`` give the frame ends; a request without them sees every frame (stock's rule). A realtime step
    carries every frame's end so far (``side_channel.FRAME_ENDS``): its item holds only the new frames.
    """
    counts = getattr(mm_input, "visible_frame_counts", None) if mm_input is not None else None
    frame_ends = side_channel.FRAME_ENDS.get(mm_input)
    if frame_ends is None:
        item = mm_input.mm_items[0] if mm_input is not None and mm_input.mm_items else None
        grid_thw = getattr(item, "grid_thw", None) if item is not None else None
        if grid_thw is not None:
            frame_ends = frame_ends_from_grid_thw(grid_thw, spatial_merge_size)
    if counts is None or frame_ends is None:
        return torch.full((q_len,), encoder_len, dtype=torch.int32, device=device)
    rows = visible_frames_of_rows(counts, text_offset, q_len).to(device)
    return encoder_boundaries_from_visible_frames(rows, frame_ends, encoder_len)


def request_row_lower_bounds(mm_input, text_offset: int, q_len: int, device) -> torch.Tensor | None:
    """Where each new row of a windowed realtime step starts seeing keys (int32 ``[q_len]``): the start of the
    first frame in its window, which is the end of the frames before it. None without a window."""
    starts = side_channel.WINDOW_STARTS.get(mm_input)
    frame_ends = side_channel.FRAME_ENDS.get(mm_input)
    if starts is None or frame_ends is None or not q_len:
        return None
    first_frames = visible_frames_of_rows(starts, text_offset, q_len).to(device)
    return encoder_boundaries_from_visible_frames(first_frames, frame_ends.clamp(min=0))


@dataclass
class ForwardAttentionMetadata:
    """What every attention layer of one forward needs, per request in batch order.

    ``cross_boundaries[i]`` is None when request i's new rows see every frame (decode, no visibility data,
    no encoder, no new rows), else int32 ``[extend_lens[i]]``: row r sees encoder keys ``[0, boundary_r)``.
    ``plans[i]`` is its block plan (None exactly when the boundaries are). ``cross_lower[i]`` (a realtime step
    with a frame window) is None or int32 ``[extend_lens[i]]``: row r sees keys ``[lower_r, boundary_r)``.
    """

    extend_lens: list[int]
    prefix_lens: list[int]
    encoder_lens: list[int]
    cross_boundaries: list[torch.Tensor | None]
    plans: list[FrameCausalPlan | None]
    device: torch.device
    # A request whose encoder row is not the pool's default (a realtime session's, growing in whole pages):
    # its encoder slots and whether its vision tokens are slot-major (``kv_layout.slot_major_vision_addresses``).
    # None (for the batch or one request): ``addressing.row_len(encoder_len)`` slots, band-major.
    encoder_rows: list[int | None] | None = None
    slot_major: list[bool] | None = None
    cross_lower: list[torch.Tensor | None] | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, extend_lens, prefix_lens, encoder_lens, cross_boundaries=None, device="cpu"):
        """Metadata from per-request lengths and boundaries (None: every row sees every frame)."""
        extend_lens, prefix_lens, encoder_lens = list(extend_lens), list(prefix_lens), list(encoder_lens)
        if cross_boundaries is None:
            cross_boundaries = [None] * len(extend_lens)
        cross_boundaries = [
            None if b is None or not (q and e) or _sees_everything(b, e) else b
            for b, q, e in zip(cross_boundaries, extend_lens, encoder_lens)
        ]
        plans = [None if b is None else plan_frame_causal_blocks(b) for b in cross_boundaries]
        return cls(extend_lens, prefix_lens, encoder_lens, cross_boundaries, plans, torch.device(device))

    @classmethod
    def for_decode(cls, seq_lens: list[int], encoder_lens: list[int], device):
        """Decode: one new row per request after ``seq_len - 1`` cached text tokens, every frame visible."""
        return cls.build([1] * len(seq_lens), [s - 1 for s in seq_lens], encoder_lens, device=device)

    @classmethod
    def from_packed_mask(cls, extend_lens, prefix_lens, encoder_lens, packed_mask, device):
        """From the stock packed mask (uint8, 1 = visible, row-major ``extend_len x encoder_len`` per request
        with encoder tokens and new rows, batch order), converted to boundaries once; None = all visible.

        A size that disagrees with the batch raises ValueError naming the request and its lengths; a row that
        is not an encoder prefix raises ValueError (no MOSS-VL producer makes one).
        """
        if packed_mask is None:
            return cls.build(extend_lens, prefix_lens, encoder_lens, device=device)
        boundaries, offset = [], 0
        for req_idx, (extend_len, encoder_len) in enumerate(zip(extend_lens, encoder_lens)):
            if not (extend_len and encoder_len):
                boundaries.append(None)
                continue
            size = extend_len * encoder_len
            if offset + size > packed_mask.numel():
                raise ValueError(
                    f"cross_attention_custom_mask too short at request {req_idx}: needs extend_seq_len {extend_len} "
                    f"x encoder_len {encoder_len} = {size} entries at offset {offset}, it has {packed_mask.numel()}"
                )
            chunk = packed_mask[offset : offset + size]
            boundaries.append(encoder_boundaries_from_packed_mask(chunk, extend_len, encoder_len).to(device))
            offset += size
        if offset != packed_mask.numel():
            raise ValueError(
                f"cross_attention_custom_mask has {packed_mask.numel()} entries but the batch's extend_seq_len x "
                f"encoder_len products sum to {offset} (extend_seq_lens {list(extend_lens)}, encoder_lens "
                f"{list(encoder_lens)})"
            )
        return cls.build(extend_lens, prefix_lens, encoder_lens, boundaries, device)

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @functools.cached_property
    def seq_lens(self) -> list[int]:
        """Text tokens per request after this forward (cached prefix + new rows); computed once per forward."""
        return [p + q for p, q in zip(self.prefix_lens, self.extend_lens)]

    @functools.cached_property
    def uniform_boundaries(self) -> list[int | None]:
        """Per request, a host int: the encoder prefix all its new rows see (0: none sees a frame; the encoder
        length: every frame), or None when its rows see different ones. From the plans: no device read."""
        return [
            encoder_len if plan is None else plan.uniform_boundary
            for plan, encoder_len in zip(self.plans, self.encoder_lens)
        ]

    def encoder_row_lens(self, addressing) -> list[int]:
        """Encoder slots in front of each request's text."""
        explicit = self.encoder_rows or [None] * self.batch_size
        return [
            addressing.row_len(encoder_len) if rows is None else rows
            for rows, encoder_len in zip(explicit, self.encoder_lens)
        ]

    def is_slot_major(self, index: int) -> bool:
        return bool(self.slot_major and self.slot_major[index])

    def with_encoder_rows(self, encoder_rows, slot_major) -> "ForwardAttentionMetadata":
        self.encoder_rows, self.slot_major = list(encoder_rows), list(slot_major)
        return self

    def with_lower_bounds(self, lowers) -> "ForwardAttentionMetadata":
        """Per request, where its rows start seeing keys (None, or all zero: the encoder's start)."""
        lowers = [None if b is None or not bool(b.any()) else b for b in lowers]
        self.cross_lower = lowers if any(b is not None for b in lowers) else None
        return self

    def has_lower(self, index: int) -> bool:
        return self.cross_lower is not None and self.cross_lower[index] is not None

    def cached(self, key, build):
        """``build()`` once per forward under ``key``; every later layer gets the same object."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def request(self, index: int) -> "ForwardAttentionMetadata":
        """The metadata of one request as a batch of one (the per-request loop the benchmark compares with)."""
        return ForwardAttentionMetadata(
            [self.extend_lens[index]],
            [self.prefix_lens[index]],
            [self.encoder_lens[index]],
            [self.cross_boundaries[index]],
            [self.plans[index]],
            self.device,
            None if self.encoder_rows is None else [self.encoder_rows[index]],
            None if self.slot_major is None else [self.slot_major[index]],
            None if self.cross_lower is None else [self.cross_lower[index]],
        )


def _sees_everything(boundaries: torch.Tensor, encoder_len: int) -> bool:
    return bool((boundaries == encoder_len).all())


def attach(forward_batch, metadata: ForwardAttentionMetadata) -> None:
    """Leave ``metadata`` on sglang's ForwardBatch for every layer of this forward."""
    side_channel.ATTENTION_METADATA.set(forward_batch, metadata)


def attached(forward_batch) -> ForwardAttentionMetadata | None:
    """The metadata the prepare_forward_batch hook (or the first layer) left on this ForwardBatch, if any."""
    return side_channel.ATTENTION_METADATA.get(forward_batch)


def metadata_of_forward_batch(forward_batch) -> ForwardAttentionMetadata:
    """This forward's metadata: the attached one, else built from the batch (stock packed mask when a producer
    set one) and attached, so the first layer builds it and every later layer reuses it."""
    metadata = attached(forward_batch)
    if metadata is None:
        if forward_batch.forward_mode.is_decode():
            metadata = decode_metadata(forward_batch)
        else:
            metadata = ForwardAttentionMetadata.from_packed_mask(
                list(forward_batch.extend_seq_lens_cpu),
                list(forward_batch.extend_prefix_lens_cpu),
                _encoder_lens_list(forward_batch),
                forward_batch.cross_attention_custom_mask,
                forward_batch.seq_lens.device,
            )
            metadata = _with_realtime_rows(metadata, forward_batch)
        attach(forward_batch, metadata)
    return metadata


def decode_metadata(forward_batch) -> ForwardAttentionMetadata:
    """A decode forward's metadata: one row per request, every frame visible (a realtime row: its encoder row and
    frame window)."""
    metadata = ForwardAttentionMetadata.for_decode(
        _seq_lens_list(forward_batch), _encoder_lens_list(forward_batch), forward_batch.seq_lens.device
    )
    return _with_realtime_rows(metadata, forward_batch)


def decode_row_gate(forward_batch) -> list[bool]:
    """Per decode row, whether it keeps its cross-attention residual: it has vision tokens and the last prompt row
    it inherits saw at least one frame (a request without visible-frame counts sees every frame)."""
    gate = []
    for i, encoder_len in enumerate(_encoder_lens_list(forward_batch)):
        counts = visible_frame_counts_of(forward_batch, i)
        gate.append(bool(encoder_len) and (counts is None or bool(counts[-1] > 0)))
    return gate


def visible_frame_counts_of(forward_batch, i: int):
    """Request ``i``'s per-row visible-frame counts, or None when it has no multimodal input or no counts."""
    mm_input = forward_batch.mm_inputs[i] if forward_batch.mm_inputs else None
    return getattr(mm_input, "visible_frame_counts", None) if mm_input is not None else None


def _with_realtime_rows(metadata: ForwardAttentionMetadata, forward_batch) -> ForwardAttentionMetadata:
    """The realtime steps' encoder rows (read from the forward's multimodal inputs, which every forward carries;
    such a request's vision tokens are slot-major) and, with a frame window, where their rows start seeing keys."""
    mm_inputs = forward_batch.mm_inputs or []
    rows = [side_channel.ENCODER_ROWS.get(mm) for mm in mm_inputs]
    if not any(r is not None for r in rows):
        return metadata
    metadata.with_encoder_rows(rows, [r is not None for r in rows])
    if any(side_channel.WINDOW_STARTS.get(mm) is not None for mm in mm_inputs):
        lowers = [
            request_row_lower_bounds(mm, prefix, q_len, metadata.device)
            for mm, prefix, q_len in zip(mm_inputs, metadata.prefix_lens, metadata.extend_lens)
        ]
        metadata.with_lower_bounds(lowers)
    return metadata


def _seq_lens_list(forward_batch) -> list[int]:
    """Text lengths from the host copy when sglang keeps one (no device sync per forward)."""
    if forward_batch.seq_lens_cpu is not None:
        return forward_batch.seq_lens_cpu.tolist()
    return forward_batch.seq_lens.tolist()


def _encoder_lens_list(forward_batch) -> list[int]:
    if forward_batch.encoder_lens_cpu is not None:
        return list(forward_batch.encoder_lens_cpu)
    return forward_batch.encoder_lens.tolist()


def metadata_from_visible_frames(forward_batch, spatial_merge_size: int) -> ForwardAttentionMetadata:
    """The prepare_forward_batch hook's builder: boundaries from each request's visible-frame counts."""
    if forward_batch.forward_mode.is_decode():
        return decode_metadata(forward_batch)
    device = forward_batch.seq_lens.device
    encoder_lens = _encoder_lens_list(forward_batch)
    extend_lens = list(forward_batch.extend_seq_lens_cpu)
    prefix_lens = list(forward_batch.extend_prefix_lens_cpu)
    boundaries = []
    for i, (extend_len, prefix_len, encoder_len) in enumerate(zip(extend_lens, prefix_lens, encoder_lens)):
        if not (extend_len and encoder_len):
            boundaries.append(None)
            continue
        mm_input = forward_batch.mm_inputs[i] if forward_batch.mm_inputs else None
        boundaries.append(
            request_row_boundaries(mm_input, prefix_len, extend_len, encoder_len, spatial_merge_size, device)
        )
    metadata = ForwardAttentionMetadata.build(extend_lens, prefix_lens, encoder_lens, boundaries, device)
    return _with_realtime_rows(metadata, forward_batch)
