"""`make demo-realtime-web`: serve the tiny MOSS-VL-Realtime checkpoint with stock sglang + the plugin on CPU and print
the address of the realtime page (``GET /v1/video/realtime/ui``); the server runs until Ctrl-C. Nothing is opened:
open the address in a browser on this machine (the camera needs ``localhost`` or HTTPS; from another machine, forward
the port with ``ssh -L PORT:127.0.0.1:PORT HOST`` and open ``localhost``, docs/realtime-web.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from moss_vl_reference.tiny_checkpoint import build_or_reuse
from mossvl_ascend.realtime.web_page import PAGE_PATH
from serving.launch import SglangServer

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="MOSS-VL-Realtime checkpoint (default: the tiny-realtime one)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "npu", "cuda"], help="sglang --device (default cpu)")
    parser.add_argument("--port", type=int, default=30000, help="port on 127.0.0.1 (default 30000)")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra sglang launch_server flag (repeatable)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = args.model or build_or_reuse("tiny-realtime")
    # A session is refused unless the KV pool holds one full context: the tiny model's context is set to fit.
    server_args = ["--context-length", "4096", *args.server_arg]
    with SglangServer(model, device=args.device, port=args.port, extra_args=server_args, name="demo-realtime-web") as s:
        print(f"server ready in {s.startup_seconds:.1f} s (log: {s.log_path})")
        print(f"realtime page: http://localhost:{s.port}{PAGE_PATH}")
        if args.model is None:
            print("(the tiny checkpoint has random weights: its words are noise by design; the page works the same")
            print(" with a real MOSS-VL-Realtime checkpoint: --model DIR)")
        print("Ctrl-C stops the server")
        try:
            while s.process.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
