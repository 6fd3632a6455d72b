"""The README and docs/ do not rot: every make target, repo path, link and ``--flag`` they name exists.

- ``make <target>`` written as code (an inline span or a fenced block) must be a target of the Makefile (its
  ``name:`` lines); ``make help`` must list every phony target but itself.
- Repo paths (``benchmarks/...``, ``tests/...``, ``sglang/...``, ``docs/...``, ``inference/...``, ...) must exist; a
  glob must match a file. ``sglang/srt/...`` names stock sglang's own files: they must exist in the installed
  package. Markdown links resolve from the document's folder, and their ``#anchor`` must be a heading there.
- Flags: a command (a fenced-block line, continued over trailing backslashes, or an inline code span) that names a
  program has its flags checked against that program alone: one of our scripts (the option strings in its argparse
  source, plus ``inference/cli_flags.py`` when the script adds the runners' shared flags from it), stock sglang's
  server arguments (``python -m sglang.launch_server``, ``make serve ARGS=``; read from ``ServerArgs.add_cli_args``),
  ``sglang.bench_serving``, pip or pytest. A flag outside such a command is checked against the programs its
  paragraph (list item, table row) names, and stock sglang's server arguments.

The checker takes the Makefile's targets, the file-existence test and the flag sets as arguments, so the tests at the
bottom can show that removing a target, a file or a flag is caught. No server, no model: the slowest part is
importing sglang's server arguments once.
"""

from __future__ import annotations

import argparse
import functools
import glob
import importlib.util
import re
import subprocess
import sysconfig
from pathlib import Path
from typing import Callable, Iterable

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]

SGLANG = "sglang"  # owner name: stock sglang's server arguments
SCRIPTS = {  # owner name -> its own argparse source (repo-relative)
    "inference/run_inference.py": "inference/run_inference.py",
    "realtime_inference/run_online_inference.py": "realtime_inference/run_online_inference.py",
    "realtime_inference/replay_proactive_videoqa.py": "realtime_inference/replay_proactive_videoqa.py",
    "moss_vl_reference/tiny_checkpoint.py": "moss_vl_reference/tiny_checkpoint.py",
    "serving/evaluate.py": "serving/evaluate.py",
    "serving/fleet.py": "serving/fleet.py",
    "sglang/mossvl_ascend/quantize.py": "sglang/mossvl_ascend/quantize.py",
    **{f"benchmarks/{p.name}": f"benchmarks/{p.name}" for p in sorted((REPO_ROOT / "benchmarks").glob("*.py"))},
}
# The runners' shared flags live in one module; a script that calls its adder accepts them too.
SHARED_FLAGS = "inference/cli_flags.py"
SHARED_FLAGS_CALL = re.compile(r"\badd_runner_flags\(")
# How a document names a program (first match in a command wins) -> owner name.
PROGRAM_PATTERNS = (
    (r"(?<![\w/])((?:inference|realtime_inference|benchmarks|moss_vl_reference)/\w+\.py)", None),
    (r"-m (benchmarks)\.(\w+)", "benchmarks/{1}.py"),
    (r"-m moss_vl_reference\.tiny_checkpoint|make tiny-model", "moss_vl_reference/tiny_checkpoint.py"),
    (r"make bench-serving", "benchmarks/bench_serving.py"),
    (r"make bench-realtime-engine", "benchmarks/bench_realtime.py"),
    (r"make bench-fleet", "benchmarks/bench_fleet.py"),
    (r"make bench-graphs", "benchmarks/bench_decode_graphs.py"),
    (r"make soak-realtime", "benchmarks/soak_realtime.py"),
    (r"make eval|-m serving\.evaluate", "serving/evaluate.py"),
    (r"-m serving\.fleet", "serving/fleet.py"),
    (r"-m mossvl_ascend\.quantize", "sglang/mossvl_ascend/quantize.py"),
    (r"sglang\.launch_server|serving\.launch|make serve", SGLANG),
    (r"sglang\.bench_serving", "sglang.bench_serving"),
    (r"\bsmg\b", "smg"),
    (r"\bpip\b", "pip"),
    (r"\bpytest\b|PYTEST_ARGS|make test", "pytest"),
)
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9]*(?:-[a-z0-9]+)*)")
MAKE = re.compile(r"\bmake ([a-z][\w-]*)")
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:benchmarks|tests|sglang|docs|inference|realtime_inference|moss_vl_reference|serving|cpu_shim"
    r"|assets|\.ci)/[\w.*/-]*|Makefile|device_utils\.py|requirements-[\w-]+\.txt|constraints-torch\.txt)"
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SPAN = re.compile(r"`([^`]+)`")


# --- reading a document ---------------------------------------------------------------------------------------


def split_document(text: str) -> tuple[list[str], list[str]]:
    """(commands of the fenced blocks, prose units). A prose unit is a paragraph, a list item or a table row."""
    commands, units, unit, fence, pending = [], [], [], None, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = None if fence is not None else line.strip()[3:]
            if unit:
                units.append("\n".join(unit))
            unit = []
            continue
        if fence is not None:
            if fence in ("", "bash", "sh", "shell", "console"):
                pending += line.rstrip("\\") + " "
                if not line.endswith("\\"):
                    commands.append(pending)
                    pending = ""
            continue
        starts_unit = not line.strip() or line.startswith(("|", "- ", "#")) or bool(re.match(r"\d+\. ", line))
        if starts_unit and unit:
            units.append("\n".join(unit))
            unit = []
        if line.strip():
            unit.append(line)
        if line.startswith("#"):  # a heading is a unit of its own
            units.append(line)
            unit = []
    if unit:
        units.append("\n".join(unit))
    return commands, units


def code_text(text: str) -> list[str]:
    """Everything written as code: fenced-block commands and inline spans."""
    commands, units = split_document(text)
    return commands + [span for unit in units for span in SPAN.findall(unit)]


def program_of(command: str) -> str | None:
    """The owner of the first program a command names, or None."""
    found = []
    for pattern, owner in PROGRAM_PATTERNS:
        match = re.search(pattern, command)
        if match:
            found.append((match.start(), owner.format(*match.groups()) if owner else match.group(1)))
    return min(found)[1] if found else None


def programs_in(unit: str) -> set[str]:
    names = set()
    for pattern, owner in PROGRAM_PATTERNS:
        for match in re.finditer(pattern, unit):
            names.add(owner.format(*match.groups()) if owner else match.group(1))
    return names


def flag_uses(text: str) -> list[tuple[str, frozenset[str], str]]:
    """(flag, the owners that may define it, where it was read) for every flag the document names."""
    commands, units = split_document(text)
    uses = []

    def command_uses(command: str, fallback: frozenset[str]):
        owner = program_of(command)
        owners = frozenset({owner}) if owner else fallback
        uses.extend((flag, owners, command.strip()) for flag in FLAG.findall(command))

    for command in commands:
        command_uses(command, frozenset({SGLANG}))
    for unit in units:
        prose_owners = frozenset(programs_in(unit) | {SGLANG})
        for span in SPAN.findall(unit):
            command_uses(span, prose_owners)
        uses.extend((flag, prose_owners, unit[:80]) for flag in FLAG.findall(SPAN.sub(" ", unit)))
    return uses


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lstrip("#").strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    _, units = split_document(path.read_text())
    return {slug(unit) for unit in units if unit.startswith("#")}


# --- what exists ----------------------------------------------------------------------------------------------


def makefile_targets(makefile: Path = REPO_ROOT / "Makefile") -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", makefile.read_text(), flags=re.MULTILINE))


def installed_sglang_root() -> Path:
    """The folder holding the installed ``sglang`` package (its ``srt/`` is stock sglang's source)."""
    return Path(importlib.util.find_spec("sglang").submodule_search_locations[0]).parent


def path_exists(name: str) -> bool:
    root = installed_sglang_root() if name.startswith(("sglang/srt/", "sglang/bench_serving")) else REPO_ROOT
    if "*" in name:
        return bool(glob.glob(str(root / name)))
    return (root / name.rstrip("/")).exists()


def _option_strings(source: str) -> set[str]:
    return set(re.findall(r"[\"'](--[a-z0-9-]+)[\"']", source))


def _sources_under(package: str) -> str:
    # Read from site-packages, not through importlib.util.find_spec: finding "pip" makes setuptools' distutils shim
    # switch this process to the stdlib distutils, and torch's inductor (which imports setuptools) then fails.
    location = Path(sysconfig.get_paths()["purelib"]) / package
    return "\n".join(p.read_text(errors="replace") for p in location.rglob("*.py"))


@functools.cache
def flags_of(owner: str) -> frozenset[str]:
    """Every option string ``owner`` accepts."""
    if owner == SGLANG:
        from sglang.srt.server_args import ServerArgs

        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        return frozenset(parser._option_string_actions)
    if owner == "sglang.bench_serving":
        # sglang/bench_serving.py is a deprecated alias of sglang.benchmark.serving, which defines the parser.
        package = installed_sglang_root() / "sglang"
        sources = (package / "bench_serving.py", package / "benchmark" / "serving.py")
        return frozenset(_option_strings("\n".join(p.read_text() for p in sources)))
    if owner == "pip":
        return frozenset(_option_strings(_sources_under("pip")))
    if owner == "smg":  # sglang's gateway: its parser is built at run time from RouterArgs
        from smg.router_args import RouterArgs

        parser = argparse.ArgumentParser()
        RouterArgs.add_cli_args(parser)
        return frozenset(parser._option_string_actions)
    if owner == "pytest":
        return frozenset(
            _option_strings(_sources_under("_pytest") + _sources_under("random_order") + _sources_under("xdist"))
        )
    sources = argparse_sources(owner)
    return frozenset(_option_strings("\n".join((REPO_ROOT / p).read_text() for p in sources)) | {"--help"})


def argparse_sources(owner: str) -> tuple[str, ...]:
    """The files whose option strings make up one of our scripts' flags: the script's own source, plus the shared
    flags module when the script adds the shared flags."""
    source = SCRIPTS[owner]
    calls_shared = SHARED_FLAGS_CALL.search((REPO_ROOT / source).read_text())
    return (source, SHARED_FLAGS) if calls_shared else (source,)


# --- the checker ----------------------------------------------------------------------------------------------


def problems(
    text: str,
    where: Path,
    *,
    targets: set[str],
    exists: Callable[[str], bool] = path_exists,
    flags: Callable[[str], Iterable[str]] = flags_of,
) -> list[str]:
    """Everything ``text`` (the document at ``where``) names that does not exist."""
    found = []
    for code in code_text(text):
        found += [f"make {t}: no such Makefile target" for t in MAKE.findall(code) if t not in targets]
    for name in {m.rstrip(".,:") for m in REPO_PATH.findall(text)}:
        if not exists(name):
            found.append(f"{name}: no such file")
    for link in LINK.findall(text):
        target, _, anchor = link.partition("#")
        if re.match(r"[a-z]+:", target):
            continue
        path = (where.parent / target).resolve() if target else where
        if not path.exists():
            found.append(f"link {link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors_of(path):
            found.append(f"link {link}: no heading #{anchor} in {path.name}")
    for flag, owners, context in flag_uses(text):
        if not any(flag in flags(owner) for owner in owners):
            found.append(f"{flag} is not a flag of {' or '.join(sorted(owners))} (in: {context!r})")
    return sorted(set(found))


# --- the real documents ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("document", DOCUMENTS, ids=[p.relative_to(REPO_ROOT).as_posix() for p in DOCUMENTS])
def test_everything_a_document_names_exists(document):
    assert problems(document.read_text(), document, targets=makefile_targets()) == []


def test_the_readme_is_a_front_door_of_at_most_200_lines():
    assert len((REPO_ROOT / "README.md").read_text().splitlines()) <= 200


def test_make_help_lists_every_target_but_itself():
    makefile = (REPO_ROOT / "Makefile").read_text()
    phony = set(re.search(r"^\.PHONY:(.*)$", makefile, flags=re.MULTILINE).group(1).split())
    listed = subprocess.run(
        ["make", "--no-print-directory", "-s", "help"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert phony - {"help"} <= {line.split("\t")[0] for line in listed.splitlines()}


# --- the checker catches what it must -------------------------------------------------------------------------

SYNTHETIC = """\
# A page

Run `make demo`, then read [the tests](docs/testing.md#oracles) and `benchmarks/bench_serving.py`.

```bash
.venv/bin/python inference/run_inference.py --checkpoint build/tiny-moss-vl --input x.json
python -m sglang.launch_server --model-path m --device npu --tp-size 8
```
"""


def _check(text: str, **overrides) -> list[str]:
    return problems(text, REPO_ROOT / "README.md", targets=overrides.pop("targets", makefile_targets()), **overrides)


def test_a_synthetic_page_that_names_only_real_things_passes():
    assert _check(SYNTHETIC) == []


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (("make demo", "make dmeo"), "make dmeo: no such Makefile target"),
        (("benchmarks/bench_serving.py", "benchmarks/bench_servin.py"), "benchmarks/bench_servin.py: no such file"),
        (("docs/testing.md#oracles", "docs/testin.md"), "link docs/testin.md: no such file"),
        (("#oracles", "#oracle"), "link docs/testing.md#oracle: no heading #oracle in testing.md"),
        (("--input x.json", "--inputs x.json"), "--inputs is not a flag of inference/run_inference.py"),
        (("--tp-size 8", "--tp-sizes 8"), "--tp-sizes is not a flag of sglang"),
    ],
    ids=["target", "file", "link", "anchor", "script-flag", "sglang-flag"],
)
def test_a_misnamed_thing_is_reported(edit, expected):
    assert any(p.startswith(expected) for p in _check(SYNTHETIC.replace(*edit)))


def test_a_script_flag_is_checked_against_that_script_not_sglang():
    # --port exists in stock sglang but not in run_inference.py: next to the script it is an error.
    assert any(
        "--port is not a flag of inference/run_inference.py" in p
        for p in _check(SYNTHETIC + "\n`inference/run_inference.py --port 1`\n")
    )


def test_the_real_readme_fails_when_a_target_a_file_or_a_flag_it_names_goes_away():
    readme = (REPO_ROOT / "README.md").read_text()
    targets = makefile_targets()
    assert _check(readme) == []
    assert "make demo: no such Makefile target" in _check(readme, targets=targets - {"demo"})
    missing = "realtime_inference/run_online_inference.py"
    assert f"{missing}: no such file" in _check(readme, exists=lambda name: name != missing and path_exists(name))
    without_media_root = lambda owner: flags_of(owner) - {"--media-root"}  # noqa: E731
    assert any(p.startswith("--media-root is not a flag of") for p in _check(readme, flags=without_media_root))


def test_a_script_that_adds_the_shared_flags_is_checked_against_them_and_only_such_a_script():
    assert argparse_sources("inference/run_inference.py") == ("inference/run_inference.py", SHARED_FLAGS)
    online = "realtime_inference/run_online_inference.py"
    assert argparse_sources(online) == (online, SHARED_FLAGS)
    assert argparse_sources("moss_vl_reference/tiny_checkpoint.py") == ("moss_vl_reference/tiny_checkpoint.py",)
    page = (
        "`realtime_inference/run_online_inference.py --device-map cpu --log-level DEBUG --sample-fps 2`\n\n"
        "`moss_vl_reference/tiny_checkpoint.py --device-map cpu`\n"
    )
    found = _check(page)
    assert len(found) == 1 and found[0].startswith("--device-map is not a flag of moss_vl_reference/tiny_checkpoint")
