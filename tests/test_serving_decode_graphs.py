"""MOSS-VL decode graphs on CPU (``--enable-torch-compile``: stock's CPU graph runner, inductor) against eager decode.

Three servers, fp32, tiny checkpoint, radix cache on, chunked prefill on:

* ``eager``: page 128, chunked (the paged module's radix server, borrowed from the pool when it is still alive);
* ``graph-p128``: the same with decode graphs, buckets {4, 8}: a batch of 4 or 8 replays its own graph, 1-3 and
  5-7 replay a padded one (padding rows: no vision token, gate off, one text token of pool row 0);
* ``graph-p1``: page 1, decode graphs, buckets {1, 8}: a request alone and a batch of 8 replay their own graph.

Oracles: the reference transformers model's greedy ids in fp32 (computed before any server starts), which the eager
server also equals (``test_serving_paged.py``), and the eager server's prompt and output logprobs (inductor compiles
the graph's non-attention ops, so within 1e-4, not bit-equal). Serving must call exactly what start-up captured:
every graph server runs with dynamo's ``recompiles`` log on (``TORCH_LOGS``), and after start-up, batches of 1, 4
and 8 (exact buckets and padded ones, with images and text only, with and without logprobs) log no recompile. The
servers log every decode step; the tests check from stock's own log lines that the graph ran, at the batch sizes
asked for.
"""

from __future__ import annotations

import re

import pytest
import requests

from support.serving import (
    CASES,
    FP32_REPORTING_ARGS,
    PAGE_128_CHUNKED,
    batch_chat_logprobs,
    chat_logprobs,
    load_reference,
    long_case,
    native_chat_input,
    openai_client,
    reference_ids,
    served_ids,
    server_log,
    short_case,
)

pytestmark = pytest.mark.timeout(2400)

MAX_TOKENS = 24
SINGLE = ["image_data_url", "two_images", "video", "text_only", "three_turns"]
MIXED = {f"mixed_{name}": CASES[name] for name in SINGLE} | {
    "mixed_long0": long_case(0),
    "mixed_long1": long_case(1),
    "mixed_short2": short_case(2),
}
# Text only: with no vision token in the batch, stock replays the graph it captured without cross-attention.
TEXT = {f"text_{i}": short_case(2 * i) for i in range(8)}
ALL_CASES = {name: CASES[name] for name in SINGLE} | MIXED | TEXT
PAGE_1_CHUNKED = ["--page-size", "1", "--chunked-prefill-size", "256"]
GRAPHS = ["--enable-torch-compile", "--decode-log-interval", "1"]
BUCKETS = {"graph-p128": ["4", "8"], "graph-p1": ["1", "8"]}
# Stock's switch that holds the scheduler's input while the tokenizer processes a batch request: its requests arrive
# together, so their decode batch does not depend on how long each one's media took to process. Dynamo's recompile
# log: one "Recompiling function" line (then the failed guards) per compile after the first of a frame.
GRAPH_ENV = {"TORCH_LOGS": "recompiles", "SGLANG_ENABLE_COLOCATED_BATCH_GEN": "1"}
RECOMPILE = re.compile(r"Recompiling function (\S+) in \S+\n((?:.*\[__recompiles\] .*\n)*)")
FAILED_GUARD = re.compile(r"\[__recompiles\] +- \d+/\d+: (.*)")
# Compiled functions of the eager prefill, outside the decode step (a function the step calls is traced into its
# graph, not compiled as a frame of its own). Stock's `@torch.compile(dynamic=True)` `apply_rotary_pos_emb_native`
# (layers/rotary_embedding/utils.py) recompiles once on any server, graphs or not: its first call's duck sizing ties
# two sizes that happened to be equal (`q.size()[2] == q.size()[0]`, 16 on the tiny checkpoint), a later prompt
# unties them.
EAGER_PATH_COMPILED = {"apply_rotary_pos_emb_native"}
INDUCTOR_LOGPROB_TOLERANCE = 1e-4
# Stock's decode log line (scheduler_components/metrics_reporter.py): the batch size and whether the graph ran.
DECODE_LINE = re.compile(r"Decode batch, #running-req: (\d+),.*?cpu graph: (True|False)")


@pytest.fixture(scope="module")
def reference(checkpoint):
    model, processor = load_reference(checkpoint)
    return {
        name: reference_ids(model, processor, messages, max_tokens=MAX_TOKENS) for name, messages in ALL_CASES.items()
    }


def together(server, processor, names: list[str]) -> dict:
    """The named cases as one batch request, released to the scheduler at once (``GRAPH_ENV``): once all are
    prefilled they decode in one batch."""
    answers = batch_chat_logprobs(server.base_url, processor, [ALL_CASES[name] for name in names], MAX_TOKENS)
    return {name: {"prompt_ids": a["ids"], "completion_ids": a["output_ids"]} for name, a in zip(names, answers)}


def together_without_logprobs(server, processor, names: list[str]) -> dict:
    """The named cases as one batch request asking for no logprobs (a request without them is another batch
    variant): their completion ids."""
    inputs = [native_chat_input(processor, ALL_CASES[name]) for name in names]
    images = [image_urls for _, image_urls, _ in inputs]
    videos = [video_urls for _, _, video_urls in inputs]
    body = {
        "text": [text for text, _, _ in inputs],
        "image_data": images if any(images) else None,
        "video_data": videos if any(videos) else None,
        "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    response = requests.post(f"{server.base_url}/generate", json=body, timeout=600)
    response.raise_for_status()
    return {name: {"completion_ids": answer["output_ids"]} for name, answer in zip(names, response.json())}


def one_by_one(server, names: list[str]) -> dict:
    client, model_name = openai_client(server)
    return {name: served_ids(client, model_name, ALL_CASES[name], max_tokens=MAX_TOKENS) for name in names}


def logprobs(server, processor) -> dict:
    return {name: chat_logprobs(server.base_url, processor, CASES[name], max_new_tokens=MAX_TOKENS) for name in SINGLE}


def decode_steps(server) -> list[tuple[int, bool]]:
    return [(int(n), graph == "True") for n, graph in DECODE_LINE.findall(server_log(server))]


def step_recompiles(server) -> list[str]:
    """Each compile dynamo logged again since the lease began (i.e. after start-up), but the eager prefill's: the
    function and the guards that failed."""
    found = RECOMPILE.findall(server_log(server))
    return [
        f"{name}: {'; '.join(FAILED_GUARD.findall(guards))}"
        for name, guards in found
        if name not in EAGER_PATH_COMPILED
    ]


def graph_run(server, processor) -> dict:
    """Alone, then 3, 4, 5 and 8 at once, then 4 and 8 at once without logprobs, the same for text only, then
    logprobs one by one."""
    names, text = list(MIXED), list(TEXT)
    return {
        "alone": one_by_one(server, SINGLE),
        "three": together(server, processor, names[:3]),
        "four": together(server, processor, names[:4]),
        "five": together(server, processor, names[3:8]),
        "eight": together(server, processor, names),
        "four_plain": together_without_logprobs(server, processor, names[4:]),
        "eight_plain": together_without_logprobs(server, processor, names),
        "text_four": together(server, processor, text[:4]),
        "text_four_plain": together_without_logprobs(server, processor, text[4:]),
        "text_eight": together(server, processor, text),
        "text_eight_plain": together_without_logprobs(server, processor, text),
        "logprobs": logprobs(server, processor),
        "steps": decode_steps(server),
        "recompiles": step_recompiles(server),
    }


@pytest.fixture(scope="module")
def served(checkpoint, processor, reference, server_pool):
    results = {}
    for name, paging in (("graph-p128", PAGE_128_CHUNKED), ("graph-p1", PAGE_1_CHUNKED)):
        args = FP32_REPORTING_ARGS + paging + GRAPHS + ["--cuda-graph-bs-decode", *BUCKETS[name]]
        with server_pool.lease(checkpoint, args, env=GRAPH_ENV, name=name, ready_timeout_s=900) as server:
            results[name] = graph_run(server, processor)
    # Last: the eager server is test_serving_paged.py's first (the next module of this one's shared-server group).
    with server_pool.lease(checkpoint, FP32_REPORTING_ARGS + PAGE_128_CHUNKED, name="paged-radix") as server:
        results["eager"] = {"logprobs": logprobs(server, processor)}
    return results


GRAPH_SERVERS = ["graph-p128", "graph-p1"]
BATCHES = [
    "three",
    "four",
    "five",
    "eight",
    "four_plain",
    "eight_plain",
    "text_four",
    "text_four_plain",
    "text_eight",
    "text_eight_plain",
]


def assert_equal_the_reference(answers: dict, reference: dict) -> None:
    for name, answer in answers.items():
        if "prompt_ids" in answer:
            assert answer["prompt_ids"] == reference[name][0], name
        assert answer["completion_ids"] == reference[name][1], name


@pytest.mark.parametrize("server", GRAPH_SERVERS)
def test_graph_decode_alone_equals_the_reference(served, reference, server):
    assert_equal_the_reference(served[server]["alone"], reference)


@pytest.mark.parametrize("server", GRAPH_SERVERS)
@pytest.mark.parametrize("batch", BATCHES)
def test_graph_decode_in_a_mixed_batch_equals_each_request_alone(served, reference, server, batch):
    assert_equal_the_reference(served[server][batch], reference)


@pytest.mark.parametrize("server", GRAPH_SERVERS)
def test_the_graph_ran_at_padded_and_exact_batch_sizes(served, server):
    """Padded replays (graph-p128: a request alone and the three at once on bucket 4, the five on bucket 8; graph-p1:
    the three, four and five on bucket 8) and exact ones (graph-p128: the four; graph-p1: a request alone; both: the
    eight) all ran; no decode step of at most 8 rows ran eagerly."""
    steps = served[server]["steps"]
    graph_sizes = {size for size, graph in steps if graph}
    assert {1, 3, 4, 5, 8} <= graph_sizes, steps
    assert all(graph for size, graph in steps if size <= 8), steps


@pytest.mark.parametrize("server", GRAPH_SERVERS)
def test_serving_replays_what_start_up_compiled(served, server):
    """After start-up (the capture compiles one graph per bucket, with and without cross-attention), no batch
    recompiles the decode step: not a batch of a captured size, not a padded one, not one asking for logprobs."""
    assert served[server]["recompiles"] == []


@pytest.mark.parametrize("server", GRAPH_SERVERS)
@pytest.mark.parametrize("case", SINGLE)
def test_graph_logprobs_equal_eager(served, server, case):
    graph, eager = served[server]["logprobs"][case], served["eager"]["logprobs"][case]
    assert graph["ids"] == eager["ids"] and graph["output_ids"] == eager["output_ids"]
    assert len(graph["output_logprobs"]) == MAX_TOKENS and len(graph["logprobs"]) > 5
    pairs = list(zip(graph["logprobs"], eager["logprobs"])) + list(
        zip(graph["output_logprobs"], eager["output_logprobs"])
    )
    assert max(abs(a - b) for a, b in pairs) <= INDUCTOR_LOGPROB_TOLERANCE
