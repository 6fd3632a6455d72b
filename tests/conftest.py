"""Test-session set-up: the CPU engine environment, before anything imports sglang; the `served` tier; the server
pool; the served modules' timings.

The Makefile sets the same variables; setting them here too lets `pytest` run directly.

The `served` marker (`make test-fast` runs `-m "not served"`) is applied here, and only here: to every test that uses
the `server_pool` fixture (directly or through a fixture), and to the tests in `SERVED_WITHOUT_POOL` (servers started
another way). A test without the marker that starts a server anyway fails (`support/served_guard.py`).
"""

import os
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CPU_SHIM = REPO_ROOT / "cpu_shim"
# This tree's plugin first, so a checkout other than the editable install (a git worktree) tests its own code;
# PYTHONPATH carries it into the servers and scripts the tests start.
PLUGIN_SRC = REPO_ROOT / "sglang"

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
for path in (str(CPU_SHIM), str(REPO_ROOT), str(PLUGIN_SRC)):
    if path not in sys.path:
        sys.path.insert(0, path)
# The served-marker check in every process a test starts (a sitecustomize; it does nothing in a served test).
SERVED_GUARD_SITE = REPO_ROOT / "tests" / "support" / "served_guard_site"
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(PLUGIN_SRC), str(CPU_SHIM), os.environ.get("PYTHONPATH", ""), str(SERVED_GUARD_SITE)) if p
)

from serving import launch  # noqa: E402  (after the environment above)
from support import served_guard  # noqa: E402
from support.server_pool import ServerPool  # noqa: E402
from support.suite_timings import SuiteTimings  # noqa: E402

# Tests that start a server without the pool: module -> the fixtures that start one (a test using any of them is
# served), the test functions that start one themselves, or "*" (every test of the module).
SERVED_WITHOUT_POOL = {
    "test_bench_realtime.py": "*",  # benchmarks/bench_realtime.py --quick serves the tiny-realtime model
    "test_fleet.py": {"fleet"},  # workers behind sglang's gateway (serving/fleet.py)
    "test_npu_route_served.py": {"served"},
    "test_quant_served.py": {"served"},  # the INT8 tiny checkpoint on the simulated NPU route
    "test_real_layout_checkpoint.py": {  # a launch_server forced to code that cannot load
        "test_a_server_forced_to_the_checkpoints_code_stops_with_one_line_naming_the_version"
    },
    "test_run_online_inference.py": {"test_serve_on_loopback_with_uvicorn"},  # the runner's --serve
    "test_serving_bf16.py": {"served"},
    "test_serving_kv_layout.py": {"default_layout", "stock_layout"},
    "test_serving_multirank.py": {"served"},
    "test_serving_pd.py": {"aggregated", "pd"},  # an aggregated server, then a PD pair behind smg (+1 stock decode)
    "test_serving_pd_faults.py": {"fleet"},  # a prefill and a decode worker behind smg, page 1; the decode one killed
    "test_serving_pd_startup.py": "*",  # a decode launch_server refused at argument resolution
    "test_serving_realtime.py": {"engines"},  # in-process sglang.Engines, one at a time
    "test_serving_realtime_ws.py": "*",
    "test_soak_realtime.py": "*",  # benchmarks/soak_realtime.py --minutes 2 serves the tiny-realtime model
}
# `make test` runs the suite on two pytest-xdist workers (`--dist loadgroup`): each module is one unit of work, sent
# whole to one worker (its module-scoped fixtures, servers among them, are set up once). Modules whose servers the
# pool shares form one unit, in the order that lets each borrow the one before's.
SHARED_SERVER_GROUPS = [
    # The paged module borrows the decode-graph module's eager server; its last, the unchunked page-1 baseline, is
    # test_serving.py's page-1 server; the cache module borrows test_serving.py's two, and keeps the page-1 one alive
    # for the chunked module's baseline.
    [
        "test_serving_decode_graphs.py",
        "test_serving_paged.py",
        "test_serving.py",
        "test_serving_cache.py",
        "test_serving_chunked.py",
    ],
]
# The units a worker takes first, longest first (wall seconds in the fresh-clone CI rehearsal of 2026-12-07 18:02,
# before that day's last cuts), so that the longest ones do not start last; the units not named here follow, by name.
LONGEST_FIRST = [
    "test_serving_decode_graphs.py",  # with its group: 380 + 439 + 147 + 72 + 373 s, now 3 starts fewer
    "test_serving_realtime_ws.py",  # 710 s, 9 starts (now 6)
    "test_serving_multirank.py",  # 430 s, 4 starts (now 3 configurations, one over two nodes)
    "test_serving_pd.py",  # 255 + 275 s with test_serving_pd_layout.py, 7 starts (now 4)
    "test_serving_realtime.py",  # 371 s, 8 in-process engines (now 6)
    "test_soak_realtime.py",  # 221 s: a 2-minute load, its server start and the reference probe
    "test_serving_pd_faults.py",  # 219 s: 2 starts and a restart
    "test_quant_served.py",  # 194 s: one start with decode graphs captured (now one bucket)
    "test_serving_kv_layout.py",  # 178 s
    "test_fleet.py",  # 177 s
    "test_real_layout_checkpoint.py",  # 142 s
    "test_npu_route_served.py",  # 129 s
    "test_bench_realtime.py",  # 97 s
    "test_serving_media.py",  # 83 s
    "test_realtime_web_served.py",  # 78 s
]
# At most this many servers alive at once (more only while every one is in use): ~1.5 GB each.
POOL_MAX_ALIVE = 2
TIMINGS_PATH = REPO_ROOT / "build" / "test-timings.json"

TIMINGS = SuiteTimings()
served_guard.refuse_sglang_child_processes()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "served: starts a server (sglang HTTP, in-process sglang.Engine, runner --serve)"
    )
    _record_server_starts()
    # A test's server exits while the next test runs (its ~8 s graceful exit is sleep); the session's end waits.
    launch.SglangServer.wait_on_exit = False


def _record_server_starts() -> None:
    """Every real sglang server start (the pool's and any other) is charged to the module whose test started it."""
    original = launch.SglangServer.start
    if getattr(original, "timed", False):
        return

    def start(self, *args, **kwargs):
        started = time.monotonic()
        original(self, *args, **kwargs)
        if served_guard.server_in_command(self.command):
            TIMINGS.add_server_start(time.monotonic() - started)

    start.timed = True
    launch.SglangServer.start = start


def starts_a_server(item) -> bool:
    if "server_pool" in item.fixturenames:
        return True
    registered = SERVED_WITHOUT_POOL.get(item.path.name)
    if registered is None:
        return False
    if registered == "*":
        return True
    return bool(registered & set(item.fixturenames)) or getattr(item, "originalname", item.name) in registered


def work_unit(module: str) -> str:
    """The xdist group of a module: its shared-server group's first module, else itself."""
    for group in SHARED_SERVER_GROUPS:
        if module in group:
            return group[0]
    return module


# tryfirst: the groups are set before xdist's own hook turns them into the units it distributes.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if starts_a_server(item):
            item.add_marker(pytest.mark.served)
        item.add_marker(pytest.mark.xdist_group(work_unit(item.path.name)))

    def rank(item):
        module = item.path.name
        unit = work_unit(module)
        first = LONGEST_FIRST.index(unit) if unit in LONGEST_FIRST else len(LONGEST_FIRST)
        within = next((group.index(module) for group in SHARED_SERVER_GROUPS if module in group), 0)
        return (first, unit if first == len(LONGEST_FIRST) else "", within)

    items.sort(key=rank)  # stable: each module keeps its own order


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    TIMINGS.current_module = item.path.name
    if item.get_closest_marker("served"):
        os.environ.pop(served_guard.UNMARKED_TEST_ENV, None)
    else:
        os.environ[served_guard.UNMARKED_TEST_ENV] = item.nodeid


def pytest_sessionstart(session):
    # An xdist controller runs no test: it is sent each worker's table instead (pytest_testnodedown).
    TIMINGS.from_workers = session.config.pluginmanager.has_plugin("dsession")


def pytest_runtest_logreport(report):
    if not TIMINGS.from_workers:
        TIMINGS.add_test_phase(Path(report.fspath).name, report.duration, "served" in report.keywords)


@pytest.hookimpl(optionalhook=True)  # an xdist hook
def pytest_testnodedown(node, error):
    TIMINGS.merge(node.workeroutput.get("timings", {}))


def pytest_sessionfinish(session):
    os.environ.pop(served_guard.UNMARKED_TEST_ENV, None)
    launch.join_stopping()
    if hasattr(session.config, "workeroutput"):  # an xdist worker: its table goes to the controller
        session.config.workeroutput["timings"] = TIMINGS.rows()
    else:
        TIMINGS.write(TIMINGS_PATH)


def pytest_terminal_summary(terminalreporter):
    if TIMINGS.served_rows():
        terminalreporter.write_sep("-", f"served modules (also in {TIMINGS_PATH.relative_to(REPO_ROOT)})")
        terminalreporter.write_line(TIMINGS.table())


@pytest.fixture(scope="session")
def server_pool():
    """The session's sglang servers (``support/server_pool.py``); a test using it is ``served``."""
    pool = ServerPool(max_alive=POOL_MAX_ALIVE, on_reuse=lambda server: TIMINGS.add_server_reuse())
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def checkpoint() -> Path:
    """The embedded tiny MOSS-VL checkpoint (built once, then reused)."""
    from moss_vl_reference.tiny_checkpoint import build_or_reuse

    return build_or_reuse("tiny")


@pytest.fixture(scope="session")
def processor(checkpoint):
    """The tiny checkpoint's processor, loaded as remote code exactly as users load it."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(checkpoint, trust_remote_code=True)
