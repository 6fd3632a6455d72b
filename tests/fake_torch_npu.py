"""STAND-IN for ``torch_npu`` (and the import-only part of ``sgl_kernel_npu``) in CPU tests.

Importing ``sglang.srt.hardware_backend.npu.attention.ascend_backend`` needs ``torch_npu`` and
``sgl_kernel_npu.attention.sinks_attention``. This stand-in lets that real sglang module import
on a CPU machine and implements, as pure-torch reference code, only the ops the MOSS-VL paths
reach: the paged KV-cache write ``torch_npu._npu_reshape_and_cache`` used by
``NPUMHATokenToKVPool.set_kv_buffer``, and ``torch_npu.npu_fused_infer_attention_score`` in the
subset the attention core calls (documented semantics as read from the torch_npu API reference;
see :func:`_npu_fused_infer_attention_score`). Every other ``torch_npu`` attribute raises
NotImplementedError naming itself, so a test that strays onto a fused NPU kernel fails loudly
instead of computing something plausible. No ``torch.npu`` namespace is installed: sglang's
``is_npu()`` must keep answering False on this machine.

Use :func:`installed_fake_torch_npu` (a context manager) so the stand-in lives in
``sys.modules`` only for a test's duration.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types

import torch

# sglang modules whose import binds the stand-in; dropped again on exit so later tests (and
# other test files) never see a module that captured the fake.
_MODULES_BOUND_TO_FAKE = ("sglang.srt.hardware_backend.npu.attention.ascend_backend",)


def _npu_reshape_and_cache(*, key, value, key_cache, value_cache, slot_indices):
    """Reference for the ATB paged KV write: token t goes to page slot // page_size, row slot % page_size.

    key/value ``[num_tokens, num_heads, head_dim]``; key/value_cache
    ``[num_pages, page_size, num_heads, head_dim]``; slot_indices int ``[num_tokens]``.
    """
    slots = slot_indices.long()
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key.to(key_cache.dtype)
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value.to(value_cache.dtype)


def _npu_fused_infer_attention_score(
    query,
    key,
    value,
    *,
    atten_mask=None,
    actual_seq_lengths_kv=None,
    block_table=None,
    block_size=0,
    num_heads=1,
    num_key_value_heads=0,
    scale=1.0,
    input_layout="BSH",
    softmax_lse_flag=False,
    **unsupported,
):
    """STAND-IN for the documented FIA op, the subset the attention core uses (pure torch, fp32 math).

    - ``input_layout="BNSD"`` only: query ``[B, N, S, D]``; key/value ``[B, N_kv, S_kv, D]``, or, with
      ``block_table`` (int32 ``[B, max_blocks]``) and ``block_size``, a paged cache ``[num_blocks, block_size,
      N_kv * D]`` read in place: batch b's key position j is row ``j % block_size`` of block
      ``block_table[b, j // block_size]``.
    - ``num_key_value_heads`` (0 = ``num_heads``): query head h reads KV head ``h // (num_heads / N_kv)``.
    - ``actual_seq_lengths_kv``: per batch entry, keys at positions >= it are not attended.
    - ``atten_mask``: bool/int8/uint8 broadcastable to ``[B, 1, S, S_kv]``, **1/True = masked out**.
    - ``scale`` multiplies ``q k^T``.
    - returns ``(out [B, N, S, D] in query's dtype, softmax_lse)``; ``softmax_lse`` is fp32 ``[B, N, S, 1]``
      (log-sum-exp of the scaled, masked logits) when ``softmax_lse_flag`` else an empty tensor. The reference
      does not say what a row with no attended key yields: the stand-in returns output 0 and lse +inf, a value
      callers must not use.
    Any other keyword raises NotImplementedError naming it.
    """
    if unsupported:
        raise NotImplementedError(f"stand-in npu_fused_infer_attention_score: unsupported {sorted(unsupported)}")
    if input_layout != "BNSD":
        raise NotImplementedError(f"stand-in npu_fused_infer_attention_score: layout {input_layout}")
    if not (query.is_contiguous() and key.is_contiguous() and value.is_contiguous()):
        raise ValueError("npu_fused_infer_attention_score does not take non-contiguous tensors")
    batch, heads, rows, dim = query.shape
    if heads != num_heads:
        raise ValueError(f"num_heads {num_heads} but query has {heads} heads")
    kv_heads = num_key_value_heads or num_heads
    if block_table is not None:
        positions = torch.arange(block_table.shape[1] * block_size)
        blocks = block_table.long()[:, positions // block_size]  # [B, S_kv]
        key = key[blocks, positions % block_size].view(batch, -1, kv_heads, dim).transpose(1, 2)
        value = value[blocks, positions % block_size].view(batch, -1, kv_heads, value.shape[-1] // kv_heads)
        value = value.transpose(1, 2)
    if key.shape[1] != kv_heads:
        raise ValueError(f"num_key_value_heads {kv_heads} but key has {key.shape[1]} heads")
    group = heads // kv_heads
    keys = key.shape[2]
    logits = torch.einsum("bnsd,bnkd->bnsk", query.float(), key.float().repeat_interleave(group, 1)) * scale
    attended = torch.ones(batch, 1, rows, keys, dtype=torch.bool)
    if actual_seq_lengths_kv is not None:
        lengths = torch.as_tensor(actual_seq_lengths_kv).reshape(batch, 1, 1, 1)
        attended = attended & (torch.arange(keys).reshape(1, 1, 1, keys) < lengths)
    if atten_mask is not None:
        attended = attended & (atten_mask == 0)
    logits = logits.masked_fill(~attended, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    blind = ~attended.any(dim=-1, keepdim=True)
    probs = torch.exp(logits - lse.masked_fill(blind, 0.0))
    out = torch.einsum("bnsk,bnkd->bnsd", probs, value.float().repeat_interleave(group, 1))
    out = out.masked_fill(blind, 0.0).to(query.dtype)
    lse = lse.masked_fill(blind.expand_as(lse), float("inf"))
    return out, (lse if softmax_lse_flag else torch.empty(0))


class _FakeTorchNpu(types.ModuleType):
    """Module whose unknown public attributes raise NotImplementedError naming themselves."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(f"torch_npu.{name} is not implemented by the CPU stand-in (tests/fake_torch_npu.py)")


def _import_only(name: str):
    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"{name} is import-only in the CPU stand-in")

    unavailable.__name__ = name.rsplit(".", 1)[-1]
    return unavailable


def build_fake_modules() -> dict[str, types.ModuleType]:
    """The stand-in modules, keyed by import name."""
    torch_npu = _FakeTorchNpu("torch_npu")
    torch_npu.__doc__ = "STAND-IN torch_npu (tests/fake_torch_npu.py)"
    torch_npu._npu_reshape_and_cache = _npu_reshape_and_cache
    torch_npu.npu_fused_infer_attention_score = _npu_fused_infer_attention_score

    kernel = types.ModuleType("sgl_kernel_npu")
    attention = types.ModuleType("sgl_kernel_npu.attention")
    sinks = types.ModuleType("sgl_kernel_npu.attention.sinks_attention")
    for fn in ("attention_sinks_prefill_triton", "attention_sinks_triton"):
        setattr(sinks, fn, _import_only(f"sgl_kernel_npu.attention.sinks_attention.{fn}"))
    kernel.__path__ = []
    attention.__path__ = []
    kernel.attention = attention
    attention.sinks_attention = sinks
    modules = {
        "torch_npu": torch_npu,
        "sgl_kernel_npu": kernel,
        "sgl_kernel_npu.attention": attention,
        "sgl_kernel_npu.attention.sinks_attention": sinks,
    }
    # A spec lets importlib.util.find_spec (used by transformers' availability probes) answer.
    for name, module in modules.items():
        module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    return modules


@contextlib.contextmanager
def installed_fake_torch_npu():
    """Install the stand-in into ``sys.modules``; restore the previous state on exit.

    Yields the fake ``torch_npu`` module.
    """
    fakes = build_fake_modules()
    touched = tuple(fakes) + _MODULES_BOUND_TO_FAKE
    saved = {name: sys.modules[name] for name in touched if name in sys.modules}
    for name in _MODULES_BOUND_TO_FAKE:
        sys.modules.pop(name, None)
    sys.modules.update(fakes)
    try:
        yield fakes["torch_npu"]
    finally:
        for name in touched:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
