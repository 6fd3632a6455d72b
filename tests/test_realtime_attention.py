"""The attention core over a realtime session's row (`ForwardAttentionMetadata.encoder_rows` / `slot_major`):
whole pages of encoder slots in front of the text, more than its vision tokens need, vision tokens slot-major
(`kv_layout.slot_major_vision_addresses`), in one batch with ordinary (band-major) requests.

With a frame window a session's rows also have a lower bound: rows before a step's new frame still see the older
frames, rows from it on see a later window start (`ForwardAttentionMetadata.cross_lower`).

Oracle: the dense reference over K/V copied out of the storage by the layout rules (`support.attention`), fp32.
"""

import pytest
import torch

from mossvl_ascend.attention.kv_layout import slot_major_vision_addresses
from support.attention import (
    Request,
    batch_metadata,
    build_session_batch,
    reference_cross_extend,
    reference_self_extend,
    run_core_layer,
)
from support.simulated_npu import npu_attention_on_cpu

REQUESTS = [
    # a session step: 3 frames of 5 tokens, 175 cached rows, 10 new rows seeing 2 then 3 frames
    Request(spans=[5, 5, 5], prefix_len=175, extend_len=10, visible_frame_counts=[0] * 175 + [2] * 8 + [3, 3]),
    # an ordinary request beside it
    Request(spans=[4, 4], prefix_len=0, extend_len=6, visible_frame_counts=[0, 1, 1, 2, 2, 2]),
    # a session in decode: one row after its cached text, every frame visible
    Request(spans=[5, 5], prefix_len=40, extend_len=1, visible_frame_counts=[2] * 41),
]
SESSION = [True, False, True]


# A frame window: each session row sees frames [first, visible).
WINDOWED = [
    # a step whose rows see frames 1-2, then (from its new frame on) 2-3
    Request(
        spans=[5, 5, 5, 5],
        prefix_len=175,
        extend_len=10,
        visible_frame_counts=[0] * 175 + [3] * 8 + [4, 4],
        first_visible_frames=[0] * 175 + [1] * 8 + [2, 2],
    ),
    Request(spans=[4, 4], prefix_len=0, extend_len=6, visible_frame_counts=[0, 1, 1, 2, 2, 2]),
    # a session in decode: every frame but the first two
    Request(spans=[5, 5, 5], prefix_len=40, extend_len=1, visible_frame_counts=[3] * 41, first_visible_frames=[2] * 41),
    # a long step (more rows than a leaf: a staircase, were it not windowed)
    Request(
        spans=[5, 6, 5, 7],
        prefix_len=3,
        extend_len=200,
        visible_frame_counts=[0] * 3 + [1] * 50 + [2] * 50 + [3] * 50 + [4] * 50,
        first_visible_frames=[0] * 103 + [1] * 50 + [2] * 50,
    ),
]
WINDOWED_SESSION = [True, False, True, True]


@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("bands", [1, 3])
def test_windowed_session_rows_see_only_their_window(page_size, bands):
    batch, encoder_rows = build_session_batch(
        WINDOWED, WINDOWED_SESSION, 4, 2, 16, torch.float32, page_size, bands, True
    )
    metadata = batch_metadata(batch).with_encoder_rows(encoder_rows, WINDOWED_SESSION)
    assert metadata.cross_lower is not None
    out = run_core_layer(batch, metadata, True, page_size=page_size)
    torch.testing.assert_close(out, reference_cross_extend(batch, 16**-0.5), rtol=1e-5, atol=1e-5)


def test_windowed_session_rows_on_the_npu_primitive(monkeypatch):
    """The same through the NPU's lengths-taking primitive (the STAND-IN FIA) in fp16: the window is a mask."""
    batch, encoder_rows = build_session_batch(WINDOWED, WINDOWED_SESSION, 4, 2, 16, torch.float16, 128, 3, True)
    metadata = batch_metadata(batch).with_encoder_rows(encoder_rows, WINDOWED_SESSION)
    with npu_attention_on_cpu(monkeypatch) as calls:
        out = run_core_layer(batch, metadata, True, page_size=128)
    assert calls and any(call.get("atten_mask") is not None for call in calls)
    reference = reference_cross_extend(batch, 16**-0.5)
    torch.testing.assert_close(out.float(), reference.float(), rtol=1e-2, atol=1e-2)


def test_a_window_ignored_reads_evicted_frames():
    """The window test can fail: without the lower bounds the session rows see the frames before their window."""
    batch, encoder_rows = build_session_batch(WINDOWED, WINDOWED_SESSION, 4, 2, 16, torch.float32, 16, 3, True)
    metadata = batch_metadata(batch).with_encoder_rows(encoder_rows, WINDOWED_SESSION).with_lower_bounds([None] * 4)
    out = run_core_layer(batch, metadata, True, page_size=16)
    reference = reference_cross_extend(batch, 16**-0.5)
    for index in (0, 2, 3):
        rows = batch.query_rows(index)
        assert not torch.allclose(out[rows], reference[rows], atol=1e-3), index


@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("bands", [1, 3])
@pytest.mark.parametrize("cross", [True, False], ids=["cross", "self"])
def test_session_rows_read_their_own_keys(page_size, bands, cross):
    batch, encoder_rows = build_session_batch(REQUESTS, SESSION, 4, 2, 16, torch.float32, page_size, bands, cross)
    metadata = batch_metadata(batch).with_encoder_rows(encoder_rows, SESSION)
    out = run_core_layer(batch, metadata, cross, page_size=page_size)
    reference = (reference_cross_extend if cross else reference_self_extend)(batch, batch.query.shape[-1] ** -0.5)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cross", [True, False], ids=["cross", "self"])
def test_the_default_rows_read_other_keys(cross):
    """The test above can fail: read with the pool's default rows (ceil(E / bands), band-major) a session's rows
    see the wrong keys."""
    batch, _ = build_session_batch(REQUESTS, SESSION, 4, 2, 16, torch.float32, 16, 3, cross)
    out = run_core_layer(batch, batch_metadata(batch), cross, page_size=16)
    reference = (reference_cross_extend if cross else reference_self_extend)(batch, batch.query.shape[-1] ** -0.5)
    rows = batch.query_rows(0)
    assert not torch.allclose(out[rows], reference[rows], atol=1e-3)


def test_slot_major_addresses_do_not_move_when_the_encoder_grows():
    row = torch.tensor([40, 41, 42, 43, 90, 91, 92, 93])
    before = slot_major_vision_addresses(row[:4], 10, 3, 1000)
    after = slot_major_vision_addresses(row, 17, 3, 1000)
    assert after[:10].tolist() == before.tolist()
    assert before.tolist() == [40, 1040, 2040, 41, 1041, 2041, 42, 1042, 2042, 43]
