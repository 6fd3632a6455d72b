"""Stock sglang layers with their NPU branches bound to the STAND-IN torch_npu (tests/fake_torch_npu.py), on CPU.

On this machine no stock module imported ``torch_npu`` (``is_npu()`` was False when they loaded), so the
``forward_npu`` branches name a ``torch_npu`` global that does not exist. ``stock_npu_branches`` binds the stand-in
into each such module for a test's duration; ``npu_route`` goes further and makes every ``BaseFusedOp`` dispatch as
on an Ascend host (platform key ``npu``), the vision tower rotate with ``apply_rotary_pos_emb_npu`` and attend with
``VisionAscendAttention`` (``--mm-attention-backend ascend_attn``), and the plugin's attention core use its NPU
primitive, so a whole model takes the route an NPU server takes.

Also here: the fp64 oracles the layer tests compare both branches against (written from the formulas, not from
sglang's code).
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

from fake_torch_npu import installed_fake_torch_npu

# Stock modules whose NPU branches call ``torch_npu.*`` on the MOSS-VL route (see tests/npu_route_inventory.json).
STOCK_MODULES_WITH_NPU_BRANCHES = (
    "sglang.srt.layers.layernorm",
    "sglang.srt.layers.activation",
    "sglang.srt.layers.rotary_embedding.base",
    "sglang.srt.layers.rotary_embedding.mrope",
    "sglang.srt.layers.rotary_embedding.utils",
    "sglang.srt.layers.attention.vision",
    "sglang.srt.layers.sampler",
    "sglang.srt.hardware_backend.npu.memory_pool_npu",
)

# Constants stock defines next to its ``import torch_npu`` (``if _is_npu:`` in rotary_embedding/utils.py), which
# therefore do not exist on this machine: the head-count and head-size limits of npu_rotary_mul it falls back at.
STOCK_NPU_ONLY_CONSTANTS = {
    "sglang.srt.layers.rotary_embedding.utils": {
        "NPU_ROTARY_MUL_MAX_NUM_HEADS": 1000,
        "NPU_ROTARY_MUL_MAX_HEAD_SIZE": 896,
    },
}

# Ops stock reaches as ``torch.ops.npu.<op>`` (registered by ``import torch_npu`` on an Ascend host): the
# W8A8_DYNAMIC linear (hardware_backend/npu/quantization/linear_method_npu.py, NPUW8A8Int8DynamicLinearMethod).
STOCK_TORCH_OPS_NPU = ("npu_dynamic_quant", "npu_quant_matmul")

NPU_DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


@contextlib.contextmanager
def stock_npu_branches():
    """Yield ``(fake torch_npu, MonkeyPatch)`` with the stand-in bound into every module above."""
    with installed_fake_torch_npu() as fake, pytest.MonkeyPatch.context() as mp:
        for name in STOCK_MODULES_WITH_NPU_BRANCHES:
            mp.setattr(importlib.import_module(name), "torch_npu", fake, raising=False)
        for name, constants in STOCK_NPU_ONLY_CONSTANTS.items():
            for constant, value in constants.items():
                mp.setattr(importlib.import_module(name), constant, value, raising=False)
        for op in STOCK_TORCH_OPS_NPU:
            mp.setattr(torch.ops.npu, op, _late_bound(fake, op), raising=False)
        yield fake, mp


def _late_bound(fake, op: str):
    """``torch.ops.npu.<op>`` calling the stand-in's attribute at call time (a test may wrap it meanwhile)."""

    def call(*args, **kwargs):
        return getattr(fake, op)(*args, **kwargs)

    return call


def ascend_vision_attention(mp: pytest.MonkeyPatch, **kwargs):
    """``VisionAscendAttention(**kwargs)``: its constructor refuses to run unless the module believes it is on an
    NPU, so the flag is raised for the construction only."""
    from sglang.srt.layers.attention import vision

    with mp.context() as construction:
        construction.setattr(vision, "_is_npu", True)
        return vision.VisionAscendAttention(**kwargs)


@contextlib.contextmanager
def npu_route(model: torch.nn.Module):
    """``model`` (a stock sglang module tree) runs every layer as it would under ``--device npu`` with the source
    PR's flags, through the stand-ins; the previous dispatch of each op is restored on exit."""
    from sglang.kernels import fused_op
    from sglang.kernels.spec import PlatformInfo
    from sglang.srt.layers.attention import vision
    from sglang.srt.layers.rotary_embedding import utils as rotary_utils

    from mossvl_ascend.attention import primitives

    with stock_npu_branches() as (fake, mp):
        mp.setattr(fused_op, "_platform_key", lambda: "npu")
        mp.setattr(fused_op, "_platform", lambda: PlatformInfo(device_type="npu"))
        mp.setattr(vision, "apply_rotary_pos_emb", rotary_utils.apply_rotary_pos_emb_npu)
        mp.setitem(primitives.FUSED_ATTENTION_BY_DEVICE, "cpu", primitives.FUSED_ATTENTION_BY_DEVICE["npu"])
        for module in model.modules():
            if isinstance(module, fused_op.BaseFusedOp):
                mp.setattr(module, "_forward_method", None)  # resolved again, now as on an NPU
            if isinstance(module, vision.VisionAttention):
                backend = module.qkv_backend
                kwargs = dict(
                    head_dim=backend.head_size, num_heads=backend.num_heads, num_kv_heads=backend.num_kv_heads
                )
                mp.setattr(module, "qkv_backend", ascend_vision_attention(mp, flatten_batch=True, **kwargs))
                mp.setattr(module, "qkv_backend_name", "ascend_attn")
        yield fake


def stock_moss_vl(checkpoint, dtype):
    """Stock sglang ``MossVLForConditionalGeneration`` built in-process (world size 1, as sglang's layer tests do)
    in ``dtype`` with the tiny checkpoint's weights, through its own loader."""
    from safetensors.torch import load_file
    from sglang.srt.models.moss_vl import MossVLForConditionalGeneration
    from sglang.test.layer_ut_utils import init_single_process_dist
    from transformers import AutoConfig

    from serving.launch import free_port

    init_single_process_dist(master_port=free_port())  # a no-op once initialized
    config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=True)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = MossVLForConditionalGeneration(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.load_weights(
        (name, weight.to(dtype)) for name, weight in load_file(str(checkpoint / "model.safetensors")).items()
    )
    return model


# ---------------------------------------------------------------------------------------------- fp64 oracles


def rms_norm_fp64(x, weight, eps, residual=None):
    """(x [+ residual]) / sqrt(mean((x [+ residual])^2) + eps) * weight in fp64; with residual also the sum."""
    total = x.double() if residual is None else x.double() + residual.double()
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return normed if residual is None else (normed, total)


def silu_and_mul_fp64(x):
    gate, up = x.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def mrope_lane_axes(mrope_section, interleaved):
    """Axis (0 = t, 1 = h, 2 = w) owning each of the ``sum(mrope_section)`` rotary pairs: interleaved pairs cycle
    t, h, w while each axis has pairs left (MOSS-VL's layout), else contiguous t, then h, then w blocks."""
    pairs = sum(mrope_section)
    if not interleaved:
        return [axis for axis, size in enumerate(mrope_section) for _ in range(size)]
    axes = [0] * pairs
    for axis in (1, 2):
        for lane in range(axis, 3 * mrope_section[axis], 3):
            axes[lane] = axis
    return axes


def mrope_fp64(positions, x, head_dim, mrope_section, interleaved, base):
    """Neox-style rotary of ``x [T, heads * head_dim]`` at 3-D ``positions [3, T]`` in fp64: pair j rotates by
    ``positions[axis_j] * base^(-2j / head_dim)`` (x[..., j] with x[..., j + head_dim/2])."""
    tokens = x.shape[0]
    x = x.double().view(tokens, -1, head_dim)
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    axes = torch.tensor(mrope_lane_axes(mrope_section, interleaved))
    angle = positions.double()[axes].T * inv_freq  # [T, head_dim / 2]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).view(tokens, -1)


def rotate_half_fp64(x, cos, sin):
    """``x * cos + rotate_half(x) * sin`` in fp64; x ``[T, heads, D]``, cos/sin ``[T, D]``."""
    x, cos, sin = x.double(), cos.double()[:, None], sin.double()[:, None]
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def varlen_attention_fp64(q, k, v, cu_seqlens, scale):
    """Block-diagonal attention in fp64: tokens attend to the tokens of their own segment ``[cu[i], cu[i+1])``;
    q ``[T, H, D]``, k/v ``[T, Hk, D]``."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds, bounds[1:]):
        qs = q[start:end].double().transpose(0, 1)
        ks = k[start:end].double().repeat_interleave(group, 1).transpose(0, 1)
        vs = v[start:end].double().repeat_interleave(group, 1).transpose(0, 1)
        out[start:end] = (torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1) @ vs).transpose(0, 1)
    return out


def max_abs_error(value, reference) -> float:
    return (value.double() - reference.double()).abs().max().item()
