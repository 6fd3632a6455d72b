"""The plugin's imports point down its layers only (docs/architecture.md, "Layers and imports").

Every ``import`` / ``from ... import`` statement of ``sglang/mossvl_ascend`` is read with ``ast`` (function-local and
``TYPE_CHECKING`` ones included, relative ones resolved), plus the registry's load of the patch modules by name
(``importlib.import_module`` of an f-string under a package). Each module sits in one rank of :data:`LAYERS`; an
edge must go to a strictly lower rank: an edge up is a cycle waiting to happen, an edge within a rank ("sideways")
couples two modules meant to stand alone (two patch modules, the HTTP side and the scheduler side of realtime).

``python tests/test_import_direction.py`` prints the edges by layer.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "sglang" / "mossvl_ascend"
PACKAGE = PACKAGE_ROOT.name

# Top to bottom: (layer, ranks); a rank is a set of module patterns ("x.*": every module under package x).
LAYERS: list[tuple[str, list[list[str]]]] = [
    ("entry", [["mossvl_ascend", "mossvl_ascend.catalog", "mossvl_ascend.quantize"]]),
    ("registry", [["mossvl_ascend.registry"]]),
    ("patches", [["mossvl_ascend.patches", "mossvl_ascend.patches.*"]]),
    (
        "realtime",
        [
            ["mossvl_ascend.realtime.web_page"],  # the browser page's routes, beside the socket they talk to
            # the HTTP process (socket, session engine) and the scheduler's sessions: neither imports the other
            ["mossvl_ascend.realtime", "mossvl_ascend.realtime.websocket", "mossvl_ascend.realtime.engine"]
            + ["mossvl_ascend.realtime.sessions"],
            # what they share: the socket protocol, the session types, a step's plan, the wire contract
            ["mossvl_ascend.realtime.protocol", "mossvl_ascend.realtime.session_api"]
            + ["mossvl_ascend.realtime.step_plan", "mossvl_ascend.realtime.wire"],
        ],
    ),
    (
        "attention",
        [
            ["mossvl_ascend.attention", "mossvl_ascend.attention.sglang_layer"],
            ["mossvl_ascend.attention.decode_graph"],
            ["mossvl_ascend.attention.decode_step"],
            ["mossvl_ascend.attention.core"],
            ["mossvl_ascend.attention.metadata"],
            ["mossvl_ascend.attention.blocks", "mossvl_ascend.attention.kv_layout"],
            ["mossvl_ascend.attention.primitives"],
        ],
    ),
    (
        "processor",
        [
            ["mossvl_ascend.processor"],
            ["mossvl_ascend.processor.processing"],
            ["mossvl_ascend.processor.image_processor"],
            [
                "mossvl_ascend.processor.images",
                "mossvl_ascend.processor.video",
                "mossvl_ascend.processor.chat_template",
            ],
        ],
    ),
    ("media", [["mossvl_ascend.media", "mossvl_ascend.media.access", "mossvl_ascend.media.sampling"]]),
    (
        "shared contracts",
        [["mossvl_ascend.side_channel", "mossvl_ascend.patch_record", "mossvl_ascend.checkpoint_code"]]
        + [["mossvl_ascend.modelslim_format"]]
        + [["mossvl_ascend.host_memory", "mossvl_ascend.env_switch"]],
    ),
]


def package_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its ``__init__``)."""
    modules = {}
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module ``name`` lands in (``a.b.func`` -> ``a.b``), None outside the package."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in modules else None


def _loaded_by_name(node: ast.Call) -> str | None:
    """``importlib.import_module("x")`` / ``(f"x.{name}")``: the constant part's package."""
    func = node.func
    if not (isinstance(func, ast.Attribute) and func.attr == "import_module" and node.args):
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rstrip(".")
    return None


def imported_names(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every dotted name ``module`` imports, anywhere in its file."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import submodule`` imports the submodule; ``from mod import name`` the module.
            names.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
        elif isinstance(node, ast.Call) and (loaded := _loaded_by_name(node)):
            names.add(loaded)
    return names


def import_edges() -> list[tuple[str, str]]:
    """(importer, imported) for every import between two modules of the package, sorted."""
    modules = package_modules()
    edges = set()
    for module, path in modules.items():
        for name in imported_names(module, path, modules):
            target = _resolve(name, modules)
            if target is not None and target != module:
                edges.add((module, target))
    return sorted(edges)


def _matches(module: str, pattern: str) -> bool:
    if pattern.endswith(".*"):
        return module.startswith(pattern[:-1])
    return module == pattern


def rank_of(module: str) -> tuple[int, str]:
    """(rank, layer name) of ``module``: ranks count down the layers, top 0."""
    rank = 0
    for layer, ranks in LAYERS:
        for patterns in ranks:
            if any(_matches(module, pattern) for pattern in patterns):
                return rank, layer
            rank += 1
    raise KeyError(f"{module} is in no layer: add it to LAYERS in {Path(__file__).name} and to docs/architecture.md")


def wrong_way_edges() -> list[str]:
    """One line per edge that goes up or sideways."""
    wrong = []
    for importer, imported in import_edges():
        (rank_from, layer_from), (rank_to, layer_to) = rank_of(importer), rank_of(imported)
        if rank_to < rank_from:
            wrong.append(f"upward: {importer} ({layer_from}) imports {imported} ({layer_to})")
        elif rank_to == rank_from:
            wrong.append(f"sideways: {importer} imports {imported} (both {layer_from}, same rank)")
    return wrong


def test_every_module_has_a_layer():
    for module in package_modules():
        rank_of(module)


def test_imports_point_down_the_layers():
    wrong = wrong_way_edges()
    assert not wrong, "imports against the layers (docs/architecture.md):\n" + "\n".join(wrong)


def test_the_walk_sees_function_local_relative_and_by_name_imports():
    """The edges this test exists for are found: a lazy import inside a function, a relative import, the registry's
    load of the patch modules by name."""
    edges = set(import_edges())
    assert ("mossvl_ascend", "mossvl_ascend.registry") in edges  # inside register()
    assert ("mossvl_ascend.realtime.websocket", "mossvl_ascend.realtime.protocol") in edges  # ``from . import``
    assert ("mossvl_ascend.registry", "mossvl_ascend.patches") in edges  # importlib, by name


if __name__ == "__main__":
    by_layer: dict[str, list[str]] = {}
    for importer, imported in import_edges():
        by_layer.setdefault(rank_of(importer)[1], []).append(f"{importer} -> {imported}")
    for layer, _ in LAYERS:
        print(f"{layer}:")
        print("\n".join(f"  {edge}" for edge in by_layer.get(layer, [])) or "  (none)")
    sys.exit(1 if wrong_way_edges() else 0)
