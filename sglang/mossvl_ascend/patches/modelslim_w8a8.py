"""MOSS-VL W8A8_DYNAMIC checkpoints (Ascend ModelSlim's format) load exactly, or start-up stops with one line.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``). The format and the name mapping:
:mod:`mossvl_ascend.modelslim_format`.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.modelslim_format import (
    DESCRIPTION_FILE,
    DYNAMIC,
    DYNAMIC_COMPANIONS,
    ENGINE_LANGUAGE_MODEL,
    ENGINE_LM_HEAD,
    STATIC,
    engine_parameter,
    engine_prefix,
    fused_module,
    is_tensor_entry,
)
from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch

# What stock's model loader adds for ModelSlim on NPU only (model_loader/loader.py, ``_get_quantization_config``),
# restricted to MOSS-VL's fused linears: the decoder's q/k/v and gate/up, the vision tower's qkv.
MOSS_VL_PACKED_MODULES = {
    "model": {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]},
    "visual": {"qkv_proj": ["qkv"]},
}


class ModelSlimCheckpointRefused(ValueError):
    """A ModelSlim checkpoint MOSS-VL would load wrongly; the message is one line naming the layer."""


def is_modelslim(quant_config) -> bool:
    return quant_config is not None and quant_config.get_name() == "modelslim"


def checkpoint_entries(description: dict) -> dict[str, str]:
    """The description's tensor entries under the checkpoint's names (the aliases this patch adds left out)."""
    return {
        key: value
        for key, value in description.items()
        if is_tensor_entry(key, value) and not key.startswith((ENGINE_LANGUAGE_MODEL, ENGINE_LM_HEAD + "."))
    }


def dynamic_layers(description: dict) -> list[str]:
    """Checkpoint layers (``X`` of ``X.weight``) the description marks W8A8_DYNAMIC."""
    return sorted(
        key[: -len(".weight")]
        for key, value in checkpoint_entries(description).items()
        if key.endswith(".weight") and value == DYNAMIC
    )


def adopt_checkpoint_names(quant_config) -> None:
    """Make stock's ModelSlim lookups find MOSS-VL's layers: alias every language-model entry under sglang's name
    (``model.language_model.layers.N`` -> ``model.language_model.model.layers.N``, ``lm_head`` ->
    ``model.language_model.lm_head``) and declare the fused linears on every platform. Static W8A8 is refused."""
    description = quant_config.quant_description
    entries = checkpoint_entries(description)
    static = sorted(key for key, value in entries.items() if value == STATIC and key.endswith(".weight"))
    if static:
        raise ModelSlimCheckpointRefused(
            f"MOSS-VL INT8: {static[0][: -len('.weight')]} is W8A8 (static, calibrated): not supported yet; "
            "convert the float checkpoint with `python -m mossvl_ascend.quantize` (W8A8_DYNAMIC)"
        )
    for key, value in entries.items():
        layer, _, tensor = key.rpartition(".")
        description.setdefault(f"{engine_prefix(layer)}.{tensor}", value)
    quant_config.update_packed_modules_mapping(MOSS_VL_PACKED_MODULES)


def refuse_what_would_load_wrongly(model: torch.nn.Module, description: dict) -> None:
    """Every W8A8_DYNAMIC layer resolved to stock's ModelSlim linear method with its dynamic scheme, and every
    tensor the description names is a parameter of the model."""
    modules = dict(model.named_modules())
    for layer in dynamic_layers(description):
        module = modules.get(fused_module(engine_prefix(layer)).removeprefix("model."))
        if module is None:
            continue  # named below as a tensor the model does not have
        method = type(getattr(module, "quant_method", None)).__name__
        scheme = getattr(module, "scheme", None)
        if method != "ModelSlimLinearMethod" or not getattr(scheme, "is_dynamic", False):
            raise ModelSlimCheckpointRefused(
                f"MOSS-VL INT8: {layer} is W8A8_DYNAMIC but would load with {method} (unquantized)"
            )
    parameters = dict(model.named_parameters())
    for key in sorted(checkpoint_entries(description)):
        if engine_parameter(key) not in parameters:
            raise ModelSlimCheckpointRefused(
                f"MOSS-VL INT8: {DESCRIPTION_FILE} names {key}, which the model does not have "
                f"(sglang parameter {engine_parameter(key)})"
            )


def quantized_moss_vl_init(original: Callable, model, *args, **kwargs):
    """AROUND hook on ``MossVLForConditionalGeneration.__init__``: with a ModelSlim config, the checkpoint's names
    are adopted before the layers are built, and the built model is checked."""
    quant_config = kwargs.get("quant_config", args[1] if len(args) > 1 else None)
    if not is_modelslim(quant_config):
        return original(model, *args, **kwargs)
    adopt_checkpoint_names(quant_config)
    original(model, *args, **kwargs)
    refuse_what_would_load_wrongly(model, quant_config.quant_description)


def checked_load_weights(original: Callable, model, weights: Iterable):
    """AROUND hook on ``MossVLForConditionalGeneration.load_weights``: an int8 tensor may only land in an int8
    parameter and an int8 parameter only receive int8 (stock copies either way, silently converting), and every
    W8A8_DYNAMIC layer must arrive with its weight, scale and offset."""
    if not is_modelslim(getattr(model, "quant_config", None)):
        return original(model, weights)
    parameters = dict(model.named_parameters())
    arrived = set()

    def watched():
        for name, tensor in weights:
            parameter = parameters.get(engine_parameter(name))
            if parameter is not None and (parameter.dtype == torch.int8) != (tensor.dtype == torch.int8):
                raise ModelSlimCheckpointRefused(
                    f"MOSS-VL INT8: {name} is {tensor.dtype} but its parameter {engine_parameter(name)} is "
                    f"{parameter.dtype} ({DESCRIPTION_FILE} and the weights disagree)"
                )
            arrived.add(name)
            yield name, tensor

    result = original(model, watched())
    for layer in dynamic_layers(model.quant_config.quant_description):
        for tensor in ("weight", *DYNAMIC_COMPANIONS):
            if f"{layer}.{tensor}" not in arrived:
                raise ModelSlimCheckpointRefused(
                    f"MOSS-VL INT8: {layer} is W8A8_DYNAMIC but the checkpoint has no {layer}.{tensor}"
                )
    return result


_WHY = (
    "stock sglang 0.5.23 loads a MOSS-VL ModelSlim checkpoint into garbage without an error: `ModelSlimConfig` looks "
    "each layer up by its sglang prefix (`model.language_model.model.layers.N...`) while the description uses the "
    "checkpoint's names (`model.language_model.layers.N...`), and a missing key only logs a warning "
    "(`modelslim.py` `get_linear_scheme`), so every decoder linear is built unquantized; `load_weights` then copies "
    "the int8 weights into bf16 parameters and skips their scales. The fused q/k/v and gate/up mapping is declared "
    "only on NPU (`model_loader/loader.py`)."
)
PATCHES = (
    Patch(
        title="MOSS-VL ModelSlim names: every W8A8_DYNAMIC layer gets stock's ModelSlim linear method",
        target="sglang.srt.models.moss_vl.MossVLForConditionalGeneration.__init__",
        kind=HookType.AROUND,
        hook=quantized_moss_vl_init,
        platforms=ON_NPU_AND_CPU,
        why=_WHY,
        how=(
            "with a ModelSlim config only: alias the description's language-model entries under sglang's names, "
            "declare MOSS-VL's fused linears on every platform, refuse static W8A8 (not supported yet), then check "
            "the built model: every described tensor is a parameter, every W8A8_DYNAMIC layer has "
            "`ModelSlimLinearMethod` (else one line naming the layer stops start-up)"
        ),
        upstream="open in sglang 0.5.23 (`models/moss_vl.py` has no ModelSlim name mapping)",
        remove_when="stock's MOSS-VL maps ModelSlim names itself and refuses a W8A8 layer it cannot quantize",
    ),
    Patch(
        title="MOSS-VL ModelSlim weights: int8 only into int8 parameters, scales present",
        target="sglang.srt.models.moss_vl.MossVLForConditionalGeneration.load_weights",
        kind=HookType.AROUND,
        hook=checked_load_weights,
        platforms=ON_NPU_AND_CPU,
        why=(
            "stock's `load_weights` copies an int8 tensor into a float parameter (and a float one into an int8 "
            "parameter) without a word, and skips a tensor it has no parameter for at debug level: a wrong "
            "description or a missing scale serves garbage"
        ),
        how=(
            "with a ModelSlim config only: watch the weights on their way into stock's loader; an int8/float "
            "mismatch with the target parameter, or a W8A8_DYNAMIC layer without weight, weight_scale and "
            "weight_offset, stops start-up with one line naming the tensor"
        ),
        upstream="open in sglang 0.5.23",
        remove_when="stock's loader checks quantized dtypes against the parameters",
    ),
)
