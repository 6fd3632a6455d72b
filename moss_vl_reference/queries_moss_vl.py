"""Runner queries and the stream protocol of MOSS-VL's generation APIs (torch-free).

One implementation shared by the model's remote-code generation APIs (`generation_moss_vl.py`), the
standalone runners (`inference/`, `realtime_inference/`) and the serving demo and tests; it imports only the
standard library, so the runners' argument parsing, dry runs and query checks never load torch.

Query forms (one JSON object per query):
- ``{"prompt": "Describe <|image|>.", "images": ["a.png"], "videos": [...], "system_prompt": ...}``; without
  placeholders the media come first (images, then videos), then the prompt text;
- ``{"messages": [{"role": "user", "content": [{"type": "text", "text": ...}, {"type": "image", "image": ...},
  {"type": "image_url", "image_url": {"url": ...}}, {"type": "video", "video": ...}]}, ...]}`` (``conversations``
  is an alias) where text may hold ``<|image|>``/``<|video|>`` placeholders that take the top-level
  ``images``/``videos`` in order;
- both take optional ``media_kwargs`` (e.g. ``video_fps``, ``max_frames``) and ``generate_kwargs``.

Stream protocol of ``offline_generate``: per query ``<|round_start|>``, text pieces, ``<|round_end|>``; a failed
query puts ``"[ERROR] <message>"`` before ``<|round_end|>``; ``{"stop_offline_generate": True}`` ends the loop
(``{"stop_online_generate": True}`` ends ``online_generate``). A realtime stream reports its failure, or a bad
queued message, as an ``"[ERROR] ..."`` output piece.
"""

from __future__ import annotations

import base64
import mimetypes
from pathlib import Path
from typing import Any

IMAGE_PLACEHOLDER = "<|image|>"
VIDEO_PLACEHOLDER = "<|video|>"
ROUND_START = "<|round_start|>"
ROUND_END = "<|round_end|>"
# MOSS-VL-Realtime's token for "nothing to say": a turn that emits it ends and the stream waits for input.
SILENCE = "<|silence|>"
ERROR_PREFIX = "[ERROR] "
STOP_OFFLINE_GENERATE = {"stop_offline_generate": True}
STOP_ONLINE_GENERATE = {"stop_online_generate": True}
# Media references kept as written: the processor fetches or decodes them itself.
REMOTE_PREFIXES = ("http://", "https://", "data:")
ROLES = ("system", "user", "assistant")


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


def _media_value(part: dict, kind: str) -> Any:
    """The medium of an ``image``/``image_url`` (``video``/``video_url``) part; ``{"url": ...}`` unwrapped."""
    value = part.get(kind, part.get(f"{kind}_url"))
    return value["url"] if isinstance(value, dict) and "url" in value else value


def _normalise_part(part: Any) -> dict:
    """One content part in the canonical form: text / image / video (``image_url`` becomes ``image``)."""
    if isinstance(part, str):
        return {"type": "text", "text": part}
    kind = part.get("type")
    if kind == "text":
        return {"type": "text", "text": part["text"]}
    for media in ("image", "video"):
        if kind in (media, f"{media}_url"):
            return _media_part(media, _media_value(part, media))
    raise ValueError(f"unsupported content part type {kind!r}")


def _normalise_messages(messages: list, images: list, videos: list) -> list[dict]:
    normalised = []
    for message in messages:
        role = message.get("role")
        if role not in ROLES:
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


def _prompt_parts(prompt: Any, images: list, videos: list) -> list[dict]:
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("'prompt' must be a non-empty string")
    if IMAGE_PLACEHOLDER in prompt or VIDEO_PLACEHOLDER in prompt:
        return _split_placeholders(prompt, images, videos)
    parts = [_media_part("image", i) for i in images] + [_media_part("video", v) for v in videos]
    images.clear()
    videos.clear()
    return parts + [{"type": "text", "text": prompt}]


def query_messages(raw: Any) -> list[dict]:
    """The canonical chat messages of a query: roles system/user/assistant, content a list of text/image/video
    parts with every medium inline, ending with a user turn.

    Raises ValueError naming the problem for a malformed query (no text, unconsumed media, ...)."""
    if not isinstance(raw, dict):
        raise ValueError(f"a query must be a JSON object, got {type(raw).__name__}")
    images, videos = list(raw.get("images") or []), list(raw.get("videos") or [])
    if "messages" in raw or "conversations" in raw:
        messages = _normalise_messages(raw.get("messages") or raw["conversations"], images, videos)
    elif "prompt" in raw:
        messages = [{"role": "user", "content": _prompt_parts(raw["prompt"], images, videos)}]
    else:
        raise ValueError("a query needs 'messages' or 'prompt'")
    if images or videos:
        raise ValueError(
            f"{len(images)} image(s) and {len(videos)} video(s) have no {IMAGE_PLACEHOLDER}/{VIDEO_PLACEHOLDER} "
            "placeholder"
        )
    if raw.get("system_prompt"):
        if messages[0]["role"] == "system":
            raise ValueError("give the system prompt either as 'system_prompt' or as a system message, not both")
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": raw["system_prompt"]}]})
    return messages


def normalize_query(raw: Any, generate_defaults: dict | None = None) -> dict:
    """The canonical query: ``messages`` (see :func:`query_messages`), ``media_kwargs`` and ``generate_kwargs``
    (the query's own values over ``generate_defaults``)."""
    messages = query_messages(raw)
    return {
        "messages": messages,
        "media_kwargs": dict(raw.get("media_kwargs") or {}),
        "generate_kwargs": {**(generate_defaults or {}), **(raw.get("generate_kwargs") or {})},
    }


def is_stop_message(message: Any, stop: dict) -> bool:
    """True for the queue message ``stop`` (e.g. STOP_OFFLINE_GENERATE) that ends a generation loop."""
    return isinstance(message, dict) and all(message.get(key) == value for key, value in stop.items())


def resolve_media_reference(value: Any, base_dir: Path) -> Any:
    """One media reference with a local path made absolute: a relative path is taken from ``base_dir`` and
    ``file://`` is stripped; ``http(s)://`` and ``data:`` URLs and non-string values are returned as given."""
    if not isinstance(value, str) or value.startswith(REMOTE_PREFIXES):
        return value
    local = value.removeprefix("file://")
    path = Path(local).expanduser()
    return str(path if path.is_absolute() else (base_dir / path).resolve())


def _resolve_part(part: dict, base_dir: Path) -> dict:
    if part["type"] == "image":
        return {"type": "image", "image": resolve_media_reference(part["image"], base_dir)}
    if part["type"] != "video":
        return part
    video = part["video"]
    if not isinstance(video, dict):
        return {"type": "video", "video": resolve_media_reference(video, base_dir)}
    if "video_path" not in video:
        raise ValueError("a video given as an object needs 'video_path'")
    return {"type": "video", "video": {**video, "video_path": resolve_media_reference(video["video_path"], base_dir)}}


def resolve_query_media_paths(query: dict, base_dir: Path) -> dict:
    """A copy of a canonical query whose local media paths are absolute (relative ones taken from ``base_dir``);
    ``http(s)://`` and ``data:`` references are kept, ``file://`` is stripped."""
    messages = [
        {"role": message["role"], "content": [_resolve_part(part, base_dir) for part in message["content"]]}
        for message in query["messages"]
    ]
    return {**query, "messages": messages}


def data_url(data: bytes, mime: str) -> str:
    """``data:<mime>;base64,...`` of raw bytes (an image or video inlined into an OpenAI chat request)."""
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def file_data_url(path: str | Path) -> str:
    """The data URL of a media file, its MIME type guessed from the file name."""
    mime = mimetypes.guess_type(str(path))[0] or "application/octet-stream"
    return data_url(Path(path).read_bytes(), mime)
