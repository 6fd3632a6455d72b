"""The ``/v1/video/realtime`` WebSocket layer (mossvl_ascend.realtime.websocket / .protocol) against a fake engine.

FakeEngine and FakeSession below are STAND-INS for the real engine side (they implement session_api's
RealtimeEngine / EngineSession): no model runs. The tests drive the endpoint through starlette's TestClient and
script the engine's outputs from the test thread.
"""

import asyncio
import io
import threading

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image
from starlette.websockets import WebSocketDisconnect

from mossvl_ascend.realtime import session_api as api
from mossvl_ascend.realtime.websocket import mount

pytestmark = pytest.mark.timeout(30)

MAX_FRAME_BYTES = 64 * 1024
URL = "/v1/video/realtime"


# ------------------------------------------------------------------------------------------- stand-in engine


class FakeSession:
    """STAND-IN EngineSession: records pushes; the test emits outputs and marks inputs processed."""

    def __init__(self, loop: asyncio.AbstractEventLoop, emit_ready: bool = True):
        self.loop = loop
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.frames: list = []  # (Frame, prompt)
        self.prompts: list = []  # (prompt, seq_no)
        self.pending = 0
        self.close_calls = 0
        # Backpressure probe: once armed, set when pending_inputs is read while at/over `full_at`.
        self.full_at = None
        self.read_while_full = threading.Event()
        if emit_ready:
            self.outputs.put_nowait(api.Output(api.READY, turn_id=0))

    def push_prompt(self, prompt, seq_no=None):
        self.prompts.append((prompt, seq_no))
        self.pending += 1

    def push_frame(self, frame, prompt=None):
        self.frames.append((frame, prompt))
        self.pending += 1

    @property
    def pending_inputs(self) -> int:
        if self.full_at is not None and self.pending >= self.full_at:
            self.read_while_full.set()
        return self.pending

    async def close(self) -> None:
        self.close_calls += 1
        await asyncio.sleep(0)

    # -- called from the test thread; everything runs on the app's loop
    def emit(self, kind, **fields) -> None:
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, api.Output(kind, **fields))

    def process(self, seq_no, **fields) -> None:
        def step():
            self.pending -= 1
            self.outputs.put_nowait(api.Output(api.PROCESSED, seq_no=seq_no, **fields))

        self.loop.call_soon_threadsafe(step)


class FakeEngine:
    """STAND-IN RealtimeEngine: opens FakeSessions, or refuses with ``refuse``."""

    def __init__(self):
        self.configs: list = []
        self.sessions: list = []
        self.refuse = None
        self.full = None  # refuse at the handshake (check_capacity)

    def capabilities(self) -> dict:
        return {}

    def check_capacity(self, waiting=0):
        if self.full is not None:
            raise self.full

    async def open(self, config):
        self.configs.append(config)
        if self.refuse is not None:
            raise self.refuse
        session = FakeSession(asyncio.get_running_loop())
        self.sessions.append(session)
        return session


# ------------------------------------------------------------------------------------------------ helpers


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def client(engine):
    app = FastAPI()
    mount(app, engine, max_frame_bytes=MAX_FRAME_BYTES, parked_request_timeout_s=30.0)
    with TestClient(app) as test_client:
        yield test_client


def png(color=(255, 0, 0), size=(8, 6)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def configure(ws, **fields):
    """created -> configure -> configured -> ready; returns (created, configured, ready)."""
    created = ws.receive_json()
    ws.send_json({"type": "session.configure", **fields})
    configured = ws.receive_json()
    ready = ws.receive_json()
    return created, configured, ready


def frame_meta(seq_no, timestamp, **fields):
    return {"type": "input.frame", "seq_no": seq_no, "timestamp": timestamp, "mime_type": "image/png", **fields}


def send_frame(ws, seq_no, timestamp, data=None, **fields):
    """input.frame -> ready -> binary -> accepted; returns the accepted event."""
    ws.send_json(frame_meta(seq_no, timestamp, **fields))
    assert ws.receive_json() == {"type": "input.frame.ready", "seq_no": seq_no}
    ws.send_bytes(png() if data is None else data)
    return ws.receive_json()


def assert_error(event, code="invalid_request"):
    assert event["type"] == "error", event
    assert event["code"] == code, event
    assert event["message"]


def probe_nothing_pending(ws):
    """A malformed message is answered at once by the reader; getting that error next proves no other event was
    queued before it."""
    ws.send_text("{probe")
    assert_error(ws.receive_json())


# -------------------------------------------------------------------------------------------------- tests


def test_handshake_order_and_config_mapping(client, engine):
    assert client.get(f"{URL}/capabilities").json() == {"prefill_messages": False}
    with client.websocket_connect(URL) as ws:
        created, configured, ready = configure(ws, prompt="watch", temperature=0.5, input_queue_capacity=3)
        assert created["type"] == "session.created"
        assert created["configure_timeout_s"] == 180.0
        assert created["capabilities"] == ["session.usage"]
        assert created["turn_id"] == 0 and created["model"] == "moss-vl-realtime"
        assert configured["type"] == "session.configured"
        assert configured["max_frame_bytes"] == MAX_FRAME_BYTES
        assert configured["parked_request_timeout_s"] == 30.0
        assert configured["input_queue_capacity"] == 3
        assert configured["max_tokens_per_turn"] == 86400.0
        assert configured["session_id"] == created["session_id"]
        assert ready == {
            "type": "session.ready",
            "session_id": created["session_id"],
            "request_id": created["request_id"],
            "turn_id": 0,
        }
    (config,) = engine.configs
    assert config.prompt == "watch" and config.temperature == 0.5 and config.top_p == 1.0
    assert config.max_new_tokens == 4096
    assert config.max_tokens_per_turn is None  # the unthrottled wire default
    assert config.ignore_eos is False


def test_rate_cap_is_passed_when_set(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws, max_tokens_per_turn=10.0, max_new_tokens=64)
    assert engine.configs[0].max_tokens_per_turn == 10.0
    assert engine.configs[0].max_new_tokens == 64


def test_the_unthrottled_rate_sent_explicitly_is_no_cap(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws, max_tokens_per_turn=86400.0)
    assert engine.configs[0].max_tokens_per_turn is None


def test_frame_round_trip(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws)
        session = engine.sessions[0]
        accepted = send_frame(ws, 0, 0.5)
        assert accepted == {
            "type": "input.frame.accepted",
            "seq_no": 0,
            "timestamp": 0.5,
            "final": False,
            "pending_events": 1,
            "interrupts_current_turn": False,
        }
        ((frame, prompt),) = session.frames
        assert prompt is None
        assert (frame.seq_no, frame.timestamp) == (0, 0.5)
        assert frame.image.mode == "RGB" and frame.image.size == (8, 6)
        assert frame.image.getpixel((0, 0)) == (255, 0, 0)
        session.process(0)
        assert ws.receive_json() == {
            "type": "input.frame.processed",
            "seq_no": 0,
            "timestamp": 0.5,
            "final": False,
            "pending_events": 0,
        }


def test_frame_with_prompt_barges_in(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws)
        session = engine.sessions[0]
        accepted = send_frame(ws, 0, 1.0, prompt="what now?")
        assert accepted["interrupts_current_turn"] is True
        assert session.frames[0][1] == "what now?"
        # A blank prompt on a frame is no prompt.
        assert send_frame(ws, 1, 2.0, prompt="  ")["interrupts_current_turn"] is False
        assert session.frames[1][1] is None


def test_prompt_interrupt_text_and_silence(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws)
        session = engine.sessions[0]
        send_frame(ws, 0, 3.0)
        session.process(0)
        assert ws.receive_json()["type"] == "input.frame.processed"

        ws.send_json({"type": "input.prompt", "seq_no": 1, "prompt": "describe"})
        assert ws.receive_json() == {
            "type": "input.prompt.accepted",
            "seq_no": 1,
            "final": False,
            "pending_events": 1,
            "interrupts_current_turn": True,
        }
        assert session.prompts == [("describe", 1)]

        session.emit(api.INTERRUPTED, turn_id=0, next_turn_id=1, seq_no=1)
        assert ws.receive_json() == {"type": "response.turn.interrupted", "turn_id": 0, "next_turn_id": 1, "seq_no": 1}
        session.process(1)
        assert ws.receive_json() == {
            "type": "input.prompt.processed",
            "seq_no": 1,
            "timestamp": 3.0,  # a prompt is reported at the latest frame's time
            "final": False,
            "pending_events": 0,
            "interrupted_turn_id": 0,
            "turn_id": 1,
        }

        session.emit(api.TEXT, text="A red ", turn_id=1)
        session.emit(api.TEXT, text="card.", turn_id=1)
        assert ws.receive_json() == {"type": "response.text.delta", "delta": "A red ", "turn_id": 1}
        assert ws.receive_json() == {"type": "response.text.delta", "delta": "card.", "turn_id": 1}

        session.emit(api.SILENCE, turn_id=1, seq_no=1)
        assert ws.receive_json() == {
            "type": "response.turn.silence",
            "turn_id": 1,
            "seq_no": 1,
            "timestamp": 3.0,
            "silence_seq": 0,
        }
        session.emit(api.SILENCE, turn_id=1)  # no seq_no from the engine: the last processed input
        silence = ws.receive_json()
        assert (silence["seq_no"], silence["silence_seq"]) == (1, 1)
        # Silence without a final input does not end the session: no response.done follows.
        probe_nothing_pending(ws)
        assert session.close_calls == 0


def test_silence_before_any_input_has_null_seq_no(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws)
        engine.sessions[0].emit(api.SILENCE, turn_id=0)
        assert ws.receive_json() == {
            "type": "response.turn.silence",
            "turn_id": 0,
            "seq_no": None,
            "timestamp": None,
            "silence_seq": 0,
        }


def test_usage_only_when_asked(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws, include_usage=True)
        engine.sessions[0].emit(api.USAGE, usage={"decoder_tokens": 7, "context_remaining": 99})
        assert ws.receive_json() == {"type": "session.usage", "decoder_tokens": 7, "context_remaining": 99}
    with client.websocket_connect(URL) as ws:
        configure(ws)
        engine.sessions[1].emit(api.USAGE, usage={"decoder_tokens": 7})
        probe_nothing_pending(ws)


# -- bad inputs: each gets an error with a code, and the session goes on


def test_malformed_json_and_unknown_type(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws)
        ws.send_text("{not json")
        assert_error(ws.receive_json())
        ws.send_text("[1, 2]")
        assert_error(ws.receive_json())
        ws.send_json({"type": "input.audio", "seq_no": 0})
        assert_error(ws.receive_json())
        ws.send_json({"type": "session.configure"})  # twice
        assert_error(ws.receive_json())
        ws.send_json({**frame_meta(0, 0.0), "extra": 1})  # input events forbid unknown fields too
        assert_error(ws.receive_json())
        assert send_frame(ws, 0, 0.0)["type"] == "input.frame.accepted"


@pytest.mark.parametrize(
    "bad",
    [
        {"top_k": 5},  # extra="forbid"
        {"input_queue_capacity": 0},
        {"input_queue_capacity": 257},
        {"temperature": -1},
        {"max_new_tokens": 0},
        {"benchmark_ignore_eos": True},  # needs server benchmark mode
        {"prefill_messages": [{"role": "user", "content": "hi"}]},  # not advertised by this engine
    ],
)
def test_bad_configure_is_rejected_and_a_good_one_still_works(client, engine, bad):
    with client.websocket_connect(URL) as ws:
        assert ws.receive_json()["type"] == "session.created"
        ws.send_bytes(png())  # a frame before configure
        assert_error(ws.receive_json())
        ws.send_json({"type": "input.prompt", "seq_no": 0, "prompt": "early"})
        assert_error(ws.receive_json())
        ws.send_json({"type": "session.configure", **bad})
        assert_error(ws.receive_json())
        assert engine.configs == []
        ws.send_json({"type": "session.configure"})
        assert ws.receive_json()["type"] == "session.configured"
        assert ws.receive_json()["type"] == "session.ready"


def test_seq_no_must_be_dense_across_frames_and_prompts(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws)
        ws.send_json(frame_meta(1, 0.0))  # gap: 0 expected
        error = ws.receive_json()
        assert_error(error)
        assert error["seq_no"] == 1
        ws.send_json({"type": "input.prompt", "seq_no": 0, "prompt": "hello"})
        assert ws.receive_json()["type"] == "input.prompt.accepted"
        ws.send_json(frame_meta(0, 0.0))  # 0 was taken by the prompt
        assert_error(ws.receive_json())
        ws.send_json({"type": "input.prompt", "seq_no": 5, "prompt": "skip"})
        assert_error(ws.receive_json())
        assert send_frame(ws, 1, 0.0)["seq_no"] == 1
        assert engine.sessions[0].prompts == [("hello", 0)]
        assert len(engine.sessions[0].frames) == 1


def test_timestamp_going_back_is_rejected(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws)
        send_frame(ws, 0, 2.0)
        ws.send_json(frame_meta(1, 1.5))
        assert_error(ws.receive_json())
        ws.send_json(frame_meta(1, -1.0))
        assert_error(ws.receive_json())
        assert send_frame(ws, 1, 2.0)["timestamp"] == 2.0  # equal is fine
        assert len(engine.sessions[0].frames) == 2


def test_undecodable_frame_keeps_its_seq_no_free(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws)
        ws.send_json(frame_meta(0, 0.0))
        assert ws.receive_json()["type"] == "input.frame.ready"
        ws.send_bytes(b"definitely not an image")
        error = ws.receive_json()
        assert_error(error)
        assert error["seq_no"] == 0
        assert engine.sessions[0].frames == []
        assert send_frame(ws, 0, 0.0)["type"] == "input.frame.accepted"


def test_oversize_frame(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws)
        ws.send_json(frame_meta(0, 0.0))
        assert ws.receive_json()["type"] == "input.frame.ready"
        ws.send_bytes(b"\0" * (MAX_FRAME_BYTES + 1))
        assert_error(ws.receive_json(), "frame_too_large")
        assert engine.sessions[0].frames == []
        assert send_frame(ws, 0, 0.0)["type"] == "input.frame.accepted"


def test_binary_without_metadata_and_metadata_twice(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws)
        ws.send_bytes(png())
        assert_error(ws.receive_json())
        ws.send_json(frame_meta(0, 0.0))
        assert ws.receive_json()["type"] == "input.frame.ready"
        ws.send_json(frame_meta(1, 0.0))  # the first frame's bytes are still owed
        assert_error(ws.receive_json())
        ws.send_bytes(png())
        assert ws.receive_json()["type"] == "input.frame.accepted"
        assert engine.sessions[0].frames[0][0].seq_no == 0


def test_backpressure_withholds_ready_until_capacity_frees(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws, input_queue_capacity=1)
        session = engine.sessions[0]
        send_frame(ws, 0, 0.0)  # the one credit is now taken
        session.full_at = 1
        ws.send_json(frame_meta(1, 1.0))
        assert session.read_while_full.wait(5), "the server never checked the full queue"
        probe_nothing_pending(ws)  # ready is withheld
        assert len(session.frames) == 1
        session.process(0)
        processed = ws.receive_json()
        assert (processed["type"], processed["seq_no"]) == ("input.frame.processed", 0)
        assert ws.receive_json() == {"type": "input.frame.ready", "seq_no": 1}
        ws.send_bytes(png())
        assert ws.receive_json()["seq_no"] == 1
        assert len(session.frames) == 2  # nothing dropped


def test_backpressure_applies_to_prompts(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws, input_queue_capacity=1)
        session = engine.sessions[0]
        send_frame(ws, 0, 0.0)
        session.full_at = 1
        ws.send_json({"type": "input.prompt", "seq_no": 1, "prompt": "q"})
        assert session.read_while_full.wait(5)
        probe_nothing_pending(ws)
        assert session.prompts == []
        session.process(0)
        assert ws.receive_json()["type"] == "input.frame.processed"
        assert ws.receive_json()["type"] == "input.prompt.accepted"
        assert session.prompts == [("q", 1)]


@pytest.mark.parametrize("code", ["session_capacity_exceeded", "insufficient_kv_capacity"])
def test_refusal_at_open_closes_with_1013(client, engine, code):
    engine.refuse = api.RealtimeError(code, "no room for one more session")
    with client.websocket_connect(URL) as ws:
        assert ws.receive_json()["type"] == "session.created"
        ws.send_json({"type": "session.configure"})
        error = ws.receive_json()
        assert error == {"type": "error", "code": code, "message": "no room for one more session"}
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        assert closed.value.code == 1013
    assert engine.sessions == []


def test_configure_timeout():
    engine = FakeEngine()
    app = FastAPI()
    mount(app, engine, configure_timeout_s=0.2)
    with TestClient(app).websocket_connect(URL) as ws:
        assert ws.receive_json()["configure_timeout_s"] == 0.2
        ws.send_json({"type": "session.configure", "bogus": 1})  # an invalid configure does not reset the deadline
        assert_error(ws.receive_json())
        assert_error(ws.receive_json(), "configuration_timeout")
        with pytest.raises(WebSocketDisconnect):
            ws.receive_json()
    assert engine.configs == []


# -- ending: session.close() exactly once, however the connection ends


def test_disconnect_mid_turn_closes_once(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws)
        session = engine.sessions[0]
        send_frame(ws, 0, 0.0)
        session.emit(api.TEXT, text="half a sen", turn_id=0)
        assert ws.receive_json()["type"] == "response.text.delta"
    assert session.close_calls == 1


def test_disconnect_while_waiting_for_capacity_closes_once(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws, input_queue_capacity=1)
        session = engine.sessions[0]
        send_frame(ws, 0, 0.0)
        session.full_at = 1
        ws.send_json(frame_meta(1, 1.0))
        assert session.read_while_full.wait(5)
    assert session.close_calls == 1


def test_final_frame_ends_at_next_silence(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws)
        session = engine.sessions[0]
        assert send_frame(ws, 0, 0.0, final=True)["final"] is True
        ws.send_json(frame_meta(1, 1.0))  # nothing after final
        assert_error(ws.receive_json())
        session.emit(api.SILENCE, turn_id=0, seq_no=None)  # a silence before the final frame ran: not the end
        assert ws.receive_json()["type"] == "response.turn.silence"
        session.process(0)
        assert ws.receive_json()["final"] is True
        session.emit(api.TEXT, text="Done.", turn_id=0)
        session.emit(api.SILENCE, turn_id=0, seq_no=0)
        assert ws.receive_json()["type"] == "response.text.delta"
        assert ws.receive_json()["type"] == "response.turn.silence"
        assert ws.receive_json() == {"type": "response.done", "finish_reason": "stop", "turn_id": 0}
        done = ws.receive_json()
        assert done["type"] == "session.done" and done["aborted"] is False
        assert session.close_calls == 1  # freed before session.done went out
        with pytest.raises(WebSocketDisconnect):
            ws.receive_json()
    assert session.close_calls == 1


def test_turn_done_ends_with_length(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws)
        engine.sessions[0].emit(api.TURN_DONE, turn_id=2)
        assert ws.receive_json() == {"type": "response.done", "finish_reason": "length", "turn_id": 2}
        assert ws.receive_json()["type"] == "session.done"
    assert engine.sessions[0].close_calls == 1


def test_client_abort_closes_once(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws)
        ws.send_json({"type": "session.abort"})
        done = ws.receive_json()
        assert done["type"] == "session.done" and done["aborted"] is True
        with pytest.raises(WebSocketDisconnect):
            ws.receive_json()
    assert engine.sessions[0].close_calls == 1


def test_engine_errors(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws)
        session = engine.sessions[0]
        session.emit(api.ERROR, code="invalid_request", message="bad segment")
        assert ws.receive_json() == {"type": "error", "code": "invalid_request", "message": "bad segment"}
        assert send_frame(ws, 0, 0.0)["type"] == "input.frame.accepted"  # a non-fatal error: the session goes on
        session.emit(api.ERROR, code="response_failed", message="kv pool exhausted", fatal=True)
        assert ws.receive_json() == {"type": "error", "code": "response_failed", "message": "kv pool exhausted"}
        done = ws.receive_json()
        assert done["type"] == "session.done" and done["aborted"] is True
        with pytest.raises(WebSocketDisconnect):
            ws.receive_json()
    assert session.close_calls == 1


def test_engine_closed(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws)
        engine.sessions[0].emit(api.CLOSED)
        done = ws.receive_json()
        assert done["type"] == "session.done" and done["aborted"] is False
    assert engine.sessions[0].close_calls == 1


def test_engine_refusing_an_input(client, engine):
    with client.websocket_connect(URL) as ws:
        configure(ws)
        session = engine.sessions[0]

        def refuse(prompt, seq_no=None):
            raise api.RealtimeError("invalid_request", "prompt too long for the context")

        session.push_prompt = refuse
        ws.send_json({"type": "input.prompt", "seq_no": 0, "prompt": "x"})
        assert_error(ws.receive_json())
        assert send_frame(ws, 0, 0.0)["seq_no"] == 0  # the refused prompt did not take seq_no 0


# -- the handshake: a full server refuses before session.created; --api-key guards the socket


def test_a_full_server_refuses_before_session_created(client, engine):
    """The real server (sglang-omni-realtime `serve/video_realtime.py`, `register_video_realtime`): the first event
    is `error{code: session_capacity_exceeded}`, then close 1013; no session is opened."""
    engine.full = api.RealtimeError("session_capacity_exceeded", "no free session slot")
    with client.websocket_connect(URL) as ws:
        assert ws.receive_json() == {
            "type": "error",
            "code": "session_capacity_exceeded",
            "message": "no free session slot",
        }
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        assert closed.value.code == 1013
    assert engine.configs == [] and engine.sessions == []


def test_a_pd_worker_refuses_before_session_created_and_closes_1011(client, engine):
    """A refusal that waiting does not cure (the engine's PD check) is not closed 1013 (try again later)."""
    engine.full = api.RealtimeError("unsupported_deployment", "not on a PD decode worker")
    with client.websocket_connect(URL) as ws:
        assert ws.receive_json() == {
            "type": "error",
            "code": "unsupported_deployment",
            "message": "not on a PD decode worker",
        }
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        assert closed.value.code == 1011
    assert engine.configs == [] and engine.sessions == []


def test_a_connection_not_yet_configured_holds_its_place(engine):
    """Capacity counts the connections between the handshake and `session.configure` (the real server counts a
    session from its handshake): the engine is told how many wait."""
    seen = []
    engine.check_capacity = lambda waiting=0: seen.append(waiting)
    app = FastAPI()
    mount(app, engine)
    with TestClient(app) as test_client:
        with test_client.websocket_connect(URL) as first:
            first.receive_json()
            with test_client.websocket_connect(URL) as second:
                second.receive_json()
    assert seen == [0, 1]


def test_an_invalid_configuration_can_be_retried(client, engine):
    """An engine refusing a configuration with invalid_request (max_new_tokens over the context) leaves the
    connection waiting for another configure."""
    engine.refuse = api.RealtimeError("invalid_request", "max_new_tokens does not fit the context")
    with client.websocket_connect(URL) as ws:
        ws.receive_json()
        ws.send_json({"type": "session.configure", "max_new_tokens": 99999})
        assert_error(ws.receive_json())
        engine.refuse = None
        ws.send_json({"type": "session.configure"})
        assert ws.receive_json()["type"] == "session.configured"
        assert ws.receive_json()["type"] == "session.ready"


KEY = "sk-realtime-test"


def keyed_client(engine, api_key=KEY, admin_api_key=None):
    app = FastAPI()
    mount(app, engine, api_keys=lambda: (api_key, admin_api_key))
    return TestClient(app)


@pytest.mark.parametrize(
    "handshake",
    [
        {},
        {"headers": {"Authorization": "Bearer wrong"}},
        {"headers": {"Authorization": KEY}},  # not a bearer token
        {"subprotocols": ["realtime", "openai-insecure-api-key.wrong"]},
    ],
    ids=["no-key", "wrong-key", "not-bearer", "wrong-browser-key"],
)
def test_a_socket_without_the_key_is_refused_at_the_handshake(engine, handshake):
    with keyed_client(engine) as test_client:
        with pytest.raises(WebSocketDisconnect):
            with test_client.websocket_connect(URL, **handshake) as ws:
                ws.receive_json()
    assert engine.configs == [] and engine.sessions == []


@pytest.mark.parametrize(
    "handshake",
    [{"headers": {"Authorization": f"Bearer {KEY}"}}, {"subprotocols": ["realtime", f"openai-insecure-api-key.{KEY}"]}],
    ids=["header", "browser-subprotocol"],
)
def test_the_right_key_opens_a_session(engine, handshake):
    with keyed_client(engine) as test_client:
        with test_client.websocket_connect(URL, **handshake) as ws:
            configure(ws)
            if "subprotocols" in handshake:
                assert ws.accepted_subprotocol == "realtime"  # a browser needs one of its offers echoed
    assert len(engine.sessions) == 1


def test_admin_key_rules_follow_sglang(engine):
    """sglang's rule for a normal endpoint: with both keys set, the API key opens it (the admin key does not);
    with only the admin key set, a normal endpoint is open."""
    with keyed_client(engine, api_key=KEY, admin_api_key="admin") as test_client:
        with pytest.raises(WebSocketDisconnect):
            with test_client.websocket_connect(URL, headers={"Authorization": "Bearer admin"}) as ws:
                ws.receive_json()
        with test_client.websocket_connect(URL, headers={"Authorization": f"Bearer {KEY}"}) as ws:
            configure(ws)
    with keyed_client(engine, api_key=None, admin_api_key="admin") as test_client:
        with test_client.websocket_connect(URL) as ws:
            configure(ws)
    assert len(engine.sessions) == 2


# -- frame limits


def test_the_advertised_frame_limit_is_below_the_socket_limit(engine):
    """uvicorn (as sglang starts it) closes a WebSocket message larger than its `ws_max_size` (1009) before any
    handler sees it: the advertised `max_frame_bytes` is capped one byte below, so one byte over it still reaches the
    handler and gets `frame_too_large`."""
    import inspect

    import uvicorn

    socket_limit = inspect.signature(uvicorn.Config).parameters["ws_max_size"].default
    app = FastAPI()
    mount(app, engine)  # the real server's 32 MiB asked for
    with TestClient(app).websocket_connect(URL) as ws:
        _, configured, _ = configure(ws)
    assert configured["max_frame_bytes"] == socket_limit - 1 < 32 * 1024 * 1024


def test_a_decompression_bomb_is_refused_from_its_header():
    """A 6000x6000 PNG of a few kilobytes is refused by its header's size against the processor's limit, before
    any pixel is decoded (PIL's own bomb check only starts at 89 megapixels)."""
    from mossvl_ascend.realtime.protocol import ProtocolError, decode_frame

    buffer = io.BytesIO()
    Image.new("L", (6000, 6000), 0).save(buffer, format="PNG", optimize=True)
    with pytest.raises(ProtocolError, match="6000x6000 = 36000000 pixels .* max_input_pixels=4194304") as refused:
        decode_frame(buffer.getvalue(), "image/png", max_pixels=2048 * 2048)
    assert refused.value.code == "invalid_request"
    assert decode_frame(png(size=(2048, 2048)), "image/png", max_pixels=2048 * 2048).size == (2048, 2048)
