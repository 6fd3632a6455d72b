"""``patches/hook_propagation.py``: stock's hook application with one index of ``sys.modules`` per run rebinds the
same ``from X import f`` copies as stock's walk per target.

Oracle: small modules written here, hooked through sglang's real ``HookRegistry`` once with stock's ``apply_hooks``
and once with the indexed one; every binding's behaviour is written out by hand (each hook tags what it wraps) and
both runs must give exactly it. The cases: a copy under the same name and under an alias; a hook on a copy of an
already hooked function (its chain wraps the first hook, and every copy of the first gets the chain); a module that
a target's resolution imports during the run and that holds a later target's original. The production load is
checked in ``test_plugin_loading.py`` (no module holds a replaced object after the real plugin loads).
"""

from __future__ import annotations

import contextlib
import sys
import textwrap

import pytest
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from mossvl_ascend.patches.hook_propagation import INDEXED, index_hook_propagation
from support.hooks import registry_restored_after

SOURCES = {
    "a": """
        def f():
            return "a.f"
        def h():
            return "a.h"
    """,
    "b": """
        from {p}_a import f
        from {p}_a import f as alias
    """,
    "y": """
        from {p}_a import f as f2
    """,
    # Not imported before the run: resolving the target "{p}_b2.x" imports it, and with it a copy of "{p}_z.k",
    # hooked after it.
    "b2": """
        from {p}_z import k
        def x():
            return "b2.x"
    """,
    "z": """
        def k():
            return "z.k"
    """,
}
IMPORTED_BEFORE = ("a", "b", "y")


def tagging(tag: str):
    def hook(original, *args, **kwargs):
        return f"{tag}({original(*args, **kwargs)})"

    return hook


# target (module key, attribute) -> its hook's tag
HOOKS = {("a", "f"): "F", ("y", "f2"): "Y", ("b2", "x"): "X", ("z", "k"): "K"}
# Every binding's call after the run, by hand: the chain on a.f is F, then Y on top of it (y.f2 held F's wrapper).
EXPECTED = {
    ("a", "f"): "Y(F(a.f))",
    ("b", "f"): "Y(F(a.f))",
    ("b", "alias"): "Y(F(a.f))",
    ("y", "f2"): "Y(F(a.f))",
    ("a", "h"): "a.h",
    ("b2", "x"): "X(b2.x)",
    ("b2", "k"): "K(z.k)",
    ("z", "k"): "K(z.k)",
}


@contextlib.contextmanager
def registry_alone():
    """HookRegistry with no hook but the test's; its state and ``apply_hooks`` put back after."""
    saved_apply = HookRegistry.__dict__["apply_hooks"]
    with registry_restored_after():
        HookRegistry.reset()
        try:
            yield
        finally:
            HookRegistry.apply_hooks = saved_apply


def stock_apply_hooks():
    current = HookRegistry.__dict__["apply_hooks"].__func__
    return getattr(current, "__wrapped__", current)


def bindings_after_a_run(tmp_path, prefix: str, indexed: bool) -> dict:
    folder = tmp_path / prefix
    folder.mkdir()
    for key, source in SOURCES.items():
        (folder / f"{prefix}_{key}.py").write_text(textwrap.dedent(source.format(p=prefix)))
    sys.path.insert(0, str(folder))
    try:
        for key in IMPORTED_BEFORE:
            __import__(f"{prefix}_{key}")
        with registry_alone():
            HookRegistry.apply_hooks = classmethod(stock_apply_hooks())
            if indexed:
                assert index_hook_propagation()
                assert getattr(HookRegistry.apply_hooks, INDEXED)
            for (key, name), tag in HOOKS.items():
                HookRegistry.register(f"{prefix}_{key}.{name}", tagging(tag), HookType.AROUND)
            assert f"{prefix}_b2" not in sys.modules
            HookRegistry.apply_hooks()
            assert HookRegistry._patched == set(HookRegistry._hooks)
        return {(key, name): getattr(sys.modules[f"{prefix}_{key}"], name)() for key, name in EXPECTED}
    finally:
        sys.path.remove(str(folder))
        for key in SOURCES:
            sys.modules.pop(f"{prefix}_{key}", None)


@pytest.mark.parametrize("indexed", [False, True], ids=["stock", "indexed"])
def test_every_copy_of_a_hooked_function_calls_its_chain(tmp_path, indexed):
    prefix = f"propagation_{'indexed' if indexed else 'stock'}"
    assert bindings_after_a_run(tmp_path, prefix, indexed) == EXPECTED


def test_installing_twice_changes_nothing():
    with registry_alone():
        HookRegistry.apply_hooks = classmethod(stock_apply_hooks())
        assert index_hook_propagation()
        installed = HookRegistry.__dict__["apply_hooks"]
        assert not index_hook_propagation()
        assert HookRegistry.__dict__["apply_hooks"] is installed
