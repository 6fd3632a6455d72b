"""Offline MOSS-VL inference with plain transformers (no sglang) on Ascend NPU, CUDA or CPU.

    python inference/run_inference.py --checkpoint CKPT --input inference/examples/image_queries.json
    python inference/run_inference.py --checkpoint CKPT --mode image --input inference/examples/image_queries.json

``--mode {offline,image,video,batch}`` is upstream's (required there): every mode runs the same
``offline_generate`` path, and the value is recorded as the report's ``mode_alias``.

Reads a JSON list or a JSONL file of queries, runs each through the model's ``offline_generate`` stream
(one query at a time, each with its own deadline), and writes ``<input stem>_results.json`` next to the
input unless ``--output`` says otherwise. A failed query is recorded with its ``error`` and never loses the
other queries' results; the exit code is 1 when any query failed.

Query forms (``prompt`` + ``images``/``videos`` with ``<|image|>``/``<|video|>`` placeholders, or chat
``messages``; optional ``system_prompt``, ``media_kwargs``, ``generate_kwargs``) are documented in
``moss_vl_reference/queries_moss_vl.py``, the one implementation the model's remote code also uses.
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

# Run as a script (`python inference/run_inference.py`), this folder is sys.path[0]; the shared modules live at
# the repository root.
REPO_ROOT = str(Path(__file__).resolve().parents[1])
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from tqdm import tqdm  # noqa: E402

from inference.cli_flags import add_runner_flags  # noqa: E402
from inference.model_loading import load_model  # noqa: E402
from moss_vl_reference.queries_moss_vl import (  # noqa: E402
    ERROR_PREFIX,
    ROUND_END,
    ROUND_START,
    STOP_OFFLINE_GENERATE,
    normalize_query,
    resolve_media_reference,
)
from mossvl_ascend import checkpoint_code  # noqa: E402

logger = logging.getLogger("run_inference")

# Greedy by default so repeated runs of one query file give the same text; a query's own values win.
GENERATE_DEFAULTS = {"max_new_tokens": 256, "do_sample": False}
MODES = ("offline", "image", "video", "batch")
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


def _resolved_reference(value: Any, base_dir: Path) -> Any:
    """A media reference with a local path made absolute: a path or URL string, ``{"url": ...}``, or a video object
    with ``video_path``."""
    if isinstance(value, dict):
        key = "url" if "url" in value else "video_path" if "video_path" in value else None
        return {**value, key: resolve_media_reference(value[key], base_dir)} if key else value
    return resolve_media_reference(value, base_dir)


def _resolved_part(part: Any, base_dir: Path) -> Any:
    if not isinstance(part, dict):
        return part
    for media in ("image", "video"):
        if part.get("type") in (media, f"{media}_url"):
            resolved = {**part, "type": media}  # upstream normalises the type and keeps the key it was given
            for key in (media, f"{media}_url"):
                if key in resolved:
                    resolved[key] = _resolved_reference(resolved[key], base_dir)
            return resolved
    return part


def resolve_query_media_paths(query: Any, base_dir: Path) -> Any:
    """Upstream's interface: a copy of a query as the user wrote it (any accepted form) whose local media paths are
    absolute, relative ones taken from ``base_dir`` (the query file's folder); ``http(s)://`` and ``data:`` references
    are kept. In messages an ``image_url`` / ``video_url`` part becomes an ``image`` / ``video`` part that keeps the
    key it was given; top-level ``images`` and ``videos`` are resolved too."""
    if not isinstance(query, dict):
        return query  # normalisation names the problem
    resolved = dict(query)
    for kind in ("images", "videos"):
        if isinstance(query.get(kind), list):
            resolved[kind] = [_resolved_reference(value, base_dir) for value in query[kind]]
    for key in ("messages", "conversations"):
        if isinstance(query.get(key), list):
            resolved[key] = [
                {**message, "content": [_resolved_part(part, base_dir) for part in message["content"]]}
                if isinstance(message, dict) and isinstance(message.get("content"), list)
                else message
                for message in query[key]
            ]
    return resolved


# -------------------------------------------------------------------------------------- generation


def generate_one(model: Any, processor: Any, query: dict, timeout_seconds: float) -> tuple[str, int]:
    """(text, number of stream events) the model streams for one canonical query through ``offline_generate``.

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
                return "".join(chunks), len(chunks)
            if isinstance(item, str) and item.startswith(ERROR_PREFIX):
                raise ModelReportedError(item[len(ERROR_PREFIX) :])
            chunks.append(item)
    finally:
        in_queue.put(STOP_OFFLINE_GENERATE)
        # A worker that overran is still generating; waiting for it would only delay the next query.
        worker.join(timeout=0.0 if overran else WORKER_JOIN_SECONDS)
        if worker.is_alive():
            logger.warning("offline_generate worker still running after its query ended; abandoning it")


def query_summary(query: dict) -> dict:
    """Upstream's per-result fields: ``prompt`` (the text of the last user turn), ``images`` and ``videos`` (the
    media of every turn, in order)."""
    media: dict[str, list] = {"image": [], "video": []}
    prompt = ""
    for message in query["messages"]:
        content = message["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        for part in parts:
            if part["type"] in media:
                media[part["type"]].append(part[part["type"]])
        if message["role"] == "user":
            prompt = "".join(part["text"] for part in parts if part["type"] == "text")
    return {"prompt": prompt, "images": media["image"], "videos": media["video"]}


def run_queries(model: Any, processor: Any, raw_queries: list, base_dir: Path, timeout_seconds: float) -> list[dict]:
    """One result per raw query, in order: the canonical query plus ``text`` or ``error``."""
    results = []
    for index, raw in enumerate(tqdm(raw_queries, desc="queries", unit="query")):
        started = time.perf_counter()
        result: dict[str, Any] = {"index": index}
        try:
            query = normalize_query(resolve_query_media_paths(raw, base_dir), GENERATE_DEFAULTS)
            result.update(query)
            result.update(query_summary(query))
            result["text"], result["event_count"] = generate_one(model, processor, query, timeout_seconds)
        except Exception as error:  # one bad query must not lose the others
            logger.error("query %d failed: %s: %s", index, type(error).__name__, error)
            if "messages" not in result:  # normalisation failed: keep the query as the user wrote it
                result["query"] = raw
            result["error"] = (
                str(error) if isinstance(error, ModelReportedError) else f"{type(error).__name__}: {error}"
            )
        result["elapsed_seconds"] = round(time.perf_counter() - started, 3)
        results.append(result)
    return results


# --------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Run MOSS-VL queries from a JSON/JSONL file with plain transformers (NPU, CUDA or CPU).",
    )
    parser.add_argument(
        "--checkpoint", required=True, type=Path, help="local MOSS-VL checkpoint directory (remote code inside)"
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="offline",
        help="upstream's mode (a legacy alias there: every mode runs offline_generate, here too); recorded as "
        "mode_alias in the report (default offline)",
    )
    parser.add_argument(
        "--input", required=True, type=Path, help="queries: a JSON list or a .jsonl file, one query per line"
    )
    parser.add_argument(
        "--output", type=Path, default=None, help="results JSON (default: <input stem>_results.json next to the input)"
    )
    add_runner_flags(parser)
    parser.add_argument(
        "--cross-attention-implementation",
        default=None,
        help="forwarded to from_pretrained only when given: eager or sdpa for the reference model; e.g. "
        "flash_attention_3 for a checkpoint whose remote code ships an FA3 cross-attention kernel",
    )
    parser.add_argument(
        "--timeout-seconds", type=float, default=300.0, help="deadline of each query in seconds (default 300)"
    )
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
    try:
        model, processor, metadata = load_model(
            args.checkpoint,
            args.device,
            args.dtype,
            args.attention_backend,
            args.cross_attention_implementation,
            args.remote_code,
        )
    except (checkpoint_code.CheckpointCodeUnloadable, ValueError) as error:  # a clear message, not a traceback
        logger.error("%s", error)
        return 2
    load_seconds = time.perf_counter() - started
    results = run_queries(model, processor, raw_queries, input_path.parent, args.timeout_seconds)
    failed = sum("error" in r for r in results)
    report = {
        "mode": "offline_generate",
        "mode_alias": args.mode,
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
