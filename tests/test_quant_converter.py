"""The W8A8_DYNAMIC converter (``python -m mossvl_ascend.quantize``) on both checkpoint layouts we load (issue 53).

Oracles: the format as stock sglang 0.5.23 reads it (``ModelSlimW8A8Int8.create_weights``: ``weight`` int8 [N, K],
``weight_scale`` / ``weight_offset`` [N, 1]) and the float checkpoint itself: every int8 weight times its scale is
the float weight within half a quantization step, every float tensor is copied bit for bit. Peak memory is measured
on a synthetic four-shard checkpoint in a child process (``ru_maxrss``) against the same process doing nothing but
the imports.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moss_vl_reference.tiny_checkpoint import build_or_reuse
from mossvl_ascend import quantize
from mossvl_ascend.modelslim_format import DESCRIPTION_FILE, DYNAMIC, FLOAT

REPO_ROOT = Path(__file__).resolve().parents[1]
# What stays float in every MOSS-VL checkpoint, and the only linears that are quantized (checkpoint names).
ALWAYS_FLOAT = re.compile(
    r"^(lm_head\.weight|model\.language_model\.embed_tokens\.weight|model\.visual\..*|model\.separator_token"
    r"|.*norm.*|.*_gate|.*cross_attn\.[kv]_proj\.weight)$"
)
QUANTIZED = re.compile(
    r"^model\.language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|cross_attn\.[qo]_proj|mlp\.\w+_proj)$"
)


def float_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in quantize.input_shards(checkpoint):
        tensors.update(load_file(str(shard)))
    return tensors


def converted_tensors(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / quantize.INDEX_FILE).read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(index.values())):
        tensors.update(load_file(str(out / shard)))
    assert set(tensors) == set(index)
    return tensors


@pytest.fixture(scope="module", params=["tiny", "tiny-real-layout"])
def converted(request, tmp_path_factory):
    source = build_or_reuse(request.param)
    out = tmp_path_factory.mktemp(f"int8-{request.param}")
    quantize.convert(source, out)
    return source, out


def test_every_decoder_linear_is_int8_with_fp32_channel_scales_and_zero_offsets(converted):
    source, out = converted
    original, tensors = float_tensors(source), converted_tensors(out)
    layers = {name[: -len(".weight")] for name in original if QUANTIZED.match(name[: -len(".weight")])}
    layers = {layer for layer in layers if not re.search(r"cross_attn\.[kv]_proj$", layer)}
    assert layers
    for layer in layers:
        weight, scale, offset = (tensors[f"{layer}.{s}"] for s in ("weight", "weight_scale", "weight_offset"))
        rows, cols = original[f"{layer}.weight"].shape
        assert weight.dtype == torch.int8 and weight.shape == (rows, cols), layer
        assert scale.dtype == torch.float32 and scale.shape == (rows, 1), layer
        assert offset.dtype == torch.float32 and offset.shape == (rows, 1) and not offset.any(), layer
        assert int(weight.abs().max()) <= 127
        # stock rounds weight_scale into a bf16 parameter: the file's scale survives that exactly
        assert torch.equal(scale.to(torch.bfloat16).float(), scale), layer
        w = original[f"{layer}.weight"].double()
        step = scale.double()
        assert bool(((weight.double() * step - w).abs() <= step / 2 * (1 + 1e-6)).all()), layer
        # the scale is within one bf16 step above max|w| / 127: the grid is not wasted
        assert bool((step <= w.abs().amax(1, keepdim=True) / 127 * (1 + 2**-7)).all()), layer


def test_everything_else_is_copied_bit_for_bit_and_described_float(converted):
    source, out = converted
    original, tensors = float_tensors(source), converted_tensors(out)
    description = json.loads((out / DESCRIPTION_FILE).read_text())
    for name, tensor in original.items():
        layer = name[: -len(".weight")]
        if name in tensors and tensors[name].dtype != torch.int8:
            assert torch.equal(tensors[name], tensor), name
            assert description[name] == FLOAT, name
            assert not (QUANTIZED.match(layer) and not re.search(r"cross_attn\.[kv]_proj$", layer)), name
        else:
            assert not ALWAYS_FLOAT.match(name), f"{name} was quantized"
    assert {key for key in description if key not in ("version", "model_quant_type", "group_size", "metadata")} == set(
        tensors
    )
    assert description["model_quant_type"] == DYNAMIC
    assert {value for key, value in description.items() if key in tensors} <= {DYNAMIC, FLOAT}


def test_config_processor_and_code_files_are_copied(converted):
    source, out = converted
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.name not in (quantize.INDEX_FILE, quantize.BUILD_STAMP):
            assert (out / path.name).read_bytes() == path.read_bytes(), path.name
    assert not (out / quantize.BUILD_STAMP).exists()


def test_keep_float_keeps_matching_layers_float(tmp_path):
    written = quantize.convert(build_or_reuse("tiny"), tmp_path, keep_float=["down_proj"])
    down = [key for key in written if key.endswith("down_proj.weight")]
    assert down and all(written[key] == FLOAT for key in down)
    assert written["model.language_model.layers.0.mlp.gate_proj.weight"] == DYNAMIC


def test_keep_float_refuses_to_split_a_layer_sglang_fuses(tmp_path):
    with pytest.raises(SystemExit, match=r"splits .*self_attn\.\{q_proj,k_proj,v_proj\}.*qkv_proj"):
        quantize.convert(build_or_reuse("tiny"), tmp_path, keep_float=[r"self_attn\.k_proj"])


def test_help_says_why_each_float_part_stays_float():
    proc = subprocess.run(
        [sys.executable, "-m", "mossvl_ascend.quantize", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    for part in ("vision tower", "embed_tokens", "lm_head", "norms", "_gate", "separator_token", "k_proj/v_proj"):
        assert part in proc.stdout, part


# VmHWM (peak RSS) is reset after the imports (``clear_refs`` 5, Linux >= 4.0), so the figure is the conversion's.
MEMORY_PROBE = """
import re, sys
from pathlib import Path
from mossvl_ascend import quantize

def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))

Path("/proc/self/clear_refs").write_text("5")
before = status("VmRSS")
quantize.main(["--checkpoint", sys.argv[1], "--out", sys.argv[2]])
print("KIB", before, status("VmHWM"))
"""


def conversion_rss_kib(source: Path, out: Path) -> tuple[int, int]:
    """(RSS after the imports, peak RSS during the conversion) of a child process, KiB."""
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(source), str(out)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, peak = proc.stdout.split("KIB")[-1].split()
    return int(before), int(peak)


def test_peak_memory_is_bounded_by_one_shard(tmp_path):
    """Four 64 MiB shards of decoder linears: the converter's peak above its imports stays under 2 shards
    (the open shard's pages, its int8 output and scales), well under the 256 MiB it converts."""
    source, shard_mib, shards = tmp_path / "source", 64, 4
    source.mkdir()
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for number in range(shards):
        name = f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
        layers = {
            f"model.language_model.layers.{number}.mlp.{proj}.weight": torch.randn(
                2048, shard_mib * 2**20 // 4 // 2048 // 2, generator=generator
            )
            for proj in ("gate_proj", "up_proj")
        }
        save_file(layers, str(source / name))
        weight_map.update(dict.fromkeys(layers, name))
    (source / quantize.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    (source / "config.json").write_text("{}")
    before, peak = conversion_rss_kib(source, tmp_path / "out")
    above_mib = (peak - before) / 1024
    print(f"converter peak {peak / 1024:.0f} MiB, after imports {before / 1024:.0f} MiB, above {above_mib:.0f} MiB")
    assert above_mib < 2 * shard_mib, f"{above_mib:.0f} MiB above the imports for {shard_mib} MiB shards"
    assert len(json.loads((tmp_path / "out" / DESCRIPTION_FILE).read_text())) == 4 + shards * 2 * 3
