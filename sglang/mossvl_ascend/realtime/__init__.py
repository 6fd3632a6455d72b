"""MOSS-VL-Realtime sessions served by sglang: the WebSocket API (:mod:`.websocket`, :mod:`.protocol`), the
session that turns pushed frames and prompts into engine steps (:mod:`.engine`) and the shared types
(:mod:`.session_api`). The scheduler side (KV kept between steps) is :mod:`mossvl_ascend.patches.realtime_sessions`.
"""
