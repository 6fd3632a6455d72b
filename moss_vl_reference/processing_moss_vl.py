"""MOSS-VL processor: chat template, media placeholders, image/video preprocessing.

Text carries one placeholder per medium (`<|image|>`, `<|video|>`). The processor expands them:
  image -> <|vision_start|><|image_pad|><|vision_end|>
  video -> <|vision_start|> (<|time_start|>{t:.1f} seconds<|time_end|><|image_pad|>) per frame <|vision_end|>
so every frame owns exactly one `<|image_pad|>` text token (id = config.image_token_id), and the
vision encoder sequence of a sample is, per frame in text order, [merged patch tokens..., separator].

Outputs (all consumed by stock sglang's `multimodal/processors/moss_vl.py`):
  input_ids, attention_mask            (batch, text_len), left padded
  pixel_values                         (num_patches, channels * temporal_patch * patch * patch), float32
  grid_thw                             (num_media, 3) in patch units, t = frames
  media_nums_per_sample                list[int]
  cross_attention_mask                 (batch, 1, text_len, max_frames) bool, True = masked: a token sees a
                                       frame iff the frame's <|image_pad|> is at or before the token.
Text-only input produces none of the vision keys (sglang would otherwise prepend encoder padding).
"""

import copy
import io
import math
import os
import re
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from transformers import BaseImageProcessor, BatchFeature, ProcessorMixin

IMAGE_PLACEHOLDER = "<|image|>"
VIDEO_PLACEHOLDER = "<|video|>"
IMAGE_PAD = "<|image_pad|>"
# The blank frame (t, h, w in patches) the real processor attaches to a text-only prompt.
PLACEHOLDER_GRID = (1, 8, 8)
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
TIME_START = "<|time_start|>"
TIME_END = "<|time_end|>"
PLACEHOLDER_PATTERN = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")

# Our wording of the realtime checkpoints' default system prompt: perceive continuously, answer and update the
# answer as the scene changes, and output <|silence|> when there is nothing (more) to say.
DEFAULT_REALTIME_SYSTEM_PROMPT = (
    "You are watching a live video stream frame by frame. Keep perceiving it continuously; answer the user "
    "when what you see lets you, and update your answer when the scene changes. When you cannot answer yet or "
    "have finished answering, output <|silence|> directly."
)


def chat_template(default_system_prompt: str = "") -> str:
    """The Qwen-style chat template (media placeholders inline, no separators).

    Without a default system prompt an empty system turn is left out: exactly what sglang's "moss-vl" conversation
    template renders for an OpenAI chat. With one (the realtime checkpoints'), every conversation opens with a
    system turn, that prompt when none or an empty one is given."""
    if default_system_prompt:
        opening = (
            "{%- if not messages or messages[0]['role'] != 'system' -%}"
            "{{- '<|im_start|>system\n" + default_system_prompt + "<|im_end|>\n' -}}{%- endif -%}"
        )
        system_rule = (
            "{%- if message['role'] == 'system' and text == '' -%}{%- set text = '"
            + default_system_prompt
            + "' -%}{%- endif -%}{%- if true -%}"
        )
    else:
        opening, system_rule = "", "{%- if not (message['role'] == 'system' and text == '') -%}"
    return (
        opening + "{%- for message in messages -%}"
        "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
        "{%- else -%}{%- set text = namespace(v='') -%}"
        "{%- for item in message['content'] -%}"
        "{%- if item['type'] == 'text' -%}{%- set text.v = text.v + item['text'] -%}"
        "{%- elif item['type'] in ('image', 'image_url') -%}{%- set text.v = text.v + '<|image|>' -%}"
        "{%- elif item['type'] in ('video', 'video_url') -%}{%- set text.v = text.v + '<|video|>' -%}"
        "{%- endif -%}{%- endfor -%}{%- set text = text.v -%}{%- endif -%}"
        + system_rule
        + "{{- '<|im_start|>' + message['role'] + '\n' + text + '<|im_end|>\n' -}}"
        "{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
    )


CHAT_TEMPLATE = chat_template()
REALTIME_CHAT_TEMPLATE = chat_template(DEFAULT_REALTIME_SYSTEM_PROMPT)


def _load_image(image) -> Image.Image:
    """A PIL image from a PIL image, encoded bytes, or a local path (file:// allowed)."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (bytes, bytearray)):
        try:
            with Image.open(io.BytesIO(image)) as opened:
                return opened.convert("RGB")
        except (UnidentifiedImageError, OSError) as error:
            raise ValueError(f"cannot decode image bytes ({len(image)} bytes): {error}") from error
    if isinstance(image, dict):
        image = image.get("image") or image.get("image_url") or image.get("url")
    if not isinstance(image, (str, os.PathLike)):
        raise ValueError(f"unsupported image input of type {type(image).__name__}")
    path = os.fspath(image)
    if path.startswith("file://"):
        path = path[len("file://") :]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"image file not found: {path}")
    try:
        with Image.open(path) as opened:
            return opened.convert("RGB")
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"cannot decode image {path}: {error}") from error


def _decode_video_file(path: str) -> tuple[list[Image.Image], list[float]]:
    """Every frame of a video file with its presentation time in seconds (PyAV)."""
    import av

    if path.startswith("file://"):
        path = path[len("file://") :]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"video file not found: {path}")
    frames, times = [], []
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise ValueError(f"no video stream in {path}")
            stream = container.streams.video[0]
            for frame in container.decode(stream):
                frames.append(frame.to_image().convert("RGB"))
                times.append(
                    float(frame.time) if frame.time is not None else len(times) / float(stream.average_rate or 1)
                )
    except (av.error.FFmpegError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot decode video {path}: {error}") from error
    return frames, times


def sample_frame_indices(times: list[float], fps: float, min_frames: int, max_frames: int) -> list[int]:
    """Indices of decoded frames sampled at `fps`, clamped to [min_frames, max_frames].

    One target time every 1/fps seconds over the clip; each picks the last frame shown at that
    time. Too many targets are thinned uniformly, too few are spread uniformly over all frames."""
    if not times:
        return []
    duration = times[-1] + (times[-1] - times[-2] if len(times) > 1 else 0.0)
    targets = np.arange(0.0, max(duration, 1e-6), 1.0 / fps)
    indices = [max(0, int(np.searchsorted(times, t, side="right")) - 1) for t in targets]
    indices = sorted(set(indices))
    count = min(max(len(indices), min_frames), max_frames, len(times))
    if count <= 0:
        return []
    if len(indices) > count:
        indices = [indices[int(i)] for i in np.linspace(0, len(indices) - 1, count).round()]
    elif len(indices) < count:
        indices = [int(i) for i in np.linspace(0, len(times) - 1, count).round()]
    return indices


class MossVLImageProcessor(BaseImageProcessor):
    """Resizes to multiples of patch*merge within a pixel budget, normalises, and patchifies in
    merge-window order (frame, block row, block col, row in block, col in block)."""

    model_input_names = ["pixel_values", "grid_thw"]

    def __init__(
        self,
        patch_size: int = 16,
        temporal_patch_size: int = 1,
        merge_size: int = 2,
        min_pixels: int = 4096,
        max_pixels: int = 16777216,
        video_max_pixels: int = 16777216,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
        video_fps: float = 1.0,
        min_frames: int = 1,
        max_frames: int = 256,
        max_input_pixels: int = 8192 * 8192,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if temporal_patch_size != 1:
            raise ValueError("MossVLImageProcessor supports temporal_patch_size=1 only (one separator per frame)")
        self.patch_size = patch_size
        self.temporal_patch_size = temporal_patch_size
        self.merge_size = merge_size
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.video_max_pixels = video_max_pixels
        self.image_mean = list(image_mean)
        self.image_std = list(image_std)
        self.video_fps = video_fps
        self.min_frames = min_frames
        self.max_frames = max_frames
        # Larger inputs are refused, not downscaled: decoding them already costs memory a server should not risk.
        self.max_input_pixels = max_input_pixels

    def target_size(self, height: int, width: int, max_pixels: int) -> tuple[int, int]:
        """(height, width) rounded to multiples of patch*merge, scaled to fit [min_pixels, max_pixels]
        with the aspect ratio kept as far as rounding allows. Tiny inputs are scaled up."""
        unit = self.patch_size * self.merge_size
        new_h = max(unit, round(height / unit) * unit)
        new_w = max(unit, round(width / unit) * unit)
        if new_h * new_w > max_pixels:
            scale = math.sqrt(height * width / max_pixels)
            new_h = max(unit, math.floor(height / scale / unit) * unit)
            new_w = max(unit, math.floor(width / scale / unit) * unit)
        elif new_h * new_w < self.min_pixels:
            scale = math.sqrt(self.min_pixels / (height * width))
            new_h = math.ceil(height * scale / unit) * unit
            new_w = math.ceil(width * scale / unit) * unit
        return new_h, new_w

    def patchify_frames(self, frames: list[Image.Image], max_pixels: int) -> tuple[torch.Tensor, list[int]]:
        """Frames of one medium (all resized to the first frame's target size) ->
        (frames*gh*gw, 3*P*P) float32 patches and grid [frames, gh, gw]."""
        for frame in frames:
            if frame.width * frame.height > self.max_input_pixels:
                raise ValueError(
                    f"image of {frame.width}x{frame.height} = {frame.width * frame.height} pixels is larger than this "
                    f"model's limit max_input_pixels={self.max_input_pixels} (processor config)"
                )
        height, width = self.target_size(frames[0].height, frames[0].width, max_pixels)
        mean = torch.tensor(self.image_mean).view(1, 3, 1, 1)
        std = torch.tensor(self.image_std).view(1, 3, 1, 1)
        stacked = torch.stack(
            [
                torch.from_numpy(
                    np.asarray(f.resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32)
                ).permute(2, 0, 1)
                for f in frames
            ]
        )
        stacked = (stacked / 255.0 - mean) / std
        p, m = self.patch_size, self.merge_size
        t, gh, gw = len(frames), height // p, width // p
        patches = stacked.view(t, 3, gh // m, m, p, gw // m, m, p)
        patches = patches.permute(0, 2, 5, 3, 6, 1, 4, 7).reshape(t * gh * gw, 3 * p * p)
        return patches.contiguous(), [t, gh, gw]

    def with_overrides(self, overrides: dict) -> "MossVLImageProcessor":
        """A copy using per-request media settings (min/max pixels, video_fps or fps, min/max frames)."""
        known = {"min_pixels", "max_pixels", "video_max_pixels", "video_fps", "min_frames", "max_frames"}
        overrides = {("video_fps" if k == "fps" else k): v for k, v in overrides.items()}
        overrides = {k: v for k, v in overrides.items() if k in known and v is not None}
        if not overrides:
            return self
        adjusted = copy.copy(self)
        for key, value in overrides.items():
            setattr(adjusted, key, value)
        return adjusted

    def load_video(self, video) -> tuple[list[Image.Image], list[float]]:
        """Frames and timestamps (seconds) of one video.

        A file (path or {"video_path": ...}) is decoded with PyAV and sampled at `video_fps`,
        clamped to [min_frames, max_frames]. A frame list (or {"frames": [...], "timestamps": [...]})
        is taken as already sampled (timestamps default to i / video_fps) and only thinned to
        max_frames."""
        if isinstance(video, dict) and "frames" in video or isinstance(video, (list, tuple)):
            frames = [_load_image(f) for f in (video["frames"] if isinstance(video, dict) else video)]
            given = video.get("timestamps") if isinstance(video, dict) else None
            times = [float(t) for t in given] if given else [i / self.video_fps for i in range(len(frames))]
            if len(times) != len(frames):
                raise ValueError(f"video {_describe(video)} has {len(frames)} frames but {len(times)} timestamps")
            count = min(len(frames), self.max_frames)
            indices = [int(i) for i in np.linspace(0, len(frames) - 1, count).round()] if count else []
        else:
            path = video.get("video_path") if isinstance(video, dict) else video
            if not isinstance(path, (str, os.PathLike)):
                raise ValueError(f"unsupported video input of type {type(video).__name__}")
            frames, times = _decode_video_file(os.fspath(path))
            indices = sample_frame_indices(times, self.video_fps, self.min_frames, self.max_frames)
        if not indices:
            raise ValueError(f"video {_describe(video)} yielded zero sampled frames")
        return [frames[i] for i in indices], [times[i] for i in indices]

    def preprocess(self, images, **kwargs) -> BatchFeature:
        """Stand-alone image preprocessing: each image is its own medium."""
        images = images if isinstance(images, (list, tuple)) else [images]
        patches, grids = zip(*(self.patchify_frames([_load_image(i)], self.max_pixels) for i in images))
        return BatchFeature({"pixel_values": torch.cat(patches), "grid_thw": torch.tensor(grids, dtype=torch.long)})


def _describe(video) -> str:
    if isinstance(video, dict):
        return repr(video.get("video_path", "<frames>"))
    if isinstance(video, (list, tuple)):
        return f"<list of {len(video)} frames>"
    return repr(os.fspath(video)) if isinstance(video, (str, os.PathLike)) else type(video).__name__


class MossVLProcessor(ProcessorMixin):
    """Tokenizer + MossVLImageProcessor + chat template (see module docstring for outputs)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template or CHAT_TEMPLATE)

    def apply_chat_template(
        self, messages, add_generation_prompt: bool = True, tokenize: bool = False, **kwargs
    ) -> str:
        """Prompt text with one `<|image|>` / `<|video|>` placeholder per media item."""
        if tokenize:
            raise ValueError("MossVLProcessor.apply_chat_template renders text only; call the processor on it")
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    @staticmethod
    def extract_media(messages) -> tuple[list[Any], list[Any]]:
        """Images and videos of chat messages, in the order their placeholders are rendered."""
        images, videos = [], []
        for message in messages:
            content = message["content"]
            for item in [] if isinstance(content, str) else content:
                if item["type"] in ("image", "image_url"):
                    value = item.get("image", item.get("image_url"))
                    images.append(value["url"] if isinstance(value, dict) and "url" in value else value)
                elif item["type"] in ("video", "video_url"):
                    value = item.get("video", item.get("video_url"))
                    videos.append(value["url"] if isinstance(value, dict) and "url" in value else value)
        return images, videos

    @staticmethod
    def _expand_sample(text: str, images, videos, media_processor: MossVLImageProcessor) -> tuple[str, list]:
        """Expanded text of one sample plus its media (patches, grid) in text order."""
        parts, media = [], []
        for piece in PLACEHOLDER_PATTERN.split(text):
            if piece == IMAGE_PLACEHOLDER:
                image = next(images, None)
                if image is None:
                    raise ValueError("more <|image|> placeholders than images")
                media.append(media_processor.patchify_frames([_load_image(image)], media_processor.max_pixels))
                parts.append(VISION_START + IMAGE_PAD + VISION_END)
            elif piece == VIDEO_PLACEHOLDER:
                video = next(videos, None)
                if video is None:
                    raise ValueError("more <|video|> placeholders than videos")
                frames, times = media_processor.load_video(video)
                media.append(media_processor.patchify_frames(frames, media_processor.video_max_pixels))
                stamps = "".join(f"{TIME_START}{t:.1f} seconds{TIME_END}{IMAGE_PAD}" for t in times)
                parts.append(VISION_START + stamps + VISION_END)
            else:
                parts.append(piece)
        return "".join(parts), media

    def __call__(self, text=None, images=None, videos=None, return_tensors="pt", **kwargs) -> BatchFeature:
        """Tokenise `text` (str or list of str), expanding placeholders with `images`/`videos`
        consumed in order across the batch. Extra sglang kwargs (padding, device, *_kwargs) are
        accepted; padding is always to the longest sample, on the left. Media settings come from
        `media_kwargs`, `images_kwargs` and `videos_kwargs` (see MossVLImageProcessor.with_overrides)."""
        if text is None:
            raise ValueError("MossVLProcessor needs text with <|image|>/<|video|> placeholders")
        texts = [text] if isinstance(text, str) else list(text)
        overrides = {
            **(kwargs.get("images_kwargs") or {}),
            **(kwargs.get("videos_kwargs") or {}),
            **(kwargs.get("media_kwargs") or {}),
        }
        media_processor = self.image_processor.with_overrides(overrides)
        image_iter = iter(images if isinstance(images, (list, tuple)) else ([] if images is None else [images]))
        video_iter = iter(videos if isinstance(videos, (list, tuple)) else ([] if videos is None else [videos]))
        expanded, media, media_nums = [], [], []
        for sample in texts:
            sample_text, sample_media = self._expand_sample(sample, image_iter, video_iter, media_processor)
            expanded.append(sample_text)
            media.extend(sample_media)
            media_nums.append(len(sample_media))
        leftover_images = sum(1 for _ in image_iter)
        leftover_videos = sum(1 for _ in video_iter)
        if leftover_images or leftover_videos:
            raise ValueError(
                f"{leftover_images} image(s) and {leftover_videos} video(s) have no <|image|>/<|video|> placeholder"
            )
        encoded = self.tokenizer(
            expanded, padding="longest", padding_side="left", return_tensors="pt", add_special_tokens=False
        )
        data = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
        if media:
            data["pixel_values"] = torch.cat([patches for patches, _ in media])
            data["grid_thw"] = torch.tensor([grid for _, grid in media], dtype=torch.long)
            data["media_nums_per_sample"] = media_nums
            data["cross_attention_mask"] = self.frame_visibility_mask(encoded["input_ids"])
        else:
            data.update(self.text_only_placeholder(media_processor, len(texts)))
        return BatchFeature(data, tensor_type=None)

    @staticmethod
    def text_only_placeholder(media_processor: "MossVLImageProcessor", batch: int) -> dict:
        """What the real checkpoint's processor returns for a text-only batch: one blank frame of 8 x 8 patches
        (``pixel_values`` zeros, ``grid_thw [[1, 8, 8]]``) that no sample counts as a medium
        (``media_nums_per_sample`` all 0) and no ``<|image_pad|>`` token refers to. The model ignores it (no image
        token, no encoder); an engine must not turn it into encoder tokens."""
        patch_dim = 3 * media_processor.temporal_patch_size * media_processor.patch_size**2
        return {
            "pixel_values": torch.zeros(PLACEHOLDER_GRID[1] * PLACEHOLDER_GRID[2], patch_dim),
            "grid_thw": torch.tensor([PLACEHOLDER_GRID], dtype=torch.long),
            "media_nums_per_sample": [0] * batch,
        }

    def frame_visibility_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(batch, 1, text_len, max_frames) bool, True = masked. Frame f of a sample is visible
        from its own <|image_pad|> token onwards (frames are prefix-causal)."""
        is_frame = input_ids == self.image_pad_token_id
        frames_seen = is_frame.long().cumsum(dim=1)
        max_frames = max(int(is_frame.sum(dim=1).max()), 1)
        frame_index = torch.arange(max_frames).view(1, 1, -1)
        return (frame_index >= frames_seen.unsqueeze(-1)).unsqueeze(1)

    @property
    def image_pad_token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)

    @property
    def model_input_names(self):
        return [
            "input_ids",
            "attention_mask",
            "pixel_values",
            "grid_thw",
            "media_nums_per_sample",
            "cross_attention_mask",
        ]
