"""CPU tensor parallelism: the CPU engine's process groups use gloo collectives, not a PyNccl communicator.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.patch_record import CPU, Patch


def without_pynccl(*args, **kwargs):
    """BEFORE hook: the CPU engine's groups use gloo collectives, never a (CUDA-only) PyNccl communicator."""
    if kwargs.get("use_pynccl") is None and len(args) < 4:
        kwargs["use_pynccl"] = False
    return args, kwargs


PATCHES = (
    Patch(
        title="CPU --tp-size > 1: process groups without a PyNccl communicator",
        target="sglang.srt.distributed.parallel_state.init_model_parallel_group",
        kind=HookType.BEFORE,
        hook=without_pynccl,
        platforms=frozenset({CPU}),
        why=(
            "stock 0.5.23 defaults `use_pynccl` to True on every in-tree platform that is not NPU/XPU, so on the CPU "
            "engine with `--tp-size 2` each scheduler builds a `PyNcclCommunicator` for a CPU device and dies at "
            "start-up (`ValueError: Expected a cuda device, but got: cpu`). The CPU collectives already exist in "
            "`GroupCoordinator` (`all_reduce` over `torch.distributed` on gloo, `_is_cpu` all-gather and "
            "reduce-scatter branches); only the communicator default is wrong."
        ),
        how=(
            "a call that leaves `use_pynccl` unset gets `use_pynccl=False`; an explicit choice is kept. Every group "
            "of the rank (world, tp, pp, ...) is then built with gloo as the stock CPU path intends. NPU already "
            "skips PyNccl (HCCL)."
        ),
        upstream="open in 0.5.23",
        remove_when="stock `init_model_parallel_group` excludes the CPU engine from the PyNccl default",
    ),
)
