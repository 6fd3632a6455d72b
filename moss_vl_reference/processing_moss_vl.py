"""MOSS-VL processor: the remote-code entry our checkpoints ship (``auto_map`` names this module).

The implementation lives in the plugin distribution, ``mossvl_ascend.processor`` (``pip install ./sglang``, part of
``requirements-npu.txt``), and follows the published checkpoints' processor code; this module only names it, so a
checkpoint's ``processing_moss_vl.MossVLProcessor`` / ``MossVLImageProcessor`` are those classes.
"""

from mossvl_ascend.processor import (
    CHAT_TEMPLATE,
    DEFAULT_REALTIME_SYSTEM_PROMPT,
    REALTIME_CHAT_TEMPLATE,
    MossVLImageProcessor,
    MossVLProcessor,
    chat_template,
)

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_REALTIME_SYSTEM_PROMPT",
    "REALTIME_CHAT_TEMPLATE",
    "MossVLImageProcessor",
    "MossVLProcessor",
    "chat_template",
]
