"""Images as the real MOSS-VL processor sees them: decoding, the resize rule, the batch pixel budget, patches.

Facts followed (the published checkpoint's ``processing_moss_vl.py``, ``MossVLImageProcessorFast._preprocess``, a
Qwen2-VL fast image processor underneath):
  * an image is RGB (transparency composited onto white), uint8, resized with torchvision bicubic + antialias to
    sides that are multiples of ``patch_size * merge_size`` (Qwen2-VL ``smart_resize``), then normalised as
    ``(pixel - 255 * mean) / (255 * std)`` in float32;
  * ``multi_image_max_pixels`` is ONE budget for all images of a processor call, shared in proportion to their
    original pixel counts, each share clamped to ``[min_pixels, max_pixels]`` (``size.shortest_edge`` /
    ``size.longest_edge``); one image gets ``min(multi_image_max_pixels, max_pixels)``;
  * patches are flattened in merge-window order: (frame, block row, block col, row in block, col in block), each
    ``channel * temporal_patch * patch * patch`` values (channel outermost).
"""

from __future__ import annotations

import io
import os
from typing import Any, Sequence

import numpy as np
import torch
import torchvision.transforms.v2.functional as tvF
from PIL import Image, UnidentifiedImageError

# The real processor's per-image bounds and batch budget (its preprocessor_config.json).
DEFAULT_IMAGE_SIZE = {"shortest_edge": 4096, "longest_edge": 16777216}
DEFAULT_MULTI_IMAGE_MAX_PIXELS = 65536000


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' ``convert_to_rgb`` makes it: transparent pixels become white, not black."""
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255)), rgba).convert("RGB")


def loaded_rgb(opened: Image.Image) -> Image.Image:
    """RGB pixels read while the file is still open (an RGB image is returned as it is, lazily loaded)."""
    rgb = to_rgb(opened)
    rgb.load()
    return rgb


def load_image(image: Any) -> Image.Image:
    """An RGB PIL image from a PIL image, encoded bytes, a local path (``file://`` allowed) or ``{"image": ...}``."""
    if isinstance(image, Image.Image):
        return to_rgb(image)
    if isinstance(image, (bytes, bytearray)):
        try:
            with Image.open(io.BytesIO(image)) as opened:
                return loaded_rgb(opened)
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
            return loaded_rgb(opened)
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"cannot decode image {path}: {error}") from error


def image_tensor(image: Image.Image) -> torch.Tensor:
    """(3, H, W) uint8."""
    return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)


def shared_image_budgets(sizes: Sequence[tuple[int, int]], budget: int, min_pixels: int, max_pixels: int) -> list[int]:
    """Each image's pixel cap: its share of ``budget`` by original pixel count, clamped to [min, max] per image."""
    total = sum(h * w for h, w in sizes)
    shares = [int(budget * (h * w) / total) if total > 0 else budget for h, w in sizes]
    return [min(max(share, min_pixels), max_pixels) for share in shares]


class Patchifier:
    """Resize + normalise + merge-window flattening shared by images and video frames."""

    def __init__(self, patch_size: int, temporal_patch_size: int, merge_size: int, image_mean, image_std):
        if temporal_patch_size != 1:
            raise ValueError("MOSS-VL uses temporal_patch_size 1 (one separator per frame)")
        self.patch_size, self.temporal_patch_size, self.merge_size = patch_size, temporal_patch_size, merge_size
        self.image_mean, self.image_std = list(image_mean), list(image_std)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def __call__(self, frames: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, list[int]]:
        """(T, 3, H, W) uint8 frames of one medium -> ((T*gh*gw, 3*P*P) float32 patches, [T, gh, gw])."""
        resized = tvF.resize(frames, [height, width], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
        mean = torch.tensor(self.image_mean).view(1, 3, 1, 1) * 255.0
        std = torch.tensor(self.image_std).view(1, 3, 1, 1) * 255.0
        normalised = (resized.to(torch.float32) - mean) / std
        p, m = self.patch_size, self.merge_size
        t, gh, gw = frames.shape[0], height // p, width // p
        patches = normalised.view(t, 3, gh // m, m, p, gw // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
        return patches.reshape(t * gh * gw, 3 * p * p).contiguous(), [t, gh, gw]


def blank_frame(patch_size: int, merge_size: int, temporal_patch_size: int) -> tuple[torch.Tensor, list[int]]:
    """The all-zero frame the real processor attaches to a sample without media: a square of at least 128 x 128
    pixels rounded up to patch*merge (8 x 8 patches at patch 16, merge 2)."""
    factor = patch_size * merge_size
    side = int(np.ceil(128 / factor) * factor)
    grid = [1, side // patch_size, side // patch_size]
    return torch.zeros(grid[1] * grid[2], 3 * temporal_patch_size * patch_size**2), grid
