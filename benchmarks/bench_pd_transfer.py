"""KV bytes a PD transfer moves per request: MOSS-VL's KV layout vs the stock pool (issue 51).

For each pool (``MOSSVL_KV_LAYOUT=mossvl``, then ``stock``): one prefill and one decode worker over ``mooncake_tcp``
behind smg (``serving.fleet --pd``), tiny checkpoint, fp32, page 128; then an image question
(``tests/support/serving.py``'s ``image_data_url``), a video (``--video-frames`` frames of ``--frame-side`` pixels
square at 1 fps, a one-word question) and a text-only question, one at a time. The bytes are counted where sglang hands
them to Mooncake's transfer engine, which has no byte counters of its own (``tests/support/pd_transfer_bytes.py``):
the written blocks whose source lies in the prefill's KV buffers, aux data left out. Beside them, per request: the
prompt's slots (layout: ``ceil(E / bands) + T``) or tokens (stock: ``E + T``) the server reports, and the bytes the
layout's addressing predicts: ``pages x page x bands x L_cross x 2 x row bytes`` (stock: ``pages x page x L x 2 x row
bytes``).

Derived, not measured: the same arithmetic for MOSS-VL-Instruct (48 layers, 12 cross, 8 KV heads of 128, bf16, page
128) and a 256-frame video of 448x448 frames (E = 256 x 197 = 50,432, T = 4,048; ``bench_kv_layout.py``'s anchors).

Run (CPU): SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=cpu_shim .venv/bin/python -m benchmarks.bench_pd_transfer
Last line: ``RESULT pd_transfer video_layout_bytes=B1 video_stock_bytes=B2 video_ratio=R1 image_ratio=R2
text_ratio=R3``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "sglang")]

from moss_vl_reference.configuration_moss_vl import MossVLTextConfig  # noqa: E402
from moss_vl_reference.tiny_checkpoint import build_or_reuse  # noqa: E402
from mossvl_ascend.attention.kv_layout import LAYOUT_ENV, MOSSVL, STOCK, LayerBands, encoder_row_len  # noqa: E402
from serving.fleet import PATIENT_HEALTH, Fleet  # noqa: E402
from support.pd_transfer_bytes import KvBytes, counting_env  # noqa: E402
from support.serving import CASES, chat_logprobs, load_reference, pd_server_args  # noqa: E402
from support.videos import write_video  # noqa: E402

logger = logging.getLogger(__name__)

PAGE = 128
SERVER_ARGS = pd_server_args(PAGE)
INSTRUCT_VIDEO = (50_432, 4_048)  # (E, T): 256 frames of 448x448, a 2,000-token question


def pages(tokens: int) -> int:
    return -(-tokens // PAGE)


def predicted_bytes(bands: LayerBands, row_bytes: int, layout: str, row: int) -> int:
    """What the transfer moves for a slot row of ``row`` slots (tokens for stock), whole pages."""
    layers = bands.bands * bands.cross_count if layout == MOSSVL else bands.num_layers
    return pages(row) * PAGE * layers * 2 * row_bytes


def requests_to_send(video_frames: int, frame_side: int, folder: Path) -> dict[str, list[dict]]:
    video = write_video(folder / "square.mp4", video_frames, 1, frame_side, frame_side)
    video_case = [{"role": "user", "content": [{"type": "video", "video": str(video)}, {"type": "text", "text": "?"}]}]
    return {"image": CASES["image_data_url"], "video": video_case, "text": CASES["text_only"]}


def measure(layout: str, checkpoint: Path, processor, cases: dict, kv_buffers: int, counts: Path) -> dict:
    """Per request: ``(prompt slots or tokens, KV bytes the prefill handed the engine)`` with ``layout`` pools."""
    saved = dict(os.environ)
    os.environ.update(counting_env(counts) | {LAYOUT_ENV: layout})  # the workers inherit it
    try:
        fleet = Fleet(
            checkpoint,
            pd=True,
            worker_args=SERVER_ARGS,
            name=f"bench-pd-{layout}",
            worker_ready_timeout_s=900,
            **PATIENT_HEALTH,
        )
        with fleet:
            counted = KvBytes(counts, kv_buffers)
            counted.take()
            results = {}
            for name, messages in cases.items():
                answer = chat_logprobs(fleet.gateway_url, processor, messages, 1)
                results[name] = (answer["prompt_tokens"], counted.take())
            return results
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--video-frames", type=int, default=8, help="frames of the video request, one per second (default: 8)"
    )
    parser.add_argument(
        "--frame-side", type=int, default=256, help="the video's frames are this many pixels square (default: 256)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    checkpoint = build_or_reuse("tiny")
    processor = load_reference(checkpoint)[1]
    config = json.loads((checkpoint / "config.json").read_text())["text_config"]
    bands = LayerBands(config["num_hidden_layers"], tuple(config["cross_attention_layers"]))
    row_bytes = config["num_key_value_heads"] * config["head_dim"] * 4  # fp32
    kv_buffers = {MOSSVL: 2 * bands.cross_count * bands.bands, STOCK: 2 * bands.num_layers}
    with tempfile.TemporaryDirectory(prefix="bench-pd-transfer-") as tmp:
        folder = Path(tmp)
        cases = requests_to_send(args.video_frames, args.frame_side, folder)
        results = {}
        for layout in (MOSSVL, STOCK):
            (folder / layout).mkdir()
            results[layout] = measure(layout, checkpoint, processor, cases, kv_buffers[layout], folder / layout)

    print(f"\nKV bytes per request over mooncake_tcp, tiny checkpoint (fp32, page {PAGE}), counted at the engine calls")
    header = f"{'request':8} {'slots':>6} {'tokens':>6} {'layout bytes':>13} {'predicted':>10} "
    print(header + f"{'stock bytes':>12} {'predicted':>10} {'ratio':>6}")
    ratios = {}
    for name in cases:
        slots, layout_bytes = results[MOSSVL][name]
        tokens, stock_bytes = results[STOCK][name]
        ratios[name] = layout_bytes / stock_bytes
        print(
            f"{name:8} {slots:6d} {tokens:6d} {layout_bytes:13,d} "
            f"{predicted_bytes(bands, row_bytes, MOSSVL, slots):10,d} {stock_bytes:12,d} "
            f"{predicted_bytes(bands, row_bytes, STOCK, tokens):10,d} {ratios[name]:6.3f}"
        )
    instruct = LayerBands.of_text_config(MossVLTextConfig())
    vision, text = INSTRUCT_VIDEO
    instruct_row = 8 * 128 * 2  # 8 KV heads of 128, bf16
    derived = {
        layout: predicted_bytes(instruct, instruct_row, layout, row) / 1e9
        for layout, row in ((MOSSVL, encoder_row_len(vision, instruct.bands) + text), (STOCK, vision + text))
    }
    print(
        f"derived, MOSS-VL-Instruct bf16 page 128, a 256-frame 448x448 video (E={vision:,}, T={text:,}): layout "
        f"{derived[MOSSVL]:.2f} GB, stock pool {derived[STOCK]:.2f} GB ({derived[MOSSVL] / derived[STOCK]:.3f}x)"
    )
    print(f"benchmark wall time {time.perf_counter() - started:.0f} s")
    print(
        f"RESULT pd_transfer video_layout_bytes={results[MOSSVL]['video'][1]} "
        f"video_stock_bytes={results[STOCK]['video'][1]} video_ratio={ratios['video']:.3f} "
        f"image_ratio={ratios['image']:.3f} text_ratio={ratios['text']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
