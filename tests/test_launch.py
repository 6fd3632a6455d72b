"""serving.launch's port handling, with a stand-in server process instead of sglang (seconds, not a model load).

The stand-in does what uvicorn does on 127.0.0.1:PORT: serve ``/health`` when it can bind, and when the port is
taken log uvicorn's bind error and stay alive without serving (CI once waited 240 s on such a server).
"""

from __future__ import annotations

import socket
import sys
import time

import pytest

from serving import launch
from serving.launch import PortTakenError, SglangServer, free_port

STAND_IN_SERVER = """
import http.server, sys, time
port = int(sys.argv[1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

try:
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError as error:
    print(f"ERROR:    [Errno {error.errno}] error while attempting to bind on address ('127.0.0.1', {port}): "
          f"{error.strerror.lower()}", flush=True)
    time.sleep(3600)
server.serve_forever()
"""


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(
        launch,
        "server_command",
        lambda model_path, port, device, extra_args: [sys.executable, "-c", STAND_IN_SERVER, str(port)],
    )


@pytest.fixture
def held_port():
    """A listening socket on a port from ``free_port``: taken, as by another process's socket."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
        sock.listen()
        yield sock.getsockname()[1]


def test_free_port_is_bindable_and_below_the_ephemeral_range_and_sglangs_own_ports():
    assert launch.PORT_RANGE[1] <= launch.ephemeral_port_floor(), "this machine's ephemeral range overlaps PORT_RANGE"
    for _ in range(20):
        port = free_port()
        assert launch.PORT_RANGE[0] <= port < launch.PORT_RANGE[1]
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_chosen_port_taken_before_the_server_binds_is_replaced(stand_in, held_port, monkeypatch):
    monkeypatch.setattr(SglangServer, "wait_on_exit", True)  # a user's default (the suite's conftest turns it off)
    ports = iter([held_port])
    monkeypatch.setattr(launch, "free_port", lambda: next(ports, None) or free_port())
    started = time.monotonic()
    with SglangServer("unused-model", name="launch-retry") as server:
        assert server.port != held_port
        assert server.process.poll() is None
        first_log = launch.LOG_DIR / f"launch-retry-{held_port}.log"
        assert launch.PORT_TAKEN_MESSAGE in first_log.read_text()
    assert time.monotonic() - started < 60
    assert server.process.poll() is not None


SLOW_EXIT_STAND_IN = """
import http.server, signal, sys, time

def slow_exit(signum, frame):
    time.sleep(3)  # sglang's graceful exit: a drain poll, then the scheduler's teardown
    sys.exit(0)

signal.signal(signal.SIGTERM, slow_exit)
port = int(sys.argv[1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_leaving_the_block_without_waiting_stops_it_in_the_background(monkeypatch):
    monkeypatch.setattr(
        launch,
        "server_command",
        lambda model_path, port, device, extra_args: [sys.executable, "-c", SLOW_EXIT_STAND_IN, str(port)],
    )
    monkeypatch.setattr(SglangServer, "wait_on_exit", False)
    with SglangServer("unused-model", name="launch-slow-exit") as server:
        pass
    left = time.monotonic()
    assert server.process.poll() is None, "the block returned before the graceful exit ended"
    launch.join_stopping()
    assert server.process.poll() == 0, "the graceful exit ran to its end (no SIGKILL)"
    assert time.monotonic() - left >= 2
    server.stop()  # a second stop of a stopped server is a no-op


def test_a_fixed_port_that_is_taken_fails_at_once_and_leaves_no_process(stand_in, held_port):
    server = SglangServer("unused-model", port=held_port, name="launch-fixed")
    started = time.monotonic()
    with pytest.raises(PortTakenError, match=str(held_port)):
        server.start()
    assert time.monotonic() - started < 60
    assert server.process.poll() is not None


def test_every_try_taken_gives_up_after_the_last(stand_in, held_port, monkeypatch):
    monkeypatch.setattr(launch, "free_port", lambda: held_port)
    server = SglangServer("unused-model", name="launch-give-up")
    with pytest.raises(PortTakenError):
        server.start(port_attempts=2)
    assert server.process.poll() is not None


# (sglang arguments, (tp, dp, pp, nnodes, node_rank), scheduler processes on this node). The per-node count follows
# sglang's ``entrypoints/engine.py::_calculate_rank_ranges``: a node runs tp_size // nnodes TP ranks of each replica.
LAYOUTS = [
    ([], (1, 1, 1, 1, 0), 1),
    (["--tp", "2"], (2, 1, 1, 1, 0), 2),  # argparse's unambiguous prefix of --tp-size: sglang accepts it
    (["--tp-size", "2"], (2, 1, 1, 1, 0), 2),
    (["--tp-size=2"], (2, 1, 1, 1, 0), 2),
    (["--tensor-parallel-size", "2"], (2, 1, 1, 1, 0), 2),
    (["--dp", "2"], (1, 2, 1, 1, 0), 2),
    (["--dp-size", "2", "--tp", "2"], (2, 2, 1, 1, 0), 4),
    (["--dp-size", "2", "--tp", "2", "--enable-dp-attention"], (2, 2, 1, 1, 0), 2),  # DP inside the TP group
    (["--nnodes", "2", "--node-rank", "1", "--tp", "2"], (2, 1, 1, 2, 1), 1),
    (["--tp", "8", "--nnodes", "2", "--node-rank", "0"], (8, 1, 1, 2, 0), 4),
    (["--pipeline-parallel-size", "2", "--tp-size", "2"], (2, 1, 2, 1, 0), 4),
]


@pytest.mark.parametrize("args,sizes,on_this_node", LAYOUTS, ids=[" ".join(a) or "default" for a, _, _ in LAYOUTS])
def test_parallel_layout_reads_every_spelling_sglang_accepts(args, sizes, on_this_node):
    layout = launch.parallel_layout(["--dtype", "float32", *args])
    assert (layout.tp, layout.dp, layout.pp, layout.nnodes, layout.node_rank) == sizes
    assert layout.ranks_on_this_node == on_this_node


def test_arguments_sglang_rejects_give_one_rank_and_leave_the_error_to_sglang():
    assert launch.parallel_layout(["--pp", "2"]).ranks_on_this_node == 1  # ambiguous: --pp-size, --pp-max-...


@pytest.mark.parametrize("args,bind,threads", [
    (["--tp", "2"], "0-3|4-7", "4"),  # the spelling the old flag table missed: no split, stock refused to start
    (["--dp", "2"], "0-3|4-7", "4"),
    (["--tp", "4", "--nnodes", "2", "--node-rank", "1"], "0-3|4-7", "4"),  # 2 of the 4 ranks run here: all cores
    (["--tp", "2", "--nnodes", "2", "--node-rank", "1"], "0-7", "8"),  # one rank here: every core; the bind is
    # still needed, stock compares the world (2 ranks) with this node's NUMA nodes
    ([], None, None),
    (["--nnodes", "2", "--node-rank", "1"], None, None),  # one rank in all: nothing to split
])  # fmt: skip
def test_cpu_cores_are_split_over_the_ranks_of_this_node(args, bind, threads, monkeypatch):
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv(launch.THREADS_BIND_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = launch.engine_env("cpu", args)
    assert env.get(launch.THREADS_BIND_ENV) == bind
    assert env.get("OMP_NUM_THREADS") == threads


def test_a_port_span_is_free_as_a_whole():
    port = free_port(span=8)
    for offset in range(8):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port + offset))
