"""Write a synthetic ProactiveVideoQA frame-input-format file and its frames (for the replay client's tests).

    python realtime_inference/examples/make_proactive_videoqa_sample.py --out build/pvqa [--samples 20]

Writes ``<out>/synthetic-1_sec_per_frame-frame_input_format.json`` (a JSON list of samples ``{question_id,
conversation}``) and the PNG frames it names under ``<out>/frames/`` (paths relative to ``<out>``). Samples vary
the way the real subsets do: a question with the first frames, later frame-only turns (some ``skip_inference``),
every third sample a TV-style subtitle turn (text on a frame), every fourth a system turn, gold assistant turns
that a replay must not send. Same arguments, same files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from PIL import Image, ImageDraw

FILE_NAME = "synthetic-1_sec_per_frame-frame_input_format.json"
QUESTIONS = ("Where does the square move?", "What colour is the square?", "Tell me when the square stops.")


def frame(sample: int, index: int) -> Image.Image:
    image = Image.new("RGB", (64, 64), (30 + 9 * sample, 40, 90))
    x = (index * 11 + sample * 3) % 48
    ImageDraw.Draw(image).rectangle((x, 24, x + 16, 40), fill=(250, 200 - 7 * index, 30))
    return image


def write_frames(out: Path, sample: int, count: int) -> list[str]:
    folder = out / "frames" / f"q{sample:03d}"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        path = folder / f"{index:03d}.png"
        frame(sample, index).save(path)
        paths.append(str(path.relative_to(out)))
    return paths


def sample_record(out: Path, sample: int) -> dict:
    paths = write_frames(out, sample, 3 + sample % 4)
    question = QUESTIONS[sample % len(QUESTIONS)]
    images = [{"type": "image", "image": path} for path in paths]
    conversation = []
    if sample % 4 == 0:
        conversation.append({"role": "system", "content": "Answer as soon as the video shows the answer."})
    conversation.append({"role": "user", "content": images[:2] + [{"type": "text", "text": question}]})
    for position, part in enumerate(images[2:], start=2):
        turn = {"role": "user", "content": [part], "skip_inference": position % 2 == 0}
        if sample % 3 == 0 and position == len(images) - 1:
            turn["content"] = [part, {"type": "text", "text": "Subtitle: keep the change."}]
        conversation.append(turn)
    conversation.append({"role": "assistant", "content": "The square moves to the right.", "time": len(paths)})
    return {"question_id": f"synthetic-{sample:03d}", "conversation": conversation}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder (created)")
    parser.add_argument("--samples", type=int, default=20, help="number of samples (default 20)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    samples = [sample_record(args.out, index) for index in range(args.samples)]
    path = args.out / FILE_NAME
    path.write_text(json.dumps(samples, indent=1) + "\n", encoding="utf-8")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
