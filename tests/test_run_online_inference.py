"""realtime_inference: sources and pacing, the WebSocket protocol (a recording stand-in session, then the real
tiny model), and the command line end to end.

Oracles: frames decoded independently with PyAV; hand-computed schedules; for model text, the reference
model's own ``offline_generate`` stream over the same frames, timestamps and prompt.
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import os
import queue
import subprocess
import sys
import time
import urllib.request
from argparse import Namespace
from pathlib import Path

import av
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from starlette.testclient import WebSocketDenialResponse
from starlette.websockets import WebSocketDisconnect

from moss_vl_reference.tiny_checkpoint import build_or_reuse
from realtime_inference import run_online_inference as online
from realtime_inference import video_sources
from serving.launch import free_port
from support.cold_prefill import assert_stream_equals_cold

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "realtime_inference" / "run_online_inference.py"
MEDIA = REPO_ROOT / "inference" / "examples" / "media"
CLIP = MEDIA / "moving_dot.mp4"  # 16 frames at 4 fps (inference/examples/make_media.py)
DATASET = REPO_ROOT / "realtime_inference" / "examples" / "dataset.jsonl"


def png_bytes(color=(200, 30, 30), size=(32, 32), fmt="PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format=fmt)
    return buffer.getvalue()


# ------------------------------------------------------------------------------- sources and pacing


def decode_all(path: Path) -> list[tuple[float, np.ndarray]]:
    with av.open(str(path)) as container:
        return [(float(f.time), np.asarray(f.to_image().convert("RGB"))) for f in container.decode(video=0)]


@pytest.mark.parametrize(
    ("fps", "max_frames", "times"),
    [(1.0, 0, [0, 1, 2, 3]), (2.0, 3, [0, 0.5, 1.0]), (4.0, 0, [i / 4 for i in range(16)])],
)
def test_video_file_is_sampled_at_sample_fps(fps, max_frames, times):
    decoded = dict(decode_all(CLIP))
    events = list(video_sources.video_file_frames(CLIP, fps, max_frames))
    assert [e.timestamp for e in events] == pytest.approx(times)
    for event in events:
        assert np.array_equal(np.asarray(event.image), decoded[event.timestamp]), "the frame shown at that time"


def test_missing_and_broken_videos_fail_when_opened(tmp_path):
    with pytest.raises(FileNotFoundError, match="video file not found"):
        video_sources.video_file_frames(tmp_path / "nope.mp4", 1.0)
    (tmp_path / "bad.mp4").write_bytes(b"not a video at all")
    with pytest.raises(ValueError, match="cannot open video"):
        video_sources.video_file_frames(tmp_path / "bad.mp4", 1.0)


def test_camera_and_screen_say_what_is_missing(monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    with pytest.raises(video_sources.SourceUnavailable, match="DISPLAY is not set"):
        video_sources.screen_frames(1.0)
    if not Path("/dev/video7").exists():
        with pytest.raises(video_sources.SourceUnavailable, match="no camera at /dev/video7"):
            video_sources.camera_frames(7, 1.0)


def test_prompts_follow_frames_of_the_same_time():
    frames = [video_sources.FrameEvent(t, Image.new("RGB", (4, 4))) for t in (0.0, 1.0, 2.0)]
    prompts = [video_sources.PromptEvent(1.0, "at one"), video_sources.PromptEvent(0.5, "between")]
    merged = video_sources.merge_by_time(frames, sorted(prompts, key=lambda p: p.timestamp))
    assert [(type(e).__name__, e.timestamp) for e in merged] == [
        ("FrameEvent", 0.0),
        ("PromptEvent", 0.5),
        ("FrameEvent", 1.0),
        ("PromptEvent", 1.0),
        ("FrameEvent", 2.0),
    ]


def training_record(tmp_path: Path) -> Path:
    """An upstream training record (messages + videos[0].segments) around the moving-dot clip."""
    record = {
        "messages": [
            {"role": "system", "content": "You guide a tour."},
            {"role": "user", "content": "<|video|>Describe the scene."},
            {"role": "assistant", "content": "<|video|><|video|>A dot.<|silence|>"},
            {"role": "user", "content": [{"type": "text", "text": "Where is it now?"}]},
            {"role": "assistant", "content": "<|video|>Right side."},
        ],
        "videos": [{"video_path": str(CLIP), "segments": [[0.0, 0.5], [1.0, 1.5], [2.0, 2.5], [3.0, 3.5], 3.5]}],
    }
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(record) + "\n")
    return path


def test_upstream_training_records_replay_the_frame_script_or_every_segment(tmp_path):
    path = training_record(tmp_path)
    decoded = dict(decode_all(CLIP))
    scripted = video_sources.load_dataset_entry(path, 0)
    assert (scripted["system_prompt"], scripted["initial_prompt"]) == ("You guide a tour.", "Describe the scene.")
    events = list(video_sources.dataset_events(scripted, 1.0))
    assert [(type(e).__name__, e.timestamp) for e in events] == [
        ("FrameEvent", 0.0),
        ("FrameEvent", 1.0),
        ("PromptEvent", 1.0),  # after the two frames the first assistant turn shows
        ("FrameEvent", 2.0),
    ]
    assert events[2].text == "Where is it now?"
    assert np.array_equal(np.asarray(events[3].image), decoded[2.0])
    every = list(video_sources.dataset_events(video_sources.load_dataset_entry(path, 0, realtime_template=False), 1.0))
    assert [(type(e).__name__, e.timestamp) for e in every] == [("FrameEvent", t) for t in (0.0, 1.0, 2.0, 3.0, 3.5)]
    assert np.array_equal(np.asarray(every[-1].image), decoded[3.5])


def test_a_frame_folder_streams_in_name_order_with_subtitles_on_frames(tmp_path):
    for name, color in (("b.png", (0, 255, 0)), ("a.png", (255, 0, 0)), ("c.jpg", (0, 0, 255))):
        Image.new("RGB", (16, 16), color).save(tmp_path / name)
    (tmp_path / "notes.txt").write_text("not a frame")
    args = online.parse_args(
        ["--frames-dir", str(tmp_path), "--sample-fps", "2", "--subtitle-at", "0.4=keep the change", "--dry-run"]
    )
    events, _ = online.open_source(args)
    events = list(events)
    assert args.source == "frames"
    assert [(e.timestamp, e.prompt) for e in events] == [(0.0, None), (0.5, "keep the change"), (1.0, None)]
    assert np.asarray(events[0].image)[0, 0].tolist() == [255, 0, 0], "name order: a.png first"


def test_pacing_releases_events_at_timestamp_over_speed():
    now = [100.0]
    slept = []

    def sleep(seconds):
        slept.append(round(seconds, 6))
        now[0] += seconds

    events = [video_sources.PromptEvent(t, "x") for t in (0.0, 0.5, 2.0)]
    released = []
    for event in video_sources.paced(events, 2.0, clock=lambda: now[0], sleep=sleep):
        released.append(round(now[0] - 100.0, 6))
    assert released == [0.0, 0.25, 1.0] and slept == [0.25, 0.75]
    assert len(list(video_sources.paced(events, 0.0, clock=lambda: now[0], sleep=sleep))) == 3 and len(slept) == 2


def test_dataset_entries_resolve_media_and_interleave_prompts():
    entry = video_sources.load_dataset_entry(DATASET, 1)
    events = list(video_sources.dataset_events(entry, 1.0))
    assert [(type(e).__name__, e.timestamp) for e in events] == [
        ("FrameEvent", 0.0),
        ("FrameEvent", 1.0),
        ("PromptEvent", 1.0),
    ]
    assert np.array_equal(np.asarray(events[1].image), np.asarray(Image.open(MEDIA / "stop_sign.png").convert("RGB")))
    with pytest.raises(ValueError, match="out of range"):
        video_sources.load_dataset_entry(DATASET, 5)


# ---------------------------------------------------------------- protocol with a stand-in session


class RecordingSession:
    """Stand-in with only the upstream session API (what the real checkpoints' remote code provides: no
    ``prompt``/``stop``/``abort``): records frames and prompts; each prompt answers with two text pieces naming
    the prompt and the frame count; ``close`` leaves two more pieces queued so that the service must drain them
    before ``session_end``."""

    def __init__(self, frame_queue_size, fail_on_poll=None, fail_turn_on=None):
        self.frames, self.prompts, self.outputs = [], [], queue.Queue()
        self.frame_queue_size, self.fail_on_poll, self.fail_turn_on = frame_queue_size, fail_on_poll, fail_turn_on
        self.started = self.closed = False
        self.polls = 0

    @property
    def active(self):
        return self.started and not self.closed

    @property
    def pending_frames(self):
        return min(len(self.frames), self.frame_queue_size)

    def start(self):
        self.started = True
        return self

    def push_frame(self, image, timestamp):
        self.frames.append((timestamp, np.asarray(image)))
        return len(self.frames) > self.frame_queue_size

    def push_prompt_frame(self, prompt, image, timestamp):
        dropped = self.push_frame(image, timestamp)
        self.push_prompt(prompt)
        return dropped

    def push_prompt(self, text):
        self.prompts.append(text)
        if text == self.fail_turn_on:
            self.outputs.put("[ERROR] ValueError: this turn failed")
            return
        self.outputs.put(f"<{text}|")
        self.outputs.put(f"{len(self.frames)} frames>")

    def poll_output(self, timeout=0.1):
        self.polls += 1
        if self.fail_on_poll is not None and self.outputs.empty() and self.closed:
            raise RuntimeError(self.fail_on_poll)
        try:
            return self.outputs.get(timeout=min(timeout, 0.02))
        except queue.Empty:
            return None

    def close(self, timeout=None):
        if not self.closed:
            self.outputs.put("first queued piece")
            self.outputs.put("final queued piece")
        self.closed = True


class RecordingModel:
    def __init__(self, **session_kwargs):
        self.session_kwargs, self.sessions, self.created_with = session_kwargs, [], []

    def create_realtime_session(self, processor, **kwargs):
        self.created_with.append(kwargs)
        self.sessions.append(RecordingSession(frame_queue_size=kwargs["frame_queue_size"], **self.session_kwargs))
        return self.sessions[-1]


def service_defaults(**overrides) -> Namespace:
    values = dict(
        prompt=None,
        system_prompt=None,
        frame_queue_size=2,
        max_new_tokens=16,
        max_tokens_per_second=0.0,
        frame_window_seconds=None,
        do_sample=False,
        temperature=0.7,
        top_k=20,
        top_p=0.8,
        repetition_penalty=1.0,
        max_frame_bytes=4096,
        sample_fps=2.0,
        playback_speed=0.0,
        max_frames=0,
        media_root=None,
    )
    return Namespace(**{**values, **overrides})


def receive_until(ws, kind: str, limit: int = 200) -> list[dict]:
    """Messages up to and including the first of type ``kind``."""
    messages = []
    for _ in range(limit):
        messages.append(ws.receive_json())
        if messages[-1]["type"] == kind:
            return messages
    raise AssertionError(f"no {kind!r} in {messages}")


def of_type(messages, kind):
    return [m for m in messages if m["type"] == kind]


@pytest.fixture
def service():
    def make(model=None, **overrides):
        model = model or RecordingModel()
        app = online.create_service_app(
            model, processor=object(), defaults=service_defaults(**overrides), metadata={"checkpoint": "stand-in"}
        )
        return model, TestClient(app)

    return make


def test_defaults_without_newer_attributes_are_accepted_as_upstream_builds_them():
    """Upstream's service tests build the defaults namespace without ``frame_window_seconds`` (an attribute this
    runner added later): a start message then opens a session without a frame window."""
    defaults = service_defaults()
    del defaults.frame_window_seconds
    model = RecordingModel()
    app = online.create_service_app(model, processor=object(), defaults=defaults)
    with TestClient(app) as client, client.websocket_connect("/v1/realtime") as ws:
        ws.send_json({"type": "start", "prompt": "hello"})
        assert ws.receive_json() == {"type": "ready"}
        ws.send_json({"type": "stop"})
        receive_until(ws, "session_end")
    assert "frame_window_seconds" not in model.created_with[0]


@pytest.mark.parametrize(
    "credentials, admitted",
    [
        ({}, False),
        ({"headers": {"Authorization": "Bearer wrong"}}, False),
        ({"headers": {"Authorization": "Basic sesame"}}, False),
        ({"headers": {"Authorization": "Bearer sesame"}}, True),
        ({"subprotocols": ["realtime", "openai-insecure-api-key.sesame"]}, True),  # a browser's way
    ],
)
def test_the_api_key_guards_the_service_socket(service, credentials, admitted):
    """With --api-key the handshake itself is refused (HTTP 401, no session created) unless the client presents the
    key as a Bearer header or, as a browser must, in a subprotocol; /health stays open."""
    model, client = service(api_key="sesame")
    with client:
        assert client.get("/health").status_code == 200
        if not admitted:
            with pytest.raises(WebSocketDenialResponse) as refused:
                client.websocket_connect("/v1/realtime", **credentials).__enter__()
            assert refused.value.status_code == 401
            assert model.created_with == []
            return
        with client.websocket_connect("/v1/realtime", **credentials) as ws:
            ws.send_json({"type": "start", "prompt": "hello"})
            assert ws.receive_json() == {"type": "ready"}
            ws.send_json({"type": "stop"})
            receive_until(ws, "session_end")
        assert len(model.created_with) == 1


def test_without_a_key_the_service_socket_is_open(service):
    model, client = service(api_key=None)
    with client, client.websocket_connect("/v1/realtime") as ws:
        ws.send_json({"type": "start", "prompt": "hello"})
        assert ws.receive_json() == {"type": "ready"}
        ws.send_json({"type": "stop"})
        receive_until(ws, "session_end")


class HeaderlessSocket:
    """A service socket as upstream MOSS-VL's own service tests drive the endpoint: no ``headers``, no ``scope``, an
    ``accept()`` without arguments, ``receive_text()`` answering ``start``, a ``receive()`` that never returns."""

    def __init__(self):
        self.messages, self.closed_with = [], []

    async def accept(self):
        pass

    async def receive_text(self):
        return json.dumps({"type": "start"})

    async def receive(self):
        await asyncio.Event().wait()

    async def send_json(self, payload):
        self.messages.append(payload)

    async def close(self, code=None):
        self.closed_with.append(code)


class ScriptedSession:
    """Upstream's session API answering ``poll_output`` from a script (a raised exception is raised); inactive."""

    active, pending_frames = False, 0

    def __init__(self, outcomes):
        self.outcomes = list(outcomes)

    def start(self):
        pass

    def poll_output(self, timeout):
        outcome = self.outcomes.pop(0) if self.outcomes else None
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def close(self, timeout):
        pass


def upstream_defaults() -> Namespace:
    """The settings namespace upstream's service tests build (no key, media root or frame window)."""
    return Namespace(
        decode_batch_size=8, do_sample=False, frame_queue_size=256, max_frame_bytes=20 * 1024 * 1024,
        max_new_tokens=4096, max_tokens_per_second=12, prompt="Describe the video.", repetition_penalty=1.0,
        sample_fps=1.0, system_prompt=None, temperature=0.7, top_k=20, top_p=0.8,
    )  # fmt: skip


@pytest.mark.parametrize(
    "last, ending",
    [
        (None, {"type": "session_end"}),
        (RuntimeError("inference failed"), {"type": "error", "message": "inference failed"}),
    ],
)
def test_a_headerless_socket_gets_every_output_before_the_end_without_a_key(last, ending):
    """Upstream's service tests: with no key configured the endpoint reads nothing from the handshake (their socket
    has no headers), reads ``start`` with ``receive_text``, sends every output, then ``session_end`` or the error,
    and returns (closing the socket) though ``receive`` never answers."""
    model = Namespace(create_realtime_session=lambda *a, **k: ScriptedSession(["first chunk", "final chunk", last]))
    app = online.create_service_app(model, processor=object(), defaults=upstream_defaults())
    endpoint = next(route.endpoint for route in app.routes if getattr(route, "path", None) == "/v1/realtime")
    socket = HeaderlessSocket()
    asyncio.run(asyncio.wait_for(endpoint(socket), 20))
    assert socket.messages == [
        {"type": "ready"},
        {"type": "output", "text": "first chunk"},
        {"type": "output", "text": "final chunk"},
        ending,
    ]
    assert socket.closed_with == [1000]


def test_session_streams_output_and_drains_before_session_end(service):
    model, client = service()
    with client, client.websocket_connect("/v1/realtime") as ws:
        ws.send_json(
            {
                "type": "start",
                "prompt": "hello",
                "system_prompt": "sys",
                "max_new_tokens": 7,
                "max_tokens_per_second": 12,
                "do_sample": True,
                "temperature": 0.5,
                "frame_queue_size": 2,
            }
        )
        assert ws.receive_json() == {"type": "ready"}
        ws.send_json({"type": "ping"})
        assert receive_until(ws, "pong")[-1] == {"type": "pong"}
        for t, color in ((0.0, (255, 0, 0)), (1.0, (0, 255, 0)), (2.0, (0, 0, 255))):
            ws.send_json({"type": "frame", "timestamp": t})
            ws.send_bytes(png_bytes(color))
        acks = of_type(
            receive_until(ws, "frame_ack") + receive_until(ws, "frame_ack") + receive_until(ws, "frame_ack"),
            "frame_ack",
        )
        assert acks == [
            {"type": "frame_ack", "timestamp": 0.0, "dropped_oldest": False, "pending_frames": 1},
            {"type": "frame_ack", "timestamp": 1.0, "dropped_oldest": False, "pending_frames": 2},
            {"type": "frame_ack", "timestamp": 2.0, "dropped_oldest": True, "pending_frames": 2},
        ]
        ws.send_json({"type": "frame", "timestamp": 3.0, "text": "with frame"})  # upstream's other field name
        ws.send_bytes(png_bytes(fmt="JPEG"))
        ws.send_json({"type": "prompt", "text": "what now?"})
        ws.send_json({"type": "stop"})
        messages = receive_until(ws, "session_end")
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        assert closed.value.code == 1000
    session = model.sessions[0]
    assert model.created_with == [
        {
            "initial_prompt": "hello",
            "system_prompt": "sys",
            "frame_queue_size": 2,
            "max_tokens_per_turn": 12.0,
            "max_new_tokens": 7,
            "do_sample": True,
            "temperature": 0.5,
            "top_k": 20,
            "top_p": 0.8,
            "repetition_penalty": 1.0,
        }
    ], "upstream's start fields: max_tokens_per_second is the rate cap, max_new_tokens the generation limit"
    assert [t for t, _ in session.frames] == [0.0, 1.0, 2.0, 3.0]
    assert session.frames[1][1][0, 0].tolist() == [0, 255, 0], "the PNG bytes reach the session decoded"
    assert session.prompts == ["with frame", "what now?"]
    outputs = [m["text"] for m in of_type(messages, "output")]
    assert outputs == [
        "<with frame|",
        "4 frames>",
        "<what now?|",
        "4 frames>",
        "first queued piece",
        "final queued piece",
    ]
    assert messages[-1] == {"type": "session_end"} and of_type(messages, "stopping") == [{"type": "stopping"}]
    assert messages.index({"type": "stopping"}) < messages.index({"type": "output", "text": "final queued piece"})
    assert session.closed


BAD_MESSAGES = [
    ({"type": "dance"}, None, "unknown message type 'dance'"),
    ({"type": "prompt", "text": "   "}, None, "prompt text is empty"),
    ({"type": "prompt"}, None, "prompt text is empty"),
    ({"type": "frame", "timestamp": 1.0}, {"type": "ping"}, "not followed by binary image bytes"),
    (None, png_bytes(), "without a preceding frame header"),
    ({"type": "frame", "timestamp": 1.0}, b"\x89PNG\r\n\x1a\n garbage", "cannot decode frame image"),
    ({"type": "frame", "timestamp": 1.0}, png_bytes(size=(400, 400)) + b"\0" * 5000, "exceeds the 4096-byte limit"),
    ({"type": "frame", "timestamp": 1.0}, png_bytes(fmt="GIF"), "must be JPEG or PNG, got GIF"),
    ({"type": "frame", "timestamp": -1}, None, "'timestamp' must be a number >= 0.0"),
    ({"type": "frame"}, None, "'timestamp' must be a number"),
    ({"type": "frame", "timestamp": 1.0, "prompt": ""}, None, "prompt must be a non-empty string"),
    ({"type": "video", "path": "missing_clip.mp4"}, None, "video file not found"),
    ("{not json", None, "message is not JSON"),
    (["a", "list"], None, "JSON object with a string 'type'"),
    ({"type": "start"}, None, "already started"),
]


@pytest.mark.parametrize(("first", "second", "error"), BAD_MESSAGES)
def test_bad_messages_get_an_error_and_the_session_survives(service, first, second, error):
    model, client = service(media_root=MEDIA)
    with client, client.websocket_connect("/v1/realtime") as ws:
        ws.send_json({"type": "start"})
        assert ws.receive_json() == {"type": "ready"}
        for message in (first, second):
            if isinstance(message, bytes):
                ws.send_bytes(message)
            elif isinstance(message, str):
                ws.send_text(message)
            elif message is not None:
                ws.send_json(message)
        errors = of_type(receive_until(ws, "error"), "error")
        assert error in errors[0]["message"], errors
        # still alive: a good frame and a prompt work, and the session ends normally
        ws.send_json({"type": "frame", "timestamp": 5.0})
        ws.send_bytes(png_bytes())
        assert receive_until(ws, "frame_ack")[-1]["timestamp"] == 5.0
        ws.send_json({"type": "prompt", "text": "still there?"})
        ws.send_json({"type": "stop"})
        outputs = [m["text"] for m in of_type(receive_until(ws, "session_end"), "output")]
    assert "<still there?|" in outputs and model.sessions[0].prompts[-1] == "still there?"
    assert not any(error in str(p) for p in model.sessions[0].prompts)


def test_messages_before_start_are_refused_without_a_session(service):
    model, client = service()
    with client, client.websocket_connect("/v1/realtime") as ws:
        ws.send_json({"type": "prompt", "text": "hi"})
        assert ws.receive_json() == {"type": "error", "message": "send 'start' before 'prompt'"}
        ws.send_bytes(png_bytes())
        assert ws.receive_json() == {"type": "error", "message": "binary message without a preceding frame header"}
        ws.send_json({"type": "start", "max_new_tokens": 0})
        assert "'max_new_tokens' must be a number >= 1" in ws.receive_json()["message"]
        ws.send_json({"type": "start"})
        assert ws.receive_json() == {"type": "ready"}
    assert len(model.sessions) == 1


def test_a_failed_turn_is_an_error_message_and_the_session_goes_on(service):
    model, client = service(RecordingModel(fail_turn_on="break"))
    with client, client.websocket_connect("/v1/realtime") as ws:
        ws.send_json({"type": "start"})
        ws.send_json({"type": "prompt", "text": "break"})
        ws.send_json({"type": "prompt", "text": "fine"})
        ws.send_json({"type": "stop"})
        messages = receive_until(ws, "session_end")
    assert of_type(messages, "error") == [{"type": "error", "message": "ValueError: this turn failed"}]
    assert [m["text"] for m in of_type(messages, "output")][:2] == ["<fine|", "0 frames>"]


def test_session_failure_is_reported_after_every_earlier_output(service):
    model, client = service(RecordingModel(fail_on_poll="inference failed"))
    with client, client.websocket_connect("/v1/realtime") as ws:
        ws.send_json({"type": "start"})
        ws.send_json({"type": "prompt", "text": "q"})
        ws.send_json({"type": "stop"})
        messages = receive_until(ws, "error")
        with pytest.raises(WebSocketDisconnect):  # a fatal error ends the connection too
            ws.receive_json()
        with client.websocket_connect("/v1/realtime") as next_client:
            next_client.send_json({"type": "start"})
            assert next_client.receive_json() == {"type": "ready"}, "the slot is free right after the error"
    tail = [m for m in messages if m["type"] in ("output", "error", "session_end")]
    assert tail == [
        {"type": "output", "text": "<q|"},
        {"type": "output", "text": "0 frames>"},
        {"type": "output", "text": "first queued piece"},
        {"type": "output", "text": "final queued piece"},
        {"type": "error", "message": "inference failed"},
    ]


def test_second_client_is_refused_with_1013_while_a_session_is_active(service):
    model, client = service()
    with client:
        with client.websocket_connect("/v1/realtime") as first:
            first.send_json({"type": "start"})
            assert first.receive_json() == {"type": "ready"}
            assert client.get("/health").json() == {"status": "ok", "busy": True, "checkpoint": "stand-in"}
            with client.websocket_connect("/v1/realtime") as second:
                with pytest.raises(WebSocketDisconnect) as refused:
                    second.receive_json()
            assert refused.value.code == 1013
            first.send_json({"type": "ping"})
            assert receive_until(first, "pong")[-1] == {"type": "pong"}, "the first session is untouched"
        assert client.get("/health").json()["busy"] is False
        with client.websocket_connect("/v1/realtime") as third:  # free again after the first client left
            third.send_json({"type": "start"})
            assert third.receive_json() == {"type": "ready"}
    assert model.sessions[0].closed, "a client that leaves without 'stop' still releases its session"


def test_stop_and_a_disconnect_both_close_the_session(service):
    model, client = service()
    with client:
        for leave_with_stop in (True, False):
            with client.websocket_connect("/v1/realtime") as ws:
                ws.send_json({"type": "start"})
                ws.send_json({"type": "prompt", "text": "still thinking"})
                receive_until(ws, "prompt_ack")
                if leave_with_stop:
                    ws.send_json({"type": "stop"})
                    receive_until(ws, "session_end")
            # the server releases the session in a thread of its own once it notices the client has gone
            deadline = time.monotonic() + 10
            while not model.sessions[-1].closed:
                assert time.monotonic() < deadline, "the session was never released"
                time.sleep(0.01)
    assert [session.closed for session in model.sessions] == [True, True]


def test_after_session_end_the_server_closes_the_socket_and_serves_the_next_client(service):
    """The session ends by itself (the stand-in's stream is closed under it): the server sends session_end, closes
    the socket without waiting for the client, and the one-session slot is free for the next client at once."""
    model, client = service()
    with client:
        with client.websocket_connect("/v1/realtime") as first:
            first.send_json({"type": "start"})
            assert first.receive_json() == {"type": "ready"}
            model.sessions[0].close()
            messages = receive_until(first, "session_end")
            with pytest.raises(WebSocketDisconnect) as closed:
                first.receive_json()
            assert closed.value.code == 1000
            assert [m["text"] for m in of_type(messages, "output")] == ["first queued piece", "final queued piece"]
            with client.websocket_connect("/v1/realtime") as second:  # the first client is still connected
                second.send_json({"type": "start"})
                assert second.receive_json() == {"type": "ready"}
    assert len(model.sessions) == 2


def test_server_side_video_is_streamed_into_the_session(service):
    model, client = service(frame_queue_size=64, media_root=MEDIA)
    with client, client.websocket_connect("/v1/realtime") as ws:
        ws.send_json({"type": "start"})
        ws.send_json({"type": "frame", "timestamp": 10.0})
        ws.send_bytes(png_bytes())
        receive_until(ws, "frame_ack")
        ws.send_json({"type": "video", "path": str(CLIP), "sample_fps": 2.0, "max_frames": 5})
        messages = receive_until(ws, "video_end")
        ws.send_json({"type": "stop_video"})
        messages += receive_until(ws, "stop_video_ack")
        ws.send_json({"type": "stop"})
        receive_until(ws, "session_end")
    assert of_type(messages, "video_started") == [{"type": "video_started", "path": str(CLIP)}]
    assert of_type(messages, "video_end") == [{"type": "video_end", "frames_sent": 5, "frames_dropped": 0}]
    session = model.sessions[0]
    # the video continues the stream's clock after the client's frame at 10 s
    assert [t for t, _ in session.frames] == pytest.approx([10.0, 10.5, 11.0, 11.5, 12.0, 12.5])
    decoded = dict(decode_all(CLIP))
    assert np.array_equal(session.frames[3][1], decoded[1.0])


def test_stop_video_interrupts_a_paced_video(service):
    model, client = service(frame_queue_size=64, media_root=MEDIA)
    with client, client.websocket_connect("/v1/realtime") as ws:
        ws.send_json({"type": "start"})
        ws.send_json(
            {"type": "video", "path": CLIP.name, "sample_fps": 4.0, "playback_speed": 0.5}
        )  # 16 frames over 8 s
        receive_until(ws, "video_started")
        ws.send_json({"type": "frame", "timestamp": 1.0})
        assert "stop_video" in of_type(receive_until(ws, "error"), "error")[0]["message"]
        ws.send_json({"type": "stop_video"})
        messages = receive_until(ws, "stop_video_ack")
        ws.send_json({"type": "stop"})
        receive_until(ws, "session_end")
    (end,) = of_type(messages, "video_end")
    assert end["frames_sent"] < 16, "stop_video ended the 8-second video early"
    assert len(model.sessions[0].frames) == end["frames_sent"]


def test_video_paths_are_refused_without_a_media_root_and_outside_it(service, tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "clip.mp4").symlink_to(CLIP)  # a link inside the root to a file outside it
    (root / "escape").symlink_to(tmp_path)
    requests = {
        None: [(str(CLIP), "start the service with --media-root DIR")],
        root: [
            (str(CLIP), "outside the media root"),
            ("clip.mp4", "outside the media root"),
            ("../media/../" + CLIP.name, "outside the media root"),
            ("escape/media/clip.mp4", "outside the media root"),
            ("/etc/passwd", "outside the media root"),
            ("", "must name a video file"),
            ("missing.mp4", "missing.mp4"),
        ],
    }
    for media_root, attempts in requests.items():
        model, client = service(media_root=media_root)
        with client, client.websocket_connect("/v1/realtime") as ws:
            ws.send_json({"type": "start"})
            for path, message in attempts:
                ws.send_json({"type": "video", "path": path})
                (error,) = of_type(receive_until(ws, "error"), "error")
                assert message in error["message"], (path, error)
            ws.send_json({"type": "ping"})
            assert receive_until(ws, "pong")[-1] == {"type": "pong"}, "the session goes on"
        assert model.sessions[0].frames == []


def test_next_session_output_catches_a_piece_put_as_the_session_ends():
    class LateSession:
        """Stand-in: the worker puts its last piece and exits between the poll and the ``active`` check."""

        def __init__(self):
            self.items, self.active = queue.Queue(), True

        def poll_output(self, timeout):
            if self.active:
                self.items.put("late piece")
                self.active = False
                return None
            try:
                return self.items.get_nowait()
            except queue.Empty:
                return None

    session = LateSession()
    assert online.next_session_output(session, 0.1) == "late piece"
    assert online.next_session_output(session, 0.1) is online.SESSION_ENDED


# --------------------------------------------------------------------------- the real tiny model


@pytest.fixture(scope="module")
def tiny_model():
    checkpoint = build_or_reuse("tiny-realtime")  # its short turns end in <|silence|>, so streams park
    args = online.parse_args(["--checkpoint", str(checkpoint), "--device-map", "cpu", "--dtype", "float32"])
    model, processor, metadata = online.load_realtime_model(args)
    return checkpoint, model, processor, metadata


class CapturingModel:
    """The real model behind the service, keeping each session it creates (with its per-step logits)."""

    def __init__(self, model):
        self.model, self.sessions = model, []

    def create_realtime_session(self, processor, **kwargs):
        self.sessions.append(self.model.create_realtime_session(processor, record_logits=True, **kwargs))
        return self.sessions[-1]


def test_real_model_stream_over_websocket_equals_a_cold_prefill(tiny_model):
    """The service runs the model's stream end to end: what the client receives is what the stream chose (one
    round marker for the prompt), the stream equals a cold prefill of its final sequence, and after stop the
    socket closes."""
    checkpoint, model, processor, metadata = tiny_model
    capturing = CapturingModel(model)
    app = online.create_service_app(
        capturing, processor, service_defaults(max_frame_bytes=1 << 20, frame_queue_size=64), metadata
    )
    colors = [(250, 20, 20), (20, 250, 20), (20, 20, 250)]
    with TestClient(app) as client:
        health = client.get("/health").json()
        assert (health["status"], health["device"], health["attention_implementation"]) == ("ok", "cpu", "sdpa")
        with client.websocket_connect("/v1/realtime") as ws:
            ws.send_json({"type": "start", "max_new_tokens": 10, "do_sample": False})
            assert ws.receive_json() == {"type": "ready"}
            messages = []  # everything the client receives, outputs interleaved with the acks
            for t, color in enumerate(colors):
                ws.send_json({"type": "frame", "timestamp": float(t)})
                ws.send_bytes(png_bytes(color, size=(64, 64)))
                messages += receive_until(ws, "frame_ack")
            ws.send_json({"type": "frame", "timestamp": 2.5})
            ws.send_bytes(b"not an image")
            messages += receive_until(ws, "error")
            assert "cannot decode frame image" in messages[-1]["message"], "a bad frame gets its own error"
            ws.send_json({"type": "prompt", "text": "Which colours appear?"})
            messages += receive_until(ws, "prompt_ack")
            assert capturing.sessions[0].wait_until_parked(60)
            ws.send_json({"type": "stop"})
            messages += receive_until(ws, "session_end")
            with pytest.raises(WebSocketDisconnect):
                ws.receive_json()
    assert len(of_type(messages, "error")) == 1, messages
    session = capturing.sessions[0]
    pieces = [m["text"] for m in messages if m["type"] == "output"]
    assert pieces.count("<|round_start|>") == 1, "one round marker for the one prompt"
    assert "".join(p for p in pieces if p != "<|round_start|>") == processor.tokenizer.decode(session.generated)
    frames = [Image.open(io.BytesIO(png_bytes(c, size=(64, 64)))).convert("RGB") for c in colors]
    assert_stream_equals_cold(model, processor, session, frames)
    assert processor.tokenizer.decode(session.stream.tokens).count("<|image_pad|>") == 3


def run_cli(checkpoint, *flags) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint), *flags]
    completed = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed


def test_cli_streams_a_dataset_entry_and_renders_rounds_and_silence(tiny_model):
    checkpoint = tiny_model[0]
    common = ["--dataset", str(DATASET), "--dataset-index", "1", "--playback-speed", "0", "--max-new-tokens", "8"]
    common += ["--device-map", "cpu", "--dtype", "float32", "--drain-seconds", "5"]
    shown = run_cli(checkpoint, *common, "--show-silence")
    assert "attention implementation: sdpa" in shown.stderr and "fed 2 frames and 1 prompts" in shown.stderr
    assert "[t=   1.00s] > What changed between the two frames?\n" in shown.stdout
    assert "\nAssistant: " in shown.stdout and "[silence]" in shown.stdout
    assert "<|" not in shown.stdout, "control tokens are hidden without --raw-output"
    raw = run_cli(checkpoint, *common, "--raw-output")
    assert "<|round_start|>" in raw.stdout and "<|silence|>" in raw.stdout and "[silence]" not in raw.stdout


def test_upstream_readme_dataset_command_line_runs(tiny_model, tmp_path):
    """Upstream README's dataset command (playback sped up for the test) on an upstream training record."""
    completed = run_cli(
        tiny_model[0],
        "--dataset",
        str(training_record(tmp_path)),
        "--dataset-index",
        "0",
        "--playback-speed",
        "0",
        "--max-frames",
        "256",
        "--max-new-tokens",
        "8",
        "--drain-seconds",
        "3",
        "--device-map",
        "cpu",
        "--dtype",
        "float32",
    )
    assert "fed 3 frames and 1 prompts" in completed.stderr
    assert "[t=   0.00s] > Describe the scene.\n" in completed.stdout
    assert "[t=   1.00s] > Where is it now?\n" in completed.stdout


def test_upstream_readme_command_line_runs(tiny_model):
    """An upstream command line (its flags, including those that only exist upstream) streams a video file."""
    checkpoint = tiny_model[0]
    completed = run_cli(
        checkpoint,
        "--source",
        "video",
        "--video",
        str(CLIP),
        "--sample-fps",
        "2",
        "--max-frames",
        "3",
        "--playback-speed",
        "0",
        "--prompt-frame-first",
        "--max-new-tokens",
        "8",
        "--max-tokens-per-second",
        "200",
        "--drain-seconds",
        "3",
        "--decode-batch-size",
        "8",
        "--monitor-index",
        "1",
        "--no-realtime-template",
        "--temperature",
        "0.7",
        "--top-k",
        "20",
        "--top-p",
        "0.8",
        "--repetition-penalty",
        "1.0",
        "--attention-backend",
        "sdpa",
        "--device-map",
        "cpu",
        "--dtype",
        "float32",
    )
    assert "fed 3 frames and 0 prompts" in completed.stderr
    assert "\nAssistant: " in completed.stdout, "the prompt sent with the first frame opens a round"


def test_cli_drives_a_session_with_only_the_upstream_api(monkeypatch, capsys):
    """The CLI against the stand-in (no wait_until_parked either): frames, the first-frame prompt and a timed
    prompt go through push_prompt_frame/push_frame/push_prompt, output is rendered, the drain ends on quiet and the
    session is closed."""
    model = RecordingModel()
    monkeypatch.setattr(online, "load_realtime_model", lambda args: (model, object(), {}))
    argv = ["--checkpoint", "stand-in", "--source", "synthetic", "--synthetic-duration", "2", "--sample-fps", "2"]
    argv += ["--playback-speed", "0", "--prompt", "first", "--prompt-frame-first", "--prompt-at", "1.0=later"]
    argv += ["--drain-seconds", "0.3", "--max-tokens-per-second", "5"]
    assert online.main(argv) == 0
    session = model.sessions[0]
    assert [t for t, _ in session.frames] == [0.0, 0.5, 1.0, 1.5]
    assert session.prompts == ["first", "later"] and session.closed
    assert model.created_with[0]["initial_prompt"] == "" and model.created_with[0]["max_tokens_per_turn"] == 5.0
    printed = capsys.readouterr().out
    assert "<first|1 frames>" in printed and "<later|3 frames>" in printed and "final queued piece" in printed


def test_cli_reports_a_missing_camera_clearly():
    if Path("/dev/video0").exists():
        pytest.skip("this machine has a camera")
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--source", "camera", "--dry-run"], capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 2 and "no camera at /dev/video0" in completed.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--source", "video", "--dry-run"], "--source video needs --video"),
        (["--sample-fps", "0", "--dry-run"], "--sample-fps must be positive"),
        (["--playback-speed", "-1", "--dry-run"], "--playback-speed must be >= 0"),
        ([], "--checkpoint is required"),
        (["--prompt-at", "soon=hello", "--dry-run"], "expected SECONDS=TEXT"),
        (["--serve", "--dry-run"], "exclude each other"),
        (["--dry-run", "--media-root", "/nonexistent/media"], "is not a folder"),
    ],
)
def test_cli_rejects_bad_arguments(capsys, argv, message):
    with pytest.raises(SystemExit):
        online.parse_args(argv)
    assert message in capsys.readouterr().err


def test_cli_parses_timed_prompts():
    assert online.parse_args(["--prompt-at", "2.5=hi=there", "--dry-run"]).prompt_at == [
        video_sources.PromptEvent(2.5, "hi=there")
    ]


# ------------------------------------------------------------------- the service over real uvicorn


def wait_for_health(port: int, process: subprocess.Popen, deadline_s: float = 180.0) -> dict:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"server exited with {process.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                return json.loads(response.read())
        except OSError:
            time.sleep(0.5)
    raise AssertionError("the service did not answer /health in time")


def test_serve_on_loopback_with_uvicorn(tmp_path):
    """uvicorn needs a WebSocket library (websockets or wsproto). Without one, --serve must say so before loading
    anything; with one, a real client on 127.0.0.1 gets the stream, a second client gets close code 1013, the
    socket closes after session_end, and a client that disconnects frees the slot for the next one."""
    checkpoint = build_or_reuse("tiny-realtime")
    port = free_port()
    command = [
        sys.executable,
        str(SCRIPT),
        "--serve",
        "--checkpoint",
        str(checkpoint),
        "--port",
        str(port),
        "--device-map",
        "cpu",
        "--dtype",
        "float32",
        "--log-level",
        "WARNING",
    ]
    if not any(importlib.util.find_spec(name) for name in ("websockets", "wsproto")):
        completed = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert completed.returncode != 0 and "pip install websockets" in completed.stderr
        return
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        health = wait_for_health(port, process)
        assert (health["status"], health["busy"], health["attention_implementation"]) == ("ok", False, "sdpa")
        with connect(f"ws://127.0.0.1:{port}/v1/realtime") as ws:
            ws.send(json.dumps({"type": "start", "max_new_tokens": 6}))
            assert json.loads(ws.recv(timeout=30)) == {"type": "ready"}
            with connect(f"ws://127.0.0.1:{port}/v1/realtime") as second:
                with pytest.raises(ConnectionClosed) as refused:
                    second.recv(timeout=30)
            assert refused.value.rcvd.code == 1013
            ws.send(json.dumps({"type": "frame", "timestamp": 0.0}))
            ws.send(png_bytes(size=(64, 64)))
            ws.send(json.dumps({"type": "frame", "timestamp": 0.5}))
            ws.send(b"not an image")  # its own error; the stream goes on
            ws.send(json.dumps({"type": "prompt", "text": "What colour is it?"}))
            ws.send(json.dumps({"type": "stop"}))
            messages = []
            while not messages or messages[-1]["type"] != "session_end":
                messages.append(json.loads(ws.recv(timeout=120)))
            with pytest.raises(ConnectionClosed) as closed:  # the server closes right after session_end
                ws.recv(timeout=30)
            assert closed.value.rcvd.code == 1000
        kinds = [m["type"] for m in messages]
        assert "frame_ack" in kinds and "prompt_ack" in kinds and kinds.count("error") == 1, messages
        assert kinds.index("error") < kinds.index("prompt_ack"), "the prompt after the bad frame still went in"
        assert kinds.index("output") < kinds.index("session_end"), messages
        with connect(f"ws://127.0.0.1:{port}/v1/realtime") as leaving:  # served at once; then it just leaves
            leaving.send(json.dumps({"type": "start"}))
            assert json.loads(leaving.recv(timeout=30)) == {"type": "ready"}
        deadline = time.monotonic() + 30
        while wait_for_health(port, process)["busy"]:
            assert time.monotonic() < deadline, "a disconnect did not free the session slot"
            time.sleep(0.2)
        with connect(f"ws://127.0.0.1:{port}/v1/realtime") as after:
            after.send(json.dumps({"type": "start"}))
            assert json.loads(after.recv(timeout=30)) == {"type": "ready"}
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
