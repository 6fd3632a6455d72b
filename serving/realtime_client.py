"""A client of ``WS /v1/video/realtime`` (the realtime protocol the plugin serves, sglang-omni-realtime's): used
by ``make demo-realtime``, ``benchmarks/bench_realtime.py`` and the served tests, as a user's client would be.

The same socket answers on ``/v1/realtime`` (the path sglang's gateway, smg, relays: ``/v1/realtime?model=NAME``, with
an ``Authorization`` header): :func:`realtime_url` builds either, and ``headers`` (an API key: ``{"Authorization":
"Bearer KEY"}``) and ``subprotocols`` (a browser's way to send one) go with the handshake.

One :class:`RealtimeClient` is one session. Every server event is kept in ``events`` (with its arrival time); the
helpers send inputs in protocol order and wait for the events that answer them.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence
from urllib.parse import urlencode

import websockets

PARKED_EVENTS = ("response.turn.silence", "response.done")
VIDEO_REALTIME_PATH = "/v1/video/realtime"
GATEWAY_PATH = "/v1/realtime"


def realtime_url(base_url: str, path: str = VIDEO_REALTIME_PATH, model: Optional[str] = None) -> str:
    """``ws://HOST:PORT{path}`` from a server's ``http://HOST:PORT`` (``?model=`` for smg's route)."""
    url = base_url.replace("https://", "wss://").replace("http://", "ws://").rstrip("/") + path
    return f"{url}?{urlencode({'model': model})}" if model else url


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return buffer.getvalue()


@dataclass
class Received:
    event: dict
    at: float  # time.perf_counter() when it arrived


@dataclass
class RealtimeClient:
    url: str  # ws://127.0.0.1:PORT/v1/video/realtime (see realtime_url)
    headers: Optional[dict] = None  # extra handshake headers (Authorization: Bearer KEY)
    subprotocols: Optional[Sequence[str]] = None  # offered subprotocols (a browser's key: openai-insecure-api-key.KEY)
    events: list[Received] = field(default_factory=list)
    next_seq_no: int = 0
    socket: Optional[object] = None
    _arrived: asyncio.Condition = field(default_factory=asyncio.Condition)
    _reader: Optional[asyncio.Task] = None

    async def connect(self) -> dict:
        """Open the socket; -> the server's first event (``session.created``, or the capacity refusal's error)."""
        self.socket = await websockets.connect(
            self.url, max_size=None, additional_headers=self.headers, subprotocols=self.subprotocols
        )
        self._reader = asyncio.get_running_loop().create_task(self._read())
        return await self.wait_for(("session.created", "error"))

    async def open(self, **configure) -> dict:
        """Connect, configure (fields of ``session.configure``), wait for ``session.ready``; -> session.configured."""
        first = await self.connect()
        if first["type"] == "error":
            raise RuntimeError(f"session refused: {first}")
        await self.send({"type": "session.configure", **configure})
        configured = await self.wait_for(("session.configured", "error"))
        if configured["type"] == "error":
            raise RuntimeError(f"session refused: {configured}")
        await self.wait_for("session.ready")
        return configured

    async def send(self, event: dict) -> None:
        await self.socket.send(json.dumps(event))

    async def frame(self, image, timestamp: float, prompt: Optional[str] = None, final: bool = False) -> int:
        """One frame in protocol order (metadata, wait for ready, image bytes, wait for accepted); -> its seq_no.
        Sent as PNG: lossless, so the served frame is the pixels given here (JPEG would change them)."""
        seq_no = self._take_seq_no()
        event = {"type": "input.frame", "seq_no": seq_no, "timestamp": timestamp, "final": final}
        if prompt:
            event["prompt"] = prompt
        event["mime_type"] = "image/png"
        await self.send(event)
        await self.wait_for("input.frame.ready", seq_no=seq_no)
        # Encoded off the event loop: other sessions on this loop keep reading, so their events' arrival times are
        # not held back by this encode (the benchmark times frames by those arrivals).
        await self.socket.send(await asyncio.to_thread(png_bytes, image))
        await self.wait_for("input.frame.accepted", seq_no=seq_no)
        return seq_no

    async def prompt(self, text: str, final: bool = False) -> int:
        seq_no = self._take_seq_no()
        await self.send({"type": "input.prompt", "seq_no": seq_no, "prompt": text, "final": final})
        await self.wait_for(("input.prompt.accepted", "error"), seq_no=seq_no)
        return seq_no

    async def wait_processed(self, seq_no: int, timeout: float = 300.0) -> dict:
        return await self.wait_for(("input.frame.processed", "input.prompt.processed"), seq_no=seq_no, timeout=timeout)

    async def wait_parked(self, after: int, timeout: float = 300.0) -> dict:
        """The first turn end (silence or done) among events from index ``after`` on."""
        return await self.wait_for(PARKED_EVENTS, start=after, timeout=timeout)

    async def settle(self, seq_no: Optional[int] = None, timeout: float = 300.0) -> dict:
        """Wait until input ``seq_no`` (None: the initial prefill) was processed and the turn it started ended."""
        if seq_no is None:
            return await self.wait_parked(0, timeout)
        processed = await self.wait_processed(seq_no, timeout)
        index = next(i for i, r in enumerate(self.events) if r.event is processed)
        return await self.wait_parked(index + 1, timeout)

    async def close(self) -> None:
        if self.socket is not None:
            await self.socket.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    def texts(self) -> list[str]:
        return [r.event["delta"] for r in self.events if r.event["type"] == "response.text.delta"]

    def count(self, kind: str) -> int:
        return sum(r.event["type"] == kind for r in self.events)

    async def wait_for(self, kinds, *, seq_no: Optional[int] = None, start: int = 0, timeout: float = 300.0) -> dict:
        kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)

        def found():
            for received in self.events[start:]:
                event = received.event
                if event["type"] in kinds and (seq_no is None or event.get("seq_no") == seq_no):
                    return event
            return None

        async with self._arrived:
            await asyncio.wait_for(self._arrived.wait_for(lambda: found() or self._reader.done()), timeout)
        event = found()
        if event is None:
            raise RuntimeError(f"the socket closed before {kinds} (seq_no {seq_no}); events: {self.events[-5:]}")
        return event

    def _take_seq_no(self) -> int:
        seq_no, self.next_seq_no = self.next_seq_no, self.next_seq_no + 1
        return seq_no

    async def _read(self) -> None:
        try:
            async for message in self.socket:
                async with self._arrived:
                    self.events.append(Received(json.loads(message), time.perf_counter()))
                    self._arrived.notify_all()
        except websockets.ConnectionClosed:
            pass
        finally:
            async with self._arrived:
                self._arrived.notify_all()
