"""Test-session set-up: the CPU engine environment, before anything imports sglang.

The Makefile sets the same variables; setting them here too lets `pytest` run directly.
"""

import os
import sys
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
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(PLUGIN_SRC), str(CPU_SHIM), os.environ.get("PYTHONPATH", "")) if p
)


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
