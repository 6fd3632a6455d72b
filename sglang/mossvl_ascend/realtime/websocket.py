"""``WS /v1/video/realtime`` and ``GET /v1/video/realtime/capabilities``, speaking sglang-omni-realtime's protocol.

One connection is one :class:`~.session_api.EngineSession`:

0. the handshake: with ``--api-key`` / ``--admin-api-key`` the key is checked first (401, no session state); a
   server already holding as many sessions (configured or not) as it can carry sends
   ``error{code: session_capacity_exceeded}`` and closes 1013 before ``session.created``, as the real server does;
   a PD prefill or decode worker sends ``error{code: unsupported_deployment}`` and closes 1011 there;
1. server ``session.created``; the client has ``configure_timeout_s`` to send a valid ``session.configure``
   (invalid messages get an error and do not reset the deadline; expiry: ``configuration_timeout``, close);
2. ``engine.open`` (a :class:`RealtimeError` -> ``error`` with its code: ``invalid_request``, a configuration the
   engine cannot serve, waits for another configure; otherwise close, 1013 for the capacity codes);
   server ``session.configured``; the engine's READY -> ``session.ready``;
3. per frame: ``input.frame`` -> ``input.frame.ready`` (held back while the engine session holds
   ``input_queue_capacity`` pending inputs; frames are never dropped) -> binary image -> ``input.frame.accepted``
   -> ``input.frame.processed``; ``input.prompt`` -> ``input.prompt.accepted`` -> ``input.prompt.processed``;
4. outputs: ``response.text.delta``, ``response.turn.silence``, ``response.turn.interrupted``, ``response.done``,
   ``session.done``, ``session.usage`` (only with ``include_usage``), ``error``.

Ending, as the real native endpoint does it: ``response.done`` ends the persistent session, so it is sent only
(a) at the first silence after the client's ``final`` input was processed (``finish_reason`` "stop") or (b) when a
turn reached ``max_new_tokens`` (``finish_reason`` "length"); ``session.done`` follows. The real server lets
generation run on after ``final`` until EOS; the engine API has no ``final`` flag, so here the first silence
after it is the end. ``session.abort``, a fatal engine error, a disconnect and the engine's CLOSED end it too.
Whatever ends the connection, ``EngineSession.close()`` is awaited exactly once.

Inputs are acknowledged in order: the engine push and the ``accepted`` event happen under the send lock, so the
engine's ``interrupted``/``processed`` for an input can never reach the client before its ``accepted``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import Any, Awaitable, Callable, Optional

import anyio
from fastapi import FastAPI, WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from . import protocol as p
from . import session_api as api

logger = logging.getLogger(__name__)

CAPACITY_CLOSE_CODE = 1013  # "try again later": the engine cannot hold one more session
# The realtime video socket's path (the real server's); its capabilities route is under it.
VIDEO_REALTIME_PATH = "/v1/video/realtime"
_CAPACITY_CODES = {p.SESSION_CAPACITY_EXCEEDED, p.INSUFFICIENT_KV_CAPACITY}


def close_code_of(error_code: str) -> int:
    """The WebSocket close code after a refused session: 1013 (try again later) for the capacity codes, else 1011."""
    return CAPACITY_CLOSE_CODE if error_code in _CAPACITY_CODES else 1011


# Fallback re-check of pending_inputs while input.frame.ready is held back: the engine's outputs wake the wait
# at once, but pending_inputs may also fall without an output (a drain that emits nothing yet).
_CAPACITY_POLL_S = 0.05


@dataclasses.dataclass(frozen=True)
class _Limits:
    model_name: str
    configure_timeout_s: float
    max_frame_bytes: int
    parked_request_timeout_s: float
    allow_benchmark_mode: bool


# The subprotocol a browser offers with its key (browsers cannot set headers on a WebSocket), OpenAI Realtime's
# convention for `/v1/realtime`: ``new WebSocket(url, ["realtime", "openai-insecure-api-key." + key])``.
REALTIME_SUBPROTOCOL = "realtime"
KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."


def socket_message_limit() -> int:
    """The largest WebSocket message the server stack (uvicorn, as sglang starts it: no ``ws_max_size``) delivers;
    a larger one closes the connection with 1009 before the handler sees it."""
    import inspect

    import uvicorn

    return int(inspect.signature(uvicorn.Config).parameters["ws_max_size"].default)


def mount(
    app: FastAPI,
    engine: api.RealtimeEngine,
    *,
    configure_timeout_s: float = p.CONFIGURE_TIMEOUT_S,
    max_frame_bytes: int = p.MAX_FRAME_BYTES,
    parked_request_timeout_s: float = 300.0,
    model_name: str = "moss-vl-realtime",
    allow_benchmark_mode: bool = False,
    api_keys: Callable[[], tuple[Optional[str], Optional[str]]] = lambda: (None, None),
) -> Callable[[WebSocket], Awaitable[None]]:
    """Add the realtime video endpoints to ``app``; sessions come from ``engine``. -> the WebSocket endpoint (to
    mount under another path too).

    ``parked_request_timeout_s`` is only advertised in ``session.configured``: enforcing it is the engine's job.
    ``benchmark_ignore_eos`` is refused unless ``allow_benchmark_mode`` (as in the real server). ``max_frame_bytes``
    is capped below the server stack's message limit, so the advertised limit is the one enforced (one byte more
    gets ``frame_too_large``, not a closed socket). ``api_keys``: sglang's ``(--api-key, --admin-api-key)``, checked
    at the handshake as sglang's middleware checks HTTP (which passes WebSockets through unchecked).
    """
    if not configure_timeout_s > 0 or max_frame_bytes <= 0:
        raise ValueError("configure_timeout_s and max_frame_bytes must be positive")
    limits = _Limits(
        model_name,
        float(configure_timeout_s),
        min(int(max_frame_bytes), socket_message_limit() - 1),
        float(parked_request_timeout_s),
        bool(allow_benchmark_mode),
    )
    waiting: set = set()  # connections admitted and not yet configured: they hold a session slot

    @app.get(f"{VIDEO_REALTIME_PATH}/capabilities")
    async def video_realtime_capabilities() -> dict:
        return _capabilities(engine)

    async def video_realtime(websocket: WebSocket) -> None:
        if not await _authorized(websocket, *api_keys()):
            return
        offered = websocket.scope.get("subprotocols") or ()
        await websocket.accept(subprotocol=REALTIME_SUBPROTOCOL if REALTIME_SUBPROTOCOL in offered else None)
        try:
            engine.check_capacity(waiting=len(waiting))
        except api.RealtimeError as exc:
            # Before session.created, as the real server refuses: a client reads its first event for this code.
            logger.info("realtime connection refused: %s (%s)", exc.code, exc.message)
            await websocket.send_json(p.ErrorEvent(code=exc.code, message=exc.message).dump())
            await websocket.close(code=close_code_of(exc.code))
            return
        connection = _Connection(websocket, engine, limits, waiting)
        waiting.add(connection)
        try:
            await connection.run()
        finally:
            waiting.discard(connection)

    app.add_api_websocket_route(VIDEO_REALTIME_PATH, video_realtime)
    return video_realtime


def presented_key(websocket: WebSocket) -> Optional[str]:
    """The key a client presents at the handshake: ``Authorization: Bearer <key>`` or, from a browser (which cannot
    set headers on a WebSocket), the subprotocol ``openai-insecure-api-key.<key>``; None when neither is there."""
    authorization = websocket.headers.get("authorization")
    if authorization is not None:
        parts = authorization.split(" ", 1)  # sglang's own reading of the header (utils/auth.py)
        return parts[1] if len(parts) == 2 and parts[0].lower() == "bearer" else None
    for offered in websocket.scope.get("subprotocols") or ():
        if offered.startswith(KEY_SUBPROTOCOL_PREFIX):
            return offered[len(KEY_SUBPROTOCOL_PREFIX) :]
    return None


async def refuse_handshake(websocket: WebSocket, status: int) -> None:
    """Answer a refused handshake with HTTP ``status`` (a close 1008 where the server cannot send an HTTP
    response), before the socket is accepted and before any session state exists."""
    logger.info("realtime handshake refused: no valid API key (%s)", websocket.url.path)
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        from fastapi.responses import JSONResponse

        body = {"error": "Unauthorized" if status == 401 else "Forbidden"}
        await websocket.send_denial_response(JSONResponse(body, status_code=status))
    else:
        await websocket.close(code=1008)


async def _authorized(websocket: WebSocket, api_key: Optional[str], admin_api_key: Optional[str]) -> bool:
    """sglang's HTTP rule for a normal endpoint (``decide_request_auth``) applied to the key the handshake presents
    (:func:`presented_key`); a refusal is answered by :func:`refuse_handshake`."""
    if not api_key and not admin_api_key:
        return True
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    key = presented_key(websocket)
    decision = decide_request_auth(
        method="GET",
        path=websocket.url.path,
        authorization_header=None if key is None else f"Bearer {key}",
        api_key=api_key,
        admin_api_key=admin_api_key,
        auth_level=AuthLevel.NORMAL,
    )
    if decision.allowed:
        return True
    await refuse_handshake(websocket, decision.error_status_code)
    return False


def _capabilities(engine: api.RealtimeEngine) -> dict:
    # Clients probe prefill_messages before sending it; SessionConfig has no such field yet, so it is off unless
    # the engine says otherwise.
    return {"prefill_messages": False, **(engine.capabilities() or {})}


@dataclasses.dataclass(frozen=True)
class _Ended:
    """What a connection task returns when the session is over; ``aborted`` goes into ``session.done``."""

    aborted: bool


class _Connection:
    def __init__(self, websocket: WebSocket, engine: api.RealtimeEngine, limits: _Limits, waiting: set):
        self.ws, self.engine, self.limits = websocket, engine, limits
        self.waiting = waiting
        # A frame decoding to more pixels than the processor takes is refused from its header, before it is decoded.
        self.max_pixels: Optional[int] = (engine.capabilities() or {}).get("max_input_pixels")
        self.session_id = f"video_sess_{uuid.uuid4().hex}"
        self.request_id = f"video_req_{uuid.uuid4().hex}"
        self.send_lock = asyncio.Lock()
        self.session: Optional[api.EngineSession] = None
        self.config: Optional[p.SessionConfigure] = None
        self.order = p.InputOrder()
        self.ready = False
        self.turn_id = 0
        self.silence_seq = 0
        self.pending_frame: Optional[p.InputFrame] = None
        self.final_received = False
        self.final_processed = False
        # seq_no -> (kind, timestamp, final) of every accepted input, for its processed/silence events.
        self.inputs: dict[int, tuple[str, float, bool]] = {}
        self.transitions: dict[int, tuple[int, int]] = {}  # seq_no -> (interrupted turn, new turn)
        self.last_processed: Optional[int] = None
        self.capacity_changed = asyncio.Event()
        self.done_sent = False

    # ------------------------------------------------------------------------------------------- lifecycle

    async def run(self) -> None:
        try:
            await self.send(
                p.SessionCreatedEvent(
                    session_id=self.session_id,
                    request_id=self.request_id,
                    model=self.limits.model_name,
                    turn_id=0,
                    capabilities=["session.usage"],
                    configure_timeout_s=self.limits.configure_timeout_s,
                )
            )
            if not await self._configure():
                return
            await self._serve()
        except WebSocketDisconnect:
            logger.info("realtime session %s: client disconnected", self.session_id)
        except Exception:
            logger.exception("realtime session %s failed", self.session_id)
            await self._send_quietly(p.ErrorEvent(code=p.RESPONSE_FAILED, message="internal error"))
            await self._send_done(aborted=True)
        finally:
            # Shielded: a server cancelling the handler on disconnect must not skip freeing the session's KV.
            with anyio.CancelScope(shield=True):
                if self.session is not None:
                    session, self.session = self.session, None
                    try:
                        await session.close()
                    except Exception:
                        logger.exception("realtime session %s: close() failed", self.session_id)
                await self._close_socket()

    async def _configure(self) -> bool:
        """Wait for a valid ``session.configure`` and open the engine session; False: the connection is over."""
        deadline = asyncio.get_running_loop().time() + self.limits.configure_timeout_s
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(self.ws.receive(), timeout=max(remaining, 0.0))
            except asyncio.TimeoutError:
                await self.send_error(
                    p.ProtocolError(
                        "session.configure was not received before the deadline", code=p.CONFIGURATION_TIMEOUT
                    )
                )
                return False
            if message["type"] == "websocket.disconnect":
                return False
            try:
                if message.get("text") is None:
                    raise p.ProtocolError("configure the session before sending frames")
                event = p.parse_client_event(p.load_json_object(message["text"]))
                if isinstance(event, p.SessionAbort):
                    return False
                if not isinstance(event, p.SessionConfigure):
                    raise p.ProtocolError(f"configure the session before sending {event.type}")
                config = self._session_config(event)
            except p.ProtocolError as exc:
                await self.send_error(exc)
                continue
            self.waiting.discard(self)  # from here the engine counts this session itself
            try:
                self.session = await self.engine.open(config)
            except api.RealtimeError as exc:
                logger.info("realtime session %s refused: %s (%s)", self.session_id, exc.code, exc.message)
                await self.send_error(p.ProtocolError(exc.message, code=exc.code))
                if exc.code == p.INVALID_REQUEST:  # a configuration the engine cannot serve: the client may retry
                    self.waiting.add(self)
                    continue
                await self._close_socket(close_code_of(exc.code))
                return False
            break
        self.config = event
        await self.send(
            p.SessionConfiguredEvent(
                session_id=self.session_id,
                request_id=self.request_id,
                input_queue_capacity=event.input_queue_capacity,
                max_tokens_per_turn=event.max_tokens_per_turn,
                max_frame_bytes=self.limits.max_frame_bytes,
                parked_request_timeout_s=self.limits.parked_request_timeout_s,
            )
        )
        return True

    def _session_config(self, event: p.SessionConfigure) -> api.SessionConfig:
        if event.benchmark_ignore_eos and not self.limits.allow_benchmark_mode:
            raise p.ProtocolError("benchmark_ignore_eos requires server benchmark mode")
        extra: dict[str, Any] = {}
        if event.prefill_messages is not None:
            fields = {f.name for f in dataclasses.fields(api.SessionConfig)}
            if "prefill_messages" not in fields or not _capabilities(self.engine).get("prefill_messages"):
                raise p.ProtocolError("prefill_messages is not supported by this server")
            extra["prefill_messages"] = [m.model_dump() for m in event.prefill_messages]
        # The wire default (86400 tok/s, sent or not) means "no cap", which SessionConfig spells None: the engine
        # paces a capped session one token per step, a cost an unthrottled session must not pay.
        rate_cap = event.max_tokens_per_turn
        if rate_cap >= p.UNTHROTTLED_TOKENS_PER_S:
            rate_cap = None
        return api.SessionConfig(
            prompt=event.prompt,
            system_prompt=event.system_prompt,
            max_new_tokens=event.max_new_tokens,
            max_tokens_per_turn=rate_cap,
            temperature=event.temperature,
            top_p=event.top_p,
            ignore_eos=event.benchmark_ignore_eos,
            parked_timeout_s=self.limits.parked_request_timeout_s,
            include_usage=event.include_usage,
            **extra,
        )

    async def _serve(self) -> None:
        """Read inputs and forward outputs until either side ends the session."""
        # Control reception (abort, disconnect) stays live while ordered input handling waits for capacity, so
        # the reader only stages messages; the staging queue is bounded like the real server's.
        staged: asyncio.Queue = asyncio.Queue()
        tasks = [
            asyncio.create_task(self._read(staged)),
            asyncio.create_task(self._handle_inputs(staged)),
            asyncio.create_task(self._forward_outputs()),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            ended = next(iter(done)).result()  # re-raises a task's unexpected exception
        finally:
            for task in tasks:
                task.cancel()
            # asyncio.wait, not gather: a cancelled gather re-raises a child's CancelledError, which a server's
            # cancel scope (anyio, as in starlette's TestClient) does not recognise as its own.
            await asyncio.wait(tasks)
            for task in tasks:
                if not task.cancelled() and task.exception() is not None:
                    logger.debug("realtime session %s: task ended with %r", self.session_id, task.exception())
        if isinstance(ended, _Ended):
            await self._finish(ended.aborted)

    async def _finish(self, aborted: bool) -> None:
        # The session's resources go before the client hears it is done.
        session, self.session = self.session, None
        with anyio.CancelScope(shield=True):
            try:
                await session.close()
            except Exception:
                logger.exception("realtime session %s: close() failed", self.session_id)
        await self._send_done(aborted)

    # ------------------------------------------------------------------------------------------------- input

    async def _read(self, staged: asyncio.Queue) -> Optional[_Ended]:
        capacity = self.config.input_queue_capacity
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                logger.info("realtime session %s: client disconnected", self.session_id)
                return None
            if message.get("bytes") is not None:
                item: Any = message["bytes"]
            else:
                try:
                    item = p.load_json_object(message.get("text"))
                except p.ProtocolError as exc:
                    await self.send_error(exc)
                    continue
                if item.get("type") == "session.abort":
                    logger.info("realtime session %s: aborted by the client", self.session_id)
                    return _Ended(aborted=True)
            # One metadata/binary pair per input credit plus one waiting pair, as in the real server.
            if staged.qsize() >= 2 * capacity + 2:
                await self.send_error(
                    p.ProtocolError(
                        "too many queued input messages; wait for acknowledgements", code=p.INPUT_QUEUE_FULL
                    )
                )
                return _Ended(aborted=True)
            staged.put_nowait(item)

    async def _handle_inputs(self, staged: asyncio.Queue) -> Optional[_Ended]:
        while True:
            item = await staged.get()
            try:
                if isinstance(item, bytes):
                    await self._on_frame_bytes(item)
                    continue
                event = p.parse_client_event(item)
                if isinstance(event, p.InputFrame):
                    await self._on_frame_metadata(event)
                elif isinstance(event, p.InputPrompt):
                    await self._on_prompt(event)
                else:
                    raise p.ProtocolError("session is already configured")
            except p.ProtocolError as exc:
                await self.send_error(exc)
            except api.RealtimeError as exc:
                # The engine refused an input: a bad input is per event, anything else ends the session.
                await self.send_error(p.ProtocolError(exc.message, code=exc.code))
                if exc.code != p.INVALID_REQUEST:
                    return _Ended(aborted=True)

    def _check_can_take_input(self, kind: str) -> None:
        if not self.ready:
            raise p.ProtocolError(f"wait for session.ready before sending {kind}s")
        if self.final_received:
            raise p.ProtocolError("session already received its final input")
        if self.pending_frame is not None:
            raise p.ProtocolError("previous frame metadata is still awaiting binary data")

    async def _on_frame_metadata(self, event: p.InputFrame) -> None:
        self._check_can_take_input("frame")
        self.order.check(event.seq_no, event.timestamp)
        await self._wait_for_capacity()
        self.pending_frame = event
        await self.send(p.FrameReadyEvent(seq_no=event.seq_no))

    async def _on_frame_bytes(self, data: bytes) -> None:
        meta, self.pending_frame = self.pending_frame, None
        if meta is None:
            raise p.ProtocolError("binary frame must follow input.frame metadata (and its input.frame.ready)")
        # Decoding is CPU work (a large JPEG takes tens of ms): keep it off the event loop.
        image = await asyncio.to_thread(
            p.decode_frame,
            data,
            meta.mime_type,
            max_frame_bytes=self.limits.max_frame_bytes,
            max_pixels=self.max_pixels,
            seq_no=meta.seq_no,
        )
        frame = api.Frame(image=image, timestamp=meta.timestamp, seq_no=meta.seq_no)
        async with self.send_lock:
            self.session.push_frame(frame, prompt=meta.prompt)
            self._accepted(meta.seq_no, "frame", meta.timestamp, meta.final)
            accepted = p.FrameAcceptedEvent(
                seq_no=meta.seq_no,
                timestamp=meta.timestamp,
                final=meta.final,
                pending_events=self.session.pending_inputs,
                interrupts_current_turn=meta.prompt is not None,
            )
            await self.ws.send_json(accepted.dump())

    async def _on_prompt(self, event: p.InputPrompt) -> None:
        self._check_can_take_input("prompt")
        self.order.check(event.seq_no)
        await self._wait_for_capacity()
        async with self.send_lock:
            self.session.push_prompt(event.prompt, event.seq_no)
            # A prompt has no video time: it is reported at the latest frame's timestamp, as the real server does.
            self._accepted(event.seq_no, "prompt", self.order.last_timestamp, event.final)
            accepted = p.PromptAcceptedEvent(
                seq_no=event.seq_no,
                final=event.final,
                pending_events=self.session.pending_inputs,
                interrupts_current_turn=True,
            )
            await self.ws.send_json(accepted.dump())

    def _accepted(self, seq_no: int, kind: str, timestamp: float, final: bool) -> None:
        self.order.commit(seq_no, timestamp if kind == "frame" else None)
        self.inputs[seq_no] = (kind, timestamp, final)
        self.final_received = final

    async def _wait_for_capacity(self) -> None:
        capacity = self.config.input_queue_capacity
        while self.session.pending_inputs >= capacity:
            self.capacity_changed.clear()
            try:
                await asyncio.wait_for(self.capacity_changed.wait(), timeout=_CAPACITY_POLL_S)
            except asyncio.TimeoutError:
                pass

    # ------------------------------------------------------------------------------------------------ output

    async def _forward_outputs(self) -> _Ended:
        while True:
            out: api.Output = await self.session.outputs.get()
            ended = await self._forward(out)
            # After the forward, so a client sees the processed event that freed a credit before the next ready.
            self.capacity_changed.set()
            if self.config.include_usage and out.usage:
                await self.send(p.SessionUsageEvent(**out.usage))
            if ended is not None:
                return ended

    async def _forward(self, out: api.Output) -> Optional[_Ended]:
        kind = out.kind
        if kind == api.READY:
            self.ready, self.turn_id = True, out.turn_id
            await self.send(
                p.SessionReadyEvent(session_id=self.session_id, request_id=self.request_id, turn_id=out.turn_id)
            )
        elif kind == api.PROCESSED:
            await self._forward_processed(out)
        elif kind == api.TEXT:
            if out.text:
                self.turn_id = out.turn_id
                await self.send(p.TextDeltaEvent(delta=out.text, turn_id=out.turn_id))
        elif kind == api.SILENCE:
            seq_no = out.seq_no if out.seq_no is not None else self.last_processed
            timestamp = self.inputs[seq_no][1] if seq_no in self.inputs else None
            await self.send(
                p.TurnSilenceEvent(
                    turn_id=out.turn_id, seq_no=seq_no, timestamp=timestamp, silence_seq=self.silence_seq
                )
            )
            self.silence_seq += 1
            if self.final_processed:
                await self.send(p.ResponseDoneEvent(finish_reason="stop", turn_id=out.turn_id))
                return _Ended(aborted=False)
        elif kind == api.TURN_DONE:
            # Reaching the generation allowance ends the native session ("length").
            await self.send(p.ResponseDoneEvent(finish_reason="length", turn_id=out.turn_id))
            return _Ended(aborted=False)
        elif kind == api.INTERRUPTED:
            next_turn = out.next_turn_id if out.next_turn_id is not None else out.turn_id + 1
            if out.seq_no is not None:
                self.transitions[out.seq_no] = (out.turn_id, next_turn)
            self.turn_id = next_turn
            await self.send(p.TurnInterruptedEvent(turn_id=out.turn_id, next_turn_id=next_turn, seq_no=out.seq_no))
        elif kind == api.ERROR:
            logger.warning("realtime session %s: engine error %s: %s", self.session_id, out.code, out.message)
            await self.send(p.ErrorEvent(code=out.code or p.RESPONSE_FAILED, message=out.message))
            if out.fatal:
                return _Ended(aborted=True)
        elif kind == api.CLOSED:
            return _Ended(aborted=False)
        elif kind == api.USAGE:
            pass  # its numbers go out as session.usage when the client asked (_forward_outputs)
        else:
            logger.warning("realtime session %s: unknown output kind %r", self.session_id, kind)
        return None

    async def _forward_processed(self, out: api.Output) -> None:
        record = self.inputs.get(out.seq_no)
        if record is None:
            logger.warning("realtime session %s: processed for unknown seq_no %r", self.session_id, out.seq_no)
            return
        input_kind, timestamp, final = record
        fields: dict[str, Any] = dict(
            seq_no=out.seq_no, timestamp=timestamp, final=final, pending_events=self.session.pending_inputs
        )
        transition = self.transitions.pop(out.seq_no, None)
        if transition is None and out.next_turn_id is not None:
            transition = (out.turn_id, out.next_turn_id)
        if transition is not None:
            fields.update(interrupted_turn_id=transition[0], turn_id=transition[1])
        model = p.FrameProcessedEvent if input_kind == "frame" else p.PromptProcessedEvent
        self.last_processed = out.seq_no
        self.final_processed = self.final_processed or final
        await self.send(model(**fields))

    # ------------------------------------------------------------------------------------------------- wire

    async def send(self, event: p.ServerEvent) -> None:
        async with self.send_lock:
            await self.ws.send_json(event.dump())

    async def send_error(self, exc: p.ProtocolError) -> None:
        logger.info("realtime session %s: %s (%s)", self.session_id, exc.code, exc.message)
        async with self.send_lock:
            await self.ws.send_json(p.error_event(exc))

    async def _send_quietly(self, event: p.ServerEvent) -> None:
        try:
            await self.send(event)
        except Exception:  # the client may be gone already; the original failure is what matters
            logger.debug("realtime session %s: could not send %s", self.session_id, event.type, exc_info=True)

    async def _send_done(self, aborted: bool) -> None:
        if not self.done_sent:
            self.done_sent = True
            await self._send_quietly(p.SessionDoneEvent(session_id=self.session_id, aborted=aborted))

    async def _close_socket(self, code: int = 1000) -> None:
        if self.ws.application_state is WebSocketState.CONNECTED and self.ws.client_state is WebSocketState.CONNECTED:
            try:
                await self.ws.close(code=code)
            except Exception:
                logger.debug("realtime session %s: socket already closed", self.session_id, exc_info=True)
