"""Server-argument resolution for MOSS-VL on Ascend NPUs and on CPU.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch

logger = logging.getLogger(__name__)

FORBIDDEN_ASCEND_ENVS = ("ASCEND_USE_FIA", "ASCEND_USE_FA")
PAGED_ATTENTION_ENV = "MOSSVL_NPU_PAGED_ATTENTION"
# torch_npu's fused attention and the ATB KV-cache write take fp16/bf16 only (no fp32 kernels).
NPU_DTYPES = ("auto", "half", "float16", "bfloat16")
# The paged fused-attention call (one-row groups with the env, every captured decode step): the block size must be a
# non-zero multiple of 16, at most 512.
NPU_PAGED_BLOCK_ALIGN, NPU_PAGED_BLOCK_MAX = 16, 512


def _is_stock_moss_vl_provider(fn: Callable) -> bool:
    return (
        getattr(fn, "__module__", None) == "sglang.srt.arg_groups.model_overrides.moss_vl"
        and getattr(fn, "__qualname__", None) == "_moss_vl_overrides"
    )


def _refuse_fused_ascend_extend() -> None:
    from sglang.srt.utils import get_bool_env_var

    enabled = [name for name in FORBIDDEN_ASCEND_ENVS if get_bool_env_var(name, "false")]
    if enabled:
        raise ValueError(
            f"MOSS-VL on NPU cannot run with {', '.join(enabled)} set: those Ascend extend paths "
            "attend over the current chunk with a causal mask and ignore the encoder "
            "(cross-attention) prefix. Unset them or set them to 0."
        )


def _refuse_what_the_npu_kernels_reject(dtype: str, page_size: int, decode_graphs: bool) -> None:
    """Fail at start-up, not in the first forward or the graph capture, on a dtype or page size the Ascend kernels
    reject."""
    if dtype not in NPU_DTYPES:
        raise ValueError(
            f"MOSS-VL on NPU cannot run with --dtype {dtype}: the Ascend fused attention op and the KV-cache "
            "write take float16/bfloat16 only. Use --dtype bfloat16 (or float16, or auto)."
        )
    paged = os.environ.get(PAGED_ATTENTION_ENV) == "1"
    block_size_taken = page_size % NPU_PAGED_BLOCK_ALIGN == 0 and 0 < page_size <= NPU_PAGED_BLOCK_MAX
    if decode_graphs and not block_size_taken:
        raise ValueError(
            f"MOSS-VL on NPU with decode graphs on needs --page-size a multiple of {NPU_PAGED_BLOCK_ALIGN} up to "
            f"{NPU_PAGED_BLOCK_MAX} (the captured step's paged fused-attention block size); got {page_size}. The "
            "default 128 works, or add --disable-cuda-graph to decode without graphs."
        )
    if paged and not block_size_taken:
        raise ValueError(
            f"MOSS-VL on NPU with {PAGED_ATTENTION_ENV}=1 needs --page-size a multiple of {NPU_PAGED_BLOCK_ALIGN} "
            f"up to {NPU_PAGED_BLOCK_MAX} (the paged fused-attention block size); got {page_size}. The default 128 "
            f"works, or unset {PAGED_ATTENTION_ENV}."
        )
    logger.info(
        "MOSS-VL on NPU: dtype %s, page size %d, %s attention for one-row groups.",
        dtype,
        page_size,
        "paged fused" if paged else "gathered fused",
    )


def npu_declarations(server_args: Any) -> Dict[str, Any]:
    """MOSS-VL field declarations for ``--device npu`` (reads raw user input and current view)."""
    from sglang.srt.arg_groups.overrides import resolving_view

    _refuse_fused_ascend_extend()
    cfg = resolving_view(server_args)
    _refuse_what_the_npu_kernels_reject(cfg.dtype, cfg.page_size, _decode_graphs_on(cfg))
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
    _log_decode_graphs(cfg)
    return declared


def _decode_graphs_on(cfg: Any) -> bool:
    from sglang.srt.model_executor.cuda_graph_config import Backend

    return cfg.cuda_graph_config.decode.backend != Backend.DISABLED


def _log_decode_graphs(cfg: Any) -> None:
    """Decode graphs keep stock's NPU setting (on, stock's buckets); one line says what was chosen and why."""
    if cfg.enable_torch_compile:
        raise ValueError(
            "MOSS-VL on NPU cannot run with --enable-torch-compile: the NPU decode graph of its cross-attention "
            "layers is captured by torch_npu's graph (on by default); drop the flag."
        )
    decode = cfg.cuda_graph_config.decode
    if not _decode_graphs_on(cfg):
        logger.info("MOSS-VL on NPU: decode graphs off (--disable-cuda-graph or a decode graph setting).")
    else:
        logger.info(
            "MOSS-VL on NPU: decode graphs on, cross-attention included (buckets %s; --disable-cuda-graph turns "
            "them off).",
            decode.bs,
        )


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


def keep_chunked_prefill(server_args: Any) -> None:
    """Let MOSS-VL keep chunked prefill (an encoder span is never split: see ``patches.chunked_prefill``)."""
    from sglang.srt.arg_groups.model_override_base import model_config_of

    model_config_of(server_args).is_multimodal_chunked_prefill_supported = True


def warn_on_a_mixed_chunk_under_two_pages(view: Any) -> None:
    """With ``--enable-mixed-chunk`` stock takes one token per running request off the chunk budget and charges a
    new request whole pages, so a budget under two pages admits no request while any other decodes."""
    chunk, page = view.chunked_prefill_size, view.page_size or 1
    if view.enable_mixed_chunk and page > 1 and chunk is not None and 0 < chunk < 2 * page:
        logger.warning(
            "MOSS-VL: --chunked-prefill-size %d with --enable-mixed-chunk at page size %d admits no new request "
            "while others decode (requests run one at a time); use %d or more.",
            chunk,
            page,
            2 * page,
        )


_DECLARATIONS_BY_DEVICE = {"npu": npu_declarations, "cpu": cpu_declarations}


def moss_vl_provider_around(original: Callable, fn: Callable, server_args: Any, hf_config: Any) -> dict:
    """AROUND hook: swap the stock MOSS-VL provider's result on NPU and CPU."""
    if _is_stock_moss_vl_provider(fn):
        from sglang.srt.arg_groups.model_override_base import resolving_view

        view = resolving_view(server_args)
        declare = _DECLARATIONS_BY_DEVICE.get(view.device)
        if declare is not None:
            keep_chunked_prefill(server_args)
            warn_on_a_mixed_chunk_under_two_pages(view)
            return declare(server_args)
    return original(fn, server_args, hf_config)


PATCHES = (
    Patch(
        title="MOSS-VL server arguments on --device npu and --device cpu",
        target="sglang.srt.arg_groups.model_override_base._invoke_provider",
        kind=HookType.AROUND,
        hook=moss_vl_provider_around,
        platforms=ON_NPU_AND_CPU,
        why=(
            "stock `_moss_vl_overrides` defaults MOSS-VL to flashinfer prefill and asserts flashinfer, because only "
            "flashinfer consumed the cross-attention mask; on `--device npu` (ascend backends) and `--device cpu` "
            "the assertion aborts start-up. The plugin's attention patches make the Ascend native path (and, on "
            "CPU, torch_native routed through the same math) apply the visibility, so the assertion no longer "
            "describes a real limitation there. The provider itself cannot be hooked: `_MODEL_OVERRIDE_FNS` holds "
            "the function object, so the call site is wrapped and only the MOSS-VL provider's call intercepted."
        ),
        how=(
            "for MOSS-VL on `npu`: prefill/decode attention resolve to the user's explicit choice, else "
            "`--attention-backend`, else `ascend`; `sampling_backend` defaults to `ascend` (so `--device npu` alone "
            "resolves like the source PR's long command); the radix cache keeps stock's default (on; the source PR "
            "turned it off for ~20 % non-deterministic greedy outputs at page size 128, which `paged_decode` "
            "explains and fixes: served at page 128 with the radix cache on, 42 of 42 answers equal the reference "
            "and logprobs within 3.05e-5 of the page-1 server's, fp32 summation order: 8 ulps of the largest logit); "
            "decode graphs keep stock's NPU default (on: "
            "`patches.npu_graph` captures the cross-attention layers too; `--disable-cuda-graph` turns them off, "
            "`--enable-torch-compile` is refused); start-up "
            "is refused when `ASCEND_USE_FIA`/`ASCEND_USE_FA` are set (those extend paths ignore the encoder "
            "prefix), with `--dtype float32` (the fused attention op and the ATB KV write take fp16/bf16 only), and, "
            f"with decode graphs on or `{PAGED_ATTENTION_ENV}=1`, with a page size that is not a multiple of 16 up "
            "to 512 (the paged op's block-size rule: the captured decode step always calls it); one line logs "
            "the dtype, page size and one-row attention path chosen. On "
            "`cpu`: `torch_native` unless the user chose a backend. On both, with the radix cache on or "
            "off, chunked prefill stays on: stock `handle_model_capability_adjustments` forces `chunked_prefill_size = "
            "-1` for MOSS-VL because a cut could split the encoder span, which `chunked_prefill` prevents; the "
            "resolution's memoized `ModelConfig` is marked as supporting it before that stock check runs, so "
            "`--chunked-prefill-size N` is kept (else the device default) and `--enable-mixed-chunk` works (one "
            "warning when its chunk is under two pages, which stock's admission starves). Any other "
            "`--device` runs the stock provider, assertion included."
        ),
        upstream="open in 0.5.23",
        remove_when=(
            "upstream `arg_groups/model_overrides/moss_vl.py` accepts non-flashinfer backends that apply the visibility"
        ),
    ),
)
