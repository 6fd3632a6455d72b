"""``benchmarks/bench_realtime.py --quick`` runs end to end (the reference session, then a real server on the
tiny-realtime checkpoint with 1 and 2 WebSocket sessions at 1 and 2 fps) and its table and RESULT line parse.

Timings are not judged against targets (the machine is shared): only that every row is there, every frame was
processed, the latencies are ordered with a positive tail, every time in the table is shorter than the whole run that
measured it (timed here, around the process: a time from a wrong clock or in a wrong unit is not), and the keeps-up
figures are session counts consistent with the rows.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(
    r"^(reference|engine)\s+(\d+)\s+([\d.]+)\s+(\d+)/(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+|-)\s+(\d+|-)\s+(\d+)/(\d+)\s+"
    r"(yes|no)\s+(\d+)\s+([\d.]+)$"
)
RESULT = re.compile(
    r"^RESULT realtime_engine sessions_realtime_1fps=(\d+) runner_sessions_realtime_1fps=(\d+) "
    r"frame_p95_ms_4=([\d.]+) prompt_first_token_ms=([\d.]+) runner_prompt_first_token_ms=([\d.]+) "
    r"prompt_first_token_ms_2fps=([\d.]+) runner_prompt_first_token_ms_2fps=([\d.]+)$"
)

pytestmark = pytest.mark.timeout(400)


def test_quick_prints_a_sane_table_and_result_line():
    started = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "benchmarks/bench_realtime.py", "--quick"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=360,
    )
    run_ms = 1e3 * (time.monotonic() - started)
    assert completed.returncode == 0, completed.stderr[-4000:]
    lines = completed.stdout.strip().splitlines()
    rows = {}
    for line in lines:
        match = ROW.match(line)
        if match:
            side, sessions, fps = match.group(1), int(match.group(2)), float(match.group(3))
            rows[(side, sessions, fps)] = match.groups()
    expected = {("reference", 1, 1.0), ("reference", 1, 2.0)}
    expected |= {("engine", n, fps) for n in (1, 2) for fps in (1.0, 2.0)}
    assert set(rows) == expected, completed.stdout
    assert "ended early" not in completed.stdout, completed.stdout
    for key, groups in rows.items():
        processed, pushed, p50, p95, max_lag, ttft, first, kept, sessions, keeps_up, peak, elsewhere = groups[3:]
        assert int(processed) == int(pushed) > 0, key  # every frame processed, none lost
        # A frame's latency is timed by the client's arrival of two events; when its loop reads both in one go (the
        # machine busy elsewhere), that frame measures 0 ms, so only the tail must be positive.
        assert 0 <= int(p50) <= int(p95) and int(p95) > 0, key
        assert int(max_lag) > 0 and int(peak) > 0 and float(elsewhere) >= 0, key
        # Every time in a row was measured inside this run (a negative one would not match the row's digits). TTFT may
        # round to 0 ms: a prompt drained into a running step can answer at once.
        assert max(int(p95), int(max_lag), *(int(t) for t in (ttft, first) if t != "-")) < run_ms, (key, run_ms)
        # One session's prompt always gets a first output in its turn (text or silence); the first text can only come
        # with it or later. It may measure 0 ms (rounded): a prompt that joins its frame's step (an offer taken) can
        # answer as soon as its accepted event is out.
        assert key[1] > 1 or first != "-", key
        assert key[1] > 1 or ttft == "-" or int(first) <= int(ttft), key
        assert int(sessions) == key[1] and 0 <= int(kept) <= int(sessions), key
        assert (keeps_up == "yes") == (int(kept) == int(sessions)), key
    result = RESULT.match(lines[-1])
    assert result, lines[-1]
    engine_1fps, runner_1fps, p95_ms = int(result.group(1)), int(result.group(2)), float(result.group(3))
    kept_up = [n for (side, n, fps), groups in rows.items() if side == "engine" and fps == 1.0 and groups[12] == "yes"]
    assert engine_1fps == max(kept_up, default=0)
    assert runner_1fps == (rows[("reference", 1, 1.0)][12] == "yes")
    first_tokens = [float(value) for value in result.groups()[3:]]
    in_rows = [int(rows[(side, 1, fps)][9]) for fps in (1.0, 2.0) for side in ("engine", "reference")]
    assert all(abs(a - b) <= 1 for a, b in zip(first_tokens, in_rows)), (first_tokens, in_rows)
    # --quick has no 4-session run: the largest one at 1 fps (2 sessions) stands in.
    assert p95_ms > 0 and abs(p95_ms - int(rows[("engine", 2, 1.0)][6])) <= 1
