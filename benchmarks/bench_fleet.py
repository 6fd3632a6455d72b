"""MOSS-VL workers behind sglang's gateway (smg) on this machine: 1 vs 2 workers, routing overhead, cache-aware vs
round-robin prefix reuse, and how fast a killed worker leaves the rotation.

One fleet (``serving.fleet``: CPU workers, fp32, page size 1 (see ``WORKER_ARGS``), the tiny-realtime checkpoint,
smg on loopback) is started once; the 1-worker phase has the second worker deregistered from smg (it idles, ~0 CPU with
``--sleep-on-idle``), the 2-worker phase has both.

Definitions (times ``time.perf_counter()`` in this process):
  * chat req/s: ``--requests`` image chats (each a different 64x64 noise image, ``--max-tokens`` greedy tokens),
    ``--concurrency`` at a time through smg; requests / wall time.
  * realtime: ``--sessions`` sessions through smg's ``/v1/realtime``, each fed ``--frames`` 64x64 noise frames on a
    1 fps clock; a session keeps real time when every frame is processed within 1.5 frame intervals of its due time
    (``bench_realtime``'s rule); p95 lag over all frames.
  * routing overhead: the median latency of ``--probes`` one-token text requests through smg minus the median of
    the same requests sent to the worker directly, one at a time.
  * cached-token ratio: ``--conversations`` three-turn conversations (an image question, then two text follow-ups,
    the earlier turns repeated), interleaved turn by turn, through a fresh gateway of each policy with both workers'
    caches flushed; the sum of ``cached_tokens`` over the sum of ``prompt_tokens``.
  * ejection: a worker killed (SIGKILL) -> smg no longer lists it as healthy (its health probe: every 1 s, one
    failure ejects). A streamed chat in flight on the killed worker reports what its client saw.

On this 2-core machine the workers share the same two cores, so the 2-worker / 1-worker throughput ratio measures
the gateway's and the second process's overhead, not scaling (see docs/benchmarks.md for the 8-card model).

    python benchmarks/bench_fleet.py [--requests 16] [--concurrency 4] [--sessions 2] [--frames 6]

Last line: ``RESULT fleet chat_rps_1w=.. chat_rps_2w=.. realtime_kept_1w=a/b realtime_kept_2w=a/b
overhead_ms=.. cached_cache_aware=.. cached_round_robin=.. ejection_s=..``.

``--pd``: chat latency while videos arrive, aggregated vs prefill/decode disaggregation (issue 51 item 7), instead of
the phases above. Two set-ups run one after the other in this process, each behind smg 1.13.0, on the ``tiny``
checkpoint (fp32, ``--page-size 128``, radix cache off so every video is a whole prefill):
  * aggregated: ``--aggregated-workers`` workers (default 1: every chat decodes beside every video prefill, which is
    the stall PD removes, and the one worker gets the same 2 cores the PD pair shares);
  * PD: ``serving.fleet --pd``, one prefill and one decode worker (one OpenMP thread each), KV over ``mooncake_tcp``.
Each of ``--rounds`` rounds keeps ``--chats`` chat streams busy (each chat a fresh text prompt, ``--chat-tokens``
greedy tokens, ``ignore_eos``; a stream sends its next chat when one ends) while ``--videos`` video requests (a
generated ``--video-frames``-frame ``--video-size``² clip, ``--video-tokens`` tokens) arrive every
``--video-interval`` s; the round ends when the last video has answered and the chats in flight finish. Requests are
native ``/generate`` streams through smg (one chunk per decode step, ``stream_interval`` 1), timed on arrival here:
TTFT = first chunk - sent; TPOT (per request) = (last chunk - first chunk) / (tokens - 1); ITL = the gap between two
consecutive chunks of a chat (a video prefill between two decode steps shows there). p50/p99 are nearest-rank over
all rounds' requests (gaps); the spread is the per-round min-max of that figure. Peak memory: the largest resident
set of each worker's process tree and the most KV slots in use (``/v1/loads``), sampled every 0.5 s.
Then the derived 910B figures (``npu_figures``; inputs are flags, defaults from issue 51).

    python benchmarks/bench_fleet.py --pd [--rounds 3] [--chats 4] [--videos 3] [--video-interval 2]

Last line: ``RESULT fleet_pd agg_chat_tpot_p50_ms=.. agg_chat_tpot_p99_ms=.. pd_chat_tpot_p50_ms=..
pd_chat_tpot_p99_ms=.. agg_chat_itl_p99_ms=.. pd_chat_itl_p99_ms=.. agg_chat_ttft_p99_ms=.. pd_chat_ttft_p99_ms=..
agg_video_ttft_p50_ms=.. pd_video_ttft_p50_ms=.. tpot_p99_pd_over_agg=.. npu_rate=.. npu_agg_tpot_p99_ms=..
npu_pd_tpot_p99_ms=..``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import requests

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [path for path in (str(REPO_ROOT), str(REPO_ROOT / "tests")) if path not in sys.path]

from benchmarks.bench_realtime import TOLERANCE, noise_frame, percentile  # noqa: E402
from benchmarks.soak_realtime import kv_tokens, server_rss_mib_by_process  # noqa: E402
from moss_vl_reference.tiny_checkpoint import build_or_reuse  # noqa: E402
from serving.fleet import PATIENT_HEALTH, ROUTED_WORKER_HEADER, Fleet  # noqa: E402
from serving.realtime_client import GATEWAY_PATH, RealtimeClient, png_bytes, realtime_url  # noqa: E402
from support.serving import native_chat_input  # noqa: E402
from support.videos import write_video  # noqa: E402

logger = logging.getLogger("bench_fleet")

# Page size 1: the tiny model's multi-turn prompts are shorter than a 128-slot page, so no prefix would count as cached
# at the NPU's page size (a real image's prompt spans many pages).
WORKER_ARGS = ["--dtype", "float32", "--enable-cache-report", "--skip-server-warmup"]
WORKER_ARGS += ["--max-total-tokens", "16384", "--context-length", "8192"]
SYSTEM = {"role": "system", "content": "Answer briefly."}
AUTH = {"Authorization": "Bearer none"}  # smg relays a realtime socket only for a client that sends one


def image_part(seed: int) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png_bytes(noise_frame(seed, 64))).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def chat(base_url: str, model: str, messages: list[dict], max_tokens: int) -> requests.Response:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = requests.post(f"{base_url}/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    return response


def image_chat(seed: int) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": [image_part(seed), {"type": "text", "text": "What is this?"}]}]


def chat_rps(fleet: Fleet, args, seed0: int) -> float:
    started = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        calls = [pool.submit(chat, fleet.gateway_url, fleet.model, image_chat(seed0 + i), args.max_tokens)
                 for i in range(args.requests)]  # fmt: skip
        for call in calls:
            call.result()
    return args.requests / (time.perf_counter() - started)


async def paced_session(url: str, frames: int, t0: float, seed0: int) -> list[float]:
    """Lags (s) of each frame: processed - due."""
    client = RealtimeClient(url, headers=AUTH)
    await client.open(max_new_tokens=24, temperature=0.0)
    await client.settle()
    lags, last = [], None
    try:
        for k in range(frames):
            await asyncio.sleep(max(0.0, t0 + k - time.perf_counter()))
            last = await client.frame(noise_frame(seed0 + k, 64), float(k))
            processed = asyncio.ensure_future(client.wait_processed(last))
            processed.add_done_callback(lambda _, due=t0 + k: lags.append(time.perf_counter() - due))
        await client.settle(last, timeout=120)
    finally:
        await client.close()
    return lags


def realtime_kept(fleet: Fleet, args, seed0: int) -> tuple[int, float]:
    """(sessions that kept real time, p95 lag in s)."""
    url = realtime_url(fleet.gateway_url, GATEWAY_PATH, model=fleet.model)

    async def all_sessions():
        t0 = time.perf_counter() + 3.0  # every session opened before the first frame is due
        return await asyncio.gather(
            *(paced_session(url, args.frames, t0, seed0 + 100 * i) for i in range(args.sessions))
        )

    try:
        results = asyncio.run(all_sessions())
    except Exception as error:  # noqa: BLE001  (reported: a refused relay is a result here)
        logger.error("realtime through smg failed: %s: %s", type(error).__name__, error)
        return 0, float("nan")
    kept = sum(len(lags) == args.frames and max(lags) <= 1 + TOLERANCE for lags in results)
    return kept, percentile([lag for lags in results for lag in lags], 95)


def routing_overhead_ms(fleet: Fleet, probes: int) -> tuple[float, float]:
    """(median direct ms, median through smg ms) of one-token text requests, one at a time."""
    messages = [SYSTEM, {"role": "user", "content": "Say one word."}]
    times = {"direct": [], "routed": []}
    for _ in range(probes):
        for kind, url in (("direct", fleet.servers[0].base_url), ("routed", fleet.gateway_url)):
            started = time.perf_counter()
            chat(url, fleet.model, messages, 1)
            times[kind].append(1000 * (time.perf_counter() - started))
    return statistics.median(times["direct"]), statistics.median(times["routed"])


def cached_ratio(fleet: Fleet, policy: str, conversations: int, max_tokens: int) -> tuple[float, int]:
    """(cached prompt tokens / prompt tokens, conversations whose turns all went to one worker)."""
    fleet.restart_gateway(policy=policy)
    for server in fleet.servers:
        requests.post(f"{server.base_url}/flush_cache", timeout=60)
    histories = {c: [SYSTEM] for c in range(conversations)}
    routed = {c: set() for c in range(conversations)}
    cached = prompt = 0
    for turn in range(3):
        for c, messages in histories.items():
            # The image comes first: a later image would change the request's encoder prefix, which is cached whole.
            question = [image_part(1000 * c), {"type": "text", "text": "What is it?"}] if turn == 0 else "And then?"
            messages.append({"role": "user", "content": question})
            response = chat(fleet.gateway_url, fleet.model, messages, max_tokens)
            usage = response.json()["usage"]
            cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            prompt += usage["prompt_tokens"]
            routed[c].add(response.headers[ROUTED_WORKER_HEADER])
            messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
    return cached / prompt, sum(len(workers) == 1 for workers in routed.values())


def ejection(fleet: Fleet) -> tuple[float, str]:
    """(seconds from the kill until smg stops listing the worker as healthy, what a streamed client saw)."""
    victim = fleet.servers[1]
    seen: dict = {}

    def stream_on_victim():  # sent to the worker through smg until one lands there
        body = {"model": fleet.model, "messages": [SYSTEM, {"role": "user", "content": "Count."}], "stream": True,
                "max_tokens": 4000, "temperature": 0, "ignore_eos": True}  # fmt: skip
        for _ in range(20):
            with requests.post(f"{fleet.gateway_url}/v1/chat/completions", json=body, stream=True, timeout=60) as r:
                if r.headers.get(ROUTED_WORKER_HEADER) != victim.base_url:
                    r.close()
                    continue
                seen["streaming"] = True
                lines = []
                try:
                    for line in r.iter_lines():
                        if line:
                            lines.append(line.decode())
                    seen["end"] = "stream ended"
                except requests.RequestException as error:
                    seen["end"] = f"connection error ({type(error).__name__})"
                seen["last"] = lines[-1][:200] if lines else ""
                seen["error"] = next((line[:300] for line in lines if '"error"' in line), "none")
                seen["chunks"] = len(lines)
                return

    thread = threading.Thread(target=stream_on_victim)
    thread.start()
    deadline = time.monotonic() + 60
    while "streaming" not in seen and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    killed = time.perf_counter()
    os.killpg(victim.process.pid, signal.SIGKILL)
    while any(worker["url"] == victim.base_url for worker in fleet.routable_workers()):
        time.sleep(0.05)
    ejected_s = time.perf_counter() - killed
    thread.join(timeout=60)
    return ejected_s, (
        f"{seen.get('end', 'no stream landed on the victim')} after {seen.get('chunks', 0)} lines; error event: "
        f"{seen.get('error', 'none')!r}; last line: {seen.get('last', '')!r}"
    )


# --pd: chat latency while videos arrive, aggregated vs PD (issue 51 item 7).
PD_WORKER_ARGS = ["--dtype", "float32", "--page-size", "128", "--disable-radix-cache", "--skip-server-warmup"]
PD_WORKER_ARGS += ["--max-total-tokens", "16384", "--context-length", "4096"]
# No worker is killed here, so probe patiently (PATIENT_HEALTH). A worker's start took over 240 s at load 40.
PATIENT = {**PATIENT_HEALTH, "worker_ready_timeout_s": 900}


@dataclass
class Streamed:
    """One streamed ``/generate`` request: when it was sent, when each chunk came and the tokens generated by then."""

    sent: float
    arrivals: list[float]
    tokens: list[int]
    prompt_tokens: int

    @property
    def ttft_ms(self) -> float:
        return 1000 * (self.arrivals[0] - self.sent)

    @property
    def tpot_ms(self) -> float:
        steps = self.tokens[-1] - self.tokens[0]
        return 1000 * (self.arrivals[-1] - self.arrivals[0]) / steps if steps else math.nan

    @property
    def gaps_ms(self) -> list[float]:
        return [1000 * (later - earlier) for earlier, later in zip(self.arrivals, self.arrivals[1:])]


def streamed_generate(base_url: str, body: dict) -> Streamed:
    sent = time.perf_counter()
    arrivals, tokens, prompt_tokens = [], [], 0
    with requests.post(f"{base_url}/generate", json={**body, "stream": True}, stream=True, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[len(b"data:") :])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            meta = chunk["meta_info"]
            prompt_tokens = meta["prompt_tokens"]
            if meta["completion_tokens"] > (tokens[-1] if tokens else 0):
                arrivals.append(now)
                tokens.append(meta["completion_tokens"])
    if not tokens:
        raise RuntimeError(f"no token streamed for {str(body.get('text'))[:80]!r}")
    return Streamed(sent, arrivals, tokens, prompt_tokens)


@dataclass
class MixedLoad:
    """The requests of the mixed load: fresh chats and one video request (the same clip each time; the workers run
    without a radix cache, so every video is a whole prefill)."""

    processor: object
    video_path: Path
    chat_tokens: int
    video_tokens: int

    def chat(self, index: int) -> dict:
        messages = [SYSTEM, {"role": "user", "content": f"Story {index}: tell a long story about a river and a boat."}]
        return self.body(messages, self.chat_tokens)

    def video_messages(self) -> list[dict]:
        question = [{"type": "video", "video": str(self.video_path)}, {"type": "text", "text": "What moves?"}]
        return [{"role": "user", "content": question}]

    def video(self) -> dict:
        return self.body(self.video_messages(), self.video_tokens)

    def video_vision_tokens(self, checkpoint: Path) -> int:
        """The video's vision tokens as the reference processor makes them (patches over the merge window)."""
        merge = json.loads((checkpoint / "config.json").read_text())["vision_config"]["spatial_merge_size"]
        messages = self.video_messages()
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = self.processor(text=text, videos=self.processor.extract_media(messages)[1])
        return int(inputs["grid_thw"].prod(-1).sum()) // merge**2

    def body(self, messages: list[dict], max_new_tokens: int) -> dict:
        text, images, videos = native_chat_input(self.processor, messages)
        return {
            "text": text,
            "image_data": images or None,
            "video_data": videos or None,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
        }


def mixed_round(base_url: str, load: MixedLoad, args, first_chat: int) -> tuple[list[Streamed], list[Streamed]]:
    """(chats, videos) of one round: ``args.chats`` chat streams busy while ``args.videos`` videos arrive."""
    videos_done = threading.Event()

    def chat_stream(slot: int) -> list[Streamed]:
        done, index = [], first_chat + 1000 * slot
        while not videos_done.is_set():
            done.append(streamed_generate(base_url, load.chat(index)))
            index += 1
        return done

    with ThreadPoolExecutor(args.chats + args.videos) as pool:
        streams = [pool.submit(chat_stream, slot) for slot in range(args.chats)]
        started = time.perf_counter()
        videos = []
        for k in range(args.videos):  # the first video after one interval: the chats are decoding by then
            time.sleep(max(0.0, started + (k + 1) * args.video_interval - time.perf_counter()))
            videos.append(pool.submit(streamed_generate, base_url, load.video()))
        try:
            video_results = [video.result() for video in videos]
        finally:
            videos_done.set()
        chat_results = [chat for stream in streams for chat in stream.result()]
    return chat_results, video_results


class PeakSampler:
    """The largest resident set (MiB) of each worker's process tree and the most KV slots it used, every 0.5 s."""

    def __init__(self, servers):
        self.servers = servers
        self.rss_mib = {server.name: 0.0 for server in servers}
        self.kv_slots = {server.name: 0 for server in servers}
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop_event.wait(0.5):
            for server in self.servers:
                rss = sum(server_rss_mib_by_process(server).values())
                self.rss_mib[server.name] = max(self.rss_mib[server.name], rss)
                self.kv_slots[server.name] = max(self.kv_slots[server.name], kv_tokens(server))

    def __enter__(self) -> "PeakSampler":
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop_event.set()
        self.thread.join()


@dataclass
class SetupResult:
    chats: list[list[Streamed]]  # per round
    videos: list[list[Streamed]]
    rss_mib: dict[str, float]
    kv_slots: dict[str, int]
    load: tuple[float, float]  # 1-minute load average before and after the rounds


def measure_setup(fleet: Fleet, load: MixedLoad, args) -> SetupResult:
    warm = argparse.Namespace(chats=1, videos=1, video_interval=0.5)  # the first batches of a shape pay one-time costs
    mixed_round(fleet.gateway_url, load, warm, first_chat=900_000)
    before = os.getloadavg()[0]
    chats, videos = [], []
    with PeakSampler(fleet.servers) as peaks:
        for round_index in range(args.rounds):
            round_chats, round_videos = mixed_round(fleet.gateway_url, load, args, first_chat=10_000 * round_index)
            chats.append(round_chats)
            videos.append(round_videos)
            logger.info("round %d: %d chats, %d videos", round_index, len(round_chats), len(round_videos))
    return SetupResult(chats, videos, peaks.rss_mib, peaks.kv_slots, (before, os.getloadavg()[0]))


def pooled(per_round: list[list[Streamed]], figure, q: float) -> tuple[float, float, float]:
    """(percentile ``q`` over every round's values, its lowest and highest per-round value); a one-token answer's
    TPOT (nan) is left out."""
    values = [
        [value for stream in streams for value in figure(stream) if not math.isnan(value)] for streams in per_round
    ]
    by_round = [percentile(round_values, q) for round_values in values if round_values] or [math.nan]
    return percentile([value for round_values in values for value in round_values], q), min(by_round), max(by_round)


FIGURES = {  # name -> (the requests it reads, the values per request)
    "chat TTFT": ("chats", lambda stream: [stream.ttft_ms]),
    "chat TPOT": ("chats", lambda stream: [stream.tpot_ms]),
    "chat ITL": ("chats", lambda stream: stream.gaps_ms),
    "video TTFT": ("videos", lambda stream: [stream.ttft_ms]),
    "video TPOT": ("videos", lambda stream: [stream.tpot_ms]),
}


def latency_table(results: dict[str, SetupResult]) -> dict[str, float]:
    """Prints the side-by-side table; returns the RESULT figures (pooled values, ms)."""
    agg, pd = results["aggregated"], results["PD"]
    print(f"{'ms (spread over rounds)':<16}{'aggregated':>26}{'PD':>26}{'PD/agg':>8}")
    summary = {}
    for name, (which, figure) in FIGURES.items():
        for q in (50, 99):
            cells = [pooled(getattr(result, which), figure, q) for result in (agg, pd)]
            text = [f"{value:.1f} ({low:.1f}-{high:.1f})" for value, low, high in cells]
            print(f"{name} p{q:<6}{text[0]:>26}{text[1]:>26}{cells[1][0] / cells[0][0]:>8.2f}")
            for setup, (value, _, _) in zip(("agg", "pd"), cells):
                summary[f"{setup}_{name.replace(' ', '_').lower()}_p{q}_ms"] = value
    for label, result in results.items():
        counts = f"{sum(map(len, result.chats))} chats, {sum(map(len, result.videos))} videos"
        memory = ", ".join(
            f"{name}: peak RSS {result.rss_mib[name]:.0f} MiB, peak KV {result.kv_slots[name]} slots"
            for name in result.rss_mib
        )
        print(f"{label}: {counts}; {memory}; load average {result.load[0]:.1f} -> {result.load[1]:.1f}")
    return summary


def poisson_quantile(mean: float, q: float) -> int:
    """The smallest k with P(K <= k) >= q for K ~ Poisson(mean)."""
    k, term = 0, math.exp(-mean)
    total = term
    while total < q:
        k += 1
        term *= mean / k
        total += term
    return k


def npu_figures(prefill_s: float, step_s: float, chat_tokens: int, rate: float, cards: int) -> dict[str, float]:
    """Derived chat decode latency on aggregated cards while videos arrive (not measured).

    ``cards`` aggregated workers share videos arriving at ``rate`` per second (each gets ``rate / cards``); MOSS-VL
    runs without chunked prefill (stock turns it off), so a video prefill of ``prefill_s`` pauses every decode on its
    card. A card spends the fraction rho = rate/cards * prefill_s prefilling, so its decode steps come at
    (1 - rho) / step_s per second and a fraction rate/cards * step_s / (1 - rho) of the gaps between two tokens hold
    a prefill (gap = step_s + prefill_s). A chat of ``chat_tokens`` tokens lives about chat_tokens * step_s / (1 - rho)
    seconds; the prefills it meets are Poisson with that many times rate/cards as mean, so its TPOT quantile q is
    step_s + K_q * prefill_s / chat_tokens. A PD decode card runs no prefill: every gap is step_s."""
    per_card = rate / cards
    busy = per_card * prefill_s
    if busy >= 1:
        return {"rho": busy, "stalled_gaps": math.inf, "tpot_mean_ms": math.inf, "tpot_p50_ms": math.inf,
                "tpot_p99_ms": math.inf, "itl_p99_ms": math.inf}  # fmt: skip
    stalled = per_card * step_s / (1 - busy)
    lifetime_prefills = per_card * chat_tokens * step_s / (1 - busy)
    return {
        "rho": busy,
        "stalled_gaps": stalled,
        "tpot_mean_ms": 1000 * step_s / (1 - busy),
        "tpot_p50_ms": 1000 * (step_s + poisson_quantile(lifetime_prefills, 0.5) * prefill_s / chat_tokens),
        "tpot_p99_ms": 1000 * (step_s + poisson_quantile(lifetime_prefills, 0.99) * prefill_s / chat_tokens),
        "itl_p99_ms": 1000 * (step_s + prefill_s if stalled > 0.01 else step_s),
    }


def npu_table(args) -> dict[str, float]:
    """Prints the derived 910B figures for each ``--npu-rates`` rate; returns those of the first rate."""
    prefill_s, step_s = args.npu_prefill_s, args.npu_step_ms / 1000
    print(
        f"\nDerived 910B2 figures (not measured): video prefill {prefill_s} s, decode step {args.npu_step_ms} ms, "
        f"chats of {args.npu_chat_tokens} tokens; a prefill card serves at most {1 / prefill_s:.2f} videos/s; "
        f"a video's KV ({args.npu_video_kv_gb} GB) moves in {1000 * args.npu_video_kv_gb / args.npu_link_gb_s:.0f} ms "
        f"at {args.npu_link_gb_s} GB/s (added to a PD video's TTFT)"
    )
    print(
        f"{'videos/s':>8} {'setup':<12}{'rho':>6}{'stalled gaps':>14}{'TPOT mean':>11}{'p50':>8}{'p99':>8}"
        f"{'ITL p99':>9}"
    )
    first = {}
    for rate in args.npu_rates:
        rows = {"1 card agg": npu_figures(prefill_s, step_s, args.npu_chat_tokens, rate, 1)}
        rows["2 cards agg"] = npu_figures(prefill_s, step_s, args.npu_chat_tokens, rate, 2)
        rows["1P+1D PD"] = {"rho": 0.0, "stalled_gaps": 0.0, **dict.fromkeys(
            ("tpot_mean_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p99_ms"), 1000 * step_s)}  # fmt: skip
        for setup, row in rows.items():
            print(
                f"{rate:>8} {setup:<12}{row['rho']:>6.2f}{100 * row['stalled_gaps']:>13.2f}%"
                f"{row['tpot_mean_ms']:>11.1f}{row['tpot_p50_ms']:>8.1f}{row['tpot_p99_ms']:>8.1f}{row['itl_p99_ms']:>9.0f}"
            )
        first = first or {"npu_rate": rate, "npu_agg_tpot_p99_ms": rows["1 card agg"]["tpot_p99_ms"],
                          "npu_agg2_tpot_p99_ms": rows["2 cards agg"]["tpot_p99_ms"],
                          "npu_pd_tpot_p99_ms": rows["1P+1D PD"]["tpot_p99_ms"]}  # fmt: skip
    return first


def pd_main(args) -> int:
    checkpoint = build_or_reuse("tiny")
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint, trust_remote_code=True)
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True, text=True)
    with tempfile.TemporaryDirectory() as scratch:
        # One frame a second: the processor keeps ceil(duration x 1 fps) frames, so every written frame is encoded.
        clip = Path(scratch) / "clip.mp4"
        write_video(clip, args.video_frames, fps=1, width=args.video_size, height=args.video_size)
        load = MixedLoad(processor, clip, args.chat_tokens, args.video_tokens)
        vision_tokens = load.video_vision_tokens(Path(checkpoint))
        setups = {
            "aggregated": dict(workers=args.aggregated_workers, name="bench-pd-agg"),
            "PD": dict(pd=True, name="bench-pd"),
        }
        results = {}
        for label, settings in setups.items():
            with Fleet(checkpoint, worker_args=PD_WORKER_ARGS, **PATIENT, **settings) as fleet:
                results[label] = measure_setup(fleet, load, args)
    shapes = results["PD"].videos[0][0].prompt_tokens, results["PD"].chats[0][0].prompt_tokens
    print(
        f"\ncommit {commit.stdout.strip()}; tiny checkpoint, fp32, page 128, radix cache off; aggregated: "
        f"{args.aggregated_workers} worker(s) sharing {len(os.sched_getaffinity(0))} cores; PD: 1 prefill + 1 decode "
        f"worker, mooncake_tcp; {args.rounds} rounds of {args.chats} chat streams ({args.chat_tokens} tokens, prompt "
        f"{shapes[1]} tokens) and {args.videos} videos every {args.video_interval} s ({args.video_frames} frames "
        f"{args.video_size}x{args.video_size}: {vision_tokens} vision tokens, {shapes[0]} prompt tokens; "
        f"{args.video_tokens} tokens)"
    )
    summary = latency_table(results)
    npu = npu_table(args)
    print(
        f"(the same {len(os.sched_getaffinity(0))} cores for both set-ups: PD's workers run one OpenMP thread each, so "
        "here PD also parts prefill and decode onto their own cores; the ratios say what that split does on this "
        "machine, the derived table what PD does on a 910B2)"
    )
    keys = ["agg_chat_tpot_p50_ms", "agg_chat_tpot_p99_ms", "pd_chat_tpot_p50_ms", "pd_chat_tpot_p99_ms",
            "agg_chat_itl_p99_ms", "pd_chat_itl_p99_ms", "agg_chat_ttft_p99_ms", "pd_chat_ttft_p99_ms",
            "agg_video_ttft_p50_ms", "pd_video_ttft_p50_ms"]  # fmt: skip
    figures = " ".join(f"{key}={summary[key]:.1f}" for key in keys)
    ratio = summary["pd_chat_tpot_p99_ms"] / summary["agg_chat_tpot_p99_ms"]
    derived = " ".join(f"{key}={value:.1f}" if key != "npu_rate" else f"{key}={value}" for key, value in npu.items())
    print(f"RESULT fleet_pd {figures} tpot_p99_pd_over_agg={ratio:.2f} {derived}")
    return 0


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    fleet = parser.add_argument_group("1 vs 2 workers (the default run)")
    fleet.add_argument("--requests", type=int, default=16, help="image chats per throughput phase")
    fleet.add_argument("--concurrency", type=int, default=4, help="image chats in flight at once")
    fleet.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per image chat and conversation turn")
    fleet.add_argument("--sessions", type=int, default=2, help="realtime sessions per phase")
    fleet.add_argument("--frames", type=int, default=6, help="frames fed to each realtime session at 1 fps")
    fleet.add_argument("--probes", type=int, default=15, help="one-token requests timed direct and through smg")
    # Odd: round robin over 2 workers with an even count would send each conversation's turns to one worker.
    fleet.add_argument("--conversations", type=int, default=3, help="three-turn conversations per routing policy")
    pd = parser.add_argument_group("--pd: chat latency while videos arrive, aggregated vs prefill/decode split")
    pd.add_argument("--pd", action="store_true", help="run the aggregated vs PD latency comparison instead")
    pd.add_argument("--rounds", type=int, default=3, help="measured rounds per set-up (after one warm-up round)")
    pd.add_argument("--chats", type=int, default=4, help="chat streams kept busy during a round")
    pd.add_argument("--chat-tokens", type=int, default=48, help="greedy tokens per chat")
    pd.add_argument("--videos", type=int, default=3, help="video requests per round")
    pd.add_argument("--video-interval", type=float, default=2.0, help="seconds between two videos' arrivals")
    pd.add_argument("--video-frames", type=int, default=8, help="frames (= seconds) of the generated 1 fps clip")
    pd.add_argument("--video-size", type=int, default=256, help="the clip's frame width and height, pixels")
    pd.add_argument("--video-tokens", type=int, default=8, help="greedy tokens per video answer")
    pd.add_argument(
        "--aggregated-workers", type=int, default=1, help="workers of the aggregated set-up (the PD set-up has 2)"
    )
    npu = parser.add_argument_group("--pd: derived 910B2 figures (inputs, not measured; defaults from issue 51)")
    npu.add_argument("--npu-prefill-s", type=float, default=1.4, help="one 256-frame 448x448 video's prefill, s")
    npu.add_argument("--npu-step-ms", type=float, default=12.0, help="one decode step, ms")
    npu.add_argument("--npu-chat-tokens", type=int, default=256, help="tokens of one chat answer")
    npu.add_argument(
        "--npu-rates", type=float, nargs="+", default=[0.1, 0.25, 0.5], help="video arrivals per second to derive for"
    )
    npu.add_argument(
        "--npu-video-kv-gb", type=float, default=3.08, help="one such video's KV in the MOSS-VL layout, GB"
    )
    npu.add_argument("--npu-link-gb-s", type=float, default=25.0, help="prefill -> decode transfer bandwidth, GB/s")
    return parser


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.pd:
        return pd_main(args)
    with Fleet(build_or_reuse("tiny-realtime"), workers=2, worker_args=WORKER_ARGS, name="bench-fleet") as fleet:
        fleet.model = requests.get(f"{fleet.gateway_url}/v1/models", timeout=30).json()["data"][0]["id"]
        chat_rps(fleet, args, seed0=0)  # warm-up: the first batches of a shape pay one-time costs
        direct_ms, routed_ms = routing_overhead_ms(fleet, args.probes)
        print(f"routing overhead: direct {direct_ms:.1f} ms, through smg {routed_ms:.1f} ms (median of {args.probes})")
        results = {}
        for workers in (1, 2):
            if workers == 1:
                fleet.deregister(fleet.servers[1].base_url)
                fleet.wait_routable(1)
            else:
                fleet.register(fleet.servers[1].base_url)
                fleet.wait_routable(2)
            rps = chat_rps(fleet, args, seed0=10_000 * workers)
            kept, p95 = realtime_kept(fleet, args, seed0=20_000 * workers)
            results[workers] = (rps, kept, p95)
            print(f"{workers} worker(s): image chat {rps:.2f} req/s (c={args.concurrency}); realtime "
                  f"{kept}/{args.sessions} sessions kept 1 fps, p95 lag {1000 * p95:.0f} ms", flush=True)  # fmt: skip
        ratios = {}
        for policy in ("cache_aware", "round_robin"):
            ratio, sticky = ratios[policy] = cached_ratio(fleet, policy, args.conversations, args.max_tokens)
            print(f"{policy}: cached-token ratio {ratio:.2f}, {sticky}/{args.conversations} conversations on 1 worker")
        ejected_s, client_saw = ejection(fleet)
    print(f"ejection after SIGKILL: {ejected_s:.2f} s; a stream in flight on it: {client_saw}")
    print("(2 cores shared by both workers: the 2/1 throughput ratio is overhead, not scaling)")
    print(
        f"RESULT fleet chat_rps_1w={results[1][0]:.2f} chat_rps_2w={results[2][0]:.2f} "
        f"realtime_kept_1w={results[1][1]}/{args.sessions} realtime_kept_2w={results[2][1]}/{args.sessions} "
        f"overhead_ms={routed_ms - direct_ms:.1f} cached_cache_aware={ratios['cache_aware'][0]:.2f} "
        f"cached_round_robin={ratios['round_robin'][0]:.2f} ejection_s={ejected_s:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
