"""A MOSS-VL decode step whose per-request inputs live in static buffers: what a captured decode reads (batch layer).

A captured decode step (stock's CPU graph runner compiles it with ``torch.compile``; the NPU records it as a
graph) freezes every Python value it sees while it is captured. So a decode row's inputs beyond stock's own
static ones (``req_pool_indices``, ``seq_lens``) are one column of :class:`DecodeBuffers`, allocated once per
graph state and filled **outside** the captured region with one host-to-device copy per step:

- ``vision``: E, the vision tokens the row attends (0: a text-only request or a padding row of the bucket);
- ``encoder_rows``: R, the encoder slots in front of its text (``addressing.row_len(E)``, or a realtime
  session's whole pages);
- ``lower``: the first vision token it sees (the start of a realtime frame window; 0 otherwise);
- ``slot_major``: 1 for a realtime session's encoder (vision token ``t`` is band ``t % bands`` of slot
  ``t // bands``);
- ``gate``: 1 when the row keeps its cross-attention residual (it sees at least one frame).

Inside the captured region these are read only as tensors (:class:`DecodeView`). On the CPU the attention of a
layer is one registered op, :func:`decode_attention`, opaque to ``torch.compile`` as stock's CPU decode kernel is:
it reads the lengths at run time, inside the op, like a kernel reads its length tensors, so the compiled graph
never freezes them and never recompiles when they change. A decode row sees every cached frame of its request
(the last prompt row comes after all of them), cut below by ``lower``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mossvl_ascend.attention.core import AttentionLayer, attention
from mossvl_ascend.attention.kv_layout import EncoderAddressing
from mossvl_ascend.attention.metadata import ForwardAttentionMetadata, decode_metadata, decode_row_gate

# The columns of one decode row in :class:`DecodeBuffers`, in storage order.
FIELDS = ("vision", "encoder_rows", "lower", "slot_major", "gate")


@dataclass(frozen=True)
class DecodeRows:
    """One decode step's per-request inputs on the host, in batch order (one list per field of ``FIELDS``)."""

    vision: list[int]
    encoder_rows: list[int]
    lower: list[int]
    slot_major: list[int]
    gate: list[int]

    @property
    def batch_size(self) -> int:
        return len(self.vision)

    @classmethod
    def of_forward_batch(cls, forward_batch, addressing: EncoderAddressing) -> "DecodeRows":
        """The rows of a decode forward (read on the host, before the captured step runs)."""
        return cls.of_metadata(decode_metadata(forward_batch), addressing, decode_row_gate(forward_batch))

    @classmethod
    def of_metadata(cls, metadata: ForwardAttentionMetadata, addressing: EncoderAddressing, gate: list[bool]):
        """The rows a decode forward's eager metadata describes (its frame window's lower bound is one int per row)."""
        lower = [int(metadata.cross_lower[i][0]) if metadata.has_lower(i) else 0 for i in range(metadata.batch_size)]
        return cls(
            vision=list(metadata.encoder_lens),
            encoder_rows=metadata.encoder_row_lens(addressing),
            lower=lower,
            slot_major=[int(metadata.is_slot_major(i)) for i in range(metadata.batch_size)],
            gate=[int(g) for g in gate],
        )


@dataclass(frozen=True)
class DecodeView:
    """The first ``bs`` columns of the static buffers (int32 ``[bs]`` each): what a captured step reads."""

    vision: torch.Tensor
    encoder_rows: torch.Tensor
    lower: torch.Tensor
    slot_major: torch.Tensor
    gate: torch.Tensor
    table: torch.Tensor  # int32 [len(FIELDS), bs]: the same columns as one tensor (the CPU op's argument)
    step: torch.Tensor  # int64 [1]: which fill this is (the CPU op builds a step's metadata once, not per layer)

    @property
    def row_gate(self) -> torch.Tensor:
        """Bool ``[bs, 1]``: True where a row keeps its cross-attention residual."""
        return (self.gate != 0)[:, None]


class DecodeBuffers:
    """Static int32 ``[len(FIELDS), max_bs]`` buffers of a graph state; a padding row is all zeros (no vision
    token, no encoder slot, gate off), whatever a previous step left there."""

    def __init__(self, max_bs: int, device):
        self.max_bs = max_bs
        self.table = torch.zeros(len(FIELDS), max_bs, dtype=torch.int32, device=device)
        self._staging = torch.zeros(len(FIELDS), max_bs, dtype=torch.int32)
        self.step = torch.zeros(1, dtype=torch.int64, device=device)
        self._fills = 0

    def fill(self, rows: DecodeRows, bs: int) -> DecodeView:
        """Write ``rows`` (then zeros up to the bucket size ``bs``) with one host-to-device copy; returns the view."""
        if not rows.batch_size <= bs <= self.max_bs:
            raise ValueError(f"{rows.batch_size} decode rows do not fit a bucket of {bs} (largest {self.max_bs})")
        self._staging[:, :bs].zero_()
        self._staging[:, : rows.batch_size] = torch.tensor([getattr(rows, name) for name in FIELDS])
        # Synchronous: the staging buffer is pageable and reused every step, and a non-blocking copy from it may
        # still be unread on the device when the next fill overwrites it. Pinning alone would not make reuse safe
        # (that needs an event per fill); the copy is a few hundred bytes, and stock's NPU replay already waits
        # for the previous replay before its update (``NPUCudaGraphBackend.replay_with_input_update``).
        self.table[:, :bs].copy_(self._staging[:, :bs])
        self._fills += 1
        self.step.fill_(self._fills)
        return self.view(bs)

    def view(self, bs: int) -> DecodeView:
        table = self.table[:, :bs]
        return DecodeView(*table, table=table, step=self.step)


# The metadata of the step :func:`decode_attention` last ran, keyed by (the table's storage, the step's fill):
# every layer of a step reads the same metadata and its cached gather tables, as an eager forward's layers do.
_STEP_METADATA: dict[tuple[int, int], ForwardAttentionMetadata] = {}


def metadata_of_step(seq_lens: torch.Tensor, table: torch.Tensor, step: torch.Tensor) -> ForwardAttentionMetadata:
    """:func:`metadata_of_decode_table`, built on a step's first layer and reused by its later layers."""
    key = (table.data_ptr(), int(step))
    if key not in _STEP_METADATA:
        _STEP_METADATA.clear()
        _STEP_METADATA[key] = metadata_of_decode_table(seq_lens, table)
    return _STEP_METADATA[key]


def metadata_of_decode_table(seq_lens: torch.Tensor, table: torch.Tensor) -> ForwardAttentionMetadata:
    """The core's metadata for one decode step, read from its static inputs (at run time, inside the op)."""
    columns = dict(zip(FIELDS, table.tolist()))
    metadata = ForwardAttentionMetadata.for_decode(seq_lens.tolist(), columns["vision"], seq_lens.device)
    metadata.with_encoder_rows(columns["encoder_rows"], [bool(s) for s in columns["slot_major"]])
    lowers = [torch.tensor([lower], dtype=torch.int32) if lower else None for lower in columns["lower"]]
    return metadata.with_lower_bounds(lowers)


@torch.library.custom_op("mossvl::store_decode_rows", mutates_args=("cache",))
def store_decode_rows(cache: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> None:
    """Write a decode step's new text K (or V) into rows ``loc`` of a layer's cache, in place.

    The same rows stock's pool writes (its CPU path without AMX: ``cache[loc] = k`` in the pool's dtype), as an op
    that declares the mutation: a layer's cache is a view into a storage tensor shared with other layers and
    bands, and ``torch.compile`` turns a traced index write into such a view into a copy of the whole view every
    layer and step (a micro-check: 100 ms against 0.5 ms at 65536 rows); a declared in-place op is written in
    place. One cache per op: of an op mutating K and V both, inductor wrote the second through a clone of its whole
    storage and copied the clone back at the end of the graph (issue 51), which costs a cache copy per layer and
    step and reverts whatever another thread wrote meanwhile (a PD decode server's incoming KV)."""
    cache[loc] = rows.to(cache.dtype)


def store_decode_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """A decode step's new text K and V into rows ``loc`` of a layer's caches (:func:`store_decode_rows` each)."""
    store_decode_rows(k_cache, loc, k)
    store_decode_rows(v_cache, loc, v)


@torch.library.custom_op("mossvl::decode_attention", mutates_args=())
def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    table: torch.Tensor,
    step: torch.Tensor,
    is_cross_attention: bool,
    scale: float,
    logit_cap: float,
    bands: int,
    band_stride: int,
) -> torch.Tensor:
    """One layer's decode attention for the batch: query ``[bs, heads, dim]``, the static ``table`` of
    :class:`DecodeBuffers` and its fill ``step``; returns ``[bs, heads, v_dim]`` (a cross-attention row that sees
    no vision token is 0)."""
    layer = AttentionLayer(
        is_cross_attention=is_cross_attention, scale=scale, causal=not is_cross_attention, logit_cap=logit_cap
    )
    return attention(
        query,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        metadata_of_step(seq_lens, table, step),
        layer,
        addressing=EncoderAddressing(bands, band_stride),
    )


@decode_attention.register_fake
def _(query, k_cache, v_cache, *args, **kwargs):
    return query.new_empty(query.shape[0], query.shape[1], v_cache.shape[-1])
