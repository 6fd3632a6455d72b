"""A PD decode server refuses at start-up, with one line, the retraction backup a CPU cannot run.

Oracle: stock sglang's own failure without the refusal (``host_pool`` builds a host KV pool that registers memory
through CUDA: "Found no NVIDIA driver on your system", seen on this machine before the refusal existed); the refusal
must come from argument resolution, before any scheduler starts, and name the flag, the value and the way out.
"""

from __future__ import annotations

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
