"""STAND-IN for ``torch_npu`` (and the import-only part of ``sgl_kernel_npu``) in CPU tests.

Importing ``sglang.srt.hardware_backend.npu.attention.ascend_backend`` needs ``torch_npu`` and
``sgl_kernel_npu.attention.sinks_attention``. This stand-in lets that real sglang module import
on a CPU machine and implements, as pure-torch reference code, only the op the MOSS-VL paths
reach: the paged KV-cache write ``torch_npu._npu_reshape_and_cache`` used by
``NPUMHATokenToKVPool.set_kv_buffer``. Every other ``torch_npu`` attribute raises
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


class _FakeTorchNpu(types.ModuleType):
    """Module whose unknown public attributes raise NotImplementedError naming themselves."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(
            f"torch_npu.{name} is not implemented by the CPU stand-in (tests/fake_torch_npu.py)"
        )


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
