"""`make demo-realtime`: serve the tiny MOSS-VL-Realtime checkpoint with stock sglang + the plugin, stream a video
through ``WS /v1/video/realtime`` with a prompt, print each round as it comes, stop the server.

The video is the example clip of the runners (``inference/examples/media/moving_dot.mp4``, a dot moving across the
frame), sampled at ``--fps`` and sent on a real clock; the prompt goes in after ``--prompt-after`` frames.
Each round is printed when its turn ends (``response.turn.silence``): what came in, what the model said, how long
the step took.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path

from moss_vl_reference.tiny_checkpoint import build_or_reuse
from realtime_inference.video_sources import video_file_frames
from serving.launch import REPO_ROOT, SglangServer
from serving.realtime_client import RealtimeClient

logger = logging.getLogger(__name__)

EXAMPLE_VIDEO = REPO_ROOT / "inference" / "examples" / "media" / "moving_dot.mp4"


async def stream(url: str, args) -> None:
    client = RealtimeClient(url)
    opened = time.perf_counter()
    configured = await client.open(max_new_tokens=args.max_new_tokens, temperature=0.0)
    print(f"session configured: max_frame_bytes={configured.get('max_frame_bytes')}")
    await client.settle()
    shown = print_round(client, "opening", 0, opened)
    started = time.perf_counter()
    for index, frame in enumerate(video_file_frames(args.video, args.fps, args.max_frames)):
        await asyncio.sleep(max(0.0, started + frame.timestamp - time.perf_counter()))
        sent = time.perf_counter()
        seq_no = await client.frame(frame.image, frame.timestamp)
        await client.settle(seq_no)
        shown = print_round(client, f"frame {frame.timestamp:.1f} s", shown, sent)
        if index + 1 == args.prompt_after:
            sent = time.perf_counter()
            seq_no = await client.prompt(args.prompt)
            await client.settle(seq_no)
            shown = print_round(client, f"prompt {args.prompt!r}", shown, sent)
    await client.close()
    print(f"session done: {client.count('response.turn.silence')} rounds, {len(client.texts())} text pieces")


def print_round(client: RealtimeClient, what: str, shown: int, sent: float) -> int:
    """Print the text of the events since index ``shown``; -> the new index."""
    pieces = [r.event["delta"] for r in client.events[shown:] if r.event["type"] == "response.text.delta"]
    said = "".join(pieces) or "(silence)"
    print(f"[{(client.events[-1].at - sent) * 1000:6.0f} ms] {what:<28} -> {said!r}")
    return len(client.events)


def realtime_server_parser(description: str) -> argparse.ArgumentParser:
    """The flags every realtime demo takes: the checkpoint, the device and extra launch_server flags."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="MOSS-VL-Realtime checkpoint (default: the tiny-realtime one)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "npu", "cuda"], help="sglang --device (default cpu)")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra sglang launch_server flag (repeatable)"
    )
    return parser


def realtime_server(args: argparse.Namespace, name: str, **kwargs) -> SglangServer:
    """A server for the demo's checkpoint (the tiny realtime one unless ``--model``), not yet started."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = args.model or build_or_reuse("tiny-realtime")
    # A session is refused unless the KV pool holds one full context: the tiny model's context is set to fit.
    server_args = ["--context-length", "4096", *args.server_arg]
    return SglangServer(model, device=args.device, extra_args=server_args, name=name, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = realtime_server_parser(__doc__)
    parser.add_argument("--video", type=Path, default=EXAMPLE_VIDEO, help="video file to stream (default: the example)")
    parser.add_argument("--fps", type=float, default=2.0, help="frames sampled and sent per second (default 2)")
    parser.add_argument("--max-frames", type=int, default=6, help="frames sent at most (default 6; 0: the whole video)")
    parser.add_argument("--prompt", default="What is moving?", help="the prompt pushed into the stream")
    parser.add_argument("--prompt-after", type=int, default=2, help="push the prompt after this many frames (2)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="tokens per turn at most (default 24)")
    args = parser.parse_args(argv)
    with realtime_server(args, "demo-realtime") as server:
        print(f"server ready on {server.base_url} in {server.startup_seconds:.1f} s (log: {server.log_path})")
        asyncio.run(stream(server.base_url.replace("http://", "ws://") + "/v1/video/realtime", args))
    if args.model is None:
        print(
            "(the tiny checkpoint has random weights: the words are noise by design; tests/test_serving_realtime_ws.py"
        )
        print(" shows each served session equals the reference transformers stream, token for token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
