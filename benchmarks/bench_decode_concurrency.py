"""Served time per output token: one request alone vs N requests decoding together (issue 11), tiny checkpoint.

One server (fp32, CPU, the plugin's batched attention core); every request is a greedy streamed chat completion
with one image and EOS ignored. Time per output token (TPOT) of a request = (time of its last streamed chunk -
time of its first) / (chunks - 1), so prefill is excluded. ``alone``: requests one after another; ``together``:
N requests started at once (they decode in one batch). Several rounds, alternating, medians reported.
Target: together / alone <= 1.3 at N = 16 (host work per decode step must not grow with the batch).

The clients run on the server's own cores here (a deployment's clients are elsewhere), so each request is read
with a plain ``http.client`` stream: the OpenAI SDK's per-chunk parsing cost 0.11-0.14 s of CPU per 16-request
round (3-4x this client's), taken from the two cores the server decodes on. ``--openai-client`` measures with the
SDK instead; the client's CPU time per round is printed either way.

Run (CPU): SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=sglang:cpu_shim .venv/bin/python -m benchmarks.bench_decode_concurrency
"""

from __future__ import annotations

import argparse
import functools
import http.client
import json
import os
import resource
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

from openai import OpenAI

from moss_vl_reference.queries_moss_vl import file_data_url
from serving.launch import SglangServer

ASSETS = Path(__file__).resolve().parents[1] / "tests" / "assets"


def messages() -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": file_data_url(ASSETS / "square_64.png")}},
                {"type": "text", "text": "Describe this picture in detail."},
            ],
        }
    ]


def tpot(stamps: list[float]) -> float:
    """Seconds per streamed chunk after the first, from the arrival times of the chunks that carry text."""
    if len(stamps) < 2:
        raise RuntimeError(f"only {len(stamps)} streamed chunks")
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def openai_tpot(client: OpenAI, model: str, max_tokens: int) -> float:
    """TPOT of one streamed greedy completion read through the OpenAI SDK."""
    stream = client.chat.completions.create(
        model=model,
        messages=messages(),
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    return tpot([time.perf_counter() for chunk in stream if chunk.choices and chunk.choices[0].delta.content])


def plain_http_tpot(base_url: str, model: str, max_tokens: int) -> float:
    """TPOT of the same completion read as server-sent events off a plain HTTP connection."""
    body = {
        "model": model,
        "messages": messages(),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    url = urlsplit(base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
        stamps = []
        for line in response:
            if line.startswith(b"data: {"):
                choices = json.loads(line[len(b"data: ") :])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    stamps.append(time.perf_counter())
        return tpot(stamps)
    finally:
        connection.close()


def process_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--openai-client", action="store_true", help="read the streams with the OpenAI SDK")
    args = parser.parse_args()
    from moss_vl_reference.tiny_checkpoint import build_or_reuse

    checkpoint = build_or_reuse("tiny")
    with SglangServer(checkpoint, extra_args=["--dtype", "float32"], name="bench-decode-concurrency") as server:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="not-needed", timeout=600)
        model = client.models.list().data[0].id
        if args.openai_client:
            streamed_tpot = functools.partial(openai_tpot, client, model)
        else:
            streamed_tpot = functools.partial(plain_http_tpot, server.base_url, model)
        streamed_tpot(8)  # warm-up
        alone, together, client_cpu = [], [], []
        for _ in range(args.rounds):
            alone.extend(streamed_tpot(args.max_tokens) for _ in range(2))
            cpu_before = process_cpu_seconds()
            with ThreadPoolExecutor(args.concurrency) as pool:
                together.extend(pool.map(streamed_tpot, [args.max_tokens] * args.concurrency))
            client_cpu.append(process_cpu_seconds() - cpu_before)
    alone_ms, together_ms = statistics.median(alone) * 1e3, statistics.median(together) * 1e3
    load = os.getloadavg()[0]
    print(
        f"tiny checkpoint, fp32, {args.max_tokens} tokens, {args.rounds} rounds, "
        f"{'OpenAI SDK' if args.openai_client else 'plain HTTP'} client "
        f"({', '.join(f'{seconds:.2f}' for seconds in client_cpu)} s CPU per {args.concurrency}-request round), "
        f"load average {load:.1f}"
    )
    print(f"{'requests':>8} {'median TPOT ms':>14} {'min':>7} {'max':>7}")
    print(f"{1:>8} {alone_ms:>14.2f} {min(alone) * 1e3:>7.2f} {max(alone) * 1e3:>7.2f}")
    print(f"{args.concurrency:>8} {together_ms:>14.2f} {min(together) * 1e3:>7.2f} {max(together) * 1e3:>7.2f}")
    print(f"RESULT tpot_ratio_c{args.concurrency}_over_c1={together_ms / alone_ms:.2f}")


if __name__ == "__main__":
    main()
