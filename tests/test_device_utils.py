"""device_utils on every branch: NPU, CUDA and CPU are simulated with labelled stand-ins.

The NPU stand-in is an empty ``torch_npu`` module plus a ``torch.npu`` namespace whose functions answer like
a 2-card Ascend machine; the CUDA stand-in patches ``torch.cuda``'s query functions. Nothing here touches a
real accelerator.
"""

import logging
import sys
import types

import pytest
import torch

import device_utils


@pytest.fixture(autouse=True)
def fresh_detection():
    device_utils.detect_device_type.cache_clear()
    yield
    device_utils.detect_device_type.cache_clear()


@pytest.fixture
def no_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # `import torch_npu` -> ModuleNotFoundError


@pytest.fixture
def simulated_npu(monkeypatch):
    """Stand-in for torch_npu on a 2-card Ascend 910B machine."""
    synchronized = []
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    npu = types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 2,
        get_device_name=lambda index=0: f"Ascend910B (stand-in {index})",
        synchronize=lambda: synchronized.append("npu"),
    )
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    return synchronized


@pytest.fixture
def simulated_cuda(monkeypatch, no_torch_npu):
    """Stand-in for a 4-GPU CUDA machine with the FlashAttention-2/3 packages installed."""
    synchronized = []
    monkeypatch.setattr(device_utils, "flash_kernel_installed", lambda implementation: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: f"H200 (stand-in {index})")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synchronized.append("cuda"))
    return synchronized


@pytest.fixture
def plain_cpu(monkeypatch, no_torch_npu):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_simulated_npu_is_detected_with_npu_defaults(simulated_npu):
    assert device_utils.get_device_type() == "npu"
    assert device_utils.is_npu() and not device_utils.is_cuda()
    assert device_utils.get_device_count() == 2
    assert device_utils.get_device_name(1) == "Ascend910B (stand-in 1)"
    assert device_utils.get_device_str(1) == "npu:1"
    assert device_utils.visible_devices_env_var() == "ASCEND_RT_VISIBLE_DEVICES"
    assert device_utils.get_default_attn_impl() == "eager"
    device_utils.synchronize()
    assert simulated_npu == ["npu"]


def test_npu_wins_over_cuda(simulated_npu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_utils.get_device_type() == "npu"


def test_simulated_cuda_is_detected_with_cuda_defaults(simulated_cuda):
    assert device_utils.get_device_type() == "cuda"
    assert device_utils.is_cuda() and not device_utils.is_npu()
    assert device_utils.get_device_count() == 4
    assert device_utils.get_device_name(0) == "H200 (stand-in 0)"
    assert device_utils.get_device_str(2) == "cuda:2"
    assert device_utils.visible_devices_env_var() == "CUDA_VISIBLE_DEVICES"
    assert device_utils.get_default_attn_impl() == "flash_attention_2"
    device_utils.synchronize()
    assert simulated_cuda == ["cuda"]


def test_cpu_fallback(plain_cpu):
    assert device_utils.get_device_type() == "cpu"
    assert not device_utils.is_npu() and not device_utils.is_cuda()
    assert device_utils.get_device_count() == 0
    assert device_utils.get_device_str(3) == "cpu"
    assert device_utils.visible_devices_env_var() is None
    assert device_utils.get_default_attn_impl() == "sdpa"
    assert isinstance(device_utils.get_device_name(), str) and device_utils.get_device_name()
    device_utils.synchronize()  # no-op, must not raise


def test_absent_torch_npu_is_silent(plain_cpu, caplog):
    with caplog.at_level(logging.WARNING, logger="device_utils"):
        assert device_utils.get_device_type() == "cpu"
    assert caplog.records == []


def test_torch_npu_failing_to_import_warns_and_falls_back(plain_cpu, monkeypatch, tmp_path, caplog):
    broken = tmp_path / "torch_npu"
    broken.mkdir()
    (broken / "__init__.py").write_text(
        "raise ImportError('libascendcl.so: cannot open shared object file (stand-in for a broken CANN)')\n"
    )
    monkeypatch.delitem(sys.modules, "torch_npu")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="device_utils"):
        assert device_utils.get_device_type() == "cpu"
    assert len(caplog.records) == 1
    assert "libascendcl.so" in caplog.records[0].getMessage()


def test_torch_npu_without_device_warns_and_falls_back(simulated_npu, monkeypatch, caplog):
    monkeypatch.setattr(torch.npu, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="device_utils"):
        assert device_utils.get_device_type() == "cpu"
    assert len(caplog.records) == 1
    assert "no NPU device" in caplog.records[0].getMessage()


def test_torch_npu_query_raising_warns_and_falls_back(simulated_npu, monkeypatch, caplog):
    def broken_query():
        raise RuntimeError("drvErr 507033 (stand-in)")

    monkeypatch.setattr(torch.npu, "is_available", broken_query)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="device_utils"):
        assert device_utils.get_device_type() == "cpu"
    assert "drvErr 507033" in caplog.records[0].getMessage()


@pytest.mark.parametrize("requested", [None, "auto"])
@pytest.mark.parametrize(
    "platform_fixture, expected",
    [("simulated_npu", "eager"), ("simulated_cuda", "flash_attention_2"), ("plain_cpu", "sdpa")],
)
def test_resolve_auto_gives_device_default(request, platform_fixture, expected, requested):
    request.getfixturevalue(platform_fixture)
    assert device_utils.resolve_attn_impl(requested) == expected


@pytest.mark.parametrize("flash", ["flash_attention_2", "flash_attention_3"])
@pytest.mark.parametrize("platform_fixture, expected", [("simulated_npu", "eager"), ("plain_cpu", "sdpa")])
def test_flash_attention_without_cuda_falls_back_with_one_warning(request, platform_fixture, expected, flash, caplog):
    request.getfixturevalue(platform_fixture)
    with caplog.at_level(logging.WARNING, logger="device_utils"):
        assert device_utils.resolve_attn_impl(flash) == expected
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and flash in warnings[0] and expected in warnings[0]


@pytest.mark.parametrize("flash", ["flash_attention_2", "flash_attention_3"])
def test_flash_attention_kept_on_cuda(simulated_cuda, flash):
    assert device_utils.resolve_attn_impl(flash) == flash


@pytest.mark.parametrize("flash", ["flash_attention_2", "flash_attention_3"])
def test_cuda_without_the_flash_package_uses_sdpa(simulated_cuda, monkeypatch, caplog, flash):
    installed = {"flash_attention_2": False, "flash_attention_3": False}
    monkeypatch.setattr(device_utils, "flash_kernel_installed", installed.__getitem__)
    assert device_utils.resolve_attn_impl("auto") == "sdpa"
    with caplog.at_level(logging.WARNING, logger="device_utils"):
        assert device_utils.resolve_attn_impl(flash) == "sdpa"
    (warning,) = [r.getMessage() for r in caplog.records]
    assert flash in warning and device_utils.FLASH_ATTN_PACKAGES[flash] in warning and "'sdpa'" in warning


def test_flash_packages_are_looked_up_by_name(monkeypatch):
    looked_up = []
    monkeypatch.setattr(device_utils.importlib.util, "find_spec", lambda name: looked_up.append(name))
    assert not device_utils.flash_kernel_installed("flash_attention_2")
    assert not device_utils.flash_kernel_installed("flash_attention_3")
    assert looked_up == ["flash_attn", "flash_attn_interface"]


@pytest.mark.parametrize("explicit", ["eager", "sdpa"])
def test_explicit_portable_choice_is_kept_on_npu(simulated_npu, explicit):
    assert device_utils.resolve_attn_impl(explicit) == explicit


def test_unknown_implementation_lists_valid_names(plain_cpu):
    with pytest.raises(ValueError) as excinfo:
        device_utils.resolve_attn_impl("flash_attn_9000")
    message = str(excinfo.value)
    assert "flash_attn_9000" in message
    for name in ("auto", *device_utils.ATTN_IMPLEMENTATIONS):
        assert name in message


def test_describe_names_device_and_default(simulated_npu):
    line = device_utils.describe()
    assert "device=npu" in line and "count=2" in line and "Ascend910B (stand-in 0)" in line
    assert "default_attn_implementation=eager" in line and "ASCEND_RT_VISIBLE_DEVICES" in line


def test_never_installs_a_flash_attn_stub(simulated_npu):
    device_utils.resolve_attn_impl("flash_attention_2")
    device_utils.describe()
    assert "flash_attn" not in sys.modules


@pytest.mark.parametrize(
    ("machine", "expected"), [("simulated_npu", "npu:0"), ("simulated_cuda", "auto"), ("plain_cpu", "cpu")]
)
def test_patch_hf_device_map_defaults_per_device_and_keeps_an_explicit_map(request, machine, expected):
    request.getfixturevalue(machine)
    assert device_utils.patch_hf_device_map() == expected
    assert device_utils.patch_hf_device_map("cuda:1") == "cuda:1"
    explicit = {"": "npu:1"}
    assert device_utils.patch_hf_device_map(explicit) is explicit


def test_print_device_info_lists_the_devices_and_the_attention_default(simulated_npu, capsys):
    device_utils.print_device_info()
    assert capsys.readouterr().out.splitlines() == [
        "[device_utils] device_type=npu device_count=2",
        "[device_utils]   device 0: Ascend910B (stand-in 0)",
        "[device_utils]   device 1: Ascend910B (stand-in 1)",
        "[device_utils] default attn_impl=eager",
    ]
