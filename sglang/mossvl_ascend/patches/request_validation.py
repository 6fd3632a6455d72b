"""Client mistakes in MOSS-VL chat requests get HTTP 400 with a message, never 500 or a silent empty answer (media:
``media_requests``).

Catalog entries: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch

MOSS_VL_ARCH = "MossVLForConditionalGeneration"


def reject_non_positive_token_limits(error, serving_chat, request):
    """AFTER hook: keep stock's error; else refuse a completion limit below 1 on a MOSS-VL server."""
    if error is not None:
        return error
    if MOSS_VL_ARCH not in (serving_chat.tokenizer_manager.model_config.hf_config.architectures or []):
        return None
    for field in ("max_tokens", "max_completion_tokens"):
        limit = getattr(request, field, None)
        if limit is not None and limit <= 0:
            return f"{field} must be at least 1 for a chat completion, got {limit}."
    return None


PATCHES = (
    Patch(
        title="max_tokens <= 0 answers 400",
        target="sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._validate_request",
        kind=HookType.AFTER,
        hook=reject_non_positive_token_limits,
        platforms=ON_NPU_AND_CPU,
        why=(
            "stock accepts `max_tokens: 0` (or `max_completion_tokens: 0`) and answers 200 with an empty completion "
            "after running the whole vision prefill; for a chat completion that is a malformed request."
        ),
        how=(
            "on a MOSS-VL server, when stock validation passed, a limit <= 0 yields the message "
            "`max_tokens must be at least 1 ...`, which stock turns into HTTP 400."
        ),
        upstream="sglang 0.5.23 behaviour",
        remove_when="upstream rejects zero completion limits",
    ),
)
