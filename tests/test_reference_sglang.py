"""The reference MOSS-VL checkpoint against stock sglang 0.5.23's MossVL code (the oracle).

Stock sglang's model is built in-process on CPU (world-size-1 gloo process group, as sglang's own
layer tests do) from the tiny checkpoint; its loader, vision tower, separator insertion, XRoPE
and processor-side position/visibility code run unchanged on our checkpoint and processor output.
"""

import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from moss_vl_reference.modeling_moss_vl import compute_xrope_positions
from mossvl_ascend.patches import text_only_requests
from serving.launch import free_port

ASSETS = Path(__file__).parent / "assets"


@pytest.fixture(scope="module")
def ours(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def sglang_model(checkpoint):
    """Stock sglang MossVLForConditionalGeneration with every parameter NaN before loading, so an
    unloaded parameter stays visible; returns (model, names of tensors the loader skipped)."""
    from sglang.test.layer_ut_utils import init_single_process_dist

    init_single_process_dist(master_port=free_port())
    from sglang.srt.models.moss_vl import MossVLForConditionalGeneration

    config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=True)
    torch.set_default_dtype(torch.float32)
    model = MossVLForConditionalGeneration(config).eval()
    for parameter in model.parameters():
        parameter.data.fill_(float("nan"))
    skipped = []

    class SkipCollector(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Skipping weight"):
                skipped.append(record.getMessage())

    loader_logger = logging.getLogger("sglang.srt.models.moss_vl")
    handler, previous = SkipCollector(level=logging.DEBUG), loader_logger.level
    loader_logger.addHandler(handler)
    loader_logger.setLevel(logging.DEBUG)
    try:
        model.load_weights(load_file(str(checkpoint / "model.safetensors")).items())
    finally:
        loader_logger.removeHandler(handler)
        loader_logger.setLevel(previous)
    # sglang's vision rotary is torch.compile'd; compiling on CPU takes long and eager is the same math
    dynamo_was_disabled = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    yield model, skipped
    torch._dynamo.config.disable = dynamo_was_disabled


@pytest.fixture(scope="module")
def sglang_processor(checkpoint):
    """Stock sglang MossVL multimodal processor, without its server plumbing: only the methods
    that turn the HF processor output into positions, visibility and mm items are used."""
    from sglang.srt.multimodal.processors.moss_vl import MossVLImageProcessor

    config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=True)
    stock = MossVLImageProcessor.__new__(MossVLImageProcessor)
    stock.hf_config = config  # spatial_merge_size is read from here
    stock.image_token_id = config.image_token_id
    stock.vision_seq_pad_multiple = 1
    return stock


def _mixed_media_inputs(processor):
    rng = np.random.default_rng(3)
    frames = [Image.fromarray(rng.integers(0, 255, (40, 60, 3), dtype=np.uint8)) for _ in range(3)]
    text = (
        "<|im_start|>user\nLook <|image|> then<|video|> and <|image|>, what changed?<|im_end|>\n<|im_start|>assistant\n"
    )
    images = [str(ASSETS / "gradient_96x64.png"), str(ASSETS / "square_64.png")]
    return processor(text=text, images=images, videos=[frames])


def test_stock_loader_takes_every_tensor_and_leaves_nothing_unset(sglang_model):
    model, skipped = sglang_model
    assert skipped == []
    unset = [name for name, p in model.named_parameters() if torch.isnan(p).any()]
    assert unset == []


def test_stock_vision_tower_and_separators_equal_ours(sglang_model, ours, processor):
    model, _ = sglang_model
    inputs = _mixed_media_inputs(processor)
    with torch.no_grad():
        stock = model._insert_separator_tokens(
            model._get_vision_features(inputs["pixel_values"], inputs["grid_thw"]), inputs["grid_thw"]
        )
        mine = torch.cat(ours.encode_media(inputs["pixel_values"], inputs["grid_thw"]))
    assert stock.shape == mine.shape
    torch.testing.assert_close(mine, stock, rtol=1e-5, atol=1e-5)


def test_stock_encoder_length_matches_the_formula_and_our_sequence(sglang_model, ours, processor):
    model, _ = sglang_model
    inputs = _mixed_media_inputs(processor)
    grid = inputs["grid_thw"]
    expected = sum(t * h * w // 4 + t for t, h, w in grid.tolist())
    stock = model._get_encoder_len(SimpleNamespace(mm_items=[SimpleNamespace(grid_thw=grid)]))
    with torch.no_grad():
        mine = sum(m.shape[0] for m in ours.encode_media(inputs["pixel_values"], grid))
    assert stock == expected == mine


def test_stock_processor_positions_and_visibility_equal_ours(sglang_processor, processor, ours):
    inputs = _mixed_media_inputs(processor)
    input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
    mrope, delta, vision_ids, info = sglang_processor._compute_position_metadata(
        input_ids=input_ids,
        attention_mask=attention_mask,
        grid_thw=inputs["grid_thw"],
        media_nums_per_sample=inputs["media_nums_per_sample"],
    )
    counts = sglang_processor._compute_visible_frame_counts(inputs["cross_attention_mask"])
    items = sglang_processor._build_mm_items(dict(inputs), input_ids.flatten())
    assert len(items) == 1 and items[0].grid_thw is not None and len(info) == 1

    grids = [(h // 2, w // 2) for t, h, w in inputs["grid_thw"].tolist() for _ in range(t)]
    mine = compute_xrope_positions(input_ids, attention_mask, [grids], ours.config.image_token_id)
    assert torch.equal(mine.text, mrope)
    assert torch.equal(mine.vision, vision_ids)
    assert int(mine.next_text[0]) - input_ids.shape[1] == int(delta.flatten()[0])
    # frame-prefix visibility: one more frame at each <|image_pad|>, none before the first
    pads = (input_ids[0] == ours.config.image_token_id).long().cumsum(0)
    assert torch.equal(counts.long(), pads)


def test_stock_processor_gives_a_text_only_prompt_no_media(sglang_processor, processor):
    """Text only, our processor returns the real checkpoint's placeholder frame. Stock's position code fails on it
    and its item builder turns it into a 17-slot junk encoder; through the plugin's hook the request has no media."""
    text = "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    raw = processor(text=text)
    assert raw["grid_thw"].tolist() == [[1, 8, 8]] and not raw["pixel_values"].any()
    assert raw["media_nums_per_sample"] == [1] and raw["cross_attention_mask"].all()
    with pytest.raises(ValueError, match="found 1 frame"):
        sglang_processor._compute_position_metadata(
            raw["input_ids"], raw["attention_mask"], raw["grid_thw"], raw["media_nums_per_sample"]
        )
    assert len(sglang_processor._build_mm_items(dict(raw), raw["input_ids"].flatten())) == 1
    # The hook on process_mm_data, given the HF processor's outputs as the wrapped call (the served tests run it
    # inside the real processor pipeline).
    inputs = text_only_requests.without_unreferenced_media(lambda _: dict(raw), sglang_processor)
    image = processor(text="<|image|>hi", images=[str(ASSETS / "square_64.png")])
    assert text_only_requests.without_unreferenced_media(lambda _: image, sglang_processor) is image
    assert inputs.get("pixel_values") is None and inputs.get("grid_thw") is None
    assert sglang_processor._build_mm_items(dict(inputs), torch.as_tensor(inputs["input_ids"]).flatten()) == []
    input_ids = torch.as_tensor(inputs["input_ids"])
    mrope, delta, vision_ids, _ = sglang_processor._compute_position_metadata(
        input_ids, torch.as_tensor(inputs["attention_mask"]), None, None
    )
    assert vision_ids is None
    assert torch.equal(mrope[0, 0], torch.arange(input_ids.shape[1]))


def test_xrope_rotation_equals_stock_cross_and_self_attention(sglang_model, ours, processor):
    """Vision keys (k_proj -> k_norm -> XRoPE at vision positions) and self-attention q/k MRoPE."""
    model, _ = sglang_model
    inputs = _mixed_media_inputs(processor)
    config = ours.config
    grids = [(h // 2, w // 2) for t, h, w in inputs["grid_thw"].tolist() for _ in range(t)]
    positions = compute_xrope_positions(inputs["input_ids"], inputs["attention_mask"], [grids], config.image_token_id)
    cross_index = config.text_config.cross_attention_layers[0]
    states = torch.randn(
        positions.vision.shape[-1], config.text_config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    stock_cross = model.language_model.model.layers[cross_index].cross_attn
    mine_cross = ours.model.language_model.layers[cross_index].cross_attn
    head_dim, kv_heads = config.text_config.head_dim, config.text_config.num_key_value_heads
    with torch.no_grad():
        k, _ = stock_cross.k_proj(states)
        k = stock_cross.k_norm(k.reshape(-1, head_dim)).view(k.shape)
        stock_k = stock_cross._apply_cross_attn_rotary(positions.vision[:, 0], k)
        mine_k, mine_v = mine_cross.key_value(states[None], positions.vision)
        stock_v, _ = stock_cross.v_proj(states)
    torch.testing.assert_close(
        mine_k[0].transpose(0, 1).reshape(-1, kv_heads * head_dim), stock_k, rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        mine_v[0].transpose(0, 1).reshape(-1, kv_heads * head_dim), stock_v, rtol=1e-5, atol=1e-5
    )

    self_index = next(
        i for i in range(config.text_config.num_hidden_layers) if i not in config.text_config.cross_attention_layers
    )
    rotary = model.language_model.model.layers[self_index].self_attn.rotary_emb
    length = positions.text.shape[-1]
    q = torch.randn(
        length, config.text_config.num_attention_heads * head_dim, generator=torch.Generator().manual_seed(1)
    )
    k = torch.randn(length, kv_heads * head_dim, generator=torch.Generator().manual_seed(2))
    stock_q, stock_k = rotary.forward_native(positions.text[:, 0], q.clone(), k.clone())
    mine_attn = ours.model.language_model.layers[self_index].self_attn
    mine_q = mine_attn.rotate(q.view(1, length, -1, head_dim).transpose(1, 2), positions.text)
    mine_k = mine_attn.rotate(k.view(1, length, -1, head_dim).transpose(1, 2), positions.text)
    torch.testing.assert_close(mine_q[0].transpose(0, 1).reshape(length, -1), stock_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine_k[0].transpose(0, 1).reshape(length, -1), stock_k, rtol=1e-5, atol=1e-5)


def test_chat_template_renders_like_sglang_moss_vl_conversation(processor):
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.parser.conversation import generate_chat_conv

    openai_messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "file:///a.png"}},
                {"type": "text", "text": "What is this?"},
            ],
        },
        {"role": "assistant", "content": "A square."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "And here"},
                {"type": "video_url", "video_url": {"url": "file:///v.mp4"}},
                {"type": "text", "text": "?"},
            ],
        },
    ]
    stock = generate_chat_conv(ChatCompletionRequest(model="m", messages=openai_messages), "moss-vl").get_prompt()
    assert processor.apply_chat_template(openai_messages, add_generation_prompt=True) == stock
    text_only = [{"role": "user", "content": "hello"}]
    stock = generate_chat_conv(ChatCompletionRequest(model="m", messages=text_only), "moss-vl").get_prompt()
    assert processor.apply_chat_template(text_only, add_generation_prompt=True) == stock


STOCK_PIPELINE_SCRIPT = """
import asyncio, json, sys
from types import SimpleNamespace
from PIL import Image
from transformers import AutoConfig
from sglang.srt.multimodal.processors.moss_vl import MossVLImageProcessor
from sglang.srt.multimodal.transport import determine_tensor_transport_mode
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_tokenizer
from sglang.srt.utils.hf_transformers.processor import get_processor

checkpoint, image, video, text = sys.argv[1:5]
# prefill backend named only to pass stock server-args validation; no attention runs here
args = ServerArgs(model_path=checkpoint, trust_remote_code=True, device="cpu", prefill_attention_backend="flashinfer")
set_global_server_args_for_tokenizer(args)
stock = MossVLImageProcessor(AutoConfig.from_pretrained(checkpoint, trust_remote_code=True), args,
                             get_processor(checkpoint, trust_remote_code=True), determine_tensor_transport_mode())
images = [Image.open(image).convert("RGB")]
out = asyncio.run(stock.process_mm_data_async(images, text, SimpleNamespace(video_data=[video])))
print(json.dumps({"input_ids": out.input_ids, "grid_thw": out.mm_items[0].grid_thw.tolist(),
                  "mrope": out.mrope_positions.tolist(), "vision": out.vision_position_ids.tolist(),
                  "counts": out.visible_frame_counts.tolist()}))
"""


def test_stock_multimodal_processor_runs_our_processor_end_to_end(checkpoint, processor, ours):
    """The tokenizer-process path of a real server: sglang loads our processor with get_processor
    and calls it from process_mm_data_async on an image plus a video file. A subprocess keeps the
    published global server args out of this test session."""
    import json
    import os
    import subprocess
    import sys

    image, video = str(ASSETS / "square_64.png"), str(ASSETS / "moving_square_3s.mp4")
    text = "<|im_start|>user\n<|image|>What moves in<|video|>?<|im_end|>\n<|im_start|>assistant\n"
    repo = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(repo / "cpu_shim"), str(repo), os.environ.get("PYTHONPATH", "")])
    )
    result = subprocess.run(
        [sys.executable, "-c", STOCK_PIPELINE_SCRIPT, str(checkpoint), image, video, text],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    stock = json.loads(result.stdout.strip().splitlines()[-1])
    mine = processor(text=text, images=[image], videos=[video])
    assert stock["input_ids"] == mine["input_ids"][0].tolist()
    assert stock["grid_thw"] == mine["grid_thw"].tolist() == [[1, 4, 4], [3, 4, 4]]
    grids = [(h // 2, w // 2) for t, h, w in mine["grid_thw"].tolist() for _ in range(t)]
    positions = compute_xrope_positions(mine["input_ids"], mine["attention_mask"], [grids], ours.config.image_token_id)
    assert stock["mrope"] == positions.text[:, 0].tolist()
    assert stock["vision"] == positions.vision[:, 0].tolist()
    assert stock["counts"] == (~mine["cross_attention_mask"][0, 0]).sum(-1).tolist()


class DenseOracleAttention:
    """Attention backend for the stock model written as the obviously-correct dense computation:
    self-attention is causal over the request's text; cross-attention during prefill lets row i
    see the encoder keys of frames < visible_frame_counts[i] (the frame-causal contract an engine
    backend must implement) and, at decode, every encoder key (what stock sglang does). K/V are
    kept per layer, as a KV cache would keep them."""

    def __init__(self, frame_of_key: torch.Tensor, visible_counts: torch.Tensor):
        self.frame_of_key, self.visible_counts = frame_of_key, visible_counts
        self.kv = {}

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **_):
        heads, kv_heads, dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        if k is not None:
            k, v = k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)
            if not layer.is_cross_attention and layer.layer_id in self.kv:
                old_k, old_v = self.kv[layer.layer_id]
                k, v = torch.cat((old_k, k)), torch.cat((old_v, v))
            self.kv[layer.layer_id] = (k, v)
        k, v = self.kv[layer.layer_id]
        q = q.view(-1, heads, dim)
        rows, keys = q.shape[0], k.shape[0]
        if layer.is_cross_attention and forward_batch.forward_mode.is_extend():
            allowed = self.frame_of_key[None, :] < self.visible_counts[:, None]
        elif layer.is_cross_attention:
            allowed = torch.ones(rows, keys, dtype=torch.bool)
        else:
            allowed = torch.arange(keys)[None, :] <= torch.arange(keys - rows, keys)[:, None]
        out = torch.zeros(rows, heads, dim)
        for h in range(heads):
            scores = (q[:, h] @ k[:, h // (heads // kv_heads)].T) * layer.scaling
            weights = torch.nan_to_num(scores.masked_fill(~allowed, float("-inf")).softmax(-1))
            out[:, h] = weights @ v[:, h // (heads // kv_heads)]
        return out.reshape(rows, heads * dim)


def test_stock_language_model_with_dense_attention_equals_ours_prefill_and_decode(
    sglang_model, sglang_processor, processor, ours
):
    """Stock sglang's MossVL forward (vision, separators, row gating, every decoder layer) with
    the dense attention above gives our logits for the prompt and for greedy decode steps."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, set_forward_context

    model, _ = sglang_model
    text = "<|im_start|>user\nBefore <|image|> between<|video|> after<|im_end|>\n<|im_start|>assistant\n"
    inputs = processor(
        text=text, images=[str(ASSETS / "gradient_96x64.png")], videos=[str(ASSETS / "moving_square_3s.mp4")]
    )
    grid = inputs["grid_thw"]
    counts = (~inputs["cross_attention_mask"][0, 0]).sum(-1)
    frame_of_key = torch.cat(
        [
            torch.full((h * w // 4 + 1,), f)
            for f, (h, w) in enumerate((h, w) for t, h, w in grid.tolist() for _ in range(t))
        ]
    )
    mrope, delta, vision_ids, _ = sglang_processor._compute_position_metadata(
        inputs["input_ids"], inputs["attention_mask"], grid, inputs["media_nums_per_sample"]
    )
    length, encoder_len = inputs["input_ids"].shape[1], frame_of_key.shape[0]
    mm_input = SimpleNamespace(
        mm_items=[SimpleNamespace(feature=inputs["pixel_values"], grid_thw=grid)],
        vision_position_ids=vision_ids[:, 0],
        visible_frame_counts=counts.to(torch.int32),
        release_features=lambda: None,
    )

    def batch(mode, new_tokens, prefix, positions):
        return SimpleNamespace(
            forward_mode=mode,
            batch_size=1,
            mm_inputs=[mm_input],
            encoder_cached=[mode.is_decode()],
            encoder_lens_cpu=[encoder_len],
            encoder_lens=torch.tensor([encoder_len]),
            seq_lens=torch.tensor([prefix + new_tokens]),
            extend_seq_lens=torch.tensor([new_tokens]),
            extend_seq_lens_cpu=[new_tokens],
            extend_prefix_lens_cpu=[prefix],
            mrope_positions=positions,
            residual_stream=None,
            global_num_token_non_padded_cpu=None,
            attn_cp_metadata=None,
        )

    def stock_logits(ids, forward_batch):
        pixels, grid_thw, vision_positions = model._collect_mm_data(forward_batch)
        states = (
            None
            if pixels is None
            else model._insert_separator_tokens(model._get_vision_features(pixels, grid_thw), grid_thw)
        )
        hidden = model.language_model(
            input_ids=ids,
            positions=forward_batch.mrope_positions,
            cross_attention_states=states,
            cross_attention_mask=None,
            full_text_row_masked_out_mask=model.get_full_text_row_masked_out_mask(forward_batch),
            forward_batch=forward_batch,
            skip_cross_attention=False,
            vision_position_ids=vision_positions,
        )
        return hidden @ model.language_model.lm_head.weight.T

    previous = set_forward_context(ForwardContext(attn_backend=DenseOracleAttention(frame_of_key, counts)))
    try:
        with torch.no_grad():
            stock = [stock_logits(inputs["input_ids"][0], batch(ForwardMode.EXTEND, length, 0, mrope[:, 0]))]
            tokens = [int(stock[0][-1].argmax())]
            for step in range(3):
                position = torch.full((3, 1), length + step + int(delta.flatten()[0]))
                stock.append(
                    stock_logits(torch.tensor(tokens[-1:]), batch(ForwardMode.DECODE, 1, length + step, position))
                )
                tokens.append(int(stock[-1][-1].argmax()))
    finally:
        set_forward_context(previous)
    generated = ours.generate(**inputs, max_new_tokens=4, eos_token_id=[])
    assert generated[0, length:].tolist() == tokens
    with torch.no_grad():
        out = ours(**inputs, use_cache=True)
        torch.testing.assert_close(out.logits[0], stock[0], rtol=1e-4, atol=1e-4)
        mask = inputs["attention_mask"]
        for step in range(3):
            mask = torch.cat((mask, torch.ones(1, 1, dtype=mask.dtype)), dim=1)
            step_logits = ours(
                torch.tensor([[tokens[step]]]), mask, past_key_values=out.past_key_values, use_cache=True
            ).logits[0]
            torch.testing.assert_close(step_logits, stock[step + 1], rtol=1e-4, atol=1e-4)
