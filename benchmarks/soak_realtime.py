"""Soak: realtime sessions served by sglang for many minutes, with the frame window on (``make soak-realtime``).

Workload, on one CPU server (``--dtype float32``, ``MOSSVL_REALTIME_FRAME_WINDOW_S`` = ``--window-s``):
``--sessions`` sessions (default 4) each stream ``--size`` noise frames at ``--fps`` (default 1) on a real-time clock
for ``--minutes``; each asks a question every ``--question-every`` seconds (default 30, staggered across sessions);
session 0 barges in once a minute (a prompt sent right after a frame, so it lands in that frame's step); once, at
half time, the last session's client drops its socket without a word and reconnects as a new session, which
streams on. Greedy, ``--max-new-tokens`` per turn.

Answers against the reference: a probe session (two frames, then a question, each input sent once the stream is
parked) runs before the load and again in the last minute under the load; each probe's tokens (every token the
session generated, the question's turn included) must equal the transformers reference stream's token ids for the
same inputs (the same checkpoint, fp32, the same frame window), computed before the server starts. The served ids
are read from sglang's own request log (``/configure_logging``, JSON, turned on for the probes only): every step of
the probe session is one request whose ``output_ids`` it logs. Text is not compared: on random tiny weights an answer
is mostly bytes that decode to U+FFFD, so different tokens read the same.

Every ``--sample-every`` seconds (default 10): the server's RSS (the sum over its processes), ``/v1/loads`` KV tokens
in use, the most vision tokens one session holds (its ``session.usage`` ``encoder_kv_tokens``, which the window
bounds), the frames processed in the interval and their p95 latency (``input.frame.accepted`` ->
``input.frame.processed``, as ``bench_realtime.py`` times it).

Definitions: aborted = sessions that ended before the soak did (an error marked fatal, ``session.done``,
``response.done`` or a closed socket; the deliberate drop is not counted); errors = ``error`` events received by any
session plus the server log's ``Traceback`` / `` ERROR `` lines; rss_slope_mib_per_min = the least-squares slope of RSS
over the samples after the warm-up (the first ``--warm-up-s`` seconds, default 60, or the first fifth of a shorter
run; the line before the last gives the same slope for each server process); p95_drift = the frame p95 over the last
span / over the first span after the warm-up (span: 5 minutes, or a third of what is left of a shorter run);
encoder_kv_bound = 2 x (window x fps + 1) frames of vision tokens (a window of frames, and as many again drained by
one step behind a backlog, held until that step ends; a frame's vision tokens as the probe's usage counts them).

Last line: ``RESULT soak_realtime minutes= sessions= aborted= errors= rss_slope_mib_per_min= kv_slope_per_min=
encoder_kv_max= encoder_kv_bound= p95_first_ms= p95_last_ms= p95_drift= answers_equal=K/N``.

Run (CPU): .venv/bin/python benchmarks/soak_realtime.py --minutes 20 [--sessions 4] [--preset tiny-realtime]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import psutil
import requests
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.bench_realtime import noise_frame, percentile, realtime_checkpoint  # noqa: E402
from moss_vl_reference import tiny_checkpoint  # noqa: E402
from mossvl_ascend.realtime.wire import parse_step_rid  # noqa: E402
from serving.launch import SglangServer  # noqa: E402
from serving.realtime_client import RealtimeClient  # noqa: E402

logger = logging.getLogger("soak_realtime")

QUESTIONS = ("What changed?", "What do you see now?", "Is anything moving?", "Describe the scene.")
BARGE_IN = "Stop, what was that?"
PROBE_QUESTION = "What is in the picture?"
PROBE_FRAMES = ((0.0, 101), (1.0, 102))  # (timestamp, noise seed)
ENDED = ("session.done", "response.done")
SERVER_ERROR_MARKERS = ("Traceback", " ERROR ")
# sglang's request log while a probe runs: level 2 keeps a step's output_ids whole (lists of up to 2048 entries).
PROBE_REQUEST_LOG = {"log_requests_level": 2, "log_requests_format": "json"}


@dataclass
class Sample:
    at: float  # seconds since the load started
    rss_by_process: dict[str, float]  # MiB, by process name
    kv_tokens: int
    encoder_kv_max: int
    frames: int
    p95_ms: float

    @property
    def rss_mib(self) -> float:
        """The server's RSS: the sum over its processes."""
        return sum(self.rss_by_process.values())


@dataclass
class Soak:
    clients: list = field(default_factory=list)  # every client the load opened, the dropped one included
    dropped: Optional[RealtimeClient] = None
    samples: list[Sample] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # sessions that ended early, and why


# ------------------------------------------------------------------------------------------------ the reference


def reference_probe_tokens(checkpoint: Path, args) -> list[int]:
    """The token ids the reference stream generates for the probe (its prefill's, each frame's and the question's
    turns), computed with no server running."""
    from transformers import AutoModelForCausalLM, AutoProcessor

    torch.set_grad_enabled(False)
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, trust_remote_code=True, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    processor = AutoProcessor.from_pretrained(checkpoint, trust_remote_code=True)
    session = model.create_realtime_session(
        processor, max_new_tokens=args.max_new_tokens, frame_window_seconds=args.window_s
    ).start()
    try:
        if not session.wait_until_parked(300):
            raise RuntimeError("the reference stream never parked after its prefill")
        for timestamp, seed in PROBE_FRAMES:
            session.push_frame(noise_frame(seed, args.size), timestamp)
            session.wait_until_parked(300)
        session.push_prompt(PROBE_QUESTION)
        if not session.wait_until_parked(300):
            raise RuntimeError("the reference stream did not park after the probe question")
    finally:
        session.close(timeout=60)
    return list(session.generated)


# ------------------------------------------------------------------------------------------------------ served


async def open_client(url: str, args) -> RealtimeClient:
    client = RealtimeClient(url)
    await client.open(max_new_tokens=args.max_new_tokens, temperature=0.0, include_usage=True)
    await client.settle()
    return client


def request_log(server: SglangServer, on: bool) -> None:
    body = {"log_requests": on, **PROBE_REQUEST_LOG}
    requests.post(f"{server.base_url}/configure_logging", json=body, timeout=30).raise_for_status()


def logged_new_session_tokens(log_text: str) -> list[int]:
    """The generated token ids of the one realtime session that opened within ``log_text`` (sglang's JSON request
    log): each of its numbered steps' ``output_ids`` in step order (its ``close`` request is not part of the stream).
    The socket's session id is not the engine's, so the probe is found as the session whose step 0 is logged: the
    load's sessions opened before the log was turned on."""
    sessions: dict[str, dict[int, list[int]]] = {}
    for line in log_text.splitlines():
        if '"event": "request.finished"' not in line:
            continue
        record = json.loads(line[line.index("{") :])
        step = parse_step_rid(record.get("rid"))
        if step is not None and step[1].isdigit():
            sessions.setdefault(step[0], {})[int(step[1])] = record["out"]["output_ids"]
    opened = [steps for steps in sessions.values() if 0 in steps]
    if len(opened) != 1:
        raise RuntimeError(f"{len(opened)} realtime sessions opened while the probe ran, expected 1")
    return [token for step in sorted(opened[0]) for token in opened[0][step]]


async def served_probe_tokens(server: SglangServer, url: str, args) -> tuple[list[int], int]:
    """The probe on a fresh session, each input once the stream is parked, sglang's request log on meanwhile;
    -> (the session's generated token ids, the vision tokens one frame holds, from the session's usage)."""
    log_start = Path(server.log_path).stat().st_size
    await asyncio.to_thread(request_log, server, True)
    client = await open_client(url, args)
    try:
        for timestamp, seed in PROBE_FRAMES:
            await client.settle(await client.frame(noise_frame(seed, args.size), timestamp))
        await client.settle(await client.prompt(PROBE_QUESTION))
    finally:
        await client.close()
        await asyncio.to_thread(request_log, server, False)
    with open(server.log_path, "rb") as log:
        log.seek(log_start)
        tokens = logged_new_session_tokens(log.read().decode(errors="replace"))
    encoder = max(r.event["encoder_tokens"] for r in client.events if r.event["type"] == "session.usage")
    return tokens, encoder // len(PROBE_FRAMES)


def ended_early(client: RealtimeClient) -> Optional[str]:
    """Why a session ended (an end event, a fatal error, its socket closed), None while it runs."""
    for received in client.events:
        event = received.event
        if event["type"] in ENDED or (event["type"] == "error" and event.get("fatal")):
            return f"{event['type']}: {str(event)[:200]}"
    if client._reader is not None and client._reader.done():
        return "socket closed"
    return None


async def stream(args, index: int, client: RealtimeClient, start: float, stop: float) -> None:
    """One session's frames on the clock from ``start``, its questions, and (session 0) a barge-in a minute."""
    asked = index * args.question_every / max(1, args.sessions)  # questions staggered across sessions
    barged = 0.0
    k = 0
    while True:
        due = start + k / args.fps
        if due >= stop:
            return
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        if ended_early(client):
            return
        await client.frame(noise_frame(1000 * index + k, args.size), k / args.fps)
        elapsed = time.perf_counter() - start
        if index == 0 and elapsed - barged >= 60.0:
            barged = elapsed
            await client.prompt(BARGE_IN)  # right behind the frame: it lands in that frame's step
        elif elapsed - asked >= args.question_every:
            asked = elapsed
            await client.prompt(QUESTIONS[k % len(QUESTIONS)])
        k += 1


async def drop_and_reconnect(url: str, args, index: int, soak: Soak, start: float, stop: float) -> None:
    """The last session: at half time its client drops the socket; a new session streams on in its place."""
    client = soak.clients[index]
    half = start + (stop - start) / 2
    await stream(args, index, client, start, half)
    soak.dropped = client
    await client.close()
    logger.info("session %d dropped its socket at %.0f s; reconnecting", index, half - start)
    replacement = await open_client(url, args)
    soak.clients.append(replacement)
    await stream(args, index, replacement, time.perf_counter(), stop)


def server_rss_mib_by_process(server: SglangServer) -> dict[str, float]:
    """RSS of each of the server's processes (the launcher, then its children by process name), MiB."""
    root = psutil.Process(server.process.pid)
    by_process = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            name = "launcher" if process is root else process.name()
            by_process[name] = by_process.get(name, 0.0) + process.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return by_process


def kv_tokens(server: SglangServer) -> int:
    response = requests.get(f"{server.base_url}/v1/loads", timeout=30)
    response.raise_for_status()
    return int(response.json()["loads"][0]["num_used_tokens"])


def frame_latencies(clients, since: float, until: float) -> list[float]:
    """Latencies (s) of the frames whose ``processed`` arrived in [since, until) (perf_counter times)."""
    latencies = []
    for client in clients:
        accepted = {}
        for received in client.events:
            event = received.event
            if event["type"] == "input.frame.accepted":
                accepted[event["seq_no"]] = received.at
            elif event["type"] == "input.frame.processed" and since <= received.at < until:
                if event["seq_no"] in accepted:
                    latencies.append(received.at - accepted[event["seq_no"]])
    return latencies


def encoder_kv_max(clients) -> int:
    return max(
        (r.event["encoder_kv_tokens"] for c in clients for r in c.events if r.event["type"] == "session.usage"),
        default=0,
    )


async def sample_every(server: SglangServer, args, soak: Soak, start: float, stop: float) -> None:
    previous = start
    while stop - time.perf_counter() > 1.0:  # no sample of an interval too short to hold a frame
        await asyncio.sleep(min(args.sample_every, stop - time.perf_counter()))
        now = time.perf_counter()
        latencies = frame_latencies(soak.clients, previous, now)
        rss = await asyncio.to_thread(server_rss_mib_by_process, server)
        kv = await asyncio.to_thread(kv_tokens, server)
        soak.samples.append(
            Sample(now - start, rss, kv, encoder_kv_max(soak.clients), len(latencies), 1e3 * percentile(latencies, 95))
        )
        previous = now


async def soak_run(server: SglangServer, args) -> tuple[Soak, list[tuple[list[int], int]], float]:
    """The load with the probes at its ends; -> (what it measured, the two probes' token ids and vision tokens per
    frame, the load's start time)."""
    url = server.base_url.replace("http://", "ws://") + "/v1/video/realtime"
    answers = [await served_probe_tokens(server, url, args)]
    soak = Soak()
    soak.clients = list(await asyncio.gather(*(open_client(url, args) for _ in range(args.sessions))))
    start = time.perf_counter() + 0.2
    stop = start + 60.0 * args.minutes
    streams = [stream(args, i, soak.clients[i], start, stop) for i in range(args.sessions - 1)]
    streams.append(drop_and_reconnect(url, args, args.sessions - 1, soak, start, stop))

    async def last_probe():
        await asyncio.sleep(max(0.0, stop - 45.0 - time.perf_counter()))
        answers.append(await served_probe_tokens(server, url, args))

    await asyncio.gather(*streams, sample_every(server, args, soak, start, stop), last_probe())
    for index, client in enumerate(soak.clients):
        why = None if client is soak.dropped else ended_early(client)
        if why:
            soak.failed.append(f"session {index}: {why}")
    await asyncio.gather(*(client.close() for client in soak.clients if client is not soak.dropped))
    return soak, answers, start


# ------------------------------------------------------------------------------------------------------ report


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope (per minute) of (seconds, value) points; nan for fewer than 2."""
    if len(points) < 2:
        return math.nan
    seconds, values = np.array(points, dtype=float).T
    return float(np.polyfit(seconds / 60.0, values, 1)[0])


def server_errors(server: SglangServer) -> int:
    log = Path(server.log_path).read_text(errors="replace")
    return sum(any(marker in line for marker in SERVER_ERROR_MARKERS) for line in log.splitlines())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0, help="length of the load (default 20)")
    parser.add_argument("--sessions", type=int, default=4, help="concurrent sessions (default 4)")
    parser.add_argument("--fps", type=float, default=1.0, help="frames per second per session (default 1)")
    parser.add_argument("--window-s", type=float, default=20.0, help="MOSSVL_REALTIME_FRAME_WINDOW_S (default 20)")
    parser.add_argument("--question-every", type=float, default=30.0, help="seconds between questions (default 30)")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples (default 10)")
    parser.add_argument("--warm-up-s", type=float, default=60.0, help="samples left out of the slopes (default 60)")
    parser.add_argument("--preset", choices=sorted(tiny_checkpoint.PRESETS), default="tiny-realtime")
    parser.add_argument("--size", type=int, default=128, help="frame side in pixels (default 128)")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=512,
        help="token limit of one turn (default 512: a turn at it ends the session)",
    )
    parser.add_argument("--context-length", type=int, default=32768, help="server --context-length (default 32768)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    checkpoint = realtime_checkpoint(args.preset)
    reference = reference_probe_tokens(checkpoint, args)
    # Text rows grow with the stream (the window bounds the vision tokens only): room for every session's context.
    pool = args.context_length * (args.sessions + 2)
    server_args = ["--dtype", "float32", "--max-total-tokens", str(pool), "--context-length", str(args.context_length)]
    env = {"MOSSVL_REALTIME_FRAME_WINDOW_S": f"{args.window_s:g}"}
    with SglangServer(checkpoint, extra_args=server_args, name="soak-realtime", env=env) as server:
        logger.info("server up in %.1f s (log: %s)", server.startup_seconds, server.log_path)
        soak, answers, start = asyncio.run(soak_run(server, args))
        errors = server_errors(server)
    errors += sum(client.count("error") for client in soak.clients)
    print_report(soak, args, checkpoint, reference, answers, start, errors)
    return 0


def print_report(soak: Soak, args, checkpoint: Path, reference: list, probes: list, start: float, errors: int):
    answers, tokens_per_frame = [answer for answer, _ in probes], max(tokens for _, tokens in probes)
    # A window of frames, plus as many again drained by one step behind a backlog (their KV is held until the step
    # ends and the frames before the window go back to the pool).
    bound = int(2 * (args.window_s * args.fps + 1) * tokens_per_frame)
    print(
        f"{checkpoint.name} (fp32, CPU): {args.sessions} sessions x {args.fps:g} fps for {args.minutes:g} min, "
        f"frame window {args.window_s:g} s, a question every {args.question_every:g} s, a barge-in a minute, one drop"
    )
    print(f"{'t s':>6} {'RSS MiB':>8} {'KV tokens':>9} {'enc KV max':>10} {'frames':>6} {'p95 ms':>7}")
    for s in soak.samples:
        print(f"{s.at:>6.0f} {s.rss_mib:>8.0f} {s.kv_tokens:>9} {s.encoder_kv_max:>10} {s.frames:>6} {s.p95_ms:>7.0f}")
    for why in soak.failed:
        print(f"  ended early: {why}")
    total = 60.0 * args.minutes
    warm = min(args.warm_up_s, total / 5)
    steady = [s for s in soak.samples if s.at > warm]
    span = min(300.0, (total - warm) / 3)
    first = frame_latencies(soak.clients, start + warm, start + warm + span)
    last = frame_latencies(soak.clients, start + total - span, start + total)
    p95_first, p95_last = 1e3 * percentile(first, 95), 1e3 * percentile(last, 95)
    equal = sum(answer == reference for answer in answers)
    print(f"probe token ids: reference {reference}; served {answers}")
    names = sorted({name for s in steady for name in s.rss_by_process})
    slopes = {name: slope_per_min([(s.at, s.rss_by_process.get(name, 0.0)) for s in steady]) for name in names}
    print("RSS slope by process after the warm-up: " + ", ".join(f"{n} {v:.2f} MiB/min" for n, v in slopes.items()))
    print(
        f"RESULT soak_realtime minutes={args.minutes:g} sessions={args.sessions} aborted={len(soak.failed)} "
        f"errors={errors} rss_slope_mib_per_min={slope_per_min([(s.at, s.rss_mib) for s in steady]):.2f} "
        f"kv_slope_per_min={slope_per_min([(s.at, s.kv_tokens) for s in steady]):.1f} "
        f"encoder_kv_max={encoder_kv_max(soak.clients)} encoder_kv_bound={bound} "
        f"p95_first_ms={p95_first:.1f} p95_last_ms={p95_last:.1f} p95_drift={p95_last / p95_first:.2f} "
        f"answers_equal={equal}/{len(answers)}"
    )


if __name__ == "__main__":
    sys.exit(main())
