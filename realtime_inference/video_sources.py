"""Frame and prompt sources of the realtime runner: video files, synthetic frames, a JSONL dataset, camera, screen.

Every source yields events in timestamp order: ``FrameEvent`` (a PIL image and its time in seconds since the
start of the stream, optionally with a prompt asked at that frame) and ``PromptEvent`` (a prompt asked at a
time). ``paced`` releases them on the wall clock; ``merge_by_time`` interleaves scripted prompts.

Dataset (JSONL, one stream per line; media paths relative to the dataset file)::

    {"id": "dot", "video": "clip.mp4", "system_prompt": "...",
     "prompts": [{"timestamp": 0.0, "text": "What do you see?"}, {"timestamp": 2.5, "text": "And now?"}]}
    {"id": "stills", "frames": [{"timestamp": 0.0, "image": "a.png"}, {"timestamp": 1.0, "image": "b.png"}],
     "prompts": [{"timestamp": 1.0, "text": "What changed?"}]}

A prompt at time t is asked after every frame stamped at or before t, so it sees those frames.
Camera (``/dev/videoN`` through PyAV's v4l2 input) and screen (X11 through PyAV's x11grab) exist only where
the machine has them; otherwise ``SourceUnavailable`` says what is missing.
"""

from __future__ import annotations

import heapq
import json
import os
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
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"video file not found: {path}")
    try:
        container = av.open(str(path))
    except av.error.FFmpegError as error:
        raise ValueError(f"cannot open video {path}: {error}") from error
    if not container.streams.video:
        container.close()
        raise ValueError(f"no video stream in {path}")
    return _closing(container, _sampled(_decoded(container), sample_fps, max_frames))


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


def load_dataset_entry(path: Union[str, Path], index: int) -> dict:
    """Line ``index`` (0-based, blank lines skipped) of a JSONL dataset, with media paths made absolute."""
    path = Path(path)
    entries = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not 0 <= index < len(entries):
        raise ValueError(f"{path} has {len(entries)} entries; --dataset-index {index} is out of range")
    entry = dict(entries[index])
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
    """Frames (the entry's video sampled at ``sample_fps``, or its listed still frames) merged with its prompts."""
    if "video" in entry:
        frames = video_file_frames(entry["video"], sample_fps, max_frames)
    else:
        stills = entry["frames"][:max_frames] if max_frames else entry["frames"]
        frames = (FrameEvent(float(f["timestamp"]), _open_image(f["image"])) for f in stills)
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


def attach_prompt_to_first_frame(events: Iterable[Event], prompt: str) -> Iterator[Event]:
    """The same events with ``prompt`` asked on the first frame (the runner's --prompt-frame-first)."""
    attached = False
    for event in events:
        if not attached and isinstance(event, FrameEvent):
            attached = True
            event = FrameEvent(event.timestamp, event.image, prompt)
        yield event


def paced(events: Iterable[Event], playback_speed: float, clock=time.monotonic, sleep=time.sleep) -> Iterator[Event]:
    """Release each event at ``timestamp / playback_speed`` seconds after the first; 0 disables pacing."""
    started = clock()
    for event in events:
        if playback_speed > 0:
            delay = started + event.timestamp / playback_speed - clock()
            if delay > 0:
                sleep(delay)
        yield event
