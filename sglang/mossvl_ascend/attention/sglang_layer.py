"""One MOSS-VL attention layer of an sglang ForwardBatch (adapter layer), shared by the Ascend and CPU hooks.

Translates sglang's objects (RadixAttention layer, ForwardBatch, token-to-KV pool, req-to-token pool) into the
core's arguments: write this forward's new K/V, then run :func:`mossvl_ascend.attention.core.attention` with the
forward's metadata (built once, by the prepare_forward_batch hook or the first layer), or, for a decode step a
graph runner captures, :func:`mossvl_ascend.attention.decode_step.decode_attention` on the step's static inputs.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_context import get_attn_backend
from sglang.srt.model_executor.runner_utils.capture_mode import get_is_capture_mode

from mossvl_ascend import side_channel
from mossvl_ascend.attention.core import AttentionLayer, attention
from mossvl_ascend.attention.decode_graph import StepTables, graph_decode_attention
from mossvl_ascend.attention.decode_step import DecodeView, decode_attention, store_decode_kv
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


def captured_decode_view(forward_batch) -> DecodeView | None:
    """The static inputs of a decode step that a graph runner captures or replays (stock's capture mode, which its
    CPU runner also keeps on at replay), else None: an eager forward reads its own metadata."""
    if not (forward_batch.forward_mode.is_decode() and get_is_capture_mode()):
        return None
    view = side_channel.DECODE_VIEW.get(get_attn_backend())
    if view is None:
        raise RuntimeError("a captured MOSS-VL decode step without its static inputs (DecodeBuffers never filled)")
    return view


def graph_step_tables(backend, forward_batch) -> StepTables | None:
    """The tables of an NPU decode step the graph runner captures (built inside the recording by the backend's
    in-graph metadata hook), else None."""
    if not (getattr(backend, "graph_mode", False) and forward_batch.forward_mode.is_decode()):
        return None
    return side_channel.DECODE_TABLES.get(backend)


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
    graph_tables: StepTables | None = None,
) -> torch.Tensor:
    """One attention layer of an encoder-decoder (MOSS-VL) batch: extend, decode or mixed.

    Writes the new K/V (encoder K/V for a cross-attention layer; nothing when k/v are None, i.e. the encoder is
    already cached or the batch has no vision input), then the core (an NPU graph's decode step: its
    ``graph_tables``). q ``[num_tokens, num_heads * head_dim]``; returns ``[num_tokens, num_heads * v_head_dim]``.
    """
    view = None if graph_tables is not None else captured_decode_view(forward_batch)
    # Rows by slot: the NPU pool's buffers are paged ``[pages, page_size, heads, dim]``, the CPU pool's flat.
    k_cache = token_to_kv_pool.get_key_buffer(layer.layer_id).view(-1, layer.tp_k_head_num, layer.qk_head_dim)
    v_cache = token_to_kv_pool.get_value_buffer(layer.layer_id).view(-1, layer.tp_v_head_num, layer.v_head_dim)
    # A captured CPU decode step writes its text K/V through the in-place op (a quantized cache keeps the pool's own
    # write: it stores scales too).
    in_place = view is not None and not layer.is_cross_attention and not token_to_kv_pool.is_quantized_kv_cache
    if save_kv_cache and k is not None and v is not None:
        if in_place:
            store_decode_kv(
                k_cache,
                v_cache,
                forward_batch.out_cache_loc,
                k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim),
                v.reshape(-1, layer.tp_v_head_num, layer.v_head_dim),
            )
        elif layer.is_cross_attention:
            token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.encoder_out_cache_loc, None), k, v)
        else:
            token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, swa_out_cache_loc), k, v)
    query = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    constants, addressing = layer_constants(layer), addressing_of_pool(token_to_kv_pool)
    if graph_tables is not None:
        if constants.logit_cap:
            raise NotImplementedError("an NPU decode graph of a layer with logit capping (the fused op has none)")
        output = graph_decode_attention(
            query,
            k_cache,
            v_cache,
            graph_tables.of(constants.is_cross_attention),
            constants.scale,
            token_to_kv_pool.page_size,
        )
    elif view is not None:
        output = decode_attention(
            query,
            k_cache,
            v_cache,
            req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            view.table,
            view.step,
            constants.is_cross_attention,
            constants.scale,
            constants.logit_cap,
            addressing.bands,
            addressing.band_stride,
        )
    else:
        output = attention(
            query,
            k_cache,
            v_cache,
            req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            metadata_of_forward_batch(forward_batch),
            constants,
            page_size=token_to_kv_pool.page_size,
            addressing=addressing,
        )
    return output.view(-1, layer.tp_q_head_num * layer.v_head_dim)
