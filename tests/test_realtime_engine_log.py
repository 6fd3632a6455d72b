"""`support.realtime_engine_log` on the prefill and step lines of real server logs (tiny-realtime checkpoint, page
128, 2026-12-03): `tests/assets/realtime_step_log.txt`, one session opening and taking a frame (the step that extended
10 rows on the session's 281 is found in stock's own prefill line); `tests/assets/realtime_four_sessions_log.txt`,
four concurrent sessions of `tests/test_serving_realtime_ws.py` (steps prefilled two at a time, and beside a one-token
request). The same logs with the batches made full re-prefills (nothing cached) leave every step unmatched.
"""

import re
from pathlib import Path

from support.realtime_engine_log import logged_steps, steps_the_engine_did_not_extend_alone

ASSETS = Path(__file__).parent / "assets"
LOG = (ASSETS / "realtime_step_log.txt").read_text()
FULL_REPREFILL = LOG.replace("#new-token: 10, #cached-token: 281", "#new-token: 291, #cached-token: 0")
FOUR_SESSIONS = (ASSETS / "realtime_four_sessions_log.txt").read_text()


def as_full_re_prefills(log: str) -> str:
    """Every prefill batch as if it had re-computed its cached prefix too."""
    return re.sub(
        r"#new-token: (\d+), #cached-token: (\d+)",
        lambda m: f"#new-token: {int(m[1]) + int(m[2])}, #cached-token: 0",
        log,
    )


def test_the_steps_are_read_from_the_plugins_lines():
    steps = logged_steps(LOG)
    assert [(s.index, s.rows, s.encoder_rows, s.text_rows) for s in steps] == [(0, 150, 0, 153), (1, 10, 128, 164)]


def test_a_step_that_extended_only_its_rows_is_matched_by_the_engines_line():
    assert steps_the_engine_did_not_extend_alone(LOG) == []


def test_a_full_re_prefill_leaves_the_step_unmatched():
    assert [s.index for s in steps_the_engine_did_not_extend_alone(FULL_REPREFILL)] == [1]


def test_extending_the_rows_on_a_shorter_cached_prefix_leaves_the_step_unmatched():
    shorter = LOG.replace("#new-token: 10, #cached-token: 281", "#new-token: 10, #cached-token: 153")
    assert [s.index for s in steps_the_engine_did_not_extend_alone(shorter)] == [1]


def test_four_concurrent_sessions_are_accounted_for_batch_by_batch():
    steps = logged_steps(FOUR_SESSIONS)
    assert len(steps) == 22 and len({s.session for s in steps}) == 4
    assert "#new-seq: 2," in FOUR_SESSIONS, "the log holds steps prefilled together"
    assert steps_the_engine_did_not_extend_alone(FOUR_SESSIONS) == []
    assert len(steps_the_engine_did_not_extend_alone(as_full_re_prefills(FOUR_SESSIONS))) == 22 - 4
