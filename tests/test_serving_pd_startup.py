"""PD workers refuse at start-up, with one line, what they cannot run: a CPU decode server's ``host_pool`` retraction
backup (a real launch), a transfer backend or KV checksum another device runs, and the ``ascend`` backend on the
simulated Ascend host without memfabric or its store URL (argument resolution in process, no server).

Oracle: stock sglang's own failure without the refusal (``host_pool`` builds a host KV pool that registers memory
through CUDA: "Found no NVIDIA driver on your system", seen on this machine before the refusal existed); the refusal
must come from argument resolution, before any scheduler starts, and name the flag, the value and the way out.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess

import pytest

from moss_vl_reference.tiny_checkpoint import build_or_reuse
from serving.launch import engine_env, free_port, server_command

pytestmark = pytest.mark.timeout(600)


def test_a_cpu_decode_server_with_a_host_pool_retraction_backup_is_refused_with_one_line():
    args = ["--dtype", "float32", "--max-total-tokens", "4096", "--disaggregation-mode", "decode"]
    args += [
        "--disaggregation-transfer-backend",
        "mooncake_tcp",
        "--disaggregation-decode-retraction-backup",
        "host_pool",
    ]
    command = server_command(build_or_reuse("tiny"), free_port(), extra_args=args)
    # subprocess.run kills the server if it outlives the timeout
    process = subprocess.run(command, capture_output=True, text=True, env=engine_env("cpu"), timeout=500)
    output = process.stdout + process.stderr
    assert process.returncode != 0
    refusal = "cannot run with --disaggregation-decode-retraction-backup host_pool"
    assert sum(refusal in line for line in output.splitlines()) == 1, output[-3000:]
    assert "use cpu_tensor" in output and "active in scheduler" not in output, output[-3000:]
    assert "Found no NVIDIA driver" not in output, output[-3000:]


# -- argument resolution, in process (no server): what a PD worker cannot run on this device or host is refused there


@pytest.fixture(autouse=True)
def environment_restored():
    """Resolution writes the launcher's environment (``MC_FORCE_TCP``, the Mooncake TCP limits): put it back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def pd_hooks_applied():
    from mossvl_ascend.patches import pd_disaggregation, server_args
    from support.hooks import patches_applied

    with patches_applied(*server_args.PATCHES, *pd_disaggregation.PATCHES):
        yield


@pytest.fixture
def simulated_ascend_host(monkeypatch):
    """STAND-IN for what stock's NPU resolution reads from the card (its memory size, torch_npu needed): a 64 GiB
    910B2-class card, as tests/test_server_args.py simulates it. Nothing else of the host is simulated."""
    import sglang.srt.hardware_backend.npu.utils as npu_utils
    import sglang.srt.utils.common as common

    monkeypatch.setattr(npu_utils, "get_npu_memory_capacity", lambda: 64 * 1024)
    monkeypatch.setattr(common, "get_npu_memory_capacity", lambda: 64 * 1024)
    for name in ("ASCEND_MF_STORE_URL", "ASCEND_MF_TRANSFER_PROTOCOL", "ASCEND_USE_FIA", "ASCEND_USE_FA"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def memfabric_installed(tmp_path, monkeypatch):
    """STAND-IN ``memfabric_hybrid``: an empty importable package (argument resolution only looks for it; the real one
    dlopens libascend_hal.so at import, which this host lacks)."""
    (tmp_path / "memfabric_hybrid").mkdir()
    (tmp_path / "memfabric_hybrid" / "__init__.py").write_text('"""STAND-IN memfabric_hybrid (import only)."""\n')
    monkeypatch.syspath_prepend(str(tmp_path))


def resolve(*argv):
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", str(build_or_reuse("tiny")), "--trust-remote-code", *argv])
    args.resolve_once()
    return resolving_view(args)


def refusal(*argv) -> str:
    with pytest.raises(ValueError) as refused:
        resolve(*argv)
    message = str(refused.value)
    assert "\n" not in message, message
    return message


NPU_PREFILL = ["--device", "npu", "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "ascend"]


def test_the_ascend_backend_on_the_simulated_ascend_host_names_the_missing_memfabric(
    pd_hooks_applied, simulated_ascend_host
):
    """Oracle: this host has no memfabric_hybrid (stock would fail in the scheduler, `ascend/transfer_engine.py`
    re-raising its ImportError after a warning)."""
    assert importlib.util.find_spec("memfabric_hybrid") is None
    message = refusal(*NPU_PREFILL)
    assert "--disaggregation-transfer-backend ascend needs the Python package memfabric_hybrid" in message
    assert "not installed here" in message and "pip install memfabric-hybrid" in message


@pytest.mark.parametrize("store_url", [None, "127.0.0.1:8100", "tcp://127.0.0.1"])
def test_the_ascend_backend_with_memfabric_needs_its_store_url(
    pd_hooks_applied, simulated_ascend_host, memfabric_installed, monkeypatch, store_url
):
    if store_url is not None:
        monkeypatch.setenv("ASCEND_MF_STORE_URL", store_url)
    message = refusal(*NPU_PREFILL)
    assert "needs ASCEND_MF_STORE_URL=tcp://IP:PORT" in message and repr(store_url or "nothing") in message


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("name", ["ASCEND_USE_FIA", "ASCEND_USE_FA"])
def test_a_pd_worker_on_npu_refuses_the_fused_ascend_kv_paths(
    pd_hooks_applied, simulated_ascend_host, memfabric_installed, monkeypatch, mode, name
):
    """With ``ASCEND_USE_FIA``/``ASCEND_USE_FA`` stock's NPU pool writes and reads K/V through other paths
    (``NPUMHATokenToKVPool.set_kv_buffer``'s ``npu_scatter_nd_update_`` under ``use_fia``) that know nothing of the
    layout's bands, and the extend ignores the encoder prefix: a PD worker is refused at start-up as an aggregated one
    is (``tests/test_server_args.py``), so the transfer's band description never meets them."""
    monkeypatch.setenv("ASCEND_MF_STORE_URL", "tcp://127.0.0.1:8100")
    monkeypatch.setenv(name, "1")
    message = refusal("--device", "npu", "--disaggregation-mode", mode, "--disaggregation-transfer-backend", "ascend")
    assert name in message


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_the_ascend_backend_resolves_on_the_simulated_ascend_host_with_memfabric_and_its_store(
    pd_hooks_applied, simulated_ascend_host, memfabric_installed, monkeypatch, mode
):
    monkeypatch.setenv("ASCEND_MF_STORE_URL", "tcp://127.0.0.1:8100")
    monkeypatch.setenv("ASCEND_MF_TRANSFER_PROTOCOL", "device_rdma")
    argv = ["--device", "npu", "--disaggregation-mode", mode, "--disaggregation-transfer-backend", "ascend"]
    lines = []
    collect = logging.Handler()
    collect.emit = lambda record: lines.append(record.getMessage())
    plugin_logger = logging.getLogger("mossvl_ascend.patches.pd_disaggregation")
    plugin_logger.addHandler(collect)  # sglang resets the root logger's handlers: listen on the plugin's own
    try:
        view = resolve(*argv)
    finally:
        plugin_logger.removeHandler(collect)
    assert (view.device, view.disaggregation_mode, view.disaggregation_transfer_backend) == ("npu", mode, "ascend")
    assert view.page_size == 128
    assert "PD over memfabric: store tcp://127.0.0.1:8100, protocol device_rdma" in lines
    if mode == "decode":  # stock's NPU choice stays (the CPU one is cpu_tensor)
        assert view.disaggregation_decode_retraction_backup != "cpu_tensor"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--disaggregation-transfer-backend", "ascend"],
            "--disaggregation-transfer-backend ascend cannot run on --device cpu: its engine moves npu memory",
        ),
        (
            ["--disaggregation-transfer-backend", "nixl"],
            "--disaggregation-transfer-backend nixl cannot run on --device cpu: its engine moves cuda memory",
        ),
        (
            ["--disaggregation-transfer-backend", "mooncake_tcp", "--disaggregation-enable-kv-checksum"],
            "--disaggregation-enable-kv-checksum cannot run on --device cpu: stock computes the checksum on cuda",
        ),
    ],
)
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_a_cpu_pd_worker_refuses_what_only_another_device_runs_with_one_line(pd_hooks_applied, argv, expected, mode):
    """Oracle: the engines' own sources (nixl registers "VRAM", memfabric dlopens libascend_hal.so, the checksum is
    built on ``cuda:<gpu_id>``): each would fail in the scheduler after the model loaded, or not at all on CPU."""
    assert expected in refusal("--device", "cpu", "--dtype", "float32", "--disaggregation-mode", mode, *argv)


def test_a_cpu_pd_worker_over_mooncake_tcp_still_resolves(pd_hooks_applied, monkeypatch):
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    argv = ["--device", "cpu", "--dtype", "float32", "--disaggregation-transfer-backend", "mooncake_tcp"]
    view = resolve(*argv, "--disaggregation-mode", "decode")
    assert view.disaggregation_transfer_backend == "mooncake"
    assert view.disaggregation_decode_retraction_backup == "cpu_tensor"


def test_a_cpu_prefill_worker_sends_a_cached_prefix_with_the_rest_of_the_kv(pd_hooks_applied, monkeypatch):
    """Oracle: stock's early send (``prefill.py`` ``maybe_send_cached_prefix_chunk``) records a ``torch.cuda.Event``,
    which killed a CPU prefill scheduler at the first repeated request (tests/test_serving_pd_faults.py); its switch
    is off for a prefill worker, refused when the user turned it on, and a decode worker's environment is untouched."""
    name = "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"
    argv = ["--device", "cpu", "--dtype", "float32", "--disaggregation-transfer-backend", "mooncake_tcp"]
    monkeypatch.delenv(name, raising=False)
    resolve(*argv, "--disaggregation-mode", "decode")
    assert name not in os.environ
    resolve(*argv, "--disaggregation-mode", "prefill")
    assert os.environ[name] == "0"
    monkeypatch.setenv(name, "true")
    assert f"{name}=true cannot run on a PD prefill server off CUDA" in refusal(
        *argv, "--disaggregation-mode", "prefill"
    )
