"""Generation and the runner APIs of MOSS-VL (remote code), mixed into `MossVLForConditionalGeneration`.

`modeling_moss_vl.py` holds the model math (forward = prefill or one decode step); this module holds what is
built on it, under the names and signatures of the public checkpoints' remote code:
  * `generate` — greedy / sampled decoding with the cross-attention K/V computed once at prefill;
  * `offline_batch_generate(processor, queries)` and the queue loop `offline_generate(processor, in, out)`;
  * `create_realtime_session(processor, ...)` and its queue loop `online_generate` (the stream itself is
    `realtime_moss_vl`).
Queries and the stream protocol (round markers, ``[ERROR]`` pieces, stop messages) are `queries_moss_vl`.
"""

import logging
import queue
import threading
from typing import Callable, Optional

import torch

from .queries_moss_vl import (
    ERROR_PREFIX,
    ROUND_END,
    ROUND_START,
    STOP_OFFLINE_GENERATE,
    is_stop_message,
    query_messages,
)

logger = logging.getLogger(__name__)

# Frames the vision tower encodes at a time in the runner APIs (the upstream default).
DEFAULT_VISION_CHUNKED_LENGTH = 64


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, set)) else [value]


class MossVLGenerationMixin:
    """Decoding and runner APIs over the model's `forward` / `prefill_state` (see the module docstring)."""

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        pixel_values: Optional[torch.Tensor] = None,
        grid_thw: Optional[torch.Tensor] = None,
        media_nums_per_sample: Optional[list] = None,
        cross_attention_mask: Optional[torch.Tensor] = None,
        max_new_tokens: int = 16,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        eos_token_id=None,
        pad_token_id: Optional[int] = None,
        use_cache: bool = True,
        on_token: Optional[Callable[[torch.Tensor], None]] = None,
        stop_event: Optional[threading.Event] = None,
        vision_chunked_length: Optional[int] = None,
        **_,
    ) -> torch.LongTensor:
        """Greedy or sampled decoding -> (B, L + new) ids; finished rows are padded with `pad_token_id`.

        Inputs are the processor's output (see `MossVLForConditionalGeneration.forward`). Cross-attention K/V are
        computed once at prefill and reused. `on_token(step_ids)` gets the (B,) ids of each step (streaming);
        `stop_event` set ends decoding after the current step; `vision_chunked_length` encodes at most that many
        frames at a time (same result, lower peak memory)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        eos = self.stop_token_ids(eos_token_id)
        pad = pad_token_id if pad_token_id is not None else (sorted(eos)[0] if eos else 0)
        media = (pixel_values, grid_thw, media_nums_per_sample, cross_attention_mask)
        output = self(
            input_ids, attention_mask, *media, use_cache=use_cache, vision_chunked_length=vision_chunked_length
        )
        cache, logits = output.past_key_values, output.logits[:, -1]
        sequences, finished = input_ids, torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            logits = self.adjust_logits(logits, sequences, repetition_penalty)
            next_ids = self.pick(logits, do_sample, temperature, top_k, top_p).masked_fill(finished, pad)
            sequences = torch.cat((sequences, next_ids[:, None]), dim=1)
            attention_mask = torch.cat((attention_mask, (~finished).long()[:, None]), dim=1)
            if on_token is not None:
                on_token(next_ids)
            finished |= torch.isin(next_ids, torch.tensor(sorted(eos), device=next_ids.device))
            if finished.all() or (stop_event is not None and stop_event.is_set()):
                break
            if use_cache:
                logits = self(next_ids[:, None], attention_mask, past_key_values=cache, use_cache=True).logits[:, -1]
            else:
                logits = self.recompute_last_logits(sequences, attention_mask, input_ids.shape[1], *media)
        return sequences

    def recompute_last_logits(
        self, sequences, attention_mask, prompt_len, pixel_values, grid_thw, media_nums_per_sample, cross_attention_mask
    ) -> torch.Tensor:
        """Logits of the last token from a full forward over prompt + continuation (no cache): generated tokens
        continue the prompt's positions and inherit its last row's visibility."""
        prompt = sequences[:, :prompt_len]
        state = self.prefill_state(
            prompt,
            attention_mask[:, :prompt_len],
            pixel_values,
            grid_thw,
            media_nums_per_sample,
            cross_attention_mask,
            None,
        )
        extra = sequences.shape[1] - prompt_len
        steps = torch.arange(extra, device=sequences.device)
        continuation = (state["next_position"][:, None] + steps).unsqueeze(0).expand(3, -1, -1)
        positions = torch.cat((state["positions"], continuation), dim=2)
        mask = cross_attention_mask
        if mask is not None:
            mask = torch.cat((mask, mask[:, :, -1:].expand(-1, -1, extra, -1)), dim=2)
        media = (pixel_values, grid_thw, media_nums_per_sample, mask)
        return self(sequences, attention_mask, *media, position_ids=positions).logits[:, -1]

    def stop_token_ids(self, eos_token_id) -> set:
        """Explicit ids, else the config's eos plus generation_config's (as sglang's stop set)."""
        if eos_token_id is None:
            generation = getattr(self, "generation_config", None)
            eos_token_id = [self.config.text_config.eos_token_id, *_as_list(getattr(generation, "eos_token_id", None))]
        return set(_as_list(eos_token_id)) - {None}

    @staticmethod
    def adjust_logits(logits: torch.Tensor, sequences: torch.Tensor, repetition_penalty: float) -> torch.Tensor:
        if repetition_penalty == 1.0:
            return logits
        seen = torch.gather(logits, 1, sequences)
        seen = torch.where(seen > 0, seen / repetition_penalty, seen * repetition_penalty)
        return logits.scatter(1, sequences, seen)

    @staticmethod
    def pick(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
        if not do_sample:
            return logits.argmax(dim=-1)
        logits = logits.float() / max(temperature, 1e-5)
        if top_k and top_k > 0:
            kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p < 1.0:
            ordered, order = logits.sort(dim=-1, descending=True)
            drop = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1) > top_p
            logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1).squeeze(-1)

    # ---- runner APIs

    def processor_inputs(self, processor, query: dict) -> tuple[dict, dict]:
        """A query (forms: `queries_moss_vl`) -> (processor output on the model's device, its generate kwargs)."""
        messages = query_messages(query)
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        images, videos = processor.extract_media(messages)
        media_kwargs = query.get("media_kwargs") or {}
        inputs = processor(text=text, images=images or None, videos=videos or None, media_kwargs=media_kwargs)
        return self.to_device(inputs), dict(query.get("generate_kwargs") or {})

    def to_device(self, inputs) -> dict:
        return {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in dict(inputs).items()}

    def offline_batch_generate(
        self, processor, queries: list, vision_chunked_length: int = DEFAULT_VISION_CHUNKED_LENGTH, **generate_kwargs
    ) -> dict:
        """Answer each query independently -> {"results": [{"text": ...}, ...]}; a failing query
        yields {"text": "", "error": message}."""
        results = []
        for query in queries:
            try:
                inputs, kwargs = self.processor_inputs(processor, query)
                kwargs = {"vision_chunked_length": vision_chunked_length, **generate_kwargs, **kwargs}
                sequences = self.generate(**inputs, **kwargs)
                text = processor.decode(sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
                results.append({"text": text})
            except (ValueError, FileNotFoundError, RuntimeError) as error:
                logger.warning("query failed: %s", error)
                results.append({"text": "", "error": str(error)})
        return {"results": results}

    def offline_generate(
        self,
        processor,
        input_queue: queue.Queue,
        output_queue: queue.Queue,
        vision_chunked_length: int = DEFAULT_VISION_CHUNKED_LENGTH,
        **generate_kwargs,
    ) -> None:
        """Serve queries from `input_queue` until {"stop_offline_generate": True}. For each query
        put <|round_start|>, text pieces as they decode, then <|round_end|>; a failure puts
        "[ERROR] <message>" before <|round_end|>."""
        while True:
            query = input_queue.get()
            if is_stop_message(query, STOP_OFFLINE_GENERATE):
                return
            output_queue.put(ROUND_START)
            try:
                inputs, kwargs = self.processor_inputs(processor, query)
                kwargs = {"vision_chunked_length": vision_chunked_length, **generate_kwargs, **kwargs}
                self.stream(processor, inputs, output_queue, **kwargs)
            except Exception as error:  # reported to the caller through the protocol
                logger.warning("offline query failed: %s", error)
                output_queue.put(f"{ERROR_PREFIX}{type(error).__name__}: {error}")
            output_queue.put(ROUND_END)

    def stream(self, processor, inputs: dict, output_queue, stop_event=None, **generate_kwargs) -> str:
        """generate() for one sample, putting newly decoded text on `output_queue` as it appears."""
        decoded, emitted = [], [""]

        def on_token(step_ids):
            decoded.append(int(step_ids[0]))
            text = processor.decode(decoded, skip_special_tokens=True)
            if len(text) > len(emitted[0]) and not text.endswith("\ufffd"):
                output_queue.put(text[len(emitted[0]) :])
                emitted[0] = text

        self.generate(**inputs, **generate_kwargs, on_token=on_token, stop_event=stop_event)
        # a trailing incomplete byte sequence was held back above; the answer ends here, so flush it
        final = processor.decode(decoded, skip_special_tokens=True)
        if len(final) > len(emitted[0]):
            output_queue.put(final[len(emitted[0]) :])
        return final

    def create_realtime_session(
        self,
        processor,
        initial_prompt: str = "",
        system_prompt: Optional[str] = None,
        frame_queue_size: int = 256,
        max_tokens_per_turn: Optional[float] = None,
        frame_window_seconds: Optional[float] = None,
        **generate_kwargs,
    ):
        """A realtime stream over frames and prompts pushed as they arrive (`realtime_moss_vl`); call `start()`."""
        from .realtime_moss_vl import MossVLRealtimeSession

        return MossVLRealtimeSession(
            self,
            processor,
            initial_prompt=initial_prompt,
            system_prompt=system_prompt,
            frame_queue_size=frame_queue_size,
            max_tokens_per_turn=max_tokens_per_turn,
            frame_window_seconds=frame_window_seconds,
            **generate_kwargs,
        )

    def online_generate(
        self,
        processor,
        input_queue: queue.Queue,
        output_queue: queue.Queue,
        frame_queue_size: int = 256,
        max_tokens_per_turn: Optional[float] = None,
        **generate_kwargs,
    ) -> None:
        """The queue-driven realtime loop (`realtime_moss_vl.online_generate`): a first settings message, then
        frames and prompts, until {"stop_online_generate": True}; output pieces go to `output_queue`."""
        from .realtime_moss_vl import online_generate

        online_generate(
            self, processor, input_queue, output_queue, frame_queue_size, max_tokens_per_turn, **generate_kwargs
        )


__all__ = ["MossVLGenerationMixin"]
