"""The types the WebSocket layer and the engine session share (no sglang, no I/O).

A realtime session (:class:`EngineSession`) has the reference session's shape
(``moss_vl_reference.realtime_moss_vl.MossVLRealtimeSession``): frames and prompts are pushed as they arrive and
drained after every generated token; what the stream says comes back as :class:`Output` events on ``outputs``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional, Protocol


class RealtimeError(Exception):
    """A refused open, a bad input or an aborted session: ``code`` is the protocol's error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class SessionConfig:
    """What ``session.configure`` sets (the engine's view of it)."""

    prompt: str = ""
    system_prompt: Optional[str] = None
    max_new_tokens: int = 4096  # per turn; re-anchored after every drained input
    max_tokens_per_turn: Optional[float] = None  # a generated-tokens-per-second cap; None: uncapped
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False
    parked_timeout_s: Optional[float] = None  # a parked session (nothing to say, no input) ends after this long
    return_logprob: bool = False  # keep each generated token's log-probability (ServedSession.logprobs)
    include_usage: bool = False  # emit USAGE outputs (the context account) with each step's outputs
    # Frames stamped more than this before the newest leave the caches; None: the engine's window (or none).
    frame_window_s: Optional[float] = None


@dataclass
class Frame:
    """A decoded frame: an RGB PIL image and its timestamp in seconds; ``seq_no`` of the event that carried it."""

    image: object
    timestamp: float
    seq_no: Optional[int] = None


# Output kinds, in the order a turn produces them.
READY = "ready"  # the initial prefill ran (the session can take input)
PROCESSED = "processed"  # the step holding input event `seq_no` ran its extend (its K/V are in the pool)
TEXT = "text"  # `text` of turn `turn_id`
SILENCE = "silence"  # turn `turn_id` ended on <|silence|>
TURN_DONE = "turn_done"  # turn `turn_id` reached max_new_tokens
INTERRUPTED = "interrupted"  # a prompt closed turn `turn_id`; `next_turn_id` opens
USAGE = "usage"  # `usage`: the session's context use (session.usage's fields)
ERROR = "error"  # `code`, `message`; `fatal` ends the session
CLOSED = "closed"  # the session ended; nothing follows


@dataclass
class Output:
    kind: str
    text: str = ""
    turn_id: int = 0
    next_turn_id: Optional[int] = None
    seq_no: Optional[int] = None
    code: str = ""
    message: str = ""
    fatal: bool = False
    usage: dict = field(default_factory=dict)


class EngineSession(Protocol):
    """One open realtime session. ``push_*`` never block on the model; ``outputs`` yields :class:`Output`."""

    outputs: "asyncio.Queue[Output]"

    def push_prompt(self, prompt: str, seq_no: Optional[int] = None) -> None: ...

    def push_frame(self, frame: Frame, prompt: Optional[str] = None) -> None: ...

    @property
    def pending_inputs(self) -> int: ...

    async def close(self) -> None: ...


class RealtimeEngine(Protocol):
    """Opens sessions; ``check_capacity`` and ``open`` raise :class:`RealtimeError` (``session_capacity_exceeded``,
    ``insufficient_kv_capacity``) when the engine cannot hold one more full context, ``open`` also
    ``invalid_request`` for a configuration it cannot serve."""

    def capabilities(self) -> dict: ...

    def check_capacity(self, waiting: int = 0) -> None:
        """Refuse one more session while ``waiting`` more connections (not yet configured) hold a place."""

    async def open(self, config: SessionConfig) -> EngineSession: ...
