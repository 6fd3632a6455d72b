"""Replay ProactiveVideoQA's frame-input format through the realtime stream and write its ``pred.jsonl``.

    python realtime_inference/replay_proactive_videoqa.py --checkpoint CKPT \\
        --input data/web-1_sec_per_frame-frame_input_format.json --output pred.jsonl

Input: a JSON list of samples ``{question_id, conversation: [turn, ...]}``; a turn has a ``role`` (system, user,
assistant) and ``content``, a string or a list of parts (``{"type": "text", "text"}``, ``{"type": "image",
"image": path}``, ``{"type": "video", "video": [path, ...]}``); frame paths are relative to --media-root (default:
the input's folder). Every frame lasts the file's seconds per frame (``0.5_sec_per_frame``, ``1_sec_per_frame`` or
``2_sec_per_frame`` in its name, or --sec-per-frame).

Each sample is one fresh stream. A system turn is the session's system prompt. A user turn's frames are pushed in
order at their times (frame i of the sample at i x seconds per frame); its text is asked at the time of the
turn's last frame, attached to that frame like a subtitle, or at the current time when the turn has no frame.
Assistant turns are gold answers and are not sent; ``skip_inference`` and ``must_reply`` are ignored, because the
stream itself decides when to speak. After every push the client waits until the stream has taken it in and has
nothing more to say (the session's ``wait_until_parked``; for a checkpoint without it, --settle-seconds).

Output, one line per finished sample (appended, so an interrupted run resumes; a sample already in the file is
skipped): ``{question_id, model_response_list: [{role, content, time}]}`` with the user turns' text and every
model reply, a reply timed at the newest frame pushed when it began. A sample that fails is written to
``<output>.errors.jsonl`` (``{question_id, error}``) and retried by the next run. Scoring (PAUC) needs an LLM judge
and is not done here.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = str(Path(__file__).resolve().parents[1])
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from PIL import Image  # noqa: E402
from tqdm import tqdm  # noqa: E402

from moss_vl_reference.queries_moss_vl import ERROR_PREFIX, ROUND_START, SILENCE  # noqa: E402

logger = logging.getLogger("replay_proactive_videoqa")

SEC_PER_FRAME_IN_NAME = re.compile(r"(0\.5|1|2)_sec_per_frame")
CONTROL_PIECE = re.compile(r"<\|[^|]+\|>|<go>")


def sec_per_frame_from_name(path: Path) -> float:
    match = SEC_PER_FRAME_IN_NAME.search(path.name)
    if match is None:
        raise ValueError(f"{path.name} names no N_sec_per_frame (0.5, 1 or 2); pass --sec-per-frame")
    return float(match.group(1))


def turn_parts(turn: dict) -> tuple[str, list[str]]:
    """(the turn's text, its frame paths in order)."""
    content = turn.get("content", "")
    if isinstance(content, str):
        return content, []
    text, frames = [], []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            text.append(part["text"])
        elif kind == "image":
            frames.append(part["image"])
        elif kind == "video":
            video = part["video"]
            frames.extend(video if isinstance(video, list) else [video])
        else:
            raise ValueError(f"unsupported content part type {kind!r}")
    return "".join(text).strip(), frames


def load_frame(path: str, media_root: Path) -> Image.Image:
    resolved = Path(path) if Path(path).is_absolute() else media_root / path
    if not resolved.is_file():
        raise FileNotFoundError(f"frame not found: {resolved}")
    with Image.open(resolved) as image:
        return image.convert("RGB")


class ReplyCollector:
    """Turns the session's output pieces into replies: a reply is the text between round markers and silences,
    timed at the newest frame pushed when its first piece arrived."""

    def __init__(self, session: Any):
        self.session = session
        self.replies: list[dict] = []
        self.current: Optional[dict] = None

    def collect(self, now: float) -> None:
        while (piece := self.session.poll_output(0)) is not None:
            if piece.startswith(ERROR_PREFIX):
                raise RuntimeError(piece[len(ERROR_PREFIX) :])
            if piece in (SILENCE, ROUND_START):
                self.current = None
                continue
            text = CONTROL_PIECE.sub("", piece)
            if not text:
                continue
            if self.current is None:
                self.current = {"role": "assistant", "content": "", "time": now}
                self.replies.append(self.current)
            self.current["content"] += text

    def finished(self) -> list[dict]:
        for reply in self.replies:
            reply["content"] = reply["content"].strip()
        return [reply for reply in self.replies if reply["content"]]


def settle(session: Any, settle_seconds: float, timeout: float) -> None:
    """Wait until the stream has taken in what was pushed and has nothing more to say."""
    waits = getattr(session, "wait_until_parked", None)
    if waits is None:
        time.sleep(settle_seconds)
    elif not waits(timeout):
        raise TimeoutError(f"the stream did not settle within {timeout:g} s")


def replay_sample(model: Any, processor: Any, sample: dict, options: argparse.Namespace) -> dict:
    """One sample through one fresh session -> its pred.jsonl record."""
    conversation = list(sample["conversation"])
    system_prompt = None
    if conversation and conversation[0].get("role") == "system":
        system_prompt = turn_parts(conversation.pop(0))[0] or None
    session = model.create_realtime_session(
        processor,
        system_prompt=system_prompt,
        max_tokens_per_turn=options.max_tokens_per_second,
        max_new_tokens=options.max_new_tokens,
    )
    session.start()
    collector = ReplyCollector(session)
    records: list[dict] = []
    frame_index, now = 0, 0.0
    try:
        settle(session, options.settle_seconds, options.timeout_seconds)
        for turn in conversation:
            if turn.get("role") != "user":
                continue
            text, frames = turn_parts(turn)
            images = [load_frame(path, options.media_root) for path in frames]
            for position, image in enumerate(images):
                now = frame_index * options.sec_per_frame
                frame_index += 1
                if text and position == len(images) - 1:
                    session.push_prompt_frame(text, image, now)
                else:
                    session.push_frame(image, now)
                collector.collect(now)
                settle(session, options.settle_seconds, options.timeout_seconds)
            if text and not images:
                session.push_prompt(text)
                settle(session, options.settle_seconds, options.timeout_seconds)
            if text:
                records.append({"role": "user", "content": text, "time": now})
            collector.collect(now)
    finally:
        session.close(options.timeout_seconds)
    collector.collect(now)
    responses = sorted(records + collector.finished(), key=lambda turn: turn["time"])
    return {"question_id": sample["question_id"], "model_response_list": responses}


def finished_question_ids(output: Path) -> set:
    if not output.is_file():
        return set()
    return {json.loads(line)["question_id"] for line in output.read_text(encoding="utf-8").splitlines() if line}


def replay_file(model: Any, processor: Any, options: argparse.Namespace) -> dict:
    """Every sample of --input not yet in --output -> {done, skipped, failed} counts."""
    samples = json.loads(options.input.read_text(encoding="utf-8"))
    finished = finished_question_ids(options.output)
    errors_path = options.output.with_name(options.output.name + ".errors.jsonl")
    counts = {"done": 0, "skipped": 0, "failed": 0}
    with options.output.open("a", encoding="utf-8") as out, errors_path.open("a", encoding="utf-8") as errors:
        for sample in tqdm(samples, desc="samples", unit="sample"):
            if sample["question_id"] in finished:
                counts["skipped"] += 1
                continue
            try:
                record = replay_sample(model, processor, sample, options)
            except Exception as error:  # one bad sample must not stop the others; it is retried next run
                logger.error("sample %s failed: %s: %s", sample["question_id"], type(error).__name__, error)
                errors.write(json.dumps({"question_id": sample["question_id"], "error": f"{error}"}) + "\n")
                errors.flush()
                counts["failed"] += 1
                continue
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            counts["done"] += 1
    return counts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="MOSS-VL realtime checkpoint directory")
    parser.add_argument("--input", type=Path, required=True, help="a ProactiveVideoQA *-frame_input_format.json")
    parser.add_argument("--output", type=Path, required=True, help="pred.jsonl to append to (resumed when present)")
    parser.add_argument(
        "--media-root", type=Path, default=None, help="folder relative frame paths start from (default: --input's)"
    )
    parser.add_argument(
        "--sec-per-frame",
        type=float,
        default=None,
        help="seconds each frame lasts (default: parsed from the input's name, N_sec_per_frame)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per model turn (default 128)")
    parser.add_argument(
        "--max-tokens-per-second", type=float, default=0.0, help="generation rate cap; 0 = uncapped (default 0)"
    )
    parser.add_argument(
        "--settle-seconds",
        type=float,
        default=1.0,
        help="wait after each push for a checkpoint whose session cannot report that it waits (default 1)",
    )
    parser.add_argument(
        "--timeout-seconds", type=float, default=300.0, help="longest wait for the stream per push (default 300)"
    )
    parser.add_argument("--device-map", default="auto", help="auto, cpu, npu, npu:1, cuda:0, ... (default auto)")
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float16", "float32"), default=None, help="default: bf16 on NPU/CUDA, fp32 CPU"
    )
    parser.add_argument("--attention-backend", default="auto", help="transformers attn_implementation (default auto)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return parser


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.input.is_file():
        parser.error(f"--input {args.input} is not a file")
    args.media_root = args.media_root or args.input.resolve().parent
    if args.sec_per_frame is None:
        try:
            args.sec_per_frame = sec_per_frame_from_name(args.input)
        except ValueError as error:
            parser.error(str(error))
    if args.sec_per_frame <= 0 or args.max_new_tokens <= 0 or args.timeout_seconds <= 0:
        parser.error("--sec-per-frame, --max-new-tokens and --timeout-seconds must be positive")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from inference.model_loading import load_model  # torch/transformers only once the arguments are good

    model, processor, _ = load_model(args.checkpoint, args.device_map, args.dtype, args.attention_backend)
    counts = replay_file(model, processor, args)
    logger.info("%(done)d samples replayed, %(skipped)d already done, %(failed)d failed", counts)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
