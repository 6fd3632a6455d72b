"""A pool of sglang test servers: a module that asks for a server with the arguments an earlier module's server was
started with gets that live server (its cache flushed) instead of a new one, a start-up (~1 min on 2 cores) saved.

Servers are started with ``serving.launch.SglangServer`` (as every served test starts them) and keyed by
``server_key``: the checkpoint, the device, the sglang arguments normalised (order, ``--flag=value`` vs ``--flag
value``, underscores, sglang's short aliases, the defaults ``serving.launch`` adds) and the environment overrides. A
server is lent to one user at a time; on return it stays alive, idle. Before another server starts, idle ones are
stopped, least recently used first, so that at most ``max_alive`` run (more only while every one is in use); at the
end of the session every server is stopped by PID.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from serving import launch

logger = logging.getLogger(__name__)

# sglang's spellings of one option (``arg_groups/fields/parallel.py``: ``--tp`` is argparse's prefix of ``--tp-size``).
ALIASES = {
    "--tp": "--tp-size",
    "--tensor-parallel-size": "--tp-size",
    "--dp": "--dp-size",
    "--data-parallel-size": "--dp-size",
    "--pp": "--pp-size",
    "--pipeline-parallel-size": "--pp-size",
}
FLUSH_TIMEOUT_S = 60.0


def normalised_args(args: list[str], device: str = "cpu") -> tuple[tuple[str, str | None], ...]:
    """sglang command-line arguments as sorted ``(flag, value)`` pairs (``None`` for a switch, the values joined by
    spaces for a flag that takes several, such as ``--cuda-graph-bs-decode 4 8``), with what
    ``serving.launch`` adds when absent (``--max-total-tokens``, ``--sleep-on-idle`` on CPU); a flag given twice
    keeps its last value, as argparse does."""
    options: dict[str, str | None] = {}
    index = 0
    while index < len(args):
        flag, equals, value = args[index].partition("=")
        if not flag.startswith("--"):
            raise ValueError(f"not an option: {args[index]!r} in {args}")
        flag = "--" + flag[2:].replace("_", "-")
        flag = ALIASES.get(flag, flag)
        if not equals:
            values = []
            while index + 1 < len(args) and not args[index + 1].startswith("--"):
                values.append(args[index + 1])
                index += 1
            value = " ".join(values) if values else None
        options[flag] = value
        index += 1
    options.setdefault("--max-total-tokens", str(launch.DEFAULT_MAX_TOTAL_TOKENS))
    if device == "cpu":
        options.setdefault("--sleep-on-idle", None)
    return tuple(sorted(options.items()))


def server_key(model_path, args: list[str], device: str = "cpu", env: dict[str, str] | None = None) -> tuple:
    return (str(Path(model_path).resolve()), device, normalised_args(args, device), tuple(sorted((env or {}).items())))


@contextlib.contextmanager
def environment(overrides: dict[str, str]):
    """``os.environ`` with ``overrides`` while a server is built (``SglangServer`` copies the environment then)."""
    saved = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclass
class Lease:
    """One user's use of a pooled server: what a test reads of ``SglangServer`` (``base_url``, ``port``,
    ``process``, ``log_path``, ``log_tail``) plus ``log_text()``, the server's log since this lease began."""

    server: launch.SglangServer
    reused: bool
    log_offset: int

    def __getattr__(self, name):
        if name == "server":  # not set yet (an object being copied): no recursion
            raise AttributeError(name)
        return getattr(self.server, name)

    @classmethod
    def from_now(cls, server: launch.SglangServer, reused: bool = True) -> Lease:
        """A use of ``server`` whose log starts at what the server has logged so far."""
        return cls(server, reused=reused, log_offset=server.log_path.stat().st_size)

    def log_text(self) -> str:
        with open(self.server.log_path, "rb") as log:
            log.seek(self.log_offset)
            return log.read().decode(errors="replace")


@dataclass
class _Entry:
    key: tuple
    server: launch.SglangServer
    in_use: bool = False
    last_used: float = field(default_factory=time.monotonic)


class ServerPool:
    def __init__(self, max_alive: int = 2, on_reuse=None):
        self.max_alive = max_alive
        self.on_reuse = on_reuse or (lambda server: None)
        self.entries: list[_Entry] = []
        self.started = 0
        self.reused = 0

    @contextlib.contextmanager
    def lease(self, model_path, args: list[str], *, device: str = "cpu", env=None, name: str = "pooled", **options):
        """A healthy server for ``model_path`` with sglang arguments ``args`` (and environment overrides ``env``),
        with an empty cache; ``options`` go to ``SglangServer`` (they are not part of the key)."""
        key = server_key(model_path, args, device, env)
        entry = self._idle_alive(key)
        reused = entry is not None and self._flushed(entry.server)
        if reused:
            self.reused += 1
            self.on_reuse(entry.server)
            logger.info("reusing %s (started as %s) for %s", entry.server.base_url, entry.server.name, name)
        else:
            if entry is not None:
                self._stop(entry)
            entry = self._start(key, model_path, args, device, env or {}, name, options)
        entry.in_use = True
        try:
            yield Lease.from_now(entry.server, reused)
        finally:
            entry.in_use = False
            entry.last_used = time.monotonic()

    def close(self) -> None:
        """Stop every server (their graceful exits overlap) and wait until all are gone."""
        servers = [entry.server for entry in self.entries]
        for entry in list(self.entries):
            self._stop(entry)
        for server in servers:
            server.stop(wait=True)

    def _idle_alive(self, key) -> _Entry | None:
        for entry in self.entries:
            if entry.key == key and not entry.in_use:
                if entry.server.process is not None and entry.server.process.poll() is None:
                    return entry
                self._stop(entry)
        return None

    def _flushed(self, server) -> bool:
        """Empty the radix cache of a server another user left (sglang refuses while requests run: wait for them)."""
        try:
            response = requests.post(f"{server.base_url}/flush_cache?timeout={FLUSH_TIMEOUT_S}", timeout=120)
        except requests.RequestException as error:
            logger.warning("flush of %s failed (%s); starting a fresh server", server.base_url, error)
            return False
        if response.status_code != 200:
            logger.warning("flush of %s refused: %s; starting a fresh server", server.base_url, response.text)
        return response.status_code == 200

    def _start(self, key, model_path, args, device, env, name, options) -> _Entry:
        idle = sorted((e for e in self.entries if not e.in_use), key=lambda e: e.last_used)
        while idle and len(self.entries) >= self.max_alive:
            self._stop(idle.pop(0))
        with environment(env):
            server = launch.SglangServer(model_path, device=device, extra_args=list(args), name=name, **options)
        server.start()
        self.started += 1
        entry = _Entry(key, server)
        self.entries.append(entry)
        return entry

    def _stop(self, entry: _Entry) -> None:
        """SIGTERM now; the ~8 s of sglang's graceful exit go on beside the next server's start-up."""
        entry.server.stop(wait=False)
        self.entries.remove(entry)
