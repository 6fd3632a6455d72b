"""The CPU server's MossVL attention runs the patched Ascend native math (item 9).

Real: ``TorchNativeAttnBackend`` (constructed with a stand-in model runner that only carries
the device and the two pools), its ``forward_extend`` / ``forward_decode`` wrapped by our hooks
through HookRegistry, ``AttentionBackend.forward`` dispatch, ``MHATokenToKVPool`` (the CPU
server's KV pool), ``ReqToTokenPool``, ``RadixAttention``, ``ForwardBatch``. The checks are the
same ones tests/test_ascend_backend.py runs on ``AscendAttnBackend``; oracle: the dense fp32
reference of support.attention.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from mossvl_ascend.patches import cpu_attention, native_attention
from support.attention import (
    ROUTE_HEADS,
    SCALE,
    Request,
    build_batch,
    causal_with_prefix,
    check_decode_cross_reads_cached_encoder_and_sees_all_frames,
    check_decode_self_writes_token_and_reads_text_window,
    check_extend_cross_with_cached_encoders_writes_nothing,
    check_extend_cross_writes_new_encoder_and_applies_mask,
    check_extend_self_with_cached_prefix,
    cross_extend_of_one_request,
    example_requests,
    load_batch_into_pools,
    make_forward_batch,
    make_layers,
    make_req_to_token_pool,
    new_text_slots,
    reference_attention,
    reference_cross_extend,
)
from support.hooks import patches_applied


def make_cpu_route():
    pool = MHATokenToKVPool(
        size=512,
        page_size=1,
        dtype=torch.float32,
        head_num=ROUTE_HEADS[1],
        head_dim=8,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    req_to_token_pool = make_req_to_token_pool()
    runner = SimpleNamespace(device="cpu", req_to_token_pool=req_to_token_pool, token_to_kv_pool=pool)
    return TorchNativeAttnBackend(runner), pool, req_to_token_pool


@pytest.fixture
def route():
    with patches_applied(*native_attention.PATCHES, *cpu_attention.PATCHES):
        yield make_cpu_route()


SOFTCAP = pytest.mark.parametrize("logit_cap", [0.0, 1.5], ids=["plain", "softcap"])


@SOFTCAP
def test_extend_cross_writes_new_encoder_and_applies_mask(route, logit_cap):
    check_extend_cross_writes_new_encoder_and_applies_mask(*route, logit_cap)


def test_extend_cross_with_cached_encoders_writes_nothing(route):
    check_extend_cross_with_cached_encoders_writes_nothing(*route)


@SOFTCAP
def test_extend_self_with_cached_prefix(route, logit_cap):
    check_extend_self_with_cached_prefix(*route, logit_cap)


@SOFTCAP
def test_decode_cross_reads_cached_encoder_and_sees_all_frames(route, logit_cap):
    check_decode_cross_reads_cached_encoder_and_sees_all_frames(*route, logit_cap)


def test_decode_self_writes_token_and_reads_text_window(route):
    check_decode_self_writes_token_and_reads_text_window(*route)


def test_encoder_batches_reach_the_core_once_per_layer_without_the_stock_method(route, monkeypatch):
    """The route calls the attention core directly (the code the Ascend hook runs), never the stock native
    method, and builds the forward's metadata once for all its layers."""
    from sglang.srt.hardware_backend.npu.attention.ascend_torch_native_backend import AscendTorchNativeAttnBackend

    from mossvl_ascend.attention import sglang_layer

    def stock_must_not_run(*args, **kwargs):
        raise AssertionError("the CPU route went through run_sdpa_forward_extend")

    monkeypatch.setattr(AscendTorchNativeAttnBackend, "run_sdpa_forward_extend", stock_must_not_run)
    metadata_seen = []
    core_attention = sglang_layer.attention

    def recording(*args, **kwargs):
        metadata_seen.append(args[5])
        return core_attention(*args, **kwargs)

    monkeypatch.setattr(sglang_layer, "attention", recording)
    backend, pool, req_to_token_pool = route
    batch = build_batch(example_requests(), *ROUTE_HEADS)
    load_batch_into_pools(batch, pool, req_to_token_pool)
    forward_batch = make_forward_batch(
        batch,
        ForwardMode.EXTEND,
        out_cache_loc=new_text_slots(batch),
        encoder_out_cache_loc=torch.zeros(0, dtype=torch.long),
        mask=batch.packed_mask(),
    )
    cross, self_attn = make_layers()
    for layer in (cross, self_attn, cross):
        backend.forward(batch.query.flatten(1), None, None, layer, forward_batch, save_kv_cache=False)
    assert len(metadata_seen) == 3 and all(m is metadata_seen[0] for m in metadata_seen)


def test_text_only_batches_keep_the_stock_torch_native_path(route):
    backend, pool, req_to_token_pool = route
    req = Request(spans=[], prefix_len=0, extend_len=5)
    batch = build_batch([req], *ROUTE_HEADS)
    load_batch_into_pools(batch, pool, req_to_token_pool)
    forward_batch = make_forward_batch(
        batch, ForwardMode.EXTEND, out_cache_loc=new_text_slots(batch), encoder_out_cache_loc=None
    )
    forward_batch.encoder_lens = None
    _, self_attn = make_layers()
    out = backend.forward(batch.query.flatten(1), None, None, self_attn, forward_batch)
    expected = reference_attention(batch.query, batch.text_k[0], batch.text_v[0], causal_with_prefix(5, 0), SCALE)
    torch.testing.assert_close(out.view_as(expected), expected, atol=1e-5, rtol=1e-5)


def test_stock_torch_native_drops_the_frame_mask():
    """Why the route exists: unhooked torch_native gives every token every frame."""
    out, batch = cross_extend_of_one_request(*make_cpu_route())
    assert not torch.allclose(out, reference_cross_extend(batch, SCALE), atol=1e-3)


def test_route_is_applied_on_cpu_hosts_only():
    """GPU hosts keep stock torch_native; on an NPU host MOSS-VL runs the Ascend backend, not this route."""
    from mossvl_ascend.registry import CPU, NPU, patches_for

    assert patches_for("gpu", cpu_attention.PATCHES) == []
    assert patches_for(NPU, cpu_attention.PATCHES) == []
    assert patches_for(CPU, cpu_attention.PATCHES) == list(cpu_attention.PATCHES)
