"""N MOSS-VL workers behind sglang's gateway (``smg``, PyPI ``smg``), all on loopback, stopped by PID.

Each worker is ``python -m sglang.launch_server`` started through :mod:`serving.launch` (on CPU: the CPU engine
settings, with this machine's cores split between the workers; on NPU: one card each through
``ASCEND_RT_VISIBLE_DEVICES``). The gateway is ``smg launch`` with no static workers; every worker is then
registered through smg's ``POST /workers``, labelled ``realtime=true`` (smg relays ``WS /v1/realtime`` only to workers
with that label). Worker health is probed every ``health_interval_s`` seconds and one failed probe ejects a worker,
so a dead worker stops receiving requests within about a second (the default is a probe a minute, three failures).

Realtime sessions: smg 1.13 places a WebSocket session on the realtime worker with the fewest HTTP requests in flight
through it and does not count open sessions (``docs/scale-out.md``), so without more every session lands on one worker.
What moves them is smg's overload veto: it polls each worker's ``/v1/loads`` every ``load_poll_s`` seconds and leaves
out of routing a worker whose KV token usage is at or above ``kv_ceiling`` (a parked session holds its KV, so the
report counts it). Sessions fill one worker up to the ceiling, then go to the next.

    python -m serving.fleet --model-path DIR [--workers 2] [--policy cache_aware] [--api-key KEY] [-- sglang args]
    python -m serving.fleet --model-path DIR --pd [-- sglang args]

``--pd`` runs prefill/decode disaggregation instead: one prefill worker (``--disaggregation-mode prefill``, its KV
bootstrap on a port of its own) and one decode worker, KV moved by Mooncake (``mooncake_tcp`` on CPU unless the worker
arguments name a ``--disaggregation-transfer-backend``), and smg in PD mode in front, which sends every request to both.

runs the fleet in the foreground (``make serve-fleet``), prints the gateway's and the workers' URLs, and stops all
of them on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from serving.launch import LOG_DIR, REPO_ROOT, SglangServer, exit_on_sigterm, free_port

logger = logging.getLogger(__name__)

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "least_load", "consistent_hashing")
# The header smg sets on every routed HTTP answer: the URL of the worker it chose.
ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"


def worker_env(device: str, index: int, workers: int, cores: list[int]) -> dict[str, str]:
    """What makes worker ``index`` of ``workers`` use its own share of the host: a card on NPU, cores on CPU."""
    if device == "npu":
        return {"ASCEND_RT_VISIBLE_DEVICES": str(index)}
    if device == "cpu":  # sglang binds threads to cores only with its CPU kernels (AMX, arm64): the count is what holds
        return {"OMP_NUM_THREADS": str(max(1, len(cores) // workers))}
    return {}


def pd_roles(device: str, args: list[str], decode_args: list[str] = ()) -> list[tuple[str, list[str]]]:
    """The prefill and the decode worker's arguments: ``args`` plus the role, the prefill's KV bootstrap port and, on
    CPU when ``args`` names none, the Mooncake TCP transfer backend; ``decode_args`` for the decode worker only."""
    if device == "cpu" and not any(arg.startswith("--disaggregation-transfer-backend") for arg in args):
        args = [*args, "--disaggregation-transfer-backend", "mooncake_tcp"]
    prefill = [*args, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(free_port())]
    return [("prefill", prefill), ("decode", [*args, *decode_args, "--disaggregation-mode", "decode"])]


# Health settings for workers on a loaded machine: smg ejects a worker after one probe over 15 s by the defaults below,
# and a PD prefill worker busy with a video on a loaded 2-core machine missed one (the next request got 503). With
# these a worker is ejected only after minutes of failed probes; the PD tests and benchmarks use them.
PATIENT_HEALTH = {"health_interval_s": 5, "health_failure_threshold": 10, "health_timeout_s": 120}


@dataclass
class Fleet:
    """Workers plus the gateway in front of them; a context manager that stops every process it started."""

    model_path: str | Path
    workers: int = 2
    policy: str = "cache_aware"
    device: str = "cpu"
    worker_args: list[str] = field(default_factory=list)
    api_key: str | None = None
    health_interval_s: int = 1
    health_failure_threshold: int = 1
    # sglang's /health runs a one-token generation: 1.0 s on an idle CPU worker, over 5 s on a loaded one (both
    # measured; each timeout ejected a live worker). A dead worker refuses the connection at once, whatever this is.
    health_timeout_s: int = 15
    # smg polls /v1/loads every 10 s by default: a worker that crossed the ceiling kept taking sessions that long.
    load_poll_s: int = 1
    kv_ceiling: float = 0.8
    gateway_port: int | None = None
    name: str = "fleet"
    pd: bool = False  # one prefill and one decode worker, smg in PD mode (``workers`` is ignored)
    decode_args: list[str] = field(default_factory=list)  # with ``pd``: the decode worker's own (decode graphs)
    worker_ready_timeout_s: float = 240.0
    servers: list[SglangServer] = field(default_factory=list, init=False)
    gateway: subprocess.Popen | None = field(default=None, init=False)

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def __enter__(self) -> "Fleet":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        try:
            self.start_workers()
            self.start_gateway()
            if not self.pd:  # smg's PD mode takes its workers on the command line
                for server in self.servers:
                    self.register(server.base_url)
            self.wait_routable()
        except BaseException:
            self.stop()
            raise

    def start_workers(self) -> None:
        cores = sorted(os.sched_getaffinity(0))
        args = list(self.worker_args) + (["--api-key", self.api_key] if self.api_key else [])
        roles = (
            pd_roles(self.device, args, self.decode_args)
            if self.pd
            else [(f"worker{index}", args) for index in range(self.workers)]
        )
        self.servers = [
            SglangServer(
                self.model_path,
                device=self.device,
                extra_args=role_args,
                name=f"{self.name}-{role}",
                ready_timeout_s=self.worker_ready_timeout_s,
                env=worker_env(self.device, index, len(roles), cores),
            )
            for index, (role, role_args) in enumerate(roles)
        ]
        # One at a time on CPU: two model loads at once on two cores take longer than one after the other.
        with ThreadPoolExecutor(1 if self.device == "cpu" else self.workers) as pool:
            list(pool.map(SglangServer.start, self.servers))

    def gateway_command(self) -> list[str]:
        command = [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(self.gateway_port)]
        command += ["--policy", self.policy, "--disable-tokenizer-autoload", "--shutdown-grace-period-secs", "1"]
        if self.pd:
            prefill, decode = self.servers
            bootstrap_port = prefill.extra_args[prefill.extra_args.index("--disaggregation-bootstrap-port") + 1]
            command += ["--pd-disaggregation", "--prefill", prefill.base_url, bootstrap_port]
            command += ["--decode", decode.base_url]
        command += ["--health-check-interval-secs", str(self.health_interval_s)]
        command += ["--health-failure-threshold", str(self.health_failure_threshold)]
        command += ["--health-check-timeout-secs", str(self.health_timeout_s), "--log-level", "info"]
        command += ["--load-monitor-interval", str(self.load_poll_s)]
        command += ["--worker-overload-token-usage", str(self.kv_ceiling)]
        # smg's metrics listen on 0.0.0.0:29000 by default: a second gateway on the host could not bind it.
        command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        if self.api_key:
            command += ["--api-key", self.api_key]
        return command

    def start_gateway(self, ready_timeout_s: float = 60.0) -> None:
        self.gateway_port = self.gateway_port or free_port()
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.gateway_log = LOG_DIR / f"{self.name}-smg-{self.gateway_port}.log"
        logger.info("starting the gateway: %s (log: %s)", " ".join(self.gateway_command()), self.gateway_log)
        with open(self.gateway_log, "w") as log:
            self.gateway = subprocess.Popen(
                self.gateway_command(),
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.gateway.poll() is not None:
                raise RuntimeError(f"smg exited with code {self.gateway.returncode}:\n{self.gateway_log_tail()}")
            try:
                self.request("GET", "/workers")
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.3)
        raise TimeoutError(f"smg not answering after {ready_timeout_s:.0f} s:\n{self.gateway_log_tail()}")

    def register(self, worker_url: str) -> None:
        """Add a worker to the gateway, labelled as one that serves realtime sessions."""
        body = {"url": worker_url, "labels": {"realtime": "true"}}
        if self.api_key:
            body["api_key"] = self.api_key
        self.request("POST", "/workers", body)

    def deregister(self, worker_url: str, timeout_s: float = 30.0) -> None:
        """Remove a worker from the gateway (smg removes it in the background: wait until it is gone)."""
        ids = {worker["url"]: worker["id"] for worker in self.request("GET", "/workers")["workers"]}
        self.request("DELETE", f"/workers/{ids[worker_url]}")
        deadline = time.monotonic() + timeout_s
        while any(worker["url"] == worker_url for worker in self.request("GET", "/workers")["workers"]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"smg still lists {worker_url} {timeout_s:.0f} s after its removal")
            time.sleep(0.2)

    def restart_gateway(self, **settings) -> None:
        """A fresh gateway with ``settings`` (``policy``, ``kv_ceiling``, ...) in front of the same workers (its routing
        state starts empty)."""
        self.stop_gateway()
        for name, value in settings.items():
            if not hasattr(self, name):
                raise AttributeError(f"Fleet has no setting {name!r}")
            setattr(self, name, value)
        self.start_gateway()
        for server in self.servers:
            self.register(server.base_url)
        self.wait_routable()

    def routable_workers(self) -> list[dict]:
        """The gateway's workers that are healthy now."""
        return [worker for worker in self.request("GET", "/workers")["workers"] if worker.get("is_healthy")]

    def wait_routable(self, count: int | None = None, timeout_s: float = 120.0) -> None:
        """Until the gateway routes to ``count`` workers (default: all of them)."""
        deadline = time.monotonic() + timeout_s
        while len(self.routable_workers()) != (len(self.servers) if count is None else count):
            if time.monotonic() > deadline:
                raise TimeoutError(f"smg lists {self.request('GET', '/workers')}:\n{self.gateway_log_tail()}")
            time.sleep(0.3)

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.gateway_url + path, data=data, headers=headers, method=method)
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read() or b"{}")

    def stop(self) -> None:
        """The gateway first (it stops routing), then every worker; each by its PID."""
        self.stop_gateway()
        for server in self.servers:
            server.stop()

    def stop_gateway(self) -> None:
        if self.gateway is not None and self.gateway.poll() is None:
            self.gateway.send_signal(signal.SIGTERM)
            try:
                self.gateway.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.gateway.pid, signal.SIGKILL)
                self.gateway.wait(timeout=15)

    def gateway_log_tail(self, chars: int = 4000) -> str:
        return self.gateway_log.read_text(errors="replace")[-chars:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="N MOSS-VL workers behind smg on 127.0.0.1 (foreground; Ctrl-C stops them all).",
        epilog="Arguments after the known ones go to every worker's sglang.launch_server.",
    )
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware")
    parser.add_argument("--pd", action="store_true", help="one prefill and one decode worker, smg in PD mode")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--port", type=int, default=30000, help="the gateway's port (default 30000)")
    parser.add_argument("--api-key", default=None, help="one key between clients, the gateway and the workers")
    parser.add_argument(
        "--kv-ceiling",
        type=float,
        default=Fleet.kv_ceiling,
        help="KV token usage at or above which smg sends a worker no new request or realtime session (default 0.8)",
    )
    args, worker_args = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    fleet = Fleet(
        args.model_path,
        workers=args.workers,
        policy=args.policy,
        device=args.device,
        worker_args=[arg for arg in worker_args if arg != "--"],
        api_key=args.api_key,
        gateway_port=args.port,
        kv_ceiling=args.kv_ceiling,
        pd=args.pd,
    )
    exit_on_sigterm()
    with fleet:
        for server in fleet.servers:
            print(f"worker   {server.base_url}   (log {server.log_path})", flush=True)
        print(f"gateway  {fleet.gateway_url}   (log {fleet.gateway_log})", flush=True)
        print(f"policy {fleet.policy}, KV ceiling {fleet.kv_ceiling}{', PD' if fleet.pd else ''}", flush=True)
        print(
            f"OpenAI:   {fleet.gateway_url}/v1    realtime: ws://127.0.0.1:{fleet.gateway_port}/v1/realtime?model=..."
        )
        try:
            while fleet.gateway.poll() is None:
                time.sleep(1)
            print(f"smg exited with code {fleet.gateway.returncode}", flush=True)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
