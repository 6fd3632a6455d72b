"""`make demo`: serve MOSS-VL with stock sglang + the plugin, ask one question about an image, stop the server.

Talks to the server only through the official ``openai`` client, exactly as a user would.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from pathlib import Path

from openai import OpenAI

from moss_vl_reference.queries_moss_vl import file_data_url
from serving.launch import REPO_ROOT, SglangServer

DEFAULT_IMAGE = REPO_ROOT / "assets" / "demo.png"
DEFAULT_QUESTION = "Describe this picture in one sentence."


def build_tiny_checkpoint() -> Path:
    """Build (or reuse) the embedded tiny MOSS-VL checkpoint; its builder prints the directory last."""
    out = subprocess.run(
        [sys.executable, "-m", "moss_vl_reference.tiny_checkpoint"],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return Path(out.strip().splitlines()[-1])


def ask(base_url: str, image: Path, question: str, max_tokens: int) -> dict:
    """One streamed chat completion; returns the reply, token usage and time to first token."""
    client = OpenAI(base_url=f"{base_url}/v1", api_key="not-needed")
    model = client.models.list().data[0].id
    started = time.perf_counter()
    first_token_at = None
    pieces, usage = [], None
    stream = client.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": file_data_url(image)}},
                    {"type": "text", "text": question},
                ],
            }
        ],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                first_token_at = first_token_at or time.perf_counter()
                pieces.append(choice.delta.content)
    return {
        "reply": "".join(pieces),
        "usage": usage,
        "ttft_s": (first_token_at or time.perf_counter()) - started,
        "total_s": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model", type=Path, help="MOSS-VL checkpoint dir (default: build/reuse the embedded tiny one)"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "npu", "cuda"], help="sglang --device (default cpu)")
    parser.add_argument(
        "--image", type=Path, default=DEFAULT_IMAGE, help="image to ask about (default assets/demo.png)"
    )
    parser.add_argument("--question", default=DEFAULT_QUESTION, help="the question sent with the image")
    parser.add_argument("--max-tokens", type=int, default=24, help="completion length limit (default 24)")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra sglang launch_server flag (repeatable)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    model = args.model or build_tiny_checkpoint()
    with SglangServer(model, device=args.device, extra_args=args.server_arg, name="demo") as server:
        print(f"server ready on {server.base_url} in {server.startup_seconds:.1f} s (log: {server.log_path})")
        result = ask(server.base_url, args.image, args.question, args.max_tokens)
    usage = result["usage"]
    print(f"question : {args.question}  [image: {args.image.name}]")
    print(f"reply    : {result['reply']!r}")
    if args.model is None:
        print("           (the embedded tiny model has random weights: the words are noise by design; the parity")
        print("            tests show the served tokens equal the reference transformers model's, token for token)")
    if usage is not None:
        print(
            f"usage    : prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens} "
            f"total_tokens={usage.total_tokens}"
        )
    print(f"TTFT     : {result['ttft_s'] * 1000:.0f} ms   (whole request {result['total_s'] * 1000:.0f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
