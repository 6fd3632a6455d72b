"""Realtime sessions through `WS /v1/video/realtime` of a real `python -m sglang.launch_server` (CPU, fp32), each
session's output against the reference stream driven by the same script (`support.realtime`).

Per session: each turn's text (its deltas joined) equals the reference's tokens of that turn decoded, and there is
one `response.turn.silence` per reference turn. Per step, from the scheduler's log: only the new frames went through the
vision tower and the extend held only the step's rows (so a silent re-prefill fails). After the sessions close the KV
pool is idle (`/v1/loads`). An ordinary OpenAI request runs alongside and still equals the reference model.

With a frame window (`MOSSVL_REALTIME_FRAME_WINDOW_S`) the oracle is the reference stream with the same window, and a
300-frame stream must hold no more encoder slots than its window's frames need (whole pages).
"""

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from moss_vl_reference.tiny_checkpoint import build_or_reuse
from mossvl_ascend.realtime.engine import FRAME_WINDOW_ENV
from serving.launch import SglangServer
from serving.realtime_client import RealtimeClient
from support.realtime import (
    SCRIPTS,
    TURN_LIMIT,
    frames_of,
    noise_image,
    reference_generated,
    segment_text,
    served_turn_texts,
    turn_texts,
)
from support.serving import (
    CASES,
    kv_load,
    load_reference,
    openai_client,
    reference_ids,
    served_ids,
    wait_for_load,
)

pytestmark = pytest.mark.timeout(1800)

STEP_LINE = re.compile(
    r"realtime step mossvl-realtime:(\w+):(\d+): extended (\d+) rows, (\d+) new frames through the vision tower"
)
CONFIGS = {
    "page128-radix": ["--page-size", "128"],
    "page1-noradix-chunk8-mixed": ["--disable-radix-cache", "--chunked-prefill-size", "8", "--enable-mixed-chunk"],
    # Two data-parallel ranks: every step of a session must reach the rank that holds its KV.
    "dp2-page128": ["--dp-size", "2", "--page-size", "128"],
    # Two tensor-parallel ranks: each rank's scheduler keeps its half of every session's K/V.
    "tp2-page128": ["--tp-size", "2", "--page-size", "128"],
    # A 1 s frame window: the 2 fps scripts evict frames, and a page of 8 slots (under 2 tiny frames) is given back
    # while the page it shares with the window's first frame keeps evicted keys the rows must not see.
    "window1s-page8-chunk8": ["--page-size", "8", "--chunked-prefill-size", "8"],
}
WINDOWS = {"window1s-page8-chunk8": 1.0}
# An image question with its own system turn: the realtime checkpoint's chat template adds its realtime system
# prompt to a conversation without one, sglang's "moss-vl" template does not.
ALONGSIDE = [{"role": "system", "content": "Answer briefly."}, *CASES["image_data_url"]]


@pytest.fixture(scope="module")
def checkpoint():
    return build_or_reuse("tiny-realtime")


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


async def play(client: RealtimeClient, actions) -> None:
    """Each action of a script in turn, waiting for the turn it starts to end."""
    for action in actions:
        if action[0] == "frame":
            seq_no = await client.frame(noise_image(action[2]), action[1])
        elif action[0] == "prompt":
            seq_no = await client.prompt(action[1])
        else:
            seq_no = await client.frame(noise_image(action[3]), action[2], prompt=action[1])
        await client.settle(seq_no)


async def drive_client(client: RealtimeClient, script) -> None:
    await client.open(max_new_tokens=TURN_LIMIT, temperature=0.0)
    await client.settle()
    await play(client, script)


async def drive(url: str, script) -> RealtimeClient:
    client = RealtimeClient(url)
    await drive_client(client, script)
    await client.close()
    return client


async def all_sessions(url: str) -> dict:
    names = sorted(SCRIPTS)
    clients = await asyncio.gather(*(drive(url, SCRIPTS[name]) for name in names))
    return dict(zip(names, clients))


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_four_sessions_equal_the_reference_streams(checkpoint, reference, config, monkeypatch):
    window = WINDOWS.get(config)
    if window is not None:
        monkeypatch.setenv(FRAME_WINDOW_ENV, str(window))
    extra = ["--dtype", "float32", "--max-total-tokens", "6000", "--context-length", "4096", *CONFIGS[config]]
    with SglangServer(checkpoint, extra_args=extra, name=f"realtime-{config}") as server:
        url = server.base_url.replace("http://", "ws://") + "/v1/video/realtime"
        client, model_name = openai_client(server)
        with ThreadPoolExecutor(max_workers=1) as pool:
            ordinary = pool.submit(served_ids, client, model_name, ALONGSIDE)
            sessions = asyncio.run(all_sessions(url))
            ordinary = ordinary.result()
        idle = wait_until_idle(server)
        log = server.log_path.read_text()
    tokenizer = reference["tokenizer"]
    if window is not None:
        assert "left the window" in log
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


def wait_until_idle(server, timeout_s: float = 60.0) -> list[dict]:
    """Every rank's ``/v1/loads`` report once none holds KV (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = requests.get(f"{server.base_url}/v1/loads", timeout=30).json()["loads"]
        if all(load["num_used_tokens"] == 0 for load in loads) or time.monotonic() > deadline:
            return loads
        time.sleep(0.2)


async def faults(url: str, script) -> dict:
    """Three sessions (the cap, every request row kept), a fourth refused; one takes a frame while every row is
    kept; one disconnects right after a frame; one gets bad inputs (a
    `seq_no` gap, a timestamp going back, an unknown event, a malformed frame) between its script's steps and must
    still equal the reference."""
    keep = [RealtimeClient(url) for _ in range(3)]
    for client in keep:
        await client.open(max_new_tokens=TURN_LIMIT, temperature=0.0)
        await client.settle()
    refused = RealtimeClient(url)
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
    victim, bystander = keep
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
    await victim.close()
    await bystander.close()
    return {"refusal": refusal, "errors": errors, "victim": victim, "dropped": dropped}


def test_refusal_disconnect_and_bad_inputs(checkpoint, reference):
    script = SCRIPTS["six_frames_2fps"]
    extra = ["--dtype", "float32", "--max-total-tokens", "6000", "--context-length", "4096"]
    with SglangServer(checkpoint, extra_args=[*extra, "--max-running-requests", "3"], name="realtime-faults") as server:
        url = server.base_url.replace("http://", "ws://") + "/v1/video/realtime"
        result = asyncio.run(faults(url, script))
        idle = wait_for_load(server, lambda load: load["num_used_tokens"] == 0, timeout_s=60)
        log = server.log_path.read_text()
    assert result["refusal"] is not None and "session_capacity_exceeded" in result["refusal"]
    assert [error["code"] for error in result["errors"]] == ["invalid_request"] * 4
    tokens = reference["streams"][None]["six_frames_2fps"]
    assert served_turn_texts(result["victim"]) == turn_texts(reference["tokenizer"], tokens)
    assert idle["num_used_tokens"] == 0, idle
    assert log.count("realtime session") >= 3 and "closed:" in log
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
    monkeypatch.setenv("SGLANG_TEST_RETRACT", "1")
    extra = ["--dtype", "float32", "--max-total-tokens", "6000", "--context-length", "4096"]
    with SglangServer(checkpoint, extra_args=extra, name="realtime-retract") as server:
        url = server.base_url.replace("http://", "ws://") + "/v1/video/realtime"
        sessions = asyncio.run(two_sessions_under_pressure(url))
        idle = wait_for_load(server, lambda load: load["num_used_tokens"] == 0, timeout_s=60)
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
    assert idle["num_used_tokens"] == 0, idle


def long_prompt(words: int) -> str:
    """About one token per word on the tiny checkpoint's tokenizer."""
    return "Remember: " + "word " * words


# Parked sessions that fill most of a 4096-slot pool (2048 stock tokens in the MOSS-VL layout): one with three frames
# and a prompt, a heavy one and a lighter one holding long prompts.
PARKED_SCRIPTS = {
    "light": SCRIPTS["frames_1fps_then_prompt"],
    "heavy": (("prompt", long_prompt(1400)), ("frame", 0.0, 21)),
    "lighter": (("prompt", long_prompt(700)), ("frame", 0.0, 22)),
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


async def parked_sessions_stall_the_pool(url: str, server) -> dict:
    """Each session plays its script but its last action and parks; an OpenAI request that the pool's free slots
    cannot take but would with the heavy session's arrives; then each session plays its last action."""
    clients = {name: RealtimeClient(url) for name in PARKED_SCRIPTS}
    for name, client in clients.items():
        await drive_client(client, PARKED_SCRIPTS[name][:-1])
    parked = kv_load(server)
    free = parked["max_total_num_tokens"] - parked["num_used_tokens"]
    words = free + 64  # its prompt alone is over the free slots
    openai, model_name = openai_client(server)
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


def test_parked_sessions_stalling_the_pool_lose_the_heaviest_and_the_others_go_on(checkpoint, parked_reference):
    """Parked sessions hold KV with no request in the scheduler, so retraction cannot reach them: a request that
    cannot be admitted while nothing runs would wait for their timeouts. The heaviest parked session is evicted
    (an error event at its next input); the request then runs and equals the reference; the other sessions stay
    exact; the pool ends idle. Page 128."""
    extra = ["--dtype", "float32", "--max-total-tokens", "2048", "--context-length", "2048", "--page-size", "128"]
    with SglangServer(checkpoint, extra_args=extra, name="realtime-parked-stall") as server:
        url = server.base_url.replace("http://", "ws://") + "/v1/video/realtime"
        result = asyncio.run(parked_sessions_stall_the_pool(url, server))
        idle = wait_until_idle(server)
        log = server.log_path.read_text()
    parked = result["parked"]
    assert parked["num_used_tokens"] > parked["max_total_num_tokens"] / 2, parked
    assert log.count("evicted while parked") == 1, "one eviction makes room"
    assert [name for name, errors in result["errors"].items() if errors] == ["heavy"]
    assert "evicted under KV memory pressure" in result["errors"]["heavy"][0]["message"]
    assert result["clients"]["heavy"].count("session.done") == 1
    model, processor = parked_reference["model"], parked_reference["processor"]
    for name in ("light", "lighter"):
        expected = turn_texts(processor.tokenizer, parked_reference["streams"][name])
        assert served_turn_texts(result["clients"][name]) == expected, name
    assert (
        result["ordinary"]["completion_ids"] == reference_ids(model, processor, stalling_question(result["words"]))[1]
    )
    assert all(load["num_used_tokens"] == 0 for load in idle), idle


LONG_STREAM_FRAMES = 300
WINDOW_FRAMES = 20
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
    """The reference stream of the 300-frame script with the window, and the vision tokens of one frame."""
    model, processor = load_reference(checkpoint)
    script = tuple(("frame", float(i), 1000 + i) for i in range(LONG_STREAM_FRAMES))
    tokens = reference_generated(model, processor, script, WINDOW_FRAMES - 0.5)
    image_processor = processor.image_processor
    _, grid = image_processor.patchify_frames([noise_image(0)], image_processor.video_max_pixels)
    merge = model.config.vision_config.spatial_merge_size
    return {"tokens": tokens, "frame_tokens": grid[1] * grid[2] // merge**2 + 1, "tokenizer": processor.tokenizer}


@pytest.mark.parametrize("page", [1, 128])
def test_a_long_stream_holds_only_its_window(checkpoint, long_reference, page, monkeypatch):
    """A 300-frame stream with a 20-frame window (19.5 s at 1 fps): its output equals the reference stream with
    that window, and parked after the last frame it holds its window's vision slots (at page 1 exactly; at page 128
    rounded out to whole pages at both ends) plus its text; without the window the frames alone would need 1500.
    One band per slot on the tiny checkpoint (2 self-attention and 2 cross-attention layers)."""
    monkeypatch.setenv(FRAME_WINDOW_ENV, str(WINDOW_FRAMES - 0.5))
    extra = ["--dtype", "float32", "--max-total-tokens", "12000", "--context-length", "8192", "--page-size", str(page)]
    with SglangServer(checkpoint, extra_args=extra, name=f"realtime-long-window-page{page}") as server:
        url = server.base_url.replace("http://", "ws://") + "/v1/video/realtime"
        result = asyncio.run(long_stream(url, server))
        idle = wait_until_idle(server)
        log = server.log_path.read_text()
    assert served_turn_texts(result["client"]) == turn_texts(long_reference["tokenizer"], long_reference["tokens"])
    encoder_rows, text_rows = map(int, HOLDS.findall(log)[-1])
    window_slots = WINDOW_FRAMES * long_reference["frame_tokens"]
    if page == 1:
        assert encoder_rows == window_slots
    else:
        assert encoder_rows <= -(-window_slots // page) * page + page, encoder_rows
    assert LONG_STREAM_FRAMES * long_reference["frame_tokens"] > encoder_rows + 2 * page
    assert result["used"] <= encoder_rows + -(-(text_rows + 1) // page) * page, result["used"]
    assert all(load["num_used_tokens"] == 0 for load in idle), idle
