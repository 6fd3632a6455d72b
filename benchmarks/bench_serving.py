"""`make bench-serving`: MOSS-VL served by stock sglang + the plugin vs the reference model, one by one (issue 5).

The bench preset (random weights, ~154M parameters) is served on CPU and measured with sglang's own
``python -m sglang.bench_serving`` (OpenAI chat backend, image dataset: one random PNG + random text per
request, fixed input/output lengths, EOS ignored, greedy, ``--flush-cache``) at concurrency 1 and 8, several
runs each (after one unmeasured warmup pass); the table shows medians over runs. Then the TTFT of a second
conversation turn (the first turn repeated, plus a question) with the first turn in the radix cache and, on the
same server right after ``/flush_cache``, without it. Then a second server with chunked prefill and mixed
chunks (``--chunked-prefill-size N --enable-mixed-chunk``; the first one runs unchunked, ``--chunked-prefill-size
-1``) runs the same bench_serving passes at the chunked concurrency, side by side in the table (issue 12).
Last, with every server stopped (the reference gets the machine to itself), the same requests (regenerated
in-process from the same seed by sglang's image dataset) go one after another through the reference transformers
model, timed end to end including image decoding and the processor.

Run (CPU): make bench-serving   (or: $(CPU_ENV) .venv/bin/python -m benchmarks.bench_serving --help)
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch
from openai import OpenAI

from serving.launch import REPO_ROOT, SglangServer, engine_env

logger = logging.getLogger(__name__)

OUT_DIR = REPO_ROOT / "build" / "bench-serving"
# bench_serving's JSONL keys shown in the table, in column order.
METRICS = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
TURN2_QUESTION = "What is in the picture? Answer briefly."


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="checkpoint dir (default: build/reuse the bench preset)")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per run")
    parser.add_argument(
        "--input-len", type=int, default=64, help="random text tokens per request (before the chat template)"
    )
    parser.add_argument("--output-len", type=int, default=32, help="generated tokens per request (EOS ignored)")
    parser.add_argument("--image-resolution", default="128x128", help="HxW of the one random PNG per request")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--runs", type=int, default=3, help="bench_serving runs per concurrency (medians)")
    parser.add_argument(
        "--turn2-reps", type=int, default=5, help="two-turn conversations; turn 2 of each is sent cached, then flushed"
    )
    parser.add_argument(
        "--seed", type=int, default=42, help="bench_serving's --seed; the reference regenerates the same requests"
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=64,
        help="chunked-prefill size of the chunked + mixed-chunk server (0: skip it); 64 cuts each "
        "~100-token prompt of this workload into 2-3 chunks on this 2-core machine",
    )
    parser.add_argument("--chunked-concurrency", type=int, nargs="+", default=[8], help="concurrencies run chunked")
    parser.add_argument("--server-arg", action="append", default=[], help="extra launch_server flag (repeatable)")
    return parser.parse_args(argv)


def server_args(args: argparse.Namespace, chunk_size: int = -1) -> list[str]:
    # CPU serving needs fp32; bench_serving sends its own warmup request, so the server's is skipped.
    # Unchunked: an explicit -1 makes stock CPU memory resolution compute a negative --mem-fraction-static (it
    # sizes activation memory from the chunk size), so the value stock resolves with its default chunk is given.
    chunking = ["--chunked-prefill-size", str(chunk_size)]
    chunking += ["--enable-mixed-chunk"] if chunk_size > 0 else ["--mem-fraction-static", "0.71"]
    return ["--dtype", "float32", "--skip-server-warmup", *chunking, *args.server_arg]


def bench_runs(
    server: SglangServer, model: Path, args: argparse.Namespace, concurrencies: list[int], output_file: Path, label: str
) -> dict[int, list[dict]]:
    """An unmeasured warmup pass, then ``args.runs`` bench_serving runs per concurrency."""
    # Unmeasured pass: the first requests of a server compile sglang's torch.compile'd vision helpers.
    warmup = argparse.Namespace(**{**vars(args), "num_prompts": max(concurrencies)})
    run_bench_serving(server, model, warmup, max(concurrencies), OUT_DIR / "warmup.jsonl")
    runs: dict[int, list[dict]] = {}
    for concurrency in concurrencies:
        for run in range(args.runs):
            result = run_bench_serving(server, model, args, concurrency, output_file)
            runs.setdefault(concurrency, []).append(result)
            logger.info(
                "%s c=%d run %d: %.2f req/s, %.1f out tok/s",
                label,
                concurrency,
                run + 1,
                result["request_throughput"],
                result["output_throughput"],
            )
    return runs


def run_bench_serving(
    server: SglangServer, model: Path, args: argparse.Namespace, concurrency: int, output_file: Path
) -> dict:
    """One ``python -m sglang.bench_serving`` run against ``server``; returns its JSONL result line."""
    command = [
        sys.executable,
        "-m",
        "sglang.bench_serving",
        "--backend",
        "sglang-oai-chat",
        "--base-url",
        server.base_url,
        "--model",
        str(model),
        "--dataset-name",
        "image",
        "--image-count",
        "1",
        "--image-resolution",
        args.image_resolution,
        "--image-format",
        "png",
        "--image-content",
        "random",
        "--num-prompts",
        str(args.num_prompts),
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--random-range-ratio",
        "1.0",
        "--max-concurrency",
        str(concurrency),
        "--flush-cache",
        "--seed",
        str(args.seed),
        "--disable-tqdm",
        "--output-file",
        str(output_file),
        "--tag",
        f"c{concurrency}",
    ]
    before = output_file.read_text().count("\n") if output_file.exists() else 0
    log_path = OUT_DIR / f"bench_serving-c{concurrency}.log"
    with open(log_path, "a") as log:
        subprocess.run(command, env=engine_env("cpu"), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    lines = output_file.read_text().splitlines()
    if len(lines) != before + 1:
        raise RuntimeError(f"bench_serving wrote no result line; see {log_path}")
    result = json.loads(lines[-1])
    expected_tokens = args.num_prompts * args.output_len
    if result["completed"] != args.num_prompts or result["total_output_tokens"] != expected_tokens:
        raise RuntimeError(
            f"bench_serving completed {result['completed']}/{args.num_prompts} requests, "
            f"{result['total_output_tokens']}/{expected_tokens} tokens; see {log_path}"
        )
    return result


def median_over_runs(results: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in results) for key in METRICS}


def image_requests(model: Path, args: argparse.Namespace, seed: int) -> list:
    """bench_serving's image-dataset rows for ``seed``, exactly as its client builds them."""
    from sglang.benchmark.datasets.image import ImageDataset

    dataset = ImageDataset(
        num_requests=args.num_prompts,
        image_count=1,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=1.0,
        image_content="random",
        image_format="png",
        image_resolution=args.image_resolution,
        backend="sglang-oai-chat",
        random_image_count=False,
        seed=seed,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # the dataset prints its statistics
        return dataset.load(model_id=str(model))


def chat_messages(row) -> list[dict]:
    """The user turn bench_serving's chat backend sends for ``row`` (images first, then the text)."""
    content = [{"type": "image_url", "image_url": {"url": url}} for url in row.image_data]
    return [{"role": "user", "content": content + [{"type": "text", "text": row.prompt}]}]


def streamed_ttft(client: OpenAI, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """(seconds to the first streamed text, the whole reply) of one greedy chat completion, EOS ignored."""
    started = time.perf_counter()
    first_text_at, pieces = None, []
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                first_text_at = first_text_at or time.perf_counter()
                pieces.append(choice.delta.content)
    if first_text_at is None:
        raise RuntimeError("the server streamed no text")
    return first_text_at - started, "".join(pieces)


def flush_cache(server: SglangServer) -> None:
    # With a timeout the server waits for the just-finished request to leave the batch instead of refusing (400).
    request = urllib.request.Request(f"{server.base_url}/flush_cache?timeout=60", method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        if response.status != 200:
            raise RuntimeError(f"/flush_cache answered {response.status}")


def turn2_ttfts(server: SglangServer, rows: list, output_len: int) -> tuple[list[float], list[float]]:
    """TTFTs of each conversation's second turn (turn 1 image + text, its answer, a new question): once with turn 1
    in the radix cache, once right after flushing it. Both on the same server, interleaved, so load drift on a
    shared machine hits both alike; a flushed cache makes turn 2 prefill everything, as --disable-radix-cache does."""
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="not-needed")
    model = client.models.list().data[0].id
    cached, flushed = [], []
    for row in rows:
        first_turn = chat_messages(row)
        _, answer = streamed_ttft(client, model, first_turn, output_len)
        second_turn = first_turn + [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": TURN2_QUESTION},
        ]
        cached.append(streamed_ttft(client, model, second_turn, output_len)[0])
        flush_cache(server)
        flushed.append(streamed_ttft(client, model, second_turn, output_len)[0])
    return cached, flushed


def data_url_bytes(url: str) -> bytes:
    return base64.b64decode(url.split(",", 1)[1])


def reference_sequential(model_dir: Path, rows: list, output_len: int) -> dict:
    """The requests one by one through the reference model (fp32, greedy), after one warmup request."""
    from transformers import AutoModelForCausalLM, AutoProcessor

    torch.set_num_threads(len(os.sched_getaffinity(0)))  # every core the server could use
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir, trust_remote_code=True)

    def answer(row) -> tuple[int, int]:
        messages = [
            {
                "role": "user",
                "content": [{"type": "image", "image": data_url_bytes(url)} for url in row.image_data]
                + [{"type": "text", "text": row.prompt}],
            }
        ]
        inputs, _ = model.processor_inputs(processor, {"messages": messages})
        with torch.inference_mode():
            sequences = model.generate(**inputs, max_new_tokens=output_len, do_sample=False, eos_token_id=[])
        prompt_len = inputs["input_ids"].shape[1]
        processor.decode(sequences[0, prompt_len:], skip_special_tokens=True)  # a server detokenizes too
        return prompt_len, sequences.shape[1] - prompt_len

    answer(rows[0])
    started = time.perf_counter()
    lengths = [answer(row) for row in rows]
    duration = time.perf_counter() - started
    output_tokens = sum(out for _, out in lengths)
    if output_tokens != len(rows) * output_len:
        raise RuntimeError(f"reference generated {output_tokens} tokens, expected {len(rows) * output_len}")
    return {
        "request_throughput": len(rows) / duration,
        "output_throughput": output_tokens / duration,
        "duration": duration,
        "mean_input_tokens": statistics.mean(p for p, _ in lengths),
    }


def format_table(rows: list[tuple[str, dict]], reference_rps: float) -> str:
    header = ("run", "req/s", "out tok/s", "TTFT med ms", "TTFT p99 ms", "TPOT med ms", "TPOT p99 ms", "vs reference")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, m in rows:
        cells = [name, f"{m['request_throughput']:.2f}", f"{m['output_throughput']:.1f}"]
        cells += [f"{m[k]:.1f}" if k in m else "–" for k in METRICS[2:]]
        cells.append(f"{m['request_throughput'] / reference_rps:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    wall_started = time.perf_counter()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from moss_vl_reference.tiny_checkpoint import build_or_reuse

        args.model = build_or_reuse("bench")
    model = args.model.resolve()
    output_file = OUT_DIR / f"results-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    turn2_rows = image_requests(
        model, argparse.Namespace(**{**vars(args), "num_prompts": args.turn2_reps}), args.seed + 1
    )

    with SglangServer(model, extra_args=server_args(args), name="bench-serving") as server:
        startup_radix_on = server.startup_seconds
        runs = bench_runs(server, model, args, args.concurrency, output_file, "unchunked")
        server_input_tokens = runs[args.concurrency[0]][0]["total_input_tokens"] / args.num_prompts
        ttft_on, ttft_off = turn2_ttfts(server, turn2_rows, args.output_len)
    chunked_runs: dict[int, list[dict]] = {}
    if args.chunk_size > 0:
        chunked_flags = server_args(args, args.chunk_size)
        with SglangServer(model, extra_args=chunked_flags, name="bench-serving-chunked") as server:
            chunked_runs = bench_runs(server, model, args, args.chunked_concurrency, output_file, "chunked")

    reference = reference_sequential(model, image_requests(model, args, args.seed), args.output_len)
    reference_rps = reference["request_throughput"]
    table_rows = [(f"sglang c={c} (median of {len(r)})", median_over_runs(r)) for c, r in runs.items()]
    table_rows += [
        (f"sglang c={c} chunked {args.chunk_size} + mixed (median of {len(r)})", median_over_runs(r))
        for c, r in chunked_runs.items()
    ]
    table_rows.append(("reference sequential", reference))

    print(
        f"\nmodel {model}; {args.num_prompts} requests, 1 random {args.image_resolution} PNG + {args.input_len} text "
        f"tokens each, {args.output_len} output tokens, greedy; server flags: {' '.join(server_args(args))}"
    )
    print(
        f"prompt tokens per request (incl. vision, chat template): server {server_input_tokens:.1f}, "
        f"reference {reference['mean_input_tokens']:.1f}; server start {startup_radix_on:.1f} s"
    )
    print(format_table(table_rows, reference_rps))
    for label, by_concurrency in (("unchunked", runs), (f"chunked {args.chunk_size}", chunked_runs)):
        for concurrency, results in by_concurrency.items():
            print(
                f"  {label} c={concurrency} runs req/s: " + ", ".join(f"{r['request_throughput']:.2f}" for r in results)
            )
    on, off = statistics.median(ttft_on) * 1000, statistics.median(ttft_off) * 1000
    print(
        f"turn-2 TTFT (median of {args.turn2_reps}): turn 1 in the radix cache {on:.1f} ms, "
        f"cache flushed {off:.1f} ms, "
        f"off/on {off / on:.2f}x"
    )
    print(f"raw bench_serving results: {output_file}")
    print(f"benchmark wall time {time.perf_counter() - wall_started:.0f} s")
    ratios = {c: statistics.median(r["request_throughput"] for r in runs[c]) / reference_rps for c in runs}
    chunked_c8 = median_over_runs(chunked_runs[8]) if 8 in chunked_runs else None
    unchunked_c8 = median_over_runs(runs[8]) if 8 in runs else None
    chunked_result = ""
    if chunked_c8 and unchunked_c8:
        rps_ratio = chunked_c8["request_throughput"] / unchunked_c8["request_throughput"]
        p99_ratio = chunked_c8["p99_ttft_ms"] / unchunked_c8["p99_ttft_ms"]
        chunked_result = (
            f" c8_chunked_over_unchunked_rps={rps_ratio:.2f} c8_ttft_p99_chunked_over_unchunked={p99_ratio:.2f}"
        )
    print(
        f"RESULT c8_vs_ref={ratios.get(8, float('nan')):.2f} c1_vs_ref={ratios.get(1, float('nan')):.2f} "
        f"turn2_ttft_radix_off_over_on={off / on:.2f}{chunked_result}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
