"""Our MOSS-VL processor reproduces a table of the published checkpoint's processor outputs.

Oracle: the table below, derived by hand from reading the real remote code of OpenMOSS-Team/MOSS-VL-Realtime (0708
line), public copies in GitHub ``Joiin0392/moss-npu-adaptations``, folder ``vlm/MOSS-VL-Realtime-0708/``:
  PROC = processing_moss_vl.py (commit 47311dd7), VIDEO = video_processing_moss_vl.py (commit 601fc6fa),
  CONFIG = preprocessor_config.json (commit 47311dd7).
Every expected value cites the lines it follows; none is produced by the code under test. The processor is built
from a checkpoint directory holding the real configuration files (their keys and values, cited), so reading the
real keys is tested too.

Rules the table applies (file:line):
  * PROC:374, 581: each ``<|image|>`` becomes the bare image token ``<|image_pad|>`` (PROC:351), nothing around it.
  * PROC:645, 649: a video becomes ``<|vision_start|>`` + per frame ``<|time_start|>{t:.1f} seconds<|time_end|>``
    + ``<|image_pad|>`` + ``<|vision_end|>``; t = frame index / the clip's average fps (PROC:627-634, 1101;
    VIDEO:995), Python's ``.1f`` (round half to even on the binary value: 1.25 -> "1.2", 3.75 -> "3.8").
  * VIDEO:669-673: n = ceil(duration * fps - 1e-6), clamped to [min_frames, min(max_frames, N)]; VIDEO:984, 990:
    duration = content end - begin, N = frames decoded; VIDEO:1017-1019: indices = unique(int32(linspace(0, N-1, n)))
    (truncation).
  * VIDEO:392-439 (smart_resize) with VIDEO:1094 (no video_max_pixels: the volume cap is size.longest_edge) and
    VIDEO:1101-1104 (min = per-frame min = size.shortest_edge, per-frame max = size.longest_edge); sizes from VIDEO:475.
  * PROC:102-110: every image of a call gets int(multi_image_max_pixels * its pixels / all images' pixels), clamped
    to [shortest_edge, longest_edge]; PROC:112: Qwen2-VL smart_resize with factor patch * merge = 32.
  * PROC:176: pixel_values rows are patches of 3 * 1 * 16 * 16 = 768 values; grid (t, h/16, w/16).
  * PROC:718, 739: media_nums_per_sample counts a sample's media, 1 for a sample without media, which gets a blank
    frame (PROC:740-756): side ceil(sqrt(128 * 128) / 32) * 32 = 128 -> grid (1, 8, 8), 64 zero rows.
  * PROC:882, 897, 904, 909: a row sees frame i iff more than i ``<|image_pad|>`` are at or before it (and it is
    not padding, and the frame exists); the mask is its negation (True = masked), shape (batch, 1, len, frames).
"""

import json
import re
import shutil
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

# CONFIG:6-23 (image processor) and VIDEO:475-491 (the video processor's class defaults; no video_max_pixels).
REAL_PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 4096},
    "multi_image_max_pixels": 65536000,
    "patch_size": 16,
    "temporal_patch_size": 1,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "MossVLProcessor",
    "image_processor_type": "MossVLImageProcessorFast",
    "interpolation": "BICUBIC",
}
REAL_VIDEO_PREPROCESSOR_CONFIG = {
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
    "video_fps": 1.0,
    "min_frames": 1,
    "max_frames": 256,
    "patch_size": 16,
    "temporal_patch_size": 1,
    "merge_size": 2,
}
OPEN = "<|im_start|>user\n"
CLOSE = "<|im_end|>\n<|im_start|>assistant\n"
VIDEO_PROMPT = OPEN + "<|video|>What happens?" + CLOSE


def stamped(*stamps: str) -> str:
    frames = "".join(f"<|time_start|>{s} seconds<|time_end|><|image_pad|>" for s in stamps)
    return "<|vision_start|>" + frames + "<|vision_end|>"


# name -> (text, images as (width, height), video fps or None, preprocessor overrides, expected)
TABLE = {
    "one image": (
        OPEN + "<|image|>Describe it." + CLOSE,
        [(100, 70)],
        None,
        {},
        {
            # PROC:581 bare pad
            "text": OPEN + "<|image_pad|>Describe it." + CLOSE,
            # PROC:112 smart_resize(70, 100): round(70/32)*32 = 64, round(100/32)*32 = 96, within [4096, 16777216]
            "grid_thw": [[1, 4, 6]],
            "pixel_values": (24, 768),  # PROC:176
            "media_nums_per_sample": [1],  # PROC:718
            "frame_counts": [0, 1],  # PROC:882: 0 before the pad, 1 from it on
            "stamps": [],
        },
    ),
    "two images of different sizes": (
        OPEN + "A<|image|>B<|image|>C" + CLOSE,
        [(128, 128), (256, 128)],
        None,
        # CONFIG:10 is the key; a small value makes the shared budget bind on small images
        {"multi_image_max_pixels": 16384},
        {
            "text": OPEN + "A<|image_pad|>B<|image_pad|>C" + CLOSE,
            # PROC:102: shares int(16384 * 16384/49152) = 5461 and int(16384 * 32768/49152) = 10922 (PROC:106-110
            # keep both in [4096, 16777216]); PROC:112: 128x128 over 5461 -> beta = sqrt(16384/5461) = 1.732,
            # floor(128/1.732/32)*32 = 64 -> 64x64; 128x256 over 10922 -> beta 1.732 -> 64x128
            "grid_thw": [[1, 4, 4], [1, 4, 8]],
            "pixel_values": (16 + 32, 768),
            "media_nums_per_sample": [2],
            "frame_counts": [0, 1, 2],
            "stamps": [],
        },
    ),
    "4 s video at 1 fps": (
        VIDEO_PROMPT,
        [],
        1.0,
        {},
        {
            # 16 frames over 4.0 s (average fps 4): n = ceil(4.0) = 4 (VIDEO:669), linspace(0, 15, 4) -> 0, 5, 10, 15
            # (VIDEO:1017), stamped 0/4, 5/4, 10/4, 15/4 = 0.0, 1.25, 2.5, 3.75 (PROC:1101) -> "1.2", "3.8" (PROC:645)
            "text": OPEN + stamped("0.0", "1.2", "2.5", "3.8") + "What happens?" + CLOSE,
            # VIDEO:392: 64x64, 4 frames: volume 16384 < 131072 -> beta sqrt(8): ceil(64*2.83/32)*32 = 192; then a
            # frame 192*192 < 131072 (VIDEO:431) -> beta sqrt(131072/4096) = 5.66: ceil(64*5.66/32)*32 = 384
            "grid_thw": [[4, 24, 24]],
            "pixel_values": (4 * 24 * 24, 768),
            "media_nums_per_sample": [1],
            "frame_counts": [0, 1, 2, 3, 4],
            "stamps": ["0.0", "1.2", "2.5", "3.8"],
        },
    ),
    "4 s video at 2 fps": (
        VIDEO_PROMPT,
        [],
        2.0,
        {},
        {
            # n = ceil(8.0) = 8; linspace(0, 15, 8) = 0, 2.14, 4.29, 6.43, 8.57, 10.71, 12.86, 15 -> int32 truncates
            # to 0, 2, 4, 6, 8, 10, 12, 15 (VIDEO:1017); / 4 fps -> ..., 3.0, 3.75 -> "3.8"
            "text": OPEN + stamped("0.0", "0.5", "1.0", "1.5", "2.0", "2.5", "3.0", "3.8") + "What happens?" + CLOSE,
            # volume 8*4096 < 131072 -> beta 2 -> 128; a frame 128*128 < 131072 -> 384 (VIDEO:421-435)
            "grid_thw": [[8, 24, 24]],
            "pixel_values": (8 * 24 * 24, 768),
            "media_nums_per_sample": [1],
            "frame_counts": list(range(9)),
            "stamps": ["0.0", "0.5", "1.0", "1.5", "2.0", "2.5", "3.0", "3.8"],
        },
    ),
    "text only": (
        OPEN + "Hello there." + CLOSE,
        [],
        None,
        {},
        {
            "text": OPEN + "Hello there." + CLOSE,
            "grid_thw": [[1, 8, 8]],  # PROC:740-756 blank frame
            "pixel_values": (64, 768),
            "media_nums_per_sample": [1],  # PROC:739
            "frame_counts": [0],  # PROC:882/904: the blank frame exists but no pad makes it visible
            "stamps": [],
        },
    ),
    "two turns with an image each": (
        OPEN + "<|image|>What is this?<|im_end|>\n<|im_start|>assistant\nA square.<|im_end|>\n"
        "<|im_start|>user\n<|image|>And this?" + CLOSE,
        [(64, 64), (96, 64)],
        None,
        {},
        {
            "text": OPEN + "<|image_pad|>What is this?<|im_end|>\n<|im_start|>assistant\nA square.<|im_end|>\n"
            "<|im_start|>user\n<|image_pad|>And this?" + CLOSE,
            "grid_thw": [[1, 4, 4], [1, 4, 6]],  # 64x64 and 64x96 (h x w) are multiples of 32 already
            "pixel_values": (16 + 24, 768),
            "media_nums_per_sample": [2],
            "frame_counts": [0, 1, 2],
            "stamps": [],
        },
    ),
}


def write_clip(path: Path, frames: int = 16, fps: int = 4, side: int = 64) -> None:
    """A 4 s clip (16 frames at 4 fps), each frame a different gray."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = side
        stream.pix_fmt = "yuv420p"
        for index in range(frames):
            image = np.full((side, side, 3), index * 15, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("clip") / "clip_4s_16f.mp4"
    write_clip(path)
    with av.open(str(path)) as container:
        times = [float(frame.time) for frame in container.decode(video=0)]
    assert len(times) == 16 and times[-1] == pytest.approx(3.75)  # the clip the table assumes
    return path


def real_layout(directory: Path, checkpoint: Path, overrides: dict) -> Path:
    """A directory with the real processor configuration files and our checkpoint's tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(checkpoint / name, directory / name)
    config = {**REAL_PREPROCESSOR_CONFIG, **overrides}
    (directory / "preprocessor_config.json").write_text(json.dumps(config))
    (directory / "video_preprocessor_config.json").write_text(json.dumps(REAL_VIDEO_PREPROCESSOR_CONFIG))
    return directory


def run_row(name: str, checkpoint: Path, clip: Path, tmp_path: Path):
    from mossvl_ascend.processor import MossVLProcessor

    text, image_sizes, fps, overrides, expected = TABLE[name]
    processor = MossVLProcessor.from_checkpoint(real_layout(tmp_path / "ckpt", checkpoint, overrides))
    images = [Image.new("RGB", size, (40 * i, 90, 160)) for i, size in enumerate(image_sizes, 1)]
    videos = [str(clip)] if fps is not None else None
    media_kwargs = {"video_fps": fps} if fps is not None else {}
    return processor, processor(text=text, images=images or None, videos=videos, media_kwargs=media_kwargs), expected


def frame_count_steps(mask: torch.Tensor) -> list[int]:
    """Visible frame counts per row, consecutive repeats collapsed (0 0 1 1 2 -> 0 1 2)."""
    counts = (~mask[0, 0]).sum(-1).tolist()
    return [c for i, c in enumerate(counts) if i == 0 or c != counts[i - 1]]


@pytest.mark.parametrize("name", list(TABLE))
def test_processor_reproduces_the_real_table(name, checkpoint, clip, tmp_path):
    processor, out, expected = run_row(name, checkpoint, clip, tmp_path)
    ids = out["input_ids"][0]
    assert processor.decode(ids) == expected["text"]
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    frames = sum(t for t, _, _ in expected["grid_thw"])
    assert int((ids == pad).sum()) == (0 if name == "text only" else frames)
    assert out["grid_thw"].tolist() == expected["grid_thw"]
    assert out["grid_thw"].dtype == torch.long
    assert tuple(out["pixel_values"].shape) == expected["pixel_values"]
    assert out["pixel_values"].dtype == torch.float32
    assert out["media_nums_per_sample"] == expected["media_nums_per_sample"]
    mask = out["cross_attention_mask"]
    assert mask.dtype == torch.bool and tuple(mask.shape) == (1, 1, ids.shape[0], frames)
    assert frame_count_steps(mask) == expected["frame_counts"]
    # each count rises exactly at a frame's own <|image_pad|> (PROC:882: at or before the row)
    counts = (~mask[0, 0]).sum(-1)
    rises = (torch.diff(counts, prepend=counts.new_zeros(1)) > 0).nonzero().flatten()
    assert rises.tolist() == (ids == pad).nonzero().flatten().tolist()
    stamps = re.findall(r"<\|time_start\|>([0-9.]+) seconds<\|time_end\|>", processor.decode(ids))
    assert stamps == expected["stamps"]
    if name == "text only":
        assert not out["pixel_values"].any()  # PROC:756 zeros
