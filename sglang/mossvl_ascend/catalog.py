"""Render the patch catalog (``sglang/PATCHES.md``) from the patch records.

``make catalog`` regenerates it; ``tests/test_patch_catalog.py`` fails when
the committed file differs, so the catalog cannot drift from the code.
"""

from __future__ import annotations

from mossvl_ascend.registry import AT_LOAD, Patch, Verified, patch_modules

HEADER = """\
# Patch catalog (generated)

Every change the `mossvl_ascend` plugin makes to stock sglang 0.5.23, and every fix of the source PR that 0.5.23
no longer needs. Generated from the `PATCHES` / `VERIFIED` records of the patch modules by
`make catalog`; a test fails when this file is stale. Platforms: `npu`
(Ascend), `cpu` (the CPU server); on CUDA and other GPUs nothing is applied and sglang runs exactly as stock.
"""


def _kind(patch: Patch) -> str:
    return "change made at plugin load" if patch.kind == AT_LOAD else f"{patch.kind.value} hook"


def render_patch(patch: Patch) -> str:
    requires = f" (only where `{patch.requires_module}` imports)" if patch.requires_module else ""
    return "\n".join(
        [
            f"### {patch.title}",
            f"- **target**: `{patch.target}` — {_kind(patch)}, on {', '.join(sorted(patch.platforms))}{requires}",
            f"- **why**: {patch.why}",
            f"- **how**: {patch.how}",
            f"- **upstream**: {patch.upstream}",
            f"- **remove when**: {patch.remove_when}",
        ]
    )


def render_verified(entry: Verified) -> str:
    return "\n".join(
        [
            f"### {entry.title} (no patch needed)",
            f"- **target**: `{entry.target}`",
            f"- **why the source PR patched it**: {entry.why_it_was_patched}",
            f"- **0.5.23**: {entry.status}",
            f"- **pinned by**: {', '.join(f'`{test}`' for test in entry.pinned_by)}",
        ]
    )


def render_catalog() -> str:
    sections = [HEADER]
    for module in patch_modules():
        entries = [render_patch(p) for p in module.PATCHES] + [
            render_verified(v) for v in getattr(module, "VERIFIED", ())
        ]
        summary = (module.__doc__ or "").strip().splitlines()[0]
        sections.append(f"## `{module.__name__}` — {summary}\n\n" + "\n\n".join(entries))
    return "\n\n".join(sections) + "\n"


if __name__ == "__main__":
    print(render_catalog(), end="")
