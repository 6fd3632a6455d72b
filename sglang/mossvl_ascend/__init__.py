"""MOSS-VL on Ascend NPUs: patches to stock sglang 0.5.23, delivered as an sglang plugin.

sglang discovers this package through the ``sglang.srt.plugins`` entry point and calls
:func:`register` in the launcher, the scheduler and every worker process
(``sglang.srt.plugins.load_plugins``); ``SGLANG_PLUGINS`` can exclude it by name
(``mossvl_ascend``). Each patch lives in the module for its sglang area, whose
docstring carries the full catalog entry (target, why, how, when removable).

Patch catalog
=============
Each line: the fix, its sglang target, and its status in 0.5.23. "hook" = 0.5.23 breaks, fixed here;
"already correct" = 0.5.23 behaves, a regression test pins it. Full entries (why, how, when removable) in the
named module. On CUDA nothing changes: every hook either checks the device (and registers nothing on CUDA) or
targets an NPU/CPU-only code path; MOSS-VL's server arguments run the stock provider there.

Server arguments (``server_args``)
  1. MOSS-VL on ``--device npu``: ascend backends by default (explicit choices kept), no flashinfer assertion,
     radix cache off with one log line unless ``MOSSVL_NPU_ENABLE_RADIX_CACHE=1``, decode graphs off,
     ``ASCEND_USE_FIA``/``ASCEND_USE_FA`` refused; ``--device cpu``: torch_native.
     target ``arg_groups.model_override_base._invoke_provider`` — hook.
 13. MOSS-VL keeps chunked prefill on npu / cpu when the radix cache is on (stock forces
     ``chunked_prefill_size = -1``): the memoized ``ModelConfig`` is marked ``is_multimodal_chunked_prefill_supported``
     before stock's capability check; with the radix cache off it stays off (one log line). same target — hook.
Attention (``native_attention``, ``ascend_backend``, ``cpu_attention``, ``compact_visibility``,
``frame_causal_attention``)
  2. Cross-attention mask built on every extend whatever the prefill backend.
     target ``models.moss_vl.MossVLForConditionalGeneration.prepare_forward_batch`` — already correct.
  3. Native extend consumes ``cross_attention_custom_mask`` (new-token queries only, running offset,
     True = attend, plain and softcap paths, blind rows and empty encoders -> 0, size errors name the request).
     target ``hardware_backend.npu.attention.ascend_torch_native_backend.AscendTorchNativeAttnBackend.
     run_sdpa_forward_extend`` — hook; ``AscendAttnBackend.forward_extend``/``forward_decode`` pass the mask
     and route encoder batches to it — hook.
  4. Self-attention keys over ``[encoder_len, encoder_len + seq_len)`` with a cached text prefix.
     same target — hook.
  5. Decode cross-attention with cached encoder K/V (k = v = None: no write, all frames visible).
     ``AscendAttnBackend.forward_decode`` — already correct (pinned), routed through the same math.
 12. Frame visibility as one int32 boundary per text row instead of the dense packed mask; cross-attention
     computed from it without a full-size mask (``compact_visibility`` + ``frame_causal_attention``).
     target ``models.moss_vl.MossVLForConditionalGeneration.prepare_forward_batch`` — hook (an optimisation;
     CUDA keeps the packed mask for flashinfer; packed masks from other producers still work).
  9. CPU servers run MOSS-VL attention through the patched Ascend native math.
     target ``layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend``/``forward_decode``
     — hook (a test-harness route).
 15. Mixed batches (``--enable-mixed-chunk``) on NPU go through the encoder-aware math, not the fused
     ``AscendAttnBackend.forward_mixed`` that ignores the encoder. target that method — hook (``ascend_backend``).
 16. The text-row gate reads rows past the prompt (mixed-batch decode rows, resumed requests) as the last prompt
     row and keeps the per-row counts (no shrink). target ``models.moss_vl.MossVLForConditionalGeneration.
     get_full_text_row_masked_out_mask`` — replace off CUDA (``text_row_gate``); boundaries read rows the same way
     (``compact_visibility.visible_frames_of_rows``).
 17. A MOSS-VL request keeps its pixel values until it finishes (stock drops them right after encoding), so a
     retracted request can be prefilled again. target ``models.moss_vl.MossVLForConditionalGeneration.forward``
     — hook off CUDA (``media_retention``).
Scheduling and caching (``radix_prefix``, ``encoder_cache_key``)
  6. A prefix match ending inside a request's encoder span (page size 128) is dropped.
     target ``mem_cache.common.match_kv_cache`` — hook.
 10. Encoder-prefix radix keys include the vision positions (same images at another text position reused
     keys rotated for the old positions). target ``models.moss_vl.MossVLForConditionalGeneration.
     _build_encoder_prefix_pad_ids`` — hook (found by the serving parity tests; not in the source PR).
Chunked prefill (``chunked_prefill``)
 14. A chunk never ends inside (or right at the end of) a request's encoder span: the first chunk holds the
     whole encoder and a text row; too small a budget waits, or, alone in the batch, takes the encoder whole.
     target ``managers.schedule_policy.PrefillAdder._select_prefill_admission`` — hook (issue 12).
 18. The decode rows of a mixed batch: encoders marked cached (``merge_batch`` drops ``encoder_cached``: IndexError
     in MOSS-VL's forward) and ``extend_end`` past the encoder (text-only ``seq_lens`` left it short: radix
     checkpoint assertion). target ``managers.schedule_batch.ScheduleBatch.mix_with_running`` — hook.
Start-up and NPU guards (``npu_imports``, ``npu_guards``)
  7. Pure-torch ``split_qkv_rmsnorm_rope`` when ``sgl_kernel_npu`` / triton-ascend is incomplete.
     target the module-level import in ``models.qwen3`` (and the Qwen3-ASR adapter) — ``sys.modules`` fallback.
  8. Profiler patch API (torch-npu 2.8 vs 2.10+), scheduler / profiler / disaggregation / dLLM device checks,
     the qwen3-ASR adapter import — already correct or covered by 6 and 7 (``npu_guards`` records each).
Requests (``request_validation``)
 11. Missing media paths answer 400 (not 500); ``max_tokens`` <= 0 answers 400. targets
     ``multimodal.processors.moss_vl.MossVLImageProcessor._load_single_item``,
     ``entrypoints.openai.serving_chat.OpenAIServingChat._validate_request`` — hooks.
"""

import logging

logger = logging.getLogger(__name__)

PLUGIN_NAME = "mossvl_ascend"

# One module per patched sglang area; each exposes ``register()``.
PATCH_MODULES: tuple[str, ...] = ("npu_imports", "server_args", "radix_prefix", "encoder_cache_key", "compact_visibility", "request_validation", "native_attention", "ascend_backend", "cpu_attention", "chunked_prefill", "text_row_gate", "media_retention")


def register() -> None:
    """Register every patch with sglang's HookRegistry (called by sglang's plugin loader)."""
    import importlib

    for name in PATCH_MODULES:
        importlib.import_module(f"{__name__}.{name}").register()
    logger.info("%s: registered patch modules %s", PLUGIN_NAME, ", ".join(PATCH_MODULES) or "(none)")
