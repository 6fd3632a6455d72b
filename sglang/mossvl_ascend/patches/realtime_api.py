"""The realtime WebSocket API on the server that ``python -m sglang.launch_server`` starts.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from fastapi import WebSocket
from sglang.srt.plugins.hook_registry import HookType
from starlette.routing import WebSocketRoute

from mossvl_ascend.env_switch import env_switch
from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch
from mossvl_ascend.realtime.engine import ServedRealtimeEngine
from mossvl_ascend.realtime.websocket import VIDEO_REALTIME_PATH, mount

logger = logging.getLogger(__name__)

# The real server's `video_realtime_benchmark_mode` (launch option; off in production): with it on, a session may set
# `benchmark_ignore_eos` (turns run to max_new_tokens, <|silence|> does not end them).
BENCHMARK_MODE_ENV = "MOSSVL_VIDEO_REALTIME_BENCHMARK_MODE"
# OpenAI's Realtime URL: smg relays WebSockets only there (`/v1/realtime?model=...`); stock serves ASR on it.
GATEWAY_PATH = "/v1/realtime"


def benchmark_mode_from_env() -> bool:
    return env_switch(BENCHMARK_MODE_ENV, default=False)


def mount_realtime_api(*args: Any, **kwargs: Any) -> None:
    """BEFORE hook on ``http_server.launch_server``: ``WS /v1/video/realtime`` and its capabilities route, and the same
    socket on ``WS /v1/realtime`` ahead of stock's ASR endpoint there (which still answers for other models)."""
    from sglang.srt.entrypoints import http_server  # sglang's HTTP server: loaded in the launcher only

    if _route_endpoint(http_server.app, VIDEO_REALTIME_PATH) is not None:  # a second launch in this process
        return

    state = lambda: http_server._global_state  # noqa: E731  (set once the server has started)
    engine = ServedRealtimeEngine(lambda: state().tokenizer_manager, lambda: state().scheduler_info)
    benchmark_mode = benchmark_mode_from_env()
    serve = mount(http_server.app, engine, allow_benchmark_mode=benchmark_mode, api_keys=_api_keys)
    stock = _route_endpoint(http_server.app, GATEWAY_PATH)

    async def realtime(websocket: WebSocket) -> None:  # annotated: FastAPI injects by type
        if stock is not None and not engine.serves_moss_vl():
            await stock(websocket)
            return
        await serve(websocket)

    _precede(http_server.app, GATEWAY_PATH, realtime)
    logger.info(
        "MOSS-VL realtime API mounted: WS /v1/video/realtime and %s, GET /v1/video/realtime/capabilities; "
        "benchmark mode %s (%s)",
        GATEWAY_PATH,
        "on" if benchmark_mode else "off",
        BENCHMARK_MODE_ENV,
    )


def _api_keys() -> tuple[Optional[str], Optional[str]]:
    """``--api-key`` and ``--admin-api-key`` of the running server."""
    from sglang.srt.runtime_context import get_serving

    serving = get_serving()
    return serving.api_key, serving.admin_api_key


def _route_endpoint(app, path: str):
    for route in app.router.routes:
        if isinstance(route, WebSocketRoute) and route.path == path:
            return route.endpoint
    return None


def _precede(app, path: str, endpoint) -> None:
    """Add a WebSocket route for ``path`` in front of any route already there (routes match in order)."""
    app.add_api_websocket_route(path, endpoint)
    routes = app.router.routes
    ours = routes.pop()
    first = next((i for i, r in enumerate(routes) if isinstance(r, WebSocketRoute) and r.path == path), len(routes))
    routes.insert(first, ours)


PATCHES = (
    Patch(
        title="MOSS-VL-Realtime: the WebSocket API on the sglang server",
        target="sglang.srt.entrypoints.http_server.launch_server",
        kind=HookType.BEFORE,
        hook=mount_realtime_api,
        platforms=ON_NPU_AND_CPU,
        why=(
            "realtime clients (the MOSS-VL-Realtime Demo's sglang-omni adapter) speak `WS /v1/video/realtime`; "
            "sglang's gateway (smg) relays WebSockets only on `/v1/realtime`, where stock serves streaming ASR"
        ),
        how=(
            "the routes are added to sglang's FastAPI app before it starts serving; sessions run on its engine. The "
            "socket is mounted on `/v1/realtime` too, ahead of stock's route, which still answers for a model that "
            "is not MOSS-VL. The handshake checks `--api-key` (sglang's key middleware passes WebSockets through)"
        ),
        upstream="not in sglang (sglang-omni-realtime serves the protocol from its own server)",
        remove_when="sglang serves MOSS-VL-Realtime sessions",
    ),
)
