"""A small VideoMME-shaped evaluation set made from this repository's own pictures: 4 slideshow videos, 6
multiple-choice questions whose answers follow from how each video was made.

Each video shows some of ``PICTURES`` one after another (2 s each, 4 fps, 96x96, the picture drifting a few pixels
per frame so no two frames are equal). A row has VideoMME's fields (``video_id``, ``duration``, ``domain``,
``sub_category``, ``task_type``, ``question_id``, ``question``, ``options`` as ``"A. ..."``, ``answer`` a letter)
plus ``video_path``, the file's absolute path.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parents[1]
PICTURES = {
    "a stop sign": REPO_ROOT / "inference" / "examples" / "media" / "stop_sign.png",
    "coloured shapes": REPO_ROOT / "inference" / "examples" / "media" / "shapes.png",
    "the demo picture": REPO_ROOT / "assets" / "demo.png",
    "a square": REPO_ROOT / "tests" / "assets" / "square_64.png",
}
SIDE, FPS, SECONDS_PER_PICTURE = 96, 4, 2
VIDEOS = {
    "slides_1": ["a stop sign", "coloured shapes", "the demo picture"],
    "slides_2": ["the demo picture", "a square"],
    "slides_3": ["coloured shapes", "a stop sign", "a square", "the demo picture"],
    "slides_4": ["a square", "coloured shapes"],
}
NAMES = list(PICTURES)


def slideshow_frames(pictures: list[str]) -> list[np.ndarray]:
    """RGB frames: each picture for SECONDS_PER_PICTURE, drifting right by one pixel per frame."""
    frames = []
    for name in pictures:
        picture = Image.open(PICTURES[name]).convert("RGB").resize((SIDE, SIDE))
        base = np.asarray(picture, dtype=np.uint8)
        for step in range(FPS * SECONDS_PER_PICTURE):
            frames.append(np.roll(base, step, axis=1))
    return frames


def write_slideshow(path: Path, pictures: list[str]) -> None:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=Fraction(FPS))
        stream.width = stream.height = SIDE
        stream.pix_fmt = "yuv420p"
        for frame in slideshow_frames(pictures):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def options_with(answer: str, others: list[str]) -> tuple[list[str], str]:
    """Four ``"X. text"`` options holding ``answer`` at a place fixed by the set (no randomness), and its letter."""
    choices = sorted({answer, *others[:3]}, key=lambda text: (hash_order(text), text))
    return [f"{letter}. {text}" for letter, text in zip("ABCD", choices)], "ABCD"[choices.index(answer)]


def hash_order(text: str) -> int:
    return sum(ord(char) * (index + 1) for index, char in enumerate(text)) % 97


def questions() -> list[dict]:
    rows = []

    def add(video_id: str, task_type: str, question: str, answer: str, others: list[str]) -> None:
        options, letter = options_with(answer, [o for o in others if o != answer])
        duration = len(VIDEOS[video_id]) * SECONDS_PER_PICTURE
        rows.append(
            {
                "video_id": video_id,
                "duration": "short",
                "domain": "Synthetic",
                "sub_category": "Slideshow",
                "task_type": task_type,
                "question_id": f"{video_id}-{len(rows) + 1}",
                "question": question,
                "options": options,
                "answer": letter,
                "seconds": duration,
            }
        )

    counts = ["1", "2", "3", "4"]
    add("slides_1", "Temporal Perception", "Which picture is shown first?", VIDEOS["slides_1"][0], NAMES)
    add("slides_1", "Counting Problem", "How many different pictures does the video show?", "3", counts)
    add("slides_2", "Temporal Perception", "Which picture is shown last?", VIDEOS["slides_2"][-1], NAMES)
    add("slides_3", "Counting Problem", "How many different pictures does the video show?", "4", counts)
    add("slides_3", "Temporal Reasoning", "Which picture comes right after the stop sign?", "a square", NAMES)
    absent = ["a stop sign", "the demo picture", "a red circle"]
    add("slides_4", "Object Recognition", "Which of these pictures appears in the video?", "coloured shapes", absent)
    return rows


def build(directory: Path) -> list[dict]:
    """Write the videos and ``questions.json`` into ``directory`` (reused when present); the rows."""
    directory.mkdir(parents=True, exist_ok=True)
    for video_id, pictures in VIDEOS.items():
        path = directory / f"{video_id}.mp4"
        if not path.is_file():
            write_slideshow(path, pictures)
    rows = [{**row, "video_path": str((directory / f"{row['video_id']}.mp4").resolve())} for row in questions()]
    (directory / "questions.json").write_text(json.dumps(rows, indent=1))
    return rows
