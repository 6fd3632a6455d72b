"""Build (or reuse) a random-weight MOSS-VL checkpoint that loads with trust_remote_code.

    python -m moss_vl_reference.tiny_checkpoint [--preset tiny|tiny-mqa|tiny-realtime|tiny-real-layout|bench] \
        [--out DIR] [--seed N]

Prints the checkpoint directory as the last line of stdout. The directory holds config.json
(with auto_map), model.safetensors (float32, seeded: same seed -> byte-identical weights), a
byte-level BPE tokenizer trained here on a small built-in corpus with the MOSS-VL special tokens,
the processor configs and the remote-code files. A directory built from the same preset,
seed and source files is reused.

`tiny-realtime` is the tiny model as a MOSS-VL-Realtime checkpoint: the same tokenizer vocabulary and special
tokens (`<|silence|>`, `<|round_start|>`, ...), the realtime chat template (every conversation opens with the
default realtime system prompt) and the tiny preset's seeded weights, except that the LM head row of `<|silence|>`
is multiplied by SILENCE_ROW_SCALE after seeding. A random model would almost never pick that one token; with its
row scaled, its logit spreads several times wider than the others', so greedy streams pick it whenever the final
hidden state leans its way: deterministically (same seed, same streams) and often, so short turns end in silence
and the realtime tests see the stream park and wake. The tiny and bench presets are untouched.

`tiny-real-layout` is tiny-realtime's model (with the plain chat template) in the published checkpoints' layout
(OpenMOSS-Team/MOSS-VL-Realtime, 0708 line): config.json in the transformers 4.57 form (`rope_scaling` with
`rope_theta` beside it, `vision_seq_pad_multiple`, `transformers_version` 4.57.1, `auto_map` naming only the config
and model classes), `preprocessor_config.json` and `video_preprocessor_config.json` with the published keys, bfloat16
weights under their published names in a sharded safetensors layout (index + one shard), and remote-code stand-ins
(`real_layout/`) that fail to import under transformers 5.19 where the published files do. Whatever loads it must
choose this project's code (`mossvl_ascend.checkpoint_code`).
"""

import argparse
import fcntl
import hashlib
import json
import logging
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from .configuration_moss_vl import MossVLConfig
from .modeling_moss_vl import MossVLForConditionalGeneration
from .processing_moss_vl import CHAT_TEMPLATE, REALTIME_CHAT_TEMPLATE, MossVLImageProcessor, MossVLProcessor

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
REMOTE_CODE_FILES = (
    "configuration_moss_vl.py",
    "processing_moss_vl.py",
    "queries_moss_vl.py",
    "generation_moss_vl.py",
    "modeling_moss_vl.py",
    "realtime_moss_vl.py",
)
# The remote-code stand-ins of the real-layout preset (their file names are the published checkpoints').
REAL_LAYOUT_DIR = PACKAGE_DIR / "real_layout"
REAL_LAYOUT_FILES = (
    "configuration_moss_vl.py",
    "processing_moss_vl.py",
    "video_processing_moss_vl.py",
    "modeling_moss_vl.py",
)
# The processor's sources: the reference checkpoints' processing_moss_vl.py re-exports it, so a change there must
# rebuild every checkpoint.
PROCESSOR_PACKAGE_DIR = REPO_ROOT / "sglang" / "mossvl_ascend" / "processor"
REAL_LAYOUT_TRANSFORMERS_VERSION = "4.57.1"
STAMP = "build_stamp.json"

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|image|>",
    "<|video|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|time_start|>",
    "<|time_end|>",
    "<|silence|>",
    "<|round_start|>",
    "<|round_end|>",
    "<|response|>",
    "<|assistant|>",
    "<go>",
)

# Small English corpus for the BPE merges: chat-like sentences about images, videos and time.
CORPUS = (
    """
You are a helpful assistant. Describe the image in detail. What is shown in this picture?
The picture shows a red square on a blue background, with a small green circle in the corner.
Describe the video. What happens between the first and the last frame? Count the objects.
At 0.0 seconds the screen is dark; at 1.0 seconds a bright shape appears; at 2.5 seconds it moves left.
The cat sits on the mat. The dog runs across the yard. A person walks into the room and waves.
Please answer briefly. Answer with one word. Is there a car in the image? Yes. No. Maybe.
Which color is the largest region? Red, green, blue, yellow, white, black, orange, purple, gray.
Compare the two images and list the differences. The left image is brighter than the right one.
Summarize the conversation so far, then continue the story with the next scene in the video.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 20 30 45 60 90 100 seconds minutes frames pixels.
Question: where is the ball? Answer: the ball is under the table, next to the chair.
"""
    * 4
)

PRESETS = {
    "tiny": {
        "text": dict(
            hidden_size=128,
            intermediate_size=256,
            # MOSS-VL-Instruct's ratio at a sixth of its depth: one layer in four is cross-attention, so the
            # self-attention layers are three times the cross-attention ones (the KV layout's three bands).
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            cross_attention_layers=[1, 5],
            max_position_embeddings=32768,
            mrope_section=[6, 5, 5],
        ),
        "vision": dict(
            depth=3,
            hidden_size=64,
            intermediate_size=128,
            num_heads=4,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0, 1],
        ),
        "bpe_vocab": 768,
        # Small budgets keep the dense per-frame vision attention of a CPU server in megabytes. Under the published
        # keys (real_layout_processor_configs, the processor of every preset): an image at most max_pixels (512x512,
        # 256 vision tokens), the images of one call sharing twice that; a video frame at most video_max_pixels
        # (256x256, 64 tokens) and at least 4096 pixels (4 tokens), the frames of a call's videos sharing eight
        # full frames' pixels. The per-image and per-frame caps are the ones the suite always ran at; the shared
        # budgets only shrink media when many share a call, so no test encodes more vision tokens than before.
        "processor": dict(max_pixels=512 * 512, video_max_pixels=256 * 256, max_input_pixels=2048 * 2048),
    },
    "bench": {
        "text": dict(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=10,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=64,
            cross_attention_layers=[2, 6],
            max_position_embeddings=65536,
            mrope_section=[12, 10, 10],
        ),
        "vision": dict(
            depth=6,
            hidden_size=384,
            intermediate_size=1024,
            num_heads=6,
            num_position_embeddings=1024,
            deepstack_visual_indexes=[1, 3],
        ),
        "bpe_vocab": 2048,
        "processor": dict(max_pixels=1024 * 1024, video_max_pixels=512 * 512, max_input_pixels=4096 * 4096),
    },
}

# The tiny model with one KV head (multi-query attention): fewer KV heads than ranks under --tp-size 2, where "tiny"
# (2 KV heads) splits them one per rank. sglang's CPU engine pads such a model to 2 KV / 8 query heads (zero heads,
# `adjust_config_with_unaligned_cpu_tp`); on NPU the self-attention KV head is replicated instead.
PRESETS["tiny-mqa"] = {**PRESETS["tiny"], "text": {**PRESETS["tiny"]["text"], "num_key_value_heads": 1}}

# How much wider the <|silence|> logit of the tiny-realtime preset spreads than the others' (see the docstring).
SILENCE_ROW_SCALE = 8.0
# Its text keeps the 4-layer shape the realtime stream tests were calibrated on (stream logits equal a cold prefill
# within 1e-5; a deeper model accumulates more fp32 reassociation between the two).
PRESETS["tiny-realtime"] = {
    **PRESETS["tiny"],
    "text": {**PRESETS["tiny"]["text"], "num_hidden_layers": 4, "cross_attention_layers": [1, 3]},
    "chat_template": REALTIME_CHAT_TEMPLATE,
    "silence_row_scale": SILENCE_ROW_SCALE,
}
# The bench preset as a realtime checkpoint (benchmarks/bench_realtime.py): without the scaled <|silence|> row its
# random weights almost never say <|silence|>, and a served turn that reaches its token limit ends the session.
# tiny-realtime's model in the published checkpoints' file layout (see the docstring). The processor budgets are
# the tiny preset's, under the published keys; the chat template is the plain one, which sglang's "moss-vl"
# conversation template renders alike for an OpenAI chat (realtime sessions bring their own system prompt).
PRESETS["tiny-real-layout"] = {**PRESETS["tiny-realtime"], "chat_template": CHAT_TEMPLATE, "layout": "real"}
PRESETS["bench-realtime"] = {
    **PRESETS["bench"],
    "chat_template": REALTIME_CHAT_TEMPLATE,
    "silence_row_scale": SILENCE_ROW_SCALE,
}


def build_tokenizer(vocab_size: int, chat_template: str = CHAT_TEMPLATE):
    """Byte-level BPE trained on CORPUS; special tokens take ids 0..len(SPECIAL_TOKENS)-1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    named = {"<|im_end|>", "<|endoftext|>"}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        # Listed so `all_special_ids` covers every control token, as in real MOSS-VL tokenizers (random-text
        # generators such as sglang's bench_serving must never sample an image placeholder).
        extra_special_tokens=[token for token in SPECIAL_TOKENS if token not in named],
        chat_template=chat_template,
        padding_side="left",
    )


def build_config(preset: dict, tokenizer) -> MossVLConfig:
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    text = dict(preset["text"])
    mrope_section = text.pop("mrope_section")
    vocab_size = math.ceil(len(tokenizer) / 64) * 64
    config = MossVLConfig(
        text_config=dict(
            text,
            vocab_size=vocab_size,
            rope_theta=5000000.0,
            rope_scaling={"rope_type": "default", "mrope_section": mrope_section, "mrope_interleaved": True},
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=dict(
            preset["vision"],
            out_hidden_size=text["hidden_size"],
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=1,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        architectures=["MossVLForConditionalGeneration"],
        dtype="float32",
        auto_map={
            "AutoConfig": "configuration_moss_vl.MossVLConfig",
            "AutoModel": "modeling_moss_vl.MossVLForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_moss_vl.MossVLForConditionalGeneration",
            "AutoProcessor": "processing_moss_vl.MossVLProcessor",
            "AutoImageProcessor": "processing_moss_vl.MossVLImageProcessor",
        },
    )
    assert config.vision_config.depth - 1 not in config.vision_config.deepstack_visual_indexes
    return config


def random_weights(config: MossVLConfig, seed: int) -> dict:
    """Seeded float32 tensors for every parameter, scaled so a random model still has peaked
    logits (greedy ties would make engine-vs-reference comparisons meaningless)."""
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in MossVLForConditionalGeneration(config).named_parameters()}
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("_gate"):
            tensor = torch.rand(shape, generator=generator) + 0.5
        elif "norm" in name and name.endswith("weight"):
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        elif name.endswith("bias"):
            tensor = 0.02 * torch.randn(shape, generator=generator)
        elif name.endswith("embed_tokens.weight") or name.endswith("separator_token"):
            tensor = torch.randn(shape, generator=generator)
        elif name.endswith("pos_embed.weight"):
            tensor = 0.5 * torch.randn(shape, generator=generator)
        elif name == "lm_head.weight":
            tensor = 3.0 * torch.randn(shape, generator=generator) / math.sqrt(shape[1])
        else:
            fan_in = math.prod(shape[1:])
            tensor = torch.randn(shape, generator=generator) / math.sqrt(fan_in)
        weights[name] = tensor.float().contiguous()
    return weights


def source_files() -> list[Path]:
    """Every file a checkpoint build depends on (its fingerprint covers their bytes)."""
    files = [PACKAGE_DIR / name for name in REMOTE_CODE_FILES + ("tiny_checkpoint.py",)]
    files += [REAL_LAYOUT_DIR / name for name in REAL_LAYOUT_FILES]
    files += sorted(PROCESSOR_PACKAGE_DIR.glob("*.py"))
    return files


def source_fingerprint(preset_name: str, seed: int) -> str:
    digest = hashlib.sha256(f"{preset_name}:{seed}".encode())
    for path in source_files():
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def seeded_weights(preset: dict, config: MossVLConfig, tokenizer, seed: int) -> dict:
    weights = random_weights(config, seed)
    if "silence_row_scale" in preset:
        weights["lm_head.weight"][tokenizer.convert_tokens_to_ids("<|silence|>")] *= preset["silence_row_scale"]
    return weights


def write_generation_config(directory: Path, config: MossVLConfig) -> None:
    generation = {
        "eos_token_id": [config.text_config.eos_token_id, config.text_config.bos_token_id],
        "pad_token_id": config.text_config.pad_token_id,
        "do_sample": False,
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def write_checkpoint(directory: Path, preset_name: str, seed: int) -> None:
    preset = PRESETS[preset_name]
    chat_template = preset.get("chat_template", CHAT_TEMPLATE)
    tokenizer = build_tokenizer(preset["bpe_vocab"], chat_template)
    config = build_config(preset, tokenizer)
    if preset.get("layout") == "real":
        write_real_layout(directory, preset, config, tokenizer, seed)
        return
    config.save_pretrained(directory)
    save_file(
        seeded_weights(preset, config, tokenizer, seed), str(directory / "model.safetensors"), metadata={"format": "pt"}
    )
    write_processor(directory, preset, tokenizer, chat_template)
    for name in REMOTE_CODE_FILES:
        shutil.copyfile(PACKAGE_DIR / name, directory / name)
    write_generation_config(directory, config)


def write_processor(directory: Path, preset: dict, tokenizer, chat_template: str) -> None:
    """Our layout's processor_config.json: the processor the real-layout files describe (same budgets, same
    semantics), its auto_map naming the checkpoint's own processing_moss_vl.py. Written by hand, not by
    register_for_auto_class, which would copy the plugin's modules into the checkpoint and name that copy."""
    published = real_layout_processor_configs(preset["processor"])
    image_processor = MossVLImageProcessor.from_real_config_dicts(
        published["preprocessor_config.json"],
        published["video_preprocessor_config.json"],
        max_input_pixels=preset["processor"]["max_input_pixels"],
    )
    processor = MossVLProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)
    # Every trust_remote_code load of a checkpoint registers these classes for their auto class (our entry re-exports
    # them), and save_pretrained would then copy the plugin's modules in: a build must not depend on what the process
    # loaded before.
    registered = {cls: cls._auto_class for cls in (MossVLProcessor, MossVLImageProcessor)}
    try:
        for cls in registered:
            cls._auto_class = None
        processor.save_pretrained(directory)
    finally:
        for cls, auto_class in registered.items():
            cls._auto_class = auto_class
    saved = json.loads((directory / "processor_config.json").read_text())
    entry = {"AutoProcessor": "processing_moss_vl.MossVLProcessor"}
    saved["auto_map"] = entry
    saved["image_processor"]["auto_map"] = {**entry, "AutoImageProcessor": "processing_moss_vl.MossVLImageProcessor"}
    (directory / "processor_config.json").write_text(json.dumps(saved, indent=2) + "\n")


# Keys transformers 5 writes into every config dict that a 4.57 config.json does not carry.
TRANSFORMERS5_ONLY_KEYS = frozenset(
    {
        "_name_or_path",
        "chunk_size_feed_forward",
        "id2label",
        "label2id",
        "is_encoder_decoder",
        "output_attentions",
        "output_hidden_states",
        "problem_type",
        "return_dict",
    }
)


def real_layout_config(config: MossVLConfig) -> dict:
    """config.json as the published checkpoints write it (transformers 4.57): the rope dict under ``rope_scaling``
    with ``rope_theta`` beside it, ``vision_seq_pad_multiple`` (1, as in the released realtime config), the
    version it was saved with, and an ``auto_map`` naming the config and model classes only."""
    data = {k: v for k, v in config.to_dict().items() if k not in TRANSFORMERS5_ONLY_KEYS}
    for key in ("text_config", "vision_config"):
        dropped = TRANSFORMERS5_ONLY_KEYS | {"architectures", "dtype"}
        data[key] = {k: v for k, v in data[key].items() if k not in dropped}
    rope = dict(data["text_config"].pop("rope_parameters"))
    data["text_config"]["rope_theta"] = rope.pop("rope_theta")
    data["text_config"]["rope_scaling"] = rope
    data.update(
        dtype="bfloat16",
        transformers_version=REAL_LAYOUT_TRANSFORMERS_VERSION,
        vision_seq_pad_multiple=1,
        auto_map={
            "AutoConfig": "configuration_moss_vl.MossVLConfig",
            "AutoModel": "modeling_moss_vl.MossVLForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_moss_vl.MossVLForConditionalGeneration",
        },
    )
    return data


def real_layout_processor_configs(processor: dict) -> dict[str, dict]:
    """preprocessor_config.json and video_preprocessor_config.json with the published keys; the pixel budgets are
    the preset's (``size`` is per image / per frame, ``multi_image_max_pixels`` and ``video_max_pixels`` are shared
    among the images / videos of one request)."""
    normalise = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    patches = {"patch_size": 16, "temporal_patch_size": 1, "merge_size": 2}
    image = {
        "auto_map": {
            "AutoProcessor": "processing_moss_vl.MossVLProcessor",
            "AutoImageProcessor": "processing_moss_vl.MossVLImageProcessorFast",
        },
        "size": {"longest_edge": processor["max_pixels"], "shortest_edge": 4096},
        "multi_image_max_pixels": 2 * processor["max_pixels"],
        **patches,
        **normalise,
        "processor_class": "MossVLProcessor",
        "image_processor_type": "MossVLImageProcessorFast",
        "interpolation": "BICUBIC",
    }
    video = {
        # Inferred: AutoVideoProcessor must find the remote class through this file's auto_map.
        "auto_map": {
            "AutoProcessor": "processing_moss_vl.MossVLProcessor",
            "AutoVideoProcessor": "video_processing_moss_vl.MossVLVideoProcessor",
        },
        "size": {"longest_edge": processor["video_max_pixels"], "shortest_edge": 4096},
        "video_max_pixels": 8 * processor["video_max_pixels"],
        "video_fps": 1.0,
        "min_frames": 1,
        "max_frames": 256,
        "num_extract_threads": 4,
        **patches,
        **normalise,
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "do_sample_frames": True,
        "resample": 3,
        "processor_class": "MossVLProcessor",
        "video_processor_type": "MossVLVideoProcessor",
    }
    return {"preprocessor_config.json": image, "video_preprocessor_config.json": video}


def write_real_layout(directory: Path, preset: dict, config: MossVLConfig, tokenizer, seed: int) -> None:
    """The published checkpoints' file layout (see the module docstring)."""
    (directory / "config.json").write_text(json.dumps(real_layout_config(config), indent=2) + "\n")
    weights = {
        name: tensor.to(torch.bfloat16) for name, tensor in seeded_weights(preset, config, tokenizer, seed).items()
    }
    shard = "model-00001-of-00001.safetensors"
    save_file(weights, str(directory / shard), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
        "weight_map": {name: shard for name in sorted(weights)},
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for name, data in real_layout_processor_configs(preset["processor"]).items():
        (directory / name).write_text(json.dumps(data, indent=2) + "\n")
    tokenizer.save_pretrained(directory)
    for name in REAL_LAYOUT_FILES:
        shutil.copyfile(REAL_LAYOUT_DIR / name, directory / name)
    write_generation_config(directory, config)


def build_or_reuse(preset_name: str = "tiny", out: Path | None = None, seed: int = 0) -> Path:
    """The checkpoint directory for (preset, seed), building it unless an identical build exists."""
    out = Path(out) if out is not None else REPO_ROOT / "build" / f"{preset_name}-moss-vl"
    out.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time per directory (the test suite's parallel workers ask for the same checkpoints): a second
    # caller waits, then finds the first one's build.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_unless_built(preset_name, out, seed)


def _build_unless_built(preset_name: str, out: Path, seed: int) -> Path:
    fingerprint = source_fingerprint(preset_name, seed)
    stamp = out / STAMP
    if stamp.is_file() and json.loads(stamp.read_text()).get("fingerprint") == fingerprint:
        logger.info("reusing %s", out)
        return out
    started = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write_checkpoint(staging, preset_name, seed)
        (staging / STAMP).write_text(
            json.dumps({"fingerprint": fingerprint, "preset": preset_name, "seed": seed}) + "\n"
        )
        # mkdtemp and the safetensors writer create owner-only modes; a checkpoint is shared read-only data
        staging.chmod(0o755)
        for path in staging.iterdir():
            path.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    logger.info("built %s in %.1fs", out, time.monotonic() - started)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--out", type=Path, default=None, help="default: build/<preset>-moss-vl under the repo root")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    print(build_or_reuse(args.preset, args.out, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
