"""The standalone runners share their device, dtype, attention, remote-code and log-level flags.

Each runner's real ``--help`` (argparse's own output, read back line by line) must show every shared flag with the
same option strings, the same choices and the same help text, and upstream's spellings must parse to the values ours
do. Oracles: upstream MOSS-VL's realtime runner (``realtime_inference/run_online_inference.py`` at 5c0c5166,
``parse_args``: ``--device-map`` default "auto", ``--dtype`` choices bfloat16/float16/float32, ``--attention-backend``)
for the spellings; for the defaults, this project's declarations before they were shared (``--device``/``--device-map``
"auto", ``--dtype`` None, ``--attention-backend`` "auto", ``--remote-code`` None, ``--log-level`` "INFO"). In-process,
no model: a few seconds.
"""

from __future__ import annotations

import re

import pytest

from inference import run_inference
from realtime_inference import replay_proactive_videoqa, run_online_inference

# runner -> (parse function, the arguments it needs besides the shared flags)
RUNNERS = {
    "inference/run_inference.py": (
        lambda argv: run_inference.build_parser().parse_args(argv),
        ["--checkpoint", "ckpt", "--input", "queries.json"],
    ),
    "realtime_inference/run_online_inference.py": (run_online_inference.parse_args, ["--checkpoint", "ckpt"]),
    "realtime_inference/replay_proactive_videoqa.py": (
        lambda argv: replay_proactive_videoqa.build_parser().parse_args(argv),
        ["--checkpoint", "ckpt", "--input", "in.json", "--output", "pred.jsonl"],
    ),
}
SHARED_OPTIONS = (
    ("--device", "--device-map"),
    ("--dtype",),
    ("--attention-backend",),
    ("--remote-code",),
    ("--log-level",),
)
DEFAULTS = {"device": "auto", "dtype": None, "attention_backend": "auto", "remote_code": None, "log_level": "INFO"}
# An upstream realtime command line's model flags (its README's NPU/CUDA form) and the values they must give.
UPSTREAM_ARGV = ["--device-map", "cuda:0", "--dtype", "bfloat16", "--attention-backend", "flash_attention_2"]
UPSTREAM_VALUES = {"device": "cuda:0", "dtype": "bfloat16", "attention_backend": "flash_attention_2"}
ACTION_LINE = re.compile(r"^  (-\S.*?)(?: {2,}(\S.*))?$")


def help_entries(runner: str, capsys, monkeypatch) -> dict[tuple[str, ...], tuple[str, str]]:
    """option strings -> (invocation as shown, help text) for every option of ``runner --help``."""
    parse, _ = RUNNERS[runner]
    monkeypatch.setenv("COLUMNS", "100000")  # one line per help text: nothing wrapped to compare around
    with pytest.raises(SystemExit) as exited:
        parse(["--help"])
    assert exited.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    entries = {}
    for index, line in enumerate(lines):
        match = ACTION_LINE.match(line)
        if match:
            invocation, help_text = match.group(1), match.group(2) or lines[index + 1].strip()
            entries[tuple(re.findall(r"--[a-z][\w-]*", invocation))] = (invocation, help_text)
    return entries


@pytest.mark.parametrize("options", SHARED_OPTIONS, ids=[options[0] for options in SHARED_OPTIONS])
def test_every_runner_shows_a_shared_flag_the_same_way(options, capsys, monkeypatch):
    shown = {runner: help_entries(runner, capsys, monkeypatch).get(options) for runner in RUNNERS}
    assert all(entry is not None for entry in shown.values()), shown
    assert len(set(shown.values())) == 1, shown
    _, help_text = next(iter(shown.values()))
    assert len(help_text) > 20  # a sentence, not a placeholder


@pytest.mark.parametrize("runner", RUNNERS)
def test_shared_flags_keep_their_defaults(runner):
    parse, required = RUNNERS[runner]
    args = parse(required)
    assert {name: getattr(args, name) for name in DEFAULTS} == DEFAULTS


@pytest.mark.parametrize("runner", RUNNERS)
def test_upstream_spellings_parse_to_the_same_values_as_ours(runner):
    parse, required = RUNNERS[runner]
    upstream = parse(required + UPSTREAM_ARGV)
    ours = parse(required + ["--device", "cuda:0", "--dtype", "bfloat16", "--attention-backend", "flash_attention_2"])
    assert {name: getattr(upstream, name) for name in UPSTREAM_VALUES} == UPSTREAM_VALUES
    assert vars(upstream) == vars(ours)
    assert not hasattr(upstream, "device_map")  # one destination, whichever spelling was used


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("device", ["auto", "cpu", "npu", "cuda", "npu:1", "cuda:0"])
def test_every_device_model_loading_accepts_parses(runner, device):
    parse, required = RUNNERS[runner]
    assert parse(required + ["--device-map", device]).device == device


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("device", ["gpu", "npu:", "cpu:0", "npu:x", "NPU", ""])
def test_a_device_name_model_loading_would_refuse_is_a_usage_error(runner, device, capsys):
    parse, required = RUNNERS[runner]
    with pytest.raises(SystemExit) as exited:
        parse(required + ["--device", device])
    assert exited.value.code == 2
    assert f"expected auto, cpu, npu, cuda, npu:N or cuda:N, got {device!r}" in capsys.readouterr().err
