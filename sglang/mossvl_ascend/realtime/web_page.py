"""``GET /v1/video/realtime/ui``: a browser page for the realtime socket (camera, screen or a video file in, the
answers as they stream out), served from the static files in ``web/`` beside this module: no build step, no
external URL.

The page's three paths (:data:`PAGE_FILES`) hold no secret, so they stay public under ``--api-key`` (see
:func:`is_public_page_request`); the key is typed into the page and offered at the socket's handshake. Every answer
carries the headers of :func:`security_headers`: a Content-Security-Policy that lets the page load only its own
script and style and connect only to this server's own origin (HTTP and ``ws``/``wss``).
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..env_switch import env_switch
from .websocket import VIDEO_REALTIME_PATH

# On by default (llama.cpp's built-in UI is too); 0 turns the page off (its paths answer 404).
UI_ENV = "MOSSVL_REALTIME_UI"
PAGE_PATH = f"{VIDEO_REALTIME_PATH}/ui"
# path -> (file in web/, media type)
PAGE_FILES = {
    PAGE_PATH: ("index.html", "text/html; charset=utf-8"),
    f"{PAGE_PATH}/app.js": ("app.js", "text/javascript; charset=utf-8"),
    f"{PAGE_PATH}/app.css": ("app.css", "text/css; charset=utf-8"),
}
# A Host header as a browser sends it: a DNS name or IPv4 address, or a bracketed IPv6 address, and a port.
_HOST = re.compile(r"^(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$")


def page_enabled() -> bool:
    return env_switch(UI_ENV, default=True)


def is_public_page_request(method: str, path: str) -> bool:
    """A GET (or HEAD) of one of the page's fixed paths: no key needed, nothing secret in them."""
    return method in ("GET", "HEAD") and path in PAGE_FILES


def security_headers(host: Optional[str]) -> dict[str, str]:
    """The page's headers; ``host`` (the request's Host) names the socket origin in ``connect-src``: ``'self'``
    alone does not cover ``ws:``/``wss:`` in every browser. A Host that is not a plain host[:port] is left out."""
    sockets = f" ws://{host} wss://{host}" if host and _HOST.match(host) else ""
    policy = "; ".join(
        (
            "default-src 'none'",
            "script-src 'self'",
            "style-src 'self'",
            "img-src 'self' blob: data:",
            "media-src 'self' blob: mediastream:",
            f"connect-src 'self'{sockets}",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        )
    )
    return {
        "Content-Security-Policy": policy,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Permissions-Policy": "camera=(self), display-capture=(self), microphone=()",
        "Cache-Control": "no-cache",
    }


def page_file(name: str) -> bytes:
    return resources.files(__package__).joinpath("web", name).read_bytes()


def mount_page(app: FastAPI) -> None:
    """Add the page's routes to ``app`` (the files are read once, here: a missing file fails at start-up)."""
    bodies = {path: (page_file(name), media_type) for path, (name, media_type) in PAGE_FILES.items()}

    async def page(request: Request) -> Response:
        body, media_type = bodies[request.url.path]
        return Response(body, media_type=media_type, headers=security_headers(request.headers.get("host")))

    for path in bodies:
        app.add_api_route(path, page, methods=["GET", "HEAD"], include_in_schema=False)
