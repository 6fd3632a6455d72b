"""Batched MOSS-VL attention core vs the per-request loop it replaces (issue 11): one layer call, CPU.

Every request has an encoder (one image) in front of a text context drawn from a range, in a shuffled KV pool.
Presets: ``issue`` (default; 8 query / 2 KV heads, head_dim 128, encoder 1024, text 512-4096) and ``tiny`` (the
tiny checkpoint's attention: 4 / 2 heads, head_dim 32, encoder 17, text 64-256, where host work dominates).
Modes:
  decode: one new row per request (self-attention over its text, cross-attention over its encoder);
  extend: ``extend_rows`` new rows per request after its cached text (cross rows see the whole image).
Methods, side by side on the same tensors and metadata: ``loop`` = ``core.per_request_attention`` (one call per
request, what the native path did), ``batched`` = ``core.attention`` (padded slot tables built once per forward,
then a few calls per layer). Columns: ms per layer call (best of --reps, methods interleaved), speedup (median
over reps of loop time / batched time measured back to back: robust to load drifting between reps), aten ops per call
(counted with a TorchDispatchMode), peak extra memory (largest sum of live op outputs during one call, MiB).
``floor ms``: the same fused kernel alone on K/V gathered beforehand (no slot tables, no gather), the faster of one
call per request (unpadded) and one call over the padded batch: what an implementation that calls this kernel pays
even if it gathered nothing. ``bound`` = loop / floor: the largest speedup over the loop such an implementation could
reach on this machine. On a CPU the kernel's pass over the K/V is the work itself, so where the bound is below a
target, no batching of the host work reaches it.
The batched form bounds each call's gathered K/V by ``core.GATHER_BUDGET_BYTES`` (CPU: 8 MiB), so on the CPU
the ``issue`` preset splits large batches into several calls and the ``long`` preset each request's keys into
chunks; ``--no-gather-budget`` measures it unbounded, ``--gather-budget-mib N`` with another budget.

Run (CPU): SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=sglang:cpu_shim .venv/bin/python benchmarks/bench_native_attention.py
The last line is ``RESULT decode_ops_b64_over_b1=... decode_speedup_b64=... extend_speedup_b8=...
decode_ops_b64_over_b1_unbudgeted=...`` (fp32, self-attention; targets: <= 1.5, >= 8, >= 2). The CPU's gather
budget trades op count for cache locality (each budget-sized call is a few more ops); the last figure is the op
count ratio without it, the configuration an NPU runs (no budget on devices that gather at HBM speed).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_cross_attention.py

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import weakref  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from mossvl_ascend.attention import core  # noqa: E402
from mossvl_ascend.attention.core import AttentionLayer, attention, per_request_attention  # noqa: E402
from mossvl_ascend.attention.metadata import ForwardAttentionMetadata  # noqa: E402
from mossvl_ascend.attention.primitives import attention_with_lse  # noqa: E402


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    encoder_len: int
    context_range: tuple[int, int]
    extend_rows: int


# "long": contexts past the CPU gather budget for a single request (16-32 K tokens: 32-64 MiB of fp32 K/V), which the
# core then attends over in key chunks.
PRESETS = {
    "issue": Shape(8, 2, 128, 1024, (512, 4096), 32),
    "tiny": Shape(4, 2, 32, 17, (64, 256), 32),
    "long": Shape(8, 2, 128, 1024, (16384, 32768), 32),
}
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
        if tensor._is_view():  # a view allocates nothing (and its storage may be the whole KV pool)
            return
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


def make_batch(shape: Shape, batch: int, mode: str, dtype: torch.dtype, seed: int):
    """Pool, req_to_token, query and metadata for ``batch`` requests (text contexts in the shape's range)."""
    gen = torch.Generator().manual_seed(seed)
    contexts = torch.randint(shape.context_range[0], shape.context_range[1] + 1, (batch,), generator=gen).tolist()
    rows = [1 if mode == "decode" else shape.extend_rows for _ in contexts]
    encoder = shape.encoder_len
    total = sum(encoder + c for c in contexts)
    k_cache = torch.randn(total + 1, shape.num_kv_heads, shape.head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(total + 1, shape.num_kv_heads, shape.head_dim, generator=gen).to(dtype)
    slots = (torch.randperm(total, generator=gen) + 1).int()
    req_to_token = torch.zeros(batch, encoder + max(contexts), dtype=torch.int32)
    start = 0
    for i, context in enumerate(contexts):
        req_to_token[i, : encoder + context] = slots[start : start + encoder + context]
        start += encoder + context
    query = torch.randn(sum(rows), shape.num_heads, shape.head_dim, generator=gen).to(dtype)
    metadata = ForwardAttentionMetadata.build(rows, [c - r for c, r in zip(contexts, rows)], [encoder] * batch)
    return (query, k_cache, v_cache, req_to_token, torch.randperm(batch, generator=gen)), metadata, contexts


def time_call(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def layer_call_args(shape: Shape, mode: str, batch: int, dtype_name: str, kind: str):
    """The arguments of one layer call of the core, and the requests' text contexts."""
    tensors, metadata, contexts = make_batch(shape, batch, mode, DTYPES[dtype_name], seed=batch)
    query, k_cache, v_cache, req_to_token, pool_rows = tensors
    req_to_token = req_to_token[torch.argsort(pool_rows)]  # request i lives in pool row pool_rows[i]
    layer = AttentionLayer(kind == "cross", shape.head_dim**-0.5, kind == "self")
    return (query, k_cache, v_cache, req_to_token, pool_rows, metadata, layer), contexts


def kernel_floor_calls(shape: Shape, mode: str, kind: str, args, contexts: list[int]):
    """The fused kernel alone over K/V gathered beforehand: once per request (unpadded) and once for the padded batch.

    Two closures; the faster of the two is the floor (per request where the pass over K/V dominates, padded where
    per-call host work does).
    """
    query, k_cache, v_cache, req_to_token, pool_rows, _, layer = args
    rows = 1 if mode == "decode" else shape.extend_rows
    per_request = []
    for index, context in enumerate(contexts):
        slots = req_to_token[pool_rows[index]].long()
        keys = slots[: shape.encoder_len] if kind == "cross" else slots[shape.encoder_len : shape.encoder_len + context]
        k, v = (cache[keys].transpose(0, 1).unsqueeze(0).contiguous() for cache in (k_cache, v_cache))
        q = query[index * rows : (index + 1) * rows].transpose(0, 1).unsqueeze(0).contiguous()
        seen = None  # cross rows see the whole encoder; a decode row sees its whole text
        if kind == "self" and rows > 1:  # causal extend: row r sees the keys up to context - rows + r
            seen = (torch.arange(context) <= torch.arange(context - rows, context)[:, None])[None, None]
        per_request.append((q, k, v, seen))
    longest = max(k.shape[2] for _, k, _, _ in per_request)
    padded_k, padded_v = (
        torch.zeros(len(contexts), shape.num_kv_heads, longest, shape.head_dim, dtype=query.dtype) for _ in range(2)
    )
    visible = torch.zeros(len(contexts), 1, rows, longest, dtype=torch.bool)
    for index, (_, k, v, seen) in enumerate(per_request):
        padded_k[index, :, : k.shape[2]], padded_v[index, :, : k.shape[2]] = k[0], v[0]
        visible[index, 0, :, : k.shape[2]] = True if seen is None else seen[0, 0]
    q = torch.cat([q for q, _, _, _ in per_request])

    def one_call_per_request():
        return [attention_with_lse(q, k, v, layer.scale, visible=seen) for q, k, v, seen in per_request]

    def one_padded_call():
        return attention_with_lse(q, padded_k, padded_v, layer.scale, visible=visible, every_row_sees_a_key=True)

    return one_call_per_request, one_padded_call


def unbudgeted_ops(shape: Shape, mode: str, batch: int) -> int:
    """Aten ops of one batched fp32 self-attention call with no gather budget (as on an NPU)."""
    budgets = dict(core.GATHER_BUDGET_BYTES)
    core.GATHER_BUDGET_BYTES.clear()
    try:
        args, _ = layer_call_args(shape, mode, batch, "fp32", "self")
        attention(*args)  # builds the forward's cached slot tables
        with OpCounter() as counter:
            attention(*args)
    finally:
        core.GATHER_BUDGET_BYTES.update(budgets)
    return counter.ops


def measure(shape: Shape, mode: str, batch: int, dtype_name: str, kind: str, reps: int) -> dict:
    args, contexts = layer_call_args(shape, mode, batch, dtype_name, kind)
    methods = {"loop": lambda: per_request_attention(*args), "batched": lambda: attention(*args)}
    outputs = {name: fn() for name, fn in methods.items()}  # also builds the forward's cached slot tables
    error = float((outputs["loop"].float() - outputs["batched"].float()).abs().max())
    floors = dict(zip(("floor per request", "floor padded"), kernel_floor_calls(shape, mode, kind, args, contexts)))
    for fn in floors.values():
        fn()
    best = dict.fromkeys([*methods, *floors], float("inf"))
    ratios = []
    for _ in range(reps):
        times = {name: time_call(fn) for name, fn in [*methods.items(), *floors.items()]}
        ratios.append(times["loop"] / times["batched"])
        best = {name: min(best[name], times[name]) for name in best}
    counts = {}
    for name, fn in methods.items():
        core.GATHER_WORKSPACE.release()  # its buffers are extra memory of the call: allocate them inside it
        with OpCounter() as counter:
            fn()
        counts[name] = counter
    return dict(
        mode=mode,
        kind=kind,
        dtype=dtype_name,
        batch=batch,
        context=f"{min(contexts)}-{max(contexts)}",
        loop_ms=best["loop"] * 1e3,
        batched_ms=best["batched"] * 1e3,
        speedup=statistics.median(ratios),
        floor_ms=min(best[name] for name in floors) * 1e3,
        loop_ops=counts["loop"].ops,
        batched_ops=counts["batched"].ops,
        loop_mib=counts["loop"].peak / 2**20,
        batched_mib=counts["batched"].peak / 2**20,
        diff=error,
    )


def print_table(rows: list[dict]) -> None:
    print(
        f"{'mode':>6} {'kind':>5} {'dtype':>5} {'batch':>5} {'context':>9} {'loop ms':>8} {'batched ms':>10} "
        f"{'speedup':>7} {'floor ms':>8} {'bound':>5} {'loop ops':>8} {'batch ops':>9} {'loop MiB':>8} "
        f"{'batch MiB':>9} {'max|diff|':>9}"
    )
    for r in rows:
        print(
            f"{r['mode']:>6} {r['kind']:>5} {r['dtype']:>5} {r['batch']:>5} {r['context']:>9} {r['loop_ms']:>8.2f} "
            f"{r['batched_ms']:>10.2f} {r['speedup']:>7.2f} {r['floor_ms']:>8.2f} {r['loop_ms'] / r['floor_ms']:>5.2f} "
            f"{r['loop_ops']:>8} "
            f"{r['batched_ops']:>9} {r['loop_mib']:>8.1f} {r['batched_mib']:>9.1f} {r['diff']:>9.1e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--modes", nargs="+", default=["decode", "extend"], choices=["decode", "extend"])
    parser.add_argument("--kinds", nargs="+", default=["self", "cross"], choices=["self", "cross"])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--preset", default="issue", choices=list(PRESETS))
    parser.add_argument("--no-gather-budget", action="store_true", help="one call per length bucket on the CPU too")
    parser.add_argument(
        "--gather-budget-mib",
        type=int,
        help=f"the CPU's gather budget for this run, MiB (default {core.GATHER_BUDGET_BYTES['cpu'] >> 20})",
    )
    args = parser.parse_args()
    if args.no_gather_budget:
        core.GATHER_BUDGET_BYTES.clear()
    elif args.gather_budget_mib is not None:
        core.GATHER_BUDGET_BYTES["cpu"] = args.gather_budget_mib << 20
    shape = PRESETS[args.preset]
    print(
        f"preset {args.preset}: {shape.num_heads} query heads / {shape.num_kv_heads} KV heads, head_dim "
        f"{shape.head_dim}, encoder {shape.encoder_len}, text context {shape.context_range[0]}-"
        f"{shape.context_range[1]}, extend {shape.extend_rows} rows, gather budget {core.GATHER_BUDGET_BYTES}; "
        f"torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, best of {args.reps}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    rows = [
        measure(shape, mode, batch, dtype, kind, args.reps)
        for dtype in args.dtypes
        for mode in args.modes
        for kind in args.kinds
        for batch in args.batch
    ]
    print_table(rows)

    def cell(mode, batch):
        wanted = (mode, "self", "fp32", batch)
        return next((r for r in rows if (r["mode"], r["kind"], r["dtype"], r["batch"]) == wanted), None)

    d1, d64, e8 = cell("decode", 1), cell("decode", 64), cell("extend", 8)
    if d1 and d64 and e8:
        unbudgeted = unbudgeted_ops(shape, "decode", 64) / unbudgeted_ops(shape, "decode", 1)
        print(
            f"RESULT decode_ops_b64_over_b1={d64['batched_ops'] / d1['batched_ops']:.2f} "
            f"decode_speedup_b64={d64['speedup']:.2f} "
            f"extend_speedup_b8={e8['speedup']:.2f} "
            f"decode_ops_b64_over_b1_unbudgeted={unbudgeted:.2f} "
            f"decode_bound_b64={d64['loop_ms'] / d64['floor_ms']:.2f} "
            f"extend_bound_b8={e8['loop_ms'] / e8['floor_ms']:.2f}"
        )


if __name__ == "__main__":
    main()
