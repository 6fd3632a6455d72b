"""Client mistakes in MOSS-VL chat and `/generate` requests get HTTP 400 with a message, never 500 or a silent empty
answer (media: ``media_requests``).

Catalog entries: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch
from mossvl_ascend.realtime.engine import posing_step_refusal
from mossvl_ascend.realtime.wire import names_a_step

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


def reject_realtime_step_rids(error, body, *args, **kwargs):
    """AFTER hook: keep stock's error; else refuse a `/generate` body naming a realtime step's rid (only the server's
    realtime sessions make steps, in process: no step comes over HTTP)."""
    if error is not None:
        return error
    if isinstance(body, dict) and names_a_step(body.get("rid")):
        return posing_step_refusal(body["rid"])
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
    Patch(
        title="a `/generate` request naming a realtime step's rid answers 400, streamed too",
        target="sglang.srt.entrypoints.api_contract.generate_contract_error",
        kind=HookType.AFTER,
        hook=reject_realtime_step_rids,
        platforms=ON_NPU_AND_CPU,
        why=(
            "the tokenizer refuses a request posing as a realtime step (`realtime_sessions`), but a streamed "
            "`/generate` has answered 200 by then and carries the refusal as an error event"
        ),
        how=(
            "when stock's schema check of the `/generate` body passed, a `rid` (or a batch's) starting with "
            "`mossvl-realtime:` yields the refusal, which stock answers with HTTP 400 before streaming"
        ),
        upstream="not in sglang",
        remove_when="sglang serves encoder-decoder streaming sessions with growing encoders",
    ),
)
