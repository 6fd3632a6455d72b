"""The frame window's edge: a frame stamped exactly W seconds before the newest frame is still in the window.

Rule (docstring of `moss_vl_reference/realtime_moss_vl.py`, and the real server's `frame_window.py` as summarised in
`/work/shared/reference/mossvl_realtime_facts.md`: frames *more than* the window behind the newest are dropped): a
frame stamped ``t`` stays while ``newest - t <= W``. The oracle below applies that rule to each frame on its own;
the code under test walks a moving start index. Timestamps are multiples of 0.25 s, exact in binary, so the edge is
hit exactly. Checked for the served session (`ServedSession._window_starts`) and for the reference stream
(`RealtimeStream.first_frame_in_window`), each built without a model (both read only the fields set here).
"""

from types import SimpleNamespace

import pytest

WINDOW_S = 1.0
# Frames at 0.5 s steps with W = 1 s: each new frame puts a frame exactly on the edge (t - 1.0).
STAMPS = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 4.0, 4.25, 5.25]


def oracle_first_in_window(stamps: list[float], newest_index: int) -> int:
    """The first frame (of those up to ``newest_index``) not more than the window behind the newest one."""
    newest = stamps[newest_index]
    return next(i for i, t in enumerate(stamps[: newest_index + 1]) if newest - t <= WINDOW_S)


EXPECTED = [oracle_first_in_window(STAMPS, j) for j in range(len(STAMPS))]


def test_the_oracle_keeps_a_frame_on_the_edge():
    assert EXPECTED == [0, 0, 0, 1, 2, 3, 6, 6, 7]  # at 2.0 the frame at 1.0 (index 2) stays; at 5.25, 4.25 stays


@pytest.mark.parametrize("batch", [1, 2, len(STAMPS)], ids=lambda n: f"{n}_per_step")
def test_the_served_session_keeps_a_frame_on_the_edge(batch):
    from mossvl_ascend.realtime.engine import ServedSession

    session = object.__new__(ServedSession)
    session.frame_window_s, session.frame_times, session.window_start = WINDOW_S, [], 0
    starts = []
    for first in range(0, len(STAMPS), batch):
        starts += session._window_starts([SimpleNamespace(timestamp=t) for t in STAMPS[first : first + batch]])
    assert starts == EXPECTED


def test_the_reference_stream_keeps_a_frame_on_the_edge():
    from moss_vl_reference.realtime_moss_vl import RealtimeStream

    stream = object.__new__(RealtimeStream)
    stream.frame_window_seconds, stream.frame_times = WINDOW_S, []
    starts, start = [], 0
    for stamp in STAMPS:
        stream.frame_times.append(stamp)
        start = stream.first_frame_in_window(stamp, start)
        starts.append(start)
    assert starts == EXPECTED
