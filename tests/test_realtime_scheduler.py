"""The scheduler side of realtime sessions (`mossvl_ascend.patches.realtime_sessions`) on its own: a step's plan
with a frame window, and the retraction order under decode memory pressure. The served tests
(`test_serving_realtime_ws.py`, `test_serving_realtime.py`) run both inside sglang; these pin the rules.

Oracle for the plan: the reference stream's rule written out here (`moss_vl_reference.realtime_moss_vl`
`RealtimeStream.append`): a row sees the frames from the window start in force at it (the one before the step
until the step's new frame j's pad, then the one after frame j) up to the last pad at or before it.
"""

from types import SimpleNamespace

import pytest

from mossvl_ascend.patches import realtime_sessions as rs

PAD = 9  # the <|image_pad|> id of these plans


def test_a_windowed_plan_gives_each_row_the_window_in_force_at_it():
    rows = [1, 2, PAD, 3, PAD, 4]
    plan = rs.plan_step(rows, [(2, 2), (2, 2)], PAD, 100, 5, window_start=1, window_starts=[2, 4])
    assert plan.visible_frames.tolist() == [5, 5, 6, 6, 7, 7]
    assert plan.first_frames.tolist() == [1, 1, 2, 2, 4, 4]
    assert plan.window_start == 4


def test_an_unwindowed_plan_starts_every_row_at_the_session_start():
    plan = rs.plan_step([1, PAD, 2], [(2, 2)], PAD, 0, 3)
    assert plan.first_frames.tolist() == [0, 0, 0] and plan.window_start == 0


@pytest.mark.parametrize(
    "starts, why",
    [([0, 4], "moves back"), ([2, 7], "drops its own frame"), ([2], "one start for two frames")],
)
def test_window_starts_that_break_the_rule_are_refused(starts, why):
    with pytest.raises(ValueError, match="window starts"):
        rs.plan_step([PAD, PAD], [(2, 2), (2, 2)], PAD, 0, 5, window_start=1, window_starts=starts)


def _step_request(monkeypatch, session: str, held: int):
    rid = rs.step_rid(session, 3)
    stream = rs.Stream(session)
    stream.step = rs.RunningStep(rid, plan=None, encoder_rows=0, vision_tokens=0)
    monkeypatch.setitem(rs._STREAMS, session, stream)
    return SimpleNamespace(rid=rid, kv=SimpleNamespace(kv_allocated_len=held, holds_kv=True))


def test_retraction_takes_ordinary_requests_then_the_heaviest_session(monkeypatch):
    """Indices are kept first; retraction pops from the end: ordinary requests (which are queued again) in stock's
    order, then the session holding the most KV."""
    reqs = [
        _step_request(monkeypatch, "aa", 900),
        SimpleNamespace(rid="chat-1", kv=SimpleNamespace(kv_allocated_len=5000, holds_kv=True)),
        _step_request(monkeypatch, "bb", 4000),
        _step_request(monkeypatch, "cc", 100),
        SimpleNamespace(rid="chat-2", kv=SimpleNamespace(kv_allocated_len=10, holds_kv=True)),
    ]
    stock_order = [4, 3, 2, 1, 0]
    order = rs.heaviest_sessions_retracted_first(stock_order, reqs)
    assert order == [3, 0, 2, 4, 1]
    retracted = [order.pop() for _ in range(3)]
    assert retracted == [1, 4, 2]  # both ordinary requests, then session "bb"


def test_retraction_order_without_sessions_is_stock(monkeypatch):
    reqs = [SimpleNamespace(rid=f"chat-{i}", kv=SimpleNamespace(kv_allocated_len=i, holds_kv=True)) for i in range(3)]
    assert rs.heaviest_sessions_retracted_first([2, 0, 1], reqs) == [2, 0, 1]
