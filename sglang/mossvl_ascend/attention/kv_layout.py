"""MOSS-VL's KV layout: a vision token stored for the cross-attention layers only, a text token for the
self-attention layers only, in one pool of slots (pure torch, no sglang).

A vision (encoder) token is read only by the cross-attention layers and a text token only by the self-attention
layers, yet stock sglang gives every slot all layers. Here storage comes in **units** of ``L_cross`` layers (one
K/V row per cross-attention layer): a vision token takes one unit, a text token ``bands = ceil(L_self / L_cross)``
units, the ``k``-th self-attention layer reading unit ``k // L_cross`` of its token at layer ``k % L_cross``
(MOSS-VL-Instruct: 12 cross layers, 36 self layers, so 3 bands of 12).

A **slot** (what the allocator, the radix cache and the scheduler count) holds ``bands`` units: one text token,
or ``bands`` vision tokens. The pool is ``L_cross`` storage layers of ``[bands, slots, heads, dim]``:

- self-attention layer ``k`` (band ``b = k // L_cross``, storage ``j = k % L_cross``) reads storage ``j``'s band
  ``b``, a contiguous ``[slots, heads, dim]`` view indexed by slot like a stock layer buffer;
- cross-attention layer ``j`` reads all of storage ``j`` flat, ``[bands * slots, heads, dim]``: vision token ``t``
  of a request whose encoder row holds ``R`` slots sits at ``(t // R) * slots + row[t % R]`` ("band-major": band 0
  of every encoder slot first, then band 1, ...).

A request's slot row stays stock's ``[encoder slots | text slots]``, with ``R = ceil(E / bands)`` encoder slots
for ``E`` vision tokens (:func:`encoder_row_len`), so every stock count (admission, radix cache, ``/v1/loads``) is
in slots and already right; the forward side maps vision tokens to units (:func:`vision_addresses`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from mossvl_ascend import side_channel

LAYOUT_ENV = "MOSSVL_KV_LAYOUT"
MOSSVL, STOCK = "mossvl", "stock"


def requested_layout() -> str:
    """``mossvl`` (the default off CUDA) or ``stock`` (every slot holds every layer), from ``MOSSVL_KV_LAYOUT``."""
    value = os.environ.get(LAYOUT_ENV, MOSSVL).strip().lower() or MOSSVL
    if value not in (MOSSVL, STOCK):
        raise ValueError(f"{LAYOUT_ENV}={value!r}: expected {MOSSVL!r} (the default) or {STOCK!r}")
    return value


@dataclass(frozen=True)
class LayerBands:
    """Which storage layer and band each decoder layer reads."""

    num_layers: int
    cross_layers: tuple[int, ...]

    @classmethod
    def of_text_config(cls, text_config) -> "LayerBands":
        return cls(int(text_config.num_hidden_layers), tuple(int(i) for i in text_config.cross_attention_layers))

    @property
    def cross_count(self) -> int:
        return len(self.cross_layers)

    @property
    def self_count(self) -> int:
        return self.num_layers - self.cross_count

    @property
    def bands(self) -> int:
        return max(1, math.ceil(self.self_count / self.cross_count))

    @property
    def applies(self) -> bool:
        """The layout needs at least one cross-attention layer (otherwise there are no vision tokens to store)."""
        return 0 < self.cross_count < self.num_layers

    def storage_of(self, layer_id: int) -> tuple[int, int | None]:
        """(storage layer, band) of decoder layer ``layer_id``; band None for a cross-attention layer (all bands)."""
        if layer_id in self.cross_layers:
            return self.cross_layers.index(layer_id), None
        self_index = sum(1 for i in range(layer_id) if i not in self.cross_layers)
        return self_index % self.cross_count, self_index // self.cross_count

    def slots_for_budget(self, stock_tokens: int, page_size: int) -> int:
        """Slots that fit in the bytes of a stock pool of ``stock_tokens`` tokens (``num_layers`` layers each):
        a slot stores ``bands * cross_count`` layers, never more than ``num_layers``; whole pages."""
        slots = stock_tokens * self.num_layers // (self.bands * self.cross_count)
        return slots // page_size * page_size

    def capacity(self, slots: int) -> dict[str, int]:
        """What ``slots`` slots hold: text tokens alone, vision tokens alone."""
        return {"text_tokens": slots, "vision_tokens": slots * self.bands}


def encoder_row_len(vision_tokens: int, bands: int) -> int:
    """Encoder slots of a request with ``vision_tokens`` vision tokens: ``bands`` per slot."""
    return -(-vision_tokens // bands)


def vision_addresses(row_slots: torch.Tensor, vision_tokens: int, band_stride: int) -> torch.Tensor:
    """Unit address (row of a cross-attention layer's flat storage) of each of a request's vision tokens.

    ``row_slots``: its encoder slots (``encoder_row_len`` of them, the start of its slot row); ``band_stride``: the
    slots per band of the storage. Band-major: token ``t`` is band ``t // R`` of slot ``row_slots[t % R]``.
    """
    row_len = row_slots.shape[-1]
    tokens = torch.arange(vision_tokens, device=row_slots.device)
    return (tokens // row_len) * band_stride + row_slots[..., tokens % row_len].long()


def slot_major_vision_addresses(row_slots: torch.Tensor, vision_tokens: int, bands: int, band_stride: int):
    """Unit addresses of a growing encoder (a realtime session's): token ``t`` is band ``t % bands`` of slot
    ``row_slots[t // bands]``, so appending vision tokens moves none already stored (band-major would: its ``R``
    grows with the encoder)."""
    tokens = torch.arange(vision_tokens, device=row_slots.device)
    return (tokens % bands) * band_stride + row_slots[..., tokens // bands].long()


@dataclass(frozen=True)
class EncoderAddressing:
    """How a KV pool addresses vision tokens: ``bands`` per encoder slot, ``band_stride`` slots per band.

    The stock pool is ``bands=1``: vision token ``t`` is the slot ``row[t]`` itself.
    """

    bands: int = 1
    band_stride: int = 0

    def row_len(self, vision_tokens: int) -> int:
        return encoder_row_len(vision_tokens, self.bands)


STOCK_ADDRESSING = EncoderAddressing()


def addressing_of_pool(pool) -> EncoderAddressing:
    """The pool's vision-token addressing: stock (one band) unless the pool was shaped by this layout."""
    return side_channel.ENCODER_ADDRESSING.get(pool, STOCK_ADDRESSING)


def storage_tokens(bands: LayerBands, slots: int, page_size: int) -> int:
    """Rows each storage layer of a shaped pool of ``slots`` slots asks stock's builder for: ``bands`` bands of
    ``slots + page_size`` rows (stock's builder adds one page of padding to what it is asked for)."""
    return bands.bands * (slots + page_size) - page_size


def band_view(storage: torch.Tensor, bands: int, band: int | None) -> torch.Tensor:
    """Band ``band`` of a storage layer (a contiguous ``1 / bands`` of its rows), or all of it for ``None``."""
    if band is None:
        return storage
    per_band = storage.shape[0] // bands
    return storage[band * per_band : (band + 1) * per_band]


def band_buffers(storage: list[torch.Tensor], bands: int) -> list[torch.Tensor]:
    """Every band of every storage layer, storage-major (storage 0's bands, then storage 1's, ...): the contiguous
    buffers the pool really is, none overlapping another, each indexed by slot (or page) like a stock layer buffer.
    A request's slots in all of them are every byte it owns: text K/V in the self-attention bands, vision units
    (band ``t // R`` of encoder slot ``t % R``) in the cross-attention layers' flat view of the same rows."""
    return [band_view(layer, bands, band) for layer in storage for band in range(bands)]


def layout_name(bands: "LayerBands | None") -> str:
    """What a PD peer must share: ``mossvl`` with its bands and cross-attention layers, or ``stock``."""
    if bands is None:
        return STOCK
    return f"{MOSSVL} ({bands.bands} bands x {bands.cross_count} cross-attention layers of {bands.num_layers})"


def encoder_write_addresses(
    row_lens: list[int],
    vision_tokens: list[int],
    cached: list[bool],
    new_slots: torch.Tensor | None,
    band_stride: int,
    step_addresses: dict[int, torch.Tensor],
) -> torch.Tensor:
    """Unit address of every new vision token of a batch, in batch order: request ``i``'s are
    ``step_addresses[i]`` (a realtime step's, slot-major) when given, else band-major over its share of
    ``new_slots`` (the encoder slots stock allocated for the requests whose encoder is not cached, concatenated)."""
    addresses, start = [], 0
    for i, (row_len, tokens, is_cached) in enumerate(zip(row_lens, vision_tokens, cached)):
        if i in step_addresses:
            addresses.append(step_addresses[i])
        elif row_len and not is_cached:
            addresses.append(vision_addresses(new_slots[start : start + row_len], tokens, band_stride))
            start += row_len
    if new_slots is not None and start != new_slots.numel():
        raise RuntimeError(f"{new_slots.numel()} new encoder slots for encoder rows {row_lens} (cached {cached})")
    return torch.cat(addresses).to(new_slots.device if new_slots is not None else addresses[0].device)


class ActiveLayout:
    """The bands of this process's shaped pool, recorded when the pool is built: the scheduler's padding of a
    request's encoder (``pad_input_ids``, which reaches no pool) runs in the same process and must pad for the same
    layout. Nothing recorded: the stock pool."""

    def __init__(self) -> None:
        self._bands: int | None = None

    @property
    def bands(self) -> int | None:
        return self._bands

    def bands_or_one(self) -> int:
        return self._bands or 1

    def record(self, bands: int | None) -> None:
        self._bands = bands


ACTIVE_LAYOUT = ActiveLayout()
