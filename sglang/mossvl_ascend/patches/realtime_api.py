"""The realtime WebSocket API on the server that ``python -m sglang.launch_server`` starts.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.registry import ON_NPU_AND_CPU, Patch

logger = logging.getLogger(__name__)

_MOUNTED: dict[str, bool] = {}


def mount_realtime_api(*args: Any, **kwargs: Any) -> None:
    """BEFORE hook on ``http_server.launch_server``: ``WS /v1/video/realtime`` and its capabilities route."""
    if _MOUNTED.get("app"):
        return
    from sglang.srt.entrypoints import http_server

    from mossvl_ascend.realtime.engine import ServedRealtimeEngine
    from mossvl_ascend.realtime.websocket import mount

    state = lambda: http_server._global_state  # noqa: E731  (set once the server has started)
    mount(http_server.app, ServedRealtimeEngine(lambda: state().tokenizer_manager, lambda: state().scheduler_info))
    _MOUNTED["app"] = True
    logger.info("MOSS-VL realtime API mounted: WS /v1/video/realtime, GET /v1/video/realtime/capabilities")


PATCHES = (
    Patch(
        title="MOSS-VL-Realtime: the WebSocket API on the sglang server",
        target="sglang.srt.entrypoints.http_server.launch_server",
        kind=HookType.BEFORE,
        hook=mount_realtime_api,
        platforms=ON_NPU_AND_CPU,
        why="realtime clients (the MOSS-VL-Realtime Demo's sglang-omni adapter) speak `WS /v1/video/realtime`",
        how="the routes are added to sglang's FastAPI app before it starts serving; sessions run on its engine",
        upstream="not in sglang (sglang-omni-realtime serves the protocol from its own server)",
        remove_when="sglang serves MOSS-VL-Realtime sessions",
    ),
)
