"""Reference model: peak memory and time of encoding a long video with and without `vision_chunked_length`.

The vision tower of the `bench` preset (depth 6, hidden 384, deepstack at blocks 1 and 3), random weights, fp32,
encodes --frames frames of --size x --size pixels (16-pixel patches). Each setting runs in a fresh process so
its peak is its own: the table reports the growth of the process's peak resident memory (VmHWM) over its
resident memory just before encoding, and the encode time. Outputs are checked equal to the unchunked run.

Run (CPU): .venv/bin/python benchmarks/bench_vision_chunking.py [--frames 64 --size 320 --chunks 0 64 16 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure(frames: int, size: int, chunk: int, reference: str | None) -> dict:
    """One setting, in this process: (peak growth MiB, seconds, max |difference| to the saved reference)."""
    import torch

    sys.path.insert(0, str(REPO_ROOT))
    from moss_vl_reference.configuration_moss_vl import MossVLConfig
    from moss_vl_reference.modeling_moss_vl import MossVLForConditionalGeneration
    from moss_vl_reference.tiny_checkpoint import PRESETS

    torch.manual_seed(0)
    vision = dict(PRESETS["bench"]["vision"], out_hidden_size=128, patch_size=16, spatial_merge_size=2)
    text = dict(PRESETS["tiny"]["text"])
    text["rope_scaling"] = {
        "rope_type": "default",
        "mrope_section": text.pop("mrope_section"),
        "mrope_interleaved": True,
    }
    model = MossVLForConditionalGeneration(MossVLConfig(text_config=text, vision_config=vision)).eval()
    side = size // 16
    grid_thw = torch.tensor([[frames, side, side]])
    pixel_values = torch.randn(frames * side * side, 3 * 16 * 16)
    before = status_kib("VmRSS")
    started = time.perf_counter()
    with torch.no_grad():
        merged = model.encode_frames(pixel_values, grid_thw, chunk or None)
    seconds = time.perf_counter() - started
    peak_growth = status_kib("VmHWM") - before
    difference = None
    if reference is None:
        torch.save(merged, REPO_ROOT / "build" / "bench_vision_chunking_reference.pt")
    else:
        difference = float((merged - torch.load(reference)).abs().max())
    return {"peak_mib": peak_growth / 1024, "seconds": seconds, "max_abs_diff": difference}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--size", type=int, default=320, help="frame side in pixels (multiple of 32)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 64, 16, 4], help="0 = all frames at once")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # child process: one setting
    parser.add_argument("--reference", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.frames, args.size, args.one, args.reference)))
        return 0
    (REPO_ROOT / "build").mkdir(exist_ok=True)
    reference = str(REPO_ROOT / "build" / "bench_vision_chunking_reference.pt")
    rows = []
    for index, chunk in enumerate([0] + [c for c in args.chunks if c]):
        command = [
            sys.executable,
            __file__,
            "--frames",
            str(args.frames),
            "--size",
            str(args.size),
            "--one",
            str(chunk),
        ]
        if index:
            command += ["--reference", reference]
        result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        rows.append((chunk, result))
    base = rows[0][1]
    print(f"vision tower (bench preset), {args.frames} frames of {args.size}x{args.size}, fp32, CPU")
    print(f"{'vision_chunked_length':>22} {'peak growth MiB':>16} {'vs whole':>9} {'time s':>8} {'max |diff|':>11}")
    for chunk, result in rows:
        diff = "reference" if result["max_abs_diff"] is None else f"{result['max_abs_diff']:.1e}"
        print(
            f"{chunk or 'all (None)':>22} {result['peak_mib']:16.1f} {result['peak_mib'] / base['peak_mib']:9.2f} "
            f"{result['seconds']:8.2f} {diff:>11}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
