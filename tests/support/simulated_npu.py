"""A fresh interpreter that simulates an Ascend host (labelled stand-ins throughout), for import-time tests.

* sglang's ``is_npu()`` predicate answers True (``torch.npu`` is not faked: that drags in torchair and
  transformers' NPU integrations, which are not under test);
* ``torch_npu`` and its submodules are import-only stand-ins: public attributes are callables that raise
  NotImplementedError naming themselves; only the patch API the test selects (torch-npu 2.8 ``_apply_patches`` or
  2.10+ ``_apply_all_patches``) exists, and it records its calls;
* ``sgl_kernel_npu`` is installed broken: ``sgl_kernel_npu.norm`` raises
  ``ModuleNotFoundError: No module named 'triton.language.extra.cann'`` like a kernel built for triton-ascend
  >= 3.2.1 on 3.2.0.

In-process, :func:`npu_attention_on_cpu` runs the attention core on CPU tensors through its NPU primitives and the
STAND-IN ``torch_npu`` of tests/fake_torch_npu.py, and :class:`HostReads` counts what would read device values on
the host (or copy host data to the device) while it is active.
"""

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from fake_torch_npu import installed_fake_torch_npu
from mossvl_ascend.attention import core, primitives

REPO_ROOT = Path(__file__).resolve().parents[2]

SIMULATED_NPU_PRELUDE = textwrap.dedent(
    '''
    import importlib.abc, importlib.machinery, json, logging, sys, types

    config = json.loads(sys.argv[1])
    patch_calls = []

    class UnreachedNpuOp:
        """Stand-in torch_npu attribute: importable, raises if ever called."""
        def __init__(self, name):
            self._name = name
        def __call__(self, *args, **kwargs):
            raise NotImplementedError(f"stand-in {self._name} was called")
        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return UnreachedNpuOp(f"{self._name}.{attr}")

    class StandInModule(types.ModuleType):
        def __getattr__(self, attr):
            if attr.startswith("_"):
                raise AttributeError(attr)
            return UnreachedNpuOp(f"{self.__name__}.{attr}")

    class StandInTorchNpuFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            if name == "torch_npu" or name.startswith("torch_npu."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None
        def create_module(self, spec):
            return StandInModule(spec.name)
        def exec_module(self, module):
            module.__path__ = []
            if module.__name__ != "torch_npu":
                return
            if config["torch_npu_patch_api"] == "apply_patches":  # torch-npu 2.8
                module._apply_patches = lambda patches: patch_calls.append(
                    ["_apply_patches", [p[0] for p in patches]])
            else:  # torch-npu 2.10+
                module._apply_all_patches = lambda: patch_calls.append(["_apply_all_patches"])

    sys.meta_path.insert(0, StandInTorchNpuFinder())
    sys.path.insert(0, config["broken_kernel_dir"])

    import sglang.srt.utils as sglang_utils
    import sglang.srt.utils.common as sglang_common
    sglang_common.is_npu = sglang_utils.is_npu = lambda: True

    plugin_warnings = []
    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                plugin_warnings.append(record.getMessage())
    logging.getLogger("mossvl_ascend").addHandler(Collect())

    if config["register_plugin"]:
        from mossvl_ascend.patches import npu_imports
        from mossvl_ascend.registry import apply_patches
        apply_patches(patches=npu_imports.PATCHES)

    import importlib
    imported = {}
    for name in config["imports"]:
        try:
            importlib.import_module(name)
            imported[name] = "ok"
        except BaseException as exc:
            imported[name] = f"{type(exc).__name__}: {exc}"
    '''
)

REPORT = textwrap.dedent(
    """
    qwen3 = sys.modules.get("sglang.srt.models.qwen3")
    kernel = getattr(qwen3, "split_qkv_rmsnorm_rope", None)
    from mossvl_ascend.patches import npu_imports
    print("REPORT" + json.dumps({
        "imported": imported,
        "patch_calls": patch_calls,
        "plugin_warnings": plugin_warnings,
        "qwen3_uses_fallback": kernel is npu_imports.split_qkv_rmsnorm_rope,
    }))
    """
)


def run_python(code, *argv):
    """Run ``code`` in a fresh interpreter with the CPU engine environment (see conftest)."""
    python_path = os.pathsep.join([str(REPO_ROOT / "sglang"), str(REPO_ROOT / "cpu_shim"), str(REPO_ROOT)])
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=python_path),
        timeout=300,
    )


def run_simulated_npu(tmp_path, imports, register_plugin, torch_npu_patch_api="apply_all_patches"):
    """Import ``imports`` in a fresh interpreter on the simulated Ascend host; return its report."""
    norm = tmp_path / "broken_kernel" / "sgl_kernel_npu" / "norm"
    norm.mkdir(parents=True, exist_ok=True)
    (norm.parent / "__init__.py").write_text("")
    (norm / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'triton.language.extra.cann'\", "
        "name='triton.language.extra.cann')\n"
    )
    config = {
        "broken_kernel_dir": str(norm.parents[1]),
        "torch_npu_patch_api": torch_npu_patch_api,
        "register_plugin": register_plugin,
        "imports": imports,
    }
    proc = run_python(SIMULATED_NPU_PRELUDE + REPORT, json.dumps(config))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT") :])


# aten ops that read a device value on the host (a sync per call on an NPU), or copy host data to the device.
_HOST_READ_OPS = {"_local_scalar_dense", "equal", "nonzero", "_unique2", "masked_select", "is_nonzero"}
_HOST_COPY_OPS = {"lift_fresh"}


class HostReads(TorchDispatchMode):
    """Counts host reads (``.item()``, ``int()``/``bool()`` of a tensor, ``torch.equal``, ``nonzero``, and
    ``.tolist()``, which no dispatch mode sees: it is wrapped while active) and host-to-device copies
    (``torch.tensor`` / ``as_tensor`` of host data) run while active, outside :meth:`paused` spans."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.copies: list[str] = []
        self._paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._paused and name in _HOST_READ_OPS:
            self.reads.append(name)
        if not self._paused and name in _HOST_COPY_OPS:
            self.copies.append(name)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        counter, tolist = self, torch.Tensor.tolist

        def counted_tolist(tensor):
            if not counter._paused:
                counter.reads.append("tolist")
            return tolist(tensor)

        torch.Tensor.tolist = counted_tolist  # shadows the C method until __exit__
        return super().__enter__()

    def __exit__(self, *exc):
        del torch.Tensor.tolist
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def paused(self):
        """What runs inside (the stand-in of a device kernel) is not counted."""
        self._paused = True
        try:
            with _disable_current_modes():
                yield
        finally:
            self._paused = False


@contextlib.contextmanager
def npu_attention_on_cpu(monkeypatch, *, paged=False, host_reads: HostReads | None = None):
    """The attention core on CPU tensors through the NPU primitives: the CPU's fused primitive is the NPU one
    (``FUSED_ATTENTION_BY_DEVICE``, with its lengths-taking form), the op it calls is the strict STAND-IN FIA, and
    with ``paged`` the opt-in paged decode (``MOSSVL_NPU_PAGED_ATTENTION=1``) is on. Yields the FIA calls, each its
    keyword arguments plus ``query_shape``; the stand-in runs outside ``host_reads``' count."""
    calls = []
    with installed_fake_torch_npu() as torch_npu:
        stand_in = torch_npu.npu_fused_infer_attention_score

        def recorded(query, key, value, **kwargs):
            calls.append(dict(kwargs, query_shape=tuple(query.shape)))
            if host_reads is None:
                return stand_in(query, key, value, **kwargs)
            with host_reads.paused():
                return stand_in(query, key, value, **kwargs)

        torch_npu.npu_fused_infer_attention_score = recorded
        monkeypatch.setitem(primitives.FUSED_ATTENTION_BY_DEVICE, "cpu", primitives.FUSED_ATTENTION_BY_DEVICE["npu"])
        if paged:
            monkeypatch.setenv("MOSSVL_NPU_PAGED_ATTENTION", "1")
            monkeypatch.setattr(core, "PAGED_ATTENTION_DEVICES", ("cpu",))
        yield calls
