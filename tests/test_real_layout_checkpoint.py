"""A checkpoint in the published MOSS-VL layout, whose remote code fails under transformers 5.19, loads through ours.

The ``tiny-real-layout`` checkpoint (``moss_vl_reference/tiny_checkpoint.py``) has the published 0708 line's files:
config.json in the transformers 4.57 form, preprocessor and video preprocessor configs with the published keys,
bfloat16 weights under their published names in a sharded layout, and remote-code stand-ins that fail to import as
the published ones do. ``mossvl_ascend.checkpoint_code`` decides whose code loads it, for the sglang plugin and the
runners alike.

Oracles: the published files' facts (paths cited where used); transformers' own remote-code loader (the stand-ins
fail as the published files do); for generation, the reference model built from the preset's config (not from
config.json) with the shard's tensors loaded by name and upcast to fp32, fed by our processor, greedy. One sglang
server (fp32, page size 128) is compared with that oracle on an image, a video and a text-only prompt.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moss_vl_reference.tiny_checkpoint import PRESETS, build_config, build_or_reuse, build_tokenizer
from mossvl_ascend import checkpoint_code
from serving.launch import engine_env, free_port, server_command
from support.serving import CASES

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = REPO_ROOT / "inference" / "examples"
RUN_INFERENCE = REPO_ROOT / "inference" / "run_inference.py"
OURS_LINE = "loading with this project's MOSS-VL code (its own code cannot load here, written for transformers 4.57.1"
MAX_TOKENS = 12

# Keys of the published preprocessor_config.json (Joiin0392/moss-npu-adaptations,
# vlm/MOSS-VL-Realtime-0708/preprocessor_config.json, lines 1-26).
PUBLISHED_PREPROCESSOR_KEYS = {
    "auto_map",
    "size",
    "multi_image_max_pixels",
    "patch_size",
    "temporal_patch_size",
    "merge_size",
    "image_mean",
    "image_std",
    "processor_class",
    "image_processor_type",
    "interpolation",
}
# Settings of the published video processor class (same folder, video_processing_moss_vl.py, the class attributes
# of MossVLVideoProcessor) that its saved config carries.
PUBLISHED_VIDEO_SETTINGS = {
    "size",
    "image_mean",
    "image_std",
    "patch_size",
    "temporal_patch_size",
    "merge_size",
    "video_fps",
    "min_frames",
    "max_frames",
    "num_extract_threads",
    "video_max_pixels",
}


@pytest.fixture(scope="module")
def real_layout() -> Path:
    return build_or_reuse("tiny-real-layout")


@pytest.fixture(scope="module")
def oracle(real_layout):
    """(model, processor): the reference model of the preset's own config with the shard's tensors by name (fp32),
    and our processor read from the checkpoint's processor files."""
    from moss_vl_reference.modeling_moss_vl import MossVLForConditionalGeneration
    from mossvl_ascend.processor import MossVLProcessor

    preset = PRESETS["tiny-real-layout"]
    config = build_config(preset, build_tokenizer(preset["bpe_vocab"], preset["chat_template"]))
    model = MossVLForConditionalGeneration(config)
    index = json.loads((real_layout / "model.safetensors.index.json").read_text())
    state = {}
    for shard in sorted(set(index["weight_map"].values())):
        state.update({name: tensor.float() for name, tensor in load_file(real_layout / shard).items()})
    missing, unexpected = model.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    return model.float().eval(), MossVLProcessor.from_checkpoint(real_layout)


def greedy_ids(model, processor, messages, max_tokens: int = MAX_TOKENS) -> tuple[list[int], list[int]]:
    inputs, _ = model.processor_inputs(processor, {"messages": messages})
    sequences = model.generate(**inputs, max_new_tokens=max_tokens, eos_token_id=[])
    prompt_len = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), sequences[0, prompt_len:].tolist()


# ------------------------------------------------------------------------------------------ the layout


def test_files_follow_the_published_layout(real_layout):
    config = json.loads((real_layout / "config.json").read_text())
    text = config["text_config"]
    assert config["transformers_version"] == "4.57.1" and config["model_type"] == "moss_vl"
    assert config["vision_seq_pad_multiple"] == 1
    assert config["auto_map"] == {
        "AutoConfig": "configuration_moss_vl.MossVLConfig",
        "AutoModel": "modeling_moss_vl.MossVLForConditionalGeneration",
        "AutoModelForCausalLM": "modeling_moss_vl.MossVLForConditionalGeneration",
    }
    # the 4.57 rope form: rope_scaling without rope_theta, rope_theta beside it, no rope_parameters
    assert text["rope_scaling"] == {"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True}
    assert text["rope_theta"] == 5000000.0 and "rope_parameters" not in text
    image = json.loads((real_layout / "preprocessor_config.json").read_text())
    assert set(image) == PUBLISHED_PREPROCESSOR_KEYS
    assert set(image["size"]) == {"longest_edge", "shortest_edge"}
    video = json.loads((real_layout / "video_preprocessor_config.json").read_text())
    assert PUBLISHED_VIDEO_SETTINGS <= set(video)
    index = json.loads((real_layout / "model.safetensors.index.json").read_text())
    assert not (real_layout / "model.safetensors").exists(), "sharded, as published"
    tensors = load_file(real_layout / "model-00001-of-00001.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert set(index["weight_map"]) == set(tensors)


def test_parameter_names_are_the_reference_models(real_layout):
    from moss_vl_reference.configuration_moss_vl import MossVLConfig
    from moss_vl_reference.modeling_moss_vl import MossVLForConditionalGeneration

    with torch.device("meta"):
        model = MossVLForConditionalGeneration(MossVLConfig.from_pretrained(real_layout))
    index = json.loads((real_layout / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {name for name, _ in model.named_parameters()}


def test_its_own_code_fails_under_the_pinned_transformers_as_the_published_code_does(real_layout):
    """What a user of the published checkpoint sees without our code: the processor's video module needs joblib and
    torchcodec (and imports BASE_VIDEO_PROCESSOR_DOCSTRING), the model module imports OutputRecorder."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoProcessor

    with pytest.raises(ImportError, match="joblib, torchcodec"):
        AutoProcessor.from_pretrained(real_layout, trust_remote_code=True)
    with pytest.raises(ImportError, match="OutputRecorder"):
        AutoModelForCausalLM.from_pretrained(real_layout, trust_remote_code=True)
    # its config class loads (4.57 rope form included): sglang builds its config from it unchanged
    config = AutoConfig.from_pretrained(real_layout, trust_remote_code=True)
    assert config.text_config.rope_scaling["mrope_section"] == [6, 5, 5]


# ------------------------------------------------------------------------------------------ the decision


def test_the_decision_uses_ours_only_when_the_checkpoints_code_cannot_import(real_layout, monkeypatch):
    monkeypatch.delenv(checkpoint_code.ENV_VAR, raising=False)
    choice = checkpoint_code.choose_code(real_layout)
    assert choice.use_ours and "written for transformers 4.57.1" in choice.reason
    processor_only = checkpoint_code.choose_code(real_layout, parts=frozenset({checkpoint_code.PROCESSOR}))
    assert processor_only.use_ours and "video_processing_moss_vl.MossVLVideoProcessor" in processor_only.reason
    ours_code = build_or_reuse("tiny-realtime")  # remote code that imports: it keeps it
    assert not checkpoint_code.choose_code(ours_code).use_ours
    assert checkpoint_code.choose_code(ours_code, "ours").use_ours
    monkeypatch.setenv(checkpoint_code.ENV_VAR, "ours")
    assert checkpoint_code.choose_code(ours_code).use_ours, "the environment variable forces ours"
    assert not checkpoint_code.choose_code(ours_code, "auto").use_ours, "the flag wins over the environment"
    monkeypatch.setenv(checkpoint_code.ENV_VAR, "theirs")
    with pytest.raises(ValueError, match="not one of auto, checkpoint, ours"):
        checkpoint_code.choose_code(real_layout)


def test_forcing_the_checkpoints_code_names_the_transformers_it_needs(real_layout):
    import transformers

    with pytest.raises(checkpoint_code.CheckpointCodeUnloadable) as raised:
        checkpoint_code.choose_code(real_layout, "checkpoint")
    message = str(raised.value)
    assert "needs transformers 4.57.1" in message and f"has transformers {transformers.__version__}" in message


def test_untrusted_remote_code_is_never_run_to_probe_it(real_layout, monkeypatch):
    def probe(*args):
        raise AssertionError("probed untrusted remote code")

    monkeypatch.setattr(checkpoint_code, "remote_code_failure", probe)
    choice = checkpoint_code.choose_code(real_layout, "auto", trust_remote_code=False)
    assert choice.use_ours and "not trusted" in choice.reason


# ------------------------------------------------------------------------------------------ the sglang hook


def test_the_plugin_hook_gives_sglang_our_processor_and_passes_others_through(real_layout, tmp_path, caplog):
    from sglang.srt.utils.hf_transformers import processor as stock

    from mossvl_ascend.patches.checkpoint_processor import processor_for_checkpoint
    from mossvl_ascend.processor import MossVLProcessor

    path = str(real_layout)
    with caplog.at_level(logging.INFO, logger="mossvl_ascend.patches.checkpoint_processor"):
        processor = processor_for_checkpoint(stock.get_processor, path, trust_remote_code=True, model_name=path)
    assert isinstance(processor, MossVLProcessor)
    assert any(OURS_LINE in record.getMessage() for record in caplog.records)
    assert "moss_vl" not in stock._CUSTOMIZED_MM_PROCESSOR, "stock's table is left as it was"
    with pytest.raises(ImportError, match="joblib, torchcodec"):  # stock alone: the published failure
        stock.get_processor(path, trust_remote_code=True, model_name=path)
    calls = []
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    assert processor_for_checkpoint(lambda *a, **k: calls.append(a) or "stock", str(other)) == "stock"
    assert calls == [(str(other),)]


def test_the_plugin_hook_forced_to_the_checkpoints_code_logs_the_version_it_needs(real_layout, monkeypatch, caplog):
    from sglang.srt.utils.hf_transformers import processor as stock

    from mossvl_ascend.patches.checkpoint_processor import processor_for_checkpoint

    monkeypatch.setenv(checkpoint_code.ENV_VAR, "checkpoint")
    path = str(real_layout)
    with caplog.at_level(logging.ERROR), pytest.raises(checkpoint_code.CheckpointCodeUnloadable):
        processor_for_checkpoint(stock.get_processor, path, trust_remote_code=True, model_name=path)
    assert any("needs transformers 4.57.1" in record.getMessage() for record in caplog.records)


def test_a_server_forced_to_the_checkpoints_code_stops_with_one_line_naming_the_version(real_layout):
    """``MOSSVL_REMOTE_CODE=checkpoint`` on a checkpoint whose code cannot import: the launcher stops before any
    scheduler starts, with the transformers version the checkpoint needs and no traceback."""
    command = server_command(real_layout, free_port(), extra_args=["--dtype", "float32"])
    environment = {**engine_env("cpu"), checkpoint_code.ENV_VAR: "checkpoint"}
    # subprocess.run kills the server if it outlives the timeout
    process = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)
    stdout, stderr = process.stdout, process.stderr
    assert process.returncode != 0
    assert "MOSS-VL start-up refused" in stderr and "4.57.1" in stderr, stderr[-3000:]
    assert "Traceback" not in stdout + stderr, stderr[-3000:]


# ------------------------------------------------------------------------------------------ the runners


def run_inference_cli(checkpoint, *flags, env=None) -> subprocess.CompletedProcess:
    command = [sys.executable, str(RUN_INFERENCE), "--checkpoint", str(checkpoint), *flags]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)


UPSTREAM_COMMANDS = {  # upstream's README: one example file per legacy --mode
    "image": "image_queries.json",
    "video": "video_queries.json",
    "batch": "multiturn_batch.jsonl",
}


@pytest.mark.parametrize("mode", sorted(UPSTREAM_COMMANDS))
def test_run_inference_upstream_modes_equal_the_oracle(real_layout, oracle, tmp_path, mode):
    from inference.run_inference import GENERATE_DEFAULTS, load_queries
    from moss_vl_reference.queries_moss_vl import normalize_query, resolve_query_media_paths

    source = EXAMPLES / UPSTREAM_COMMANDS[mode]
    output = tmp_path / "results.json"
    completed = run_inference_cli(
        real_layout, "--mode", mode, "--input", str(source), "--output", str(output), "--dtype", "float32"
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert OURS_LINE in completed.stderr
    report = json.loads(output.read_text())
    assert report["code"] == "ours" and report["num_failed"] == 0
    model, processor = oracle
    queries = [
        resolve_query_media_paths(normalize_query(raw, GENERATE_DEFAULTS), EXAMPLES) for raw in load_queries(source)
    ]
    expected = model.offline_batch_generate(processor, queries)["results"]
    assert [r["text"] for r in report["results"]] == [e["text"] for e in expected]


def test_run_inference_forcing_the_checkpoints_code_is_a_clear_error(real_layout, tmp_path):
    source = EXAMPLES / "image_queries.json"
    forced = run_inference_cli(
        real_layout, "--input", str(source), "--output", str(tmp_path / "r.json"), "--remote-code", "checkpoint"
    )
    by_env = run_inference_cli(
        real_layout,
        "--input",
        str(source),
        "--output",
        str(tmp_path / "r.json"),
        env={checkpoint_code.ENV_VAR: "checkpoint"},
    )
    for completed in (forced, by_env):
        assert completed.returncode == 2
        assert "needs transformers 4.57.1" in completed.stderr
        assert "Traceback" not in completed.stderr
    assert not (tmp_path / "r.json").exists()


def test_forcing_ours_on_a_checkpoint_without_the_published_processor_files_is_a_clear_error():
    from inference import model_loading

    with pytest.raises(ValueError, match="has no preprocessor_config.json"):
        model_loading.load_model(build_or_reuse("tiny"), device="cpu", remote_code="ours")


def test_realtime_runner_drives_our_session_on_the_real_layout(real_layout, oracle):
    """run_online_inference loads our reference model (its session API) for the real layout; the session's tokens
    equal the oracle model's session on the same inputs (pushed before the stream starts, so both streams see the
    same inputs at the same steps)."""
    from PIL import Image

    from realtime_inference import run_online_inference as online

    args = online.parse_args(["--checkpoint", str(real_layout), "--device-map", "cpu", "--dtype", "float32"])
    model, processor, metadata = online.load_realtime_model(args)
    assert metadata["code"] == "ours"
    frames = [Image.new("RGB", (64, 64), color) for color in ((250, 20, 20), (20, 250, 20))]

    def stream(model, processor) -> list[int]:
        session = model.create_realtime_session(
            processor, initial_prompt="Which colours appear?", max_tokens_per_turn=0.0, max_new_tokens=8
        )
        for t, frame in enumerate(frames):
            session.push_frame(frame, float(t))
        session.start()
        assert session.wait_until_parked(120)
        session.close(30.0)
        return list(session.generated)

    assert stream(model, processor) == stream(*oracle)


# ------------------------------------------------------------------------------------------ served by sglang

# The served suite's own cases (support/serving.py), under this module's names.
SERVED_CASES = {"image": CASES["image_data_url"], "video": CASES["video"], "text_only": CASES["text_only"]}
# fp32 for token parity; the NPU's page size; start-up runs stock's warm-up image request through our processor.
SERVED_ARGS = ["--dtype", "float32", "--page-size", "128"]


def test_served_greedy_ids_equal_the_oracle_at_page_128(real_layout, oracle, server_pool):
    from support.serving import openai_client, served_ids

    model, processor = oracle
    expected = {name: greedy_ids(model, processor, messages) for name, messages in SERVED_CASES.items()}
    with server_pool.lease(real_layout, SERVED_ARGS, name="real-layout") as server:
        client, model_name = openai_client(server)
        served = {
            name: served_ids(client, model_name, messages, max_tokens=MAX_TOKENS)
            for name, messages in SERVED_CASES.items()
        }
        log = server.log_path.read_text(errors="replace")  # from start-up on
    assert OURS_LINE in log, "the plugin logs the code it chose"
    for name, (prompt_ids, completion_ids) in expected.items():
        assert served[name]["prompt_ids"] == prompt_ids, name
        assert served[name]["completion_ids"] == completion_ids, name
