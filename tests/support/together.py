"""Start a module's independent fresh-interpreter checks at once.

A check that imports sglang in a new interpreter spends ~12 s on one core; a 2-core machine runs two at a time in the
wall time of one. Each test then waits for its own result only, so each still passes or fails alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor


@contextlib.contextmanager
def started_together(runs: dict[str, Callable[[], object]]) -> Iterator[dict[str, Future]]:
    """Every call in ``runs`` started in its own thread: name -> its future (``result()`` re-raises its error).
    Leaving the block waits for all of them."""
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        yield {name: pool.submit(run) for name, run in runs.items()}
