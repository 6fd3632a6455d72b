"""MOSS-VL attention math in the Ascend torch-native backend.

On an Ascend NPU every MossVL attention (extend and decode, self and cross) runs through
``AscendTorchNativeAttnBackend`` because ``forward_batch.encoder_lens`` is set. That class is
pure torch, so this module imports without ``torch_npu`` and the same code serves the CPU route
(:mod:`mossvl_ascend.cpu_attention`).

Layout the math relies on (``ScheduleBatch.prepare_encoder_info_extend``): a request's KV slots
are ``req_to_token[req, :encoder_len]`` for the vision encoder tokens followed by its text tokens;
``seq_lens`` / ``extend_prefix_lens`` / ``extend_seq_lens`` count text tokens only.

Catalog entries: ``PATCHES`` and ``VERIFIED`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang.srt.hardware_backend.npu.attention.ascend_torch_native_backend import (
    AscendTorchNativeAttnBackend,
)
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.frame_causal_attention import (
    encoder_boundaries_from_packed_mask,
    frame_causal_cross_attention,
)
from mossvl_ascend.registry import ON_NPU_AND_CPU, Patch, Verified

NATIVE_BACKEND = "sglang.srt.hardware_backend.npu.attention.ascend_torch_native_backend.AscendTorchNativeAttnBackend"

# AscendTorchNativeAttnBackend holds no state. This one instance serves the softcap kernel of
# the per-request functions below and is the native math of the CPU route (cpu_attention).
ASCEND_NATIVE_MATH = AscendTorchNativeAttnBackend()


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visibility: Optional[torch.Tensor],
    *,
    scaling: Optional[float],
    enable_gqa: bool,
    logit_cap: float,
    logit_capping_method: str,
) -> torch.Tensor:
    """Attention of one request with an explicit visibility matrix.

    query ``[num_heads, q_len, head_dim]``; key ``[num_kv_heads, kv_len, head_dim]``; value
    ``[num_kv_heads, kv_len, v_head_dim]``; visibility bool ``[q_len, kv_len]`` with True =
    attend, or None for all visible. Returns ``[num_heads, q_len, v_head_dim]``. Rows that see
    no key are zero: softmax over an empty set is undefined (NaN on the softcap path and on some
    SDPA kernels), and MOSS-VL defines such a row's cross-attention as contributing nothing.
    """
    num_heads, q_len = query.shape[0], query.shape[1]
    if q_len == 0 or key.shape[1] == 0:
        return query.new_zeros(num_heads, q_len, value.shape[-1])
    if logit_cap > 0:
        out = ASCEND_NATIVE_MATH.scaled_dot_product_attention_with_softcapping(
            query.unsqueeze(0),
            key.unsqueeze(0),
            value.unsqueeze(0),
            attn_mask=visibility,
            scale=scaling,
            enable_gqa=enable_gqa,
            logit_cap=logit_cap,
            logit_capping_method=logit_capping_method,
        )
    else:
        out = scaled_dot_product_attention(
            query.unsqueeze(0),
            key.unsqueeze(0),
            value.unsqueeze(0),
            attn_mask=visibility,
            scale=scaling,
            enable_gqa=enable_gqa,
        )
    out = out.squeeze(0)
    if visibility is not None:
        sees_nothing = ~visibility.any(dim=-1)
        out = out.masked_fill(sees_nothing[None, :, None], 0.0)
    return out


def cross_attention_for_request(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visibility: torch.Tensor,
    *,
    scaling: Optional[float],
    enable_gqa: bool,
    logit_cap: float,
    logit_capping_method: str,
) -> torch.Tensor:
    """MOSS-VL cross-attention of one request: new text tokens attend to its encoder tokens.

    Shapes as :func:`masked_attention`. ``visibility`` is either int per-row encoder boundaries ``[q_len]``
    (row ``r`` sees keys ``[0, boundary_r)``: the frame-causal kernel, no dense mask) or, for a packed mask
    whose rows are not encoder prefixes, a bool ``[q_len, kv_len]`` matrix (True = attend; dense path).
    """
    if query.shape[1] == 0 or key.shape[1] == 0:  # no new rows, or a request without encoder tokens
        return query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])
    if visibility.dtype != torch.bool and logit_capping_method == "tanh":
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return frame_causal_cross_attention(query, key, value, visibility, scale, logit_cap=logit_cap)
    if visibility.dtype != torch.bool:
        visibility = torch.arange(key.shape[1], device=key.device)[None, :] < visibility[:, None].to(key.device)
    return masked_attention(
        query,
        key,
        value,
        visibility,
        scaling=scaling,
        enable_gqa=enable_gqa,
        logit_cap=logit_cap,
        logit_capping_method=logit_capping_method,
    )


def causal_visibility_with_prefix(
    extend_len: int, prefix_len: int, device: torch.device
) -> torch.Tensor:
    """Bool ``[extend_len, prefix_len + extend_len]``: new token ``i`` sees keys ``0..prefix_len+i``."""
    return torch.ones(
        extend_len, prefix_len + extend_len, dtype=torch.bool, device=device
    ).tril(diagonal=prefix_len)


def request_visibilities(
    row_boundaries: Optional[torch.Tensor],
    packed_mask: Optional[torch.Tensor],
    extend_seq_lens: list[int],
    encoder_lens: list[int],
    device: torch.device,
) -> list[torch.Tensor]:
    """Per request, what its new rows see of its encoder: int boundaries ``[extend_seq_len]``, or a bool
    ``[extend_seq_len, encoder_len]`` matrix for a packed-mask slice that is not prefix-shaped.

    ``row_boundaries`` (int32, :mod:`mossvl_ascend.compact_visibility`: ``extend_seq_len`` entries per request)
    and the stock packed mask (uint8, 1 = visible, row-major ``extend_seq_len x encoder_len`` per request) both
    hold entries only for requests with encoder tokens and new rows, in batch order. Neither given: every row
    sees every frame. A size that disagrees with the batch raises ValueError naming the request and lengths.
    """
    source = row_boundaries if row_boundaries is not None else packed_mask
    name = "cross_attention_row_boundaries" if row_boundaries is not None else "cross_attention_custom_mask"
    visibilities, offset = [], 0
    for req_idx, (extend_len, encoder_len) in enumerate(zip(extend_seq_lens, encoder_lens)):
        if source is None or not (extend_len and encoder_len):
            visibilities.append(torch.full((extend_len,), encoder_len, dtype=torch.int32, device=device))
            continue
        size = extend_len if row_boundaries is not None else extend_len * encoder_len
        if offset + size > source.numel():
            need = f"{extend_len} rows" if row_boundaries is not None else f"{extend_len} x encoder_len {encoder_len}"
            raise ValueError(
                f"{name} too short at request {req_idx}: needs extend_seq_len {need} = {size} entries at "
                f"offset {offset}, it has {source.numel()} (encoder_len {encoder_len})"
            )
        chunk = source[offset : offset + size]
        visibilities.append(
            chunk.to(device) if row_boundaries is not None else packed_slice_visibility(chunk, extend_len, encoder_len)
        )
        offset += size
    if source is not None and offset != source.numel():
        per_request = "extend_seq_lens" if row_boundaries is not None else "extend_seq_len x encoder_len products"
        raise ValueError(
            f"{name} has {source.numel()} entries but the batch's {per_request} sum to {offset} "
            f"(extend_seq_lens {extend_seq_lens}, encoder_lens {encoder_lens})"
        )
    return visibilities


def packed_slice_visibility(mask_slice: torch.Tensor, extend_len: int, encoder_len: int) -> torch.Tensor:
    """Boundaries of a stock packed-mask slice; its bool matrix if some row is not an encoder prefix."""
    try:
        return encoder_boundaries_from_packed_mask(mask_slice, extend_len, encoder_len)
    except ValueError:
        return mask_slice.view(extend_len, encoder_len).bool()


def _gather_kv(k_cache, v_cache, slots, full_to_swa_mapping, dtype):
    """K/V ``[num_kv_heads, len(slots), dim]`` for the given KV-pool slots, in the query dtype."""
    if full_to_swa_mapping is not None:
        slots = full_to_swa_mapping[slots]
    key = k_cache[slots].movedim(0, 1).to(dtype)
    value = v_cache[slots].movedim(0, 1).to(dtype)
    return key, value


def encoder_decoder_extend(
    query: torch.Tensor,
    output: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    encoder_lens: torch.Tensor,
    *,
    is_cross_attention: bool,
    cross_attention_custom_mask: Optional[torch.Tensor] = None,
    cross_attention_row_boundaries: Optional[torch.Tensor] = None,
    scaling: Optional[float] = None,
    enable_gqa: bool = False,
    causal: bool = True,
    full_to_swa_mapping: Optional[torch.Tensor] = None,
    logit_cap: float = 0.0,
    logit_capping_method: str = "tanh",
) -> torch.Tensor:
    """Extend attention for a batch whose requests carry encoder tokens (MOSS-VL).

    query/output ``[num_new_tokens, num_heads, head_dim]`` packed in batch order; k/v_cache
    ``[pool_slots, num_kv_heads, head_dim]``. Fills and returns ``output``.
    """
    extend_lens = extend_seq_lens.tolist()
    prefix_lens = extend_prefix_lens.tolist()
    text_lens = seq_lens.tolist()
    enc_lens = encoder_lens.tolist()
    visibilities = (
        request_visibilities(
            cross_attention_row_boundaries, cross_attention_custom_mask, extend_lens, enc_lens, query.device
        )
        if is_cross_attention
        else None
    )

    heads_first_query = query.movedim(0, 1)
    start_q = 0
    for req_idx, extend_len in enumerate(extend_lens):
        end_q = start_q + extend_len
        req_query = heads_first_query[:, start_q:end_q]
        req_slots = req_to_token[req_pool_indices[req_idx]]
        encoder_len = enc_lens[req_idx]
        if is_cross_attention:
            key, value = _gather_kv(
                k_cache, v_cache, req_slots[:encoder_len], full_to_swa_mapping, query.dtype
            )
            req_out = cross_attention_for_request(
                req_query,
                key,
                value,
                visibilities[req_idx],
                scaling=scaling,
                enable_gqa=enable_gqa,
                logit_cap=logit_cap,
                logit_capping_method=logit_capping_method,
            )
        else:
            prefix_len = prefix_lens[req_idx]
            if prefix_len + extend_len != text_lens[req_idx]:
                raise ValueError(
                    f"request {req_idx}: extend_prefix_len {prefix_len} + extend_seq_len "
                    f"{extend_len} != seq_len {text_lens[req_idx]}"
                )
            key, value = _gather_kv(
                k_cache,
                v_cache,
                req_slots[encoder_len : encoder_len + text_lens[req_idx]],
                full_to_swa_mapping,
                query.dtype,
            )
            visibility = (
                causal_visibility_with_prefix(extend_len, prefix_len, query.device)
                if causal
                else None
            )
            req_out = masked_attention(
                req_query,
                key,
                value,
                visibility,
                scaling=scaling,
                enable_gqa=enable_gqa,
                logit_cap=logit_cap,
                logit_capping_method=logit_capping_method,
            )
        output[start_q:end_q] = req_out.movedim(0, 1)
        start_q = end_q
    return output


def _route_encoder_batches_extend(
    original, backend, *args, cross_attention_custom_mask=None, cross_attention_row_boundaries=None, **kwargs
):
    """AROUND hook: encoder-decoder batches get :func:`encoder_decoder_extend`, others stock.

    Arguments are bound against the stock signature, so callers may pass them positionally or
    by keyword exactly as for the stock method; ``cross_attention_custom_mask`` (stock packed mask) and
    ``cross_attention_row_boundaries`` (:mod:`mossvl_ascend.compact_visibility`) are the ones added.
    """
    stock_args = inspect.signature(original).bind(backend, *args, **kwargs)
    stock_args.apply_defaults()
    params = dict(stock_args.arguments)
    if params["encoder_lens"] is None:
        if cross_attention_custom_mask is not None or cross_attention_row_boundaries is not None:
            raise ValueError("cross-attention visibility given for a batch without encoder_lens")
        return original(backend, *args, **kwargs)
    del params["self"]
    # Stock applies no sliding window to encoder batches either.
    del params["sliding_window_size"]
    return encoder_decoder_extend(
        **params,
        cross_attention_custom_mask=cross_attention_custom_mask,
        cross_attention_row_boundaries=cross_attention_row_boundaries,
    )


def encoder_decoder_attention(
    native: AscendTorchNativeAttnBackend,
    token_to_kv_pool,
    req_to_token_pool,
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    layer,
    forward_batch,
    save_kv_cache: bool,
    *,
    swa_out_cache_loc: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One attention layer of an encoder-decoder (MOSS-VL) batch, extend or decode.

    Shared by the Ascend backend hook and the CPU route so both run the same code: write the
    new K/V (encoder K/V for a cross-attention layer; nothing when k/v are None, i.e. the
    encoder is already cached or the batch has no vision input), then run the native per-request
    math with the batch's cross-attention mask. q ``[num_tokens, num_heads * head_dim]``;
    returns ``[num_tokens, num_heads * v_head_dim]``.
    """
    if save_kv_cache and k is not None and v is not None:
        if layer.is_cross_attention:
            write_loc = KVWriteLoc(forward_batch.encoder_out_cache_loc, None)
        else:
            write_loc = KVWriteLoc(forward_batch.out_cache_loc, swa_out_cache_loc)
        token_to_kv_pool.set_kv_buffer(layer, write_loc, k, v)

    q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    output = q_.new_empty(q_.shape[0], layer.tp_q_head_num, layer.v_head_dim)
    k_cache = token_to_kv_pool.get_key_buffer(layer.layer_id).view(
        -1, layer.tp_k_head_num, layer.qk_head_dim
    )
    v_cache = token_to_kv_pool.get_value_buffer(layer.layer_id).view(
        -1, layer.tp_v_head_num, layer.v_head_dim
    )
    if forward_batch.forward_mode.is_decode():
        # Decode is an extend of one token whose whole text is the cached prefix: the same
        # per-request math, so an encoder-less request never reaches an SDPA over zero keys.
        extend_seq_lens = torch.ones_like(forward_batch.seq_lens)
        extend_prefix_lens = forward_batch.seq_lens - 1
    else:
        extend_seq_lens = forward_batch.extend_seq_lens
        extend_prefix_lens = forward_batch.extend_prefix_lens
    native.run_sdpa_forward_extend(
        q_,
        output,
        k_cache,
        v_cache,
        req_to_token_pool.req_to_token,
        forward_batch.req_pool_indices,
        forward_batch.seq_lens,
        extend_prefix_lens,
        extend_seq_lens,
        forward_batch.encoder_lens,
        is_cross_attention=layer.is_cross_attention,
        scaling=layer.scaling,
        enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
        causal=not (layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY),
        logit_cap=layer.logit_cap,
        logit_capping_method=layer.logit_capping_method,
        cross_attention_custom_mask=forward_batch.cross_attention_custom_mask,
        cross_attention_row_boundaries=getattr(forward_batch, "cross_attention_row_boundaries", None),
    )
    return output.view(-1, layer.tp_q_head_num * layer.v_head_dim)


PATCHES = (
    Patch(
        title="Native extend applies MOSS-VL cross-attention visibility and reads the cached text prefix",
        target=f"{NATIVE_BACKEND}.run_sdpa_forward_extend",
        kind=HookType.AROUND,
        hook=_route_encoder_batches_extend,
        platforms=ON_NPU_AND_CPU,
        why=(
            "stock 0.5.23 (a) has no `cross_attention_custom_mask` parameter, so frame-causal visibility is never "
            "applied and every text token sees every frame; (b) pads cross-attention queries to the full text "
            "length, which is what made the source PR read mask rows with the wrong query length once a text prefix "
            "is cached; (c) reads self-attention keys over `[encoder_len, encoder_len + extend_len)` instead of "
            "`[encoder_len, encoder_len + seq_len)`, so with a cached text prefix (multi-turn, chunked prefill, "
            "retract) new tokens miss the prefix and the causal diagonal is misplaced."
        ),
        how=(
            "the hook adds the keywords `cross_attention_custom_mask=` (the source PR's packed uint8 mask, 1 = "
            "visible, per request `[extend_seq_len x encoder_len]` row-major, batch order) and "
            "`cross_attention_row_boundaries=`; batches with `encoder_lens` run `encoder_decoder_extend`, others "
            "the stock method. Cross-attention: new-token queries only, keys its encoder slots, visibility read at "
            "a running offset; rows that see nothing and encoder-less requests give zeros. Self-attention: keys "
            "over `[encoder_len, encoder_len + seq_len)`, query i sees keys `j <= prefix_len + i`. A visibility "
            "whose size disagrees with the batch raises ValueError naming the request and lengths."
        ),
        upstream="not upstream in 0.5.23 (the source PR patched the file in its fork)",
        remove_when="`run_sdpa_forward_extend` accepts MOSS-VL visibility and reads the right windows",
    ),
)

VERIFIED = (
    Verified(
        title="Cross-attention mask built for non-flashinfer prefill backends",
        target="sglang.srt.models.moss_vl.MossVLForConditionalGeneration.prepare_forward_batch",
        why_it_was_patched="the source PR's fork returned early from the mask builder unless prefill was flashinfer.",
        status=(
            "already correct: 0.5.23 has no backend gate; the packed mask is built on every extend with vision "
            "input. Off CUDA the plugin replaces the builder anyway (per-row boundaries, `compact_visibility`); the "
            "stock builder still feeds the native backend correctly, which keeps the packed-mask edge honest."
        ),
        pinned_by=("tests/test_native_attention.py::test_stock_mask_builder_feeds_the_native_backend",),
    ),
    Verified(
        title="Decode cross-attention over cached encoder K/V",
        target=f"{NATIVE_BACKEND}.run_sdpa_forward_decode",
        why_it_was_patched="the source PR guarded decode with k = v = None (encoder K/V already cached).",
        status=(
            "already correct on CPU: cross-attention reads the cached encoder slots without a mask, self-attention "
            "`[encoder_len, encoder_len + seq_len)`. The plugin's routes nevertheless run decode as a one-token "
            "extend through this module, so the NPU never depends on SDPA over zero keys."
        ),
        pinned_by=("tests/test_native_attention.py::test_stock_decode_already_reads_the_right_windows",),
    ),
)
