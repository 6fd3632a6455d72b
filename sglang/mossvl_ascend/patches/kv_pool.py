"""A KV pool shaped like MOSS-VL: vision tokens stored for the cross-attention layers only, text tokens for the
self-attention layers only, in the stock pool's bytes (the layout: :mod:`mossvl_ascend.attention.kv_layout`).

Four hooks, one idea: the scheduler side (allocator, radix cache, admission, ``/v1/loads``) counts **slots**, a
request's encoder taking ``ceil(E / bands)`` of them; the forward side (the model, the attention core) sees its
``E`` vision tokens at their unit addresses. ``MOSSVL_KV_LAYOUT=stock`` keeps the stock pool.
Catalog entries: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import msgspec
import torch
from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend import side_channel
from mossvl_ascend.attention.kv_layout import (
    ACTIVE_LAYOUT,
    MOSSVL,
    EncoderAddressing,
    LayerBands,
    addressing_of_pool,
    band_view,
    encoder_row_len,
    encoder_write_addresses,
    layout_name,
    requested_layout,
    storage_tokens,
)
from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch
from mossvl_ascend.realtime.sessions import SCHEDULER_SESSIONS

logger = logging.getLogger(__name__)

CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"


def is_moss_vl(configurator) -> bool:
    hf_config = configurator.model_config.hf_config
    return getattr(hf_config, "model_type", None) == "moss_vl" and getattr(hf_config, "text_config", None) is not None


def layer_bands_for(configurator) -> LayerBands | None:
    """The layout for this pool, or None where the stock pool stays (not MOSS-VL, ``MOSSVL_KV_LAYOUT=stock``,
    a pipeline stage holding part of the layers, a draft model)."""
    if not is_moss_vl(configurator):
        return None
    text_config = configurator.model_config.hf_config.text_config
    if requested_layout() != MOSSVL or configurator.is_draft_worker:
        return None
    bands = LayerBands.of_text_config(text_config)
    info = configurator.layer_info
    if not bands.applies or (info.start_layer, info.end_layer) != (0, bands.num_layers):
        return None
    if features_that_copy_stock_layers():
        return None
    return bands


def features_that_copy_stock_layers() -> list[str]:
    """Enabled features that move KV between devices one stock layer buffer at a time (they would copy a
    cross-attention layer's vision tokens by slot): with any of them the stock pool stays. PD disaggregation is not
    one: its transfer moves the shaped pool's storage band by band (:mod:`mossvl_ascend.patches.pd_kv_transfer`)."""
    from sglang.srt.runtime_context import get_server_args

    args = get_server_args()
    enabled = {
        "--enable-hierarchical-cache": args.enable_hierarchical_cache,
        "--enable-lmcache": args.enable_lmcache,
        "--speculative-algorithm": args.speculative_algorithm is not None,
    }
    return [flag for flag, on in enabled.items() if on]


def slots_in_the_stock_budget(sizes, configurator, *args: Any, **kwargs: Any):
    """AFTER hook on ``_derive_pool_sizes``: the slot count that fills the stock pool's bytes."""
    bands = layer_bands_for(configurator)
    if bands is None:
        copying = features_that_copy_stock_layers()
        if copying and getattr(configurator.model_config.hf_config, "model_type", None) == "moss_vl":
            logger.warning("MOSS-VL KV layout off (stock pool): %s copy KV one stock layer at a time", copying)
        return sizes
    page_size = configurator.pool_page_size
    stock_tokens = sizes.max_total_num_tokens
    slots = bands.slots_for_budget(stock_tokens, page_size)
    capacity = bands.capacity(slots)
    logger.info(
        "MOSS-VL KV layout: the stock pool's bytes (%d tokens x %d layers) hold %d slots of %d x %d layers: "
        "%d text tokens or %d vision tokens (a vision token stores the %d cross-attention layers, a text token "
        "the %d self-attention layers; %s=stock keeps the stock pool)",
        stock_tokens,
        bands.num_layers,
        slots,
        bands.bands,
        bands.cross_count,
        capacity["text_tokens"],
        capacity["vision_tokens"],
        bands.cross_count,
        bands.self_count,
        "MOSSVL_KV_LAYOUT",
    )
    return msgspec.structs.replace(sizes, max_total_num_tokens=slots)


def shape_pool(pool, bands: LayerBands, slots: int) -> None:
    """Turn a stock pool of ``bands.cross_count`` layers of ``bands * (slots + page) - page`` tokens (storage
    layer ``j``: ``[bands * (slots + page), ...]`` rows) into the per-decoder-layer views the layout reads:
    a cross-attention layer all of its storage, a self-attention layer one band of it."""
    band_stride = slots + pool.page_size
    storage_k, storage_v = list(pool.k_buffer), list(pool.v_buffer)
    placement = [bands.storage_of(layer_id) for layer_id in range(bands.num_layers)]
    pool.k_buffer = [band_view(storage_k[j], bands.bands, band) for j, band in placement]
    pool.v_buffer = [band_view(storage_v[j], bands.bands, band) for j, band in placement]
    pool.layer_num = bands.num_layers
    pool.start_layer, pool.end_layer = 0, bands.num_layers - 1
    pool.model_layer_ids = tuple(range(bands.num_layers))
    pool.size = slots
    side_channel.STORAGE_BYTES.set(pool, sum(t.numel() * t.element_size() for t in storage_k + storage_v))
    side_channel.KV_STORAGE.set(pool, (tuple(storage_k), tuple(storage_v)))
    side_channel.ENCODER_ADDRESSING.set(pool, EncoderAddressing(bands.bands, band_stride))


def build_shaped_pool(original: Callable, configurator, *args: Any, max_total_num_tokens: int, **kwargs: Any):
    """AROUND hook on the MHA pool builders (CPU and Ascend): stock's builder for the storage layers, then
    :func:`shape_pool`."""
    bands = layer_bands_for(configurator)
    if bands is None:
        pool = original(configurator, *args, max_total_num_tokens=max_total_num_tokens, **kwargs)
        if is_moss_vl(configurator):
            side_channel.KV_LAYOUT_NAME.set(pool, layout_name(None))
        return pool
    storage_rows = storage_tokens(bands, max_total_num_tokens, configurator.pool_page_size)
    stock_info = configurator.layer_info
    configurator.layer_info = msgspec.structs.replace(
        stock_info, start_layer=0, end_layer=bands.cross_count, num_effective_layers=bands.cross_count
    )
    try:
        pool = original(configurator, *args, max_total_num_tokens=storage_rows, **kwargs)
    finally:
        configurator.layer_info = stock_info
    shape_pool(pool, bands, max_total_num_tokens)
    side_channel.KV_LAYOUT_NAME.set(pool, layout_name(bands))
    ACTIVE_LAYOUT.record(bands.bands)
    return pool


def encoder_slots_for_vision_tokens(original: Callable, model, input_ids, mm_inputs):
    """AROUND hook on MOSS-VL's ``pad_input_ids``: ``ceil(E / bands)`` encoder placeholders, not ``E``."""
    padded = original(model, input_ids, mm_inputs)
    vision_tokens = mm_inputs.num_image_tokens or 0
    bands = ACTIVE_LAYOUT.bands
    if bands is None or not vision_tokens:
        return padded
    rows = encoder_row_len(vision_tokens, bands)
    side_channel.VISION_TOKENS.set(mm_inputs, vision_tokens)
    mm_inputs.num_image_tokens = rows
    return padded[vision_tokens - rows :]


def vision_tokens_in_the_forward(forward_batch, cls, batch, model_runner, *args: Any, **kwargs: Any):
    """AFTER hook on ``ForwardBatch.init_new``: the forward's encoder lengths in vision tokens, and the unit
    address of each new vision token for the cross-attention K/V writes (a realtime step's new frames included)."""
    addressing = addressing_of_pool(model_runner.token_to_kv_pool)
    rows = forward_batch.encoder_lens_cpu
    if not rows or not any(rows):
        return forward_batch
    stock_cached = list(forward_batch.encoder_cached)
    realtime = SCHEDULER_SESSIONS.step_vision_in_the_forward(forward_batch, batch, addressing)
    if addressing.bands == 1 and realtime is None:
        return forward_batch
    realtime, step_addresses = realtime or ([None] * len(rows), {})
    tokens = [
        step_tokens if step_tokens is not None else _vision_tokens(req, row_len, addressing.bands)
        for req, row_len, step_tokens in zip(batch.reqs, rows, realtime)
    ]
    new_slots = forward_batch.encoder_out_cache_loc
    # A decode batch keeps the last extend's (unused) encoder slots: only an extend writes vision K/V.
    if forward_batch.forward_mode.is_extend() and (step_addresses or (new_slots is not None and new_slots.numel())):
        forward_batch.encoder_out_cache_loc = encoder_write_addresses(
            rows, tokens, stock_cached, new_slots, addressing.band_stride, step_addresses
        )
    forward_batch.encoder_lens_cpu = tokens
    forward_batch.encoder_lens = torch.tensor(tokens, dtype=forward_batch.encoder_lens.dtype).to(
        forward_batch.encoder_lens.device, non_blocking=True
    )
    return forward_batch


def _vision_tokens(req, row_len: int, bands: int) -> int:
    if not row_len or bands == 1:
        return row_len
    vision_tokens = side_channel.VISION_TOKENS.get(req.multimodal_inputs)
    if vision_tokens is None or encoder_row_len(vision_tokens, bands) != row_len:
        raise RuntimeError(
            f"request {req.rid}: {row_len} encoder slots but no matching vision-token count on its multimodal "
            "inputs (the MOSS-VL KV layout pads every request through pad_input_ids)"
        )
    return vision_tokens


def vision_tokens_per_prefill_within_a_chunk(original: Callable, adder, req, *args: Any, **kwargs: Any):
    """AROUND hook on ``PrefillAdder.add_one_req``: a prefill batch takes at most a chunk of new vision tokens
    (the vision tower's work), as with stock's token counts; alone in a batch a request is admitted as before."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    vision_tokens = _new_vision_tokens(req)
    if ACTIVE_LAYOUT.bands is None or not vision_tokens or not adder.can_run_list:
        return original(adder, req, *args, **kwargs)
    admitted = sum(_new_vision_tokens(other) for other in adder.can_run_list)
    if admitted + vision_tokens > _prefill_chunk_tokens():
        return AddReqResult.OTHER
    return original(adder, req, *args, **kwargs)


def _new_vision_tokens(req) -> int:
    """The vision tokens this request's next prefill runs through the vision tower (0 once its encoder is in)."""
    mm_inputs = req.multimodal_inputs
    rows = (mm_inputs.num_image_tokens or 0) if mm_inputs is not None else 0
    if not rows or req.prefix_len >= rows:
        return 0
    return side_channel.VISION_TOKENS.get(mm_inputs, rows)


def _prefill_chunk_tokens() -> int:
    from sglang.srt.runtime_context import get_server_args

    args = get_server_args()
    chunk = args.chunked_prefill_size
    return chunk if chunk is not None and chunk > 0 else args.max_prefill_tokens


PATCHES = (
    Patch(
        title="MOSS-VL KV layout: the stock pool's bytes counted in slots of bands x cross-layer count layers",
        target=f"{CONFIGURATOR}._derive_pool_sizes",
        kind=HookType.AFTER,
        hook=slots_in_the_stock_budget,
        platforms=ON_NPU_AND_CPU,
        why=(
            "stock sizes the KV pool in tokens of all decoder layers (MOSS-VL-Instruct: 48), but a vision token is "
            "read only by the 12 cross-attention layers and a text token only by the 36 self-attention layers: "
            "three quarters of a vision token's bytes and a quarter of a text token's are never read"
        ),
        how=(
            "the stock token count (from `--mem-fraction-static` or `--max-total-tokens`, unchanged) becomes the "
            "pool's bytes; they hold `tokens * L / (bands * L_cross)` slots (whole pages), a slot storing one text "
            "token or `bands` vision tokens. The start-up log gives the capacity in text and in vision tokens. "
            "MOSS-VL only, all layers on this rank (no pipeline split), not a draft model, and none of the features "
            "that copy KV one stock layer buffer at a time (hierarchical cache, LMCache, speculative decoding: a "
            "warning says the stock pool stays; PD disaggregation moves the storage band by band, `pd_kv_transfer`); "
            "`MOSSVL_KV_LAYOUT=stock` keeps stock"
        ),
        upstream="not in sglang (its hybrid pools split by layer kind for sliding-window and linear attention)",
        remove_when="sglang sizes encoder-decoder KV per layer kind",
    ),
    Patch(
        title="MOSS-VL KV layout: the CPU pool's storage layers viewed per decoder layer",
        target=f"{CONFIGURATOR}._build_mha_kv_pool",
        kind=HookType.AROUND,
        hook=build_shaped_pool,
        platforms=ON_NPU_AND_CPU,
        why="the pool must store a vision token in the cross-attention layers only and a text token in the "
        "self-attention layers only, within the bytes of the stock pool",
        how=(
            "stock's builder makes `L_cross` storage layers of `bands * (slots + page)` rows (stock's own buffers, "
            "dtype and device handling), then `shape_pool` gives every decoder layer a view: a self-attention layer "
            "`k` band `k // L_cross` of storage `k % L_cross` (a contiguous `[slots, heads, dim]`, written and read "
            "by slot as stock does), a cross-attention layer `j` all of storage `j` (vision tokens at unit "
            "addresses). The pool carries its `EncoderAddressing` for the attention core"
        ),
        upstream="not in sglang",
        remove_when="sglang sizes encoder-decoder KV per layer kind",
    ),
    Patch(
        title="MOSS-VL KV layout: the Ascend pool's storage layers viewed per decoder layer",
        target=f"{CONFIGURATOR}._build_ascend_mha_kv_pool",
        kind=HookType.AROUND,
        hook=build_shaped_pool,
        platforms=ON_NPU_AND_CPU,
        why="as for the CPU pool; `--attention-backend ascend` builds `NPUMHATokenToKVPool` through this builder",
        how=(
            "as for the CPU pool: the views are slices of whole pages of stock's `[layers, pages, page, heads, "
            "dim]` storage, so `_npu_reshape_and_cache` and the paged block tables address them as stock layers"
        ),
        upstream="not in sglang",
        remove_when="sglang sizes encoder-decoder KV per layer kind",
    ),
    Patch(
        title="MOSS-VL KV layout: a request's encoder holds ceil(E / bands) slots",
        target="sglang.srt.models.moss_vl.MossVLForConditionalGeneration.pad_input_ids",
        kind=HookType.AROUND,
        hook=encoder_slots_for_vision_tokens,
        platforms=ON_NPU_AND_CPU,
        why=(
            "the scheduler, the allocator, the radix cache and `/v1/loads` count a request's placeholder tokens; "
            "with `E` placeholders a vision token would be charged a whole slot though it takes `1 / bands` of one"
        ),
        how=(
            "with the layout active in this process, the prompt starts with `ceil(E / bands)` encoder placeholders "
            "(same pad value) and `num_image_tokens` is that count, so every stock count is in slots; `E` is kept "
            "on the request's multimodal inputs for the forward"
        ),
        upstream="not in sglang",
        remove_when="sglang sizes encoder-decoder KV per layer kind",
    ),
    Patch(
        title="MOSS-VL KV layout: the forward sees vision tokens at their unit addresses",
        target="sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
        kind=HookType.AFTER,
        hook=vision_tokens_in_the_forward,
        platforms=ON_NPU_AND_CPU,
        why=(
            "the model and the attention core need each request's `E` vision tokens (vision tower output, frame "
            "visibility) and where each new one's K/V goes, while the batch carries encoder slots"
        ),
        how=(
            "on a shaped pool with more than one band, the ForwardBatch's `encoder_lens` / `encoder_lens_cpu` "
            "become vision tokens and `encoder_out_cache_loc` the unit address of every new vision token (band "
            "`t // R` of encoder slot `t % R`); the ScheduleBatch keeps its slot counts. The attention core reads "
            "text behind `R` encoder slots and vision tokens at the same addresses"
        ),
        upstream="not in sglang",
        remove_when="sglang sizes encoder-decoder KV per layer kind",
    ),
    Patch(
        title="MOSS-VL KV layout: a prefill batch takes at most a chunk of new vision tokens",
        target="sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
        kind=HookType.AROUND,
        hook=vision_tokens_per_prefill_within_a_chunk,
        platforms=ON_NPU_AND_CPU,
        why=(
            "admission and the chunk budget count slots, and an encoder takes `1 / bands` of its vision tokens in "
            "slots, so one prefill batch could carry `bands` times the vision tokens stock would put through the "
            "vision tower at once (measured on the bench preset at chunk 4096: 7 videos in one batch, about 57k "
            "patches, and the CPU vision attention asked for 78.9 GB)"
        ),
        how=(
            "with the layout active, a request whose encoder is not cached yet joins a prefill batch that already "
            "has requests only if the batch's new vision tokens stay within `--chunked-prefill-size` (else "
            "`--max-prefill-tokens`); otherwise it waits for the next batch (`AddReqResult.OTHER`). A request alone "
            "in its batch is admitted as before. Memory admission is unchanged (slots)"
        ),
        upstream="not in sglang",
        remove_when="sglang sizes encoder-decoder KV per layer kind",
    ),
)
