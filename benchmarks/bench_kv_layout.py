"""Requests running at once in one KV budget: the stock pool vs MOSS-VL's KV layout (issue 23).

MOSS-VL's layout (``sglang/mossvl_ascend/attention/kv_layout.py``) stores a vision (encoder) token in the
``L_cross`` cross-attention layers only and a text token in the ``L_self`` self-attention layers only, within the
bytes of the stock pool (every token all ``L`` layers). A request of ``E`` vision and ``T`` text tokens then fits
``(E + T)·L / (E·L_cross + T·L_self)`` times as many requests as stock: the bound printed beside every gain.

1. Capacities, from configs only (no weights): the tiny and bench presets at ``--max-total-tokens`` stock tokens (the
   served part's budget; fp32, page 1, as the CPU server runs them) and MOSS-VL-Instruct (the default text config of
   ``moss_vl_reference.configuration_moss_vl``) at ``--instruct-budget-gb`` in bf16 at the NPU's page 128: bytes
   per stock token, slots, text- and vision-token capacity in each layout, and the bound for (a) a 256-frame video
   at the default pixel budget (E = 256 x 769 = 196,864 vision tokens, T = 4,048 text tokens:
   ``ascend_perf_anchors.md`` §5.3-5.4), (a') the same video at 448x448 frames (E = 256 x 197 = 50,432) and (b) a
   2,000-token question about one 448x448 image (E = 197, T = 2,000); for Instruct also the requests of each that
   fit in the budget. The layout side uses ``LayerBands``; the stock side is computed here on its own.
2. Served (skipped with ``--quick``): a bench-preset server (fp32, CPU) with ``MOSSVL_KV_LAYOUT=stock``, then one
   with the default layout, one after the other, both with the same ``--max-total-tokens``. On each, two workloads:
   ``video`` (a synthetic clip of ``--video-frames`` frames of ``--frame-size`` pixels at 1 fps, made from
   ``assets/demo.png``; a short question: the encoder dominates) and ``image`` (``assets/demo.png`` resized to
   ``--image-size`` pixels and a ``--question-tokens`` question built from ``tests/support/serving.py``'s
   ``long_question``). E and T per request come from the checkpoint's processor; one probe request per workload
   checks them against the prompt tokens the server reports (``E + T`` stock, ``ceil(E / bands) + T`` ours). Then
   ``n`` identical requests (greedy, EOS ignored, ``--max-tokens`` each; ``n`` = that layout's predicted capacity
   plus ``--extra-requests``) are sent at once. The scheduler logs every decode step (``--decode-log-interval 1``);
   once ``--settle-steps`` decode steps ran with a request still queued (memory full), every request is aborted.
   "Running" is the most ``#running-req`` of a decode step; "predicted" is ``floor(pool slots / slots per
   request)``. A request holds its ``T`` prompt text tokens plus ``--max-tokens`` generated ones (stock admission
   reserves them for an EOS-ignoring request), so the served bound takes ``T + max_tokens`` text tokens.
   Server flags beyond the budget, the same on both servers: ``--disable-radix-cache`` (identical prompts would
   share their KV, and the count would measure sharing, not memory); ``--max-running-requests`` far above any
   count reached; ``--prefill-max-requests 1``: stock sglang's CPU vision attention (``VisionSdpaAttention``)
   runs one dense SDPA over every patch of a prefill batch, memory and time quadratic in the batch's patches (7
   clips of 8 x 512x512 frames in one batch asked for 79 GB, before the plugin capped a prefill batch's new vision
   tokens at a chunk); one request per prefill batch keeps the vision work per batch the same in both layouts, and
   admission (what fits in the pool) is unchanged. The default budget puts every count of
   both workloads just above a whole request in both layouts (3 and 4 image requests, 6 and 25 video requests):
   the counts are whole numbers, so at other budgets a gain moves by up to one request in 3 around the bound.

Run (CPU): SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=cpu_shim .venv/bin/python -m benchmarks.bench_kv_layout [--quick]
Last line (not with ``--quick``): ``RESULT kv_layout video_gain=G1 video_bound=B1 image_gain=G2 image_bound=B2``.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "sglang")]

import requests  # noqa: E402

from moss_vl_reference.configuration_moss_vl import MossVLTextConfig  # noqa: E402
from moss_vl_reference.tiny_checkpoint import PRESETS  # noqa: E402
from mossvl_ascend.attention.blocks import frame_ends_from_grid_thw  # noqa: E402
from mossvl_ascend.attention.kv_layout import LAYOUT_ENV, MOSSVL, STOCK, LayerBands, encoder_row_len  # noqa: E402
from serving.launch import REPO_ROOT, SglangServer  # noqa: E402
from support.serving import long_question, openai_client, to_openai  # noqa: E402

logger = logging.getLogger(__name__)

OUT_DIR = REPO_ROOT / "build" / "bench-kv-layout"
DEMO_IMAGE = REPO_ROOT / "assets" / "demo.png"
GB = 1e9
INSTRUCT_PAGE_SIZE = 128  # the NPU's page
CPU_PAGE_SIZE = 1  # the CPU server's default page
DTYPE_BYTES = {"bf16": 2, "fp32": 4}

# Decode lines of the scheduler log (sglang's metrics_reporter): "Decode batch, #running-req: N, ... #queue-req: Q".
DECODE_LINE = re.compile(r"Decode batch[^\n]*?#running-req: (\d+),[^\n]*?#queue-req: (\d+)")
POOL_LINE = re.compile(r"max_total_num_tokens=(\d+)")
LAYOUT_LINE = re.compile(r"MOSS-VL KV layout: the stock pool's bytes \((\d+) tokens")


# --- capacities from configs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """A request's KV: ``vision`` encoder tokens and ``text`` text tokens."""

    name: str
    vision: int
    text: int

    @property
    def stock_tokens(self) -> int:
        return self.vision + self.text

    def layout_slots(self, bands: LayerBands) -> int:
        return encoder_row_len(self.vision, bands.bands) + self.text


# Anchors §5.3-5.4: a 2,000-token prompt plus ~8 timestamp/placeholder tokens per frame = 4,048 text tokens.
VIDEO_256_DEFAULT = Request("(a) 256 frames, default pixel budget (786k px/frame)", 256 * (768 + 1), 4048)
VIDEO_256_448 = Request("(a') 256 frames of 448x448", 256 * (196 + 1), 4048)
IMAGE_QUESTION = Request("(b) one 448x448 image + 2,000-token question", 196 + 1, 2000)
REFERENCE_REQUESTS = (VIDEO_256_DEFAULT, VIDEO_256_448, IMAGE_QUESTION)


def bound(text_config, request: Request) -> float:
    """``(E + T)·L / (E·L_cross + T·L_self)``: how many times as many such requests an exact layout fits."""
    layers = text_config.num_hidden_layers
    cross = len(text_config.cross_attention_layers)
    weighted = request.vision * cross + request.text * (layers - cross)
    return request.stock_tokens * layers / weighted


def layer_bytes(text_config, dtype: str) -> int:
    """K and V of one token in one layer."""
    return 2 * text_config.num_key_value_heads * text_config.head_dim * DTYPE_BYTES[dtype]


def stock_token_bytes(text_config, dtype: str) -> int:
    """A stock slot: every decoder layer."""
    return text_config.num_hidden_layers * layer_bytes(text_config, dtype)


@dataclass(frozen=True)
class Budget:
    """One model's KV pool at one byte budget, in both layouts."""

    name: str
    text_config: object
    dtype: str
    page_size: int
    budget_bytes: int

    @property
    def layer_bands(self) -> LayerBands:
        return LayerBands.of_text_config(self.text_config)

    @property
    def stock_token_bytes(self) -> int:
        return stock_token_bytes(self.text_config, self.dtype)

    @property
    def slot_bytes(self) -> int:
        """A slot of the layout: ``bands`` x ``L_cross`` layers."""
        bands = self.layer_bands
        return bands.bands * bands.cross_count * layer_bytes(self.text_config, self.dtype)

    @property
    def stock_tokens(self) -> int:
        return self.budget_bytes // self.stock_token_bytes

    @property
    def slots(self) -> int:
        return self.layer_bands.slots_for_budget(self.stock_tokens, self.page_size)

    def capacity_row(self) -> dict:
        bands = self.layer_bands
        capacity = bands.capacity(self.slots)
        return {
            "preset": self.name,
            "L": self.text_config.num_hidden_layers,
            "cross": bands.cross_count,
            "self": bands.self_count,
            "bands": bands.bands,
            "dtype": self.dtype,
            "page": self.page_size,
            "stock_token_bytes": self.stock_token_bytes,
            "budget_bytes": self.budget_bytes,
            "stock_tokens": self.stock_tokens,
            "slots": self.slots,
            "text_stock": self.stock_tokens,
            "text_ours": capacity["text_tokens"],
            "vision_stock": self.stock_tokens,
            "vision_ours": capacity["vision_tokens"],
            "bound_video": bound(self.text_config, VIDEO_256_DEFAULT),
            "bound_image": bound(self.text_config, IMAGE_QUESTION),
        }

    def request_row(self, request: Request) -> dict:
        stock, ours = self.stock_tokens // request.stock_tokens, self.slots // request.layout_slots(self.layer_bands)
        return {
            "request": request.name,
            "E": request.vision,
            "T": request.text,
            "stock_gb": request.stock_tokens * self.stock_token_bytes / GB,
            "ours_gb": request.layout_slots(self.layer_bands) * self.slot_bytes / GB,
            "stock_requests": stock,
            "ours_requests": ours,
            "gain": ours / stock if stock else float("nan"),
            "bound": bound(self.text_config, request),
        }


def preset_text_config(preset: str) -> MossVLTextConfig:
    text = {key: value for key, value in PRESETS[preset]["text"].items() if key != "mrope_section"}
    return MossVLTextConfig(**text)


def budgets(max_total_tokens: int, instruct_budget_gb: float) -> list[Budget]:
    """tiny and bench at ``max_total_tokens`` fp32 stock tokens (page 1); Instruct at the GB budget, bf16, page 128."""
    rows = []
    for preset in ("tiny", "bench"):
        config = preset_text_config(preset)
        token_bytes = stock_token_bytes(config, "fp32")
        rows.append(Budget(preset, config, "fp32", CPU_PAGE_SIZE, max_total_tokens * token_bytes))
    instruct = MossVLTextConfig()
    rows.append(Budget("MOSS-VL-Instruct", instruct, "bf16", INSTRUCT_PAGE_SIZE, int(instruct_budget_gb * GB)))
    return rows


# --- printing -------------------------------------------------------------------------------------------------


def markdown_table(header: tuple[str, ...], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def capacity_table(rows: list[dict]) -> str:
    header = (
        "preset",
        "L",
        "cross / self",
        "bands",
        "KV dtype, page",
        "bytes / stock token",
        "budget",
        "stock tokens",
        "slots",
        "text tokens stock / ours",
        "vision tokens stock / ours",
        "bound (a)",
        "bound (b)",
    )
    cells = [
        [
            r["preset"],
            str(r["L"]),
            f"{r['cross']} / {r['self']}",
            str(r["bands"]),
            f"{r['dtype']}, {r['page']}",
            f"{r['stock_token_bytes']:,}",
            f"{r['budget_bytes'] / GB:.4g} GB",
            f"{r['stock_tokens']:,}",
            f"{r['slots']:,}",
            f"{r['text_stock']:,} / {r['text_ours']:,}",
            f"{r['vision_stock']:,} / {r['vision_ours']:,}",
            f"{r['bound_video']:.2f}",
            f"{r['bound_image']:.2f}",
        ]
        for r in rows
    ]
    return markdown_table(header, cells)


def requests_table(rows: list[dict]) -> str:
    header = ("request", "E", "T", "GB stock", "GB ours", "requests stock", "requests ours", "gain", "bound")
    cells = [
        [
            r["request"],
            f"{r['E']:,}",
            f"{r['T']:,}",
            f"{r['stock_gb']:.2f}",
            f"{r['ours_gb']:.2f}",
            str(r["stock_requests"]),
            str(r["ours_requests"]),
            f"{r['gain']:.2f}",
            f"{r['bound']:.2f}",
        ]
        for r in rows
    ]
    return markdown_table(header, cells)


def print_capacities(args: argparse.Namespace) -> None:
    rows = budgets(args.max_total_tokens, args.instruct_budget_gb)
    print(
        f"\nKV capacity from configs (no weights): tiny and bench at --max-total-tokens {args.max_total_tokens} "
        f"stock tokens (fp32, page 1, as served on CPU), MOSS-VL-Instruct at {args.instruct_budget_gb:g} GB (bf16, "
        "page 128). "
        f"A slot holds one text token or `bands` vision tokens. Bound (a): {VIDEO_256_DEFAULT.name}, "
        f"E={VIDEO_256_DEFAULT.vision:,} T={VIDEO_256_DEFAULT.text:,}; bound (b): {IMAGE_QUESTION.name}, "
        f"E={IMAGE_QUESTION.vision} T={IMAGE_QUESTION.text:,}."
    )
    print(capacity_table([budget.capacity_row() for budget in rows]))
    instruct = rows[-1]
    print(f"\nMOSS-VL-Instruct: requests that fit in {args.instruct_budget_gb:g} GB of KV")
    print(requests_table([instruct.request_row(request) for request in REFERENCE_REQUESTS]))


# --- served part: workloads -----------------------------------------------------------------------------------


def write_video(path: Path, frames: int, size: int) -> None:
    """``frames`` seconds at 1 fps, ``size`` x ``size`` H.264: the demo picture with a square moving across it."""
    import av
    from PIL import Image, ImageDraw

    base = Image.open(DEMO_IMAGE).convert("RGB").resize((size, size))
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=1)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for index in range(frames):
            frame = base.copy()
            x = (size - size // 8) * index // max(frames - 1, 1)
            ImageDraw.Draw(frame).rectangle((x, size // 2, x + size // 8, size // 2 + size // 8), fill="black")
            container.mux(stream.encode(av.VideoFrame.from_image(frame)))
        container.mux(stream.encode())


def image_question(tokenizer, target_tokens: int) -> str:
    """The shortest ``long_question(i)`` of at least ``target_tokens`` tokens."""
    for i in range(1000):
        question = long_question(i)
        if len(tokenizer(question, add_special_tokens=False)["input_ids"]) >= target_tokens:
            return question
    raise ValueError(f"no long_question reaches {target_tokens} tokens")


def workloads(processor, media_dir: Path, args: argparse.Namespace) -> dict[str, list[dict]]:
    """The chat messages (reference form: media as file paths) of one request of each workload."""
    video, image = media_dir / "clip.mp4", media_dir / "image.png"
    write_video(video, args.video_frames, args.frame_size)
    from PIL import Image

    Image.open(DEMO_IMAGE).convert("RGB").resize((args.image_size, args.image_size)).save(image)
    question = image_question(processor.tokenizer, args.question_tokens)
    return {
        "video": [
            {
                "role": "user",
                "content": [
                    {"type": "video", "video": str(video)},
                    {"type": "text", "text": "What moves in this video?"},
                ],
            }
        ],
        "image": [
            {"role": "user", "content": [{"type": "image", "image": str(image)}, {"type": "text", "text": question}]}
        ],
    }


def request_kv(processor, name: str, messages: list[dict]) -> Request:
    """E (vision tokens: per frame ``h*w / merge**2`` plus a separator) and T (prompt text tokens) of a request."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    images, videos = processor.extract_media(messages)
    inputs = processor(text=text, images=images or None, videos=videos or None)
    merge = processor.image_processor.merge_size
    vision = int(frame_ends_from_grid_thw(inputs["grid_thw"], merge)[-1])
    return Request(name, vision, int(inputs["input_ids"].shape[1]))


# --- served part: one server ----------------------------------------------------------------------------------


def server_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--dtype",
        "float32",
        "--max-total-tokens",
        str(args.max_total_tokens),
        "--max-running-requests",
        str(args.max_running_requests),
        "--disable-radix-cache",
        "--decode-log-interval",
        "1",
        "--prefill-max-requests",
        "1",
        "--skip-server-warmup",
        *args.server_arg,
    ]


def log_text(server: SglangServer, start: int = 0) -> str:
    with open(server.log_path, errors="replace") as log:
        log.seek(start)
        return log.read()


def decode_steps(log: str) -> list[tuple[int, int]]:
    """(#running-req, #queue-req) of every decode step in a scheduler log."""
    return [(int(running), int(queued)) for running, queued in DECODE_LINE.findall(log)]


def chat_body(model_name: str, messages: list[dict], max_tokens: int) -> dict:
    return {
        "model": model_name,
        "messages": to_openai(messages),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def post_chat(base_url: str, body: dict) -> dict:
    try:
        response = requests.post(f"{base_url}/v1/chat/completions", json=body, timeout=900)
    except requests.RequestException as error:
        return {"status": type(error).__name__, "json": str(error)[:300]}
    return {"status": response.status_code, "json": response.json() if response.ok else response.text[:300]}


def check_alive(server: SglangServer) -> None:
    if server.process.poll() is not None:
        raise RuntimeError(f"server exited with code {server.process.returncode}; log tail:\n{server.log_tail()}")


def load(server: SglangServer) -> dict:
    response = requests.get(f"{server.base_url}/v1/loads", timeout=30)
    response.raise_for_status()
    return response.json()["loads"][0]


def wait_idle(server: SglangServer, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = load(server)
        if not report["num_running_reqs"] and not report["num_waiting_reqs"]:
            return
        time.sleep(0.5)
    raise TimeoutError(f"server still busy after {timeout_s:.0f} s: {load(server)}")


def probe_prompt_tokens(server: SglangServer, model_name: str, messages: list[dict]) -> int:
    """Prompt tokens the server charges one request (one generated token; also warms the vision path up)."""
    result = post_chat(server.base_url, chat_body(model_name, messages, 1))
    if result["status"] != 200:
        raise RuntimeError(f"probe request failed: HTTP {result['status']}: {result['json']}")
    return result["json"]["usage"]["prompt_tokens"]


def fill(server: SglangServer, body: dict, count: int, settle_steps: int, timeout_s: float) -> dict:
    """Send ``count`` requests at once; once ``settle_steps`` decode steps ran with a request queued (memory full),
    or every request finished, or ``timeout_s`` passed, abort the rest. Returns the most requests running in a
    decode step, whether memory filled, and the HTTP statuses."""
    start = server.log_path.stat().st_size
    deadline = time.monotonic() + timeout_s
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(post_chat, server.base_url, body) for _ in range(count)]
        while time.monotonic() < deadline and not all(f.done() for f in futures):
            check_alive(server)
            if sum(1 for _, queued in decode_steps(log_text(server, start)) if queued) >= settle_steps:
                break
            time.sleep(0.5)
        # Requests still in the tokenizer when an abort goes out reach the scheduler later: abort until all return.
        while not all(f.done() for f in futures):
            check_alive(server)
            requests.post(f"{server.base_url}/abort_request", json={"abort_all": True}, timeout=30)
            wait(futures, timeout=2)
    wait_idle(server)
    steps = decode_steps(log_text(server, start))
    statuses = [str(f.result()["status"]) for f in futures]
    return {
        "running": max((running for running, _ in steps), default=0),
        "filled": any(queued for _, queued in steps),
        "steps": len(steps),
        "statuses": {status: statuses.count(status) for status in sorted(set(statuses))},
    }


def serve_layout(layout: str, model: Path, args: argparse.Namespace, messages: dict, counts: dict) -> dict:
    """One server with ``MOSSVL_KV_LAYOUT=layout``: its pool size, each workload's prompt tokens and fill."""
    server = SglangServer(model, extra_args=server_flags(args), name=f"bench-kv-layout-{layout}")
    server.env[LAYOUT_ENV] = layout
    measured = {}
    with server:
        startup = log_text(server)
        pool = int(POOL_LINE.findall(startup)[-1])
        stock_tokens = LAYOUT_LINE.findall(startup)
        _, model_name = openai_client(server)
        for workload, chat in messages.items():
            prompt_tokens = probe_prompt_tokens(server, model_name, chat)
            wait_idle(server)
            body = chat_body(model_name, chat, args.max_tokens)
            logger.info("%s layout, %s workload: %d requests at once", layout, workload, counts[workload])
            result = fill(server, body, counts[workload], args.settle_steps, args.timeout)
            logger.info("%s layout, %s workload: %s", layout, workload, result)
            measured[workload] = {**result, "prompt_tokens": prompt_tokens}
    return {
        "pool": pool,
        "layout_line_stock_tokens": int(stock_tokens[-1]) if stock_tokens else None,
        "log": server.log_path,
        "workloads": measured,
    }


# --- served part: the comparison ------------------------------------------------------------------------------


def held(request: Request, max_tokens: int) -> Request:
    """What a request holds at its end: its prompt and ``max_tokens`` generated text tokens."""
    return Request(request.name, request.vision, request.text + max_tokens)


def request_slots(layout: str, request: Request, bands: LayerBands) -> int:
    return request.stock_tokens if layout == STOCK else request.layout_slots(bands)


def served_rows(kv: dict[str, Request], runs: dict[str, dict], bench: Budget, args: argparse.Namespace) -> list[dict]:
    bands = bench.layer_bands
    rows = []
    for workload, request in kv.items():
        at_end = held(request, args.max_tokens)
        stock, ours = runs[STOCK]["workloads"][workload], runs[MOSSVL]["workloads"][workload]
        gain = ours["running"] / stock["running"] if stock["running"] else float("nan")
        predicted = [runs[layout]["pool"] // request_slots(layout, at_end, bands) for layout in (STOCK, MOSSVL)]
        rows.append(
            {
                "workload": workload,
                "E": request.vision,
                "T": request.text,
                "stock_slots": at_end.stock_tokens,
                "ours_slots": at_end.layout_slots(bands),
                "prompt_tokens": f"{stock['prompt_tokens']} / {ours['prompt_tokens']}",
                "prompt_expected": f"{request.stock_tokens} / {request.layout_slots(bands)}",
                "pool": f"{runs[STOCK]['pool']:,} / {runs[MOSSVL]['pool']:,}",
                "predicted": f"{predicted[0]} / {predicted[1]}",
                "stock": stock["running"],
                "ours": ours["running"],
                "filled": f"{'yes' if stock['filled'] else 'NO'} / {'yes' if ours['filled'] else 'NO'}",
                "gain": gain,
                "bound": bound(bench.text_config, at_end),
            }
        )
    return rows


def served_table(rows: list[dict]) -> str:
    header = (
        "workload",
        "E",
        "T (+ out)",
        "slots / request stock / ours",
        "prompt tokens served (expected)",
        "pool slots stock / ours",
        "predicted stock / ours",
        "memory filled",
        "stock running",
        "ours running",
        "gain",
        "bound",
        "gain / bound",
    )
    cells = [
        [
            r["workload"],
            f"{r['E']:,}",
            f"{r['T']:,} (+{r['stock_slots'] - r['E'] - r['T']})",
            f"{r['stock_slots']:,} / {r['ours_slots']:,}",
            f"{r['prompt_tokens']} ({r['prompt_expected']})",
            r["pool"],
            r["predicted"],
            r["filled"],
            str(r["stock"]),
            str(r["ours"]),
            f"{r['gain']:.2f}",
            f"{r['bound']:.2f}",
            f"{r['gain'] / r['bound']:.2f}",
        ]
        for r in rows
    ]
    return markdown_table(header, cells)


def serve_and_compare(args: argparse.Namespace) -> list[dict]:
    from transformers import AutoProcessor

    if args.model is None:
        from moss_vl_reference.tiny_checkpoint import build_or_reuse

        args.model = build_or_reuse("bench")
    model = args.model.resolve()
    processor = AutoProcessor.from_pretrained(model, trust_remote_code=True)
    media_dir = OUT_DIR / "media"  # rewritten every run
    media_dir.mkdir(parents=True, exist_ok=True)
    messages = workloads(processor, media_dir, args)
    kv = {workload: request_kv(processor, workload, chat) for workload, chat in messages.items()}
    bench = next(budget for budget in budgets(args.max_total_tokens, args.instruct_budget_gb) if budget.name == "bench")
    pools = {STOCK: bench.stock_tokens, MOSSVL: bench.slots}
    counts = {
        layout: {
            workload: pool // request_slots(layout, held(request, args.max_tokens), bench.layer_bands)
            + args.extra_requests
            for workload, request in kv.items()
        }
        for layout, pool in pools.items()
    }
    for workload, request in kv.items():
        logger.info("%s: E=%d T=%d, requests sent %s", workload, request.vision, request.text, counts)
    runs = {layout: serve_layout(layout, model, args, messages, counts[layout]) for layout in (STOCK, MOSSVL)}
    rows = served_rows(kv, runs, bench, args)
    print(
        f"\nServed, bench preset ({model}), fp32, CPU, --max-total-tokens {args.max_total_tokens} on both servers; "
        f"identical requests at once (stock / ours: "
        f"{', '.join(f'{w} {counts[STOCK][w]} / {counts[MOSSVL][w]}' for w in kv)}; greedy, EOS ignored, "
        f"{args.max_tokens} tokens each); video: {args.video_frames} frames of {args.frame_size}x{args.frame_size} "
        f"at 1 fps; image: {args.image_size}x{args.image_size} + a {args.question_tokens}-token question. "
        f"Server flags: {' '.join(server_flags(args))}; logs: {runs[STOCK]['log']}, {runs[MOSSVL]['log']}"
    )
    print(served_table(rows))
    for layout, run in runs.items():
        for workload, result in run["workloads"].items():
            print(f"  {layout} {workload}: {result['steps']} decode steps logged, HTTP statuses {result['statuses']}")
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="print the capacity tables from configs only (no server, no RESULT line)"
    )
    parser.add_argument(
        "--model", type=Path, help="bench-preset checkpoint dir (default: build/reuse the bench preset)"
    )
    parser.add_argument(
        "--max-total-tokens",
        type=int,
        default=6900,
        help="the KV budget of both servers in stock tokens (sglang's flag, unchanged meaning: the stock pool's "
        "token count, so its bytes); also the tiny and bench rows of the capacity table",
    )
    parser.add_argument(
        "--max-running-requests", type=int, default=128, help="sglang's cap on running requests, set never to bind"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="generated tokens per request (EOS ignored; counted as text KV)"
    )
    parser.add_argument("--video-frames", type=int, default=4, help="frames (seconds at 1 fps) of the synthetic clip")
    parser.add_argument(
        "--frame-size",
        type=int,
        default=512,
        help="clip frame side in pixels; 512 is the bench processor's per-frame budget (video_max_pixels): 257 "
        "vision tokens a frame",
    )
    parser.add_argument("--image-size", type=int, default=448, help="image side in pixels (448: 197 vision tokens)")
    parser.add_argument(
        "--question-tokens", type=int, default=2000, help="at least this many tokens in the image workload's question"
    )
    parser.add_argument(
        "--extra-requests",
        type=int,
        default=2,
        help="requests sent beyond the layout's predicted capacity, so that memory fills on both servers",
    )
    parser.add_argument(
        "--settle-steps",
        type=int,
        default=3,
        help="decode steps with a request queued (memory full) before the rest are aborted",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per workload and server before aborting")
    parser.add_argument(
        "--instruct-budget-gb", type=float, default=40.0, help="MOSS-VL-Instruct's KV budget in the capacity table"
    )
    parser.add_argument("--server-arg", action="append", default=[], help="extra launch_server flag (repeatable)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    print_capacities(args)
    if args.quick:
        return 0
    rows = serve_and_compare(args)
    print(f"benchmark wall time {time.perf_counter() - started:.0f} s")
    video, image = (next(r for r in rows if r["workload"] == name) for name in ("video", "image"))
    print(
        f"RESULT kv_layout video_gain={video['gain']:.2f} video_bound={video['bound']:.2f} "
        f"image_gain={image['gain']:.2f} image_bound={image['bound']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
