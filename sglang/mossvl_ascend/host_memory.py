"""glibc's malloc thresholds in the server's processes on NPU and CPU hosts: pinned, so freed buffers go back to the
system instead of staying resident.

glibc serves an allocation above its mmap threshold from a mapping of its own, returned at ``free``. The threshold
is dynamic: freeing such a block raises it to that block's size (up to 32 MiB), so from then on buffers up to that
size come from the heap, where freed memory below the heap's top stays resident. A realtime session's per-step
buffers (its attention's keys and scores, its positions) grow with its context, so with the dynamic threshold the
server's RSS ratchets up with them through a long stream: ``benchmarks/soak_realtime.py`` measured 3.0-3.8 MiB/min
for 4 sessions, 1.5-1.6 with the thresholds pinned at 128 KiB (glibc's starting value, fixed). Setting either
threshold also stops glibc from moving them (mallopt(3)).

A threshold the user set through glibc's environment (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``) is
left as set. On a C library without ``mallopt`` (not glibc) nothing changes. CUDA hosts never call this: stock
sglang runs there as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
PINNED_THRESHOLD_BYTES = 128 << 10
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def pin_malloc_thresholds() -> bool:
    """Pin the mmap and trim thresholds at :data:`PINNED_THRESHOLD_BYTES`; -> whether they are pinned now."""
    chosen = [name for name in USER_SETTINGS if os.environ.get(name)]
    if chosen:
        logger.info("malloc thresholds left as set in the environment (%s)", ", ".join(chosen))
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        logger.info("malloc thresholds left alone: this C library has no mallopt")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    pinned = bool(mallopt(M_MMAP_THRESHOLD, PINNED_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, PINNED_THRESHOLD_BYTES)
    )
    logger.info(
        "malloc mmap and trim thresholds %s at %d KiB (freed buffers are returned, not kept resident)",
        "pinned" if pinned else "could not be pinned",
        PINNED_THRESHOLD_BYTES >> 10,
    )
    return pinned
