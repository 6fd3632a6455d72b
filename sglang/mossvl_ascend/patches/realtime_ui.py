"""The realtime page (``GET /v1/video/realtime/ui``) on the sglang server, public under ``--api-key``.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch
from mossvl_ascend.realtime.web_page import PAGE_PATH, UI_ENV, is_public_page_request, mount_page, page_enabled

logger = logging.getLogger(__name__)


def mount_realtime_page(*args: Any, **kwargs: Any) -> None:
    """BEFORE hook on ``http_server.launch_server``: the page's routes unless ``MOSSVL_REALTIME_UI`` is 0. The
    socket the page talks to is mounted by ``realtime_api`` on the same platforms, by a hook that runs after this
    one (hooks on one target nest: the one registered last runs first)."""
    from sglang.srt.entrypoints import http_server  # sglang's HTTP server: loaded in the launcher only

    app = http_server.app
    if any(getattr(route, "path", None) == PAGE_PATH for route in app.router.routes):  # a second launch
        return
    if not page_enabled():
        logger.info("MOSS-VL realtime page off (%s=0)", UI_ENV)
        return
    mount_page(app)
    logger.info("MOSS-VL realtime page: GET %s (%s=0 turns it off)", PAGE_PATH, UI_ENV)


def page_is_public(original: Callable, *args: Any, **kwargs: Any):
    """AROUND hook on ``decide_request_auth``: a GET of the page's fixed paths is allowed without a key; every
    other request (the socket, ``/capabilities``, the API) is decided by stock."""
    if is_public_page_request(kwargs.get("method", ""), kwargs.get("path", "")):
        from sglang.srt.utils.auth import AuthDecision

        return AuthDecision(allowed=True)
    return original(*args, **kwargs)


PATCHES = (
    Patch(
        title="MOSS-VL-Realtime: a browser page on the sglang server",
        target="sglang.srt.entrypoints.http_server.launch_server",
        kind=HookType.BEFORE,
        hook=mount_realtime_page,
        platforms=ON_NPU_AND_CPU,
        why=(
            "watching the model at work needed a WebSocket client of one's own; the page (camera, screen or a video "
            "file in, the answers as they stream) is one click away on the server that runs the model, offline"
        ),
        how=(
            "`GET /v1/video/realtime/ui` and its script and style, static files of the plugin package with a strict "
            "Content-Security-Policy, are added to sglang's FastAPI app beside the realtime socket; "
            "`MOSSVL_REALTIME_UI=0` leaves them out"
        ),
        upstream="not in sglang (the MOSS-VL-Realtime Demo is a separate React app with its own gateway)",
        remove_when="sglang serves a realtime video page",
    ),
    Patch(
        title="MOSS-VL-Realtime: the browser page is public under --api-key",
        target="sglang.srt.utils.auth.decide_request_auth",
        kind=HookType.AROUND,
        hook=page_is_public,
        platforms=ON_NPU_AND_CPU,
        why=(
            "with `--api-key` sglang's middleware wants a Bearer header on every HTTP path but health and metrics, "
            "and a browser opening a page sends none: the page could not load"
        ),
        how=(
            "a GET or HEAD of exactly the page's three paths is allowed; they hold no secret (the key is typed into "
            "the page and offered at the socket's handshake). Every other request is decided by stock"
        ),
        upstream="not in sglang (llama.cpp keeps its built-in UI's assets public under its API key the same way)",
        remove_when="sglang serves a realtime video page",
    ),
)
