"""MOSS-VL on Ascend NPUs: patches to stock sglang 0.5.23, delivered as an sglang plugin.

sglang discovers this package through the ``sglang.srt.plugins`` entry point and calls
:func:`register` in the launcher, the scheduler and every worker process
(``sglang.srt.plugins.load_plugins``); ``SGLANG_PLUGINS`` can exclude it by name
(``mossvl_ascend``). Each patch lives in the module for its sglang area, whose
docstring carries the full catalog entry (target, why, how, when removable).

Patch catalog
=============
(filled in by the patch modules; see each module's docstring)
"""

import logging

logger = logging.getLogger(__name__)

PLUGIN_NAME = "mossvl_ascend"

# One module per patched sglang area; each exposes ``register()``.
PATCH_MODULES: tuple[str, ...] = ("npu_imports", "server_args", "radix_prefix", "encoder_cache_key", "request_validation", "native_attention", "ascend_backend", "cpu_attention")


def register() -> None:
    """Register every patch with sglang's HookRegistry (called by sglang's plugin loader)."""
    import importlib

    for name in PATCH_MODULES:
        importlib.import_module(f"{__name__}.{name}").register()
    logger.info("%s: registered patch modules %s", PLUGIN_NAME, ", ".join(PATCH_MODULES) or "(none)")
