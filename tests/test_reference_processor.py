"""The reference MOSS-VL processor: resizing, patchification, video sampling, placeholders, errors.

Oracles: explicit per-pixel loops for patch values, frame timestamps read back with PyAV, and
the encoder-length formula sum(t*h*w/merge^2 + t)."""

import re
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

ASSETS = Path(__file__).parent / "assets"
VIDEO = ASSETS / "moving_square_3s.mp4"


def frame_token_count(processor, inputs) -> int:
    return int((inputs["input_ids"] == processor.image_pad_token_id).sum())


def test_patches_equal_an_explicit_pixel_loop(processor):
    """square_64.png is already 64x64 (a multiple of patch*merge = 32): no resize, so each patch
    value is (pixel/255 - 0.5)/0.5, patches ordered by merge window then row/col inside it."""
    inputs = processor(text="<|image|>", images=[str(ASSETS / "square_64.png")])
    pixels = np.asarray(Image.open(ASSETS / "square_64.png").convert("RGB"), dtype=np.float32) / 255.0
    assert inputs["grid_thw"].tolist() == [[1, 4, 4]]
    expected = []
    for block_row in range(2):
        for block_col in range(2):
            for row in range(2):
                for col in range(2):
                    y, x = (block_row * 2 + row) * 16, (block_col * 2 + col) * 16
                    patch = [
                        (pixels[y + i, x + j, c] - 0.5) / 0.5 for c in range(3) for i in range(16) for j in range(16)
                    ]
                    expected.append(patch)
    torch.testing.assert_close(inputs["pixel_values"], torch.tensor(expected), rtol=0, atol=1e-6)


def test_tiny_image_is_resized_up_and_sizes_stay_in_budget(processor):
    tiny = processor(text="<|image|>", images=[str(ASSETS / "tiny_8x8.png")])
    assert tiny["grid_thw"].tolist() == [[1, 4, 4]]  # 8x8 -> 64x64 = min_pixels 4096
    assert tiny["pixel_values"].shape == (16, 768)
    capped = processor(text="<|image|>", images=[Image.new("RGB", (640, 200))], media_kwargs={"max_pixels": 64 * 96})
    _, h, w = capped["grid_thw"][0].tolist()
    assert (h * 16) * (w * 16) <= 64 * 96 and h % 2 == 0 and w % 2 == 0 and w > h


def test_input_larger_than_the_configured_limit_is_refused_not_resized(processor):
    limit = processor.image_processor.max_input_pixels
    side = int(limit**0.5) + 1
    with pytest.raises(ValueError, match=rf"{side}x{side} = {side * side} pixels .* max_input_pixels={limit}"):
        processor(text="<|image|>", images=[Image.new("RGB", (side, side))])
    at_limit = processor(text="<|image|>", images=[Image.new("RGB", (limit // 1024, 1024))])
    _, h, w = at_limit["grid_thw"][0].tolist()
    assert (h * 16) * (w * 16) <= processor.image_processor.max_pixels  # accepted, then downscaled to the budget


def test_video_file_sampled_at_fps_with_one_timestamp_marker_per_frame(processor):
    with av.open(str(VIDEO)) as container:
        times = [float(frame.time) for frame in container.decode(video=0)]
    assert len(times) == 12 and times[-1] == pytest.approx(2.75)
    for fps, expected_stamps in ((1.0, [0.0, 1.0, 2.0]), (2.0, [0.0, 0.5, 1.0, 1.5, 2.0, 2.5])):
        inputs = processor(text="<|video|>", videos=[str(VIDEO)], media_kwargs={"video_fps": fps})
        text = processor.decode(inputs["input_ids"][0])
        stamps = [float(s) for s in re.findall(r"<\|time_start\|>([0-9.]+) seconds<\|time_end\|><\|image_pad\|>", text)]
        assert stamps == expected_stamps
        assert inputs["grid_thw"].tolist() == [[len(expected_stamps), 4, 4]]  # 64x48 -> 64x64
        assert frame_token_count(processor, inputs) == len(expected_stamps)
        assert text.startswith("<|vision_start|>") and text.endswith("<|vision_end|>")
    thinned = processor(
        text="<|video|>", videos=[{"video_path": str(VIDEO)}], media_kwargs={"video_fps": 4.0, "max_frames": 2}
    )
    assert thinned["grid_thw"][0, 0] == 2
    # 0.25 fps gives one target in a 3 s clip; min_frames 3 spreads frames 0, 6, 11 (of 12) instead
    padded = processor(text="<|video|>", videos=[str(VIDEO)], media_kwargs={"video_fps": 0.25, "min_frames": 3})
    stamps = re.findall(r"<\|time_start\|>([0-9.]+) seconds", processor.decode(padded["input_ids"][0]))
    assert padded["grid_thw"][0, 0] == 3 and [float(s) for s in stamps] == [
        0.0,
        1.5,
        2.8,
    ]  # 2.75 s printed with one decimal


def test_frame_list_video_and_interleaved_media(processor):
    frames = [Image.new("RGB", (64, 64), (i * 40, 0, 0)) for i in range(3)]
    text = "<|im_start|>user\nA<|image|>B<|video|>C<|image|>D<|im_end|>\n"
    inputs = processor(
        text=text,
        images=[str(ASSETS / "square_64.png"), str(ASSETS / "gradient_96x64.png")],
        videos=[{"frames": frames, "timestamps": [0.5, 1.5, 2.5]}],
    )
    assert inputs["grid_thw"].tolist() == [[1, 4, 4], [3, 4, 4], [1, 4, 6]]
    assert inputs["media_nums_per_sample"] == [3]
    assert "0.5 seconds" in processor.decode(inputs["input_ids"][0])
    encoder_len = sum(t * h * w // 4 + t for t, h, w in inputs["grid_thw"].tolist())
    assert encoder_len == (4 + 1) + 3 * (4 + 1) + (6 + 1)
    counts = (~inputs["cross_attention_mask"][0, 0]).sum(-1)
    first_pad = int((inputs["input_ids"][0] == processor.image_pad_token_id).nonzero()[0])
    assert counts[:first_pad].eq(0).all() and counts[first_pad] == 1
    assert (counts[1:] >= counts[:-1]).all() and counts[-1] == 5
    assert inputs["cross_attention_mask"].dtype == torch.bool and inputs["cross_attention_mask"].shape[-1] == 5


def test_batch_is_left_padded_and_visibility_counts_only_own_frames(processor):
    inputs = processor(
        text=["<|image|>short", "a much longer prompt here <|image|><|image|>"],
        images=[str(ASSETS / "square_64.png")] * 3,
    )
    assert inputs["media_nums_per_sample"] == [1, 2]
    assert inputs["attention_mask"][0, 0] == 0 and inputs["attention_mask"][:, -1].eq(1).all()
    counts = (~inputs["cross_attention_mask"][:, 0]).sum(-1)
    assert counts[0, -1] == 1 and counts[1, -1] == 2 and counts[0, 0] == 0


@pytest.mark.parametrize(
    "kwargs, error, culprit",
    [
        (dict(text="<|image|>", images=["/nonexistent/cat.png"]), FileNotFoundError, "cat.png"),
        (dict(text="<|video|>", videos=["/nonexistent/clip.mp4"]), FileNotFoundError, "clip.mp4"),
        (dict(text="<|image|><|image|>", images=[str(ASSETS / "square_64.png")]), ValueError, "<|image|>"),
        (dict(text="no placeholder", images=[str(ASSETS / "square_64.png")]), ValueError, "1 image(s)"),
        (dict(text="<|video|>", videos=[{"frames": []}]), ValueError, "zero sampled frames"),
        (dict(text="<|video|>"), ValueError, "<|video|>"),
    ],
)
def test_bad_input_names_the_culprit(processor, kwargs, error, culprit):
    with pytest.raises(error) as raised:
        processor(**kwargs)
    assert culprit in str(raised.value)


def test_corrupt_image_and_video_raise_value_error_naming_the_file(processor, tmp_path):
    broken_image = tmp_path / "broken.png"
    broken_image.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    with pytest.raises(ValueError, match="broken.png"):
        processor(text="<|image|>", images=[str(broken_image)])
    broken_video = tmp_path / "broken.mp4"
    broken_video.write_bytes(VIDEO.read_bytes()[:40] + b"\x00garbage" * 50)
    with pytest.raises(ValueError, match="broken.mp4"):
        processor(text="<|video|>", videos=[str(broken_video)])
