"""The MOSS-VL KV layout on both sides of sglang's PD transfer (the layout: `attention.kv_layout`).

Stock's transfer registers a pool as a list of buffers (``get_contiguous_buf_infos``: K buffers, then V buffers, each
with its bytes and one page's bytes) and moves a request by writing, for every buffer pair in order, the pages of its
slot row: ``src_ptr + page * item_len`` to ``dst_ptr + page * item_len``. A shaped pool's per-decoder-layer views
overlap (a cross-attention layer's view is its storage layer, every band; a self-attention layer's is one band of
it), so here the pool describes its storage as what it really is: per storage layer, per band, a contiguous buffer
indexed by page like a stock layer buffer (:func:`~mossvl_ascend.attention.kv_layout.band_buffers`). A request's pages
in all of them are exactly its bytes: text K/V in the self-attention bands, vision units in the cross-attention
layers' rows of its encoder slots.

Both peers must then hold the same layout: the prefill registers a one-line description of its pool at its bootstrap
server (stock's ``kv_layout`` field), and the decode server compares it with its own when it first fetches that
prefill's information, refusing a mismatch with one line naming both.
Catalog entries: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, Callable

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend import side_channel
from mossvl_ascend.attention.kv_layout import addressing_of_pool, band_buffers
from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch

logger = logging.getLogger(__name__)

AGREEMENT_PREFIX = "MOSS-VL KV layout "


def storage_bands(pool) -> tuple[list, list] | None:
    """A shaped pool's K and V band buffers (storage-major), or None for any other pool."""
    storage = side_channel.KV_STORAGE.get(pool)
    if storage is None:
        return None
    bands = addressing_of_pool(pool).bands
    return band_buffers(list(storage[0]), bands), band_buffers(list(storage[1]), bands)


def transfer_description(pool) -> tuple[list[int], list[int], list[int]] | None:
    """``(data_ptrs, data_lens, item_lens)`` of a shaped pool's storage, K bands then V bands, one page per item;
    None for any other pool."""
    kv_bands = storage_bands(pool)
    if kv_bands is None:
        return None
    buffers = [*kv_bands[0], *kv_bands[1]]
    # Every band holds `slots + page` rows (one padding page, as stock's buffers): whole pages.
    pages_per_band = (pool.size + pool.page_size) // pool.page_size
    return (
        [buffer.data_ptr() for buffer in buffers],
        [buffer.nbytes for buffer in buffers],
        [buffer.nbytes // pages_per_band for buffer in buffers],
    )


def shaped_storage_to_the_transfer(original: Callable, pool, *args: Any, **kwargs: Any):
    """AROUND hook on the MHA pools' ``get_contiguous_buf_infos`` (CPU and Ascend): a shaped pool's band buffers."""
    description = transfer_description(pool)
    return original(pool, *args, **kwargs) if description is None else description


def copies_by_storage_band(original: Callable, pool, *args: Any, **kwargs: Any):
    """AROUND hook on the MHA pools' ``get_cpu_copy`` / ``load_cpu_copy`` (a PD decode server's ``cpu_tensor``
    retraction backup): stock's copy loop runs over a shaped pool's band buffers instead of its overlapping
    per-decoder-layer views, so a request's slots carry all of its bytes there and back."""
    kv_bands = storage_bands(pool)
    if kv_bands is None:
        return original(pool, *args, **kwargs)
    layer_views = pool.k_buffer, pool.v_buffer, pool.layer_num
    # The scheduler thread retracts between forwards, the only reader of these attributes meanwhile.
    pool.k_buffer, pool.v_buffer, pool.layer_num = kv_bands[0], kv_bands[1], len(kv_bands[0])
    try:
        return original(pool, *args, **kwargs)
    finally:
        pool.k_buffer, pool.v_buffer, pool.layer_num = layer_views


def checkpoint_identity(model_path: str) -> str:
    """The checkpoint's directory name and the hash of its ``config.json`` (the same checkpoint wherever each peer
    keeps it); the path as given where there is no local config."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return str(model_path)
    return f"{Path(model_path).name}@{hashlib.sha256(config.read_bytes()).hexdigest()[:12]}"


def agreement_of(pool) -> str | None:
    """The one line a MOSS-VL pool's PD peer must match: layout, page size, KV dtype, TP width, checkpoint."""
    from sglang.srt.runtime_context import get_server_args

    layout = side_channel.KV_LAYOUT_NAME.get(pool)
    if layout is None:
        return None
    args = get_server_args()
    dtype = str(pool.dtype).removeprefix("torch.")
    return (
        f"{AGREEMENT_PREFIX}{layout}, page {pool.page_size}, {dtype} KV, TP {args.tp_size}, "
        f"checkpoint {checkpoint_identity(args.model_path)}"
    )


def layout_for_the_peer(result: Any, pool, *args: Any, **kwargs: Any):
    """AFTER hook on ``get_pd_kv_layout``: a MOSS-VL pool's agreement line (stock's field, None for our pools)."""
    agreement = agreement_of(pool) if result is None else None
    if agreement is None:
        return result
    logger.info("PD KV transfer: %s; %d buffers", agreement, len(pool.get_contiguous_buf_infos()[0]))
    return agreement


def refuse_a_prefill_that_disagrees(original: Callable, manager, bootstrap_addr: str, *args: Any, **kwargs: Any):
    """AROUND hook on ``CommonKVManager.try_ensure_parallel_info`` (the decode server's first fetch of a prefill's
    information): a prefill whose agreement line differs from this decode server's is refused in one line."""
    ours = manager.kv_layout
    if not (ours or "").startswith(AGREEMENT_PREFIX) or bootstrap_addr in manager.prefill_info_table:
        return original(manager, bootstrap_addr, *args, **kwargs)
    # Stock compares the same field with advice for DeepSeek-V4's layouts; ours names what MOSS-VL peers share.
    # Only this scheduler thread reads the decode manager's kv_layout.
    manager.kv_layout = None
    try:
        ready = original(manager, bootstrap_addr, *args, **kwargs)
    finally:
        manager.kv_layout = ours
    theirs = manager.prefill_info_table[bootstrap_addr].kv_layout if ready else ours
    if theirs != ours:
        del manager.prefill_info_table[bootstrap_addr]
        raise RuntimeError(
            f"PD peers disagree on the KV they exchange: the prefill server at {bootstrap_addr} has "
            f"[{theirs or 'no MOSS-VL KV layout'}], this decode server has [{ours}]; start both with the same "
            "MOSSVL_KV_LAYOUT, --page-size, --kv-cache-dtype, --tp-size and checkpoint"
        )
    return ready


POOLS = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool"
NPU_POOLS = "sglang.srt.hardware_backend.npu.memory_pool_npu.NPUMHATokenToKVPool"

PATCHES = (
    Patch(
        title="MOSS-VL KV layout under PD: the CPU pool registers its storage bands for the transfer",
        target=f"{POOLS}.get_contiguous_buf_infos",
        kind=HookType.AROUND,
        hook=shaped_storage_to_the_transfer,
        platforms=ON_NPU_AND_CPU,
        why=(
            "stock describes a pool to the PD transfer as one K and one V buffer per decoder layer and moves a "
            "request page by page through each; a shaped pool's per-layer views overlap (a cross-attention layer's "
            "view contains the self-attention layers' bands), so the layout was turned off under "
            "`--disaggregation-mode` and PD shipped a video's KV in the stock pool (3.5x the layout's bytes)"
        ),
        how=(
            "for a shaped pool: per storage layer, per band, K then V, the band's contiguous `[slots + page]` rows "
            "(`kv_layout.band_buffers`), item length one page's bytes, so a request's pages move every byte it owns "
            "(vision units in the cross-attention layers, text in the self-attention bands) and nothing else; any "
            "other pool: stock's description"
        ),
        upstream="not in sglang",
        remove_when="sglang sizes encoder-decoder KV per layer kind",
    ),
    Patch(
        title="MOSS-VL KV layout under PD: the Ascend pool registers its storage bands for the transfer",
        target=f"{NPU_POOLS}.get_contiguous_buf_infos",
        kind=HookType.AROUND,
        hook=shaped_storage_to_the_transfer,
        platforms=ON_NPU_AND_CPU,
        why="as for the CPU pool; `NPUMHATokenToKVPool` walks `get_key_buffer(i)` over the decoder layers' views",
        how=(
            "as for the CPU pool: each band is whole pages of stock's `[layers, pages, page, heads, dim]` storage, "
            "one page per item as stock's Ascend description"
        ),
        upstream="not in sglang",
        remove_when="sglang sizes encoder-decoder KV per layer kind",
    ),
    *(
        Patch(
            title=f"MOSS-VL KV layout under PD: retraction backup by storage band, {pool_name} `{method}`",
            target=f"{pools}.{method}",
            kind=HookType.AROUND,
            hook=copies_by_storage_band,
            platforms=ON_NPU_AND_CPU,
            why=(
                "a PD decode server retracting a request keeps its KV in host memory (`--disaggregation-decode-"
                "retraction-backup cpu_tensor`, what our start-up picks on CPU) with the pool's `get_cpu_copy` and "
                "restores it with `load_cpu_copy`, both looping over the decoder layers' views by slot: a cross-"
                "attention layer's view read by slot holds only band 0 of the request's vision units, so the other "
                "bands would be lost once the slots are reused"
            ),
            how=(
                "for a shaped pool, stock's loop runs over the storage band buffers (the transfer's description, K "
                "and V) in place of the per-layer views for the length of the call; any other pool: stock"
            ),
            upstream="not in sglang",
            remove_when="sglang sizes encoder-decoder KV per layer kind",
        )
        for pools, pool_name in ((POOLS, "CPU pool"), (NPU_POOLS, "Ascend pool"))
        for method in ("get_cpu_copy", "load_cpu_copy")
    ),
    Patch(
        title="MOSS-VL KV layout under PD: each peer announces what its KV is",
        target="sglang.srt.disaggregation.utils.get_pd_kv_layout",
        kind=HookType.AFTER,
        hook=layout_for_the_peer,
        platforms=ON_NPU_AND_CPU,
        why=(
            "a prefill and a decode server that disagree on the layout, the bands, the page size, the KV dtype, the "
            "TP width or the checkpoint would pair buffers of different meaning by position and write garbage"
        ),
        how=(
            "for a MOSS-VL pool (shaped or stock) the layout field stock exchanges at bootstrap (None for these "
            "pools) becomes one line: `MOSS-VL KV layout mossvl (bands x cross layers of layers)` or `stock`, page, "
            "KV dtype, TP size, checkpoint (directory name and config.json hash); logged at start-up"
        ),
        upstream="not in sglang (its `kv_layout` field serves DeepSeek-V4's layouts)",
        remove_when="sglang sizes encoder-decoder KV per layer kind",
    ),
    Patch(
        title="MOSS-VL KV layout under PD: the decode server refuses a prefill that disagrees, in one line",
        target="sglang.srt.disaggregation.common.conn.CommonKVManager.try_ensure_parallel_info",
        kind=HookType.AROUND,
        hook=refuse_a_prefill_that_disagrees,
        platforms=ON_NPU_AND_CPU,
        why=(
            "stock compares the layout field only when both peers set one and words its refusal for DeepSeek-V4 "
            "(`--dsv4-attn-backend`); a MOSS-VL layout on one side and the stock pool on the other must be refused"
        ),
        how=(
            "when a MOSS-VL decode server first fetches a prefill's information, stock's fetch and checks run, then "
            "a differing line (or none) raises `RuntimeError` naming both lines, as stock does for a page-size "
            "mismatch"
        ),
        upstream="not in sglang",
        remove_when="sglang sizes encoder-decoder KV per layer kind",
    ),
)
