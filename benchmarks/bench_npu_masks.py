"""Mask bytes and host traffic of the attention core's NPU calls (issue 20), measured on CPU through the STAND-IN
``torch_npu`` of tests/fake_torch_npu.py: nothing here ran on an Ascend card.

Mask bytes: bool bytes that ops allocate during one self-attention layer call on the NPU path (a TorchDispatchMode
sums the storage of every new bool tensor; views are free), the fused op itself excluded: it is a shape-only stub
here (zeros of the documented output shapes), since the question is what the caller builds and sends.
- ``now``: the core as it is (``core.attention`` through the NPU primitive), measured on the second layer of a
  forward (the first builds the per-forward tables); the op's compressed 2048 x 2048 causal mask is built once per
  device (``once`` column) and shared by every layer;
- ``before``: the previous call form, replayed: causal calls of fresh prefills built ``[1, 1, L, S]`` (key <= row)
  and inverted it for the op (True = masked out) every layer; prefixed calls inverted their ``[B, 1, L, S]`` group
  mask every layer (the mask itself was built once per forward: ``before/fwd``).
Host traffic per layer, both NPU paths (default batched; opt-in paged at page 16), with the real stand-in on a
forward holding every group type: host reads (``.item()``/``int()``/``.tolist()``/``torch.equal``/``nonzero``) and
host-to-device copies of host data, counted by ``support.simulated_npu.HostReads`` on the second layer of each kind.

Run: SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=sglang:cpu_shim:tests .venv/bin/python benchmarks/bench_npu_masks.py
Last line: ``RESULT mask_bytes_8k_before=... mask_bytes_8k_now=... host_reads_per_layer_default=...
host_reads_per_layer_paged=... host_copies_per_layer_default=... host_copies_per_layer_paged=...``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "sglang")]

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

from mossvl_ascend.attention import primitives  # noqa: E402
from support.attention import (  # noqa: E402
    CROSS_BOUNDARIES,
    DECODE,
    ONE_ROW_EXTENDS,
    STAIRCASE,
    Request,
    batch_metadata,
    build_paged_batch,
    run_core_layer,
)
from support.simulated_npu import HostReads, npu_attention_on_cpu  # noqa: E402

HEADS = (4, 2, 16)  # the mask bytes do not depend on heads or head_dim
MIB = 1 << 20


class BoolBytes(TorchDispatchMode):
    """Bytes of every new (non-view) bool tensor an op returns while active, outside :meth:`paused` spans."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self._paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        if not self._paused and not func.is_view:
            self.bytes += sum(t.untyped_storage().nbytes() for t in outputs if _is_bool_tensor(t))
        return out

    def paused(self):
        mode = self

        class Paused:
            def __enter__(self):
                mode._paused = True
                self._modes = _disable_current_modes()
                self._modes.__enter__()

            def __exit__(self, *exc):
                self._modes.__exit__(*exc)
                mode._paused = False

        return Paused()


def _is_bool_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool


def shape_only_fia(counter):
    """The op as a stub of its documented output shapes (out like q with v's D; lse [B, N, S, 1] fp32)."""

    def fia(query, key, value, **kwargs):
        with counter.paused():
            dim = query.shape[-1]
            return query.new_zeros(*query.shape[:-1], dim), torch.zeros(*query.shape[:3], 1)

    return fia


def now_bytes(requests):
    """Bool bytes of the second self-attention layer of a forward through the core on the NPU path, and the
    compressed mask's bytes if the forward built it (once per device)."""
    primitives.npu_compressed_causal_mask.cache_clear()
    batch = build_paged_batch(requests, *HEADS, torch.bfloat16, page_size=1)
    metadata = batch_metadata(batch)
    counter = BoolBytes()
    with pytest.MonkeyPatch.context() as mp, npu_attention_on_cpu(mp):
        import torch_npu

        torch_npu.npu_fused_infer_attention_score = shape_only_fia(counter)
        with counter:
            run_core_layer(batch, metadata, cross=False)
            first = counter.bytes
            run_core_layer(batch, metadata, cross=False)
    built = primitives.npu_compressed_causal_mask.cache_info().currsize
    return counter.bytes - first, built * primitives.NPU_COMPRESSED_MASK_SIZE**2


def before_bytes(requests):
    """The previous NPU call form, replayed: (per layer, per forward) bool bytes."""
    rows = max(r.extend_len for r in requests)
    keys = max(r.text_len for r in requests)
    counter = BoolBytes()
    with counter:
        if not any(r.prefix_len for r in requests):  # fresh prefills: the causal mask, built and inverted per layer
            visible = (torch.arange(keys) <= torch.arange(rows)[:, None])[None, None]
            (~visible).contiguous()
            return counter.bytes, 0
        key = torch.arange(keys)[None, None, :]
        limit = torch.tensor([r.prefix_len for r in requests])[:, None, None] + torch.arange(rows)[None, :, None]
        lengths = torch.tensor([r.text_len for r in requests])[:, None, None]
        visible = ((key < lengths) & (key <= limit))[:, None]
        per_forward = counter.bytes
        (~visible).contiguous()
    return counter.bytes - per_forward, per_forward


MASK_CASES = {
    "fresh prefill 1 x 8192": [Request(spans=[], prefix_len=0, extend_len=8192)],
    "fresh prefills 4 x 2048": [Request(spans=[64], prefix_len=0, extend_len=2048 - 64 * i) for i in range(4)],
    "8192 rows after 24576 cached": [Request(spans=[], prefix_len=24576, extend_len=8192)],
    "decode 64 x 1k-8k": [Request(spans=[], prefix_len=1024 + 112 * i, extend_len=1) for i in range(64)],
}


def host_traffic(paged: bool):
    """(host reads, host copies) per layer on the second layer of each kind, real stand-in."""
    requests = ONE_ROW_EXTENDS + DECODE if paged else STAIRCASE + CROSS_BOUNDARIES + ONE_ROW_EXTENDS
    page_size = 16 if paged else 1
    batch = build_paged_batch(requests, *HEADS, torch.bfloat16, page_size=page_size, seed=8)
    metadata = batch_metadata(batch)
    counter = HostReads()
    with pytest.MonkeyPatch.context() as mp, npu_attention_on_cpu(mp, paged=paged, host_reads=counter):
        for cross in (False, True):
            run_core_layer(batch, metadata, cross, page_size)
        with counter:
            for cross in (False, True):
                run_core_layer(batch, metadata, cross, page_size)
    return len(counter.reads) / 2, len(counter.copies) / 2


def main():
    print("mask bytes per self-attention layer call on the NPU path (MiB); STAND-IN op, CPU")
    print(f"{'case':32} {'before/layer':>13} {'before/fwd':>11} {'now/layer':>10} {'now once':>9}")
    results = {}
    for name, requests in MASK_CASES.items():
        before_layer, before_forward = before_bytes(requests)
        now_layer, once = now_bytes(requests)
        results[name] = (before_layer, now_layer)
        figures = f"{before_layer / MIB:13.1f} {before_forward / MIB:11.1f} {now_layer / MIB:10.1f} {once / MIB:9.1f}"
        print(f"{name:32} {figures}")
    print()
    print(f"{'NPU path':10} {'host reads/layer':>17} {'host copies/layer':>18}")
    traffic = {}
    for paged in (False, True):
        traffic[paged] = host_traffic(paged)
        print(f"{'paged' if paged else 'default':10} {traffic[paged][0]:17g} {traffic[paged][1]:18g}")
    before_8k, now_8k = results["fresh prefill 1 x 8192"]
    print(
        f"RESULT mask_bytes_8k_before={before_8k} mask_bytes_8k_now={now_8k} "
        f"host_reads_per_layer_default={traffic[False][0]:g} host_reads_per_layer_paged={traffic[True][0]:g} "
        f"host_copies_per_layer_default={traffic[False][1]:g} host_copies_per_layer_paged={traffic[True][1]:g}"
    )


if __name__ == "__main__":
    main()
