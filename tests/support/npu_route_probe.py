"""Test-only sglang plugin: a CPU server that records the route MOSS-VL takes, optionally the ``--device npu`` one.

sglang loads it in every server process like any plugin (``sglang.srt.plugins`` entry point); the entry point
exists only in the throw-away distribution :func:`install_probe` writes for one test, and the probe does nothing
unless ``MOSSVL_NPU_ROUTE_PROBE`` names the JSON file to record into. With ``MOSSVL_NPU_ROUTE_PROBE_MODE=npu`` the
loaded model runs through :func:`support.npu_layers.npu_route` (every stock layer's NPU branch, the vision tower's
``ascend_attn`` backend and NPU rotary, the plugin's NPU attention primitive, all on the STAND-IN torch_npu) and the
KV cache is stock's ``NPUMHATokenToKVPool``, and the sampler takes the ascend backend (the source PR's
``--sampling-backend ascend``, which stock overrides to pytorch for ``--device cpu``).

Recorded (rewritten after every model forward and every sampling step): each module class that ran, with the
method its dispatch chose (``BaseFusedOp``) or the backend it used (``RadixAttention``: the attention backend class
and forward mode; ``VisionAttention``: its ``qkv_backend`` class; ``Sampler``: plain or ascend), the KV pool class,
how often each stand-in ``torch_npu`` op was called, and how many prefill batches took running decode rows in.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections import Counter, defaultdict
from pathlib import Path

import torch

PROBE_ENV = "MOSSVL_NPU_ROUTE_PROBE"
MODE_ENV = "MOSSVL_NPU_ROUTE_PROBE_MODE"
ENTRY_POINT = "mossvl_npu_route_probe"
TESTS_DIR = Path(__file__).resolve().parents[1]

logger = logging.getLogger(__name__)
_route = contextlib.ExitStack()  # the npu route stays entered for the process's lifetime
_runner = []  # the model runner, once loaded
_seen: dict[str, set] = defaultdict(set)
_op_calls: Counter = Counter()
_mixed_batches: list = []


def install_probe(directory: Path) -> str:
    """Write a distribution that declares the probe's entry point under ``directory``; return the PYTHONPATH
    entries a server needs to load it (the distribution and the tests directory)."""
    info = directory / f"{ENTRY_POINT}-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {ENTRY_POINT}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{ENTRY_POINT} = support.npu_route_probe:register\n")
    return os.pathsep.join([str(directory), str(TESTS_DIR)])


def register() -> None:
    if not os.environ.get(PROBE_ENV):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.load_model", _after_model_load, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.mix_with_running", _count_mixed_batch, HookType.AFTER
    )
    if os.environ.get(MODE_ENV) == "npu":
        from mossvl_ascend.patches import ascend_sampler, vision_rotary
        from mossvl_ascend.registry import apply_patch

        HookRegistry.register(
            "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mha_kv_pool",
            _npu_kv_pool,
            HookType.AROUND,
        )
        # NPU-only stock-layer patches: the plugin applies them on an Ascend host, not on this CPU one.
        for patch in vision_rotary.PATCHES + ascend_sampler.PATCHES:
            apply_patch(patch)


def _npu_kv_pool(original, configurator, *args, **kwargs):
    """The pool an Ascend server builds for MOSS-VL (``NPUMHATokenToKVPool``) instead of the CPU one."""
    from sglang.srt.hardware_backend.npu.memory_pool_npu import NPUMHATokenToKVPool

    kwargs["mha_pool_class"] = NPUMHATokenToKVPool
    return original(configurator, *args, **kwargs)


def _after_model_load(result, runner, *args, **kwargs):
    model = runner.model
    if os.environ.get(MODE_ENV) == "npu":
        from support.npu_layers import npu_route

        fake = _route.enter_context(npu_route(model))
        # What --sampling-backend ascend sets; stock forces the pytorch sampler for --device cpu.
        runner.sampler.use_ascend_backend = True
        for name, op in list(vars(fake).items()):
            if callable(op) and not name.startswith("__"):
                setattr(fake, name, _counted(name, op))
    _runner.append(runner)
    logger.warning("npu route probe (%s) recording into %s", os.environ.get(MODE_ENV, "cpu"), os.environ[PROBE_ENV])
    torch.nn.modules.module.register_module_forward_hook(_record_module, with_kwargs=True)
    return result


def _count_mixed_batch(result, *args, **kwargs):
    """A prefill batch took the running decode rows in (``--enable-mixed-chunk``)."""
    _mixed_batches.append(1)
    return result


def _counted(name, op):
    def call(*args, **kwargs):
        if not torch.compiler.is_compiling():
            _op_calls[name] += 1
        return op(*args, **kwargs)

    return call


def _record_module(module, args, kwargs, output):
    """Records eager forwards only: traced by ``torch.compile`` (a CPU decode graph, ``--enable-torch-compile``) the
    hook would break the step's graph at every module (its bookkeeping is not traceable), so a captured step is
    recorded by nothing, and the prefill that precedes every decode records the route."""
    if torch.compiler.is_compiling():
        return
    from sglang.kernels.fused_op import BaseFusedOp

    kind = type(module)
    key = f"{kind.__module__}.{kind.__qualname__}"
    if not key.startswith("sglang."):
        _seen[key].add("forward")
    elif isinstance(module, BaseFusedOp):
        method = module._forward_method
        _seen[key].add(getattr(method, "__name__", repr(method)))
    elif kind.__name__ == "RadixAttention":
        forward_batch = args[3] if len(args) > 3 else kwargs["forward_batch"]
        backend = type(_runner[0].attn_backend)
        cross = "cross" if module.is_cross_attention else "self"
        _seen[key].add(f"{backend.__module__}.{backend.__qualname__} {forward_batch.forward_mode.name} {cross}")
    elif kind.__name__ == "VisionAttention":
        backend = type(module.qkv_backend)
        _seen[key].add(f"{backend.__module__}.{backend.__qualname__}")
    elif kind.__name__ == "Sampler":
        _seen[key].add("ascend backend" if module.use_ascend_backend else "plain")
    else:
        _seen[key].add("forward")
    if module is _runner[0].model or kind.__name__ == "Sampler":
        _dump(_runner[0])


def _dump(runner) -> None:
    pool = type(runner.token_to_kv_pool)
    record = {
        "modules": {name: sorted(labels) for name, labels in sorted(_seen.items())},
        "kv_pool": f"{pool.__module__}.{pool.__qualname__}",
        "torch_npu_ops": dict(sorted(_op_calls.items())),
        "mixed_batches": len(_mixed_batches),
    }
    Path(os.environ[PROBE_ENV]).write_text(json.dumps(record, indent=1))
