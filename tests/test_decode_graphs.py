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

import pytest
import torch

from mossvl_ascend.attention import core, decode_graph
from mossvl_ascend.attention.decode_graph import host_kv_lengths, per_record_update, step_tables
from mossvl_ascend.attention.decode_step import FIELDS, DecodeBuffers, DecodeRows
from support.decode_graph_case import (
    BUCKETS,
    LAYOUTS,
    PAGE,
    REPLAYS,
    SCALE,
    TOLERANCE,
    GraphState,
    Pool,
    assert_close,
    eager_decode,
    npu_graph_route,
    random_queries,
)
from support.fake_npu_graph import RELEASES, FakeNPUGraph, HostRead, LseOverflow, NotCaptureSafe, recordable_fia


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


@pytest.mark.parametrize("release", list(RELEASES))
def test_the_production_step_replays_equal_to_eager_under_every_torch_npu_release(monkeypatch, release):
    """torch_npu records each captured fused-attention call in its ``.out`` form with buffers of its own (7.1-7.2: a
    one-element LSE buffer whatever ``softmax_lse_flag`` says); the captured step must fit them on every release."""
    dtype = torch.bfloat16
    pool = Pool(dtype, LAYOUTS["mossvl"])
    names = ["image", "text_only", "realtime_windowed"]
    with npu_graph_route(monkeypatch):
        state = GraphState(pool, dtype, new_graph=lambda: FakeNPUGraph(RELEASES[release]))
        state.capture(4)
        queries = random_queries(names, dtype, 13)
        assert_close(state.replay(names, queries, 4), eager_decode(pool, names, queries), dtype, names)


@pytest.mark.parametrize("page", [128, 16])
def test_page_sizes_the_graph_path_takes_capture_and_replay_equal_to_eager(monkeypatch, page):
    """The block sizes start-up accepts with graphs on (16-aligned, up to 512): the NPU's 128 and the smallest."""
    dtype = torch.float16
    pool = Pool(dtype, LAYOUTS["mossvl"], page=page)
    with npu_graph_route(monkeypatch):
        state = GraphState(pool, dtype)
        for bs in (1, 4):
            state.capture(bs)
        for bs, names in ((4, ["video", "text_only", "realtime_windowed"]), (1, ["long_text"])):
            queries = random_queries(names, dtype, page + bs)
            assert_close(state.replay(names, queries, bs), eager_decode(pool, names, queries), dtype, (page, names))


def replay_with_an_update_rule(monkeypatch, names: list[str], seed: int, update, release=RELEASES["7.1-7.2"]):
    """Replay ``names`` in a bucket of 2 with ``update`` deciding what NPUGraph.update gets; returns (graph, eager)."""
    dtype = torch.bfloat16
    pool = Pool(dtype, LAYOUTS["mossvl"])
    with npu_graph_route(monkeypatch):
        state = GraphState(pool, dtype, new_graph=lambda: FakeNPUGraph(release))
        state.capture(2)
        queries = random_queries(names, dtype, seed)
        return state.replay(names, queries, 2, update=update), eager_decode(pool, names, queries)


def test_an_update_list_shorter_than_the_records_is_silent_up_to_7_3_and_refused_from_26(monkeypatch):
    """torch_npu's count check as it behaves: up to 7.3.x it never fires (the later records keep their capture-time
    lengths and compute a wrong answer); from 26.0.0 it raises."""

    def first_two(layers, lengths):
        return per_record_update(layers, lengths)[:2]

    names = ["image", "video"]
    replayed, eager = replay_with_an_update_rule(monkeypatch, names, 17, first_two, RELEASES["7.3"])
    tolerance = TOLERANCE[torch.bfloat16]
    assert torch.allclose(replayed[1].float(), eager[1].float(), atol=tolerance)  # the updated records
    assert not torch.allclose(replayed[3].float(), eager[3].float(), atol=tolerance)  # the stale one
    with pytest.raises(RuntimeError, match="2 dicts for 4 recorded calls"):
        replay_with_an_update_rule(monkeypatch, names, 17, first_two, RELEASES["26"])


def test_a_replay_without_the_update_keeps_the_capture_lengths_and_is_wrong(monkeypatch):
    """The frozen capture-time KV lengths (one key per row) are what the recording would use without update."""
    stale, eager = replay_with_an_update_rule(monkeypatch, ["image", "long_text"], 3, lambda layers, lengths: [{}])
    assert not torch.allclose(stale[0].float(), eager[0].float(), atol=TOLERANCE[torch.bfloat16])


def test_one_broadcast_update_gives_cross_layers_the_self_lengths_and_is_wrong(monkeypatch):
    """Stock's update is one dict for every record; MOSS-VL's two kinds of layer need one dict per record."""

    def broadcast(layers, lengths):
        return [{"actual_seq_lengths_kv": lengths[0]}]

    replayed, eager = replay_with_an_update_rule(monkeypatch, ["image", "video"], 5, broadcast)
    tolerance = TOLERANCE[torch.bfloat16]
    assert torch.allclose(replayed[0].float(), eager[0].float(), atol=tolerance)  # self layers fine
    assert not torch.allclose(replayed[1].float(), eager[1].float(), atol=tolerance)


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


class PageableCopiesLand:
    """A device on which a ``non_blocking=True`` copy from pageable host memory is asynchronous: it lands when the
    device gets to it, reading its source then (modelled: at :meth:`drain`, in issue order). Other copies land when
    issued. ``landed``: the watched tensor after each copy into it landed, in device order."""

    def __init__(self, watched: torch.Tensor):
        self.watched, self.queued, self.landed = watched, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.ops.aten.copy_.default:
            return func(*args, **kwargs)
        destination, source = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if non_blocking and source.device.type == "cpu" and not source.is_pinned():
            self.queued.append((destination, source))
            return destination
        result = func(*args, **kwargs)
        self._note(destination)
        return result

    def drain(self):
        """Land the queued copies (each a blocking copy now: through this mode, noted when it lands)."""
        queued, self.queued = self.queued, []
        for destination, source in queued:
            destination.copy_(source)

    def _note(self, destination):
        if destination.untyped_storage().data_ptr() == self.watched.untyped_storage().data_ptr():
            self.landed.append(self.watched.clone())


def test_each_fill_lands_its_own_rows_even_when_the_next_fill_comes_first():
    """``DecodeBuffers.fill`` reuses one host staging buffer every step; on a device where its copy is asynchronous
    the next step's fill must not be able to overwrite the bytes before the device read them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    pool = Pool(torch.bfloat16, LAYOUTS["mossvl"])
    buffers = DecodeBuffers(2, "cpu")
    first, second = pool.rows(["image", "video"]), pool.rows(["text_only", "long_text"])
    device = type("Device", (PageableCopiesLand, TorchDispatchMode), {})(buffers.table)
    with device:
        buffers.fill(first, 2)
        buffers.fill(second, 2)
        device.drain()
    expected = [[getattr(rows, name) for name in FIELDS] for rows in (first, second)]
    assert [table.tolist() for table in device.landed] == expected


@pytest.mark.parametrize(
    "release, flag, lse_shape, lse_dtype",
    [
        ("7.1-7.2", False, (1,), torch.bfloat16),
        ("7.3", False, (0,), torch.float32),
        ("7.3", True, (2, 4, 1, 1), torch.float32),
        ("26", True, (2, 4, 1, 1), torch.float32),
    ],
)
def test_a_captured_call_returns_the_buffers_its_torch_npu_release_allocates(release, flag, lse_shape, lse_dtype):
    """The stand-in against the facts read in torch_npu's source (``support/fake_npu_graph.py``): the call returns
    torch_npu's own buffers, the output ``empty_like(query)``, the LSE as each release line allocates it; 7.1-7.2
    refuse a flagged call, whose LSE would not fit."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 1, 32, generator=generator).to(torch.bfloat16)
    pages = [torch.randn(4, 16, 2 * 32, generator=generator).to(torch.bfloat16) for _ in range(2)]
    table = torch.tensor([[1], [3]], dtype=torch.int32)

    def step():
        return recordable_fia(
            query, *pages, block_table=table, block_size=16, actual_seq_lengths_kv=[3, 16], num_heads=4,
            num_key_value_heads=2, scale=0.2, input_layout="BNSD", softmax_lse_flag=flag,
        )  # fmt: skip

    graph = FakeNPUGraph(RELEASES[release])
    out, lse = graph.capture(step, may_read=[query, *pages, table])
    assert (tuple(lse.shape), lse.dtype) == (lse_shape, lse_dtype)
    eager_out, eager_lse = step()  # outside capture: the plain stand-in
    assert torch.equal(out, eager_out) and len(graph.fia_records()) == 1
    if flag:
        assert torch.equal(lse, eager_lse)


def test_a_flagged_call_overflows_the_one_element_lse_buffer_of_7_1_to_7_2():
    query = torch.zeros(2, 4, 1, 32, dtype=torch.bfloat16)
    pages = torch.zeros(4, 16, 64, dtype=torch.bfloat16)
    table = torch.tensor([[1], [3]], dtype=torch.int32)

    def step():
        return recordable_fia(
            query, pages, pages, block_table=table, block_size=16, actual_seq_lengths_kv=[3, 16], num_heads=4,
            num_key_value_heads=2, scale=0.2, input_layout="BNSD", softmax_lse_flag=True,
        )  # fmt: skip

    with pytest.raises(LseOverflow, match=r"writes a \(2, 4, 1, 1\) float32 LSE into the 1-element"):
        FakeNPUGraph(RELEASES["7.1-7.2"]).capture(step, may_read=[query, pages, table])
