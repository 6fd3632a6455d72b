"""The patch records are the single source of truth: the catalog is rendered from them, every record names a real
sglang target and a real test, and the platform decides what is applied (nothing on GPUs).

Oracles: the committed ``sglang/PATCHES.md`` (regenerate with ``make catalog``), sglang's own
modules (``pkgutil.resolve_name``), the test files' source, and sglang's HookRegistry after ``apply_patches``.
"""

from __future__ import annotations

import ast
import inspect
import pkgutil
from pathlib import Path

import pytest
from sglang.srt.plugins.hook_registry import HookRegistry

import mossvl_ascend
from fake_torch_npu import installed_fake_torch_npu
from mossvl_ascend.catalog import render_catalog
from mossvl_ascend.registry import AT_LOAD, CPU, NPU, all_patches, all_verified, apply_patches, patch_modules
from support.hooks import patches_applied

REPO_ROOT = Path(__file__).resolve().parents[1]
CATALOG = REPO_ROOT / "sglang" / "PATCHES.md"


def test_committed_catalog_is_rendered_from_the_records():
    assert CATALOG.read_text() == render_catalog(), "sglang/PATCHES.md is stale: run `make catalog`"


def test_every_listed_module_declares_its_patches_and_no_module_registers_hooks_itself():
    plugin_dir = Path(mossvl_ascend.__file__).parent
    listed = {f"mossvl_ascend.patches.{name}" for name in mossvl_ascend.PATCH_MODULES}
    for module in patch_modules():
        assert isinstance(module.PATCHES, tuple), module.__name__
    for path in plugin_dir.rglob("*.py"):
        source = path.read_text()
        if path.name != "registry.py":
            assert "HookRegistry.register(" not in source, f"{path} registers a hook outside the records"
        if "PATCHES = " in source:
            module = ".".join(("mossvl_ascend", *path.relative_to(plugin_dir).with_suffix("").parts))
            assert module in listed, f"{path} declares patches but is not a listed module of mossvl_ascend.patches"


@pytest.mark.parametrize("patch", all_patches(), ids=lambda p: p.title)
def test_record_is_complete_and_targets_exist_in_sglang(patch):
    for field in ("title", "why", "how", "upstream", "remove_when"):
        assert getattr(patch, field).strip(), f"{patch.target}: empty {field}"
    assert patch.platforms and patch.platforms <= {NPU, CPU}, "patches never apply on CUDA/GPU hosts"
    if patch.kind == AT_LOAD and patch.target.startswith("sgl_kernel_npu."):
        return  # an import fallback: its target is the kernel module absent here
    with installed_fake_torch_npu():  # the Ascend backend module imports only with (a stand-in for) torch_npu
        owner_path, attr = patch.target.rsplit(".", 1)
        owner = pkgutil.resolve_name(owner_path)
        assert hasattr(owner, attr), f"{patch.target} does not exist in sglang 0.5.23"
    assert callable(patch.hook) and inspect.getmodule(patch.hook).__name__.startswith("mossvl_ascend.")


def _test_functions(test_file: Path) -> set[str]:
    tree = ast.parse(test_file.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


@pytest.mark.parametrize("entry", all_verified(), ids=lambda v: v.title)
def test_verified_entries_name_existing_tests(entry):
    assert entry.pinned_by
    for node_id in entry.pinned_by:
        file_name, test_name = node_id.split("::")
        assert test_name in _test_functions(REPO_ROOT / file_name), f"{node_id} does not exist"


def test_nothing_is_applied_on_a_gpu_host():
    with patches_applied():
        assert apply_patches("gpu") == []
        assert not HookRegistry._hooks


def test_cpu_and_npu_platforms_apply_their_records():
    hook_patches = [p for p in all_patches() if p.kind != AT_LOAD and p.requires_module is None]
    with patches_applied():
        applied = apply_patches(CPU, hook_patches)
        assert applied == [p for p in hook_patches if CPU in p.platforms]
        assert set(HookRegistry._hooks) == {p.target for p in applied}
    with patches_applied():
        applied = apply_patches(NPU, hook_patches)
        assert applied == [p for p in hook_patches if NPU in p.platforms]
