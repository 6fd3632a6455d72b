"""The tiny MOSS-VL served along the ``--device npu`` route on CPU, and the inventory of that route (issue 20,
items 1 and 4).

Two CPU servers in bf16 run the same prompt (two images and a 3-second video, then greedy decode steps), one at a
time; a test-only plugin (support/npu_route_probe.py) records in each which stock layer classes ran and which
implementation each dispatched to, which attention / mm-attention / sampling backends and KV pool served it, and
which STAND-IN torch_npu ops were called:

* the CPU route: stock sglang on this machine (``forward_native``, torch_native attention, SDPA vision attention);
* the NPU route: every stock layer dispatching as on an Ascend host (``forward_npu``), ``apply_rotary_pos_emb_npu``
  and ``VisionAscendAttention`` in the vision tower (``--mm-attention-backend ascend_attn``), the plugin's NPU
  attention primitive, stock's ``NPUMHATokenToKVPool`` and the ascend sampling backend, all on the stand-ins,
  with the two NPU-only stock-layer patches this route needs (``mossvl_ascend.patches.vision_rotary``,
  ``mossvl_ascend.patches.ascend_sampler``). A second phase on each server runs a sampled text request
  (temperature, top-k, top-p) while the media prompt prefills, so decode rows and a prefill share forwards
  (``--enable-mixed-chunk``).

Oracles: the NPU route's greedy tokens equal the CPU route's (same single-request batch, same dtype); its prompt
logprobs stay within the bf16 reference model's own spread around the fp32 reference model (the budget of
test_serving_bf16). The inventory (tests/npu_route_inventory.json) must list every class, dispatch, backend and
torch_npu op the NPU route recorded, and every torch_npu call written in the stock code on it, each with the test
that exercises it on CPU or the reason it is unreachable for MOSS-VL.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import pkgutil
import re
import threading
import time
from pathlib import Path

import pytest
import requests

from moss_vl_reference.queries_moss_vl import file_data_url
from serving.launch import SglangServer
from support.npu_route_probe import MODE_ENV, PROBE_ENV, install_probe
from support.serving import ASSETS, assert_within_the_bf16_spread, reference_in_fp32_and_bf16

pytestmark = pytest.mark.timeout(900)

TESTS_DIR = Path(__file__).resolve().parent
INVENTORY = TESTS_DIR / "npu_route_inventory.json"
IMAGES = [ASSETS / "square_64.png", ASSETS / "gradient_96x64.png"]
VIDEO = ASSETS / "moving_square_3s.mp4"
MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "image", "image": str(IMAGES[0])},
            {"type": "image", "image": str(IMAGES[1])},
            {"type": "video", "video": str(VIDEO)},
            {"type": "text", "text": "Compare the two pictures with what moves in the video."},
        ],
    }
]
DECODE_STEPS = 8
BASE_ARGS = [
    "--dtype",
    "bfloat16",
    "--skip-server-warmup",
    "--disable-radix-cache",
    "--enable-mixed-chunk",
    "--chunked-prefill-size",
    "16",
]


def generate(base_url, text, max_new_tokens, sampling=None, media=True, logprobs=True):
    """Native ``/generate``: (prompt [(logprob, id)], output [(logprob, id)]) with ``logprobs``; greedy unless
    ``sampling``. Requests without logprobs can share a forward with decoding ones (sglang mixes only those)."""
    body = {
        "text": text,
        "image_data": [file_data_url(path) for path in IMAGES] if media else None,
        "video_data": [file_data_url(VIDEO)] if media else None,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, **(sampling or {})},
        "return_logprob": logprobs,
        "logprob_start_len": 0,
    }
    response = requests.post(f"{base_url}/generate", json=body, timeout=600)
    response.raise_for_status()
    meta = response.json()["meta_info"]
    return (meta["input_token_logprobs"], meta["output_token_logprobs"]) if logprobs else None


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Prompt ids and fp32 / bf16 prompt logprobs of the reference model (computed before any server starts)."""
    return reference_in_fp32_and_bf16(checkpoint, MESSAGES)


def serve_route(checkpoint, tmp_path, reference, mode):
    """One server on ``mode``'s route: the media prompt alone (greedy), then the media prompt again while a sampled
    text request decodes; returns the first request's logprobs and the recorded route."""
    record = tmp_path / f"route-{mode}.json"
    server = SglangServer(checkpoint, extra_args=BASE_ARGS, name=f"npu-route-{mode}")
    server.env.update({PROBE_ENV: str(record), MODE_ENV: mode})
    server.env["PYTHONPATH"] = os.pathsep.join([install_probe(tmp_path / "probe"), server.env["PYTHONPATH"]])
    with server:
        prompt, output = generate(server.base_url, reference["text"], DECODE_STEPS)
        sampled = {"temperature": 0.8, "top_k": 20, "top_p": 0.9}
        decoding = threading.Thread(
            target=generate, args=(server.base_url, "Tell me a long story about cats.", 96, sampled, False, False)
        )
        decoding.start()
        time.sleep(0.5)
        generate(server.base_url, reference["text"], 2, logprobs=False)
        decoding.join()
    return {"prompt": prompt, "output": output, "route": json.loads(record.read_text())}


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory, reference):
    tmp = tmp_path_factory.mktemp("npu-route")
    return {mode: serve_route(checkpoint, tmp, reference, mode) for mode in ("cpu", "npu")}


# ------------------------------------------------------------------------------------------------ item 4


def test_npu_route_greedy_tokens_equal_the_cpu_route(served, reference):
    npu, cpu = served["npu"], served["cpu"]
    assert [entry[1] for entry in npu["prompt"]] == reference["ids"]
    assert [entry[1] for entry in npu["output"]] == [entry[1] for entry in cpu["output"]]


def test_npu_route_prompt_logprobs_within_the_bf16_reference_spread(served, reference):
    assert_within_the_bf16_spread(served["npu"]["prompt"], reference, "NPU route")


def test_npu_route_took_the_npu_implementations(served):
    """The route really is the NPU one (a probe that silently left the CPU dispatch would pass the tests above)."""
    route = served["npu"]["route"]
    modules = route["modules"]
    assert modules["sglang.srt.layers.layernorm.RMSNorm"] == ["forward_npu"]
    assert modules["sglang.srt.layers.activation.SiluAndMul"] == ["forward_npu"]
    assert modules["sglang.srt.layers.attention.vision.VisionAttention"] == [
        "sglang.srt.layers.attention.vision.VisionAscendAttention"
    ]
    assert modules["sglang.srt.layers.sampler.Sampler"] == ["ascend backend"]
    assert route["kv_pool"] == "sglang.srt.hardware_backend.npu.memory_pool_npu.NPUMHATokenToKVPool"
    for op in ("npu_rms_norm", "npu_add_rms_norm", "npu_swiglu", "npu_rotary_mul", "npu_fused_infer_attention_score"):
        assert route["torch_npu_ops"].get(op, 0) > 0, op
    assert route["torch_npu_ops"].get("_npu_reshape_and_cache", 0) > 0
    assert route["torch_npu_ops"].get("npu_top_k_top_p", 0) > 0  # the sampled request of the second phase
    assert route["mixed_batches"] > 0, "the second phase never put decode rows and a prefill in one forward"
    cpu_modules = served["cpu"]["route"]["modules"]
    assert cpu_modules["sglang.srt.layers.layernorm.RMSNorm"] == ["forward_native"]
    assert served["cpu"]["route"]["torch_npu_ops"] == {}


# ------------------------------------------------------------------------------------------------ item 1


def inventory():
    return json.loads(INVENTORY.read_text())


def defined_functions(path: str) -> set[str]:
    tree = ast.parse((TESTS_DIR.parent / path).read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


def assert_accounted(entry: dict, what: str):
    """An inventory entry names existing tests that exercise it on CPU, or says why MOSS-VL never reaches it."""
    covered, reason = entry.get("covered_by", []), entry.get("unreachable")
    assert bool(covered) != bool(reason), f"{what}: give covered_by or unreachable, exactly one"
    for node in covered:
        path, name = node.split("::")
        assert name in defined_functions(path), f"{what}: {node} does not exist"


def torch_npu_calls_in(target: str) -> set[str]:
    """The ``torch_npu.<op>`` names written in the source of a stock class or function (dotted path)."""
    return set(re.findall(r"torch_npu\.(\w+)", inspect.getsource(pkgutil.resolve_name(target))))


def test_inventory_accounts_for_every_class_and_dispatch_the_npu_route_took(served):
    listed = inventory()["modules"]
    for module, labels in served["npu"]["route"]["modules"].items():
        assert module in listed, f"{module} ran on the NPU route but is not in {INVENTORY.name}"
        for label in labels:
            assert label in listed[module]["npu"], f"{module}: dispatch {label!r} not in the inventory"
        assert_accounted(listed[module], module)
    for module in served["cpu"]["route"]["modules"]:
        assert module in listed, f"{module} ran on the CPU route but is not in {INVENTORY.name}"


def test_inventory_accounts_for_every_torch_npu_op_the_route_called(served):
    ops = inventory()["torch_npu_ops"]
    for op in served["npu"]["route"]["torch_npu_ops"]:
        assert op in ops and ops[op].get("covered_by"), f"torch_npu.{op} was called but no test covers it"
        assert_accounted(ops[op], op)


def test_inventory_accounts_for_every_torch_npu_call_written_on_the_route():
    """Static half: every ``torch_npu.<op>`` written in the stock classes and functions on the route (reached or
    behind a branch MOSS-VL does not take) is listed, covered or with its reason. A new NPU call in a stock layer on
    the route fails here until a test or a reason is added."""
    data = inventory()
    ops = data["torch_npu_ops"]
    for target in [*data["modules"], *data["npu_functions"]]:
        for op in torch_npu_calls_in(target):
            assert op in ops, f"{target} calls torch_npu.{op}, which the inventory does not list"
            assert_accounted(ops[op], op)
    for name, entry in data["npu_functions"].items():
        assert_accounted(entry, name)
