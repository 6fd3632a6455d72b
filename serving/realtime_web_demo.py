"""`make demo-realtime-web`: serve the tiny MOSS-VL-Realtime checkpoint with stock sglang + the plugin on CPU and print
the address of the realtime page (``GET /v1/video/realtime/ui``); the server runs until Ctrl-C. Nothing is opened:
open the address in a browser on this machine (the camera needs ``localhost`` or HTTPS; from another machine, forward
the port with ``ssh -L PORT:127.0.0.1:PORT HOST`` and open ``localhost``, docs/realtime-web.md).
"""

from __future__ import annotations

import sys
import time

from mossvl_ascend.realtime.web_page import PAGE_PATH
from serving.launch import exit_on_sigterm
from serving.realtime_demo import realtime_server, realtime_server_parser


def main(argv: list[str] | None = None) -> int:
    parser = realtime_server_parser(__doc__)
    parser.add_argument("--port", type=int, default=30000, help="port on 127.0.0.1 (default 30000)")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    with realtime_server(args, "demo-realtime-web", port=args.port) as s:
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
