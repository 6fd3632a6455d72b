"""Attention dispatch of the reference model through transformers' attention interface, and chunked vision.

Oracles: the model loaded with `sdpa` in fp32 (the serving parity oracle); for FlashAttention-2, which cannot run
on CPU, a STAND-IN registered under transformers' `flash_attention_2` name: plain torch softmax attention with
FlashAttention's documented input contract — (B, keys) padding mask, 1 = real token; causality as the module's
`is_causal` flag, aligned to the bottom-right when there are more keys than queries — and output (B, L, H, D).
"""

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoProcessor
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from moss_vl_reference.modeling_moss_vl import frame_chunks
from moss_vl_reference.tiny_checkpoint import build_or_reuse

ASSETS = Path(__file__).parent / "assets"
GREEDY = {"max_new_tokens": 6, "eos_token_id": []}


def runnable_implementations() -> list[str]:
    implementations = ["eager", "sdpa"]
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        implementations.append("flash_attention_2")
    return implementations


@pytest.fixture(scope="module")
def checkpoint():
    return build_or_reuse("tiny")


@pytest.fixture(scope="module")
def processor(checkpoint):
    return AutoProcessor.from_pretrained(checkpoint, trust_remote_code=True, frame_extract_num_threads=1)


def load(checkpoint, implementation: str):
    return AutoModelForCausalLM.from_pretrained(
        checkpoint, trust_remote_code=True, dtype=torch.float32, attn_implementation=implementation
    ).eval()


@pytest.fixture(scope="module")
def sdpa_model(checkpoint):
    return load(checkpoint, "sdpa")


def padded_image_batch(processor) -> dict:
    """Two samples, left-padded: a long image question and a short one (padding rows and keys exist)."""
    texts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
            add_generation_prompt=True,
        )
        for question in ("Describe every shape and colour in this picture, then count them.", "What?")
    ]
    images = [str(ASSETS / "square_64.png"), str(ASSETS / "gradient_96x64.png")]
    inputs = processor(text=texts, images=images)
    assert (inputs["attention_mask"] == 0).any(), "the batch must contain padding"
    return inputs


@pytest.mark.parametrize("implementation", runnable_implementations())
def test_each_runnable_implementation_loads_routes_and_matches_sdpa(checkpoint, processor, sdpa_model, implementation):
    model = load(checkpoint, implementation)
    layers = model.model.language_model.layers
    cross = model.config.text_config.cross_attention_layers
    self_layer = next(layer for index, layer in enumerate(layers) if index not in cross)
    assert self_layer.self_attn.implementation == implementation
    assert model.model.visual.config._attn_implementation == implementation
    inputs = padded_image_batch(processor)
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        got, expected = model(**inputs).logits, sdpa_model(**inputs).logits
    torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-4)


def test_flash_attention_2_is_declared_and_only_the_missing_kernel_stops_it_here(checkpoint):
    model_class = type(load(checkpoint, "sdpa"))
    assert model_class._supports_flash_attn and model_class._supports_sdpa
    if "flash_attention_2" in runnable_implementations():
        pytest.skip("FlashAttention-2 runs on this machine; the parametrized test above loads it")
    with pytest.raises(ImportError, match="FlashAttention2") as refused:
        load(checkpoint, "flash_attention_2")
    assert "does not support" not in str(refused.value)


def flash_attention_2_stand_in(calls: list):
    """STAND-IN for transformers' flash_attention_2 function (see the module docstring); records the module
    class of every call and refuses dense masks, which the real kernel cannot take."""

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        calls.append(type(module).__name__)
        if attention_mask is not None and attention_mask.dim() != 2:
            raise AssertionError(
                f"FlashAttention takes a (batch, keys) padding mask, got {tuple(attention_mask.shape)}"
            )
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        queries, keys = query.shape[2], key.shape[2]
        allowed = torch.ones(query.shape[0], 1, queries, keys, dtype=torch.bool)
        if module.is_causal:
            offset = keys - queries
            allowed &= torch.arange(keys)[None, :] <= torch.arange(queries)[:, None] + offset
        if attention_mask is not None:
            allowed &= attention_mask.bool()[:, None, None, :]
        scores = (query @ key.transpose(-1, -2)) * scaling
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
        return (weights @ value).transpose(1, 2).contiguous(), None

    return attend


def test_flash_attention_2_routes_self_and_vision_attention_and_keeps_cross_attention_dense(
    checkpoint, processor, sdpa_model, monkeypatch
):
    calls: list[str] = []
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", flash_attention_2_stand_in(calls))
    model = load(checkpoint, "sdpa")
    model.config._attn_implementation = "flash_attention_2"  # the kernel is absent here: switch after loading
    inputs = padded_image_batch(processor)
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        got, expected = model(**inputs).logits, sdpa_model(**inputs).logits
    torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-4)
    text = model.config.text_config
    self_layers = text.num_hidden_layers - len(text.cross_attention_layers)
    assert calls.count("MossVLSelfAttention") == self_layers
    assert calls.count("MossVLVisionAttention") >= model.config.vision_config.depth
    assert "MossVLCrossAttention" not in calls, (
        "per-row frame visibility needs a dense mask: cross-attention stays sdpa"
    )
    calls.clear()
    assert torch.equal(model.generate(**inputs, **GREEDY), sdpa_model.generate(**inputs, **GREEDY))
    steps = calls.count("MossVLSelfAttention") / self_layers
    assert steps == int(steps) and steps > 1, "the prefill and the cached decode steps all run the stand-in"


def test_an_explicit_flash_cross_attention_is_refused_by_name(checkpoint, processor):
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, trust_remote_code=True, dtype=torch.float32, cross_attention_implementation="flash_attention_3"
    )
    inputs = padded_image_batch(processor)
    with pytest.raises(ValueError, match="flash_attention_3.*per-row frame visibility"):
        model(**inputs)


def test_frame_chunks_split_media_into_runs_of_at_most_n_frames():
    assert frame_chunks([[3, 4, 4], [2, 6, 6]], 2) == [[(2, 4, 4)], [(1, 4, 4), (1, 6, 6)], [(1, 6, 6)]]
    assert frame_chunks([[1, 4, 4], [1, 6, 6]], 64) == [[(1, 4, 4), (1, 6, 6)]]
    assert frame_chunks([[4, 2, 2]], 2) == [[(2, 2, 2)], [(2, 2, 2)]]


def test_vision_chunked_length_encodes_the_same_tokens_in_chunks(checkpoint, processor, sdpa_model, monkeypatch):
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "image"}, {"type": "text", "text": "Compare."}]}],
        add_generation_prompt=True,
    )
    inputs = processor(text=text, videos=[str(ASSETS / "moving_square_3s.mp4")], images=[str(ASSETS / "square_64.png")])
    frames = int(inputs["grid_thw"][:, 0].sum())
    assert frames >= 4, frames
    tower_frames: list[int] = []
    visual = sdpa_model.model.visual
    original = visual.forward
    monkeypatch.setattr(
        visual, "forward", lambda pixels, grid: tower_frames.append(int(grid[:, 0].sum())) or original(pixels, grid)
    )
    with torch.no_grad():
        whole = sdpa_model.encode_frames(inputs["pixel_values"], inputs["grid_thw"])
        chunked = sdpa_model.encode_frames(inputs["pixel_values"], inputs["grid_thw"], vision_chunked_length=3)
    assert tower_frames == [frames] + [3] * (frames // 3) + ([frames % 3] if frames % 3 else [])
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    assert torch.equal(
        sdpa_model.generate(**inputs, **GREEDY, vision_chunked_length=3), sdpa_model.generate(**inputs, **GREEDY)
    )
