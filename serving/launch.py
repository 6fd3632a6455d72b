"""Start stock ``python -m sglang.launch_server`` for MOSS-VL, wait until it is healthy, stop it by PID.

Used by ``make demo``, the serving tests and the serving benchmark, so every one of them launches the server
the same way a user does. On ``--device cpu`` the CPU engine environment is added (the import-only
``sgl_kernel`` stand-in on ``PYTHONPATH`` and ``SGLANG_USE_CPU_ENGINE=1``); on NPU/CUDA nothing is added.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
CPU_SHIM = REPO_ROOT / "cpu_shim"
PLUGIN_SRC = REPO_ROOT / "sglang"
LOG_DIR = REPO_ROOT / "build" / "logs"
DEFAULT_MAX_TOTAL_TOKENS = 16384


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_env(device: str) -> dict[str, str]:
    """The process environment for a server on ``device``; CPU gets the CPU-engine settings."""
    env = dict(os.environ)
    # This tree's plugin ahead of the editable install, so a git worktree serves its own code.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGIN_SRC), env.get("PYTHONPATH", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SHIM), env.get("PYTHONPATH", "")) if p)
    return env


def server_command(model_path: str | Path, port: int, device: str = "cpu", extra_args: list[str] | None = None) -> list[str]:
    args = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        "--device", device,
        "--host", "127.0.0.1", "--port", str(port),
        "--trust-remote-code", "--enable-multimodal",
    ]
    extra_args = list(extra_args or [])
    if "--max-total-tokens" not in extra_args:
        args += ["--max-total-tokens", str(DEFAULT_MAX_TOTAL_TOKENS)]
    return args + extra_args


class SglangServer:
    """A server process on 127.0.0.1 that is stopped by its PID, whatever happens (use as a context manager)."""

    def __init__(self, model_path, device: str = "cpu", extra_args=None, port: int | None = None,
                 ready_timeout_s: float = 240.0, name: str = "server"):
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = server_command(model_path, self.port, device, extra_args)
        self.env = engine_env(device)
        self.ready_timeout_s = ready_timeout_s
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{name}-{self.port}.log"
        self.process: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    def __enter__(self) -> "SglangServer":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        logger.info("starting: %s (log: %s)", " ".join(self.command), self.log_path)
        started = time.monotonic()
        with open(self.log_path, "w") as log:
            # Own session: the launcher's scheduler/detokenizer children can be reaped by group if it dies.
            self.process = subprocess.Popen(
                self.command, env=self.env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        logger.info("server healthy on %s after %.1f s", self.base_url, self.startup_seconds)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with code {self.process.returncode}; log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {self.ready_timeout_s:.0f} s; log tail:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        pid = self.process.pid
        self.process.send_signal(signal.SIGTERM)  # the launcher tears down its scheduler and detokenizer
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            logger.warning("server pid %d ignored SIGTERM for 30 s; killing its process group", pid)
        try:
            os.killpg(pid, signal.SIGKILL)  # children left behind by a crashed launcher share its group id
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no log)"
