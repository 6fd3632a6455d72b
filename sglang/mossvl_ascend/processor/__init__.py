"""The MOSS-VL processor, written for the pinned transformers (5.19) to behave as the published checkpoints' own
(``processing_moss_vl.py`` / ``video_processing_moss_vl.py`` of the 0708 line, written for 4.57): same token layout,
pixels, frame sampling, timestamps, budgets and visibility mask. PyAV decodes video; no sglang, torchcodec or joblib.

Public API (stable; the tiny checkpoints' remote code and the real-checkpoint fallback import it):
  ``from mossvl_ascend.processor import MossVLProcessor, MossVLImageProcessor``
  ``MossVLProcessor.from_checkpoint(directory)``: ours for a checkpoint directory, read from its REAL files
      (``preprocessor_config.json``, ``video_preprocessor_config.json``, tokenizer files; chat template from the
      tokenizer unless one is given). ``MossVLImageProcessor.from_real_configs(directory)`` is its media half.
  ``MossVLProcessor(image_processor=MossVLImageProcessor(...), tokenizer=..., chat_template=...)``: direct
      construction; ``save_pretrained`` / ``AutoProcessor.from_pretrained(trust_remote_code=True)`` round-trip it
      when a checkpoint's ``processing_moss_vl.py`` re-exports these classes.
  ``CHAT_TEMPLATE``, ``REALTIME_CHAT_TEMPLATE``, ``DEFAULT_REALTIME_SYSTEM_PROMPT``, ``chat_template()``.
"""

from .chat_template import CHAT_TEMPLATE, DEFAULT_REALTIME_SYSTEM_PROMPT, REALTIME_CHAT_TEMPLATE, chat_template
from .image_processor import MossVLImageProcessor
from .processing import MossVLProcessor

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_REALTIME_SYSTEM_PROMPT",
    "REALTIME_CHAT_TEMPLATE",
    "MossVLImageProcessor",
    "MossVLProcessor",
    "chat_template",
]
