"""min-p requests on the ascend sampling backend take its sorted path.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import inspect
from typing import Callable

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.patch_record import NPU, Patch


def min_p_on_the_sorted_path(original: Callable, *args, **kwargs):
    """AROUND hook on ``top_k_top_p_min_p_sampling_from_logits_ascend``: a batch that needs min-p never takes the
    ``npu_top_k_top_p`` branch (whose min-p step raises); the sorted branch applies top-k, top-p and min-p."""
    call = inspect.signature(original).bind(*args, **kwargs)
    if call.arguments["need_min_p_sampling"]:
        call.arguments["npu_top_k_top_p_eligible"] = False
    return original(*call.args, **call.kwargs)


PATCHES = (
    Patch(
        title="min-p sampling on the ascend sampler does not crash",
        target="sglang.srt.layers.sampler.top_k_top_p_min_p_sampling_from_logits_ascend",
        kind=HookType.AROUND,
        hook=min_p_on_the_sorted_path,
        platforms=frozenset({NPU}),
        why=(
            "with `--sampling-backend ascend` (the source PR's launch flag), a batch whose top_k values all lie in "
            "[1, 1024] is filtered by `torch_npu.npu_top_k_top_p`; if any request also sets min_p > 0, stock "
            "computes `probs.max(dim=-1) * min_ps`, multiplying the (values, indices) pair `Tensor.max(dim=...)` "
            "returns, and the whole batch fails with a TypeError. Found by `tests/test_npu_route_layers.py` "
            "through the stand-in; not run on hardware."
        ),
        how=(
            "such a batch is sent to the same function's sorted branch (`npu_top_k_top_p_eligible=False`), which "
            "implements top-k, top-p and min-p in torch; batches without min-p keep the fused filter"
        ),
        upstream="open in sglang 0.5.23 (`layers/sampler.py`, `top_k_top_p_min_p_sampling_from_logits_ascend`)",
        remove_when="the npu_top_k_top_p branch takes `.values` of the row maxima",
    ),
)
