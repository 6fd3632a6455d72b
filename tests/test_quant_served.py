"""The INT8 (W8A8_DYNAMIC) tiny MOSS-VL served along the ``--device npu`` route on CPU (issue 53).

The converter's output of the tiny checkpoint, one server in bf16 at page size 128 on the simulated Ascend route of
tests/test_npu_route_served.py (support/npu_route_probe.py: every stock layer's NPU branch, stock's ModelSlim linear
method calling the STAND-IN ``npu_dynamic_quant`` / ``npu_quant_matmul``, stock's NPU KV pool).

Oracle: the reference transformers model, fp32, whose quantized linears compute in fp64 from the same int8 weights
and scales with the activations quantized per token as the torch_npu page defines it (``s = max|x| / 127``,
``round(x / s)``). For an image, a video, text and two turns the served greedy tokens are its tokens, with logprobs
within the stated bound, except where the reference itself is within that bound of a tie (bf16 serving may then
take the other tied token; measured: text and two turns meet such a tie at tokens 4 and 6 of 8). Eight concurrent
requests each equal the same request served alone.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from moss_vl_reference.queries_moss_vl import file_data_url
from moss_vl_reference.tiny_checkpoint import build_or_reuse
from mossvl_ascend import quantize
from mossvl_ascend.modelslim_format import DESCRIPTION_FILE, DYNAMIC
from serving.launch import SglangServer
from support.npu_route_probe import MODE_ENV, PROBE_ENV, install_probe
from support.serving import ASSETS, greedy_with_logprobs, load_reference

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 8
# Served bf16 INT8 against the fp32/fp64 fake-quant reference: the largest |logprob difference| of a served token.
# Measured 2026-12-07: 0.118 (image), 0.074 (video): bf16 activations, attention and residuals (the tiny model's
# logits reach ~44, where a bf16 step is 0.25). An INT8 kernel or name-mapping bug moves logprobs by whole units.
LOGPROB_BOUND = 0.15
CASES = {
    "image": [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": str(ASSETS / "square_64.png")},
                {"type": "text", "text": "What is in this image?"},
            ],
        }
    ],
    "video": [
        {
            "role": "user",
            "content": [
                {"type": "video", "video": str(ASSETS / "moving_square_3s.mp4")},
                {"type": "text", "text": "What moves in this video?"},
            ],
        }
    ],
    "text": [{"role": "user", "content": "Tell me about cats."}],
    "two_turns": [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": str(ASSETS / "gradient_96x64.png")},
                {"type": "text", "text": "What is this?"},
            ],
        },
        {"role": "assistant", "content": "A gradient."},
        {"role": "user", "content": "Which way does it fade?"},
    ],
}


def media(messages):
    images = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"] if "image" in p]
    videos = [p["video"] for m in messages if isinstance(m["content"], list) for p in m["content"] if "video" in p]
    return [file_data_url(Path(p)) for p in images] or None, [file_data_url(Path(p)) for p in videos] or None


def fake_quant_forward(weight_q: torch.Tensor, weight_scale: torch.Tensor):
    """A linear computing in fp64 what the W8A8_DYNAMIC kernel computes: per-token activation int8, int8 weights."""
    weight = weight_q.double().T
    scale = weight_scale.double().T

    def forward(x):
        x64 = x.double()
        x_scale = x64.abs().amax(-1, keepdim=True) / 127
        x_q = torch.round(x64 / torch.where(x_scale > 0, x_scale, torch.ones_like(x_scale)))
        return ((x_q @ weight) * x_scale * scale).to(x.dtype)

    return forward


def int8_reference(float_checkpoint: Path, int8_checkpoint: Path):
    """The fp32 reference model with every W8A8_DYNAMIC linear replaced by its fp64 fake-quant computation."""
    from safetensors.torch import load_file

    model, processor = load_reference(float_checkpoint)
    description = json.loads((int8_checkpoint / DESCRIPTION_FILE).read_text())
    tensors = {}
    for shard in sorted(int8_checkpoint.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    modules = dict(model.named_modules())
    replaced = 0
    for key, value in description.items():
        if key.endswith(".weight") and value == DYNAMIC:
            layer = key[: -len(".weight")]
            modules[layer].forward = fake_quant_forward(tensors[key], tensors[f"{layer}.weight_scale"])
            replaced += 1
    assert replaced == 52  # tiny: 6 x 4 self-attn + 2 x 2 cross-attn + 8 x 3 MLP linears
    return model, processor


def reference_answer(model, processor, messages):
    """(chat text, greedy ids, every step's log-softmax fp64) of the reference, never stopping at EOS."""
    inputs, _ = model.processor_inputs(processor, {"messages": messages})
    steps = []
    pick = model.pick

    def recorded(logits, *args):  # the reference's greedy choice, step by step (generation_moss_vl.py)
        steps.append(logits[0].double())
        return pick(logits, *args)

    model.pick = recorded
    try:
        with torch.no_grad():
            sequences = model.generate(**inputs, max_new_tokens=MAX_TOKENS, eos_token_id=[])
    finally:
        del model.pick
    ids = sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = torch.log_softmax(torch.stack(steps), -1)  # [MAX_TOKENS, vocab], fp64
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text, ids, logprobs


@pytest.fixture(scope="module")
def int8_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("int8-tiny-served")
    quantize.convert(build_or_reuse("tiny"), out)
    return out


@pytest.fixture(scope="module")
def reference(int8_checkpoint):
    model, processor = int8_reference(build_or_reuse("tiny"), int8_checkpoint)
    return {name: reference_answer(model, processor, messages) for name, messages in CASES.items()}


def ask(base_url, text, messages):
    images, videos = media(messages)
    meta = greedy_with_logprobs(base_url, text, images, videos, MAX_TOKENS)["meta_info"]
    return [entry[1] for entry in meta["output_token_logprobs"]], [entry[0] for entry in meta["output_token_logprobs"]]


@pytest.fixture(scope="module")
def served(int8_checkpoint, reference, tmp_path_factory):
    """One INT8 server on the NPU route: each case alone, then all cases twice at once (8 concurrent)."""
    tmp = tmp_path_factory.mktemp("int8-route")
    args = ["--dtype", "bfloat16", "--page-size", "128", "--skip-server-warmup"]
    server = SglangServer(int8_checkpoint, extra_args=args, name="int8-npu-route", ready_timeout_s=600)
    server.env.update({PROBE_ENV: str(tmp / "route.json"), MODE_ENV: "npu"})
    server.env["PYTHONPATH"] = os.pathsep.join([install_probe(tmp / "probe"), server.env["PYTHONPATH"]])
    with server:
        alone = {name: ask(server.base_url, reference[name][0], CASES[name]) for name in CASES}
        together, threads = {}, []
        for copy in range(2):
            for name in CASES:

                def run(name=name, copy=copy):
                    together[(name, copy)] = ask(server.base_url, reference[name][0], CASES[name])

                threads.append(threading.Thread(target=run))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return {"alone": alone, "together": together, "route": json.loads((tmp / "route.json").read_text())}


def test_the_server_ran_the_int8_kernels_on_the_npu_route(served):
    ops = served["route"]["torch_npu_ops"]
    assert ops.get("npu_dynamic_quant", 0) > 0 and ops["npu_dynamic_quant"] == ops.get("npu_quant_matmul")
    assert served["route"]["kv_pool"].endswith("NPUMHATokenToKVPool")


@pytest.mark.parametrize("case", list(CASES))
def test_served_int8_tokens_equal_the_fake_quant_reference(served, reference, case):
    """Token by token: the served token is the reference's, with its logprob within LOGPROB_BOUND; the only
    allowed difference is where the reference itself is within bf16's error of a tie (its top two logprobs closer
    than 2 x LOGPROB_BOUND), and there the served token must be one of the tied ones. Past a difference the two
    continue from different prefixes and are not compared."""
    _, ids, logprobs = reference[case]
    served_ids, served_logprobs = served["alone"][case]
    compared, errors = 0, []
    for step, (token, expected) in enumerate(zip(served_ids, ids)):
        errors.append(abs(served_logprobs[step] - logprobs[step, token].item()))
        assert errors[-1] <= LOGPROB_BOUND, (step, errors[-1])
        if token != expected:
            margin = (logprobs[step, expected] - logprobs[step, token]).item()
            assert margin <= 2 * LOGPROB_BOUND, f"step {step}: {token} instead of {expected} (margin {margin:.3f})"
            break
        compared += 1
    print(f"{case}: {compared}/{len(ids)} tokens equal; max |logprob error| {max(errors):.4f}")
    assert compared >= 1


def test_eight_concurrent_requests_each_equal_themselves_alone(served):
    for (name, _), answer in served["together"].items():
        assert answer[0] == served["alone"][name][0], name
