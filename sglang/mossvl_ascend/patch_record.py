"""What the plugin is made of, as data every layer may read: its name, its patch modules in application order, and
the records each patch module declares (``PATCHES``: :class:`Patch`; ``VERIFIED``: :class:`Verified`). The registry
(:mod:`mossvl_ascend.registry`) applies the records; the catalog renders them. No sglang at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Union

if TYPE_CHECKING:
    from sglang.srt.plugins.hook_registry import HookType

PLUGIN_NAME = "mossvl_ascend"

# The modules of mossvl_ascend.patches, one per patched sglang area, in the order their patches are applied.
PATCH_MODULES: tuple[str, ...] = (
    "hook_propagation",
    "npu_imports",
    "npu_guards",
    "server_args",
    "radix_prefix",
    "paged_decode",
    "pd_disaggregation",
    "kv_pool",
    "pd_kv_transfer",
    "realtime_sessions",
    "realtime_api",
    "realtime_ui",
    "encoder_cache_key",
    "request_validation",
    "media_requests",
    "text_only_requests",
    "checkpoint_processor",
    "modelslim_w8a8",
    "chunked_prefill",
    "media_retention",
    "text_row_gate",
    "compact_visibility",
    "native_attention",
    "ascend_backend",
    "npu_graph",
    "vision_rotary",
    "ascend_sampler",
    "cpu_attention",
    "cpu_vision_attention",
    "cpu_graph",
    "cpu_parallel",
    "rank_report",
)

# A patch that is not a HookRegistry hook: its ``hook`` is called once at plugin load, before sglang applies the hooks,
# and returns True when it changed something: a module put into ``sys.modules`` before sglang imports it (an import
# fails before there is any attribute to wrap), or a change to the hook machinery itself.
AT_LOAD = "at-load"

# Platforms a patch can apply on. CUDA (and every other GPU) is never listed: there sglang runs exactly as stock.
NPU, CPU = "npu", "cpu"
ON_NPU_AND_CPU = frozenset({NPU, CPU})


@dataclass(frozen=True)
class Patch:
    """One change to stock sglang 0.5.23."""

    title: str
    target: str  # dotted path of what is wrapped (for AT_LOAD, what the load-time change provides or wraps)
    kind: Union[HookType, str]  # a HookType, or AT_LOAD
    hook: Callable  # the HookRegistry hook; for AT_LOAD a function called once at load, True when it changed something
    platforms: frozenset  # subset of {NPU, CPU}
    why: str
    how: str
    upstream: str  # status in sglang 0.5.23 / upstream
    remove_when: str
    # Applied only where this module imports (e.g. the Ascend backend needs torch_npu and sgl_kernel_npu).
    requires_module: str | None = None


@dataclass(frozen=True)
class Verified:
    """A fix of the source PR that sglang 0.5.23 does not need: no patch, a test pins the behaviour."""

    title: str
    target: str
    why_it_was_patched: str
    status: str
    pinned_by: tuple  # test node ids, "tests/test_x.py::test_name"
