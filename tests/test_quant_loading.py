"""A W8A8_DYNAMIC MOSS-VL (our converter's output) in stock sglang's ModelSlim path, in-process (issue 53).

The model is stock's ``MossVLForConditionalGeneration`` built with stock's ``ModelSlimConfig`` read from the
converted checkpoint's ``quant_model_description.json`` (as ``get_quant_config`` builds it on this CPU host: no
packed mapping), then loaded through its own ``load_weights`` and each layer's ``process_weights_after_loading``.

Oracles: the description (how many layers must resolve to the ModelSlim linear method; stock alone resolves 0), the
converted tensors (what each parameter must hold), the torch_npu documentation's formulas evaluated in fp64 for the
STAND-IN ops, and an fp64 product of the very int8 tensors and scales the layer used.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from moss_vl_reference.tiny_checkpoint import build_or_reuse
from mossvl_ascend import quantize
from mossvl_ascend.modelslim_format import DESCRIPTION_FILE, DYNAMIC, STATIC, engine_prefix, fused_module
from mossvl_ascend.patches import modelslim_w8a8
from mossvl_ascend.patches.modelslim_w8a8 import ModelSlimCheckpointRefused
from support.hooks import patches_applied
from support.npu_layers import stock_npu_branches

LAYER = "model.language_model.layers.0.self_attn"


@pytest.fixture(scope="module")
def int8_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("int8-tiny")
    quantize.convert(build_or_reuse("tiny"), out)
    return out


def description_of(checkpoint) -> dict:
    return json.loads((checkpoint / DESCRIPTION_FILE).read_text())


def converted_tensors(checkpoint) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def build_model(checkpoint, description: dict | None = None):
    """Stock's MOSS-VL in bf16 with stock's ModelSlimConfig, as the CPU loader makes it (no packed mapping)."""
    from sglang.srt.layers.quantization.modelslim.modelslim import ModelSlimConfig
    from sglang.srt.models.moss_vl import MossVLForConditionalGeneration
    from sglang.test.layer_ut_utils import init_single_process_dist
    from transformers import AutoConfig

    from serving.launch import free_port

    init_single_process_dist(master_port=free_port())
    quant_config = ModelSlimConfig.from_config(
        dict(description or description_of(checkpoint), packed_modules_mapping={})
    )
    config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=True)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return MossVLForConditionalGeneration(config, quant_config=quant_config).eval()
    finally:
        torch.set_default_dtype(previous)


def load(model, tensors: dict):
    model.load_weights(iter(tensors.items()))
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
    return model


def modelslim_modules(model) -> dict[str, torch.nn.Module]:
    return {
        name: module
        for name, module in model.named_modules()
        if type(getattr(module, "quant_method", None)).__name__ == "ModelSlimLinearMethod"
    }


def expected_modules(description: dict) -> set[str]:
    """sglang modules holding a W8A8_DYNAMIC layer of the description (q/k/v and gate/up fused)."""
    return {
        fused_module(engine_prefix(key[: -len(".weight")])).removeprefix("model.")
        for key, value in description.items()
        if key.endswith(".weight") and value == DYNAMIC
    }


@pytest.fixture(scope="module")
def loaded(int8_checkpoint):
    with patches_applied(*modelslim_w8a8.PATCHES):
        yield load(build_model(int8_checkpoint), converted_tensors(int8_checkpoint))


def test_stock_alone_resolves_no_layer_to_the_modelslim_method(int8_checkpoint, caplog):
    with caplog.at_level(logging.WARNING):
        model = build_model(int8_checkpoint)
    assert modelslim_modules(model) == {}
    assert "Unsupported Linear modelslim scheme" in caplog.text  # stock's only trace: a warning per layer


def test_every_w8a8_dynamic_layer_resolves_to_the_modelslim_method(loaded, int8_checkpoint):
    description = description_of(int8_checkpoint)
    expected = expected_modules(description)
    assert len(expected) == 32  # tiny: 6 self-attn x (qkv, o) + 2 cross-attn x (q, o) + 8 x (gate_up, down)
    resolved = modelslim_modules(loaded)
    assert set(resolved) == expected
    assert all(module.scheme.is_dynamic for module in resolved.values())
    for name, module in loaded.named_modules():
        if hasattr(module, "quant_method") and name not in expected and "embed" not in name:
            assert type(module.quant_method).__name__ != "ModelSlimLinearMethod", name


def test_parameters_hold_the_converted_int8_weights_and_scales(loaded, int8_checkpoint):
    tensors = converted_tensors(int8_checkpoint)
    qkv = loaded.language_model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int8 and qkv.weight.shape == (128, 128 + 64 + 64)  # [K, N] after loading
    expected = torch.cat([tensors[f"{LAYER}.{p}_proj.weight"] for p in "qkv"]).T
    assert torch.equal(qkv.weight, expected)
    scales = torch.cat([tensors[f"{LAYER}.{p}_proj.weight_scale"] for p in "qkv"]).flatten()
    assert qkv.weight_scale.dtype == torch.bfloat16 and qkv.weight_scale.shape == (256,)
    assert torch.equal(qkv.weight_scale.float(), scales)  # bf16-exact scales survive stock's bf16 parameter
    cross = loaded.language_model.model.layers[1].cross_attn
    assert cross.q_proj.weight.dtype == torch.int8
    assert cross.k_proj.weight.dtype == torch.bfloat16  # float by default


def bf16_ulp(reference: torch.Tensor) -> torch.Tensor:
    """Spacing of bfloat16 numbers at ``reference`` (8 significant bits)."""
    _, exponent = torch.frexp(reference.abs().clamp_min(2.0**-126))
    return torch.ldexp(torch.ones_like(reference), exponent - 8)


@pytest.mark.parametrize("module_path", ["model.layers.0.self_attn.qkv_proj", "model.layers.2.mlp.down_proj"])
def test_quantized_linear_within_one_bf16_ulp_of_fp64_on_the_same_int8_tensors(loaded, module_path):
    module = loaded.language_model.get_submodule(module_path)
    x = torch.randn(5, module.weight.shape[0], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with stock_npu_branches() as (fake, _):
        quantized = []
        stand_in = fake.npu_dynamic_quant

        def recorded(*args, **kwargs):
            quantized.append(stand_in(*args, **kwargs))
            return quantized[-1]

        fake.npu_dynamic_quant = recorded
        out, _ = module(x)
    (x_q, x_scale) = quantized[0]
    reference = (x_q.double() @ module.weight.double()) * module.weight_scale.double() * x_scale.double()[:, None]
    assert out.dtype == torch.bfloat16
    assert bool(((out.double() - reference).abs() <= bf16_ulp(reference)).all())
    # and the activations were quantized as the torch_npu page writes it: scale = rowMax|x| / 127, y = round(x/s)
    assert torch.equal(x_scale, x.float().abs().amax(1) / 127)
    assert torch.equal(x_q.double(), torch.round(x.double() / x_scale.double()[:, None]))


# ------------------------------------------------------------------------------------------------ refusals


def refusal(checkpoint, description=None, tensors=None) -> str:
    with patches_applied(*modelslim_w8a8.PATCHES), pytest.raises(ModelSlimCheckpointRefused) as caught:
        load(build_model(checkpoint, description), tensors if tensors is not None else converted_tensors(checkpoint))
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_description_naming_a_tensor_the_model_lacks_is_refused(int8_checkpoint):
    description = description_of(int8_checkpoint)
    description[f"{LAYER}.x_proj.weight"] = DYNAMIC
    message = refusal(int8_checkpoint, description)
    assert f"{LAYER}.x_proj.weight" in message and "does not have" in message


def test_a_missing_scale_is_refused(int8_checkpoint):
    tensors = converted_tensors(int8_checkpoint)
    del tensors[f"{LAYER}.o_proj.weight_scale"]
    assert f"no {LAYER}.o_proj.weight_scale" in refusal(int8_checkpoint, tensors=tensors)


def test_a_w8a8_layer_left_float_is_refused(int8_checkpoint):
    tensors = converted_tensors(int8_checkpoint)
    tensors[f"{LAYER}.o_proj.weight"] = torch.randn(128, 128)
    message = refusal(int8_checkpoint, tensors=tensors)
    assert f"{LAYER}.o_proj.weight is torch.float32" in message and "torch.int8" in message


def test_an_int8_tensor_for_a_float_layer_is_refused(int8_checkpoint):
    description = description_of(int8_checkpoint)
    description[f"{LAYER}.o_proj.weight"] = "FLOAT"
    del description[f"{LAYER}.o_proj.weight_scale"], description[f"{LAYER}.o_proj.weight_offset"]
    message = refusal(int8_checkpoint, description)
    assert f"{LAYER}.o_proj.weight is torch.int8" in message and "bfloat16" in message


def test_static_w8a8_is_refused_as_not_supported_yet(int8_checkpoint):
    description = description_of(int8_checkpoint)
    description[f"{LAYER}.o_proj.weight"] = STATIC
    message = refusal(int8_checkpoint, description)
    assert f"{LAYER}.o_proj is W8A8 (static" in message and "not supported yet" in message


def test_a_layer_stock_would_leave_unquantized_is_refused(int8_checkpoint, monkeypatch):
    """The check behind the aliases: were a W8A8_DYNAMIC layer still unresolved, start-up stops."""
    monkeypatch.setattr(modelslim_w8a8, "MOSS_VL_PACKED_MODULES", {})  # stock's CPU state: no fused mapping
    message = refusal(int8_checkpoint)
    assert "model.language_model.layers.0.mlp.gate_proj is W8A8_DYNAMIC but would load with Unquantized" in message


# ------------------------------------------------------------------------------------------------ stand-ins


def test_dynamic_quant_stand_in_refuses_what_the_op_refuses():
    with stock_npu_branches() as (fake, _):
        with pytest.raises(ValueError, match="float16 or bfloat16"):
            fake.npu_dynamic_quant(torch.randn(2, 8))
        with pytest.raises(ValueError, match="2-8"):
            fake.npu_dynamic_quant(torch.randn(8).to(torch.bfloat16))


def test_quant_matmul_stand_in_refuses_what_table_2_excludes():
    x = torch.randint(-127, 128, (3, 16), dtype=torch.int8)
    w = torch.randint(-127, 128, (16, 4), dtype=torch.int8)
    pertoken = torch.rand(3)
    with stock_npu_branches() as (fake, _):
        # what stock passes for an fp16 model: weight_scale in fp16 (the parameter's dtype)
        with pytest.raises(ValueError, match="scale torch.float16"):
            fake.npu_quant_matmul(x, w, torch.rand(4).half(), pertoken_scale=pertoken, output_dtype=torch.float16)
        with pytest.raises(ValueError, match="needs pertoken_scale"):
            fake.npu_quant_matmul(x, w, torch.rand(4), output_dtype=torch.float16)
        with pytest.raises(ValueError, match="int8"):
            fake.npu_quant_matmul(x.float(), w, torch.rand(4), output_dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="k differs"):
            fake.npu_quant_matmul(x, w[:8], torch.rand(4), output_dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="pertoken_scale"):
            fake.npu_quant_matmul(x, w, torch.rand(4), pertoken_scale=pertoken[:2], output_dtype=torch.bfloat16)
        out = fake.npu_quant_matmul(x, w, torch.rand(4), pertoken_scale=pertoken, output_dtype=torch.float16)
        assert out.dtype == torch.float16 and out.shape == (3, 4)


def test_quant_matmul_stand_in_accumulates_exactly_at_the_largest_k():
    """k = 65535 of 127 * -128 products: 1.07e9, beyond fp32's integers, exact in the stand-in."""
    k = 65535
    x = torch.full((1, k), 127, dtype=torch.int8)
    w = torch.full((k, 1), -128, dtype=torch.int8)
    with stock_npu_branches() as (fake, _):
        out = fake.npu_quant_matmul(x, w, torch.ones(1), pertoken_scale=torch.ones(1), output_dtype=torch.bfloat16)
    assert out.item() == torch.tensor(127.0 * -128 * k).to(torch.bfloat16).item()
