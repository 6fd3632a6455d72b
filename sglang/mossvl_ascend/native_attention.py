"""The stock native extend method as an edge of the MOSS-VL attention core (issue 4, items 3, 4, 5).

On an Ascend NPU stock sglang sends every MossVL attention (extend and decode, self and cross) to
``AscendTorchNativeAttnBackend`` because ``forward_batch.encoder_lens`` is set. Our Ascend and CPU backend hooks
call the attention core (:mod:`mossvl_ascend.attention`) directly; this hook keeps the stock method correct for
any other caller of it, with the interface the source PR's review thread defined (the packed
``cross_attention_custom_mask`` keyword), converted to per-row boundaries once, here.

Layout the math relies on (``ScheduleBatch.prepare_encoder_info_extend``): a request's KV slots
are ``req_to_token[req, :encoder_len]`` for the vision encoder tokens followed by its text tokens;
``seq_lens`` / ``extend_prefix_lens`` / ``extend_seq_lens`` count text tokens only.

Catalog
-------
**Hook: MossVL extend in the Ascend native backend** (items 3 and 4)

- *target*: ``sglang.srt.hardware_backend.npu.attention.ascend_torch_native_backend.``
  ``AscendTorchNativeAttnBackend.run_sdpa_forward_extend`` (AROUND).
- *why*: stock 0.5.23 (a) has no ``cross_attention_custom_mask`` parameter, so MossVL's
  frame-causal visibility is never applied and every text token sees every frame; (b) pads the
  cross-attention queries to the full text length, which is what made the source PR read mask
  rows with the wrong query length once a text prefix is cached; (c) reads self-attention keys
  over ``[encoder_len, encoder_len + extend_len)`` instead of ``[encoder_len, encoder_len +
  seq_len)``, so with a cached text prefix (multi-turn, chunked prefill, retract) the new tokens
  miss the prefix and the causal diagonal is misplaced.
- *how*: the hook adds the keyword ``cross_attention_custom_mask=`` (packed uint8, 1 = visible,
  per request ``[extend_seq_len x encoder_len]`` row-major, batch order, requests without encoder
  tokens or new tokens contribute nothing). Batches with ``encoder_lens`` go to
  :func:`mossvl_ascend.attention.core.attention` (the mask becomes boundaries via
  ``ForwardAttentionMetadata.from_packed_mask``; a row that is not an encoder prefix raises ValueError); every
  other batch goes to the stock method unchanged.
  Cross-attention: queries are the request's new tokens only, keys/values its encoder slots,
  mask slice read at a running offset advancing by ``extend_seq_len x encoder_len`` (1 = visible),
  frame-causal blocks merged by log-sum-exp in fp32, same on the plain and the logit-softcap paths;
  rows that see nothing and requests with ``encoder_len == 0`` give zeros, never NaN. Self-attention: keys over
  ``[encoder_len, encoder_len + seq_len)``, query ``i`` sees keys ``j <= prefix_len + i``.
  A mask whose size disagrees with the batch raises ValueError naming the request and lengths.
- *upstream status / when to remove*: not upstream in 0.5.23 (the source PR patched the file in
  its fork). Remove once ``run_sdpa_forward_extend`` accepts the mask and reads the right windows.

**No hook: the cross-attention mask for non-flashinfer backends** (item 2)

- *target*: ``sglang.srt.models.moss_vl.MossVLForConditionalGeneration.prepare_forward_batch``
  (called by ``model_executor.runner.eager_runner`` before every extend's
  ``init_forward_metadata``, whatever the attention backend).
- *status*: 0.5.23 already behaves: unlike the source PR's fork it has no
  ``prefill_backend != "flashinfer"`` early return, so the packed mask is built on every extend
  with vision input (None on decode, and None when no request carries frame-level visibility,
  which means all frames visible). Pinned by ``tests/test_native_attention.py::``
  ``test_stock_mask_builder_feeds_the_native_backend`` (stock builder -> this module -> dense
  reference). Only a refactor that gates the builder on the backend again would need a hook.

**No hook: MossVL decode in the Ascend native backend** (item 5)

- *target*: ``AscendTorchNativeAttnBackend.run_sdpa_forward_decode``.
- *status*: 0.5.23 already behaves on CPU: cross-attention reads the cached encoder slots
  ``[0, encoder_len)`` without a mask (every decode token sees all frames), self-attention reads
  ``[encoder_len, encoder_len + seq_len)``, ``encoder_len == 0`` yields zeros (CPU SDPA over
  zero keys). Pinned by regression tests (``tests/test_native_attention.py``,
  ``tests/test_ascend_backend.py``). The Ascend and CPU hooks nevertheless run decode through the core
  (``mossvl_ascend.attention.sglang_layer``): all requests in one call per layer, encoder-less requests give
  zeros whatever the device's SDPA does over zero keys; decode never writes encoder K/V when k/v are None.
"""

from __future__ import annotations

import inspect

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from mossvl_ascend.attention.core import AttentionLayer, attention
from mossvl_ascend.attention.metadata import ForwardAttentionMetadata

NATIVE_EXTEND_TARGET = (
    "sglang.srt.hardware_backend.npu.attention.ascend_torch_native_backend."
    "AscendTorchNativeAttnBackend.run_sdpa_forward_extend"
)


def _route_encoder_batches_extend(original, backend, *args, cross_attention_custom_mask=None, **kwargs):
    """AROUND hook: encoder-decoder batches through the attention core, others stock.

    Arguments are bound against the stock signature, so callers pass them positionally or by keyword exactly as
    for the stock method; ``cross_attention_custom_mask`` (stock packed mask, 1 = visible) is the one added.
    """
    bound = inspect.signature(original).bind(backend, *args, **kwargs)
    bound.apply_defaults()
    params = bound.arguments
    if params["encoder_lens"] is None:
        if cross_attention_custom_mask is not None:
            raise ValueError("cross-attention visibility given for a batch without encoder_lens")
        return original(backend, *args, **kwargs)
    if params["logit_cap"] > 0 and params["logit_capping_method"] != "tanh":
        raise NotImplementedError(f"logit capping method {params['logit_capping_method']!r} (only tanh)")
    query = params["query"]
    extend_lens = params["extend_seq_lens"].tolist()
    prefix_lens = params["extend_prefix_lens"].tolist()
    for req_idx, (prefix_len, extend_len, seq_len) in enumerate(
        zip(prefix_lens, extend_lens, params["seq_lens"].tolist())
    ):
        if prefix_len + extend_len != seq_len:
            raise ValueError(
                f"request {req_idx}: extend_prefix_len {prefix_len} + extend_seq_len {extend_len} != seq_len {seq_len}"
            )
    metadata = ForwardAttentionMetadata.from_packed_mask(
        extend_lens,
        prefix_lens,
        params["encoder_lens"].tolist(),
        cross_attention_custom_mask if params["is_cross_attention"] else None,
        query.device,
    )
    scale = params["scaling"] if params["scaling"] is not None else query.shape[-1] ** -0.5
    layer = AttentionLayer(params["is_cross_attention"], scale, params["causal"], params["logit_cap"])
    # Stock applies no sliding window to encoder batches either.
    params["output"][:] = attention(
        query, params["k_cache"], params["v_cache"], params["req_to_token"], params["req_pool_indices"], metadata,
        layer, full_to_swa_mapping=params["full_to_swa_mapping"],
    )
    return params["output"]


def register() -> None:
    HookRegistry.register(NATIVE_EXTEND_TARGET, _route_encoder_batches_extend, HookType.AROUND)
