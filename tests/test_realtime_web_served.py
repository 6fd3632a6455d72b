"""The realtime page in headless Chromium against a real `python -m sglang.launch_server` serving the tiny
MOSS-VL-Realtime checkpoint (CPU, fp32) with `--api-key`: the page loads without the key, the key typed into it
opens the session, and what the session said equals the reference stream.

Oracle: the reference transformers stream (`support.realtime.reference_generated`) driven by the inputs the page
sent, read back from the socket traffic the browser recorded (each JPEG decoded as the server decodes it, its
timestamp, the question), each pushed while the stream is parked, as the page's inputs were (checked from the same
traffic). Per turn, the text deltas the page received (and shows) equal the reference's tokens decoded.

Then the clock is released and a second session answers the question on the page's real clock: its screenshot
(video and answer, non-blank by pixels, a real first-token latency) goes to build/realtime_web.png, and to the README's
picture assets/realtime_web.png with MOSSVL_UPDATE_SCREENSHOT=1; the committed picture must pass the same check.
"""

from __future__ import annotations

import io
import os
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
import requests
from PIL import Image
from playwright.sync_api import sync_playwright

from moss_vl_reference.tiny_checkpoint import build_or_reuse
from mossvl_ascend.realtime.web_page import PAGE_PATH
from support.browser import Traffic, chromium_version, launch, wait_until, write_camera_y4m
from support.realtime import TURN_LIMIT, reference_generated, turn_texts
from support.serving import load_reference

pytestmark = pytest.mark.timeout(900)

REPO_ROOT = Path(__file__).resolve().parents[1]
README_PICTURE = REPO_ROOT / "assets" / "realtime_web.png"
BUILT_PICTURE = REPO_ROOT / "build" / "realtime_web.png"
KEY = "sk-realtime-page"
SERVER_ARGS = [
    *("--dtype", "float32", "--skip-server-warmup", "--max-total-tokens", "6000", "--context-length", "4096"),
    *("--api-key", KEY),
]
QUESTION = "What is moving?"
CLOCK_START = datetime(2026, 1, 1, tzinfo=timezone.utc)
FRAMES_BEFORE_QUESTION = 2
FRAMES_AFTER_QUESTION = 1


@pytest.fixture(scope="module")
def checkpoint():
    return build_or_reuse("tiny-realtime")


def parked_inputs(traffic: Traffic) -> list[str]:
    """The inputs the page sent while the session was not parked (after an input, a turn must end with
    `response.turn.silence` before the next input for the reference to see the same stream): [] when none."""
    busy, unparked = True, []  # the initial prefill runs until its first silence
    for direction, message in traffic.snapshot():
        if not isinstance(message, dict):
            continue
        kind = message["type"]
        if direction == "sent" and kind in ("input.frame", "input.prompt"):
            if busy:
                unparked.append(f"{kind} {message['seq_no']}")
            busy = True
        elif direction == "received" and kind == "response.turn.silence":
            busy = False
    return unparked


def turns_received(traffic: Traffic) -> list[str]:
    """The deltas the page received, joined per turn (a turn ends at its silence)."""
    turns, current = [], []
    for message in traffic.events("received"):
        if message["type"] == "response.text.delta":
            current.append(message["delta"])
        elif message["type"] == "response.turn.silence":
            turns.append("".join(current))
            current = []
    return [*turns, "".join(current)] if current else turns


def script_sent(traffic: Traffic) -> list[tuple]:
    """The page's inputs as a reference script: each frame's JPEG decoded (as the server decodes it) and its
    timestamp, each question; in seq_no order."""
    binaries = iter(traffic.binaries())
    script = []
    for event in traffic.events("sent"):
        if event["type"] == "input.frame":
            with Image.open(io.BytesIO(next(binaries))) as image:
                script.append(("frame", event["timestamp"], image.convert("RGB")))
        elif event["type"] == "input.prompt":
            script.append(("prompt", event["prompt"]))
    return script


def inked(picture: Image.Image) -> dict:
    """Pixel facts of a screenshot region: distinct colours, spread, and the share of dark (text) pixels."""
    pixels = np.asarray(picture.convert("RGB"), dtype=np.float64)
    luminance = pixels @ np.array([0.299, 0.587, 0.114])
    return {
        "colours": len(np.unique(pixels.reshape(-1, 3), axis=0)),
        "spread": float(luminance.std()),
        "dark_share": float((luminance < 110).mean()),
        "mean": float(luminance.mean()),
    }


def assert_not_blank(screenshot: Path, video_box: dict, turns_box: dict) -> None:
    with Image.open(screenshot) as picture:
        video = inked(picture.crop(_box(video_box)))
        turns = inked(picture.crop(_box(turns_box)))
    # The fake camera's moving square: a grey background with a white square, not a black or empty player.
    assert video["mean"] > 20 and video["spread"] > 10, video
    # The answer panel: white with dark glyphs of text.
    assert turns["colours"] > 20 and 0.002 < turns["dark_share"] < 0.5, turns


def _box(box: dict) -> tuple[int, int, int, int]:
    return (int(box["x"]), int(box["y"]), int(box["x"] + box["width"]), int(box["y"] + box["height"]))


def parked_after(traffic: Traffic, seq_no: int | None) -> bool:
    """Input ``seq_no`` (None: the initial prefill) was processed and a turn ended with silence after it."""
    seen = seq_no is None
    for message in traffic.events("received"):
        if message["type"].endswith(".processed") and message["seq_no"] == seq_no:
            seen = True
        elif seen and message["type"] == "response.turn.silence":
            return True
    return False


@pytest.fixture(scope="module")
def page_session(checkpoint, server_pool, tmp_path_factory):
    """The page driven on the keyed server at 0.5 fps: two frames, the question, one more frame, each input once
    the turn before it parked; then the screenshot and hang-up. The page's timers run on playwright's clock, so a
    frame is taken only when the test moves time on by one interval. -> what the browser recorded and showed."""
    directory = tmp_path_factory.mktemp("chromium")
    camera = write_camera_y4m(directory / "camera.y4m")
    lease = server_pool.lease(checkpoint, SERVER_ARGS, name="realtime-web", ready_timeout_s=600)
    with lease as server, sync_playwright() as playwright:
        unkeyed = {
            "page": requests.get(f"{server.base_url}{PAGE_PATH}", timeout=30).status_code,
            "chat": requests.post(f"{server.base_url}/v1/chat/completions", json={}, timeout=30).status_code,
        }
        context = launch(playwright, directory / "profile", camera)
        try:
            page = context.new_page()
            page.set_default_timeout(60_000)
            page.clock.install(time=CLOCK_START)
            page.clock.pause_at(CLOCK_START + timedelta(seconds=1))  # from here time moves only by run_for
            traffic = Traffic()
            traffic.attach(page)
            page.goto(f"{server.base_url}{PAGE_PATH}")
            page.click("#settings summary")
            page.fill("#api-key", KEY)
            page.fill("#max-new-tokens", str(TURN_LIMIT))
            page.select_option("#fps", "0.5")
            page.click("#settings summary")
            page.click("#start")
            wait_until(page, lambda: parked_after(traffic, None), 120, "the initial prefill to park")

            def next_frame() -> None:
                sent = len(traffic.events("sent", "input.frame"))
                page.clock.run_for(2000)
                wait_until(page, lambda: len(traffic.events("sent", "input.frame")) > sent, 30, "a frame")
                seq_no = traffic.events("sent", "input.frame")[-1]["seq_no"]
                wait_until(page, lambda: parked_after(traffic, seq_no), 120, f"frame {seq_no}'s turn to park")

            for _ in range(FRAMES_BEFORE_QUESTION):
                next_frame()
            page.fill("#question", QUESTION)
            page.click("#send")
            wait_until(page, lambda: traffic.events("sent", "input.prompt"), 30, "the question")
            seq_no = traffic.events("sent", "input.prompt")[0]["seq_no"]
            wait_until(page, lambda: parked_after(traffic, seq_no), 120, "the question's turn to park")
            for _ in range(FRAMES_AFTER_QUESTION):
                next_frame()
            shown = page.locator("#turns li.answer").evaluate_all(
                "items => items.map(i => [i.dataset.turn, i.lastChild.textContent])"
            )
            page.click("#hangup")
            page.wait_for_selector("#status:has-text('session ended')")
            compared = traffic.snapshot()
            # The picture: a second session on the page's real clock (its latency figure is real; the paused
            # clock above reads 0 ms), once its answer to the question streamed.
            page.clock.resume()
            page.click("#start")
            wait_until(page, lambda: len(traffic.events("received", "input.frame.processed")) > 3, 120, "a frame")
            page.fill("#question", QUESTION)
            page.click("#send")
            page.wait_for_selector("#turns li.answer .meta:has-text('first token after')", timeout=120_000)
            page.wait_for_selector("#send:has-text('Send')", timeout=120_000)
            BUILT_PICTURE.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(BUILT_PICTURE))
            boxes = {"video": page.locator("#video").bounding_box(), "turns": page.locator("#turns").bounding_box()}
            latency = page.text_content("#latency")
            page.click("#hangup")
            page.wait_for_selector("#status:has-text('session ended')")
            version = chromium_version(context)
        finally:
            context.close()
    traffic.messages = compared
    return {
        "traffic": traffic,
        "unkeyed": unkeyed,
        "boxes": boxes,
        "shown": shown,
        "latency": latency,
        "version": version,
    }


def test_the_page_session_equals_the_reference_stream(checkpoint, page_session):
    """The keyed server serves the page without a key (the API still refuses one); the page's session, read back
    from the traffic, said per turn what the reference stream says for the same inputs."""
    traffic = page_session["traffic"]
    print(f"Chromium {page_session['version']}")
    assert page_session["unkeyed"] == {"page": 200, "chat": 401}
    assert traffic.events("sent")[0]["type"] == "session.configure"
    assert traffic.events("sent")[0]["max_new_tokens"] == TURN_LIMIT
    assert parked_inputs(traffic) == [], "an input went in while the model was still answering: not comparable"
    script = script_sent(traffic)
    assert [action[0] for action in script] == ["frame", "frame", "prompt", "frame"]
    assert [action[1] for action in script if action[0] == "frame"] == [2.0, 4.0, 6.0]  # the page's clock at 0.5 fps
    assert all(action[2].size == (512, 288) for action in script if action[0] == "frame")
    assert script[2][1] == QUESTION

    model, processor = load_reference(checkpoint)
    expected = turn_texts(processor.tokenizer, reference_generated(model, processor, script))
    served = turns_received(traffic)
    assert served == expected
    # The page shows each turn's text in its own bubble (turns that said nothing are marked silent instead).
    assert [text for _, text in page_session["shown"]] == [text for text in served if text]


def test_the_screenshot_shows_the_video_and_the_answer(page_session):
    """Non-blank by pixels: the video region holds the camera's picture, the answer panel holds text; the
    README's committed picture passes the same check."""
    assert re.fullmatch(r"[1-9]\d* ms", page_session["latency"]), page_session["latency"]
    assert_not_blank(BUILT_PICTURE, page_session["boxes"]["video"], page_session["boxes"]["turns"])
    if os.environ.get("MOSSVL_UPDATE_SCREENSHOT") == "1":
        README_PICTURE.write_bytes(BUILT_PICTURE.read_bytes())
    assert_not_blank(README_PICTURE, page_session["boxes"]["video"], page_session["boxes"]["turns"])
