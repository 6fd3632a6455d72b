"""The command-line flags every standalone runner shares, declared once.

``inference/run_inference.py`` and ``realtime_inference/run_online_inference.py`` add these through
:func:`add_runner_flags`, so each flag has one spelling, one default and one help text in all of them. Upstream
MOSS-VL's realtime runner spells the device flag ``--device-map``; it is an alias of ``--device`` here, so upstream's
command lines run unchanged (upstream's ``--dtype`` and ``--attention-backend`` are spelled as ours).
"""

from __future__ import annotations

import argparse
import re

import device_utils
from mossvl_ascend import checkpoint_code

DTYPE_NAMES = ("bfloat16", "float16", "float32")
ATTENTION_BACKENDS = ("auto",) + device_utils.ATTN_IMPLEMENTATIONS
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# What model_loading.choose_device accepts; checked here too so a typo fails before a model or a video is read.
_DEVICE_NAME = re.compile(r"auto|cpu|(?:npu|cuda)(?::\d+)?")


def device_name(value: str) -> str:
    """``--device``'s value: auto, cpu, npu, cuda, or an accelerator with its index (npu:1, cuda:0)."""
    if not _DEVICE_NAME.fullmatch(value):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, npu, cuda, npu:N or cuda:N, got {value!r}")
    return value


def add_runner_flags(parser: argparse.ArgumentParser) -> None:
    """Add the runners' shared flags (device, dtype, attention backend, whose code loads the checkpoint, log level)
    to ``parser`` or one of its argument groups. Their values land in ``device``, ``dtype``, ``attention_backend``,
    ``remote_code`` and ``log_level``."""
    parser.add_argument(
        "--device",
        "--device-map",
        type=device_name,
        default="auto",
        help="where the model runs: auto (NPU if present, else CUDA, else CPU) or one device: cpu, npu, cuda, npu:1, "
        "cuda:0, ...; naming an accelerator this machine lacks is an error (default auto; --device-map is "
        "upstream's spelling)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=None,
        help="weights/activations dtype (default: bfloat16 on NPU/CUDA, float32 on CPU)",
    )
    parser.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="transformers attn_implementation (default auto: eager on NPU, flash_attention_2 on CUDA when flash_attn "
        "is installed else sdpa, sdpa on CPU; FlashAttention without CUDA or its package falls back to the default)",
    )
    parser.add_argument(
        "--remote-code",
        choices=checkpoint_code.CHOICES,
        default=None,
        help="whose code loads a MOSS-VL checkpoint: auto (its own remote code when it imports under this "
        "transformers, else this project's processor and reference model), checkpoint, or ours "
        f"(default: ${checkpoint_code.ENV_VAR}, else auto)",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=LOG_LEVELS, help="logging level of the runner's log (default INFO)"
    )
