"""Slot rows and layer rows of a KV pool as the layout tests and the PD transfer tests address them."""

from __future__ import annotations

import torch


def rows_of(buffer: torch.Tensor) -> torch.Tensor:
    """A layer buffer as ``[rows, heads, dim]`` (the NPU pool keeps ``[pages, page, heads, dim]``)."""
    return buffer.view(-1, *buffer.shape[-2:])


def allocate_rows(lengths: list[int], slots: int, page: int, seed: int) -> list[list[int]]:
    """Slot rows as sglang's allocators hand them out: page 1, shuffled slots 1..slots; page > 1, shuffled whole
    pages 1..slots/page, each row from the start of its first page (encoder and text share the page between)."""
    gen = torch.Generator().manual_seed(seed)
    if page == 1:
        free = (torch.randperm(slots, generator=gen) + 1).tolist()
        assert sum(lengths) <= len(free)
        rows, start = [], 0
        for n in lengths:
            rows.append(free[start : start + n])
            start += n
        return rows
    free_pages = (torch.randperm(slots // page, generator=gen) + 1).tolist()
    rows = []
    for n in lengths:
        pages = [free_pages.pop() for _ in range(-(-n // page))]
        rows.append([p * page + i for p in pages for i in range(page)][:n])
    return rows
