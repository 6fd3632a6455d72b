"""The media half of the MOSS-VL processor: the real checkpoint's image AND video settings, and the pixels.

One object holds both because our checkpoints load it as one transformers image processor (``AutoImageProcessor``,
saved in ``processor_config.json``); :meth:`MossVLImageProcessor.from_real_configs` reads a published checkpoint's
two files (``preprocessor_config.json``: ``size``, ``multi_image_max_pixels``, patch/merge sizes, mean/std;
``video_preprocessor_config.json``: ``size``, ``video_max_pixels``, ``video_fps``, ``min_frames``, ``max_frames``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from transformers import BaseImageProcessor, BatchFeature
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from .images import (
    DEFAULT_IMAGE_SIZE,
    DEFAULT_MULTI_IMAGE_MAX_PIXELS,
    Patchifier,
    blank_frame,
    image_tensor,
    load_image,
    shared_image_budgets,
)
from .video import (
    DEFAULT_VIDEO_SIZE,
    DecodedClip,
    SampledVideo,
    decode_clip,
    frame_count,
    frame_list_clip,
    is_frame_list,
    sample_clip,
    sample_segments,
    share_max_frames,
    video_path_of,
    video_target_size,
    volume_budgets,
)

# Real preprocessor_config.json keys taken as they are (the rest of that file is transformers bookkeeping).
REAL_IMAGE_KEYS = ("size", "multi_image_max_pixels", "patch_size", "temporal_patch_size", "merge_size")
REAL_NORMALISATION_KEYS = ("image_mean", "image_std")
# Real video_preprocessor_config.json keys, and the names they take here.
REAL_VIDEO_KEYS = {
    "size": "video_size",
    "video_max_pixels": "video_max_pixels",
    "video_fps": "video_fps",
    "min_frames": "min_frames",
    "max_frames": "max_frames",
}
# Per-call media settings (sglang's images_kwargs / videos_kwargs, the runners' media_kwargs) -> attribute.
CALL_SETTINGS = {
    "min_pixels": "min_pixels",
    "max_pixels": "max_pixels",
    "multi_image_max_pixels": "multi_image_max_pixels",
    "video_max_pixels": "video_max_pixels",
    "video_fps": "video_fps",
    "fps": "video_fps",
    "min_frames": "min_frames",
    "max_frames": "max_frames",
    "max_source_frames": "max_source_frames",
}
# What one video of a call may set for itself (keys of a ``{"video_path": ...}`` input): the real processor's
# sampling keywords (``video_fps``, ``min_frames``, ``max_frames``) and ``calculate_num_frames``' ``num_frames``.
PER_VIDEO_SAMPLING = ("num_frames", "video_fps", "min_frames", "max_frames")
# A video with more frames is refused undecoded (ours: 2 hours at 30 fps; the real processor has no such bound).
DEFAULT_MAX_SOURCE_FRAMES = 2 * 3600 * 30

# Every constructor setting (what a per-call copy carries over).
SETTINGS = (
    "size",
    "multi_image_max_pixels",
    "patch_size",
    "temporal_patch_size",
    "merge_size",
    "image_mean",
    "image_std",
    "video_size",
    "video_max_pixels",
    "video_fps",
    "min_frames",
    "max_frames",
    "max_source_frames",
    "max_input_pixels",
)


class MossVLImageProcessor(BaseImageProcessor):
    """Image and video preprocessing of the real MOSS-VL processor (module docstrings of ``images``/``video``).

    Settings (real names): ``size`` {shortest_edge = min pixels, longest_edge = max pixels} of one image;
    ``multi_image_max_pixels`` the budget all images of one call share; ``video_size`` (the video config's
    ``size``) bounds one video frame; ``video_max_pixels`` the frames*height*width budget all videos of one call
    share (None: no shared budget); ``video_fps``, ``min_frames``, ``max_frames``; ``min_pixels`` / ``max_pixels``
    override ``size`` as in Qwen2-VL's image processors. ``max_input_pixels`` is ours:
    a decoded image or frame larger than that is refused, not resized (a server should not hold it); so is
    ``max_source_frames``: a video file with more frames is refused before decoding.

    A video given as ``{"video_path": ..., "num_frames" | "video_fps", "min_frames", "max_frames"}`` samples with
    those values instead of the call's (``PER_VIDEO_SAMPLING``); its ``max_frames`` may only lower the call's
    ``max_frames`` (a value above it, or a ``num_frames`` / ``min_frames`` above it, is refused)."""

    model_input_names = ["pixel_values", "grid_thw"]

    def __init__(
        self,
        size: Optional[dict] = None,
        multi_image_max_pixels: int = DEFAULT_MULTI_IMAGE_MAX_PIXELS,
        patch_size: int = 16,
        temporal_patch_size: int = 1,
        merge_size: int = 2,
        image_mean: Sequence[float] = (0.5, 0.5, 0.5),
        image_std: Sequence[float] = (0.5, 0.5, 0.5),
        video_size: Optional[dict] = None,
        video_max_pixels: Optional[int] = None,
        video_fps: float = 1.0,
        min_frames: int = 1,
        max_frames: int = 256,
        max_source_frames: int = DEFAULT_MAX_SOURCE_FRAMES,
        max_input_pixels: int = 8192 * 8192,
        min_pixels: Optional[int] = None,
        max_pixels: Optional[int] = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.size = dict(size or DEFAULT_IMAGE_SIZE)
        # Qwen2-VL's image processors take min_pixels / max_pixels as overrides of size's two edges.
        if min_pixels is not None:
            self.size["shortest_edge"] = min_pixels
        if max_pixels is not None:
            self.size["longest_edge"] = max_pixels
        self.multi_image_max_pixels = multi_image_max_pixels
        self.patch_size, self.temporal_patch_size, self.merge_size = patch_size, temporal_patch_size, merge_size
        self.image_mean, self.image_std = list(image_mean), list(image_std)
        self.video_size = dict(video_size or DEFAULT_VIDEO_SIZE)
        self.video_max_pixels = video_max_pixels
        self.video_fps, self.min_frames, self.max_frames = video_fps, min_frames, max_frames
        self.max_source_frames = max_source_frames
        self.max_input_pixels = max_input_pixels
        Patchifier(patch_size, temporal_patch_size, merge_size, image_mean, image_std)  # refuses what MOSS-VL cannot

    @classmethod
    def from_real_configs(cls, checkpoint: str | Path, **overrides: Any) -> "MossVLImageProcessor":
        """Built from a published checkpoint's ``preprocessor_config.json`` and, when present,
        ``video_preprocessor_config.json`` (real key names; unknown keys ignored)."""
        checkpoint = Path(checkpoint)
        image = json.loads((checkpoint / "preprocessor_config.json").read_text())
        video_file = checkpoint / "video_preprocessor_config.json"
        video = json.loads(video_file.read_text()) if video_file.is_file() else {}
        return cls.from_real_config_dicts(image, video, **overrides)

    @classmethod
    def from_real_config_dicts(cls, image: dict, video: Optional[dict] = None, **overrides: Any):
        """Built from the contents of those two files (``video`` None or empty: the video class defaults)."""
        settings = {key: image[key] for key in REAL_IMAGE_KEYS + REAL_NORMALISATION_KEYS if key in image}
        settings.update({ours: (video or {})[real] for real, ours in REAL_VIDEO_KEYS.items() if real in (video or {})})
        return cls(**{**settings, **overrides})

    # ---- settings

    @property
    def min_pixels(self) -> int:
        return self.size["shortest_edge"]

    @property
    def max_pixels(self) -> int:
        return self.size["longest_edge"]

    def with_settings(self, settings: dict) -> "MossVLImageProcessor":
        """A copy with per-call settings (``CALL_SETTINGS`` names; unknown names and None values ignored)."""
        chosen = {CALL_SETTINGS[k]: v for k, v in settings.items() if k in CALL_SETTINGS and v is not None}
        if not chosen:
            return self
        return type(self)(**{**{name: getattr(self, name) for name in SETTINGS}, **chosen})

    @property
    def patchifier(self) -> Patchifier:
        return Patchifier(self.patch_size, self.temporal_patch_size, self.merge_size, self.image_mean, self.image_std)

    def check_input_size(self, height: int, width: int) -> None:
        if height * width > self.max_input_pixels:
            raise ValueError(
                f"image of {width}x{height} = {width * height} pixels is larger than this model's limit "
                f"max_input_pixels={self.max_input_pixels} (processor config)"
            )

    # ---- images

    def images(self, images: Sequence[Any]) -> list[tuple[torch.Tensor, list[int]]]:
        """(patches, [1, gh, gw]) per image of one call, the batch budget shared among them."""
        pictures = [image_tensor(load_image(image)) for image in images]
        for picture in pictures:
            self.check_input_size(*picture.shape[-2:])
        sizes = [tuple(picture.shape[-2:]) for picture in pictures]
        budgets = shared_image_budgets(sizes, self.multi_image_max_pixels, self.min_pixels, self.max_pixels)
        patchify = self.patchifier
        media = []
        for picture, (height, width), budget in zip(pictures, sizes, budgets):
            target = smart_resize(height, width, patchify.factor, self.min_pixels, budget)
            media.append(patchify(picture.unsqueeze(0), *target))
        return media

    def realtime_frame(self, frame: Any) -> tuple[torch.Tensor, list[int]]:
        """One pushed realtime frame -> (patches, [1, gh, gw]). The published realtime loop
        (``_update_model_kwargs_for_real_time_generation``) sends the frames it drains through the processor as
        images, one ``<|image|>`` each, so a frame is sized by the image rule, not the video one: here one image of
        a call, ``[size.shortest_edge, min(multi_image_max_pixels, size.longest_edge)]`` pixels."""
        return self.images([frame])[0]

    def blank_frame(self) -> tuple[torch.Tensor, list[int]]:
        return blank_frame(self.patch_size, self.merge_size, self.temporal_patch_size)

    # ---- videos

    def sample_videos(self, videos: Sequence[Any]) -> list[SampledVideo]:
        """Each video input's sampled frames (a segments dict gives one video per segment). ``max_frames`` is the
        cap on the frames of one call, shared by its videos: a video's own ``max_frames`` can lower its share, never
        raise it (a server's request fields arrive as a video's own values)."""
        owns = [self.own_sampling(video) for video in videos]  # refused before any file is decoded
        clips, given_stamps = zip(*(self.clip_of(video) for video in videos))
        shares = share_max_frames([clip.duration for clip in clips], self.max_frames)
        sampled = []
        for video, own, clip, stamps, share in zip(videos, owns, clips, given_stamps, shares):
            fps, min_frames = own.get("video_fps", self.video_fps), own.get("min_frames", self.min_frames)
            share = min(own.get("max_frames", share), share)
            if is_frame_list(video):
                # pre-sampled: every frame kept up to max_frames (integer linspace), stamps as given or i / fps
                sampled.append(sample_clip(clip, min(len(clip.times), share), stamps))
            elif isinstance(video, dict) and "segments" in video:
                sampled += sample_segments(clip, video["segments"], fps, min_frames, share)
            else:
                # a whole clip is also capped by how many minimum-size frames the total budget holds
                if self.video_max_pixels is not None and self.video_size["shortest_edge"] > 0:
                    share = min(share, self.video_max_pixels // self.video_size["shortest_edge"])
                count = frame_count(clip, fps, min_frames, share, own.get("num_frames"))
                sampled.append(sample_clip(clip, count))
        return sampled

    def own_sampling(self, video: Any) -> dict:
        """A video's own sampling values (``PER_VIDEO_SAMPLING``), refused where the real rule cannot meet them."""
        own = {key: video[key] for key in PER_VIDEO_SAMPLING if isinstance(video, dict) and video.get(key) is not None}
        if "num_frames" in own and "segments" in video:
            raise ValueError("num_frames does not apply to a video given as segments (each samples at its fps)")
        if "num_frames" in own and "video_fps" in own:
            raise ValueError("num_frames and fps are mutually exclusive (the processor's calculate_num_frames)")
        if own.get("max_frames", 0) > self.max_frames:
            raise ValueError(
                f"max_frames={own['max_frames']} is more than this server's max_frames={self.max_frames} (the cap "
                "on the frames of one request)"
            )
        max_frames = own.get("max_frames", self.max_frames)
        if own.get("num_frames", 0) > max_frames:
            raise ValueError(f"num_frames={own['num_frames']} is more than max_frames={max_frames}")
        if own.get("min_frames", 0) > max_frames:
            raise ValueError(f"min_frames={own['min_frames']} is more than max_frames={max_frames}")
        return own

    def clip_of(self, video: Any) -> tuple[DecodedClip, Optional[list[float]]]:
        if is_frame_list(video):
            return frame_list_clip(video, self.video_fps, lambda frame: image_tensor(load_image(frame)))
        return decode_clip(video_path_of(video), self.max_source_frames, self.max_input_pixels), None

    def videos(self, sampled: Sequence[SampledVideo]) -> list[tuple[torch.Tensor, list[int]]]:
        """(patches, [frames, gh, gw]) per sampled video, the call's video budget shared by volume."""
        for video in sampled:
            self.check_input_size(*video.frames.shape[-2:])
        volumes = [v.frames.shape[0] * v.frames.shape[-2] * v.frames.shape[-1] for v in sampled]
        frame_min, frame_max = self.video_size["shortest_edge"], self.video_size["longest_edge"]
        budgets = volume_budgets(volumes, self.video_max_pixels, frame_max)
        patchify = self.patchifier
        media = []
        for video, budget in zip(sampled, budgets):
            count, height, width = video.frames.shape[0], *video.frames.shape[-2:]
            target = video_target_size(count, height, width, patchify.factor, frame_min, budget, frame_min, frame_max)
            media.append(patchify(video.frames, *target))
        return media

    def preprocess(self, images, **kwargs) -> BatchFeature:
        """Stand-alone image preprocessing (one call: one shared budget)."""
        media = self.images(images if isinstance(images, (list, tuple)) else [images])
        return BatchFeature(
            {"pixel_values": torch.cat([p for p, _ in media]), "grid_thw": torch.tensor([g for _, g in media])}
        )
