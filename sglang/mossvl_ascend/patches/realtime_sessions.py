"""MOSS-VL-Realtime sessions in the scheduler: one growing sequence per session whose text and vision K/V stay in
the pool between steps (the HTTP side is :mod:`mossvl_ascend.realtime.engine`).

A session is driven as a chain of ordinary requests, one per **step** (rid ``mossvl-realtime:<session>:<n>``):
a step carries only its new rows (the token generated last, whose K/V are not computed yet, then the drained prompts
and frames) and its new frames' pixels; it runs them as an extend over the session's kept K/V, then decodes until
``<|silence|>`` or the turn's token limit. When it finishes, its KV record (the ``req_to_token`` row and every
slot) is kept for the next step instead of being freed, through the seams stock 0.5.23 made for its own streaming
sessions (``StreamingSession.try_match_prefix`` / ``try_cache_finished_req`` / ``try_checkpoint``), which stock
skips for requests without a stock session.

The row is ``[encoder rows | text rows]``. New frames grow the encoder region in whole pages: new encoder slots are
allocated and the row is rewritten ``[old encoder | new encoder | text]``; no K/V moves, and since the text shifts
by whole pages every text slot keeps its page offset (page size 128, the NPU's, as at 1). Vision tokens are
slot-major (token ``t``: band ``t % bands`` of encoder slot ``t // bands``), so appending never re-addresses one.
Only the new frames go through the vision tower; the step's rows see every frame before them (cumulative frame
ends); MRoPE positions continue from the session's last one.

A frame window (the HTTP side decides, per new frame, the first frame still in the window once it arrives, and
passes it in the step's ``custom_params``): each row sees the frames from its window's first to the last before it
(rows before a step's new frame still see the older ones); once the step finishes, the encoder pages holding only
frames before the window go back to the pool and the row becomes ``[kept encoder | text]`` (the text moves by whole
pages again). The kept vision tokens are renumbered by the dropped slots times the bands, which slot-major
addressing allows without moving them.

The realtime step never reads or writes the radix tree (each session pays its own prefill, as in
sglang-omni-realtime); a ``:close`` request frees the session's slots and its row.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.attention.kv_layout import encoder_row_len, slot_major_vision_addresses
from mossvl_ascend.attention.metadata import ENCODER_ROWS_ATTRIBUTE, FRAME_ENDS_ATTRIBUTE, WINDOW_STARTS_ATTRIBUTE
from mossvl_ascend.registry import ON_NPU_AND_CPU, Patch

logger = logging.getLogger(__name__)

RID_PREFIX = "mossvl-realtime:"
# The abort message that asks a running step to end at its next token, keeping its KV (barge-in).
INTERRUPT_MESSAGE = "mossvl-realtime-interrupt"
CLOSE_STEP = "close"
# On a step's MultimodalInputs: the session it belongs to, the vision tokens before it, its new vision tokens.
SESSION_ATTRIBUTE = "mossvl_realtime_session"
# In a windowed step's sampling ``custom_params``: per new frame, the first frame still in the window after it.
WINDOW_STARTS_PARAM = "mossvl_window_starts"
# The abort message of a step its session's context cannot hold (the session is full; the client's error code
# `context_exhausted`, the real server's).
CONTEXT_EXHAUSTED = "realtime context exhausted"
# A step's ``customized_info`` key (reaches the HTTP side in its first output's ``meta_info``): the session's context
# account when the step starts (:func:`usage_after`).
USAGE_INFO_KEY = "mossvl_realtime_context"


def usage_after(account: dict, generated: int) -> dict:
    """``session.usage`` once a step generated ``generated`` tokens, from the account at its start: ``decoder_tokens``
    (text positions, the token sampled last included), ``encoder_tokens`` (every vision token appended, windowed-out
    ones included), ``encoder_kv_tokens`` (those still held), ``token_space_used`` (what counts against the context
    here: encoder rows, whole pages, plus text positions), ``context_limit``, ``context_remaining``; and ``kv_tokens``:
    the KV slots the session holds (whole pages), what ``/v1/loads`` counts for it."""
    decoder = account["text_rows"] + generated
    used = account["encoder_rows"] + decoder
    return {
        "decoder_tokens": decoder,
        "encoder_tokens": account["encoder_tokens"],
        "encoder_kv_tokens": account["encoder_kv_tokens"],
        "token_space_used": used,
        "context_limit": account["context_limit"],
        "context_remaining": max(0, account["context_limit"] - used),
        "kv_tokens": _ceil_to(used - 1, account["page_size"]),
    }


def step_rid(session_id: str, step: int | str) -> str:
    return f"{RID_PREFIX}{session_id}:{step}"


def parse_step_rid(rid) -> tuple[str, str] | None:
    """(session id, step) of a realtime step's rid, else None."""
    if not isinstance(rid, str) or not rid.startswith(RID_PREFIX):
        return None
    session_id, _, step = rid[len(RID_PREFIX) :].rpartition(":")
    return (session_id, step) if session_id else None


def frame_block_positions(start: int, rows: int, cols: int) -> tuple[torch.Tensor, int]:
    """MOSS-VL's XRoPE block for a frame opened at position ``start`` on a ``rows x cols`` merged grid: its vision
    tokens at (start, start + y, start + x) row-major, then its separator and its ``<|image_pad|>`` text token at
    ``start + max(rows, cols)``; the next text token takes one more."""
    last = start + max(rows, cols)
    ys = torch.arange(rows).repeat_interleave(cols)
    xs = torch.arange(cols).repeat(rows)
    block = torch.stack((torch.full_like(ys, start), start + ys, start + xs))
    return torch.cat((block, torch.full((3, 1), last)), dim=1), last


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


@dataclass
class Stream:
    """The scheduler's record of one session: what its kept K/V hold and where."""

    session_id: str
    slot: Any = None  # stock SessionSlot holding the kept KV record (None before the first step finished)
    encoder_rows: int = 0  # row entries in front of the text (whole pages)
    vision_tokens: int = 0  # in the encoder row (numbered from its first slot)
    frame_ends: list[int] = field(default_factory=list)  # every frame's, counting the dropped vision tokens
    windowed: bool = False  # a frame window is on (its steps carry window starts)
    window_start: int = 0  # the first frame in the window
    dropped_tokens: int = 0  # vision tokens the window gave back (whole encoder pages) from the front
    text_ids: list[int] = field(default_factory=list)  # rows whose K/V are in the pool
    pending: list[int] = field(default_factory=list)  # the last generated token (its K/V not computed yet)
    positions: torch.Tensor = field(default_factory=lambda: torch.zeros(3, 0, dtype=torch.int64))
    next_position: int = 0
    pad_value: int = 0
    step: Optional["RunningStep"] = None
    # Counters (read by tests through the scheduler log and by the engine's usage): work actually done.
    frames_encoded: int = 0
    rows_extended: int = 0

    @property
    def keeps_kv(self) -> bool:
        """Its kept record still holds a ``req_to_token`` row and KV slots."""
        return self.slot is not None and self.slot.kv.holds_kv


@dataclass
class RunningStep:
    rid: str
    plan: StepPlan
    encoder_rows: int
    vision_tokens: int
    prepared: bool = False  # its row rewrite ran (match_prefix runs again for every scheduling attempt)
    new_vision_from: int = 0  # the first vision token this step writes
    encoded: bool = False  # its new frames went through the vision tower (only its first extend writes them)


_STREAMS: dict[str, Stream] = {}
# Sessions evicted while parked: the message their next step is refused with (their client's error event).
_EVICTED: dict[str, str] = {}


def stream_of(req) -> Stream | None:
    parsed = parse_step_rid(getattr(req, "rid", None))
    if parsed is None or parsed[1] == CLOSE_STEP:
        return None
    return _STREAMS.get(parsed[0])


def _bands_and_page(scheduler_or_cache) -> tuple[int, int]:
    from mossvl_ascend.patches.kv_pool import _active_bands

    return _active_bands() or 1, scheduler_or_cache.token_to_kv_pool_allocator.page_size


def _ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def prepare_step_request(scheduler, req, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook on ``Scheduler._add_request_to_queue``: a realtime step's request becomes the session's whole
    sequence (``[encoder rows | every text row]``) with its multimodal inputs describing the session so far."""
    parsed = parse_step_rid(req.rid)
    if parsed is None or req.finished() or req.to_finish is not None:  # aborted (a retracted step, say): not run
        return
    session_id, step = parsed
    if step == CLOSE_STEP:
        _EVICTED.pop(session_id, None)
        release_stream(session_id, scheduler.tree_cache)
        req.set_finish_with_abort("realtime session closed")
        return
    if step != "0" and session_id not in _STREAMS:  # its KV is gone: running it would start the session afresh
        req.set_finish_with_abort(_EVICTED.pop(session_id, f"realtime session {session_id} holds no KV here"))
        return
    stream = _STREAMS.setdefault(session_id, Stream(session_id))
    if stream.step is not None:
        req.set_finish_with_abort(f"realtime session {session_id} already runs step {stream.step.rid}")
        return
    mm = req.multimodal_inputs
    own_encoder = (mm.num_image_tokens or 0) if mm is not None else 0
    new_rows = list(req.origin_input_ids[own_encoder:])  # the session's last generated token, then the segment
    if new_rows[: len(stream.pending)] != stream.pending:
        req.set_finish_with_abort(
            f"realtime step {req.rid} does not start with its session's last generated token {stream.pending}"
        )
        return
    grids = []
    if mm is not None and mm.mm_items:
        merge = scheduler.model_config.hf_config.vision_config.spatial_merge_size
        grid = torch.as_tensor(mm.mm_items[0].grid_thw).reshape(-1, 3)
        grids = [(int(h) // merge, int(w) // merge) for _, h, w in grid.tolist()]
        stream.pad_value = mm.mm_items[0].pad_value
    image_token_id = scheduler.model_config.hf_config.image_token_id
    window_starts = (req.sampling_params.custom_params or {}).get(WINDOW_STARTS_PARAM)
    stream.windowed = stream.windowed or window_starts is not None
    try:
        plan = plan_step(
            new_rows,
            grids,
            image_token_id,
            stream.next_position,
            len(stream.frame_ends),
            stream.window_start,
            window_starts if grids else None,
        )
    except ValueError as error:
        req.set_finish_with_abort(str(error))
        return
    bands, page = _bands_and_page(scheduler)
    vision_tokens = stream.vision_tokens + sum(plan.frame_lens)
    needed = encoder_row_len(vision_tokens, bands)
    encoder_rows = stream.encoder_rows
    if needed > encoder_rows:
        encoder_rows += _ceil_to(needed - encoder_rows, page)
    text_rows = len(stream.text_ids) + len(plan.rows)
    # A step reserves what it can write, not the turn's allowance: most steps end on <|silence|> after a few tokens.
    # Stock's bound on a request's new tokens (``init_req_max_new_tokens``), applied to the whole sequence.
    context_limit = scheduler.max_req_len - 1
    room = context_limit - (encoder_rows + text_rows)
    if room < 1:
        req.set_finish_with_abort(
            f"{CONTEXT_EXHAUSTED}: realtime session {session_id} holds {encoder_rows} encoder and "
            f"{text_rows - len(plan.rows)} text rows; its next {len(plan.rows)} rows and a token exceed the context "
            f"({context_limit} positions)"
        )
        return
    req.sampling_params.max_new_tokens = min(req.sampling_params.max_new_tokens, room)
    from sglang.srt.managers.schedule_batch import MultimodalInputs

    if mm is None:
        mm = MultimodalInputs(mm_items=[])
        req.multimodal_inputs = mm
    ids = array("q", [stream.pad_value] * encoder_rows)
    ids.extend(stream.text_ids)
    ids.extend(plan.rows)
    req.origin_input_ids = ids
    req.origin_input_ids_unpadded = ids
    if req.return_logprob:  # the generated tokens' only: stock counted from the step's own ids
        req.logprob_start_len = len(ids)
    req.skip_radix_cache_insert = True
    mm.num_image_tokens = encoder_rows or None
    setattr(mm, "mossvl_vision_tokens", vision_tokens)
    setattr(mm, SESSION_ATTRIBUTE, session_id)
    setattr(mm, ENCODER_ROWS_ATTRIBUTE, encoder_rows)
    frame_ends = list(stream.frame_ends)
    for length in plan.frame_lens:
        frame_ends.append((frame_ends[-1] if frame_ends else 0) + length)
    setattr(mm, FRAME_ENDS_ATTRIBUTE, torch.tensor(frame_ends, dtype=torch.int64) - stream.dropped_tokens)
    visible = torch.zeros(text_rows, dtype=torch.int32)
    visible[len(stream.text_ids) :] = plan.visible_frames
    mm.visible_frame_counts = visible
    if stream.windowed:
        first = torch.zeros(text_rows, dtype=torch.int32)
        first[len(stream.text_ids) :] = plan.first_frames
        setattr(mm, WINDOW_STARTS_ATTRIBUTE, first)
    mm.mrope_positions = torch.cat((stream.positions, plan.positions), dim=1)
    mm.mrope_position_delta = torch.tensor([[plan.next_position - text_rows]], dtype=torch.int64)
    mm.vision_position_ids = plan.vision_positions
    stream.step = RunningStep(req.rid, plan, encoder_rows, vision_tokens, new_vision_from=stream.vision_tokens)
    req.customized_info = {
        USAGE_INFO_KEY: [
            {
                "text_rows": text_rows,
                "encoder_rows": encoder_rows,
                "encoder_tokens": stream.dropped_tokens + vision_tokens,
                "encoder_kv_tokens": vision_tokens,
                "context_limit": context_limit,
                "page_size": page,
            }
        ]
    }


def match_step_prefix(original: Callable, session, params):
    """AROUND ``StreamingSession.try_match_prefix``: a realtime step lends the session's record, its row
    rewritten for the new frames' encoder pages; the tree is never consulted."""
    req = params.req
    stream = stream_of(req) if req is not None else None
    if stream is None or stream.step is None or stream.step.rid != req.rid:
        return original(session, params)
    from sglang.srt.mem_cache.base_prefix_cache import MatchResult
    from sglang.srt.session.streaming_session import SessionSlot

    cache, step = session.cache, stream.step
    if stream.slot is None:
        # The first step: nothing kept yet; a later chunk of it continues its own row.
        computed = req.kv.kv_committed_len if req.kv.holds_kv else 0
        return cache.tree_core.empty_match_result._replace(device_prefix_len=computed)
    slot: SessionSlot = stream.slot
    if not step.prepared:
        _grow_encoder(cache, stream, step)
        step.prepared = True
    req.kv = slot.kv
    node = slot.virtual_node
    return MatchResult(
        device_prefix_len=slot.kv.kv_committed_len,
        last_device_node=node,
        last_host_node=node,
        best_match_node=node,
        cache_protected_len=0,
    )


def _grow_encoder(cache, stream: Stream, step: RunningStep) -> None:
    """Rewrite the kept row ``[old encoder | new encoder | text]`` (new encoder slots in whole pages)."""
    kv = stream.slot.kv
    grow = step.encoder_rows - stream.encoder_rows
    if grow <= 0:
        return
    new_slots = cache.token_to_kv_pool_allocator.alloc(grow)
    if new_slots is None:
        cache.evict_for_alloc(_evict_params(grow))
        new_slots = cache.token_to_kv_pool_allocator.alloc(grow)
    if new_slots is None:
        raise MemoryError(f"no KV room for {grow} encoder slots of realtime session {stream.session_id}")
    row = cache.req_to_token_pool.req_to_token[kv.req_pool_idx]
    committed = kv.kv_committed_len
    text = row[stream.encoder_rows : committed].clone()
    row[stream.encoder_rows : step.encoder_rows] = new_slots.to(row.dtype)
    row[step.encoder_rows : step.encoder_rows + text.numel()] = text
    kv.kv_committed_len += grow
    kv.kv_allocated_len = kv.kv_committed_len


def _evict_params(tokens: int):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    return EvictParams(num_tokens=tokens)


def keep_step_kv(original: Callable, session, req) -> bool:
    """AROUND ``StreamingSession.try_cache_finished_req``: a finished step's record stays with its session (the
    last generated token's K/V is computed by the next step); an aborted step ends the session and frees all."""
    stream = stream_of(req)
    if stream is None or stream.step is None or stream.step.rid != req.rid:
        return original(session, req)
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.session.streaming_session import SessionSlot

    cache, step = session.cache, stream.step
    cache.unlock(req.lock)
    req.lock = None
    retracted = not req.finished()
    if retracted or isinstance(req.finished_reason, FINISH_ABORT) or not req.output_ids:
        # A retracted step (memory pressure) cannot be prefilled again (its pixels are gone, so are earlier
        # frames'): its session ends, with an error to its client; the other requests go on.
        if retracted:
            logger.warning(
                "realtime session %s aborted: its step %s was retracted (it held %d KV slots)",
                stream.session_id,
                req.rid,
                _held_slots(req),
            )
            req.set_finish_with_abort(f"realtime session {stream.session_id} evicted under KV memory pressure")
        if stream.slot is None or stream.slot.kv is not req.kv:
            stream.slot = SessionSlot(kv=req.detach_kv())
        release_stream(stream.session_id, cache)
        return True
    if stream.slot is None:
        stream.slot = SessionSlot(kv=req.kv)
    req.detach_kv()
    kv = stream.slot.kv
    outputs = list(req.output_ids)
    committed = step.encoder_rows + len(stream.text_ids) + len(step.plan.rows) + len(outputs) - 1
    _, page = _bands_and_page(cache)
    free_from = _ceil_to(committed, page)
    if kv.kv_allocated_len > free_from:
        cache.free_kv_row(kv, [(free_from, kv.kv_allocated_len)])
    kv.kv_allocated_len = kv.kv_committed_len = committed
    generated_positions = torch.arange(step.plan.next_position, step.plan.next_position + len(outputs) - 1)
    stream.positions = torch.cat((stream.positions, step.plan.positions, generated_positions.expand(3, -1)), dim=1)
    stream.next_position = step.plan.next_position + len(outputs) - 1
    stream.text_ids.extend(step.plan.rows)
    stream.text_ids.extend(outputs[:-1])
    stream.pending = outputs[-1:]
    stream.encoder_rows, stream.vision_tokens = step.encoder_rows, step.vision_tokens
    for length in step.plan.frame_lens:
        stream.frame_ends.append((stream.frame_ends[-1] if stream.frame_ends else 0) + length)
    stream.frames_encoded += len(step.plan.frame_lens)
    stream.rows_extended += len(step.plan.rows)
    stream.window_start = step.plan.window_start
    _drop_pages_before_window(cache, stream)
    logger.info(
        "realtime step %s: extended %d rows, %d new frames through the vision tower (%d vision tokens), "
        "generated %d; session holds %d encoder + %d text rows",
        req.rid,
        len(step.plan.rows),
        len(step.plan.frame_lens),
        step.vision_tokens - step.new_vision_from,
        len(outputs),
        stream.encoder_rows,
        len(stream.text_ids),
    )
    stream.step = None
    return True


def _drop_pages_before_window(cache, stream: Stream) -> None:
    """Give back the whole encoder pages that hold only frames before the window; the row becomes ``[kept encoder |
    text]``, the text moving by whole pages (each slot keeps its page offset). Kept vision tokens are numbered
    from the row's new first slot (slot-major: token ``t`` moves to ``t - dropped slots * bands``)."""
    bands, page = _bands_and_page(cache)
    first_kept = (stream.frame_ends[stream.window_start - 1] if stream.window_start else 0) - stream.dropped_tokens
    drop = first_kept // bands // page * page
    if drop <= 0:
        return
    kv = stream.slot.kv
    committed = kv.kv_committed_len
    cache.free_kv_row(kv, [(0, drop)])
    row = cache.req_to_token_pool.req_to_token[kv.req_pool_idx]
    row[: committed - drop] = row[drop:committed].clone()
    kv.kv_committed_len = kv.kv_allocated_len = committed - drop
    stream.encoder_rows -= drop
    stream.vision_tokens -= drop * bands
    stream.dropped_tokens += drop * bands
    logger.info(
        "realtime session %s: frames before %d left the window, %d encoder slots freed",
        stream.session_id,
        stream.window_start,
        drop,
    )


def skip_step_checkpoint(original: Callable, session, req, *args: Any, **kwargs: Any) -> bool:
    """AROUND ``StreamingSession.try_checkpoint``: a realtime step inserts nothing into the radix tree."""
    if stream_of(req) is not None:
        return True
    return original(session, req, *args, **kwargs)


def release_stream(session_id: str, cache) -> None:
    """Free every slot and the row a session holds, and forget it."""
    stream = _STREAMS.pop(session_id, None)
    if stream is None or not stream.keeps_kv:
        return
    kv = stream.slot.kv
    freed = kv.kv_allocated_len
    if freed:
        cache.free_kv_row(kv, [(0, freed)])
    cache.req_to_token_pool.free(stream.slot)
    kv.mark_kv_released()
    logger.info("realtime session %s closed: %d rows freed", session_id, freed)


def step_vision_in_the_forward(forward_batch, batch, addressing):
    """Called by the KV-layout forward hook: (per request, the vision tokens a realtime step's forward sees, None
    for other requests; batch index -> slot-major unit addresses of a step's new vision tokens, the hook's K/V
    write locations), or None when the batch has no realtime step. A step with new vision tokens is marked
    uncached, so the vision tower runs on its new frames."""
    if not any(parse_step_rid(rid) for rid in getattr(forward_batch, "rids", None) or ()):
        return None
    steps = [_running_step(req) for req in batch.reqs]
    if not any(steps):
        return None
    new_addresses: dict[int, torch.Tensor] = {}
    if forward_batch.forward_mode.is_extend():
        req_to_token = batch.req_to_token_pool.req_to_token
        for i, (req, step) in enumerate(zip(batch.reqs, steps)):
            if step is None or step.encoded or step.vision_tokens == step.new_vision_from:
                continue
            row = req_to_token[req.kv.req_pool_idx, : step.encoder_rows]
            addresses = slot_major_vision_addresses(row, step.vision_tokens, addressing.bands, addressing.band_stride)
            new_addresses[i] = addresses[step.new_vision_from :]
            forward_batch.encoder_cached[i] = False
            step.encoded = True
    return [None if step is None else step.vision_tokens for step in steps], new_addresses


def _running_step(req) -> RunningStep | None:
    stream = stream_of(req)
    step = stream.step if stream is not None else None
    return step if step is not None and step.rid == req.rid else None


def heaviest_sessions_retracted_first(order: list[int], reqs, *args: Any, **kwargs: Any) -> list[int]:
    """AFTER ``ScheduleBatch._get_decode_retraction_order`` (request indices, the ones to keep first; retraction
    pops from the end): ordinary requests, which are queued again and recover, go before any realtime step, whose
    session cannot be prefilled again and is aborted; among the sessions the one holding the most KV goes first."""
    held = {i: _held_slots(reqs[i]) for i in order if _running_step(reqs[i]) is not None}
    if not held:
        return order
    ordinary = [i for i in order if i not in held]
    return sorted(held, key=held.__getitem__) + ordinary


def evict_a_parked_session_when_stalled(plan, scheduler, *args: Any, **kwargs: Any):
    """AFTER ``Scheduler.get_new_batch_prefill``: when requests wait, none could be admitted and nothing runs, no
    finishing request will ever make room (the prefill adder has already evicted what the tree could give), only
    parked sessions hold KV. The parked session holding the most goes (every slot and its row freed); its next step is
    refused with the reason, which its client gets as an error event. One per pass, until a waiting request fits."""
    if plan.batch_to_run is not None or not plan.running_batch.is_empty() or scheduler.chunked_req is not None:
        return plan
    if not scheduler.waiting_queue:
        return plan
    parked = {
        session_id: stream.slot.kv.kv_allocated_len
        for session_id, stream in _STREAMS.items()
        if stream.step is None and stream.keeps_kv
    }
    if not parked:
        return plan
    heaviest = max(parked, key=parked.__getitem__)
    # What stood in the way: every request row kept (as many parked sessions as --max-running-requests), or KV slots.
    pressure = (
        "request-row pressure (every row kept; see --max-running-requests)"
        if scheduler.req_to_token_pool.available_size() == 0
        else "KV memory pressure"
    )
    logger.warning(
        "realtime session %s evicted while parked: %d waiting requests could not be admitted and none runs, "
        "under %s (it held %d KV slots, the heaviest of %d parked sessions)",
        heaviest,
        len(scheduler.waiting_queue),
        pressure,
        parked[heaviest],
        len(parked),
    )
    release_stream(heaviest, scheduler.tree_cache)
    _EVICTED[heaviest] = f"realtime session {heaviest} evicted under {pressure} (parked, the heaviest)"
    return plan


def _borrows_a_kept_row(req) -> bool:
    """A queued step whose session keeps a ``req_to_token`` row: it runs in that row and needs no free one."""
    return _running_step(req) is not None and stream_of(req).keeps_kv


def kept_rows_first(result, policy, waiting_queue, *args: Any, **kwargs: Any):
    """AFTER ``SchedulePolicy.calc_priority``: the queued steps that run in their session's kept row go first (stable,
    so stock's order holds within both groups). :func:`count_kept_rows_as_allocatable` relies on it: the rows it
    credits are taken by the first candidates of the pass, never by a request that needs a free row."""
    if _STREAMS:  # a pass over the queue only while sessions exist: ordinary serving pays nothing
        waiting_queue.sort(key=lambda req: not _borrows_a_kept_row(req))
    return result


def count_kept_rows_as_allocatable(original: Callable, scheduler, *args: Any, num_held_rows: int = 0, **kwargs: Any):
    """AROUND ``Scheduler.get_num_allocatable_reqs``: stock counts a row as held only once its request is in the
    pass's admitted list, since its requests borrow a row when they are matched. A queued realtime step borrows its
    session's kept row, so with every row kept by a parked session (as many sessions as ``--max-running-requests``)
    stock would admit no step and the pool would look stalled. The queued steps' kept rows count as held: at least
    as many as there are such steps (they are first in the queue, see :func:`kept_rows_first`)."""
    # Only while sessions exist: stock asks once per admission candidate, so ordinary serving pays nothing.
    waiting = sum(_borrows_a_kept_row(req) for req in scheduler.waiting_queue) if _STREAMS else 0
    return original(scheduler, *args, num_held_rows=max(num_held_rows, waiting), **kwargs)


def _held_slots(req) -> int:
    kv = getattr(req, "kv", None)
    return kv.kv_allocated_len if kv is not None and kv.holds_kv else 0


def interrupt_step(original: Callable, scheduler, recv_req, *args: Any, **kwargs: Any):
    """AROUND ``Scheduler.abort_request``: an abort carrying :data:`INTERRUPT_MESSAGE` ends a running realtime
    step at its next token as a normal finish (its KV stays with the session); any other abort is stock's."""
    if getattr(recv_req, "abort_message", None) != INTERRUPT_MESSAGE or parse_step_rid(recv_req.rid) is None:
        return original(scheduler, recv_req, *args, **kwargs)
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    # In flight as stock's abort sees it: the running batch AND the last batch. A step whose first token just came
    # back is still in the last (prefill) batch until the next pass merges it; looking in the running batch alone
    # lost that interrupt, and the step decoded on to its silence or allowance (the prompt's time to first text).
    for req in scheduler.collect_inflight_reqs():
        if req.rid == recv_req.rid and req.output_ids and not req.finished():
            req.to_finish = FINISH_LENGTH(length=len(req.output_ids) + 1)
            logger.info("realtime step %s interrupted after %d tokens", req.rid, len(req.output_ids))
    return None


def with_realtime_records(records: dict, cache, *args: Any, **kwargs: Any) -> dict:
    """AFTER ``UnifiedRadixCache.session_records``: the realtime sessions' kept records count as session-held (the
    pool's leak check and ``/v1/loads`` see them as such, not as leaked)."""
    kept = {RID_PREFIX + sid: stream.slot.kv for sid, stream in _STREAMS.items() if stream.slot is not None}
    return {**records, **kept} if kept else records


async def step_multimodal_inputs(original: Callable, processor, *args: Any, request_obj=None, **kwargs: Any):
    """AROUND MOSS-VL's ``process_mm_data_async``: a realtime step's rows are token ids already (the session built
    them) and its frames are patches already (``realtime.engine`` made them); the step's multimodal inputs carry
    them as they are. The scheduler completes them (:func:`prepare_step_request`)."""
    if parse_step_rid(getattr(request_obj, "rid", None)) is None:
        return await original(processor, *args, request_obj=request_obj, **kwargs)
    from sglang.srt.managers.schedule_batch import MultimodalProcessorOutput

    from mossvl_ascend.realtime.engine import take_step_frames

    ids = list(request_obj.input_ids)
    frames = take_step_frames(request_obj.rid)
    items = []
    if frames is not None:
        pixel_values, grid_thw = frames
        items = processor._build_mm_items({"pixel_values": pixel_values, "grid_thw": grid_thw}, torch.tensor(ids))
        items = processor._prepare_mm_items_for_transport(items)
    placeholder = torch.arange(len(ids), dtype=torch.int64).expand(3, -1).clone()
    return MultimodalProcessorOutput(
        input_ids=ids,
        mm_items=items,
        im_token_id=processor.image_token_id,
        mrope_positions=placeholder,
        mrope_position_delta=torch.zeros(1, 1, dtype=torch.int64),
    )


PATCHES = (
    Patch(
        title="MOSS-VL-Realtime: a step's multimodal inputs are the session's token ids and patches",
        target="sglang.srt.multimodal.processors.moss_vl.MossVLImageProcessor.process_mm_data_async",
        kind=HookType.AROUND,
        hook=step_multimodal_inputs,
        platforms=ON_NPU_AND_CPU,
        why=(
            "the HF processor would re-tokenize a step's text (the generated token in front of it may not survive "
            "a decode round trip) and patchify its frames at the image budget, while the stream uses the video one"
        ),
        how=(
            "for rid `mossvl-realtime:...`: the request's token ids as they are and the frames the session "
            "patchified (handed over in this process by rid); positions are placeholders the scheduler replaces"
        ),
        upstream="not in sglang",
        remove_when="sglang serves encoder-decoder streaming sessions with growing encoders",
    ),
    Patch(
        title="MOSS-VL-Realtime: a step request becomes its session's whole sequence",
        target="sglang.srt.managers.scheduler.Scheduler._add_request_to_queue",
        kind=HookType.BEFORE,
        hook=prepare_step_request,
        platforms=ON_NPU_AND_CPU,
        why=(
            "a realtime step carries only its new rows and frames, but the scheduler and the model need the "
            "session's sequence: its encoder rows, every text row, where each frame ends, the positions so far"
        ),
        how=(
            "for rid `mossvl-realtime:<session>:<n>`: origin ids `[encoder rows | kept text | last generated token | "
            "new rows]`, the encoder grown in whole pages for the new frames, multimodal inputs holding the new "
            "frames' pixels with every frame's encoder end, per-row visible frames (with a frame window, each "
            "row's first visible frame too) and MRoPE positions that continue the session's; `:close` frees the "
            "session"
        ),
        upstream="sglang's streaming sessions copy a turn's multimodal inputs from the previous one (no new frames)",
        remove_when="sglang serves encoder-decoder streaming sessions with growing encoders",
    ),
    Patch(
        title="MOSS-VL-Realtime: a step runs over its session's kept K/V",
        target="sglang.srt.session.streaming_session.StreamingSession.try_match_prefix",
        kind=HookType.AROUND,
        hook=match_step_prefix,
        platforms=ON_NPU_AND_CPU,
        why="a step must extend only its new rows, over the K/V of everything before it",
        how=(
            "the step borrows the session's KV record; new encoder slots (whole pages) are allocated and the row "
            "rewritten `[old encoder | new encoder | text]` once per step; the matched prefix is every kept row. "
            "The first step matches nothing (the tree is not consulted: sessions share no prefix)"
        ),
        upstream="stock streaming sessions lend a record the same way, for decoder-only rows",
        remove_when="sglang serves encoder-decoder streaming sessions with growing encoders",
    ),
    Patch(
        title="MOSS-VL-Realtime: a finished step's KV stays with its session",
        target="sglang.srt.session.streaming_session.StreamingSession.try_cache_finished_req",
        kind=HookType.AROUND,
        hook=keep_step_kv,
        platforms=ON_NPU_AND_CPU,
        why="the next step extends the same sequence; freeing the K/V would force a re-prefill without pixels",
        how=(
            "the record is detached from the request and kept (committed: every row but the last generated token), "
            "any whole page past it freed; the session's text, positions and frame ends advance; with a frame "
            "window the encoder pages holding only frames before it are freed and the row moves down by whole "
            "pages. An aborted step "
            "frees the whole session; so does a retracted one (memory pressure), which is then aborted: a "
            "session cannot be prefilled again without its frames"
        ),
        upstream="stock streaming sessions keep a turn's record the same way",
        remove_when="sglang serves encoder-decoder streaming sessions with growing encoders",
    ),
    Patch(
        title="MOSS-VL-Realtime: an interrupt ends a running step at its next token, keeping its KV",
        target="sglang.srt.managers.scheduler.Scheduler.abort_request",
        kind=HookType.AROUND,
        hook=interrupt_step,
        platforms=ON_NPU_AND_CPU,
        why=(
            "input that arrives while a turn runs is drained after the next token (a prompt barges in); an abort "
            "would free the session's KV, which cannot be rebuilt without the pixels"
        ),
        how=(
            "an AbortReq for a realtime step rid whose `abort_message` is the interrupt marker sets the running "
            "request's `to_finish` to a length finish: it ends after its next token like any finished step. Other "
            "aborts (and a step still waiting) go to stock"
        ),
        upstream="not in sglang",
        remove_when="sglang serves encoder-decoder streaming sessions with growing encoders",
    ),
    Patch(
        title="MOSS-VL-Realtime: under decode memory pressure the heaviest session goes, after ordinary requests",
        target="sglang.srt.managers.schedule_batch.ScheduleBatch._get_decode_retraction_order",
        kind=HookType.AFTER,
        hook=heaviest_sessions_retracted_first,
        platforms=ON_NPU_AND_CPU,
        why=(
            "a retracted realtime step ends its session (it cannot be prefilled again without its frames), while a "
            "retracted ordinary request is queued again; stock orders them alike, by output and input length"
        ),
        how=(
            "the retraction order keeps realtime steps first, lightest session first, then the ordinary requests "
            "in stock's order, so retraction takes ordinary requests, then the session holding the most KV"
        ),
        upstream="not in sglang",
        remove_when="sglang serves encoder-decoder streaming sessions with growing encoders",
    ),
    Patch(
        title="MOSS-VL-Realtime: when the pool is stalled by parked sessions the heaviest one goes",
        target="sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill",
        kind=HookType.AFTER,
        hook=evict_a_parked_session_when_stalled,
        platforms=ON_NPU_AND_CPU,
        why=(
            "a parked session (its turn ended on `<|silence|>`) holds its KV with no request in the scheduler, so "
            "neither retraction nor the tree's eviction can reclaim it: requests that need that KV would wait until "
            "the session timed out"
        ),
        how=(
            "after a prefill pass that admitted nothing while requests wait and none runs, the parked session "
            "holding the most KV is freed (slots and row, one per pass) and its next step aborted with the reason"
        ),
        upstream="not in sglang",
        remove_when="sglang serves encoder-decoder streaming sessions with growing encoders",
    ),
    Patch(
        title="MOSS-VL-Realtime: a queued step runs in its session's kept row, first in the queue",
        target="sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority",
        kind=HookType.AFTER,
        hook=kept_rows_first,
        platforms=ON_NPU_AND_CPU,
        why=(
            "the admission gate credits the queued steps' kept rows (next entry); a request needing a free row "
            "admitted before them could take a credited row that is not free"
        ),
        how="the waiting queue is re-sorted, stably, with the steps whose session keeps a row first",
        upstream="not in sglang",
        remove_when="sglang serves encoder-decoder streaming sessions with growing encoders",
    ),
    Patch(
        title="MOSS-VL-Realtime: a queued step's kept row counts as held at admission",
        target="sglang.srt.managers.scheduler.Scheduler.get_num_allocatable_reqs",
        kind=HookType.AROUND,
        hook=count_kept_rows_as_allocatable,
        platforms=ON_NPU_AND_CPU,
        why=(
            "stock counts a request's row as held only once it is admitted; with every `req_to_token` row kept by a "
            "parked session no step was admitted, although it needs no new row, and the pool looked stalled (a "
            "parked session was evicted for nothing)"
        ),
        how=(
            "`num_held_rows` becomes at least the number of queued steps whose session keeps a row (those steps "
            "are first in the queue, so the credited rows are theirs)"
        ),
        upstream="not in sglang",
        remove_when="sglang serves encoder-decoder streaming sessions with growing encoders",
    ),
    Patch(
        title="MOSS-VL-Realtime: kept session KV counts as session-held",
        target="sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.session_records",
        kind=HookType.AFTER,
        hook=with_realtime_records,
        platforms=ON_NPU_AND_CPU,
        why="the idle leak check and the pool metrics count KV outside the tree and the running batch as leaked",
        how="the realtime sessions' kept KV records are added to the cache's session records",
        upstream="stock streaming sessions report their records the same way",
        remove_when="sglang serves encoder-decoder streaming sessions with growing encoders",
    ),
    Patch(
        title="MOSS-VL-Realtime: a step inserts nothing into the radix tree",
        target="sglang.srt.session.streaming_session.StreamingSession.try_checkpoint",
        kind=HookType.AROUND,
        hook=skip_step_checkpoint,
        platforms=ON_NPU_AND_CPU,
        why="a session's row is rewritten when frames arrive, so no part of it may become tree-owned",
        how="the checkpoint of a realtime step is a no-op (returns handled)",
        upstream="not in sglang",
        remove_when="sglang serves encoder-decoder streaming sessions with growing encoders",
    ),
)
