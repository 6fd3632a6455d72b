"""Which code loads a MOSS-VL checkpoint: the checkpoint's own remote code, or this project's.

The published MOSS-VL checkpoints ship remote code written for transformers 4.57 (their config.json says
``transformers_version: 4.57.1``). Under the transformers 5.19 that sglang 0.5.23 pins it does not import: the video
processor needs ``joblib`` and ``torchcodec`` and imports ``BASE_VIDEO_PROCESSOR_DOCSTRING`` (gone in 5.x), the
model imports ``transformers.utils.generic.OutputRecorder`` (moved in 5.x). This module answers, for one checkpoint,
"does its own code import here, and whose code do we use?" -- the one decision the sglang plugin (processor) and the
standalone runners (processor and model) share. It imports no sglang and no torch: the runners use it too.

The choice, from the runners' ``--remote-code`` flag or else the ``MOSSVL_REMOTE_CODE`` environment variable:
  ``auto`` (default)  the checkpoint's own code when every remote module it names imports, else ours;
  ``checkpoint``      the checkpoint's own code; if it cannot import, :class:`CheckpointCodeUnloadable` names the
                      transformers version it was written for;
  ``ours``            this project's processor (``mossvl_ascend.processor``) and, in the runners, the reference
                      model class, loading the checkpoint's weights by their own names.
Probing imports the checkpoint's remote modules (transformers' dynamic-module loader), so it happens only when the
caller trusts remote code; an untrusted MOSS-VL checkpoint gets ours without running any of its code.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_VAR = "MOSSVL_REMOTE_CODE"
CHOICES = ("auto", "checkpoint", "ours")
MOSS_VL_MODEL_TYPE = "moss_vl"

# The remote code a consumer needs: the processor (sglang and the runners) and the model (the runners only).
PROCESSOR, MODEL = "processor", "model"
# Files whose ``auto_map`` names remote classes, and which part each auto class belongs to. The config class is
# needed by both parts (sglang and the runners both build it from config.json).
AUTO_MAP_FILES = (
    "config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "tokenizer_config.json",
)
MODEL_AUTO_CLASSES = frozenset({"AutoModel", "AutoModelForCausalLM", "AutoModelForImageTextToText"})
SHARED_AUTO_CLASSES = frozenset({"AutoConfig"})


class CheckpointCodeUnloadable(RuntimeError):
    """The checkpoint's own code was asked for, but it does not import under this transformers."""


@dataclass(frozen=True)
class CodeChoice:
    """Whose code loads ``checkpoint`` and why (``reason`` is one human sentence)."""

    checkpoint: str
    use_ours: bool
    reason: str

    @property
    def code(self) -> str:
        return "ours" if self.use_ours else "checkpoint"

    def describe(self) -> str:
        """The one log line naming the code chosen and why."""
        whose = "this project's MOSS-VL code" if self.use_ours else "the checkpoint's own remote code"
        return f"MOSS-VL checkpoint {self.checkpoint}: loading with {whose} ({self.reason})"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return {}


def checkpoint_config(checkpoint: str | os.PathLike) -> dict:
    """The checkpoint's config.json as a dict ({} when it has none)."""
    return _read_json(Path(checkpoint) / "config.json")


def is_moss_vl_checkpoint(checkpoint: str | os.PathLike) -> bool:
    """True for a local checkpoint directory whose config.json says ``model_type: moss_vl``."""
    return checkpoint_config(checkpoint).get("model_type") == MOSS_VL_MODEL_TYPE


def written_for(checkpoint: str | os.PathLike) -> str | None:
    """The transformers version the checkpoint was saved with (config.json ``transformers_version``)."""
    return checkpoint_config(checkpoint).get("transformers_version")


def remote_class_refs(checkpoint: str | os.PathLike, parts: frozenset) -> list[tuple[str, str, str]]:
    """(file, auto class, ``module.Class`` reference) of every remote class the checkpoint names for ``parts``,
    each reference once, in file order."""
    found, seen = [], set()
    for name in AUTO_MAP_FILES:
        auto_map = _read_json(Path(checkpoint) / name).get("auto_map") or {}
        for auto_class, refs in auto_map.items():
            part = MODEL if auto_class in MODEL_AUTO_CLASSES else PROCESSOR
            if auto_class not in SHARED_AUTO_CLASSES and part not in parts:
                continue
            # AutoTokenizer maps to a [slow, fast] pair, either of which may be null
            for ref in refs if isinstance(refs, (list, tuple)) else [refs]:
                if ref and ref not in seen:
                    seen.add(ref)
                    found.append((name, auto_class, ref))
    return found


@functools.lru_cache(maxsize=None)
def remote_code_failure(checkpoint: str, parts: frozenset) -> str | None:
    """Why the checkpoint's remote code for ``parts`` does not import here (``None`` when all of it does).

    Each referenced class is imported through transformers' dynamic-module loader, exactly as ``from_pretrained``
    with ``trust_remote_code=True`` would (its missing-package check included). Cached per process."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    for file_name, auto_class, ref in remote_class_refs(checkpoint, parts):
        try:
            get_class_from_dynamic_module(ref, checkpoint, local_files_only=True)
        except Exception as error:  # ImportError, AttributeError, SyntaxError...: any of them means "does not load"
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            return f"{ref} ({auto_class} in {file_name}) fails to import: {type(error).__name__}: {first_line}"
    return None


def requested_choice(flag: str | None = None) -> str:
    """The runner's flag when given, else ``$MOSSVL_REMOTE_CODE``, else ``auto``; anything else is a ValueError."""
    value = flag if flag is not None else os.environ.get(ENV_VAR, "auto")
    value = value.strip().lower()
    if value not in CHOICES:
        raise ValueError(f"{ENV_VAR}={value!r} is not one of {', '.join(CHOICES)}")
    return value


def unloadable_message(checkpoint: str, failure: str) -> str:
    import transformers

    needed = written_for(checkpoint)
    wanted = f"transformers {needed}" if needed else "the transformers version it was written for"
    return (
        f"the checkpoint's own remote code was requested ({ENV_VAR}=checkpoint or --remote-code checkpoint), but "
        f"{checkpoint} needs {wanted} and this environment has transformers {transformers.__version__}: {failure}. "
        f"Use this project's MOSS-VL code instead ({ENV_VAR}=ours or auto, the default), or run the checkpoint's "
        f"code in an environment with {wanted} and its packages."
    )


def choose_code(
    checkpoint: str | os.PathLike,
    requested: str | None = None,
    parts: frozenset = frozenset({PROCESSOR, MODEL}),
    trust_remote_code: bool = True,
) -> CodeChoice:
    """Whose code loads the MOSS-VL ``checkpoint`` (a local directory) for ``parts``; see the module docstring.

    Raises :class:`CheckpointCodeUnloadable` when the checkpoint's own code is forced and does not import, and
    ValueError for an unknown ``requested`` value."""
    checkpoint = str(checkpoint)
    choice = requested_choice(requested)
    if choice == "ours":
        return CodeChoice(checkpoint, True, f"{ENV_VAR}/--remote-code asks for ours")
    if not remote_class_refs(checkpoint, parts):
        if choice == "checkpoint":
            raise CheckpointCodeUnloadable(f"{checkpoint} ships no remote code (no auto_map) to load")
        return CodeChoice(checkpoint, True, "the checkpoint ships no remote code")
    if not trust_remote_code:  # never run code the caller did not trust, not even to probe it
        if choice == "checkpoint":
            return CodeChoice(checkpoint, False, f"{ENV_VAR}/--remote-code asks for it (not probed: not trusted)")
        return CodeChoice(checkpoint, True, "remote code is not trusted, so the checkpoint's own code is not run")
    failure = remote_code_failure(checkpoint, frozenset(parts))
    if failure is None:
        return CodeChoice(checkpoint, False, f"its remote code imports under this transformers ({choice})")
    if choice == "checkpoint":
        raise CheckpointCodeUnloadable(unloadable_message(checkpoint, failure))
    needed = written_for(checkpoint)
    written = f", written for transformers {needed}" if needed else ""
    return CodeChoice(checkpoint, True, f"its own code cannot load here{written}: {failure}")
