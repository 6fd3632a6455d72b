"""AscendAttnBackend.forward_extend / forward_decode on MossVL-shaped batches (items 3 and 5).

Real: sglang's ``ascend_backend`` module and ``AscendAttnBackend`` class (imported with the
STAND-IN ``torch_npu`` of tests/fake_torch_npu.py), its ``forward_extend`` / ``forward_decode``
(wrapped by our hooks through HookRegistry), ``AttentionBackend.forward`` dispatch,
``AscendTorchNativeAttnBackend``, ``NPUMHATokenToKVPool`` (its ``set_kv_buffer`` calls the
stand-in's pure-torch ``_npu_reshape_and_cache``), ``ReqToTokenPool``, ``RadixAttention``,
``ForwardBatch``, ``ForwardMetadata``.
Stand-ins: ``torch_npu`` / ``sgl_kernel_npu`` (every op but the KV write raises), and the backend
object is built with ``object.__new__`` plus the attributes the methods read (its real
constructor allocates NPU tensors). Oracle: the dense fp32 reference of support.attention.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from sglang.srt.hardware_backend.npu.attention.ascend_torch_native_backend import (
    AscendTorchNativeAttnBackend,
)
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from fake_torch_npu import installed_fake_torch_npu
from mossvl_ascend.patches import ascend_backend as ascend_hooks
from mossvl_ascend.patches import native_attention
from support.attention import (
    ROUTE_HEADS,
    SCALE,
    build_batch,
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
    reference_cross_extend,
    reference_self_extend,
)
from support.hooks import patches_applied

TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def npu_modules():
    """The real ascend_backend module imported against the stand-in torch_npu."""
    import importlib

    import sglang.srt.hardware_backend.npu.memory_pool_npu as memory_pool_npu

    # fp32 pools (which a 910B refuses) keep the routing checks exact against the fp32 reference; the NPU ops
    # themselves are tested in fp16/bf16 (tests/test_fake_torch_npu.py, tests/test_npu_attention_core.py).
    with installed_fake_torch_npu(float32_kv_cache=True) as fake, pytest.MonkeyPatch.context() as mp:
        # memory_pool_npu binds torch_npu only when is_npu(); give it the stand-in.
        mp.setattr(memory_pool_npu, "torch_npu", fake, raising=False)
        module = importlib.import_module(ascend_hooks.ASCEND_BACKEND_MODULE)
        yield module, memory_pool_npu


@pytest.fixture
def hooked(npu_modules):
    with patches_applied(*native_attention.PATCHES, *ascend_hooks.PATCHES):
        yield npu_modules


def make_ascend_backend(ascend_module, pool, req_to_token_pool, *, use_fia=False):
    """AscendAttnBackend without its NPU constructor: the attributes forward_* read, eager mode."""
    backend = object.__new__(ascend_module.AscendAttnBackend)
    backend.forward_metadata = ascend_module.ForwardMetadata()
    backend.native_attn = AscendTorchNativeAttnBackend()
    backend.token_to_kv_pool = pool
    backend.req_to_token_pool = req_to_token_pool
    backend.use_mla = False
    backend.graph_mode = False
    backend.enable_torch_compile = False
    backend.is_dllm_model = False
    backend.is_hybrid_swa = False
    backend.use_alibi = False
    backend.use_fia = use_fia
    backend.use_fa = False
    backend.attn_cp_size = 1
    return backend


def make_npu_pool(memory_pool_npu):
    num_kv_heads = ROUTE_HEADS[1]
    return memory_pool_npu.NPUMHATokenToKVPool(
        size=512,
        page_size=128,
        dtype=torch.float32,
        head_num=num_kv_heads,
        head_dim=8,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )


@pytest.fixture
def route(hooked, request):
    ascend_module, memory_pool_npu = hooked
    pool = make_npu_pool(memory_pool_npu)
    req_to_token_pool = make_req_to_token_pool()
    use_fia = getattr(request, "param", False)
    return make_ascend_backend(ascend_module, pool, req_to_token_pool, use_fia=use_fia), pool, req_to_token_pool


FIA_FLAG = pytest.mark.parametrize("route", [False, True], ids=["default", "ASCEND_USE_FIA"], indirect=True)
SOFTCAP = pytest.mark.parametrize("logit_cap", [0.0, 1.5], ids=["plain", "softcap"])


@FIA_FLAG
@SOFTCAP
def test_extend_cross_writes_new_encoder_and_applies_mask(route, logit_cap):
    check_extend_cross_writes_new_encoder_and_applies_mask(*route, logit_cap)


@FIA_FLAG
def test_extend_cross_with_cached_encoders_writes_nothing(route):
    check_extend_cross_with_cached_encoders_writes_nothing(*route)


@FIA_FLAG
@SOFTCAP
def test_extend_self_with_cached_prefix(route, logit_cap):
    check_extend_self_with_cached_prefix(*route, logit_cap)


@FIA_FLAG
@SOFTCAP
def test_decode_cross_reads_cached_encoder_and_sees_all_frames(route, logit_cap):
    check_decode_cross_reads_cached_encoder_and_sees_all_frames(*route, logit_cap)


@FIA_FLAG
def test_decode_self_writes_token_and_reads_text_window(route):
    check_decode_self_writes_token_and_reads_text_window(*route)


def test_batches_without_encoder_go_to_the_stock_kernels(route):
    """The hook hands text-only batches to stock, which reaches a fused NPU op (the stand-in raises)."""
    backend, pool, req_to_token_pool = route
    batch = build_batch(example_requests(), *ROUTE_HEADS)
    load_batch_into_pools(batch, pool, req_to_token_pool)
    forward_batch = make_forward_batch(
        batch, ForwardMode.EXTEND, out_cache_loc=new_text_slots(batch), encoder_out_cache_loc=None
    )
    forward_batch.encoder_lens = None
    _, self_attn = make_layers()
    with pytest.raises(NotImplementedError, match="_npu_flash_attention_qlens"):
        backend.forward(batch.query.flatten(1), None, None, self_attn, forward_batch)


def test_stock_decode_already_handles_mossvl(npu_modules):
    """Item 5 regression without our hook: 0.5.23 decode skips the KV write and reads all frames."""
    ascend_module, memory_pool_npu = npu_modules
    pool, req_to_token_pool = make_npu_pool(memory_pool_npu), make_req_to_token_pool()
    backend = make_ascend_backend(ascend_module, pool, req_to_token_pool)
    check_decode_cross_reads_cached_encoder_and_sees_all_frames(backend, pool, req_to_token_pool, 0.0)
    check_decode_self_writes_token_and_reads_text_window(backend, pool, req_to_token_pool)


def test_stock_extend_drops_the_frame_mask(npu_modules):
    """Why the extend hook exists: unhooked 0.5.23 gives every token every frame."""
    ascend_module, memory_pool_npu = npu_modules
    pool, req_to_token_pool = make_npu_pool(memory_pool_npu), make_req_to_token_pool()
    backend = make_ascend_backend(ascend_module, pool, req_to_token_pool)
    out, batch = cross_extend_of_one_request(backend, pool, req_to_token_pool)
    assert not torch.allclose(out, reference_cross_extend(batch, SCALE), atol=1e-3)


def test_stock_extend_self_misses_the_cached_prefix(npu_modules):
    """Why item 4 needs the hook: unhooked 0.5.23 reads keys over [encoder_len, encoder_len + extend_len)."""
    ascend_module, memory_pool_npu = npu_modules
    pool, req_to_token_pool = make_npu_pool(memory_pool_npu), make_req_to_token_pool()
    backend = make_ascend_backend(ascend_module, pool, req_to_token_pool)
    batch = build_batch([example_requests()[2]], *ROUTE_HEADS)  # 4 cached text tokens
    load_batch_into_pools(batch, pool, req_to_token_pool)
    forward_batch = make_forward_batch(
        batch,
        ForwardMode.EXTEND,
        out_cache_loc=new_text_slots(batch),
        encoder_out_cache_loc=torch.zeros(0, dtype=torch.long),
    )
    _, self_attn = make_layers()
    out = backend.forward(batch.query.flatten(1), None, None, self_attn, forward_batch)
    assert not torch.allclose(out.view_as(batch.query), reference_self_extend(batch, SCALE), atol=1e-3)


# ----------------------------------------------------------------------------- plugin loading

_LOAD_AND_REPORT = textwrap.dedent(
    """
    import json, sys
    if sys.argv[1] == "fake":
        from fake_torch_npu import build_fake_modules
        sys.modules.update(build_fake_modules())
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.hardware_backend.npu.attention.ascend_torch_native_backend import (
        AscendTorchNativeAttnBackend,
    )
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    wrapped = {
        "native_extend": hasattr(AscendTorchNativeAttnBackend.run_sdpa_forward_extend, "__wrapped__"),
        "torch_native_extend": hasattr(TorchNativeAttnBackend.forward_extend, "__wrapped__"),
        "torch_native_decode": hasattr(TorchNativeAttnBackend.forward_decode, "__wrapped__"),
    }
    ascend = sys.modules.get("sglang.srt.hardware_backend.npu.attention.ascend_backend")
    wrapped["ascend_imported"] = ascend is not None
    if ascend is not None:
        wrapped["ascend_extend"] = hasattr(ascend.AscendAttnBackend.forward_extend, "__wrapped__")
        wrapped["ascend_decode"] = hasattr(ascend.AscendAttnBackend.forward_decode, "__wrapped__")
    print("HOOKS " + json.dumps(wrapped))
    """
)


def _load_plugins_in_subprocess(variant):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), *sys.path])
    env.pop("SGLANG_PLUGINS", None)
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_REPORT, variant],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(out for out in result.stdout.splitlines() if out.startswith("HOOKS "))
    return json.loads(line[len("HOOKS ") :])


def test_entry_point_load_with_fake_torch_npu_wraps_ascend_backend():
    assert _load_plugins_in_subprocess("fake") == {
        "native_extend": True,
        "torch_native_extend": True,
        "torch_native_decode": True,
        "ascend_imported": True,
        "ascend_extend": True,
        "ascend_decode": True,
    }


def test_entry_point_load_without_torch_npu_skips_ascend_backend():
    assert _load_plugins_in_subprocess("none") == {
        "native_extend": True,
        "torch_native_extend": True,
        "torch_native_decode": True,
        "ascend_imported": False,
    }


# ---- mixed batches (--enable-mixed-chunk): decode rows ride in a prefill batch


@pytest.fixture
def npu_dispatch(monkeypatch):
    """``AttentionBackend.forward`` as on an NPU: MIXED batches go to ``forward_mixed``."""
    import sglang.srt.layers.attention.base_attn_backend as base

    monkeypatch.setattr(base, "is_npu", lambda: True)


def mixed_forward_batch(batch, mask):
    return make_forward_batch(
        batch, ForwardMode.MIXED, out_cache_loc=new_text_slots(batch),
        encoder_out_cache_loc=torch.zeros(0, dtype=torch.long), mask=mask,
    )  # fmt: skip


def run_cross_and_self(backend, pool, req_to_token_pool):
    batch = build_batch(example_requests(), *ROUTE_HEADS)
    new_slots = new_text_slots(batch)
    load_batch_into_pools(batch, pool, req_to_token_pool, except_slots=[new_slots])
    cross, self_attn = make_layers()
    new_k = torch.cat([k[r.prefix_len :] for r, k in zip(batch.requests, batch.text_k)])
    new_v = torch.cat([v[r.prefix_len :] for r, v in zip(batch.requests, batch.text_v)])
    forward_batch = mixed_forward_batch(batch, batch.packed_mask())
    self_out = backend.forward(batch.query.flatten(1), new_k, new_v, self_attn, forward_batch)
    cross_batch = build_batch([example_requests()[i] for i in (2, 1, 3)], *ROUTE_HEADS)
    load_batch_into_pools(cross_batch, pool, req_to_token_pool)
    cross_out = backend.forward(
        cross_batch.query.flatten(1), None, None, cross, mixed_forward_batch(cross_batch, cross_batch.packed_mask())
    )
    self_expected = reference_self_extend(batch, SCALE)
    cross_expected = reference_cross_extend(cross_batch, SCALE)
    return (self_out, self_expected), (cross_out, cross_expected)


def test_mixed_batches_take_the_encoder_aware_math(hooked, npu_dispatch):
    ascend_module, memory_pool_npu = hooked
    pool, req_to_token_pool = make_npu_pool(memory_pool_npu), make_req_to_token_pool()
    backend = make_ascend_backend(ascend_module, pool, req_to_token_pool)
    for out, expected in run_cross_and_self(backend, pool, req_to_token_pool):
        torch.testing.assert_close(out.view_as(expected), expected, atol=1e-5, rtol=1e-5)


def test_stock_forward_mixed_is_the_fused_path(npu_modules, npu_dispatch):
    """Why the hook exists: unhooked, a MIXED MOSS-VL batch reaches the fused NPU kernel, which has no encoder
    argument (neither the stand-in nor torch's op registry on this machine provides it: it raises)."""
    ascend_module, memory_pool_npu = npu_modules
    pool, req_to_token_pool = make_npu_pool(memory_pool_npu), make_req_to_token_pool()
    backend = make_ascend_backend(ascend_module, pool, req_to_token_pool)
    with pytest.raises((NotImplementedError, AttributeError), match="npu_fused_infer_attention_score"):
        run_cross_and_self(backend, pool, req_to_token_pool)
