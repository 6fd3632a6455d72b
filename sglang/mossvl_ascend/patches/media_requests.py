"""A MOSS-VL request's media: read only where the operator allows (``media.access``), videos sampled as the request
asks (``media.sampling``), every client mistake an HTTP 400.

Catalog entries: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any, Callable
from urllib.parse import urlparse

from sglang.srt.managers.schedule_batch import Modality
from sglang.srt.plugins.hook_registry import HookType
from sglang.srt.utils.common import ImageData, VideoData

from mossvl_ascend.media import access, sampling
from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch

MOSS_VL_ARCH = "MossVLForConditionalGeneration"
PROCESSOR = "sglang.srt.multimodal.processors.moss_vl.MossVLImageProcessor"
# What a /generate client may put in a video dict: the real processor's path and segments, and the sampling values.
VIDEO_DICT_KEYS = frozenset({"video_path", "segments", *sampling.PROCESSOR_KEYS})


def serves_moss_vl(serving_chat) -> bool:
    return MOSS_VL_ARCH in (serving_chat.tokenizer_manager.model_config.hf_config.architectures or [])


async def carry_media_io_kwargs(original: Callable, serving_chat, request, raw_request=None, *args: Any, **kwargs: Any):
    """AROUND ``OpenAIServingChat.handle_request``: the body's ``media_io_kwargs`` (vLLM's field, which sglang's request
    model drops) rides in the request's ``video_config`` to the processor hook, which validates it."""
    if raw_request is not None and serves_moss_vl(serving_chat):
        body = await raw_request.json()  # the body FastAPI read: Starlette keeps it on the request
        media_io = body.get("media_io_kwargs") if isinstance(body, dict) else None
        if media_io is not None:
            request.video_config = {**(request.video_config or {}), sampling.MEDIA_IO_KWARGS_KEY: media_io}
    return await original(serving_chat, request, raw_request, *args, **kwargs)


def video_input_with_sampling(video: Any, request: dict) -> Any:
    """One ``video_data`` entry as our processor takes it: the URL, or ``{"video_path", ...sampling}`` when the part
    or the request asks for a sampling."""
    if isinstance(video, VideoData):
        reference, part = video.url, sampling.part_level(video.preprocess_kwargs, video.max_long_side_pixel)
    elif isinstance(video, str):
        reference, part = video, {}
    elif isinstance(video, dict) and isinstance(video.get("video_path"), str) and video.keys() <= VIDEO_DICT_KEYS:
        given = {key: video[key] for key in sampling.PROCESSOR_KEYS if key in video}
        reference, part = video, sampling.one_level(sampling.fields_of("video", given, {k: k for k in given}))
    else:
        raise sampling.SamplingRefused(
            "a video must be a URL, a path, or {'video_path': ..., 'segments': ...} with sampling keys "
            f"{list(sampling.PROCESSOR_KEYS)}"
        )
    chosen = sampling.video_sampling(part, request)
    if isinstance(reference, dict):
        return {**{k: v for k, v in reference.items() if k not in sampling.PROCESSOR_KEYS}, **chosen}
    return {"video_path": reference, **chosen} if chosen else reference


def sampling_into_videos(processor, *args: Any, request_obj=None, **kwargs: Any):
    """BEFORE MOSS-VL's ``process_mm_data_async``: the request's and each part's sampling fields, validated, written
    into each video entry (stock's MOSS-VL path reads neither, and crashes on a ``VideoData``)."""
    if request_obj is None:
        return None
    request = sampling.request_level(
        getattr(request_obj, "video_config", None), getattr(request_obj, "mm_processor_kwargs", None)
    )
    videos = getattr(request_obj, "video_data", None)
    if videos:
        videos = videos if isinstance(videos, list) else [videos]
        request_obj.video_data = [video_input_with_sampling(video, request) for video in videos]
    return None


def admitted_video(processor, reference: str) -> tuple[str, list[str]]:
    """A video reference the server may read, as a local path (a URL's body in a temp file, listed to remove);
    inline data is left to stock."""
    target = access.classify(reference)
    if target.kind == "local":
        return access.admit_local(target), []
    if target.kind == "url":
        suffix = os.path.splitext(urlparse(reference).path)[1] or ".mp4"
        temp = processor._write_video_bytes_to_tempfile(access.fetch_url(target), suffix=suffix)
        return temp, [temp]
    return reference, []


async def admitted_video_inputs(original: Callable, processor, video_data, *args: Any, **kwargs: Any):
    """AROUND MOSS-VL's ``_normalize_video_inputs_async``: every video admitted first (``admitted_video``, on the
    processor's I/O threads), then stock's normalisation; our temp files join stock's list, removed after the call."""
    if not video_data:
        return await original(processor, video_data, *args, **kwargs)
    loop = asyncio.get_running_loop()
    admitted, ours = [], []
    try:
        for video in video_data:
            reference = video["video_path"] if isinstance(video, dict) else video
            path, temps = await loop.run_in_executor(processor.io_executor, admitted_video, processor, reference)
            ours += temps
            admitted.append({**video, "video_path": path} if isinstance(video, dict) else path)
        normalized, stock_temps = await original(processor, admitted, *args, **kwargs)
    except BaseException:
        processor._remove_temp_video_paths(ours)
        raise
    return normalized, stock_temps + ours


def admitted_image(data: Any) -> Any:
    """An image reference the server may read: a local file's resolved path, a URL's body; else as given."""
    text = data.url if isinstance(data, ImageData) else data
    if not isinstance(text, str):
        return data
    target = access.classify(text)
    if target.kind == "inline":
        return data
    resolved = access.admit_local(target) if target.kind == "local" else access.fetch_url(target)
    return dataclasses.replace(data, url=resolved) if isinstance(data, ImageData) else resolved


def admitted_image_item(original: Callable, data: Any, modality: Modality, *args: Any, **kwargs: Any):
    """AROUND MOSS-VL's ``_load_single_item`` (run on the I/O threads): an image is admitted before stock loads it."""
    if modality == Modality.IMAGE:
        data = admitted_image(data)
    return original(data, modality, *args, **kwargs)


UPSTREAM = "sglang 0.5.23 behaviour"
PATCHES = (
    Patch(
        title="Local media only under the operator's directories; media URLs fail as one 400",
        target=f"{PROCESSOR}._load_single_item",
        kind=HookType.AROUND,
        hook=admitted_image_item,
        platforms=ON_NPU_AND_CPU,
        why=(
            "stock reads any local file a client names (`file://`, a bare path) and answers a missing one with 500 "
            "(`FileNotFoundError` wrapped in `RuntimeError`); its errors tell a missing file from an undecodable one "
            "and a refused URL from an unreachable one"
        ),
        how=(
            "an image's local path is resolved (`..`, symlinks) and read only inside a directory listed in "
            "`MOSSVL_ALLOWED_LOCAL_MEDIA_PATH` (none by default, as vLLM's `--allowed-local-media-path`); a URL is "
            "fetched by stock's `download_remote_media` (`--allowed-media-domains`, `--media-url-max-file-size-mb`, "
            "5 redirects) within `REQUEST_TIMEOUT` (default 10 s); any refusal or failure is a `ValueError` with one "
            "text, 'not allowed or not found' (HTTP 400), the reason in the server log (`mossvl_ascend.media.access`)"
        ),
        upstream=UPSTREAM,
        remove_when="sglang restricts local media paths (as vLLM's --allowed-local-media-path)",
    ),
    Patch(
        title="A MOSS-VL video is read only where the operator allows, its fetch failures a 400",
        target=f"{PROCESSOR}._normalize_video_inputs_async",
        kind=HookType.AROUND,
        hook=admitted_video_inputs,
        platforms=ON_NPU_AND_CPU,
        why=(
            "stock's MOSS-VL video normalisation reads any local path and downloads any URL; a missing `file://` "
            "video answers 500 from the processor, an unreachable or stalled URL answers 500 (`requests` errors are "
            "not wrapped)"
        ),
        how=(
            "each video reference is admitted first, on the processor's I/O threads, by the same rules as images "
            "(`mossvl_ascend.media.access`): a local path resolved inside an allowed directory, a URL fetched by "
            "stock's guarded download into a temp file that is removed with stock's; then stock's normalisation "
            "runs on the admitted paths"
        ),
        upstream=UPSTREAM,
        remove_when="sglang restricts local media paths and answers video fetch failures with 400",
    ),
    Patch(
        title="A MOSS-VL request's video sampling fields are honoured (part > request > server) or refused",
        target=f"{PROCESSOR}.process_mm_data_async",
        kind=HookType.BEFORE,
        hook=sampling_into_videos,
        platforms=ON_NPU_AND_CPU,
        why=(
            "stock's MOSS-VL processor path passes neither the request's `video_config` / `mm_processor_kwargs` nor "
            "vLLM's `media_io_kwargs` to the processor (every request gets the server's 1 fps), and a `video_url` "
            "part with `fps` / `max_frames` arrives as a `VideoData` that its normalisation crashes on (500)"
        ),
        how=(
            "the request's fields and each part's are validated and reduced to the processor's own sampling values "
            "(`num_frames` or `video_fps`, `min_frames`, `max_frames`; `mossvl_ascend.media.sampling`), and each "
            "video becomes `{'video_path': url, ...values}`, which our processor samples by the published "
            "`calculate_num_frames` rule; an unknown field or impossible value is a 400 naming the field"
        ),
        upstream=UPSTREAM,
        remove_when="stock's MOSS-VL processor forwards per-request and per-part video sampling",
    ),
    Patch(
        title="The chat route keeps vLLM's media_io_kwargs for a MOSS-VL server",
        target="sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat.handle_request",
        kind=HookType.AROUND,
        hook=carry_media_io_kwargs,
        platforms=ON_NPU_AND_CPU,
        why=(
            "lmms-eval's `--model openai` (pass_video_url) asks for its frame count as vLLM's top-level "
            "`media_io_kwargs: {'video': {'num_frames': N}}`; sglang's `ChatCompletionRequest` drops unknown fields, "
            "so the count was silently ignored"
        ),
        how=(
            "on a MOSS-VL server the body's `media_io_kwargs` (read again from the request FastAPI parsed) is put "
            "into the request's `video_config` under `media_io_kwargs`, where the sampling hook validates and "
            "applies it; any other model: stock"
        ),
        upstream=UPSTREAM,
        remove_when="sglang's chat request model accepts media_io_kwargs",
    ),
)
