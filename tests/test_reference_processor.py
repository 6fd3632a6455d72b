"""Our MOSS-VL processor (``mossvl_ascend.processor``, the tiny checkpoints' remote code): resizing, patchification,
video sampling and budgets, placeholders, text only, batches, errors.

Oracles: explicit per-pixel loops for patch values, frame times read back with PyAV, the real processor's rules worked
by hand (``tests/test_processor_real_table.py`` cites them), and the encoder-length formula sum(t*h*w/merge^2 + t)."""

import re
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

ASSETS = Path(__file__).parent / "assets"
VIDEO = ASSETS / "moving_square_3s.mp4"  # 12 frames of 64 x 48 at 4 fps: frame i shown from i/4 s, 3.0 s in all


def frame_token_count(processor, inputs) -> int:
    return int((inputs["input_ids"] == processor.image_pad_token_id).sum())


def stamps_of(processor, inputs) -> list[str]:
    return re.findall(r"<\|time_start\|>([0-9.]+) seconds<\|time_end\|><\|image_pad\|>", processor.decode(inputs[0]))


@pytest.fixture(scope="module")
def video_processor(processor):
    """The checkpoint's tokenizer with explicit video settings (the presets' video budgets are theirs to change)."""
    from mossvl_ascend.processor import MossVLImageProcessor, MossVLProcessor

    # frames of at most 64 x 64, at least 32 x 32; all videos of a call share 256 such frames' pixels
    media = MossVLImageProcessor(
        video_size={"shortest_edge": 1024, "longest_edge": 64 * 64}, video_max_pixels=256 * 4096
    )
    return MossVLProcessor(image_processor=media, tokenizer=processor.tokenizer)


def test_the_checkpoint_loads_the_plugin_processor_through_its_remote_code_entry(processor):
    """processing_moss_vl.py is the auto_map entry and only names the plugin's classes: no second implementation."""
    from mossvl_ascend.processor import MossVLImageProcessor, MossVLProcessor

    assert type(processor) is MossVLProcessor
    assert type(processor.image_processor) is MossVLImageProcessor


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


def test_transparency_becomes_white_as_transformers_converts_to_rgb(processor):
    clear = Image.new("RGBA", (64, 64), (0, 0, 0, 0))
    inputs = processor(text="<|image|>", images=[clear])
    assert inputs["pixel_values"].eq(1.0).all()  # (255/255 - 0.5) / 0.5


def test_tiny_image_is_resized_up_and_sizes_stay_in_budget(processor):
    tiny = processor(text="<|image|>", images=[str(ASSETS / "tiny_8x8.png")])
    assert tiny["grid_thw"].tolist() == [[1, 4, 4]]  # 8x8 -> 64x64 = min_pixels 4096
    assert tiny["pixel_values"].shape == (16, 768)
    capped = processor(text="<|image|>", images=[Image.new("RGB", (640, 200))], media_kwargs={"max_pixels": 64 * 96})
    _, h, w = capped["grid_thw"][0].tolist()
    assert (h * 16) * (w * 16) <= 64 * 96 and h % 2 == 0 and w % 2 == 0 and w > h


def test_images_of_one_call_share_the_multi_image_budget(processor):
    """16384 pixels shared by a 128x128 and a 256x128 image: 5461 and 10922 -> 64x64 and 64x128; alone, the first
    keeps 128x128 (its share is the whole budget)."""
    images = [Image.new("RGB", (128, 128)), Image.new("RGB", (256, 128))]
    settings = {"multi_image_max_pixels": 16384}
    shared = processor(text="<|image|><|image|>", images=images, media_kwargs=settings)
    assert shared["grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8]]
    alone = processor(text="<|image|>", images=images[:1], media_kwargs=settings)
    assert alone["grid_thw"].tolist() == [[1, 8, 8]]


def test_input_larger_than_the_configured_limit_is_refused_not_resized(processor):
    limit = processor.image_processor.max_input_pixels
    side = int(limit**0.5) + 1
    with pytest.raises(ValueError, match=rf"{side}x{side} = {side * side} pixels .* max_input_pixels={limit}"):
        processor(text="<|image|>", images=[Image.new("RGB", (side, side))])
    at_limit = processor(text="<|image|>", images=[Image.new("RGB", (limit // 1024, 1024))])
    _, h, w = at_limit["grid_thw"][0].tolist()
    assert (h * 16) * (w * 16) <= processor.image_processor.max_pixels  # accepted, then downscaled to the budget


def test_video_keeps_ceil_duration_times_fps_frames_at_integer_linspace(video_processor):
    """3.0 s, 12 frames: 1 fps keeps 3 frames at linspace(0, 11, 3) = 0, 5.5, 11 -> 0, 5, 11, stamped i / 4 fps;
    2 fps keeps 6 at 0, 2.2, 4.4, 6.6, 8.8, 11 -> 0, 2, 4, 6, 8, 11."""
    with av.open(str(VIDEO)) as container:
        times = [float(frame.time) for frame in container.decode(video=0)]
    assert len(times) == 12 and times[-1] == pytest.approx(2.75)
    for fps, indices in ((1.0, [0, 5, 11]), (2.0, [0, 2, 4, 6, 8, 11])):
        inputs = video_processor(text="<|video|>", videos=[str(VIDEO)], media_kwargs={"video_fps": fps})
        assert stamps_of(video_processor, inputs["input_ids"]) == [f"{times[i]:.1f}" for i in indices]
        assert inputs["grid_thw"].tolist() == [[len(indices), 4, 4]]  # 48x64 -> 64x64 (rounded to 32)
        assert frame_token_count(video_processor, inputs) == len(indices)
        text = video_processor.decode(inputs["input_ids"][0])
        assert text.startswith("<|vision_start|>") and text.endswith("<|vision_end|>")


def test_video_frame_limits_and_segments(video_processor):
    capped = video_processor(text="<|video|>", videos=[{"video_path": str(VIDEO)}], media_kwargs={"max_frames": 2})
    assert stamps_of(video_processor, capped["input_ids"]) == ["0.0", "2.8"]  # linspace(0, 11, 2); 2.75 printed
    raised = video_processor(text="<|video|>", videos=[str(VIDEO)], media_kwargs={"video_fps": 0.25, "min_frames": 3})
    assert stamps_of(video_processor, raised["input_ids"]) == ["0.0", "1.2", "2.8"]  # ceil(0.75) = 1 -> 3
    # a segments dict is one video per segment: [0.5, 2.5) at 1 fps -> 0.5, 1.5; [2.0] -> the frame shown at 2.0
    segments = {"video_path": str(VIDEO), "segments": [[0.5, 2.5], [2.0]]}
    split = video_processor(text="<|video|>x<|video|>", videos=[segments])
    assert split["grid_thw"][:, 0].tolist() == [2, 1]
    assert stamps_of(video_processor, split["input_ids"]) == ["0.5", "1.5", "2.0"]


def test_frame_list_video_is_ours_pre_sampled(video_processor):
    """Not in the real processor (paths and segment dicts only): frames given as a list are one video, every frame
    kept up to max_frames (integer linspace), stamped as given or i / video_fps."""
    frames = [Image.new("RGB", (64, 64), (i * 40, 0, 0)) for i in range(5)]
    given = video_processor(text="<|video|>", videos=[{"frames": frames[:3], "timestamps": [0.5, 1.5, 2.5]}])
    assert stamps_of(video_processor, given["input_ids"]) == ["0.5", "1.5", "2.5"]
    thinned = video_processor(text="<|video|>", videos=[frames], media_kwargs={"max_frames": 3, "video_fps": 2.0})
    assert stamps_of(video_processor, thinned["input_ids"]) == ["0.0", "1.0", "2.0"]  # frames 0, 2, 4 at 2 fps
    assert thinned["grid_thw"].tolist() == [[3, 4, 4]]


def test_videos_of_one_call_share_max_frames_and_the_pixel_budget(video_processor):
    """max_frames 3 over two 3 s clips: one each, the spare one to the first (equal remainders, lower index first).
    video_max_pixels 16384 over two 3-frame clips of 48x64: 8192 each, under their 3 x 64 x 64 -> 32x32 frames;
    one clip alone keeps 64x64 (12288 <= 16384)."""
    two = video_processor(text="<|video|><|video|>", videos=[str(VIDEO)] * 2, media_kwargs={"max_frames": 3})
    assert two["grid_thw"][:, 0].tolist() == [2, 1]
    budget = {"video_max_pixels": 16384}
    shared = video_processor(text="<|video|><|video|>", videos=[str(VIDEO)] * 2, media_kwargs=budget)
    assert shared["grid_thw"].tolist() == [[3, 2, 2], [3, 2, 2]]
    alone = video_processor(text="<|video|>", videos=[str(VIDEO)], media_kwargs=budget)
    assert alone["grid_thw"].tolist() == [[3, 4, 4]]


def test_a_videos_own_values_never_lift_the_calls_max_frames(video_processor):
    """The call's max_frames (a server's: its checkpoint or --mm-process-config) caps the frames of one call; a video's
    own values (what a request asks) may lower it only. Above it: refused before the file is decoded, a whole clip
    and segments alike. Two videos asking 4 frames each under a cap of 4 get their shares, 2 each (the published
    rule's 12-frame clip at linspace(0, 11, 2) = 0, 11: stamped 0.0 and 2.75)."""
    cap = {"max_frames": 2}
    lifted = [
        {"video_path": str(VIDEO), "num_frames": 12, "max_frames": 12},
        {"video_path": str(VIDEO), "max_frames": 3},
        {"video_path": str(VIDEO), "segments": [[0.0, 3.0]], "video_fps": 4.0, "max_frames": 12},
    ]
    for video in lifted:
        refused = f"max_frames={video['max_frames']} is more than this server's max_frames=2"
        with pytest.raises(ValueError, match=refused):
            video_processor(text="<|video|>", videos=[video], media_kwargs=cap)
    asking_four = {"video_path": str(VIDEO), "num_frames": 4, "max_frames": 4}
    two = video_processor(text="<|video|><|video|>", videos=[asking_four] * 2, media_kwargs={"max_frames": 4})
    assert two["grid_thw"][:, 0].tolist() == [2, 2]
    assert stamps_of(video_processor, two["input_ids"]) == ["0.0", "2.8"] * 2
    lowered = video_processor(text="<|video|>", videos=[{"video_path": str(VIDEO), "max_frames": 2}])
    assert lowered["grid_thw"][:, 0].tolist() == [2]  # under the call's 256: honoured


def test_interleaved_media_keep_text_order(video_processor):
    text = "<|im_start|>user\nA<|image|>B<|video|>C<|image|>D<|im_end|>\n"
    inputs = video_processor(
        text=text,
        images=[str(ASSETS / "square_64.png"), str(ASSETS / "gradient_96x64.png")],
        videos=[str(VIDEO)],
    )
    assert inputs["grid_thw"].tolist() == [[1, 4, 4], [3, 4, 4], [1, 4, 6]]
    assert inputs["media_nums_per_sample"] == [3]
    decoded = video_processor.decode(inputs["input_ids"][0])
    assert decoded.startswith("<|im_start|>user\nA<|image_pad|>B<|vision_start|>")
    assert decoded.endswith("<|vision_end|>C<|image_pad|>D<|im_end|>\n")
    encoder_len = sum(t * h * w // 4 + t for t, h, w in inputs["grid_thw"].tolist())
    assert encoder_len == (4 + 1) + 3 * (4 + 1) + (6 + 1)
    counts = (~inputs["cross_attention_mask"][0, 0]).sum(-1)
    first_pad = int((inputs["input_ids"][0] == video_processor.image_pad_token_id).nonzero()[0])
    assert counts[:first_pad].eq(0).all() and counts[first_pad] == 1
    assert (counts[1:] >= counts[:-1]).all() and counts[-1] == 5
    assert inputs["cross_attention_mask"].dtype == torch.bool and inputs["cross_attention_mask"].shape[-1] == 5


def test_text_only_carries_one_blank_frame_no_token_sees(processor):
    inputs = processor(text="<|im_start|>user\nhello<|im_end|>\n")
    assert inputs["grid_thw"].tolist() == [[1, 8, 8]] and inputs["media_nums_per_sample"] == [1]
    assert inputs["pixel_values"].shape == (64, 768) and not inputs["pixel_values"].any()
    assert frame_token_count(processor, inputs) == 0
    assert inputs["cross_attention_mask"].shape[-1] == 1 and inputs["cross_attention_mask"].all()


def test_batch_is_left_padded_and_visibility_counts_only_own_frames(processor):
    inputs = processor(
        text=["<|image|>short", "a much longer prompt here <|image|><|image|>", "no media at all"],
        images=[str(ASSETS / "square_64.png")] * 3,
    )
    assert inputs["media_nums_per_sample"] == [1, 2, 1]
    assert inputs["grid_thw"].tolist() == [[1, 4, 4]] * 3 + [[1, 8, 8]]  # the blank frame in its sample's place
    assert inputs["attention_mask"][0, 0] == 0 and inputs["attention_mask"][:, -1].eq(1).all()
    counts = (~inputs["cross_attention_mask"][:, 0]).sum(-1)
    assert counts[0, -1] == 1 and counts[1, -1] == 2 and counts[0, 0] == 0 and counts[2].eq(0).all()
    assert inputs["cross_attention_mask"][:, 0][inputs["attention_mask"] == 0].all()  # padding sees nothing


@pytest.mark.parametrize(
    "kwargs, error, culprit",
    [
        (dict(text="<|image|>", images=["/nonexistent/cat.png"]), FileNotFoundError, "cat.png"),
        (dict(text="<|video|>", videos=["/nonexistent/clip.mp4"]), FileNotFoundError, "clip.mp4"),
        (dict(text="<|image|><|image|>", images=[str(ASSETS / "square_64.png")]), ValueError, "<|image|>"),
        (dict(text="no placeholder", images=[str(ASSETS / "square_64.png")]), ValueError, "1 image(s)"),
        (dict(text="<|video|>", videos=[{"frames": []}]), ValueError, "has none"),
        (dict(text="<|video|>", videos=[{"clip": "a.mp4"}]), ValueError, "video_path"),
        (dict(text="<|video|>"), ValueError, "<|video|>"),
        (dict(text="  "), ValueError, "non-empty text"),
        (dict(text="<|video|>", videos=[str(VIDEO)], media_kwargs={"video_max_pixels": 1}), ValueError, "any frame"),
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
