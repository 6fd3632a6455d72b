"""Replay ProactiveVideoQA's frame-input format through the realtime stream and write its ``pred.jsonl``.

    python realtime_inference/replay_proactive_videoqa.py --checkpoint CKPT \\
        --input data/web-1_sec_per_frame-frame_input_format.json --output pred.jsonl
    python realtime_inference/replay_proactive_videoqa.py --server http://127.0.0.1:30000 --concurrency 8 \\
        --input data/web-1_sec_per_frame-frame_input_format.json --output pred.jsonl

``--checkpoint`` drives the transformers stream in this process, one sample at a time. ``--server`` drives a server's
realtime WebSocket (``WS /v1/realtime?model=NAME``, the path smg relays, so the URL may be a worker's or the gateway's;
``--path /v1/video/realtime`` for a server without it), ``--concurrency`` samples at once, each its own session.

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
nothing more to say (the session's ``wait_until_parked``, for a checkpoint without it --settle-seconds; served: the
input's ``processed`` event, then the end of the turn it started).

Output, one line per finished sample (appended, so an interrupted run resumes; a sample already in the file is
skipped; served, lines come in the order samples finish): ``{question_id, model_response_list: [{role, content,
time}]}`` with the user turns' text and every model reply (its text decoded whole), a reply timed at the newest frame
pushed when it began. A sample that fails is written to
``<output>.errors.jsonl`` (``{question_id, error}``) and retried by the next run. Scoring (PAUC) needs an LLM judge
and is not done here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = str(Path(__file__).resolve().parents[1])
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from PIL import Image  # noqa: E402
from tqdm import tqdm  # noqa: E402

from inference.cli_flags import add_runner_flags  # noqa: E402
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


class Replies:
    """The replies of one sample: a reply is the text of one turn (between round markers, silences and interrupts),
    timed at the newest frame pushed when its first piece arrived."""

    def __init__(self):
        self.replies: list[dict] = []
        self.current: Optional[dict] = None

    def end_turn(self) -> None:
        self.current = None

    def add_text(self, piece: str, now: float) -> None:
        text = CONTROL_PIECE.sub("", piece)
        if not text:
            return
        if self.current is None:
            self.current = {"role": "assistant", "content": "", "time": now}
            self.replies.append(self.current)
        self.current["content"] += text

    def finished(self) -> list[dict]:
        for reply in self.replies:
            reply["content"] = reply["content"].strip()
        return [reply for reply in self.replies if reply["content"]]


class ReplyCollector(Replies):
    """Replies from the transformers session's output pieces."""

    def __init__(self, session: Any):
        super().__init__()
        self.session = session

    def collect(self, now: float) -> None:
        while (piece := self.session.poll_output(0)) is not None:
            if piece.startswith(ERROR_PREFIX):
                raise RuntimeError(piece[len(ERROR_PREFIX) :])
            if piece in (SILENCE, ROUND_START):
                self.end_turn()
            else:
                self.add_text(piece, now)


def settle(session: Any, settle_seconds: float, timeout: float) -> None:
    """Wait until the stream has taken in what was pushed and has nothing more to say."""
    waits = getattr(session, "wait_until_parked", None)
    if waits is None:
        time.sleep(settle_seconds)
    elif not waits(timeout):
        raise TimeoutError(f"the stream did not settle within {timeout:g} s")


@dataclass
class Push:
    """One input of a sample's stream: a frame (with the turn's text on its last frame), or text with no frame."""

    time: float
    frame: Optional[str]
    text: str


def sample_plan(sample: dict, sec_per_frame: float) -> tuple[Optional[str], list[Push], list[dict]]:
    """(system prompt, the pushes in order, the user turns' records) of one sample."""
    conversation = list(sample["conversation"])
    system_prompt = None
    if conversation and conversation[0].get("role") == "system":
        system_prompt = turn_parts(conversation.pop(0))[0] or None
    pushes: list[Push] = []
    records: list[dict] = []
    frame_index, now = 0, 0.0
    for turn in conversation:
        if turn.get("role") != "user":
            continue
        text, frames = turn_parts(turn)
        for position, frame in enumerate(frames):
            now = frame_index * sec_per_frame
            frame_index += 1
            pushes.append(Push(now, frame, text if position == len(frames) - 1 else ""))
        if text and not frames:
            pushes.append(Push(now, None, text))
        if text:
            records.append({"role": "user", "content": text, "time": now})
    return system_prompt, pushes, records


def sample_record(sample: dict, records: list[dict], replies: list[dict]) -> dict:
    return {
        "question_id": sample["question_id"],
        "model_response_list": sorted(records + replies, key=lambda t: t["time"]),
    }


def replay_sample(model: Any, processor: Any, sample: dict, options: argparse.Namespace) -> dict:
    """One sample through one fresh transformers session -> its pred.jsonl record."""
    system_prompt, pushes, records = sample_plan(sample, options.sec_per_frame)
    session = model.create_realtime_session(
        processor,
        system_prompt=system_prompt,
        max_tokens_per_turn=options.max_tokens_per_second,
        max_new_tokens=options.max_new_tokens,
    )
    session.start()
    collector = ReplyCollector(session)
    try:
        settle(session, options.settle_seconds, options.timeout_seconds)
        collector.collect(0.0)
        for push in pushes:
            if push.frame is None:
                session.push_prompt(push.text)
            elif push.text:
                session.push_prompt_frame(push.text, load_frame(push.frame, options.media_root), push.time)
            else:
                session.push_frame(load_frame(push.frame, options.media_root), push.time)
            settle(session, options.settle_seconds, options.timeout_seconds)
            collector.collect(push.time)  # what the push made the stream say began while it was the newest input
    finally:
        session.close(options.timeout_seconds)
    collector.collect(pushes[-1].time if pushes else 0.0)
    return sample_record(sample, records, collector.finished())


class ServedReplies(Replies):
    """Replies from a served session's events: the text deltas of a turn (a turn ends at its silence or when a
    prompt interrupts it), timed like :class:`ReplyCollector`'s."""

    def __init__(self, client: Any):
        super().__init__()
        self.client, self.seen = client, 0

    def collect(self, now: float) -> None:
        events = [received.event for received in self.client.events[self.seen :]]
        self.seen += len(events)
        for event in events:
            kind = event["type"]
            if kind == "error":
                raise RuntimeError(f"server error {event.get('code')}: {event.get('message')}")
            if kind in ("response.turn.silence", "response.turn.interrupted", "response.done"):
                self.end_turn()
            elif kind == "response.text.delta":
                self.add_text(event["delta"], now)


async def replay_sample_served(url: str, sample: dict, options: argparse.Namespace) -> dict:
    """One sample through one fresh session of the server's realtime socket -> its pred.jsonl record."""
    from serving.realtime_client import RealtimeClient

    system_prompt, pushes, records = sample_plan(sample, options.sec_per_frame)
    headers = {"Authorization": f"Bearer {options.api_key or 'none'}"}  # smg relays only a client with one
    client = RealtimeClient(url, headers=headers)
    replies = ServedReplies(client)
    configure = {"max_new_tokens": options.max_new_tokens, "temperature": 0.0}
    if system_prompt:
        configure["system_prompt"] = system_prompt
    if options.max_tokens_per_second:
        configure["max_tokens_per_turn"] = options.max_tokens_per_second
    try:
        await client.open(**configure)
        await client.settle(timeout=options.timeout_seconds)
        replies.collect(0.0)
        for push in pushes:
            if push.frame is None:
                seq_no = await client.prompt(push.text)
            else:
                image = load_frame(push.frame, options.media_root)
                seq_no = await client.frame(image, push.time, prompt=push.text or None)
            await client.settle(seq_no, timeout=options.timeout_seconds)
            replies.collect(push.time)
    finally:
        await client.close()
    replies.collect(pushes[-1].time if pushes else 0.0)
    return sample_record(sample, records, replies.finished())


def finished_question_ids(output: Path) -> set:
    if not output.is_file():
        return set()
    return {json.loads(line)["question_id"] for line in output.read_text(encoding="utf-8").splitlines() if line}


class Output:
    """pred.jsonl (appended, one line per finished sample) and its errors file, with the run's counts."""

    def __init__(self, output: Path):
        self.finished = finished_question_ids(output)
        self.out = output.open("a", encoding="utf-8")
        self.errors = output.with_name(output.name + ".errors.jsonl").open("a", encoding="utf-8")
        self.counts = {"done": 0, "skipped": 0, "failed": 0}

    def pending(self, samples: list[dict]) -> list[dict]:
        todo = [sample for sample in samples if sample["question_id"] not in self.finished]
        self.counts["skipped"] = len(samples) - len(todo)
        return todo

    def record(self, record: dict) -> None:
        self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.out.flush()
        self.counts["done"] += 1

    def failure(self, sample: dict, error: BaseException) -> None:
        """One bad sample must not stop the others; it is retried by the next run."""
        logger.error("sample %s failed: %s: %s", sample["question_id"], type(error).__name__, error)
        self.errors.write(json.dumps({"question_id": sample["question_id"], "error": f"{error}"}) + "\n")
        self.errors.flush()
        self.counts["failed"] += 1

    def close(self) -> dict:
        self.out.close()
        self.errors.close()
        return self.counts


def replay_file(model: Any, processor: Any, options: argparse.Namespace) -> dict:
    """Every sample of --input not yet in --output, through the transformers stream -> {done, skipped, failed}."""
    output = Output(options.output)
    for sample in tqdm(output.pending(json.loads(options.input.read_text(encoding="utf-8"))), desc="samples"):
        try:
            output.record(replay_sample(model, processor, sample, options))
        except Exception as error:
            output.failure(sample, error)
    return output.close()


def served_model_name(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url.rstrip('/')}/v1/models", timeout=60) as response:
        return json.loads(response.read())["data"][0]["id"]


def replay_file_served(options: argparse.Namespace) -> dict:
    """Every sample of --input not yet in --output through --server, --concurrency sessions at once."""
    from serving.realtime_client import realtime_url

    url = realtime_url(options.server, options.path, model=options.model or served_model_name(options.server))
    output = Output(options.output)
    todo = output.pending(json.loads(options.input.read_text(encoding="utf-8")))

    async def run_all() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        for sample in todo:
            queue.put_nowait(sample)
        progress = tqdm(total=len(todo), desc="samples")

        async def stream_worker() -> None:
            while not queue.empty():
                sample = queue.get_nowait()
                try:
                    output.record(await replay_sample_served(url, sample, options))
                except Exception as error:
                    output.failure(sample, error)
                progress.update()

        await asyncio.gather(*(stream_worker() for _ in range(options.concurrency)))
        progress.close()

    asyncio.run(run_all())
    return output.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path, help="MOSS-VL realtime checkpoint: the transformers stream here")
    source.add_argument("--server", help="http://HOST:PORT of a server or of smg in front of servers")
    parser.add_argument("--path", default="/v1/realtime", help="served: the socket's path (default /v1/realtime)")
    parser.add_argument("--model", default=None, help="served: the model name (default: the server's first)")
    parser.add_argument("--api-key", default=None, help="served: sent as Authorization: Bearer KEY")
    parser.add_argument("--concurrency", type=int, default=1, help="served: sessions at once (default 1)")
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
    add_runner_flags(parser)
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
    if min(args.sec_per_frame, args.max_new_tokens, args.timeout_seconds, args.concurrency) <= 0:
        parser.error("--sec-per-frame, --max-new-tokens, --timeout-seconds and --concurrency must be positive")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.server:
        counts = replay_file_served(args)
    else:
        from inference.model_loading import load_model  # torch/transformers only once the arguments are good

        model, processor, _ = load_model(
            args.checkpoint, args.device, args.dtype, args.attention_backend, remote_code=args.remote_code
        )
        counts = replay_file(model, processor, args)
    logger.info("%(done)d samples replayed, %(skipped)d already done, %(failed)d failed", counts)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
