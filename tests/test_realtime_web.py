"""The realtime page (`GET /v1/video/realtime/ui`, mossvl_ascend.realtime.web_page and patches.realtime_ui), fast tier:
no sglang server.

Without a browser: the page and its assets with their security headers; public under an API key while the socket,
`/capabilities` and `/v1/chat/completions` still refuse a request without one (sglang's own key middleware, with
the plugin's hook); no external URL in the page's files; the environment switch; the files in the built wheel.

In headless Chromium (support/browser.py) against the real socket layer (`realtime.websocket.mount`) on a
STAND-IN engine (`StandInEngine` below: no model; it records what reaches it and answers with scripted outputs),
the page driven as a user would: the socket traffic the browser records is the oracle for what the page sent.
"""

from __future__ import annotations

import asyncio
import functools
import io
import re
import socket
import subprocess
import sys
import threading
import time
import types
import zipfile
from fractions import Fraction
from pathlib import Path

import av
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image
from playwright.sync_api import sync_playwright
from sglang.srt.utils import auth
from starlette.websockets import WebSocketDisconnect

from mossvl_ascend.patches import realtime_ui
from mossvl_ascend.realtime import session_api as api
from mossvl_ascend.realtime.web_page import PAGE_FILES, PAGE_PATH, UI_ENV, mount_page, security_headers
from mossvl_ascend.realtime.websocket import VIDEO_REALTIME_PATH, mount
from support.browser import Traffic, launch, wait_until, write_camera_y4m
from support.videos import moving_square

pytestmark = pytest.mark.timeout(300)

REPO_ROOT = Path(__file__).resolve().parents[1]
WEB_DIR = REPO_ROOT / "sglang" / "mossvl_ascend" / "realtime" / "web"
KEY = "sk-page-test"
CHAT_PATH = "/v1/chat/completions"


# ------------------------------------------------------------------------------------------- stand-in engine


class StandInSession:
    """STAND-IN for an engine session: frame 0 opens an answer in turn 0 ("watching", which never parks); frames
    after the first question are silent, except while a slow answer streams (a model that is talking does not answer
    a frame with silence); a question interrupts the turn, answers "hello" + " world" in the next turn and reports a
    non-fatal error; a question containing "slowly" answers a word every 0.1 s, never parking."""

    def __init__(self, engine: "StandInEngine"):
        self.engine = engine
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.turn = 0
        self.talking = False
        self.closed = False
        self.loop = asyncio.get_running_loop()
        self.emit(api.READY)
        self.emit(api.USAGE, usage={"decoder_tokens": 12, "encoder_tokens": 0})

    def emit(self, kind: str, **fields) -> None:
        self.outputs.put_nowait(api.Output(kind=kind, turn_id=fields.pop("turn_id", self.turn), **fields))

    def push_frame(self, frame: api.Frame, prompt=None) -> None:
        self.engine.frames.append((frame.seq_no, frame.timestamp, frame.image.size))
        self.emit(api.PROCESSED, seq_no=frame.seq_no)
        if frame.seq_no == 0:
            self.emit(api.TEXT, text="watching")
        elif self.turn > 0 and not self.talking:
            self.emit(api.SILENCE)

    def push_prompt(self, prompt: str, seq_no=None) -> None:
        self.engine.prompts.append((seq_no, prompt))
        self.emit(api.INTERRUPTED, next_turn_id=self.turn + 1, seq_no=seq_no)
        self.turn += 1
        self.emit(api.PROCESSED, seq_no=seq_no, next_turn_id=self.turn, turn_id=self.turn - 1)
        if "slowly" in prompt:
            self.talking = True
            for index in range(600):
                self.loop.call_later(0.1 * index, self._word, index)
            return
        self.emit(api.TEXT, text="hello")
        self.emit(api.TEXT, text=" world")
        self.emit(api.SILENCE)
        self.emit(api.ERROR, code="stand_in_warning", message="a scripted non-fatal error")

    def _word(self, index: int) -> None:
        if not self.closed:
            self.emit(api.TEXT, text=f" w{index}")

    @property
    def pending_inputs(self) -> int:
        return 0

    async def close(self) -> None:
        self.closed = True
        self.engine.closed += 1


class StandInEngine:
    def __init__(self):
        self.full = False
        self.configs: list[api.SessionConfig] = []
        self.frames: list[tuple] = []
        self.prompts: list[tuple] = []
        self.closed = 0

    def capabilities(self) -> dict:
        return {"max_input_pixels": 1 << 20}

    def check_capacity(self, waiting: int = 0) -> None:
        if self.full:
            raise api.RealtimeError("session_capacity_exceeded", "the stand-in holds no more sessions")

    async def open(self, config: api.SessionConfig) -> StandInSession:
        self.configs.append(config)
        return StandInSession(self)


def keyed_app(engine, monkeypatch) -> FastAPI:
    """The socket, the page and a chat route behind sglang's own key middleware, with the plugin's hook on
    ``decide_request_auth`` (as the registry applies it on a served launch)."""
    app = FastAPI()
    mount(app, engine, api_keys=lambda: (KEY, None))
    mount_page(app)

    @app.post(CHAT_PATH)
    async def chat() -> dict:
        return {"ok": True}

    original = auth.decide_request_auth
    monkeypatch.setattr(auth, "decide_request_auth", functools.partial(realtime_ui.page_is_public, original))
    auth.add_api_key_middleware(app, api_key=KEY, admin_api_key=None)
    return app


# ------------------------------------------------------------------------------------------- without a browser


def test_the_page_and_its_assets_answer_with_the_security_headers():
    app = FastAPI()
    mount_page(app)
    client = TestClient(app, base_url="http://127.0.0.1:8123")
    for path, (name, media_type) in PAGE_FILES.items():
        response = client.get(path)
        assert response.status_code == 200, path
        assert response.content == (WEB_DIR / name).read_bytes()
        assert response.headers["content-type"] == media_type
        csp = dict(part.strip().split(" ", 1) for part in response.headers["content-security-policy"].split(";"))
        assert csp["default-src"] == "'none'"
        assert csp["script-src"] == "'self'" and csp["style-src"] == "'self'"
        assert csp["connect-src"] == "'self' ws://127.0.0.1:8123 wss://127.0.0.1:8123"
        assert csp["frame-ancestors"] == "'none'" and csp["base-uri"] == "'none'"
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["referrer-policy"] == "no-referrer"
        assert response.headers["permissions-policy"] == "camera=(self), display-capture=(self), microphone=()"
    assert client.head(PAGE_PATH).status_code == 200
    assert client.get(f"{PAGE_PATH}/other.js").status_code == 404


def test_a_host_header_that_is_not_a_host_is_left_out_of_connect_src():
    assert "connect-src 'self';" in security_headers("evil.example; script-src *")["Content-Security-Policy"]
    assert "ws://[::1]:30000 wss://[::1]:30000" in security_headers("[::1]:30000")["Content-Security-Policy"]


def test_the_page_files_name_no_external_url_and_hold_no_inline_code():
    for path in sorted(WEB_DIR.iterdir()):
        text = path.read_text()
        assert not re.search(r"https?://", text, re.I), path
        assert not re.search(r"""(src|href|url)\s*[=(]\s*["']?//""", text, re.I), path  # protocol-relative
    html = (WEB_DIR / "index.html").read_text()
    assert re.findall(r"<script[^>]*>", html) == ['<script src="ui/app.js" defer>']
    assert re.findall(r"<link[^>]*>", html) == ['<link rel="stylesheet" href="ui/app.css">']
    assert "<style" not in html and " style=" not in html
    assert not re.search(r"<[^>]+\son[a-z]+=", html)  # no inline event handlers
    # Model text goes in as text: no HTML sink anywhere in the script.
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write", (WEB_DIR / "app.js").read_text())


def test_under_an_api_key_the_page_is_public_and_everything_else_is_not(monkeypatch):
    engine = StandInEngine()
    client = TestClient(keyed_app(engine, monkeypatch))
    bearer = {"Authorization": f"Bearer {KEY}"}
    for path in PAGE_FILES:
        assert client.get(path).status_code == 200, path
    assert client.head(PAGE_PATH).status_code == 200
    assert client.post(PAGE_PATH).status_code == 401  # only GET/HEAD of the page's paths are exempt
    assert client.get(f"{PAGE_PATH}/../capabilities").status_code == 401
    assert client.post(CHAT_PATH).status_code == 401
    assert client.post(CHAT_PATH, headers=bearer).status_code == 200
    assert client.get(f"{VIDEO_REALTIME_PATH}/capabilities").status_code == 401
    assert client.get(f"{VIDEO_REALTIME_PATH}/capabilities", headers=bearer).status_code == 200
    with pytest.raises(WebSocketDisconnect):
        with client.websocket_connect(VIDEO_REALTIME_PATH) as ws:
            ws.receive_json()
    with client.websocket_connect(
        VIDEO_REALTIME_PATH, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]
    ) as ws:
        assert ws.receive_json()["type"] == "session.created"


class FakeHttpServer(types.ModuleType):
    """STAND-IN for ``sglang.srt.entrypoints.http_server`` as the launch hook reads it: only its ``app``."""

    def __init__(self):
        super().__init__("sglang.srt.entrypoints.http_server")
        self.app = FastAPI()


def launched(monkeypatch) -> TestClient:
    fake = FakeHttpServer()
    import sglang.srt.entrypoints as entrypoints

    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(entrypoints, "http_server", fake, raising=False)
    realtime_ui.mount_realtime_page()
    realtime_ui.mount_realtime_page()  # a second launch in the process adds nothing
    assert sum(getattr(route, "path", None) == PAGE_PATH for route in fake.app.router.routes) <= 1
    return TestClient(fake.app)


def test_the_switch_turns_the_page_off(monkeypatch):
    monkeypatch.delenv(UI_ENV, raising=False)
    assert launched(monkeypatch).get(PAGE_PATH).status_code == 200
    monkeypatch.setenv(UI_ENV, "0")
    client = launched(monkeypatch)
    assert [client.get(path).status_code for path in PAGE_FILES] == [404, 404, 404]
    monkeypatch.setenv(UI_ENV, "maybe")
    with pytest.raises(ValueError, match=UI_ENV):
        launched(monkeypatch)


def test_the_built_wheel_ships_the_page(tmp_path):
    """A plain `pip install ./sglang` (the NPU hosts' install) builds a wheel: the page must be in it."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
        cwd=REPO_ROOT / "sglang",
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("mossvl_ascend-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name, _ in PAGE_FILES.values():
        assert f"mossvl_ascend/realtime/web/{name}" in names


# ------------------------------------------------------------------------------------------- in Chromium


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def stand_in():
    """The keyed app on uvicorn (127.0.0.1, a free port) in a thread: -> (base URL, engine)."""
    engine = StandInEngine()
    with pytest.MonkeyPatch.context() as monkeypatch:
        app = keyed_app(engine, monkeypatch)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the stand-in server did not start"
            time.sleep(0.05)
        try:
            yield f"http://127.0.0.1:{port}", engine
        finally:
            server.should_exit = True
            thread.join(30)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chromium")
    camera = write_camera_y4m(directory / "camera.y4m")
    with sync_playwright() as playwright:
        context = launch(playwright, directory / "profile", camera)
        try:
            yield context
        finally:
            context.close()


def open_page(browser, base_url: str, key: str):
    page = browser.new_page()
    traffic = Traffic()
    traffic.attach(page)
    page.set_default_timeout(15_000)
    page.goto(f"{base_url}{PAGE_PATH}")
    page.click("#settings summary")
    page.fill("#api-key", key)
    return page, traffic


def inputs_in_order(traffic: Traffic) -> list[dict]:
    return [e for e in traffic.events("sent") if e["type"] in ("input.frame", "input.prompt")]


def frames_in_flight_at_most_one(traffic: Traffic) -> bool:
    """No frame metadata is sent while an earlier frame's input.frame.accepted has not arrived."""
    travelling = None
    for direction, message in traffic.snapshot():
        if not isinstance(message, dict):
            continue
        if direction == "sent" and message["type"] == "input.frame":
            if travelling is not None:
                return False
            travelling = message["seq_no"]
        elif direction == "received" and message["type"] == "input.frame.accepted":
            if message["seq_no"] == travelling:
                travelling = None
    return True


def test_a_session_in_chromium_against_the_stand_in(browser, stand_in):
    """Start sends one configure; the camera's frames arrive as JPEG (long edge <= 512, the 640x360 camera scaled
    to 512x288) with dense seq_no shared with the question, increasing timestamps, one in flight; the question
    reaches the engine and opens a new turn (the interrupted one marked), its deltas render in that turn, the
    error event and the counters show; Stop (the Send button while an answer streams) sends session.abort."""
    base_url, engine = stand_in
    page, traffic = open_page(browser, base_url, KEY)
    assert page.input_value("#fps") == "1"  # the default rate, as the trained setting
    assert page.is_hidden("#secure-note")  # 127.0.0.1 is a secure context: the camera is allowed
    page.select_option("#fps", "2")
    page.click("#start")
    wait_until(page, lambda: len(traffic.events("received", "input.frame.accepted")) >= 3, 30, "3 accepted frames")
    page.fill("#question", "What do you see?")
    page.click("#send")
    wait_until(page, lambda: engine.prompts, 10, "the question at the engine")
    page.wait_for_selector("li.answer:has-text('hello world')", timeout=10_000)
    page.wait_for_selector("#errors li:has-text('stand_in_warning')", timeout=10_000)
    wait_until(page, lambda: len(traffic.events("received", "input.frame.accepted")) >= 5, 30, "5 accepted frames")

    configures = traffic.events("sent", "session.configure")
    assert len(configures) == 1 and traffic.events("sent")[0] is configures[0]
    assert configures[0]["include_usage"] is True and configures[0]["temperature"] == 0
    assert len(engine.configs) == 1 and engine.configs[0].include_usage

    inputs = inputs_in_order(traffic)
    assert [e["seq_no"] for e in inputs] == list(range(len(inputs)))
    frames = [e for e in inputs if e["type"] == "input.frame"]
    stamps = [e["timestamp"] for e in frames]
    assert all(b > a for a, b in zip(stamps, stamps[1:])), stamps
    assert all(e["mime_type"] == "image/jpeg" for e in frames)
    binaries = traffic.binaries()
    assert len(binaries) >= 5 and len(binaries) in (len(frames), len(frames) - 1)  # the last may still be encoding
    for data in binaries:
        assert data[:3] == b"\xff\xd8\xff"
        with Image.open(io.BytesIO(data)) as image:
            assert image.format == "JPEG" and image.size == (512, 288)
    assert frames_in_flight_at_most_one(traffic)
    assert [e["prompt"] for e in inputs if e["type"] == "input.prompt"] == ["What do you see?"]
    prompt_seq = next(e["seq_no"] for e in inputs if e["type"] == "input.prompt")
    assert engine.prompts == [(prompt_seq, "What do you see?")]
    assert [f[0] for f in engine.frames] == [e["seq_no"] for e in frames[: len(engine.frames)]]

    assert page.get_attribute("li.answer:has-text('watching')", "data-turn") == "0"
    assert "interrupted" in page.get_attribute("li.answer[data-turn='0']", "class")
    assert page.text_content("li.answer[data-turn='1']").endswith("hello world")
    assert "interrupted" not in page.get_attribute("li.answer[data-turn='1']", "class")
    assert re.fullmatch(r"\d+ ms", page.text_content("#latency"))
    assert int(page.text_content("#frames-sent")) >= 5 and int(page.text_content("#frames-processed")) >= 5
    assert "decoder_tokens=12" in page.text_content("#usage")
    assert page.locator("li.silent").count() >= 1

    page.fill("#question", "Now talk slowly")
    page.click("#send")
    page.wait_for_selector("li.answer[data-turn='2']:has-text('w3')", timeout=10_000)
    assert page.text_content("#send") == "Stop"
    closed_before = engine.closed
    page.click("#send")
    wait_until(page, lambda: traffic.events("sent", "session.abort"), 10, "session.abort")
    page.wait_for_selector("#status:has-text('session ended (aborted)')", timeout=10_000)
    wait_until(page, lambda: engine.closed == closed_before + 1, 10, "the engine session closed")
    page.close()


def test_a_wrong_key_and_a_full_server_read_as_messages(browser, stand_in):
    base_url, engine = stand_in
    page, traffic = open_page(browser, base_url, "sk-wrong")
    page.click("#start")
    page.wait_for_selector("#status:has-text('refused: API key')", timeout=15_000)
    assert "refused the API key (HTTP 401)" in page.text_content("#errors")
    assert traffic.events("received") == []
    page.close()

    engine.full = True
    try:
        page, traffic = open_page(browser, base_url, KEY)
        page.click("#start")
        page.wait_for_selector("#status:has-text('server full')", timeout=15_000)
        assert "session_capacity_exceeded" in page.text_content("#errors")
        assert "try again in a moment" in page.text_content("#errors")
        assert traffic.events("sent", "session.configure") == []
        page.close()
    finally:
        engine.full = False


def write_webm(path: Path, seconds: int = 3, fps: int = 8, size: tuple[int, int] = (320, 240)) -> Path:
    """A VP8 webm (Chromium plays it) of the moving square."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libvpx", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
        for index in range(seconds * fps):
            picture = av.VideoFrame.from_ndarray(moving_square(index, *size), format="rgb24")
            container.mux(stream.encode(picture))
        container.mux(stream.encode())
    return path


def test_a_video_file_is_the_source_and_its_time_the_clock(browser, stand_in, tmp_path):
    """A local file as the source: its frames go out as they play (timestamps from the file's currentTime, within
    its length, increasing), at its own size (under 512 px, not scaled), and none once it has ended."""
    base_url, _ = stand_in
    video = write_webm(tmp_path / "clip.webm")
    page, traffic = open_page(browser, base_url, KEY)
    page.select_option("#source", "file")
    assert page.is_visible("#file")
    page.set_input_files("#file", str(video))
    page.select_option("#fps", "2")
    page.click("#start")
    wait_until(page, lambda: page.evaluate("() => document.getElementById('video').ended"), 30, "the file's end")
    sent = len(traffic.events("sent", "input.frame"))
    page.wait_for_timeout(1500)  # three more ticks: a file that has ended gives no frame
    frames = traffic.events("sent", "input.frame")
    assert 2 <= sent == len(frames), (sent, len(frames))
    stamps = [e["timestamp"] for e in frames]
    assert all(b > a for a, b in zip(stamps, stamps[1:])) and stamps[-1] <= 3.0 + 0.05, stamps
    assert int(page.text_content("#ticks-skipped")) >= 2
    for data in traffic.binaries():
        with Image.open(io.BytesIO(data)) as image:
            assert image.size == (320, 240)
    page.click("#hangup")
    page.wait_for_selector("#status:has-text('session ended')")
    page.close()
