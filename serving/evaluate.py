"""`make eval`: a VideoMME-shaped evaluation through the served OpenAI API, sent the way lmms-eval 0.7.3's
``--model openai`` with ``pass_video_url=True`` sends it, then compared with the transformers runner.

Per sample one chat completion: a ``video_url`` part (``file://`` + the video's absolute path), a text part with
lmms-eval's VideoMME prompt, ``max_tokens``, ``temperature: 0`` and vLLM's top-level
``media_io_kwargs: {"video": {"num_frames": N}}``. The answer's letter is scored against the row's. Written to
``--out``: ``media/`` (the set, ``serving.eval_set``), ``results.jsonl`` (one line per sample, as it finishes).
Printed: accuracy per task type and overall, and how many served answers equal the transformers runner's text on
the same video and frame count (the tiny checkpoint in fp32: all of them). Exit status: 1 when any request failed
(lmms-eval itself records a failure and exits 0), 2 when a served answer differs from the runner's, else 0.

Without ``--base-url`` it starts its own server (fp32, on a free loopback port) allowing local media only from the
set's directory; with it, that server must allow the directory (``MOSSVL_ALLOWED_LOCAL_MEDIA_PATH``).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from contextlib import nullcontext
from pathlib import Path

import requests
from tqdm import tqdm

from serving import eval_set
from serving.launch import REPO_ROOT, SglangServer

logger = logging.getLogger(__name__)

# lmms-eval's VideoMME prompt without subtitles (its task's option prompt, then question, options, post prompt).
OPTION_PROMPT = (
    "Select the best answer to the following multiple-choice question based on the video. "
    "Respond with only the letter (A, B, C, or D) of the correct option."
)
POST_PROMPT = "The best answer is:"
LETTER = re.compile(r"\b([ABCD])\b")
ALLOWED_MEDIA_ENV = "MOSSVL_ALLOWED_LOCAL_MEDIA_PATH"


def videomme_prompt(row: dict) -> str:
    return "\n".join([OPTION_PROMPT, row["question"], *row["options"], POST_PROMPT])


def answer_letter(text: str) -> str | None:
    """The first standalone A-D of an answer (VideoMME's scoring reads the first option letter)."""
    found = LETTER.search(text.replace(POST_PROMPT, ""))
    return found.group(1) if found else None


def lmms_eval_body(row: dict, model: str, num_frames: int, max_tokens: int) -> dict:
    """One sample's request body as lmms-eval's pass_video_url mode sends it."""
    video = {"type": "video_url", "video_url": {"url": "file://" + row["video_path"]}}
    return {
        "model": model,
        "messages": [{"role": "user", "content": [video, {"type": "text", "text": videomme_prompt(row)}]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "media_io_kwargs": {"video": {"num_frames": num_frames}},
    }


def served_answer(base_url: str, body: dict, timeout_s: float) -> tuple[str | None, str | None]:
    """(answer text, None) or (None, why the request failed)."""
    try:
        response = requests.post(f"{base_url}/v1/chat/completions", json=body, timeout=timeout_s)
    except requests.RequestException as error:
        return None, f"{type(error).__name__}: {error}"
    if response.status_code != 200:
        return None, f"HTTP {response.status_code}: {response.text[:300]}"
    return response.json()["choices"][0]["message"]["content"] or "", None


def runner_answers(checkpoint: Path, rows: list[dict], num_frames: int, max_tokens: int) -> list[str]:
    """The transformers runner's answers (``inference.model_loading``, fp32, greedy) on the same video, frame count
    and prompt; computed before the server starts, so the two never share the cores."""
    from inference.model_loading import load_model

    model, processor, _ = load_model(checkpoint, device="cpu", dtype="float32")
    queries = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "video", "video": {"video_path": row["video_path"], "num_frames": num_frames}},
                        {"type": "text", "text": videomme_prompt(row)},
                    ],
                }
            ]
        }
        for row in rows
    ]
    results = model.offline_batch_generate(processor, queries, max_new_tokens=max_tokens, do_sample=False)["results"]
    return [result["text"] for result in results]


def summary_table(results: list[dict]) -> str:
    groups: dict[str, list[dict]] = {}
    for result in results:
        groups.setdefault(result["task_type"], []).append(result)
    lines = ["| task type | samples | correct | accuracy |", "|---|---:|---:|---:|"]
    for name, members in sorted(groups.items()) + [("all", results)]:
        correct = sum(member["correct"] for member in members)
        lines.append(f"| {name} | {len(members)} | {correct} | {100 * correct / len(members):.1f} % |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, help="MOSS-VL checkpoint (default: the embedded tiny one)")
    parser.add_argument("--base-url", help="a running server to evaluate (default: start one)")
    parser.add_argument("--num-frames", type=int, default=8, help="frames per video asked for (default 8)")
    parser.add_argument("--max-tokens", type=int, default=16, help="answer length limit (default 16)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "eval", help="output directory")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    parser.add_argument("--no-runner", action="store_true", help="skip the transformers runner comparison")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.model_path is None:
        from moss_vl_reference.tiny_checkpoint import build_or_reuse

        args.model_path = build_or_reuse("tiny")
    media = args.out / "media"
    rows = eval_set.build(media)
    expected = None if args.no_runner else runner_answers(args.model_path, rows, args.num_frames, args.max_tokens)
    own_server = None
    if args.base_url is None:
        own_server = SglangServer(
            args.model_path,
            extra_args=["--dtype", "float32"],
            env={ALLOWED_MEDIA_ENV: str(media.resolve())},
            name="eval",
        )
    with own_server or nullcontext():
        base_url = args.base_url or own_server.base_url
        model = requests.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        results = []
        with open(args.out / "results.jsonl", "w") as log:
            for index, row in enumerate(tqdm(rows, desc="samples", unit="sample")):
                body = lmms_eval_body(row, model, args.num_frames, args.max_tokens)
                text, error = served_answer(base_url, body, args.timeout)
                result = {
                    **{key: row[key] for key in ("question_id", "video_id", "task_type", "answer")},
                    "response": text,
                    "error": error,
                    "predicted": None if text is None else answer_letter(text),
                    "runner_response": None if expected is None else expected[index],
                }
                result["correct"] = result["predicted"] == row["answer"]
                results.append(result)
                log.write(json.dumps(result) + "\n")
                log.flush()
    print(summary_table(results))
    print(f"per-sample results: {args.out / 'results.jsonl'}")
    failed = [r for r in results if r["error"] is not None]
    differing = [
        r for r in results if expected is not None and r["error"] is None and r["response"] != r["runner_response"]
    ]
    if expected is not None:
        answered = len(results) - len(failed)
        print(f"served answers equal to the transformers runner's: {answered - len(differing)} of {answered}")
    if failed:
        print(f"{len(failed)} of {len(results)} samples failed (first: {failed[0]['error']})")
        return 1
    return 2 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
