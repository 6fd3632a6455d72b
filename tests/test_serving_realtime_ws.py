"""Realtime sessions through `WS /v1/video/realtime` of a real `python -m sglang.launch_server` (CPU, fp32), each
session's output against the reference stream driven by the same script (`support.realtime`).

Per session: each turn's text (its deltas joined) equals the reference's tokens of that turn decoded, and there is
one `response.turn.silence` per reference turn. Per step, from the scheduler's log: only the new frames went through the
vision tower and the extend held only the step's rows (so a silent re-prefill fails). After the sessions close the KV
pool is idle (`/v1/loads`). An ordinary OpenAI request runs alongside and still equals the reference model.

With a frame window (`MOSSVL_REALTIME_FRAME_WINDOW_S`) the oracle is the reference stream with the same window, and a
300-frame stream must hold exactly the whole pages its window's frames touch.

A server start is about a minute on CI's two cores, so every test whose configuration it is runs on one shared server
(`shared_server`: page 128, the radix cache, CPU decode graphs, a session cap, an API key, benchmark mode), which each
test borrows idle with its radix cache empty and reads its log from the borrow on (`keyed_server`); the frame-window
tests share one more (`window_server`: the window is fixed at start-up). The others start a server of their own, for
a flag or environment the shared tests must not run under (said at each).
"""

import asyncio
import contextlib
import io
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests
import websockets
from PIL import Image

from moss_vl_reference.tiny_checkpoint import build_or_reuse
from mossvl_ascend.patches.realtime_api import BENCHMARK_MODE_ENV
from mossvl_ascend.realtime.engine import FRAME_WINDOW_ENV
from serving.launch import SglangServer
from serving.realtime_client import GATEWAY_PATH, VIDEO_REALTIME_PATH, RealtimeClient, realtime_url
from support.demo_like_client import demo_view, first_event_verdict
from support.realtime import (
    SCRIPTS,
    TURN_LIMIT,
    frames_of,
    noise_image,
    play,
    reference_generated,
    segment_text,
    served_turn_texts,
    turn_texts,
)
from support.realtime_engine_log import steps_the_engine_did_not_extend_alone
from support.server_pool import Lease
from support.serving import (
    CASES,
    load_reference,
    openai_client,
    reference_ids,
    served_ids,
    server_log,
)

pytestmark = pytest.mark.timeout(1800)

STEP_LINE = re.compile(
    r"realtime step mossvl-realtime:(\w+):(\d+): extended (\d+) rows, (\d+) new frames through the vision tower"
)
# Stock's decode log line (every step with --decode-log-interval 1): whether the CPU graph ran it.
DECODE_LINE = re.compile(r"Decode batch, #running-req: \d+,.*?cpu graph: (True|False)")
# The shared server's request cap (its comment below).
SESSION_CAP = 5
# The window server's page: under two tiny frames.
WINDOW_PAGE = 8
# Every server here: fp32, and no warm-up request before /health answers (each test's first session is one; ~3 s
# of start-up each).
SERVER_BASE = ["--dtype", "float32", "--skip-server-warmup"]
# Each configuration but the shared server's (SHARED_CONFIG) differs from it in what a server is started with.
CONFIGS = {
    # The shared server: page 128, the radix cache and CPU decode graphs (torch.compile), as an NPU serves (decode
    # graphs are on by default there); one bucket of the session cap (stock captures no bucket above
    # --max-running-requests): every decode step of the sessions (slot-major encoders) and of the ordinary requests
    # replays the graph, padded, and stock logs each step.
    "page128-radix-graphs": [
        *("--page-size", "128", "--enable-torch-compile", "--cuda-graph-bs-decode", str(SESSION_CAP)),
        *("--decode-log-interval", "1"),
    ],
    "page1-noradix-chunk8-mixed": ["--disable-radix-cache", "--chunked-prefill-size", "8", "--enable-mixed-chunk"],
    # Two data-parallel ranks: every step of a session must reach the rank that holds its KV.
    "dp2-page128": ["--dp-size", "2", "--page-size", "128"],
    # Two tensor-parallel ranks: each rank's scheduler keeps its half of every session's K/V.
    "tp2-page128": ["--tp-size", "2", "--page-size", "128"],
    # A 1 s frame window: the 2 fps scripts evict frames, and a page of 8 slots (under 2 tiny frames) is given back
    # while the page it shares with the window's first frame keeps evicted keys the rows must not see. The 300-frame
    # stream runs here too: its ~3950 text rows and its window need an 8192-token context.
    "window1s-page8-chunk8": [
        *("--max-total-tokens", "12000", "--context-length", "8192", "--page-size", str(WINDOW_PAGE)),
        *("--chunked-prefill-size", "8"),
    ],
}
WINDOW_CONFIG = "window1s-page8-chunk8"
WINDOWS = {WINDOW_CONFIG: 1.0}
SHARED_CONFIG = "page128-radix-graphs"
# An image question with its own system turn: the realtime checkpoint's chat template adds its realtime system
# prompt to a conversation without one, sglang's "moss-vl" template does not.
ALONGSIDE = [{"role": "system", "content": "Answer briefly."}, *CASES["image_data_url"]]


# The shared server. Its request cap is the session cap: the four reference sessions and an ordinary request beside
# them fit it, the refusal tests fill it. The API key guards the socket and every HTTP path but /health (the clients
# here always send it; a server started without a key ignores it). Benchmark mode only lets a session set
# `benchmark_ignore_eos`.
API_KEY = "sk-realtime-served"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SHARED_ARGS = [
    *(*SERVER_BASE, "--max-total-tokens", "6000", "--context-length", "4096", *CONFIGS[SHARED_CONFIG]),
    *("--max-running-requests", str(SESSION_CAP), "--api-key", API_KEY),
]


@pytest.fixture(scope="module")
def checkpoint():
    return build_or_reuse("tiny-realtime")


@pytest.fixture(scope="module")
def shared_server(checkpoint):
    env = {BENCHMARK_MODE_ENV: "1", FRAME_WINDOW_ENV: ""}  # no frame window, whatever the test that starts it set
    with SglangServer(
        checkpoint, extra_args=SHARED_ARGS, name="realtime-shared", env=env, ready_timeout_s=900
    ) as server:
        yield server


@pytest.fixture
def keyed_server(shared_server):
    """The shared server for one test, as a fresh one would be: idle (the sessions an earlier test closed release
    their KV a moment after their sockets close; CI once saw 384 tokens still held), its radix cache empty, its log
    (``log_text()``) read from here on."""
    idle = wait_until_idle(shared_server)
    assert all(load["num_used_tokens"] == 0 for load in idle), f"KV still held before the test: {idle}"
    flushed = requests.post(f"{shared_server.base_url}/flush_cache?timeout=60", headers=AUTH, timeout=120)
    assert flushed.status_code == 200, flushed.text
    return Lease.from_now(shared_server)


def loads(server) -> list[dict]:
    """Every rank's ``/v1/loads`` report."""
    return requests.get(f"{server.base_url}/v1/loads", headers=AUTH, timeout=30).json()["loads"]


def wait_until_idle(server, timeout_s: float = 60.0) -> list[dict]:
    """Every rank's ``/v1/loads`` report once none holds KV (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reports = loads(server)
        if all(load["num_used_tokens"] == 0 for load in reports) or time.monotonic() > deadline:
            return reports
        time.sleep(0.2)


def keyed_client(server, path=VIDEO_REALTIME_PATH, **handshake) -> RealtimeClient:
    return RealtimeClient(realtime_url(server.base_url, path), **{"headers": AUTH, **handshake})


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Computed before any server starts (the reference runs alone on the CPU)."""
    model, processor = load_reference(checkpoint)
    streams = {
        window: {name: reference_generated(model, processor, script, window) for name, script in SCRIPTS.items()}
        for window in {None, *WINDOWS.values()}
    }
    ordinary = reference_ids(model, processor, ALONGSIDE)[1]
    return {"streams": streams, "ordinary": ordinary, "tokenizer": processor.tokenizer}


async def drive_client(client: RealtimeClient, script) -> None:
    await client.open(max_new_tokens=TURN_LIMIT, temperature=0.0)
    await client.settle()
    await play(client, script)


async def drive(server, script) -> RealtimeClient:
    client = keyed_client(server)
    await drive_client(client, script)
    await client.close()
    return client


async def all_sessions(server) -> dict:
    names = sorted(SCRIPTS)
    clients = await asyncio.gather(*(drive(server, SCRIPTS[name]) for name in names))
    return dict(zip(names, clients))


@pytest.fixture(scope="module")
def window_server(checkpoint):
    """The frame-window server (`WINDOW_CONFIG`), for the four sessions and the 300-frame stream."""
    extra = [*SERVER_BASE, *CONFIGS[WINDOW_CONFIG]]
    env = {FRAME_WINDOW_ENV: str(WINDOWS[WINDOW_CONFIG])}
    with SglangServer(checkpoint, extra_args=extra, name=f"realtime-{WINDOW_CONFIG}", env=env) as server:
        yield server


@contextlib.contextmanager
def four_sessions_server(request, checkpoint, config: str):
    """The shared server or the window server for their configurations; for every other, a server of its own
    (ranks, graphs, page size and chunking are fixed at start-up)."""
    if config == SHARED_CONFIG:
        yield request.getfixturevalue("keyed_server")
        return
    if config == WINDOW_CONFIG:
        yield Lease.from_now(request.getfixturevalue("window_server"))
        return
    extra = [*SERVER_BASE, "--max-total-tokens", "6000", "--context-length", "4096", *CONFIGS[config]]
    with SglangServer(checkpoint, extra_args=extra, name=f"realtime-{config}", ready_timeout_s=900) as server:
        yield server


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_four_sessions_equal_the_reference_streams(checkpoint, reference, config, request):
    window = WINDOWS.get(config)
    graphs = "--enable-torch-compile" in CONFIGS[config]
    with four_sessions_server(request, checkpoint, config) as server:
        client, model_name = openai_client(server, api_key=API_KEY)
        with ThreadPoolExecutor(max_workers=1) as pool:
            ordinary = pool.submit(served_ids, client, model_name, ALONGSIDE)
            sessions = asyncio.run(all_sessions(server))
            ordinary = ordinary.result()
        idle = wait_until_idle(server)
        log = server_log(server)
    tokenizer = reference["tokenizer"]
    if window is not None:
        assert "left the window" in log
    if graphs:
        decode_steps = DECODE_LINE.findall(log)
        assert decode_steps and all(graph == "True" for graph in decode_steps), decode_steps
    for name, session in sessions.items():
        tokens = reference["streams"][window][name]
        assert served_turn_texts(session) == turn_texts(tokenizer, tokens), name
        silence = tokenizer.convert_tokens_to_ids("<|silence|>")
        assert session.count("response.turn.silence") == tokens.count(silence) == len(SCRIPTS[name]) + 1, name
    assert ordinary["completion_ids"] == reference["ordinary"]
    assert all(load["num_used_tokens"] == 0 for load in idle), idle
    steps = {}
    for session_id, step, rows, frames in STEP_LINE.findall(log):
        steps.setdefault(session_id, {})[int(step)] = (int(rows), int(frames))
    assert len(steps) == len(SCRIPTS)
    by_script = {}
    for per_step in steps.values():
        # Tell the sessions apart by their frames per step: each script's is different.
        key = tuple(per_step[i][1] for i in sorted(per_step))[1:]
        by_script[key] = per_step
    for name, script in SCRIPTS.items():
        per_step = by_script[tuple(frames_of(action) for action in script)]
        for index, action in enumerate(script, start=1):
            rows, frames = per_step[index]
            new_rows = 1 + len(tokenizer(segment_text(action), add_special_tokens=False)["input_ids"])
            assert (rows, frames) == (new_rows, frames_of(action)), f"{name} step {index}"
    # The plan above is built from the incoming request; what the engine computed comes from stock's own prefill
    # lines (a silent full re-prefill leaves a step unmatched). Chunked prefill splits a step across batches.
    if "--chunked-prefill-size" not in CONFIGS[config]:
        assert steps_the_engine_did_not_extend_alone(log) == []


async def faults(server, script) -> dict:
    """Sessions up to the cap (every request row kept), one more refused; one takes a frame while every row is
    kept; one disconnects right after a frame; one gets bad inputs (a
    `seq_no` gap, a timestamp going back, an unknown event, a malformed frame) between its script's steps and must
    still equal the reference."""
    keep = [keyed_client(server) for _ in range(SESSION_CAP)]
    for client in keep:
        await client.open(max_new_tokens=TURN_LIMIT, temperature=0.0)
        await client.settle()
    refused = keyed_client(server)
    refusal = None
    try:
        await refused.open(max_new_tokens=TURN_LIMIT)
    except RuntimeError as error:
        refusal = str(error)
    await refused.close()
    # Every request row is now kept by a parked session: a step runs in its own session's row all the same.
    await keep[1].settle(await keep[1].frame(noise_image(98), 0.0))
    dropped = keep.pop()
    await dropped.frame(noise_image(99), 0.0)
    await dropped.close()  # disconnect while its step runs (or just after)
    victim, bystander, *parked = keep
    errors = []
    for index, action in enumerate(script):
        if index == 1:
            await victim.send({"type": "input.frame", "seq_no": victim.next_seq_no + 5, "timestamp": 9.0})
            errors.append(await victim.wait_for("error", start=len(victim.events) - 1))
            await victim.send({"type": "input.frame", "seq_no": victim.next_seq_no, "timestamp": -1.0})
            errors.append(await victim.wait_for("error", start=len(victim.events) - 1))
            await victim.send({"type": "no.such.event"})
            errors.append(await victim.wait_for("error", start=len(victim.events) - 1))
            # A malformed frame: its metadata in order, then bytes that are no image (its seq_no stays free).
            meta = {"type": "input.frame", "seq_no": victim.next_seq_no, "timestamp": 0.0, "mime_type": "image/png"}
            await victim.send(meta)
            await victim.wait_for("input.frame.ready", seq_no=victim.next_seq_no)
            await victim.socket.send(b"these bytes are no PNG")
            errors.append(await victim.wait_for("error", start=len(victim.events) - 1))
        seq_no = await victim.frame(noise_image(action[2]), action[1])
        await victim.settle(seq_no)
    for client in (victim, bystander, *parked):
        await client.close()
    return {"refusal": refusal, "errors": errors, "victim": victim, "dropped": dropped}


def test_refusal_disconnect_and_bad_inputs(keyed_server, reference):
    script = SCRIPTS["six_frames_2fps"]
    result = asyncio.run(faults(keyed_server, script))
    idle = wait_until_idle(keyed_server)
    log = keyed_server.log_text()
    assert result["refusal"] is not None and "session_capacity_exceeded" in result["refusal"]
    assert [error["code"] for error in result["errors"]] == ["invalid_request"] * 4
    tokens = reference["streams"][None]["six_frames_2fps"]
    assert served_turn_texts(result["victim"]) == turn_texts(reference["tokenizer"], tokens)
    assert all(load["num_used_tokens"] == 0 for load in idle), idle
    assert log.count("realtime session") >= SESSION_CAP and "closed:" in log
    assert "evicted while parked" not in log, "a step waiting for its own kept row looked like a stalled pool"


async def two_sessions_under_pressure(url: str) -> dict:
    """Two sessions at once; each either completes its script or ends with an error event."""

    async def one(name):
        client = RealtimeClient(url)
        try:
            await drive_client(client, SCRIPTS[name])
        except RuntimeError:
            pass  # the socket closed: its session was aborted
        await client.close()
        return client

    names = ["frames_1fps_then_prompt", "six_frames_2fps"]
    clients = await asyncio.gather(*(one(name) for name in names))
    return dict(zip(names, clients))


def test_memory_pressure_aborts_a_session_and_the_others_go_on(checkpoint, reference, monkeypatch):
    """sglang's retraction switch (`SGLANG_TEST_RETRACT`: a running request loses its KV every few forwards, as
    under memory pressure) hits the sessions' steps: a retracted session ends with an error event and frees its KV;
    a session that completes equals the reference; the server stays up and ends idle."""
    # A server of its own: stock reads the switch once, when the scheduler starts, and it then retracts whatever runs.
    monkeypatch.setenv("SGLANG_TEST_RETRACT", "1")
    extra = [*SERVER_BASE, "--max-total-tokens", "6000", "--context-length", "4096"]
    with SglangServer(checkpoint, extra_args=extra, name="realtime-retract") as server:
        url = server.base_url.replace("http://", "ws://") + "/v1/video/realtime"
        sessions = asyncio.run(two_sessions_under_pressure(url))
        idle = wait_until_idle(server)
        log = server.log_path.read_text()
    aborted = [name for name, c in sessions.items() if c.count("error")]
    assert "retracted" in log and aborted, "the retraction switch aborted no session"
    for name, client in sessions.items():
        errors = [r.event for r in client.events if r.event["type"] == "error"]
        if errors:
            assert client.count("session.done") == 1, name
        else:
            assert served_turn_texts(client) == turn_texts(reference["tokenizer"], reference["streams"][None][name]), (
                name
            )
    assert all(load["num_used_tokens"] == 0 for load in idle), idle


def long_prompt(words: int) -> str:
    """About one token per word on the tiny checkpoint's tokenizer."""
    return "Remember: " + "word " * words


# Parked sessions that fill about three quarters of the shared server's 11776-slot pool (6000 stock tokens in the
# MOSS-VL layout), leaving fewer free slots than its 4096-token context, so that a request can be over them: one with
# three frames and a prompt, and three holding long prompts, the heavy one the heaviest by a page.
PARKED_SCRIPTS = {
    "light": SCRIPTS["frames_1fps_then_prompt"],
    "heavy": (("prompt", long_prompt(2600)), ("frame", 0.0, 21)),
    "middle": (("prompt", long_prompt(2500)), ("frame", 0.0, 23)),
    "lighter": (("prompt", long_prompt(2400)), ("frame", 0.0, 22)),
}


@pytest.fixture(scope="module")
def parked_reference(checkpoint):
    """The sessions' reference streams, and the model (the OpenAI request's reference is sized from the served pool,
    so it is computed after the server)."""
    model, processor = load_reference(checkpoint)
    streams = {name: reference_generated(model, processor, script) for name, script in PARKED_SCRIPTS.items()}
    return {"streams": streams, "model": model, "processor": processor}


def stalling_question(words: int) -> list[dict]:
    return [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": long_prompt(words)}]


async def parked_sessions_stall_the_pool(server) -> dict:
    """Each session plays its script but its last action and parks; an OpenAI request that the pool's free slots
    cannot take but would with the heavy session's arrives; then each session plays its last action."""
    clients = {name: keyed_client(server) for name in PARKED_SCRIPTS}
    for name, client in clients.items():
        await drive_client(client, PARKED_SCRIPTS[name][:-1])
    parked = loads(server)[0]
    free = parked["max_total_num_tokens"] - parked["num_used_tokens"]
    words = free + 64  # its prompt alone is over the free slots
    openai, model_name = openai_client(server, api_key=API_KEY)
    # Without the eviction it would wait for the sessions' idle timeouts.
    ordinary = await asyncio.to_thread(served_ids, openai, model_name, stalling_question(words), timeout=120)
    errors = {}
    for name, client in clients.items():
        try:
            await play(client, PARKED_SCRIPTS[name][-1:])
        except RuntimeError:  # the socket closed: its session was evicted
            pass
        errors[name] = [r.event for r in client.events if r.event["type"] == "error"]
        await client.close()
    return {"clients": clients, "errors": errors, "parked": parked, "words": words, "ordinary": ordinary}


def test_parked_sessions_stalling_the_pool_lose_the_heaviest_and_the_others_go_on(keyed_server, parked_reference):
    """Parked sessions hold KV with no request in the scheduler, so retraction cannot reach them: a request that
    cannot be admitted while nothing runs would wait for their timeouts. The heaviest parked session is evicted
    (an error event at its next input); the request then runs and equals the reference; the other sessions stay
    exact; the pool ends idle. Page 128."""
    result = asyncio.run(parked_sessions_stall_the_pool(keyed_server))
    idle = wait_until_idle(keyed_server)
    log = keyed_server.log_text()
    parked = result["parked"]
    assert parked["num_used_tokens"] > parked["max_total_num_tokens"] / 2, parked
    assert log.count("evicted while parked") == 1, "one eviction makes room"
    assert [name for name, errors in result["errors"].items() if errors] == ["heavy"]
    assert "evicted under KV memory pressure" in result["errors"]["heavy"][0]["message"]
    assert result["clients"]["heavy"].count("session.done") == 1
    model, processor = parked_reference["model"], parked_reference["processor"]
    for name in ("light", "middle", "lighter"):
        expected = turn_texts(processor.tokenizer, parked_reference["streams"][name])
        assert served_turn_texts(result["clients"][name]) == expected, name
    assert (
        result["ordinary"]["completion_ids"] == reference_ids(model, processor, stalling_question(result["words"]))[1]
    )
    assert all(load["num_used_tokens"] == 0 for load in idle), idle


LONG_STREAM_FRAMES = 300
HOLDS = re.compile(r"session holds (\d+) encoder \+ (\d+) text rows")


async def long_stream(url: str, server) -> dict:
    """300 frames at 1 fps; the pool's use read while the session is parked after the last one."""
    client = RealtimeClient(url)
    await client.open(max_new_tokens=TURN_LIMIT, temperature=0.0)
    await client.settle()
    for index in range(LONG_STREAM_FRAMES):
        await client.settle(await client.frame(noise_image(1000 + index), float(index)))
    used = requests.get(f"{server.base_url}/v1/loads", timeout=30).json()["loads"][0]["num_used_tokens"]
    await client.close()
    return {"client": client, "used": used}


@pytest.fixture(scope="module")
def long_reference(checkpoint):
    """The reference stream of the 300-frame script with the window server's window, and the vision tokens of one
    frame."""
    model, processor = load_reference(checkpoint)
    script = tuple(("frame", float(i), 1000 + i) for i in range(LONG_STREAM_FRAMES))
    tokens = reference_generated(model, processor, script, WINDOWS[WINDOW_CONFIG])
    image_processor = processor.image_processor
    _, grid = image_processor.realtime_frame(noise_image(0))
    merge = model.config.vision_config.spatial_merge_size
    return {"tokens": tokens, "frame_tokens": grid[1] * grid[2] // merge**2 + 1, "tokenizer": processor.tokenizer}


def test_a_long_stream_holds_only_its_window(window_server, long_reference):
    """A 300-frame stream at 1 fps on the window server (a 1 s window, pages of 8 slots): its output equals the
    reference stream with that window, and parked after the last frame it holds exactly the whole pages its window's
    frames touch plus its text; without the window the frames alone would need 300 frames' slots.

    The oracle, from the window rule (frames more than the window behind the newest leave it) and whole pages:
    one band per slot on the tiny checkpoint (2 self-attention and 2 cross-attention layers), so a frame's vision
    tokens are its slots; every slot before the page holding the first kept frame's first slot is given back, and
    the row ends on a whole page. At page 1 that is the window's frames' slots exactly."""
    server = Lease.from_now(window_server)
    url = server.base_url.replace("http://", "ws://") + "/v1/video/realtime"
    result = asyncio.run(long_stream(url, server))
    idle = wait_until_idle(server)
    assert served_turn_texts(result["client"]) == turn_texts(long_reference["tokenizer"], long_reference["tokens"])
    page, frame_slots = WINDOW_PAGE, long_reference["frame_tokens"]
    newest = LONG_STREAM_FRAMES - 1
    first_kept = math.ceil(newest - WINDOWS[WINDOW_CONFIG])  # at 1 fps frame i is at i s
    given_back = first_kept * frame_slots // page * page
    expected = -(-LONG_STREAM_FRAMES * frame_slots // page) * page - given_back
    encoder_rows, text_rows = map(int, HOLDS.findall(server.log_text())[-1])
    assert encoder_rows == expected, (encoder_rows, expected, first_kept, frame_slots, page)
    assert result["used"] <= encoder_rows + -(-(text_rows + 1) // page) * page, result["used"]
    assert all(load["num_used_tokens"] == 0 for load in idle), idle


# ---- The socket as the real clients expect it (issue 34), on the shared server: page 128, the session cap, an API
# key, benchmark mode on. Each check below failed on the socket before its fix.


async def refused_handshakes(server) -> list:
    statuses = []
    for handshake in ({"headers": None}, {"headers": {"Authorization": "Bearer wrong"}}):
        client = keyed_client(server, **handshake)
        try:
            await client.connect()
            statuses.append("opened")
        except websockets.InvalidStatus as refusal:
            statuses.append(refusal.response.status_code)
        await client.close()
    return statuses


async def keyed_sessions(server) -> list[str]:
    """The right key as a header on smg's path (with its `model` query parameter), and as a browser sends it."""
    opened = []
    for client in (
        RealtimeClient(realtime_url(server.base_url, GATEWAY_PATH, model="moss-vl-realtime"), headers=AUTH),
        keyed_client(server, headers=None, subprotocols=["realtime", f"openai-insecure-api-key.{API_KEY}"]),
    ):
        await client.open(max_new_tokens=TURN_LIMIT)
        opened.append(client.events[0].event["type"])
        await client.close()
    return opened


def test_the_api_key_guards_the_socket(keyed_server):
    """No key or a wrong one: refused at the handshake (401), no session, nothing held; the right key (a header on
    `/v1/realtime?model=`, or the browser's subprotocol) opens a session."""
    assert asyncio.run(refused_handshakes(keyed_server)) == [401, 401]
    assert all(load["num_used_tokens"] == 0 for load in loads(keyed_server))
    assert "realtime session" not in keyed_server.log_text()
    assert asyncio.run(keyed_sessions(keyed_server)) == ["session.created", "session.created"]
    assert all(load["num_used_tokens"] == 0 for load in wait_until_idle(keyed_server))


async def an_admitted_client(server, timeout_s: float = 60.0) -> RealtimeClient:
    """A connection given ``session.created``, retried as the Demo retries while the server answers busy (a session
    a client closed a moment ago holds its place until the server has released it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        client = keyed_client(server)
        first = await client.connect()
        if first_event_verdict(first) == "ok":
            return client
        await client.close()
        assert first_event_verdict(first) == "busy" and time.monotonic() < deadline, first
        await asyncio.sleep(0.2)


async def a_client_past_the_cap(server) -> dict:
    # Not configured: a connection holds its place from the handshake.
    holders = [await an_admitted_client(server) for _ in range(SESSION_CAP)]
    one_more = keyed_client(server)
    first = await one_more.connect()
    await asyncio.wait_for(one_more._reader, 30)
    for client in holders:
        await client.close()
    return {"first": first, "events": [r.event["type"] for r in one_more.events], "close": one_more.socket.close_code}


def test_a_client_past_the_cap_is_refused_before_session_created(keyed_server):
    """The Demo reads the first event: `session_capacity_exceeded` means busy (retry), anything else marks the
    replica down."""
    result = asyncio.run(a_client_past_the_cap(keyed_server))
    assert first_event_verdict(result["first"]) == "busy", result
    assert result["events"] == ["error"] and result["close"] == 1013


async def questions_and_barge_in(server) -> dict:
    """A question while the model is silent; then, with a slow turn (a 3 tok/s cap), a question that barges in
    once the turn's first text arrived (the Demo mutes at that moment)."""
    client = keyed_client(server)
    await client.open(max_new_tokens=TURN_LIMIT, include_usage=True)
    await client.settle()
    parked_question = await client.prompt("Tell me when a dot appears.")
    await client.settle(parked_question)
    slow = keyed_client(server)
    await client.close()
    await slow.open(max_new_tokens=TURN_LIMIT, max_tokens_per_turn=3.0)
    await slow.settle()
    first = await slow.prompt("Tell me when a dot appears.")
    await slow.wait_processed(first)
    start = len(slow.events)
    await slow.wait_for("response.text.delta", start=start)
    barge_index = len(slow.events)
    second = await slow.prompt("What moved?")
    await slow.settle(second)
    await slow.close()
    return {"client": client, "question": parked_question, "slow": slow, "barge": (barge_index, second)}


def turn_change(client, seq_no) -> tuple[dict, dict]:
    events = [r.event for r in client.events]
    interrupted = [e for e in events if e["type"] == "response.turn.interrupted" and e["seq_no"] == seq_no]
    processed = [e for e in events if e["type"] == "input.prompt.processed" and e["seq_no"] == seq_no]
    assert len(interrupted) == 1 and len(processed) == 1, events
    assert events.index(interrupted[0]) < events.index(processed[0])
    return interrupted[0], processed[0]


def test_every_question_announces_its_turn(keyed_server):
    """Asked while the model is silent, and barging into a running turn: `response.turn.interrupted` with the
    prompt's `seq_no`, the turn fields on its `.processed`, the answer's deltas in the announced turn; the Demo's
    view shows the answers (it advances turns only on the interrupt and unmutes only at the prompt's `seq_no`)."""
    result = asyncio.run(questions_and_barge_in(keyed_server))
    client, slow = result["client"], result["slow"]
    interrupted, processed = turn_change(client, result["question"])
    assert (processed["interrupted_turn_id"], processed["turn_id"]) == (
        interrupted["turn_id"],
        interrupted["next_turn_id"],
    )
    answer = [r.event for r in client.events if r.event["type"] == "response.text.delta"][-1]
    assert answer["turn_id"] == interrupted["next_turn_id"]
    view = demo_view([r.event for r in client.events])
    assert view.shown.get(interrupted["next_turn_id"]), view
    assert not view.dropped and not view.invalid_usage

    barge_index, second = result["barge"]
    interrupted, processed = turn_change(slow, second)
    assert (processed["interrupted_turn_id"], processed["turn_id"]) == (
        interrupted["turn_id"],
        interrupted["next_turn_id"],
    )
    view = demo_view([r.event for r in slow.events], barge_ins={barge_index: second})
    assert not view.muted and view.shown.get(interrupted["next_turn_id"]), view


async def usage_while_parked(server) -> dict:
    client = keyed_client(server)
    await client.open(max_new_tokens=TURN_LIMIT, include_usage=True)
    await client.settle()
    await client.settle(await client.frame(noise_image(31), 0.0))
    reports = loads(server)
    await client.close()
    return {"client": client, "loads": reports}


def test_usage_matches_the_loads(keyed_server):
    """With `include_usage`: a `session.usage` per output with the real server's fields; parked, the KV it reports
    is what `/v1/loads` counts, and the context arithmetic holds."""
    result = asyncio.run(usage_while_parked(keyed_server))
    usages = [r.event for r in result["client"].events if r.event["type"] == "session.usage"]
    assert usages, "no session.usage"
    last = usages[-1]
    assert sum(load["num_used_tokens"] for load in result["loads"]) == last["kv_tokens"], (result["loads"], last)
    assert last["context_limit"] < 4096  # the positions a request may fill (stock: its max_req_len - 1)
    assert last["token_space_used"] + last["context_remaining"] == last["context_limit"]
    assert last["encoder_tokens"] == last["encoder_kv_tokens"] > 0
    view = demo_view([r.event for r in result["client"].events])
    assert view.usage is not None and not view.invalid_usage
    decoder = [u["decoder_tokens"] for u in usages]
    assert decoder == sorted(decoder)


async def configure_then_stream(server, frames: int) -> RealtimeClient:
    client = keyed_client(server)
    await client.connect()
    await client.send({"type": "session.configure", "max_new_tokens": 5000})
    await client.wait_for("error")
    await client.send({"type": "session.configure", "max_new_tokens": 2048, "include_usage": True})
    await client.wait_for("session.ready")
    await client.settle()
    for index in range(frames):
        await client.settle(await client.frame(noise_image(500 + index), float(index)))
    await client.close()
    return client


def test_a_minute_at_1fps_with_2048_new_tokens_runs_to_its_end(keyed_server):
    """`--context-length 4096`: `max_new_tokens` 5000 is refused at configure (`invalid_request`, the connection
    waits for another configure); 2048 opens, and 60 frames at 1 fps run to the end (each step reserves what it can
    write, not the turn's allowance)."""
    client = asyncio.run(configure_then_stream(keyed_server, 60))
    errors = [r.event for r in client.events if r.event["type"] == "error"]
    assert [error["code"] for error in errors] == ["invalid_request"], errors
    assert client.count("input.frame.processed") == 60
    assert client.count("session.done") == 0
    last = [r.event for r in client.events if r.event["type"] == "session.usage"][-1]
    assert last["context_remaining"] > 0


async def benchmark_session(server) -> RealtimeClient:
    client = keyed_client(server)
    await client.open(max_new_tokens=4, benchmark_ignore_eos=True)
    await client.wait_for("response.done")
    await client.close()
    return client


def test_benchmark_mode_accepts_ignore_eos(keyed_server):
    """The server runs with benchmark mode (`MOSSVL_VIDEO_REALTIME_BENCHMARK_MODE=1`): `benchmark_ignore_eos` is
    accepted and the first turn runs to its allowance (`response.done` "length")."""
    client = asyncio.run(benchmark_session(keyed_server))
    done = [r.event for r in client.events if r.event["type"] == "response.done"]
    assert done[0]["finish_reason"] == "length"


def png_of_size(size: int) -> bytes:
    """A valid PNG of exactly ``size`` bytes (an 8x8 image and trailing bytes after IEND, which decoders skip)."""
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buffer, format="PNG")
    data = buffer.getvalue()
    return data + b"\0" * (size - len(data))


def bomb_png(side: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (side, side), 0).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


async def frames_at_the_limits(server, rss: psutil.Process) -> dict:
    """Each frame's answer and size; the server's RSS growth across the bomb alone (the frame at the limit, accepted
    and processed before it, grows the server by its own bytes)."""
    client = keyed_client(server)
    configured = await client.open(max_new_tokens=TURN_LIMIT)
    await client.settle()
    limit = configured["max_frame_bytes"]
    answers = {}
    for name, data in (
        ("at_limit", png_of_size(limit)),
        ("over_limit", png_of_size(limit + 1)),
        ("bomb", bomb_png(6000)),
    ):
        seq_no = client.next_seq_no
        await client.send({"type": "input.frame", "seq_no": seq_no, "timestamp": 1.0, "mime_type": "image/png"})
        await client.wait_for("input.frame.ready", seq_no=seq_no)
        start, before = len(client.events), rss.memory_info().rss
        await client.socket.send(data)
        answers[name] = await client.wait_for(("input.frame.accepted", "error"), start=start)
        answers[f"{name}_rss_grown"] = rss.memory_info().rss - before
        if answers[name]["type"] == "input.frame.accepted":
            client.next_seq_no += 1
            await client.settle(seq_no)
        answers[f"{name}_bytes"] = len(data)
    await client.close()
    return {"answers": answers, "limit": limit}


def test_frames_at_the_limits(keyed_server):
    """The advertised `max_frame_bytes` is the enforced one (below the server stack's message limit): exactly that
    many bytes are accepted, one more gets `frame_too_large` and the session goes on; a PNG of 36 megapixels (a few
    kilobytes, over the processor's `max_input_pixels`) is refused from its header and the server's memory stays flat
    (decoding it would take 36 MB)."""
    result = asyncio.run(frames_at_the_limits(keyed_server, psutil.Process(keyed_server.process.pid)))
    answers = result["answers"]
    assert answers["at_limit"]["type"] == "input.frame.accepted", answers["at_limit"]
    assert answers["at_limit_bytes"] == result["limit"]
    assert (answers["over_limit"]["type"], answers["over_limit"]["code"]) == ("error", "frame_too_large")
    assert (answers["bomb"]["type"], answers["bomb"]["code"]) == ("error", "invalid_request")
    assert "max_input_pixels" in answers["bomb"]["message"] and answers["bomb_bytes"] < 200_000
    assert answers["bomb_rss_grown"] < 16 * 1024 * 1024, answers["bomb_rss_grown"]


def posing_step_bodies(checkpoint) -> list[dict]:
    """`/generate` bodies posing as a session's first step (a realtime rid): its rows alone, and with a frame's
    patches in stock's preprocessed form, as the server's realtime engine builds a step in process."""
    from transformers import AutoProcessor

    from mossvl_ascend.realtime.wire import step_rid
    from support.realtime import frame_string

    processor = AutoProcessor.from_pretrained(checkpoint, trust_remote_code=True)
    pixels, grid = processor.image_processor.realtime_frame(noise_image(41))
    rows = processor.tokenizer(frame_string(0.0), add_special_tokens=False)["input_ids"]
    frame = {"format": "processor_output", "pixel_values": pixels.tolist(), "grid_thw": [list(grid)]}
    text = {"rid": step_rid("posing", 0), "input_ids": rows[:4], "sampling_params": {"max_new_tokens": 4}}
    return [text, {**text, "stream": True}, {**text, "input_ids": rows, "image_data": [frame]}]


def test_a_client_cannot_pose_as_a_realtime_step(keyed_server, checkpoint):
    """Only the server's realtime engine makes realtime steps: a `/generate` request (streamed or not, with a frame
    or not) or a chat completion naming a realtime rid is refused with 400, runs nothing (no step in the
    scheduler's log) and leaves no KV held (`/v1/loads`); the socket's sessions go on."""
    url = keyed_server.base_url
    # `keyed_server` starts idle: the check below sees only what the refused requests hold.
    responses = [
        requests.post(f"{url}/generate", json=body, headers=AUTH, timeout=120)
        for body in posing_step_bodies(checkpoint)
    ]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for rid in ("mossvl-realtime:posing:0", ["mossvl-realtime:posing:1"]):
        responses.append(requests.post(f"{url}/v1/chat/completions", json={**chat, "rid": rid}, headers=AUTH))
    held = [load["num_used_tokens"] for load in loads(keyed_server)]
    assert [r.status_code for r in responses] == [400] * 5, [(r.status_code, r.text[:300]) for r in responses]
    assert held == [0] * len(held), f"KV held after the refused requests: {held}"
    log = keyed_server.log_text()
    assert "realtime step mossvl-realtime:posing" not in log and "realtime session posing" not in log
    assert asyncio.run(keyed_sessions(keyed_server)) == ["session.created", "session.created"]
    assert all(load["num_used_tokens"] == 0 for load in wait_until_idle(keyed_server))
