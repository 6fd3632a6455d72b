"""``benchmarks/soak_realtime.py`` for two minutes (two sessions at 1 fps with the frame window on, questions, a
barge-in, a client dropping and reconnecting): nothing aborted, no error, both probe sessions (before the load and in
its last minute) generate the transformers reference stream's token ids (ids, not text: the tiny model's answers
decode mostly to U+FFFD), the vision tokens a session holds bounded by the window, a sample every 10 s, frames
processed in every interval.

What two minutes can judge of the server's memory: a leak that grows with the frames. One 128x128 frame's patches
are 192 KiB in fp32; the load pushes 120 frames a minute, so keeping each frame's pixels would raise RSS by about
22 MiB/min: the RSS slope after the warm-up must stay under 10 MiB/min (2-minute runs measured 0.11). What it cannot
judge: the soak's own target (under 1 MiB/min over 20 minutes, ``make soak-realtime``): a 96-second fit of 9 samples
does not resolve a slope that small, nor growth that only shows as contexts get long. Nor the frame p95 drift (target
1.2x over 20 minutes): here the two spans are 32 s each (about 64 frames) on a machine shared with other runs, so a
p95 there moves with everyone else's load; the drift is only parsed.
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
# Under what keeping one 128x128 frame's fp32 patches per frame would add at 120 frames a minute (~22 MiB/min).
LEAK_BOUND_MIB_PER_MIN = 10.0


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
    aborted, errors, rss_slope, _, kv_max, bound, p95_first, p95_last, _, equal, probes = result.groups()
    assert int(aborted) == 0 and int(errors) == 0, completed.stdout
    assert float(rss_slope) < LEAK_BOUND_MIB_PER_MIN, completed.stdout
    assert int(probes) == 2 and int(equal) == 2, completed.stdout
    assert 0 < int(kv_max) <= int(bound), "the frame window bounds the vision tokens a session holds"
    assert float(p95_first) > 0 and float(p95_last) > 0
    samples = [SAMPLE.match(line) for line in lines]
    samples = [m for m in samples if m]
    assert len(samples) >= 10, completed.stdout  # every 10 s for 120 s
    assert all(int(m.group(5)) > 0 for m in samples), "frames were processed in every interval"
