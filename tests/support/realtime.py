"""Realtime event scripts and their oracle: the reference stream (`moss_vl_reference.realtime_moss_vl`) driven by
the same script, each input pushed while the stream is parked, then run until it parks again (greedy, fp32).

A script is a tuple of actions: ("frame", timestamp, seed), ("prompt", text), ("subtitle", text, timestamp, seed);
a frame's seed may be the image itself.
The segment texts a step extends are written here as literal strings (not the engine's helpers).
"""

import numpy as np
from PIL import Image

TURN_LIMIT = 24
WAIT = 300.0

SCRIPTS = {
    "frames_1fps_then_prompt": (("frame", 0.0, 1), ("frame", 1.0, 2), ("frame", 2.0, 3), ("prompt", "What moved?")),
    "prompt_then_frames_2fps": (
        ("prompt", "Tell me when a dot appears."),
        ("frame", 0.0, 4),
        ("frame", 0.5, 5),
        ("frame", 1.0, 6),
    ),
    "prompts_between_frames": (
        ("frame", 0.0, 7),
        ("prompt", "What is it?"),
        ("frame", 1.0, 8),
        ("subtitle", "keep the change", 2.0, 9),
    ),
    "six_frames_2fps": tuple(("frame", 0.5 * i, 10 + i) for i in range(6)),
}


def noise_image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (64, 64, 3), dtype=np.uint8))


def frame_image(source) -> Image.Image:
    """A script's frame: the seed of a :func:`noise_image`, or an image itself (the frames a browser sent)."""
    return source if isinstance(source, Image.Image) else noise_image(source)


def frame_string(ts: float) -> str:
    return f"<|vision_start|><|time_start|>{ts:.1f} seconds<|time_end|><|image_pad|><|vision_end|>"


def splice_string(prompt: str) -> str:
    return f"<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<|silence|>"


def segment_text(action) -> str:
    """The text one action's step appends behind the token generated last."""
    if action[0] == "frame":
        return frame_string(action[1])
    if action[0] == "prompt":
        return splice_string(action[1])
    return splice_string(action[1]) + frame_string(action[2])


def frames_of(action) -> int:
    return 0 if action[0] == "prompt" else 1


async def play(client, actions) -> None:
    """Each action of a script through a realtime client (``serving.realtime_client.RealtimeClient``) in turn,
    waiting for the turn it starts to end."""
    for action in actions:
        if action[0] == "frame":
            seq_no = await client.frame(noise_image(action[2]), action[1])
        elif action[0] == "prompt":
            seq_no = await client.prompt(action[1])
        else:
            seq_no = await client.frame(noise_image(action[3]), action[2], prompt=action[1])
        await client.settle(seq_no)


def reference_generated(model, processor, script, frame_window_seconds=None) -> list[int]:
    """Every token the reference stream chose for ``script`` (with a frame window of that many seconds)."""
    return list(reference_session(model, processor, script, frame_window_seconds).generated)


def reference_session(model, processor, script, frame_window_seconds=None, record_logits=False):
    """The reference stream driven by ``script``, closed."""
    session = model.create_realtime_session(
        processor, max_new_tokens=TURN_LIMIT, frame_window_seconds=frame_window_seconds, record_logits=record_logits
    ).start()
    try:
        assert session.wait_until_parked(WAIT)
        for action in script:
            if action[0] == "frame":
                session.push_frame(frame_image(action[2]), action[1])
            elif action[0] == "prompt":
                session.push_prompt(action[1])
            else:
                session.push_prompt_frame(action[1], noise_image(action[3]), action[2])
            assert session.wait_until_parked(WAIT)
    finally:
        session.close(WAIT)
    return session


def turn_texts(tokenizer, tokens: list[int]) -> list[str]:
    """The text of each turn of ``tokens`` (a turn ends on <|silence|>, which is not text), decoded whole."""
    silence = tokenizer.convert_tokens_to_ids("<|silence|>")
    turns, current = [], []
    for token in tokens:
        if token == silence:
            turns.append(tokenizer.decode(current))
            current = []
        else:
            current.append(token)
    if current:
        turns.append(tokenizer.decode(current))
    return turns


def served_turn_texts(client) -> list[str]:
    """The text deltas a served session sent, joined per turn (a turn ends at its `response.turn.silence`)."""
    turns, current = [], []
    for received in client.events:
        kind = received.event["type"]
        if kind == "response.text.delta":
            current.append(received.event["delta"])
        elif kind == "response.turn.silence":
            turns.append("".join(current))
            current = []
    if current:
        turns.append("".join(current))
    return turns


def replay_logits(model, processor, segments, generated, images, frame_window_seconds=None) -> list:
    """Replay a served session's steps through the reference stream (``RealtimeStream``): for each step its rows
    (behind the last token generated) and frames, then each token it generated (teacher-forced, whatever step
    boundaries the served timing made: a barge-in ends a step early). ``segments``: (rows, frame timestamps, number
    of tokens generated) per step; ``generated``: every generated token in order; ``images``: timestamp -> PIL
    image. -> per generated token, the reference's logits (float64) before it, under the generation mask."""
    import sys

    # The checkpoint's own realtime module (remote code): its stream recognises the model's cross-attention layers.
    stream = model.create_realtime_session(processor, frame_window_seconds=frame_window_seconds).stream
    StreamFrame = sys.modules[type(stream).__module__].StreamFrame
    tokenizer, image_processor = processor.tokenizer, processor.image_processor
    silence = tokenizer.convert_tokens_to_ids("<|silence|>")
    control = {i for t, i in tokenizer.get_added_vocab().items() if t.startswith("<|") and t.endswith("|>")}
    masked = sorted(control - {silence})
    pending, chosen, tokens = [], [], iter(generated)
    for rows, timestamps, count in segments:
        step_tokens = [next(tokens) for _ in range(count)]
        frames = []
        for ts in timestamps:
            pixels, grid = image_processor.realtime_frame(images[ts].convert("RGB"))
            frames.append(StreamFrame(pixels, grid, ts))
        logits = stream.append(pending + list(rows), frames)
        for k, token in enumerate(step_tokens):
            choice = logits.double().clone()
            choice[masked] = float("-inf")
            choice[len(tokenizer) :] = float("-inf")
            chosen.append(choice)
            if k < len(step_tokens) - 1:
                logits = stream.append([token], [])
        pending = step_tokens[-1:]
    return chosen


def replay_mismatches(model, processor, segments, generated, images, frame_window_seconds=None) -> list[str]:
    """Every generated token must be the reference's greedy pick in the replay (:func:`replay_logits`). -> the
    mismatches (none: exact)."""
    import torch

    logits = replay_logits(model, processor, segments, generated, images, frame_window_seconds)
    return [
        f"token {k}: served {token}, reference {int(torch.argmax(choice))}"
        for k, (choice, token) in enumerate(zip(logits, generated, strict=True))
        if int(torch.argmax(choice)) != token
    ]


def replay_logprobs(model, processor, segments, generated, images) -> list[float]:
    """Each generated token's log-probability in the replay (:func:`replay_logits`)."""
    import torch

    logits = replay_logits(model, processor, segments, generated, images)
    return [float(torch.log_softmax(choice, dim=-1)[token]) for choice, token in zip(logits, generated, strict=True)]
