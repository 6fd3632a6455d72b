"""MOSS-VL attention of a whole batch, self and cross, extend and decode (batch layer).

All requests of a batch go through a few calls of the device primitive per layer, whatever the batch size:

- self-attention: one call over all requests, queries padded to the longest new-row count, keys gathered from
  the KV pool through a padded slot table (each request's text slots behind its encoder), a mask that is causal
  with each request's cached prefix and cuts every request at its own length; when no request of the call has a
  cached prefix (fresh prefills), its rows and keys start together and the primitive's own causal flag replaces
  the mask (on the CPU the kernel then skips the blocks above the diagonal: about 2x at 2048 rows). On devices
  whose primitive takes per-request lengths (the NPU) no mask is built at all: each request's rows, keys and
  cached prefix go as lengths, and the causal limit as the op's compressed causal mode;
- cross-attention: requests whose visibility is one rectangle or one small staircase (decode, an image, a short
  prompt) go together through one masked call over their encoder slots; a request with a long staircase (a video
  with many text rows, several images) is computed by its block plan (:mod:`mossvl_ascend.attention.blocks`),
  whose cost is arithmetic, not per-call overhead. Requests whose rows see no frame are in no call (their output
  stays zero). With lengths, a group whose requests' rows each see one encoder prefix needs no mask either.

K/V rows are gathered into reused buffers (:class:`GatherWorkspace`), not into a fresh tensor per call.
Padding is bounded: requests are sorted by key length and split into a few buckets so that the padded
``rows x keys`` area of a call stays within ``PADDING_LIMIT`` times the useful area (plus a floor that keeps
small batches in one call), and, on devices listed in ``GATHER_BUDGET_BYTES`` (the CPU), so that a call's
gathered K/V fits that budget; a request whose keys alone outgrow it goes through in key chunks merged by their
log-sum-exp, so the buffers stay within the budget however long a context grows (a cross-attention staircase
gathers its request's whole encoder, which a realtime stream's frame window bounds). Requests without an encoder
and padding contribute nothing (cross-attention rows that see no key are zero).

Opt-in on an NPU (``MOSSVL_NPU_PAGED_ATTENTION=1``, off by default until it has run on an Ascend card):
one-row groups (decode) read K/V in place from the paged pool through a block table and per-request KV
lengths (``torch_npu.npu_fused_infer_attention_score``), no gather; the tables are built once per forward.
Checked on CPU only, against the STAND-IN of that op in ``tests/fake_torch_npu.py``.

Tensors: query/output ``[num_tokens, num_heads, head_dim]`` packed in batch order; ``k_cache``/``v_cache``
``[pool_slots, num_kv_heads, head_dim]``; ``req_to_token`` ``[pool_rows, max_context]`` int.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from dataclasses import dataclass

import torch

from mossvl_ascend.attention.blocks import LEAF_ROWS, frame_causal_cross_attention
from mossvl_ascend.attention.kv_layout import (
    STOCK_ADDRESSING,
    EncoderAddressing,
    slot_major_vision_addresses,
    vision_addresses,
)
from mossvl_ascend.attention.metadata import ForwardAttentionMetadata
from mossvl_ascend.attention.primitives import (
    BatchLengths,
    accumulate_by_lse,
    attention_with_lse,
    npu_paged_attention,
    takes_lengths,
)

# A call's padded rows x keys may exceed its useful rows x keys by this factor before the batch is split.
PADDING_LIMIT = 2.0
# Devices where MOSSVL_NPU_PAGED_ATTENTION=1 switches decode to the gather-free paged call.
PAGED_ATTENTION_DEVICES = ("npu",)

# Padded K+V bytes one call may gather, per device type (absent: unbounded). On a CPU a call whose gathered K/V
# outgrows the caches streams it through DRAM twice (written by the gather, read by the kernel), which costs
# more than a few extra calls: 8 MiB ran batched decode and extend as fast as 32 MiB or faster
# (docs/benchmarks.md, "The CPU gather budget"), and it bounds the reused gather buffers, which a growing context would
# otherwise grow for a session's life. Accelerators gather at HBM speed.
GATHER_BUDGET_BYTES = {"cpu": 8 << 20}

# Calls below this padded area never split: one call is cheaper than saving a little padding.
_PADDING_FLOOR = 1 << 16


class GatherWorkspace:
    """Reused buffers that K/V rows are gathered into, one per role ("k", "v"), grown to the largest gather.

    A fresh tensor per gather costs more than the copy on a CPU: allocations above glibc's mmap threshold
    (32 MiB at most) are page-faulted in on every call; reusing the buffer touches its pages once. The
    gathered rows are dead once the layer's attention call returns, and layers run one after another, so
    one buffer per role serves every call of a process.
    """

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def gather(self, role: str, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``cache[slots]`` (shape ``[*slots.shape, *cache.shape[1:]]``) in the role's buffer."""
        row_shape = cache.shape[1:]
        elements = slots.numel() * math.prod(row_shape)
        buffer = self._buffers.get(role)
        if buffer is None or buffer.dtype != cache.dtype or buffer.device != cache.device or buffer.numel() < elements:
            buffer = self._buffers[role] = torch.empty(elements, dtype=cache.dtype, device=cache.device)
        rows = buffer[:elements].view(slots.numel(), *row_shape)
        torch.index_select(cache, 0, slots.flatten(), out=rows)
        return rows.view(*slots.shape, *row_shape)

    def release(self) -> None:
        """Drop the buffers (the benchmark counts their allocation inside the call it measures)."""
        self._buffers.clear()


GATHER_WORKSPACE = GatherWorkspace()


@dataclass(frozen=True)
class AttentionLayer:
    """The per-layer constants the math needs (read from sglang's RadixAttention by the adapters)."""

    is_cross_attention: bool
    scale: float
    causal: bool
    logit_cap: float = 0.0


@dataclass(frozen=True)
class PaddedGroup:
    """Requests computed in one call, in padded form (padding rows and keys read slot / row 0, then discarded).

    ``slots`` ``[B, max_keys]`` KV-pool slots of each request's keys, which start at ``key_starts`` ``[B]`` in its
    slots (self-attention: behind the encoder) and number ``key_lens`` ``[B]``; ``query_index`` ``[B, max_rows]``
    packed row of each new row. ``visible`` ``[B, 1, rows, keys]`` (True = attend: below the boundary for
    cross-attention, causal with the cached prefix and within the length for self-attention) is None when every
    row sees every key (decode over equal lengths, decided on the host) or when ``causal_from_first_key``: no
    member has a cached prefix, so new row r of every request sees exactly its keys 0..r (padding rows, which see
    padding keys, are discarded). ``output_rows`` / ``padded_rows`` map the real rows between the packed and the
    padded layout. ``lengths`` (host): each request's new rows and the keys it sees (self-attention: its text;
    cross-attention: the prefix all its rows see, else its encoder). ``by_lengths``: the device's primitive takes
    them, so ``visible`` exists only where they cannot say it (cross-attention rows seeing different prefixes).
    """

    requests: tuple[int, ...]
    slots: torch.Tensor
    key_lens: torch.Tensor
    key_starts: torch.Tensor
    query_index: torch.Tensor
    visible: torch.Tensor | None
    output_rows: torch.Tensor
    padded_rows: torch.Tensor
    lengths: BatchLengths
    causal_from_first_key: bool = False
    by_lengths: bool = False


@dataclass(frozen=True)
class PagedTables:
    """One-row group's paged call, built once per forward: ``block_table`` int32 ``[B, blocks]``, ``kv_ends``
    (host ints, where each request's keys end in its slots), ``masked_out`` ``[B, 1, 1, blocks * page_size]`` True
    over the encoder in front of self-attention's text (None when no request has one)."""

    block_table: torch.Tensor
    kv_ends: list[int]
    masked_out: torch.Tensor | None


def attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    metadata: ForwardAttentionMetadata,
    layer: AttentionLayer,
    *,
    full_to_swa_mapping: torch.Tensor | None = None,
    page_size: int = 1,
    addressing: EncoderAddressing = STOCK_ADDRESSING,
) -> torch.Tensor:
    """One layer's attention for every request of the batch; returns ``[num_tokens, num_heads, v_head_dim]``.

    ``page_size`` (the KV pool's) is read only by the opt-in paged decode. ``addressing``: where the pool keeps
    vision tokens (:mod:`mossvl_ascend.attention.kv_layout`); a request's text slots start behind its
    ``addressing.row_len(encoder_len)`` encoder slots, and a cross-attention layer's ``k_cache`` holds every band.
    """
    output = query.new_zeros(query.shape[0], query.shape[1], v_cache.shape[-1])
    paged = _paged_attention_enabled(query.device) and full_to_swa_mapping is None and not layer.logit_cap
    groups = _groups(metadata, req_to_token, req_pool_indices, layer.is_cross_attention, k_cache, v_cache, addressing)
    for group in groups:
        # A slot-major encoder (a realtime session's) has no run of blocks per band, and a frame window's lower
        # bound is no KV length: such groups are gathered.
        gathered = layer.is_cross_attention and any(
            metadata.is_slot_major(i) or metadata.has_lower(i) for i in group.requests
        )
        if paged and group.query_index.shape[1] == 1 and not gathered:
            _paged_group_attention(
                query,
                output,
                k_cache,
                v_cache,
                req_to_token,
                req_pool_indices,
                metadata,
                group,
                layer,
                page_size,
                addressing,
            )
        else:
            _group_attention(query, output, k_cache, v_cache, group, layer, full_to_swa_mapping)
    if layer.is_cross_attention:
        for index in _staircase_requests(metadata):
            _staircase_attention(
                query,
                output,
                k_cache,
                v_cache,
                req_to_token,
                req_pool_indices,
                metadata,
                index,
                layer,
                full_to_swa_mapping,
                addressing,
            )
    return output


def per_request_attention(query, k_cache, v_cache, req_to_token, req_pool_indices, metadata, layer, **kwargs):
    """The same attention one request at a time (the loop the batched form replaces; kept for the benchmark)."""
    output = query.new_zeros(query.shape[0], query.shape[1], v_cache.shape[-1])
    start = 0
    for index in range(metadata.batch_size):
        rows = slice(start, start + metadata.extend_lens[index])
        output[rows] = attention(
            query[rows],
            k_cache,
            v_cache,
            req_to_token,
            req_pool_indices[index : index + 1],
            metadata.request(index),
            layer,
            **kwargs,
        )
        start = rows.stop
    return output


def _staircase_requests(metadata: ForwardAttentionMetadata) -> list[int]:
    """Cross-attention requests computed by their block plan: more than one block and more than a leaf of rows
    (a plan covers encoder prefixes: a request whose rows start past the encoder's start goes in a masked call)."""
    return [
        i
        for i, plan in enumerate(metadata.plans)
        if plan is not None
        and len(plan.blocks) > 1
        and metadata.extend_lens[i] > LEAF_ROWS
        and not metadata.has_lower(i)
    ]


def _groups(
    metadata, req_to_token, req_pool_indices, is_cross: bool, k_cache, v_cache, addressing
) -> list[PaddedGroup]:
    """This forward's padded groups for one attention kind, built on the first layer of that kind and cached
    (every layer of a forward reads the same ``req_to_token`` rows)."""
    by_lengths = takes_lengths(k_cache.device.type)
    build = functools.partial(
        _build_groups,
        metadata,
        req_to_token,
        req_pool_indices,
        is_cross,
        _budget_keys(k_cache, v_cache),
        by_lengths,
        addressing,
    )
    return metadata.cached(("groups", is_cross), build)


def _budget_keys(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int | None:
    """How many keys' K and V rows fit the device's gather budget (None: the device has none)."""
    budget = GATHER_BUDGET_BYTES.get(k_cache.device.type)
    if budget is None:
        return None
    bytes_per_key = k_cache.stride(0) * k_cache.element_size() + v_cache.stride(0) * v_cache.element_size()
    return max(1, budget // bytes_per_key)


def _build_groups(
    metadata,
    req_to_token,
    req_pool_indices,
    is_cross: bool,
    max_keys=None,
    by_lengths=False,
    addressing=STOCK_ADDRESSING,
) -> list[PaddedGroup]:
    if is_cross:
        staircase = set(_staircase_requests(metadata))
        members = [
            i
            for i in range(metadata.batch_size)
            if metadata.encoder_lens[i]
            and metadata.extend_lens[i]
            and i not in staircase
            and metadata.uniform_boundaries[i] != 0
        ]
        key_lens = metadata.encoder_lens
    else:
        members = [i for i in range(metadata.batch_size) if metadata.extend_lens[i]]
        key_lens = metadata.seq_lens
    return [
        _padded_group(metadata, req_to_token, req_pool_indices, bucket, is_cross, addressing, by_lengths)
        for bucket in _length_buckets(members, metadata.extend_lens, key_lens, max_keys)
    ]


def _length_buckets(members: list[int], row_lens: list[int], key_lens: list[int], max_keys=None) -> list[list[int]]:
    """Split requests (sorted by key length) so each call's padded area stays within ``PADDING_LIMIT`` and its
    padded keys within ``max_keys`` (the device's gather budget; None: unbounded). One pass, running totals."""
    buckets: list[list[int]] = []
    current: list[int] = []
    most_rows = most_keys = useful = 0
    for i in sorted(members, key=lambda r: (key_lens[r], row_lens[r])):
        rows, keys = max(most_rows, row_lens[i]), max(most_keys, key_lens[i])
        count, area = len(current) + 1, useful + row_lens[i] * key_lens[i]
        too_many_keys = max_keys is not None and count * keys > max_keys
        if current and (count * rows * keys > max(_PADDING_FLOOR, PADDING_LIMIT * area) or too_many_keys):
            buckets.append(current)
            current, rows, keys, area = [], row_lens[i], key_lens[i], row_lens[i] * key_lens[i]
        current.append(i)
        most_rows, most_keys, useful = rows, keys, area
    if current:
        buckets.append(current)
    return buckets


def _padded_group(
    metadata,
    req_to_token,
    req_pool_indices,
    members: list[int],
    is_cross: bool,
    addressing: EncoderAddressing = STOCK_ADDRESSING,
    by_lengths: bool = False,
) -> PaddedGroup:
    """One call's padded tables, built with a fixed number of ops whatever the group size and with no device
    sync: the per-request integers go to the device in one copy, and everything else is derived there.

    Cross-attention keys are vision tokens: key ``t`` of a request with ``R`` encoder slots is band ``t // R``
    of its slot ``t % R`` (``kv_layout.vision_addresses``; the stock pool has one band, so ``R`` = keys), or, for
    a slot-major request, band ``t % bands`` of slot ``t // bands``."""
    device = req_to_token.device
    query_starts = list(itertools.accumulate(metadata.extend_lens, initial=0))
    row_lens = [metadata.extend_lens[i] for i in members]
    all_rows = metadata.encoder_row_lens(addressing)
    encoder_rows = [all_rows[i] for i in members]
    key_starts = [0] * len(members) if is_cross else encoder_rows
    key_lens = [metadata.encoder_lens[i] if is_cross else metadata.seq_lens[i] for i in members]
    packed_starts = list(itertools.accumulate(row_lens, initial=0))[:-1]  # of each request's rows in this group
    max_rows, max_keys, total_rows = max(row_lens), max(key_lens), sum(row_lens)
    per_request = torch.tensor(
        [
            row_lens,
            key_starts,
            key_lens,
            [query_starts[i] for i in members],
            [metadata.prefix_lens[i] for i in members],
            [j * max_rows - start for j, start in enumerate(packed_starts)],
            [query_starts[i] - start for i, start in zip(members, packed_starts)],
            [max(1, rows) for rows in encoder_rows],
        ],
        device=device,
    )
    row_lens_t, key_starts_t, key_lens_t, query_starts_t, prefix_lens_t, to_padded, to_packed, encoder_rows_t = (
        per_request
    )

    key_offsets = torch.arange(max_keys, device=device)[None, :]
    pool_rows = req_pool_indices[members].to(device).long()
    if is_cross:
        columns = key_offsets % encoder_rows_t[:, None]
        bands = key_offsets // encoder_rows_t[:, None]
        if any(metadata.is_slot_major(i) for i in members):
            slot_major = torch.tensor([metadata.is_slot_major(i) for i in members], device=device)[:, None]
            columns = torch.where(slot_major, key_offsets // addressing.bands, columns)
            bands = torch.where(slot_major, key_offsets % addressing.bands, bands)
        columns = columns.clamp_(max=req_to_token.shape[1] - 1)
        slots = req_to_token[pool_rows[:, None], columns].long() + bands * addressing.band_stride
    else:
        columns = (key_starts_t[:, None] + key_offsets).clamp_(max=req_to_token.shape[1] - 1)
        slots = req_to_token[pool_rows[:, None], columns].long()
    slots = slots.masked_fill_(key_offsets >= key_lens_t[:, None], 0)

    row_offsets = torch.arange(max_rows, device=device)[None, :]
    query_index = (query_starts_t[:, None] + row_offsets).masked_fill_(row_offsets >= row_lens_t[:, None], 0)
    # Real row r of the group (packed order): padded position and packed batch row, without a boolean gather.
    real_rows = torch.arange(total_rows, device=device)
    padded_rows = torch.repeat_interleave(to_padded, row_lens_t, output_size=total_rows) + real_rows
    output_rows = torch.repeat_interleave(to_packed, row_lens_t, output_size=total_rows) + real_rows

    # One row per request after its whole cached text (decode): the causal limit is the key length itself.
    sees_all_keys = max_rows == 1 and len(set(key_lens)) == 1
    windowed = is_cross and any(metadata.has_lower(i) for i in members)
    if is_cross:
        sees_all_keys = sees_all_keys and all(metadata.cross_boundaries[i] is None for i in members) and not windowed
    causal_from_first_key = not is_cross and not any(metadata.prefix_lens[i] for i in members)
    uniform = [metadata.uniform_boundaries[i] for i in members] if is_cross else []
    seen_keys = [keys if bound is None else bound for bound, keys in zip(uniform, key_lens)] or key_lens
    needs_mask = (
        (is_cross and (None in uniform or windowed)) if by_lengths else not (sees_all_keys or causal_from_first_key)
    )
    visible = None
    if needs_mask:
        keys = key_offsets[:, None, :]  # [1, 1, max_keys]
        if is_cross:
            visible = keys < _padded_boundaries(metadata, members, key_lens_t, max_rows, device)[:, :, None]
            if windowed:
                visible &= keys >= _padded_lower_bounds(metadata, members, max_rows, device)[:, :, None]
        else:
            causal_limit = prefix_lens_t[:, None, None] + row_offsets[:, :, None]
            visible = (keys < key_lens_t[:, None, None]) & (keys <= causal_limit)
        visible = visible[:, None]
    return PaddedGroup(
        tuple(members),
        slots,
        key_lens_t,
        key_starts_t,
        query_index,
        visible,
        output_rows,
        padded_rows,
        BatchLengths(tuple(row_lens), tuple(seen_keys)),
        causal_from_first_key,
        by_lengths,
    )


def _padded_boundaries(metadata, members: list[int], encoder_lens: torch.Tensor, max_rows: int, device):
    """``[B, max_rows]`` encoder boundary of each new row; rows past a request's length are padding (discarded),
    so they may take any value. Requests whose rows see every frame need no per-row data."""
    bounds = [metadata.cross_boundaries[i] for i in members]
    if all(b is None for b in bounds):
        return encoder_lens[:, None].expand(-1, max_rows)
    rows = [
        torch.full((metadata.extend_lens[i],), metadata.encoder_lens[i], device=device)
        if b is None
        else b.to(device, torch.int64)
        for i, b in zip(members, bounds)
    ]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def _padded_lower_bounds(metadata, members: list[int], max_rows: int, device):
    """``[B, max_rows]`` first key each new row sees (0 for a request without a frame window; padding rows any)."""
    rows = [
        torch.zeros(max_rows, dtype=torch.int64, device=device)
        if not metadata.has_lower(i)
        else metadata.cross_lower[i].to(device, torch.int64)
        for i in members
    ]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)[:, :max_rows]


def _group_attention(query, output, k_cache, v_cache, group: PaddedGroup, layer: AttentionLayer, slot_map) -> None:
    """The primitive's call(s) for every request of the group; writes their rows of ``output``.

    One call, unless the group's keys outgrow the device's gather budget (a request whose context alone is
    larger: buckets split requests, not keys): then its keys go through in chunks that each fit the budget, and
    the chunks' results are merged by their log-sum-exp, so the gathered K/V never exceeds the budget however
    long the context grows."""
    batch, max_rows = group.query_index.shape
    slots = group.slots if slot_map is None else slot_map[group.slots]
    q = query[group.query_index].permute(0, 2, 1, 3)  # [B, Hq, rows, D]
    lengths = group.lengths if group.by_lengths else None
    budget_keys = _budget_keys(k_cache, v_cache)
    chunk_keys = None if budget_keys is None or lengths is not None else max(1, budget_keys // batch)
    if chunk_keys is None or slots.shape[1] <= chunk_keys:
        k = GATHER_WORKSPACE.gather("k", k_cache, slots).to(query.dtype).permute(0, 2, 1, 3)  # [B, Hk, keys, D]
        v = GATHER_WORKSPACE.gather("v", v_cache, slots).to(query.dtype).permute(0, 2, 1, 3)
        self_causal = layer.causal and not layer.is_cross_attention
        out, _ = attention_with_lse(
            q,
            k,
            v,
            layer.scale,
            visible=_visible_keys(group, layer, 0, slots.shape[1], lengths),
            lengths=lengths,
            logit_cap=layer.logit_cap,
            every_row_sees_a_key=self_causal,
            causal=self_causal and (group.causal_from_first_key or lengths is not None),
        )
    else:
        out = _key_chunked_attention(q, k_cache, v_cache, slots, group, layer, chunk_keys)
    out = out.permute(0, 2, 1, 3).reshape(batch * max_rows, out.shape[1], -1)
    output[group.output_rows] = out[group.padded_rows]


def _visible_keys(group: PaddedGroup, layer: AttentionLayer, start: int, stop: int, lengths) -> torch.Tensor | None:
    """The group's ``visible`` over its keys ``start..stop``, as the single call takes it: None where every row
    sees every key or the primitive's causal flag says it (a whole-key-range call), the key-length cut for
    encoder-only self-attention (which has no mask of its own)."""
    if not (layer.is_cross_attention or layer.causal or lengths):
        return (torch.arange(start, stop, device=group.key_lens.device) < group.key_lens[:, None])[:, None, None]
    return None if group.visible is None else group.visible[..., start:stop]


def _key_chunked_attention(q, k_cache, v_cache, slots, group: PaddedGroup, layer: AttentionLayer, chunk_keys: int):
    """Attention of ``q`` over the group's keys in chunks of ``chunk_keys``, merged in fp32 by log-sum-exp.

    A chunk's rows may see none of its keys (a cross-attention row before its frame, a causal row before the
    chunk): such rows get lse -inf from that chunk and keep what earlier chunks gave. A fresh prefill's causal
    limit (which the single call leaves to the primitive's flag) becomes an explicit mask per chunk, and rows
    before the chunk's first key are not computed at all."""
    batch, num_heads, max_rows, _ = q.shape
    acc = q.new_zeros(batch, num_heads, max_rows, v_cache.shape[-1], dtype=torch.float32)
    acc_lse = torch.full((batch, num_heads, max_rows), float("-inf"), device=q.device)
    causal_limit = layer.causal and not layer.is_cross_attention and group.causal_from_first_key
    row_offsets = torch.arange(max_rows, device=q.device)[:, None]
    for start in range(0, slots.shape[1], chunk_keys):
        stop = min(start + chunk_keys, slots.shape[1])
        first_row = min(start, max_rows) if causal_limit else 0
        if first_row == max_rows:
            break
        chunk = slots[:, start:stop]
        k = GATHER_WORKSPACE.gather("k", k_cache, chunk).to(q.dtype).permute(0, 2, 1, 3)
        v = GATHER_WORKSPACE.gather("v", v_cache, chunk).to(q.dtype).permute(0, 2, 1, 3)
        if causal_limit:  # key start + j is seen by row r >= start + j
            visible = (torch.arange(start, stop, device=q.device) <= row_offsets[first_row:])[None, None]
        else:  # every row is computed (first_row 0)
            visible = _visible_keys(group, layer, start, stop, None)
        out, lse = attention_with_lse(
            q[:, :, first_row:], k, v, layer.scale, visible=visible, logit_cap=layer.logit_cap
        )
        accumulate_by_lse(acc[:, :, first_row:], acc_lse[:, :, first_row:], out, lse)
    return acc.to(q.dtype)


def _staircase_attention(
    query, output, k_cache, v_cache, req_to_token, req_pool_indices, metadata, index, layer, slot_map, addressing
):
    """One request's cross-attention by its block plan (long staircases: videos, several images)."""
    start = sum(metadata.extend_lens[:index])
    rows = slice(start, start + metadata.extend_lens[index])
    slots = metadata.cached(
        ("staircase slots", index),
        lambda: _encoder_slots(req_to_token, req_pool_indices, metadata, index, addressing),
    )
    if slot_map is not None:
        slots = slot_map[slots]
    key = GATHER_WORKSPACE.gather("k", k_cache, slots).to(query.dtype).movedim(0, 1)
    value = GATHER_WORKSPACE.gather("v", v_cache, slots).to(query.dtype).movedim(0, 1)
    out = frame_causal_cross_attention(
        query[rows].movedim(0, 1),
        key,
        value,
        metadata.cross_boundaries[index],
        layer.scale,
        logit_cap=layer.logit_cap,
        plan=metadata.plans[index],
    )
    output[rows] = out.movedim(0, 1)


def _encoder_slots(req_to_token, req_pool_indices, metadata, index: int, addressing) -> torch.Tensor:
    """Where request ``index``'s vision tokens are in a cross-attention layer's K/V, read once per forward (a
    1-element slice keeps the pool row on the device: indexing with a 0-d tensor would read it on the host)."""
    encoder_len = metadata.encoder_lens[index]
    row = req_to_token[req_pool_indices[index : index + 1], : metadata.encoder_row_lens(addressing)[index]][0]
    if metadata.is_slot_major(index):
        return slot_major_vision_addresses(row, encoder_len, addressing.bands, addressing.band_stride)
    return vision_addresses(row, encoder_len, addressing.band_stride)


def _paged_attention_enabled(device: torch.device) -> bool:
    return device.type in PAGED_ATTENTION_DEVICES and os.environ.get("MOSSVL_NPU_PAGED_ATTENTION") == "1"


def _paged_group_attention(
    query, output, k_cache, v_cache, req_to_token, req_pool_indices, metadata, group, layer, page_size, addressing
):
    """One-row group straight from the paged pool: block table over each request's slots up to the end of its
    keys, the encoder in front of self-attention's text masked out, no K/V gather."""
    is_cross = layer.is_cross_attention
    build = functools.partial(
        _paged_tables, metadata, group, req_to_token, req_pool_indices, is_cross, page_size, addressing
    )
    tables = metadata.cached(("paged", is_cross, group.requests, page_size), build)
    q = query[group.query_index].permute(0, 2, 1, 3)
    out = npu_paged_attention(
        q,
        k_cache.view(-1, page_size, k_cache.shape[1] * k_cache.shape[2]),
        v_cache.view(-1, page_size, v_cache.shape[1] * v_cache.shape[2]),
        layer.scale,
        block_table=tables.block_table,
        block_size=page_size,
        kv_ends=tables.kv_ends,
        masked_out=tables.masked_out,
    )
    output[group.query_index[:, 0]] = out[:, :, 0]


def _paged_tables(
    metadata, group, req_to_token, req_pool_indices, is_cross: bool, page_size: int, addressing
) -> PagedTables:
    """The block table (the page of every ``page_size``-th slot of each request's row), the KV ends from host
    metadata (self-attention: encoder + text; cross-attention: the prefix its row sees, never 0: such requests are
    in no group, so no table is empty) and the encoder mask of self-attention."""
    device = req_to_token.device
    pool_rows = req_pool_indices[list(group.requests)].to(device).long()
    if is_cross and addressing.bands > 1:
        return _banded_vision_tables(metadata, group, req_to_token, pool_rows, page_size, addressing)
    encoder_rows = metadata.encoder_row_lens(addressing)
    starts = [0 if is_cross else encoder_rows[i] for i in group.requests]
    ends = [start + keys for start, keys in zip(starts, group.lengths.keys)]
    blocks = -(-max(ends) // page_size)
    columns = (torch.arange(blocks, device=device) * page_size).clamp_(max=req_to_token.shape[1] - 1)
    block_table = (req_to_token[pool_rows[:, None], columns] // page_size).to(torch.int32)
    masked_out = None
    if any(starts):
        positions = torch.arange(blocks * page_size, device=device)
        masked_out = (positions[None, :] < group.key_starts[:, None]).view(len(ends), 1, 1, -1)
    return PagedTables(block_table, ends, masked_out)


def _banded_vision_tables(metadata, group, req_to_token, pool_rows, page_size: int, addressing) -> PagedTables:
    """Cross-attention block tables when an encoder slot holds several vision tokens: band ``b`` of a request's
    encoder pages is a run of blocks of its own (the same pages, ``band_stride`` slots further into the
    storage), bands one after another; the mask hides what is not one of the vision tokens its row sees
    (the band's tail past the encoder row, text sharing the last encoder page, the last band's unused part)."""
    device = req_to_token.device
    bands = addressing.bands
    encoder_rows = metadata.encoder_row_lens(addressing)
    rows = [encoder_rows[i] for i in group.requests]
    per_band = -(-max(rows) // page_size)
    columns = (torch.arange(per_band, device=device) * page_size).clamp_(max=req_to_token.shape[1] - 1)
    pages = req_to_token[pool_rows[:, None], columns] // page_size
    band_offsets = torch.arange(bands, device=device)[None, :, None] * (addressing.band_stride // page_size)
    block_table = (pages[:, None, :] + band_offsets).flatten(1).to(torch.int32)
    band_keys = per_band * page_size
    positions = torch.arange(bands * band_keys, device=device)
    band, entry = positions // band_keys, positions % band_keys
    rows_t, keys_t = torch.tensor([rows, list(group.lengths.keys)], device=device)
    visible = (entry[None, :] < rows_t[:, None]) & (band[None, :] * rows_t[:, None] + entry[None, :] < keys_t[:, None])
    ends = [bands * band_keys] * len(rows)
    return PagedTables(block_table, ends, (~visible).view(len(rows), 1, 1, -1))
