"""MOSS-VL-Realtime sessions in the scheduler: one growing sequence per session whose text and vision K/V stay in
the pool between steps (the HTTP side is :mod:`.engine`; what they tell each other is :mod:`.wire`).

A session is driven as a chain of ordinary requests, one per **step**: a step carries only its new rows (the token
generated last, whose K/V are not computed yet, then the drained prompts and frames) and its new frames' pixels; it
runs them as an extend over the session's kept K/V, then decodes until ``<|silence|>`` or the turn's token limit.
When it finishes, its KV record (the ``req_to_token`` row and every slot) is kept for the next step instead of being
freed, through the seams stock 0.5.23 made for its own streaming sessions (``StreamingSession.try_match_prefix`` /
``try_cache_finished_req`` / ``try_checkpoint``), which stock skips for requests without a stock session.
:class:`RealtimeSessions` is shaped like stock's ``StreamingSession``: its ``try_*`` methods answer None / False for
a request that is not a realtime step, and the hooks (``patches/realtime_sessions.py``) then call stock.

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
from typing import Any, NamedTuple, Optional

import torch

from mossvl_ascend import side_channel
from mossvl_ascend.attention.kv_layout import ACTIVE_LAYOUT, encoder_row_len, slot_major_vision_addresses
from mossvl_ascend.realtime.step_plan import StepPlan, frame_ends_after, plan_step
from mossvl_ascend.realtime.wire import (
    CLOSE_STEP,
    CONTEXT_EXHAUSTED,
    FIRST_STEP,
    OFFER_TAKEN_KEY,
    RID_PREFIX,
    USAGE_INFO_KEY,
    WINDOW_STARTS_PARAM,
    PromptOffer,
    parse_step_rid,
    whole_pages,
)

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class StepInputs:
    """What a step's request brought: its new rows (the token generated last, then its segment), each new frame's
    merged grid, per new frame the window's first frame (None without a window)."""

    rows: list[int]
    grids: list[tuple[int, int]]
    window_starts: Optional[list[int]]

    def with_prompts(self, pending: int, offer: PromptOffer) -> "StepInputs":
        """The offered prompts' rows after the ``pending`` first rows (the token generated last)."""
        return StepInputs(self.rows[:pending] + offer.rows + self.rows[pending:], self.grids, self.window_starts)


@dataclass
class RunningStep:
    rid: str
    plan: StepPlan
    encoder_rows: int
    vision_tokens: int
    prepared: bool = False  # its row rewrite ran (match_prefix runs again for every scheduling attempt)
    new_vision_from: int = 0  # the first vision token this step writes
    inputs: Optional[StepInputs] = None  # what its request brought (to lay it out again with offered prompts)


@dataclass(frozen=True)
class NewVision:
    """A step's new vision tokens, as the scheduler records them for the forward: the first one (in the step's
    encoder row, slot-major) and the text rows kept before the step (its first extend starts there)."""

    first: int
    text_from: int


class Layout(NamedTuple):
    """Where a step's rows go in its session's sequence, and what room the context leaves it."""

    plan: StepPlan
    encoder_rows: int  # whole pages
    vision_tokens: int  # in the encoder row once the step's frames are in
    text_rows: int  # every text row, the step's included
    context_limit: int  # the positions a request may fill
    page_size: int

    @property
    def room(self) -> int:
        """The tokens the step may still generate."""
        return self.context_limit - (self.encoder_rows + self.text_rows)


def _lay_out(scheduler, stream: Stream, inputs: StepInputs) -> Layout:
    """The layout of a step with ``inputs`` on ``stream``; ValueError (the refusal, its client's message) when its
    rows break the frame rules or its session's context cannot hold them and a token to generate."""
    plan = plan_step(
        inputs.rows,
        inputs.grids,
        scheduler.model_config.hf_config.image_token_id,
        stream.next_position,
        len(stream.frame_ends),
        stream.window_start,
        inputs.window_starts,
    )
    page = _page_size(scheduler)
    vision_tokens = stream.vision_tokens + sum(plan.frame_lens)
    needed = encoder_row_len(vision_tokens, ACTIVE_LAYOUT.bands_or_one())
    encoder_rows = stream.encoder_rows
    if needed > encoder_rows:
        encoder_rows += whole_pages(needed - encoder_rows, page)
    text_rows = len(stream.text_ids) + len(plan.rows)
    # A step reserves what it can write, not the turn's allowance: most steps end on <|silence|> after a few tokens.
    # Stock's bound on a request's new tokens (``init_req_max_new_tokens``), applied to the whole sequence.
    layout = Layout(plan, encoder_rows, vision_tokens, text_rows, scheduler.max_req_len - 1, page)
    if layout.room < 1:
        raise ValueError(
            f"{CONTEXT_EXHAUSTED}: realtime session {stream.session_id} holds {encoder_rows} encoder and "
            f"{text_rows - len(plan.rows)} text rows; its next {len(plan.rows)} rows and a token exceed the "
            f"context ({layout.context_limit} positions)"
        )
    return layout


def _page_size(scheduler_or_cache) -> int:
    return scheduler_or_cache.token_to_kv_pool_allocator.page_size


def _held_slots(req) -> int:
    kv = getattr(req, "kv", None)
    return kv.kv_allocated_len if kv is not None and kv.holds_kv else 0


class RealtimeSessions:
    """The realtime sessions of one scheduler process: their streams, and the sessions evicted while parked (the
    message their next step is refused with, their client's error event)."""

    def __init__(self) -> None:
        self.streams: dict[str, Stream] = {}
        self.evicted: dict[str, str] = {}
        # session id -> (the rid of a step interrupted before it arrived, the prompts the interrupt offered it)
        self.early_interrupts: dict[str, tuple[str, Optional[PromptOffer]]] = {}

    # -- which request is ours --

    def stream_of(self, req) -> Stream | None:
        parsed = parse_step_rid(getattr(req, "rid", None))
        if parsed is None or parsed[1] == CLOSE_STEP:
            return None
        return self.streams.get(parsed[0])

    def running_step(self, req) -> RunningStep | None:
        """The step ``req`` is, when its session runs it."""
        stream = self.stream_of(req)
        step = stream.step if stream is not None else None
        return step if step is not None and step.rid == req.rid else None

    def _borrows_a_kept_row(self, req) -> bool:
        """A queued step whose session keeps a ``req_to_token`` row: it runs in that row and needs no free one."""
        return self.running_step(req) is not None and self.stream_of(req).keeps_kv

    # -- a step enters the queue --

    def prepare_step(self, scheduler, req) -> None:
        """A realtime step's request becomes the session's whole sequence (``[encoder rows | every text row]``)
        with its multimodal inputs describing the session so far; ``:close`` frees the session. Not a step: nothing."""
        parsed = parse_step_rid(req.rid)
        if parsed is None or req.finished() or req.to_finish is not None:  # aborted (a retracted step, say): not run
            return
        session_id, step = parsed
        if step == CLOSE_STEP:
            self.evicted.pop(session_id, None)
            self.release(session_id, scheduler.tree_cache)
            req.set_finish_with_abort("realtime session closed")
            return
        if step != FIRST_STEP and session_id not in self.streams:  # its KV is gone: running it would start afresh
            req.set_finish_with_abort(self.evicted.pop(session_id, f"realtime session {session_id} holds no KV here"))
            return
        stream = self.streams.setdefault(session_id, Stream(session_id))
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
        if mm is None:
            from sglang.srt.managers.schedule_batch import MultimodalInputs

            req.multimodal_inputs = MultimodalInputs(mm_items=[])
        window_starts = (req.sampling_params.custom_params or {}).get(WINDOW_STARTS_PARAM)
        stream.windowed = stream.windowed or window_starts is not None
        inputs = StepInputs(new_rows, grids, window_starts if grids else None)
        early = self.early_interrupts.pop(session_id, None)
        rid, offer = early if early is not None else (None, None)
        if rid == req.rid and offer is not None and self._plan_with_offer(scheduler, req, stream, inputs, offer):
            return
        if self._plan(scheduler, req, stream, inputs) and rid == req.rid:
            _finish_at_the_next_result(req)

    def _plan(self, scheduler, req, stream: Stream, inputs: StepInputs) -> bool:
        """Lay out step ``req`` as its session's whole sequence from its new rows and frames (``inputs``). False
        when the step is refused (aborted with the reason: its client's error)."""
        try:
            layout = _lay_out(scheduler, stream, inputs)
        except ValueError as refusal:
            req.set_finish_with_abort(str(refusal))
            return False
        self._apply(req, stream, inputs, layout)
        return True

    def _plan_with_offer(self, scheduler, req, stream: Stream, inputs: StepInputs, offer: PromptOffer) -> bool:
        """Lay out step ``req`` with the offered prompts' rows after its first row, as the turn they open. False,
        ``req`` untouched, when it cannot take them: a session's first step (no generated token before its rows), or
        rows its session's context cannot hold with them. Such an offer is declined, not a refusal of the step: its
        own rows may still fit, and the prompts go to the next step, which is refused if they do not fit there."""
        if not stream.pending:
            return False
        with_prompts = inputs.with_prompts(len(stream.pending), offer)
        try:
            layout = _lay_out(scheduler, stream, with_prompts)
        except ValueError as refusal:
            logger.info("realtime step %s declines %d offered prompt rows: %s", req.rid, len(offer.rows), refusal)
            return False
        self._apply(req, stream, with_prompts, layout, offer)
        return True

    def _apply(
        self, req, stream: Stream, inputs: StepInputs, layout: Layout, offer: Optional[PromptOffer] = None
    ) -> None:
        """Make ``req`` the session's whole sequence by ``layout``: ids, positions, frame visibility, the context
        account (with ``offer``, whose rows ``inputs`` already hold, the turn its prompts open)."""
        plan, encoder_rows, vision_tokens, text_rows, context_limit, page = layout
        if offer is not None:
            req.sampling_params.max_new_tokens = offer.max_new_tokens
        req.sampling_params.max_new_tokens = min(req.sampling_params.max_new_tokens, layout.room)
        mm = req.multimodal_inputs
        ids = array("q", [stream.pad_value] * encoder_rows)
        ids.extend(stream.text_ids)
        ids.extend(plan.rows)
        req.origin_input_ids = ids
        req.origin_input_ids_unpadded = ids
        if req.return_logprob:  # the generated tokens' only: stock counted from the step's own ids
            req.logprob_start_len = len(ids)
        req.skip_radix_cache_insert = True
        mm.num_image_tokens = encoder_rows or None
        side_channel.VISION_TOKENS.set(mm, vision_tokens)
        side_channel.ENCODER_ROWS.set(mm, encoder_rows)
        frame_ends = frame_ends_after(stream.frame_ends, plan.frame_lens)
        side_channel.FRAME_ENDS.set(mm, torch.tensor(frame_ends, dtype=torch.int64) - stream.dropped_tokens)
        visible = torch.zeros(text_rows, dtype=torch.int32)
        visible[len(stream.text_ids) :] = plan.visible_frames
        mm.visible_frame_counts = visible
        if stream.windowed:
            first = torch.zeros(text_rows, dtype=torch.int32)
            first[len(stream.text_ids) :] = plan.first_frames
            side_channel.WINDOW_STARTS.set(mm, first)
        mm.mrope_positions = torch.cat((stream.positions, plan.positions), dim=1)
        mm.mrope_position_delta = torch.tensor([[plan.next_position - text_rows]], dtype=torch.int64)
        mm.vision_position_ids = plan.vision_positions
        if vision_tokens > stream.vision_tokens:
            side_channel.STEP_NEW_VISION.set(mm, NewVision(first=stream.vision_tokens, text_from=len(stream.text_ids)))
        prepared = stream.step is not None and stream.step.rid == req.rid and stream.step.prepared
        stream.step = RunningStep(
            req.rid, plan, encoder_rows, vision_tokens, prepared, stream.vision_tokens, inputs=inputs
        )
        req.customized_info = {
            USAGE_INFO_KEY: [
                {
                    "text_rows": text_rows,
                    "encoder_rows": encoder_rows,
                    "encoder_tokens": stream.dropped_tokens + vision_tokens,
                    "encoder_kv_tokens": vision_tokens,
                    "context_limit": context_limit,
                    "page_size": page,
                    OFFER_TAKEN_KEY: len(offer.rows) if offer is not None else 0,
                }
            ]
        }

    # -- barge-in --

    def interrupt(self, scheduler, rid: str, offer: Optional[PromptOffer] = None) -> None:
        """End step ``rid`` now, as a normal finish (its KV stays with the session): the token of a forward already
        under way when the interrupt arrives is its last (a step in its extend keeps the extend's token); a forward
        the scheduler launches later for it is discarded (stock drops the result of a request finished under
        overlap scheduling), so no token decoded after the interrupt is sent or kept. A step still queued ends after
        its extend; one not here yet (the interrupt overtook it) is ended when it arrives.

        With a prompt ``offer``, a step whose extend has not started (queued, or not here yet) takes the prompts'
        rows instead and runs on as the turn they open: one extend for the step's inputs and the prompts, as the
        reference drains inputs that arrive together, where an interrupt costs a second extend after the first."""
        for req in self._queued_or_in_flight(scheduler):
            if req.rid == rid and not req.finished():
                if offer is None or not self._take_offer(scheduler, req, offer):
                    _finish_at_the_next_result(req)
                return
        parsed = parse_step_rid(rid)
        # A session's first step creates its stream, so an interrupt that overtook it finds none (until its close,
        # which forgets the interrupt with the session, if the step never comes).
        if parsed is not None and (parsed[0] in self.streams or parsed[1] == FIRST_STEP):
            self.early_interrupts[parsed[0]] = (rid, offer)

    def _take_offer(self, scheduler, req, offer: PromptOffer) -> bool:
        """A queued step (in the waiting queue: no part of its extend ran) laid out again with the offered prompts'
        rows; False when it is not such a step or cannot take them (:meth:`_plan_with_offer`)."""
        stream = self.stream_of(req)
        step = stream.step if stream is not None else None
        if step is None or step.rid != req.rid or req.to_finish is not None:
            return False
        if not any(queued is req for queued in scheduler.waiting_queue):
            return False
        if not self._plan_with_offer(scheduler, req, stream, step.inputs, offer):
            return False
        logger.info("realtime step %s takes %d offered prompt rows before its extend", req.rid, len(offer.rows))
        return True

    @staticmethod
    def _queued_or_in_flight(scheduler) -> list:
        # In flight as stock's abort sees it: the running batch AND the last batch (a step whose first token just
        # came back is in the last, prefill, batch until the next pass merges it); and the waiting queue.
        chunked = [scheduler.chunked_req] if getattr(scheduler, "chunked_req", None) is not None else []
        return [*scheduler.waiting_queue, *chunked, *scheduler.collect_inflight_reqs()]

    # -- the overlap loop --

    def process_step_extends_first(self, scheduler) -> None:
        """Under overlap scheduling, before the next batch is built: a pending extend result that holds a realtime
        step is processed now, not after the next forward. Stock's overlap loop builds and launches the next batch
        (the step's first decode) before it reads the extend's result, so the step's first token went out one
        decode later, and a step that ends at that token (``<|silence|>``, an interrupt, a turn's limit) still paid
        that decode, its token dropped. Processed first, the step's first token goes out at once and a finished
        step is not in the next batch; the loop then finds nothing pending (``last_batch`` cleared), as stock's
        own consecutive-prefill rule leaves it. Other batches keep stock's order; so do loops that synchronise
        ranks per batch (DP attention), where every rank must take the same path. Only while sessions exist (a
        step's session is recorded when it is queued): stock asks every scheduler pass, so ordinary serving pays
        nothing."""
        pending = getattr(scheduler, "result_queue", None) if self.streams else None
        if not pending or not scheduler.enable_skip_finishing_decode or scheduler.require_mlp_sync:
            return
        batch, result = pending[0]
        if not batch.forward_mode.is_extend() or not any(parse_step_rid(req.rid) for req in batch.reqs):
            return
        pending.popleft()
        scheduler.process_batch_result(batch, result)
        scheduler.last_batch = None

    # -- stock's streaming-session seams --

    def try_match_prefix(self, cache, req):
        """A running step's match: it lends the session's record, its row rewritten for the new frames' encoder
        pages; the tree is never consulted. None when ``req`` is not a running step."""
        stream = self.stream_of(req) if req is not None else None
        if stream is None or stream.step is None or stream.step.rid != req.rid:
            return None
        from sglang.srt.mem_cache.base_prefix_cache import MatchResult

        step = stream.step
        if stream.slot is None:
            # The first step: nothing kept yet; a later chunk of it continues its own row.
            computed = req.kv.kv_committed_len if req.kv.holds_kv else 0
            return cache.tree_core.empty_match_result._replace(device_prefix_len=computed)
        slot = stream.slot
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

    def try_cache_finished_req(self, cache, req) -> bool:
        """A finished step's record stays with its session (the last generated token's K/V is computed by the next
        step); an aborted or retracted step ends the session and frees all. False when ``req`` is not a running
        step."""
        stream = self.stream_of(req)
        if stream is None or stream.step is None or stream.step.rid != req.rid:
            return False
        from sglang.srt.managers.schedule_batch import FINISH_ABORT
        from sglang.srt.session.streaming_session import SessionSlot

        step = stream.step
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
            self.release(stream.session_id, cache)
            return True
        if stream.slot is None:
            stream.slot = SessionSlot(kv=req.kv)
        req.detach_kv()
        kv = stream.slot.kv
        outputs = list(req.output_ids)
        committed = step.encoder_rows + len(stream.text_ids) + len(step.plan.rows) + len(outputs) - 1
        free_from = whole_pages(committed, _page_size(cache))
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
        stream.frame_ends = frame_ends_after(stream.frame_ends, step.plan.frame_lens)
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

    def try_checkpoint(self, req) -> bool:
        """A realtime step inserts nothing into the radix tree: handled (True) for a step, False otherwise."""
        return self.stream_of(req) is not None

    def kept_records(self) -> dict:
        """The sessions' kept KV records by rid prefix, as stock's session records (session-held, not leaked)."""
        return {RID_PREFIX + sid: stream.slot.kv for sid, stream in self.streams.items() if stream.slot is not None}

    def release(self, session_id: str, cache) -> None:
        """Free every slot and the row a session holds, and forget it."""
        self.early_interrupts.pop(session_id, None)
        stream = self.streams.pop(session_id, None)
        if stream is None or not stream.keeps_kv:
            return
        kv = stream.slot.kv
        freed = kv.kv_allocated_len
        if freed:
            cache.free_kv_row(kv, [(0, freed)])
        cache.req_to_token_pool.free(stream.slot)
        kv.mark_kv_released()
        logger.info("realtime session %s closed: %d rows freed", session_id, freed)

    # -- the forward --

    def step_vision_in_the_forward(self, forward_batch, batch, addressing):
        """(per request, the vision tokens a realtime step's forward sees, None for other requests; batch index ->
        slot-major unit addresses of a step's new vision tokens, the K/V write locations), or None when the batch
        has no realtime step. Read from what :meth:`prepare_step` recorded on each request's multimodal inputs: the
        step's new vision tokens go through the vision tower in the extend that starts at the step's first row (a
        later chunk of it starts further on), which is marked uncached."""
        if not any(parse_step_rid(rid) for rid in getattr(forward_batch, "rids", None) or ()):
            return None  # no realtime step in the batch: nothing to read per request
        mms = [req.multimodal_inputs for req in batch.reqs]
        rows = [side_channel.ENCODER_ROWS.get(mm) for mm in mms]
        if not any(row is not None for row in rows):
            return None
        new_addresses: dict[int, torch.Tensor] = {}
        if forward_batch.forward_mode.is_extend():
            req_to_token = batch.req_to_token_pool.req_to_token
            for i, (req, mm) in enumerate(zip(batch.reqs, mms)):
                new_vision = side_channel.STEP_NEW_VISION.get(mm)
                if new_vision is None or forward_batch.extend_prefix_lens_cpu[i] != new_vision.text_from:
                    continue
                vision_tokens = side_channel.VISION_TOKENS.get(mm)
                row = req_to_token[req.kv.req_pool_idx, : rows[i]]
                addresses = slot_major_vision_addresses(row, vision_tokens, addressing.bands, addressing.band_stride)
                new_addresses[i] = addresses[new_vision.first :]
                forward_batch.encoder_cached[i] = False
        tokens = [None if row is None else side_channel.VISION_TOKENS.get(mm) for mm, row in zip(mms, rows)]
        return tokens, new_addresses

    # -- memory pressure and admission --

    def retraction_order(self, order: list[int], reqs) -> list[int]:
        """Stock's decode retraction order (request indices, the ones to keep first; retraction pops from the end)
        with ordinary requests, which are queued again and recover, going before any realtime step, whose session
        cannot be prefilled again and is aborted; among the sessions the one holding the most KV goes first."""
        held = {i: _held_slots(reqs[i]) for i in order if self.running_step(reqs[i]) is not None}
        if not held:
            return order
        ordinary = [i for i in order if i not in held]
        return sorted(held, key=held.__getitem__) + ordinary

    def evict_a_parked_session_when_stalled(self, plan, scheduler) -> None:
        """After a prefill pass: when requests wait, none could be admitted and nothing runs, no finishing request
        will ever make room (the prefill adder has already evicted what the tree could give), only parked sessions
        hold KV. The parked session holding the most goes (every slot and its row freed); its next step is refused
        with the reason, which its client gets as an error event. One per pass, until a waiting request fits."""
        if plan.batch_to_run is not None or not plan.running_batch.is_empty() or scheduler.chunked_req is not None:
            return
        if not scheduler.waiting_queue:
            return
        parked = {
            session_id: stream.slot.kv.kv_allocated_len
            for session_id, stream in self.streams.items()
            if stream.step is None and stream.keeps_kv
        }
        if not parked:
            return
        heaviest = max(parked, key=parked.__getitem__)
        # What stood in the way: every request row kept (as many parked sessions as --max-running-requests), or KV.
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
        self.release(heaviest, scheduler.tree_cache)
        self.evicted[heaviest] = f"realtime session {heaviest} evicted under {pressure} (parked, the heaviest)"

    def put_kept_rows_first(self, waiting_queue: list) -> None:
        """The queued steps that run in their session's kept row go first (stable, so stock's order holds within
        both groups). :meth:`rows_held_at_admission` relies on it: the rows it credits are taken by the first
        candidates of the pass, never by a request that needs a free row."""
        if self.streams:  # a pass over the queue only while sessions exist: ordinary serving pays nothing
            waiting_queue.sort(key=lambda req: not self._borrows_a_kept_row(req))

    def rows_held_at_admission(self, waiting_queue, num_held_rows: int) -> int:
        """Stock's count of held rows (``num_held_rows``: its admitted requests') raised to the queued steps' kept
        rows. Stock counts a row as held only once its request is in the pass's admitted list, since its requests
        borrow a row when they are matched; a queued step borrows its session's kept row, so with every row kept by
        a parked session stock would admit no step and the pool would look stalled. The credited rows are at least
        as many as such steps (they are first in the queue, see :meth:`put_kept_rows_first`)."""
        # Only while sessions exist: stock asks once per admission candidate, so ordinary serving pays nothing.
        waiting = sum(self._borrows_a_kept_row(req) for req in waiting_queue) if self.streams else 0
        return max(num_held_rows, waiting)


def _finish_at_the_next_result(req) -> None:
    """The step ends at its next processed result, as a finished one (its session keeps the KV): its token limit
    becomes that result's token, and stock's abort mechanism (``to_finish``) makes the finish a length one. The
    lowered limit is what stock's overlap loop reads to leave a request whose in-flight result is its last out of
    the next decode batch (``Scheduler._reqs_finishing_inflight``); ``to_finish`` alone is not, and the step then
    paid one more decode forward whose token was dropped."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH

    if isinstance(req.to_finish, FINISH_ABORT):  # already aborted (its session closing): a finish would keep its KV
        return
    last = len(req.output_ids) + 1
    req.sampling_params.max_new_tokens = min(req.sampling_params.max_new_tokens, last)
    req.to_finish = FINISH_LENGTH(length=last)
    logger.info("realtime step %s interrupted after %d tokens", req.rid, len(req.output_ids))


def _grow_encoder(cache, stream: Stream, step: RunningStep) -> None:
    """Rewrite the kept row ``[old encoder | new encoder | text]`` (new encoder slots in whole pages)."""
    kv = stream.slot.kv
    grow = step.encoder_rows - stream.encoder_rows
    if grow <= 0:
        return
    new_slots = cache.token_to_kv_pool_allocator.alloc(grow)
    if new_slots is None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        cache.evict_for_alloc(EvictParams(num_tokens=grow))
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


def _drop_pages_before_window(cache, stream: Stream) -> None:
    """Give back the whole encoder pages that hold only frames before the window; the row becomes ``[kept encoder |
    text]``, the text moving by whole pages (each slot keeps its page offset). Kept vision tokens are numbered
    from the row's new first slot (slot-major: token ``t`` moves to ``t - dropped slots * bands``)."""
    bands, page = ACTIVE_LAYOUT.bands_or_one(), _page_size(cache)
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


# The sessions of this scheduler process. One per process, not per cache as stock's StreamingSession is: two of the
# hooks that consult it reach no cache (the decode retraction order is a static method of the requests; the
# forward's init runs with the model runner).
SCHEDULER_SESSIONS = RealtimeSessions()
