"""Realtime sessions on the running sglang engine (the HTTP process side; the scheduler side is
:mod:`mossvl_ascend.realtime.sessions`, what they tell each other :mod:`mossvl_ascend.realtime.wire`).

A :class:`ServedSession` has the reference session's semantics (``moss_vl_reference.realtime_moss_vl``): the
initial prefill is ``[system, user]`` by the chat template then the assistant opener; whatever arrives is drained
in one segment, prompts first (each spliced as a user/assistant pair, then one ``<|silence|>`` opener), then the
frames by timestamp (``<|vision_start|><|time_start|>{ts:.1f} seconds<|time_end|><|image_pad|><|vision_end|>``);
generation masks every ``<|...|>`` control token but ``<|silence|>`` and stops a turn on it or at the turn's token
limit, and the session parks until input arrives. Each segment is one engine step (one request whose rows are the
segment, behind the token generated last); the scheduler keeps the K/V between steps.

Input arriving while a step runs interrupts it: the token under way is its last, and the input is drained by the next
step. Prompts alone are offered to the step with the interrupt: a step that has not started its extend takes them
(their rows go right after its first row, the turn they open is the step's), so a question sent just after its frame
costs one extend, as in the reference, which drains inputs that arrive together in one forward.

A rate cap (``max_tokens_per_turn``, generated tokens per second, the upstream name): each token is then a step of
its own, the next one due 1/rate later, input drained between them, as the reference loop paces itself.

A frame window (server-wide, ``MOSSVL_REALTIME_FRAME_WINDOW_S`` seconds; off when unset): when a frame stamped t
arrives, the frames stamped before t - W leave the window (the reference stream's rule); each windowed step tells
the scheduler, per new frame, the first frame still in the window, and the scheduler gives the rest back.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import sys
import uuid
from dataclasses import dataclass
from typing import Optional

from mossvl_ascend.realtime.session_api import (
    CLOSED,
    ERROR,
    INTERRUPTED,
    PROCESSED,
    READY,
    SILENCE,
    TEXT,
    TURN_DONE,
    USAGE,
    Frame,
    Output,
    RealtimeError,
    SessionConfig,
)
from mossvl_ascend.realtime.wire import (
    CLOSE_STEP,
    CONTEXT_EXHAUSTED,
    OFFER_TAKEN_KEY,
    RID_PREFIX,
    USAGE_INFO_KEY,
    WINDOW_STARTS_PARAM,
    PromptOffer,
    interrupt_message,
    step_rid,
    usage_after,
)

logger = logging.getLogger(__name__)

SILENCE_TOKEN = "<|silence|>"
FRAME_WINDOW_ENV = "MOSSVL_REALTIME_FRAME_WINDOW_S"
# Our error code for a session refused by a PD worker (the real server has no PD and no code for it).
UNSUPPORTED_DEPLOYMENT = "unsupported_deployment"
CONTROL_TOKEN = re.compile(r"^<\|[^|]+\|>$")


# The step requests this process's sessions have in flight, by ``id()``. The object itself is the proof that a request
# is a step: a client's request naming a step's rid is another object, which no client can make this one.
_ISSUED_STEPS: dict[int, object] = {}


def is_engine_step(request_obj) -> bool:
    """``request_obj`` is a step request a session of this process made and has in flight."""
    return _ISSUED_STEPS.get(id(request_obj)) is request_obj


def posing_step_refusal(rid) -> str:
    """The refusal of a request naming a realtime step's rid that no session of this process made."""
    return (
        f"request id {rid!r}: ids starting with {RID_PREFIX!r} are the server's realtime session steps (open a "
        "session on WS /v1/video/realtime)"
    )


@contextlib.contextmanager
def _issued(request):
    """``request`` counts as a step of this process's sessions while the block runs."""
    _ISSUED_STEPS[id(request)] = request
    try:
        yield request
    finally:
        del _ISSUED_STEPS[id(request)]


def step_frames_input(pixel_values, grid_thw) -> dict:
    """A step's new frames as its request's one ``image_data`` entry, in stock's preprocessed form (``format:
    processor_output``): the patches this session made (:meth:`ServedSession._patches`) and their grids."""
    return {"format": "processor_output", "pixel_values": pixel_values, "grid_thw": grid_thw}


def step_processor_output(processor, request_obj, image_data):
    """What MOSS-VL's processor returns for a realtime step (the tokenizer's side, this process): the step's token
    ids as they are (the session built them; re-tokenizing could change the generated token in front) and its new
    frames as its request carries them (``image_data``: at most one :func:`step_frames_input`). Positions are
    placeholders the scheduler replaces (:meth:`mossvl_ascend.realtime.sessions.RealtimeSessions.prepare_step`)."""
    import torch
    from sglang.srt.managers.schedule_batch import MultimodalProcessorOutput

    ids = list(request_obj.input_ids)
    items = []
    if image_data:
        (frames,) = image_data
        patches = {"pixel_values": frames["pixel_values"], "grid_thw": frames["grid_thw"]}
        items = processor._prepare_mm_items_for_transport(processor._build_mm_items(patches, torch.tensor(ids)))
    placeholder = torch.arange(len(ids), dtype=torch.int64).expand(3, -1).clone()
    return MultimodalProcessorOutput(
        input_ids=ids,
        mm_items=items,
        im_token_id=processor.image_token_id,
        mrope_positions=placeholder,
        mrope_position_delta=torch.zeros(1, 1, dtype=torch.int64),
    )


def prompt_splice(prompt: str) -> str:
    return f"<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def frame_markup(timestamp: float) -> str:
    return f"<|vision_start|><|time_start|>{timestamp:.1f} seconds<|time_end|><|image_pad|><|vision_end|>"


def frame_window_from_env() -> Optional[float]:
    """The server's frame window in seconds (``MOSSVL_REALTIME_FRAME_WINDOW_S``), None when unset."""
    value = os.environ.get(FRAME_WINDOW_ENV, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise ValueError(f"{FRAME_WINDOW_ENV}={value!r}: the frame window must be a positive number of seconds")
    return seconds


@dataclass(frozen=True)
class DrainedInput:
    """An input event of a step: its ``seq_no`` (None: pushed without one) and, for a prompt, the turn it closed and
    the turn it opened."""

    seq_no: Optional[int]
    turn: Optional[tuple[int, int]] = None


class ServedRealtimeEngine:
    """Opens :class:`ServedSession` s on the tokenizer manager of this server. ``scheduler_info_of``: the
    scheduler's start-up report (pool size, request cap), for the checks at open."""

    def __init__(self, tokenizer_manager_of, scheduler_info_of=dict):
        self._tokenizer_manager_of = tokenizer_manager_of
        self._scheduler_info_of = scheduler_info_of
        self.sessions: dict[str, "ServedSession"] = {}
        self.frame_window_s = frame_window_from_env()
        logger.info(
            "realtime frame window: %s",
            f"{self.frame_window_s} s ({FRAME_WINDOW_ENV})"
            if self.frame_window_s
            else f"off ({FRAME_WINDOW_ENV} unset)",
        )

    @property
    def tokenizer_manager(self):
        return self._tokenizer_manager_of()

    def capabilities(self) -> dict:
        manager = self.tokenizer_manager
        return {
            "model": "moss-vl-realtime",
            "page_size": manager.server_args.page_size,
            "frame_window_s": self.frame_window_s,
            "context_length": manager.context_len,
            "max_input_pixels": self.max_input_pixels(),
        }

    def max_input_pixels(self) -> Optional[int]:
        """The processor's limit on a decoded frame's pixels (its config's ``max_input_pixels``), if it has one."""
        return getattr(self.tokenizer_manager.mm_processor._processor.image_processor, "max_input_pixels", None)

    def serves_moss_vl(self) -> bool:
        architectures = getattr(self.tokenizer_manager.model_config.hf_config, "architectures", None) or []
        return "MossVLForConditionalGeneration" in architectures

    def check_capacity(self, waiting: int = 0) -> None:
        self._check_deployment(self.tokenizer_manager)
        self._check_capacity(self.tokenizer_manager, waiting)

    async def open(self, config: SessionConfig) -> "ServedSession":
        manager = self.tokenizer_manager
        if not self.serves_moss_vl():
            architectures = getattr(manager.model_config.hf_config, "architectures", None)
            raise RealtimeError("unsupported_model", f"realtime sessions need a MOSS-VL model, not {architectures}")
        if config.max_new_tokens > manager.context_len:
            raise RealtimeError(
                "invalid_request",
                f"max_new_tokens {config.max_new_tokens} does not fit the context ({manager.context_len} tokens) "
                "with the session's prompt: ask for fewer",
            )
        self._check_deployment(manager)
        self._check_capacity(manager)
        session = ServedSession(self, config)
        self.sessions[session.session_id] = session
        session.start()
        return session

    @staticmethod
    def _check_deployment(manager) -> None:
        """Refuse sessions on a PD worker: a session grows one request's rows step by step on the server that holds
        its KV, and PD moves a request's KV once, from a prefill to a decode worker, when its prefill ends."""
        mode = manager.server_args.disaggregation_mode
        if mode != "null":
            raise RealtimeError(
                UNSUPPORTED_DEPLOYMENT,
                f"realtime sessions are not served by a PD {mode} worker (--disaggregation-mode {mode}): open them on "
                "an aggregated worker (behind smg: one registered with the label realtime=true)",
            )

    def _check_capacity(self, manager, waiting: int = 0) -> None:
        """Refuse a session the engine could not carry to a full context, or one past the request cap (a parked
        session still holds its KV and a request slot; so does a connection not yet configured)."""
        info = self._scheduler_info_of() or {}
        pool, context = info.get("max_total_num_tokens"), manager.context_len
        if pool is not None and pool < context:
            raise RealtimeError(
                "insufficient_kv_capacity",
                f"the KV pool holds {pool} tokens, fewer than one full context ({context}): start the server with a "
                "smaller --context-length or a larger --max-total-tokens / --mem-fraction-static",
            )
        cap = manager.server_args.max_running_requests
        if cap is not None and len(self.sessions) + waiting >= cap:
            raise RealtimeError(
                "session_capacity_exceeded",
                f"{len(self.sessions) + waiting} realtime sessions already open (capacity {cap}): retry later",
            )


class ServedSession:
    """One realtime stream on the engine (see the module docstring)."""

    def __init__(self, engine: ServedRealtimeEngine, config: SessionConfig):
        self.engine, self.config = engine, config
        self.session_id = uuid.uuid4().hex[:16]
        manager = engine.tokenizer_manager
        self.processor = manager.mm_processor._processor
        self.tokenizer = self.processor.tokenizer
        self.silence_id = self.tokenizer.convert_tokens_to_ids(SILENCE_TOKEN)
        control = {i for t, i in self.tokenizer.get_added_vocab().items() if CONTROL_TOKEN.match(t)}
        vocab = manager.model_config.vocab_size
        masked = sorted(control - {self.silence_id}) + list(range(len(self.tokenizer), vocab))
        self.logit_bias = {str(token): float("-inf") for token in masked}
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.prompts: list[tuple[str, Optional[int]]] = []
        self.frames: list[Frame] = []
        self.wake = asyncio.Event()
        self.closing = False
        self.closed = asyncio.Event()
        self.steps = itertools.count()
        self.turn_id = 0
        self.generated: list[int] = []  # every token the model chose (tests compare it with the reference's)
        self.logprobs: list[float] = []  # with config.return_logprob: each chosen token's log-probability
        # Every step: its rows, its frames' timestamps, the tokens it generated (enough to replay the stream).
        self.segments: list[tuple[list[int], list[float], int]] = []
        self.running_rid: Optional[str] = None
        self.running_len = 0  # the running step's token ids (what an offer's rows add to)
        self.running_takes_prompts = False  # it continues the session (not its initial prefill)
        self.interrupt_sent = False  # the running step was asked to end
        self.offered: list[tuple[str, Optional[int]]] = []  # prompts its interrupt offered it (see PromptOffer)
        # Every step of a session runs on the data-parallel rank that holds its KV.
        dp_size = getattr(manager.server_args, "dp_size", 1) or 1
        self.dp_rank = int(self.session_id, 16) % dp_size if dp_size > 1 else None
        window = config.frame_window_s if config.frame_window_s is not None else engine.frame_window_s
        self.frame_window_s: Optional[float] = window
        self.frame_times: list[float] = []  # every frame's timestamp, in stream order
        self.window_start = 0  # the first frame still in the window
        self.text_run: list[int] = []  # this turn's tokens, decoded together (a character may span tokens)
        self.text_emitted = ""
        self.task: Optional[asyncio.Task] = None

    # ---- input (never blocks on the model)

    def push_prompt(self, prompt: str, seq_no: Optional[int] = None) -> None:
        if not prompt or not prompt.strip():
            raise RealtimeError("invalid_request", "empty prompt")
        self._check_prompt_fits(prompt)
        self.prompts.append((prompt, seq_no))
        self._input_arrived()

    def push_frame(self, frame: Frame, prompt: Optional[str] = None) -> None:
        if prompt:
            self._check_prompt_fits(prompt)
            self.prompts.append((prompt, frame.seq_no))
        self.frames.append(frame)
        self._input_arrived()

    def _input_arrived(self) -> None:
        """Input wakes a parked session and interrupts a running step now, not at the step's next output."""
        self.wake.set()
        self._interrupt_running_step()

    def _interrupt_running_step(self) -> None:
        """Ask the scheduler to end the running step (once per step): the token under way is its last. When only
        prompts are pending they are offered to the step: one that has not started its extend takes them (see
        :class:`~mossvl_ascend.realtime.wire.PromptOffer`) and the step's first output says so; else they are
        drained by the next step."""
        from sglang.srt.managers.io_struct import AbortReq

        if self.running_rid is None or self.interrupt_sent:
            return
        self.interrupt_sent = True
        offer = None
        if self.prompts and not self.frames and self.running_takes_prompts:
            self.offered, self.prompts = self.prompts, []
            rows = self._encode(self._prompt_text(self.offered))
            room = self.engine.tokenizer_manager.context_len - self.running_len - len(rows) - 1
            offer = PromptOffer(rows, max(1, min(self._new_turn_allowance(), room)))
        self.engine.tokenizer_manager._dispatch_to_scheduler(
            AbortReq(rid=self.running_rid, abort_message=interrupt_message(offer))
        )

    def _new_turn_allowance(self) -> int:
        """The tokens a step opening a turn may generate: the turn's limit, or one with a rate cap."""
        return 1 if self.config.max_tokens_per_turn else self.config.max_new_tokens

    def _check_prompt_fits(self, prompt: str) -> None:
        """A prompt no session could hold is refused as a bad input (the session goes on); one that only overfills
        this session's context ends the session when the scheduler refuses its step."""
        rows = len(self._encode(prompt_splice(prompt)))
        context = self.engine.tokenizer_manager.context_len
        if rows >= context:
            raise RealtimeError("invalid_request", f"prompt of {rows} tokens does not fit the context ({context})")

    @property
    def pending_inputs(self) -> int:
        return len(self.prompts) + len(self.frames) + len(self.offered)

    async def close(self) -> None:
        """End the session: a running step is aborted (its KV freed with the session's), then every slot freed."""
        if self.closing:
            return
        self.closing = True
        self.closed.set()
        self.wake.set()
        if self.running_rid is not None:
            self.engine.tokenizer_manager.abort_request(rid=self.running_rid)
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)
        await self._finish_step_request(step_rid(self.session_id, CLOSE_STEP), [self.silence_id])
        self.engine.sessions.pop(self.session_id, None)

    # ---- the stream

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        rate = self.config.max_tokens_per_turn
        clock = asyncio.get_running_loop().time
        try:
            rows, frames, inputs = self._initial_rows(), [], []
            first, turn_tokens, next_due = True, 0, clock()
            while not self.closing:
                # With a rate cap each token is a step of its own, spaced 1/rate apart, input drained between them
                # (the reference loop paces the same way).
                allowance = 1 if rate else self.config.max_new_tokens - turn_tokens
                turn_id = self.turn_id
                last, generated, interrupted = await self._step(rows, frames, inputs, ready=first, allowance=allowance)
                if self.turn_id != turn_id:  # the step took offered prompts: it ran as the turn they opened
                    turn_tokens, next_due = 0, clock()
                first, turn_tokens = False, turn_tokens + generated
                if rate:
                    next_due = max(next_due + generated / rate, clock())
                    await self._pause_until(next_due)
                idle = self._ends_turn(last) or turn_tokens >= self.config.max_new_tokens
                if idle or (interrupted and self.prompts):
                    self._flush_text()
                if idle and not interrupted:
                    kind = SILENCE if self._ends_turn(last) else TURN_DONE
                    self.outputs.put_nowait(Output(kind, turn_id=self.turn_id))
                    await self._wait_for_input()
                if self.closing:
                    break
                turn_id = self.turn_id
                rows, frames, inputs = self._drain()
                if idle or self.turn_id != turn_id:
                    turn_tokens, next_due = 0, clock()
        except RealtimeError as error:
            self.outputs.put_nowait(Output(ERROR, code=error.code, message=error.message, fatal=True))
        except Exception as error:  # reported to the client; the session ends
            logger.exception("realtime session %s failed", self.session_id)
            self.outputs.put_nowait(Output(ERROR, code="internal_error", message=str(error), fatal=True))
        finally:
            self.outputs.put_nowait(Output(CLOSED))

    async def _pause_until(self, due: float) -> None:
        """The rate cap's wait: until ``due`` on the loop's clock, cut short only by close."""
        delay = due - asyncio.get_running_loop().time()
        if delay > 0:
            try:
                await asyncio.wait_for(self.closed.wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def _wait_for_input(self) -> None:
        """Parked: nothing to say and nothing pending; no engine work until input arrives (or the timeout)."""
        while not self.pending_inputs and not self.closing:
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), self.config.parked_timeout_s)
            except asyncio.TimeoutError:
                raise RealtimeError(
                    "parked_request_timeout", f"no input for {self.config.parked_timeout_s} s while parked"
                ) from None

    def _initial_rows(self) -> list[int]:
        module = sys.modules.get(type(self.processor).__module__)
        default = getattr(module, "DEFAULT_REALTIME_SYSTEM_PROMPT", "")
        messages = [
            {"role": "system", "content": self.config.system_prompt or default},
            {"role": "user", "content": self.config.prompt or ""},
        ]
        return self._encode(self.processor.apply_chat_template(messages, add_generation_prompt=True))

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _drain(self) -> tuple[list[int], list[Frame], list["DrainedInput"]]:
        """The pending inputs as one segment: (its rows, its frames, its inputs in order). Every prompt opens a turn,
        whether the model was speaking or silent (the real server announces each one)."""
        prompts, self.prompts = self.prompts, []
        frames, self.frames = sorted(self.frames, key=lambda f: f.timestamp), []
        text = self._prompt_text(prompts)
        inputs = self._open_turns(prompts)
        text += "".join(frame_markup(frame.timestamp) for frame in frames)
        opened = {entry.seq_no for entry in inputs}
        inputs += [DrainedInput(f.seq_no) for f in frames if f.seq_no is not None and f.seq_no not in opened]
        inputs.sort(key=lambda entry: -1 if entry.seq_no is None else entry.seq_no)
        return self._encode(text), frames, inputs

    @staticmethod
    def _prompt_text(prompts: list[tuple[str, Optional[int]]]) -> str:
        """A segment's prompts: each spliced as a user/assistant pair, then one ``<|silence|>`` opener."""
        return "".join(prompt_splice(prompt) for prompt, _ in prompts) + (SILENCE_TOKEN if prompts else "")

    def _open_turns(self, prompts: list[tuple[str, Optional[int]]]) -> list["DrainedInput"]:
        """Each prompt closes the turn and opens the next."""
        inputs = []
        for _, seq_no in prompts:
            inputs.append(DrainedInput(seq_no, (self.turn_id, self.turn_id + 1)))
            self.turn_id += 1
        return inputs

    def _take_offered(self, inputs: list["DrainedInput"], taken: int) -> tuple[list[int], list["DrainedInput"]]:
        """The running step took the ``taken`` rows of the offered prompts before its extend: the old turn's text
        ends, their turns open, and the step is no longer interrupted (input arriving meanwhile interrupts it now).
        -> (their rows, the step's inputs with theirs, in order)."""
        prompts, self.offered = self.offered, []
        rows = self._encode(self._prompt_text(prompts))
        if taken != len(rows):
            raise RuntimeError(f"the step took {taken} offered rows, not the {len(rows)} offered")
        self._flush_text()
        opened = self._open_turns(prompts)
        self.interrupt_sent = False
        if self.pending_inputs:
            self._interrupt_running_step()
        return rows, sorted(inputs + opened, key=lambda entry: -1 if entry.seq_no is None else entry.seq_no)

    def _patches(self, frames: list[Frame]):
        import torch

        image_processor = self.processor.image_processor
        pixels, grids = [], []
        for frame in frames:
            values, grid = image_processor.realtime_frame(frame.image)
            pixels.append(values)
            grids.append(grid)
        return torch.cat(pixels), torch.tensor(grids)

    async def _step(
        self, rows: list[int], frames: list[Frame], inputs: list["DrainedInput"], ready: bool, allowance: int
    ) -> tuple[int, int, bool]:
        """One engine step: the rows (and frames) as an extend, then up to ``allowance`` tokens; input arriving
        meanwhile interrupts it (:meth:`_input_arrived`). -> (the last token, tokens generated, interrupted)."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        rid = step_rid(self.session_id, next(self.steps))
        input_ids = self.generated[-1:] + rows  # the token generated last goes through the model with the rows
        # What the step may write is bounded by the context (the scheduler bounds it again by the session's room):
        # a turn's allowance larger than the context is no reason to refuse the step.
        step_tokens = max(1, min(allowance, self.engine.tokenizer_manager.context_len - len(input_ids) - 1))
        request = GenerateReqInput(
            rid=rid,
            input_ids=input_ids,
            image_data=[step_frames_input(*self._patches(frames))] if frames else None,
            sampling_params=self._sampling(step_tokens, self._window_starts(frames)),
            stream=True,
            return_logprob=self.config.return_logprob,
            data_parallel_rank=self.dp_rank,
        )
        seen = 0
        self.running_rid, self.interrupt_sent = rid, False
        self.running_len, self.running_takes_prompts = len(input_ids), not ready
        if self.pending_inputs:  # arrived after this step's inputs were drained
            self._interrupt_running_step()
        manager = self.engine.tokenizer_manager
        try:
            with _issued(request):
                async for chunk in manager.generate_request(request, None):
                    # A refused or aborted step ends the session before any of its output counts: stock's stub run of
                    # a refused request still returns a token, which is no choice of this stream.
                    finish = chunk.get("meta_info", {}).get("finish_reason")
                    if isinstance(finish, dict) and finish.get("type") == "abort":
                        message = finish.get("message") or "the engine aborted the session"
                        code = "context_exhausted" if CONTEXT_EXHAUSTED in message else "session_aborted"
                        raise RealtimeError(code, message)
                    ids = chunk.get("output_ids") or []
                    if ids and seen < len(ids):
                        self._put_usage(chunk, len(ids))
                    if seen == 0 and ids:
                        taken_rows = self._account(chunk).get(OFFER_TAKEN_KEY)
                        if self.offered and taken_rows:
                            taken, inputs = self._take_offered(inputs, taken_rows)
                            rows, allowance = taken + rows, self._new_turn_allowance()
                        if ready:
                            self.outputs.put_nowait(Output(READY))
                        self._put_processed(inputs)
                    new, seen = ids[seen:], len(ids)
                    self.generated.extend(new)
                    if self.config.return_logprob:
                        logprobs = chunk["meta_info"]["output_token_logprobs"]
                        self.logprobs.extend(entry[0] for entry in logprobs[len(logprobs) - len(new) :])
                    self._emit_text(new)
        finally:
            self.running_rid = None
            self.prompts[:0], self.offered = self.offered, []  # not taken: drained by the next step, first
        if not seen:
            raise RealtimeError("session_aborted", f"step {rid} produced no token")
        self.segments.append((rows, [frame.timestamp for frame in frames], seen))
        last = self.generated[-1]
        # An interrupt that lost the race with the turn's own end (silence, the limit) changed nothing; one whose
        # prompts the step took did not end it.
        interrupted = self.interrupt_sent and not self._ends_turn(last) and seen < allowance
        return last, seen, interrupted

    def _put_processed(self, inputs: list["DrainedInput"]) -> None:
        """Each input of the step, once its extend ran: a prompt's turn change first (the real server sends
        ``response.turn.interrupted`` with the prompt's ``seq_no``, then its ``.processed`` with the turn fields)."""
        for entry in inputs:
            if entry.turn is not None:
                interrupted, opened = entry.turn
                self.outputs.put_nowait(
                    Output(INTERRUPTED, turn_id=interrupted, next_turn_id=opened, seq_no=entry.seq_no)
                )
            if entry.seq_no is not None:
                turn, opened = entry.turn if entry.turn is not None else (self.turn_id, None)
                self.outputs.put_nowait(Output(PROCESSED, seq_no=entry.seq_no, turn_id=turn, next_turn_id=opened))

    @staticmethod
    def _account(chunk: dict) -> dict:
        """The scheduler's account of the step at its start (:data:`USAGE_INFO_KEY`), {} when absent."""
        accounts = chunk.get("meta_info", {}).get(USAGE_INFO_KEY) or []
        return accounts[0] if accounts else {}

    def _put_usage(self, chunk: dict, generated: int) -> None:
        """The session's context use once this step generated ``generated`` tokens, from the scheduler's account at
        the step's start; the real server's fields, plus the KV slots held (``kv_tokens``, what ``/v1/loads`` counts
        for the session)."""
        account = self._account(chunk)
        if account and self.config.include_usage:
            self.outputs.put_nowait(Output(USAGE, usage=usage_after(account, generated)))

    def _ends_turn(self, token: int) -> bool:
        """``<|silence|>`` ends a turn, except in benchmark mode (``ignore_eos``: a turn runs to its allowance)."""
        return token == self.silence_id and not self.config.ignore_eos

    def _window_starts(self, frames: list[Frame]) -> Optional[list[int]]:
        """Per new frame, the first frame still in the window once it arrived (frames stamped more than the window
        before it have left); None without a window."""
        if self.frame_window_s is None or not frames:
            return None
        starts = []
        for frame in frames:
            self.frame_times.append(frame.timestamp)
            while self.frame_times[self.window_start] < frame.timestamp - self.frame_window_s:
                self.window_start += 1
            starts.append(self.window_start)
        return starts

    def _emit_text(self, new: list[int]) -> None:
        """Text deltas as the turn's text decodes (an incomplete UTF-8 sequence is held back); <|silence|> hidden
        and it ends the turn's text."""
        for token in new:
            if token == self.silence_id:
                self._flush_text()
                continue
            self.text_run.append(token)
            text = self.tokenizer.decode(self.text_run)
            if text.endswith("\ufffd"):
                continue
            self._put_text(text[len(self.text_emitted) :])
            self.text_emitted = text

    def _flush_text(self) -> None:
        """The rest of the turn's text (a held-back incomplete character as the replacement character)."""
        if self.text_run:
            self._put_text(self.tokenizer.decode(self.text_run)[len(self.text_emitted) :])
        self.text_run, self.text_emitted = [], ""

    def _put_text(self, piece: str) -> None:
        if piece:
            self.outputs.put_nowait(Output(TEXT, text=piece, turn_id=self.turn_id))

    def _sampling(self, max_new_tokens: int, window_starts: Optional[list[int]] = None) -> dict:
        sampling = {
            "max_new_tokens": max_new_tokens,
            "temperature": self.config.temperature,
            "top_p": self.config.top_p,
            "stop_token_ids": [] if self.config.ignore_eos else [self.silence_id],
            "ignore_eos": self.config.ignore_eos,
            "logit_bias": self.logit_bias,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if window_starts is not None:
            sampling["custom_params"] = {WINDOW_STARTS_PARAM: window_starts}
        return sampling

    async def _finish_step_request(self, rid: str, rows: list[int]) -> None:
        """The ``:close`` request: the scheduler frees the session's slots and row and aborts the request."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        request = GenerateReqInput(
            rid=rid, input_ids=rows, sampling_params={"max_new_tokens": 1}, data_parallel_rank=self.dp_rank
        )
        try:
            with _issued(request):
                async for _ in self.engine.tokenizer_manager.generate_request(request, None):
                    pass
        except Exception:  # the close request finishes as an abort by design
            logger.debug("realtime session %s closed", self.session_id)


__all__ = ["ServedRealtimeEngine", "ServedSession", "is_engine_step", "posing_step_refusal", "step_processor_output"]
