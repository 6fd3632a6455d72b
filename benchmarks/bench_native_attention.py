"""Batched MOSS-VL attention core vs the per-request loop it replaces (issue 11): one layer call, CPU.

Every request has an encoder of ENCODER_LEN vision tokens (one image) in front of a text context drawn from
512-4096 tokens, in a shuffled KV pool. Modes:
  decode: one new row per request (self-attention over its text, cross-attention over its encoder);
  extend: EXTEND_ROWS new rows per request after its cached text (cross rows see the whole image).
Methods, side by side on the same tensors and metadata: ``loop`` = ``core.per_request_attention`` (one call per
request, what the native path did), ``batched`` = ``core.attention`` (padded slot tables built once per forward,
then a few calls per layer). Columns: ms per layer call (best of --reps, methods interleaved), aten ops per call
(counted with a TorchDispatchMode), peak extra memory (largest sum of live op outputs during one call, MiB).

Run (CPU): SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=sglang:cpu_shim .venv/bin/python benchmarks/bench_native_attention.py
The last line is ``RESULT decode_ops_b64_over_b1=... decode_speedup_b64=... extend_speedup_b8=...`` (fp32, self-
attention; targets: <= 1.5, >= 8, >= 2).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_cross_attention.py

import argparse  # noqa: E402
import time  # noqa: E402
import weakref  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from mossvl_ascend.attention.core import AttentionLayer, attention, per_request_attention  # noqa: E402
from mossvl_ascend.attention.metadata import ForwardAttentionMetadata  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 128
ENCODER_LEN = 1024
EXTEND_ROWS = 32
CONTEXT_RANGE = (512, 4096)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class OpCounter(TorchDispatchMode):
    """Counts aten ops and tracks the bytes of live op outputs (peak), during one call."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.live = 0
        self.peak = 0
        self._storages = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in self._storages or tensor.untyped_storage().nbytes() == 0:
            return
        size = tensor.untyped_storage().nbytes()
        self._storages.add(pointer)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._release, pointer, size)

    def _release(self, pointer: int, size: int) -> None:
        self._storages.discard(pointer)
        self.live -= size


def make_batch(batch: int, mode: str, dtype: torch.dtype, seed: int):
    """Pool, req_to_token, query and metadata for ``batch`` requests (text contexts in CONTEXT_RANGE)."""
    gen = torch.Generator().manual_seed(seed)
    contexts = torch.randint(CONTEXT_RANGE[0], CONTEXT_RANGE[1] + 1, (batch,), generator=gen).tolist()
    rows = [1 if mode == "decode" else EXTEND_ROWS for _ in contexts]
    total = sum(ENCODER_LEN + c for c in contexts)
    k_cache = torch.randn(total + 1, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(total + 1, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    slots = (torch.randperm(total, generator=gen) + 1).int()
    req_to_token = torch.zeros(batch, ENCODER_LEN + max(contexts), dtype=torch.int32)
    start = 0
    for i, context in enumerate(contexts):
        req_to_token[i, : ENCODER_LEN + context] = slots[start : start + ENCODER_LEN + context]
        start += ENCODER_LEN + context
    query = torch.randn(sum(rows), NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    metadata = ForwardAttentionMetadata.build(rows, [c - r for c, r in zip(contexts, rows)], [ENCODER_LEN] * batch)
    return (query, k_cache, v_cache, req_to_token, torch.randperm(batch, generator=gen)), metadata, contexts


def time_call(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(mode: str, batch: int, dtype_name: str, kind: str, reps: int) -> dict:
    tensors, metadata, contexts = make_batch(batch, mode, DTYPES[dtype_name], seed=batch)
    query, k_cache, v_cache, req_to_token, pool_rows = tensors
    req_to_token = req_to_token[torch.argsort(pool_rows)]  # request i lives in pool row pool_rows[i]
    layer = AttentionLayer(kind == "cross", HEAD_DIM**-0.5, kind == "self")
    args = (query, k_cache, v_cache, req_to_token, pool_rows, metadata, layer)
    methods = {"loop": lambda: per_request_attention(*args), "batched": lambda: attention(*args)}
    outputs = {name: fn() for name, fn in methods.items()}  # also builds the forward's cached slot tables
    error = float((outputs["loop"].float() - outputs["batched"].float()).abs().max())
    best = dict.fromkeys(methods, float("inf"))
    for _ in range(reps):
        for name, fn in methods.items():
            best[name] = min(best[name], time_call(fn))
    counts = {}
    for name, fn in methods.items():
        with OpCounter() as counter:
            fn()
        counts[name] = counter
    return dict(
        mode=mode, kind=kind, dtype=dtype_name, batch=batch, context=f"{min(contexts)}-{max(contexts)}",
        loop_ms=best["loop"] * 1e3, batched_ms=best["batched"] * 1e3,
        loop_ops=counts["loop"].ops, batched_ops=counts["batched"].ops,
        loop_mib=counts["loop"].peak / 2**20, batched_mib=counts["batched"].peak / 2**20, diff=error,
    )


def print_table(rows: list[dict]) -> None:
    print(
        f"{'mode':>6} {'kind':>5} {'dtype':>5} {'batch':>5} {'context':>9} {'loop ms':>8} {'batched ms':>10} "
        f"{'speedup':>7} {'loop ops':>8} {'batch ops':>9} {'loop MiB':>8} {'batch MiB':>9} {'max|diff|':>9}"
    )
    for r in rows:
        print(
            f"{r['mode']:>6} {r['kind']:>5} {r['dtype']:>5} {r['batch']:>5} {r['context']:>9} {r['loop_ms']:>8.2f} "
            f"{r['batched_ms']:>10.2f} {r['loop_ms'] / r['batched_ms']:>7.2f} {r['loop_ops']:>8} "
            f"{r['batched_ops']:>9} {r['loop_mib']:>8.1f} {r['batched_mib']:>9.1f} {r['diff']:>9.1e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--modes", nargs="+", default=["decode", "extend"], choices=["decode", "extend"])
    parser.add_argument("--kinds", nargs="+", default=["self", "cross"], choices=["self", "cross"])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{NUM_HEADS} query heads / {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, encoder {ENCODER_LEN}, text "
        f"context {CONTEXT_RANGE[0]}-{CONTEXT_RANGE[1]}, extend {EXTEND_ROWS} rows; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, best of {args.reps}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    rows = [
        measure(mode, batch, dtype, kind, args.reps)
        for dtype in args.dtypes
        for mode in args.modes
        for kind in args.kinds
        for batch in args.batch
    ]
    print_table(rows)

    def cell(mode, batch):
        return next((r for r in rows if (r["mode"], r["kind"], r["dtype"], r["batch"]) == (mode, "self", "fp32", batch)), None)

    d1, d64, e8 = cell("decode", 1), cell("decode", 64), cell("extend", 8)
    if d1 and d64 and e8:
        print(
            f"RESULT decode_ops_b64_over_b1={d64['batched_ops'] / d1['batched_ops']:.2f} "
            f"decode_speedup_b64={d64['loop_ms'] / d64['batched_ms']:.2f} "
            f"extend_speedup_b8={e8['loop_ms'] / e8['batched_ms']:.2f}"
        )


if __name__ == "__main__":
    main()
