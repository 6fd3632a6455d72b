"""INT8 (W8A8_DYNAMIC) against bf16: the same MOSS-VL served both ways, compared token by token.

    python benchmarks/bench_int8_quality.py [--checkpoint DIR] [--max-new-tokens 16]

Both servers run the simulated Ascend route on CPU (tests/support/npu_route_probe.py: stock's NPU branches on the
STAND-IN torch_npu, the INT8 one through stock's ModelSlim linear method and the stand-in ``npu_dynamic_quant`` /
``npu_quant_matmul``), bf16, page size 128. The INT8 checkpoint is this repo's converter's output of ``--checkpoint``.

Per prompt of a fixed set (text, images, a video, several turns): every prompt position is teacher-forced on both
servers (sglang's ``input_token_logprobs`` / ``input_top_logprobs``), so the two see identical inputs: top-1
agreement is the share of positions whose most likely next token is the same, logprob error the |difference| of the
logprob each gives the actual next token. Greedy continuations are compared too (tokens equal before the first
divergence). What this says: how much the INT8 kernels and per-channel weight rounding move this model's next-token
distribution. What it does not say: anything about MOSS-VL-Instruct's quality. The tiny checkpoint is random and
small (128 hidden), its activations have no outlier channels, and quality on a benchmark (MMMU, Video-MME) needs the
real weights on an NPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "sglang")]

from moss_vl_reference.tiny_checkpoint import build_or_reuse  # noqa: E402
from mossvl_ascend import quantize  # noqa: E402
from serving.launch import SglangServer  # noqa: E402
from support.npu_route_probe import MODE_ENV, PROBE_ENV, install_probe  # noqa: E402
from support.serving import CASES, greedy_with_logprobs, to_openai  # noqa: E402

PROMPTS = {
    name: CASES[name] for name in ("image_data_url", "two_images", "three_turns", "video", "text_only", "long_question")
}
PROMPTS["text_story"] = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
PROMPTS["text_math"] = [{"role": "user", "content": "What is seventeen times twenty-three? Explain."}]


def request_parts(processor, messages):
    """(chat text, image data URLs, video data URLs) as sglang's /generate takes them."""
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    parts = [
        part for message in to_openai(messages) if isinstance(message["content"], list) for part in message["content"]
    ]
    images = [part["image_url"]["url"] for part in parts if part["type"] == "image_url"]
    videos = [part["video_url"]["url"] for part in parts if part["type"] == "video_url"]
    return text, images or None, videos or None


def serve_all(checkpoint: Path, prompts: dict, max_new_tokens: int, probe_dir: Path, name: str) -> dict:
    server = SglangServer(
        checkpoint,
        extra_args=["--dtype", "bfloat16", "--page-size", "128", "--skip-server-warmup"],
        name=name,
        ready_timeout_s=600,
    )
    server.env.update({PROBE_ENV: str(probe_dir / f"{name}.json"), MODE_ENV: "npu"})
    server.env["PYTHONPATH"] = os.pathsep.join([install_probe(probe_dir / name), server.env["PYTHONPATH"]])
    answers = {}
    with server:
        for prompt, (text, images, videos) in prompts.items():
            answers[prompt] = greedy_with_logprobs(server.base_url, text, images, videos, max_new_tokens, 1)[
                "meta_info"
            ]
    return answers


def compare(bf16: dict, int8: dict) -> tuple[int, int, list[float], int, int]:
    """(positions, top-1 agreements, |logprob errors|, greedy tokens equal before divergence, greedy tokens)."""
    positions = agree = 0
    errors = []
    for reference, quantized in zip(bf16["input_top_logprobs"][1:], int8["input_top_logprobs"][1:]):
        positions += 1
        agree += reference[0][1] == quantized[0][1]
    for reference, quantized in zip(bf16["input_token_logprobs"][1:], int8["input_token_logprobs"][1:]):
        errors.append(abs(reference[0] - quantized[0]))
    same = 0
    for reference, quantized in zip(bf16["output_token_logprobs"], int8["output_token_logprobs"]):
        if reference[1] != quantized[1]:
            break
        same += 1
    return positions, agree, errors, same, len(bf16["output_token_logprobs"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=None, help="float MOSS-VL checkpoint (default: tiny)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    checkpoint = args.checkpoint or build_or_reuse("tiny")
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint, trust_remote_code=True)
    prompts = {name: request_parts(processor, messages) for name, messages in PROMPTS.items()}
    with tempfile.TemporaryDirectory(prefix="int8-quality-") as tmp:
        tmp = Path(tmp)
        quantize.convert(checkpoint, tmp / "int8")
        bf16 = serve_all(checkpoint, prompts, args.max_new_tokens, tmp, "bf16")
        int8 = serve_all(tmp / "int8", prompts, args.max_new_tokens, tmp, "int8")
    print(
        f"{'prompt':<16} {'positions':>9} {'top-1 agree':>11} {'mean |dlogp|':>12} {'max |dlogp|':>11} "
        f"{'greedy same':>11}"
    )
    totals = [0, 0, [], 0, 0]
    for name in PROMPTS:
        positions, agree, errors, same, generated = compare(bf16[name], int8[name])
        print(
            f"{name:<16} {positions:>9} {agree / positions:>11.3f} {statistics.fmean(errors):>12.4f} "
            f"{max(errors):>11.4f} {same:>5}/{generated:<5}"
        )
        totals = [totals[0] + positions, totals[1] + agree, totals[2] + errors, totals[3] + same, totals[4] + generated]
    positions, agree, errors, same, generated = totals
    print(
        f"RESULT top1_agreement={agree / positions:.4f} mean_logprob_error={statistics.fmean(errors):.4f} "
        f"max_logprob_error={max(errors):.4f} greedy_tokens_same={same}/{generated} positions={positions}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
