"""Offline MOSS-VL inference with plain transformers (no sglang) on Ascend NPU, CUDA or CPU.

    python inference/run_inference.py --checkpoint CKPT --input inference/examples/image_queries.json

Reads a JSON list or a JSONL file of queries, runs each through the model's ``offline_generate`` stream
(one query at a time, each with its own deadline), and writes ``<input stem>_results.json`` next to the
input unless ``--output`` says otherwise. A failed query is recorded with its ``error`` and never loses the
other queries' results; the exit code is 1 when any query failed.

Query forms (one JSON object per query):
- ``{"prompt": "Describe <|image|>.", "images": ["a.png"], "videos": [...], "system_prompt": ...}``;
  without placeholders the media come first (images, then videos), then the prompt text;
- ``{"messages": [{"role": "user", "content": [{"type": "text", "text": ...}, {"type": "image", "image": ...},
  {"type": "image_url", "image_url": {"url": ...}}, {"type": "video", "video": ...}]}, ...]}`` where text may
  hold ``<|image|>``/``<|video|>`` placeholders that take the top-level ``images``/``videos`` in order;
- both take optional ``media_kwargs`` (e.g. ``video_fps``, ``max_frames``) and ``generate_kwargs``.
Relative media paths resolve against the query file's folder; ``http(s)://`` and ``data:`` URLs are kept.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoModelForCausalLM, AutoProcessor  # noqa: E402

import device_utils  # noqa: E402  -- looked up as a module attribute at call time so tests can simulate devices

logger = logging.getLogger("run_inference")

IMAGE_PLACEHOLDER = "<|image|>"
VIDEO_PLACEHOLDER = "<|video|>"
ROUND_START = "<|round_start|>"
ROUND_END = "<|round_end|>"
ERROR_PREFIX = "[ERROR] "
STOP_OFFLINE_GENERATE = {"stop_offline_generate": True}
REMOTE_PREFIXES = ("http://", "https://", "data:")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Greedy by default so repeated runs of one query file give the same text; a query's own values win.
GENERATE_DEFAULTS = {"max_new_tokens": 256, "do_sample": False}
WORKER_JOIN_SECONDS = 30.0


class ModelReportedError(RuntimeError):
    """A query the model itself rejected (``"[ERROR] ..."`` on the stream); the message already names the cause."""


# ----------------------------------------------------------------------------------------- queries


def load_queries(path: Path) -> list[Any]:
    """The raw queries of a ``.jsonl`` file (one object per non-blank line) or a JSON list."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a .json query file must hold a list of queries, got {type(data).__name__}")
    return data


def _media_part(kind: str, value: Any) -> dict:
    return {"type": kind, kind: value}


def _split_placeholders(text: str, images: list, videos: list) -> list[dict]:
    """Content parts of ``text`` with each placeholder replaced by the next top-level image/video (consumed)."""
    parts: list[dict] = []
    rest = text
    while rest:
        positions = [(rest.find(p), p) for p in (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER) if p in rest]
        if not positions:
            parts.append({"type": "text", "text": rest})
            break
        index, placeholder = min(positions)
        if index:
            parts.append({"type": "text", "text": rest[:index]})
        pool, kind = (images, "image") if placeholder == IMAGE_PLACEHOLDER else (videos, "video")
        if not pool:
            raise ValueError(f"more {placeholder} placeholders than top-level {kind}s")
        parts.append(_media_part(kind, pool.pop(0)))
        rest = rest[index + len(placeholder) :]
    return parts


def _normalise_part(part: Any) -> dict:
    """One content part in the canonical form: text / image / video (``image_url`` becomes ``image``)."""
    if isinstance(part, str):
        return {"type": "text", "text": part}
    kind = part.get("type")
    if kind == "text":
        return {"type": "text", "text": part["text"]}
    if kind in ("image", "image_url"):
        value = part.get("image", part.get("image_url"))
        return _media_part("image", value["url"] if isinstance(value, dict) and "url" in value else value)
    if kind in ("video", "video_url"):
        value = part.get("video", part.get("video_url"))
        return _media_part("video", value["url"] if isinstance(value, dict) and "url" in value else value)
    raise ValueError(f"unsupported content part type {kind!r}")


def _normalise_messages(messages: list, images: list, videos: list) -> list[dict]:
    normalised = []
    for message in messages:
        role = message.get("role")
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"message role must be system, user or assistant, got {role!r}")
        content = message.get("content", "")
        raw_parts = [content] if isinstance(content, str) else list(content)
        parts: list[dict] = []
        for part in map(_normalise_part, raw_parts):
            parts.extend(_split_placeholders(part["text"], images, videos) if part["type"] == "text" else [part])
        normalised.append({"role": role, "content": parts})
    while normalised and normalised[-1]["role"] == "assistant":  # the model writes the next assistant turn
        normalised.pop()
    if not normalised or normalised[-1]["role"] != "user":
        raise ValueError("a query needs at least one user message")
    return normalised


def normalize_query(raw: Any) -> dict:
    """The canonical query: ``messages`` with media inline, plus ``media_kwargs`` and ``generate_kwargs``.

    Raises ValueError naming the problem for a malformed query (no text, unconsumed media, ...)."""
    if not isinstance(raw, dict):
        raise ValueError(f"a query must be a JSON object, got {type(raw).__name__}")
    images, videos = list(raw.get("images") or []), list(raw.get("videos") or [])
    if "messages" in raw:
        messages = _normalise_messages(raw["messages"], images, videos)
    elif "prompt" in raw:
        prompt = raw["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("'prompt' must be a non-empty string")
        if IMAGE_PLACEHOLDER in prompt or VIDEO_PLACEHOLDER in prompt:
            parts = _split_placeholders(prompt, images, videos)
        else:
            parts = [_media_part("image", i) for i in images] + [_media_part("video", v) for v in videos]
            parts.append({"type": "text", "text": prompt})
            images, videos = [], []
        messages = [{"role": "user", "content": parts}]
    else:
        raise ValueError("a query needs 'messages' or 'prompt'")
    if images or videos:
        raise ValueError(f"{len(images)} image(s) and {len(videos)} video(s) have no {IMAGE_PLACEHOLDER}/{VIDEO_PLACEHOLDER} placeholder")
    if raw.get("system_prompt"):
        if messages[0]["role"] == "system":
            raise ValueError("give the system prompt either as 'system_prompt' or as a system message, not both")
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": raw["system_prompt"]}]})
    return {
        "messages": messages,
        "media_kwargs": dict(raw.get("media_kwargs") or {}),
        "generate_kwargs": {**GENERATE_DEFAULTS, **(raw.get("generate_kwargs") or {})},
    }


def _resolve_path(value: Any, base_dir: Path) -> Any:
    if not isinstance(value, str) or value.startswith(REMOTE_PREFIXES):
        return value
    local = value[len("file://") :] if value.startswith("file://") else value
    path = Path(local).expanduser()
    return str(path if path.is_absolute() else (base_dir / path).resolve())


def resolve_query_media_paths(query: dict, base_dir: Path) -> dict:
    """A copy of a canonical query whose local media paths are absolute (relative ones taken from ``base_dir``)."""
    messages = []
    for message in query["messages"]:
        parts = []
        for part in message["content"]:
            if part["type"] == "image":
                part = {"type": "image", "image": _resolve_path(part["image"], base_dir)}
            elif part["type"] == "video":
                video = part["video"]
                if isinstance(video, dict):
                    if "video_path" not in video:
                        raise ValueError("a video given as an object needs 'video_path'")
                    video = {**video, "video_path": _resolve_path(video["video_path"], base_dir)}
                else:
                    video = _resolve_path(video, base_dir)
                part = {"type": "video", "video": video}
            parts.append(part)
        messages.append({"role": message["role"], "content": parts})
    return {**query, "messages": messages}


# ------------------------------------------------------------------------------------------ device


def choose_device(requested: str) -> tuple[str, str]:
    """(device type, torch device string) for ``auto``, ``cpu``, ``npu``, ``cuda`` or ``npu:1``-style names.

    An accelerator this machine lacks is an error, not a silent fallback to CPU."""
    detected = device_utils.get_device_type()
    if requested == "auto":
        logger.info("device auto: using %s (%s)", detected, device_utils.describe())
        return detected, device_utils.get_device_str(0)
    device_type, _, index = requested.partition(":")
    if device_type not in ("cpu", detected) or (index and not index.isdigit()) or (device_type == "cpu" and index):
        raise SystemExit(f"device {requested!r} requested, but this machine offers {detected} ({device_utils.describe()})")
    logger.info("device %s requested", requested)
    return device_type, "cpu" if device_type == "cpu" else device_utils.get_device_str(int(index or 0))


def choose_attention(requested: str, device: str) -> tuple[str, str]:
    """(attn_implementation, why) for ``--attention-backend`` on ``device``."""
    detected = device_utils.get_device_type()
    if device == "cpu" and detected != "cpu":
        # CPU forced on an accelerator host: device_utils answers for the accelerator, so decide here.
        cpu_default = device_utils.DEFAULT_ATTN_IMPLEMENTATION["cpu"]
        if requested == "auto" or requested in device_utils.CUDA_ONLY_ATTN_IMPLEMENTATIONS:
            return cpu_default, f"--attention-backend {requested} on a forced CPU run -> CPU default {cpu_default}"
        return requested, f"--attention-backend {requested} given explicitly"
    implementation = device_utils.resolve_attn_impl(requested)
    if requested == "auto":
        why = f"--attention-backend auto -> the {device} default"
    elif implementation != requested:
        why = f"--attention-backend {requested} is unavailable on {device} -> the {device} default"
    else:
        why = f"--attention-backend {requested} given explicitly"
    return implementation, why


def choose_dtype(requested: str | None, device: str) -> str:
    """bfloat16 on accelerators and float32 on CPU unless ``--dtype`` says otherwise."""
    return requested or ("float32" if device == "cpu" else "bfloat16")


def load_model(
    checkpoint: Path | str,
    device: str = "auto",
    dtype: str | None = None,
    attention_backend: str = "auto",
    cross_attention_implementation: str | None = None,
) -> tuple[Any, Any, dict]:
    """(model in eval mode, processor, run metadata). Shared with the realtime runner."""
    device_type, target = choose_device(device)
    attn_implementation, why = choose_attention(attention_backend, device_type)
    dtype = choose_dtype(dtype, device_type)
    logger.info("attention implementation: %s (%s)", attn_implementation, why)
    # Loaded on the host and moved with .to(): a device_map would need `accelerate`, which one device does not.
    model_kwargs = {"trust_remote_code": True, "dtype": DTYPES[dtype], "attn_implementation": attn_implementation}
    if cross_attention_implementation is not None:
        model_kwargs["cross_attention_implementation"] = cross_attention_implementation
    logger.info("loading %s on %s as %s", checkpoint, target, dtype)
    processor = AutoProcessor.from_pretrained(checkpoint, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, **model_kwargs).to(target).eval()
    metadata = {
        "checkpoint": str(checkpoint),
        "device": target,
        "device_description": device_utils.describe(),
        "dtype": dtype,
        "attention_implementation": attn_implementation,
        "attention_implementation_reason": why,
        "cross_attention_implementation": cross_attention_implementation,
    }
    return model, processor, metadata


# -------------------------------------------------------------------------------------- generation


def generate_one(model: Any, processor: Any, query: dict, timeout_seconds: float) -> str:
    """The text the model streams for one canonical query through ``offline_generate``.

    Runs the model in a worker thread with its own queues so that a query which overruns its deadline can be
    abandoned (TimeoutError) without its late output reaching the next query."""
    in_queue: queue.Queue = queue.Queue()
    out_queue: queue.Queue = queue.Queue()
    worker = threading.Thread(
        target=model.offline_generate, args=(processor, in_queue, out_queue), name="offline_generate", daemon=True
    )
    worker.start()
    in_queue.put(query)
    deadline = time.monotonic() + timeout_seconds
    chunks: list[str] = []
    overran = False
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                overran = True
                raise TimeoutError(f"no answer within {timeout_seconds:g} s")
            try:
                item = out_queue.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if not worker.is_alive():
                    raise RuntimeError("offline_generate stopped without finishing the round") from None
                continue
            if item == ROUND_START:
                continue
            if item == ROUND_END:
                return "".join(chunks)
            if isinstance(item, str) and item.startswith(ERROR_PREFIX):
                raise ModelReportedError(item[len(ERROR_PREFIX) :])
            chunks.append(item)
    finally:
        in_queue.put(STOP_OFFLINE_GENERATE)
        # A worker that overran is still generating; waiting for it would only delay the next query.
        worker.join(timeout=0.0 if overran else WORKER_JOIN_SECONDS)
        if worker.is_alive():
            logger.warning("offline_generate worker still running after its query ended; abandoning it")


def run_queries(model: Any, processor: Any, raw_queries: list, base_dir: Path, timeout_seconds: float) -> list[dict]:
    """One result per raw query, in order: the canonical query plus ``text`` or ``error``."""
    results = []
    for index, raw in enumerate(tqdm(raw_queries, desc="queries", unit="query")):
        started = time.perf_counter()
        result: dict[str, Any] = {"index": index}
        try:
            query = resolve_query_media_paths(normalize_query(raw), base_dir)
            result.update(query)
            result["text"] = generate_one(model, processor, query, timeout_seconds)
        except Exception as error:  # one bad query must not lose the others
            logger.error("query %d failed: %s: %s", index, type(error).__name__, error)
            if "messages" not in result:  # normalisation failed: keep the query as the user wrote it
                result["query"] = raw
            result["error"] = str(error) if isinstance(error, ModelReportedError) else f"{type(error).__name__}: {error}"
        result["elapsed_seconds"] = round(time.perf_counter() - started, 3)
        results.append(result)
    return results


# --------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Run MOSS-VL queries from a JSON/JSONL file with plain transformers (NPU, CUDA or CPU).",
    )
    parser.add_argument("--checkpoint", required=True, type=Path, help="local MOSS-VL checkpoint directory (remote code inside)")
    parser.add_argument("--input", required=True, type=Path, help="queries: a JSON list or a .jsonl file, one query per line")
    parser.add_argument("--output", type=Path, default=None, help="results JSON (default: <input stem>_results.json next to the input)")
    parser.add_argument(
        "--device", choices=("auto", "npu", "cuda", "cpu"), default="auto",
        help="default auto: NPU if present, else CUDA, else CPU; naming an accelerator this machine lacks is an error",
    )
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), default=None,
        help="weights/activations dtype (default: bfloat16 on NPU/CUDA, float32 on CPU)",
    )
    parser.add_argument(
        "--attention-backend", choices=("auto",) + device_utils.ATTN_IMPLEMENTATIONS, default="auto",
        help="transformers attn_implementation (default auto: eager on NPU, flash_attention_2 on CUDA, sdpa on CPU; "
        "FlashAttention without CUDA falls back to the device default)",
    )
    parser.add_argument(
        "--cross-attention-implementation", default=None,
        help="forwarded to from_pretrained only when given (e.g. flash_attention_3 for a checkpoint's FA3 kernel)",
    )
    parser.add_argument("--timeout-seconds", type=float, default=300.0, help="deadline of each query in seconds (default 300)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="logging level (default INFO)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.timeout_seconds <= 0:
        raise SystemExit("--timeout-seconds must be positive")
    input_path = args.input.resolve()
    output_path = args.output or input_path.with_name(f"{input_path.stem}_results.json")
    raw_queries = load_queries(input_path)
    started = time.perf_counter()
    model, processor, metadata = load_model(
        args.checkpoint, args.device, args.dtype, args.attention_backend, args.cross_attention_implementation
    )
    load_seconds = time.perf_counter() - started
    results = run_queries(model, processor, raw_queries, input_path.parent, args.timeout_seconds)
    failed = sum("error" in r for r in results)
    report = {
        "mode": "offline_generate",
        **metadata,
        "input": str(input_path),
        "num_queries": len(results),
        "num_failed": failed,
        "load_seconds": round(load_seconds, 3),
        "elapsed_seconds": round(time.perf_counter() - started, 3),
        "results": results,
    }
    output_path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    logger.info("wrote %d results (%d failed) to %s", len(results), failed, output_path)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
