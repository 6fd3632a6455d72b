"""Decode graphs vs eager decode for MOSS-VL on CPU: served TPOT at batch 1, 8 and 16, capture time, host ops.

Two servers, one after the other (fp32, tiny checkpoint, CPU): eager decode, then ``--enable-torch-compile`` (stock's
CPU graph runner, inductor) with buckets {1, 8, 16}. Every request is a greedy streamed chat completion with one
image, EOS ignored; TPOT of a request = (last streamed chunk - first) / (chunks - 1), so prefill is excluded; batch
N = N such requests started at once (they decode together). Rounds alternate nothing across servers (one server at a
time: an idle sglang scheduler keeps a core busy), so compare the ratio, and repeat the run for its spread.

Host ops per decode step: the aten ops the host dispatches for the attention of one decode step of a batch of 8
(four layers, two of them cross-attention, MOSS-VL KV layout, page 128, bf16), eager (the attention core) against
the NPU decode graph's replay (``attention.decode_graph`` recorded by the graph STAND-IN of
``tests/support/fake_npu_graph.py``: on a device one replay launch; the recording's node count is what it replaces).

``--first-batches``: instead, one graph server (buckets {1, 4, 8}, dynamo's ``recompiles`` log on): after start-up
and one image request of one token (a prefill and no decode step: the first image's processing and the first prefill
cost seconds whatever the graphs do), a batch of 1, 4 and 8 image requests (one native batch request each, distinct
prompts), first without then with logprobs, each size twice: the wall time of the first batch against the second, and
the recompile lines each logged. Serving must run what start-up captured: no recompile, and a first batch about as
fast as a later one.

Run: make bench-graphs [ARGS=--first-batches]
(or SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=cpu_shim .venv/bin/python benchmarks/bench_decode_graphs.py)
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "sglang")]

from benchmarks.bench_decode_concurrency import plain_http_tpot  # noqa: E402
from serving.launch import SglangServer  # noqa: E402

BATCHES = (1, 8, 16)
CAPTURE_LINE = re.compile(r"Capture target decode CPU graph end\..*?elapsed=([0-9.]+) s")
BASE_ARGS = ["--dtype", "float32", "--skip-server-warmup"]
FIRST_BATCHES = (1, 4, 8)
# Stock's switch that releases a native batch request to the scheduler at once (its requests decode together), and
# dynamo's recompile log: one "Recompiling function" line per compile after a frame's first.
FIRST_BATCH_ENV = {"SGLANG_ENABLE_COLOCATED_BATCH_GEN": "1", "TORCH_LOGS": "recompiles"}
RECOMPILE_LINE = re.compile(r"Recompiling function")


def served_tpots(server, batches, max_tokens: int, rounds: int) -> dict[int, list[float]]:
    from openai import OpenAI

    model = OpenAI(base_url=f"{server.base_url}/v1", api_key="not-needed").models.list().data[0].id
    plain_http_tpot(server.base_url, model, 8)  # warm-up
    tpots = {batch: [] for batch in batches}
    for _ in range(rounds):
        for batch in batches:
            with ThreadPoolExecutor(batch) as pool:
                tpots[batch].extend(
                    pool.map(lambda _: plain_http_tpot(server.base_url, model, max_tokens), range(batch))
                )
    return tpots


def capture_seconds(server) -> float | None:
    found = CAPTURE_LINE.findall(server.log_path.read_text(errors="replace"))
    return float(found[-1]) if found else None


def host_ops_per_step() -> tuple[int, int]:
    """(eager aten ops, recorded graph nodes) for the attention of one decode step of 8 requests."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from support import decode_graph_case as case
    from support.fake_npu_graph import graph_mode
    from support.simulated_npu import npu_attention_on_cpu

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    names = ["image", "text_only", "realtime_windowed", "long_text", "video", "image", "long_text", "video"]
    dtype = torch.bfloat16
    pool = case.Pool(dtype, case.LAYOUTS["mossvl"])
    queries = case.random_queries(names, dtype, 0)
    with _monkeypatch() as monkeypatch, npu_attention_on_cpu(monkeypatch):
        import torch_npu

        with graph_mode(torch_npu):
            case.eager_decode(pool, names, queries)  # warm-up
            with Count() as counted:
                case.eager_decode(pool, names, queries)
            state = case.GraphState(pool, dtype, max_bs=len(names))
            state.capture(len(names))
    nodes = sum(1 for node in state.graphs[len(names)].recording.graph.nodes if node.op == "call_function")
    return counted.ops, nodes


def _monkeypatch():
    import pytest

    return pytest.MonkeyPatch.context()


def recompile_lines(server) -> int:
    return len(RECOMPILE_LINE.findall(server.log_path.read_text(errors="replace")))


def timed_batch(server, processor, size: int, logprobs: bool, max_tokens: int, tag: str) -> float:
    """Seconds for ``size`` one-image requests sent as one native batch request (prompts distinct by ``tag``)."""
    import requests

    from support.serving import image, native_chat_input

    inputs = [
        native_chat_input(processor, [image("square_64.png", f"What is in image {tag}-{i}?")]) for i in range(size)
    ]
    body = {
        "text": [text for text, _, _ in inputs],
        "image_data": [image_urls for _, image_urls, _ in inputs],
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        "return_logprob": logprobs,
    }
    started = time.monotonic()
    requests.post(f"{server.base_url}/generate", json=body, timeout=1200).raise_for_status()
    return time.monotonic() - started


def first_batches(checkpoint, max_tokens: int) -> None:
    """The ``--first-batches`` run (see the module's docstring)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint, trust_remote_code=True)
    graph_args = ["--enable-torch-compile", "--cuda-graph-bs-decode", *map(str, FIRST_BATCHES)]
    server = SglangServer(checkpoint, extra_args=BASE_ARGS + graph_args, env=FIRST_BATCH_ENV, name="bench-first")
    server.ready_timeout_s = 1200
    with server:
        at_start = recompile_lines(server)
        warm_up_s = timed_batch(server, processor, 1, False, 1, "warm-up")
        rows = []
        for logprobs in (False, True):
            for size in FIRST_BATCHES:
                row = []
                for attempt in ("first", "second"):
                    before = recompile_lines(server)
                    seconds = timed_batch(server, processor, size, logprobs, max_tokens, f"{logprobs}-{attempt}")
                    row.append((seconds, recompile_lines(server) - before))
                rows.append((size, logprobs, row))
    print(
        f"tiny checkpoint, fp32, CPU, buckets {list(FIRST_BATCHES)}, {max_tokens} tokens per request, load average "
        f"{os.getloadavg()[0]:.1f}; recompile lines during start-up (the capture): {at_start}; the one-token "
        f"warm-up request: {warm_up_s:.2f} s"
    )
    header = ("batch", "logprobs", "first s", "second s", "first/second", "recompiles 1st", "recompiles 2nd")
    print(" ".join(f"{title:>14}" for title in header))
    for size, logprobs, ((first, first_n), (second, second_n)) in rows:
        cells = (size, logprobs, f"{first:.2f}", f"{second:.2f}", f"{first / second:.2f}", first_n, second_n)
        print(" ".join(f"{cell!s:>14}" for cell in cells))
    worst = max(first / second for _, _, ((first, _), (second, _)) in rows)
    recompiles = sum(first_n + second_n for _, _, ((_, first_n), (_, second_n)) in rows)
    print(f"RESULT first_over_second_max={worst:.2f} recompiles_after_startup={recompiles}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every batch size per server")
    parser.add_argument(
        "--first-batches", action="store_true", help="first vs second batch and recompiles after start-up, only"
    )
    args = parser.parse_args()
    from moss_vl_reference.tiny_checkpoint import build_or_reuse

    checkpoint = build_or_reuse("tiny")
    if args.first_batches:
        first_batches(checkpoint, args.max_tokens)
        return
    graph_args = ["--enable-torch-compile", "--cuda-graph-bs-decode", *map(str, BATCHES)]
    results = {}
    for name, extra in (("eager", []), ("graph", graph_args)):
        server = SglangServer(checkpoint, extra_args=BASE_ARGS + extra, name=f"bench-graphs-{name}")
        server.ready_timeout_s = 1200
        started = time.monotonic()
        with server:
            start_s = time.monotonic() - started
            results[name] = {
                "tpots": served_tpots(server, BATCHES, args.max_tokens, args.rounds),
                "start_s": start_s,
                "capture_s": capture_seconds(server),
            }
    eager_ops, graph_nodes = host_ops_per_step()

    print(
        f"tiny checkpoint, fp32, CPU, {args.max_tokens} tokens, {args.rounds} rounds, "
        f"load average {os.getloadavg()[0]:.1f}; eager server up in {results['eager']['start_s']:.0f} s, graph "
        f"server in {results['graph']['start_s']:.0f} s (capture {results['graph']['capture_s']} s, buckets "
        f"{list(BATCHES)})"
    )
    header = ("batch", "eager TPOT ms", "graph TPOT ms", "graph/eager", "eager spread", "graph spread")
    print(" ".join(f"{title:>{width}}" for title, width in zip(header, (5, 14, 14, 12, 14, 14))))
    ratios = {}
    for batch in BATCHES:
        eager, graph = results["eager"]["tpots"][batch], results["graph"]["tpots"][batch]
        e_ms, g_ms = statistics.median(eager) * 1e3, statistics.median(graph) * 1e3
        ratios[batch] = g_ms / e_ms
        print(
            f"{batch:>5} {e_ms:>14.2f} {g_ms:>14.2f} {ratios[batch]:>12.2f} "
            f"{min(eager) * 1e3:>6.1f}-{max(eager) * 1e3:<7.1f} {min(graph) * 1e3:>6.1f}-{max(graph) * 1e3:<7.1f}"
        )
    print(
        f"host ops per decode step, attention of 8 requests x 4 layers (bf16, page 128, MOSS-VL KV layout): eager "
        f"{eager_ops} aten ops; NPU graph: 1 replay launching a recording of {graph_nodes} ops"
    )
    print(
        f"RESULT tpot_ratio_b1={ratios[1]:.2f} tpot_ratio_b8={ratios[8]:.2f} tpot_ratio_b16={ratios[16]:.2f} "
        f"capture_s={results['graph']['capture_s']} eager_host_ops={eager_ops} graph_host_launches=1"
    )


if __name__ == "__main__":
    main()
