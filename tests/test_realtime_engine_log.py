"""`support.realtime_engine_log` on lines of a real server log (`tests/assets/realtime_step_log.txt`: the
tiny-realtime checkpoint at page 128, one session opening and taking a frame, 2026-12-03): the step that extended 10
rows on the session's 281 rows is found in stock's own prefill line; the same log with that batch a full re-prefill
(nothing cached) leaves the step unmatched.
"""

from pathlib import Path

from support.realtime_engine_log import logged_steps, steps_the_engine_did_not_extend_alone

LOG = (Path(__file__).parent / "assets" / "realtime_step_log.txt").read_text()
FULL_REPREFILL = LOG.replace("#new-token: 10, #cached-token: 281", "#new-token: 291, #cached-token: 0")


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
