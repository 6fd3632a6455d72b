"""Imported at start-up by the processes of a test that puts this folder first on ``PYTHONPATH`` (before
``served_guard_site``, whose ``sitecustomize`` it then runs): with ``MOSSVL_TEST_TRANSFER_LOG`` naming a folder, every
call sglang makes into Mooncake's transfer engine to register memory or to write is appended to
``<folder>/<pid>.jsonl`` after the engine returns, its arguments and return code unchanged.

Mooncake's Python ``TransferEngine`` (0.3.13) exposes no byte counters, so the bytes are counted where sglang hands
them over: ``batch_register_memory(ptrs, lengths)`` and ``batch_transfer_sync_write(session, src, dst, lengths)``
(``distributed/device_communicators/mooncake_transfer_engine.py``, the calls behind every KV and aux transfer).
"""

import json
import os
from pathlib import Path

LOG_ENV = "MOSSVL_TEST_TRANSFER_LOG"


def _record(entry: dict) -> None:
    with open(Path(os.environ[LOG_ENV]) / f"{os.getpid()}.jsonl", "a") as log:
        log.write(json.dumps(entry) + "\n")


def _count_engine_calls() -> None:
    from mooncake.engine import TransferEngine

    register, write = TransferEngine.batch_register_memory, TransferEngine.batch_transfer_sync_write

    def batch_register_memory(self, ptrs, lengths):
        rc = register(self, ptrs, lengths)
        _record({"register": [list(ptrs), list(lengths)], "rc": rc})
        return rc

    def batch_transfer_sync_write(self, session_id, buffers, peer_buffer_addresses, lengths):
        rc = write(self, session_id, buffers, peer_buffer_addresses, lengths)
        _record({"write": [list(buffers), list(lengths)], "rc": rc})
        return rc

    TransferEngine.batch_register_memory = batch_register_memory
    TransferEngine.batch_transfer_sync_write = batch_transfer_sync_write


if os.environ.get(LOG_ENV):
    _count_engine_calls()

_next_site = Path(__file__).resolve().parents[1] / "served_guard_site" / "sitecustomize.py"
exec(compile(_next_site.read_text(), str(_next_site), "exec"))
