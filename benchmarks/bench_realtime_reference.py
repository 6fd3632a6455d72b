"""Reference realtime stream: work per step early and late in a stream, against the old per-prompt re-encode.

For each preset (random weights, fp32, CPU) two `RealtimeStream`s are grown frame by frame (--size x --size noise
frames, one generated token with each frame, the realtime loop's unit of work), one to frame 10 and one to frame
--late (200). A step is one frame arriving with one token: the new frame through the vision tower, its K/V appended
to every cross-attention cache, the token and the frame's text through the decoder. Its time is the median of
--repeats steps of each stream, taken alternately, beside a decode step (one token, no frame). The old reference
session answered every prompt by re-encoding the whole frame window as one video and prefilling it; its cost is
measured here as that prefill (the processor over the window's frames, then the model up to the first token) with
10 and --late frames in the window. The vision tower's frame count is checked: every frame is encoded exactly once.

Then a parked session (the tiny-realtime checkpoint, after <|silence|> with nothing pending) is left alone for
--park-seconds and the process's CPU time over that wait is printed.

Run (CPU): .venv/bin/python benchmarks/bench_realtime_reference.py [--presets tiny bench --late 200]
Last line: ``RESULT realtime_reference step_ratio_200_over_10=R reencode_ratio_200_over_10=Q`` (R and Q taken on
the last preset; the target is R <= 1.3).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from moss_vl_reference.processing_moss_vl import DEFAULT_REALTIME_SYSTEM_PROMPT  # noqa: E402
from moss_vl_reference.realtime_moss_vl import RealtimeStream, StreamFrame, frame_text  # noqa: E402
from moss_vl_reference.tiny_checkpoint import build_or_reuse  # noqa: E402

EARLY = 10


def load(preset: str):
    from transformers import AutoModelForCausalLM, AutoProcessor

    checkpoint = build_or_reuse(preset)
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, trust_remote_code=True, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    return model, AutoProcessor.from_pretrained(checkpoint, trust_remote_code=True)


def noise_frame(index: int, size: int) -> Image.Image:
    pixels = np.random.default_rng(index).integers(0, 255, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


class StreamDriver:
    """A stream fed one frame (plus the greedy token before it) at a time, timing each step."""

    def __init__(self, model, processor, size: int):
        self.model, self.processor, self.size = model, processor, size
        self.stream = RealtimeStream(model)
        messages = [{"role": "system", "content": DEFAULT_REALTIME_SYSTEM_PROMPT}, {"role": "user", "content": ""}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        self.logits = self.stream.append(self.encode(text), [])

    def encode(self, text: str) -> list[int]:
        return self.processor.tokenizer(text, add_special_tokens=False)["input_ids"]

    def frame_step(self) -> float:
        index = self.stream.frames_seen
        image_processor = self.processor.image_processor
        pixels, grid = image_processor.realtime_frame(noise_frame(index, self.size))
        frame = StreamFrame(pixels, grid, float(index))
        token = int(self.logits.argmax())
        started = time.perf_counter()
        self.logits = self.stream.append([token] + self.encode(frame_text(frame.timestamp)), [frame])
        return time.perf_counter() - started

    def decode_step(self) -> float:
        started = time.perf_counter()
        self.logits = self.stream.append([int(self.logits.argmax())], [])
        return time.perf_counter() - started


def reencode_seconds(model, processor, frames: int, size: int) -> float:
    """The old session's work for one prompt: the whole window as one video, processed and prefilled."""
    video = {"frames": [noise_frame(i, size) for i in range(frames)], "timestamps": [float(i) for i in range(frames)]}
    messages = [
        {"role": "system", "content": DEFAULT_REALTIME_SYSTEM_PROMPT},
        {"role": "user", "content": [{"type": "video", "video": video}, {"type": "text", "text": "What changed?"}]},
    ]
    started = time.perf_counter()
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, videos=[video], media_kwargs={"min_frames": 1, "max_frames": frames})
    model.generate(**inputs, max_new_tokens=1)
    return time.perf_counter() - started


def measure_preset(preset: str, late: int, repeats: int, size: int) -> dict:
    """Two streams, one grown to frame 10 and one to frame `late`, stepped alternately: a change in the machine's
    load (it is shared) then hits both medians alike instead of skewing their ratio."""
    model, processor = load(preset)
    drivers = {"early": StreamDriver(model, processor, size), "late": StreamDriver(model, processor, size)}
    for label, point in (("early", EARLY), ("late", late)):
        while drivers[label].stream.frames_seen < point:
            drivers[label].frame_step()
        for _ in range(repeats):  # warm-up: the first calls of each shape pay for allocations
            drivers[label].decode_step()
    samples = {f"{kind}_{label}": [] for kind in ("frame", "decode") for label in drivers}
    for _ in range(repeats):
        for label, driver in drivers.items():
            samples[f"frame_{label}"].append(driver.frame_step())
            samples[f"decode_{label}"].append(driver.decode_step())
    row = {"preset": preset, **{key: statistics.median(values) for key, values in samples.items()}}
    for driver in drivers.values():
        if driver.stream.vision_frames_encoded != driver.stream.frames_seen:
            raise AssertionError(
                f"vision tower encoded {driver.stream.vision_frames_encoded} frames for {driver.stream.frames_seen}"
            )
    row["frames"] = drivers["late"].stream.frames_seen
    row["tokens"] = len(drivers["late"].stream.tokens)
    row["reencode_early"] = reencode_seconds(model, processor, EARLY, size)
    row["reencode_late"] = reencode_seconds(model, processor, late, size)
    return row


def parked_cpu_seconds(park_seconds: float) -> tuple[float, float]:
    """(process CPU seconds, wall seconds) while a tiny-realtime session sits parked."""
    model, processor = load("tiny-realtime")
    session = model.create_realtime_session(processor).start()
    try:
        if not session.wait_until_parked(120):
            raise AssertionError("the tiny-realtime stream never parked")
        cpu, wall = time.process_time(), time.monotonic()
        threading.Event().wait(park_seconds)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        if not session.parked:
            raise AssertionError("the session left its park without input")
    finally:
        session.close(timeout=60)
    return cpu, wall


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "bench"], help="checkpoint presets (default both)")
    parser.add_argument("--late", type=int, default=200, help="the late frame count (default 200)")
    parser.add_argument("--repeats", type=int, default=9, help="steps per median (default 9)")
    parser.add_argument("--size", type=int, default=128, help="frame side in pixels (default 128: 8x8 patches)")
    parser.add_argument("--park-seconds", type=float, default=5.0, help="parked wait measured (default 5)")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    rows = [measure_preset(preset, args.late, args.repeats, args.size) for preset in args.presets]
    late = args.late
    print(f"step = one frame + one token; ms, median of {args.repeats}; frames {args.size}x{args.size}")
    header = (
        f"{'preset':<8} {'frame+token@10':>15} {f'@{late}':>9} {'ratio':>6} {'decode@10':>10} {f'@{late}':>9} "
        f"{'ratio':>6} {'re-encode@10':>13} {f'@{late}':>10} {'ratio':>6}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['preset']:<8} {1e3 * r['frame_early']:>15.2f} {1e3 * r['frame_late']:>9.2f} "
            f"{r['frame_late'] / r['frame_early']:>6.2f} {1e3 * r['decode_early']:>10.2f} "
            f"{1e3 * r['decode_late']:>9.2f} {r['decode_late'] / r['decode_early']:>6.2f} "
            f"{1e3 * r['reencode_early']:>13.1f} {1e3 * r['reencode_late']:>10.1f} "
            f"{r['reencode_late'] / r['reencode_early']:>6.2f}"
        )
        print(f"         ({r['frames']} frames, {r['tokens']} text tokens, every frame through the vision tower once)")
    cpu, wall = parked_cpu_seconds(args.park_seconds)
    print(f"parked session: {cpu:.4f} s process CPU over {wall:.2f} s parked")
    last = rows[-1]
    print(
        f"RESULT realtime_reference step_ratio_{late}_over_{EARLY}={last['frame_late'] / last['frame_early']:.2f} "
        f"reencode_ratio_{late}_over_{EARLY}={last['reencode_late'] / last['reencode_early']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
