"""Stock's hook application with one scan of ``sys.modules`` instead of one per hooked target.

``HookRegistry.apply_hooks`` (``sglang/srt/plugins/hook_registry.py``) wraps each target, then calls
``_propagate_patch``, which walks every attribute of every module in ``sys.modules`` to rebind the ``from X import
f`` copies of the original. With this plugin's 64 targets and the ~6,850 modules a server process has loaded, that
is 64 full walks: 2.2 s of CPU in each of a server's three processes (launcher, scheduler, detokenizer), timed on
2026-12-07 in a detokenizer-like process (cProfile had first shown it as 3.49 s of ``load_plugins``' 5.7 s).

Here each ``apply_hooks`` run builds one index of the module attributes by the identity of their values, and every
propagation of that run reads it (0.7-1.0 s in the same process, the same 16 attributes rebound): an attribute is
rebound when it holds the original at that moment, as in stock's walk, for modules imported during the run too (they
are indexed at the next propagation, and so is a module whose attribute count changed since). What the index cannot
see is an attribute of an indexed module set to the original later by something other than an import, without
adding an attribute; during ``apply_hooks`` only imports run.
"""

from __future__ import annotations

import sys
import types
from collections import defaultdict

from mossvl_ascend.patch_record import AT_LOAD, CPU, NPU, Patch

# Set on the indexed ``apply_hooks`` so that a second plugin load does not wrap it again.
INDEXED = "_mossvl_indexed_propagation"


class BindingIndex:
    """Which module attribute holds which object (by identity), for ``sys.modules`` as it grows during one
    ``apply_hooks`` run; ``rebind`` is a drop-in for stock's ``_propagate_patch``."""

    def __init__(self) -> None:
        self._holders: dict[int, list[tuple[types.ModuleType, str]]] = defaultdict(list)
        self._sizes: dict[int, int] = {}  # id(module) -> its attribute count when indexed

    def _index_new_modules(self) -> None:
        """Index every module not indexed yet, and again every module whose attribute count changed since (a module
        still importing when it was first seen)."""
        for module in list(sys.modules.values()):
            if not isinstance(module, types.ModuleType):
                continue
            try:
                namespace = vars(module)
            except TypeError:
                continue
            if self._sizes.get(id(module)) == len(namespace):
                continue
            self._sizes[id(module)] = len(namespace)
            for name, value in list(namespace.items()):
                self._holders[id(value)].append((module, name))

    def rebind(self, original: object, wrapped: object, source_module: object) -> int:
        """Every module attribute other than ``source_module``'s that holds ``original`` now holds ``wrapped``;
        returns how many were rebound (stock's contract)."""
        self._index_new_modules()
        rebound = 0
        holders = self._holders.pop(id(original), [])
        for module, name in holders:
            if module is source_module or vars(module).get(name) is not original:
                continue
            try:
                setattr(module, name, wrapped)
                rebound += 1
            except (AttributeError, TypeError):
                pass
        # A later target may hold ``wrapped`` (a hook on a name another module imported from this one).
        self._holders[id(wrapped)].extend(holders)
        return rebound


def index_hook_propagation() -> bool:
    """Make ``HookRegistry.apply_hooks`` propagate through one :class:`BindingIndex` per run (stock's function is
    put back after each run); True when installed, False when it already was."""
    from sglang.srt.plugins import hook_registry

    registry = hook_registry.HookRegistry
    if getattr(registry.apply_hooks, INDEXED, False):
        return False
    stock_apply_hooks = registry.apply_hooks.__func__

    def apply_hooks(cls):
        stock_propagate = hook_registry._propagate_patch
        hook_registry._propagate_patch = BindingIndex().rebind
        try:
            stock_apply_hooks(cls)
        finally:
            hook_registry._propagate_patch = stock_propagate

    apply_hooks.__doc__ = stock_apply_hooks.__doc__
    apply_hooks.__wrapped__ = stock_apply_hooks
    setattr(apply_hooks, INDEXED, True)
    registry.apply_hooks = classmethod(apply_hooks)
    return True


PATCHES = (
    Patch(
        title="One index of sys.modules per hook application instead of one walk per hooked target",
        target="sglang.srt.plugins.hook_registry.HookRegistry.apply_hooks",
        kind=AT_LOAD,
        hook=index_hook_propagation,
        platforms=frozenset({NPU, CPU}),
        why=(
            "`_propagate_patch` walks every attribute of every loaded module once per hooked target to rebind "
            "`from X import f` copies; with this plugin's 64 targets and ~6,850 loaded modules that is 2.2 s of CPU "
            "in each of a server's three processes (timed 2026-12-07), ~6.5 s of CPU in every server start"
        ),
        how=(
            "at plugin load (the plugin runs inside `load_plugins`, before it calls `apply_hooks`), `apply_hooks` is "
            "wrapped so that each run swaps the module's `_propagate_patch` for the `rebind` of one fresh "
            "`BindingIndex` (module attributes by the identity of their values, modules imported during the run "
            "indexed at the next propagation) and puts stock's back after the run. The rebinding is stock's: every "
            "module attribute but the source's that holds the original at that moment"
        ),
        upstream="open in 0.5.23 (`_propagate_patch` scans `sys.modules` per target)",
        remove_when="stock propagates all hooks in one pass, or the plugin needs only a few targets",
    ),
)
