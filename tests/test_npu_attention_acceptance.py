"""benchmarks/npu_acceptance.py, the Ascend acceptance check of the plugin's NPU attention calls, on this CPU host:
without an NPU it says so and exits non-zero; through the STAND-IN torch_npu (``--stand-in``) every case passes,
and its judge fails a wrong op result (oracle: the CPU fp64 reference it compares with)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "npu_acceptance.py"
# The decode graph cases the script's docstring promises: (bucket, rows, page size); four layers each.
GRAPH_CASES = ((1, 1, 128), (16, 16, 128), (16, 13, 128), (16, 13, 16))


@pytest.fixture(scope="module")
def acceptance():
    spec = importlib.util.spec_from_file_location("npu_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve annotations through it
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_without_an_npu_it_says_so_and_exits_non_zero():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "cpu_shim"), str(ROOT / "sglang")]))
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no Ascend NPU on this host" in proc.stdout and "torch_npu" in proc.stdout


def test_every_case_passes_through_the_stand_in(acceptance, capsys):
    assert acceptance.main(["--stand-in"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("RESULT passed=") and " failed=0 " in lines[-1]
    table = "\n".join(lines)
    for case in ("(a) PFA", "(b) sparse_mode=3", "(c) Q_S=1", "(d) page attention", "(e) empty block table"):
        assert case in table
    for name, *_ in acceptance.core_cases():
        assert table.count(f"{name} ") >= 4  # bf16 and fp16, tiny and instruct
    graph_cases = [f"decode graph bucket {bs}, {rows} rows, page {page}" for bs, rows, page in GRAPH_CASES]
    for case in graph_cases:
        assert table.count(case) == 2  # bf16 and fp16
    assert all("4 records, LSE asked by 0" in line for line in lines if "decode graph" in line)


def test_the_judge_fails_a_wrong_result(acceptance):
    """An op result that is not attention over the attended keys (here: the keys of the other polarity) fails."""
    q, k, v = acceptance.random_bnsd(1, 4, 32, torch.bfloat16, seed=0, shape=(4, 2, 16))
    attended = torch.rand(1, 1, 4, 32, generator=torch.Generator().manual_seed(1)) < 0.5
    attended[..., 0] = True

    def inverted():
        from support.precision import masked_fp64_reference

        out, lse = masked_fp64_reference(q, k, v, ~attended | (torch.arange(32) == 0), 0.25)
        return out.to(q.dtype), lse.float()[..., None]

    runner = type("CpuRunner", (), {"timed": lambda self, fn: (fn(), 0.0)})()
    outcome = acceptance.judge_op("inverted mask", torch.bfloat16, runner, inverted, q, k, v, attended, 0.25)
    assert outcome.status == "FAIL"
