"""MOSS-VL-Realtime: one growing token stream per session, frames and prompts appended as they arrive.

The stream (`RealtimeStream`) is a single sequence whose K/V are never recomputed:
  * the initial prefill is ``[system, user]`` rendered by the chat template (the default realtime system prompt
    unless one is given; the user turn empty unless an initial prompt is given), then the assistant opener;
  * after every generated token the session drains what arrived, prompts first, each spliced as
    ``<|im_end|>\\n<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n``, then one ``<|silence|>`` opener
    (every trained assistant turn starts with it), then the frames by timestamp, each
    ``<|vision_start|><|time_start|>{ts:.1f} seconds<|time_end|><|image_pad|><|vision_end|>``;
  * the generated token and the drained text go through the decoder in one forward; only the new frames go
    through the vision tower, their cross-attention K/V are appended to every cross-attention layer's cache and
    the MRoPE positions continue from the last one.
Frame-causal cross-attention makes this exact: a text row never sees a frame that arrives after it, so appending
a frame changes no cached row, and the stream equals a cold prefill of its final token sequence.

A frame window (`frame_window_seconds`, off by default): when a frame stamped t arrives, frames stamped before
t - W leave the cross-attention caches; rows from that frame on no longer see them, rows written earlier keep what
they saw, and every text token and position stays.

Generation masks every ``<|...|>`` control token except ``<|silence|>`` (the model's only idle signal) and the LM
head rows the tokenizer has no token for. After ``<|silence|>`` (or a turn reaching its token limit) with nothing
pending, the worker thread blocks on a condition variable until input arrives or the session closes: a parked
session uses no CPU. Output pieces (text, ``<|silence|>``, ``<|round_start|>`` for every spliced prompt) are
polled with `poll_output`; runners hide the control pieces unless asked to show them.

The session API is the one the upstream runner drives (`create_realtime_session` -> `start`, `active`,
`pending_frames`, `poll_output`, `push_prompt`, `push_frame`, `push_prompt_frame`, `close`), plus
`wait_until_parked` and `parked` for callers that want to know the stream has nothing more to say.
"""

import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from .modeling_moss_vl import KVBuffer, frame_block_positions
from .processing_moss_vl import DEFAULT_REALTIME_SYSTEM_PROMPT
from .queries_moss_vl import ERROR_PREFIX, ROUND_START, SILENCE, STOP_ONLINE_GENERATE, is_stop_message

logger = logging.getLogger(__name__)

CONTROL_TOKEN = re.compile(r"^<\|[^|]+\|>$")


def prompt_splice_text(prompt: str) -> str:
    """A user prompt spliced into the stream: closes the open assistant turn, opens a user/assistant pair."""
    return f"<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def frame_text(timestamp: float) -> str:
    """One frame's text: its timestamp and exactly one `<|image_pad|>` (its vision tokens go to cross-attention)."""
    return f"<|vision_start|><|time_start|>{timestamp:.1f} seconds<|time_end|><|image_pad|><|vision_end|>"


@dataclass
class StreamFrame:
    """A frame ready for the stream: patches (N, 3*P*P), patch grid [1, gh, gw], timestamp in seconds."""

    pixel_values: torch.Tensor
    grid: list
    timestamp: float


class RealtimeStream:
    """The incremental state of one stream (no threads): self-attention K/V of every text row, cross-attention K/V
    of the frames in the window, the next MRoPE position and the frame clock.

    `append(token_ids, frames)` runs the new rows (and the new frames' vision tokens) and returns the logits of the
    last row. `token_ids` holds one `<|image_pad|>` per frame in `frames`, in order."""

    def __init__(self, model, frame_window_seconds: Optional[float] = None):
        self.model = model
        config = model.config
        self.image_token_id = config.image_token_id
        self.merge = config.vision_config.spatial_merge_size
        # From the config, as the text model builds its layers: a class check would find none when the model comes
        # from a checkpoint's copy of this package (trust_remote_code), and the stream would silently skip vision.
        self.cross_layers = sorted(int(index) for index in config.text_config.cross_attention_layers)
        self.frame_window_seconds = frame_window_seconds
        self.tokens: list[int] = []
        self.self_kv: dict = {}
        self.cross_kv = {index: KVBuffer() for index in self.cross_layers}
        self.key_frame = torch.zeros(0, dtype=torch.long, device=model.device)  # frame index of each cached key
        self.next_position = 0
        self.frame_times: list[float] = []  # every frame's timestamp, in stream order
        self.window_start = 0  # first frame whose keys are still cached
        self.vision_frames_encoded = 0  # frames that went through the vision tower (all of them, once each)

    @property
    def frames_seen(self) -> int:
        return len(self.frame_times)

    def first_frame_in_window(self, newest: float, start: int) -> int:
        if self.frame_window_seconds is None:
            return start
        while start < len(self.frame_times) and self.frame_times[start] < newest - self.frame_window_seconds:
            start += 1
        return start

    @torch.no_grad()
    def append(self, token_ids: list[int], frames: list[StreamFrame]) -> torch.Tensor:
        """Run `token_ids` (with `frames` behind their `<|image_pad|>` tokens) -> logits (vocab,) of the last row."""
        if sum(token == self.image_token_id for token in token_ids) != len(frames):
            raise ValueError(f"{len(frames)} frames for a segment with a different number of <|image_pad|> tokens")
        device = self.model.device
        positions, lowest, highest, vision_positions, key_frames = [], [], [], [], []
        window_start, pending = self.window_start, iter(frames)
        for token in token_ids:
            if token == self.image_token_id:
                frame = next(pending)
                _, gh, gw = frame.grid
                block, position = frame_block_positions(self.next_position, gh // self.merge, gw // self.merge)
                vision_positions.append(block)
                key_frames.append(torch.full((block.shape[1],), self.frames_seen, dtype=torch.long))
                self.frame_times.append(frame.timestamp)
                window_start = self.first_frame_in_window(frame.timestamp, window_start)
                self.next_position = position + 1
            else:
                position = self.next_position
                self.next_position += 1
            positions.append(position)
            lowest.append(window_start)
            highest.append(self.frames_seen)
        if frames:
            self.encode_frames(frames, torch.cat(vision_positions, dim=1), torch.cat(key_frames))
        self.tokens.extend(token_ids)
        ids = torch.tensor([token_ids], device=device)
        text_positions = torch.tensor(positions, device=device).view(1, 1, -1).expand(3, 1, -1)
        attention_mask = torch.ones(1, len(self.tokens), dtype=torch.long, device=device)
        sees = None
        if self.key_frame.numel():
            low = torch.tensor(lowest, device=device)[:, None]
            high = torch.tensor(highest, device=device)[:, None]
            sees = ((self.key_frame[None, :] >= low) & (self.key_frame[None, :] < high))[None]
        cross_kv = {index: buffer.view() for index, buffer in self.cross_kv.items() if len(buffer)}
        logits = self.model.decode_text(ids, text_positions, attention_mask, self.self_kv, cross_kv, sees)
        self.evict_before(window_start)
        return logits[0, -1]

    def encode_frames(self, frames: list[StreamFrame], vision_positions: torch.Tensor, key_frames: torch.Tensor):
        """The new frames through the vision tower; their K/V appended to every cross-attention layer's cache."""
        model, device = self.model, self.model.device
        pixel_values = torch.cat([frame.pixel_values for frame in frames]).to(device)
        grid_thw = torch.tensor([frame.grid for frame in frames], device=device)
        states = torch.cat(model.encode_media(pixel_values, grid_thw))[None]
        positions = vision_positions.to(device)[:, None, :]
        for index in self.cross_layers:
            layer = model.model.language_model.layers[index]
            self.cross_kv[index].extend(*layer.cross_attn.key_value(states, positions))
        self.key_frame = torch.cat((self.key_frame, key_frames.to(device)))
        self.vision_frames_encoded += len(frames)

    def evict_before(self, frame: int) -> None:
        """Frames before `frame` leave the cross-attention caches (their keys are a prefix of every cache)."""
        if frame <= self.window_start:
            return
        count = int((self.key_frame < frame).sum())
        for buffer in self.cross_kv.values():
            buffer.drop_front(count)
        self.key_frame = self.key_frame[count:]
        logger.debug("frame window: frames %d..%d left the caches", self.window_start, frame - 1)
        self.window_start = frame


@dataclass
class PendingInput:
    """What arrived since the last drain: prompts in order; frames (StreamFrame, pinned) in arrival order."""

    prompts: list = field(default_factory=list)
    frames: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prompts or self.frames)


class TextPieces:
    """Turns generated ids into output pieces: text as it decodes (an incomplete UTF-8 sequence is held back),
    each control token as its own piece."""

    def __init__(self, tokenizer, control_ids: set):
        self.tokenizer, self.control_ids = tokenizer, control_ids
        self.run: list[int] = []
        self.emitted = ""

    def add(self, token: int) -> list[str]:
        if token in self.control_ids:
            return [*self.flush(), self.tokenizer.convert_ids_to_tokens(token)]
        self.run.append(token)
        text = self.tokenizer.decode(self.run)
        if text.endswith("\ufffd"):
            return []
        piece, self.emitted = text[len(self.emitted) :], text
        return [piece] if piece else []

    def flush(self) -> list[str]:
        text = self.tokenizer.decode(self.run) if self.run else ""
        piece = text[len(self.emitted) :]
        self.run, self.emitted = [], ""
        return [piece] if piece else []


class MossVLRealtimeSession:
    """One realtime stream driven by a worker thread (see the module docstring).

    Args (of `create_realtime_session`): initial_prompt (the first user turn, may be empty); system_prompt (None
    or empty: the default realtime one); frame_queue_size (frames waiting for the stream at most; a full queue
    drops its oldest frame that carries no prompt); max_tokens_per_turn (a rate cap in generated tokens per
    second, the upstream name; None or 0: uncapped); frame_window_seconds (None: off); record_logits (keep each
    step's logits, for tests); generate_kwargs: max_new_tokens (tokens per turn before the stream parks as after
    <|silence|>; default 256), do_sample, temperature, top_k, top_p, repetition_penalty."""

    def __init__(
        self,
        model,
        processor,
        initial_prompt: str = "",
        system_prompt: Optional[str] = None,
        frame_queue_size: int = 256,
        max_tokens_per_turn: Optional[float] = None,
        frame_window_seconds: Optional[float] = None,
        record_logits: bool = False,
        **generate_kwargs,
    ):
        if frame_queue_size < 1:
            raise ValueError("frame_queue_size must be at least 1")
        self.model, self.processor = model, processor
        self.tokenizer = processor.tokenizer
        self.initial_prompt = initial_prompt or ""
        self.system_prompt = system_prompt or DEFAULT_REALTIME_SYSTEM_PROMPT
        self.frame_queue_size = frame_queue_size
        self.tokens_per_second = float(max_tokens_per_turn or 0)
        self.turn_token_limit = int(generate_kwargs.pop("max_new_tokens", 256) or 256)
        self.sampling = {
            "do_sample": bool(generate_kwargs.pop("do_sample", False)),
            "temperature": float(generate_kwargs.pop("temperature", 1.0)),
            "top_k": int(generate_kwargs.pop("top_k", 0)),
            "top_p": float(generate_kwargs.pop("top_p", 1.0)),
        }
        self.repetition_penalty = float(generate_kwargs.pop("repetition_penalty", 1.0))
        if generate_kwargs:
            logger.info("realtime session ignores generate keywords %s", sorted(generate_kwargs))
        self.silence_id = self.tokenizer.convert_tokens_to_ids(SILENCE)
        self.control_ids = {
            token_id for token, token_id in self.tokenizer.get_added_vocab().items() if CONTROL_TOKEN.match(token)
        }
        self.stream = RealtimeStream(model, frame_window_seconds)
        self.record_logits = record_logits
        self.step_logits: list[tuple[int, torch.Tensor]] = []  # (row whose logits chose the next token, logits)
        self.generated: list[int] = []  # every token the model chose, in order
        self.outputs: queue.Queue = queue.Queue()
        self.condition = threading.Condition()
        self.pending = PendingInput()
        self.closing = False
        self.is_parked = False
        self.started_at = time.monotonic()
        self.worker: Optional[threading.Thread] = None

    # ---- upstream API

    @property
    def active(self) -> bool:
        return self.worker is not None and self.worker.is_alive()

    @property
    def pending_frames(self) -> int:
        with self.condition:
            return len(self.pending.frames)

    def start(self) -> "MossVLRealtimeSession":
        if self.worker is not None:
            raise RuntimeError("the realtime session has already started")
        self.worker = threading.Thread(target=self.run, name="mossvl-realtime-stream", daemon=True)
        self.worker.start()
        return self

    def push_prompt(self, text: str) -> None:
        if not text or not text.strip():
            raise ValueError("empty prompt")
        with self.condition:
            self.pending.prompts.append(text)
            self.condition.notify_all()

    def push_frame(self, image, timestamp: Optional[float] = None) -> bool:
        """Queue a frame (PIL image, seconds since the stream began; None: now) -> whether a frame was dropped."""
        return self.enqueue_frame(image, timestamp, prompt=None)

    def push_prompt_frame(self, prompt: str, image, timestamp: Optional[float] = None) -> bool:
        """A prompt attached to a frame (a subtitle): both enter the same drain, the prompt spliced before the frame;
        the frame is never dropped. -> whether another frame was dropped."""
        if not prompt or not prompt.strip():
            raise ValueError("empty prompt")
        return self.enqueue_frame(image, timestamp, prompt=prompt)

    def poll_output(self, timeout: Optional[float] = 0.1) -> Optional[str]:
        try:
            return self.outputs.get(timeout=timeout) if timeout else self.outputs.get_nowait()
        except queue.Empty:
            return None

    def close(self, timeout: Optional[float] = None) -> None:
        """End the stream after its current step; inputs not yet drained are dropped."""
        with self.condition:
            self.closing = True
            self.condition.notify_all()
        if self.worker is not None:
            self.worker.join(timeout)

    # ---- additions

    @property
    def parked(self) -> bool:
        """True while the stream waits for input after <|silence|> (or a full turn)."""
        with self.condition:
            return self.is_parked

    def wait_until_parked(self, timeout: Optional[float] = None) -> bool:
        """Block until the stream has drained everything pushed so far and parked; False on timeout or close."""
        with self.condition:
            done = self.condition.wait_for(lambda: self.closing or (self.is_parked and not self.pending), timeout)
            return bool(done) and not self.closing

    # ---- the stream

    def enqueue_frame(self, image, timestamp: Optional[float], prompt: Optional[str]) -> bool:
        """Patchify in the caller's thread, so a bad image fails its own push and the stream goes on."""
        stamp = time.monotonic() - self.started_at if timestamp is None else float(timestamp)
        frame = self.stream_frame(image, stamp)
        dropped = False
        with self.condition:
            frames = self.pending.frames
            if len(frames) >= self.frame_queue_size:
                victim = next((i for i, (_, pinned) in enumerate(frames) if not pinned), None)
                if victim is not None:
                    frames.pop(victim)
                    dropped = True
            if prompt is not None:
                self.pending.prompts.append(prompt)
            frames.append((frame, prompt is not None))
            self.condition.notify_all()
        return dropped

    def run(self) -> None:
        pieces = TextPieces(self.tokenizer, self.control_ids)
        try:
            if self.initial_prompt:
                self.outputs.put(ROUND_START)
            logits = self.stream.append(self.initial_ids(), [])
            turn_tokens, next_due = 0, time.monotonic()
            while True:
                token = self.choose(logits)
                self.generated.append(token)
                for piece in pieces.add(token):
                    self.outputs.put(piece)
                turn_tokens += 1
                if self.tokens_per_second:
                    next_due = max(next_due + 1.0 / self.tokens_per_second, time.monotonic())
                    self.pause_until(next_due)
                idle = token == self.silence_id or turn_tokens >= self.turn_token_limit
                drained = self.drain(park=idle)
                if drained is None:
                    break
                if drained.prompts or idle:
                    turn_tokens = 0
                    next_due = time.monotonic()
                ids, frames = self.segment(token, drained)
                for _ in drained.prompts:
                    self.outputs.put(ROUND_START)
                logits = self.stream.append(ids, frames)
        except Exception as error:  # reported to the client through the output stream
            logger.exception("realtime stream failed")
            self.outputs.put(f"{ERROR_PREFIX}{type(error).__name__}: {error}")
        finally:
            for piece in pieces.flush():
                self.outputs.put(piece)
            with self.condition:
                self.is_parked = False
                self.closing = True
                self.condition.notify_all()

    def initial_ids(self) -> list[int]:
        messages = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": self.initial_prompt},
        ]
        return self.encode(self.processor.apply_chat_template(messages, add_generation_prompt=True))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def choose(self, logits: torch.Tensor) -> int:
        if self.record_logits:
            self.step_logits.append((len(self.stream.tokens) - 1, logits.detach().clone()))
        masked = logits.clone()[None]
        masked[0, sorted(self.control_ids - {self.silence_id})] = float("-inf")
        masked[0, len(self.tokenizer) :] = float("-inf")
        if self.repetition_penalty != 1.0:
            history = torch.tensor([self.stream.tokens], device=masked.device)
            masked = self.model.adjust_logits(masked, history, self.repetition_penalty)
        return int(self.model.pick(masked, **self.sampling)[0])

    def pause_until(self, due: float) -> None:
        """The rate cap: wait (woken early only by close) until `due` on the monotonic clock."""
        with self.condition:
            self.condition.wait_for(lambda: self.closing, max(0.0, due - time.monotonic()))

    def drain(self, park: bool) -> Optional[PendingInput]:
        """Take everything pending; with `park` and nothing pending, block until input arrives. None once closing."""
        with self.condition:
            if park and not self.pending and not self.closing:
                self.is_parked = True
                self.condition.notify_all()
                self.condition.wait_for(lambda: self.closing or bool(self.pending))
                self.is_parked = False
            if self.closing:
                return None
            drained, self.pending = self.pending, PendingInput()
            return drained

    def segment(self, token: int, drained: PendingInput) -> tuple[list[int], list[StreamFrame]]:
        """The rows appended after `token`: spliced prompts and their opener, then the frames by timestamp."""
        text = "".join(prompt_splice_text(prompt) for prompt in drained.prompts)
        if drained.prompts:
            text += SILENCE
        frames = sorted((frame for frame, _ in drained.frames), key=lambda frame: frame.timestamp)
        text += "".join(frame_text(frame.timestamp) for frame in frames)
        return [token] + (self.encode(text) if text else []), frames

    def stream_frame(self, image, timestamp: float) -> StreamFrame:
        """A pushed frame as the processor sizes a realtime frame (the image rule, ``realtime_frame``)."""
        if not callable(getattr(image, "convert", None)):
            raise ValueError(f"a frame must be a PIL image, got {type(image).__name__}")
        pixel_values, grid = self.processor.image_processor.realtime_frame(image)
        return StreamFrame(pixel_values, grid, timestamp)


def online_generate(
    model,
    processor,
    input_queue: queue.Queue,
    output_queue: queue.Queue,
    frame_queue_size: int = 256,
    max_tokens_per_turn: Optional[float] = None,
    **generate_kwargs,
) -> None:
    """The queue loop over one session. First message: {initial_prompt, system_prompt, frame_queue_size,
    max_tokens_per_turn} (each optional); then {"frame": image, "timestamp": s[, "prompt"/"text": subtitle]},
    {"prompt": text} or {"stop_online_generate": True}. Output pieces are forwarded to `output_queue`; a bad
    message puts an "[ERROR] ..." piece and the stream goes on."""
    first = input_queue.get()
    if is_stop_message(first, STOP_ONLINE_GENERATE):
        return
    session = MossVLRealtimeSession(
        model,
        processor,
        initial_prompt=first.get("initial_prompt") or "",
        system_prompt=first.get("system_prompt"),
        frame_queue_size=first.get("frame_queue_size", frame_queue_size),
        max_tokens_per_turn=first.get("max_tokens_per_turn", max_tokens_per_turn),
        **generate_kwargs,
    ).start()
    forwarder = threading.Thread(target=forward_outputs, args=(session, output_queue), daemon=True)
    forwarder.start()
    try:
        while True:
            message = input_queue.get()
            if is_stop_message(message, STOP_ONLINE_GENERATE):
                break
            try:
                push_message(session, message)
            except (ValueError, KeyError, AttributeError) as error:
                output_queue.put(f"{ERROR_PREFIX}{type(error).__name__}: {error}")
    finally:
        session.close(timeout=30)
        forwarder.join(timeout=30)


def push_message(session: MossVLRealtimeSession, message: dict) -> None:
    if "frame" in message:
        prompt = message.get("prompt") or message.get("text")
        if prompt:
            session.push_prompt_frame(prompt, message["frame"], message.get("timestamp"))
        else:
            session.push_frame(message["frame"], message.get("timestamp"))
    elif message.get("prompt"):
        session.push_prompt(message["prompt"])
    else:
        raise ValueError(f"message has neither 'frame' nor 'prompt': {sorted(message)}")


def forward_outputs(session: MossVLRealtimeSession, output_queue: queue.Queue) -> None:
    while session.active or not session.outputs.empty():
        piece = session.poll_output(0.1)
        if piece is not None:
            output_queue.put(piece)


__all__ = [
    "DEFAULT_REALTIME_SYSTEM_PROMPT",
    "MossVLRealtimeSession",
    "RealtimeStream",
    "frame_text",
    "online_generate",
    "prompt_splice_text",
]
