"""The INT8 (W8A8_DYNAMIC) tiny MOSS-VL served along the ``--device npu`` route on CPU with decode graphs (issue 53).

The converter's output of the tiny checkpoint, one server in bf16 at page size 128 on the simulated Ascend route of
tests/test_npu_route_served.py (support/npu_route_probe.py: every stock layer's NPU branch, stock's ModelSlim linear
method calling the STAND-IN ``npu_dynamic_quant`` / ``npu_quant_matmul``, stock's NPU KV pool), decode graphs on
(``--enable-torch-compile``, stock's CPU graph runner, one bucket of 4): a request alone and three at once replay it
padded, eight at once decode eagerly (above the bucket), so both decode paths are checked.

Oracle: the reference transformers model, fp32, whose quantized linears compute in fp64 from the same int8 weights
and scales with the activations quantized per token as the torch_npu page defines it (``s = max|x| / 127``,
``round(x / s)``). The served bf16 logprobs differ from it by up to ``LOGPROB_BOUND`` (measured, below), so a greedy
step whose reference top-2 logprobs are closer than ``2 * LOGPROB_BOUND`` may legitimately go either way in bf16.
How exactness is checked anyway (option "prompts without a near-tie"): every case's reference continuation keeps its
top-2 margin above ``2 * LOGPROB_BOUND`` at every step, asserted on the reference
(``test_the_reference_has_no_near_tie``: the prompt choice is checked, not trusted), and then the served tokens must
equal the reference's exactly, for an image, a video, text and two turns, alone and in batches, each logprob within
the bound. Teacher-forcing the reference's tokens through the API was the other option; it reads prompt logprobs,
i.e. a prefill, and would never check the decode step that the graphs replace. The earlier prompts "Tell me about
cats." and the two-turn "Which way does it fade?" met reference margins of 0.012 and 0.023; the prompts below were
picked from a list of phrasings (4 per text subject, 20 image questions, 40 two-turn variants) as ones whose
continuations stay clear of ties. What this can and cannot catch (checked on the reference, 2026-12-07, by swapping
its quantized linears): weight scales applied per row instead of per column change these tokens (from step 0, 1 or
6); float weights (INT8 skipped) or unquantized activations do not: on the tiny model they move step 0's logprobs
by at most 0.112, below the bf16 bound. Those are caught by the kernel counts here and by tests/test_quant_loading.py
(every layer on stock's ModelSlim method; a quantized linear within one bf16 ulp of fp64).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from moss_vl_reference.queries_moss_vl import file_data_url
from moss_vl_reference.tiny_checkpoint import build_or_reuse
from mossvl_ascend import quantize
from mossvl_ascend.modelslim_format import DESCRIPTION_FILE, DYNAMIC
from serving.launch import SglangServer
from support.npu_route_probe import MODE_ENV, PROBE_ENV, install_probe
from support.serving import ASSETS, greedy_with_logprobs, load_reference, server_log

pytestmark = pytest.mark.timeout(1500)

MAX_TOKENS = 8
# Served bf16 INT8 against the fp32/fp64 fake-quant reference: the largest |logprob difference| of a served token.
# Measured 2026-12-07: 0.156 with decode graphs (image, step 2; video 0.104, text 0.123, two turns 0.072), 0.129 with
# graphs off: bf16 activations, attention and residuals (the tiny model's logits reach ~44, where a bf16 step is
# 0.25). Weight scales on the wrong axis move logprobs by 0.5-0.7 and change the tokens.
LOGPROB_BOUND = 0.17
# A reference step whose top-2 logprobs are closer than this may flip in bf16: no case may contain one.
TIE_MARGIN = 2 * LOGPROB_BOUND
BUCKETS = ["4"]
GRAPHS = ["--enable-torch-compile", "--cuda-graph-bs-decode", *BUCKETS, "--decode-log-interval", "1"]
# Stock's switch that holds the scheduler's input while the tokenizer processes a batch request: its requests are
# scheduled together, so a batch of three decodes as three rows and a batch of eight as eight.
GRAPH_ENV = {"SGLANG_ENABLE_COLOCATED_BATCH_GEN": "1"}
# Stock's decode log line (scheduler_components/metrics_reporter.py): the batch size and whether the graph ran.
DECODE_LINE = re.compile(r"Decode batch, #running-req: (\d+),.*?cpu graph: (True|False)")
CASES = {
    "image": [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": str(ASSETS / "gradient_96x64.png")},
                {"type": "text", "text": "What can you see?"},
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
    "text": [{"role": "user", "content": "What do you know about dogs?"}],
    "two_turns": [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": str(ASSETS / "gradient_96x64.png")},
                {"type": "text", "text": "What is this?"},
            ],
        },
        {"role": "assistant", "content": "A gradient."},
        {"role": "user", "content": "Why?"},
    ],
}


def media(messages) -> tuple[list[str], list[str]]:
    images = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"] if "image" in p]
    videos = [p["video"] for m in messages if isinstance(m["content"], list) for p in m["content"] if "video" in p]
    return [file_data_url(Path(p)) for p in images], [file_data_url(Path(p)) for p in videos]


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


def answers(meta: dict) -> tuple[list[int], list[float]]:
    """(ids, logprobs) of one answer's output tokens."""
    return [entry[1] for entry in meta["output_token_logprobs"]], [entry[0] for entry in meta["output_token_logprobs"]]


def ask(base_url, reference, name):
    images, videos = media(CASES[name])
    answer = greedy_with_logprobs(base_url, reference[name][0], images or None, videos or None, MAX_TOKENS)
    return answers(answer["meta_info"])


def ask_together(base_url, reference, names: list[str]) -> list[tuple[list[int], list[float]]]:
    """The named cases as one batch request (per text a media list, empty when it has none: stock's request decoder
    reads a field's shape from its first entry)."""
    images, videos = zip(*(media(CASES[name]) for name in names))
    batch = greedy_with_logprobs(
        base_url,
        [reference[name][0] for name in names],
        list(images) if any(images) else None,
        list(videos) if any(videos) else None,
        MAX_TOKENS,
    )
    return [answers(answer["meta_info"]) for answer in batch]


@pytest.fixture(scope="module")
def served(int8_checkpoint, reference, tmp_path_factory):
    """One INT8 server on the NPU route with decode graphs: each case alone and three at once (bucket 4, padded),
    all four twice at once (eight rows: eager decode)."""
    tmp = tmp_path_factory.mktemp("int8-route")
    args = ["--dtype", "bfloat16", "--page-size", "128", "--skip-server-warmup", *GRAPHS]
    server = SglangServer(int8_checkpoint, extra_args=args, name="int8-npu-route", ready_timeout_s=900)
    server.env.update({PROBE_ENV: str(tmp / "route.json"), MODE_ENV: "npu", **GRAPH_ENV})
    server.env["PYTHONPATH"] = os.pathsep.join([install_probe(tmp / "probe"), server.env["PYTHONPATH"]])
    names = list(CASES)
    with server:
        alone = {name: ask(server.base_url, reference, name) for name in names}
        three = dict(zip(names[:3], ask_together(server.base_url, reference, names[:3])))
        eight = ask_together(server.base_url, reference, names + names)
        steps = [(int(n), graph == "True") for n, graph in DECODE_LINE.findall(server_log(server))]
    return {
        "alone": alone,
        "three": three,
        "eight": list(zip(names + names, eight)),
        "steps": steps,
        "route": json.loads((tmp / "route.json").read_text()),
    }


def test_the_server_ran_the_int8_kernels_on_the_npu_route(served):
    ops = served["route"]["torch_npu_ops"]
    assert ops.get("npu_dynamic_quant", 0) > 0 and ops["npu_dynamic_quant"] == ops.get("npu_quant_matmul")
    assert served["route"]["kv_pool"].endswith("NPUMHATokenToKVPool")


def test_decode_ran_the_graph_alone_and_padded_and_eagerly_above_the_buckets(served):
    steps = served["steps"]
    assert {1, 3} <= {size for size, graph in steps if graph}, steps
    assert all(graph for size, graph in steps if size <= int(BUCKETS[-1])), steps
    assert any(size == 8 and not graph for size, graph in steps), steps


@pytest.mark.parametrize("case", list(CASES))
def test_the_reference_has_no_near_tie(reference, case):
    """The precondition of exact token equality: at every step the reference's top-2 logprobs are more than
    ``2 * LOGPROB_BOUND`` apart, so bf16 serving within the bound cannot take the other token."""
    top2 = reference[case][2].topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    print(f"{case}: reference top-2 margins {' '.join(f'{m:.3f}' for m in margins)}")
    assert min(margins) > TIE_MARGIN, margins


@pytest.mark.parametrize("case", list(CASES))
def test_served_int8_tokens_equal_the_fake_quant_reference(served, reference, case):
    """Every served token is the reference's, with its logprob within LOGPROB_BOUND of the reference's."""
    _, ids, logprobs = reference[case]
    served_ids, served_logprobs = served["alone"][case]
    assert served_ids == ids
    errors = [abs(lp - logprobs[step, token].item()) for step, (token, lp) in enumerate(zip(ids, served_logprobs))]
    print(f"{case}: {len(ids)}/{len(ids)} tokens equal; max |logprob error| {max(errors):.4f}")
    assert max(errors) <= LOGPROB_BOUND, errors


@pytest.mark.parametrize("batch", ["three", "eight"])
def test_concurrent_requests_each_equal_the_reference_and_themselves_alone(served, reference, batch):
    """Three at once (a padded graph replay) and eight at once (eager decode, above the largest bucket)."""
    answers_of = served[batch].items() if batch == "three" else served[batch]
    for name, (ids, _) in answers_of:
        assert ids == reference[name][1] == served["alone"][name][0], name
