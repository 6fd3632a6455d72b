"""Mixed batches (``--enable-mixed-chunk``) of MOSS-VL on the Ascend backend take the encoder-aware math (issue 12).

On an NPU, ``AttentionBackend.forward`` sends a MIXED batch to ``AscendAttnBackend.forward_mixed``, a fused path
that ignores the encoder. Same harness as test_ascend_backend (real ``ascend_backend`` module imported with the
STAND-IN ``torch_npu`` of tests/fake_torch_npu.py, real NPU KV pool, real ``AttentionBackend.forward`` dispatch
with ``is_npu`` answered True as on an NPU); oracle: the dense fp32 reference of test_native_attention.
"""

from __future__ import annotations

import pytest
import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode

import test_native_attention as native
from test_ascend_backend import hooked, make_ascend_backend, make_npu_pool, npu_modules  # noqa: F401 (fixtures)


@pytest.fixture
def npu_dispatch(monkeypatch):
    """``AttentionBackend.forward`` as on an NPU: MIXED batches go to ``forward_mixed``."""
    import sglang.srt.layers.attention.base_attn_backend as base

    monkeypatch.setattr(base, "is_npu", lambda: True)


def mixed_forward_batch(batch, mask):
    return native.make_forward_batch(
        batch, ForwardMode.MIXED, out_cache_loc=native.new_text_slots(batch),
        encoder_out_cache_loc=torch.zeros(0, dtype=torch.long), mask=mask,
    )  # fmt: skip


def run_cross_and_self(backend, pool, req_to_token_pool):
    batch = native.build_batch(native.example_requests(), *native.ROUTE_HEADS)
    new_slots = native.new_text_slots(batch)
    native.load_batch_into_pools(batch, pool, req_to_token_pool, except_slots=[new_slots])
    cross, self_attn = native.make_layers()
    new_k = torch.cat([k[r.prefix_len :] for r, k in zip(batch.requests, batch.text_k)])
    new_v = torch.cat([v[r.prefix_len :] for r, v in zip(batch.requests, batch.text_v)])
    forward_batch = mixed_forward_batch(batch, batch.packed_mask())
    self_out = backend.forward(batch.query.flatten(1), new_k, new_v, self_attn, forward_batch)
    cross_batch = native.build_batch([native.example_requests()[i] for i in (2, 1, 3)], *native.ROUTE_HEADS)
    native.load_batch_into_pools(cross_batch, pool, req_to_token_pool)
    cross_out = backend.forward(
        cross_batch.query.flatten(1), None, None, cross, mixed_forward_batch(cross_batch, cross_batch.packed_mask())
    )
    self_expected = native.reference_self_extend(batch, native.SCALE)
    cross_expected = native.reference_cross_extend(cross_batch, native.SCALE)
    return (self_out, self_expected), (cross_out, cross_expected)


def test_mixed_batches_take_the_encoder_aware_math(hooked, npu_dispatch):
    ascend_module, memory_pool_npu = hooked
    pool, req_to_token_pool = make_npu_pool(memory_pool_npu), native.make_req_to_token_pool()
    backend = make_ascend_backend(ascend_module, pool, req_to_token_pool)
    for out, expected in run_cross_and_self(backend, pool, req_to_token_pool):
        torch.testing.assert_close(out.view_as(expected), expected, atol=1e-5, rtol=1e-5)


def test_stock_forward_mixed_is_the_fused_path(npu_modules, npu_dispatch):
    """Why the hook exists: unhooked, a MIXED MOSS-VL batch reaches the fused NPU kernel, which has no encoder
    argument (neither the stand-in nor torch's op registry on this machine provides it: it raises)."""
    ascend_module, memory_pool_npu = npu_modules
    pool, req_to_token_pool = make_npu_pool(memory_pool_npu), native.make_req_to_token_pool()
    backend = make_ascend_backend(ascend_module, pool, req_to_token_pool)
    with pytest.raises((NotImplementedError, AttributeError), match="npu_fused_infer_attention_score"):
        run_cross_and_self(backend, pool, req_to_token_pool)
