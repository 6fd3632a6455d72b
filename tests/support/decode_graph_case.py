"""A MOSS-VL decode step's attention at the NPU's page size, eager and as a recorded NPU graph (the graph STAND-IN of
``support/fake_npu_graph.py``): the pool, the requests and the graph state shared by ``tests/test_decode_graphs.py``
and ``benchmarks/bench_decode_graphs.py``.

A paged pool (page 128, or another the graph path takes: 16) with four layers' K/V (self, cross, self, cross), a
``req_to_token`` table (row 0 reserved, zeros) and five requests: an image, a text-only request, a realtime row
(slot-major encoder of whole pages, frame window), text crossing pages and a video. Eager decode is the attention core
with the batch's own metadata; the graph state is what stock's runner and the backend own: static inputs for the
largest bucket and one recording per bucket.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

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
from support.fake_npu_graph import FakeNPUGraph, graph_mode
from support.simulated_npu import npu_attention_on_cpu

PAGE = 128  # the NPU's
HEADS, KV_HEADS, DIM = 4, 2, 32
# Enough slots for the stand-in op's rule (the pool holds at least the blocks all rows' lengths need) at 16 rows.
SLOTS, ROW_SLOTS = 64 * PAGE, 8 * PAGE
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


def encoder_rows(request: Request, addressing: EncoderAddressing, page: int) -> int:
    if request.realtime:
        return -(-request.vision // (addressing.bands * page)) * page  # whole pages, as a session's encoder grows
    return addressing.row_len(request.vision)


class Pool:
    """A paged pool with four layers' K/V, a req_to_token table (row 0 reserved, zeros) and the requests' rows."""

    def __init__(self, dtype, addressing: EncoderAddressing, seed: int = 0, device="cpu", page: int = PAGE):
        generator = torch.Generator().manual_seed(seed)
        self.addressing, self.device, self.page = addressing, torch.device(device), page
        self.k, self.v = [], []
        for cross in CROSS_LAYERS:
            rows = SLOTS * (addressing.bands if cross else 1)
            self.k.append(torch.randn(rows, KV_HEADS, DIM, generator=generator).to(self.device, dtype))
            self.v.append(torch.randn(rows, KV_HEADS, DIM, generator=generator).to(self.device, dtype))
        self.req_to_token = torch.zeros(1 + len(REQUESTS), ROW_SLOTS, dtype=torch.int32)
        self.pool_row = {}
        free_pages = (torch.randperm(SLOTS // page - 1, generator=generator) + 1).tolist()
        for row, (name, request) in enumerate(REQUESTS.items(), start=1):
            length = encoder_rows(request, addressing, page) + request.seq_len
            pages = [free_pages.pop() for _ in range(-(-length // page))]
            columns = torch.arange(length)
            self.req_to_token[row, :length] = torch.tensor(pages)[columns // page] * page + columns % page
            self.pool_row[name] = row
        self.req_to_token = self.req_to_token.to(self.device)

    def rows(self, names: list[str]) -> DecodeRows:
        requests = [REQUESTS[n] for n in names]
        return DecodeRows(
            vision=[r.vision for r in requests],
            encoder_rows=[encoder_rows(r, self.addressing, self.page) for r in requests],
            lower=[r.lower for r in requests],
            slot_major=[int(r.realtime) for r in requests],
            gate=[int(r.vision > 0) for r in requests],
        )


def eager_decode(pool: Pool, names: list[str], queries: list[torch.Tensor]) -> list[torch.Tensor]:
    """The eager path of a decode forward for this batch: the attention core with the batch's metadata."""
    rows = pool.rows(names)
    metadata = ForwardAttentionMetadata.for_decode([REQUESTS[n].seq_len for n in names], rows.vision, pool.device)
    metadata.with_encoder_rows(rows.encoder_rows, [bool(s) for s in rows.slot_major])
    metadata.with_lower_bounds([torch.tensor([lo], dtype=torch.int32) if lo else None for lo in rows.lower])
    pool_rows = torch.tensor([pool.pool_row[n] for n in names], device=pool.device)
    return [
        attention(
            query.to(pool.device),
            pool.k[i],
            pool.v[i],
            pool.req_to_token,
            pool_rows,
            metadata,
            AttentionLayer(is_cross_attention=cross, scale=SCALE, causal=not cross),
            page_size=pool.page,
            addressing=pool.addressing,
        )
        for i, (query, cross) in enumerate(zip(queries, CROSS_LAYERS))
    ]


class GraphState:
    """What stock's graph runner and the backend own: static inputs for the largest bucket, one graph per bucket."""

    def __init__(self, pool: Pool, dtype, max_bs: int = max(BUCKETS), new_graph=FakeNPUGraph):
        """``new_graph``: makes one graph (the STAND-IN here; ``torch.npu.NPUGraph`` behind the same methods on a
        device, ``benchmarks/npu_acceptance.py``)."""
        self.pool, self.new_graph = pool, new_graph
        self.buffers = DecodeBuffers(max_bs, pool.device)
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=pool.device)
        self.queries = [torch.zeros(max_bs, HEADS, DIM, dtype=dtype, device=pool.device) for _ in CROSS_LAYERS]
        self.graphs: dict[int, FakeNPUGraph] = {}

    def step(self, bs: int, make_tables=step_tables):
        """The captured closure: the step's tables from the static inputs, then every layer's attention."""
        view = self.buffers.view(bs)
        pool = self.pool

        def run():
            tables = make_tables(
                view, pool.req_to_token, self.req_pool_indices[:bs], pool.page, pool.addressing, capture_kv_lengths(bs)
            )
            return [
                graph_decode_attention(query[:bs], pool.k[i], pool.v[i], tables.of(cross), SCALE, pool.page)
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
        graph = self.new_graph()
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
        lengths = host_kv_lengths(rows, [REQUESTS[n].seq_len for n in names], bs, self.pool.page, self.pool.addressing)
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
