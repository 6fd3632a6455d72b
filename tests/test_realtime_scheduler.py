"""The scheduler side of realtime sessions (`mossvl_ascend.realtime.sessions`, `.step_plan`) on its own: a step's plan
with a frame window, the retraction order under decode memory pressure, and which parked session a stalled pool
evicts. The served tests
(`test_serving_realtime_ws.py`, `test_serving_realtime.py`) run both inside sglang; these pin the rules.

Oracle for the plan: the reference stream's rule written out here (`moss_vl_reference.realtime_moss_vl`
`RealtimeStream.append`): a row sees the frames from the window start in force at it (the one before the step
until the step's new frame j's pad, then the one after frame j) up to the last pad at or before it.
"""

from types import SimpleNamespace

import pytest

from mossvl_ascend.realtime.sessions import RealtimeSessions, RunningStep, Stream
from mossvl_ascend.realtime.step_plan import plan_step
from mossvl_ascend.realtime.wire import RID_PREFIX, parse_step_rid, step_rid

PAD = 9  # the <|image_pad|> id of these plans


@pytest.fixture
def sessions():
    """A scheduler process's realtime sessions, empty."""
    return RealtimeSessions()


def test_a_windowed_plan_gives_each_row_the_window_in_force_at_it():
    rows = [1, 2, PAD, 3, PAD, 4]
    plan = plan_step(rows, [(2, 2), (2, 2)], PAD, 100, 5, window_start=1, window_starts=[2, 4])
    assert plan.visible_frames.tolist() == [5, 5, 6, 6, 7, 7]
    assert plan.first_frames.tolist() == [1, 1, 2, 2, 4, 4]
    assert plan.window_start == 4


def test_an_unwindowed_plan_starts_every_row_at_the_session_start():
    plan = plan_step([1, PAD, 2], [(2, 2)], PAD, 0, 3)
    assert plan.first_frames.tolist() == [0, 0, 0] and plan.window_start == 0


@pytest.mark.parametrize(
    "starts, why",
    [([0, 4], "moves back"), ([2, 7], "drops its own frame"), ([2], "one start for two frames")],
)
def test_window_starts_that_break_the_rule_are_refused(starts, why):
    with pytest.raises(ValueError, match="window starts"):
        plan_step([PAD, PAD], [(2, 2), (2, 2)], PAD, 0, 5, window_start=1, window_starts=starts)


def _step_request(sessions, session: str, held: int):
    rid = step_rid(session, 3)
    stream = Stream(session)
    stream.step = RunningStep(rid, plan=None, encoder_rows=0, vision_tokens=0)
    sessions.streams[session] = stream
    return SimpleNamespace(rid=rid, kv=SimpleNamespace(kv_allocated_len=held, holds_kv=True))


def test_retraction_takes_ordinary_requests_then_the_heaviest_session(sessions):
    """Indices are kept first; retraction pops from the end: ordinary requests (which are queued again) in stock's
    order, then the session holding the most KV."""
    reqs = [
        _step_request(sessions, "aa", 900),
        SimpleNamespace(rid="chat-1", kv=SimpleNamespace(kv_allocated_len=5000, holds_kv=True)),
        _step_request(sessions, "bb", 4000),
        _step_request(sessions, "cc", 100),
        SimpleNamespace(rid="chat-2", kv=SimpleNamespace(kv_allocated_len=10, holds_kv=True)),
    ]
    stock_order = [4, 3, 2, 1, 0]
    order = sessions.retraction_order(stock_order, reqs)
    assert order == [3, 0, 2, 4, 1]
    retracted = [order.pop() for _ in range(3)]
    assert retracted == [1, 4, 2]  # both ordinary requests, then session "bb"


def test_retraction_order_without_sessions_is_stock(sessions):
    reqs = [SimpleNamespace(rid=f"chat-{i}", kv=SimpleNamespace(kv_allocated_len=i, holds_kv=True)) for i in range(3)]
    assert sessions.retraction_order([2, 0, 1], reqs) == [2, 0, 1]


class _KV:
    def __init__(self, held: int):
        self.kv_allocated_len = held
        self.holds_kv = True

    def mark_kv_released(self):
        self.holds_kv = False


class _Cache:
    """The two frees ``release_stream`` makes, recorded."""

    def __init__(self):
        self.freed_slots, self.freed_rows = [], []
        self.req_to_token_pool = SimpleNamespace(free=self.freed_rows.append)

    def free_kv_row(self, kv, spans):
        self.freed_slots.extend(spans)


def _parked(sessions, session: str, held: int):
    stream = Stream(session)
    stream.slot = SimpleNamespace(kv=_KV(held))
    sessions.streams[session] = stream
    return stream


def _pass(admitted=None, running=(), waiting=("chat-1",), chunked=None, free_rows=1):
    cache = _Cache()
    rows = SimpleNamespace(available_size=lambda: free_rows)
    scheduler = SimpleNamespace(
        waiting_queue=list(waiting), chunked_req=chunked, tree_cache=cache, req_to_token_pool=rows
    )
    plan = SimpleNamespace(batch_to_run=admitted, running_batch=SimpleNamespace(is_empty=lambda: not running))
    return plan, scheduler, cache


def test_a_stalled_pool_evicts_the_heaviest_parked_session_only(sessions):
    """Requests wait, none was admitted, none runs: the parked session holding the most KV is freed and its next
    step refused with the reason; a session whose step is queued (not parked) and the lighter ones stay."""
    light, heavy = _parked(sessions, "light", 300), _parked(sessions, "heavy", 2000)
    _step_request(sessions, "stepping", 5000)
    plan, scheduler, cache = _pass()
    sessions.evict_a_parked_session_when_stalled(plan, scheduler)
    assert "heavy" not in sessions.streams and cache.freed_slots == [(0, 2000)] and cache.freed_rows == [heavy.slot]
    assert sessions.streams["light"] is light and "stepping" in sessions.streams
    assert set(sessions.evicted) == {"heavy"}

    reasons = []
    step = SimpleNamespace(
        rid=step_rid("heavy", 4), finished=lambda: False, to_finish=None, set_finish_with_abort=reasons.append
    )
    sessions.prepare_step(SimpleNamespace(tree_cache=cache), step)
    assert len(reasons) == 1 and "evicted under KV memory pressure" in reasons[0]
    assert "heavy" not in sessions.streams and not sessions.evicted


def test_an_eviction_for_want_of_rows_says_so(sessions):
    """Every request row kept by a parked session and an ordinary request waiting: the heaviest parked session goes
    and its reason names the rows, not the KV."""
    _parked(sessions, "light", 300)
    _parked(sessions, "heavy", 2000)
    plan, scheduler, cache = _pass(free_rows=0)
    sessions.evict_a_parked_session_when_stalled(plan, scheduler)
    assert set(sessions.evicted) == {"heavy"} and "light" in sessions.streams
    assert "request-row pressure" in sessions.evicted["heavy"] and "KV memory" not in sessions.evicted["heavy"]


@pytest.mark.parametrize(
    "state",
    [
        {"admitted": SimpleNamespace()},  # a batch runs: room is being made, or was found
        {"running": ("decoding",)},  # a running request will finish and free its KV
        {"waiting": ()},  # nothing needs the KV
        {"chunked": SimpleNamespace()},  # a chunked prefill goes on
    ],
)
def test_no_eviction_unless_the_pool_is_stalled(sessions, state):
    _parked(sessions, "heavy", 2000)
    plan, scheduler, cache = _pass(**state)
    sessions.evict_a_parked_session_when_stalled(plan, scheduler)
    assert "heavy" in sessions.streams and not cache.freed_slots and not sessions.evicted


def test_a_later_step_of_a_session_with_no_kv_is_refused(sessions):
    """A step after the first one for a session this scheduler holds nothing of would run as a new session over
    no context: it is refused."""
    reasons = []
    step = SimpleNamespace(
        rid=step_rid("gone", 2), finished=lambda: False, to_finish=None, set_finish_with_abort=reasons.append
    )
    sessions.prepare_step(SimpleNamespace(tree_cache=_Cache()), step)
    assert reasons == ["realtime session gone holds no KV here"] and "gone" not in sessions.streams


def _admitted(sessions, scheduler, free_rows: int) -> list[str]:
    """One prefill pass over ``scheduler.waiting_queue`` as stock's gate runs it (stop once the admitted list is as
    long as the allocatable rows: the free ones plus those the admitted requests hold), with the rows checked
    independently: a request that does not run in its session's kept row must find a free one."""

    def stock_allocatable(sched, running_bs, num_held_rows=0):
        return free_rows + num_held_rows

    sessions.put_kept_rows_first(scheduler.waiting_queue)
    admitted, free = [], free_rows
    for req in scheduler.waiting_queue:
        held = sum(r.kv.holds_kv for r in admitted)
        held = sessions.rows_held_at_admission(scheduler.waiting_queue, held)
        if len(admitted) >= stock_allocatable(scheduler, 0, num_held_rows=held):
            break
        if req.rid.startswith(RID_PREFIX):
            req.kv = sessions.streams[parse_step_rid(req.rid)[0]].slot.kv  # the borrow stock's match makes
        else:
            assert free > 0, f"{req.rid} was admitted with no free request row"
            free -= 1  # its row is allocated when the batch is built: at admission it holds none
        admitted.append(req)
    return [req.rid for req in admitted]


def _queued_step(sessions, session: str):
    """A parked session (its row kept) whose next step is queued; the step holds nothing until it is matched."""
    stream = _parked(sessions, session, 600)
    rid = step_rid(session, 2)
    stream.step = RunningStep(rid, plan=None, encoder_rows=0, vision_tokens=0)
    return SimpleNamespace(rid=rid, kv=SimpleNamespace(holds_kv=False))


def _ordinary(rid: str):
    return SimpleNamespace(rid=rid, kv=SimpleNamespace(holds_kv=False))


def test_steps_run_in_their_kept_rows_when_no_row_is_free(sessions):
    """Every request row kept by a parked session (as many sessions as ``--max-running-requests``): the queued
    steps are admitted, ahead of an ordinary request queued before them, which waits (no free row)."""
    _parked(sessions, "idle", 600)
    queue = [_ordinary("chat-1"), _queued_step(sessions, "aa"), _ordinary("chat-2"), _queued_step(sessions, "bb")]
    scheduler = SimpleNamespace(waiting_queue=queue)
    assert _admitted(sessions, scheduler, free_rows=0) == [step_rid("aa", 2), step_rid("bb", 2)]


def test_a_free_row_goes_to_the_ordinary_request_after_the_steps(sessions):
    queue = [_ordinary("chat-1"), _queued_step(sessions, "aa"), _ordinary("chat-2")]
    scheduler = SimpleNamespace(waiting_queue=queue)
    assert _admitted(sessions, scheduler, free_rows=1) == [step_rid("aa", 2), "chat-1"]


def test_without_queued_steps_admission_is_stock(sessions):
    _parked(sessions, "idle", 600)
    scheduler = SimpleNamespace(waiting_queue=[_ordinary("chat-1"), _ordinary("chat-2")])
    assert _admitted(sessions, scheduler, free_rows=0) == []
    scheduler = SimpleNamespace(waiting_queue=[_ordinary("chat-1"), _ordinary("chat-2")])
    assert _admitted(sessions, scheduler, free_rows=1) == ["chat-1"]


# -- a prompt offered to a step that has not started its extend --

PENDING, FRAME_ROWS, PROMPT_ROWS = 55, [30, 31, PAD, 32], [40, 41, 42, 43, 44]
KEPT_TEXT = list(range(100, 110))


def _scheduler(waiting=(), in_flight=()):
    hf = SimpleNamespace(image_token_id=PAD, vision_config=SimpleNamespace(spatial_merge_size=2))
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf),
        token_to_kv_pool_allocator=SimpleNamespace(page_size=128),
        max_req_len=4096,
        waiting_queue=list(waiting),
        chunked_req=None,
        collect_inflight_reqs=lambda: list(in_flight),
        tree_cache=_Cache(),
    )


def _continuing_session(sessions, session="s1"):
    """A session with ten kept text rows (positions 0-9) and its last generated token pending."""
    import torch

    stream = Stream(session, text_ids=list(KEPT_TEXT), pending=[PENDING], next_position=len(KEPT_TEXT))
    stream.positions = torch.arange(len(KEPT_TEXT)).expand(3, -1).clone()
    sessions.streams[session] = stream
    return stream


def _frame_step(session="s1", n=4):
    """A step carrying the pending token, then one frame's markup (a 4x4 patch grid: 2x2 merged) and 12 tokens."""
    reasons = []
    mm = SimpleNamespace(mm_items=[SimpleNamespace(grid_thw=[[1, 4, 4]], pad_value=77)], num_image_tokens=None)
    return SimpleNamespace(
        rid=step_rid(session, n),
        origin_input_ids=[PENDING, *FRAME_ROWS],
        multimodal_inputs=mm,
        sampling_params=SimpleNamespace(max_new_tokens=3, custom_params=None),
        return_logprob=False,
        output_ids=[],
        finished=lambda: bool(reasons),
        to_finish=None,
        set_finish_with_abort=reasons.append,
        reasons=reasons,
    )


def _drained_together(rows):
    """Oracle: the session's rows when its prompt and frame are drained in one segment (prompts first, the
    reference's order): one encoder page (the frame's 5 vision tokens, padded), the kept text, then the pending
    token, the prompt, the frame; text positions run on from the kept text's (the frame's 2x2 merged block puts the
    pad 2 past the row before it)."""
    import torch

    ids = [77] * 128 + [*KEPT_TEXT, *rows]
    position = len(KEPT_TEXT)
    positions = []
    for token in rows:
        if token == PAD:
            position += 2  # the merged grid's max(rows, cols): the pad's position
        positions.append(position)
        position += 1
    return ids, torch.tensor(list(range(len(KEPT_TEXT))) + positions)


def _assert_took_the_prompt(req, stream):
    from mossvl_ascend.realtime.wire import OFFER_TAKEN_KEY, USAGE_INFO_KEY

    rows = [PENDING, *PROMPT_ROWS, *FRAME_ROWS]
    ids, positions = _drained_together(rows)
    assert list(req.origin_input_ids) == ids and not req.reasons and req.to_finish is None
    assert req.multimodal_inputs.mrope_positions[0].tolist() == positions.tolist()
    # the prompt's rows see no new frame; the pad row and after see it
    assert req.multimodal_inputs.visible_frame_counts[len(KEPT_TEXT) :].tolist() == [0] * 8 + [1, 1]
    assert req.sampling_params.max_new_tokens == 64, "the step runs as the turn the prompt opens"
    assert req.customized_info[USAGE_INFO_KEY][0][OFFER_TAKEN_KEY] == len(PROMPT_ROWS)
    assert stream.step.plan.rows == rows


def _interrupt(sessions, scheduler, rid, offer):
    from sglang.srt.managers.io_struct import AbortReq

    from mossvl_ascend.patches.realtime_sessions import interrupt_step
    from mossvl_ascend.realtime.wire import interrupt_message

    stock = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("mossvl_ascend.patches.realtime_sessions.SCHEDULER_SESSIONS", sessions)
        interrupt_step(
            lambda s, r: stock.append(r), scheduler, AbortReq(rid=rid, abort_message=interrupt_message(offer))
        )
    assert not stock


def test_a_queued_step_takes_an_offered_prompt_before_its_frame(sessions):
    """The interrupt's offer reaches a step still in the waiting queue: it is laid out again as if the prompt had
    been drained with its frame, and runs as the prompt's turn (not interrupted)."""
    from mossvl_ascend.realtime.wire import PromptOffer

    stream = _continuing_session(sessions)
    req = _frame_step()
    scheduler = _scheduler(waiting=[req])
    sessions.prepare_step(scheduler, req)
    assert list(req.origin_input_ids) == [77] * 128 + [*KEPT_TEXT, PENDING, *FRAME_ROWS]
    _interrupt(sessions, scheduler, req.rid, PromptOffer(PROMPT_ROWS, 64))
    _assert_took_the_prompt(req, stream)


def test_a_step_the_offer_overtook_takes_it_when_it_arrives(sessions):
    from mossvl_ascend.realtime.wire import PromptOffer

    stream = _continuing_session(sessions)
    req = _frame_step()
    scheduler = _scheduler()
    _interrupt(sessions, scheduler, req.rid, PromptOffer(PROMPT_ROWS, 64))
    scheduler.waiting_queue.append(req)
    sessions.prepare_step(scheduler, req)
    _assert_took_the_prompt(req, stream)
    assert not sessions.early_interrupts


@pytest.mark.parametrize("where", ["in flight", "first step", "another step"])
def test_an_offer_a_step_cannot_take_interrupts_it(sessions, where):
    """A step in a forward (its extend under way), a session's first step (its prompt follows the initial rows'
    first token) and an offer for another step than the queued one: the step is interrupted as without an offer,
    its rows untouched; the prompts stay with the session for its next step."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    from mossvl_ascend.realtime.wire import OFFER_TAKEN_KEY, USAGE_INFO_KEY, PromptOffer

    stream = _continuing_session(sessions)
    req = _frame_step()
    if where == "first step":
        stream.pending = []
        req.origin_input_ids = list(FRAME_ROWS)
    scheduler = _scheduler(in_flight=[req]) if where == "in flight" else _scheduler(waiting=[req])
    if where == "another step":
        _interrupt(sessions, scheduler, step_rid("s1", 3), PromptOffer(PROMPT_ROWS, 64))
    sessions.prepare_step(scheduler, req)
    laid_out = list(req.origin_input_ids)
    if where != "another step":
        _interrupt(sessions, scheduler, req.rid, PromptOffer(PROMPT_ROWS, 64))
        assert isinstance(req.to_finish, FINISH_LENGTH) and req.sampling_params.max_new_tokens == 1
    else:
        assert req.to_finish is None, "an interrupt for another step leaves this one alone"
    assert list(req.origin_input_ids) == laid_out and not set(PROMPT_ROWS) & set(laid_out)
    assert req.customized_info[USAGE_INFO_KEY][0][OFFER_TAKEN_KEY] == 0


def _stock_abort(req):
    """STAND-IN for stock's ``Req.set_finish_with_abort`` (``managers/schedule_batch.py``): the request keeps one
    input token (so it skips its prefill) and is finished as an abort with the message."""

    def set_finish_with_abort(message):
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        req.reasons.append(message)
        req.origin_input_ids = [0]
        req.multimodal_inputs = None
        req.to_finish = FINISH_ABORT(message)

    req.set_finish_with_abort = set_finish_with_abort
    req.finished = lambda: False  # stock finishes a request from ``to_finish`` when its next result is processed
    return req


def test_an_offer_that_overfills_the_context_is_declined_and_the_step_runs_its_own_rows(sessions):
    """The step's own rows fit the session's context, with the offered prompt's they do not: the offer is declined
    (the step keeps its layout and is interrupted after its extend, so what it commits is what it computed), and
    the prompt's own step is then refused with ``context_exhausted`` (the client's error). Oracle: the context
    arithmetic written out (one encoder page, the kept text, the step's rows, a token to generate)."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH

    from mossvl_ascend.realtime.wire import CONTEXT_EXHAUSTED, OFFER_TAKEN_KEY, USAGE_INFO_KEY, PromptOffer

    stream = _continuing_session(sessions)
    req = _stock_abort(_frame_step())
    own_rows = [PENDING, *FRAME_ROWS]
    # max_req_len - 1 positions: the frame step (128 + 10 + 5 rows, 1 token) fits, with the prompt's 5 rows not
    scheduler = _scheduler(waiting=[req])
    scheduler.max_req_len = 128 + len(KEPT_TEXT) + len(own_rows) + 1 + 1
    sessions.prepare_step(scheduler, req)
    laid_out = list(req.origin_input_ids)
    assert laid_out == [77] * 128 + [*KEPT_TEXT, *own_rows]
    _interrupt(sessions, scheduler, req.rid, PromptOffer(PROMPT_ROWS, 64))
    assert not req.reasons, "the step was aborted by the prompt it could not take"
    assert list(req.origin_input_ids) == laid_out and stream.step.plan.rows == own_rows
    assert isinstance(req.to_finish, FINISH_LENGTH) and req.sampling_params.max_new_tokens == 1
    assert req.customized_info[USAGE_INFO_KEY][0][OFFER_TAKEN_KEY] == 0

    # The step finishes with one token; the prompt's step (that token, then the prompt) meets a full context.
    stream.step, stream.text_ids, stream.pending = None, [*KEPT_TEXT, *own_rows], [56]
    stream.encoder_rows = 128
    prompt_step = _stock_abort(_frame_step(n=5))
    prompt_step.origin_input_ids, prompt_step.multimodal_inputs = [56, *PROMPT_ROWS], None
    sessions.prepare_step(scheduler, prompt_step)
    assert isinstance(prompt_step.to_finish, FINISH_ABORT) and stream.step is None
    assert prompt_step.reasons[0].startswith(CONTEXT_EXHAUSTED)


def test_an_interrupt_keeps_a_stock_abort_already_pending(sessions):
    """A step that stock already aborts (its session closing, say) stays aborted: the interrupt does not turn the
    abort into a normal finish that would keep its KV."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    _continuing_session(sessions)
    req = _frame_step()
    scheduler = _scheduler(in_flight=[req])
    sessions.prepare_step(scheduler, req)
    req.to_finish = FINISH_ABORT("Aborted")
    _interrupt(sessions, scheduler, req.rid, None)
    assert isinstance(req.to_finish, FINISH_ABORT)


def test_an_interrupt_that_overtakes_a_sessions_first_step_ends_it_when_it_arrives(sessions):
    """The interrupt reaches the scheduler before the session's first step (its request is still being tokenized):
    the step, when it arrives, ends after its extend, as the interrupt asked."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    req = _frame_step(n=0)
    req.origin_input_ids = list(FRAME_ROWS)
    scheduler = _scheduler()
    _interrupt(sessions, scheduler, req.rid, None)
    scheduler.waiting_queue.append(req)
    sessions.prepare_step(scheduler, req)
    assert not req.reasons
    assert isinstance(req.to_finish, FINISH_LENGTH) and req.sampling_params.max_new_tokens == 1
    assert not sessions.early_interrupts


def test_a_closed_sessions_early_interrupt_is_forgotten(sessions):
    """An interrupt recorded for a first step that never arrives is dropped with its session's close."""
    scheduler = _scheduler()
    _interrupt(sessions, scheduler, step_rid("s9", 0), None)
    close = _frame_step("s9", "close")
    sessions.prepare_step(scheduler, close)
    assert not sessions.early_interrupts and close.reasons == ["realtime session closed"]
