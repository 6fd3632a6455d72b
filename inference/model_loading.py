"""Device, dtype and attention choice, and the one model-loading function of both standalone runners.

``inference/run_inference.py`` and ``realtime_inference/run_online_inference.py`` load MOSS-VL through
:func:`load_model`; device detection itself is ``device_utils``.

Whose code loads a MOSS-VL checkpoint is decided by ``mossvl_ascend.checkpoint_code`` (shared with the sglang
plugin): the checkpoint's own remote code when it imports under this transformers, else this project's processor
(``mossvl_ascend.processor``) and reference model class (``moss_vl_reference.modeling_moss_vl``), which loads the
checkpoint's weights under their own names. ``--remote-code`` / ``$MOSSVL_REMOTE_CODE`` force either; one log line
says which was chosen and why.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoProcessor

import device_utils  # looked up as a module attribute at call time so tests can simulate devices
from inference.cli_flags import DTYPE_NAMES
from mossvl_ascend import checkpoint_code

logger = logging.getLogger("model_loading")

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def choose_device(requested: str) -> tuple[str, str]:
    """(device type, torch device string) for ``auto``, ``cpu``, ``npu``, ``cuda`` or ``npu:1``-style names.

    An accelerator this machine lacks is an error, not a silent fallback to CPU."""
    detected = device_utils.get_device_type()
    if requested == "auto":
        logger.info("device auto: using %s (%s)", detected, device_utils.describe())
        return detected, device_utils.get_device_str(0)
    device_type, _, index = requested.partition(":")
    if device_type not in ("cpu", detected) or (index and not index.isdigit()) or (device_type == "cpu" and index):
        raise SystemExit(
            f"device {requested!r} requested, but this machine offers {detected} ({device_utils.describe()})"
        )
    logger.info("device %s requested", requested)
    return device_type, "cpu" if device_type == "cpu" else device_utils.get_device_str(int(index or 0))


def choose_attention(requested: str, device: str) -> tuple[str, str]:
    """(attn_implementation, why) for ``--attention-backend`` on ``device``."""
    detected = device_utils.get_device_type()
    if device == "cpu" and detected != "cpu":
        # CPU forced on an accelerator host: device_utils answers for the accelerator, so decide here.
        cpu_default = device_utils.DEFAULT_ATTN_IMPLEMENTATION["cpu"]
        if requested == "auto" or requested in device_utils.CUDA_ONLY_ATTN_IMPLEMENTATIONS:
            return cpu_default, f"--attention-backend {requested} on a forced CPU run -> CPU default {cpu_default}"
        return requested, f"--attention-backend {requested} given explicitly"
    implementation = device_utils.resolve_attn_impl(requested)
    if requested == "auto":
        why = f"--attention-backend auto -> the {device} default"
    elif implementation != requested:
        why = f"--attention-backend {requested} is unavailable on {device} -> the {device} default"
    else:
        why = f"--attention-backend {requested} given explicitly"
    return implementation, why


def choose_dtype(requested: str | None, device: str) -> str:
    """bfloat16 on accelerators and float32 on CPU unless ``--dtype`` says otherwise."""
    return requested or ("float32" if device == "cpu" else "bfloat16")


def code_choice(checkpoint: Path | str, remote_code: str | None) -> checkpoint_code.CodeChoice | None:
    """Whose code loads a MOSS-VL ``checkpoint`` (None for any other checkpoint: its remote code, as always)."""
    if not checkpoint_code.is_moss_vl_checkpoint(checkpoint):
        return None
    choice = checkpoint_code.choose_code(checkpoint, remote_code)
    logger.info("%s", choice.describe())
    return choice


def load_ours(checkpoint: Path | str, model_kwargs: dict) -> tuple[Any, Any]:
    """(model, processor) of this project's code for a MOSS-VL checkpoint: the reference model class with the
    checkpoint's config.json read by the reference config class (4.57 and 5.x forms alike), and our processor from
    the checkpoint's own processor files."""
    from moss_vl_reference.configuration_moss_vl import MossVLConfig
    from moss_vl_reference.modeling_moss_vl import MossVLForConditionalGeneration
    from mossvl_ascend.processor import MossVLProcessor

    if not (Path(checkpoint) / "preprocessor_config.json").is_file():
        raise ValueError(
            f"{checkpoint} has no preprocessor_config.json, the published processor file this project's processor "
            "reads; a checkpoint built by this project ships this project's code as its own: load it with auto"
        )
    kwargs = {key: value for key, value in model_kwargs.items() if key != "trust_remote_code"}
    config = MossVLConfig.from_pretrained(checkpoint)
    model = MossVLForConditionalGeneration.from_pretrained(checkpoint, config=config, **kwargs)
    return model, MossVLProcessor.from_checkpoint(checkpoint)


def load_model(
    checkpoint: Path | str,
    device: str = "auto",
    dtype: str | None = None,
    attention_backend: str = "auto",
    cross_attention_implementation: str | None = None,
    remote_code: str | None = None,
) -> tuple[Any, Any, dict]:
    """(model in eval mode, processor, run metadata) for a local checkpoint.

    ``remote_code`` (``auto``/``checkpoint``/``ours``, default ``$MOSSVL_REMOTE_CODE`` else auto) picks whose code
    loads a MOSS-VL checkpoint (module docstring); forcing a checkpoint's own code that cannot import raises
    :class:`mossvl_ascend.checkpoint_code.CheckpointCodeUnloadable`."""
    choice = code_choice(checkpoint, remote_code)
    device_type, target = choose_device(device)
    attn_implementation, why = choose_attention(attention_backend, device_type)
    dtype = choose_dtype(dtype, device_type)
    logger.info("attention implementation: %s (%s)", attn_implementation, why)
    # Loaded on the host and moved with .to(): a device_map would need `accelerate`, which one device does not.
    model_kwargs = {"trust_remote_code": True, "dtype": DTYPES[dtype], "attn_implementation": attn_implementation}
    if cross_attention_implementation is not None:
        model_kwargs["cross_attention_implementation"] = cross_attention_implementation
    logger.info("loading %s on %s as %s", checkpoint, target, dtype)
    if choice is not None and choice.use_ours:
        model, processor = load_ours(checkpoint, model_kwargs)
    else:
        processor = AutoProcessor.from_pretrained(checkpoint, trust_remote_code=True)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, **model_kwargs)
    model = model.to(target).eval()
    metadata = {
        "checkpoint": str(checkpoint),
        "device": target,
        "device_description": device_utils.describe(),
        "dtype": dtype,
        "attention_implementation": attn_implementation,
        "attention_implementation_reason": why,
        "cross_attention_implementation": cross_attention_implementation,
        "code": "remote" if choice is None else choice.code,
        "code_reason": "not a MOSS-VL checkpoint" if choice is None else choice.reason,
    }
    return model, processor, metadata
