"""The reference model's realtime stream (`realtime_moss_vl`) on the tiny-realtime checkpoint (CPU).

Oracle: the model's ordinary full forward (a cold prefill) over the stream's final token sequence, with every
frame's pixels and, per row, the frames that row may see (a prefix; with the frame window on, the frames still in
the window when the row was written). Every token the stream chose must be the greedy pick of the cold logits of
the row before it, and the stream's logits must equal the cold ones within 1e-5, both run in float64 (why:
``exact_model``). The token formats are checked against literal strings written here, not the module's helpers.
"""

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoProcessor

from moss_vl_reference.processing_moss_vl import DEFAULT_REALTIME_SYSTEM_PROMPT
from moss_vl_reference.tiny_checkpoint import build_or_reuse
from support.cold_prefill import assert_stream_equals_cold, cold_logits

TURN_LIMIT = 24
WAIT = 60.0


@pytest.fixture(scope="module")
def realtime_checkpoint():
    return build_or_reuse("tiny-realtime")


@pytest.fixture(scope="module")
def model(realtime_checkpoint):
    return AutoModelForCausalLM.from_pretrained(
        realtime_checkpoint, trust_remote_code=True, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


@pytest.fixture(scope="module")
def exact_model(realtime_checkpoint):
    """The model in float64, for the stream-equals-cold-prefill oracle. The stream and a cold prefill are the same
    math summed in a different order (rows in pieces vs at once, K/V appended vs whole): in float32 that moves a
    logit by up to 8 ulps of the largest logit (3.05e-5 at |logit| 44 and 48, measured on subtitle_prompt_on_a_frame
    and frames_then_prompt), past an element-wise 1e-5 for the small logits of the same row; in float64 the two
    agree to 2.5e-14 (measured), so the 1e-5 check tests the math, not the rounding."""
    return AutoModelForCausalLM.from_pretrained(
        realtime_checkpoint, trust_remote_code=True, dtype=torch.float64, attn_implementation="sdpa"
    ).eval()


@pytest.fixture(scope="module")
def rt_processor(realtime_checkpoint):
    return AutoProcessor.from_pretrained(realtime_checkpoint, trust_remote_code=True)


def noise_image(seed: int, size=(64, 64)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def frame_string(ts: float) -> str:
    return f"<|vision_start|><|time_start|>{ts:.1f} seconds<|time_end|><|image_pad|><|vision_end|>"


def splice_string(prompt: str) -> str:
    return f"<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def drain_outputs(session) -> list[str]:
    pieces = []
    while (piece := session.poll_output(0)) is not None:
        pieces.append(piece)
    return pieces


class Script:
    """Drives a session: each action is pushed while the stream is parked, then the stream is let run until it
    parks again. Records every image pushed (by timestamp) and the expected text segments in order."""

    def __init__(self, session):
        self.session = session
        self.images: dict[float, Image.Image] = {}
        self.expected: list[str] = []
        self.parks = 0

    def settle(self):
        assert self.session.wait_until_parked(WAIT), "the stream never parked"
        self.parks += 1

    def frame(self, ts: float, seed: int):
        self.images[ts] = noise_image(seed)
        assert self.session.push_frame(self.images[ts], ts) is False
        self.expected.append(frame_string(ts))
        self.settle()

    def prompt(self, text: str):
        self.session.push_prompt(text)
        self.expected.append(splice_string(text) + "<|silence|>")
        self.settle()

    def prompt_frame(self, text: str, ts: float, seed: int):
        self.images[ts] = noise_image(seed)
        assert self.session.push_prompt_frame(text, self.images[ts], ts) is False
        self.expected.append(splice_string(text) + "<|silence|>" + frame_string(ts))
        self.settle()

    def prompts_in_one_drain(self, *texts: str):
        with self.session.condition:  # the worker cannot drain until both are queued
            for text in texts:
                self.session.push_prompt(text)
        self.expected.append("".join(splice_string(text) for text in texts) + "<|silence|>")
        self.settle()


def start(model, processor, **kwargs):
    session = model.create_realtime_session(processor, max_new_tokens=TURN_LIMIT, record_logits=True, **kwargs)
    return session.start()


def assert_segments_in_order(text: str, expected: list[str]):
    opening = (
        f"<|im_start|>system\n{DEFAULT_REALTIME_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text.startswith(opening)
    cursor = len(opening)
    for segment in expected:
        found = text.find(segment, cursor)
        assert found >= 0, f"segment {segment!r} missing after offset {cursor}"
        cursor = found + len(segment)


CASES = {
    "frames_then_prompt": lambda s: (s.frame(0.0, 1), s.frame(1.0, 2), s.frame(2.0, 3), s.prompt("What moved?")),
    "prompt_before_any_frame": lambda s: (s.prompt("Tell me when a dot appears."), s.frame(0.5, 4), s.frame(1.5, 5)),
    "prompts_between_frames": lambda s: (
        s.frame(0.0, 6),
        s.prompt("What is it?"),
        s.frame(1.0, 7),
        s.prompt("And now?"),
        s.frame(2.0, 8),
    ),
    "subtitle_prompt_on_a_frame": lambda s: (s.frame(0.0, 9), s.prompt_frame("keep the change", 1.0, 10)),
    "two_prompts_in_one_drain": lambda s: (s.frame(0.0, 11), s.prompts_in_one_drain("Count the dots.", "Be brief.")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_stream_equals_cold_prefill_of_its_final_sequence(exact_model, rt_processor, case):
    session = start(exact_model, rt_processor)
    script = Script(session)
    try:
        script.settle()
        CASES[case](script)
    finally:
        session.close(timeout=WAIT)
    assert not session.active
    images = [script.images[ts] for ts in sorted(script.images)]
    assert_stream_equals_cold(exact_model, rt_processor, session, images)
    assert_segments_in_order(rt_processor.tokenizer.decode(session.stream.tokens), script.expected)


def test_silence_parks_the_stream_and_input_wakes_it(exact_model, rt_processor):
    session = start(exact_model, rt_processor)
    script = Script(session)
    try:
        script.settle()
        before = len(session.stream.tokens)
        assert session.parked
        time.sleep(0.3)
        assert len(session.stream.tokens) == before, "a parked stream appends nothing"
        script.frame(0.0, 12)
        script.frame(1.0, 13)
        assert len(session.stream.tokens) > before, "a frame wakes the parked stream"
    finally:
        session.close(timeout=WAIT)
    pieces = drain_outputs(session)
    silences = pieces.count("<|silence|>")
    assert silences >= 2, f"short turns of the tiny-realtime checkpoint end in <|silence|> ({pieces})"
    silence_id = rt_processor.tokenizer.convert_tokens_to_ids("<|silence|>")
    chosen = [session.stream.tokens[row + 1] for row, _ in session.step_logits if row + 1 < len(session.stream.tokens)]
    assert silence_id in chosen, "the model itself chose <|silence|>"
    images = [script.images[ts] for ts in sorted(script.images)]
    assert_stream_equals_cold(exact_model, rt_processor, session, images)


def test_frame_window_equals_cold_prefill_without_the_evicted_frames(exact_model, rt_processor):
    window = 1.5
    session = start(exact_model, rt_processor, frame_window_seconds=window)
    script = Script(session)
    stamps = [0.0, 1.0, 2.0, 3.0, 4.0]
    try:
        script.settle()
        for index, ts in enumerate(stamps):
            script.frame(ts, 20 + index)
        script.prompt("What is left?")
    finally:
        session.close(timeout=WAIT)

    def in_window(row, count):
        if count == 0:
            return range(0)
        newest = stamps[count - 1]
        return [f for f in range(count) if stamps[f] >= newest - window]

    images = [script.images[ts] for ts in stamps]
    assert_stream_equals_cold(exact_model, rt_processor, session, images, in_window)
    per_frame = int((session.stream.key_frame == session.stream.key_frame[-1]).sum())
    assert session.stream.key_frame.unique().tolist() == [3, 4]  # frames at 3.0 and 4.0 s: within 1.5 s of 4.0
    for buffer in session.stream.cross_kv.values():
        assert len(buffer) == 2 * per_frame, "evicted frames' K/V left every cross-attention cache"
    decoded = rt_processor.tokenizer.decode(session.stream.tokens)
    assert all(frame_string(ts) in decoded for ts in stamps), "the evicted frames' text stays"
    # The oracle must tell the window apart: without it (every frame visible) the late rows differ.
    prefix_cold = cold_logits(exact_model, rt_processor, session.stream.tokens, images, lambda row, count: range(count))
    last_row = session.step_logits[-1][0]
    assert not torch.allclose(prefix_cold[last_row], session.step_logits[-1][1], atol=1e-3)


def test_vision_tower_sees_only_new_frames(model, rt_processor):
    calls = []
    visual = model.model.visual
    original = visual.forward

    def counting(pixel_values, grid_thw):
        calls.append(int(grid_thw[:, 0].sum()))
        return original(pixel_values, grid_thw)

    visual.forward = counting
    try:
        session = start(model, rt_processor)
        script = Script(session)
        try:
            script.settle()
            with session.condition:  # two frames in one drain: one call with both
                session.push_frame(noise_image(30), 0.0)
                session.push_frame(noise_image(31), 1.0)
            script.settle()
            script.frame(2.0, 32)
            script.frame(3.0, 33)
        finally:
            session.close(timeout=WAIT)
    finally:
        del visual.forward
    assert calls == [2, 1, 1]
    assert session.stream.vision_frames_encoded == 4


def test_turn_limit_and_rate_cap(checkpoint, processor):
    """The plain tiny checkpoint (no silence bias) talks until the turn limit, paced by the rate cap."""
    plain = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True, dtype=torch.float32).eval()
    rate, limit = 40.0, 8
    session = plain.create_realtime_session(processor, max_new_tokens=limit, max_tokens_per_turn=rate)
    started = time.monotonic()
    session.start()
    try:
        assert session.wait_until_parked(WAIT)
        elapsed = time.monotonic() - started
    finally:
        session.close(timeout=WAIT)
    generated = len(session.stream.tokens) - len(session.initial_ids())
    assert generated == limit - 1, "the turn's last token is chosen but only appended with the next input"
    assert elapsed >= (limit - 1) / rate, f"{limit} tokens in {elapsed:.3f}s exceed {rate} tokens/s"


def thread_cpu_seconds(native_id: int) -> float:
    """CPU time (user + system) of one thread of this process, from /proc (Linux)."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_parked_stream_uses_no_cpu(model, rt_processor):
    """The stream's own thread, not the whole process: other test modules may leave idle helper threads behind.
    (benchmarks/bench_realtime_reference.py reports the process's CPU time over a 5 s park.)"""
    session = start(model, rt_processor)
    try:
        assert session.wait_until_parked(WAIT)
        worker = session.worker.native_id
        cpu_before, wall_before = thread_cpu_seconds(worker), time.monotonic()
        threading.Event().wait(2.0)
        cpu = thread_cpu_seconds(worker) - cpu_before
        assert session.parked and time.monotonic() - wall_before >= 2.0
    finally:
        session.close(timeout=WAIT)
    assert cpu <= 0.02, f"parked for 2 s, the stream's thread used {cpu:.3f} s of CPU"


def test_bad_frame_fails_its_push_and_the_stream_goes_on(model, rt_processor):
    session = start(model, rt_processor)
    try:
        assert session.wait_until_parked(WAIT)
        with pytest.raises(ValueError, match="PIL image"):
            session.push_frame(b"not an image", 0.0)
        with pytest.raises(ValueError, match="empty prompt"):
            session.push_prompt("  ")
        session.push_frame(noise_image(40), 0.0)
        assert session.wait_until_parked(WAIT) and session.active
    finally:
        session.close(timeout=WAIT)
    assert rt_processor.tokenizer.decode(session.stream.tokens).count("<|image_pad|>") == 1


def test_full_frame_queue_drops_the_oldest_frame_without_a_prompt(model, rt_processor):
    session = model.create_realtime_session(rt_processor, frame_queue_size=2)  # not started: frames queue up
    assert session.push_prompt_frame("first", noise_image(50), 0.0) is False
    assert session.push_frame(noise_image(51), 1.0) is False
    assert session.push_frame(noise_image(52), 2.0) is True
    assert session.pending_frames == 2
    assert [frame.timestamp for frame, _ in session.pending.frames] == [0.0, 2.0]


def test_this_packages_stream_runs_a_checkpoint_loaded_from_its_own_copy(model, rt_processor):
    """The model comes from the checkpoint's copy of the reference package (trust_remote_code), whose layer classes
    are not this package's: `moss_vl_reference.realtime_moss_vl.RealtimeStream` must still find its cross-attention
    layers (from the config), so a frame changes what the next row predicts exactly as the checkpoint's own stream."""
    import sys

    from moss_vl_reference.realtime_moss_vl import RealtimeStream, StreamFrame

    own = sys.modules[type(model.create_realtime_session(rt_processor).stream).__module__]
    assert own.__name__ != "moss_vl_reference.realtime_moss_vl"
    pixels, grid = rt_processor.image_processor.realtime_frame(noise_image(3))
    ids = rt_processor.tokenizer("hello" + frame_string(0.0), add_special_tokens=False)["input_ids"]
    ours, theirs = RealtimeStream(model), own.RealtimeStream(model)
    assert ours.cross_layers == sorted(model.config.text_config.cross_attention_layers)
    logits = ours.append(ids, [StreamFrame(pixels, grid, 0.0)])
    torch.testing.assert_close(logits, theirs.append(ids, [own.StreamFrame(pixels, grid, 0.0)]), rtol=0, atol=0)


def test_a_pushed_frame_is_sized_as_an_image_of_the_processor(model, rt_processor):
    """The published realtime loop puts each drained frame through the processor as an image (an ``<|image|>``
    placeholder with ``images=frames``: modeling_moss_vl.py of MOSS-VL-Realtime-0708,
    ``_update_model_kwargs_for_real_time_generation`` step 3), so a frame follows the image size rule: at most
    size.longest_edge = 512 x 512 pixels on the tiny checkpoints, not the video rule (frames of at most 256 x 256).
    A 1024 x 768 frame: 786432 pixels scaled by sqrt(3) -> floor(768 / 1.732 / 32) * 32 = 416 by
    floor(1024 / 1.732 / 32) * 32 = 576, a [1, 26, 36] patch grid (the video rule would give [1, 12, 18])."""
    frame = noise_image(7, size=(1024, 768))
    session = model.create_realtime_session(rt_processor)
    pushed = session.stream_frame(frame, 0.0)
    assert pushed.grid == [1, 26, 36]
    as_image = rt_processor(text="<|image|>", images=[frame])
    assert as_image["grid_thw"].tolist() == [pushed.grid]
    assert torch.equal(pushed.pixel_values, as_image["pixel_values"])
