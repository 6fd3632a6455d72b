"""The foreground demos stop their servers when stopped with SIGTERM (``kill PID``, a supervisor), as with Ctrl-C:
``serving.realtime_web_demo`` (`make demo-realtime-web`) with a stand-in for its server, a process in a session of
its own as a real server is (``serving.launch.SglangServer``), which the demo's ``with`` block must stop. Before
``serving.launch.exit_on_sigterm`` the demo died at once and the server ran on (seen by hand on 2026-12-07: after
``kill -TERM`` of the demo's process group the sglang launcher and its children were still serving).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# The demo, its server replaced by a child in its own session (a stand-in: no sglang here) that the context manager
# stops on exit; the child's pid is printed once the demo waits, as a real server's address would be.
DEMO = r"""
import contextlib, subprocess, sys, types
import serving.realtime_web_demo as demo

@contextlib.contextmanager
def stand_in_server(args, name, port):
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        print(f"CHILD {child.pid}", flush=True)
        yield types.SimpleNamespace(startup_seconds=0.0, log_path="-", port=port, process=child)
    finally:
        child.kill()
        child.wait()
        print("STOPPED", flush=True)

demo.realtime_server = stand_in_server
sys.exit(demo.main(["--port", "1"]))
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_stops_the_web_demos_server():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "sglang")])}
    demo = subprocess.Popen(
        [sys.executable, "-c", DEMO],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    child = None
    try:
        for line in demo.stdout:
            if line.startswith("CHILD "):
                child = int(line.split()[1])
            if line.startswith("Ctrl-C stops the server"):
                break
        assert child is not None and alive(child)
        demo.send_signal(signal.SIGTERM)
        rest = demo.communicate(timeout=30)[0]
        assert "STOPPED" in rest, rest
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(child)
    finally:
        if demo.poll() is None:
            demo.kill()
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)
