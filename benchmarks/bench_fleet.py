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
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import os
import signal
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.bench_realtime import TOLERANCE, noise_frame, percentile  # noqa: E402
from moss_vl_reference.tiny_checkpoint import build_or_reuse  # noqa: E402
from serving.fleet import ROUTED_WORKER_HEADER, Fleet  # noqa: E402
from serving.realtime_client import GATEWAY_PATH, RealtimeClient, png_bytes, realtime_url  # noqa: E402

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--frames", type=int, default=6)
    parser.add_argument("--probes", type=int, default=15)
    # Odd: round robin over 2 workers with an even count would send each conversation's turns to one worker.
    parser.add_argument("--conversations", type=int, default=3)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
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
