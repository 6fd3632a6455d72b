"""Frame and prompt sources of the realtime runner: video files, synthetic frames, a JSONL dataset, camera, screen.

Every source yields events in timestamp order: ``FrameEvent`` (a PIL image and its time in seconds since the
start of the stream, optionally with a prompt asked at that frame) and ``PromptEvent`` (a prompt asked at a
time). ``paced`` releases them on the wall clock; ``merge_by_time`` interleaves scripted prompts.

Dataset (JSONL, one stream per line; media paths relative to the dataset file)::

    {"id": "dot", "video": "clip.mp4", "system_prompt": "...",
     "prompts": [{"timestamp": 0.0, "text": "What do you see?"}, {"timestamp": 2.5, "text": "And now?"}]}
    {"id": "stills", "frames": [{"timestamp": 0.0, "image": "a.png"}, {"timestamp": 1.0, "image": "b.png"}],
     "prompts": [{"timestamp": 1.0, "text": "What changed?"}]}

A still frame may carry a ``prompt`` (a subtitle: asked with that frame). A prompt at time t is asked after every
frame stamped at or before t, so it sees those frames.

Upstream's training records are read too (one JSON object per line with ``messages`` and ``videos``: ``videos[0]``
a path or ``{video_path, segments}``, each segment a timestamp or a list starting with one). The first system
and user turns become the system prompt and the initial prompt (vision placeholders stripped). With the realtime
template (the default) the assistant turns' ``<|video|>`` placeholders say how many frames stream before each later
user turn, which is asked after them; without it (``--no-realtime-template``) every segment timestamp streams and
only the first user turn is asked.
Camera (``/dev/videoN`` through PyAV's v4l2 input) and screen (X11 through PyAV's x11grab) exist only where
the machine has them; otherwise ``SourceUnavailable`` says what is missing.
"""

from __future__ import annotations

import heapq
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

import av
from PIL import Image, ImageDraw


@dataclass(frozen=True)
class FrameEvent:
    timestamp: float
    image: Image.Image
    prompt: Optional[str] = None


@dataclass(frozen=True)
class PromptEvent:
    timestamp: float
    text: str


Event = Union[FrameEvent, PromptEvent]


class SourceUnavailable(RuntimeError):
    """A camera/screen/video source this machine cannot provide; the message says what is missing."""


def _sampled(frames: Iterable[tuple[float, Image.Image]], sample_fps: float, max_frames: int) -> Iterator[FrameEvent]:
    """Keep the first frame at or after each multiple of 1/sample_fps; stop after max_frames (0 = no limit)."""
    next_due, sent = 0.0, 0
    for timestamp, image in frames:
        if timestamp + 1e-6 < next_due:
            continue
        yield FrameEvent(timestamp, image)
        sent += 1
        if max_frames and sent >= max_frames:
            return
        next_due = (int(timestamp * sample_fps + 1e-6) + 1) / sample_fps


def _decoded(container: av.container.InputContainer) -> Iterator[tuple[float, Image.Image]]:
    stream = container.streams.video[0]
    rate = float(stream.average_rate or 25)
    for index, frame in enumerate(container.decode(stream)):
        timestamp = float(frame.time) if frame.time is not None else index / rate
        yield timestamp, frame.to_image().convert("RGB")


def video_file_frames(path: Union[str, Path], sample_fps: float, max_frames: int = 0) -> Iterator[FrameEvent]:
    """Frames of a video file sampled at ``sample_fps``, stamped with their time in the video.

    Opens the file at once, so a missing or unreadable video fails here rather than at the first frame."""
    container = _open_video(Path(path))
    return _closing(container, _sampled(_decoded(container), sample_fps, max_frames))


def _open_video(path: Path) -> av.container.InputContainer:
    if not path.is_file():
        raise FileNotFoundError(f"video file not found: {path}")
    try:
        container = av.open(str(path))
    except av.error.FFmpegError as error:
        raise ValueError(f"cannot open video {path}: {error}") from error
    if not container.streams.video:
        container.close()
        raise ValueError(f"no video stream in {path}")
    return container


def video_frames_at(path: Union[str, Path], times: list[float]) -> Iterator[FrameEvent]:
    """The frame shown at each of ``times`` (ascending seconds): the last decoded frame stamped at or before it."""
    container = _open_video(Path(path))

    def frames() -> Iterator[FrameEvent]:
        pending, shown = list(times), None
        for timestamp, image in _decoded(container):
            while pending and shown is not None and timestamp > pending[0] + 1e-6:
                yield FrameEvent(pending.pop(0), shown)
            shown = image
            if not pending:
                return
        for target in pending:
            if shown is not None:
                yield FrameEvent(target, shown)

    return _closing(container, frames())


def _closing(container: av.container.InputContainer, frames: Iterator[FrameEvent]) -> Iterator[FrameEvent]:
    with container:
        yield from frames


def synthetic_frame(index: int, timestamp: float, size: tuple[int, int] = (128, 96)) -> Image.Image:
    """A frame that differs visibly from its neighbours: a square sliding right, the time written on it."""
    width, height = size
    image = Image.new("RGB", size, (20 + 20 * (index % 10), 40, 90))
    draw = ImageDraw.Draw(image)
    x = (index * 9) % max(width - 24, 1)
    draw.rectangle((x, height // 2 - 12, x + 24, height // 2 + 12), fill=(250, 200, 30))
    draw.text((4, 4), f"{timestamp:.1f}s", fill="white")
    return image


def synthetic_frames(duration: float, sample_fps: float, max_frames: int = 0) -> Iterator[FrameEvent]:
    count = int(round(duration * sample_fps))
    if max_frames:
        count = min(count, max_frames)
    for index in range(count):
        timestamp = index / sample_fps
        yield FrameEvent(timestamp, synthetic_frame(index, timestamp))


def _live_frames(container: av.container.InputContainer) -> Iterator[tuple[float, Image.Image]]:
    """Frames of a live input stamped with wall-clock seconds since the first one."""
    started = None
    for frame in container.decode(video=0):
        now = time.monotonic()
        started = now if started is None else started
        yield now - started, frame.to_image().convert("RGB")


def camera_frames(index: int, sample_fps: float, max_frames: int = 0) -> Iterator[FrameEvent]:
    device = Path(f"/dev/video{index}")
    if not device.exists():
        present = sorted(str(p) for p in Path("/dev").glob("video*"))
        raise SourceUnavailable(f"no camera at {device}; video devices on this machine: {present or 'none'}")
    try:
        container = av.open(str(device), format="v4l2")
    except av.error.FFmpegError as error:
        raise SourceUnavailable(f"cannot open camera {device}: {error}") from error
    return _closing(container, _sampled(_live_frames(container), sample_fps, max_frames))


def screen_frames(sample_fps: float, max_frames: int = 0, monitor_index: int = 1) -> Iterator[FrameEvent]:
    """The X11 display $DISPLAY; monitor_index counts screens from 1 (screen number monitor_index - 1)."""
    display = os.environ.get("DISPLAY")
    if display and monitor_index > 1:
        display = f"{display.split('.')[0]}.{monitor_index - 1}"
    if not display:
        raise SourceUnavailable("screen capture needs an X11 display, and DISPLAY is not set on this machine")
    try:
        container = av.open(display, format="x11grab", options={"framerate": str(max(sample_fps, 1.0))})
    except av.error.FFmpegError as error:
        raise SourceUnavailable(f"cannot capture X11 display {display}: {error}") from error
    return _closing(container, _sampled(_live_frames(container), sample_fps, max_frames))


FRAME_SUFFIXES = (".png", ".jpg", ".jpeg")
VISION_PLACEHOLDERS = re.compile(r"<\|(?:vision_start|vision_end|image_pad|video_pad|image|video)\|>")


def _message_text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(str(part.get("text", "")) for part in content or [] if isinstance(part, dict))


def _prompt_text(content) -> str:
    return VISION_PLACEHOLDERS.sub("", _message_text(content)).strip()


def training_record_entry(record: dict, base: Path, realtime_template: bool = True) -> dict:
    """An upstream training record (see the module docstring) as a dataset entry of this module's form: the
    video, the frame timestamps to stream (``frame_times``), the initial prompt and the later prompts."""
    videos = record.get("videos") or []
    if not videos:
        raise ValueError("a training record needs videos[0] with its segments")
    video = videos[0] if isinstance(videos[0], dict) else {"video_path": videos[0]}
    location = video.get("video_path") or video.get("video") or video.get("path")
    if not location:
        raise ValueError("videos[0] names no video_path")
    segments = video.get("segments") or video.get("segment") or []
    times = [float(segment[0] if isinstance(segment, (list, tuple)) else segment) for segment in segments]
    if not times:
        raise ValueError("videos[0] has no segment timestamps")
    messages = [m for m in record.get("messages") or [] if isinstance(m, dict)]
    system = next((_message_text(m["content"]) for m in messages if m.get("role") == "system"), None)
    users = [_prompt_text(m.get("content")) for m in messages if m.get("role") == "user"]
    prompts, frames = [], len(times)
    if realtime_template:
        frames, seen_user = 0, False
        for message in messages:
            text = _message_text(message.get("content"))
            if message.get("role") == "assistant":
                frames = min(frames + text.count("<|video|>"), len(times))
            elif message.get("role") == "user":
                if seen_user and _prompt_text(text):
                    at = times[frames - 1] if frames else 0.0
                    prompts.append({"timestamp": at, "text": _prompt_text(text)})
                seen_user = True
        if not frames:
            raise ValueError("the record's assistant turns hold no <|video|> frame placeholders")
    return {
        "video": str(base / location),
        "frame_times": times[:frames],
        "system_prompt": system,
        "initial_prompt": users[0] if users else "",
        "prompts": prompts,
    }


def load_dataset_entry(path: Union[str, Path], index: int, realtime_template: bool = True) -> dict:
    """Line ``index`` (0-based, blank lines skipped) of a JSONL dataset, with media paths made absolute."""
    path = Path(path)
    entries = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not 0 <= index < len(entries):
        raise ValueError(f"{path} has {len(entries)} entries; --dataset-index {index} is out of range")
    entry = dict(entries[index])
    if "messages" in entry:
        return training_record_entry(entry, path.resolve().parent, realtime_template)
    if ("video" in entry) == ("frames" in entry):
        raise ValueError(f"{path} entry {index}: give exactly one of 'video' or 'frames'")
    base = path.resolve().parent
    if "video" in entry:
        entry["video"] = str(base / entry["video"])
    else:
        entry["frames"] = [{**f, "image": str(base / f["image"])} for f in entry["frames"]]
    entry["prompts"] = sorted(entry.get("prompts") or [], key=lambda p: float(p["timestamp"]))
    return entry


def dataset_events(entry: dict, sample_fps: float, max_frames: int = 0) -> Iterator[Event]:
    """Frames (the entry's video sampled at ``sample_fps`` or at its ``frame_times``, or its listed still frames)
    merged with its prompts."""
    if "frame_times" in entry:
        times = entry["frame_times"][:max_frames] if max_frames else entry["frame_times"]
        frames = video_frames_at(entry["video"], times)
    elif "video" in entry:
        frames = video_file_frames(entry["video"], sample_fps, max_frames)
    else:
        stills = entry["frames"][:max_frames] if max_frames else entry["frames"]
        frames = (FrameEvent(float(f["timestamp"]), _open_image(f["image"]), f.get("prompt")) for f in stills)
    prompts = [PromptEvent(float(p["timestamp"]), p["text"]) for p in entry["prompts"]]
    return merge_by_time(frames, prompts)


def _open_image(path: str) -> Image.Image:
    if not Path(path).is_file():
        raise FileNotFoundError(f"frame image not found: {path}")
    with Image.open(path) as image:
        return image.convert("RGB")


def merge_by_time(frames: Iterable[FrameEvent], prompts: Iterable[PromptEvent]) -> Iterator[Event]:
    """One timestamp-ordered stream; on equal times the frame comes first so the prompt can see it."""
    keyed_frames = ((event.timestamp, 0, order, event) for order, event in enumerate(frames))
    keyed_prompts = ((event.timestamp, 1, order, event) for order, event in enumerate(prompts))
    for _, _, _, event in heapq.merge(keyed_frames, keyed_prompts, key=lambda item: item[:3]):
        yield event


def attach_subtitles(events: Iterable[Event], subtitles: Iterable[PromptEvent]) -> Iterator[Event]:
    """The same events with each subtitle asked on the first frame stamped at or after its time (a frame's own
    prompt comes first); subtitles after the last frame are dropped."""
    pending = sorted(subtitles, key=lambda subtitle: subtitle.timestamp)
    for event in events:
        if isinstance(event, FrameEvent):
            due = [s.text for s in pending if s.timestamp <= event.timestamp + 1e-6]
            if due:
                pending = pending[len(due) :]
                event = FrameEvent(event.timestamp, event.image, " ".join(filter(None, [event.prompt, *due])))
        yield event


def frame_folder_frames(folder: Union[str, Path], sample_fps: float, max_frames: int = 0) -> Iterator[FrameEvent]:
    """The PNG/JPEG images of a folder in name order, frame i stamped i / sample_fps."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"frame folder not found: {folder}")
    paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
    if not paths:
        raise ValueError(f"no .png/.jpg/.jpeg frames in {folder}")
    for index, path in enumerate(paths[:max_frames] if max_frames else paths):
        yield FrameEvent(index / sample_fps, _open_image(str(path)))


def paced(events: Iterable[Event], playback_speed: float, clock=time.monotonic, sleep=time.sleep) -> Iterator[Event]:
    """Release each event at ``timestamp / playback_speed`` seconds after the first; 0 disables pacing."""
    started = clock()
    for event in events:
        if playback_speed > 0:
            delay = started + event.timestamp / playback_speed - clock()
            if delay > 0:
                sleep(delay)
        yield event
