"""The NPU decode graph of MOSS-VL (``attention.decode_graph``) captured and replayed through the strict graph
STAND-IN (``support/fake_npu_graph.py``), against eager decode of the same batch.

A pool at the NPU's page size (128) in bf16 and fp16, with the MOSS-VL KV layout (3 bands) and the stock one; four
layers (self, cross, self, cross); buckets {1, 2, 4} captured once each (two warm-ups, then the recording, as stock's
``NPUCudaGraphBackend`` does), then replayed with batches the capture never saw: vision encoders of different
lengths, a text-only row, a realtime row (slot-major encoder, frame window), text crossing pages, and a bucket's
padding row. Each replay must equal eager decode of the same batch (the attention core through the same FIA
STAND-IN, gathered, with the batch's own metadata) within the dtype's rounding. The stand-in freezes every Python
value of the step at capture, refuses host reads and foreign tensors, and applies ``NPUGraph.update`` as torch_npu
does; the mutation tests show that each class of mistake the reference file lists is caught.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch

from mossvl_ascend.attention import core, decode_graph
from mossvl_ascend.attention.core import AttentionLayer, attention
from mossvl_ascend.attention.decode_graph import (
    capture_kv_lengths,
    graph_decode_attention,
    host_kv_lengths,
    per_record_update,
    step_tables,
)
from mossvl_ascend.attention.decode_step import DecodeBuffers, DecodeRows
from mossvl_ascend.attention.kv_layout import EncoderAddressing
from mossvl_ascend.attention.metadata import ForwardAttentionMetadata
from support.fake_npu_graph import FakeNPUGraph, HostRead, NotCaptureSafe, graph_mode
from support.simulated_npu import npu_attention_on_cpu

PAGE = 128
HEADS, KV_HEADS, DIM = 4, 2, 32
POOL_PAGES, ROW_PAGES = 24, 8
SLOTS = POOL_PAGES * PAGE
BUCKETS = (1, 2, 4)
CROSS_LAYERS = [False, True, False, True]  # the recorded calls' kinds, in capture order
SCALE = DIM**-0.5
# Eager and graph compute in fp32 inside the same op; they differ only in key order, then round to the dtype.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


@dataclass(frozen=True)
class Request:
    vision: int  # E
    seq_len: int  # text tokens, the decoded one included
    realtime: bool = False  # slot-major encoder of whole pages
    lower: int = 0  # first visible vision token (a frame window)


REQUESTS = {
    "image": Request(vision=300, seq_len=60),
    "text_only": Request(vision=0, seq_len=40),
    "realtime_windowed": Request(vision=700, seq_len=140, realtime=True, lower=250),
    "long_text": Request(vision=130, seq_len=300),
    "video": Request(vision=760, seq_len=9),
}
REPLAYS = {  # bucket -> batches replayed in it (fewer rows than the bucket: padding)
    4: [["image", "text_only", "realtime_windowed", "long_text"], ["video", "text_only", "image"]],
    2: [["long_text", "text_only"], ["realtime_windowed"]],
    1: [["video"], ["text_only"]],
}


def encoder_rows(request: Request, addressing: EncoderAddressing) -> int:
    if request.realtime:
        return -(-request.vision // (addressing.bands * PAGE)) * PAGE  # whole pages, as a session's encoder grows
    return addressing.row_len(request.vision)


class Pool:
    """A paged pool with four layers' K/V, a req_to_token table (row 0 reserved, zeros) and the requests' rows."""

    def __init__(self, dtype, addressing: EncoderAddressing, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.addressing = addressing
        self.k, self.v = [], []
        for cross in CROSS_LAYERS:
            rows = SLOTS * (addressing.bands if cross else 1)
            self.k.append(torch.randn(rows, KV_HEADS, DIM, generator=generator).to(dtype))
            self.v.append(torch.randn(rows, KV_HEADS, DIM, generator=generator).to(dtype))
        self.req_to_token = torch.zeros(1 + len(REQUESTS), ROW_PAGES * PAGE, dtype=torch.int32)
        self.pool_row = {}
        free_pages = (torch.randperm(POOL_PAGES - 1, generator=generator) + 1).tolist()
        for row, (name, request) in enumerate(REQUESTS.items(), start=1):
            length = encoder_rows(request, addressing) + request.seq_len
            pages = [free_pages.pop() for _ in range(-(-length // PAGE))]
            columns = torch.arange(length)
            self.req_to_token[row, :length] = torch.tensor(pages)[columns // PAGE] * PAGE + columns % PAGE
            self.pool_row[name] = row

    def rows(self, names: list[str]) -> DecodeRows:
        requests = [REQUESTS[n] for n in names]
        return DecodeRows(
            vision=[r.vision for r in requests],
            encoder_rows=[encoder_rows(r, self.addressing) for r in requests],
            lower=[r.lower for r in requests],
            slot_major=[int(r.realtime) for r in requests],
            gate=[int(r.vision > 0) for r in requests],
        )


def eager_decode(pool: Pool, names: list[str], queries: list[torch.Tensor]) -> list[torch.Tensor]:
    """The eager path of a decode forward for this batch: the attention core with the batch's metadata."""
    rows = pool.rows(names)
    metadata = ForwardAttentionMetadata.for_decode([REQUESTS[n].seq_len for n in names], rows.vision, "cpu")
    metadata.with_encoder_rows(rows.encoder_rows, [bool(s) for s in rows.slot_major])
    metadata.with_lower_bounds([torch.tensor([lo], dtype=torch.int32) if lo else None for lo in rows.lower])
    pool_rows = torch.tensor([pool.pool_row[n] for n in names])
    return [
        attention(
            query,
            pool.k[i],
            pool.v[i],
            pool.req_to_token,
            pool_rows,
            metadata,
            AttentionLayer(is_cross_attention=cross, scale=SCALE, causal=not cross),
            page_size=PAGE,
            addressing=pool.addressing,
        )
        for i, (query, cross) in enumerate(zip(queries, CROSS_LAYERS))
    ]


class GraphState:
    """What stock's graph runner and the backend own: static inputs for the largest bucket, one graph per bucket."""

    def __init__(self, pool: Pool, dtype):
        self.pool = pool
        max_bs = max(BUCKETS)
        self.buffers = DecodeBuffers(max_bs, "cpu")
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64)
        self.queries = [torch.zeros(max_bs, HEADS, DIM, dtype=dtype) for _ in CROSS_LAYERS]
        self.graphs: dict[int, FakeNPUGraph] = {}

    def step(self, bs: int, make_tables=step_tables):
        """The captured closure: the step's tables from the static inputs, then every layer's attention."""
        view = self.buffers.view(bs)
        pool = self.pool

        def run():
            tables = make_tables(
                view, pool.req_to_token, self.req_pool_indices[:bs], PAGE, pool.addressing, capture_kv_lengths(bs)
            )
            return [
                graph_decode_attention(query[:bs], pool.k[i], pool.v[i], tables.of(cross), SCALE, PAGE)
                for i, (query, cross) in enumerate(zip(self.queries, CROSS_LAYERS))
            ]

        return run

    def static_tensors(self) -> list[torch.Tensor]:
        return [
            self.buffers.table,
            self.req_pool_indices,
            self.pool.req_to_token,
            *self.queries,
            *self.pool.k,
            *self.pool.v,
        ]

    def capture(self, bs: int, step=None):
        self.buffers.fill(DecodeRows([], [], [], [], []), bs)
        step = step or self.step(bs)
        for _ in range(2):  # stock's two warm-ups before the recording
            step()
        graph = FakeNPUGraph()
        graph.capture(step, may_read=self.static_tensors())
        self.graphs[bs] = graph

    def load(self, names: list[str], queries: list[torch.Tensor], bs: int) -> DecodeRows:
        """What a replay does outside the graph: the static inputs, in place."""
        rows = self.pool.rows(names)
        self.buffers.fill(rows, bs)
        self.req_pool_indices.zero_()
        self.req_pool_indices[: len(names)] = torch.tensor([self.pool.pool_row[n] for n in names])
        for static, query in zip(self.queries, queries):
            static.zero_()
            static[: len(names)] = query
        return rows

    def replay(self, names: list[str], queries: list[torch.Tensor], bs: int, update=per_record_update):
        rows = self.load(names, queries, bs)
        lengths = host_kv_lengths(rows, [REQUESTS[n].seq_len for n in names], bs, PAGE, self.pool.addressing)
        self.graphs[bs].update(cpu_update_input=update(CROSS_LAYERS, lengths))
        return [out[: len(names)] for out in self.graphs[bs].replay()]


def random_queries(names: list[str], dtype, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(len(names), HEADS, DIM, generator=generator).to(dtype) for _ in CROSS_LAYERS]


@contextlib.contextmanager
def npu_graph_route(monkeypatch):
    """The FIA STAND-IN behind the NPU primitives (eager core and graph alike), recordable by the fake graph."""
    with npu_attention_on_cpu(monkeypatch):
        import torch_npu

        with graph_mode(torch_npu):
            yield


LAYOUTS = {"mossvl": EncoderAddressing(bands=3, band_stride=SLOTS), "stock": EncoderAddressing()}


def assert_close(graph_out, eager_out, dtype, label):
    for layer, (g, e) in enumerate(zip(graph_out, eager_out)):
        assert not g.isnan().any(), f"{label}: layer {layer} has NaN rows"
        assert torch.allclose(g.float(), e.float(), atol=TOLERANCE[dtype], rtol=0), (
            f"{label}: layer {layer} differs by {(g.float() - e.float()).abs().max():.3g}"
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_replays_of_buckets_1_2_4_equal_eager_decode(monkeypatch, dtype, layout):
    pool = Pool(dtype, LAYOUTS[layout])
    with npu_graph_route(monkeypatch):
        state = GraphState(pool, dtype)
        for bs in BUCKETS:
            state.capture(bs)
        for seed, (bs, batches) in enumerate(sorted(REPLAYS.items())):
            for names in batches:
                queries = random_queries(names, dtype, seed)
                assert_close(state.replay(names, queries, bs), eager_decode(pool, names, queries), dtype, names)


def test_each_row_sees_what_eager_sees_not_a_neighbours_rows(monkeypatch):
    """Swapping two requests' pool rows between capture-free replays changes exactly their outputs: the tables
    read each row's own slots (a graph that baked the capture batch's rows would give the same answer twice)."""
    dtype = torch.bfloat16
    pool = Pool(dtype, LAYOUTS["mossvl"])
    names = ["image", "long_text"]
    with npu_graph_route(monkeypatch):
        state = GraphState(pool, dtype)
        state.capture(2)
        queries = random_queries(names, dtype, 7)
        first = state.replay(names, queries, 2)
        swapped = state.replay(names[::-1], [q.flip(0) for q in queries], 2)
    for a, b in zip(first, swapped):
        assert torch.equal(a, b.flip(0))
    assert not torch.allclose(first[1][0].float(), first[1][1].float(), atol=1e-2)


def test_a_replay_without_the_update_keeps_the_capture_lengths_and_is_wrong(monkeypatch):
    """The frozen capture-time KV lengths (one key per row) are what the recording would use without update."""
    dtype = torch.bfloat16
    pool = Pool(dtype, LAYOUTS["mossvl"])
    names = ["image", "long_text"]
    with npu_graph_route(monkeypatch):
        state = GraphState(pool, dtype)
        state.capture(2)
        queries = random_queries(names, dtype, 3)
        stale = state.replay(names, queries, 2, update=lambda layers, lengths: [{}])
        eager = eager_decode(pool, names, queries)
    assert not torch.allclose(stale[0].float(), eager[0].float(), atol=TOLERANCE[dtype])


def test_one_broadcast_update_gives_cross_layers_the_self_lengths_and_is_wrong(monkeypatch):
    """Stock's update is one dict for every record; MOSS-VL's two kinds of layer need one dict per record."""
    dtype = torch.bfloat16
    pool = Pool(dtype, LAYOUTS["mossvl"])
    names = ["image", "video"]
    with npu_graph_route(monkeypatch):
        state = GraphState(pool, dtype)
        state.capture(2)
        queries = random_queries(names, dtype, 5)

        def broadcast(layers, lengths):
            return [{"actual_seq_lengths_kv": lengths[0]}]

        broadcast_out = state.replay(names, queries, 2, update=broadcast)
        eager = eager_decode(pool, names, queries)
    assert torch.allclose(broadcast_out[0].float(), eager[0].float(), atol=TOLERANCE[dtype])  # self layers fine
    assert not torch.allclose(broadcast_out[1].float(), eager[1].float(), atol=TOLERANCE[dtype])


# ---- mutations: each mistake of the reference file's list is caught by the stand-in or by the oracle ----


def test_mutation_a_length_read_on_the_host_at_capture_is_refused(monkeypatch):
    pool = Pool(torch.bfloat16, LAYOUTS["mossvl"])

    def tables_from_host_lengths(view, req_to_token, req_pool_indices, page, addressing, kv_lengths):
        rows = DecodeRows(*(column.tolist() for column in view.table))  # the mistake: a host read in the step
        lengths = host_kv_lengths(rows, [1] * rows.batch_size, rows.batch_size, page, addressing)
        return step_tables(view, req_to_token, req_pool_indices, page, addressing, lengths)

    with npu_graph_route(monkeypatch):
        state = GraphState(pool, torch.bfloat16)
        with pytest.raises(HostRead, match="tolist"):
            state.capture(2, step=state.step(2, make_tables=tables_from_host_lengths))


def test_mutation_a_workspace_kept_across_capture_is_refused(monkeypatch):
    """The core's gather workspace (grown by the warm-ups, a module-level buffer) read by the recording."""
    pool = Pool(torch.bfloat16, LAYOUTS["mossvl"])
    core.GATHER_WORKSPACE.release()
    original = decode_graph.graph_decode_attention

    def gathering(query, k_cache, v_cache, tables, scale, page_size):
        core.GATHER_WORKSPACE.gather("k", k_cache, tables.block_table.long())  # the mistake
        return original(query, k_cache, v_cache, tables, scale, page_size)

    monkeypatch.setattr(decode_graph, "graph_decode_attention", gathering)
    with npu_graph_route(monkeypatch):
        state = GraphState(pool, torch.bfloat16)

        def step():
            view = state.buffers.view(1)
            tables = step_tables(view, pool.req_to_token, state.req_pool_indices[:1], PAGE, pool.addressing, ([1], [1]))
            return [gathering(state.queries[0][:1], pool.k[0], pool.v[0], tables.self_attention, SCALE, PAGE)]

        with pytest.raises(NotCaptureSafe, match="made before capture"):
            state.capture(1, step=step)
    core.GATHER_WORKSPACE.release()


def test_mutation_a_workspace_allocated_during_capture_is_refused(monkeypatch):
    pool = Pool(torch.bfloat16, LAYOUTS["mossvl"])
    kept = []
    with npu_graph_route(monkeypatch):
        state = GraphState(pool, torch.bfloat16)
        inner = state.step(1)

        def step():
            outputs = inner()
            if len(kept) == 2:  # after the warm-ups: allocated in the recording and kept in Python state
                kept.append(torch.empty(64, dtype=torch.bfloat16))
            elif len(kept) < 2:
                kept.append(None)
            return outputs

        with pytest.raises(NotCaptureSafe, match="allocated during capture"):
            state.capture(1, step=step)


def test_mutation_the_row_gate_as_a_product_keeps_the_nan_of_a_row_without_keys(monkeypatch):
    dtype = torch.bfloat16
    pool = Pool(dtype, LAYOUTS["mossvl"])
    names = ["image", "text_only"]
    monkeypatch.setattr(decode_graph, "zero_rows_without_keys", lambda out, sees: sees[:, None, None] * out)
    with npu_graph_route(monkeypatch):
        state = GraphState(pool, dtype)
        state.capture(2)
        queries = random_queries(names, dtype, 11)
        replayed = state.replay(names, queries, 2)
        eager = eager_decode(pool, names, queries)
    assert replayed[1][1].isnan().all()  # the text-only row's cross-attention: 0 * NaN
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(replayed, eager, dtype, names)
