"""What makes a compiled CPU decode step of MOSS-VL one graph and cheap to replay (``patches.cpu_graph``,
``attention.decode_step``), checked without a server: the served equality of graphs and eager is
``tests/test_serving_decode_graphs.py``'s.

- The layer boundary's ``msgspec`` structs break a dynamo trace (the stock ``Contribution`` fails
  ``fullgraph=True``); their traceable twins trace and keep the structs' fields, defaults and methods.
- The compiled step's text K/V write (``mossvl::store_decode_rows``) lands in its layer's band of a shared storage
  tensor and nowhere else, and the same graph reads it back; rows another thread writes meanwhile (a PD decode
  server's incoming KV) stay as written, K and V, in stock's pool (both halves of one tensor).
- The CPU decode op builds a step's metadata once for all its layers, and anew for every fill of the buffers, even
  a fill with the same rows (a pool row reused by another request must not get the previous step's gather tables).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from sglang.srt.layers.layer_boundary import exit as boundary_exit
from sglang.srt.layers.layer_boundary.residual import stream

from mossvl_ascend.attention import decode_step
from mossvl_ascend.attention.decode_step import DecodeBuffers, DecodeRows
from mossvl_ascend.patches.cpu_graph import traceable_twin


class PlainAdd:
    """A residual update as a producer declares it: a plain add, bound at its stage (``bind`` is None)."""

    bind = None
    is_plain_add = True


def record_then_write(x: torch.Tensor) -> torch.Tensor:
    """One layer's residual bookkeeping: the producer records its output, the next boundary reads and writes it."""
    residual_stream = stream.ResidualStream(x)
    hidden = residual_stream.record(x * 2, PlainAdd())
    output, residual = residual_stream.input(hidden)
    return residual_stream.write(output + residual)


def test_the_stock_struct_breaks_a_full_graph_trace():
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(record_then_write, fullgraph=True, backend="eager")(torch.ones(3))


def test_its_twin_traces_into_one_graph_with_the_same_result(monkeypatch):
    monkeypatch.setattr(stream, "Contribution", traceable_twin(stream.Contribution))
    torch._dynamo.reset()
    x = torch.arange(3.0)
    traced = torch.compile(record_then_write, fullgraph=True, backend="eager")(x)
    assert torch.equal(traced, x * 3)


# What stock sglang 0.5.23 declares, read from its source (not derived by the filter the twin is built with):
# struct -> (fields in order, {field: default}, methods).
#   layers/layer_boundary/residual/stream.py:40-78: Contribution(value, update, owed=None): for_boundary, complete,
#   release; layers/layer_boundary/exit.py:486-501: ExitDecision(defer_moe_finalize, sum_in_reduce_scatter, complete),
#   frozen, no methods (``complete`` is a field holding a callable).
STOCK_STRUCTS = {
    stream.Contribution: (("value", "update", "owed"), {"owed": None}, {"for_boundary", "complete", "release"}),
    boundary_exit.ExitDecision: (("defer_moe_finalize", "sum_in_reduce_scatter", "complete"), {}, set()),
}
# The attention-backend methods stock's CPUGraphRunner calls (model_executor/cpu_graph_runner.py: 680, 686, 876) that
# stock's torch_native backend lacks; init_forward_metadata (947, 989) it has.
CPU_GRAPH_RUNNER_CALLS = {
    "init_cpu_graph_state",
    "get_cpu_graph_seq_len_fill_value",
    "init_forward_metadata_capture_cpu_graph",
}


@pytest.mark.parametrize("struct", list(STOCK_STRUCTS), ids=lambda s: s.__name__)
def test_a_twin_has_the_structs_fields_defaults_and_methods(struct):
    fields, defaults, methods = STOCK_STRUCTS[struct]
    assert struct.__struct_fields__ == fields  # the table still describes the installed stock
    twin = traceable_twin(struct)
    assert twin.__slots__ == fields
    required = [object() for name in fields if name not in defaults]
    built = twin(*required)
    assert [getattr(built, name) for name in fields] == [*required, *defaults.values()]
    for name in methods:
        assert vars(twin).get(name) is vars(struct)[name], name
    own = {name for name, value in vars(twin).items() if callable(value) and not name.startswith("__")}
    assert own == methods  # nothing else: a field must stay a field (ExitDecision.complete)


def test_the_graph_ready_backend_has_every_method_stocks_cpu_graph_runner_calls_on_it():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor import cpu_graph_runner

    from mossvl_ascend.patches.cpu_graph import GraphReadyTorchNativeBackend

    source = Path(cpu_graph_runner.__file__).read_text()
    called = set(re.findall(r"attn_backend\.(\w+)\(", source))
    assert called - set(dir(TorchNativeAttnBackend)) == CPU_GRAPH_RUNNER_CALLS
    for name in CPU_GRAPH_RUNNER_CALLS:
        assert name in vars(GraphReadyTorchNativeBackend), name


def test_a_contribution_twin_completes_and_releases_as_the_struct_does():
    twin = traceable_twin(stream.Contribution)
    value = torch.ones(2)
    for cls in (stream.Contribution, twin):
        contribution = cls(value, PlainAdd())
        assert contribution.owed is None  # the struct's default
        assert contribution.complete() is value and contribution.for_boundary() is value
        contribution.release()
        assert (contribution.value, contribution.owed, contribution.update) == (None, None, None)
    keyword = twin(value, update=None, owed="owed")
    assert (keyword.value, keyword.update, keyword.owed) == (value, None, "owed")


def rows(vision: list[int]) -> DecodeRows:
    n = len(vision)
    return DecodeRows(vision, [v // 3 for v in vision], [0] * n, [0] * n, [int(v > 0) for v in vision])


def test_a_steps_layers_share_one_metadata_and_each_fill_gets_its_own():
    buffers = DecodeBuffers(4, "cpu")
    seq_lens = torch.tensor([7, 9])
    view = buffers.fill(rows([6, 0]), 2)
    first = decode_step.metadata_of_step(seq_lens, view.table, view.step)
    assert decode_step.metadata_of_step(seq_lens, view.table, view.step) is first  # the step's next layer
    assert first.encoder_lens == [6, 0]
    again = buffers.fill(rows([6, 0]), 2)  # the same rows, the next step: fresh metadata
    second = decode_step.metadata_of_step(seq_lens, again.table, again.step)
    assert second is not first
    changed = buffers.fill(rows([0, 12]), 2)
    assert decode_step.metadata_of_step(seq_lens, changed.table, changed.step).encoder_lens == [0, 12]


def test_the_compiled_kv_write_lands_in_its_band_of_the_shared_storage_and_nowhere_else():
    """Two bands of one storage tensor (as ``patches.kv_pool`` shapes a cross layer's storage for two self layers):
    a compiled step writes band 1's rows ``loc`` through ``mossvl::store_decode_rows`` (bf16 values into an fp32
    cache, cast as the pool casts) and reads them back in the same graph; band 0 and every other row keep their
    bytes."""
    storage = torch.randn(2 * 64, 2, 8)
    before = storage.clone()
    band_1 = storage[64:]
    loc = torch.tensor([3, 17, 40])
    k = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    v = torch.randn(3, 2, 8, dtype=torch.bfloat16)

    def step(cache, loc, k, v):
        decode_step.store_decode_kv(cache, cache, loc, k, v)
        return cache[loc] * 2

    torch._dynamo.reset()
    read = torch.compile(step, fullgraph=True, dynamic=False)(band_1, loc, k, v)
    expected = before.clone()
    expected[64 + loc] = v.float()  # k then v into the same cache: v's values stay
    assert torch.equal(storage, expected)
    assert torch.equal(read, v.float() * 2)


# What Mooncake's receiver does to a PD decode server's caches while a compiled step runs: it writes a transferred
# request's rows from another thread, unseen by the compiler (stood in for by this op, which the step calls between
# its K/V write and the end of the graph).
TRANSFER_TARGETS: dict[str, torch.Tensor] = {}
TRANSFERRED_ROW, TRANSFERRED_VALUE = 40, 7.0


@torch.library.custom_op("mossvl_tests::attend_while_a_transfer_lands", mutates_args=())
def attend_while_a_transfer_lands(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    for cache in TRANSFER_TARGETS.values():
        cache[TRANSFERRED_ROW] = TRANSFERRED_VALUE
    return query + k_cache[3].sum() + v_cache[3].sum()


@attend_while_a_transfer_lands.register_fake
def _(query, k_cache, v_cache):
    return torch.empty_like(query)


def test_a_compiled_step_keeps_the_rows_a_pd_transfer_writes_into_its_caches_meanwhile():
    """Stock's CPU pool keeps a layer's K and V as the two halves of one tensor (`mem_cache/memory_pool.py`
    `_create_buffers_normal`, what ``MOSSVL_KV_LAYOUT=stock`` serves). Issue 51: with one op mutating both caches,
    inductor wrote V through a clone of the whole storage and copied it back at the end of the graph, reverting
    the rows the PD transfer wrote in the meantime (a PD decode server then decoded a request whose V rows of one
    layer were stale: the 16-together answers parted from the lone ones). Every row the step does not write keeps
    what the transfer put there; the step's own rows hold its K and V."""
    fused = torch.zeros(2, 64, 2, 8)
    k_cache, v_cache = fused[0], fused[1]
    TRANSFER_TARGETS.update(k=k_cache, v=v_cache)
    loc = torch.tensor([3])
    k, v = torch.randn(1, 2, 8), torch.randn(1, 2, 8)

    def step(query, k_cache, v_cache, loc, k, v):
        decode_step.store_decode_kv(k_cache, v_cache, loc, k, v)
        return attend_while_a_transfer_lands(query, k_cache, v_cache)

    torch._dynamo.reset()
    try:
        torch.compile(step, fullgraph=True, dynamic=False)(torch.zeros(1, 16), k_cache, v_cache, loc, k, v)
    finally:
        TRANSFER_TARGETS.clear()
    assert torch.all(fused[:, TRANSFERRED_ROW] == TRANSFERRED_VALUE), fused[:, TRANSFERRED_ROW, 0]
    assert torch.equal(k_cache[loc], k) and torch.equal(v_cache[loc], v)
