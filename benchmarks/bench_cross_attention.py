"""Frame-causal cross-attention: dense packed mask vs per-row boundaries (issue 7).

One MOSS-VL cross-attention layer's prefill, fp32 / bf16 / fp16, 8 query heads / 2 KV heads, head_dim 64, on
video prompts: every frame is 64 vision tokens + 1 separator in the encoder, each frame is
followed by 6 text rows that see the frames so far, then a 512-row question sees every frame.

Methods, side by side on the same tensors:
  (a) dense: stock sglang's ``_build_cross_attention_custom_mask`` (packed uint8, 1 = visible),
      each request's slice unpacked to bool and passed to SDPA (the source PR's Ascend path);
  (b) ours: per-row boundaries + block plan, ``frame_causal_cross_attention`` (blocks merged by log-sum-exp);
  (c) floor: visible fraction x time of one unmasked SDPA over all rows and all encoder tokens.
Times are the best of --reps repetitions per cell, the methods interleaved. err_a / err_b: max abs error of
(a) / (b) on the first request against an fp64 reference on the same rounded inputs (per-row softmax over the
visible keys only); the speed targets are read at fp32.

Run (CPU): SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=cpu_shim .venv/bin/python benchmarks/bench_cross_attention.py
Many SDPA calls (b) suffer more than one big call (a, c) when other processes share the cores,
so the header reports the load average and OMP_WAIT_POLICY (PASSIVE unless set).
"""

from __future__ import annotations

import os

# Before torch starts OpenMP: on a shared machine, threads that spin while waiting at the end of
# each parallel region take the CPU from the thread they wait for, which taxes every op and so
# penalises (b)'s many SDPA calls far more than one big call. Passive waiting measures compute.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402
from torch.nn.functional import scaled_dot_product_attention

from mossvl_ascend.attention.blocks import (  # noqa: E402
    encoder_boundaries_from_visible_frames,
    frame_causal_cross_attention,
    frame_ends_from_grid_thw,
    plan_frame_causal_blocks,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 64
MERGE = 2
GRID_HW = 16  # 16x16 patches -> 64 merged vision tokens per frame, + 1 separator
TEXT_ROWS_PER_FRAME = 6
QUESTION_ROWS = 512
SCALE = HEAD_DIM**-0.5


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def video_request(num_frames: int, generator: torch.Generator, dtype: torch.dtype) -> SimpleNamespace:
    """One request's multimodal metadata and its cross-attention q/k/v (rounded to ``dtype``)."""
    grid_thw = torch.tensor([[num_frames, GRID_HW, GRID_HW]])
    tokens_per_frame = GRID_HW * GRID_HW // MERGE**2 + 1
    encoder_len = num_frames * tokens_per_frame
    counts = torch.arange(1, num_frames + 1).repeat_interleave(TEXT_ROWS_PER_FRAME)
    counts = torch.cat([counts, torch.full((QUESTION_ROWS,), num_frames)]).to(torch.int32)
    text_len = counts.numel()
    return SimpleNamespace(
        grid_thw=grid_thw,
        visible_frame_counts=counts,
        text_len=text_len,
        encoder_len=encoder_len,
        q=torch.randn(NUM_HEADS, text_len, HEAD_DIM, generator=generator).to(dtype),
        k=torch.randn(NUM_KV_HEADS, encoder_len, HEAD_DIM, generator=generator).to(dtype),
        v=torch.randn(NUM_KV_HEADS, encoder_len, HEAD_DIM, generator=generator).to(dtype),
    )


def stock_packed_mask(requests) -> torch.Tensor:
    """(a) build: stock sglang's builder on a minimal forward batch (whole prompt extended)."""
    from sglang.srt.models.moss_vl import MossVLForConditionalGeneration

    forward_batch = SimpleNamespace(
        batch_size=len(requests),
        encoder_lens_cpu=[r.encoder_len for r in requests],
        extend_seq_lens_cpu=[r.text_len for r in requests],
        extend_prefix_lens_cpu=[0] * len(requests),
        mm_inputs=[
            SimpleNamespace(
                visible_frame_counts=r.visible_frame_counts,
                mm_items=[SimpleNamespace(grid_thw=r.grid_thw)],
            )
            for r in requests
        ],
        seq_lens=torch.zeros(len(requests), dtype=torch.int64),
    )
    model = SimpleNamespace(spatial_merge_size=MERGE)
    return MossVLForConditionalGeneration._build_cross_attention_custom_mask(model, forward_batch)


def dense_attention(requests, packed: torch.Tensor) -> list[torch.Tensor]:
    """(a) attention: each request's packed slice -> bool [L, S] (True = attend) -> SDPA."""
    outs, offset = [], 0
    for r in requests:
        size = r.text_len * r.encoder_len
        visible = packed[offset : offset + size].view(r.text_len, r.encoder_len).bool()
        offset += size
        outs.append(scaled_dot_product_attention(r.q, r.k, r.v, attn_mask=visible, scale=SCALE, enable_gqa=True))
    return outs


def boundary_metadata(requests):
    """(b) build: per-row boundaries from visible-frame counts, and each request's tile plan."""
    metadata = []
    for r in requests:
        frame_ends = frame_ends_from_grid_thw(r.grid_thw, MERGE)
        boundaries = encoder_boundaries_from_visible_frames(r.visible_frame_counts, frame_ends, r.encoder_len)
        metadata.append((boundaries, plan_frame_causal_blocks(boundaries)))
    return metadata


def boundary_attention(requests, metadata) -> list[torch.Tensor]:
    return [
        frame_causal_cross_attention(r.q, r.k, r.v, boundaries, SCALE, plan=plan)
        for r, (boundaries, plan) in zip(requests, metadata)
    ]


def unmasked_attention(requests) -> list[torch.Tensor]:
    """(c) one unmasked SDPA per request over all rows and all encoder tokens."""
    return [scaled_dot_product_attention(r.q, r.k, r.v, scale=SCALE, enable_gqa=True) for r in requests]


def metadata_bytes(metadata) -> int:
    """Boundaries plus everything the plans keep (tensors and block descriptors as 5 int32)."""
    total = 0
    for boundaries, plan in metadata:
        total += boundaries.numel() * boundaries.element_size()
        for tensor in (plan.order, plan.sorted_boundaries):
            if tensor is not None:  # no order when the rows are already sorted
                total += tensor.numel() * tensor.element_size()
        total += 20 * len(plan.blocks)
    return total


def fp64_reference(r, boundaries) -> torch.Tensor:
    """Row r: softmax over its visible keys [0, boundary_r) only, fp64, in row chunks (bounded memory)."""
    group = NUM_HEADS // NUM_KV_HEADS
    k = r.k.double().repeat_interleave(group, 0)
    v = r.v.double().repeat_interleave(group, 0)
    out = torch.zeros(NUM_HEADS, r.text_len, HEAD_DIM, dtype=torch.float64)
    for start in range(0, r.text_len, 128):
        rows = slice(start, min(r.text_len, start + 128))
        logits = torch.matmul(r.q[:, rows].double(), k.transpose(1, 2)) * SCALE
        hidden = torch.arange(r.encoder_len)[None, :] >= boundaries[rows, None]
        out[:, rows] = torch.softmax(logits.masked_fill_(hidden, float("-inf")), dim=-1) @ v
    return out


def measure(num_frames: int, batch: int, reps: int, dtype_name: str) -> dict:
    gen = torch.Generator().manual_seed(num_frames * 10 + batch)
    requests = [video_request(num_frames, gen, DTYPES[dtype_name]) for _ in range(batch)]
    packed = stock_packed_mask(requests)
    metadata = boundary_metadata(requests)
    reference = fp64_reference(requests[0], metadata[0][0])
    err_a = float((dense_attention(requests[:1], packed).pop().double() - reference).abs().max())
    err_b = float((boundary_attention(requests[:1], metadata[:1]).pop().double() - reference).abs().max())
    cells = {
        "build_a": lambda: stock_packed_mask(requests),
        "attn_a": lambda: dense_attention(requests, packed),
        "build_b": lambda: boundary_metadata(requests),
        "attn_b": lambda: boundary_attention(requests, metadata),
        "unmasked": lambda: unmasked_attention(requests),
    }
    # Repetitions interleave the methods, so load from other processes hits all of them alike.
    best = dict.fromkeys(cells, float("inf"))
    for _ in range(reps):
        for name, fn in cells.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)

    visible = sum(int(b.sum()) for b, _ in metadata)
    visible_fraction = visible / sum(r.text_len * r.encoder_len for r in requests)
    return dict(
        dtype=dtype_name,
        frames=num_frames,
        batch=batch,
        rows=requests[0].text_len,
        enc=requests[0].encoder_len,
        blocks=len(metadata[0][1].blocks),
        vis=visible_fraction,
        floor=visible_fraction * best.pop("unmasked"),
        bytes_a=packed.numel() * packed.element_size(),
        bytes_b=metadata_bytes(metadata),
        err_a=err_a,
        err_b=err_b,
        **best,
    )


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'dtype':>5} {'frames':>6} {'batch':>5} {'rows':>5} {'enc':>6} {'blocks':>6} {'vis':>5} "
        f"{'build_a ms':>10} {'build_b ms':>10} {'attn_a ms':>10} {'attn_b ms':>10} "
        f"{'floor_c ms':>10} {'meta_a B':>10} {'meta_b B':>9} {'a/b':>5} {'b/c':>5} {'err_a':>8} {'err_b':>8}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['dtype']:>5} {r['frames']:>6} {r['batch']:>5} {r['rows']:>5} {r['enc']:>6} {r['blocks']:>6} "
            f"{r['vis']:>5.2f} {r['build_a'] * 1e3:>10.1f} {r['build_b'] * 1e3:>10.1f} "
            f"{r['attn_a'] * 1e3:>10.1f} {r['attn_b'] * 1e3:>10.1f} {r['floor'] * 1e3:>10.1f} "
            f"{r['bytes_a']:>10} {r['bytes_b']:>9} {r['attn_a'] / r['attn_b']:>5.2f} "
            f"{r['attn_b'] / r['floor']:>5.2f} {r['err_a']:>8.1e} {r['err_b']:>8.1e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--reps", type=int, default=5, help="repetitions per cell (best is kept)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    print(
        f"{NUM_HEADS} query heads / {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, best of {args.reps}, "
        f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    rows = [measure(f, b, args.reps, d) for d in args.dtypes for f in args.frames for b in args.batch]
    print_table(rows)
    headline = next((r for r in rows if (r["dtype"], r["frames"], r["batch"]) == ("fp32", 256, 1)), None)
    if headline is not None:
        errors = " ".join(
            f"err_b_over_a_{r['dtype']}={r['err_b'] / r['err_a']:.2f}"
            for r in rows
            if r["frames"] == 256 and r["batch"] == 1 and r["dtype"] != "fp32"
        )
        print(
            f"RESULT speedup_vs_dense={headline['attn_a'] / headline['attn_b']:.2f} "
            f"mask_memory_ratio={headline['bytes_a'] / headline['bytes_b']:.0f} "
            f"vs_floor={headline['attn_b'] / headline['floor']:.2f} max_err_fp32={headline['err_b']:.1e} {errors}"
        )


if __name__ == "__main__":
    main()
