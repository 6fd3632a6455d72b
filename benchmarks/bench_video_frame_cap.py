"""What one video request costs the server's processes, by the number of frames it asks for.

One tiny-checkpoint server (fp32, page 128) is started with the published checkpoint's shared video budget,
``video_max_pixels`` 201326592 (``--mm-process-config``), so a whole clip's frame count is bounded by ``max_frames``
as it is on the real model (the tiny checkpoint's own budget would stop it at 128 frames). A --seconds long clip of
--width x --height at --fps is sent as a ``video_url`` part asking ``num_frames`` N (and ``max_frames`` N where N
is above the server's cap, which is how a client lifted it before the cap was held). For each N the table gives the
answer's status, the seconds until it came, and the peak growth of the resident memory of the server's whole process
tree over its resident memory just before (sampled every 20 ms), then what it still holds after.

Run (CPU, no other server needed): .venv/bin/python benchmarks/bench_video_frame_cap.py [--frames 120 256 1800]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from fractions import Fraction
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks.soak_realtime import server_rss_mib_by_process  # noqa: E402
from moss_vl_reference.tiny_checkpoint import build_or_reuse  # noqa: E402
from serving.launch import SglangServer  # noqa: E402
from support.videos import write_video  # noqa: E402

PUBLISHED_VIDEO_MAX_PIXELS = 201326592  # the published checkpoint's video_preprocessor_config.json
SERVER_MAX_FRAMES = 256  # the published default, which the tiny checkpoint keeps
QUESTION = {"type": "text", "text": "What moves?"}


def tree_rss_mib(server: SglangServer) -> float:
    return sum(server_rss_mib_by_process(server).values())


def measured_request(server: SglangServer, model: str, url: str, frames: int) -> dict:
    """One chat request asking ``frames`` frames: status, seconds, peak and retained growth of the tree's RSS."""
    asked = {"num_frames": frames, **({"max_frames": frames} if frames > SERVER_MAX_FRAMES else {})}
    body = {
        "model": model,
        "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}, QUESTION]}],
        "max_tokens": 1,
        "temperature": 0,
        "mm_processor_kwargs": asked,
    }
    before = tree_rss_mib(server)
    peak, done = [before], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss_mib(server))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.perf_counter()
    try:
        response = requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=1800)
    finally:
        seconds = time.perf_counter() - started
        done.set()
        sampler.join()
    time.sleep(1.0)
    message = "" if response.status_code == 200 else response.json().get("message", "")[:90]
    return {
        "frames": frames,
        "asked": asked,
        "status": response.status_code,
        "seconds": seconds,
        "peak_growth_mib": peak[0] - before,
        "retained_mib": tree_rss_mib(server) - before,
        "message": message,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, nargs="+", default=[120, 256, 1800])
    parser.add_argument("--seconds", type=int, default=120)
    parser.add_argument("--fps", type=int, default=15)
    parser.add_argument("--width", type=int, default=320)
    parser.add_argument("--height", type=int, default=240)
    args = parser.parse_args()
    checkpoint = build_or_reuse("tiny")
    with tempfile.TemporaryDirectory() as media:
        frames = args.seconds * args.fps
        clip = write_video(Path(media) / "long.mp4", frames, Fraction(args.fps), args.width, args.height)
        config = {"video": {"video_max_pixels": PUBLISHED_VIDEO_MAX_PIXELS}}
        server_args = ["--dtype", "float32", "--page-size", "128", "--skip-server-warmup"]
        server_args += ["--mm-process-config", json.dumps(config)]
        env = {"MOSSVL_ALLOWED_LOCAL_MEDIA_PATH": media}
        with SglangServer(checkpoint, extra_args=server_args, env=env, name="bench-video-frame-cap") as server:
            model = requests.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
            rows = [measured_request(server, model, f"file://{clip}", frames) for frames in sorted(args.frames)]
    print(
        f"clip: {args.seconds} s, {args.seconds * args.fps} frames of {args.width}x{args.height}; server max_frames "
        f"{SERVER_MAX_FRAMES}, video_max_pixels {PUBLISHED_VIDEO_MAX_PIXELS}"
    )
    print(f"{'frames asked':>12} {'status':>6} {'seconds':>8} {'peak MiB':>9} {'kept MiB':>9}  answer")
    for row in rows:
        print(
            f"{row['frames']:>12} {row['status']:>6} {row['seconds']:>8.2f} {row['peak_growth_mib']:>9.0f} "
            f"{row['retained_mib']:>9.0f}  {row['message'] or 'ok'}"
        )
    largest = rows[-1]
    print(
        f"RESULT frames={largest['frames']} status={largest['status']} seconds={largest['seconds']:.2f} "
        f"peak_growth_mib={largest['peak_growth_mib']:.0f}"
    )


if __name__ == "__main__":
    main()
