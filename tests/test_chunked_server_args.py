"""MOSS-VL keeps chunked prefill on npu and cpu with the radix cache on (stock resolves -1); CUDA stays stock.

Same harness as ``test_server_args`` (real ``prepare_server_args`` + resolution, the plugin's server-args hook
applied as sglang's loader applies it, the NPU memory probe a 64 GiB stand-in). The oracle for the defaults is
stock resolution itself: the chunk size sglang picks for a plain text model (Llama) on the same device.
"""

import json

import pytest

from test_server_args import model_dir, npu_memory_stand_in, plugin_hook_applied, resolve  # noqa: F401 (fixtures)


@pytest.fixture
def text_model_dir(tmp_path):
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256,
        "max_position_embeddings": 512,
    }  # fmt: skip
    path = tmp_path / "text-model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def npu_radix_opt_in(monkeypatch):
    monkeypatch.setenv("MOSSVL_NPU_ENABLE_RADIX_CACHE", "1")


@pytest.mark.parametrize("device", ["npu", "cpu"])
def test_default_chunk_size_is_the_stock_device_default(
    model_dir, text_model_dir, npu_memory_stand_in, npu_radix_opt_in, device
):
    moss_vl = resolve(model_dir, "--device", device).chunked_prefill_size
    text_model = resolve(text_model_dir, "--device", device).chunked_prefill_size
    assert moss_vl == text_model > 0


@pytest.mark.parametrize("device", ["npu", "cpu"])
def test_explicit_chunk_size_and_mixed_chunks_are_kept(model_dir, npu_memory_stand_in, npu_radix_opt_in, device):
    view = resolve(model_dir, "--device", device, "--chunked-prefill-size", "256", "--enable-mixed-chunk")
    assert (view.chunked_prefill_size, view.enable_mixed_chunk) == (256, True)


def test_cuda_still_turns_chunked_prefill_off(model_dir):
    assert resolve(model_dir, "--device", "cuda", "--chunked-prefill-size", "256").chunked_prefill_size == -1


@pytest.mark.parametrize("argv", [["--device", "npu"], ["--device", "cpu", "--disable-radix-cache"]], ids=["npu", "cpu"])
def test_chunked_prefill_stays_off_without_the_radix_cache(model_dir, npu_memory_stand_in, argv):
    # NPU disables the radix cache by default; a continuing chunk of a vision request fails there.
    view = resolve(model_dir, *argv, "--chunked-prefill-size", "256")
    assert (view.disable_radix_cache, view.chunked_prefill_size) == (True, -1)
