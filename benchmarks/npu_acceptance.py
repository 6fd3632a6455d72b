"""Acceptance of the plugin's own NPU attention calls on a real Ascend card (issue 20). NOT RUN ON HARDWARE YET.

On an Ascend host (``torch_npu`` importable and ``torch.npu.is_available()``) it runs, on the real torch_npu ops,
against a CPU fp64 reference, and prints a pass/fail table with timings:
1. the audit's "suggested first device check" (``../shared/reference/npu_ops_audit.md``), bf16 and fp16 at
   MOSS-VL-Instruct's heads (32 query / 8 KV, head_dim 128), each op call compared with fp64 (out and LSE):
   (a) B=2 with a ``[B,1,L,S]`` mask that has blind rows (their values are reported, not judged: the core
   overwrites them), (b) the compressed causal mode the core now uses (sparse_mode=3, 2048^2 mask) with B=3,
   cached prefixes and per-batch lengths, next to (b0) the previous ``[1,1,L,L]`` full causal mask, (c) Q_S=1 with
   a ``[B,1,1,S]`` mask, (d) BNSD page attention at page 128 with a hidden-prefix mask, (e) the empty block table
   (the core no longer sends one; what the op does with it is reported);
2. every group type of the attention core (``core.attention`` on NPU tensors: batched self-attention with cached
   prefixes, fresh prefills, decode self/cross, cross boundary masks, cross rows seeing one prefix, the
   frame-causal block plan, the all-blind group, the opt-in paged path at page 128 and 16), the cases of
   tests/test_npu_attention_core.py, at tiny and Instruct shapes, bf16 and fp16, against the fp64 reference with
   that test's budget (1.5 x one dense SDPA's error in the same dtype + 1e-3);
3. the decode graph (``attention.decode_graph``, the production step: the same calls, flags and tables) captured
   and replayed as stock's ``NPUCudaGraphBackend`` does it (``torch.npu.graph(..., auto_dispatch_capture=True)`` in
   one graph pool, so torch_npu records each fused-attention call in its ``.out`` form with its own buffers;
   ``replay_with_input_update``: ``NPUGraph.update`` with one dict per recorded call on a worker thread while the
   replay is issued) at buckets 1 and 16, page 128 and 16, against eager decode of the same batch, with the attention
   time of one decode step both ways (the cases of tests/test_decode_graphs.py); judged too: torch_npu's record list
   holds one call per layer (torch_npu up to 7.3.x skips a count mismatch silently) and none asks for an LSE;
4. the INT8 (W8A8_DYNAMIC) linear of stock's ModelSlim path (``npu_dynamic_quant`` + ``npu_quant_matmul``) at
   MOSS-VL-Instruct's layer shapes, 1 and 16 rows, bf16, against fp64 on the same int8 tensors and scales (one bf16
   ulp), and one decoder layer's four linears at one row, INT8 against bf16 (issue 53; docs/int8.md).

Run on the Ascend host, from the repository root (needs the test requirements, pytest included):
  python benchmarks/npu_acceptance.py
Without an NPU it says so and exits 2. ``--stand-in`` runs the same cases on CPU through the STAND-IN torch_npu of
tests/fake_torch_npu.py (how the script itself is tested); its timings mean nothing. Exit status: 0 every judged
case passes, 1 one fails. The last line is ``RESULT passed=... failed=... info=... device=...``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "sglang")]

import torch  # noqa: E402

NO_NPU_EXIT = 2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
INSTRUCT = (32, 8, 128)
LSE_TOLERANCE = 2e-2  # the op's fp32 LSE of rounded inputs against fp64


def missing_npu() -> str | None:
    """Why this host cannot run the check, or None."""
    try:
        import torch_npu  # noqa: F401
    except Exception as exc:  # an Ascend stack that fails to import is as absent as a missing one
        return f"torch_npu is not importable ({type(exc).__name__}: {exc})"
    if not (hasattr(torch, "npu") and torch.npu.is_available()):
        return "torch_npu imports but torch.npu.is_available() is False"
    return None


@dataclasses.dataclass
class Outcome:
    case: str
    dtype: str
    shape: str
    ms: float
    error: float
    budget: float
    status: str  # PASS, FAIL or INFO (reported, not judged)
    note: str = ""


class Runner:
    """Where the cases run: the real ops on ``npu``, or the stand-in on CPU."""

    def __init__(self, stand_in: bool, monkeypatch):
        self.stand_in, self.monkeypatch = stand_in, monkeypatch
        self.device = torch.device("cpu" if stand_in else "npu")
        import torch_npu

        self.torch_npu = torch_npu

    def sync(self):
        if not self.stand_in:
            torch.npu.synchronize()

    def timed(self, fn):
        """``fn()`` once to warm up, then once timed (ms, device synchronised)."""
        fn()
        self.sync()
        start = time.perf_counter()
        result = fn()
        self.sync()
        return result, (time.perf_counter() - start) * 1e3

    @contextlib.contextmanager
    def paged(self):
        """The opt-in paged decode on (and, for the stand-in, on the CPU device)."""
        from mossvl_ascend.attention import core

        with self.monkeypatch.context() as mp:
            mp.setenv("MOSSVL_NPU_PAGED_ATTENTION", "1")
            if self.stand_in:
                mp.setattr(core, "PAGED_ATTENTION_DEVICES", ("cpu",))
            yield


# ----------------------------------------------------------------------------- 1. the op itself


def random_bnsd(batch, rows, keys, dtype, seed, shape=INSTRUCT):
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(batch, n, s, dim, generator=gen).to(dtype)
        for n, s in ((heads, rows), (kv_heads, keys), (kv_heads, keys))
    )


def judge_op(name, dtype, runner, call, q, k, v, attended, scale):
    """Run ``call`` (the op on device tensors), compare out and LSE with fp64 over the rows that see a key."""
    from support.precision import masked_fp64_reference, masked_same_dtype

    (out, lse), ms = runner.timed(call)
    out, lse = out.cpu(), lse.cpu()[..., 0]
    expected, expected_lse = masked_fp64_reference(q, k, v, attended, scale)
    seen = attended.any(-1).expand(expected_lse.shape)
    rows = seen[..., None].expand_as(expected)
    error = float((out.double() - expected)[rows].abs().max())
    dense = masked_same_dtype(q, k, v, attended, scale)
    budget = 1.5 * float((dense.double() - expected)[rows].abs().max()) + 1e-3
    lse_error = float((lse.double() - expected_lse)[seen].abs().max())
    blind = ~seen
    note = f"lse err {lse_error:.2g}"
    if blind.any():
        note += f"; rows seeing no key: out finite={bool(out[blind[..., None].expand_as(out)].isfinite().all())}"
    ok = error <= budget and lse_error <= LSE_TOLERANCE
    return Outcome(name, dtype_name(dtype), "instruct", ms, error, budget, "PASS" if ok else "FAIL", note)


def dtype_name(dtype):
    return next(name for name, value in DTYPES.items() if value == dtype)


def fia(runner, q, k, v, **kwargs):
    device = runner.device
    kwargs = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()}
    return runner.torch_npu.npu_fused_infer_attention_score(
        q.to(device),
        k.to(device),
        v.to(device),
        num_heads=q.shape[1],
        num_key_value_heads=kwargs.pop("num_key_value_heads", k.shape[1]),
        input_layout="BNSD",
        scale=q.shape[-1] ** -0.5,
        softmax_lse_flag=True,
        **kwargs,
    )


def op_cases(runner, dtype):
    from mossvl_ascend.attention.primitives import npu_compressed_causal_mask

    scale = INSTRUCT[2] ** -0.5
    outcomes = []
    # (a) B=2 PFA with a full mask, blind rows included.
    q, k, v = random_bnsd(2, 24, 80, dtype, seed=1)
    masked_out = torch.rand(2, 1, 24, 80, generator=torch.Generator().manual_seed(2)) < 0.5
    masked_out[0, 0, 3] = masked_out[1, 0, 7] = True
    call = functools.partial(fia, runner, q, k, v, atten_mask=masked_out)
    outcomes.append(
        judge_op("(a) PFA B=2 [B,1,L,S] mask + blind rows", dtype, runner, call, q, k, v, ~masked_out, scale)
    )
    # (b) the compressed causal mode with cached prefixes, per-batch lengths (right-down per batch).
    q, k, v = random_bnsd(3, 40, 96, dtype, seed=3)
    query_lens, key_lens = [40, 17, 29], [96, 17, 60]
    row, col = torch.arange(40)[:, None], torch.arange(96)[None, :]
    attended = torch.stack([(row < n) & (col < s) & (col <= row + s - n) for n, s in zip(query_lens, key_lens)])[
        :, None
    ]
    compressed = npu_compressed_causal_mask(runner.device)
    call = functools.partial(fia, runner, q, k, v, atten_mask=compressed, sparse_mode=3,
                             actual_seq_lengths=query_lens, actual_seq_lengths_kv=key_lens)  # fmt: skip
    outcome = judge_op("(b) sparse_mode=3 B=3, cached prefixes", dtype, runner, call, q, k, v, attended, scale)
    outcomes.append(outcome)
    # (b0) the previous form: a full [1,1,L,L] causal mask, B=3, no prefix.
    q, k, v = random_bnsd(3, 64, 64, dtype, seed=4)
    causal = torch.arange(64)[None, :] <= torch.arange(64)[:, None]
    call = functools.partial(fia, runner, q, k, v, atten_mask=(~causal)[None, None].contiguous())
    outcomes.append(
        judge_op("(b0) full [1,1,L,L] causal mask B=3", dtype, runner, call, q, k, v, causal[None, None], scale)
    )
    # (c) decode with a [B,1,1,S] mask.
    q, k, v = random_bnsd(4, 1, 300, dtype, seed=5)
    hidden = (torch.arange(300)[None, :] < torch.tensor([0, 17, 128, 299])[:, None]).view(4, 1, 1, 300)
    call = functools.partial(fia, runner, q, k, v, atten_mask=hidden)
    outcomes.append(judge_op("(c) Q_S=1 [B,1,1,S] mask", dtype, runner, call, q, k, v, ~hidden, scale))
    outcomes.append(paged_op_case(runner, dtype, scale))
    outcomes.append(empty_block_table_case(runner, dtype))
    return outcomes


def paged_op_case(runner, dtype, scale):
    """(d) BNSD page attention at page 128 (KV cache (blocks, 128, KV_N * D)), hidden-prefix mask, LSE."""
    heads, kv_heads, dim = INSTRUCT
    page, kv_lens, hidden = 128, [300, 129, 40], torch.tensor([150, 0, 10])
    gen = torch.Generator().manual_seed(6)
    k_pages = torch.randn(12, page, kv_heads * dim, generator=gen).to(dtype)
    v_pages = torch.randn(12, page, kv_heads * dim, generator=gen).to(dtype)
    table = torch.tensor([[7, 2, 9], [5, 1, 0], [3, 0, 0]], dtype=torch.int32)
    q = torch.randn(3, heads, 1, dim, generator=gen).to(dtype)
    masked_out = (torch.arange(3 * page)[None, :] < hidden[:, None]).view(3, 1, 1, -1)
    slots = (table.long()[:, :, None] * page + torch.arange(page)).flatten(1)  # [B, 3 * page] pool rows
    k = k_pages.view(-1, kv_heads, dim)[slots].permute(0, 2, 1, 3)
    v = v_pages.view(-1, kv_heads, dim)[slots].permute(0, 2, 1, 3)
    attended = ~masked_out & (torch.arange(3 * page)[None, :] < torch.tensor(kv_lens)[:, None]).view(3, 1, 1, -1)
    call = functools.partial(fia, runner, q, k_pages, v_pages, num_key_value_heads=kv_heads, block_table=table,
                             block_size=page, actual_seq_lengths_kv=kv_lens, atten_mask=masked_out)  # fmt: skip
    return judge_op("(d) page attention, page 128, hidden prefix", dtype, runner, call, q, k, v, attended, scale)


def empty_block_table_case(runner, dtype):
    """(e) what the op does with a [B, 0] block table (reported: the core never sends one any more)."""
    heads, kv_heads, dim = INSTRUCT
    pages = torch.zeros(4, 128, kv_heads * dim).to(dtype)
    q = torch.zeros(2, heads, 1, dim).to(dtype)
    try:
        empty = torch.zeros(2, 0, dtype=torch.int32)
        out, _ = fia(runner, q, pages, pages, num_key_value_heads=kv_heads, block_table=empty, block_size=128,
                     actual_seq_lengths_kv=[0, 0])  # fmt: skip
        runner.sync()
        note = f"returned, finite={bool(out.cpu().isfinite().all())}"
    except Exception as exc:  # the outcome itself is the information
        note = f"raised {type(exc).__name__}: {str(exc)[:60]}"
    return Outcome(
        "(e) empty block table (not sent by the core)", dtype_name(dtype), "instruct", 0.0, 0.0, 0.0, "INFO", note
    )


# ----------------------------------------------------------------------------- 2. the attention core's group types


def core_cases():
    from support import attention as cases

    return [
        ("self, cached prefixes", cases.PREFIXED_SELF, False, "extend", None),
        ("self, fresh prefills", cases.FRESH_PREFILLS, False, "extend", None),
        ("self decode", cases.DECODE, False, "decode", None),
        ("cross decode", cases.DECODE, True, "decode", None),
        ("cross boundary masks", cases.CROSS_BOUNDARIES, True, "extend", None),
        ("cross rows seeing one prefix", cases.CROSS_UNIFORM, True, "extend", None),
        ("cross frame-causal block plan", cases.STAIRCASE, True, "extend", None),
        ("cross all-blind group", cases.BLIND, True, "extend", None),
        ("paged self, page 128", cases.ONE_ROW_EXTENDS, False, "extend", 128),
        ("paged cross, page 128", cases.ONE_ROW_EXTENDS, True, "extend", 128),
        ("paged self, page 16", cases.ONE_ROW_EXTENDS, False, "extend", 16),
        ("paged cross, page 16", cases.ONE_ROW_EXTENDS, True, "extend", 16),
        ("paged all-blind group, page 128", cases.BLIND, True, "extend", 128),
    ]


def metadata_on(batch, mode, device):
    """The forward's metadata with its tensors on ``device`` (what the prepare_forward_batch hook builds there)."""
    from mossvl_ascend.attention.metadata import ForwardAttentionMetadata
    from support.attention import batch_metadata

    requests = batch.requests
    if mode == "decode":
        return ForwardAttentionMetadata.for_decode(
            [r.text_len for r in requests], [r.encoder_len for r in requests], device
        )
    cpu = batch_metadata(batch)
    boundaries = [None if b is None else b.to(device) for b in cpu.cross_boundaries]
    return ForwardAttentionMetadata.build(cpu.extend_lens, cpu.prefix_lens, cpu.encoder_lens, boundaries, device)


def on_device(batch, device):
    moved = {
        f: getattr(batch, f).to(device) for f in ("req_pool_indices", "req_to_token", "k_cache", "v_cache", "query")
    }
    return dataclasses.replace(batch, **moved)


def core_case(runner, name, requests, cross, mode, page_size, shape_name, shape, dtype):
    from support.attention import build_paged_batch, errors_against_fp64, run_core_layer

    batch = build_paged_batch(requests, *shape, dtype, page_size or 1, seed=11)
    device_batch = on_device(batch, runner.device)
    context = runner.paged() if page_size else contextlib.nullcontext()
    with context:
        out, ms = runner.timed(
            lambda: run_core_layer(device_batch, metadata_on(batch, mode, runner.device), cross, page_size or 1)
        )
    results = errors_against_fp64(out.cpu(), batch, cross)
    ok = all(e <= b for e, b in results)
    error, budget = max(results, key=lambda eb: eb[0] / eb[1] if eb[1] else (float("inf") if eb[0] else 0.0))
    return Outcome(name, dtype_name(dtype), shape_name, ms, error, budget, "PASS" if ok else "FAIL", "worst request")


# ----------------------------------------------------------------------------- 3. decode graphs


class DeviceGraph:
    """``torch.npu.NPUGraph`` behind the graph STAND-IN's methods (capture a step, update, replay), captured and
    replayed through the code of stock's ``NPUCudaGraphBackend`` (``capture_one``'s graph call; the update and replay
    of ``replay_with_input_update`` itself, on a backend-shaped namespace holding this one graph)."""

    pool = None  # one graph pool for every capture, as stock's backend keeps

    def capture(self, step, *, may_read):
        from concurrent.futures import ThreadPoolExecutor

        if DeviceGraph.pool is None:
            DeviceGraph.pool = torch.npu.graph_pool_handle()
        self.graph = torch.npu.NPUGraph()
        with torch.npu.graph(self.graph, pool=DeviceGraph.pool, auto_dispatch_capture=True):
            self.output = step()
        device = torch.npu.current_device()
        self.backend = types.SimpleNamespace(
            _graphs={"step": self.graph}, _outputs={"step": self.output}, _rebind_fence=None, _device_module=torch.npu,
            _update_executor=ThreadPoolExecutor(1, initializer=torch.npu.set_device, initargs=(device,)),
        )  # fmt: skip
        return self.output

    def update(self, cpu_update_input):
        self.pending_update = cpu_update_input  # applied by replay(), as stock applies it

    def replay(self):
        from sglang.srt.hardware_backend.npu.graph_runner.npu_cudagraph_backend import NPUCudaGraphBackend

        return NPUCudaGraphBackend.replay_with_input_update(
            self.backend, "step", seq_lens=None, cpu_update_input=self.pending_update
        )

    def recorded_lse_flags(self) -> list[bool]:
        """``softmax_lse_flag`` of each call in torch_npu's record list (``NPUGraph.update`` walks it)."""
        records = self.graph.graph_dispatch_mode.graph_dispatch_records
        return [bool(record.kwargs.get("softmax_lse_flag", False)) for record in records]


def recorded_lse_flags(graph) -> list[bool]:
    """``softmax_lse_flag`` of each recorded fused-attention call, on the device or the STAND-IN."""
    if isinstance(graph, DeviceGraph):
        return graph.recorded_lse_flags()
    return [node.kwargs.get("softmax_lse_flag", node.args[10]) for node in graph.fia_records()]


def graph_cases(runner, dtype):
    """The MOSS-VL decode graph (``attention.decode_graph``, 4 layers: self, cross, self, cross; MOSS-VL KV layout,
    page 128, and 16 at the bucket of 16) captured at buckets 1 and 16, replayed with mixed rows (images, text-only,
    a windowed realtime row, text across pages; the bucket of 16 also with 13 rows: padding), against eager decode
    of the same batch: error and the attention time of one decode step both ways (replay includes its per-record
    update); it fails too unless torch_npu recorded one call per layer, none asking for an LSE."""
    from support import decode_graph_case as case
    from support.fake_npu_graph import FakeNPUGraph, graph_mode

    if runner.stand_in:
        with graph_mode(runner.torch_npu):
            return _graph_cases(runner, dtype, case, FakeNPUGraph)
    return _graph_cases(runner, dtype, case, DeviceGraph)


def _graph_cases(runner, dtype, case, new_graph):
    outcomes = []
    names = list(case.REQUESTS)
    for bs, rows, page in ((1, 1, 128), (16, 16, 128), (16, 13, 128), (16, 13, 16)):
        batch = [names[i % len(names)] for i in range(rows)]
        pool = case.Pool(dtype, case.LAYOUTS["mossvl"], device=runner.device, page=page)
        state = case.GraphState(pool, dtype, max_bs=bs, new_graph=new_graph)
        queries = case.random_queries(batch, dtype, seed=bs + rows)
        _, capture_ms = runner.timed(lambda: state.capture(bs))
        replayed, replay_ms = runner.timed(lambda: state.replay(batch, queries, bs))
        eager, eager_ms = runner.timed(lambda: case.eager_decode(pool, batch, queries))
        error = max((g.float() - e.float()).abs().max().item() for g, e in zip(replayed, eager))
        nan = any(bool(g.isnan().any()) for g in replayed)
        flags = recorded_lse_flags(state.graphs[bs])
        records_fit = len(flags) == len(case.CROSS_LAYERS) and not any(flags)
        budget = case.TOLERANCE[dtype]
        status = "PASS" if error <= budget and not nan and records_fit else "FAIL"
        label = f"decode graph bucket {bs}, {rows} rows, page {page}"
        note = (
            f"eager {eager_ms:.2f} ms, graph/eager {replay_ms / eager_ms:.2f}, capture {capture_ms:.0f} ms, "
            f"{len(flags)} records, LSE asked by {sum(flags)}"
        )
        outcomes.append(Outcome(label, dtype_name(dtype), "tiny", replay_ms, error, budget, status, note))
    return outcomes


# ----------------------------------------------------------------------------- driver


# ----------------------------------------------------------------------------- 4. INT8 (W8A8_DYNAMIC) linears

# (name, N, K) of one MOSS-VL-Instruct decoder layer's quantized linears (hidden 4096, 32/8 heads x 128,
# intermediate 12288): fused q/k/v, o, fused gate/up, down; the stand-in runs them at the tiny checkpoint's size.
INT8_LINEARS = {
    "instruct": (
        ("qkv_proj", 6144, 4096),
        ("o_proj", 4096, 4096),
        ("gate_up_proj", 24576, 4096),
        ("down_proj", 4096, 12288),
    ),
    "tiny": (("qkv_proj", 256, 128), ("o_proj", 128, 128), ("gate_up_proj", 512, 128), ("down_proj", 128, 256)),
}


def int8_cases(runner, dtype):
    """Stock's W8A8_DYNAMIC kernel pair (``npu_dynamic_quant`` then ``npu_quant_matmul(x_q, w_q^T, weight_scale,
    pertoken_scale, output_dtype)``, linear_method_npu.py) on the real ops: the activation scale against
    ``max|x| / 127`` and the int8 codes against ``round(x / scale)`` (off by one at most: the page does not say
    how ties round), the output against fp64 on the same int8 tensors and scales (budget: one ulp of the output
    dtype); then one decoder layer's four linears per decode row count, INT8 against the same matmuls in bf16
    (INFO: the measured ratio is what the INT8 decode floor in docs/int8.md has to be checked against)."""
    if dtype != torch.bfloat16:
        return []  # stock's fp16 model passes an fp16 weight_scale, which the op's table 2 refuses (docs/int8.md)
    shape_name = "tiny" if runner.stand_in else "instruct"
    gen = torch.Generator().manual_seed(53)
    outcomes, step = [], {"int8": 0.0, "bf16": 0.0}
    for rows in (1, 16):
        for name, n, k in INT8_LINEARS[shape_name]:
            x = torch.randn(rows, k, generator=gen).to(dtype)
            w = torch.randn(n, k, generator=gen) / k**0.5
            scale = (w.abs().amax(1) / 127).to(dtype)
            w_q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
            x_dev, w_dev, scale_dev = (t.to(runner.device) for t in (x, w_q.T.contiguous(), scale))

            def int8_linear():
                x_q, x_scale = runner.torch_npu.npu_dynamic_quant(x_dev)
                out = runner.torch_npu.npu_quant_matmul(
                    x_q, w_dev, scale_dev, pertoken_scale=x_scale.flatten(), output_dtype=dtype
                )
                return x_q, x_scale, out

            (x_q, x_scale, out), ms = runner.timed(int8_linear)
            w_float = (w_q.float() * scale.float()[:, None]).to(dtype).T.contiguous().to(runner.device)
            _, ms_bf16 = runner.timed(lambda: x_dev @ w_float)
            step["int8"] += ms if rows == 1 else 0.0
            step["bf16"] += ms_bf16 if rows == 1 else 0.0
            x_q, x_scale, out = x_q.cpu(), x_scale.cpu(), out.cpu()
            expected_scale = x.double().abs().amax(1) / 127
            scale_error = float(((x_scale.double() - expected_scale) / expected_scale).abs().max())
            codes_off = int((x_q.double() - torch.round(x.double() / x_scale.double()[:, None])).abs().max())
            reference = (x_q.double() @ w_q.double().T) * scale.double() * x_scale.double()[:, None]
            error = float((out.double() - reference).abs().max())
            _, exponent = torch.frexp(reference.abs().clamp_min(2.0**-126))
            ulp_budget = torch.ldexp(torch.ones_like(reference), exponent - 8)
            ok = (
                bool(((out.double() - reference).abs() <= ulp_budget).all())
                and scale_error <= 2**-22
                and codes_off <= 1
            )
            note = (
                f"rows {rows}; scale rel err {scale_error:.2g}; codes off by {codes_off}; bf16 matmul {ms_bf16:.3f} ms"
            )
            budget = float(ulp_budget.max())
            outcomes.append(
                Outcome(f"int8 {name}", "bf16", shape_name, ms, error, budget, "PASS" if ok else "FAIL", note)
            )
    ratio = step["int8"] / step["bf16"] if step["bf16"] else float("nan")
    note = f"one layer's 4 linears at 1 row: int8 {step['int8']:.3f} ms, bf16 {step['bf16']:.3f} ms, ratio {ratio:.2f}"
    outcomes.append(
        Outcome("int8 decode step (layer linears)", "bf16", shape_name, step["int8"], ratio, 0.0, "INFO", note)
    )
    return outcomes


def run_all(runner):
    from support.attention import NPU_SHAPES

    outcomes = []
    for dtype in DTYPES.values():
        outcomes += op_cases(runner, dtype)
        outcomes += graph_cases(runner, dtype)
        outcomes += int8_cases(runner, dtype)
        for case in core_cases():
            for shape_name, shape in NPU_SHAPES.items():
                outcomes.append(core_case(runner, *case, shape_name, shape, dtype))
    return outcomes


def print_table(outcomes, device):
    print(f"MOSS-VL plugin NPU attention acceptance on {device}")
    header = f"{'case':46} {'dtype':5} {'shape':8} {'ms':>8} {'max err':>9} {'budget':>9}  result"
    print(header)
    for o in outcomes:
        figures = f"{o.ms:8.2f} {o.error:9.2g} {o.budget:9.2g}"
        print(f"{o.case:46} {o.dtype:5} {o.shape:8} {figures}  {o.status} {o.note}".rstrip())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stand-in", action="store_true", help="run on CPU through the STAND-IN torch_npu")
    args = parser.parse_args(argv)
    import pytest

    with pytest.MonkeyPatch.context() as monkeypatch:
        if args.stand_in:
            from support.simulated_npu import npu_attention_on_cpu

            stack = npu_attention_on_cpu(monkeypatch)
            device_words = "CPU through the STAND-IN torch_npu (not an NPU)"
        else:
            reason = missing_npu()
            if reason is not None:
                print(f"no Ascend NPU on this host: {reason}. Run this on an Ascend host (or pass --stand-in).")
                return NO_NPU_EXIT
            stack = contextlib.nullcontext()
            device_words = torch.npu.get_device_name(0)
        with stack:
            outcomes = run_all(Runner(args.stand_in, monkeypatch))
    print_table(outcomes, device_words)
    failed = sum(o.status == "FAIL" for o in outcomes)
    passed = sum(o.status == "PASS" for o in outcomes)
    info = sum(o.status == "INFO" for o in outcomes)
    print(f"RESULT passed={passed} failed={failed} info={info} device={'stand-in' if args.stand_in else 'npu'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
