"""The MOSS-VL processor: prompt text with media placeholders -> token ids, pixels and the frame-visibility mask,
as the published checkpoint's ``processing_moss_vl.py`` (``MossVLProcessor.__call__``) builds them.

Text carries one placeholder per medium. The processor expands them:
  ``<|image|>`` -> ``<|image_pad|>``  (bare: no vision start/end markup around an image)
  ``<|video|>`` -> ``<|vision_start|>`` + per frame ``<|time_start|>{t:.1f} seconds<|time_end|><|image_pad|>``
                   + ``<|vision_end|>``
so every frame owns one ``<|image_pad|>`` token, and a sample's vision encoder sequence is, per frame in text
order, [merged patch tokens..., separator].

Outputs (what stock sglang's ``multimodal/processors/moss_vl.py`` consumes):
  input_ids, attention_mask   (batch, text_len) int64, left padded
  pixel_values                (num_patches, 3 * temporal_patch * patch * patch) float32, media in text order
  grid_thw                    (num_media, 3) int64 in patches, t = frames
  media_nums_per_sample       list[int]; a sample without media counts its blank frame: 1
  cross_attention_mask        (batch, 1, text_len, max_frames) bool, True = masked: a token sees frame i of its
                              sample iff at least i + 1 ``<|image_pad|>`` tokens are at or before it (and it is not
                              padding).
A sample without media carries one all-zero frame of 8 x 8 patches that no token sees (the real processor's form;
the model computes nothing from it, sglang's text-only hook drops it).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import AutoTokenizer, BatchFeature, ProcessorMixin

from .chat_template import CHAT_TEMPLATE, DEFAULT_REALTIME_SYSTEM_PROMPT
from .image_processor import MossVLImageProcessor

IMAGE_PLACEHOLDER = "<|image|>"
VIDEO_PLACEHOLDER = "<|video|>"
IMAGE_PAD = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
TIME_START = "<|time_start|>"
TIME_END = "<|time_end|>"
# The realtime engine reads a processor's default system prompt from the module defining the processor class.
__all__ = ["DEFAULT_REALTIME_SYSTEM_PROMPT", "MossVLProcessor", "video_markup"]

PLACEHOLDER_PATTERN = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")


def video_markup(timestamps: list[float]) -> str:
    """The text a video becomes: one timestamped ``<|image_pad|>`` per frame inside vision start/end."""
    frames = "".join(f"{TIME_START}{t:.1f} seconds{TIME_END}{IMAGE_PAD}" for t in timestamps)
    return VISION_START + frames + VISION_END


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


class MossVLProcessor(ProcessorMixin):
    """Tokenizer + :class:`MossVLImageProcessor` (images and videos) + chat template (outputs: module docstring)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template or CHAT_TEMPLATE)

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path, chat_template: Optional[str] = None) -> "MossVLProcessor":
        """Ours for a published checkpoint directory, read from its real files: ``preprocessor_config.json``,
        ``video_preprocessor_config.json`` and its tokenizer (chat template: the argument, else the tokenizer's)."""
        tokenizer = AutoTokenizer.from_pretrained(str(checkpoint), trust_remote_code=False)
        image_processor = MossVLImageProcessor.from_real_configs(checkpoint)
        return cls(image_processor, tokenizer, chat_template=chat_template or tokenizer.chat_template)

    def apply_chat_template(
        self, messages, add_generation_prompt: bool = True, tokenize: bool = False, **kwargs
    ) -> str:
        """Prompt text with one ``<|image|>`` / ``<|video|>`` placeholder per media item."""
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

    def __call__(self, text=None, images=None, videos=None, return_tensors="pt", **kwargs) -> BatchFeature:
        """Tokenise ``text`` (str or list of str), expanding placeholders with ``images``/``videos`` consumed in
        order across the batch. Per-call media settings come from ``images_kwargs``, ``videos_kwargs`` (sglang) and
        ``media_kwargs`` (the runners); names in ``image_processor.CALL_SETTINGS``. Other sglang keywords (padding,
        device, ...) are accepted: padding is always to the longest sample, on the left."""
        texts = [text] if isinstance(text, str) else list(text or [])
        if not texts or any(not isinstance(t, str) for t in texts) or all(not t.strip() for t in texts):
            raise ValueError("MossVLProcessor needs non-empty text with <|image|>/<|video|> placeholders")
        settings = {
            **(kwargs.get("images_kwargs") or {}),
            **(kwargs.get("videos_kwargs") or {}),
            **(kwargs.get("media_kwargs") or {}),
        }
        media_processor = self.image_processor.with_settings(settings)
        orders = [[piece for piece in PLACEHOLDER_PATTERN.findall(t)] for t in texts]
        images, videos = _as_list(images), _as_list(videos)
        image_media = media_processor.images(images) if images else []
        sampled_videos = media_processor.sample_videos(videos) if videos else []
        video_media = media_processor.videos(sampled_videos) if sampled_videos else []
        wanted = {p: sum(order.count(p) for order in orders) for p in (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER)}
        if wanted[IMAGE_PLACEHOLDER] != len(image_media) or wanted[VIDEO_PLACEHOLDER] != len(video_media):
            raise ValueError(
                f"the text has {wanted[IMAGE_PLACEHOLDER]} <|image|> and {wanted[VIDEO_PLACEHOLDER]} <|video|> "
                f"placeholder(s) for {len(image_media)} image(s) and {len(video_media)} video(s)"
            )
        image_iter, video_iter = iter(image_media), iter(zip(video_media, sampled_videos))
        expanded, media, media_nums = [], [], []
        for sample, order in zip(texts, orders):
            parts = []
            for piece in PLACEHOLDER_PATTERN.split(sample):
                if piece == IMAGE_PLACEHOLDER:
                    media.append(next(image_iter))
                    parts.append(IMAGE_PAD)
                elif piece == VIDEO_PLACEHOLDER:
                    patches, video = next(video_iter)
                    media.append(patches)
                    parts.append(video_markup(video.timestamps))
                else:
                    parts.append(piece)
            if not order:
                media.append(media_processor.blank_frame())
            expanded.append("".join(parts))
            media_nums.append(max(len(order), 1))
        encoded = self.tokenizer(
            expanded, padding="longest", padding_side="left", return_tensors="pt", add_special_tokens=False
        )
        grid_thw = torch.tensor([grid for _, grid in media], dtype=torch.long)
        return BatchFeature(
            {
                "input_ids": encoded["input_ids"],
                "attention_mask": encoded["attention_mask"],
                "pixel_values": torch.cat([patches for patches, _ in media]),
                "grid_thw": grid_thw,
                "media_nums_per_sample": media_nums,
                "cross_attention_mask": self.frame_visibility_mask(
                    encoded["input_ids"], encoded["attention_mask"], frames_per_sample(grid_thw, media_nums)
                ),
            },
            tensor_type=None,
        )

    def frame_visibility_mask(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, frames: list[int]
    ) -> torch.Tensor:
        """(batch, 1, text_len, max frames) bool, True = masked (module docstring)."""
        seen = (input_ids == self.image_pad_token_id).long().cumsum(dim=1).unsqueeze(-1)
        frame_index = torch.arange(max(frames)).view(1, 1, -1)
        visible = (seen > frame_index) & attention_mask.bool().unsqueeze(-1)
        visible &= frame_index < torch.tensor(frames).view(-1, 1, 1)
        return (~visible).unsqueeze(1)

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


def frames_per_sample(grid_thw: torch.Tensor, media_nums: list[int]) -> list[int]:
    """Frames (grid t summed) of each sample's media."""
    counts = grid_thw[:, 0].split(media_nums)
    return [int(c.sum()) for c in counts]
