"""The batched attention core equals the per-request loop (the NPU primitives and the opt-in paged decode:
tests/test_npu_attention_core.py).

Oracles: :func:`support.attention.reference_cross_extend` / ``reference_self_extend`` (dense fp32 reference,
explicit per-row softmax) for both forms, and the per-request loop for the batched form (fp32, 1e-5). Batches mix
requests with and without an encoder, cached text prefixes, rows that see no frame, GQA and MHA, softcap on/off,
and unequal lengths that force length buckets.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mossvl_ascend.attention import core
from mossvl_ascend.attention.core import AttentionLayer, attention, per_request_attention
from mossvl_ascend.attention.metadata import ForwardAttentionMetadata
from support.attention import (
    SCALE,
    Request,
    batch_metadata,
    build_batch,
    example_requests,
    reference_cross_extend,
    reference_self_extend,
)
from support.precision import dense_same_dtype, fp64_reference, max_error

HEADS = {"gqa": (4, 2), "mha": (2, 2)}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run while it is active, and keeps their names."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def mixed_requests():
    """The example requests plus a 1-row extend after a cached prefix (a decode row inside a mixed batch)."""
    return example_requests() + [
        Request(spans=[3, 3], prefix_len=5, extend_len=1, visible_frame_counts=[2] * 6),
        Request(spans=[], prefix_len=0, extend_len=7),
    ]


def run(fn, batch, metadata, cross, logit_cap=0.0):
    layer = AttentionLayer(cross, SCALE, not cross, logit_cap)
    return fn(batch.query, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices, metadata, layer)


@pytest.mark.parametrize("logit_cap", [0.0, 1.5], ids=["plain", "softcap"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("cross", [True, False], ids=["cross", "self"])
def test_batched_equals_per_request_and_reference(cross, heads, logit_cap):
    batch = build_batch(mixed_requests(), *heads)
    metadata = batch_metadata(batch)
    batched = run(attention, batch, metadata, cross, logit_cap)
    looped = run(per_request_attention, batch, metadata, cross, logit_cap)
    reference = (reference_cross_extend if cross else reference_self_extend)(batch, SCALE, logit_cap)
    torch.testing.assert_close(batched, looped, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched, reference, atol=1e-5, rtol=1e-5)


class KernelCalls(TorchDispatchMode):
    """Records (is_causal, has a mask) of every CPU flash-kernel call run while it is active."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            is_causal = args[4] if len(args) > 4 else False  # (q, k, v, dropout_p, is_causal); defaults omitted
            self.calls.append((is_causal, kwargs.get("attn_mask") is not None))
        return func(*args, **kwargs)


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_fresh_prefills_run_the_kernels_causal_flag_and_match_the_reference(heads):
    """No request has a cached prefix: rows and keys start together, so the call passes the kernel's own causal flag
    and no mask; unequal lengths (padding), encoders in front of the text, 3 to 30 rows (GQA rows must not fold)."""
    requests = [
        Request(spans=[4, 4], prefix_len=0, extend_len=9, visible_frame_counts=[1] * 4 + [2] * 5),
        Request(spans=[], prefix_len=0, extend_len=3),
        Request(spans=[6], prefix_len=0, extend_len=30, visible_frame_counts=[1] * 30),
    ]
    batch = build_batch(requests, *heads)
    with KernelCalls() as kernel:
        out = run(attention, batch, batch_metadata(batch), cross=False)
    assert kernel.calls == [(True, False)]
    torch.testing.assert_close(out, reference_self_extend(batch, SCALE), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_budget", [False, True], ids=["one-call", "key-chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_fresh_prefills_within_the_precision_budget(monkeypatch, dtype, chunk_budget):
    """The causal-flag call in every dtype, several fresh requests (8:2 heads), against the fp64 reference on the
    same rounded inputs; budget as in test_attention_precision: fp32 1e-5, half precision 1.5x the error of one
    dense masked attention in that dtype + 1e-3 (causal row r = boundary r + 1 over the request's text keys).
    ``key-chunks``: a 16-key gather budget, so each request's keys go in chunks merged by log-sum-exp in fp32."""
    if chunk_budget:
        monkeypatch.setitem(core.GATHER_BUDGET_BYTES, "cpu", 16 * 2 * (2 * 8) * dtype.itemsize)
    requests = [
        Request(spans=[4, 4], prefix_len=0, extend_len=40, visible_frame_counts=[1] * 4 + [2] * 36),
        Request(spans=[], prefix_len=0, extend_len=5),
        Request(spans=[6], prefix_len=0, extend_len=57, visible_frame_counts=[1] * 57),
    ]
    batch = build_batch(requests, 8, 2)
    batch = dataclasses.replace(
        batch, query=batch.query.to(dtype), k_cache=batch.k_cache.to(dtype), v_cache=batch.v_cache.to(dtype)
    )
    out = run(attention, batch, batch_metadata(batch), cross=False)
    assert out.dtype == dtype
    for i, request in enumerate(requests):
        text_slots = batch.slots[i][request.encoder_len :]
        q = batch.query[batch.query_rows(i)].transpose(0, 1)  # [heads, rows, dim]
        k, v = (cache[text_slots].transpose(0, 1) for cache in (batch.k_cache, batch.v_cache))
        causal = torch.arange(1, request.extend_len + 1)
        reference = fp64_reference(q, k, v, causal, SCALE)
        error = max_error(out[batch.query_rows(i)].transpose(0, 1), reference, causal)
        budget = 1e-5
        if dtype != torch.float32:
            budget = 1.5 * max_error(dense_same_dtype(q, k, v, causal, SCALE), reference, causal) + 1e-3
        assert error <= budget, f"request {i} {dtype}: error {error:.3g} > budget {budget:.3g}"


def test_a_cached_prefix_in_the_call_keeps_the_mask():
    """One request with a cached prefix among fresh ones: the kernel's causal flag would align its rows with its
    first key, so the call keeps the mask."""
    requests = [Request(spans=[], prefix_len=0, extend_len=7), Request(spans=[], prefix_len=5, extend_len=4)]
    batch = build_batch(requests)
    with KernelCalls() as kernel:
        out = run(attention, batch, batch_metadata(batch), cross=False)
    assert kernel.calls == [(False, True)]
    torch.testing.assert_close(out, reference_self_extend(batch, SCALE), atol=1e-5, rtol=1e-5)


def test_unequal_lengths_split_into_few_buckets_not_one_call_per_request(monkeypatch):
    lengths = [1, 2, 3, 20, 21, 22, 23, 24, 25, 26, 27, 28]
    requests = [Request(spans=[], prefix_len=n - 1, extend_len=1) for n in lengths]
    batch = build_batch(requests)
    metadata = ForwardAttentionMetadata.for_decode(lengths, [0] * len(lengths), "cpu")
    monkeypatch.setattr(core, "_PADDING_FLOOR", 0)
    groups = core._build_groups(metadata, batch.req_to_token, batch.req_pool_indices, False)
    assert 1 < len(groups) <= 3
    out = run(attention, batch, metadata, cross=False)
    torch.testing.assert_close(out, reference_self_extend(batch, SCALE), atol=1e-5, rtol=1e-5)


def test_building_a_forwards_tables_takes_as_many_ops_for_16_requests_as_for_one():
    """Host work per forward must not grow with the batch: the padded tables of a decode batch (self and cross,
    unequal lengths, one bucket) are built with the same number of aten ops for 1 and for 16 requests."""

    def ops_to_build(count):
        requests = [Request(spans=[3, 2], prefix_len=4 + i % 5, extend_len=1) for i in range(count)]
        batch = build_batch(requests)
        metadata = ForwardAttentionMetadata.for_decode(
            [r.text_len for r in requests], [r.encoder_len for r in requests], "cpu"
        )
        with OpCounter() as counter:
            for cross in (False, True):
                assert len(core._build_groups(metadata, batch.req_to_token, batch.req_pool_indices, cross)) == 1
        return counter.ops

    assert ops_to_build(16) <= ops_to_build(1) + 4


def test_groups_are_built_once_per_forward():
    batch = build_batch(mixed_requests())
    metadata = batch_metadata(batch)
    run(attention, batch, metadata, cross=False)
    first = metadata._cache[("groups", False)]
    run(attention, batch, metadata, cross=False)
    assert metadata._cache[("groups", False)] is first


def test_gather_budget_splits_the_batch_and_keeps_the_result(monkeypatch):
    """A call's gathered K/V is bounded per device: a small budget gives several calls, the same numbers."""
    batch = build_batch(mixed_requests())
    monkeypatch.setitem(core.GATHER_BUDGET_BYTES, "cpu", 16 * 2 * (2 * 8) * 4)  # 16 padded keys (K + V, fp32)
    metadata = batch_metadata(batch)
    out = run(attention, batch, metadata, cross=False)
    assert len(metadata._cache[("groups", False)]) >= 3
    torch.testing.assert_close(out, reference_self_extend(batch, SCALE), atol=1e-5, rtol=1e-5)


# K + V bytes of one key of build_batch's pool (2 KV heads x HEAD_DIM 8, fp32).
KEY_BYTES = 2 * (2 * 8) * 4


def long_context_requests():
    """Requests whose keys alone outgrow a 3-key budget: a decode row after 20 cached tokens, an extend after a
    cached prefix, a fresh prefill (its causal limit must cross chunk edges), and a frame-windowed extend whose rows
    see frames 1-2 of 3 (whole chunks of keys no row sees)."""
    return [
        Request(spans=[4, 5], prefix_len=20, extend_len=1, visible_frame_counts=[2] * 21),
        Request(spans=[3], prefix_len=9, extend_len=7, visible_frame_counts=[0] * 11 + [1] * 5),
        Request(spans=[], prefix_len=0, extend_len=13),
        Request(
            spans=[3, 4, 2],
            prefix_len=2,
            extend_len=5,
            visible_frame_counts=[1, 1, 2, 2, 3, 3, 3],
            first_visible_frames=[0, 0, 1, 1, 1, 2, 2],
        ),
    ]


@pytest.mark.parametrize("logit_cap", [0.0, 1.5], ids=["plain", "softcap"])
@pytest.mark.parametrize("cross", [True, False], ids=["cross", "self"])
@pytest.mark.parametrize("alone", [True, False], ids=["each-alone", "one-batch"])
def test_keys_beyond_the_gather_budget_go_in_chunks_with_the_same_numbers(monkeypatch, cross, alone, logit_cap):
    """A request whose keys alone outgrow the budget is computed over chunks of keys merged by log-sum-exp: the
    same numbers as the dense reference (causal limit, cached prefix, frame boundaries, a window, blind rows),
    and neither gather buffer ever holds more than the budget, however long the context."""
    budget_keys = 3
    monkeypatch.setitem(core.GATHER_BUDGET_BYTES, "cpu", budget_keys * KEY_BYTES)
    workspace = core.GatherWorkspace()
    monkeypatch.setattr(core, "GATHER_WORKSPACE", workspace)
    requests = long_context_requests()
    for batch in [build_batch([r]) for r in requests] if alone else [build_batch(requests)]:
        metadata = batch_metadata(batch)
        with KernelCalls() as kernel:
            out = run(attention, batch, metadata, cross, logit_cap)
        reference = (reference_cross_extend if cross else reference_self_extend)(batch, SCALE, logit_cap)
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
        if not cross:  # cross-attention's staircase requests gather their whole encoder (module doc)
            assert sum(b.numel() * b.element_size() for b in workspace._buffers.values()) <= budget_keys * KEY_BYTES
            assert logit_cap or len(kernel.calls) >= 2


def test_a_chunked_fresh_prefill_skips_the_rows_before_each_chunk(monkeypatch):
    """The causal limit of a fresh prefill in chunks: rows before a chunk's first key see none of it and are not
    computed, so the kernel gets fewer query rows per chunk (13 rows, 4-key chunks: 13, 9, 5, 1)."""
    monkeypatch.setitem(core.GATHER_BUDGET_BYTES, "cpu", 4 * KEY_BYTES)
    batch = build_batch([Request(spans=[], prefix_len=0, extend_len=13)], *HEADS["mha"])  # no GQA row folding
    rows = []

    class QueryRows(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
                rows.append(args[0].shape[2])
            return func(*args, **(kwargs or {}))

    with QueryRows():
        out = run(attention, batch, batch_metadata(batch), cross=False)
    assert rows == [13, 9, 5, 1]
    torch.testing.assert_close(out, reference_self_extend(batch, SCALE), atol=1e-5, rtol=1e-5)


def one_row_extend_requests():
    """Mixed-batch members of one new row each: seeing the first frame only, no frame, every frame, no encoder."""
    return [
        Request(spans=[4, 3], prefix_len=2, extend_len=1, visible_frame_counts=[1, 1, 1]),
        Request(spans=[5], prefix_len=1, extend_len=1, visible_frame_counts=[0, 0]),
        Request(spans=[2, 2, 2], prefix_len=4, extend_len=1, visible_frame_counts=[3] * 5),
        Request(spans=[], prefix_len=3, extend_len=1),
    ]


@pytest.mark.parametrize("cross", [True, False], ids=["cross", "self"])
def test_default_path_reads_no_device_value_on_the_host(cross):
    """One-row members with their own boundaries: the default (gather) path builds its tables and attends without
    reading a device value on the host (``aten._local_scalar_dense``, behind ``int()`` / ``.item()``), which would
    be a device sync per request on an NPU; the result still equals the dense reference."""
    batch = build_batch(one_row_extend_requests())
    metadata = batch_metadata(batch)
    with OpCounter() as counter:
        out = run(attention, batch, metadata, cross)
    assert "_local_scalar_dense" not in counter.names
    reference = (reference_cross_extend if cross else reference_self_extend)(batch, SCALE)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_gather_workspace_returns_the_rows_and_reuses_its_buffer():
    """The reused gather buffer gives ``cache[slots]`` for any slot shape, size or dtype, and a gather no larger
    than an earlier one writes into the same memory (no allocation per layer call)."""
    workspace = core.GatherWorkspace()
    cache = torch.randn(50, 2, 8)
    large = torch.randint(0, 50, (4, 9))
    small = torch.randint(0, 50, (3, 5))
    first = workspace.gather("k", cache, large)
    torch.testing.assert_close(first, cache[large], atol=0, rtol=0)
    pointer = first.data_ptr()
    second = workspace.gather("k", cache, small)
    torch.testing.assert_close(second, cache[small], atol=0, rtol=0)
    assert second.data_ptr() == pointer
    other_role = workspace.gather("v", cache, small)
    assert other_role.data_ptr() != pointer  # K and V are live together: one buffer each
    torch.testing.assert_close(workspace.gather("k", cache.half(), large), cache.half()[large], atol=0, rtol=0)
