"""What a shaped KV pool tells sglang's PD transfer (``mossvl_ascend.patches.pd_kv_transfer``), no server.

The transfer registers ``(data_ptrs, data_lens, item_lens)`` (K buffers, then V buffers) and moves a request by
writing, for the i-th K (V) buffer of the prefill into the i-th of the decode, each page of the request's slot row:
``dst_ptr + dst_page * item_len <- src_ptr + src_page * item_len`` (``mooncake/conn.py`` ``_send_kvcache_generic``,
pages from ``mem_cache/common.py`` ``kv_to_page_indices``). The CPU pool (fp32, pages 1 and 128) and the Ascend
pool (sglang's real ``NPUMHATokenToKVPool``, bf16, page 128, written through the STAND-IN ``torch_npu``
``_npu_reshape_and_cache`` of tests/fake_torch_npu.py).

Oracles, written here from the layout's addressing (``kv_layout``'s docstring), not from the implementation:

* the buffers are the storage: their bytes sum to ``L_cross x 2 x bands x (slots + page) x row bytes``, no two
  overlap, each lies inside one storage layer, each item is one page of rows;
* a request moved by exactly that arithmetic (a raw ``memmove`` per page and buffer, into a second pool at other
  slots) reads back in the second pool, layer by layer through the pool's own ``get_key_buffer``, exactly as written:
  its vision tokens in every cross-attention layer at band ``t // R`` of encoder slot ``t % R``, its text in every
  self-attention layer; a request not moved leaves the second pool's rows untouched; the bytes moved are its pages x
  bands x ``L_cross`` x 2 x a page's row bytes.

The stock description of the same pool (one K and one V view per decoder layer) fails both: its views overlap and
its bytes exceed the storage.
"""

from __future__ import annotations

import ctypes
import hashlib
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.common import kv_to_page_indices
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from fake_torch_npu import installed_fake_torch_npu
from mossvl_ascend import side_channel
from mossvl_ascend.attention.kv_layout import LayerBands, encoder_row_len, layout_name
from mossvl_ascend.patches.kv_pool import shape_pool
from mossvl_ascend.patches.pd_kv_transfer import (
    copies_by_storage_band,
    layout_for_the_peer,
    refuse_a_prefill_that_disagrees,
    shaped_storage_to_the_transfer,
)
from support.kv_pool_rows import allocate_rows, rows_of

KV_HEADS, DIM = 2, 8
# (decoder layers, cross-attention layer ids): the tiny checkpoint's pattern and one whose last band is half used.
PATTERNS = {"tiny": (8, (1, 5)), "uneven": (7, (1, 4, 6))}
# (vision tokens, text tokens): encoders that are not a multiple of the bands, one request without an encoder.
REQUESTS = [(301, 150), (0, 200), (600, 300)]
MOVED = (0, 2)  # request 1 stays on the prefill side
POOLS = {"cpu-page1": ("cpu", 1), "cpu-page128": ("cpu", 128), "npu-page128": ("npu", 128)}


def layer_bands(name: str) -> LayerBands:
    layers, cross = PATTERNS[name]
    return LayerBands.of_text_config(SimpleNamespace(num_hidden_layers=layers, cross_attention_layers=list(cross)))


@pytest.fixture(scope="module")
def npu_pool_class():
    """sglang's real ``NPUMHATokenToKVPool``, its ``set_kv_buffer`` calling the STAND-IN ``_npu_reshape_and_cache``."""
    import sglang.srt.hardware_backend.npu.memory_pool_npu as memory_pool_npu

    with installed_fake_torch_npu() as fake, pytest.MonkeyPatch.context() as mp:
        mp.setattr(memory_pool_npu, "torch_npu", fake, raising=False)
        mp.delenv("ASCEND_USE_FIA", raising=False)
        yield memory_pool_npu.NPUMHATokenToKVPool


def pool_settings(kind: str, request) -> tuple[type, torch.dtype, int]:
    device, page = POOLS[kind]
    if device == "npu":
        return request.getfixturevalue("npu_pool_class"), torch.bfloat16, page
    return MHATokenToKVPool, torch.float32, page


def shaped_pool(bands: LayerBands, slots: int, page: int, pool_class: type, dtype: torch.dtype):
    """As the kv_pool builder hook makes it: stock's pool of L_cross layers of bands * (slots + page) - page tokens."""
    pool = pool_class(
        size=bands.bands * (slots + page) - page,
        page_size=page,
        dtype=dtype,
        head_num=KV_HEADS,
        head_dim=DIM,
        layer_num=bands.cross_count,
        device="cpu",
        enable_memory_saver=False,
    )
    shape_pool(pool, bands, slots)
    return pool


def description(pool) -> tuple[list[int], list[int], list[int]]:
    return shaped_storage_to_the_transfer(type(pool).get_contiguous_buf_infos, pool)


def kv_addresses(bands: LayerBands, slots: int, page: int, row: list[int], vision_tokens: int) -> dict[int, list]:
    """Per decoder layer, the rows of its view holding the request's tokens, from the layout's addressing: a cross
    layer's vision token t at band t // R of encoder slot t % R (a band being slots + page rows), a self layer's text
    token at its slot."""
    row_len = encoder_row_len(vision_tokens, bands.bands)
    encoder, text = row[:row_len], row[row_len:]
    vision = [(t // row_len) * (slots + page) + encoder[t % row_len] for t in range(vision_tokens)]
    return {layer: vision if layer in bands.cross_layers else text for layer in range(bands.num_layers)}


def written_requests(bands: LayerBands, slots: int, page: int, pool, seed: int) -> list[dict]:
    """Distinct K/V per request and layer, written through the pool's own write path (``set_kv_buffer``)."""
    lengths = [encoder_row_len(e, bands.bands) + t for e, t in REQUESTS]
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for (vision_tokens, _), row in zip(REQUESTS, allocate_rows(lengths, slots, page, seed)):
        addresses = kv_addresses(bands, slots, page, row, vision_tokens)
        values = {}
        for layer_id, loc in addresses.items():
            if not loc:
                continue
            k, v = torch.randn(2, len(loc), KV_HEADS, DIM, generator=gen).to(pool.dtype)
            cross = layer_id in bands.cross_layers
            layer = RadixAttention(KV_HEADS, DIM, DIM**-0.5, KV_HEADS, layer_id=layer_id, is_cross_attention=cross)
            pool.set_kv_buffer(layer, torch.tensor(loc), k, v)
            values[layer_id] = (k, v)
        requests.append({"row": row, "vision_tokens": vision_tokens, "values": values})
    return requests


def transfer(src_pool, dst_pool, src_row: list[int], dst_row: list[int]) -> int:
    """Stock's MHA transfer arithmetic over the two pools' descriptions (K half paired with K half, V with V, by
    position); returns the bytes written."""
    src_ptrs, _, item_lens = description(src_pool)
    dst_ptrs, _, _ = description(dst_pool)
    page = src_pool.page_size
    src_pages = kv_to_page_indices(torch.tensor(src_row), page)
    dst_pages = kv_to_page_indices(torch.tensor(dst_row), page)
    moved = 0
    for src_ptr, dst_ptr, item_len in zip(src_ptrs, dst_ptrs, item_lens):
        for src_page, dst_page in zip(src_pages, dst_pages):
            ctypes.memmove(dst_ptr + int(dst_page) * item_len, src_ptr + int(src_page) * item_len, item_len)
            moved += item_len
    return moved


def storage_of(pool, bands: LayerBands) -> list[torch.Tensor]:
    """The pool's storage layers, found from its views (a cross-attention layer's view is a whole storage layer)."""
    return [pool.k_buffer[j] for j in bands.cross_layers] + [pool.v_buffer[j] for j in bands.cross_layers]


@pytest.mark.parametrize("kind", list(POOLS))
@pytest.mark.parametrize("name", list(PATTERNS))
def test_the_description_is_the_storage_with_no_overlap(name, kind, request):
    pool_class, dtype, page = pool_settings(kind, request)
    bands = layer_bands(name)
    slots = 8 * 128
    pool = shaped_pool(bands, slots, page, pool_class, dtype)
    ptrs, lens, item_lens = description(pool)
    row_bytes = KV_HEADS * DIM * dtype.itemsize

    assert len(ptrs) == 2 * bands.cross_count * bands.bands
    assert sum(lens) == bands.cross_count * 2 * bands.bands * (slots + page) * row_bytes
    assert set(item_lens) == {page * row_bytes} and set(lens) == {(slots + page) * row_bytes}
    spans = sorted(zip(ptrs, lens))
    assert all(start + length <= following for (start, length), (following, _) in zip(spans, spans[1:]))
    storage = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in storage_of(pool, bands)]
    for start, length in spans:
        assert sum(begin <= start and start + length <= end for begin, end in storage) == 1, start

    stock_ptrs, stock_lens, _ = type(pool).get_contiguous_buf_infos(pool)
    stock_spans = sorted(zip(stock_ptrs, stock_lens))
    assert any(start + length > following for (start, length), (following, _) in zip(stock_spans, stock_spans[1:]))


@pytest.mark.parametrize("kind", list(POOLS))
@pytest.mark.parametrize("name", list(PATTERNS))
def test_a_request_moved_by_the_description_reads_back_layer_by_layer(name, kind, request):
    pool_class, dtype, page = pool_settings(kind, request)
    bands = layer_bands(name)
    lengths = [encoder_row_len(e, bands.bands) + t for e, t in REQUESTS]
    slots = sum(-(-n // page) * page for n in lengths) + 2 * page
    prefill = shaped_pool(bands, slots, page, pool_class, dtype)
    decode = shaped_pool(bands, slots, page, pool_class, dtype)
    sent = written_requests(bands, slots, page, prefill, seed=5)
    marker = torch.tensor(-7.0, dtype=dtype)
    for layer_id in range(bands.num_layers):
        decode.get_key_buffer(layer_id).fill_(marker)
        decode.get_value_buffer(layer_id).fill_(marker)
    decode_rows = allocate_rows(lengths, slots, page, seed=11)  # the decode server's own slots for each request
    assert decode_rows != [r["row"] for r in sent]

    row_bytes = KV_HEADS * DIM * dtype.itemsize
    for index in MOVED:
        moved = transfer(prefill, decode, sent[index]["row"], decode_rows[index])
        pages = -(-lengths[index] // page)
        assert moved == pages * page * bands.bands * bands.cross_count * 2 * row_bytes

    for index, got in enumerate(sent):
        addresses = kv_addresses(bands, slots, page, decode_rows[index], got["vision_tokens"])
        for layer_id, (k, v) in got["values"].items():
            loc = torch.tensor(addresses[layer_id])
            read_k = rows_of(decode.get_key_buffer(layer_id))[loc]
            read_v = rows_of(decode.get_value_buffer(layer_id))[loc]
            if index in MOVED:
                assert torch.equal(read_k, k) and torch.equal(read_v, v), (index, layer_id)
            else:
                assert (read_k == marker).all() and (read_v == marker).all(), (index, layer_id)


# ----------------------------------------------------------------------------- the peers' agreement

MOSSVL_LINE = "MOSS-VL KV layout mossvl (3 bands x 2 cross-attention layers of 8), page 128, bfloat16 KV, TP 1"
STOCK_LINE = "MOSS-VL KV layout stock, page 128, bfloat16 KV, TP 1"


def decode_manager(ours: str | None, theirs: str | None, fetched: bool = True):
    """A decode manager as the hook sees it, and stock's fetch: it stores the prefill's information (its layout line
    ``theirs``) when ``fetched``; it records the manager's own layout line it saw, which stock compares."""
    manager = SimpleNamespace(kv_layout=ours, prefill_info_table={}, seen_by_stock=[])

    def stock_fetch(manager, bootstrap_addr):
        manager.seen_by_stock.append(manager.kv_layout)
        if fetched:
            manager.prefill_info_table[bootstrap_addr] = SimpleNamespace(kv_layout=theirs)
        return fetched

    return manager, stock_fetch


@pytest.mark.parametrize("theirs", [STOCK_LINE, None, MOSSVL_LINE.replace("page 128", "page 1")])
def test_a_decode_server_refuses_a_prefill_that_disagrees_in_one_line_naming_both(theirs):
    manager, stock_fetch = decode_manager(MOSSVL_LINE, theirs)
    with pytest.raises(RuntimeError) as refused:
        refuse_a_prefill_that_disagrees(stock_fetch, manager, "127.0.0.1:8998")
    message = str(refused.value)
    assert "\n" not in message and "127.0.0.1:8998" in message
    assert f"has [{theirs or 'no MOSS-VL KV layout'}]" in message and f"has [{MOSSVL_LINE}]" in message
    assert manager.prefill_info_table == {}  # nothing kept from the refused prefill
    assert manager.seen_by_stock == [None] and manager.kv_layout == MOSSVL_LINE  # stock's own comparison stood aside


@pytest.mark.parametrize("line", [MOSSVL_LINE, STOCK_LINE])
def test_a_decode_server_takes_a_prefill_that_agrees(line):
    manager, stock_fetch = decode_manager(line, line)
    assert refuse_a_prefill_that_disagrees(stock_fetch, manager, "127.0.0.1:8998") is True
    assert manager.prefill_info_table["127.0.0.1:8998"].kv_layout == line


def test_a_failed_fetch_and_other_models_are_stocks_business():
    manager, stock_fetch = decode_manager(MOSSVL_LINE, None, fetched=False)
    assert refuse_a_prefill_that_disagrees(stock_fetch, manager, "127.0.0.1:8998") is False  # stock retries
    other, stock_fetch = decode_manager(None, "a DeepSeek-V4 layout")
    assert refuse_a_prefill_that_disagrees(stock_fetch, other, "127.0.0.1:8998") is True
    assert other.seen_by_stock == [None]


@pytest.mark.parametrize("layout", ["mossvl", "stock"])
def test_each_peer_announces_layout_page_dtype_tp_and_checkpoint(layout, tmp_path, npu_pool_class):
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import prepare_server_args

    config = b'{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}'
    model = tmp_path / "tiny-moss-vl"
    model.mkdir()
    (model / "config.json").write_bytes(config)
    bands = layer_bands("tiny")
    if layout == "mossvl":
        pool = shaped_pool(bands, 2 * 128, 128, npu_pool_class, torch.bfloat16)
        side_channel.KV_LAYOUT_NAME.set(pool, layout_name(bands))
    else:
        pool = npu_pool_class(
            size=256, page_size=128, dtype=torch.bfloat16, head_num=KV_HEADS, head_dim=DIM, layer_num=8,
            device="cpu", enable_memory_saver=False,
        )  # fmt: skip
        side_channel.KV_LAYOUT_NAME.set(pool, layout_name(None))
    args = prepare_server_args(["--model-path", str(model), "--device", "cpu"])
    with use_context(create_context(args, role="scheduler")):
        line = layout_for_the_peer(None, pool)
    expected = MOSSVL_LINE if layout == "mossvl" else STOCK_LINE
    assert line == f"{expected}, checkpoint tiny-moss-vl@{hashlib.sha256(config).hexdigest()[:12]}"
    assert layout_for_the_peer("a DeepSeek-V4 layout", pool) == "a DeepSeek-V4 layout"


# ----------------------------------------------------------------------------- the decode's retraction backup


@pytest.mark.parametrize("kind", list(POOLS))
@pytest.mark.parametrize("name", list(PATTERNS))
def test_a_retracted_request_comes_back_whole_from_the_host_copy(name, kind, request, monkeypatch):
    """``get_cpu_copy`` of a request's slots, every row of the pool overwritten (its slots reused), ``load_cpu_copy``:
    every layer reads the request's K/V back (with the uneven pattern a band holds vision units that no
    self-attention layer's view reaches). On the Ascend pool ``torch.npu.synchronize`` is a STAND-IN no-op (the
    copies themselves are plain tensor indexing, ``memory_pool_npu.py`` ``_chunk_copy_npu_to_cpu``)."""
    pool_class, dtype, page = pool_settings(kind, request)
    if POOLS[kind][0] == "npu":
        monkeypatch.setattr(torch, "npu", SimpleNamespace(synchronize=lambda: None), raising=False)
    bands = layer_bands(name)
    lengths = [encoder_row_len(e, bands.bands) + t for e, t in REQUESTS]
    slots = sum(-(-n // page) * page for n in lengths) + 2 * page
    pool = shaped_pool(bands, slots, page, pool_class, dtype)
    retracted = written_requests(bands, slots, page, pool, seed=7)[2]
    indices = torch.tensor(retracted["row"])

    host_copy = copies_by_storage_band(type(pool).get_cpu_copy, pool, indices)
    for layer_id in range(bands.num_layers):
        pool.get_key_buffer(layer_id).fill_(-7.0)
        pool.get_value_buffer(layer_id).fill_(-7.0)
    copies_by_storage_band(type(pool).load_cpu_copy, pool, host_copy, indices)

    addresses = kv_addresses(bands, slots, page, retracted["row"], retracted["vision_tokens"])
    for layer_id, (k, v) in retracted["values"].items():
        loc = torch.tensor(addresses[layer_id])
        assert torch.equal(rows_of(pool.get_key_buffer(layer_id))[loc], k), layer_id
        assert torch.equal(rows_of(pool.get_value_buffer(layer_id))[loc], v), layer_id
    assert len(pool.k_buffer) == bands.num_layers  # the per-layer views are back
