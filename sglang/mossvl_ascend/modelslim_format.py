"""ModelSlim's W8A8 checkpoint format for MOSS-VL, as data both its writer (:mod:`mossvl_ascend.quantize`) and its
loader patch (:mod:`mossvl_ascend.patches.modelslim_w8a8`) read. No sglang at import.

The format, as stock sglang 0.5.23 reads it (``layers/quantization/modelslim/modelslim.py``, ``ModelSlimConfig``;
``schemes/modelslim_w8a8_int8.py``) and msmodelslim 26.1.0 writes it: ``quant_model_description.json`` maps every
tensor name of the checkpoint (the published, Hugging Face names) to ``W8A8``, ``W8A8_DYNAMIC`` or ``FLOAT``, next to
a few metadata keys. A ``W8A8_DYNAMIC`` linear ``X`` holds ``X.weight`` int8 ``[N, K]``, ``X.weight_scale`` fp32
``[N, 1]`` and ``X.weight_offset`` (zeros, ``[N, 1]``); its activations are quantized per token at run time.
"""

from __future__ import annotations

import re

DESCRIPTION_FILE = "quant_model_description.json"
DYNAMIC, STATIC, FLOAT = "W8A8_DYNAMIC", "W8A8", "FLOAT"
# The layer's tensors besides ``weight`` a W8A8_DYNAMIC linear carries (ModelSlimW8A8Int8.create_weights).
DYNAMIC_COMPANIONS = ("weight_scale", "weight_offset")
# Keys of the description that are not tensor names (msmodelslim's writer, and what stock's loader adds).
METADATA_KEYS = frozenset(
    {"version", "model_quant_type", "metadata", "group_size", "optional", "ignore", "packed_modules_mapping"}
)

# The decoder's linears, by checkpoint name; the only tensors the converter may quantize. Each entry: the layer
# (without ``.weight``) is ``model.language_model.layers.<i>.<module>``.
DECODER_LINEAR = re.compile(
    r"^model\.language_model\.layers\.\d+\."
    r"(self_attn\.[qkvo]_proj|cross_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$"
)
# Linears sglang fuses into one module (stock loader.py's packed mapping on NPU): all or none quantized.
FUSED_GROUPS = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}

# Checkpoint name prefix -> sglang module prefix (models/moss_vl.py: the text model sits under
# ``model.language_model.model``, lm_head under ``model.language_model``; the vision tower keeps its names).
_LANGUAGE_MODEL = "model.language_model."
ENGINE_LANGUAGE_MODEL = "model.language_model.model."
ENGINE_LM_HEAD = "model.language_model.lm_head"


def is_tensor_entry(key: str, value) -> bool:
    """A description entry naming a tensor (not one of the metadata keys)."""
    return isinstance(value, str) and key not in METADATA_KEYS and key != "quant_method"


def engine_prefix(checkpoint_layer: str) -> str:
    """The sglang module prefix of a checkpoint layer name (``X`` of ``X.weight``), before fusing."""
    if checkpoint_layer == "lm_head":
        return ENGINE_LM_HEAD
    if checkpoint_layer.startswith(_LANGUAGE_MODEL) and not checkpoint_layer.startswith(ENGINE_LANGUAGE_MODEL):
        return ENGINE_LANGUAGE_MODEL + checkpoint_layer[len(_LANGUAGE_MODEL) :]
    return checkpoint_layer


def fused_module(engine_layer: str) -> str:
    """The sglang module a (possibly fused) layer lives in: ``...self_attn.q_proj`` -> ``...self_attn.qkv_proj``;
    the vision tower's ``attn.qkv`` is sglang's ``attn.qkv_proj``; any other layer is its own module."""
    for fused, shards in FUSED_GROUPS.items():
        parent, _, _ = fused.rpartition(".")
        for shard in shards:
            suffix = f".{parent}.{shard}"
            if engine_layer.endswith(suffix) and ".cross_attn." not in engine_layer:
                return engine_layer[: -len(suffix)] + f".{fused}"
    if engine_layer.startswith("model.visual.") and engine_layer.endswith(".attn.qkv"):
        return engine_layer + "_proj"
    return engine_layer


def engine_parameter(checkpoint_name: str) -> str:
    """The sglang parameter (``MossVLForConditionalGeneration.named_parameters()``) a checkpoint tensor loads
    into: its layer's module (fused where sglang fuses it) under the model's attributes ``visual`` and
    ``language_model`` (module prefixes carry a leading ``model.``), e.g. ``model.language_model.layers.0.self_attn
    .k_proj.weight_scale`` -> ``language_model.model.layers.0.self_attn.qkv_proj.weight_scale``."""
    layer, _, tensor = checkpoint_name.rpartition(".")
    return f"{fused_module(engine_prefix(layer))}.{tensor}".removeprefix("model.")
