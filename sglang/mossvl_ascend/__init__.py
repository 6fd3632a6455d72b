"""MOSS-VL on Ascend NPUs: patches to stock sglang 0.5.23, delivered as an sglang plugin.

sglang discovers this package through the ``sglang.srt.plugins`` entry point and calls :func:`register` in the
launcher, the scheduler and every worker process (``sglang.srt.plugins.load_plugins``); ``SGLANG_PLUGINS`` can
exclude it by name (``mossvl_ascend``).

The package is the machinery (:mod:`~mossvl_ascend.registry`, :mod:`~mossvl_ascend.catalog`), the attention core
(:mod:`mossvl_ascend.attention`, pure torch below the sglang adapters) and :mod:`mossvl_ascend.patches`, one module
per patched sglang area. Each patch module declares its changes to sglang as data (``PATCHES``, and ``VERIFIED``
for fixes 0.5.23 no longer needs; see :mod:`mossvl_ascend.registry`). :func:`register` applies the patches for this
host's platform (Ascend NPU or CPU; on CUDA and other GPUs nothing, so sglang runs exactly as stock) and logs one
line per patch; on those hosts it also pins glibc's malloc thresholds (:mod:`~mossvl_ascend.host_memory`).
The human catalog, ``sglang/PATCHES.md``, is generated from the same records (:mod:`mossvl_ascend.catalog`).
"""

import logging

from mossvl_ascend.host_memory import pin_malloc_thresholds
from mossvl_ascend.patch_record import ON_NPU_AND_CPU, PATCH_MODULES, PLUGIN_NAME

logger = logging.getLogger(__name__)

__all__ = ["PATCH_MODULES", "PLUGIN_NAME", "register"]


def register() -> None:
    """Apply this platform's patches (called by sglang's plugin loader in every process)."""
    from mossvl_ascend.registry import apply_patches, current_platform

    platform = current_platform()
    applied = apply_patches(platform)
    if platform in ON_NPU_AND_CPU:  # a GPU host runs as stock
        pin_malloc_thresholds()
    logger.info("%s: %d patches applied on platform %s", PLUGIN_NAME, len(applied), platform)
