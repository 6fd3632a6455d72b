"""What the MOSS-VL-Realtime Demo's sglang-omni adapter would show for a session's events: a model of its behaviour,
written here from its documented rules (not its code), to judge a served session the way that client judges it.

The rules (fnlp-vision/MOSS-VL-Realtime_Demo, ``client/session/``, the sglang-omni adapter, read for facts only):

* the first event of a connection is ``session.created``, or ``error{code: session_capacity_exceeded}``: the replica
  is busy (retry later), not down;
* the current turn starts at ``session.created``'s ``turn_id`` and advances ONLY on ``response.turn.interrupted``
  (to its ``next_turn_id``); a ``response.text.delta`` of any other turn is a straggler and is dropped;
* a barge-in mutes the output until an interrupt whose ``seq_no`` reaches the ``seq_no`` the barge-in's prompt was
  sent with (an interrupt without ``seq_no``, or an older one, keeps it muted);
* context budget: from ``session.usage`` (``context_limit``, ``token_space_used``; all four counters non-negative
  integers, the limit positive), never from its own estimate once usage arrived.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

USAGE_FIELDS = ("decoder_tokens", "encoder_tokens", "token_space_used", "context_limit")


def first_event_verdict(event: dict) -> str:
    """``ok`` (a session), ``busy`` (capacity refusal: retry later) or ``down`` (anything else)."""
    if event.get("type") == "session.created":
        return "ok"
    if event.get("type") == "error" and event.get("code") == "session_capacity_exceeded":
        return "busy"
    return "down"


@dataclass
class DemoView:
    """The adapter's state after a run of events."""

    turn: int = 0
    muted: bool = False
    resume_after_seq: int = 0
    shown: dict[int, str] = field(default_factory=dict)  # turn -> the text the user saw
    dropped: list[dict] = field(default_factory=list)  # deltas it discarded (stragglers or muted)
    turn_ends: list[int] = field(default_factory=list)  # turns it closed on an interrupt (its <|eot_id|>)
    usage: Optional[dict] = None
    invalid_usage: list[dict] = field(default_factory=list)

    def barge_in(self, prompt_seq_no: int) -> None:
        """The user speaks over the model: mute until the interrupt of the prompt sent with ``prompt_seq_no``."""
        self.muted, self.resume_after_seq = True, prompt_seq_no

    def context_remaining(self) -> Optional[int]:
        return None if self.usage is None else max(0, self.usage["context_limit"] - self.usage["token_space_used"])

    def feed(self, event: dict) -> None:
        kind = event.get("type")
        if kind == "session.created":
            self.turn = int(event.get("turn_id") or 0)
        elif kind == "response.turn.interrupted":
            old = int(event.get("turn_id") or self.turn)
            self.turn = int(event.get("next_turn_id") or old + 1)
            if self.muted:
                seq_no = event.get("seq_no")
                if not isinstance(seq_no, int) or seq_no < self.resume_after_seq:
                    return
                self.muted = False
            self.turn_ends.append(old)
        elif kind == "response.text.delta":
            if int(event.get("turn_id") or 0) != self.turn or self.muted:
                self.dropped.append(event)
                return
            self.shown[self.turn] = self.shown.get(self.turn, "") + event["delta"]
        elif kind == "session.usage":
            valid = all(
                isinstance(event.get(key), int) and not isinstance(event[key], bool) and event[key] >= 0
                for key in USAGE_FIELDS
            )
            if not valid or event["context_limit"] <= 0:
                self.invalid_usage.append(event)
                return
            self.usage = {key: event[key] for key in USAGE_FIELDS}


def demo_view(events: list[dict], barge_ins: dict[int, int] | None = None) -> DemoView:
    """Replay ``events`` (in arrival order) through the adapter's rules; ``barge_ins``: event index -> the prompt's
    ``seq_no``, a barge-in made just before that event arrived."""
    view = DemoView()
    for index, event in enumerate(events):
        if barge_ins and index in barge_ins:
            view.barge_in(barge_ins[index])
        view.feed(event)
    return view
