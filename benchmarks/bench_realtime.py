"""Realtime video sessions served by the engine (``WS /v1/video/realtime`` of ``python -m sglang.launch_server``)
against the transformers reference session, on CPU, in one dtype on both sides (``--dtype``, default float32).

Workload: N concurrent sessions (``--sessions``, default 1 2 4 8) at F frames per second (``--fps``, default 1 2)
over a ``--seconds`` stream (default 8). Frames are pushed on a real-time clock: frame k at t0 + k/F (t0 common to
all sessions of a run), each a fixed ``--size`` x ``--size`` noise image (default 128x128: 8x8 patches, 16 vision
tokens), stamped k/F seconds; one prompt is pushed right after the third frame (engine: the client sends it once
the frame's ``input.frame.accepted`` came back, as the protocol's clients do; reference: ``push_prompt`` right after
``push_frame``), or with ``--prompt-with-frame`` carried in the third frame (engine: ``input.frame`` with
``prompt``; reference: ``push_prompt_frame``). Greedy, ``--max-new-tokens`` per turn. Before the measured runs one
warm-up session (same shape, not reported) runs on each side.

Checkpoint: ``--preset`` (default ``bench``) as a MOSS-VL-Realtime checkpoint. A served turn ends only on
``<|silence|>`` and a turn that reaches its token limit ends the whole served session (``response.done``
"length"); the random bench weights almost never pick ``<|silence|>``, so a preset that is not a realtime one is
built as ``<preset>-realtime``: its seeded weights with the ``<|silence|>`` LM head row scaled and the realtime
chat template, exactly as ``tiny-realtime`` is made from ``tiny`` (``moss_vl_reference.tiny_checkpoint``). Both
sides load that same checkpoint.

Definitions (all times ``time.perf_counter()`` in this process):
  * frame latency, engine: the client's arrival of ``input.frame.accepted`` -> of ``input.frame.processed`` (the
    engine step holding the frame ran its extend and sampled its first token). Reference: the ``push_frame`` call
    -> the end of the stream forward that carried the frame (the stream's ``append`` timed per call; the call
    patchifies the frame in the caller's thread, as the engine does in its HTTP process after ``accepted``).
  * TTFT: prompt accepted (engine: ``input.prompt.accepted``, or the carrying frame's ``input.frame.accepted``;
    reference: the ``push_prompt`` or ``push_prompt_frame`` call) -> the first
    text piece of the prompt's turn or later (engine: the first ``response.text.delta`` after
    ``input.prompt.processed``; reference: the first non-control output piece after the prompt's
    ``<|round_start|>``). "-" when the model said nothing but ``<|silence|>`` before the stream ended.
  * prompt first token: prompt accepted (as for TTFT) -> the first output of the prompt's turn, text or silence
    (engine: the first ``response.text.delta`` or ``response.turn.silence`` carrying the turn that
    ``input.prompt.processed`` opened; reference: the first output piece after the prompt's ``<|round_start|>``,
    control pieces such as ``<|silence|>`` included): how fast the model reacts, whatever the weights choose to say.
  * lag of frame k: its processed time - its due time t0 + k/F (includes any wait before the push).
  * keeps up: a session keeps up when every one of its frames was processed with lag <= (1 + TOLERANCE) / F,
    i.e. before the next frame was due plus half a frame interval, so a backlog that grows by even a fraction of
    an interval per frame fails by the end of the stream. A run keeps up when all its sessions do (an ended or
    failed session does not). "most sessions that keep up at F fps": the largest N measured whose run kept up.
  * p50/p95: over every frame of every session of the run (nearest-rank).
  * peak MiB: engine, the summed VmHWM of the server's processes (launcher, scheduler, detokenizer) after the run;
    one server serves every run, in increasing N, so it is the peak up to that run. Reference: this process's
    peak RSS (measured before any server starts).
  * busy elsewhere: cores the machine spent outside this benchmark and its server during the run (all CPU time,
    steal included, less this process's and the server processes'): on a shared machine, the competition.

The reference runs first, with no server running (an idle server would take a core); the engine runs follow on
one server. Last line: ``RESULT realtime_engine sessions_realtime_1fps=N runner_sessions_realtime_1fps=M
frame_p95_ms_4=X`` (M: 1 if the one reference session keeps up at 1 fps, else 0; X: the engine's p95 frame
latency at 4 sessions, 1 fps; without a 4-session run, e.g. ``--quick``, the largest N measured at 1 fps stands
in and a warning says so), then ``prompt_first_token_ms=`` / ``runner_prompt_first_token_ms=`` (1 session, 1 fps)
and the same at 2 fps (``..._2fps=``), nan where not measured.

Run (CPU): .venv/bin/python benchmarks/bench_realtime.py [--quick] [--sessions 1 2 4 8] [--fps 1 2] [--seconds 8]
    [--dtype float32|bfloat16] [--prompt-with-frame] [--trace]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import re
import resource
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import psutil
import torch
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from moss_vl_reference import tiny_checkpoint  # noqa: E402
from moss_vl_reference.configuration_moss_vl import MossVLConfig  # noqa: E402
from moss_vl_reference.queries_moss_vl import ROUND_START  # noqa: E402
from serving.launch import SglangServer  # noqa: E402
from serving.realtime_client import RealtimeClient  # noqa: E402

logger = logging.getLogger("bench_realtime")

PROMPT = "What changed in the video?"
PROMPT_AFTER = 2  # the prompt follows the third frame
TOLERANCE = 0.5  # of a frame interval, on top of one interval (see "keeps up")
DRAIN_S = 120.0  # after the last push: the longest wait for the backlog to be processed
# The pool must hold one full context per the engine's open check; 8192 is far more than a stream here grows to.
SERVER_ARGS = ["--max-total-tokens", "32768", "--context-length", "8192"]
CONTROL_PIECE = re.compile(r"^<\|[^|]+\|>$")


@dataclass
class Run:
    """One measured configuration: frame latencies (s) and lags (s) pooled over its sessions."""

    side: str  # "engine" or "reference"
    sessions: int
    fps: float
    frames: int  # frames pushed per session
    latencies: list[float] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    first_tokens: list[float] = field(default_factory=list)  # prompt accepted -> first output of its turn
    kept_up: int = 0  # sessions that kept up
    failed: list[str] = field(default_factory=list)  # why a session ended early
    peak_mib: Optional[float] = None
    elsewhere: float = math.nan  # cores busy outside this benchmark and its server during the run

    @property
    def keeps_up(self) -> bool:
        return self.kept_up == self.sessions and not self.failed

    def add_session(
        self, latencies: list[float], lags: list[float], ttft: Optional[float], first_token: Optional[float]
    ) -> None:
        self.latencies += latencies
        self.lags += lags
        if ttft is not None:
            self.ttfts.append(ttft)
        if first_token is not None:
            self.first_tokens.append(first_token)
        limit = (1 + TOLERANCE) / self.fps
        if len(lags) == self.frames and max(lags) <= limit:
            self.kept_up += 1


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def cpu_snapshot(server: Optional[SglangServer] = None) -> tuple[float, float, float]:
    """(wall s, the machine's busy CPU s, CPU s of this process and of the server's processes)."""
    times = psutil.cpu_times()
    busy = times.user + times.nice + times.system + times.irq + times.softirq + times.steal
    processes = [psutil.Process()]
    if server is not None:
        root = psutil.Process(server.process.pid)
        processes += [root, *root.children(recursive=True)]
    ours = 0.0
    for process in processes:
        try:
            cpu = process.cpu_times()
            ours += cpu.user + cpu.system
        except psutil.NoSuchProcess:
            pass
    return time.perf_counter(), busy, ours


def cores_elsewhere(before: tuple, after: tuple) -> float:
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / (after[0] - before[0])


def noise_frame(index: int, size: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(index).integers(0, 255, (size, size, 3), dtype=np.uint8))


def realtime_checkpoint(preset: str) -> Path:
    """The checkpoint of ``preset`` as a realtime one: ``<preset>-realtime`` where the builder has one."""
    realtime = f"{preset}-realtime"
    return tiny_checkpoint.build_or_reuse(realtime if realtime in tiny_checkpoint.PRESETS else preset)


# ---------------------------------------------------------------------------------------------------- reference


def reference_run(model, processor, args, fps: float, frames: int) -> Run:
    """One reference session fed on the clock; its stream's forwards timed by wrapping ``stream.append``."""
    session = model.create_realtime_session(processor, max_new_tokens=args.max_new_tokens)
    forwards = []  # (end time, frames in the stream) after every forward
    append = session.stream.append

    def timed_append(token_ids, stream_frames):
        logits = append(token_ids, stream_frames)
        forwards.append((time.perf_counter(), session.stream.frames_seen))
        return logits

    session.stream.append = timed_append
    session.start()
    pieces = []  # (arrival, output piece)

    def read_outputs():
        while session.active or not session.outputs.empty():
            piece = session.poll_output(0.1)
            if piece is not None:
                pieces.append((time.perf_counter(), piece))

    reader = threading.Thread(target=read_outputs, daemon=True)
    reader.start()
    run, before = Run("reference", 1, fps, frames), cpu_snapshot()
    try:
        if not session.wait_until_parked(300):
            raise RuntimeError("the reference stream never parked after its prefill")
        images = [noise_frame(k, args.size) for k in range(frames)]
        t0 = time.perf_counter() + 0.2
        pushed, prompted = [], None
        for k, image in enumerate(images):
            time.sleep(max(0.0, t0 + k / fps - time.perf_counter()))
            pushed.append(time.perf_counter())
            if k == PROMPT_AFTER and args.prompt_with_frame:
                prompted = pushed[-1]
                session.push_prompt_frame(PROMPT, image, k / fps)
                continue
            session.push_frame(image, k / fps)
            if k == PROMPT_AFTER:
                prompted = time.perf_counter()
                session.push_prompt(PROMPT)
        if not session.wait_until_parked(DRAIN_S):
            run.failed.append("the reference stream did not park after the stream")
    finally:
        session.close(timeout=60)
        reader.join(timeout=10)
    done = [(k, next((at for at, seen in forwards if seen > k), None)) for k in range(len(pushed))]
    done = [(k, at) for k, at in done if at is not None]
    ttft = first_token = None
    if prompted is not None:
        after = [(at, piece) for at, piece in pieces if at >= prompted]
        start = next((i for i, (_, piece) in enumerate(after) if piece == ROUND_START), len(after))
        ttft = next((at - prompted for at, piece in after[start + 1 :] if not CONTROL_PIECE.match(piece)), None)
        first_token = next((at - prompted for at, _ in after[start + 1 :]), None)
    run.add_session([at - pushed[k] for k, at in done], [at - (t0 + k / fps) for k, at in done], ttft, first_token)
    run.peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    run.elsewhere = cores_elsewhere(before, cpu_snapshot())
    return run


def reference_runs(checkpoint: Path, args, frames_of) -> list[Run]:
    from transformers import AutoModelForCausalLM, AutoProcessor

    torch.set_grad_enabled(False)
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, trust_remote_code=True, dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
    ).eval()
    processor = AutoProcessor.from_pretrained(checkpoint, trust_remote_code=True)
    warm_up = reference_run(model, processor, args, max(args.fps), PROMPT_AFTER + 2)
    if warm_up.failed:
        raise RuntimeError(f"the reference warm-up session failed: {warm_up.failed[0]}")
    runs = []
    for fps in args.fps:
        runs.append(reference_run(model, processor, args, fps, frames_of(fps)))
        log_run(runs[-1])
    return runs


# ------------------------------------------------------------------------------------------------------- engine


def received(client: RealtimeClient, kind: str, seq_no: int) -> Optional[int]:
    """Index in ``client.events`` of the event ``kind`` for ``seq_no``."""
    return next(
        (i for i, r in enumerate(client.events) if r.event["type"] == kind and r.event.get("seq_no") == seq_no), None
    )


async def open_session(url: str, args) -> RealtimeClient:
    client = RealtimeClient(url)
    await client.open(max_new_tokens=args.max_new_tokens, temperature=0.0, input_queue_capacity=args.queue_capacity)
    await client.settle()  # the initial prefill's turn ended
    return client


async def feed(client: RealtimeClient, args, fps: float, frames: int, t0: float) -> dict:
    """Push the frames (and the prompt) on the clock, then wait until the last input's turn ended."""
    result = {"client": client, "frames": [], "prompt": None, "error": None}
    try:
        for k in range(frames):
            await asyncio.sleep(max(0.0, t0 + k / fps - time.perf_counter()))
            carried = PROMPT if k == PROMPT_AFTER and args.prompt_with_frame else None
            last = await client.frame(noise_frame(k, args.size), k / fps, prompt=carried)
            result["frames"].append(last)
            if carried:
                result["prompt"] = last
            elif k == PROMPT_AFTER:
                last = result["prompt"] = await client.prompt(PROMPT)
        await client.settle(last, timeout=DRAIN_S)
    except (RuntimeError, asyncio.TimeoutError) as error:
        ended = [r.event for r in client.events if r.event["type"] in ("response.done", "error", "session.done")]
        result["error"] = f"{type(error).__name__}: {str(error)[:160]} (server said: {ended[:2]})"
    return result


async def engine_sessions(url: str, args, count: int, fps: float, frames: int) -> tuple[list, float]:
    """Open ``count`` sessions, feed them all from one t0, close them; -> (results or open errors, t0)."""
    opened = await asyncio.gather(*(open_session(url, args) for _ in range(count)), return_exceptions=True)
    clients = [client for client in opened if isinstance(client, RealtimeClient)]
    t0 = time.perf_counter() + 0.2
    try:
        results = await asyncio.gather(*(feed(client, args, fps, frames, t0) for client in clients))
    finally:
        await asyncio.gather(*(client.close() for client in clients))
    refused = [f"open failed: {type(error).__name__}: {error}" for error in opened if isinstance(error, Exception)]
    return results + [{"error": why} for why in refused], t0


def engine_run(server: SglangServer, args, count: int, fps: float, frames: int) -> Run:
    url = server.base_url.replace("http://", "ws://") + "/v1/video/realtime"
    before = cpu_snapshot(server)
    results, t0 = asyncio.run(engine_sessions(url, args, count, fps, frames))
    run = Run("engine", count, fps, frames)
    for result in results:
        if result["error"]:
            run.failed.append(result["error"])
        client = result.get("client")
        if client is None:
            continue
        latencies, lags = [], []
        for k, seq_no in enumerate(result["frames"]):
            accepted = received(client, "input.frame.accepted", seq_no)
            processed = received(client, "input.frame.processed", seq_no)
            if processed is not None:
                latencies.append(client.events[processed].at - client.events[accepted].at)
                lags.append(client.events[processed].at - (t0 + k / fps))
        ttft = first_token = None
        if result["prompt"] is not None:
            kind = "input.frame" if args.prompt_with_frame else "input.prompt"
            accepted = received(client, f"{kind}.accepted", result["prompt"])
            processed = received(client, f"{kind}.processed", result["prompt"])
            if processed is not None:
                text = next((r for r in client.events[processed:] if r.event["type"] == "response.text.delta"), None)
                ttft = text.at - client.events[accepted].at if text else None
                first = first_output_of_turn(client, accepted, client.events[processed].event.get("turn_id"))
                first_token = first.at - client.events[accepted].at if first else None
                if args.trace:
                    log_ttft_trace(client, accepted, text, fps)
        run.add_session(latencies, lags, ttft, first_token)
    run.peak_mib = server_peak_mib(server)
    run.elsewhere = cores_elsewhere(before, cpu_snapshot(server))
    return run


def first_output_of_turn(client: RealtimeClient, since: int, turn_id: Optional[int]):
    """The first text delta or silence of turn ``turn_id`` in ``client.events`` from index ``since``, else None."""
    outputs = ("response.text.delta", "response.turn.silence")
    return next(
        (r for r in client.events[since:] if r.event["type"] in outputs and r.event.get("turn_id") == turn_id), None
    )


def log_interrupts(server: SglangServer) -> None:
    """The scheduler's account of every interrupted step of the server's runs: the tokens it had when the interrupt
    reached the scheduler and the tokens it generated (one more is the forward under way; more would be tokens
    decoded after the interrupt)."""
    log = Path(server.log_path).read_text(errors="replace")
    at_interrupt = dict(re.findall(r"realtime step (\S+) interrupted after (\d+) tokens", log))
    generated = dict(re.findall(r"realtime step (\S+): extended .*? generated (\d+)", log))
    later = [rid for rid, had in at_interrupt.items() if int(generated.get(rid, 0)) > int(had) + 1]
    logger.info(
        "interrupts: %d steps interrupted (tokens had -> generated: %s); %d decoded a token after the interrupt",
        len(at_interrupt),
        ", ".join(f"{had}->{generated.get(rid, '?')}" for rid, had in at_interrupt.items()),
        len(later),
    )


def log_ttft_trace(client: RealtimeClient, accepted: int, text, fps: float) -> None:
    """Where the time to first text goes: every event from the frame before the prompt to the first text piece of its
    turn, in ms from the prompt's ``input.prompt.accepted``."""
    start = client.events[accepted].at
    first = max(0, accepted - 2)
    last = client.events.index(text) if text is not None else len(client.events) - 1
    lines = []
    for received_event in client.events[first : last + 1]:
        event = received_event.event
        detail = " ".join(f"{k}={event[k]!r}" for k in ("seq_no", "turn_id", "next_turn_id", "delta") if k in event)
        lines.append(f"  {1e3 * (received_event.at - start):+8.1f} ms  {event['type']} {detail}")
    logger.info("TTFT trace at %g fps (ms from the prompt's accepted):\n%s", fps, "\n".join(lines))


def server_peak_mib(server: SglangServer) -> float:
    """Summed VmHWM (peak RSS) of the server's processes."""
    root = psutil.Process(server.process.pid)
    total_kib = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            status = Path(f"/proc/{process.pid}/status").read_text()
        except FileNotFoundError:
            continue
        total_kib += int(re.search(r"VmHWM:\s+(\d+)", status).group(1))
    return total_kib / 1024


def engine_runs(checkpoint: Path, args, frames_of) -> list[Run]:
    runs = []
    with SglangServer(checkpoint, extra_args=["--dtype", args.dtype, *SERVER_ARGS], name="bench-realtime") as server:
        logger.info("server up in %.1f s (log: %s)", server.startup_seconds, server.log_path)
        warm_up = engine_run(server, args, 1, max(args.fps), PROMPT_AFTER + 2)
        if warm_up.failed:
            raise RuntimeError(f"the warm-up session failed: {warm_up.failed[0]} (log: {server.log_path})")
        for count in args.sessions:
            for fps in args.fps:
                runs.append(engine_run(server, args, count, fps, frames_of(fps)))
                log_run(runs[-1])
        if args.trace:
            log_interrupts(server)
    return runs


# ------------------------------------------------------------------------------------------------------- report


def log_run(run: Run) -> None:
    logger.info(
        "%s %d session(s) at %g fps: %d/%d frames processed, p95 %.0f ms, max lag %.0f ms, %d/%d kept up%s",
        run.side,
        run.sessions,
        run.fps,
        len(run.latencies),
        run.sessions * run.frames,
        1e3 * percentile(run.latencies, 95),
        1e3 * max(run.lags, default=math.nan),
        run.kept_up,
        run.sessions,
        "".join(f"; FAILED: {why}" for why in run.failed),
    )


def most_sessions(runs: list[Run], fps: float) -> int:
    return max((run.sessions for run in runs if run.fps == fps and run.keeps_up), default=0)


def print_table(runs: list[Run], shapes: str) -> None:
    print(shapes)
    print(
        f"{'side':<10} {'sessions':>8} {'fps':>4} {'frames':>9} {'p50 ms':>8} {'p95 ms':>8} {'max lag ms':>10} "
        f"{'TTFT ms':>8} {'1st tok':>8} {'kept up':>8} {'keeps up':>8} {'peak MiB':>9} {'elsewhere':>9}"
    )
    for run in runs:
        ttft = f"{1e3 * percentile(run.ttfts, 50):.0f}" if run.ttfts else "-"
        first = f"{1e3 * percentile(run.first_tokens, 50):.0f}" if run.first_tokens else "-"
        peak = f"{run.peak_mib:.0f}" if run.peak_mib is not None else "-"
        print(
            f"{run.side:<10} {run.sessions:>8} {run.fps:>4g} {len(run.latencies):>4}/{run.sessions * run.frames:<4} "
            f"{1e3 * percentile(run.latencies, 50):>8.0f} {1e3 * percentile(run.latencies, 95):>8.0f} "
            f"{1e3 * max(run.lags, default=math.nan):>10.0f} {ttft:>8} {first:>8} {run.kept_up:>3}/{run.sessions:<4} "
            f"{'yes' if run.keeps_up else 'no':>8} {peak:>9} {run.elsewhere:>9.2f}"
        )
    for run in runs:
        for why in run.failed:
            print(f"  {run.side} {run.sessions}x{run.fps:g} fps: a session ended early: {why}")


def prompt_first_token_fields(runs: list[Run]) -> str:
    """``prompt_first_token_ms=`` (engine) and ``runner_prompt_first_token_ms=`` at 1 session, 1 fps, then 2 fps;
    the median over the run's sessions, nan where not measured."""
    fields = []
    for fps, suffix in ((1.0, ""), (2.0, "_2fps")):
        for side, name in (("engine", "prompt_first_token_ms"), ("reference", "runner_prompt_first_token_ms")):
            run = next((r for r in runs if r.side == side and r.sessions == 1 and r.fps == fps), None)
            value = 1e3 * percentile(run.first_tokens, 50) if run is not None else math.nan
            fields.append(f"{name}{suffix}={value:.1f}")
    return " ".join(fields)


def describe(checkpoint: Path, args) -> str:
    config = MossVLConfig.from_pretrained(checkpoint)
    text, vision = config.text_config, config.vision_config
    tokens = (args.size // vision.patch_size // vision.spatial_merge_size) ** 2
    return (
        f"{checkpoint.name} ({args.dtype}, CPU): text {text.hidden_size}x{text.num_hidden_layers} layers "
        f"(cross-attention {list(text.cross_attention_layers)}), vision {vision.hidden_size}x{vision.depth}; "
        f"frames {args.size}x{args.size} noise ({tokens} vision tokens each), {args.seconds:g} s stream, prompt "
        f"after frame {PROMPT_AFTER + 1}, {args.max_new_tokens} new tokens per turn at most; "
        f"keeps up: every frame's lag <= {1 + TOLERANCE:g} frame intervals"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny-realtime preset, 1 and 2 sessions, a 3 s stream (overrides those three flags; for the test)",
    )
    parser.add_argument(
        "--sessions", type=int, nargs="+", default=[1, 2, 4, 8], help="concurrent engine sessions (default 1 2 4 8)"
    )
    parser.add_argument("--fps", type=float, nargs="+", default=[1.0, 2.0], help="frames per second (default 1 2)")
    parser.add_argument("--seconds", type=float, default=8.0, help="stream length in seconds (default 8)")
    parser.add_argument(
        "--preset",
        choices=sorted(tiny_checkpoint.PRESETS),
        default="bench",
        help="checkpoint preset, served as a realtime checkpoint (default bench: bench-realtime)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights and activations on both sides (default float32; bfloat16 uses the CPU's bf16 kernels)",
    )
    parser.add_argument("--size", type=int, default=128, help="frame side in pixels (default 128: 16 vision tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="token limit of one turn (default 64)")
    parser.add_argument(
        "--queue-capacity",
        type=int,
        default=64,
        help="input_queue_capacity of each served session (default 64: the server never holds a push back)",
    )
    parser.add_argument(
        "--prompt-with-frame",
        action="store_true",
        help="carry the prompt in the third frame (input.frame with prompt; push_prompt_frame) instead of sending it "
        "after that frame was accepted",
    )
    parser.add_argument(
        "--trace", action="store_true", help="log each run's events from the prompt to its first text (TTFT trace)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.sessions, args.seconds = "tiny-realtime", [1, 2], 3.0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    started = time.monotonic()
    checkpoint = realtime_checkpoint(args.preset)

    def frames_of(fps: float) -> int:
        return max(PROMPT_AFTER + 1, round(args.seconds * fps))

    runs = reference_runs(checkpoint, args, frames_of)
    runs += engine_runs(checkpoint, args, frames_of)
    engine = [run for run in runs if run.side == "engine"]
    print_table(runs, describe(checkpoint, args))
    one_fps = [run for run in engine if run.fps == 1.0]
    at_four = next((run for run in one_fps if run.sessions == 4), None)
    if at_four is None and one_fps:
        at_four = max(one_fps, key=lambda run: run.sessions)
        logger.warning("no 4-session run at 1 fps: frame_p95_ms_4 is taken at %d session(s)", at_four.sessions)
    p95_four = 1e3 * percentile(at_four.latencies, 95) if at_four else math.nan
    logger.info("whole run: %.0f s", time.monotonic() - started)
    print(
        f"RESULT realtime_engine sessions_realtime_1fps={most_sessions(engine, 1.0)} "
        f"runner_sessions_realtime_1fps={most_sessions([r for r in runs if r.side == 'reference'], 1.0)} "
        f"frame_p95_ms_4={p95_four:.1f} {prompt_first_token_fields(runs)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
