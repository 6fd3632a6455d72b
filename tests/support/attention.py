"""Shared attention test builders and oracles: MOSS-VL-shaped batches over a real KV-pool layout, a dense
reference attention written from first principles, and one-layer route checks.

Oracle: :func:`reference_attention`, explicit scores, explicit per-row softmax over the visible keys only. Each
request's visibility is built from its frame spans and per-token visible-frame counts; the packed uint8 mask
handed to the code under test is derived from that, so a polarity flip, a wrong row length (prefix counted in),
a wrong running offset or wrong KV slots all change the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.hardware_backend.npu.attention.ascend_torch_native_backend import (
    AscendTorchNativeAttnBackend,
)
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from mossvl_ascend.attention.kv_layout import STOCK_ADDRESSING, EncoderAddressing
from mossvl_ascend.patches import native_attention
from support.hooks import patches_applied

HEAD_DIM = 8
POOL_SLOTS = 400


@pytest.fixture(scope="module")
def patched_native():
    with patches_applied(*native_attention.PATCHES):
        yield AscendTorchNativeAttnBackend()


# ----------------------------------------------------------------------------- reference


def reference_attention(q, k, v, visible, scale, logit_cap=0.0):
    """Dense fp32 attention. q [Lq, H, D], k [S, Hkv, D], v [S, Hkv, Dv], visible bool [Lq, S].

    Query head h reads kv head h // (H // Hkv). A row with no visible key outputs zeros.
    """
    q, k, v = q.float(), k.float(), v.float()
    num_heads, group = q.shape[1], q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], num_heads, v.shape[-1])
    for h in range(num_heads):
        scores = (q[:, h] @ k[:, h // group].T) * scale
        if logit_cap > 0:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        for row in range(q.shape[0]):
            cols = visible[row].nonzero().flatten()
            if cols.numel() == 0:
                continue
            weights = torch.softmax(scores[row, cols], dim=0)
            out[row, h] = weights @ v[cols, h // group]
    return out


def frame_visibility(spans, visible_frame_counts, first_frames=None):
    """Bool [rows, sum(spans)]: a row that sees n frames sees the encoder prefix of n spans; with ``first_frames``
    (a frame window) a row whose first frame is f does not see the keys of the f frames before it."""
    encoder_len = sum(spans)
    boundaries = [sum(spans[:count]) for count in visible_frame_counts]
    keys = torch.arange(encoder_len)[None, :]
    visible = keys < torch.tensor(boundaries, dtype=torch.long)[:, None]
    if first_frames is not None:
        visible &= keys >= torch.tensor([sum(spans[:f]) for f in first_frames], dtype=torch.long)[:, None]
    return visible


def causal_with_prefix(extend_len, prefix_len):
    """Bool [extend_len, prefix_len + extend_len]: new token i sees text tokens 0..prefix_len+i."""
    rows = torch.arange(prefix_len, prefix_len + extend_len)[:, None]
    return torch.arange(prefix_len + extend_len)[None, :] <= rows


# ----------------------------------------------------------------------------- batches


@dataclass
class Request:
    """One MOSS-VL request: frame spans of its encoder tokens, text lengths, per-token frame counts."""

    spans: list[int]
    prefix_len: int
    extend_len: int
    visible_frame_counts: list[int] = field(default_factory=list)
    # A realtime step with a frame window: per text row, the first frame it sees (empty: frame 0 for every row).
    first_visible_frames: list[int] = field(default_factory=list)

    @property
    def encoder_len(self) -> int:
        return sum(self.spans)

    @property
    def text_len(self) -> int:
        return self.prefix_len + self.extend_len

    def new_token_visibility(self):
        counts = self.visible_frame_counts[self.prefix_len : self.text_len]
        first = self.first_visible_frames[self.prefix_len : self.text_len] or None
        return frame_visibility(self.spans, counts, first)


def example_requests():
    """Encoder 0 / 2 frames / 3 frames / 1 frame; cached text prefixes 0 and > 0; rows seeing 0 frames."""
    return [
        Request(spans=[5, 5], prefix_len=0, extend_len=6, visible_frame_counts=[0, 1, 1, 2, 2, 2]),
        Request(spans=[], prefix_len=2, extend_len=3),
        Request(
            spans=[4, 4, 4],
            prefix_len=4,
            extend_len=5,
            visible_frame_counts=[0, 0, 1, 1, 1, 2, 2, 3, 3],
        ),
        Request(spans=[7], prefix_len=3, extend_len=2, visible_frame_counts=[0, 0, 0, 0, 1]),
    ]


@dataclass
class Batch:
    requests: list[Request]
    num_heads: int
    num_kv_heads: int
    req_pool_indices: torch.Tensor
    req_to_token: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    encoder_k: list[torch.Tensor]  # per request [encoder_len, Hkv, D]
    encoder_v: list[torch.Tensor]
    text_k: list[torch.Tensor]  # per request [text_len, Hkv, D]
    text_v: list[torch.Tensor]
    query: torch.Tensor  # [sum(extend_len), H, D]
    slots: list[torch.Tensor]  # per request pool slots, encoder first then text
    addressing: EncoderAddressing = STOCK_ADDRESSING  # where the pool keeps vision tokens

    @property
    def encoder_lens(self):
        return torch.tensor([r.encoder_len for r in self.requests])

    @property
    def seq_lens(self):
        return torch.tensor([r.text_len for r in self.requests])

    @property
    def extend_prefix_lens(self):
        return torch.tensor([r.prefix_len for r in self.requests])

    @property
    def extend_seq_lens(self):
        return torch.tensor([r.extend_len for r in self.requests])

    def query_rows(self, req_idx):
        start = sum(r.extend_len for r in self.requests[:req_idx])
        return slice(start, start + self.requests[req_idx].extend_len)

    def packed_mask(self):
        """uint8, 1 = visible, per request [extend_len x encoder_len] row-major, batch order."""
        parts = [
            r.new_token_visibility().to(torch.uint8).flatten() for r in self.requests if r.encoder_len and r.extend_len
        ]
        return torch.cat(parts)


def build_batch(requests, num_heads=4, num_kv_heads=2, seed=0) -> Batch:
    """Random K/V at shuffled pool slots (the rest of the pool is noise), random queries."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(POOL_SLOTS, num_kv_heads, HEAD_DIM, generator=gen)
    v_cache = torch.randn(POOL_SLOTS, num_kv_heads, HEAD_DIM, generator=gen)
    free_slots = (torch.randperm(POOL_SLOTS - 1, generator=gen) + 1).tolist()
    req_pool_indices = torch.randperm(len(requests) + 2, generator=gen)[: len(requests)]
    req_to_token = torch.zeros(len(requests) + 2, 64, dtype=torch.int32)
    slots = []
    for req, pool_idx in zip(requests, req_pool_indices.tolist()):
        n = req.encoder_len + req.text_len
        req_slots = torch.tensor([free_slots.pop() for _ in range(n)])
        req_to_token[pool_idx, :n] = req_slots.int()
        slots.append(req_slots)
    query = torch.randn(sum(r.extend_len for r in requests), num_heads, HEAD_DIM, generator=gen)
    return _batch_over_slots(requests, req_pool_indices, req_to_token, k_cache, v_cache, query, slots)


def build_paged_batch(requests, num_heads, num_kv_heads, head_dim, dtype, page_size, seed=0) -> Batch:
    """Random K/V (rounded to ``dtype``) laid out as the NPU pool holds them: each request owns whole pages
    (distinct, shuffled, slot 0 never used) from column 0 of its req_to_token row, position j at slot
    ``page[j // page_size] * page_size + j % page_size``; the rest of the pool is noise. ``page_size`` 1 is a plain
    shuffled pool."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_request = [-(-(r.encoder_len + r.text_len) // page_size) for r in requests]
    num_pages = sum(pages_per_request) + 3
    k_cache = torch.randn(num_pages * page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages * page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    free_pages = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    req_pool_indices = torch.randperm(len(requests) + 2, generator=gen)[: len(requests)]
    width = max(64, max(pages_per_request) * page_size)
    req_to_token = torch.zeros(len(requests) + 2, width, dtype=torch.int32)
    slots = []
    for req, pool_idx, pages in zip(requests, req_pool_indices.tolist(), pages_per_request):
        n = req.encoder_len + req.text_len
        owned = torch.tensor([free_pages.pop() for _ in range(pages)])
        req_slots = (owned[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        req_to_token[pool_idx, :n] = req_slots.int()
        slots.append(req_slots)
    query = torch.randn(sum(r.extend_len for r in requests), num_heads, head_dim, generator=gen).to(dtype)
    return _batch_over_slots(requests, req_pool_indices, req_to_token, k_cache, v_cache, query, slots)


def build_banded_batch(requests, num_heads, num_kv_heads, head_dim, dtype, page_size, bands, cross, seed=0) -> Batch:
    """One layer's K/V in the MOSS-VL KV layout (``mossvl_ascend.attention.kv_layout``): each request's row is
    ``R = ceil(E / bands)`` encoder slots then its text, on whole shuffled pages; the storage is ``bands`` bands of
    ``stride`` slots. A cross-attention layer's cache is the whole storage, vision token ``t`` at band ``t // R`` of
    slot ``row[t % R]``; a self-attention layer's is one band (the second, so its slots are not storage rows). The
    references copy each request's K/V out of the storage by that rule, written here independently of the core."""
    session = [False] * len(requests)
    return build_session_batch(
        requests, session, num_heads, num_kv_heads, head_dim, dtype, page_size, bands, cross, seed
    )[0]


def build_session_batch(requests, session, num_heads, num_kv_heads, head_dim, dtype, page_size, bands, cross, seed=0):
    """As ``build_banded_batch``, but the requests flagged in ``session`` are realtime sessions: their encoder row is
    whole pages (at least ``ceil(E / bands)`` slots, one page more than needed, as after a grown encoder) and their
    vision tokens are slot-major, token ``t`` at band ``t % bands`` of slot ``row[t // bands]``. Returns the batch
    and each request's encoder rows (the references copy K/V out of the storage by these rules, written here)."""
    gen = torch.Generator().manual_seed(seed)
    encoder_rows = [
        (-(-(-(-r.encoder_len // bands)) // page_size) + 1) * page_size if is_session else -(-r.encoder_len // bands)
        for r, is_session in zip(requests, session)
    ]
    pages_per_request = [-(-(rows + r.text_len) // page_size) for rows, r in zip(encoder_rows, requests)]
    num_pages = sum(pages_per_request) + 3
    stride = num_pages * page_size
    storage_k = torch.randn(bands * stride, num_kv_heads, head_dim, generator=gen).to(dtype)
    storage_v = torch.randn(bands * stride, num_kv_heads, head_dim, generator=gen).to(dtype)
    band = min(1, bands - 1)
    k_cache, v_cache = (
        (storage_k, storage_v)
        if cross
        else (storage_k[band * stride : (band + 1) * stride], storage_v[band * stride : (band + 1) * stride])
    )
    free_pages = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    req_pool_indices = torch.randperm(len(requests) + 2, generator=gen)[: len(requests)]
    width = max(64, max(pages_per_request) * page_size)
    req_to_token = torch.zeros(len(requests) + 2, width, dtype=torch.int32)
    slots, encoder_k, encoder_v, text_k, text_v = [], [], [], [], []
    for req, pool_idx, pages, rows, is_session in zip(
        requests, req_pool_indices.tolist(), pages_per_request, encoder_rows, session
    ):
        owned = torch.tensor([free_pages.pop() for _ in range(pages)])
        row = (owned[:, None] * page_size + torch.arange(page_size)).flatten()[: rows + req.text_len]
        req_to_token[pool_idx, : len(row)] = row.int()
        slots.append(row)
        if is_session:
            vision = [(t % bands) * stride + int(row[t // bands]) for t in range(req.encoder_len)]
        else:
            vision = [(t // rows) * stride + int(row[t % rows]) for t in range(req.encoder_len)]
        encoder_k.append(storage_k[vision].clone())
        encoder_v.append(storage_v[vision].clone())
        text_k.append(k_cache[row[rows:]].clone() if not cross else storage_k[:0])
        text_v.append(v_cache[row[rows:]].clone() if not cross else storage_v[:0])
    query = torch.randn(sum(r.extend_len for r in requests), num_heads, head_dim, generator=gen).to(dtype)
    batch = Batch(
        requests,
        num_heads,
        num_kv_heads,
        req_pool_indices,
        req_to_token,
        k_cache,
        v_cache,
        encoder_k,
        encoder_v,
        text_k,
        text_v,
        query,
        slots,
        EncoderAddressing(bands, stride),
    )
    return batch, encoder_rows


def _batch_over_slots(requests, req_pool_indices, req_to_token, k_cache, v_cache, query, slots) -> Batch:
    """The batch, with each request's encoder and text K/V copied out of the pool for the references."""
    encoder_k, encoder_v, text_k, text_v = [], [], [], []
    for req, req_slots in zip(requests, slots):
        encoder_k.append(k_cache[req_slots[: req.encoder_len]].clone())
        encoder_v.append(v_cache[req_slots[: req.encoder_len]].clone())
        text_k.append(k_cache[req_slots[req.encoder_len :]].clone())
        text_v.append(v_cache[req_slots[req.encoder_len :]].clone())
    return Batch(
        requests,
        query.shape[1],
        k_cache.shape[1],
        req_pool_indices,
        req_to_token,
        k_cache,
        v_cache,
        encoder_k,
        encoder_v,
        text_k,
        text_v,
        query,
        slots,
    )


def batch_metadata(batch):
    """The per-forward metadata of an extend (or decode) batch: each request's new rows see the encoder prefix of
    their visible-frame counts; a request without counts (decode) sees every frame."""
    from mossvl_ascend.attention.metadata import ForwardAttentionMetadata

    boundaries = []
    for r in batch.requests:
        counts = r.visible_frame_counts[r.prefix_len : r.text_len]
        boundaries.append(
            torch.tensor([sum(r.spans[:c]) for c in counts], dtype=torch.int32) if r.encoder_len and counts else None
        )
    metadata = ForwardAttentionMetadata.build(
        [r.extend_len for r in batch.requests],
        [r.prefix_len for r in batch.requests],
        [r.encoder_len for r in batch.requests],
        boundaries,
    )
    if any(r.first_visible_frames for r in batch.requests):
        lowers = [
            torch.tensor([sum(r.spans[:f]) for f in r.first_visible_frames[r.prefix_len : r.text_len]])
            if r.first_visible_frames
            else None
            for r in batch.requests
        ]
        metadata.with_lower_bounds(lowers)
    return metadata


def reference_cross_extend(batch, scale, logit_cap=0.0):
    out = torch.zeros_like(batch.query)
    for i, req in enumerate(batch.requests):
        if req.encoder_len == 0:
            continue  # no vision input: cross-attention contributes zeros
        out[batch.query_rows(i)] = reference_attention(
            batch.query[batch.query_rows(i)],
            batch.encoder_k[i],
            batch.encoder_v[i],
            req.new_token_visibility(),
            scale,
            logit_cap,
        )
    return out


def reference_self_extend(batch, scale, logit_cap=0.0):
    out = torch.zeros_like(batch.query)
    for i, req in enumerate(batch.requests):
        out[batch.query_rows(i)] = reference_attention(
            batch.query[batch.query_rows(i)],
            batch.text_k[i],
            batch.text_v[i],
            causal_with_prefix(req.extend_len, req.prefix_len),
            scale,
            logit_cap,
        )
    return out


def run_native_extend(native, batch, *, cross, mask, scale, logit_cap=0.0, with_encoder_lens=True):
    """The stock ``run_sdpa_forward_extend`` argument list on ``batch``; ``with_encoder_lens=False`` passes
    ``encoder_lens=None``, as text-only models do."""
    output = torch.full_like(batch.query, float("nan"))
    return native.run_sdpa_forward_extend(
        batch.query,
        output,
        batch.k_cache,
        batch.v_cache,
        batch.req_to_token,
        batch.req_pool_indices,
        batch.seq_lens,
        batch.extend_prefix_lens,
        batch.extend_seq_lens,
        batch.encoder_lens if with_encoder_lens else None,
        is_cross_attention=cross,
        scaling=scale,
        enable_gqa=batch.num_heads != batch.num_kv_heads,
        causal=not cross,
        logit_cap=logit_cap,
        cross_attention_custom_mask=mask,
    )


SCALE = HEAD_DIM**-0.5


def moss_vl_extend_batch(requests, grids, merge):
    """Duck-typed ForwardBatch (stand-in) with the fields prepare_forward_batch reads."""
    mm_inputs = [
        SimpleNamespace(
            visible_frame_counts=torch.tensor(req.visible_frame_counts),
            mm_items=[SimpleNamespace(grid_thw=grid)],
        )
        if grid is not None
        else None
        for req, grid in zip(requests, grids)
    ]
    return SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(requests),
        encoder_lens=torch.tensor([r.encoder_len for r in requests]),
        encoder_lens_cpu=[r.encoder_len for r in requests],
        extend_seq_lens_cpu=[r.extend_len for r in requests],
        extend_prefix_lens_cpu=[r.prefix_len for r in requests],
        seq_lens=torch.tensor([r.text_len for r in requests]),
        seq_lens_cpu=torch.tensor([r.text_len for r in requests]),
        mm_inputs=mm_inputs,
    )


def decode_batch(heads=(4, 2), seed=1):
    """Requests after prefill: one new token each, its KV already written (text_len includes it)."""
    requests = [
        Request(spans=[5, 5], prefix_len=6, extend_len=1),
        Request(spans=[], prefix_len=4, extend_len=1),
        Request(spans=[4, 4, 4], prefix_len=8, extend_len=1),
    ]
    return build_batch(requests, *heads, seed=seed)


# ----------------------------------------------------------------------------- layer routes
# Shared by tests/test_ascend_backend.py and tests/test_cpu_attention_route.py: one attention
# layer through a real backend's forward() (sglang's AttentionBackend.forward dispatch) over a
# real KV pool and a real ReqToTokenPool, with a real ForwardBatch.

CROSS_LAYER_ID, SELF_LAYER_ID = 0, 1
ROUTE_HEADS = (4, 2)


def make_layers(logit_cap=0.0):
    from sglang.srt.layers.radix_attention import RadixAttention

    num_heads, num_kv_heads = ROUTE_HEADS
    cross = RadixAttention(
        num_heads,
        HEAD_DIM,
        SCALE,
        num_kv_heads,
        layer_id=CROSS_LAYER_ID,
        is_cross_attention=True,
        logit_cap=logit_cap,
    )
    self_attn = RadixAttention(num_heads, HEAD_DIM, SCALE, num_kv_heads, layer_id=SELF_LAYER_ID, logit_cap=logit_cap)
    return cross, self_attn


def make_req_to_token_pool():
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    return ReqToTokenPool(size=8, max_context_len=64, device="cpu", enable_memory_saver=False)


def pool_rows(pool, layer_id, slots):
    """(K, V) ``[len(slots), Hkv, D]`` as stored in the pool (read straight from its buffers)."""
    num_kv_heads = ROUTE_HEADS[1]
    k = pool.get_key_buffer(layer_id).view(-1, num_kv_heads, HEAD_DIM)[slots]
    v = pool.get_value_buffer(layer_id).view(-1, num_kv_heads, HEAD_DIM)[slots]
    return k.clone(), v.clone()


def load_batch_into_pools(batch, pool, req_to_token_pool, *, except_slots=()):
    """Test set-up: every request's cached K/V into both layers, except slots this forward writes."""
    num_kv_heads = ROUTE_HEADS[1]
    rows = batch.req_to_token.shape[0]
    req_to_token_pool.req_to_token[:rows, : batch.req_to_token.shape[1]] = batch.req_to_token
    for layer_id in (CROSS_LAYER_ID, SELF_LAYER_ID):
        k_buf = pool.get_key_buffer(layer_id).view(-1, num_kv_heads, HEAD_DIM)
        v_buf = pool.get_value_buffer(layer_id).view(-1, num_kv_heads, HEAD_DIM)
        k_buf[:POOL_SLOTS] = batch.k_cache
        v_buf[:POOL_SLOTS] = batch.v_cache
        for slots in except_slots:
            k_buf[slots] = -100.0  # garbage the forward must overwrite before reading
            v_buf[slots] = 100.0


def make_forward_batch(batch, mode, *, out_cache_loc, encoder_out_cache_loc, mask=None):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    forward_batch = ForwardBatch(
        forward_mode=mode,
        batch_size=len(batch.requests),
        input_ids=torch.zeros(batch.query.shape[0], dtype=torch.long),
        req_pool_indices=batch.req_pool_indices,
        seq_lens=batch.seq_lens,
        out_cache_loc=out_cache_loc,
        seq_lens_sum=int(batch.seq_lens.sum()),
    )
    forward_batch.encoder_lens = batch.encoder_lens
    forward_batch.encoder_lens_cpu = batch.encoder_lens.tolist()
    forward_batch.encoder_out_cache_loc = encoder_out_cache_loc
    forward_batch.extend_prefix_lens = batch.extend_prefix_lens
    forward_batch.extend_seq_lens = batch.extend_seq_lens
    forward_batch.extend_prefix_lens_cpu = batch.extend_prefix_lens.tolist()
    forward_batch.extend_seq_lens_cpu = batch.extend_seq_lens.tolist()
    forward_batch.cross_attention_custom_mask = mask
    return forward_batch


def new_text_slots(batch):
    return torch.cat([s[r.encoder_len + r.prefix_len :] for r, s in zip(batch.requests, batch.slots)])


def check_extend_cross_writes_new_encoder_and_applies_mask(backend, pool, req_to_token_pool, logit_cap):
    """Request 0's encoder is computed in this pass (k/v given); 2 and 3 are cached; 1 has none."""
    batch = build_batch(example_requests(), *ROUTE_HEADS)
    fresh = batch.slots[0][: batch.requests[0].encoder_len]
    load_batch_into_pools(batch, pool, req_to_token_pool, except_slots=[fresh])
    others_before = pool_rows(pool, CROSS_LAYER_ID, batch.slots[2])
    cross, _ = make_layers(logit_cap)
    forward_batch = make_forward_batch(
        batch,
        ForwardMode.EXTEND,
        out_cache_loc=new_text_slots(batch),
        encoder_out_cache_loc=fresh,
        mask=batch.packed_mask(),
    )
    out = backend.forward(batch.query.flatten(1), batch.encoder_k[0], batch.encoder_v[0], cross, forward_batch)
    expected = reference_cross_extend(batch, SCALE, logit_cap)
    torch.testing.assert_close(out.view_as(expected), expected, atol=1e-5, rtol=1e-5)
    written_k, written_v = pool_rows(pool, CROSS_LAYER_ID, fresh)
    assert torch.equal(written_k, batch.encoder_k[0]) and torch.equal(written_v, batch.encoder_v[0])
    for before, after in zip(others_before, pool_rows(pool, CROSS_LAYER_ID, batch.slots[2])):
        assert torch.equal(before, after)


def check_extend_cross_with_cached_encoders_writes_nothing(backend, pool, req_to_token_pool):
    """k = v = None (every encoder cached): no KV write, cached encoder K/V read, mask applied."""
    batch = build_batch([example_requests()[i] for i in (2, 1, 3)], *ROUTE_HEADS)
    load_batch_into_pools(batch, pool, req_to_token_pool)
    k_before = pool.get_key_buffer(CROSS_LAYER_ID).clone()
    cross, _ = make_layers()
    forward_batch = make_forward_batch(
        batch,
        ForwardMode.EXTEND,
        out_cache_loc=new_text_slots(batch),
        encoder_out_cache_loc=torch.zeros(0, dtype=torch.long),
        mask=batch.packed_mask(),
    )
    out = backend.forward(batch.query.flatten(1), None, None, cross, forward_batch)
    expected = reference_cross_extend(batch, SCALE)
    torch.testing.assert_close(out.view_as(expected), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool.get_key_buffer(CROSS_LAYER_ID), k_before)


def check_extend_self_with_cached_prefix(backend, pool, req_to_token_pool, logit_cap):
    """New text K/V written at out_cache_loc; keys over the cached prefix plus the new tokens."""
    batch = build_batch(example_requests(), *ROUTE_HEADS)
    new_slots = new_text_slots(batch)
    load_batch_into_pools(batch, pool, req_to_token_pool, except_slots=[new_slots])
    _, self_attn = make_layers(logit_cap)
    new_k = torch.cat([k[r.prefix_len :] for r, k in zip(batch.requests, batch.text_k)])
    new_v = torch.cat([v[r.prefix_len :] for r, v in zip(batch.requests, batch.text_v)])
    forward_batch = make_forward_batch(
        batch,
        ForwardMode.EXTEND,
        out_cache_loc=new_slots,
        encoder_out_cache_loc=torch.zeros(0, dtype=torch.long),
        mask=batch.packed_mask(),
    )
    out = backend.forward(batch.query.flatten(1), new_k, new_v, self_attn, forward_batch)
    expected = reference_self_extend(batch, SCALE, logit_cap)
    torch.testing.assert_close(out.view_as(expected), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool_rows(pool, SELF_LAYER_ID, new_slots)[0], new_k)


def check_decode_cross_reads_cached_encoder_and_sees_all_frames(backend, pool, req_to_token_pool, logit_cap):
    batch = decode_batch(ROUTE_HEADS)
    load_batch_into_pools(batch, pool, req_to_token_pool)
    k_before = pool.get_key_buffer(CROSS_LAYER_ID).clone()
    cross, _ = make_layers(logit_cap)
    forward_batch = make_forward_batch(
        batch,
        ForwardMode.DECODE,
        out_cache_loc=new_text_slots(batch),
        encoder_out_cache_loc=torch.zeros(0, dtype=torch.long),
    )
    out = backend.forward(batch.query.flatten(1), None, None, cross, forward_batch).view_as(batch.query)
    for i, req in enumerate(batch.requests):
        all_frames = torch.ones(1, req.encoder_len, dtype=torch.bool)
        expected = reference_attention(
            batch.query[i : i + 1], batch.encoder_k[i], batch.encoder_v[i], all_frames, SCALE, logit_cap
        )
        torch.testing.assert_close(out[i : i + 1], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool.get_key_buffer(CROSS_LAYER_ID), k_before)


def check_decode_self_writes_token_and_reads_text_window(backend, pool, req_to_token_pool):
    batch = decode_batch(ROUTE_HEADS)
    new_slots = new_text_slots(batch)
    load_batch_into_pools(batch, pool, req_to_token_pool, except_slots=[new_slots])
    _, self_attn = make_layers()
    forward_batch = make_forward_batch(
        batch,
        ForwardMode.DECODE,
        out_cache_loc=new_slots,
        encoder_out_cache_loc=torch.zeros(0, dtype=torch.long),
    )
    new_k = torch.stack([k[-1] for k in batch.text_k])
    new_v = torch.stack([v[-1] for v in batch.text_v])
    out = backend.forward(batch.query.flatten(1), new_k, new_v, self_attn, forward_batch).view_as(batch.query)
    for i, req in enumerate(batch.requests):
        all_text = torch.ones(1, req.text_len, dtype=torch.bool)
        expected = reference_attention(batch.query[i : i + 1], batch.text_k[i], batch.text_v[i], all_text, SCALE)
        torch.testing.assert_close(out[i : i + 1], expected, atol=1e-5, rtol=1e-5)


def cross_extend_of_one_request(backend, pool, req_to_token_pool):
    """Example request 0 (frame-causal mask, nothing cached but its encoder) through a cross layer.

    Returns (output ``[extend_len, H, D]``, batch).
    """
    batch = build_batch([example_requests()[0]], *ROUTE_HEADS)
    load_batch_into_pools(batch, pool, req_to_token_pool)
    forward_batch = make_forward_batch(
        batch,
        ForwardMode.EXTEND,
        out_cache_loc=new_text_slots(batch),
        encoder_out_cache_loc=torch.zeros(0, dtype=torch.long),
        mask=batch.packed_mask(),
    )
    cross, _ = make_layers()
    out = backend.forward(batch.query.flatten(1), None, None, cross, forward_batch)
    return out.view_as(batch.query), batch


# ----------------------------------------------------------------------------- NPU group types
# The attention core's group types as the NPU primitives see them, shared by tests/test_npu_attention_core.py (CPU,
# through the STAND-IN FIA) and benchmarks/npu_acceptance.py (the real ops on an Ascend card).

NPU_SHAPES = {"tiny": (4, 2, 16), "instruct": (32, 8, 128)}  # query heads, KV heads, head_dim (MOSS-VL-Instruct)

PREFIXED_SELF = [
    Request(spans=[5, 5], prefix_len=6, extend_len=9),
    Request(spans=[], prefix_len=2, extend_len=3),
    Request(spans=[4, 4, 4], prefix_len=0, extend_len=12),
    Request(spans=[7], prefix_len=13, extend_len=1),
]
FRESH_PREFILLS = [
    Request(spans=[4, 4], prefix_len=0, extend_len=9),
    Request(spans=[], prefix_len=0, extend_len=3),
    Request(spans=[6], prefix_len=0, extend_len=30),
]
DECODE = [
    Request(spans=[5, 5], prefix_len=6, extend_len=1),
    Request(spans=[], prefix_len=4, extend_len=1),
    Request(spans=[4, 4, 4], prefix_len=8, extend_len=1),
    Request(spans=[3], prefix_len=11, extend_len=1),
]
CROSS_BOUNDARIES = [
    Request(spans=[5, 5], prefix_len=0, extend_len=6, visible_frame_counts=[0, 1, 1, 2, 2, 2]),
    Request(spans=[], prefix_len=2, extend_len=3),
    Request(spans=[4, 4, 4], prefix_len=4, extend_len=5, visible_frame_counts=[0, 0, 1, 1, 1, 2, 2, 3, 3]),
    Request(spans=[7], prefix_len=3, extend_len=2, visible_frame_counts=[0, 0, 0, 0, 1]),
    Request(spans=[6, 4], prefix_len=1, extend_len=4, visible_frame_counts=[1] * 5),
]
CROSS_UNIFORM = [
    Request(spans=[6, 4], prefix_len=1, extend_len=4, visible_frame_counts=[1] * 5),
    Request(spans=[8], prefix_len=0, extend_len=7, visible_frame_counts=[1] * 7),
    Request(spans=[3, 3, 3], prefix_len=2, extend_len=1, visible_frame_counts=[3, 3, 2]),
]
# A video-like request (8 frames, 30 text rows after each) whose block plan has several blocks, and a short one that
# goes through the batched call.
STAIRCASE = [
    Request(spans=[16] * 8, prefix_len=0, extend_len=240, visible_frame_counts=[1 + i // 30 for i in range(240)]),
    Request(spans=[5, 5], prefix_len=0, extend_len=6, visible_frame_counts=[0, 1, 1, 2, 2, 2]),
]
BLIND = [
    Request(spans=[5], prefix_len=2, extend_len=1, visible_frame_counts=[0, 0, 0]),
    Request(spans=[4, 4], prefix_len=0, extend_len=3, visible_frame_counts=[0, 0, 0]),
    Request(spans=[], prefix_len=3, extend_len=1),
]
# One-row rows of every kind (the paged call's groups): the first frame only, no frame, every frame, no encoder, and
# encoders of 90-240 tokens so that requests span several pages.
ONE_ROW_EXTENDS = [
    Request(spans=[100, 60], prefix_len=2, extend_len=1, visible_frame_counts=[1, 1, 1]),
    Request(spans=[90], prefix_len=1, extend_len=1, visible_frame_counts=[0, 0]),
    Request(spans=[80, 80, 80], prefix_len=4, extend_len=1, visible_frame_counts=[3] * 5),
    Request(spans=[], prefix_len=130, extend_len=1),
    Request(spans=[150], prefix_len=20, extend_len=1),
]


def run_core_layer(batch, metadata, cross, page_size=1):
    """One MOSS-VL attention layer (cross, or causal self) of ``batch`` through the attention core."""
    from mossvl_ascend.attention.core import AttentionLayer, attention

    layer = AttentionLayer(cross, batch.query.shape[-1] ** -0.5, not cross)
    return attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.req_to_token,
        batch.req_pool_indices,
        metadata,
        layer,
        page_size=page_size,
        addressing=batch.addressing,
    )


def row_boundaries(request, cross):
    """Where each new row stops seeing keys: its frames' encoder prefix, or its text up to itself."""
    if not cross:
        return request.prefix_len + 1 + torch.arange(request.extend_len)
    counts = request.visible_frame_counts[request.prefix_len : request.text_len]
    if not counts:
        return torch.full((request.extend_len,), request.encoder_len)
    return torch.tensor([sum(request.spans[:c]) for c in counts])


def errors_against_fp64(out, batch, cross):
    """Per request ``(error, budget)`` of ``out`` (any device) against the fp64 reference on the same rounded
    inputs (support.precision), over the keys it may see; budget 1.5 x the error of one dense SDPA in the same
    dtype + 1e-3, as test_attention_precision. Rows that must be 0 (no frame, no encoder) count as error inf when
    they are not."""
    from support.precision import dense_same_dtype, fp64_reference, max_error

    out, scale, results = out.cpu(), batch.query.shape[-1] ** -0.5, []
    for i, request in enumerate(batch.requests):
        got = out[batch.query_rows(i)].transpose(0, 1)
        if cross and not request.encoder_len:
            results.append((0.0 if not got.any() else float("inf"), 0.0))
            continue
        keys, values = (batch.encoder_k[i], batch.encoder_v[i]) if cross else (batch.text_k[i], batch.text_v[i])
        q, k, v = (t.cpu().transpose(0, 1) for t in (batch.query[batch.query_rows(i)], keys, values))
        bounds = row_boundaries(request, cross)
        reference = fp64_reference(q, k, v, bounds, scale)
        error = float("inf") if got[:, bounds == 0].any() else max_error(got, reference, bounds)
        budget = 1.5 * max_error(dense_same_dtype(q, k, v, bounds, scale), reference, bounds) + 1e-3
        results.append((error, budget))
    return results
