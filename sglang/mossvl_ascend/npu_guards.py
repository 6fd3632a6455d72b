"""The source PR's small NPU guards, checked against sglang 0.5.23: no hook is needed.

This module registers nothing (it is not in ``PATCH_MODULES``); it is the catalog record of
each guard the source PR added, why 0.5.23 already behaves, and the test that pins it
(``tests/test_npu_guards.py`` unless named otherwise).

Catalog entries
---------------
**Profiler patch API (torch-npu 2.8 ``_apply_patches`` vs 2.10+ ``_apply_all_patches``)**
    *target*: ``sglang.srt.utils.profile_utils`` and
    ``sglang.srt.managers.scheduler_components.profiler_manager`` (0.5.23's successor of
    ``scheduler_profiler_mixin.py``), both at import time under ``is_npu()``.
    *why the PR patched it*: torch-npu 2.10 removed ``_apply_patches``, so the unguarded call
    crashed sglang's import on newer torch-npu.
    *0.5.23*: already correct. Both modules call
    ``sglang.srt.utils.torch_npu_patch_utils.apply_torch_npu_patches`` (upstream PR #26356),
    which uses ``_apply_patches(patches)`` when present, else ``_apply_all_patches()``. On NPU
    the trace handler is ``torch_npu.profiler.tensorboard_trace_handler``.
    *pinned by*: simulated-NPU imports of both modules with a 2.8-shaped and a 2.10-shaped
    ``torch_npu`` stand-in, and the helper's dispatch on both shapes.
    *when to remove the test*: when sglang drops torch-npu 2.8 support.

**Scheduler device-type check (schedule-stream alias check)**
    *target*: ``sglang.srt.managers.scheduler.Scheduler.run_event_loop``.
    *why the PR patched it*: the overlap scheduler compared ``stream.cuda_stream`` handles,
    which NPU streams do not have.
    *0.5.23*: already correct: the alias check runs only under ``is_cuda() or is_hip``; other
    accelerators skip it.
    *pinned by*: the real ``run_event_loop`` on a stand-in scheduler whose streams have no
    ``cuda_stream`` (a non-CUDA device with overlap on) reaches the event-loop dispatch.

**Disaggregation decode and dLLM scheduler**
    *target*: ``sglang.srt.disaggregation.decode`` (``_match_prefix_and_lock``) and
    ``sglang.srt.dllm.mixin.scheduler`` (``init_next_round_input`` callers).
    *why the PR patched it*: its encoder-prefix truncation lived in
    ``Req.init_next_round_input(model_config=...)``, so every caller had to pass the model
    config.
    *0.5.23 + this plugin*: no caller edit needed: ``mossvl_ascend.radix_prefix`` hooks
    ``match_kv_cache`` and reads the encoder length from the request. The HookRegistry rebinds
    the ``from ... import match_kv_cache`` copy in ``disaggregation/decode.py``.
    *pinned by*: ``tests/test_radix_prefix.py`` (the decode module's binding drops a partial
    encoder match).

**Optional Qwen3-ASR transcription adapter import**
    *target*: ``sglang.srt.entrypoints.openai.transcription_adapters``.
    *0.5.23*: still imports the Qwen3-ASR adapter unguarded; it fails only through
    ``models/qwen3.py``'s ``sgl_kernel_npu`` import, which ``mossvl_ascend.npu_imports``
    unblocks, so the adapter needs no separate guard (pinned in ``tests/test_npu_imports.py``).
"""
