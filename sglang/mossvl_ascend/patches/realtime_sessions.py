"""MOSS-VL-Realtime sessions: the hooks that hand a realtime step to `mossvl_ascend.realtime`.

In the scheduler, to the process's :class:`~mossvl_ascend.realtime.sessions.RealtimeSessions` (one growing sequence
per session whose text and vision K/V stay in the pool between steps; the rules live there); in the tokenizer, a
step's multimodal inputs to :func:`mossvl_ascend.realtime.engine.step_processor_output`. Every hook: not a realtime
step -> stock; else one call.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch
from mossvl_ascend.realtime.engine import is_engine_step, posing_step_refusal, step_processor_output
from mossvl_ascend.realtime.sessions import SCHEDULER_SESSIONS
from mossvl_ascend.realtime.wire import names_a_step, parse_interrupt, parse_step_rid


def prepare_step_request(scheduler, req, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook on ``Scheduler._add_request_to_queue``: a realtime step's request becomes the session's whole
    sequence (``[encoder rows | every text row]``) with its multimodal inputs describing the session so far."""
    SCHEDULER_SESSIONS.prepare_step(scheduler, req)


def match_step_prefix(original: Callable, session, params):
    """AROUND ``StreamingSession.try_match_prefix``: a running step lends its session's record."""
    matched = SCHEDULER_SESSIONS.try_match_prefix(session.cache, params.req)
    return original(session, params) if matched is None else matched


def keep_step_kv(original: Callable, session, req) -> bool:
    """AROUND ``StreamingSession.try_cache_finished_req``: a finished step's record stays with its session."""
    return SCHEDULER_SESSIONS.try_cache_finished_req(session.cache, req) or original(session, req)


def skip_step_checkpoint(original: Callable, session, req, *args: Any, **kwargs: Any) -> bool:
    """AROUND ``StreamingSession.try_checkpoint``: a realtime step inserts nothing into the radix tree."""
    return SCHEDULER_SESSIONS.try_checkpoint(req) or original(session, req, *args, **kwargs)


def with_realtime_records(records: dict, cache, *args: Any, **kwargs: Any) -> dict:
    """AFTER ``UnifiedRadixCache.session_records``: the realtime sessions' kept records count as session-held (the
    pool's leak check and ``/v1/loads`` see them as such, not as leaked)."""
    kept = SCHEDULER_SESSIONS.kept_records()
    return {**records, **kept} if kept else records


def heaviest_sessions_retracted_first(order: list[int], reqs, *args: Any, **kwargs: Any) -> list[int]:
    """AFTER ``ScheduleBatch._get_decode_retraction_order``: ordinary requests first, then the heaviest session."""
    return SCHEDULER_SESSIONS.retraction_order(order, reqs)


def evict_a_parked_session_when_stalled(plan, scheduler, *args: Any, **kwargs: Any):
    """AFTER ``Scheduler.get_new_batch_prefill``: a pool stalled by parked sessions frees the heaviest one."""
    SCHEDULER_SESSIONS.evict_a_parked_session_when_stalled(plan, scheduler)
    return plan


def kept_rows_first(result, policy, waiting_queue, *args: Any, **kwargs: Any):
    """AFTER ``SchedulePolicy.calc_priority``: the queued steps that run in their session's kept row go first."""
    SCHEDULER_SESSIONS.put_kept_rows_first(waiting_queue)
    return result


def count_kept_rows_as_allocatable(original: Callable, scheduler, *args: Any, num_held_rows: int = 0, **kwargs: Any):
    """AROUND ``Scheduler.get_num_allocatable_reqs``: the queued steps' kept rows count as held."""
    held = SCHEDULER_SESSIONS.rows_held_at_admission(scheduler.waiting_queue, num_held_rows)
    return original(scheduler, *args, num_held_rows=held, **kwargs)


def step_extend_results_first(scheduler, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``Scheduler.get_next_batch_to_run``: under overlap scheduling a realtime step's extend result is
    processed before the next batch is built."""
    SCHEDULER_SESSIONS.process_step_extends_first(scheduler)


def interrupt_step(original: Callable, scheduler, recv_req, *args: Any, **kwargs: Any):
    """AROUND ``Scheduler.abort_request``: an abort carrying the interrupt marker ends a realtime step now as a
    normal finish (its KV stays with the session), or, when it offers prompts and the step's extend has not started,
    gives the step their rows; any other abort is stock's."""
    is_interrupt, offer = parse_interrupt(getattr(recv_req, "abort_message", None))
    if not is_interrupt or parse_step_rid(recv_req.rid) is None:
        return original(scheduler, recv_req, *args, **kwargs)
    SCHEDULER_SESSIONS.interrupt(scheduler, recv_req.rid, offer)
    return None


async def step_multimodal_inputs(
    original: Callable, processor, image_data=None, *args: Any, request_obj=None, **kwargs: Any
):
    """AROUND MOSS-VL's ``process_mm_data_async``: a realtime step's rows and frames are carried as the session
    made them (the scheduler completes them). A step is the request object a session of this process made, not a
    request that names a step's rid."""
    if not is_engine_step(request_obj):
        return await original(processor, image_data, *args, request_obj=request_obj, **kwargs)
    return step_processor_output(processor, request_obj, image_data)


def refuse_posing_steps(original: Callable, manager, obj, *args: Any, **kwargs: Any):
    """AROUND ``TokenizerManager.generate_request`` (every HTTP API's way to the scheduler): a request naming a
    realtime step's rid that no session of this process made is refused before anything runs."""
    if names_a_step(getattr(obj, "rid", None)) and not is_engine_step(obj):
        return _refusal(posing_step_refusal(obj.rid))
    return original(manager, obj, *args, **kwargs)


async def _refusal(message: str):
    """Raises ``message`` as stock's ``generate_request`` raises a bad request: a ValueError at its first item,
    which every HTTP route answers with 400."""
    raise ValueError(message)
    yield  # unreached: makes this an async generator, as the method it stands for


PATCHES = (
    Patch(
        title="MOSS-VL-Realtime: only the server's own sessions make realtime steps",
        target="sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
        kind=HookType.AROUND,
        hook=refuse_posing_steps,
        platforms=ON_NPU_AND_CPU,
        why=(
            "a step is recognised by its rid; a client's `/generate` or chat request naming one reached the step "
            "hooks: it skipped the media checks and left a parked session holding KV that nothing would close"
        ),
        how=(
            "a request whose rid (or one of a batch's) starts with `mossvl-realtime:` and is not a request object a "
            "session of this process has in flight is refused (ValueError: HTTP 400) before it is tokenized; the "
            "step hooks of the tokenizer recognise a step the same way"
        ),
        upstream="not in sglang",
        remove_when="sglang serves encoder-decoder streaming sessions with growing encoders",
    ),
    Patch(
        title="MOSS-VL-Realtime: a step's multimodal inputs are the session's token ids and patches",
        target="sglang.srt.multimodal.processors.moss_vl.MossVLImageProcessor.process_mm_data_async",
        kind=HookType.AROUND,
        hook=step_multimodal_inputs,
        platforms=ON_NPU_AND_CPU,
        why=(
            "the HF processor would re-tokenize a step's text (the generated token in front of it may not survive "
            "a decode round trip) and compute positions for the step alone, while a step continues its session; "
            "its frames are already patches (by the image rule, as the published realtime loop sizes a frame)"
        ),
        how=(
            "for a step request of this process's sessions (rid `mossvl-realtime:...`): the request's token ids as "
            "they are, and its frames' patches from its "
            "one `image_data` entry in stock's preprocessed form (`format: processor_output`) as multimodal items; "
            "positions are placeholders the scheduler replaces"
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
        title="MOSS-VL-Realtime: an interrupt ends a step when it arrives, keeping its KV, or gives it the prompts",
        target="sglang.srt.managers.scheduler.Scheduler.abort_request",
        kind=HookType.AROUND,
        hook=interrupt_step,
        platforms=ON_NPU_AND_CPU,
        why=(
            "input that arrives while a turn runs is drained after the token under way (a prompt barges in at "
            "once); an abort would free the session's KV, which cannot be rebuilt without the pixels"
        ),
        how=(
            "an AbortReq for a realtime step rid whose `abort_message` is the interrupt marker lowers the step's "
            "token limit to the token under way and sets its `to_finish` to a length finish (queued, chunked or in "
            "flight; one that the interrupt overtook, when it arrives): the forward under way gives its last token, "
            "and stock's overlap loop leaves a request finishing by length out of the next decode batch. Other "
            "aborts go to stock. An interrupt whose message also carries a prompt offer (the prompts' rows and the "
            "turn's token limit) gives a step still in the waiting queue, or not here yet, those rows after its first "
            "row and the limit, laid out again (one extend where the runner drains inputs arriving together in one "
            "forward); a step already in a forward, or one whose session's context cannot hold the prompts' rows "
            "with its own, is interrupted as above, its prompts drained by the next step (refused with "
            "`context_exhausted` if they do not fit there either)"
        ),
        upstream="not in sglang",
        remove_when="sglang serves encoder-decoder streaming sessions with growing encoders",
    ),
    Patch(
        title="MOSS-VL-Realtime: a step's extend result is processed before the next batch is built",
        target="sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
        kind=HookType.BEFORE,
        hook=step_extend_results_first,
        platforms=ON_NPU_AND_CPU,
        why=(
            "stock's overlap loop launches the next batch before it reads the last one's result: a realtime step's "
            "first token (how fast the model reacts to a frame or a prompt) went out one decode forward later, and "
            "a step ending at that token (silence, an interrupt) paid that forward for a token that was dropped"
        ),
        how=(
            "under overlap scheduling without per-batch rank sync, a pending extend result holding a realtime step "
            "is processed before the next batch is built and `last_batch` cleared (the loop then has nothing "
            "pending, as after stock's consecutive-prefill rule); other batches keep stock's order"
        ),
        upstream="not in sglang (stock does the same for two consecutive prefill batches)",
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
