"""The plugin loads exactly as production loads it: sglang's entry-point discovery in a fresh interpreter.

Each case runs ``sglang.srt.plugins.load_plugins()`` in a subprocess (the CPU environment, no torch_npu) and
reports which hooks our plugin registered and whether sglang's HookRegistry applied every one of them. The cases'
interpreters start together (each imports sglang on one core for ~12 s); each test reads only its own.
"""

import functools
import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from support.together import started_together

REPO_ROOT = Path(__file__).resolve().parents[1]

# Besides what the plugin registered: every object a hook replaced (recorded as stock's ``_apply_target`` resolves
# it), and the module attributes that still hold one after the load (stock's propagation leaves none).
PROBE = r"""
import json, logging, pkgutil, sys, types
logging.basicConfig(level=logging.INFO)
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
replaced = []
stock_apply_target = HookRegistry.__dict__["_apply_target"].__func__
def recording_apply_target(cls, target, hooks):
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
    replaced.append((target, raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else getattr(owner, attr)))
    return stock_apply_target(cls, target, hooks)
HookRegistry._apply_target = classmethod(recording_apply_target)
load_plugins()
ours = sorted(
    t for t, hooks in HookRegistry._hooks.items() if any(s and s.plugin_name == "mossvl_ascend" for _, _, s in hooks)
)
replaced_ids = {id(obj) for _, obj in replaced}
stale = sorted(
    f"{module.__name__}.{name}"
    for module in list(sys.modules.values()) if isinstance(module, types.ModuleType)
    for name, value in list(getattr(module, "__dict__", {}).items()) if id(value) in replaced_ids
)
import mossvl_ascend
print("PROBE" + json.dumps({"ours": ours, "unapplied": [t for t in ours if t not in HookRegistry._patched],
                            "modules": list(mossvl_ascend.PATCH_MODULES), "replaced": [t for t, _ in replaced],
                            "stale": stale}))
"""


def run_probe(extra_env: dict[str, str]) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    env.update(
        SGLANG_USE_CPU_ENGINE="1",
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "sglang"), str(REPO_ROOT / "cpu_shim")]),
        **extra_env,
    )
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(out for out in proc.stdout.splitlines() if out.startswith("PROBE"))
    return json.loads(line[len("PROBE") :]), proc.stderr


# Each case's extra environment.
CASES = {"cpu": {}, "whitelist_without_us": {"SGLANG_PLUGINS": "smg-zmq"}}


@pytest.fixture(scope="module")
def probes():
    """Every case's probe, started at once: case name -> a future of ``run_probe``'s result."""
    with started_together({name: functools.partial(run_probe, env) for name, env in CASES.items()}) as futures:
        yield futures


def test_entry_point_is_registered():
    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert names.get("mossvl_ascend") == "mossvl_ascend:register"


def cpu_hook_patches():
    """The catalog's hook patches for the CPU platform that need no extra module (no torch_npu here)."""
    from mossvl_ascend.registry import AT_LOAD, CPU, all_patches

    return [p for p in all_patches() if CPU in p.platforms and p.kind != AT_LOAD and p.requires_module is None]


def test_load_plugins_applies_exactly_the_catalog_hooks_for_cpu(probes):
    report, log = probes["cpu"].result()
    assert "Executed general plugin: mossvl_ascend" in log
    assert "Failed to execute general plugin: mossvl_ascend" not in log
    assert report["unapplied"] == [], f"hooks registered but not applied: {report['unapplied']}\n{log[-3000:]}"
    expected = cpu_hook_patches()
    assert report["ours"] == sorted({p.target for p in expected})
    for patch in expected:  # one log line per applied patch
        assert f"mossvl_ascend: {patch.title}: {patch.kind.value} hook on {patch.target}" in log


def test_after_the_load_no_module_holds_an_object_a_hook_replaced(probes):
    """The plugin indexes stock's propagation (``patches/hook_propagation.py``): every ``from X import f`` copy of a
    hooked target is rebound all the same, checked by one walk of every module attribute after the load."""
    report, log = probes["cpu"].result()
    assert "HookRegistry.apply_hooks changed at plugin load" in log
    assert set(report["ours"]) <= set(report["replaced"])
    assert report["stale"] == []


def test_sglang_plugins_whitelist_excludes_us(probes):
    report, log = probes["whitelist_without_us"].result()
    assert "Skipping plugin mossvl_ascend (not in SGLANG_PLUGINS)" in log
    assert "Executed general plugin: mossvl_ascend" not in log
    assert report["ours"] == []
