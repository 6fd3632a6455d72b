"""Server-argument resolution for MOSS-VL on Ascend NPUs and on CPU.

Catalog entry
-------------
**target**: ``sglang.srt.arg_groups.model_override_base._invoke_provider`` (AROUND).
    sglang calls it for every per-architecture override provider; we intercept only the call
    whose provider is ``sglang.srt.arg_groups.model_overrides.moss_vl._moss_vl_overrides``.
    The provider itself cannot be hooked: ``_MODEL_OVERRIDE_FNS`` holds the function object,
    so rebinding the module attribute would not change what resolution calls.

**why**: stock ``_moss_vl_overrides`` defaults MOSS-VL to flashinfer prefill and asserts
    flashinfer, because only flashinfer consumed the cross-attention custom mask. On
    ``--device npu`` (where ``set_default_server_args`` declares ``ascend`` for all three
    attention fields) and on ``--device cpu`` (where ``handle_cpu_backends`` declares
    ``intel_amx``) the assertion aborts start-up. This plugin makes the Ascend native path
    (and, on CPU, ``torch_native`` routed through the same math) consume the mask, so the
    assertion no longer describes a real limitation there.

**how**: for MOSS-VL with ``device`` ``npu`` or ``cpu`` the stock provider is not called and
    these declarations are returned instead (on any other device the stock provider runs
    unchanged, assertion included):

    * NPU: prefill/decode attention resolve to the user's explicit ``--prefill-/--decode-
      attention-backend``, else ``--attention-backend``, else ``ascend`` (stock NPU defaults
      would overwrite explicit choices; for MOSS-VL they are kept). ``sampling_backend``
      defaults to ``ascend`` (stock vision attention already picks ``ascend_attn`` on NPU), so
      ``--device npu`` alone resolves like the source PR's full launch command.
    * NPU: the radix cache is disabled with one log line, because the source PR measured
      ~20 % non-deterministic greedy outputs with retained encoder pages on Ascend paged
      attention. Opt back in with the environment variable ``MOSSVL_NPU_ENABLE_RADIX_CACHE=1``
      (the only opt-in path).
    * NPU: decode graphs (``cuda_graph_config.decode``) are forced off with one log line (a
      direct ``declare_resolution``: the provider gate rejects graph fields): the
      Ascend graph decode path (FIA with block tables) ignores the encoder prefix and the
      cross-attention layers.
    * NPU: start-up is refused with ``ValueError`` when ``ASCEND_USE_FIA`` or ``ASCEND_USE_FA``
      is truthy (as ``sglang.srt.utils.get_bool_env_var`` reads them): those extend paths
      attend over the current chunk with a causal mask, which is wrong for cross-attention.
      Refusing, not overriding, because the variables are read by every worker process at
      backend construction and silently rewriting a user's environment hides the conflict.
    * CPU: ``attention_backend`` resolves to ``torch_native`` unless the user chose any
      attention backend; no flashinfer assertion.
    * NPU and CPU, with the radix cache on: chunked prefill stays on. Stock
      ``handle_model_capability_adjustments`` forces ``chunked_prefill_size = -1`` for every model ``is_multimodal_chunked_prefill_supported`` lists
      (MOSS-VL among them) because a chunk cut could split the encoder span; here the scheduler never
      does (:mod:`mossvl_ascend.chunked_prefill`) and every chunk gets its own frame-causal rows
      (:mod:`mossvl_ascend.compact_visibility`). So the resolution's memoized ``ModelConfig`` is marked
      as supporting it before that stock check runs (the provider runs earlier in the same pipeline):
      ``--chunked-prefill-size N`` is kept, and without it the device default stock chooses (8192 on
      a 64 GiB NPU) applies. ``--enable-mixed-chunk`` then works too (mixed batches are routed through
      the encoder-aware math: ``ascend_backend`` / ``cpu_attention``). With the radix cache disabled (the NPU
      default, or ``--disable-radix-cache``) chunked prefill stays off with one log line: a continuing chunk of
      an encoder request then fails ``prepare_encoder_info_extend``'s size check (measured on CPU; not fixed yet).

**upstream status / when to remove**: open. Remove when upstream
    ``arg_groups/model_overrides/moss_vl.py`` accepts non-flashinfer backends that consume
    ``cross_attention_custom_mask`` and Ascend paged attention is deterministic with a
    retained encoder prefix.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

logger = logging.getLogger(__name__)

RADIX_OPT_IN_ENV = "MOSSVL_NPU_ENABLE_RADIX_CACHE"
FORBIDDEN_ASCEND_ENVS = ("ASCEND_USE_FIA", "ASCEND_USE_FA")

_TARGET = "sglang.srt.arg_groups.model_override_base._invoke_provider"


def _is_stock_moss_vl_provider(fn: Callable) -> bool:
    return (
        getattr(fn, "__module__", None) == "sglang.srt.arg_groups.model_overrides.moss_vl"
        and getattr(fn, "__qualname__", None) == "_moss_vl_overrides"
    )


def _radix_opted_in() -> bool:
    return os.environ.get(RADIX_OPT_IN_ENV, "").strip().lower() in ("1", "true")


def _refuse_fused_ascend_extend() -> None:
    from sglang.srt.utils import get_bool_env_var

    enabled = [name for name in FORBIDDEN_ASCEND_ENVS if get_bool_env_var(name, "false")]
    if enabled:
        raise ValueError(
            f"MOSS-VL on NPU cannot run with {', '.join(enabled)} set: those Ascend extend paths "
            "attend over the current chunk with a causal mask and ignore the encoder "
            "(cross-attention) prefix. Unset them or set them to 0."
        )


def keep_chunked_prefill(server_args: Any) -> None:
    """Let MOSS-VL keep chunked prefill (see the module docstring: encoder spans are never split)."""
    from sglang.srt.arg_groups.model_override_base import model_config_of

    model_config_of(server_args).is_multimodal_chunked_prefill_supported = True


def npu_declarations(server_args: Any) -> Dict[str, Any]:
    """MOSS-VL field declarations for ``--device npu`` (reads raw user input and current view)."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    _refuse_fused_ascend_extend()
    cfg = resolving_view(server_args)
    # Raw record fields are what the user typed; the view already carries the stock NPU
    # defaults, which replace explicit choices.
    base = server_args.attention_backend or "ascend"
    declared: Dict[str, Any] = {
        "attention_backend": base,
        "prefill_attention_backend": server_args.prefill_attention_backend or base,
        "decode_attention_backend": server_args.decode_attention_backend or base,
        # The source PR's launch command names it; defaulting it makes ``--device npu``
        # alone resolve to the same backends (the vision backend needs nothing: stock
        # ``layers/attention/vision.py`` picks ``ascend_attn`` on NPU when unset).
        "sampling_backend": server_args.sampling_backend or "ascend",
    }
    if not cfg.disable_radix_cache and not _radix_opted_in():
        logger.warning(
            "MOSS-VL on NPU: radix cache disabled: retained encoder pages made ~20%% of greedy "
            "outputs non-deterministic on Ascend paged attention (set %s=1 to keep it).",
            RADIX_OPT_IN_ENV,
        )
        declared["disable_radix_cache"] = True
    if cfg.cuda_graph_config.decode.backend != Backend.DISABLED:
        logger.warning(
            "MOSS-VL on NPU: decode graphs disabled: the Ascend graph decode path ignores the "
            "encoder prefix and the cross-attention layers."
        )
        # The provider gate does not accept graph fields, so this one goes straight to the
        # resolution stash, as stock handle_model_specific_adjustments does for its own rules.
        declare_resolution(
            server_args,
            "mossvl_ascend.server_args",
            cuda_graph_config=with_phase(
                cfg.cuda_graph_config, Phase.DECODE, backend=Backend.DISABLED
            ),
        )
    return declared


def cpu_declarations(server_args: Any) -> Dict[str, Any]:
    """MOSS-VL field declarations for ``--device cpu``."""
    user_chose = any(
        getattr(server_args, name) is not None
        for name in (
            "attention_backend",
            "prefill_attention_backend",
            "decode_attention_backend",
        )
    )
    if user_chose:
        return {}
    logger.info("MOSS-VL on CPU: using torch_native attention (Ascend native math).")
    return {"attention_backend": "torch_native"}


_DECLARATIONS_BY_DEVICE = {"npu": npu_declarations, "cpu": cpu_declarations}


def moss_vl_provider_around(
    original: Callable, fn: Callable, server_args: Any, hf_config: Any
) -> dict:
    """AROUND hook: swap the stock MOSS-VL provider's result on NPU and CPU."""
    if _is_stock_moss_vl_provider(fn):
        from sglang.srt.arg_groups.model_override_base import resolving_view

        declare = _DECLARATIONS_BY_DEVICE.get(resolving_view(server_args).device)
        if declare is not None:
            declared = declare(server_args)
            if declared.get("disable_radix_cache") or resolving_view(server_args).disable_radix_cache:
                logger.warning(
                    "MOSS-VL: chunked prefill stays off: with the prefix cache disabled a continuing chunk of a "
                    "request with vision input is not supported yet."
                )
            else:
                keep_chunked_prefill(server_args)
            return declared
    return original(fn, server_args, hf_config)


def register() -> None:
    HookRegistry.register(_TARGET, moss_vl_provider_around, HookType.AROUND)
