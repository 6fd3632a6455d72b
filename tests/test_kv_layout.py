"""The MOSS-VL-shaped KV pool (``mossvl_ascend.attention.kv_layout``, ``mossvl_ascend.patches.kv_pool``), no server.

Storage comes in units of ``L_cross`` layers, ``bands = ceil(L_self / L_cross)``; a slot holds ``bands`` units (one
text token, or ``bands`` vision tokens). The pool is ``L_cross`` storage layers of ``bands * (slots + page)`` rows;
self-attention layer ``k`` reads band ``k // L_cross`` of storage ``k % L_cross``, cross layer ``j`` storage ``j``
flat. A request's slot row is ``[R encoder slots | text slots]``, ``R = ceil(E / bands)``; vision token ``t`` is at
``(t // R) * (slots + page) + row[t % R]``.

Oracles, written here independently of the implementation:

* bytes and capacities: a stock ``MHATokenToKVPool`` of the same budget (its real buffers, their distinct untyped
  storages) and hand-computed slot counts;
* isolation: every (layer, token) written through the pool's real ``set_kv_buffer`` reads back exactly, and the
  number of storage rows touched is exactly the number written (no two share a row), at page 1 and at page 128
  with requests whose encoder and text share a page;
* attention: a dense fp64 softmax over each request's original K/V (explicit visibility), against the attention
  core reading the shaped pool, for a batch of several requests (encoders not a multiple of ``bands``, cached text
  prefixes, frame-causal rows, a video-sized staircase, decode rows); addressing mutated by one page, or the stock
  addressing, must change the answer;
* the forward-side hooks (padding, ``ForwardBatch.init_new`` conversion) against the same hand-written addresses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from fake_torch_npu import installed_fake_torch_npu
from moss_vl_reference.tiny_checkpoint import PRESETS
from mossvl_ascend import side_channel
from mossvl_ascend.attention.core import AttentionLayer, attention
from mossvl_ascend.attention.kv_layout import (
    ACTIVE_LAYOUT,
    LAYOUT_ENV,
    STOCK_ADDRESSING,
    EncoderAddressing,
    LayerBands,
    addressing_of_pool,
    encoder_row_len,
    requested_layout,
    vision_addresses,
)
from mossvl_ascend.attention.metadata import ForwardAttentionMetadata
from mossvl_ascend.patches import kv_pool
from mossvl_ascend.patches.kv_pool import shape_pool
from support.kv_pool_rows import allocate_rows, rows_of

GB = 1 << 30

# (decoder layers, cross-attention layer ids)
PATTERNS = {
    "tiny": (8, (1, 5)),
    "bench": (10, (2, 6)),
    "instruct": (48, tuple(range(2, 48, 4))),  # MOSS-VL-Instruct: 12 of 48, every fourth from 2
    "uneven": (7, (1, 4, 6)),  # 4 self layers over 3 cross layers: the second band is half used
}
STOCK_TOKENS = 1024
# By hand, for a stock pool of 1024 tokens: bands = ceil(L_self / L_cross); slots = the whole pages of
# floor(1024 * L / (bands * L_cross)).
#   tiny      8 layers, 2 cross, 6 self: bands 3; 1024 * 8 / 6  = 1365.3 -> 1365; page 128: 10 pages = 1280
#   bench    10 layers, 2 cross, 8 self: bands 4; 1024 * 10 / 8 = 1280          ; page 128: 10 pages = 1280
#   instruct 48 layers, 12 cross, 36 self: bands 3; 1024 * 48 / 36 = 1365.3 -> 1365; page 128: 1280
#   uneven    7 layers, 3 cross, 4 self: bands 2; 1024 * 7 / 6  = 1194.7 -> 1194; page 128: 9 pages = 1152
HAND = {
    ("tiny", 1): (3, 1365),
    ("tiny", 128): (3, 1280),
    ("bench", 1): (4, 1280),
    ("bench", 128): (4, 1280),
    ("instruct", 1): (3, 1365),
    ("instruct", 128): (3, 1280),
    ("uneven", 1): (2, 1194),
    ("uneven", 128): (2, 1152),
}
HEADS, KV_HEADS, DIM = 4, 2, 8


def layer_bands(name: str) -> LayerBands:
    layers, cross = PATTERNS[name]
    return LayerBands.of_text_config(SimpleNamespace(num_hidden_layers=layers, cross_attention_layers=list(cross)))


def stock_pool(
    tokens: int,
    layers: int,
    page: int,
    kv_heads: int = KV_HEADS,
    dim: int = DIM,
    pool_class: type = MHATokenToKVPool,
    dtype: torch.dtype = torch.float32,
) -> MHATokenToKVPool:
    return pool_class(
        size=tokens,
        page_size=page,
        dtype=dtype,
        head_num=kv_heads,
        head_dim=dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )


def shaped_pool(bands: LayerBands, slots: int, page: int, **kwargs) -> MHATokenToKVPool:
    """As the kv_pool builder hook makes it: stock's pool of L_cross layers of bands * (slots + page) - page
    tokens, then shaped."""
    pool = stock_pool(bands.bands * (slots + page) - page, bands.cross_count, page, **kwargs)
    shape_pool(pool, bands, slots)
    return pool


def distinct_storage_bytes(pool) -> int:
    storages = {}
    for tensor in [*pool.k_buffer, *pool.v_buffer]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.fixture(scope="module")
def npu_pool_class():
    """sglang's real ``NPUMHATokenToKVPool``, its ``set_kv_buffer`` calling the STAND-IN torch_npu's
    ``_npu_reshape_and_cache`` (tests/fake_torch_npu.py: bf16/fp16 only, slots inside the cache)."""
    import sglang.srt.hardware_backend.npu.memory_pool_npu as memory_pool_npu

    with installed_fake_torch_npu() as fake, pytest.MonkeyPatch.context() as mp:
        mp.setattr(memory_pool_npu, "torch_npu", fake, raising=False)
        mp.delenv("ASCEND_USE_FIA", raising=False)
        yield memory_pool_npu.NPUMHATokenToKVPool


def self_layers(bands: LayerBands) -> list[int]:
    return [i for i in range(bands.num_layers) if i not in bands.cross_layers]


# ----------------------------------------------------------------------------- (a) bytes and capacities


def test_the_presets_are_the_patterns_tested_here():
    for name in ("tiny", "bench"):
        text = PRESETS[name]["text"]
        assert (text["num_hidden_layers"], tuple(text["cross_attention_layers"])) == PATTERNS[name]
    assert layer_bands("tiny").bands == layer_bands("instruct").bands == 3


@pytest.mark.parametrize("page", [1, 128])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_shaped_pool_bytes_never_exceed_the_stock_pool_and_capacities_match_hand_arithmetic(name, page):
    bands = layer_bands(name)
    layers = bands.num_layers
    hand_bands, hand_slots = HAND[(name, page)]
    assert bands.bands == hand_bands
    assert bands.slots_for_budget(STOCK_TOKENS, page) == hand_slots

    stock = stock_pool(STOCK_TOKENS, layers, page)
    pool = shaped_pool(bands, hand_slots, page)
    stock_bytes = distinct_storage_bytes(stock)
    assert stock_bytes == layers * 2 * (STOCK_TOKENS + page) * KV_HEADS * DIM * 4  # the stock pool as documented
    shaped_bytes = distinct_storage_bytes(pool)
    assert shaped_bytes <= stock_bytes
    assert side_channel.STORAGE_BYTES.get(pool) == shaped_bytes  # the attribute counts the real storage
    assert pool.mem_usage <= stock.mem_usage  # what /v1/loads and the metrics report
    assert abs(pool.mem_usage * GB - shaped_bytes) < 1
    # Whole pages: one more page of slots would need more token-layers than the stock pool has.
    assert hand_slots % page == 0
    assert (hand_slots + page) * hand_bands * bands.cross_count > STOCK_TOKENS * layers

    # Capacities: one slot per text token, `bands` vision tokens per slot.
    assert pool.size == hand_slots
    assert bands.capacity(hand_slots) == {"text_tokens": hand_slots, "vision_tokens": hand_bands * hand_slots}
    addressing = addressing_of_pool(pool)
    assert addressing == EncoderAddressing(hand_bands, hand_slots + page)
    assert addressing_of_pool(stock) == STOCK_ADDRESSING
    assert len(pool.k_buffer) == len(pool.v_buffer) == layers
    for layer_id in range(layers):
        k, v = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
        rows = hand_bands * (hand_slots + page) if layer_id in bands.cross_layers else hand_slots + page
        assert k.shape == v.shape == (rows, KV_HEADS, DIM), layer_id
        assert k.is_contiguous() and v.is_contiguous()


@pytest.mark.parametrize("page", [1, 16, 128])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_shaped_pool_bytes_within_the_stock_pool_for_any_budget(name, page):
    bands = layer_bands(name)
    for stock_tokens in (page, 3 * page, 1000 // page * page or page, 4096):
        slots = bands.slots_for_budget(stock_tokens, page)
        hand = (stock_tokens * bands.num_layers // (bands.bands * bands.cross_count)) // page * page
        assert slots == hand, stock_tokens
        stock = stock_pool(stock_tokens, bands.num_layers, page, kv_heads=1, dim=2)
        pool = shaped_pool(bands, slots, page, kv_heads=1, dim=2)
        assert distinct_storage_bytes(pool) <= distinct_storage_bytes(stock), stock_tokens
        assert side_channel.STORAGE_BYTES.get(pool) <= distinct_storage_bytes(stock), stock_tokens


@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_shaped_npu_pool_bytes_never_exceed_the_stock_npu_pool(name, page, npu_pool_class):
    """The Ascend pool (``[layers, pages, page, heads, dim]``, one padding page) shaped by the same hook."""
    bands = layer_bands(name)
    slots = bands.slots_for_budget(STOCK_TOKENS, page)
    npu = {"pool_class": npu_pool_class, "dtype": torch.bfloat16}
    stock = stock_pool(STOCK_TOKENS, bands.num_layers, page, **npu)
    pool = shaped_pool(bands, slots, page, **npu)
    stock_bytes = distinct_storage_bytes(stock)
    assert stock_bytes == bands.num_layers * 2 * (STOCK_TOKENS + page) * KV_HEADS * DIM * 2
    assert distinct_storage_bytes(pool) == side_channel.STORAGE_BYTES.get(pool) <= stock_bytes
    assert addressing_of_pool(pool) == EncoderAddressing(bands.bands, slots + page)
    for layer_id in range(bands.num_layers):
        rows = bands.bands * (slots + page) if layer_id in bands.cross_layers else slots + page
        k = pool.get_key_buffer(layer_id)
        assert k.shape == (rows // page, page, KV_HEADS, DIM) and k.is_contiguous(), layer_id


# ----------------------------------------------------------------------------- allocation (test side)


def unit_addresses(encoder_slots: list[int], vision_tokens: int, slots: int, page: int) -> list[int]:
    """Hand-written: band t // R of encoder slot t % R, a band being slots + page rows of the flat storage."""
    row_len = len(encoder_slots)
    return [(t // row_len) * (slots + page) + encoder_slots[t % row_len] for t in range(vision_tokens)]


# ----------------------------------------------------------------------------- (b) isolation


# (vision tokens, text tokens): encoders that are not a multiple of any band count, one without an encoder, one of
# several pages.
ISOLATION_REQUESTS = [(301, 150), (7, 5), (0, 200), (600, 300), (2, 1)]


POOL_KINDS = {
    "cpu-page1": ("cpu", 1),
    "cpu-page128": ("cpu", 128),
    "npu-page16": ("npu", 16),
    "npu-page128": ("npu", 128),
}


@pytest.mark.parametrize("kind", list(POOL_KINDS))
@pytest.mark.parametrize("name", ["tiny", "bench", "uneven"])
def test_every_layer_and_token_has_its_own_storage(name, kind, request):
    """A pool just large enough for the requests (every slot in use at page 1, every page otherwise); the CPU pool
    in fp32, the Ascend pool in bf16 through the stand-in ``_npu_reshape_and_cache``."""
    device, page = POOL_KINDS[kind]
    kwargs = {}
    if device == "npu":
        kwargs = {"pool_class": request.getfixturevalue("npu_pool_class"), "dtype": torch.bfloat16}
    bands = layer_bands(name)
    encoder_rows = [-(-e // bands.bands) for e, _ in ISOLATION_REQUESTS]
    assert [encoder_row_len(e, bands.bands) for e, _ in ISOLATION_REQUESTS] == encoder_rows
    row_lens = [rows + t for rows, (_, t) in zip(encoder_rows, ISOLATION_REQUESTS)]
    slots = sum(-(-n // page) * page for n in row_lens)
    pool = shaped_pool(bands, slots, page, **kwargs)
    storages = [rows_of(pool.k_buffer[j]) for j in bands.cross_layers]
    storages += [rows_of(pool.v_buffer[j]) for j in bands.cross_layers]
    for storage in storages:
        storage.fill_(float("nan"))
    rows = allocate_rows(row_lens, slots, page, seed=3)
    assert {s // page for row in rows for s in row} == set(range(1, slots // page + 1))  # the whole pool in use
    if page > 1:  # the last encoder slot and the first text slot on one page
        shared = [row[r - 1] // page == row[r] // page for row, r in zip(rows, encoder_rows) if r]
        assert sum(shared) >= 3

    gen = torch.Generator().manual_seed(4)
    dtype = kwargs.get("dtype", torch.float32)
    written = []  # (layer_id, addresses, k, v)
    for (vision_tokens, text_tokens), row in zip(ISOLATION_REQUESTS, rows):
        row_len = encoder_row_len(vision_tokens, bands.bands)
        encoder_slots, text_slots = row[:row_len], row[row_len:]
        assert len(text_slots) == text_tokens
        if vision_tokens:
            addresses = torch.tensor(unit_addresses(encoder_slots, vision_tokens, slots, page))
            implemented = vision_addresses(torch.tensor(encoder_slots, dtype=torch.int32), vision_tokens, slots + page)
            assert torch.equal(implemented, addresses)
            for layer_id in bands.cross_layers:
                k, v = torch.randn(2, vision_tokens, KV_HEADS, DIM, generator=gen).to(dtype)
                written.append((layer_id, addresses, k, v))
        for layer_id in self_layers(bands):
            k, v = torch.randn(2, text_tokens, KV_HEADS, DIM, generator=gen).to(dtype)
            written.append((layer_id, torch.tensor(text_slots), k, v))

    for layer_id, loc, k, v in written:
        cross = layer_id in bands.cross_layers
        layer = RadixAttention(HEADS, DIM, DIM**-0.5, KV_HEADS, layer_id=layer_id, is_cross_attention=cross)
        pool.set_kv_buffer(layer, loc, k, v)
    for layer_id, loc, k, v in written:
        assert torch.equal(rows_of(pool.get_key_buffer(layer_id))[loc], k), (layer_id, loc[:4])
        assert torch.equal(rows_of(pool.get_value_buffer(layer_id))[loc], v), (layer_id, loc[:4])

    # Exactly the written rows were touched: every vision token in L_cross rows, every text token in L_self rows.
    expected_rows = sum(e * bands.cross_count + t * bands.self_count for e, t in ISOLATION_REQUESTS)
    for half in (storages[: bands.cross_count], storages[bands.cross_count :]):
        written_rows = [~storage.isnan() for storage in half]
        assert sum(int(w.all(dim=(1, 2)).sum()) for w in written_rows) == expected_rows
        assert sum(int((w.any(dim=(1, 2)) & ~w.all(dim=(1, 2))).sum()) for w in written_rows) == 0


# ----------------------------------------------------------------------------- (c) attention against a dense oracle


@dataclass
class Request:
    spans: list[int]  # vision tokens of each frame
    prefix_len: int  # cached text
    extend_len: int  # new rows
    counts: list[int] = field(default_factory=list)  # frames each text token sees (empty: every frame)

    @property
    def vision_tokens(self) -> int:
        return sum(self.spans)

    @property
    def text_len(self) -> int:
        return self.prefix_len + self.extend_len

    def boundaries(self) -> torch.Tensor | None:
        """Encoder keys each new row sees (None: no encoder)."""
        if not self.vision_tokens:
            return None
        counts = self.counts[self.prefix_len : self.text_len] if self.counts else [len(self.spans)] * self.extend_len
        return torch.tensor([sum(self.spans[:c]) for c in counts], dtype=torch.int32)


ATTENTION_REQUESTS = [
    Request(spans=[5, 5, 4], prefix_len=0, extend_len=7, counts=[0, 1, 1, 2, 2, 3, 3]),
    Request(spans=[], prefix_len=3, extend_len=4),
    Request(spans=[7], prefix_len=5, extend_len=3, counts=[0, 0, 0, 0, 0, 0, 1, 1]),
    # A video-sized staircase (computed by its block plan): 8 frames of 16, 240 new rows.
    Request(spans=[16] * 8, prefix_len=0, extend_len=240, counts=[1 + i // 30 for i in range(240)]),
    Request(spans=[6, 4], prefix_len=20, extend_len=1),  # a decode row
    Request(spans=[100, 100], prefix_len=130, extend_len=2, counts=[1] * 131 + [2]),  # cached text over a page
    Request(spans=[1], prefix_len=0, extend_len=2, counts=[1, 1]),  # one vision token: R = 1
]


def dense_attention(q, k, v, visible, scale):
    """fp64 softmax over the visible keys only; a row that sees no key is 0. q [Lq, H, D], k/v [S, Hkv, D]."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q, k) * scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqs,shd->qhd", weights, v)


@dataclass
class ShapedBatch:
    bands: LayerBands
    pool: MHATokenToKVPool
    slots: int
    page: int
    requests: list[Request]
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    query: torch.Tensor
    encoder_kv: dict  # (request, cross layer) -> (k, v) [E, Hkv, D]
    text_kv: dict  # (request, self layer) -> (k, v) [T, Hkv, D]

    def metadata(self) -> ForwardAttentionMetadata:
        return ForwardAttentionMetadata.build(
            [r.extend_len for r in self.requests],
            [r.prefix_len for r in self.requests],
            [r.vision_tokens for r in self.requests],
            [r.boundaries() for r in self.requests],
        )

    def rows(self, index: int) -> slice:
        start = sum(r.extend_len for r in self.requests[:index])
        return slice(start, start + self.requests[index].extend_len)

    def run(self, layer_id: int, addressing=None) -> torch.Tensor:
        cross = layer_id in self.bands.cross_layers
        return attention(
            self.query,
            self.pool.get_key_buffer(layer_id),
            self.pool.get_value_buffer(layer_id),
            self.req_to_token,
            self.req_pool_indices,
            self.metadata(),
            AttentionLayer(cross, DIM**-0.5, not cross),
            page_size=self.page,
            addressing=addressing_of_pool(self.pool) if addressing is None else addressing,
        )

    def reference(self, layer_id: int) -> torch.Tensor:
        cross = layer_id in self.bands.cross_layers
        out = torch.zeros(self.query.shape, dtype=torch.float64)
        for i, r in enumerate(self.requests):
            q = self.query[self.rows(i)]
            if cross:
                if not r.vision_tokens:
                    continue
                k, v = self.encoder_kv[(i, layer_id)]
                visible = torch.arange(r.vision_tokens)[None, :] < r.boundaries()[:, None].long()
            else:
                k, v = self.text_kv[(i, layer_id)]
                visible = torch.arange(r.text_len)[None, :] <= torch.arange(r.prefix_len, r.text_len)[:, None]
            out[self.rows(i)] = dense_attention(q, k, v, visible, DIM**-0.5)
        return out


def shaped_batch(page: int, seed: int = 0) -> ShapedBatch:
    """The tiny pattern's pool, every other row noise, each request's K/V for every layer written through
    set_kv_buffer (vision tokens at hand-computed unit addresses), req_to_token rows [R encoder | text]."""
    bands = layer_bands("tiny")
    slots = bands.slots_for_budget(STOCK_TOKENS, page)
    pool = shaped_pool(bands, slots, page)
    gen = torch.Generator().manual_seed(seed)
    for j in bands.cross_layers:
        pool.k_buffer[j].copy_(torch.randn(pool.k_buffer[j].shape, generator=gen))
        pool.v_buffer[j].copy_(torch.randn(pool.v_buffer[j].shape, generator=gen))
    requests = ATTENTION_REQUESTS
    row_lens = [encoder_row_len(r.vision_tokens, bands.bands) + r.text_len for r in requests]
    rows = allocate_rows(row_lens, slots, page, seed=seed + 1)
    req_pool_indices = torch.randperm(len(requests) + 3, generator=gen)[: len(requests)]
    req_to_token = torch.zeros(len(requests) + 3, max(row_lens) + 5, dtype=torch.int32)
    encoder_kv, text_kv = {}, {}
    for i, (r, row, pool_row) in enumerate(zip(requests, rows, req_pool_indices.tolist())):
        req_to_token[pool_row, : len(row)] = torch.tensor(row, dtype=torch.int32)
        row_len = encoder_row_len(r.vision_tokens, bands.bands)
        if r.vision_tokens:
            addresses = torch.tensor(unit_addresses(row[:row_len], r.vision_tokens, slots, page))
            for layer_id in bands.cross_layers:
                k, v = torch.randn(2, r.vision_tokens, KV_HEADS, DIM, generator=gen)
                layer = RadixAttention(HEADS, DIM, DIM**-0.5, KV_HEADS, layer_id=layer_id, is_cross_attention=True)
                pool.set_kv_buffer(layer, addresses, k, v)
                encoder_kv[(i, layer_id)] = (k, v)
        for layer_id in self_layers(bands):
            k, v = torch.randn(2, r.text_len, KV_HEADS, DIM, generator=gen)
            layer = RadixAttention(HEADS, DIM, DIM**-0.5, KV_HEADS, layer_id=layer_id)
            pool.set_kv_buffer(layer, torch.tensor(row[row_len:]), k, v)
            text_kv[(i, layer_id)] = (k, v)
    query = torch.randn(sum(r.extend_len for r in requests), HEADS, DIM, generator=gen)
    return ShapedBatch(bands, pool, slots, page, requests, req_to_token, req_pool_indices, query, encoder_kv, text_kv)


def max_gap(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


@pytest.mark.parametrize("page", [1, 128])
def test_attention_core_over_the_shaped_pool_equals_dense_attention(page):
    batch = shaped_batch(page)
    assert all(r.vision_tokens % 3 for r in batch.requests if r.vision_tokens)  # encoders not multiples of bands
    metadata = batch.metadata()
    assert any(plan is not None and len(plan.blocks) > 1 for plan in metadata.plans)  # a staircase is in the batch
    for layer_id in range(batch.bands.num_layers):  # both cross layers, all three bands of the self layers
        out = batch.run(layer_id)
        reference = batch.reference(layer_id)
        assert max_gap(out, reference) <= 1e-5, layer_id


@pytest.mark.parametrize("page", [1, 128])
def test_wrong_addressing_reads_wrong_keys(page):
    """The oracle test above can fail: a band stride off by one page, a band count off by one, or the stock
    addressing, each change the outputs."""
    batch = shaped_batch(page)
    right = addressing_of_pool(batch.pool)
    cross_layer, self_layer = batch.bands.cross_layers[1], self_layers(batch.bands)[-1]
    mutations = {
        "stride - page": EncoderAddressing(right.bands, right.band_stride - page),
        "stride + page": EncoderAddressing(right.bands, right.band_stride + page),
        "bands - 1": EncoderAddressing(right.bands - 1, right.band_stride),
        "stock": STOCK_ADDRESSING,
    }
    for name, addressing in mutations.items():
        try:
            gap = max_gap(batch.run(cross_layer, addressing), batch.reference(cross_layer))
        except IndexError:  # read past the storage: caught as well
            gap = math.inf
        assert gap > 1e-2, (name, gap)
    # Text read from behind E slots instead of R: the self-attention keys move.
    for name in ("bands - 1", "stock"):
        gap = max_gap(batch.run(self_layer, mutations[name]), batch.reference(self_layer))
        assert gap > 1e-2, (name, gap)


# ----------------------------------------------------------------------------- the forward-side hooks


@pytest.fixture
def layout_bands():
    """Record a layout's bands as this process's (as building a shaped pool does); the previous one after."""
    previous = ACTIVE_LAYOUT.bands
    yield ACTIVE_LAYOUT.record
    ACTIVE_LAYOUT.record(previous)


def test_padding_hook_gives_a_request_ceil_e_over_bands_encoder_slots(layout_bands):
    layout_bands(3)
    pad, text = 9999, [11, 12, 13]
    for vision_tokens, rows in ((10, 4), (9, 3), (1, 1), (0, 0)):
        mm_inputs = SimpleNamespace(num_image_tokens=None)

        def stock_pad(model, input_ids, mm, e=vision_tokens):
            mm.num_image_tokens = e
            return [pad] * e + list(input_ids)

        padded = kv_pool.encoder_slots_for_vision_tokens(stock_pad, None, text, mm_inputs)
        assert list(padded) == [pad] * rows + text, vision_tokens
        assert mm_inputs.num_image_tokens == rows
        if vision_tokens:
            assert side_channel.VISION_TOKENS.get(mm_inputs) == vision_tokens


def test_padding_hook_is_stock_without_a_shaped_pool(layout_bands):
    layout_bands(None)
    mm_inputs = SimpleNamespace(num_image_tokens=None)

    def stock_pad(model, input_ids, mm):
        mm.num_image_tokens = 5
        return [7] * 5 + list(input_ids)

    assert list(kv_pool.encoder_slots_for_vision_tokens(stock_pad, None, [1, 2], mm_inputs)) == [7] * 5 + [1, 2]
    assert mm_inputs.num_image_tokens == 5


def forward_batch_of(batch: ShapedBatch, cached: list[bool], mode=ForwardMode.EXTEND):
    """A stand-in ForwardBatch as stock init_new leaves it: encoder lengths in slots, the new encoders' slots."""
    bands = batch.bands.bands
    row_lens = [encoder_row_len(r.vision_tokens, bands) for r in batch.requests]
    new_slots = [
        batch.req_to_token[pool_row, :row_len]
        for pool_row, row_len, is_cached in zip(batch.req_pool_indices.tolist(), row_lens, cached)
        if row_len and not is_cached
    ]
    reqs = [SimpleNamespace(rid=f"r{i}", multimodal_inputs=SimpleNamespace()) for i in range(len(batch.requests))]
    for req, r in zip(reqs, batch.requests):
        side_channel.VISION_TOKENS.set(req.multimodal_inputs, r.vision_tokens)
    forward_batch = SimpleNamespace(
        forward_mode=mode,
        encoder_lens_cpu=row_lens,
        encoder_lens=torch.tensor(row_lens, dtype=torch.int32),
        encoder_cached=cached,
        encoder_out_cache_loc=torch.cat(new_slots).long() if new_slots else torch.zeros(0, dtype=torch.long),
    )
    model_runner = SimpleNamespace(token_to_kv_pool=batch.pool)
    return forward_batch, SimpleNamespace(reqs=reqs), model_runner


@pytest.mark.parametrize("page", [1, 128])
def test_forward_batch_hook_gives_vision_tokens_and_their_unit_addresses(page, layout_bands):
    batch = shaped_batch(page)
    layout_bands(batch.bands.bands)
    cached = [False, False, True, False, True, False, False]  # two encoders already in the pool
    forward_batch, schedule_batch, model_runner = forward_batch_of(batch, cached)
    out = kv_pool.vision_tokens_in_the_forward(forward_batch, None, schedule_batch, model_runner)
    assert out.encoder_lens_cpu == [r.vision_tokens for r in batch.requests]
    assert out.encoder_lens.tolist() == [r.vision_tokens for r in batch.requests]
    expected = []
    for r, pool_row, is_cached in zip(batch.requests, batch.req_pool_indices.tolist(), cached):
        if r.vision_tokens and not is_cached:
            row = batch.req_to_token[pool_row].tolist()
            expected += unit_addresses(row[: encoder_row_len(r.vision_tokens, 3)], r.vision_tokens, batch.slots, page)
    assert out.encoder_out_cache_loc.tolist() == expected

    # A decode batch: lengths in vision tokens, the (unused) encoder locations left alone.
    forward_batch, schedule_batch, model_runner = forward_batch_of(batch, [True] * len(cached), ForwardMode.DECODE)
    before = forward_batch.encoder_out_cache_loc.clone()
    out = kv_pool.vision_tokens_in_the_forward(forward_batch, None, schedule_batch, model_runner)
    assert out.encoder_lens_cpu == [r.vision_tokens for r in batch.requests]
    assert torch.equal(out.encoder_out_cache_loc, before)


def test_forward_batch_hook_leaves_a_stock_pool_alone():
    pool = stock_pool(64, 4, 1)
    forward_batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        encoder_lens_cpu=[5],
        encoder_lens=torch.tensor([5]),
        encoder_cached=[False],
        encoder_out_cache_loc=torch.arange(1, 6),
    )
    out = kv_pool.vision_tokens_in_the_forward(forward_batch, None, None, SimpleNamespace(token_to_kv_pool=pool))
    assert out.encoder_lens_cpu == [5] and out.encoder_out_cache_loc.tolist() == [1, 2, 3, 4, 5]


# ----------------------------------------------------------------------------- (d) MOSSVL_KV_LAYOUT


@pytest.mark.parametrize(
    ("value", "layout"),
    [(None, "mossvl"), ("", "mossvl"), ("mossvl", "mossvl"), ("stock", "stock"), (" Stock ", "stock")],
)
def test_requested_layout_accepts_mossvl_and_stock(value, layout, monkeypatch):
    if value is None:
        monkeypatch.delenv(LAYOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(LAYOUT_ENV, value)
    assert requested_layout() == layout


@pytest.mark.parametrize("value", ["bogus", "hybrid", "stock2", "0"])
def test_requested_layout_refuses_anything_else_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv(LAYOUT_ENV, value)
    with pytest.raises(ValueError, match="MOSSVL_KV_LAYOUT"):
        requested_layout()


def test_layer_bands_of_the_instruct_config():
    bands = layer_bands("instruct")
    assert (bands.cross_count, bands.self_count, bands.bands) == (12, 36, 3)
    # Self layer k (k-th non-cross layer) reads band k // 12 of storage k % 12; cross layer j storage j.
    for k, layer_id in enumerate(self_layers(bands)):
        assert bands.storage_of(layer_id) == (k % 12, k // 12)
    for j, layer_id in enumerate(bands.cross_layers):
        assert bands.storage_of(layer_id) == (j, None)
    assert math.ceil(36 / 12) == bands.bands


# ----------------------------------------------------------------------------- prefill batches


def video_request(vision_tokens: int, bands: int = 3, prefix_len: int = 0):
    mm_inputs = SimpleNamespace(num_image_tokens=-(-vision_tokens // bands))
    side_channel.VISION_TOKENS.set(mm_inputs, vision_tokens)
    return SimpleNamespace(multimodal_inputs=mm_inputs, prefix_len=prefix_len)


@pytest.mark.parametrize(
    "admitted, candidate, joins",
    [
        ([], 5000, True),  # alone in its batch: admitted as before, whatever its size
        ([1500, 1500], 1000, True),  # 4000 new vision tokens <= the 4096 chunk
        ([1500, 1500], 1200, False),  # 4200 > 4096: the next batch
        ([3000], 3000, False),
        ([3000], 0, True),  # a text request is never held back
    ],
)
def test_a_prefill_batch_takes_at_most_a_chunk_of_new_vision_tokens(
    monkeypatch, layout_bands, admitted, candidate, joins
):
    """Vision tokens, not slots: three per slot would fit 3x the vision tower's work in one chunk of slots."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    layout_bands(3)
    monkeypatch.setattr(kv_pool, "_prefill_chunk_tokens", lambda: 4096)
    adder = SimpleNamespace(can_run_list=[video_request(e) for e in admitted])
    candidate_req = video_request(candidate) if candidate else SimpleNamespace(multimodal_inputs=None, prefix_len=0)
    calls = []
    result = kv_pool.vision_tokens_per_prefill_within_a_chunk(
        lambda a, r: calls.append(r) or AddReqResult.CONTINUE, adder, candidate_req
    )
    assert (result, calls) == ((AddReqResult.CONTINUE, [candidate_req]) if joins else (AddReqResult.OTHER, []))


def test_an_encoder_already_cached_counts_no_vision_tokens(monkeypatch, layout_bands):
    from sglang.srt.managers.schedule_policy import AddReqResult

    layout_bands(3)
    monkeypatch.setattr(kv_pool, "_prefill_chunk_tokens", lambda: 4096)
    adder = SimpleNamespace(can_run_list=[video_request(4000, prefix_len=1334)])  # its next chunk: text only
    result = kv_pool.vision_tokens_per_prefill_within_a_chunk(
        lambda a, r: AddReqResult.CONTINUE, adder, video_request(4000)
    )
    assert result == AddReqResult.CONTINUE
