"""MOSS-VL-Realtime sessions served by sglang: the WebSocket API (:mod:`.websocket`, :mod:`.protocol`) and the
session that turns pushed frames and prompts into engine steps (:mod:`.engine`) in the HTTP process; the sessions'
kept K/V in the scheduler (:mod:`.sessions`, its steps planned by :mod:`.step_plan`); what the two processes tell
each other (:mod:`.wire`) and the shared types (:mod:`.session_api`). The hooks that reach them from sglang are
``mossvl_ascend.patches.realtime_sessions`` and ``mossvl_ascend.patches.realtime_api``.
"""
