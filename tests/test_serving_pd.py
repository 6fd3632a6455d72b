"""Prefill/decode disaggregation as a user runs it: one prefill and one decode worker, KV moved by Mooncake over TCP
(``mooncake_tcp``, real bytes between two processes), smg in PD mode in front (``serving.fleet --pd``), tiny checkpoint,
fp32, page 128 (``test_serving_pd_faults.py`` serves page 1), decode graphs on the decode worker
(``--enable-torch-compile``, one captured bucket). One set of servers for the module.

Oracle: one aggregated server with the same arguments and eager decode, run alone before the PD servers start: every
answer through smg (greedy ids, prompt and output logprobs, a streamed chat) equals its answer, prompt logprobs
within the suite's fp32 summation bound, output logprobs within inductor's bound against eager decode (as
``test_serving_decode_graphs.py``); 16 mixed answers sent together through smg equal the same answers sent alone.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from openai import OpenAI

from moss_vl_reference.tiny_checkpoint import build_or_reuse
from serving.fleet import PATIENT_HEALTH, Fleet
from serving.launch import SglangServer
from support.serving import (
    FP32_ORDER_TOLERANCE,
    GREEDY,
    MAX_TOKENS,
    PD_CASES,
    PD_READY_TIMEOUT_S,
    chat_logprobs,
    kv_load,
    load_reference,
    long_case,
    pd_server_args,
    server_log,
    short_case,
    to_openai,
    wait_for_load,
)

pytestmark = [pytest.mark.timeout(1800), pytest.mark.random_order(disabled=True)]

SERVER_ARGS = pd_server_args(128)
STREAMED = "image"
# Sent together: every case above, videos and images with questions over several pages, short texts and images.
MIXED = PD_CASES | {f"long{i}": long_case(i) for i in range(4)} | {f"short{i}": short_case(i) for i in range(7)}
# The decode worker's decode graphs: stock's CPU graph runner (inductor), one bucket (batches of 1 and 2 replay it).
DECODE_GRAPHS = ["--enable-torch-compile", "--cuda-graph-bs-decode", "2", "--decode-log-interval", "1"]
# An output logprob from the compiled decode step against eager decode (test_serving_decode_graphs.py's bound).
GRAPH_LOGPROB_TOLERANCE = 1e-4
# Stock's decode log line (scheduler_components/metrics_reporter.py): the batch size and whether the graph ran.
DECODE_LINE = re.compile(r"Decode batch, #running-req: (\d+),.*?cpu graph: (True|False)")


@pytest.fixture(scope="module")
def checkpoint():
    return build_or_reuse("tiny")


@pytest.fixture(scope="module")
def processor(checkpoint):
    return load_reference(checkpoint)[1]


def answers(base_url: str, processor) -> dict:
    return {name: chat_logprobs(base_url, processor, messages, MAX_TOKENS) for name, messages in MIXED.items()}


def streamed_text(base_url: str, model: str, messages: list[dict]) -> str:
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300)
    stream = client.chat.completions.create(
        model=model, messages=to_openai(messages), stream=True, extra_body={"ignore_eos": True}, **GREEDY
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def model_name(base_url: str) -> str:
    return requests.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def aggregated(checkpoint, processor):
    """One server doing both jobs, alone on the machine; stopped before the PD servers start."""
    with SglangServer(
        checkpoint, extra_args=SERVER_ARGS, name="pd-aggregated", ready_timeout_s=PD_READY_TIMEOUT_S
    ) as server:
        url = server.base_url
        return {"answers": answers(url, processor), "streamed": streamed_text(url, model_name(url), PD_CASES[STREAMED])}


@pytest.fixture(scope="module")
def pd(checkpoint, aggregated):
    fleet = Fleet(
        checkpoint,
        pd=True,
        worker_args=SERVER_ARGS,
        decode_args=DECODE_GRAPHS,
        name="test-pd",
        worker_ready_timeout_s=PD_READY_TIMEOUT_S,
        **PATIENT_HEALTH,
    )
    with fleet:
        yield fleet


def first_difference(got: dict, expected: dict) -> dict | None:
    """Where two answers' outputs part: the position and each side's (token, logprob) there (a near-tie shows as two
    logprobs within the bounds below)."""
    for at, (mine, theirs) in enumerate(zip(got["output_ids"], expected["output_ids"])):
        if mine != theirs:
            return {
                "at": at,
                "got": (mine, got["output_logprobs"][at]),
                "expected": (theirs, expected["output_logprobs"][at]),
            }
    return None


def assert_same_answer(got: dict, expected: dict, name: str) -> None:
    assert got["ids"] == expected["ids"], name
    assert got["output_ids"] == expected["output_ids"], (name, first_difference(got, expected))
    assert len(got["output_logprobs"]) == MAX_TOKENS and len(got["logprobs"]) == len(expected["logprobs"]), name
    prompt_gap = max(abs(a - b) for a, b in zip(got["logprobs"], expected["logprobs"]))
    output_gap = max(abs(a - b) for a, b in zip(got["output_logprobs"], expected["output_logprobs"]))
    assert prompt_gap <= FP32_ORDER_TOLERANCE and output_gap <= GRAPH_LOGPROB_TOLERANCE, (name, prompt_gap, output_gap)


def test_pd_workers_start_with_the_mooncake_tcp_limits_and_a_cpu_retraction_backup(pd):
    prefill, decode = pd.servers
    for server in pd.servers:
        assert "Mooncake over TCP: set {'MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER': '65535'" in server_log(server)
    assert "--disaggregation-decode-retraction-backup cpu_tensor" in server_log(decode)


def test_each_answer_through_smg_equals_the_aggregated_servers(pd, processor, aggregated):
    for name in PD_CASES:
        expected = aggregated["answers"][name]
        assert_same_answer(chat_logprobs(pd.gateway_url, processor, PD_CASES[name], MAX_TOKENS), expected, name)


def test_a_streamed_chat_through_smg_equals_the_aggregated_servers(pd, aggregated):
    url = pd.gateway_url
    assert streamed_text(url, model_name(url), PD_CASES[STREAMED]) == aggregated["streamed"]


def test_sixteen_mixed_answers_sent_together_equal_themselves_alone_and_both_workers_end_idle(
    pd, processor, aggregated
):
    names = list(MIXED)
    assert len(names) == 16
    with ThreadPoolExecutor(len(names)) as pool:
        together = list(pool.map(lambda n: chat_logprobs(pd.gateway_url, processor, MIXED[n], MAX_TOKENS), names))
    for name, got in zip(names, together):
        assert_same_answer(got, aggregated["answers"][name], name)
    for server in pd.servers:
        load = wait_for_load(server, lambda load: load["num_used_tokens"] == 0)
        assert load["num_used_tokens"] == 0, (server.name, load, kv_load(server))


def test_the_decode_worker_decodes_through_its_graph(pd):
    """Stock's own decode log: steps of one and two rows (the captured bucket) ran the graph, larger ones eagerly."""
    steps = [(int(size), graph == "True") for size, graph in DECODE_LINE.findall(server_log(pd.servers[1]))]
    assert any(graph for size, graph in steps if size <= 2), steps
    assert all(graph for size, graph in steps if size <= 2), steps
