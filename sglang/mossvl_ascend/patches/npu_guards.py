"""The source PR's small NPU guards, checked against sglang 0.5.23: no patch is needed.

Each entry records the guard, why 0.5.23 already behaves, and the test that pins it (rendered into
``sglang/PATCHES.md``).
"""

from mossvl_ascend.patch_record import Verified

PATCHES = ()

VERIFIED = (
    Verified(
        title="Profiler patch API (torch-npu 2.8 `_apply_patches` vs 2.10+ `_apply_all_patches`)",
        target=(
            "sglang.srt.utils.profile_utils and sglang.srt.managers.scheduler_components.profiler_manager "
            "(import time, under is_npu())"
        ),
        why_it_was_patched="torch-npu 2.10 removed `_apply_patches`, so the unguarded call crashed sglang's import.",
        status=(
            "already correct: both modules call `sglang.srt.utils.torch_npu_patch_utils.apply_torch_npu_patches` "
            "(upstream PR #26356), which uses `_apply_patches(patches)` when present, else `_apply_all_patches()`."
        ),
        pinned_by=(
            "tests/test_npu_guards.py::test_profiler_modules_import_on_torch_npu_2_8",
            "tests/test_npu_guards.py::test_profiler_modules_import_on_torch_npu_2_10",
            "tests/test_npu_guards.py::test_patch_helper_prefers_the_2_8_api_and_rejects_neither",
        ),
    ),
    Verified(
        title="Scheduler schedule-stream alias check",
        target="sglang.srt.managers.scheduler.Scheduler.run_event_loop",
        why_it_was_patched="the overlap scheduler compared `stream.cuda_stream` handles, which NPU streams lack.",
        status="already correct: the alias check runs only under `is_cuda() or is_hip`; other devices skip it.",
        pinned_by=("tests/test_npu_guards.py::test_scheduler_skips_cuda_stream_alias_check_off_cuda",),
    ),
    Verified(
        title="Disaggregation decode and dLLM scheduler callers of `init_next_round_input`",
        target="sglang.srt.disaggregation.decode._match_prefix_and_lock, sglang.srt.dllm.mixin.scheduler",
        why_it_was_patched=(
            "the PR's encoder-prefix truncation lived in `Req.init_next_round_input(model_config=...)`, so every "
            "caller had to pass the model config."
        ),
        status=(
            "no caller edit needed: `mossvl_ascend.patches.radix_prefix` hooks `match_kv_cache` and reads the encoder "
            "length from the request; the HookRegistry rebinds the imported copy in `disaggregation/decode.py`."
        ),
        pinned_by=("tests/test_radix_prefix.py::test_imported_bindings_drop_partial_encoder_match",),
    ),
    Verified(
        title="Optional Qwen3-ASR transcription adapter import",
        target="sglang.srt.entrypoints.openai.transcription_adapters",
        why_it_was_patched="the adapter import chain fails on NPU when `sgl_kernel_npu` is incomplete.",
        status=(
            "still unguarded in 0.5.23, but it fails only through `models/qwen3.py`'s `sgl_kernel_npu` import, "
            "which `mossvl_ascend.patches.npu_imports` unblocks; no separate guard is needed."
        ),
        pinned_by=("tests/test_npu_imports.py::test_plugin_unblocks_startup_imports_with_one_warning",),
    ),
)
