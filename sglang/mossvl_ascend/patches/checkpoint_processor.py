"""A MOSS-VL checkpoint whose own processor code cannot load under the pinned transformers gets ours.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``). Whose code loads a checkpoint is decided by
:mod:`mossvl_ascend.checkpoint_code` (shared with the standalone runners); this adapter only acts on its answer.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend import checkpoint_code
from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch
from mossvl_ascend.processor import MossVLProcessor

logger = logging.getLogger(__name__)

TARGET_MODULE = "sglang.srt.utils.hf_transformers.processor"


class CheckpointProcessor:
    """What stock's per-model-type processor table expects of an entry (``from_pretrained``): our processor, read
    from the checkpoint's own processor files (``MossVLProcessor.from_checkpoint``)."""

    @staticmethod
    def from_pretrained(checkpoint: str, *args: Any, **kwargs: Any):
        return MossVLProcessor.from_checkpoint(checkpoint)


def processor_for_checkpoint(original: Callable, tokenizer_name: str, *args: Any, **kwargs: Any):
    """AROUND hook on stock ``get_processor``: for a MOSS-VL checkpoint whose processor code is not chosen
    (``checkpoint_code.choose_code``), stock loads ``CheckpointProcessor`` as the model type's processor class."""
    checkpoint = kwargs.get("model_name") or tokenizer_name
    if not checkpoint_code.is_moss_vl_checkpoint(checkpoint):
        return original(tokenizer_name, *args, **kwargs)
    try:
        choice = checkpoint_code.choose_code(
            checkpoint,
            parts=frozenset({checkpoint_code.PROCESSOR}),
            trust_remote_code=bool(kwargs.get("trust_remote_code")),
        )
    except (checkpoint_code.CheckpointCodeUnloadable, ValueError) as error:
        logger.error("%s", error)
        raise
    logger.info("%s", choice.describe())
    if not choice.use_ours:
        return original(tokenizer_name, *args, **kwargs)
    import sglang.srt.utils.hf_transformers.processor as stock

    # Stock's own extension point (the per-model-type processor table), set only for this call: the rest of stock's
    # get_processor (config, tokenizer fix-ups, chat template) runs unchanged around our processor.
    table, key = stock._CUSTOMIZED_MM_PROCESSOR, checkpoint_code.MOSS_VL_MODEL_TYPE
    previous = table.get(key)
    table[key] = CheckpointProcessor
    try:
        return original(tokenizer_name, *args, **kwargs)
    finally:
        if previous is None:
            del table[key]
        else:
            table[key] = previous


def refuse_unloadable_forced_code(*args: Any, **kwargs: Any) -> None:
    """BEFORE hook on stock ``http_server.launch_server``, in the launcher process before any scheduler starts: a
    MOSS-VL checkpoint whose own code is forced (``MOSSVL_REMOTE_CODE=checkpoint``) but cannot import stops start-up
    with one line naming the transformers version it needs, instead of a traceback from every process."""
    server_args = args[0] if args else kwargs["server_args"]
    checkpoint = server_args.tokenizer_path or server_args.model_path
    if not checkpoint_code.is_moss_vl_checkpoint(checkpoint):
        return
    try:
        checkpoint_code.choose_code(
            checkpoint,
            parts=frozenset({checkpoint_code.PROCESSOR}),
            trust_remote_code=bool(server_args.trust_remote_code),
        )
    except (checkpoint_code.CheckpointCodeUnloadable, ValueError) as error:
        raise SystemExit(f"MOSS-VL start-up refused: {error}") from None


PATCHES = (
    Patch(
        title="A published MOSS-VL checkpoint whose processor code cannot load gets ours",
        target=f"{TARGET_MODULE}.get_processor",
        kind=HookType.AROUND,
        hook=processor_for_checkpoint,
        platforms=ON_NPU_AND_CPU,
        why=(
            "the published MOSS-VL checkpoints' processor is remote code written for transformers 4.57; under the "
            "5.19 that sglang 0.5.23 pins its video processor does not import (it needs `joblib` and `torchcodec` "
            "and imports `BASE_VIDEO_PROCESSOR_DOCSTRING`, gone in 5.x), so `AutoProcessor.from_pretrained` fails "
            "and the server never starts. (Their config class does import and load under 5.19, 4.57 `rope_scaling` "
            "form included, so sglang's config loading is left as stock.)"
        ),
        how=(
            "for a checkpoint whose config.json says `model_type: moss_vl`, `mossvl_ascend.checkpoint_code` decides "
            "(`MOSSVL_REMOTE_CODE=auto|checkpoint|ours`, default auto: the checkpoint's own code when every remote "
            "processor module it names imports, else ours) and one log line says which and why. For ours, stock "
            "`get_processor` runs with its per-model-type processor table (`_CUSTOMIZED_MM_PROCESSOR`) mapping "
            "`moss_vl` to `MossVLProcessor.from_checkpoint` (`mossvl_ascend.processor`) for that call only. Forcing "
            "the checkpoint's code when it cannot import fails start-up with an error naming the transformers "
            "version config.json says it needs. Any other checkpoint: stock."
        ),
        upstream="open: stock 0.5.23 loads the checkpoint's remote processor (no MOSS-VL processor of its own)",
        remove_when="the published checkpoints ship remote code that loads under the transformers sglang pins",
    ),
    Patch(
        title="Forcing a published MOSS-VL checkpoint's own code that cannot load stops the server with one line",
        target="sglang.srt.entrypoints.http_server.launch_server",
        kind=HookType.BEFORE,
        hook=refuse_unloadable_forced_code,
        platforms=ON_NPU_AND_CPU,
        why=(
            "with `MOSSVL_REMOTE_CODE=checkpoint` on a checkpoint whose code cannot import, the processor hook's "
            "error would surface as a traceback from the tokenizer manager and the schedulers, each loading the "
            "processor"
        ),
        how=(
            "before `launch_server` starts any process, the same decision (`mossvl_ascend.checkpoint_code`) runs for "
            "a MOSS-VL checkpoint; an unloadable forced choice exits with the message naming the transformers version "
            "config.json says it needs, no traceback. Everything else: stock, unchanged"
        ),
        upstream="open: stock 0.5.23 loads the checkpoint's remote processor (no MOSS-VL processor of its own)",
        remove_when="the published checkpoints ship remote code that loads under the transformers sglang pins",
    ),
)
