"""Frame-causal cross-attention precision in fp32, bf16 and fp16, through the hooked stock method (the edge) and
through the backends' entry (metadata from boundaries, then the core).

Oracle: :func:`support.precision.fp64_reference` (per-row softmax over the visible keys only, fp64). Budget: a
half-precision case's max error is at most 1.5x the error of ONE dense masked attention in the same dtype on the
same rounded inputs, plus 1e-3; fp32 at most 1e-5. Rows that see nothing must be exactly zero. The cases are the
ones MOSS-VL exists for: several images with text after each (600 new rows), a 40-frame video with a 200-row
question, random unsorted boundaries; GQA 8:2, 8:1, 4:4; softcap on and off.
"""

from __future__ import annotations

import pytest
import torch

from support.attention import patched_native  # noqa: F401  (fixture)
from support.precision import (
    dense_same_dtype,
    fp64_reference,
    images_case,
    max_error,
    random_case,
    random_qkv,
    through_core,
    through_stock_method,
    video_case,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CASES = {"images": images_case, "video": video_case, "random": random_case}
HEADS = {"8:2": (8, 2), "8:1": (8, 1), "4:4": (4, 4)}
SOFTCAP = 30.0


def check_precision(native, case, heads, dtype, logit_cap, head_dim=128, via="stock_method"):
    num_heads, num_kv_heads = heads
    scale = head_dim**-0.5
    q, k, v = random_qkv(num_heads, num_kv_heads, case.boundaries.numel(), case.encoder_len, head_dim)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    reference = fp64_reference(q, k, v, case.boundaries, scale, logit_cap)
    if via == "stock_method":
        out = through_stock_method(native, q, k, v, case.boundaries, scale, logit_cap)
    else:
        out = through_core(q, k, v, case.boundaries, scale, logit_cap)
    assert out.dtype == dtype and torch.isfinite(out).all()
    blind = case.boundaries == 0
    assert torch.equal(out[:, blind], torch.zeros_like(out[:, blind]))
    error = max_error(out, reference, case.boundaries)
    if dtype == torch.float32:
        budget = 1e-5
    else:
        dense = dense_same_dtype(q, k, v, case.boundaries, scale, logit_cap)
        dense_error = max_error(dense, reference, case.boundaries)
        budget = 1.5 * dense_error + 1e-3
    assert error <= budget, f"{case.name} {dtype} cap={logit_cap}: error {error:.3g} > budget {budget:.3g}"


@pytest.mark.parametrize("logit_cap", [0.0, SOFTCAP], ids=["plain", "softcap"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_cases_within_budget_gqa_8_2(patched_native, case, dtype, logit_cap):
    check_precision(patched_native, case(), (8, 2), dtype, logit_cap)


@pytest.mark.parametrize("logit_cap", [0.0, SOFTCAP], ids=["plain", "softcap"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", [images_case, random_case], ids=["images", "random"])
def test_cases_within_budget_through_the_backends_entry(case, dtype, logit_cap):
    check_precision(None, case(), (8, 2), dtype, logit_cap, via="core")


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_head_layouts_within_budget(patched_native, heads, dtype):
    """Every GQA layout on a staircase that needs several blocks and leaves (video, fewer frames)."""
    check_precision(patched_native, video_case(frames=12, tokens_per_frame=65, rows_per_frame=20), heads, dtype, 0.0)


@pytest.mark.parametrize("gap", [0.0, 10.0, 50.0, 73.0, 74.0, 88.0, 100.0, 150.0, 200.0])
def test_logit_gap_sweep_fp32_is_finite_and_exact(patched_native, gap):
    """Boundaries [64]*200 + [128]*200; the first 64 keys have logit 0, the next 64 logit ``gap`` (v = 10 there).

    Rows seeing 128 keys are dominated by the far keys (output -> 10); a merge that loses the weight of either
    block gives inf, NaN or the wrong value. The old sink merge returned inf for gaps of 73-74.
    """
    rows, dim = 400, 8
    boundaries = torch.tensor([64] * 200 + [128] * 200)
    q = torch.zeros(1, rows, dim)
    q[..., 0] = 1.0
    k = torch.zeros(1, 128, dim)
    k[0, 64:, 0] = gap
    v = torch.zeros(1, 128, 4)
    v[0, :64] = torch.linspace(-1, 1, 64)[:, None]
    v[0, 64:] = 10.0
    out = through_stock_method(patched_native, q, k, v, boundaries, 1.0)
    assert torch.isfinite(out).all()
    reference = fp64_reference(q, k, v, boundaries, 1.0)
    assert max_error(out, reference, boundaries) <= 1e-4
