"""Start-up import fallback for an incomplete ``sgl_kernel_npu`` on Ascend NPUs.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from typing import Optional

import torch

from mossvl_ascend.patch_record import AT_LOAD, NPU, Patch

logger = logging.getLogger(__name__)

KERNEL_MODULE = "sgl_kernel_npu.norm.split_qkv_rmsnorm_rope"


def _rms_norm_heads(
    x: torch.Tensor,
    head_dim: int,
    eps: float,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
) -> torch.Tensor:
    """RMSNorm over each head's ``head_dim`` features in fp32: ``[T, H*D] -> [T, H, D]``."""
    heads = x.float().unflatten(-1, (-1, head_dim))
    normed = heads * torch.rsqrt(heads.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        normed = normed * weight.float()
    if bias is not None:
        normed = normed + bias.float()
    return normed


def _rotate_neox(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half (NeoX) layout, on ``[T, H, D]`` with cos/sin ``[T, 1, D]``."""
    first, second = heads.chunk(2, dim=-1)
    return heads * cos + torch.cat((-second, first), dim=-1) * sin


def split_qkv_rmsnorm_rope(
    input: torch.Tensor,
    sin: torch.Tensor,
    cos: torch.Tensor,
    q_hidden_size: int,
    kv_hidden_size: int,
    head_dim: int,
    eps: Optional[float] = None,
    q_weight: Optional[torch.Tensor] = None,
    k_weight: Optional[torch.Tensor] = None,
    q_bias: Optional[torch.Tensor] = None,
    k_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch stand-in for ``sgl_kernel_npu``'s fused split + per-head RMSNorm + RoPE.

    ``input`` is the fused projection ``[T, q_hidden_size + 2 * kv_hidden_size]`` laid out
    q | k | v. ``sin``/``cos`` hold one full-width (``head_dim``) row per token, as
    ``RotaryEmbedding.get_cos_sin_with_position`` stores them (``[T, 1, 1, head_dim]``).
    q and k are RMS-normalised per head when ``eps`` is given (times weight, plus bias), then
    rotated in the rotate-half layout; v is passed through. Returns q ``[T, q_hidden_size]``,
    k and v ``[T, kv_hidden_size]`` in ``input``'s dtype. Math runs in fp32 throughout (the
    Triton kernel rounds the normalised values to bf16 before the rotation).
    """
    q, k, v = input.split([q_hidden_size, kv_hidden_size, kv_hidden_size], dim=-1)
    num_tokens = input.shape[0]
    cos_rows = cos.reshape(num_tokens, 1, head_dim).float()
    sin_rows = sin.reshape(num_tokens, 1, head_dim).float()

    def prepare(x, weight, bias):
        heads = (
            _rms_norm_heads(x, head_dim, eps, weight, bias)
            if eps is not None
            else x.float().unflatten(-1, (-1, head_dim))
        )
        return _rotate_neox(heads, cos_rows, sin_rows).flatten(-2).to(input.dtype)

    return prepare(q, q_weight, q_bias), prepare(k, k_weight, k_bias), v.contiguous()


def _kernel_import_error() -> Optional[Exception]:
    try:
        importlib.import_module(KERNEL_MODULE)
    except (ImportError, AttributeError) as exc:
        return exc
    return None


def install_fallback_if_kernel_missing() -> bool:
    """Serve :func:`split_qkv_rmsnorm_rope` under the kernel's module name when the kernel does not import."""
    error = _kernel_import_error()
    if error is None:
        return False
    logger.warning(
        "%s cannot be imported (%s: %s); using the pure-torch split_qkv_rmsnorm_rope from %s "
        "(slower). Install triton-ascend >= 3.2.1 with a complete sgl_kernel_npu for the kernel.",
        KERNEL_MODULE,
        type(error).__name__,
        error,
        __name__,
    )
    module = types.ModuleType(KERNEL_MODULE)
    module.__doc__ = f"pure-torch fallback installed by {__name__}"
    module.split_qkv_rmsnorm_rope = split_qkv_rmsnorm_rope
    sys.modules[KERNEL_MODULE] = module
    return True


PATCHES = (
    Patch(
        title="Pure-torch split_qkv_rmsnorm_rope when sgl_kernel_npu is incomplete",
        target=KERNEL_MODULE,
        kind=AT_LOAD,
        hook=install_fallback_if_kernel_missing,
        platforms=frozenset({NPU}),
        why=(
            "`sglang.srt.models.qwen3` (also `glm4_moe`, `dflash`, and through `qwen3_asr` the OpenAI transcription "
            "adapters the HTTP server imports at start-up) imports this kernel at module level under `is_npu()`. "
            "It needs `triton.language.extra.cann` (triton-ascend >= 3.2.1); with triton-ascend 3.2.0 (the PyPI "
            "release) or a partial `sgl_kernel_npu` the import raises and sglang does not start, MOSS-VL included."
        ),
        how=(
            "not a HookRegistry hook: the failure happens while the import statement runs. At plugin load (before "
            "any of those modules is imported) the real import is tried; if it raises `ImportError`/`AttributeError`, "
            "one warning is logged and a module with the pure-torch `split_qkv_rmsnorm_rope` (same contract, fp32 "
            "math) is put into `sys.modules` under the kernel's name. A working kernel is never replaced."
        ),
        upstream="open in 0.5.23 (sglang PR #34344 guards a sibling import in `layers/layernorm.py` the same way)",
        remove_when="`models/qwen3.py` guards this import, or deployments ship triton-ascend with `extra.cann`",
    ),
)
