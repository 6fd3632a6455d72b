"""The plugin's changes to stock sglang as data, and the one function that applies them.

Every patch module declares ``PATCHES``, a tuple of :class:`Patch` records (what is changed, on which platforms,
why, how, upstream status, when it can go), and may declare ``VERIFIED``, a tuple of :class:`Verified` records for
behaviour the source PR patched but sglang 0.5.23 already gets right (the evidence is the test that pins it).
:func:`apply_patches` is the only place that decides what runs where; ``PATCHES.md`` is rendered from the same
records (:mod:`mossvl_ascend.catalog`), and the test suite checks that the catalog is current and that the hooks
sglang applies are exactly the records for the platform.
"""

from __future__ import annotations

import importlib
import logging
from typing import Iterable

from sglang.srt.plugins.hook_registry import HookRegistry

from mossvl_ascend.patch_record import AT_LOAD, CPU, NPU, PATCH_MODULES, Patch, Verified

logger = logging.getLogger(__name__)


def current_platform() -> str:
    """``npu`` on an Ascend host, ``gpu`` on a CUDA/ROCm/XPU host (stock sglang, nothing applied), else ``cpu``."""
    from sglang.srt.utils import is_cuda_alike, is_npu, is_xpu

    if is_npu():
        return NPU
    if is_cuda_alike() or is_xpu():
        return "gpu"
    return CPU


def patch_modules() -> list:
    """The patch modules (``mossvl_ascend.patches.*``), imported, in :data:`PATCH_MODULES` order."""
    return [importlib.import_module(f"mossvl_ascend.patches.{name}") for name in PATCH_MODULES]


def all_patches() -> list[Patch]:
    return [patch for module in patch_modules() for patch in module.PATCHES]


def all_verified() -> list[Verified]:
    return [entry for module in patch_modules() for entry in getattr(module, "VERIFIED", ())]


def _importable(module_name: str | None) -> bool:
    if module_name is None:
        return True
    try:
        importlib.import_module(module_name)
    except ImportError as exc:
        logger.debug("%s not importable (%s)", module_name, exc)
        return False
    return True


def patches_for(platform: str, patches: Iterable[Patch]) -> list[Patch]:
    """The patches that apply on ``platform`` in this process (their required module imports)."""
    return [p for p in patches if platform in p.platforms and _importable(p.requires_module)]


def apply_patch(patch: Patch) -> None:
    """Register one patch with sglang's HookRegistry (or make its load-time change) and log it."""
    if patch.kind == AT_LOAD:
        if patch.hook():
            logger.info("mossvl_ascend: %s: %s changed at plugin load", patch.title, patch.target)
        return
    HookRegistry.register(patch.target, patch.hook, patch.kind)
    logger.info("mossvl_ascend: %s: %s hook on %s", patch.title, patch.kind.value, patch.target)


def apply_patches(platform: str | None = None, patches: Iterable[Patch] | None = None) -> list[Patch]:
    """Apply every patch for ``platform`` (default: this host's); returns the ones applied."""
    platform = platform or current_platform()
    chosen = patches_for(platform, all_patches() if patches is None else patches)
    for patch in chosen:
        apply_patch(patch)
    return chosen
