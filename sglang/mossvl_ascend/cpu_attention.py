"""CPU route for MOSS-VL attention through the Ascend native math (issue 4, item 9).

Catalog
-------
**Hook: encoder-decoder batches in** ``TorchNativeAttnBackend.forward_extend`` **and**
``forward_decode`` (item 9)

- *target*: ``sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.``
  ``forward_extend`` and ``.forward_decode`` (AROUND).
- *why*: on an NPU, MOSS-VL attention runs in the attention core (:mod:`mossvl_ascend.attention`,
  reached through the Ascend backend hook). The CPU server (MOSS-VL on ``--device cpu``
  resolves to ``--attention-backend torch_native``) would otherwise run the different stock
  ``TorchNativeAttnBackend`` math (its windows are right but it has no cross-attention mask),
  so CPU end-to-end tests would neither apply frame-causal visibility nor exercise the NPU code.
- *how*: a batch with ``forward_batch.encoder_lens`` is handed to
  :func:`mossvl_ascend.attention.sglang_layer.encoder_decoder_attention`: the same KV write, metadata and
  batched core the Ascend backend hook runs. Only the KV pool (the CPU pool's ``set_kv_buffer`` versus the
  NPU pool's) and the device primitive differ. Every other batch, and torch_native on any
  device but the CPU (CUDA keeps stock behaviour), goes to the stock method.
- *upstream status / when to remove*: a test-harness route, not an upstream bug. Keep while
  CPU tests stand in for the NPU; it can go once NPU CI exercises the Ascend backend directly.
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from mossvl_ascend.attention.sglang_layer import encoder_decoder_attention

TORCH_NATIVE_CLASS = (
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
)
EXTEND_TARGET = f"{TORCH_NATIVE_CLASS}.forward_extend"
DECODE_TARGET = f"{TORCH_NATIVE_CLASS}.forward_decode"


def _through_ascend_native(
    original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs
):
    """AROUND hook shared by forward_extend and forward_decode (the batch's mode picks the math)."""
    if forward_batch.encoder_lens is None or str(backend.device) != "cpu":
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    return encoder_decoder_attention(
        backend.token_to_kv_pool,
        backend.req_to_token_pool,
        q,
        k,
        v,
        layer,
        forward_batch,
        save_kv_cache,
        swa_out_cache_loc=backend.swa_out_cache_loc,
    )


def register() -> None:
    HookRegistry.register(EXTEND_TARGET, _through_ascend_native, HookType.AROUND)
    HookRegistry.register(DECODE_TARGET, _through_ascend_native, HookType.AROUND)
