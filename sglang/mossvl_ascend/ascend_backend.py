"""MOSS-VL batches in the Ascend attention backend (issue 4, items 3 and 5).

Catalog
-------
**Hook: encoder-decoder batches in** ``AscendAttnBackend.forward_extend``, ``forward_decode`` **and**
``forward_mixed`` (items 3 and 5; issue 12)

- *target*: ``sglang.srt.hardware_backend.npu.attention.ascend_backend.AscendAttnBackend.``
  ``forward_extend``, ``.forward_decode`` and ``.forward_mixed`` (AROUND).
- *why*: stock 0.5.23 calls ``AscendTorchNativeAttnBackend.run_sdpa_forward_extend`` without
  ``forward_batch.cross_attention_custom_mask`` (no such keyword exists there), so MOSS-VL's
  frame-causal visibility is dropped on the NPU. Also, with ``ASCEND_USE_FIA=1`` or
  ``ASCEND_USE_FA=1`` stock takes fused-kernel branches that ignore ``encoder_lens`` (they would
  attend text queries over the encoder slots as if they were text), so the encoder-aware native
  path must be chosen by the batch, not by those flags (``mossvl_ascend.server_args`` also
  refuses those flags for MOSS-VL on NPU and turns decode graphs off; this hook does not rely
  on it). The k/v None guard (cross-attention layers get k = v = None when the encoder K/V is
  already cached or there is no vision input) is already in stock 0.5.23; the hook keeps it.
- *how*: for a batch with ``forward_batch.encoder_lens`` on a non-MLA model (eager mode), the
  hook runs :func:`mossvl_ascend.native_attention.encoder_decoder_attention`: KV write through
  the pool's ``set_kv_buffer`` (encoder slots for cross-attention layers, skipped when k/v are
  None), then the patched native extend with ``cross_attention_custom_mask=`` (decode runs as a
  one-token extend without a mask: every decode token sees all frames). Other batches, MLA
  models and NPU graph replay go to the stock method unchanged (the native math syncs with the
  host per request, so it cannot be captured; graph decode is off for MOSS-VL, see
  ``server_args``).
- *mixed batches* (``--enable-mixed-chunk``, issue 12): on NPU ``AttentionBackend.forward`` sends a MIXED
  batch (a prefill chunk plus the decode rows of running requests) to ``AscendAttnBackend.forward_mixed``, a
  fused path that ignores the encoder; ``forward_mixed`` is a third target of the same hook, so the batch
  runs the extend math (decode rows are one-row extends whose visibility is every frame).
- *upstream status / when to remove*: not upstream in 0.5.23. Remove once ``forward_extend``
  passes the mask (keyword ``cross_attention_custom_mask``) and encoder-decoder batches cannot
  reach the FIA/FA branches.

``register()`` only registers when the Ascend backend module imports (``torch_npu`` and
``sgl_kernel_npu`` present); elsewhere (CPU, CUDA) it logs one debug line and does nothing.
"""

from __future__ import annotations

import importlib
import logging

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from mossvl_ascend.native_attention import encoder_decoder_attention

logger = logging.getLogger(__name__)

ASCEND_BACKEND_MODULE = "sglang.srt.hardware_backend.npu.attention.ascend_backend"
EXTEND_TARGET = f"{ASCEND_BACKEND_MODULE}.AscendAttnBackend.forward_extend"
DECODE_TARGET = f"{ASCEND_BACKEND_MODULE}.AscendAttnBackend.forward_decode"
MIXED_TARGET = f"{ASCEND_BACKEND_MODULE}.AscendAttnBackend.forward_mixed"


def _takes_encoder_decoder_route(backend, forward_batch) -> bool:
    return (
        forward_batch.encoder_lens is not None
        and not backend.use_mla
        and not backend.graph_mode
    )


def _encoder_decoder_forward(
    original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs
):
    """AROUND hook shared by forward_extend and forward_decode (the batch's mode picks the math)."""
    if not _takes_encoder_decoder_route(backend, forward_batch):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    return encoder_decoder_attention(
        backend.native_attn,
        backend.token_to_kv_pool,
        backend.req_to_token_pool,
        q,
        k,
        v,
        layer,
        forward_batch,
        save_kv_cache,
        swa_out_cache_loc=backend.forward_metadata.swa_out_cache_loc,
    )


def register() -> None:
    try:
        importlib.import_module(ASCEND_BACKEND_MODULE)
    except ImportError as exc:
        logger.debug("Ascend attention backend not importable (%s); its hooks are not registered", exc)
        return
    HookRegistry.register(EXTEND_TARGET, _encoder_decoder_forward, HookType.AROUND)
    HookRegistry.register(DECODE_TARGET, _encoder_decoder_forward, HookType.AROUND)
    HookRegistry.register(MIXED_TARGET, _encoder_decoder_forward, HookType.AROUND)
