"""The attention core's NPU primitives in every group type, on CPU tensors through the STAND-IN FIA of
tests/fake_torch_npu.py (routed by ``support.simulated_npu.npu_attention_on_cpu``: the CPU's fused primitive is the
NPU one), in bf16 and fp16, at tiny shapes and at MOSS-VL-Instruct's (32 query / 8 KV heads, head_dim 128).

Oracle: per request, the fp64 reference of support.precision on the same rounded inputs, over the keys the request
may see (self-attention: its text up to each row; cross-attention: the encoder prefix of each row's frames). Budget
as in test_attention_precision: 1.5 x the error of one dense SDPA in the same dtype on the same inputs, + 1e-3;
rows that see no frame must be exactly 0. The batches mix cached text prefixes and fresh prompts, unequal lengths
(padding), several requests per call, rows seeing no frame, encoders before the text, so a mask of the wrong
polarity, a causal limit at the wrong offset or keys read from the wrong slots fail. Each test also checks the form
of the op calls: the compressed causal mode instead of a rows x keys mask, per-request lengths, block tables.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mossvl_ascend.attention import core
from mossvl_ascend.attention.core import AttentionLayer, attention
from mossvl_ascend.attention.metadata import ForwardAttentionMetadata
from mossvl_ascend.attention.primitives import NPU_COMPRESSED_MASK_SIZE
from support.attention import (
    BLIND,
    CROSS_BOUNDARIES,
    CROSS_UNIFORM,
    DECODE,
    FRESH_PREFILLS,
    NPU_SHAPES,
    ONE_ROW_EXTENDS,
    PREFIXED_SELF,
    STAIRCASE,
    Request,
    batch_metadata,
    build_banded_batch,
    build_paged_batch,
    errors_against_fp64,
    reference_cross_extend,
    reference_self_extend,
    run_core_layer,
)
from support.simulated_npu import HostReads, npu_attention_on_cpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
EVERY_SHAPE_AND_DTYPE = [
    pytest.param(shape, dtype, id=f"{shape_id}-{dtype_id}")
    for shape_id, shape in NPU_SHAPES.items()
    for dtype_id, dtype in DTYPES.items()
]


def assert_within_budget(out, batch, cross):
    assert out.dtype == batch.query.dtype
    for i, (error, budget) in enumerate(errors_against_fp64(out, batch, cross)):
        assert error <= budget, f"request {i} {out.dtype}: error {error:.3g} > budget {budget:.3g}"


def npu_batch(requests, shape, dtype, page_size=1, seed=0):
    return build_paged_batch(requests, *shape, dtype, page_size, seed=seed)


def is_compressed_causal(call):
    mask = call.get("atten_mask")
    return call.get("sparse_mode") == 3 and mask is not None and mask.shape == (NPU_COMPRESSED_MASK_SIZE,) * 2


@pytest.mark.parametrize("shape, dtype", EVERY_SHAPE_AND_DTYPE)
@pytest.mark.parametrize("requests", [PREFIXED_SELF, FRESH_PREFILLS], ids=["cached-prefixes", "fresh-prefills"])
def test_batched_self_attention_takes_the_compressed_causal_mode(monkeypatch, requests, shape, dtype):
    """Padded self-attention of several requests, with and without cached prefixes: one call, sparse_mode 3 with
    the 2048^2 mask (each request's rows end at its last key), per-request rows and text lengths, no rows x keys
    mask."""
    batch = npu_batch(requests, shape, dtype)
    with npu_attention_on_cpu(monkeypatch) as calls:
        out = run_core_layer(batch, batch_metadata(batch), cross=False)
    assert len(calls) == 1 and is_compressed_causal(calls[0])
    lengths = sorted(zip(calls[0]["actual_seq_lengths"], calls[0]["actual_seq_lengths_kv"]))
    assert lengths == sorted((r.extend_len, r.text_len) for r in requests)
    assert_within_budget(out, batch, cross=False)


def decode_metadata(batch):
    requests = batch.requests
    return ForwardAttentionMetadata.for_decode([r.text_len for r in requests], [r.encoder_len for r in requests], "cpu")


@pytest.mark.parametrize("shape, dtype", EVERY_SHAPE_AND_DTYPE)
@pytest.mark.parametrize("cross", [True, False], ids=["cross", "self"])
def test_decode_cuts_each_request_by_its_kv_length(monkeypatch, cross, shape, dtype):
    """Decode (one row each, unequal lengths): no mask at all, each request's keys cut by actual_seq_lengths_kv."""
    batch = npu_batch(DECODE, shape, dtype, seed=1)
    with npu_attention_on_cpu(monkeypatch) as calls:
        out = run_core_layer(batch, decode_metadata(batch), cross)
    assert len(calls) == 1 and "atten_mask" not in calls[0] and "actual_seq_lengths" not in calls[0]
    members = [r for r in DECODE if r.encoder_len or not cross]
    expected = sorted(r.encoder_len if cross else r.text_len for r in members)
    assert sorted(calls[0]["actual_seq_lengths_kv"]) == expected
    assert_within_budget(out, batch, cross)


@pytest.mark.parametrize("shape, dtype", EVERY_SHAPE_AND_DTYPE)
def test_cross_boundary_masks_in_one_masked_call(monkeypatch, shape, dtype):
    """Rows of a request that see different frames (some none): one call with the full mask (True = masked out)
    and the encoder lengths; a request without an encoder is in no call."""
    batch = npu_batch(CROSS_BOUNDARIES, shape, dtype, seed=2)
    with npu_attention_on_cpu(monkeypatch) as calls:
        out = run_core_layer(batch, batch_metadata(batch), cross=True)
    assert len(calls) == 1 and calls[0].get("sparse_mode", 0) == 0
    assert calls[0]["atten_mask"].shape == (4, 1, 6, 12) and calls[0]["atten_mask"].dtype == torch.bool
    assert_within_budget(out, batch, cross=True)


@pytest.mark.parametrize("shape, dtype", EVERY_SHAPE_AND_DTYPE)
def test_cross_rows_seeing_one_prefix_need_no_mask(monkeypatch, shape, dtype):
    """Every row of each request sees one encoder prefix (an image then a question; a decode-like row): the
    prefix goes as the request's KV length, no mask."""
    batch = npu_batch(CROSS_UNIFORM, shape, dtype, seed=3)
    with npu_attention_on_cpu(monkeypatch) as calls:
        out = run_core_layer(batch, batch_metadata(batch), cross=True)
    assert len(calls) == 1 and "atten_mask" not in calls[0]
    assert sorted(calls[0]["actual_seq_lengths_kv"]) == [6, 6, 8]
    assert_within_budget(out, batch, cross=True)


@pytest.mark.parametrize("shape, dtype", EVERY_SHAPE_AND_DTYPE)
def test_frame_causal_block_plan_through_the_npu_primitive(monkeypatch, shape, dtype):
    """The long staircase goes block by block (unmasked rectangles, masked leaves), merged by the op's LSE; a
    natural-log LSE is needed for the merge to be exact."""
    batch = npu_batch(STAIRCASE, shape, dtype, seed=4)
    metadata = batch_metadata(batch)
    plan = metadata.plans[0]
    assert len(plan.blocks) >= 3 and any(block.masked for block in plan.blocks)
    with npu_attention_on_cpu(monkeypatch) as calls:
        out = run_core_layer(batch, metadata, cross=True)
    assert len(calls) == len(plan.blocks) + 1
    assert_within_budget(out, batch, cross=True)


@pytest.mark.parametrize("paged", [False, True], ids=["default", "paged"])
def test_all_blind_group_sends_no_call(monkeypatch, paged):
    """Requests whose rows all see no frame are in no cross-attention call (so the paged path never sends an empty
    block table); their rows are 0."""
    batch = npu_batch(BLIND, NPU_SHAPES["tiny"], torch.bfloat16, page_size=16 if paged else 1, seed=5)
    with npu_attention_on_cpu(monkeypatch, paged=paged) as calls:
        out = run_core_layer(batch, batch_metadata(batch), cross=True, page_size=16 if paged else 1)
    assert calls == [] and not out.any()


@pytest.mark.parametrize("shape, dtype", EVERY_SHAPE_AND_DTYPE)
@pytest.mark.parametrize("page_size", [128, 16])
@pytest.mark.parametrize("cross", [True, False], ids=["cross", "self"])
def test_opt_in_paged_decode_at_npu_page_sizes(monkeypatch, cross, page_size, shape, dtype):
    """MOSSVL_NPU_PAGED_ATTENTION=1: one-row rows (decode, and one-row extends seeing the first frame only, no
    frame, every frame, no encoder) read in place from a pool of page_size slots per page, requests spanning
    several pages, behind encoders of 90-240 tokens: one call with a block table; self-attention masks its
    encoder (True = masked out)."""
    batch = npu_batch(ONE_ROW_EXTENDS, shape, dtype, page_size=page_size, seed=6)
    with npu_attention_on_cpu(monkeypatch, paged=True) as calls:
        out = run_core_layer(batch, batch_metadata(batch), cross, page_size=page_size)
    assert len(calls) == 1 and calls[0]["block_size"] == page_size
    assert calls[0]["block_table"].dtype == torch.int32
    assert (calls[0].get("atten_mask") is None) == cross
    assert_within_budget(out, batch, cross)


def test_paged_table_reads_every_page_of_a_request(monkeypatch):
    """A request over three pages of 128: the block table lists its pages in order (a table shifted by one page
    reads another request's keys)."""
    requests = [Request(spans=[200], prefix_len=100, extend_len=1), Request(spans=[130], prefix_len=5, extend_len=1)]
    batch = npu_batch(requests, NPU_SHAPES["tiny"], torch.bfloat16, page_size=128, seed=7)
    with npu_attention_on_cpu(monkeypatch, paged=True) as calls:
        out = run_core_layer(batch, batch_metadata(batch), cross=False, page_size=128)
    table = calls[0]["block_table"].tolist()
    for slots in batch.slots:
        pages = (slots[::128] // 128).tolist()
        assert len(pages) > 1 and any(row[: len(pages)] == pages for row in table)
    assert_within_budget(out, batch, cross=False)


def mixed_forward():
    """Every group type in one forward: prefixed and fresh self rows, a staircase, masked and one-row cross rows,
    blind rows, decode-like rows."""
    return STAIRCASE + CROSS_BOUNDARIES + ONE_ROW_EXTENDS


@pytest.mark.parametrize("paged", [False, True], ids=["default", "paged"])
def test_no_host_read_or_host_copy_per_layer(monkeypatch, paged):
    """After the first layer of each kind built the forward's tables, a layer (default path: every group type in
    one forward; paged: one-row rows of every kind) reads no device value on the host
    (``.item()``, ``int()``, ``.tolist()``, ``torch.equal``, ``nonzero``) and copies no host data to the device:
    0 per layer on both NPU paths (each is a sync or a copy per layer on an NPU). The op's stand-in is not counted."""
    page_size = 16 if paged else 1
    requests = ONE_ROW_EXTENDS + DECODE if paged else mixed_forward()  # the paged call takes one-row groups
    batch = npu_batch(requests, NPU_SHAPES["tiny"], torch.bfloat16, page_size=page_size, seed=8)
    metadata = batch_metadata(batch)
    host_reads = HostReads()
    with npu_attention_on_cpu(monkeypatch, paged=paged, host_reads=host_reads) as calls:
        for cross in (False, True):
            run_core_layer(batch, metadata, cross, page_size)
        first_forward_calls = len(calls)
        with host_reads:
            outputs = {cross: run_core_layer(batch, metadata, cross, page_size) for cross in (False, True)}
    assert host_reads.reads == [] and host_reads.copies == []
    assert len(calls) == 2 * first_forward_calls
    assert any("block_table" in call for call in calls) == paged
    for cross, out in outputs.items():
        assert_within_budget(out, batch, cross)


def test_host_read_counter_sees_reads_and_copies():
    """The counter above can fail: each kind of host read and copy is counted."""
    tensor = torch.arange(4)
    with HostReads() as counter:
        int(tensor[1])
        tensor.tolist()
        torch.equal(tensor, tensor)
        torch.tensor([1, 2])
    assert counter.reads == ["_local_scalar_dense", "tolist", "equal"] and counter.copies == ["lift_fresh"]


def test_cpu_path_keeps_its_kernel_flag_and_masks(monkeypatch):
    """Without the NPU routing the CPU primitive still gets masks and the kernel's causal flag (no lengths)."""
    batch = npu_batch(PREFIXED_SELF, NPU_SHAPES["tiny"], torch.float32)
    groups = core._build_groups(batch_metadata(batch), batch.req_to_token, batch.req_pool_indices, False)
    assert all(group.visible is not None and not group.by_lengths for group in groups)


@pytest.mark.parametrize("cross", [True, False], ids=["cross", "self"])
def test_softcapped_layers_turn_the_lengths_into_a_mask(monkeypatch, cross):
    """No fused op has a softcap: with the NPU routing such a layer takes the plain path, its lengths and causal
    limit become a mask there (fp32, against the dense softcapped reference)."""
    requests = CROSS_BOUNDARIES if cross else PREFIXED_SELF
    batch = npu_batch(requests, NPU_SHAPES["tiny"], torch.float32, seed=9)
    scale = batch.query.shape[-1] ** -0.5
    layer = AttentionLayer(cross, scale, not cross, logit_cap=1.5)
    with npu_attention_on_cpu(monkeypatch) as calls:
        args = (batch.query, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices)
        out = attention(*args, batch_metadata(batch), layer)
    assert calls == []
    reference = (reference_cross_extend if cross else reference_self_extend)(batch, scale, 1.5)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


BANDED_ROUTES = [
    pytest.param("cpu", 1, id="cpu-page1"),
    pytest.param("cpu", 128, id="cpu-page128"),
    pytest.param("npu", 128, id="npu-page128"),
    pytest.param("npu-paged", 128, id="npu-paged-page128"),
    pytest.param("npu-paged", 16, id="npu-paged-page16"),
]


@pytest.mark.parametrize("route, page_size", BANDED_ROUTES)
@pytest.mark.parametrize("bands", [3, 4])
@pytest.mark.parametrize("cross", [True, False], ids=["cross", "self"])
def test_the_mossvl_kv_layout_reads_each_vision_token_at_its_band(monkeypatch, cross, bands, route, page_size):
    """MOSS-VL KV layout (three or four vision tokens per encoder slot, encoders of 90-240 vision tokens that are
    not multiples of the bands, text sharing the last encoder page): cross-attention finds vision token t at band
    t // R of encoder slot t % R and self-attention finds the text behind the R encoder slots, on the CPU kernel,
    through the NPU stand-in, and from the paged pool's block tables (one block run per band)."""
    requests = ONE_ROW_EXTENDS if route == "npu-paged" else mixed_forward()
    batch = build_banded_batch(requests, *NPU_SHAPES["tiny"], torch.bfloat16, page_size, bands, cross, seed=11)
    if route == "cpu":
        out = run_core_layer(batch, batch_metadata(batch), cross, page_size=page_size)
    else:
        with npu_attention_on_cpu(monkeypatch, paged=route == "npu-paged") as calls:
            out = run_core_layer(batch, batch_metadata(batch), cross, page_size=page_size)
        assert any("block_table" in call for call in calls) == (route == "npu-paged")
    assert_within_budget(out, batch, cross)


def test_a_band_offset_off_by_one_page_reads_other_keys(monkeypatch):
    """The banded test above can fail: the same batch read with the bands one page further apart is wrong."""
    batch = build_banded_batch(ONE_ROW_EXTENDS, *NPU_SHAPES["tiny"], torch.bfloat16, 16, 3, True, seed=11)
    shifted = core.EncoderAddressing(batch.addressing.bands, batch.addressing.band_stride + 16)
    with npu_attention_on_cpu(monkeypatch, paged=True):
        out = run_core_layer(dataclasses.replace(batch, addressing=shifted), batch_metadata(batch), True, 16)
    assert any(error > budget for error, budget in errors_against_fp64(out, batch, cross=True))
