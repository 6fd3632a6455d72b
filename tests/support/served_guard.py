"""The check behind the ``served`` marker: a test without it that starts a server fails, naming itself.

``tests/conftest.py`` puts the running test's id in ``UNMARKED_TEST_ENV`` while a test without the marker runs, and
puts ``served_guard_site/`` (a ``sitecustomize``) on the ``PYTHONPATH`` every process it starts inherits. There, and
in the test process itself, a server start is refused while that variable is set:
- a process started as ``python -m sglang.launch_server`` (``serving.launch``, a benchmark script's server) or with
  ``--serve`` (the transformers runners' service) exits with ``REFUSED_EXIT_CODE`` before it loads anything;
- a process whose target is an sglang function (the scheduler and detokenizer of an in-process ``sglang.Engine``)
  is refused at ``start()``.
"""

from __future__ import annotations

import multiprocessing.process
import os
import sys

UNMARKED_TEST_ENV = "MOSSVL_TEST_WITHOUT_SERVED_MARKER"
REFUSED_EXIT_CODE = 3


class ServerWithoutServedMarker(RuntimeError):
    pass


def server_in_command(argv: list[str]) -> str | None:
    """What in ``argv`` starts a server, or None."""
    for flag, following in zip(argv, argv[1:] + [""]):
        if flag == "-m" and following == "sglang.launch_server":
            return "python -m sglang.launch_server"
        if flag == "--serve":
            return "--serve"
    return None


def refusal(what: str) -> str:
    return (
        f"{os.environ.get(UNMARKED_TEST_ENV)} starts a server ({what}) without the `served` marker: add it in "
        "tests/conftest.py (a fixture from tests/support/server_pool.py marks the tests that use it)"
    )


def refuse_a_server_process() -> None:
    """In a process a test without the marker started: exit at once if it is a server."""
    what = server_in_command(list(getattr(sys, "orig_argv", sys.argv)))
    if what is not None:
        sys.stderr.write(refusal(what) + "\n")
        sys.stderr.flush()
        os._exit(REFUSED_EXIT_CODE)


def refuse_sglang_child_processes() -> None:
    """Wrap ``multiprocessing``'s ``Process.start``: a process running an sglang function is an engine's."""
    original = multiprocessing.process.BaseProcess.start
    if getattr(original, "served_guard", False):
        return

    def start(self):
        target = getattr(self, "_target", None)
        module = getattr(target, "__module__", "") or ""
        if os.environ.get(UNMARKED_TEST_ENV) and module.split(".")[0] == "sglang":
            raise ServerWithoutServedMarker(refusal(f"an sglang engine process, {module}.{target.__name__}"))
        return original(self)

    start.served_guard = True
    multiprocessing.process.BaseProcess.start = start
