"""Realtime MOSS-VL with plain transformers (no sglang): frames stream in, the model's stream comes out.

The model is one continuous stream (the checkpoint's `create_realtime_session`, the upstream session API): frames
and prompts are appended as they arrive, and the model decides by itself when to speak; `<|silence|>` means it has
nothing to say and waits for input. Command line (text on stdout as it streams, logs on stderr); upstream's command
lines run unchanged (a superset of its flags)::

    # a video file at 1 sampled frame per second of video, in real time, with a question at 2.5 s
    python realtime_inference/run_online_inference.py --checkpoint CKPT --video clip.mp4 \\
        --prompt "Describe what happens." --prompt-at "2.5=Where is the dot now?"
    # one stream of a JSONL dataset (timestamps, prompts and per-frame subtitles inside, see video_sources.py)
    python realtime_inference/run_online_inference.py --checkpoint CKPT \\
        --dataset realtime_inference/examples/dataset.jsonl --dataset-index 0
    # synthetic frames, no model: check the source and the schedule
    python realtime_inference/run_online_inference.py --source synthetic --dry-run

Without --raw-output a new round prints "Assistant:", `<|silence|>` prints as [silence] with --show-silence and
control tokens are hidden. After the source ends the runner reads output for --drain-seconds of quiet (or until
the stream waits for input), then closes the session.

Service (``--serve``): FastAPI + uvicorn, ``GET /health`` and a WebSocket at ``/v1/realtime``, one session
at a time (a second connection is closed with code 1013). Client -> server messages are JSON text, except
a frame's image, which is the binary message right after its header:

    start {prompt, system_prompt, frame_queue_size, max_tokens_per_second (the rate cap), max_new_tokens (tokens
           per turn), frame_window_seconds, do_sample, temperature, top_k, top_p, repetition_penalty}
                                                      -> ready
    ping                                              -> pong
    prompt {text}                                     -> prompt_ack
    frame {timestamp[, prompt | text]} + binary JPEG/PNG
                                                      -> frame_ack {timestamp, dropped_oldest, pending_frames}
    video {path[, sample_fps, playback_speed, max_frames]}
                                                      -> video_started ... video_end {frames_sent, frames_dropped}
          (a server-side file, only under --media-root; refused when the service has none)
    stop_video                                        -> video_end, stop_video_ack
    stop                                              -> stopping ... session_end
The model's stream arrives as ``output {text}`` pieces, control pieces (``<|round_start|>``, ``<|silence|>``)
included. Every output is sent before ``session_end`` or a fatal ``error``; right after either the server closes
the socket and frees the session slot. A bad message (unknown type, frame without bytes, undecodable image, frame
over ``--max-frame-bytes``, empty prompt, ...) is answered with ``error {message}`` and the session goes on.
A client that disconnects without ``stop`` closes its session after the stream's current step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import logging
import os
import re
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

# Run as a script (`python realtime_inference/run_online_inference.py`), this folder is sys.path[0]; the shared
# modules live at the repository root.
REPO_ROOT = str(Path(__file__).resolve().parents[1])
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from fastapi import FastAPI, WebSocket, WebSocketDisconnect  # noqa: E402
from PIL import Image, UnidentifiedImageError  # noqa: E402

from inference.cli_flags import add_runner_flags  # noqa: E402
from moss_vl_reference.queries_moss_vl import ERROR_PREFIX, ROUND_START, SILENCE  # noqa: E402
from mossvl_ascend import checkpoint_code  # noqa: E402
from mossvl_ascend.realtime.websocket import REALTIME_SUBPROTOCOL, presented_key, refuse_handshake  # noqa: E402
from realtime_inference import video_sources  # noqa: E402
from realtime_inference.video_sources import FrameEvent, PromptEvent  # noqa: E402

logger = logging.getLogger("run_online_inference")

DEFAULT_PROMPT = "Describe what you see."
ACCEPTED_IMAGE_FORMATS = ("JPEG", "PNG")
API_KEY_ENV = "MOSSVL_REALTIME_API_KEY"  # the --serve socket's key when --api-key is not given
SESSION_CLOSE_SECONDS = 30.0  # how long closing a session waits for its stream's current step
SESSION_ENDED = object()  # next_session_output's answer once the session has stopped and is fully drained
SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")
# Control pieces a reader never sees without --raw-output (the round markers' text and the demo's hidden tokens).
HIDDEN_PIECES = re.compile(r"<\|round_end\|>|<\|response\|>|<\|assistant\|>|<go>")


# --------------------------------------------------------------------------------- session helpers


def next_session_output(session: Any, timeout: float) -> Any:
    """The next text piece, ``None`` if none came within ``timeout``, or SESSION_ENDED once the session is
    inactive and its output queue empty (checked again after ``active`` turns False, since the worker may
    put a last piece between the poll and that check)."""
    chunk = session.poll_output(timeout)
    if chunk is not None or session.active:
        return chunk
    late = session.poll_output(0.0)
    return SESSION_ENDED if late is None else late


def feed_session(
    session: Any,
    events: Iterable,
    playback_speed: float,
    stop: threading.Event,
    timestamp_offset: float = 0.0,
    on_prompt: Optional[Callable[[PromptEvent], None]] = None,
) -> dict:
    """Push paced frame/prompt events into the session until they run out or ``stop`` is set."""
    frames_sent = frames_dropped = prompts_sent = 0
    last_timestamp = None
    started = time.monotonic()
    for event in video_sources.paced(events, playback_speed, sleep=stop.wait):
        if stop.is_set():
            break
        if isinstance(event, FrameEvent):
            last_timestamp = timestamp_offset + event.timestamp
            frames_sent += 1
            frames_dropped += bool(push_frame(session, event.image, last_timestamp, event.prompt))
        else:
            if on_prompt is not None:
                on_prompt(event)
            session.push_prompt(event.text)
            prompts_sent += 1
    return {
        "frames_sent": frames_sent,
        "frames_dropped": frames_dropped,
        "prompts_sent": prompts_sent,
        "last_timestamp": last_timestamp,
        "elapsed_seconds": time.monotonic() - started,
    }


def push_frame(session: Any, image: Any, timestamp: float, prompt: Optional[str] = None) -> bool:
    """A frame, with its prompt (a subtitle) when it has one, through the upstream session API -> dropped?"""
    if prompt:
        return bool(session.push_prompt_frame(prompt, image, timestamp))
    return bool(session.push_frame(image, timestamp))


def render_piece(piece: str, raw_output: bool, show_silence: bool) -> str:
    """What the CLI prints for one output piece: everything with --raw-output; otherwise a new round opens an
    "Assistant:" line, <|silence|> shows as [silence] only with --show-silence, other control pieces are hidden."""
    if raw_output:
        return piece
    text = piece.replace(ROUND_START, "\nAssistant: ")
    text = text.replace(SILENCE, "[silence]" if show_silence else "")
    return HIDDEN_PIECES.sub("", text)


def sampling_kwargs(values: dict) -> dict:
    return {key: values[key] for key in SAMPLING_KEYS if values.get(key) is not None}


def generation_kwargs(values: dict) -> dict:
    """Keywords of create_realtime_session beyond the upstream ones: sampling, the turn limit and, when set, the
    frame window (a checkpoint without one would reject the keyword, so it is only passed when asked for)."""
    kwargs = {**sampling_kwargs(values), "max_new_tokens": values["max_new_tokens"]}
    if values.get("frame_window_seconds") is not None:
        kwargs["frame_window_seconds"] = values["frame_window_seconds"]
    return kwargs


def load_realtime_model(args: argparse.Namespace) -> tuple[Any, Any, dict]:
    """The runners' shared loader, plus a check that the checkpoint has the realtime API."""
    from inference.model_loading import load_model  # torch/transformers: only when a model is needed

    model, processor, metadata = load_model(
        args.checkpoint,
        args.device,
        args.dtype,
        args.attention_backend,
        remote_code=args.remote_code,
    )
    if not callable(getattr(model, "create_realtime_session", None)):
        raise RuntimeError(
            f"{args.checkpoint} has no realtime API (create_realtime_session); use a MOSS-VL realtime checkpoint"
        )
    return model, processor, metadata


# ------------------------------------------------------------------------------------ command line


def parse_timed_prompt(value: str) -> PromptEvent:
    seconds, sep, text = value.partition("=")
    try:
        timestamp = float(seconds)
    except ValueError:
        timestamp = -1.0
    if not sep or timestamp < 0 or not text.strip():
        raise argparse.ArgumentTypeError(f"expected SECONDS=TEXT with SECONDS >= 0, got {value!r}")
    return PromptEvent(timestamp, text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Realtime MOSS-VL over a frame stream (video file, synthetic, dataset, camera, screen) or as a "
        "WebSocket service, with plain transformers on NPU, CUDA or CPU.",
    )
    model = parser.add_argument_group("model")
    model.add_argument("--checkpoint", type=Path, help="local MOSS-VL checkpoint directory (not needed with --dry-run)")
    add_runner_flags(model)

    source = parser.add_argument_group("source (CLI mode)")
    source.add_argument(
        "--source",
        choices=("synthetic", "video", "frames", "dataset", "camera", "screen"),
        default=None,
        help="default: dataset if --dataset is given, video if --video is given, frames if --frames-dir is given, "
        "else synthetic",
    )
    source.add_argument("--video", type=Path, help="video file for --source video")
    source.add_argument(
        "--frames-dir",
        type=Path,
        help="folder of PNG/JPEG frames for --source frames, streamed in name order at --sample-fps",
    )
    source.add_argument(
        "--dataset", type=Path, help="JSONL dataset for --source dataset (format: realtime_inference/video_sources.py)"
    )
    source.add_argument("--dataset-index", type=int, default=0, help="which dataset line to stream (default 0)")
    source.add_argument(
        "--camera-index", type=int, default=0, help="camera /dev/videoN for --source camera (default 0)"
    )
    source.add_argument(
        "--monitor-index",
        type=int,
        default=1,
        help="monitor for --source screen, counted from 1 as upstream does; here X11 screen number index - 1 of "
        "$DISPLAY (default 1)",
    )
    source.add_argument(
        "--decode-batch-size",
        type=int,
        default=8,
        help="accepted for upstream command lines; PyAV decodes one frame at a time here, so it changes nothing",
    )
    source.add_argument(
        "--no-realtime-template",
        action="store_false",
        dest="realtime_template",
        help="for an upstream training-record --dataset line (messages + videos[0].segments): stream every segment "
        "timestamp with only the first user turn as the prompt, instead of replaying the assistant turns' <|video|> "
        "frame script with the later user turns between them",
    )
    source.add_argument(
        "--synthetic-duration", type=float, default=10.0, help="seconds of synthetic frames (default 10)"
    )
    source.add_argument(
        "--sample-fps", type=float, default=1.0, help="frames sampled per second of source time (default 1)"
    )
    source.add_argument(
        "--playback-speed",
        type=float,
        default=1.0,
        help="source seconds per wall-clock second; frames go out at sample-fps x playback-speed; "
        "0 = as fast as possible (default 1)",
    )
    source.add_argument(
        "--max-frames", type=int, default=256, help="stop after this many frames; 0 = no limit (default 256)"
    )

    prompts = parser.add_argument_group("prompts and generation")
    prompts.add_argument(
        "--prompt",
        default=None,
        help=f"the first user turn, in the initial prefill before any frame (default {DEFAULT_PROMPT!r}; for a "
        "dataset its first user turn, if any)",
    )
    prompts.add_argument(
        "--prompt-frame-first",
        action="store_true",
        dest="prompt_frame_first",
        help="send --prompt together with the first frame instead of in the initial prefill before any frame",
    )
    prompts.add_argument(
        "--no-prompt-frame-first",
        action="store_false",
        dest="prompt_frame_first",
        help="put --prompt in the initial prefill, before any frame (the default)",
    )
    prompts.add_argument(
        "--prompt-at",
        type=parse_timed_prompt,
        action="append",
        default=[],
        metavar="SECONDS=TEXT",
        help="ask TEXT at SECONDS of source time (repeatable)",
    )
    prompts.add_argument(
        "--subtitle-at",
        type=parse_timed_prompt,
        action="append",
        default=[],
        metavar="SECONDS=TEXT",
        help="a subtitle: TEXT asked together with the first frame at or after SECONDS (repeatable)",
    )
    prompts.add_argument(
        "--system-prompt",
        default=None,
        help="system prompt (default: the dataset entry's, else the checkpoint's default realtime system prompt)",
    )
    prompts.add_argument(
        "--frame-queue-size",
        type=int,
        default=256,
        help="frames waiting for the stream at most; a full queue drops its oldest frame without a prompt "
        "(default 256)",
    )
    prompts.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="tokens one turn may generate before the stream waits for input as after <|silence|> (default 256; "
        "upstream 4096)",
    )
    prompts.add_argument(
        "--max-tokens-per-second",
        type=float,
        default=0.0,
        help="cap on generated tokens per second (the session's max_tokens_per_turn); 0 = uncapped (default 0; "
        "upstream 12)",
    )
    prompts.add_argument(
        "--frame-window-seconds",
        type=float,
        default=None,
        help="drop frames more than this many seconds behind the newest one from the model's vision cache "
        "(default: keep every frame)",
    )
    prompts.add_argument(
        "--drain-seconds",
        type=float,
        default=15.0,
        help="after the source ends, keep reading output until this many seconds pass without any, or until the "
        "stream waits for input (default 15)",
    )
    prompts.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    prompts.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    prompts.add_argument("--top-k", type=int, default=20, help="sampling top-k (default 20)")
    prompts.add_argument("--top-p", type=float, default=0.8, help="sampling top-p (default 0.8)")
    prompts.add_argument("--repetition-penalty", type=float, default=1.0, help="repetition penalty (default 1.0)")
    prompts.add_argument(
        "--dry-run", action="store_true", help="list the frames and prompts the source produces, load no model"
    )
    output = parser.add_argument_group("output (CLI mode)")
    output.add_argument("--show-silence", action="store_true", help="print [silence] where the model chose silence")
    output.add_argument(
        "--raw-output",
        action="store_true",
        help="print every output piece as the model streams it, control tokens (<|round_start|>, <|silence|>) too",
    )

    service = parser.add_argument_group("service")
    service.add_argument("--serve", action="store_true", help="run the WebSocket service instead of streaming a source")
    service.add_argument("--host", default="127.0.0.1", help="service address (default 127.0.0.1)")
    service.add_argument("--port", type=int, default=8000, help="service port (default 8000)")
    service.add_argument(
        "--max-frame-bytes", type=int, default=20 * 1024 * 1024, help="largest accepted frame image (default 20 MiB)"
    )
    service.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"key a client must present at the WebSocket handshake (Authorization: Bearer KEY, or from a browser the "
        f"subprotocol openai-insecure-api-key.KEY); a refused handshake gets HTTP 401 (default: ${API_KEY_ENV}, "
        "else no key)",
    )
    service.add_argument(
        "--media-root",
        type=Path,
        default=None,
        help="folder whose video files clients may stream with a 'video' message (paths relative to it or inside "
        "it); default: none, 'video' messages are refused",
    )
    return parser


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.source is None:
        args.source = (
            "dataset" if args.dataset else "video" if args.video else "frames" if args.frames_dir else "synthetic"
        )
    if args.source == "video" and args.video is None:
        parser.error("--source video needs --video PATH")
    if args.source == "frames" and args.frames_dir is None:
        parser.error("--source frames needs --frames-dir DIR")
    if args.source == "dataset" and args.dataset is None:
        parser.error("--source dataset needs --dataset PATH")
    if args.sample_fps <= 0:
        parser.error("--sample-fps must be positive")
    if args.playback_speed < 0:
        parser.error("--playback-speed must be >= 0 (0 disables pacing)")
    for name in ("max_frames", "dataset_index", "camera_index", "monitor_index"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.max_tokens_per_second < 0:
        parser.error("--max-tokens-per-second must be >= 0 (0 = uncapped)")
    if args.frame_window_seconds is not None and args.frame_window_seconds <= 0:
        parser.error("--frame-window-seconds must be positive")
    for name in ("frame_queue_size", "max_new_tokens", "max_frame_bytes", "synthetic_duration", "drain_seconds"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.checkpoint is None and not args.dry_run:
        parser.error("--checkpoint is required (except with --dry-run)")
    if args.serve and args.dry_run:
        parser.error("--serve and --dry-run exclude each other")
    if args.media_root is not None and not args.media_root.is_dir():
        parser.error(f"--media-root {args.media_root} is not a folder")
    return args


def open_source(args: argparse.Namespace) -> tuple[Iterable, dict]:
    """(timestamp-ordered events, settings the source brings: system_prompt, live)."""
    timed_prompts = sorted(args.prompt_at, key=lambda p: p.timestamp)
    if args.source == "dataset":
        entry = video_sources.load_dataset_entry(args.dataset, args.dataset_index, args.realtime_template)
        frames = video_sources.attach_subtitles(
            video_sources.dataset_events(entry, args.sample_fps, args.max_frames), args.subtitle_at
        )
        return video_sources.merge_by_time(frames, timed_prompts), {
            "system_prompt": entry.get("system_prompt"),
            "prompt": entry.get("initial_prompt"),
            "live": False,
        }
    if args.source == "video":
        frames = video_sources.video_file_frames(args.video, args.sample_fps, args.max_frames)
    elif args.source == "frames":
        frames = video_sources.frame_folder_frames(args.frames_dir, args.sample_fps, args.max_frames)
    elif args.source == "synthetic":
        frames = video_sources.synthetic_frames(args.synthetic_duration, args.sample_fps, args.max_frames)
    elif args.source == "camera":
        frames = video_sources.camera_frames(args.camera_index, args.sample_fps, args.max_frames)
    else:
        frames = video_sources.screen_frames(args.sample_fps, args.max_frames, args.monitor_index)
    frames = video_sources.attach_subtitles(frames, args.subtitle_at)
    return video_sources.merge_by_time(frames, timed_prompts), {
        "system_prompt": None,
        "live": args.source in ("camera", "screen"),
    }


def dry_run(events: Iterable, playback_speed: float) -> None:
    started = time.monotonic()
    frames = prompts = 0
    for event in video_sources.paced(events, playback_speed):
        if isinstance(event, FrameEvent):
            frames += 1
            print(f"frame  t={event.timestamp:7.2f}s  {event.image.width}x{event.image.height}")
        else:
            prompts += 1
            print(f"prompt t={event.timestamp:7.2f}s  {event.text}")
    elapsed = time.monotonic() - started
    print(f"{frames} frames, {prompts} prompts in {elapsed:.2f}s ({frames / max(elapsed, 1e-9):.1f} frames/s)")


def print_outputs(session: Any, out, raw_output: bool, show_silence: bool, last_output: list) -> None:
    """Write the session's pieces to ``out`` as they arrive (see render_piece); stream errors go to the log.
    ``last_output[0]`` is set to the monotonic time of each piece (the drain clock)."""
    while (chunk := next_session_output(session, 0.1)) is not SESSION_ENDED:
        if chunk is None:
            continue
        last_output[0] = time.monotonic()
        if chunk.startswith(ERROR_PREFIX):
            logger.error("stream error: %s", chunk[len(ERROR_PREFIX) :])
            continue
        out.write(render_piece(chunk, raw_output, show_silence))
        out.flush()
    out.write("\n")
    out.flush()


def wait_for_drain(session: Any, drain_seconds: float, last_output: list) -> None:
    """After the source ends: until ``drain_seconds`` pass without output, or (when the session can say so) the
    stream has drained its input and waits for more."""
    waits = getattr(session, "wait_until_parked", None)
    while session.active and time.monotonic() - last_output[0] < drain_seconds:
        if waits is not None and waits(0.2):
            return
        if waits is None:
            time.sleep(0.1)


def stream_source(args: argparse.Namespace) -> int:
    events, settings = open_source(args)  # fails fast (missing file, no camera) before the model loads
    playback_speed = 0.0 if settings["live"] else args.playback_speed  # live sources pace themselves
    if args.dry_run:
        dry_run(events, playback_speed)
        return 0
    model, processor, metadata = load_realtime_model(args)
    prompt = args.prompt if args.prompt is not None else settings.get("prompt") or ""
    if args.prompt is None and args.source != "dataset":
        prompt = DEFAULT_PROMPT
    system_prompt = args.system_prompt if args.system_prompt is not None else settings["system_prompt"]
    if args.prompt_frame_first and prompt:
        events = video_sources.attach_subtitles(events, [PromptEvent(0.0, prompt)])
    session = model.create_realtime_session(
        processor,
        initial_prompt="" if args.prompt_frame_first else prompt,
        system_prompt=system_prompt,
        frame_queue_size=args.frame_queue_size,
        max_tokens_per_turn=args.max_tokens_per_second,
        **generation_kwargs(vars(args)),
    )
    if prompt:  # before the stream starts, so its round comes after the question
        print(f"[t=   0.00s] > {prompt}", flush=True)
    session.start()
    last_output = [time.monotonic()]
    printer = threading.Thread(
        target=print_outputs,
        args=(session, sys.stdout, args.raw_output, args.show_silence, last_output),
        name="print_outputs",
        daemon=True,
    )
    printer.start()

    def announce(event: PromptEvent) -> None:
        print(f"\n[t={event.timestamp:7.2f}s] > {event.text}", flush=True)

    try:
        stats = feed_session(session, events, playback_speed, threading.Event(), on_prompt=announce)
        last_output[0] = max(last_output[0], time.monotonic())
        wait_for_drain(session, args.drain_seconds, last_output)
    finally:
        session.close(30.0)
        printer.join()
    rate = stats["frames_sent"] / max(stats["elapsed_seconds"], 1e-9)
    logger.info(
        "fed %d frames and %d prompts in %.2fs (%.1f frames/s); %d frames dropped from the %d-frame queue",
        stats["frames_sent"],
        stats["prompts_sent"],
        stats["elapsed_seconds"],
        rate,
        stats["frames_dropped"],
        args.frame_queue_size,
    )
    return 0


# ----------------------------------------------------------------------------------------- service


class ClientError(ValueError):
    """A client message the session cannot act on; reported as an ``error`` message, the session goes on."""


def decode_frame(data: bytes, max_bytes: int) -> Image.Image:
    if len(data) > max_bytes:
        raise ClientError(f"frame of {len(data)} bytes exceeds the {max_bytes}-byte limit (--max-frame-bytes)")
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in ACCEPTED_IMAGE_FORMATS:
                raise ClientError(f"frame must be JPEG or PNG, got {image.format}")
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as error:
        raise ClientError(f"cannot decode frame image: {error}") from error


def media_path(requested: str, media_root: Optional[Path]) -> Path:
    """The server-side file a ``video`` message names, which must lie under ``media_root`` once symlinks and
    ``..`` are resolved; without a media root no path is served."""
    if media_root is None:
        raise ClientError(
            "server-side video is disabled: start the service with --media-root DIR to stream files under DIR"
        )
    if not requested:
        raise ClientError("'path' must name a video file under the media root")
    root = media_root.resolve()
    path = (root / requested).resolve()  # an absolute `requested` replaces root here and is checked all the same
    if not path.is_relative_to(root):
        raise ClientError(f"video path {requested!r} is outside the media root")
    return path


def _number(payload: dict, key: str, default: Any, kind: type, minimum: float) -> Any:
    value = payload.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and value != int(value))
        or value < minimum
    ):
        raise ClientError(f"{key!r} must be a number >= {minimum}, got {value!r}")
    return kind(value)


def _text(payload: dict, key: str, default: str = "") -> str:
    value = payload.get(key, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ClientError(f"{key!r} must be a string, got {type(value).__name__}")
    return value


class RealtimeConnection:
    """One WebSocket client driving one realtime session (see the module docstring for the protocol)."""

    def __init__(self, websocket: Any, model: Any, processor: Any, defaults: argparse.Namespace):
        self.websocket, self.model, self.processor, self.defaults = websocket, model, processor, defaults
        self.send_lock = asyncio.Lock()
        self.session: Any = None
        self.pump: Optional[asyncio.Task] = None
        self.frame_header: Optional[dict] = None
        self.last_timestamp: Optional[float] = None
        self.video_task: Optional[asyncio.Task] = None
        self.video_stop = threading.Event()
        self.ended = asyncio.Event()  # set once session_end or a fatal error has been sent

    async def send(self, message: dict) -> None:
        async with self.send_lock:
            await self.websocket.send_json(message)

    async def run(self) -> None:
        """Serve client messages until ``stop``, a disconnect, or the end of the session (session_end or a fatal
        error sent): then the session is released and the socket closed, so the next client is served at once."""
        try:
            while not self.ended.is_set():
                message = await self.next_message()
                if message is None or message["type"] == "websocket.disconnect":
                    return
                try:
                    if await self.handle(message) == "stop":
                        return
                except ClientError as error:
                    await self.send({"type": "error", "message": str(error)})
        finally:
            await self.shutdown()
            if self.ended.is_set():
                with contextlib.suppress(RuntimeError, OSError):
                    await self.websocket.close(code=1000)

    async def next_message(self) -> Optional[dict]:
        """The next client message, or None once the session has ended first (or the client left before ``start``).
        Before the session starts, messages are read as text (``receive_text``), as upstream's service reads its
        ``start``; a binary message there gets the error of bytes without a frame header."""
        if self.session is None:
            try:
                return {"type": "websocket.receive", "text": await self.websocket.receive_text()}
            except WebSocketDisconnect:
                return None
            except KeyError:  # Starlette's receive_text on a binary message
                return {"type": "websocket.receive", "bytes": b""}
        receiving = asyncio.ensure_future(self.websocket.receive())
        ending = asyncio.ensure_future(self.ended.wait())
        done, _ = await asyncio.wait({receiving, ending}, return_when=asyncio.FIRST_COMPLETED)
        if receiving in done:
            ending.cancel()
            return receiving.result()
        receiving.cancel()
        await asyncio.gather(receiving, return_exceptions=True)
        return None

    async def handle(self, message: dict) -> Optional[str]:
        if message.get("bytes") is not None:
            await self.on_frame_bytes(message["bytes"])
            return None
        if self.frame_header is not None:
            self.frame_header = None
            await self.send(
                {"type": "error", "message": "frame header was not followed by binary image bytes; frame dropped"}
            )
        try:
            payload = json.loads(message.get("text") or "")
        except json.JSONDecodeError as error:
            raise ClientError(f"message is not JSON: {error}") from error
        if not isinstance(payload, dict) or not isinstance(payload.get("type"), str):
            raise ClientError("message must be a JSON object with a string 'type'")
        kind = payload["type"]
        if kind == "ping":
            await self.send({"type": "pong"})
            return None
        if kind == "start":
            await self.on_start(payload)
            return None
        handlers = {
            "prompt": self.on_prompt,
            "frame": self.on_frame_header,
            "video": self.on_video,
            "stop_video": self.on_stop_video,
            "stop": self.on_stop,
        }
        if kind not in handlers:
            raise ClientError(f"unknown message type {kind!r}; expected one of start, ping, {', '.join(handlers)}")
        if self.session is None:
            raise ClientError(f"send 'start' before {kind!r}")
        return await handlers[kind](payload)

    async def on_start(self, payload: dict) -> None:
        if self.session is not None:
            raise ClientError("the session has already started")
        d = self.defaults
        generate = sampling_kwargs(
            {
                "do_sample": bool(payload.get("do_sample", d.do_sample)),
                "temperature": _number(payload, "temperature", d.temperature, float, 0.0),
                "top_k": _number(payload, "top_k", d.top_k, int, 0),
                "top_p": _number(payload, "top_p", d.top_p, float, 0.0),
                "repetition_penalty": _number(payload, "repetition_penalty", d.repetition_penalty, float, 0.0),
            }
        )
        generate["max_new_tokens"] = _number(payload, "max_new_tokens", d.max_new_tokens, int, 1)
        # getattr: upstream's service builds its defaults without this newer attribute
        window = payload.get("frame_window_seconds", getattr(d, "frame_window_seconds", None))
        if window is not None:
            generate["frame_window_seconds"] = _number(payload, "frame_window_seconds", window, float, 1e-6)
        self.session = self.model.create_realtime_session(
            self.processor,
            initial_prompt=_text(payload, "prompt", d.prompt or ""),
            system_prompt=_text(payload, "system_prompt", d.system_prompt or "") or None,
            frame_queue_size=_number(payload, "frame_queue_size", d.frame_queue_size, int, 1),
            max_tokens_per_turn=_number(payload, "max_tokens_per_second", d.max_tokens_per_second, float, 0.0),
            **generate,
        )
        self.session.start()
        await self.send({"type": "ready"})
        self.pump = asyncio.create_task(self.pump_outputs())

    async def on_prompt(self, payload: dict) -> None:
        text = _text(payload, "text")
        if not text.strip():
            raise ClientError("prompt text is empty")
        try:
            await asyncio.to_thread(self.session.push_prompt, text)
        except ValueError as error:
            raise ClientError(str(error)) from error
        await self.send({"type": "prompt_ack", "text": text})

    async def on_frame_header(self, payload: dict) -> None:
        if self.video_task is not None:
            raise ClientError("a server-side video is playing; send stop_video before sending frames")
        timestamp = _number(payload, "timestamp", None, float, 0.0)
        if self.last_timestamp is not None and timestamp < self.last_timestamp:
            raise ClientError(f"frame timestamp {timestamp} is before the previous frame's {self.last_timestamp}")
        prompt = payload.get("prompt", payload.get("text"))  # upstream accepts either field
        if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
            raise ClientError("a frame's prompt must be a non-empty string when given")
        self.frame_header = {"timestamp": timestamp, "prompt": prompt}

    async def on_frame_bytes(self, data: bytes) -> None:
        header, self.frame_header = self.frame_header, None
        if header is None:
            raise ClientError("binary message without a preceding frame header")
        image = decode_frame(data, self.defaults.max_frame_bytes)
        try:
            dropped = await asyncio.to_thread(push_frame, self.session, image, header["timestamp"], header["prompt"])
        except ValueError as error:  # the session refused this frame; the stream goes on
            raise ClientError(str(error)) from error
        self.last_timestamp = header["timestamp"]
        pending = self.session.pending_frames
        ack = {"timestamp": header["timestamp"], "dropped_oldest": dropped, "pending_frames": pending}
        await self.send({"type": "frame_ack", **ack})

    async def on_video(self, payload: dict) -> None:
        if self.video_task is not None:
            raise ClientError("a video is already playing; send stop_video first")
        requested = _text(payload, "path")
        path = media_path(requested, self.defaults.media_root)
        sample_fps = _number(payload, "sample_fps", self.defaults.sample_fps, float, 1e-6)
        playback_speed = _number(payload, "playback_speed", self.defaults.playback_speed, float, 0.0)
        max_frames = _number(payload, "max_frames", self.defaults.max_frames, int, 0)
        try:
            frames = video_sources.video_file_frames(path, sample_fps, max_frames)
        except (FileNotFoundError, ValueError) as error:
            raise ClientError(str(error)) from error
        # Video frames continue the stream's clock after the last frame already in the session.
        offset = 0.0 if self.last_timestamp is None else self.last_timestamp + 1.0 / sample_fps
        self.video_stop.clear()
        await self.send({"type": "video_started", "path": requested})
        self.video_task = asyncio.create_task(self.play_video(frames, playback_speed, offset))

    async def play_video(self, frames: Iterable, playback_speed: float, offset: float) -> None:
        try:
            stats = await asyncio.to_thread(feed_session, self.session, frames, playback_speed, self.video_stop, offset)
        except Exception as error:  # a decode failure mid-file ends this video, not the session
            logger.warning("server-side video failed: %s", error)
            await self.send({"type": "error", "message": f"video failed: {error}"})
            return
        finally:
            self.video_task = None
        if stats["last_timestamp"] is not None:
            self.last_timestamp = stats["last_timestamp"]
        await self.send(
            {"type": "video_end", "frames_sent": stats["frames_sent"], "frames_dropped": stats["frames_dropped"]}
        )

    async def on_stop_video(self, payload: dict) -> None:
        await self.finish_video()
        await self.send({"type": "stop_video_ack"})

    async def finish_video(self) -> None:
        task = self.video_task
        if task is not None:
            self.video_stop.set()
            await task

    async def on_stop(self, payload: dict) -> str:
        await self.send({"type": "stopping"})
        await self.finish_video()
        await asyncio.to_thread(self.session.close, SESSION_CLOSE_SECONDS)
        await self.pump  # drains every output, then sends session_end (or error) and marks the end
        return "stop"

    async def pump_outputs(self) -> None:
        """Forward model text until the session ends; nothing is left behind before session_end/error."""
        while True:
            try:
                chunk = await asyncio.to_thread(next_session_output, self.session, 0.1)
            except Exception as error:
                logger.exception("realtime session failed")
                await self.send({"type": "error", "message": str(error)})
                self.ended.set()
                return
            if chunk is SESSION_ENDED:
                await self.send({"type": "session_end"})
                self.ended.set()
                return
            if chunk is None:
                continue
            if chunk.startswith(ERROR_PREFIX):  # reported; the session ends by itself if it cannot go on
                await self.send({"type": "error", "message": chunk[len(ERROR_PREFIX) :]})
            else:
                await self.send({"type": "output", "text": chunk})

    async def shutdown(self) -> None:
        """Release the session when the client leaves (or after stop): no thread keeps generating for nobody.
        A client gone without ``stop`` closes the stream after its current step."""
        if self.pump is not None and not self.pump.done():
            self.pump.cancel()
        if self.pump is not None:
            try:
                await self.pump
            except asyncio.CancelledError:
                pass
            except Exception as error:  # the client left while output was being sent
                logger.info("output stream ended with the connection: %s", error)
        if self.session is None:
            return
        self.video_stop.set()
        if self.video_task is not None:
            await asyncio.gather(self.video_task, return_exceptions=True)
        if self.session.active:
            # Its own thread, not asyncio.to_thread: this handler may be cancelled here (server shutdown), and a
            # cancelled to_thread call that has not started yet never runs, which would leave the session generating.
            releaser = threading.Thread(
                target=self.session.close, args=(SESSION_CLOSE_SECONDS,), name="release_realtime_session", daemon=True
            )
            releaser.start()
            await asyncio.to_thread(releaser.join)


def create_service_app(
    model: Any, processor: Any, defaults: argparse.Namespace, metadata: Optional[dict] = None
) -> FastAPI:
    """The FastAPI app: GET /health and the one-session-at-a-time WebSocket at /v1/realtime."""
    app = FastAPI(title="MOSS-VL realtime")
    app.state.busy = False

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "busy": app.state.busy, **(metadata or {})}

    api_key = getattr(defaults, "api_key", None)  # upstream's settings namespace has no key

    @app.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket) -> None:
        # Accept before any other refusal: a refusal before the handshake would reach clients as HTTP 403.
        if api_key:
            presented = presented_key(websocket)
            if presented is None or not secrets.compare_digest(presented, api_key):
                await refuse_handshake(websocket, 401)
                return
            offered = websocket.scope.get("subprotocols") or ()
            await websocket.accept(subprotocol=REALTIME_SUBPROTOCOL if REALTIME_SUBPROTOCOL in offered else None)
        else:  # no key: the handshake is not read at all, as upstream's service (its test sockets have no headers)
            await websocket.accept()
        if app.state.busy:
            await websocket.close(code=1013, reason="another realtime session is active; try again later")
            return
        app.state.busy = True
        try:
            await RealtimeConnection(websocket, model, processor, defaults).run()
        finally:
            app.state.busy = False

    return app


def serve(args: argparse.Namespace) -> int:
    import importlib.util

    import uvicorn

    if not any(importlib.util.find_spec(name) for name in ("websockets", "wsproto")):
        raise SystemExit("--serve needs a WebSocket library for uvicorn: pip install websockets")
    model, processor, metadata = load_realtime_model(args)
    app = create_service_app(model, processor, args, metadata)
    logger.info("serving ws://%s:%d/v1/realtime and http://%s:%d/health", args.host, args.port, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        return serve(args) if args.serve else stream_source(args)
    except (
        checkpoint_code.CheckpointCodeUnloadable,
        video_sources.SourceUnavailable,
        FileNotFoundError,
        ValueError,
    ) as error:
        logger.error("%s", error)
        return 2


if __name__ == "__main__":
    sys.exit(main())
