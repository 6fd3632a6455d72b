"""The test-server pool (`tests/support/server_pool.py`) and the `served` marker's check, with a stand-in server
process instead of sglang (seconds, not a model load).

The stand-in serves ``/health`` and ``/flush_cache`` (logging each flush), as sglang's HTTP server does.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import requests

from serving import launch
from support import served_guard
from support.server_pool import ServerPool, normalised_args, server_key

STAND_IN_SERVER = """
import http.server, sys
port = int(sys.argv[1])

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        flushed = self.path.startswith("/flush_cache")
        if flushed:
            print("cache flushed", flush=True)
        self.send_response(200 if flushed else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(
        launch,
        "server_command",
        lambda model_path, port, device, extra_args: [sys.executable, "-c", STAND_IN_SERVER, str(port)],
    )


def test_equivalent_spellings_normalise_alike():
    written = ["--dtype", "float32", "--page-size", "128", "--tp", "2", "--disable-radix-cache"]
    respelled = ["--disable_radix_cache", "--tensor-parallel-size=2", "--page-size=128", "--dtype", "float32"]
    assert normalised_args(written) == normalised_args(respelled)
    # What serving.launch adds when absent is the same as writing it.
    explicit = written + ["--max-total-tokens", str(launch.DEFAULT_MAX_TOTAL_TOKENS), "--sleep-on-idle"]
    assert normalised_args(explicit) == normalised_args(written)
    assert normalised_args(["--chunked-prefill-size", "-1"]) == (
        ("--chunked-prefill-size", "-1"),
        ("--max-total-tokens", str(launch.DEFAULT_MAX_TOTAL_TOKENS)),
        ("--sleep-on-idle", None),
    )


@pytest.mark.parametrize(
    "other",
    [
        (["--page-size", "1"], {}),  # another value
        (["--page-size", "128", "--disable-radix-cache"], {}),  # one more switch
        (["--page-size", "128"], {"SGLANG_TEST_RETRACT": "1"}),  # another environment
    ],
)
def test_different_servers_get_different_keys(tmp_path, other):
    args, env = other
    assert server_key(tmp_path, ["--page-size", "128"]) != server_key(tmp_path, args, env=env)


def test_a_server_is_lent_again_flushed_and_its_log_starts_at_the_lease(stand_in, tmp_path):
    pool = ServerPool(max_alive=2)
    try:
        with pool.lease(tmp_path, ["--page-size", "128", "--dtype", "float32"], name="pool-a") as first:
            pid = first.process.pid
            assert not first.reused
        with pool.lease(tmp_path, ["--dtype=float32", "--page_size", "128"], name="pool-b") as second:
            assert second.reused and second.process.pid == pid
            assert second.log_path.read_text() == "cache flushed\n", "flushed once, before the second user"
            assert second.log_text() == ""
            requests.post(f"{second.base_url}/flush_cache", timeout=10).raise_for_status()
            assert second.log_text() == "cache flushed\n", "the second user's log starts at its lease"
        assert (pool.started, pool.reused) == (1, 1)
    finally:
        pool.close()
    assert first.process.poll() is not None, "close() stops every server"


def exits_within(process, timeout_s: float) -> bool:
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def test_a_server_in_use_is_not_lent_and_idle_ones_are_stopped_least_recently_used_first(stand_in, tmp_path):
    pool = ServerPool(max_alive=2)
    try:
        with pool.lease(tmp_path, ["--page-size", "1"], name="pool-one") as one:
            with pool.lease(tmp_path, ["--page-size", "1"], name="pool-one-again") as again:
                assert again.process.pid != one.process.pid
            with pool.lease(tmp_path, ["--page-size", "128"], name="pool-128") as other:
                pass
        # An evicted server is sent SIGTERM and exits while the next one runs.
        assert exits_within(again.process, 30), "the least recently used idle server made room"
        assert one.process.poll() is None and other.process.poll() is None
        # "other" was given back before "one" (its lease ended inside one's): it is the least recently used.
        with pool.lease(tmp_path, ["--page-size", "64"], name="pool-64"):
            assert exits_within(other.process, 30) and one.process.poll() is None
    finally:
        pool.close()


@pytest.mark.parametrize(
    "argv,what",
    [
        ([sys.executable, "-m", "sglang.launch_server", "--model-path", "m"], "python -m sglang.launch_server"),
        ([sys.executable, "realtime_inference/run_online_inference.py", "--serve"], "--serve"),
        ([sys.executable, "-c", "import sglang.launch_server"], None),  # imports it, starts nothing
        ([sys.executable, "-m", "serving.demo"], None),
    ],
)
def test_the_guard_recognises_a_server_command(argv, what):
    assert served_guard.server_in_command(argv) == what


def test_a_test_without_the_marker_cannot_start_a_server(tmp_path):
    """This test has no `served` marker: the server process it starts exits at once, naming the test."""
    server = launch.SglangServer(tmp_path, name="unmarked", ready_timeout_s=60)
    with pytest.raises(RuntimeError, match="without the `served` marker") as refused:
        server.start()
    assert f"exited with code {served_guard.REFUSED_EXIT_CODE}" in str(refused.value)
    assert "test_a_test_without_the_marker_cannot_start_a_server" in str(refused.value)
