"""``benchmarks/soak_realtime.py`` for two minutes (two sessions at 1 fps with the frame window on, questions, a
barge-in, a client dropping and reconnecting): nothing aborted, no error, both probe answers (before the load and in
its last minute) equal to the transformers reference stream's, the vision tokens a session holds bounded by the
window, a sample every 10 s. Timings are not judged (the machine is shared): the slopes and the drift only parse.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULT = re.compile(
    r"^RESULT soak_realtime minutes=2 sessions=2 aborted=(\d+) errors=(\d+) rss_slope_mib_per_min=(-?[\d.]+) "
    r"kv_slope_per_min=(-?[\d.]+) encoder_kv_max=(\d+) encoder_kv_bound=(\d+) p95_first_ms=([\d.]+) "
    r"p95_last_ms=([\d.]+) p95_drift=([\d.]+) answers_equal=(\d+)/(\d+)$"
)
SAMPLE = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+|nan)$")

pytestmark = pytest.mark.timeout(600)


def test_a_two_minute_soak_loses_nothing_and_answers_as_the_reference():
    completed = subprocess.run(
        [sys.executable, "benchmarks/soak_realtime.py", "--minutes", "2", "--sessions", "2", "--window-s", "10"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    lines = completed.stdout.strip().splitlines()
    result = RESULT.match(lines[-1])
    assert result, completed.stdout
    aborted, errors, *_, kv_max, bound, p95_first, p95_last, _, equal, probes = result.groups()
    assert int(aborted) == 0 and int(errors) == 0, completed.stdout
    assert int(probes) == 2 and int(equal) == 2, completed.stdout
    assert 0 < int(kv_max) <= int(bound), "the frame window bounds the vision tokens a session holds"
    assert float(p95_first) > 0 and float(p95_last) > 0
    samples = [SAMPLE.match(line) for line in lines]
    samples = [m for m in samples if m]
    assert len(samples) >= 10, completed.stdout  # every 10 s for 120 s
    assert all(int(m.group(5)) > 0 for m in samples), "frames were processed in every interval"
