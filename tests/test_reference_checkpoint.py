"""The tiny checkpoint builder: deterministic, small, fast, self-contained remote code."""

import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoProcessor

from moss_vl_reference import tiny_checkpoint
from moss_vl_reference.tiny_checkpoint import SPECIAL_TOKENS, build_or_reuse


def test_same_seed_is_byte_identical_other_seed_differs_and_build_is_fast_and_small(tmp_path):
    timings = []
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        started = time.perf_counter()
        build_or_reuse("tiny", tmp_path / name, seed)
        timings.append(time.perf_counter() - started)
    weights = {name: (tmp_path / name / "model.safetensors").read_bytes() for name in "abc"}
    assert weights["a"] == weights["b"] and weights["a"] != weights["c"]
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert max(timings) < 30, timings
    size = sum(f.stat().st_size for f in (tmp_path / "a").iterdir())
    assert size < 20 * 2**20, size
    started = time.perf_counter()
    assert build_or_reuse("tiny", tmp_path / "a", 7) == tmp_path / "a"
    assert time.perf_counter() - started < 1.0  # reused, not rebuilt


def test_cli_prints_the_directory_last(tmp_path, capsys):
    assert tiny_checkpoint.main(["--out", str(tmp_path / "cli"), "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(tmp_path / "cli")


def test_architecture_requirements_and_float32_weights():
    directory = build_or_reuse("tiny")
    config = AutoConfig.from_pretrained(directory, trust_remote_code=True)
    text, vision = config.text_config, config.vision_config
    assert len(text.cross_attention_layers) >= 2 and vision.depth >= 3
    assert vision.deepstack_visual_indexes and vision.depth - 1 not in vision.deepstack_visual_indexes
    assert vision.out_hidden_size == text.hidden_size
    assert sum(text.rope_scaling["mrope_section"]) == text.head_dim // 2 and text.rope_scaling["mrope_interleaved"]
    weights = load_file(str(directory / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.float32}
    assert "model.separator_token" in weights and "lm_head.weight" in weights
    raw = json.loads((directory / "config.json").read_text())
    assert raw["architectures"] == ["MossVLForConditionalGeneration"] and raw["model_type"] == "moss_vl"
    assert set(raw["auto_map"]) >= {"AutoConfig", "AutoModelForCausalLM", "AutoProcessor"}


def test_loads_offline_with_remote_code_and_special_token_ids_match_config():
    directory = build_or_reuse("tiny")
    processor = AutoProcessor.from_pretrained(directory, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, dtype=torch.float32)
    assert type(model).__module__.startswith("transformers_modules")  # the copied remote code, not the repo package
    tokenizer = processor.tokenizer
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    assert len(set(ids.values())) == len(SPECIAL_TOKENS) and tokenizer.unk_token_id not in ids.values()
    assert model.config.image_token_id == ids["<|image_pad|>"]
    assert model.config.video_token_id == ids["<|video_pad|>"]
    assert model.config.vision_start_token_id == ids["<|vision_start|>"]
    assert model.config.vision_end_token_id == ids["<|vision_end|>"]
    assert model.config.text_config.eos_token_id == ids["<|im_end|>"]
    for token in SPECIAL_TOKENS:  # each special token is one id, never split by BPE
        assert tokenizer(f"a{token}b", add_special_tokens=False)["input_ids"][1:-1] == [ids[token]]
    assert tokenizer("", add_special_tokens=True)["input_ids"] == []  # sglang: no auto-added BOS
    assert model.config.text_config.vocab_size >= len(tokenizer)


def test_every_control_token_is_a_special_token(processor):
    """Random-text generators (sglang's bench_serving) sample outside all_special_ids: placeholders must be in it."""
    tokenizer = processor.tokenizer
    assert set(tokenizer.all_special_tokens) == set(SPECIAL_TOKENS)
    assert tokenizer.convert_tokens_to_ids("<|image|>") in tokenizer.all_special_ids


def test_realtime_preset_is_the_tiny_model_with_its_template_and_a_scaled_silence_row():
    """tiny-realtime: the tiny preset at 4 text layers (cross-attention at 1 and 3; the depth its stream tests were
    calibrated on), the tiny vocabulary, the realtime chat template, and only the <|silence|> LM head row changed
    (multiplied by SILENCE_ROW_SCALE) against the same preset's seeded weights; the tiny preset itself is untouched."""
    tiny, realtime = build_or_reuse("tiny"), build_or_reuse("tiny-realtime")
    tiny_text, realtime_text = (tiny_checkpoint.PRESETS[name]["text"] for name in ("tiny", "tiny-realtime"))
    depth = ("num_hidden_layers", "cross_attention_layers")
    assert {k: v for k, v in realtime_text.items() if k not in depth} == {
        k: v for k, v in tiny_text.items() if k not in depth
    }
    assert (realtime_text["num_hidden_layers"], realtime_text["cross_attention_layers"]) == (4, [1, 3])
    realtime_weights = load_file(str(realtime / "model.safetensors"))
    processor = AutoProcessor.from_pretrained(realtime, trust_remote_code=True)
    silence = processor.tokenizer.convert_tokens_to_ids("<|silence|>")
    config = tiny_checkpoint.build_config(tiny_checkpoint.PRESETS["tiny-realtime"], processor.tokenizer)
    unscaled = tiny_checkpoint.random_weights(config, seed=0)
    assert set(unscaled) == set(realtime_weights)
    for name, tensor in unscaled.items():
        if name != "lm_head.weight":
            assert torch.equal(tensor, realtime_weights[name]), name
    expected_head = unscaled["lm_head.weight"].clone()
    expected_head[silence] *= tiny_checkpoint.SILENCE_ROW_SCALE
    assert torch.equal(realtime_weights["lm_head.weight"], expected_head)
    plain = AutoProcessor.from_pretrained(tiny, trust_remote_code=True)
    assert processor.tokenizer.get_vocab() == plain.tokenizer.get_vocab()
    rendered = processor.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n") and "<|silence|>" in rendered.split("<|im_end|>")[0]
    assert plain.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_change_to_the_processor_package_rebuilds_every_checkpoint(tmp_path, monkeypatch):
    """The reference checkpoints' remote processor re-exports mossvl_ascend.processor: its sources are part of every
    build's fingerprint, so a checkpoint in build/ never ships a stale processor."""
    package = tiny_checkpoint.PROCESSOR_PACKAGE_DIR
    sources = sorted(package.glob("*.py"))
    assert sources and set(sources) <= set(tiny_checkpoint.source_files())
    copy = tmp_path / "processor"
    copy.mkdir()
    for source in sources:
        (copy / source.name).write_bytes(source.read_bytes())
    monkeypatch.setattr(tiny_checkpoint, "PROCESSOR_PACKAGE_DIR", copy)
    before = {preset: tiny_checkpoint.source_fingerprint(preset, 0) for preset in ("tiny", "tiny-real-layout")}
    edited = copy / sources[0].name
    edited.write_bytes(edited.read_bytes() + b"\n# edited\n")
    after = {preset: tiny_checkpoint.source_fingerprint(preset, 0) for preset in before}
    assert all(before[preset] != after[preset] for preset in before)


def test_our_layout_ships_the_processor_the_real_layout_files_describe(tmp_path):
    """tiny-realtime (our layout, its processor_config.json read through the checkpoint's processing_moss_vl entry)
    and tiny-real-layout (the published preprocessor_config.json / video_preprocessor_config.json read by
    from_checkpoint) are the same model: same media settings, same pixels, grids and ids for an image pair and a video.
    The auto_map names the checkpoint's own processing_moss_vl.py, no copy of the plugin's modules."""
    from mossvl_ascend.processor import MossVLProcessor
    from mossvl_ascend.processor.image_processor import SETTINGS

    # built after a trust_remote_code load, which registers the plugin's classes for their auto classes
    AutoProcessor.from_pretrained(build_or_reuse("tiny"), trust_remote_code=True)
    ours_dir = build_or_reuse("tiny-realtime", tmp_path / "ours")
    saved = json.loads((ours_dir / "processor_config.json").read_text())
    assert saved["auto_map"] == {"AutoProcessor": "processing_moss_vl.MossVLProcessor"}
    assert saved["image_processor"]["auto_map"]["AutoImageProcessor"] == "processing_moss_vl.MossVLImageProcessor"
    assert not (ours_dir / "image_processor.py").exists() and not (ours_dir / "processing.py").exists()
    ours = AutoProcessor.from_pretrained(ours_dir, trust_remote_code=True)
    real = MossVLProcessor.from_checkpoint(build_or_reuse("tiny-real-layout"))
    published = [name for name in SETTINGS if name != "max_input_pixels"]  # ours: a server's decode-size guard
    assert {n: getattr(ours.image_processor, n) for n in published} == {
        n: getattr(real.image_processor, n) for n in published
    }
    assets = Path(__file__).parent / "assets"
    call = dict(
        text="<|image|>and<|image|> then <|video|>",
        images=[str(assets / "square_64.png"), str(assets / "gradient_96x64.png")],
        videos=[str(assets / "moving_square_3s.mp4")],
    )
    mine, theirs = ours(**call), real(**call)
    for key in ("input_ids", "pixel_values", "grid_thw", "cross_attention_mask"):
        assert torch.equal(mine[key], theirs[key]), key
    assert mine["grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6], [3, 4, 4]]
