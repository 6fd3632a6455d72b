"""CPU tensor parallelism: collectives over gloo instead of a PyNccl communicator (issue 14, item 13).

Catalog
-------
**Hook: no PyNccl communicator on the CPU engine** (item 13)

- *target*: ``sglang.srt.distributed.parallel_state.init_model_parallel_group`` (BEFORE).
- *why*: stock 0.5.23 defaults ``use_pynccl`` to True on every in-tree platform that is not NPU/XPU, so
  with ``SGLANG_USE_CPU_ENGINE=1`` and ``--tp-size 2`` each scheduler builds a ``PyNcclCommunicator`` for a
  CPU device and dies at start-up (``ValueError: Expected a cuda device, but got: cpu``). The CPU
  collectives themselves already exist in ``GroupCoordinator``: ``all_reduce`` of a CPU tensor uses
  ``torch.distributed`` on the group (gloo, from ``get_default_distributed_backend("cpu")``) when the
  shared-memory kernel is unavailable, and the all-gather / reduce-scatter paths have ``_is_cpu``
  branches. Only the communicator default is wrong.
- *how*: registered only when sglang's ``is_cpu()`` holds (CPU engine); a call that leaves ``use_pynccl``
  unset gets ``use_pynccl=False``. An explicit ``use_pynccl`` from the caller is kept. Every group of the
  rank (world, tp, pp, ...) is built with gloo as the stock CPU path intends. NPU (HCCL, stock already
  skips PyNccl there) and CUDA register nothing.
- *upstream status / when to remove*: open in 0.5.23. Remove when stock ``init_model_parallel_group``
  excludes the CPU engine from the PyNccl default (as it does NPU/XPU).
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

TARGET = "sglang.srt.distributed.parallel_state.init_model_parallel_group"


def without_pynccl(*args, **kwargs):
    """BEFORE hook: the CPU engine's groups use gloo collectives, never a (CUDA-only) PyNccl communicator."""
    if kwargs.get("use_pynccl") is None and len(args) < 4:
        kwargs["use_pynccl"] = False
    return args, kwargs


def register() -> None:
    from sglang.srt.utils import is_cpu

    if is_cpu():
        HookRegistry.register(TARGET, without_pynccl, HookType.BEFORE)
