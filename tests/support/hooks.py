"""Apply the plugin's patches for one test and put sglang back exactly as it was afterwards.

Patches go through :func:`mossvl_ascend.registry.apply_patch` and ``HookRegistry.apply_hooks`` exactly as sglang's
plugin loader does. On exit every wrapped attribute is restored, including the ``from ... import`` copies that
``HookRegistry`` propagated into other modules, and the registry's own state is restored, so the suite's result
does not depend on test order.
"""

from __future__ import annotations

import contextlib
import pkgutil
import sys

from sglang.srt.plugins.hook_registry import HookRegistry

from mossvl_ascend.registry import AT_LOAD, CPU, Patch, all_patches, apply_patch, patches_for


def _owner_and_attr(target: str):
    owner_path, attr = target.rsplit(".", 1)
    return pkgutil.resolve_name(owner_path), attr


# A target a class inherits (not in its own __dict__) is restored by deleting the wrapper set on the class.
_INHERITED = object()


def _restore(owner, attr: str, original) -> None:
    """Put ``original`` back on ``owner`` and in every module that received the wrapped copy."""
    wrapped = owner.__dict__[attr]
    if original is _INHERITED:
        delattr(owner, attr)
        return
    setattr(owner, attr, original)
    if wrapped is original:
        return
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for name, value in list(namespace.items()):
            if value is wrapped:
                setattr(module, name, original)


def _saved_originals(targets) -> list:
    originals = []
    for target in targets:
        owner, attr = _owner_and_attr(target)
        originals.append((owner, attr, owner.__dict__.get(attr, _INHERITED)))
    return originals


def _put_back(originals) -> None:
    for owner, attr, original in reversed(originals):
        if owner.__dict__.get(attr, _INHERITED) is not original:
            _restore(owner, attr, original)


@contextlib.contextmanager
def registry_restored_after():
    saved_hooks = {target: list(hooks) for target, hooks in HookRegistry._hooks.items()}
    saved_patched = set(HookRegistry._patched)
    try:
        yield
    finally:
        HookRegistry.reset()
        HookRegistry._hooks.update(saved_hooks)
        HookRegistry._patched.update(saved_patched)


@contextlib.contextmanager
def patches_applied(*patches: Patch):
    """Apply these hook patches (platform checks are the caller's business); restore everything on exit."""
    if any(p.kind == AT_LOAD for p in patches):
        raise ValueError("load-time changes (sys.modules, the hook machinery) are tested in a subprocess")
    with registry_restored_after():
        HookRegistry.reset()
        for patch in patches:
            apply_patch(patch)
        originals = _saved_originals(HookRegistry._hooks)
        HookRegistry.apply_hooks()
        assert HookRegistry._patched == set(HookRegistry._hooks), "a hook failed to apply"
        try:
            yield
        finally:
            _put_back(originals)


@contextlib.contextmanager
def sglang_restored_after_an_in_process_engine():
    """For a test that starts ``sglang.Engine`` in the test process: the engine's plugin loader applies every CPU
    patch to this process's sglang for good (and marks the plugin loaded), so a later test of stock behaviour in the
    same process would see the plugin's hooks. On exit every hooked attribute, stock's ``apply_hooks`` (the plugin
    indexes its propagation at load) and the loader's flag are put back; the next in-process engine loads the plugin
    afresh."""
    import sglang.srt.plugins as plugin_loader

    targets = [p.target for p in patches_for(CPU, all_patches()) if p.kind != AT_LOAD]
    loaded = plugin_loader._plugins_loaded
    stock_apply_hooks = HookRegistry.__dict__["apply_hooks"]
    with registry_restored_after():
        originals = _saved_originals(targets)
        try:
            yield
        finally:
            _put_back(originals)
            HookRegistry.apply_hooks = stock_apply_hooks
            plugin_loader._plugins_loaded = loaded
