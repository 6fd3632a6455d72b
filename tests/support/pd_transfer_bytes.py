"""KV bytes a PD prefill worker hands Mooncake's transfer engine, counted in the servers a test or a benchmark starts.

Mooncake's Python ``TransferEngine`` (0.3.13) exposes no byte counters, so ``transfer_counting_site/`` (a
``sitecustomize`` put first on the workers' ``PYTHONPATH``) records, per process, every ``batch_register_memory`` and
``batch_transfer_sync_write`` call sglang makes (``distributed/device_communicators/mooncake_transfer_engine.py``).
A request's KV bytes are the written blocks whose source lies in the prefill's KV buffers: the first ``kv_buffers``
regions of its first registration (sglang's ``_registerable_regions`` lists the KV buffers first, then aux).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SHIM = Path(__file__).resolve().parent / "transfer_counting_site"
LOG_ENV = "MOSSVL_TEST_TRANSFER_LOG"


def counting_env(folder: Path) -> dict[str, str]:
    """The environment that makes every Python process started in it record its engine calls under ``folder``."""
    return {"PYTHONPATH": os.pathsep.join([str(SHIM), os.environ.get("PYTHONPATH", "")]), LOG_ENV: str(folder)}


def engine_calls(path: Path) -> list[dict]:
    """One process's calls into the engine, in order."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def kv_regions(calls: list[dict], kv_buffers: int) -> list[tuple[int, int]]:
    """A worker's KV buffers ``(ptr, bytes)``: the first ``kv_buffers`` regions of its first registration."""
    ptrs, lengths = next(call["register"] for call in calls if "register" in call)
    return list(zip(ptrs, lengths))[:kv_buffers]


class KvBytes:
    """KV bytes written by the one process under ``folder`` that writes, since the last :meth:`take`."""

    def __init__(self, folder: Path, kv_buffers: int):
        self.folder, self.kv_buffers = folder, kv_buffers
        self.seen: dict[Path, int] = {}

    def registrations(self) -> list[list[tuple[int, int]]]:
        """Every worker process's KV buffers (the prefill's and the decode's)."""
        return [kv_regions(engine_calls(path), self.kv_buffers) for path in sorted(self.folder.glob("*.jsonl"))]

    def take(self) -> int:
        total = 0
        for path in sorted(self.folder.glob("*.jsonl")):
            calls = engine_calls(path)
            new, self.seen[path] = calls[self.seen.get(path, 0) :], len(calls)
            writes = [call for call in new if "write" in call]
            if not writes:
                continue
            regions = kv_regions(calls, self.kv_buffers)
            for call in writes:
                if call["rc"] != 0:
                    raise RuntimeError(f"a transfer returned {call['rc']}")
                for src, length in zip(*call["write"]):
                    total += length if any(start <= src < start + size for start, size in regions) else 0
        return total
