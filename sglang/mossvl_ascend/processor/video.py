"""Videos as the real MOSS-VL video processor samples them, decoded with PyAV (no torchcodec).

Facts followed (the published checkpoint's ``video_processing_moss_vl.py`` and ``processing_moss_vl.py``):
  * a clip's N frames are all counted (decoded), its duration is ``end - begin`` over the frames' presentation
    times (a frame ends at pts + its duration) and its ``average_fps`` is ``N / duration`` (torchcodec's metadata);
  * ``n = ceil(duration * video_fps - 1e-6)``, raised to ``min_frames``, capped by ``max_frames``, by
    ``video_max_pixels // size.shortest_edge`` when a total budget is set, and by N;
  * the frames kept are ``unique(int(linspace(0, N - 1, n)))`` (truncation, not rounding), each stamped
    ``index / average_fps`` seconds and printed with one decimal;
  * several videos of one call share ``max_frames`` by duration (one each first, the rest by largest remainder);
  * ``{"video_path", "segments"}`` gives one video per segment: ``[t]`` is the frame shown at t, ``[start, end)``
    is ``ceil((end - start) * video_fps)`` timestamps ``linspace(start, end, endpoint=False)`` (min/max frames
    weighted by the segment's share of the segments' duration), stamped with those times;
  * sizes: one ``(height, width)`` per video from a 3-D rule over ``frames * height * width`` (below).

Unlike the real processor (torchcodec seeks to the frames it keeps), PyAV decodes a file twice: once for the frames'
times, once keeping only the sampled frames, so memory holds the sampled frames, never the whole video. A file with
more frames than ``max_source_frames``, or frames larger than ``max_frame_pixels``, is refused before its frames are
kept (a server must not spend hours decoding one request).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

# A torchcodec request must be strictly before the content's end; the real code keeps this margin.
END_MARGIN_SECONDS = 1e-6
DEFAULT_VIDEO_SIZE = {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}


@dataclass
class DecodedClip:
    """A video stream's frames: presentation times (s), torchcodec-style metadata, and ``load`` giving the frames at
    sorted distinct indices as (n, 3, H, W) uint8."""

    times: list[float]
    begin: float
    end: float
    load: Callable[[list[int]], torch.Tensor]

    def frames_at(self, indices: Sequence[int]) -> torch.Tensor:
        """The frames at ``indices`` (any order, repeats allowed), each decoded once."""
        distinct = sorted(set(indices))
        frames = self.load(distinct)
        position = {index: row for row, index in enumerate(distinct)}
        return frames[[position[index] for index in indices]]

    @property
    def duration(self) -> float:
        return self.end - self.begin

    @property
    def average_fps(self) -> float:
        return len(self.times) / self.duration if self.duration > 0 else 24.0


@dataclass
class SampledVideo:
    """The frames one video contributes and the seconds printed before each."""

    frames: torch.Tensor
    timestamps: list[float]


def is_frame_list(video: Any) -> bool:
    """Pre-sampled frames: a list of images or ``{"frames": [...], "timestamps": [...]}`` (ours; the real processor
    takes paths and segment dicts only)."""
    return isinstance(video, (list, tuple)) or (isinstance(video, dict) and "frames" in video)


def frame_list_clip(video: Any, fps: float, load_frame) -> tuple[DecodedClip, Optional[list[float]]]:
    """A frame list as a clip of its frames shown 1/fps each, and its given timestamps if any."""
    frames = list(video["frames"] if isinstance(video, dict) else video)
    given = video.get("timestamps") if isinstance(video, dict) else None
    if not frames:
        raise ValueError("a video given as frames has none")
    if given is not None and len(given) != len(frames):
        raise ValueError(f"a video of {len(frames)} frames has {len(given)} timestamps")
    pictures = [load_frame(frame) for frame in frames]
    if len({tuple(p.shape) for p in pictures}) > 1:
        raise ValueError("the frames of one video must have one size")
    times = [i / fps for i in range(len(frames))]
    stacked = torch.stack(pictures)
    clip = DecodedClip(times, 0.0, len(frames) / fps, lambda indices: stacked[indices])
    return clip, None if given is None else [float(t) for t in given]


def video_path_of(video: Any) -> str:
    path = video.get("video_path") if isinstance(video, dict) else video
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"unsupported video input of type {type(video).__name__} (a path or {{'video_path': ...}})")
    path = os.fspath(path)
    return path[len("file://") :] if path.startswith("file://") else path


def decode_clip(path: str, max_source_frames: int, max_frame_pixels: int) -> DecodedClip:
    """The first video stream of a file, RGB: every frame's time now, the frames themselves when sampled."""
    import av

    if not os.path.isfile(path):
        raise FileNotFoundError(f"video file not found: {path}")
    times, ends = [], []
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise ValueError(f"no video stream in {path}")
            stream = container.streams.video[0]
            check_source_size(
                stream.frames,
                stream.codec_context.width,
                stream.codec_context.height,
                max_source_frames,
                max_frame_pixels,
            )
            rate = float(stream.average_rate or 0) or 24.0
            for frame in container.decode(stream):
                start = float(frame.time) if frame.time is not None else len(times) / rate
                length = float(frame.duration * frame.time_base) if frame.duration and frame.time_base else 1 / rate
                times.append(start)
                ends.append(start + length)
                check_source_size(len(times), frame.width, frame.height, max_source_frames, max_frame_pixels)
    except (av.error.FFmpegError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot decode video {path}: {error}") from error
    if not times:
        raise ValueError(f"video {path} has no frames")
    return DecodedClip(times, min(times), max(ends), lambda indices: decode_frames(path, indices))


def check_source_size(frames: int, width: int, height: int, max_source_frames: int, max_frame_pixels: int) -> None:
    """A video this server will not decode: more frames than ``max_source_frames`` or larger frames than
    ``max_frame_pixels`` (the container's declared counts first, then what decoding finds)."""
    if frames > max_source_frames:
        raise ValueError(
            f"video has {frames} or more frames, over this server's max_source_frames={max_source_frames} "
            "(the frames it will decode for one video)"
        )
    if width * height > max_frame_pixels:
        raise ValueError(
            f"video frames of {width}x{height} = {width * height} pixels are larger than this model's limit "
            f"max_input_pixels={max_frame_pixels} (processor config)"
        )


def decode_frames(path: str, indices: list[int]) -> torch.Tensor:
    """The frames at sorted distinct ``indices`` of the file's first video stream, decoding stopped after the last."""
    import av

    wanted, kept = set(indices), []
    try:
        with av.open(path) as container:
            for index, frame in enumerate(container.decode(container.streams.video[0])):
                if index in wanted:
                    kept.append(torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1))
                if len(kept) == len(wanted):
                    break
    except (av.error.FFmpegError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot decode video {path}: {error}") from error
    if len(kept) != len(wanted):
        raise ValueError(f"video {path} changed while it was read: {len(kept)} of {len(wanted)} frames decoded")
    return torch.stack(kept)


def frame_count(
    clip: DecodedClip, fps: float, min_frames: int, max_frames: int, num_frames: Optional[int] = None
) -> int:
    """How many frames the real processor keeps of a whole clip (``calculate_num_frames``: ``ceil(duration * fps)``,
    or its fixed-count branch's ``num_frames``, then clamped the same way); none is an error."""
    target = num_frames if num_frames is not None else int(math.ceil(clip.duration * fps - 1e-6))
    count = min(max(target, min_frames), max_frames, len(clip.times))
    if count <= 0:
        raise ValueError(
            f"cannot keep any frame of a video of {len(clip.times)} frames: max_frames is {max_frames} (a total "
            "video_max_pixels below one frame of size.shortest_edge pixels allows none)"
        )
    return count


def sample_clip(clip: DecodedClip, count: int, stamps: Optional[Sequence[float]] = None) -> SampledVideo:
    """``count`` frames at integer linspace over all decoded frames, stamped index / average_fps (or ``stamps``,
    one per frame of the clip)."""
    total = len(clip.times)
    indices = np.unique(np.clip(np.linspace(0, total - 1, count).astype(np.int32), 0, total - 1)).tolist()
    seconds = [stamps[i] if stamps is not None else i / clip.average_fps for i in indices]
    return SampledVideo(clip.frames_at(indices), seconds)


def clamp_to_content(timestamps: Sequence[float], clip: DecodedClip) -> list[float]:
    """Requested times kept inside the decodable content (torchcodec's valid range)."""
    last = min((len(clip.times) - 1) / clip.average_fps + clip.begin, clip.end - END_MARGIN_SECONDS)
    last = max(clip.begin, last)
    return [max(clip.begin, min(float(t), last)) for t in timestamps]


def frames_played_at(clip: DecodedClip, timestamps: Sequence[float]) -> torch.Tensor:
    """The frame on screen at each time: the last one whose presentation time is not after it."""
    indices = [max(0, int(np.searchsorted(clip.times, t, side="right")) - 1) for t in timestamps]
    return clip.frames_at(indices)


def sample_segments(
    clip: DecodedClip, segments: Sequence[Sequence[float]], fps: float, min_frames: int, max_frames: int
) -> list[SampledVideo]:
    """One video per segment (``_fetch_video_segments_batched``)."""
    min_frames, max_frames = max(1, min_frames), max(1, max_frames)
    ranges = [segment[1] - segment[0] for segment in segments if len(segment) == 2]
    total_range = sum(ranges)
    videos = []
    for segment in segments:
        if len(segment) == 1:
            stamps = clamp_to_content([segment[0]], clip)
        else:
            start, end = segment
            weight = (end - start) / total_range if total_range > 0 else 1.0 / len(ranges)
            count = int(math.ceil((end - start) * fps))
            count = min(max(count, max(1, int(round(min_frames * weight)))), max(1, int(round(max_frames * weight))))
            wanted = [start] if count == 1 else np.linspace(start, end, count, endpoint=False).tolist()
            stamps = clamp_to_content(wanted, clip)
        videos.append(SampledVideo(frames_played_at(clip, stamps), stamps))
    return videos


def share_max_frames(durations: Sequence[float], max_frames: int) -> list[int]:
    """``max_frames`` as a budget over several videos: one frame each, the rest by duration, largest remainder."""
    count = len(durations)
    if count == 1:
        return [max_frames]
    if max_frames < count:
        return [1] * count
    spare, total = max_frames - count, sum(durations)
    raw = [spare * d / total if total > 0 else spare / count for d in durations]
    shares = [1 + int(math.floor(r)) for r in raw]
    left = spare - sum(int(math.floor(r)) for r in raw)
    by_remainder = sorted(range(count), key=lambda i: (-(raw[i] - math.floor(raw[i])), i))
    for index in by_remainder[:left]:
        shares[index] += 1
    return shares


def video_target_size(
    frames: int,
    height: int,
    width: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
    frame_min_pixels: int,
    frame_max_pixels: int,
) -> tuple[int, int]:
    """The real video ``smart_resize``: sides multiples of ``factor``; a frame first capped at ``frame_max_pixels``,
    then ``frames * h * w`` brought into ``[min_pixels, max_pixels]``, then a frame raised to ``frame_min_pixels``."""
    if height < factor or width < factor:
        raise ValueError(f"video frames of {width}x{height} are smaller than {factor} pixels on a side")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"video aspect ratio must be below 200, got {max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor

    def scaled_down(pixels: float) -> tuple[int, int]:
        beta = math.sqrt(pixels)
        return max(factor, math.floor(height / beta / factor) * factor), max(
            factor, math.floor(width / beta / factor) * factor
        )

    def scaled_up(beta: float) -> tuple[int, int]:
        return math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor

    if h_bar * w_bar > frame_max_pixels:
        h_bar, w_bar = scaled_down(height * width / frame_max_pixels)
    if frames * h_bar * w_bar > max_pixels:
        h_bar, w_bar = scaled_down(frames * height * width / max_pixels)
    elif frames * h_bar * w_bar < min_pixels:
        h_bar, w_bar = scaled_up(math.sqrt(min_pixels / (frames * height * width)))
    if h_bar * w_bar < frame_min_pixels:
        h_bar, w_bar = scaled_up(math.sqrt(frame_min_pixels / (height * width)))
    return h_bar, w_bar


def volume_budgets(volumes: Sequence[int], video_max_pixels: Optional[int], frame_max_pixels: int) -> list[int]:
    """Each video's 3-D pixel cap: its share of ``video_max_pixels`` by frames*height*width, or, with no total
    budget configured, the per-frame maximum applied to the whole volume (what the real code does then)."""
    total = sum(volumes)
    if video_max_pixels is None or total <= 0:
        return [frame_max_pixels] * len(volumes)
    return [int(video_max_pixels * volume / total) for volume in volumes]
