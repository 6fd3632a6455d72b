"""Stock sglang's NPU implementations on the MOSS-VL route, run on CPU through the STAND-IN torch_npu (issue 20,
items 2 and 3).

Each NPU branch (``forward_npu``, ``apply_rotary_pos_emb_npu``, ``VisionAscendAttention``, the ascend sampler, the
NPU KV pool) runs on CPU tensors with the stand-in ops of tests/fake_torch_npu.py, in bf16 and fp16, at the tiny
checkpoint's shapes and at MOSS-VL-Instruct's. Oracles: fp64 references written from the formulas
(support/npu_layers.py). Budget: the NPU branch's error against fp64 stays within the error the CPU branch
(``forward_native`` / SDPA) makes in the same dtype on the same rounded inputs (x 1.5, plus one unit of the dtype's
resolution for ops whose two branches round at different points). The stand-ins are checked against the same
oracles, and shown refusing what the torch_npu pages exclude.
"""

from __future__ import annotations

import pytest
import torch

from fake_torch_npu import build_fake_modules
from support.npu_layers import (
    NPU_DTYPES,
    ascend_vision_attention,
    max_abs_error,
    mrope_fp64,
    rms_norm_fp64,
    rotate_half_fp64,
    silu_and_mul_fp64,
    stock_moss_vl,
    stock_npu_branches,
    varlen_attention_fp64,
)

# (query heads, kv heads, head_dim, hidden, intermediate, mrope_section, vision heads, vision head_dim)
SHAPES = {
    "tiny": dict(heads=4, kv_heads=2, head_dim=32, hidden=128, intermediate=256, section=[6, 5, 5], vheads=4, vdim=16),
    "instruct": dict(
        heads=32, kv_heads=8, head_dim=128, hidden=4096, intermediate=12288, section=[24, 20, 20], vheads=16, vdim=72
    ),
}
SHAPE = pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
ROPE_THETA = 5_000_000.0
EPS = 1e-6


def resolution(dtype) -> float:
    """One unit in the last place at magnitude 1."""
    return torch.finfo(dtype).eps


def within_budget(npu_error, native_error, dtype, scale=1.0):
    return npu_error <= 1.5 * native_error + resolution(dtype) * scale


def randn(*shape, dtype, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)


@pytest.fixture
def npu():
    with stock_npu_branches() as (fake, mp):
        yield fake, mp


@pytest.fixture
def fake():
    return build_fake_modules()["torch_npu"]


# ------------------------------------------------------------------------------------------ the stand-in ops


@NPU_DTYPES
def test_stand_in_rms_norms_match_fp64_and_refuse_what_the_op_refuses(fake, dtype):
    x, residual, weight = randn(6, 64, dtype=dtype), randn(6, 64, dtype=dtype, seed=1), randn(64, dtype=dtype, seed=2)
    y, rstd = fake.npu_rms_norm(x, weight, EPS)
    assert y.dtype == dtype and rstd.dtype == torch.float32 and rstd.shape == (6, 1)
    assert max_abs_error(y, rms_norm_fp64(x, weight, EPS)) <= 4 * resolution(dtype) * weight.abs().max().item() * 4
    y, _, total = fake.npu_add_rms_norm(residual, x, weight, EPS)
    expected, expected_total = rms_norm_fp64(x, weight, EPS, residual)
    assert max_abs_error(total, expected_total) <= resolution(dtype) * expected_total.abs().max().item()
    assert max_abs_error(y, expected) <= 8 * resolution(dtype) * expected.abs().max().item()
    with pytest.raises(ValueError, match="2-8"):
        fake.npu_rms_norm(x[0], weight, EPS)
    with pytest.raises(ValueError, match="gamma dtype"):
        fake.npu_rms_norm(x, weight.float(), EPS)
    with pytest.raises(ValueError, match="dtypes"):
        fake.npu_add_rms_norm(residual.float(), x, weight, EPS)


@NPU_DTYPES
def test_stand_in_swiglu_matches_fp64_and_refuses_non_contiguous_and_odd_input(fake, dtype):
    x = randn(5, 96, dtype=dtype)
    expected = silu_and_mul_fp64(x)
    assert max_abs_error(fake.npu_swiglu(x), expected) <= resolution(dtype) * expected.abs().max().item()
    with pytest.raises(ValueError, match="non-contiguous"):
        fake.npu_swiglu(x.T.contiguous().T)
    with pytest.raises(ValueError, match="odd"):
        fake.npu_swiglu(x[:, :95].contiguous())
    with pytest.raises(ValueError, match="shape"):
        fake.npu_swiglu(x[:0])


@NPU_DTYPES
def test_stand_in_rotary_mul_matches_fp64_in_both_modes_and_refuses_mixed_dtypes(fake, dtype):
    x = randn(1, 7, 3, 16, dtype=dtype)
    angle = randn(1, 7, 1, 16, dtype=torch.float64, seed=1)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    half = rotate_half_fp64(x[0], cos[0, :, 0], sin[0, :, 0])
    assert max_abs_error(fake.npu_rotary_mul(x, cos, sin)[0], half) <= 2 * resolution(dtype) * 4
    first, second = x.double()[..., ::2], x.double()[..., 1::2]
    interleaved = x.double() * cos.double() + torch.stack((-second, first), -1).flatten(-2) * sin.double()
    assert max_abs_error(fake.npu_rotary_mul(x, cos, sin, "interleave"), interleaved) <= 2 * resolution(dtype) * 4
    with pytest.raises(ValueError, match="differ from input"):
        fake.npu_rotary_mul(x, cos.float(), sin.float())
    with pytest.raises(ValueError, match="dims"):
        fake.npu_rotary_mul(x[0], cos[0], sin[0])
    with pytest.raises(ValueError, match="layout"):
        fake.npu_rotary_mul(x, cos.expand(2, 7, 1, 16), sin.expand(2, 7, 1, 16))


def tnd_case(dtype, lengths=(5, 9, 9, 4), heads=4, kv_heads=2, dim=16):
    total = sum(lengths)
    q, k, v = (randn(total, h, dim, dtype=dtype, seed=s) for s, h in ((0, heads), (1, kv_heads), (2, kv_heads)))
    cu = torch.tensor([0, *lengths]).cumsum(0)
    return q, k, v, cu


@NPU_DTYPES
def test_stand_in_varlen_attention_matches_fp64_and_refuses_fp32_and_bad_lengths(fake, dtype):
    q, k, v, cu = tnd_case(dtype)
    ends = cu[1:].tolist()
    common = dict(actual_seq_lengths=ends, actual_seq_lengths_kv=ends, num_heads=4, num_key_value_heads=2)
    out, lse = fake.npu_fused_infer_attention_score(q, k, v, scale=0.25, input_layout="TND", **common)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (1,) and lse.item() == 0
    expected = varlen_attention_fp64(q, k, v, cu, 0.25)
    assert max_abs_error(out, expected) <= 2 * resolution(dtype)
    _, lse = fake.npu_fused_infer_attention_score(
        q, k, v, scale=0.25, input_layout="TND", softmax_lse_flag=True, **common
    )
    assert lse.shape == (q.shape[0], 4, 1) and lse.dtype == torch.float32
    with pytest.raises(ValueError, match="fp16/bf16"):
        fake.npu_fused_infer_attention_score(q.float(), k.float(), v.float(), input_layout="TND", **common)
    with pytest.raises(ValueError, match="actual_seq_lengths"):
        bad = dict(common, actual_seq_lengths=[5, 9, 9, 4], actual_seq_lengths_kv=[5, 9, 9, 4])
        fake.npu_fused_infer_attention_score(q, k, v, input_layout="TND", **bad)
    with pytest.raises(ValueError, match="GQA"):
        wide_q = randn(q.shape[0], 130, 16, dtype=dtype)
        fake.npu_fused_infer_attention_score(
            wide_q, k[:, :1].contiguous(), v[:, :1].contiguous(), input_layout="TND",
            **dict(common, num_heads=130, num_key_value_heads=1),
        )  # fmt: skip
    with pytest.raises(ValueError, match="contiguous"):
        fake.npu_fused_infer_attention_score(
            q.transpose(0, 1).contiguous().transpose(0, 1), k, v, input_layout="TND", **common
        )


def top_k_top_p_kept_fp64(logits, k, p):
    """The documented top-k then top-p filter in fp64, descending form: keep the k largest; of those keep the
    smallest prefix (by decreasing probability) whose mass reaches p, at least one token."""
    kept = torch.zeros(logits.shape, dtype=torch.bool)
    for row in range(logits.shape[0]):
        order = logits[row].double().argsort(descending=True, stable=True)
        top = order[: int(k[row])]
        probs = torch.softmax(logits[row].double()[top], dim=0)
        mass_before = probs.cumsum(0) - probs
        kept[row, top[mass_before < float(p[row])]] = True
    return kept


@NPU_DTYPES
def test_stand_in_top_k_top_p_keeps_the_documented_set_and_refuses_bad_k(fake, dtype):
    logits = randn(4, 300, dtype=dtype, scale=3.0)
    k = torch.tensor([1, 5, 300, 40], dtype=torch.int32)
    p = torch.tensor([0.9, 0.5, 0.3, 1.0], dtype=dtype)
    out = fake.npu_top_k_top_p(logits, p, k)
    assert out.dtype == dtype
    assert torch.equal(torch.isfinite(out), top_k_top_p_kept_fp64(logits, k, p))
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])
    with pytest.raises(ValueError, match="k values"):
        fake.npu_top_k_top_p(logits, p, torch.tensor([0, 5, 5, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="k values"):
        fake.npu_top_k_top_p(logits.repeat(1, 4), p, torch.tensor([1025, 5, 5, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="p "):
        fake.npu_top_k_top_p(logits, p.float() if dtype != torch.float32 else p.half(), k)


# ------------------------------------------------------------------------------------- stock layers, NPU branch


@NPU_DTYPES
@SHAPE
@pytest.mark.parametrize("width", ["hidden", "head_dim"])
def test_rms_norm_npu_branch_with_and_without_residual(npu, dtype, shape, width):
    """Decoder norms (``hidden``, with the residual the layer boundary passes) and q/k norms (``head_dim``)."""
    from sglang.srt.layers.layernorm import RMSNorm

    size = SHAPES[shape][width]
    norm = RMSNorm(size, eps=EPS).to(dtype)
    norm.weight.data = randn(size, dtype=dtype, seed=3) * 0.5 + 1
    x, residual = randn(9, size, dtype=dtype, seed=1, scale=3), randn(9, size, dtype=dtype, seed=2, scale=3)
    expected = rms_norm_fp64(x, norm.weight, EPS)
    scale = expected.abs().max().item()
    native, npu_out = norm.forward_native(x), norm.forward_npu(x)
    assert npu_out.dtype == dtype
    assert within_budget(max_abs_error(npu_out, expected), max_abs_error(native, expected), dtype, scale)

    expected, expected_total = rms_norm_fp64(x, norm.weight, EPS, residual)
    native, native_total = norm.forward_native(x.clone(), residual.clone())
    npu_out, npu_total = norm.forward_npu(x.clone(), residual.clone())
    assert npu_total.dtype == dtype
    scale = expected_total.abs().max().item()
    assert within_budget(
        max_abs_error(npu_total, expected_total), max_abs_error(native_total, expected_total), dtype, scale
    )
    # The fused op normalizes the sum rounded to the dtype, forward_native the fp32 sum: one extra rounding.
    scale = 2 * expected.abs().max().item()
    assert within_budget(max_abs_error(npu_out, expected), max_abs_error(native, expected), dtype, scale)


@NPU_DTYPES
@SHAPE
def test_silu_and_mul_npu_branch(npu, dtype, shape):
    from sglang.srt.layers.activation import SiluAndMul

    x = randn(7, 2 * SHAPES[shape]["intermediate"], dtype=dtype, scale=3)
    expected = silu_and_mul_fp64(x)
    act = SiluAndMul()
    native, npu_out = act.forward_native(x), act.forward_npu(x)
    assert npu_out.dtype == dtype and npu_out.shape == native.shape
    assert within_budget(max_abs_error(npu_out, expected), max_abs_error(native, expected), dtype)


def moss_vl_mrope(shape, dtype):
    from sglang.srt.layers.rotary_embedding import get_rope

    section = SHAPES[shape]["section"]
    head_dim = SHAPES[shape]["head_dim"]
    scaling = {"rope_type": "default", "mrope_section": section, "mrope_interleaved": True}
    return get_rope(head_dim, head_dim, 32768, ROPE_THETA, rope_scaling=scaling, dtype=dtype)


def xrope_positions(tokens, seed=0):
    """3 x T positions as MOSS-VL's processor makes them: text rows equal on the three axes, vision-ish rows
    spread over h and w (each axis differs, so a rotary that ignored the sections would rotate differently)."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(tokens).repeat(3, 1)
    positions[1, ::2] += torch.randint(0, 40, (len(range(0, tokens, 2)),), generator=gen)
    positions[2, 1::3] += torch.randint(0, 40, (len(range(1, tokens, 3)),), generator=gen)
    return positions


@NPU_DTYPES
@SHAPE
@pytest.mark.parametrize("tokens", [11, 3], ids=["prefill", "decode"])
def test_mrope_npu_branch_rotates_by_the_interleaved_sections(npu, dtype, shape, tokens):
    """MRotaryEmbedding.forward_npu with MOSS-VL's 3 x T positions (prefill and a 3-request decode step) against the
    fp64 interleaved MRoPE; the torch_npu rotary (``npu_mrope``) takes 1-D positions only, so stock must not call it
    here (the stand-in has no npu_mrope: a call would raise)."""
    rope = moss_vl_mrope(shape, dtype)
    dims = SHAPES[shape]
    positions = xrope_positions(tokens)
    q = randn(tokens, dims["heads"] * dims["head_dim"], dtype=dtype, seed=1)
    k = randn(tokens, dims["kv_heads"] * dims["head_dim"], dtype=dtype, seed=2)
    native_q, native_k = rope.forward_native(positions, q.clone(), k.clone())
    npu_q, npu_k = rope.forward_npu(positions, q.clone(), k.clone())
    for npu_out, native, x in ((npu_q, native_q, q), (npu_k, native_k, k)):
        expected = mrope_fp64(positions, x, dims["head_dim"], dims["section"], True, ROPE_THETA)
        assert within_budget(max_abs_error(npu_out, expected), max_abs_error(native, expected), dtype, 4)


@NPU_DTYPES
@SHAPE
def test_vision_rotary_npu_rotates_like_fp64_with_cos_in_the_query_dtype(npu, dtype, shape):
    """``apply_rotary_pos_emb_npu`` (torch_npu.npu_rotary_mul, BSND with 1S1D cos/sin) against fp64, given cos/sin
    in the query's dtype (what Qwen2.5-VL casts them to; see the next test for what MOSS-VL passes)."""
    from sglang.srt.layers.rotary_embedding.utils import apply_rotary_pos_emb_native_eager, apply_rotary_pos_emb_npu

    dims = SHAPES[shape]
    tokens, dim = 20, dims["vdim"]
    q, k = randn(tokens, dims["vheads"], dim, dtype=dtype), randn(tokens, dims["vheads"], dim, dtype=dtype, seed=1)
    angle = randn(tokens, dim // 2, dtype=torch.float64, seed=2, scale=20).repeat(1, 2)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    native = apply_rotary_pos_emb_native_eager(q, k, cos, sin)
    npu_out = apply_rotary_pos_emb_npu(q, k, cos, sin)
    for npu_x, native_x, x in zip(npu_out, native, (q, k)):
        expected = rotate_half_fp64(x, cos, sin)
        assert npu_x.dtype == dtype
        assert within_budget(max_abs_error(npu_x, expected), max_abs_error(native_x, expected), dtype, 4)


@pytest.fixture(scope="module")
def vision_towers(checkpoint):
    """Stock MossVL's vision tower with the tiny checkpoint's weights, by dtype."""
    return {dtype: stock_moss_vl(checkpoint, dtype).visual for dtype in (torch.bfloat16, torch.float32)}


def test_moss_vl_vision_tower_hands_fp32_cos_to_the_npu_rotary(npu, checkpoint, vision_towers):
    """BUG (stock 0.5.23, NPU only): MossVLVisionModel builds its rotary cos/sin in fp32 and VisionAttention hands
    them, with bf16 q/k, to ``torch_npu.npu_rotary_mul``, whose kernel takes cos/sin of x's dtype only
    (aclnnRotaryPositionEmbedding); Qwen2.5-VL casts them to the activations' dtype first. The stand-in refuses the
    call as the kernel documents; the patch ``mossvl_ascend.patches.vision_rotary`` casts them (next test)."""
    model = vision_towers[torch.bfloat16]
    pixels, grid = vision_inputs(checkpoint)
    from sglang.srt.layers.attention import vision
    from sglang.srt.layers.rotary_embedding import utils as rotary_utils

    _, mp = npu
    mp.setattr(vision, "apply_rotary_pos_emb", rotary_utils.apply_rotary_pos_emb_npu)
    with torch.no_grad(), pytest.raises(ValueError, match="r1/r2 dtypes torch.float32/torch.float32 differ"):
        model(pixels, grid_thw=grid)


def test_vision_rotary_patch_gives_the_npu_rotary_the_activation_dtype(npu, checkpoint, vision_towers):
    from sglang.srt.layers.attention import vision
    from sglang.srt.layers.rotary_embedding import utils as rotary_utils

    from mossvl_ascend.patches import vision_rotary
    from support.hooks import patches_applied

    model = vision_towers[torch.bfloat16]
    pixels, grid = vision_inputs(checkpoint)
    with torch.no_grad():
        native = model(pixels, grid_thw=grid)
        fp32 = vision_towers[torch.float32](pixels, grid_thw=grid)
        _, mp = npu
        mp.setattr(vision, "apply_rotary_pos_emb", rotary_utils.apply_rotary_pos_emb_npu)
        with patches_applied(*vision_rotary.PATCHES):
            patched = model(pixels, grid_thw=grid)
    scale = fp32.abs().max().item()
    assert within_budget(max_abs_error(patched, fp32), max_abs_error(native, fp32), torch.bfloat16, 8 * scale)


def frame_segments(shape):
    """Per-frame cu_seqlens of two images and a 3-frame video (MossVL cuts the vision attention at every frame)."""
    tokens = [16, 24, 36, 36, 36] if shape == "tiny" else [64, 96, 144, 144, 144]
    return torch.tensor([0, *tokens]).cumsum(0).to(torch.int32)


@NPU_DTYPES
@SHAPE
def test_vision_attention_ascend_backend_attends_within_each_frame(npu, dtype, shape):
    """``--mm-attention-backend ascend_attn`` (VisionAscendAttention -> FIA TND with cumulative per-frame lengths)
    against fp64 block-diagonal attention; the CPU backend (VisionSdpaAttention) gives the budget."""
    from sglang.srt.layers.attention.vision import VisionSdpaAttention, prepare_vision_attention_metadata

    _, mp = npu
    dims = SHAPES[shape]
    cu = frame_segments(shape)
    total, heads, dim = int(cu[-1]), dims["vheads"], dims["vdim"]
    q, k, v = (randn(total, heads, dim, dtype=dtype, seed=s) for s in range(3))
    kwargs = dict(head_dim=dim, num_heads=heads, num_kv_heads=heads, flatten_batch=True)
    metadata = prepare_vision_attention_metadata(cu, device="cpu")
    common = dict(bsz=1, seq_len=total, cu_seqlens=cu, forward_metadata=metadata)
    npu_out = ascend_vision_attention(mp, **kwargs)(q, k, v, **common)
    native = VisionSdpaAttention(**kwargs)(q, k, v, **common)
    expected = varlen_attention_fp64(q, k, v, cu, dim**-0.5)
    assert npu_out.shape == native.shape and npu_out.dtype == dtype
    assert within_budget(max_abs_error(npu_out, expected), max_abs_error(native, expected), dtype)


# --------------------------------------------------------------------------------------- the ascend sampler


def thresholds_between_tokens(logits, counts):
    """Per row a top-p halfway between the fp64 masses of its ``counts[row]`` and ``counts[row] + 1`` most likely
    tokens, so no rounding of the dtype under test can move a token across the threshold."""
    masses = torch.softmax(logits.double(), -1).sort(-1, descending=True).values.cumsum(-1)
    rows = torch.arange(logits.shape[0])
    counts = torch.tensor(counts)
    return ((masses[rows, counts - 1] + masses[rows, counts]) / 2).float()


def sample_many(logits, top_k, top_p, draws=4000, eligible=True):
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_logits_ascend

    torch.manual_seed(0)
    rows = logits.shape[0]
    many = logits.repeat(draws, 1)
    ids = top_k_top_p_min_p_sampling_from_logits_ascend(
        many, top_k.repeat(draws), top_p.repeat(draws), torch.zeros(rows * draws), False, None,
        torch.zeros(rows * draws, dtype=torch.long), npu_top_k_top_p_eligible=eligible,
    )  # fmt: skip
    return ids.view(draws, rows)


@NPU_DTYPES
@pytest.mark.parametrize("eligible", [True, False], ids=["npu_top_k_top_p", "sorted_fallback"])
def test_ascend_sampler_draws_only_from_the_top_k_top_p_set_in_proportion(npu, dtype, eligible):
    """The ascend sampling backend's filter (``npu_top_k_top_p`` when every top_k is in [1, 1024], else its sorted
    fallback) against the fp64 kept set; the draws land in it only, each kept token about as often as its
    renormalized probability (seeded, 4000 draws, a 4-sigma band)."""
    from sglang.srt.sampling.sampling_params import TOP_K_ALL

    logits = randn(3, 64, dtype=dtype, scale=2.0)
    top_k = torch.tensor([5, 64, 20] if eligible else [TOP_K_ALL, TOP_K_ALL, TOP_K_ALL], dtype=torch.int32)
    top_p = thresholds_between_tokens(logits, [10, 6, 3])  # row 0: top-k binds first
    draws = sample_many(logits, top_k.clone(), top_p, eligible=eligible)
    kept = top_k_top_p_kept_fp64(logits, torch.tensor([5, 64, 20]) if eligible else torch.full((3,), 64), top_p)
    for row in range(3):
        counts = torch.bincount(draws[:, row], minlength=64).double()
        assert kept[row, counts > 0].all(), f"row {row} drew outside the kept set"
        probs = torch.softmax(logits[row].double().masked_fill(~kept[row], float("-inf")), 0)
        expected = probs * draws.shape[0]
        sigma = (expected * (1 - probs)).sqrt()
        assert ((counts - expected).abs() <= 4 * sigma + 1).all()


def test_ascend_sampler_greedy_and_temperature(npu):
    """Greedy rows take the argmax on every backend; the ascend backend divides by the temperature before the
    logprobs it returns (so they are the tempered distribution's)."""
    from types import SimpleNamespace

    from sglang.srt.layers.sampler import Sampler

    logits = randn(2, 50, dtype=torch.bfloat16, scale=2.0)
    sampler = object.__new__(Sampler)
    info = SimpleNamespace(temperatures=torch.tensor([[0.5], [2.0]], dtype=torch.bfloat16), sampling_seed=None)
    ids, logprobs = Sampler._forward_ascend_backend(sampler, logits.clone(), info, True, True, torch.zeros(2))
    expected = torch.log_softmax(logits.double() / info.temperatures.double(), dim=-1)
    assert max_abs_error(logprobs, expected) <= 8 * resolution(torch.bfloat16) * expected.abs().max().item()
    assert ids.dtype == torch.int32 and ids.shape == (2,)


def test_ascend_sampler_min_p_on_the_npu_filter_crashes_in_stock(npu):
    """BUG (stock 0.5.23, NPU only): with min_p > 0 and top_k in [1, 1024] the ascend sampler multiplies the
    ``(values, indices)`` pair that ``Tensor.max(dim=-1)`` returns by ``min_ps``; every such request fails with a
    TypeError. The patch ``mossvl_ascend.patches.ascend_sampler`` applies the threshold to the row maxima."""
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_logits_ascend

    logits = randn(2, 40, dtype=torch.bfloat16, scale=2.0)
    args = (torch.tensor([10, 10], dtype=torch.int32), torch.tensor([0.9, 0.9]), torch.tensor([0.2, 0.2]), True)
    with pytest.raises(TypeError):
        top_k_top_p_min_p_sampling_from_logits_ascend(
            logits, *args, None, torch.zeros(2), npu_top_k_top_p_eligible=True
        )


def test_ascend_sampler_patch_keeps_min_p_within_the_top_k_top_p_set(npu):
    from sglang.srt.layers import sampler

    from mossvl_ascend.patches import ascend_sampler
    from support.hooks import patches_applied

    logits = randn(2, 40, dtype=torch.bfloat16, scale=2.0)
    top_k, top_p, min_p = torch.tensor([10, 10], dtype=torch.int32), torch.tensor([0.9, 0.9]), torch.tensor([0.2, 0.2])
    kept = top_k_top_p_kept_fp64(logits, top_k, top_p)
    probs = torch.softmax(logits.double().masked_fill(~kept, float("-inf")), -1)
    kept &= probs >= probs.max(-1, keepdim=True).values * min_p[:, None].double()
    torch.manual_seed(0)
    with patches_applied(*ascend_sampler.PATCHES):
        ids = sampler.top_k_top_p_min_p_sampling_from_logits_ascend(
            logits.repeat(500, 1), top_k.repeat(500), top_p.repeat(500), min_p.repeat(500), True, None,
            torch.zeros(1000), npu_top_k_top_p_eligible=True,
        )  # fmt: skip
    drawn = torch.zeros_like(kept)
    drawn.view(-1)[(ids.view(500, 2) + torch.tensor([0, 40])).flatten().long()] = True
    assert (drawn <= kept).all() and drawn.any(-1).all()


# ------------------------------------------------------------------------------------------ the NPU KV pool


@NPU_DTYPES
@SHAPE
def test_npu_kv_pool_writes_each_token_to_its_slot_at_page_128(npu, dtype, shape):
    """``NPUMHATokenToKVPool.set_kv_buffer`` (torch_npu._npu_reshape_and_cache) at the NPU's page size 128, slots
    spread over several pages and within pages, as an encoder prefix plus text rows lay them out; what is read back
    through ``get_key_buffer`` is exactly what was written, and no other slot changed."""
    from types import SimpleNamespace

    from sglang.srt.hardware_backend.npu.memory_pool_npu import NPUMHATokenToKVPool

    dims = SHAPES[shape]
    pool = NPUMHATokenToKVPool(
        size=1024, page_size=128, dtype=dtype, head_num=dims["kv_heads"], head_dim=dims["head_dim"], layer_num=2,
        device="cpu", enable_memory_saver=False,
    )  # fmt: skip
    slots = torch.cat([torch.arange(1, 40), torch.arange(127, 131), torch.tensor([300, 511, 767, 900])])
    k = randn(len(slots), dims["kv_heads"], dims["head_dim"], dtype=dtype)
    v = randn(len(slots), dims["kv_heads"], dims["head_dim"], dtype=dtype, seed=1)

    def by_slot(buffer):  # the pool's [pages, page_size, heads, dim] buffer, one row per slot
        return buffer.view(-1, dims["kv_heads"], dims["head_dim"])

    before = by_slot(pool.get_key_buffer(1)).clone()
    pool.set_kv_buffer(SimpleNamespace(layer_id=1), slots, k, v)
    assert torch.equal(by_slot(pool.get_key_buffer(1))[slots], k)
    assert torch.equal(by_slot(pool.get_value_buffer(1))[slots], v)
    untouched = torch.ones(before.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(by_slot(pool.get_key_buffer(1))[untouched], before[untouched])
    assert not pool.get_key_buffer(0).any()


# ------------------------------------------------------------------------------------------- tiny vision tower


def vision_inputs(checkpoint):
    """Pixel patches and grid of two images and a 3-frame video, through the checkpoint's processor."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    from support.serving import ASSETS

    processor = AutoProcessor.from_pretrained(checkpoint, trust_remote_code=True)
    rng = np.random.default_rng(3)
    frames = [Image.fromarray(rng.integers(0, 255, (40, 60, 3), dtype=np.uint8)) for _ in range(3)]
    text = "<|im_start|>user\nA <|image|> B <|image|> C <|video|>?<|im_end|>\n"
    images = [str(ASSETS / "gradient_96x64.png"), str(ASSETS / "square_64.png")]
    inputs = processor(text=text, images=images, videos=[frames])
    return inputs["pixel_values"], inputs["grid_thw"]
