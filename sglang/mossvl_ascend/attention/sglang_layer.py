"""One MOSS-VL attention layer of an sglang ForwardBatch (adapter layer), shared by the Ascend and CPU hooks.

Translates sglang's objects (RadixAttention layer, ForwardBatch, token-to-KV pool, req-to-token pool) into the
core's arguments: write this forward's new K/V, then run :func:`mossvl_ascend.attention.core.attention` with the
forward's metadata (built once, by the prepare_forward_batch hook or the first layer).
"""

from __future__ import annotations

import torch
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from mossvl_ascend.attention.core import AttentionLayer, attention
from mossvl_ascend.attention.kv_layout import addressing_of_pool
from mossvl_ascend.attention.metadata import metadata_of_forward_batch


def layer_constants(layer) -> AttentionLayer:
    """What the core needs from sglang's RadixAttention."""
    if layer.logit_cap > 0 and layer.logit_capping_method != "tanh":
        raise NotImplementedError(f"logit capping method {layer.logit_capping_method!r} (only tanh)")
    return AttentionLayer(
        is_cross_attention=layer.is_cross_attention,
        scale=layer.scaling if layer.scaling is not None else layer.qk_head_dim**-0.5,
        causal=not (layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY),
        logit_cap=layer.logit_cap,
    )


def encoder_decoder_attention(
    token_to_kv_pool,
    req_to_token_pool,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    layer,
    forward_batch,
    save_kv_cache: bool,
    *,
    swa_out_cache_loc: torch.Tensor | None = None,
) -> torch.Tensor:
    """One attention layer of an encoder-decoder (MOSS-VL) batch: extend, decode or mixed.

    Writes the new K/V (encoder K/V for a cross-attention layer; nothing when k/v are None, i.e. the encoder is
    already cached or the batch has no vision input), then the core. q ``[num_tokens, num_heads * head_dim]``;
    returns ``[num_tokens, num_heads * v_head_dim]``.
    """
    if save_kv_cache and k is not None and v is not None:
        if layer.is_cross_attention:
            write_loc = KVWriteLoc(forward_batch.encoder_out_cache_loc, None)
        else:
            write_loc = KVWriteLoc(forward_batch.out_cache_loc, swa_out_cache_loc)
        token_to_kv_pool.set_kv_buffer(layer, write_loc, k, v)
    k_cache = token_to_kv_pool.get_key_buffer(layer.layer_id).view(-1, layer.tp_k_head_num, layer.qk_head_dim)
    v_cache = token_to_kv_pool.get_value_buffer(layer.layer_id).view(-1, layer.tp_v_head_num, layer.v_head_dim)
    output = attention(
        q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim),
        k_cache,
        v_cache,
        req_to_token_pool.req_to_token,
        forward_batch.req_pool_indices,
        metadata_of_forward_batch(forward_batch),
        layer_constants(layer),
        page_size=token_to_kv_pool.page_size,
        addressing=addressing_of_pool(token_to_kv_pool),
    )
    return output.view(-1, layer.tp_q_head_num * layer.v_head_dim)
