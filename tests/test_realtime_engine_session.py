"""The engine session's turn logic (`mossvl_ascend.realtime.engine.ServedSession`) and the scheduler's interrupt
hook, each against a labelled stand-in of the other side, with timed turns (the tiny checkpoint's turns end on
<|silence|> within a few tokens; `test_serving_realtime.py` barges into a served turn in benchmark mode instead).

STAND-IN: `StreamingManager` plays sglang's tokenizer manager: it streams a scripted token list for each step
request, one token per `TOKEN_S`, and ends a step after the next token once it receives the interrupt abort (what
the scheduler hook makes the real engine do); with `take_offers`, an interrupt offering prompts that arrives before a
step's first token (its extend) is taken instead, as the scheduler takes it for a step still queued
(`test_realtime_scheduler.py` pins that side). Oracle: the reference session's rules (module docstring of
`moss_vl_reference.realtime_moss_vl`): input arriving mid-turn is drained after the next token; a prompt closes
the turn (a new turn with a fresh token allowance), a frame does not (the allowance continues).
"""

import asyncio
from types import SimpleNamespace

import pytest
from transformers import AutoProcessor

from moss_vl_reference.tiny_checkpoint import build_or_reuse
from mossvl_ascend.patches.realtime_sessions import interrupt_step
from mossvl_ascend.realtime.wire import (
    INTERRUPT_MESSAGE,
    OFFER_TAKEN_KEY,
    USAGE_INFO_KEY,
    parse_interrupt,
    step_rid,
)
from support.realtime import frame_string, noise_image, splice_string

TOKEN_S = 0.02
LIMIT = 12


@pytest.fixture(scope="module")
def processor():
    return AutoProcessor.from_pretrained(build_or_reuse("tiny-realtime"), trust_remote_code=True)


class StreamingManager:
    """STAND-IN for sglang's TokenizerManager (see the module docstring)."""

    def __init__(self, processor, turns: list[list[int]], take_offers: bool = False):
        self.mm_processor = SimpleNamespace(_processor=processor)
        self.model_config = SimpleNamespace(
            hf_config=SimpleNamespace(architectures=["MossVLForConditionalGeneration"]),
            vocab_size=len(processor.tokenizer),
        )
        self.context_len = 4096
        self.server_args = SimpleNamespace(max_running_requests=None, disaggregation_mode="null")
        self.turns, self.requests, self.interrupts = list(turns), [], set()
        self.outputs: list[list[int]] = []  # the tokens each step request yielded
        self.take_offers, self.offers = take_offers, {}  # rid -> the prompts its interrupt offered

    def _dispatch_to_scheduler(self, request):
        is_interrupt, offer = parse_interrupt(request.abort_message)
        assert is_interrupt
        if offer is not None:
            self.offers[request.rid] = offer
        self.interrupts.add(request.rid)

    def abort_request(self, rid):
        self.interrupts.add(rid)

    async def generate_request(self, request, _):
        self.requests.append(request)
        tokens = self.turns.pop(0) if self.turns else [0]
        limit = request.sampling_params["max_new_tokens"]
        ids, stop_after, taken = [], None, 0
        for token in tokens:
            await asyncio.sleep(TOKEN_S)
            if not ids and self.take_offers and request.rid in self.offers:  # offered during the extend: taken
                self.interrupts.discard(request.rid)
                taken, limit = len(self.offers[request.rid].rows), self.offers[request.rid].max_new_tokens
            ids.append(token)
            if stop_after is None and request.rid in self.interrupts:
                stop_after = len(ids)  # the token generated after the interrupt arrived is the last
            last = stop_after is not None or len(ids) == min(len(tokens), limit)
            meta_info = {"finish_reason": {"type": "length"} if last else None}
            if len(ids) == 1:
                meta_info[USAGE_INFO_KEY] = [{OFFER_TAKEN_KEY: taken}]
            yield {"output_ids": list(ids), "meta_info": meta_info}
            if last:
                self.outputs.append(ids)
                return


async def outputs_until_parked(session, outputs: list) -> None:
    """Collect the session's outputs into ``outputs`` until its turn ends on <|silence|>."""
    while True:
        output = await asyncio.wait_for(session.outputs.get(), 30)
        outputs.append(output)
        if output.kind == "silence":
            return


async def run_barge_in(processor, mid_turn_input: str):
    from mossvl_ascend.realtime.engine import ServedRealtimeEngine
    from mossvl_ascend.realtime.session_api import Frame, SessionConfig

    tokenizer = processor.tokenizer
    silence = tokenizer.convert_tokens_to_ids("<|silence|>")
    words = tokenizer("one two three four five six seven eight nine ten", add_special_tokens=False)["input_ids"]
    manager = StreamingManager(processor, [words + [silence], [words[0], silence]])
    session = await ServedRealtimeEngine(lambda: manager).open(SessionConfig(max_new_tokens=LIMIT))
    kinds = []
    while True:
        output = await asyncio.wait_for(session.outputs.get(), 30)
        kinds.append((output.kind, output.turn_id, output.next_turn_id))
        if output.kind == "text" and len([k for k in kinds if k[0] == "text"]) == 2:
            if mid_turn_input == "prompt":
                session.push_prompt("Stop there.", seq_no=0)
            else:
                session.push_frame(Frame(noise_image(1), 0.0, seq_no=0))
        if output.kind in ("silence", "turn_done") and len(manager.requests) == 2:
            break
    await session.close()
    return manager, kinds, words, silence


def test_a_prompt_mid_turn_barges_in_at_the_next_token(processor):
    manager, kinds, words, silence = asyncio.run(run_barge_in(processor, "prompt"))
    first, second = manager.requests[:2]
    assert first.rid in manager.interrupts
    texts_in_first_turn = [k for k in kinds if k[0] == "text" and k[1] == 0]
    assert 2 <= len(texts_in_first_turn) < len(words), "the turn ended early, after the token following the input"
    assert ("interrupted", 0, 1) in kinds
    names = [k[0] for k in kinds]
    assert names.index("interrupted") < names.index("processed"), "the turn closes before the prompt's step runs"
    expected_rows = processor.tokenizer(splice_string("Stop there."), add_special_tokens=False)["input_ids"]
    # the step carries the token generated last (its K/V are not computed yet), then the prompt's rows
    assert list(second.input_ids) == manager.outputs[0][-1:] + expected_rows
    assert second.sampling_params["max_new_tokens"] == LIMIT, "a prompt opens a turn with a fresh allowance"
    assert kinds[-1][0] == "silence"


def test_a_frame_mid_turn_continues_the_turn(processor):
    manager, kinds, words, _ = asyncio.run(run_barge_in(processor, "frame"))
    first, second = manager.requests[:2]
    assert first.rid in manager.interrupts
    assert not any(k[0] == "interrupted" for k in kinds), "a frame does not close the turn"
    generated_first = len([k for k in kinds if k[0] == "text"]) - 1  # the second step said one word
    assert second.sampling_params["max_new_tokens"] == LIMIT - generated_first, "the turn's allowance continues"


def test_a_frame_travels_in_its_step_request_as_stock_preprocessed_image_data(processor):
    """The step carrying a frame has it as its one ``image_data`` entry in stock's preprocessed form, the patches
    the checkpoint's image processor makes of that image (by the image rule); the step before it carries none."""
    import torch

    manager, _, _, _ = asyncio.run(run_barge_in(processor, "frame"))
    first, second = manager.requests[:2]
    assert first.image_data is None
    (entry,) = second.image_data
    pixels, grid = processor.image_processor.realtime_frame(noise_image(1))
    assert entry["format"] == "processor_output"
    assert torch.equal(entry["pixel_values"], pixels) and entry["grid_thw"].tolist() == [list(grid)]


def test_the_scheduler_hook_ends_a_step_where_the_interrupt_finds_it():
    """Running, just prefilled, queued (not yet extended): each ends at its next processed result, the token of the
    forward under way (a queued one: its extend's). An interrupt that overtook its step (the session is known here)
    waits for it; one for a session this scheduler does not hold is dropped. Any other abort is stock's."""
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    from mossvl_ascend.realtime import sessions as realtime_sessions

    def step(session, n, outputs):
        return SimpleNamespace(
            rid=step_rid(session, n),
            output_ids=outputs,
            finished=lambda: False,
            to_finish=None,
            sampling_params=SimpleNamespace(max_new_tokens=LIMIT),
        )

    running, other, prefilled, queued = step("s1", 3, [5, 6]), step("s2", 1, [5]), step("s3", 1, [7]), step("s5", 2, [])
    running_batch, last_batch = SimpleNamespace(reqs=[running, other]), SimpleNamespace(reqs=[prefilled])
    # Stock's Scheduler.collect_inflight_reqs (pp_size 1): the requests of the running and the last batch (a set).
    scheduler = SimpleNamespace(
        waiting_queue=[queued],
        chunked_req=None,
        collect_inflight_reqs=lambda: [*running_batch.reqs, *last_batch.reqs],
    )
    owned = realtime_sessions.RealtimeSessions()
    owned.streams["s4"] = realtime_sessions.Stream("s4")
    stock = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("mossvl_ascend.patches.realtime_sessions.SCHEDULER_SESSIONS", owned)
        for req in (running, prefilled, queued):
            interrupt_step(
                lambda s, r: stock.append(r), scheduler, AbortReq(rid=req.rid, abort_message=INTERRUPT_MESSAGE)
            )
            assert isinstance(req.to_finish, FINISH_LENGTH) and req.to_finish.length == len(req.output_ids) + 1
            assert req.sampling_params.max_new_tokens == len(req.output_ids) + 1
        assert other.to_finish is None and other.sampling_params.max_new_tokens == LIMIT and not stock
        for rid in (step_rid("s4", 2), step_rid("elsewhere", 2)):
            interrupt_step(lambda s, r: stock.append(r), scheduler, AbortReq(rid=rid, abort_message=INTERRUPT_MESSAGE))
        assert owned.early_interrupts == {"s4": (step_rid("s4", 2), None)} and not stock
        plain = AbortReq(rid=running.rid)
        interrupt_step(lambda s, r: stock.append(r), scheduler, plain)
    assert stock == [plain], "an ordinary abort is stock's"


def test_an_interrupted_step_in_flight_gets_no_further_decode_from_stocks_overlap_loop():
    """Stock's overlap loop builds the next decode batch before it processes the in-flight result, and leaves out
    only the requests that result finishes by their token limit (``Scheduler._reqs_finishing_inflight``, stock's
    code run here): a step interrupted while its extend or decode is in flight is left out (no decode forward whose
    token would be dropped), an uninterrupted step of the same batch is not."""
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler

    from mossvl_ascend.realtime import sessions as realtime_sessions

    class Step:  # hashable by identity, as stock's Req (the loop puts the in-flight requests in a set)
        next_output_finishes_by_length = Req.next_output_finishes_by_length

        def __init__(self, **fields):
            self.__dict__.update(fields)

    def step(session, outputs):
        return Step(
            rid=step_rid(session, 1),
            output_ids=outputs,
            finished=lambda: False,
            to_finish=None,
            beam_group=None,
            sampling_params=SimpleNamespace(max_new_tokens=LIMIT),
        )

    extended, decoding, going_on = step("s1", []), step("s2", [4, 5]), step("s3", [6])
    in_flight = SimpleNamespace(reqs=[extended, decoding, going_on])
    scheduler = SimpleNamespace(
        waiting_queue=[],
        chunked_req=None,
        collect_inflight_reqs=lambda: list(in_flight.reqs),
        enable_skip_finishing_decode=True,
        result_queue=[(in_flight, None)],
    )
    assert Scheduler._reqs_finishing_inflight(scheduler, in_flight) == [], "nothing is finishing before the interrupt"
    with pytest.MonkeyPatch.context() as patch:
        sessions = realtime_sessions.RealtimeSessions()
        patch.setattr("mossvl_ascend.patches.realtime_sessions.SCHEDULER_SESSIONS", sessions)
        for req in (extended, decoding):
            interrupt_step(lambda s, r: None, scheduler, AbortReq(rid=req.rid, abort_message=INTERRUPT_MESSAGE))
    assert Scheduler._reqs_finishing_inflight(scheduler, in_flight) == [extended, decoding]


def test_a_prompt_longer_than_the_context_is_refused_and_the_session_goes_on(processor):
    """Refused at input with `invalid_request` naming both lengths (alone or with a frame, which is then not taken
    either); the session's next prompt is taken."""
    from mossvl_ascend.realtime.engine import ServedRealtimeEngine
    from mossvl_ascend.realtime.session_api import Frame, RealtimeError, SessionConfig

    async def run():
        manager = StreamingManager(processor, [])
        manager.context_len = 64
        session = await ServedRealtimeEngine(lambda: manager).open(SessionConfig(max_new_tokens=LIMIT))
        with pytest.raises(RealtimeError) as refused:
            session.push_prompt("word " * 64, seq_no=0)
        with pytest.raises(RealtimeError, match="does not fit"):
            session.push_frame(Frame(noise_image(1), 0.0, seq_no=1), prompt="word " * 64)
        session.push_prompt("Short one.", seq_no=2)
        pending = session.pending_inputs
        await session.close()
        return refused.value, pending

    error, pending = asyncio.run(run())
    assert error.code == "invalid_request" and "(64)" in error.message and "tokens" in error.message
    assert pending == 1


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_a_pd_worker_refuses_sessions_at_the_handshake_and_at_open_naming_its_role(processor, mode):
    """Oracle: the aggregated stand-in (mode "null") opens the same session; a PD worker refuses it
    with `unsupported_deployment` (no session registered) and a message naming its role and where sessions go."""
    from mossvl_ascend.realtime.engine import ServedRealtimeEngine
    from mossvl_ascend.realtime.session_api import RealtimeError, SessionConfig

    async def run():
        manager = StreamingManager(processor, [])
        engine = ServedRealtimeEngine(lambda: manager)
        await (await engine.open(SessionConfig(max_new_tokens=LIMIT))).close()
        manager.server_args.disaggregation_mode = mode
        sessions = len(engine.sessions)
        with pytest.raises(RealtimeError) as at_handshake:
            engine.check_capacity()
        with pytest.raises(RealtimeError) as at_open:
            await engine.open(SessionConfig(max_new_tokens=LIMIT))
        return [at_handshake.value, at_open.value], len(engine.sessions) - sessions

    refusals, sessions_added = asyncio.run(run())
    for error in refusals:
        assert error.code == "unsupported_deployment", error
        assert f"PD {mode} worker (--disaggregation-mode {mode})" in error.message
        assert "aggregated worker" in error.message and "realtime=true" in error.message
    assert sessions_added == 0


def test_a_prompt_while_parked_announces_its_turn(processor):
    """The real server announces every prompt (sglang-omni-realtime `request_builders.py`, the stream output
    builder: `response.turn.interrupted{turn_id, next_turn_id, seq_no}` then the input's `.processed` with
    `interrupted_turn_id`/`turn_id`), whether the model was speaking or silent; a prompt carried by a frame is
    that frame's event. The answer's text is in the announced turn."""
    from mossvl_ascend.realtime.engine import ServedRealtimeEngine
    from mossvl_ascend.realtime.session_api import Frame, SessionConfig

    tokenizer = processor.tokenizer
    silence = tokenizer.convert_tokens_to_ids("<|silence|>")
    word = tokenizer("yes", add_special_tokens=False)["input_ids"]

    async def run():
        manager = StreamingManager(processor, [[silence], word + [silence], word + [silence]])
        session = await ServedRealtimeEngine(lambda: manager).open(SessionConfig(max_new_tokens=LIMIT))
        outputs = []

        def until_parked():
            return outputs_until_parked(session, outputs)

        await until_parked()
        session.push_prompt("Anything?", seq_no=0)
        await until_parked()
        session.push_frame(Frame(noise_image(1), 0.0, seq_no=1), prompt="And now?")
        await until_parked()
        await session.close()
        return outputs

    outputs = asyncio.run(run())
    seen = [(o.kind, o.seq_no, o.turn_id, o.next_turn_id) for o in outputs if o.kind in ("interrupted", "processed")]
    assert seen == [
        ("interrupted", 0, 0, 1),
        ("processed", 0, 0, 1),
        ("interrupted", 1, 1, 2),
        ("processed", 1, 1, 2),
    ]
    texts = [o.turn_id for o in outputs if o.kind == "text"]
    assert texts == sorted(texts) and set(texts) == {1, 2}


def test_a_pending_extend_holding_a_step_is_processed_before_the_next_batch():
    """The overlap loop's pending result (stock's ``result_queue``) is read before the next batch is built when it is
    an extend holding a realtime step, and ``last_batch`` cleared so the loop finds nothing pending; a decode result,
    an extend of ordinary requests, a loop whose ranks sync per batch, or a scheduler with no session keep stock's
    order (nothing processed early)."""
    from collections import deque

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from mossvl_ascend.realtime import sessions as realtime_sessions

    def scheduler_with(mode, rid, mlp_sync=False):
        batch = SimpleNamespace(forward_mode=mode, reqs=[SimpleNamespace(rid=rid)])
        scheduler = SimpleNamespace(
            result_queue=deque([(batch, "result")]),
            enable_skip_finishing_decode=True,
            require_mlp_sync=mlp_sync,
            last_batch=batch,
            processed=[],
        )
        scheduler.process_batch_result = lambda b, r: scheduler.processed.append((b, r))
        return scheduler, batch

    owned = realtime_sessions.RealtimeSessions()
    owned.streams["s1"] = realtime_sessions.Stream("s1")
    step = step_rid("s1", 2)
    scheduler, batch = scheduler_with(ForwardMode.EXTEND, step)
    owned.process_step_extends_first(scheduler)
    assert scheduler.processed == [(batch, "result")] and not scheduler.result_queue and scheduler.last_batch is None
    for mode, rid, mlp_sync, sessions in (
        (ForwardMode.DECODE, step, False, owned),
        (ForwardMode.EXTEND, "ordinary", False, owned),
        (ForwardMode.EXTEND, step, True, owned),
        (ForwardMode.EXTEND, step, False, realtime_sessions.RealtimeSessions()),
    ):
        scheduler, batch = scheduler_with(mode, rid, mlp_sync)
        sessions.process_step_extends_first(scheduler)
        assert not scheduler.processed and len(scheduler.result_queue) == 1 and scheduler.last_batch is batch


@pytest.mark.parametrize("taken", [True, False], ids=["taken", "refused"])
def test_a_prompt_right_after_a_frame_is_offered_to_its_step(processor, taken):
    """A prompt arriving while the frame's step has not produced its first token (a client sends it once the frame
    is accepted) is offered to that step with the rows and allowance of the turn it opens. Taken: one step carries
    the prompt then the frame, as the reference drains inputs that arrive together (prompts first), and the events
    are those of that drain (the frame processed in the prompt's turn, the turn change, the prompt processed), the
    answer in the new turn. Refused (the step's extend had started): the step is interrupted and the next step
    carries the prompt, as before."""
    from mossvl_ascend.realtime.engine import ServedRealtimeEngine
    from mossvl_ascend.realtime.session_api import Frame, SessionConfig

    tokenizer = processor.tokenizer
    silence = tokenizer.convert_tokens_to_ids("<|silence|>")
    word = tokenizer("yes", add_special_tokens=False)["input_ids"]
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731

    async def run():
        # refused: the frame's step ends on its extend's token (silence here), then the prompt's step answers
        turns = [[silence], word + [silence]] if taken else [[silence], [silence], word + [silence]]
        manager = StreamingManager(processor, turns, take_offers=taken)
        session = await ServedRealtimeEngine(lambda: manager).open(SessionConfig(max_new_tokens=LIMIT))
        outputs = []

        def until_parked():
            return outputs_until_parked(session, outputs)

        await until_parked()
        session.push_frame(Frame(noise_image(1), 0.0, seq_no=0))
        while len(manager.requests) < 2:
            await asyncio.sleep(0.001)
        session.push_prompt("What now?", seq_no=1)
        await until_parked()
        if not taken:
            await until_parked()
        await session.close()
        return manager, session, outputs

    manager, session, outputs = asyncio.run(run())
    prompt_rows = encode(splice_string("What now?"))
    frame_step = manager.requests[1]
    (offer,) = manager.offers.values()
    assert list(manager.offers) == [frame_step.rid] and offer.rows == prompt_rows and offer.max_new_tokens == LIMIT
    frame_rows = encode(frame_string(0.0))
    assert list(frame_step.input_ids) == [silence] + frame_rows
    seen = [(o.kind, o.seq_no, o.turn_id, o.next_turn_id) for o in outputs if o.kind in ("interrupted", "processed")]
    texts = {o.turn_id for o in outputs if o.kind == "text"}
    if taken:
        assert len(manager.requests) == 3  # the initial prefill, the frame's step, the close
        assert session.segments[1][0] == prompt_rows + frame_rows, "the step's rows as drained together"
        assert seen == [("processed", 0, 1, None), ("interrupted", 1, 0, 1), ("processed", 1, 0, 1)]
    else:
        prompt_step = manager.requests[2]
        assert frame_step.rid in manager.interrupts
        assert list(prompt_step.input_ids) == manager.outputs[1][-1:] + prompt_rows
        assert session.segments[1][0] == frame_rows and session.segments[2][0] == prompt_rows
        assert seen == [("processed", 0, 0, None), ("interrupted", 1, 0, 1), ("processed", 1, 0, 1)]
    assert texts == {1}, "the answer is in the prompt's turn"


class GatedManager(StreamingManager):
    """The stand-in behind the plugin's gate on ``TokenizerManager.generate_request`` (``refuse_posing_steps``),
    recording per step request its rid, whether it is a step to the tokenizer's hooks, and whether a client's copy
    of it (the same fields, another object) is."""

    def __init__(self, processor, turns):
        super().__init__(processor, turns)
        self.seen: list[tuple[str, bool, bool]] = []
        self.copies = []

    def generate_request(self, request, raw_request):
        import copy

        from mossvl_ascend.patches.realtime_sessions import refuse_posing_steps
        from mossvl_ascend.realtime.engine import is_engine_step

        self.copies.append(copy.copy(request))
        self.seen.append((request.rid, is_engine_step(request), is_engine_step(self.copies[-1])))
        return refuse_posing_steps(StreamingManager.generate_request, self, request, raw_request)


def test_only_a_sessions_own_step_requests_pass_as_steps(processor):
    """The session's step requests (its initial rows, a frame's, the close) pass the gate as steps; a client's
    request naming one of their rids is refused as a bad request (ValueError: HTTP 400) before anything runs, and
    the same at stock's `/generate` contract check; other requests go to stock."""
    from mossvl_ascend.patches.realtime_sessions import refuse_posing_steps
    from mossvl_ascend.patches.request_validation import reject_realtime_step_rids
    from mossvl_ascend.realtime.engine import ServedRealtimeEngine
    from mossvl_ascend.realtime.session_api import Frame, SessionConfig

    silence = processor.tokenizer.convert_tokens_to_ids("<|silence|>")

    async def session_with_a_frame():
        manager = GatedManager(processor, [[silence], [silence]])
        session = await ServedRealtimeEngine(lambda: manager).open(SessionConfig(max_new_tokens=LIMIT))
        await outputs_until_parked(session, [])
        session.push_frame(Frame(noise_image(1), 0.0))
        await outputs_until_parked(session, [])
        await session.close()
        return manager, session

    async def first_item(requests):
        return await refuse_posing_steps(StreamingManager.generate_request, manager, requests, None).__anext__()

    manager, session = asyncio.run(session_with_a_frame())
    rids = [step_rid(session.session_id, step) for step in (0, 1, "close")]
    assert manager.seen == [(rid, True, False) for rid in rids]
    for posing in manager.copies:
        with pytest.raises(ValueError, match="realtime session steps"):
            asyncio.run(first_item(posing))
    for rid in (rids[0], ["chat-1", rids[1]]):
        assert "realtime session steps" in reject_realtime_step_rids(None, {"rid": rid})
    assert reject_realtime_step_rids(None, {"rid": "chat-1"}) is None
    assert reject_realtime_step_rids("stock's error", {"rid": rids[0]}) == "stock's error"
    assert refuse_posing_steps(lambda manager, obj: "stock", None, SimpleNamespace(rid="chat-1")) == "stock"
