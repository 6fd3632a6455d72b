"""Regression pins for the source PR's small NPU guards that sglang 0.5.23 already handles.

See ``mossvl_ascend/patches/npu_guards.py`` for the catalog. Stand-ins are labelled where used; the
simulated-NPU import harness is ``tests/support/simulated_npu.py``.
"""

import contextlib
import functools
from types import SimpleNamespace

import pytest

from support.simulated_npu import run_simulated_npu
from support.together import started_together

PROFILER_MODULES = [
    "sglang.srt.utils.profile_utils",
    "sglang.srt.managers.scheduler_components.profiler_manager",
]
PROFILER_PATCH_NAMES = [
    "profiler.profile",
    "profiler.ProfilerActivity.CUDA",
    "profiler.ProfilerActivity.CPU",
]


@pytest.fixture(scope="module")
def profiler_imports(tmp_path_factory):
    """The profiler modules imported on each torch-npu stand-in's patch API, in fresh interpreters started at once."""
    runs = {
        api: functools.partial(
            run_simulated_npu, tmp_path_factory.mktemp(api), PROFILER_MODULES, False, torch_npu_patch_api=api
        )
        for api in ("apply_patches", "apply_all_patches")
    }
    with started_together(runs) as futures:
        yield futures


def test_profiler_modules_import_on_torch_npu_2_8(profiler_imports):
    """torch-npu 2.8 stand-in: only ``_apply_patches(patches)`` exists, and gets the list."""
    report = profiler_imports["apply_patches"].result()
    assert report["imported"] == {name: "ok" for name in PROFILER_MODULES}
    assert report["patch_calls"] == [["_apply_patches", PROFILER_PATCH_NAMES]] * 2


def test_profiler_modules_import_on_torch_npu_2_10(profiler_imports):
    """torch-npu 2.10+ stand-in: only ``_apply_all_patches()`` exists."""
    report = profiler_imports["apply_all_patches"].result()
    assert report["imported"] == {name: "ok" for name in PROFILER_MODULES}
    assert report["patch_calls"] == [["_apply_all_patches"]] * 2


def test_patch_helper_prefers_the_2_8_api_and_rejects_neither():
    from sglang.srt.utils.torch_npu_patch_utils import apply_torch_npu_patches

    calls = []
    both = SimpleNamespace(
        _apply_patches=lambda patches: calls.append(("patches", patches)),
        _apply_all_patches=lambda: calls.append(("all",)),
    )
    apply_torch_npu_patches(both, [["a", 1]])
    assert calls == [("patches", [["a", 1]])]
    with pytest.raises(AttributeError):
        apply_torch_npu_patches(SimpleNamespace(), [])


class StreamWithoutCudaHandle:
    """Stand-in accelerator stream: like an NPU stream, it has no ``cuda_stream`` handle."""


def test_scheduler_skips_cuda_stream_alias_check_off_cuda(monkeypatch):
    from sglang.srt.managers import scheduler as scheduler_module

    dispatched = []
    monkeypatch.setattr(scheduler_module, "is_cuda", lambda: False)  # stand-in: an NPU host
    monkeypatch.setattr(scheduler_module, "_is_hip", False)
    monkeypatch.setattr(scheduler_module, "dispatch_event_loop", dispatched.append)
    stand_in = SimpleNamespace(
        device="npu",
        enable_overlap=True,
        schedule_stream=StreamWithoutCudaHandle(),
        forward_stream=StreamWithoutCudaHandle(),
        device_module=SimpleNamespace(StreamContext=lambda stream: contextlib.nullcontext()),
        metrics_reporter=SimpleNamespace(start_scheduler_time_accounting=lambda: None),
    )
    scheduler_module.Scheduler.run_event_loop(stand_in)
    assert dispatched == [stand_in]
