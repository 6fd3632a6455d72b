"""Turn a MOSS-VL checkpoint into a W8A8_DYNAMIC checkpoint in Ascend ModelSlim's format, on CPU.

    python -m mossvl_ascend.quantize --checkpoint IN --out OUT [--keep-float PATTERN ...]

The decoder's linear weights become int8 with one symmetric scale per output channel (``scale = max|w| / 127``,
``w_q = round(w / scale)``): no calibration data, because W8A8_DYNAMIC quantizes the activations per token at run
time (``npu_dynamic_quant``). Everything else stays in the checkpoint's float dtype. Shard by shard: one input shard
and its output are in memory at a time; config, tokenizer, processor and remote-code files are copied.

Float by default, and why:
  vision tower and merger   ModelSlim's and llm-compressor's VLM recipes keep them float; the ViT runs once per
                            image/frame (prefill only), so INT8 would save little time and cost accuracy.
  embed_tokens              a table lookup, not a matmul: nothing for npu_quant_matmul to speed up.
  lm_head                   stock sglang always keeps it bf16 (vocab_parallel_embedding.py), and the logits are
                            the most quantization-sensitive output.
  norms, q_norm/k_norm      vectors, not matmuls.
  cross_attn_*_gate         scalars gating the cross-attention residual.
  separator_token           a learned vector appended after every frame.
  cross_attn.k_proj/v_proj  computed once per image over the vision states (not per decode step: no decode
                            saving), and the default ModelSlim adapter never calibrates them on vision states.

``--keep-float PATTERN`` (a regular expression searched in the layer name, e.g. ``down_proj``) keeps more decoder
linears float; sglang's fused q/k/v and gate/up must stay all-quantized or all-float.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from mossvl_ascend.modelslim_format import (
    DECODER_LINEAR,
    DESCRIPTION_FILE,
    DYNAMIC,
    FLOAT,
    FUSED_GROUPS,
)

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# The tiny checkpoint builder's fingerprint of the float build (moss_vl_reference/tiny_checkpoint.py): not ours.
BUILD_STAMP = "build_stamp.json"
FLOAT_BY_DEFAULT = (r"cross_attn\.[kv]_proj$",)
INT8_MAX = 127


def input_shards(checkpoint: Path) -> list[Path]:
    """The checkpoint's weight files: the index's shards (the published layout) or ``model.safetensors``."""
    index = checkpoint / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [checkpoint / name for name in names]
    single = checkpoint / "model.safetensors"
    if not single.is_file():
        raise SystemExit(f"{checkpoint}: neither {INDEX_FILE} nor model.safetensors")
    return [single]


def quantized_layers(names: list[str], keep_float: list[str]) -> set[str]:
    """The layers (tensor name without ``.weight``) to quantize: decoder linears not matched by a float pattern."""
    patterns = [re.compile(p) for p in (*FLOAT_BY_DEFAULT, *keep_float)]
    layers = {name[: -len(".weight")] for name in names if name.endswith(".weight")}
    chosen = {layer for layer in layers if DECODER_LINEAR.match(layer) and not any(p.search(layer) for p in patterns)}
    for layer in layers:
        _refuse_split_fused_group(layer, chosen)
    return chosen


def _refuse_split_fused_group(layer: str, chosen: set[str]) -> None:
    for fused, shards in FUSED_GROUPS.items():
        parent = fused.rpartition(".")[0]
        for shard in shards:
            if ".cross_attn." in layer or not layer.endswith(f".{parent}.{shard}"):
                continue
            base = layer[: -len(shard)]
            states = {s: base + s in chosen for s in shards}
            if len(set(states.values())) > 1:
                raise SystemExit(
                    f"--keep-float splits {base}{{{','.join(shards)}}}: sglang fuses them into one {fused} "
                    f"(all quantized or all float); quantized: {states}"
                )


def bf16_exact_scale(weight: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N, 1]`` per output channel: ``max|w| / 127`` rounded UP to a bfloat16 value. Stock loads
    ``weight_scale`` into a parameter of the model's dtype (ModelSlimW8A8Int8.create_weights), so a bf16 model would
    round it anyway; a bf16-exact scale makes ``w_q * scale`` the served weight exactly, and rounding up keeps
    ``|w| / scale <= 127`` (no clipping)."""
    largest = torch.maximum(weight.amax(dim=1, keepdim=True), -weight.amin(dim=1, keepdim=True))
    scale = largest.float() / INT8_MAX
    rounded = scale.to(torch.bfloat16)
    below = rounded.float() < scale
    # the next bfloat16 up of a non-negative value is its bit pattern plus one
    rounded[below] = (rounded[below].view(torch.int16) + 1).view(torch.bfloat16)
    return rounded.float()


def quantize_weight(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight`` int8 ``[N, K]``, ``weight_scale`` fp32 ``[N, 1]``, ``weight_offset`` fp32 zeros ``[N, 1]``. A
    row of zeros gets scale 0 and zeros. ``weight`` is consumed (divided in place when it is fp32): the caller's
    copy from the shard, so the peak stays at one tensor plus its int8 result."""
    scale = bf16_exact_scale(weight)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = weight.float().div_(divisor).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return {"weight": quantized, "weight_scale": scale, "weight_offset": torch.zeros_like(scale)}


def convert_shard(source: Path, target: Path, layers: set[str], progress: tqdm) -> dict[str, str]:
    """Write ``target`` from ``source``; return {tensor name: W8A8_DYNAMIC | FLOAT} for the tensors written."""
    written, types = {}, {}
    with safe_open(str(source), framework="pt") as shard:
        for name in shard.keys():
            tensor = shard.get_tensor(name)
            layer = name[: -len(".weight")] if name.endswith(".weight") else None
            if layer in layers:
                for suffix, value in quantize_weight(tensor).items():
                    written[f"{layer}.{suffix}"] = value
                    types[f"{layer}.{suffix}"] = DYNAMIC
            else:
                written[name], types[name] = tensor, FLOAT
            del tensor
            progress.update(1)
    save_file(written, str(target), metadata={"format": "pt"})
    return types


def description(types: dict[str, str]) -> dict:
    """quant_model_description.json: msmodelslim's metadata keys, then every tensor's type, sorted by name."""
    return {
        "version": "1.0.0",
        "model_quant_type": DYNAMIC,
        "group_size": 0,
        "metadata": {"producer": "mossvl_ascend.quantize", "weights": "per-output-channel symmetric int8"},
        **dict(sorted(types.items())),
    }


def copy_other_files(checkpoint: Path, out: Path) -> None:
    """Config, generation config, tokenizer, processor and remote code: every file but the weights."""
    for path in sorted(checkpoint.iterdir()):
        if path.is_file() and not path.name.endswith(".safetensors") and path.name not in (INDEX_FILE, BUILD_STAMP):
            shutil.copy2(path, out / path.name)


def convert(checkpoint: Path, out: Path, keep_float: list[str] = ()) -> dict:
    """Convert ``checkpoint`` into ``out``; returns the description written."""
    checkpoint, out = Path(checkpoint), Path(out)
    if out.resolve() == checkpoint.resolve():
        raise SystemExit("--out must differ from --checkpoint")
    shards = input_shards(checkpoint)
    names = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            names[shard] = list(handle.keys())
    layers = quantized_layers([n for shard_names in names.values() for n in shard_names], list(keep_float))
    if not layers:
        raise SystemExit(f"{checkpoint}: no decoder linear to quantize (model.language_model.layers.N.*_proj)")
    out.mkdir(parents=True, exist_ok=True)
    copy_other_files(checkpoint, out)
    types, weight_map = {}, {}
    total = sum(len(shard_names) for shard_names in names.values())
    with tqdm(total=total, desc="quantizing", unit="tensor", file=sys.stderr) as progress:
        for number, shard in enumerate(shards, start=1):
            target = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            shard_types = convert_shard(shard, out / target, layers, progress)
            types.update(shard_types)
            weight_map.update(dict.fromkeys(shard_types, target))
    sizes = sum((out / name).stat().st_size for name in set(weight_map.values()))
    index = {"metadata": {"total_size": sizes}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    written = description(types)
    (out / DESCRIPTION_FILE).write_text(json.dumps(written, indent=2) + "\n")
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mossvl_ascend.quantize",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--checkpoint", required=True, type=Path, help="a MOSS-VL checkpoint directory")
    parser.add_argument("--out", required=True, type=Path, help="the W8A8_DYNAMIC checkpoint directory to write")
    parser.add_argument(
        "--keep-float",
        action="append",
        default=[],
        metavar="PATTERN",
        help="also keep decoder linears whose name matches this regular expression float (repeatable), "
        "e.g. down_proj (the common accuracy trade-off: +2.4 GB on MOSS-VL-Instruct)",
    )
    args = parser.parse_args(argv)
    written = convert(args.checkpoint, args.out, args.keep_float)
    quantized = sum(1 for key, value in written.items() if key.endswith(".weight") and value == DYNAMIC)
    print(f"{args.out}: {quantized} linear layers W8A8_DYNAMIC, the rest float ({DESCRIPTION_FILE})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
