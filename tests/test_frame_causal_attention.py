"""Frame-causal cross-attention from per-row boundaries (issue 7) against independent oracles.

Oracles: a dense fp64 attention with an explicit bool visibility matrix and an explicit softmax;
a closed-form case (equal logits, so each row's output is the mean of the values it sees); a
packed mask built here by a plain per-row/per-frame loop from the documented format (uint8,
1 = visible, row-major ``[extend_seq_len x encoder_len]`` per request, batch order); and stock
sglang's own ``MossVLForConditionalGeneration._build_cross_attention_custom_mask``.
"""

from types import SimpleNamespace

import pytest
import torch

from mossvl_ascend.attention.blocks import (
    encoder_boundaries_from_packed_mask,
    encoder_boundaries_from_visible_frames,
    frame_causal_cross_attention,
    frame_ends_from_grid_thw,
    plan_frame_causal_blocks,
)

MERGE = 2


def dense_reference(q, k, v, visible, scale, logit_cap=0.0):
    """fp64 attention; ``visible`` bool [L, S] True = attend; rows seeing nothing give zeros."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    logits = torch.einsum("hld,hsd->hls", q, k) * scale
    if logit_cap > 0:
        logits = logit_cap * torch.tanh(logits / logit_cap)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for row in range(q.shape[1]):
        keys = visible[row].nonzero().flatten()
        if keys.numel() == 0:
            continue
        row_logits = logits[:, row, keys]
        weights = torch.exp(row_logits - row_logits.max(dim=-1, keepdim=True).values)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out[:, row] = torch.einsum("hn,hnd->hd", weights, v[:, keys])
    return out


def visibility_of(boundaries, kv_len):
    """Explicit bool [L, S]: row r sees key j iff j < boundaries[r]."""
    visible = torch.zeros(len(boundaries), kv_len, dtype=torch.bool)
    for row, boundary in enumerate(boundaries.tolist()):
        visible[row, :boundary] = True
    return visible


def video_prompt_boundaries(num_frames, tokens_per_frame, rows_per_frame, question_rows):
    """Rows after frame f see frames 0..f; the question sees all (sorted, long runs)."""
    per_frame = [(f + 1) * tokens_per_frame for f in range(num_frames) for _ in range(rows_per_frame)]
    return torch.tensor(per_frame + [num_frames * tokens_per_frame] * question_rows)


def random_qkv(num_heads, num_kv_heads, q_len, kv_len, head_dim, generator, v_dim=None):
    q = torch.randn(num_heads, q_len, head_dim, generator=generator)
    k = torch.randn(num_kv_heads, kv_len, head_dim, generator=generator)
    v = torch.randn(num_kv_heads, kv_len, v_dim or head_dim, generator=generator)
    return q, k, v


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("logit_cap", [0.0, 2.0])
def test_random_unsorted_boundaries_match_dense_reference(num_heads, num_kv_heads, logit_cap):
    gen = torch.Generator().manual_seed(7)
    q_len, kv_len, head_dim = 57, 83, 16
    q, k, v = random_qkv(num_heads, num_kv_heads, q_len, kv_len, head_dim, gen)
    q *= 3.0  # large logits so the softcap changes the result visibly
    boundaries = torch.randint(0, kv_len + 1, (q_len,), generator=gen)
    boundaries[:4] = torch.tensor([0, kv_len, 1, kv_len - 1])
    boundaries[10:20] = 31  # a run inside an unsorted sequence
    assert not bool((boundaries[1:] >= boundaries[:-1]).all())
    scale = head_dim**-0.5

    out = frame_causal_cross_attention(q, k, v, boundaries, scale, logit_cap=logit_cap)

    ref = dense_reference(q, k, v, visibility_of(boundaries, kv_len), scale, logit_cap)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    assert out[:, boundaries == 0].abs().max() == 0
    if logit_cap > 0:
        uncapped = dense_reference(q, k, v, visibility_of(boundaries, kv_len), scale)
        assert (ref - uncapped).abs().max() > 1e-2


def coverage_of(plan, kv_len):
    """How many plan blocks cover each (sorted row, key) pair."""
    count = torch.zeros(len(plan.sorted_boundaries), kv_len, dtype=torch.int64)
    for block in plan.blocks:
        rows = slice(block.row_start, block.row_end)
        keys = torch.arange(block.key_start, block.key_end)
        seen = (
            keys[None, :] < plan.sorted_boundaries[rows, None] if block.masked else torch.ones(1, 1, dtype=torch.bool)
        )
        count[rows, block.key_start : block.key_end] += seen.to(torch.int64)
    return count


@pytest.mark.parametrize("leaf_rows", [1, 4, 16, 10_000])
def test_plan_blocks_cover_every_visible_pair_exactly_once(leaf_rows):
    gen = torch.Generator().manual_seed(1)
    boundaries = torch.cat([video_prompt_boundaries(20, 5, 3, 17), torch.randint(0, 101, (40,), generator=gen)])
    plan = plan_frame_causal_blocks(boundaries, leaf_rows=leaf_rows)
    assert torch.equal(plan.sorted_boundaries, boundaries.sort(stable=True).values)
    assert torch.equal(boundaries[plan.order], plan.sorted_boundaries)
    assert plan_frame_causal_blocks(plan.sorted_boundaries).order is None
    expected = visibility_of(plan.sorted_boundaries, 100).to(torch.int64)
    assert torch.equal(coverage_of(plan, 100), expected)
    if leaf_rows == 10_000:
        assert len(plan.blocks) == 1 and plan.blocks[0].masked


@pytest.mark.parametrize("logit_cap", [0.0, 5.0])
@pytest.mark.parametrize("leaf_rows", [1, 6, 10_000])
def test_video_prompt_is_exact_for_every_leaf_size(logit_cap, leaf_rows):
    """Leaf size only picks the blocks; many unmasked blocks merged through the sink, masked
    leaves, or one masked block for everything must all give the dense result."""
    gen = torch.Generator().manual_seed(3)
    boundaries = video_prompt_boundaries(num_frames=12, tokens_per_frame=5, rows_per_frame=3, question_rows=40)
    boundaries = torch.cat([torch.zeros(2, dtype=torch.int64), boundaries])  # text before the video
    kv_len = 60
    q, k, v = random_qkv(8, 2, len(boundaries), kv_len, 8, gen, v_dim=12)
    q *= 2.0
    plan = plan_frame_causal_blocks(boundaries, leaf_rows=leaf_rows)
    assert (len(plan.blocks) > 1) == (leaf_rows < 10_000)

    out = frame_causal_cross_attention(q, k, v, boundaries, 0.3, logit_cap=logit_cap, plan=plan)

    ref = dense_reference(q, k, v, visibility_of(boundaries, kv_len), 0.3, logit_cap)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    assert out[:, :2].abs().max() == 0


@pytest.mark.parametrize(
    "boundaries,masked",
    [
        (torch.tensor([0, 0] + [40] * 30), False),  # one image after some text: one run
        (torch.tensor([0] + [38] * 3 + [40] * 30), True),  # a short video, nearly all visible
    ],
)
def test_nearly_all_visible_is_one_block(boundaries, masked):
    gen = torch.Generator().manual_seed(4)
    q, k, v = random_qkv(4, 2, len(boundaries), 40, 8, gen)
    plan = plan_frame_causal_blocks(boundaries)
    assert [(b.row_start, b.key_end, b.masked) for b in plan.blocks] == [(int((boundaries == 0).sum()), 40, masked)]
    out = frame_causal_cross_attention(q, k, v, boundaries, 0.4, plan=plan)
    ref = dense_reference(q, k, v, visibility_of(boundaries, 40), 0.4)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_single_row_runs_are_exact():
    """Many one-row runs (a streaming prompt) with the default leaf size."""
    gen = torch.Generator().manual_seed(11)
    boundaries = torch.arange(1, 301)
    q, k, v = random_qkv(2, 1, 300, 300, 8, gen)
    out = frame_causal_cross_attention(q, k, v, boundaries, 0.5)
    ref = dense_reference(q, k, v, visibility_of(boundaries, 300), 0.5)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_logits_far_above_the_first_keys_merge_exactly():
    """Later keys' logits ~400 above the first keys': the LSE merge must weigh the blocks exactly, no inf/NaN."""
    gen = torch.Generator().manual_seed(2)
    kv_len, rows = 200, 60
    q = torch.randn(2, rows, 8, generator=gen) * 0.1
    q[..., 0] = 10.0
    k = torch.randn(1, kv_len, 8, generator=gen) * 0.1
    k[0, :64, 0] = -20.0  # first keys: logits about -200; the rest about +200
    k[0, 64:, 0] = 20.0
    v = torch.randn(1, kv_len, 4, generator=gen)
    boundaries = torch.randint(1, kv_len + 1, (rows,), generator=gen)
    plan = plan_frame_causal_blocks(boundaries, leaf_rows=4)
    assert len(plan.blocks) > 1
    out = frame_causal_cross_attention(q, k, v, boundaries, 1.0, plan=plan)
    ref = dense_reference(q, k, v, visibility_of(boundaries, kv_len), 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_boundary_is_exclusive_and_true_means_visible():
    """Equal logits: each row's output is the mean of values[0:boundary]. Reading one key too
    many or too few, or treating the boundary as the masked side, gives another number."""
    kv_len = 10
    q = torch.zeros(2, 6, 4)
    k = torch.randn(1, kv_len, 4)
    v = torch.arange(kv_len, dtype=torch.float32).reshape(1, kv_len, 1)
    boundaries = torch.tensor([3, 1, 10, 0, 7, 3])
    out = frame_causal_cross_attention(q, k, v, boundaries, 1.0)
    expected = torch.tensor([1.0, 0.0, 4.5, 0.0, 3.0, 1.0])
    torch.testing.assert_close(out[0, :, 0], expected)
    torch.testing.assert_close(out[1, :, 0], expected)


def test_empty_encoder_gives_zeros_not_nan():
    q = torch.randn(4, 5, 8)
    k = torch.zeros(2, 0, 8)
    v = torch.zeros(2, 0, 8)
    out = frame_causal_cross_attention(q, k, v, torch.zeros(5, dtype=torch.int32), 0.35, logit_cap=3.0)
    assert out.shape == (4, 5, 8)
    assert out.abs().max() == 0


def test_boundary_beyond_encoder_raises():
    q, k, v = random_qkv(2, 2, 3, 4, 8, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="beyond encoder length"):
        frame_causal_cross_attention(q, k, v, torch.tensor([1, 5, 2]), 1.0)


def test_frame_ends_from_grid_thw():
    # image 4x6 patches -> 6 tokens + sep; video of 3 frames 8x8 -> 16 + sep each
    grid = torch.tensor([[1, 4, 6], [3, 8, 8]])
    assert frame_ends_from_grid_thw(grid, MERGE).tolist() == [7, 24, 41, 58]
    assert frame_ends_from_grid_thw(torch.tensor([2, 2, 2]), MERGE).tolist() == [2, 4]


def packed_mask_by_loop(requests):
    """The documented packed format, written out one row and one frame at a time.

    Each request: dict(grid_thw, visible_frame_counts, prefix_len, q_len, kv_len).
    """
    parts = []
    for req in requests:
        q_len, kv_len = req["q_len"], req["kv_len"]
        if q_len == 0 or kv_len == 0:
            continue
        frames = []
        cursor = 0
        for t, h, w in req["grid_thw"]:
            for _ in range(t):
                span = h * w // (MERGE * MERGE) + 1
                frames.append((cursor, cursor + span))
                cursor += span
        block = torch.zeros(q_len, kv_len, dtype=torch.uint8)
        for row in range(q_len):
            count = int(req["visible_frame_counts"][req["prefix_len"] + row])
            for f, (start, end) in enumerate(frames):
                if f < count:
                    block[row, start : min(end, kv_len)] = 1
        parts.append(block.flatten())
    return torch.cat(parts)


def stock_packed_mask(requests):
    """stock sglang's own builder on a minimal forward batch carrying the same requests."""
    from sglang.srt.models.moss_vl import MossVLForConditionalGeneration

    mm_inputs = [
        SimpleNamespace(
            visible_frame_counts=req["visible_frame_counts"],
            mm_items=[SimpleNamespace(grid_thw=torch.tensor(req["grid_thw"]))],
        )
        for req in requests
    ]
    forward_batch = SimpleNamespace(
        batch_size=len(requests),
        encoder_lens_cpu=[req["kv_len"] for req in requests],
        extend_seq_lens_cpu=[req["q_len"] for req in requests],
        extend_prefix_lens_cpu=[req["prefix_len"] for req in requests],
        mm_inputs=mm_inputs,
        seq_lens=torch.zeros(len(requests), dtype=torch.int64),
    )
    model = SimpleNamespace(spatial_merge_size=MERGE)
    return MossVLForConditionalGeneration._build_cross_attention_custom_mask(model, forward_batch)


def batch_of_requests():
    gen = torch.Generator().manual_seed(5)

    def counts(text_len, num_frames):
        return torch.randint(0, num_frames + 2, (text_len,), generator=gen).sort().values.to(torch.int32)

    return [
        # video of 4 frames after an image; cached text prefix of 5 rows
        dict(
            grid_thw=[[1, 4, 6], [4, 4, 4]],
            visible_frame_counts=counts(20, 5),
            prefix_len=5,
            q_len=11,
            kv_len=7 + 4 * 5,
        ),
        # no new rows: contributes nothing
        dict(grid_thw=[[2, 2, 2]], visible_frame_counts=counts(6, 2), prefix_len=6, q_len=0, kv_len=4),
        # unsorted counts, no prefix
        dict(
            grid_thw=[[3, 4, 4]],
            visible_frame_counts=torch.tensor([3, 0, 1, 2, 0, 3, 4], dtype=torch.int32),
            prefix_len=0,
            q_len=7,
            kv_len=15,
        ),
        # encoder shorter than the frames (stock clamps frame ranges to kv_len)
        dict(grid_thw=[[3, 4, 4]], visible_frame_counts=counts(9, 3), prefix_len=2, q_len=6, kv_len=12),
    ]


def split_packed(packed, requests):
    """Per-request [q_len * kv_len] slices at running offsets, skipping empty requests."""
    slices, offset = [], 0
    for req in requests:
        size = req["q_len"] * req["kv_len"]
        slices.append(packed[offset : offset + size] if size else None)
        offset += size
    assert offset == packed.numel()
    return slices


def boundaries_from_counts(req):
    rows = req["visible_frame_counts"][req["prefix_len"] : req["prefix_len"] + req["q_len"]]
    frame_ends = frame_ends_from_grid_thw(torch.tensor(req["grid_thw"]), MERGE)
    return encoder_boundaries_from_visible_frames(rows, frame_ends, req["kv_len"])


def test_loop_built_mask_agrees_with_stock_builder():
    requests = batch_of_requests()
    assert torch.equal(packed_mask_by_loop(requests), stock_packed_mask(requests))


def test_boundaries_from_visible_counts_equal_packed_mask_boundaries():
    requests = batch_of_requests()
    packed = packed_mask_by_loop(requests)
    for req, mask_slice in zip(requests, split_packed(packed, requests)):
        if mask_slice is None:
            continue
        from_counts = boundaries_from_counts(req)
        from_mask = encoder_boundaries_from_packed_mask(mask_slice, req["q_len"], req["kv_len"])
        assert from_counts.dtype == from_mask.dtype == torch.int32
        assert torch.equal(from_counts, from_mask)
        # and each boundary reproduces its mask row exactly
        assert torch.equal(visibility_of(from_counts, req["kv_len"]), mask_slice.view(req["q_len"], -1).bool())


def test_packed_mask_path_matches_dense_attention_per_request():
    gen = torch.Generator().manual_seed(9)
    requests = batch_of_requests()
    packed = packed_mask_by_loop(requests)
    for req, mask_slice in zip(requests, split_packed(packed, requests)):
        if mask_slice is None:
            continue
        q, k, v = random_qkv(8, 2, req["q_len"], req["kv_len"], 16, gen)
        boundaries = encoder_boundaries_from_packed_mask(mask_slice, req["q_len"], req["kv_len"])
        out = frame_causal_cross_attention(q, k, v, boundaries, 0.25)
        visible = mask_slice.view(req["q_len"], req["kv_len"]).bool()
        torch.testing.assert_close(out.double(), dense_reference(q, k, v, visible, 0.25), atol=2e-5, rtol=1e-5)


def test_non_prefix_packed_mask_raises():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        encoder_boundaries_from_packed_mask(mask.flatten(), 3, 4)
    suffix = torch.tensor([[0, 0, 1, 1]], dtype=torch.uint8)  # inverted polarity of a prefix
    with pytest.raises(ValueError):
        encoder_boundaries_from_packed_mask(suffix.flatten(), 1, 4)
    with pytest.raises(ValueError, match="expected q_len"):
        encoder_boundaries_from_packed_mask(mask.flatten(), 2, 4)


def test_counts_beyond_frames_and_zero():
    frame_ends = torch.tensor([7, 24, 41])
    counts = torch.tensor([0, 1, 3, 9, 2])
    assert encoder_boundaries_from_visible_frames(counts, frame_ends).tolist() == [0, 7, 41, 41, 24]
    assert encoder_boundaries_from_visible_frames(counts, frame_ends, encoder_len=30).tolist() == [0, 7, 30, 30, 24]
    assert encoder_boundaries_from_visible_frames(counts, torch.zeros(0, dtype=torch.int64)).tolist() == [0] * 5


def test_bfloat16_inputs_merge_in_float32():
    """Half-precision q/k/v (the NPU's usual dtype): blocks still merge to the dense result
    within bf16 rounding, and the output keeps the input dtype."""
    gen = torch.Generator().manual_seed(8)
    boundaries = video_prompt_boundaries(num_frames=30, tokens_per_frame=5, rows_per_frame=4, question_rows=20)
    q, k, v = random_qkv(4, 2, len(boundaries), 150, 16, gen)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    plan = plan_frame_causal_blocks(boundaries, leaf_rows=8)
    assert len(plan.blocks) > 1
    out = frame_causal_cross_attention(q, k, v, boundaries, 0.25, plan=plan)
    assert out.dtype == torch.bfloat16
    ref = dense_reference(q, k, v, visibility_of(boundaries, 150), 0.25)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
