"""How a request asks for a video's frames, reduced to the MOSS-VL video processor's own sampling values.

The published ``video_processing_moss_vl.py`` samples a whole video with ``calculate_num_frames``: from
``video_fps`` it keeps ``ceil(duration * fps)`` frames, or a fixed ``num_frames`` (its other branch), either clamped to
``[min_frames, min(max_frames, frames in the file)]``, at ``linspace(0, N - 1, n)``, stamped ``index / average_fps``;
``num_frames`` and ``fps`` together are an error there. Those four names (``PROCESSOR_KEYS``) are what our processor
takes per video (``processor.image_processor.PER_VIDEO_SAMPLING``).

Where a request says it, most specific first:
  1. part: sglang's ``video_url`` fields ``fps`` and ``max_frames`` (they arrive as a ``VideoData``);
  2. request: vLLM's ``media_io_kwargs: {"video": {"num_frames" | "fps"}}`` (what lmms-eval sends), sglang's
     ``video_config`` and ``mm_processor_kwargs`` (``num_frames``, ``fps`` or ``video_fps``, ``min_frames``,
     ``max_frames``); two of them giving one value differently is refused;
  3. server: ``--mm-process-config '{"video": {...}}'``, then the checkpoint's ``video_preprocessor_config.json``.
The rate (``num_frames`` or ``fps``) is taken whole from the most specific level that gives either; ``min_frames`` and
``max_frames`` each from the most specific level that gives it. Anything else in those places, or a value the rule
cannot take, is refused with ``SamplingRefused`` (HTTP 400) naming the field: never silently dropped.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

PROCESSOR_KEYS = ("num_frames", "video_fps", "min_frames", "max_frames")
RATE_KEYS = ("num_frames", "video_fps")
# Per source: the field names it may use -> the processor's name.
PART_FIELDS = {"fps": "video_fps", "max_frames": "max_frames"}
MEDIA_IO_VIDEO_FIELDS = {"num_frames": "num_frames", "fps": "video_fps"}
REQUEST_CONFIG_FIELDS = {
    "num_frames": "num_frames",
    "fps": "video_fps",
    "video_fps": "video_fps",
    "min_frames": "min_frames",
    "max_frames": "max_frames",
}
# Keys stock sglang itself writes into a request's video_config (serving_chat._build_video_config).
STOCK_VIDEO_CONFIG_KEYS = ("_question",)
# Where the chat route's media_io_kwargs rides to the processor (GenerateReqInput has no field of that name).
MEDIA_IO_KWARGS_KEY = "media_io_kwargs"


class SamplingRefused(ValueError):
    """A sampling field the server cannot honour (a ``ValueError``: stock answers it with HTTP 400)."""


def checked_value(field: str, key: str, value: Any):
    """``value`` as the processor takes it, or ``SamplingRefused`` naming ``field``."""
    if key == "video_fps":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise SamplingRefused(f"{field} must be a positive number of frames per second, got {value!r}")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SamplingRefused(f"{field} must be a positive integer, got {value!r}")
    return value


def fields_of(source: str, given: Optional[Mapping], accepted: Mapping[str, str], ignored=()) -> dict:
    """The processor values in ``given`` (named ``source.<field>`` in errors), with the field each came from."""
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise SamplingRefused(f"{source} must be an object, got {type(given).__name__}")
    values = {}
    for field, value in given.items():
        if field in ignored or value is None:
            continue
        if field not in accepted:
            raise SamplingRefused(
                f"{source}.{field} is not a video sampling field this server honours (accepted: {sorted(accepted)})"
            )
        key, name = accepted[field], f"{source}.{field}"
        if key in values and values[key][0] != checked_value(name, key, value):
            raise SamplingRefused(f"{name}={value!r} disagrees with {values[key][1]}={values[key][0]!r}")
        values[key] = (checked_value(name, key, value), name)
    return values


def one_level(*sources: dict) -> dict:
    """Several sources of one level merged; a value given twice differently, or a rate given both ways, refused."""
    merged: dict = {}
    for values in sources:
        for key, (value, name) in values.items():
            if key in merged and merged[key][0] != value:
                raise SamplingRefused(f"{name}={value!r} disagrees with {merged[key][1]}={merged[key][0]!r}")
            merged[key] = (value, name)
    if all(key in merged for key in RATE_KEYS):
        raise SamplingRefused(
            f"{merged['num_frames'][1]} and {merged['video_fps'][1]} are mutually exclusive (the MOSS-VL video "
            "processor's calculate_num_frames)"
        )
    return merged


def media_io_video_fields(media_io_kwargs: Optional[Mapping]) -> dict:
    """vLLM's ``media_io_kwargs``: only its ``video`` entry, only a rate."""
    if media_io_kwargs is None:
        return {}
    if not isinstance(media_io_kwargs, Mapping):
        raise SamplingRefused(f"media_io_kwargs must be an object, got {type(media_io_kwargs).__name__}")
    for modality in media_io_kwargs:
        if modality != "video":
            raise SamplingRefused(f"media_io_kwargs.{modality} is not supported by this server (only 'video')")
    return fields_of("media_io_kwargs.video", media_io_kwargs.get("video"), MEDIA_IO_VIDEO_FIELDS)


def request_level(video_config: Optional[Mapping], mm_processor_kwargs: Optional[Mapping]) -> dict:
    """The request's sampling (``video_config`` carrying the chat route's ``media_io_kwargs`` under
    ``MEDIA_IO_KWARGS_KEY``), as ``{processor key: (value, field)}``."""
    config = dict(video_config or {})
    media_io = media_io_video_fields(config.pop(MEDIA_IO_KWARGS_KEY, None))
    return one_level(
        media_io,
        fields_of("video_config", config, REQUEST_CONFIG_FIELDS, ignored=STOCK_VIDEO_CONFIG_KEYS),
        fields_of("mm_processor_kwargs", mm_processor_kwargs, REQUEST_CONFIG_FIELDS),
    )


def part_level(preprocess_kwargs: Optional[Mapping], max_long_side_pixel: Optional[int]) -> dict:
    """sglang's per-part ``video_url`` fields (a ``VideoData``'s ``preprocess_kwargs`` and its own field)."""
    if max_long_side_pixel is not None:
        raise SamplingRefused("video_url.max_long_side_pixel is not supported by this server's MOSS-VL processor")
    return one_level(fields_of("video_url", preprocess_kwargs, PART_FIELDS))


def video_sampling(part: dict, request: dict) -> dict:
    """One video's processor values: the part's over the request's, the rate taken whole from one level."""
    chosen = {key: value for key, (value, _) in request.items()}
    if any(key in part for key in RATE_KEYS):
        for key in RATE_KEYS:
            chosen.pop(key, None)
    chosen.update({key: value for key, (value, _) in part.items()})
    return chosen
