"""Start stock ``python -m sglang.launch_server`` for MOSS-VL, wait until it is healthy, stop it by PID.

Used by ``make demo``, the serving tests and the serving benchmark, so every one of them launches the server
the same way a user does. On ``--device cpu`` the CPU engine environment is added (the import-only
``sgl_kernel`` stand-in on ``PYTHONPATH`` and ``SGLANG_USE_CPU_ENGINE=1``); on NPU/CUDA nothing is added.
A CPU server with more than one rank on this node (tp x dp x pp / nnodes, read by sglang's own argument parser, so
``--tp 2`` counts as ``--tp-size 2`` does) also gets a per-rank core split (see :func:`multi_rank_cpu_env`).

    python -m serving.launch --model-path DIR [--device cpu] [--port 30000] [sglang arguments ...]

runs the server in the foreground with that environment (``make serve``).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
CPU_SHIM = REPO_ROOT / "cpu_shim"
PLUGIN_SRC = REPO_ROOT / "sglang"
LOG_DIR = REPO_ROOT / "build" / "logs"
DEFAULT_MAX_TOTAL_TOKENS = 16384
THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


# Where a server's HTTP port is chosen: below the kernel's ephemeral range (``ip_local_port_range``, Linux default
# from 32768) and below where sglang picks each server's NCCL/gloo port (``get_free_port_below_ephemeral``: 22000 to
# 29999). A port the kernel hands out for ``bind(0)`` or an outgoing connection can be taken by another socket between
# the probe and the server's own bind: CI once saw uvicorn fail on such a port (43587) while other sockets were being
# opened (2026-12-02). The retry in ``SglangServer.start`` covers what a choice cannot. (sglang's own
# ``get_free_port_below_ephemeral`` is not used: importing it loads torch, 4 s, into this stdlib-only launcher.)
PORT_RANGE = (10000, 22000)
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# What uvicorn logs when the HTTP port is taken; the server then neither serves nor exits.
PORT_TAKEN_MESSAGE = "error while attempting to bind on address"


class PortTakenError(RuntimeError):
    """The server's HTTP port was taken by another socket before the server bound it."""


def ephemeral_port_floor() -> int:
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(span: int = 1) -> int:
    """A port on 127.0.0.1 that nothing holds now (with the ``span - 1`` ports after it: a multi-node
    ``--dist-init-addr`` port is followed by the ZMQ ports sglang derives from it), from ``PORT_RANGE`` where the
    machine's ephemeral range allows (else one the kernel picks)."""
    low, high = PORT_RANGE[0], min(PORT_RANGE[1], ephemeral_port_floor()) - span
    chooser = random.SystemRandom()
    for _ in range(200 if high - low >= 1000 else 0):
        port = chooser.randrange(low, high)
        if all(_bindable(port + offset) for offset in range(span)):
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class ParallelLayout:
    """The rank sizes a ``sglang.launch_server`` command line asks for."""

    tp: int = 1
    dp: int = 1
    pp: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dp_attention: bool = False  # DP groups inside the TP group: no scheduler processes of their own

    @property
    def world_size(self) -> int:
        """Scheduler processes over all nodes (what stock compares with this node's NUMA nodes)."""
        return self.tp * self.pp * (1 if self.dp_attention else self.dp)

    @property
    def ranks_on_this_node(self) -> int:
        """Scheduler processes this node starts: sglang spreads every TP x PP group (and every DP replica) evenly
        over the nodes (``entrypoints/engine.py::_calculate_rank_ranges``)."""
        return max(1, self.world_size // self.nnodes)


class _RaisingParser(argparse.ArgumentParser):
    """sglang's parser, raising instead of printing its whole usage and exiting."""

    def error(self, message):
        raise ValueError(message)


def parallel_layout(extra_args: list[str]) -> ParallelLayout:
    """The rank sizes in sglang arguments, read by sglang's own parser (``ServerArgs.add_cli_args``), so every
    spelling it accepts counts: ``--tp-size``, ``--tensor-parallel-size``, ``--tp`` (argparse's unambiguous
    prefix), ``--dp``, ``--tp-size=2``. Arguments sglang itself would reject give the one-rank layout; sglang then
    reports them. (The import loads torch, seconds: only a CPU launch, which needs the count, calls this.)"""
    from sglang.srt.server_args import ServerArgs

    parser = _RaisingParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    try:
        parsed, _ = parser.parse_known_args(["--model-path", "unused", *extra_args])
    except ValueError as error:
        logger.warning("sglang will reject these arguments (%s); no core split chosen", error)
        return ParallelLayout()
    return ParallelLayout(
        tp=parsed.tp_size,
        dp=parsed.dp_size,
        pp=parsed.pp_size,
        nnodes=parsed.nnodes,
        node_rank=parsed.node_rank,
        dp_attention=bool(getattr(parsed, "enable_dp_attention", False)),
    )


def rank_count(extra_args: list[str]) -> int:
    """Scheduler processes the server will start on this node."""
    return parallel_layout(extra_args).ranks_on_this_node


def core_ranges(cores: list[int]) -> str:
    """Sorted core ids in sglang's bind syntax: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    ranges, start = [], cores[0]
    for previous, core in zip(cores, cores[1:] + [None]):
        if core != previous + 1:
            ranges.append(str(start) if start == previous else f"{start}-{previous}")
            start = core
    return ",".join(ranges)


def cpu_threads_bind(ranks: int, cores: list[int]) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND``: contiguous, near-equal core groups, one per rank (``"0|1"`` for two
    ranks on two cores); with fewer cores than ranks, ranks share cores round-robin."""
    cores = sorted(cores)
    if ranks >= len(cores):
        return "|".join(str(cores[rank % len(cores)]) for rank in range(ranks))
    per_rank, extra = divmod(len(cores), ranks)
    groups, start = [], 0
    for rank in range(ranks):
        size = per_rank + (rank < extra)
        groups.append(core_ranges(cores[start : start + size]))
        start += size
    return "|".join(groups)


def multi_rank_cpu_env(ranks: int, cores: list[int]) -> dict[str, str]:
    """Settings that let a CPU server run ``ranks`` scheduler processes (of a multi-rank world) on ``cores``.

    Without ``SGLANG_CPU_OMP_THREADS_BIND`` stock sglang refuses a world of more ranks than NUMA nodes, so one core
    group per rank of this node is chosen. sglang applies that bind only with its CPU kernels (AMX or arm64);
    elsewhere each rank would start one OpenMP thread per core and the ranks would oversubscribe the machine, so
    ``OMP_NUM_THREADS`` is set to the cores per rank as well. Variables already set by the user win.
    """
    settings = {THREADS_BIND_ENV: cpu_threads_bind(ranks, cores), "OMP_NUM_THREADS": str(max(1, len(cores) // ranks))}
    return {name: value for name, value in settings.items() if name not in os.environ}


def engine_env(device: str, extra_args: list[str] | None = None) -> dict[str, str]:
    """The process environment for a server on ``device`` started with sglang arguments ``extra_args``;
    CPU gets the CPU-engine settings (and a core split when it runs several ranks)."""
    env = dict(os.environ)
    # This tree's plugin ahead of the editable install, so a git worktree serves its own code.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGIN_SRC), env.get("PYTHONPATH", "")) if p)
    if device == "cpu":
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        # OpenMP threads that sleep when idle instead of spinning: with another process busy on this 2-core machine
        # (a client, the test process) spinning workers starved the server (a realtime session's frame p95 went
        # from ~350 ms with PASSIVE to 2.9-4.6 s without, benchmarks/bench_realtime.py, 2026-12-02).
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SHIM), env.get("PYTHONPATH", "")) if p)
        layout = parallel_layout(list(extra_args or []))
        # Stock refuses a world larger than this node's NUMA nodes unless a bind names the cores of each rank that
        # runs here (indexed by the rank's device id on this node): node 1 of a 2-node TP=2 needs it for its one rank.
        if layout.world_size > 1:
            settings = multi_rank_cpu_env(layout.ranks_on_this_node, list(os.sched_getaffinity(0)))
            chosen = " ".join(f"{name}={value}" for name, value in settings.items())
            logger.info(
                "%d CPU ranks on node %d of %d: %s",
                layout.ranks_on_this_node,
                layout.node_rank,
                layout.nnodes,
                chosen or "the user's binding",
            )
            env.update(settings)
    return env


def server_command(
    model_path: str | Path, port: int, device: str = "cpu", extra_args: list[str] | None = None
) -> list[str]:
    args = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        "--device",
        device,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--trust-remote-code",
        "--enable-multimodal",
    ]
    extra_args = list(extra_args or [])
    if "--max-total-tokens" not in extra_args:
        args += ["--max-total-tokens", str(DEFAULT_MAX_TOTAL_TOKENS)]
    if device == "cpu" and "--sleep-on-idle" not in extra_args:
        # Without it an idle scheduler polls its sockets in a busy loop, a whole core (measured: 1.01 cores idle,
        # 0.01 with it); on a CPU server that core is the one the HTTP server, the detokenizer and the clients need.
        args.append("--sleep-on-idle")
    return args + extra_args


# Servers stopped with ``stop(wait=False)`` whose exit a thread still waits for (:func:`join_stopping`).
STOPPING: list[threading.Thread] = []


def join_stopping() -> None:
    """Wait until every server stopped with ``wait=False`` is gone, its process group killed."""
    while STOPPING:
        STOPPING.pop().join()


class SglangServer:
    """A server process on 127.0.0.1 that is stopped by its PID, whatever happens (use as a context manager)."""

    # Whether leaving the ``with`` block waits until the server is gone. sglang's graceful exit takes ~8 s (its
    # SIGTERM watchdog polls every 5 s, then the scheduler tears down); the test suite, which starts ~40 servers,
    # turns this off and calls join_stopping() at its end.
    wait_on_exit = True

    def __init__(
        self,
        model_path,
        device: str = "cpu",
        extra_args=None,
        port: int | None = None,
        ready_timeout_s: float = 240.0,
        name: str = "server",
        env: dict[str, str] | None = None,
    ):
        self.model_path = model_path
        self.device = device
        self.extra_args = extra_args
        self.fixed_port = port
        self.name = name
        self.env = {**engine_env(device, extra_args), **(env or {})}  # ``env``: settings that win over the chosen ones
        self.ready_timeout_s = ready_timeout_s
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self._use_port(port or free_port())
        self.process: subprocess.Popen | None = None
        self.startup_seconds: float | None = None
        self._reaper: threading.Thread | None = None

    def _use_port(self, port: int) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.command = server_command(self.model_path, port, self.device, self.extra_args)
        self.log_path = LOG_DIR / f"{self.name}-{port}.log"

    def __enter__(self) -> "SglangServer":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop(wait=self.wait_on_exit)

    def start(self, port_attempts: int = 3) -> None:
        """Start the server and wait until it is healthy; a chosen port that another socket took first is replaced
        by a fresh one (at most ``port_attempts`` tries), a port the caller fixed is not."""
        for attempt in range(1, port_attempts + 1):
            try:
                self._start_once()
                return
            except PortTakenError:
                if self.fixed_port is not None or attempt == port_attempts:
                    raise
                taken = self.port
                self._use_port(free_port())
                logger.warning("port %d was taken before the server bound it; retrying on %d", taken, self.port)

    def _start_once(self) -> None:
        logger.info("starting: %s (log: %s)", " ".join(self.command), self.log_path)
        started = time.monotonic()
        with open(self.log_path, "w") as log:
            # Own session: the launcher's scheduler/detokenizer children can be reaped by group if it dies.
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
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
            if PORT_TAKEN_MESSAGE in self.log_tail():
                raise PortTakenError(f"port {self.port} taken before the server bound it; log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {self.ready_timeout_s:.0f} s; log tail:\n{self.log_tail()}")

    def stop(self, wait: bool = True) -> None:
        """SIGTERM to the launcher (it tears down its scheduler and detokenizer), up to 30 s for it to exit, then
        SIGKILL to its process group (children a crashed launcher left behind). ``wait=False`` returns after the
        SIGTERM and leaves the rest to a thread (:func:`join_stopping`)."""
        if self._reaper is not None:
            if wait:
                self._reaper.join()
            return
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        if wait:
            self._reap()
            return
        self._reaper = threading.Thread(target=self._reap, name=f"stop-{self.name}-{self.port}", daemon=True)
        self._reaper.start()
        STOPPING.append(self._reaper)

    def _reap(self) -> None:
        pid = self.process.pid
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


def exit_on_sigterm() -> None:
    """Make SIGTERM (``kill PID``, a supervisor stopping the process) unwind like Ctrl-C, so that the caller's ``with``
    blocks stop its servers by PID; by default the process dies at once and its servers, each in its own session, run
    on."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


def main(argv: list[str] | None = None) -> None:
    """Foreground server: this module's environment and command, then exec (Ctrl-C stops sglang directly)."""
    parser = argparse.ArgumentParser(
        description="Serve MOSS-VL with stock sglang + this plugin (foreground).",
        epilog="Every other argument is passed to sglang.launch_server.",
    )
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--port", type=int, default=30000)
    args, sglang_args = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    command = server_command(args.model_path, args.port, args.device, sglang_args)
    env = engine_env(args.device, sglang_args)
    logger.info("exec: %s", " ".join(command))
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    main()
