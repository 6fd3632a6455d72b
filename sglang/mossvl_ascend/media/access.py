"""Which media a client may make the server read: local files only under directories the operator names, URLs only
through stock sglang's guarded download.

Local files. ``MOSSVL_ALLOWED_LOCAL_MEDIA_PATH`` lists the directories (separated by ``os.pathsep``, like ``PATH``)
whose files a request may name, as ``file://`` URLs or bare paths, for images and videos alike. Unset or empty: no
local file at all (vLLM's default: ``--allowed-local-media-path`` is empty unless the operator sets it). A path is
resolved (``..`` and every symlink) before it is compared, so neither can lead out of an allowed directory. A file
that is outside, missing, a directory or unreadable gets one message, so an answer never tells which.

URLs. Stock's ``download_remote_media`` already holds the operator's URL policy: ``--allowed-media-domains`` (exact
host names, redirect destinations checked too), ``--media-url-max-file-size-mb`` (default 64), at most 5 redirects,
and a deadline; the deadline here is stock's ``REQUEST_TIMEOUT`` (seconds) or 10. Every failure (refused domain,
unreachable, timeout, too large, an HTTP error) gets one message; the reason goes to the server log only, so a client
cannot map the server's network through error texts.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Optional
from urllib.parse import unquote, urlparse

logger = logging.getLogger(__name__)

ALLOWED_LOCAL_MEDIA_ENV = "MOSSVL_ALLOWED_LOCAL_MEDIA_PATH"
URL_TIMEOUT_ENV = "REQUEST_TIMEOUT"
DEFAULT_URL_TIMEOUT_S = 10.0
# Raw base64 (no data: prefix) is also a media reference; JPEG's starts with "/9j/", so a leading "/" alone does
# not make a path.
BASE64_TEXT = re.compile(r"[A-Za-z0-9+/]+={0,2}")


class MediaNotAvailable(ValueError):
    """A media reference the server will not read (a ``ValueError``: stock answers it with HTTP 400)."""


@dataclass(frozen=True)
class MediaReference:
    """What a client's media string names: ``kind`` is ``local`` (``path``), ``url``, or ``inline`` (data URL or
    base64, read by stock)."""

    kind: str
    text: str
    path: Optional[str] = None


def classify(reference: str) -> MediaReference:
    head = reference[:8].lower()
    if head.startswith(("http://", "https://")):
        return MediaReference("url", reference)
    if head.startswith("file:"):
        # the URL's path alone, as stock reads it (file://host/x is /x on this machine)
        return MediaReference("local", reference, unquote(urlparse(reference).path))
    if head.startswith("data:"):
        return MediaReference("inline", reference)
    compact = "".join(reference.split())
    if os.path.lexists(reference) or len(compact) % 4 or not BASE64_TEXT.fullmatch(compact):
        return MediaReference("local", reference, reference)
    return MediaReference("inline", reference)


def allowed_directories() -> tuple[str, ...]:
    """The operator's directories, resolved (a directory that does not exist allows nothing)."""
    listed = os.environ.get(ALLOWED_LOCAL_MEDIA_ENV, "")
    return tuple(os.path.realpath(entry) for entry in listed.split(os.pathsep) if entry.strip())


def not_available(reference: str) -> MediaNotAvailable:
    shown = reference if len(reference) <= 200 else reference[:200] + "..."
    return MediaNotAvailable(f"media {shown!r} is not allowed or not found")


def admit_local(reference: MediaReference) -> str:
    """The resolved path of a local file the client may read, else ``MediaNotAvailable``."""
    resolved = os.path.realpath(reference.path)
    inside = any(os.path.commonpath([resolved, root]) == root for root in allowed_directories())
    if not (inside and os.path.isfile(resolved) and os.access(resolved, os.R_OK)):
        logger.info(
            "media refused: %r (resolved %s, inside an allowed directory: %s)", reference.text, resolved, inside
        )
        raise not_available(reference.text)
    return resolved


def url_timeout_s() -> float:
    return float(os.environ.get(URL_TIMEOUT_ENV) or DEFAULT_URL_TIMEOUT_S)


def fetch_url(reference: MediaReference) -> bytes:
    """The body of a media URL under stock's URL policy, else ``MediaNotAvailable`` (reason logged)."""
    import requests
    from sglang.srt.utils.common import download_remote_media

    try:
        return download_remote_media(reference.text, timeout=url_timeout_s())
    except (ValueError, requests.exceptions.RequestException, OSError) as error:
        logger.info("media URL refused: %r: %s", reference.text, error)
        raise not_available(reference.text) from None
