"""Encoder-prefix radix keys depend on the media AND their vision positions (real sglang MossVL + items).

The end-to-end consequence (same images at another text position on a warm server must still equal the
reference model) is checked in tests/test_serving.py; here the key itself is pinned.
"""

from array import array

import pytest
import torch

from support.hooks import patches_applied


@pytest.fixture(scope="module")
def hooked():
    from sglang.srt.models.moss_vl import MossVLForConditionalGeneration

    from mossvl_ascend.patches import encoder_cache_key

    with patches_applied(*encoder_cache_key.PATCHES):
        model = object.__new__(MossVLForConditionalGeneration)  # pad helpers read only these two attributes
        torch.nn.Module.__init__(model)
        model.spatial_merge_size = 2
        model.vision_seq_pad_multiple = 1
        yield model


def mm_inputs(pixel_seed: int, vision_position_ids):
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, MultimodalInputs

    generator = torch.Generator().manual_seed(pixel_seed)
    item = MultimodalDataItem(modality=Modality.IMAGE, feature=torch.rand(16, 768, generator=generator))
    item.set("grid_thw", torch.tensor([[1, 4, 4]]))
    item.set_pad_value()
    return MultimodalInputs(mm_items=[item], vision_position_ids=vision_position_ids)


def positions(text_offset: int) -> torch.Tensor:
    return torch.arange(5).repeat(3, 1) + text_offset  # 4 vision tokens + separator, (3, encoder_len)


def image_positions(offset: int, rows: int, cols: int) -> torch.Tensor:
    """XRoPE-like (t, h, w) positions of one image's rows x cols merged tokens and its separator, from ``offset``."""
    t = torch.full((rows * cols + 1,), offset)
    h = torch.cat([torch.arange(rows).repeat_interleave(cols), torch.tensor([rows])]) + offset
    w = torch.cat([torch.arange(cols).repeat(rows), torch.tensor([cols])]) + offset
    return torch.stack([t, h, w])


def two_images(first_offset: int, text_between: int, later_grid=(2, 2)) -> torch.Tensor:
    """Two 4-token images: the first at ``first_offset``, the later one ``text_between`` text tokens after it."""
    first = image_positions(first_offset, 2, 2)
    later = image_positions(first_offset + first.shape[1] + text_between, *later_grid)
    return torch.cat([first, later], dim=1)


def test_same_media_same_positions_share_a_key(hooked):
    a = hooked.pad_input_ids(array("q", [7, 8]), mm_inputs(0, positions(3)))
    b = hooked.pad_input_ids(array("q", [7, 8]), mm_inputs(0, positions(3)))
    assert list(a) == list(b)
    assert len(a) == 5 + 2 and list(a[-2:]) == [7, 8]


def test_same_media_at_other_positions_get_another_key(hooked):
    a = hooked.pad_input_ids(array("q", [7, 8]), mm_inputs(0, positions(3)))
    b = hooked.pad_input_ids(array("q", [7, 8]), mm_inputs(0, positions(9)))
    assert a[0] != b[0]


def test_same_images_with_other_text_between_them_get_another_key(hooked):
    """The first image sits where it sat; only the later one moved: every vision position is in the key, not the
    first one alone (a key of the first position would reuse the later image's keys rotated for its old place)."""
    a = hooked.pad_input_ids(array("q", [7]), mm_inputs(0, two_images(3, text_between=2)))
    b = hooked.pad_input_ids(array("q", [7]), mm_inputs(0, two_images(3, text_between=6)))
    assert a[0] != b[0]


def test_same_images_with_the_later_one_laid_out_otherwise_get_another_key(hooked):
    """Same media, same offsets, same encoder length: the later image's rows and columns (2x2 vs 1x4) differ."""
    a = hooked.pad_input_ids(array("q", [7]), mm_inputs(0, two_images(3, text_between=2, later_grid=(2, 2))))
    b = hooked.pad_input_ids(array("q", [7]), mm_inputs(0, two_images(3, text_between=2, later_grid=(1, 4))))
    assert len(a) == len(b)
    assert a[0] != b[0]


def test_other_media_at_same_positions_get_another_key(hooked):
    a = hooked.pad_input_ids(array("q", [7]), mm_inputs(0, positions(3)))
    b = hooked.pad_input_ids(array("q", [7]), mm_inputs(1, positions(3)))
    assert a[0] != b[0]


def test_without_positions_the_stock_key_is_kept(hooked):
    inputs = mm_inputs(0, None)
    padded = hooked.pad_input_ids(array("q", [7]), inputs)
    assert list(padded[:5]) == [inputs.mm_items[0].pad_value] * 5
