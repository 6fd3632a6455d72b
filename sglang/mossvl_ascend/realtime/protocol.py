"""The events of sglang-omni-realtime's ``/v1/video/realtime`` WebSocket protocol, and their validation.

Facts relied on (read from fnlp-vision/sglang-omni-realtime ``sglang_omni/serve/video_realtime.py`` and
``_sources/cookbook/moss_vl_realtime.md``):

* Client JSON events: ``session.configure`` (``extra="forbid"``), ``input.frame`` (metadata; the image follows as
  one binary message after the server's ``input.frame.ready``), ``input.prompt`` and ``session.abort``. All
  client models forbid unknown fields.
* ``seq_no`` is one dense space from 0 shared by frames and prompts; frame timestamps never decrease. A violation
  is a per-event ``invalid_request`` error and the session goes on; a rejected event does not consume its
  ``seq_no`` (the client may resend it).
* Frames are JPEG, PNG or WebP, at most 32 MiB by default (the real server's ``MAX_FRAME_BYTES``).
* Server events and their fields are the ``*Event`` models below; optional fields the real server omits when
  unset are left out of the wire dict (see :meth:`ServerEvent.dump`).

Deliberate differences (all listed in docs/architecture.md, "Realtime sessions in sglang"): the real server ends the
session on an oversize binary message (``frame_too_large``); here it is a per-event error like an undecodable frame,
and the session goes on. The real server decodes the image in the scheduler; here it is decoded at the edge, so a
bad image, or one whose header says it has more pixels than the processor takes, is a per-event ``invalid_request``
instead of a session abort.
"""

from __future__ import annotations

import json
from io import BytesIO
from typing import Any, ClassVar, Literal, Optional, Union

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_FRAME_BYTES = 32 * 1024 * 1024
MAX_INPUT_QUEUE_CAPACITY = 256
CONFIGURE_TIMEOUT_S = 180.0
UNTHROTTLED_TOKENS_PER_S = 86400.0  # the real default of max_tokens_per_turn: no rate cap
MAX_PREFILL_CHARS = 131072

# Error codes, as the real server spells them.
INVALID_REQUEST = "invalid_request"
CONFIGURATION_TIMEOUT = "configuration_timeout"
FRAME_TOO_LARGE = "frame_too_large"
INPUT_QUEUE_FULL = "input_queue_full"
INPUT_SUBMISSION_FAILED = "input_submission_failed"
RESPONSE_FAILED = "response_failed"
SESSION_CAPACITY_EXCEEDED = "session_capacity_exceeded"
INSUFFICIENT_KV_CAPACITY = "insufficient_kv_capacity"

_FORMATS_BY_MIME = {"image/jpeg": "JPEG", "image/png": "PNG", "image/webp": "WEBP"}


class ProtocolError(Exception):
    """A client event the protocol rejects; ``code`` goes into the ``error`` event."""

    def __init__(self, message: str, *, code: str = INVALID_REQUEST, seq_no: Optional[int] = None):
        super().__init__(message)
        self.code, self.message, self.seq_no = code, message, seq_no


# ---------------------------------------------------------------------------------------------------- client


class _ClientEvent(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PrefillMessage(_ClientEvent):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=MAX_PREFILL_CHARS)


class SessionConfigure(_ClientEvent):
    type: Literal["session.configure"]
    prompt: str = ""  # the real default: empty, as in the Transformers reference
    system_prompt: Optional[str] = None
    prefill_messages: Optional[list[PrefillMessage]] = Field(default=None, min_length=1, max_length=64)
    max_new_tokens: int = Field(default=4096, gt=0)
    # A generation rate cap in tokens per second despite its name.
    max_tokens_per_turn: float = Field(default=UNTHROTTLED_TOKENS_PER_S, gt=0.0, allow_inf_nan=False)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    input_queue_capacity: int = Field(default=4, ge=1, le=MAX_INPUT_QUEUE_CAPACITY)
    benchmark_ignore_eos: bool = False
    include_usage: bool = False

    @field_validator("prefill_messages")
    @classmethod
    def _bound_prefill_text(cls, messages):
        if messages is not None and sum(len(m.content) for m in messages) > MAX_PREFILL_CHARS:
            raise ValueError(f"prefill_messages text exceeds {MAX_PREFILL_CHARS} characters")
        return messages


class InputFrame(_ClientEvent):
    type: Literal["input.frame"]
    seq_no: int = Field(ge=0)
    timestamp: float = Field(ge=0.0, allow_inf_nan=False)
    prompt: Optional[str] = None
    final: bool = False
    mime_type: Literal["image/jpeg", "image/png", "image/webp"]

    @field_validator("prompt")
    @classmethod
    def _blank_prompt_is_none(cls, value: Optional[str]) -> Optional[str]:
        # A blank prompt on a frame means "no prompt" (no barge-in), as in the real server.
        return value if value is not None and value.strip() else None


class InputPrompt(_ClientEvent):
    type: Literal["input.prompt"]
    seq_no: int = Field(ge=0)
    prompt: str = Field(min_length=1)
    final: bool = False

    @field_validator("prompt")
    @classmethod
    def _reject_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("prompt must contain non-whitespace text")
        return value


class SessionAbort(_ClientEvent):
    type: Literal["session.abort"]


ClientEvent = Union[SessionConfigure, InputFrame, InputPrompt, SessionAbort]
_CLIENT_EVENTS: dict[str, type[_ClientEvent]] = {
    "session.configure": SessionConfigure,
    "input.frame": InputFrame,
    "input.prompt": InputPrompt,
    "session.abort": SessionAbort,
}


def load_json_object(text: Optional[str]) -> dict:
    """The top-level JSON object of a text message, or :class:`ProtocolError`."""
    if text is None:
        raise ProtocolError("empty WebSocket message")
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"malformed JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise ProtocolError("top-level message must be a JSON object")
    return payload


def parse_client_event(payload: dict) -> ClientEvent:
    """Validate one decoded JSON event; an unknown type or a schema violation is :class:`ProtocolError`."""
    model = _CLIENT_EVENTS.get(payload.get("type"))
    if model is None:
        raise ProtocolError(f"unsupported event type: {payload.get('type')!r}")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        seq_no = payload.get("seq_no")
        raise ProtocolError(_short(exc), seq_no=seq_no if isinstance(seq_no, int) else None) from None


def _short(exc: ValidationError) -> str:
    parts = [f"{'.'.join(str(p) for p in e['loc']) or '<event>'}: {e['msg']}" for e in exc.errors()]
    return "; ".join(parts)


class InputOrder:
    """The ordering rules: one dense ``seq_no`` space from 0 for frames and prompts, non-decreasing timestamps.

    ``check`` before an event is acted on; ``commit`` once it was handed to the engine, so a rejected event
    leaves its ``seq_no`` free.
    """

    def __init__(self) -> None:
        self.next_seq_no = 0
        self.last_timestamp = 0.0

    def check(self, seq_no: int, timestamp: Optional[float] = None) -> None:
        if seq_no != self.next_seq_no:
            raise ProtocolError(f"expected seq_no {self.next_seq_no}, received {seq_no}", seq_no=seq_no)
        if timestamp is not None and timestamp < self.last_timestamp:
            raise ProtocolError(f"timestamp moved backwards: {timestamp} < {self.last_timestamp}", seq_no=seq_no)

    def commit(self, seq_no: int, timestamp: Optional[float] = None) -> None:
        self.next_seq_no = seq_no + 1
        if timestamp is not None:
            self.last_timestamp = float(timestamp)


def decode_frame(
    data: bytes,
    mime_type: str,
    *,
    max_frame_bytes: int = MAX_FRAME_BYTES,
    max_pixels: Optional[int] = None,
    seq_no=None,
):
    """Decode one binary frame into an RGB PIL image; too large -> ``frame_too_large``, else ``invalid_request``.

    Only the three formats the protocol names are tried, so a payload of any other format is undecodable. The
    declared ``mime_type`` is not required to match the bytes (the real server does not check it either). An image
    of more than ``max_pixels`` pixels is refused from its header (PIL reads the size without decoding): a small
    file can decode to a huge image.
    """
    if not data:
        raise ProtocolError("frame payload must be non-empty", seq_no=seq_no)
    if len(data) > max_frame_bytes:
        raise ProtocolError(
            f"frame payload of {len(data)} bytes exceeds max_frame_bytes {max_frame_bytes}",
            code=FRAME_TOO_LARGE,
            seq_no=seq_no,
        )
    try:
        with Image.open(BytesIO(data), formats=tuple(_FORMATS_BY_MIME.values())) as image:
            width, height = image.size
            if max_pixels is not None and width * height > max_pixels:
                raise ProtocolError(
                    f"frame of {width}x{height} = {width * height} pixels exceeds the processor's limit "
                    f"max_input_pixels={max_pixels}",
                    seq_no=seq_no,
                )
            image.load()
            return image.convert("RGB")
    except ProtocolError:
        raise
    except Exception as exc:  # PIL raises many types (UnidentifiedImageError, OSError, DecompressionBombError)
        raise ProtocolError(f"undecodable {mime_type} frame: {exc}", seq_no=seq_no) from None


# ---------------------------------------------------------------------------------------------------- server


class ServerEvent(BaseModel):
    """A server event; :meth:`dump` is its wire dict."""

    type: ClassVar[str]

    def dump(self) -> dict[str, Any]:
        # Only the fields the caller set: optional keys the real server omits stay absent, while a field set
        # to None on purpose (silence's seq_no before any input) is sent as null.
        return {"type": self.type, **self.model_dump(exclude_unset=True)}


class SessionCreatedEvent(ServerEvent):
    type: ClassVar[str] = "session.created"
    session_id: str
    request_id: str
    model: str
    turn_id: int = 0
    capabilities: list[str]
    configure_timeout_s: float


class SessionConfiguredEvent(ServerEvent):
    type: ClassVar[str] = "session.configured"
    session_id: str
    request_id: str
    input_queue_capacity: int
    max_tokens_per_turn: float
    max_frame_bytes: int
    parked_request_timeout_s: float


class SessionReadyEvent(ServerEvent):
    type: ClassVar[str] = "session.ready"
    session_id: str
    request_id: str
    turn_id: int


class FrameReadyEvent(ServerEvent):
    type: ClassVar[str] = "input.frame.ready"
    seq_no: int


class FrameAcceptedEvent(ServerEvent):
    type: ClassVar[str] = "input.frame.accepted"
    seq_no: int
    timestamp: float
    final: bool
    pending_events: int
    interrupts_current_turn: bool


class PromptAcceptedEvent(ServerEvent):
    type: ClassVar[str] = "input.prompt.accepted"
    seq_no: int
    final: bool
    pending_events: int
    interrupts_current_turn: bool  # always true: any prompt closes the current turn


class _ProcessedFields(ServerEvent):
    seq_no: int
    timestamp: float
    final: bool
    pending_events: int
    # Set only when the input opened a new turn (it carried a prompt).
    interrupted_turn_id: Optional[int] = None
    turn_id: Optional[int] = None


class FrameProcessedEvent(_ProcessedFields):
    type: ClassVar[str] = "input.frame.processed"


class PromptProcessedEvent(_ProcessedFields):
    type: ClassVar[str] = "input.prompt.processed"


class TextDeltaEvent(ServerEvent):
    type: ClassVar[str] = "response.text.delta"
    delta: str
    turn_id: int


class TurnSilenceEvent(ServerEvent):
    type: ClassVar[str] = "response.turn.silence"
    turn_id: int
    seq_no: Optional[int]
    timestamp: Optional[float]
    silence_seq: int


class TurnInterruptedEvent(ServerEvent):
    type: ClassVar[str] = "response.turn.interrupted"
    turn_id: int
    next_turn_id: int
    seq_no: Optional[int]


class ResponseDoneEvent(ServerEvent):
    type: ClassVar[str] = "response.done"
    finish_reason: str
    turn_id: int


class SessionDoneEvent(ServerEvent):
    type: ClassVar[str] = "session.done"
    session_id: str
    aborted: bool


class SessionUsageEvent(ServerEvent):
    """Resource counters (``decoder_tokens``, ``encoder_tokens``, ``context_remaining``, ...) passed through."""

    model_config = ConfigDict(extra="allow")
    type: ClassVar[str] = "session.usage"


class ErrorEvent(ServerEvent):
    type: ClassVar[str] = "error"
    code: str
    message: str
    seq_no: Optional[int] = None  # ours: the rejected event's seq_no when known (the real error has none)
    retryable: bool = False


def error_event(exc: ProtocolError) -> dict[str, Any]:
    fields = {"code": exc.code, "message": exc.message}
    if exc.seq_no is not None:
        fields["seq_no"] = exc.seq_no
    return ErrorEvent(**fields).dump()
