"""Headless Chromium (Debian's package, `make setup` installs it) driven by playwright for the realtime page's tests,
with a fake camera that plays a y4m file the test writes, and a record of the page's socket traffic.

Never playwright's own browser download: ``executable_path`` is the system Chromium. A missing Chromium fails the
test (the browser tests are skipped nowhere).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import av
import pytest

from support.videos import moving_square

CHROMIUM = "/usr/bin/chromium"
# As root (CI and these machines) Chromium needs --no-sandbox; the rest keep a headless run offline and quiet.
FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
]


def chromium_path() -> str:
    path = shutil.which("chromium") or (CHROMIUM if Path(CHROMIUM).exists() else None)
    if path is None:
        pytest.fail("Chromium is not installed: run `make setup` (it installs Debian's chromium package as root)")
    return path


def write_camera_y4m(path: Path, frames: int = 24, fps: int = 8, scale: int = 10) -> Path:
    """A y4m (I420, as Chromium's file capture device reads it) that the fake camera loops: the moving square of
    64x36 pixels, each pixel drawn ``scale`` times as large (640x360 by default), on a never-black background."""
    with av.open(str(path), "w", format="yuv4mpegpipe") as container:
        stream = container.add_stream("rawvideo", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 64 * scale, 36 * scale, "yuv420p"
        for index in range(frames):
            small = moving_square(index + 3, 64, 36)
            picture = av.VideoFrame.from_ndarray(small.repeat(scale, axis=0).repeat(scale, axis=1), format="rgb24")
            container.mux(stream.encode(picture))
        container.mux(stream.encode())
    return path


def launch(playwright, user_data_dir: Path, camera_y4m: Path):
    """A fresh browser context (its own profile directory) on the system Chromium with the fake camera."""
    return playwright.chromium.launch_persistent_context(
        str(user_data_dir),
        executable_path=chromium_path(),
        headless=True,
        args=[*FLAGS, f"--use-file-for-fake-video-capture={camera_y4m}"],
        viewport={"width": 1200, "height": 760},
    )


def chromium_version(context) -> str:
    return context.browser.version if context.browser is not None else context.pages[0].evaluate("navigator.userAgent")


@dataclass
class Traffic:
    """Every WebSocket message of a page, in order: ``("sent" | "received", payload)``, a payload being the decoded
    JSON event of a text message or the bytes of a binary one."""

    messages: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def attach(self, page) -> None:
        page.on("websocket", self._socket)

    def _socket(self, socket) -> None:
        socket.on("framesent", lambda payload: self._add("sent", payload))
        socket.on("framereceived", lambda payload: self._add("received", payload))

    def _add(self, direction: str, payload) -> None:
        decoded = json.loads(payload) if isinstance(payload, str) else bytes(payload)
        with self.lock:
            self.messages.append((direction, decoded))

    def snapshot(self) -> list:
        with self.lock:
            return list(self.messages)

    def events(self, direction: str, kind: str | None = None) -> list[dict]:
        return [
            m for d, m in self.snapshot() if d == direction and isinstance(m, dict) and kind in (None, m.get("type"))
        ]

    def binaries(self) -> list[bytes]:
        return [m for d, m in self.snapshot() if d == "sent" and isinstance(m, bytes)]


def wait_until(page, predicate, timeout_s: float, what: str) -> None:
    """Poll ``predicate()`` (Python, reading the traffic) while the page runs; fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        page.wait_for_timeout(100)
