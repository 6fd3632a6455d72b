"""Videos the media tests send: a moving square of any length and rate, and the broken files a server must refuse.

Written with PyAV (mpeg4 in mp4, as ``tests/assets/moving_square_3s.mp4``); every frame differs, so a wrong frame
choice changes the pixels the model sees.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np

SIZE = (64, 48)  # width, height: one frame is a few vision tokens on the tiny checkpoint


def moving_square(index: int, width: int = SIZE[0], height: int = SIZE[1]) -> np.ndarray:
    """Frame ``index``: a white square stepping right and down over a background whose shade moves with the index."""
    frame = np.full((height, width, 3), (index * 23) % 200, dtype=np.uint8)
    x, y = (index * 5) % (width - 12), (index * 3) % (height - 12)
    frame[y : y + 12, x : x + 12] = 255
    return frame


def write_video(path: Path, frames: int, fps: Fraction | int = 4, width: int = SIZE[0], height: int = SIZE[1]) -> Path:
    """An mp4 of ``frames`` moving-square frames at ``fps`` (a ``Fraction`` for rates below 1)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        container.start_encoding()  # writes the header even when no frame follows (a zero-frame file)
        for index in range(frames):
            picture = av.VideoFrame.from_ndarray(moving_square(index, width, height), format="rgb24")
            container.mux(stream.encode(picture))
        container.mux(stream.encode())
    return path


def decoded_frames(path: Path) -> list[np.ndarray]:
    """Every frame of a file as RGB arrays (PyAV, the decoder the server uses)."""
    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
