"""Prefill/decode disaggregation as a user runs it: one prefill and one decode worker, KV moved by Mooncake over TCP
(``mooncake_tcp``, real bytes between two processes), smg in PD mode in front (``serving.fleet --pd``), tiny checkpoint,
fp32, page 128 (``test_serving_pd_faults.py`` serves page 1), the MOSS-VL KV layout on both workers (the default,
``patches/pd_kv_transfer.py``), decode graphs on the decode worker (``--enable-torch-compile``, one captured bucket).
One set of servers for the module: an aggregated oracle, then the PD pair, plus one stock-pool decode worker for the
refusal.

Oracle: one aggregated server with the same arguments and eager decode, run alone before the PD servers start: every
answer through smg (greedy ids, prompt and output logprobs, a streamed chat, the video below) equals its answer, prompt
logprobs within the suite's fp32 summation bound, output logprobs within inductor's bound against eager decode (as
``test_serving_decode_graphs.py``); 16 mixed answers sent together through smg equal the same answers sent alone.

Bytes are counted where sglang hands them to Mooncake's transfer engine, whose Python ``TransferEngine`` has no byte
counters (``support/pd_transfer_bytes.py``; the PD workers start in its environment): the blocks
``batch_transfer_sync_write`` was given whose source lies in the prefill's registered KV buffers (the first
``2 x L_cross x bands`` regions it registers, before its aux buffers). Oracles, by hand from the tiny checkpoint's
config (8 layers, 2 of them cross-attention, so 3 bands; 2 KV heads of 32 fp32 values, a row of 256 bytes) and the
video written here (8 frames of 256 x 256 at 1 fps: 16 x 16 patches merge into 64 vision tokens plus one separator per
frame, 520 vision tokens, ``ceil(520 / 3) = 174`` encoder slots):

* both workers register exactly the layout's buffers: ``2 x 2 x 3`` bands of ``(slots + 128) x 256`` bytes each;
* a request moves exactly its slot row's pages in every band of every storage layer, K and V:
  ``pages x 128 x 3 x 2 x 2 x 256`` bytes; the stock pool would move ``ceil((520 + T) / 128)`` pages of 8 layers;
* a decode worker with the stock pool (``MOSSVL_KV_LAYOUT=stock``) paired with the layout's prefill refuses in one
  line naming both.
"""

from __future__ import annotations

import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from openai import OpenAI

from moss_vl_reference.tiny_checkpoint import build_or_reuse
from serving.fleet import PATIENT_HEALTH, Fleet, pd_roles
from serving.launch import SglangServer
from support.pd_transfer_bytes import KvBytes, counting_env
from support.serving import (
    CASES,
    FP32_ORDER_TOLERANCE,
    GREEDY,
    MAX_TOKENS,
    PD_CASES,
    PD_READY_TIMEOUT_S,
    chat_logprobs,
    kv_load,
    load_reference,
    long_case,
    native_chat_input,
    pd_server_args,
    server_log,
    short_case,
    to_openai,
    wait_for_load,
)
from support.videos import write_video

pytestmark = [pytest.mark.timeout(1800), pytest.mark.random_order(disabled=True)]

PAGE = 128
SERVER_ARGS = pd_server_args(PAGE)
STREAMED = "image"
# Sent together: every case above, videos and images with questions over several pages, short texts and images.
MIXED = PD_CASES | {f"long{i}": long_case(i) for i in range(4)} | {f"short{i}": short_case(i) for i in range(7)}
# The decode worker's decode graphs: stock's CPU graph runner (inductor), one bucket (batches of 1 and 2 replay it).
DECODE_GRAPHS = ["--enable-torch-compile", "--cuda-graph-bs-decode", "2", "--decode-log-interval", "1"]
# An output logprob from the compiled decode step against eager decode (test_serving_decode_graphs.py's bound).
GRAPH_LOGPROB_TOLERANCE = 1e-4
# Stock's decode log line (scheduler_components/metrics_reporter.py): the batch size and whether the graph ran.
DECODE_LINE = re.compile(r"Decode batch, #running-req: (\d+),.*?cpu graph: (True|False)")

LAYERS, CROSS, BANDS = 8, 2, 3
ROW_BYTES = 2 * 32 * 4
VIDEO_FRAMES, VIDEO_SIDE = 8, 256
VISION_TOKENS = VIDEO_FRAMES * ((VIDEO_SIDE // 16) ** 2 // 4 + 1)
assert VISION_TOKENS == 520
KV_BUFFERS = 2 * CROSS * BANDS
SLOTS_LINE = re.compile(r"MOSS-VL KV layout: the stock pool's bytes \(\d+ tokens x \d+ layers\) hold (\d+) slots")
PD_LINE = "PD KV transfer: MOSS-VL KV layout mossvl (3 bands x 2 cross-attention layers of 8), page 128, float32 KV"
REFUSAL = re.compile(r"PD peers disagree on the KV they exchange: the prefill server at \S+ has \[(.*?)\], this decode")


def pages(tokens: int) -> int:
    return -(-tokens // PAGE)


@pytest.fixture(scope="module")
def checkpoint():
    return build_or_reuse("tiny")


@pytest.fixture(scope="module")
def processor(checkpoint):
    return load_reference(checkpoint)[1]


@pytest.fixture(scope="module")
def video_case(tmp_path_factory):
    path = write_video(tmp_path_factory.mktemp("pd-layout") / "square.mp4", VIDEO_FRAMES, 1, VIDEO_SIDE, VIDEO_SIDE)
    return [{"role": "user", "content": [{"type": "video", "video": str(path)}, {"type": "text", "text": "What?"}]}]


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
def aggregated(checkpoint, processor, video_case):
    """One server doing both jobs, alone on the machine; stopped before the PD servers start."""
    with SglangServer(
        checkpoint, extra_args=SERVER_ARGS, name="pd-aggregated", ready_timeout_s=PD_READY_TIMEOUT_S
    ) as server:
        url = server.base_url
        return {
            "answers": answers(url, processor),
            "streamed": streamed_text(url, model_name(url), PD_CASES[STREAMED]),
            "video": chat_logprobs(url, processor, video_case, MAX_TOKENS),
        }


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """The environment the PD workers start in: the engine calls of each process recorded under a folder."""
    folder = tmp_path_factory.mktemp("transfers")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in counting_env(folder).items():
            mp.setenv(name, value)
        mp.delenv("MOSSVL_KV_LAYOUT", raising=False)
        yield KvBytes(folder, KV_BUFFERS)


@pytest.fixture(scope="module")
def pd(checkpoint, aggregated, counted):
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


def test_both_workers_start_with_the_layout_and_register_its_storage(pd, counted):
    for server in pd.servers:
        assert PD_LINE in server_log(server), server.name
    slots = {int(n) for server in pd.servers for n in SLOTS_LINE.findall(server_log(server))}
    assert len(slots) == 1
    band_bytes = (slots.pop() + PAGE) * ROW_BYTES
    registrations = counted.registrations()
    assert len(registrations) == 2  # the prefill's and the decode's
    for regions in registrations:
        assert [size for _, size in regions] == [band_bytes] * KV_BUFFERS
        spans = sorted(regions)
        assert all(start + size <= following for (start, size), (following, _) in zip(spans, spans[1:]))


def test_a_video_moves_exactly_its_layout_bytes_and_answers_as_one_server(
    pd, counted, processor, video_case, aggregated
):
    """The fleet's first request: the two takes around it count its transfer alone."""
    counted.take()
    got = chat_logprobs(pd.gateway_url, processor, video_case, MAX_TOKENS)
    moved = counted.take()
    assert_same_answer(got, aggregated["video"], "video")

    text_tokens = len(got["ids"])
    assert got["prompt_tokens"] == -(-VISION_TOKENS // BANDS) + text_tokens  # the encoder's slots, by hand
    layout = pages(got["prompt_tokens"]) * PAGE * BANDS * CROSS * 2 * ROW_BYTES
    stock = pages(VISION_TOKENS + text_tokens) * PAGE * LAYERS * 2 * ROW_BYTES
    print(f"video: {moved} bytes moved, layout {layout}, stock pool {stock} ({moved / stock:.3f}x)")
    assert moved == layout
    assert moved <= 0.35 * stock


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


def direct_pd_request(prefill: SglangServer, decode: SglangServer, text: str, images: list[str]) -> None:
    """What smg sends for one request: the same body to both workers, naming the prefill's KV bootstrap."""
    port = int(prefill.extra_args[prefill.extra_args.index("--disaggregation-bootstrap-port") + 1])
    body = {
        "text": text,
        "image_data": images or None,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port,
        "bootstrap_room": random.getrandbits(62),
    }

    def post(server):
        try:
            requests.post(f"{server.base_url}/generate", json=body, timeout=30)
        except requests.RequestException:
            pass  # the refused pair never answers; the decode worker's log says why

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(post, (prefill, decode)))


def test_a_stock_decode_worker_refuses_the_layouts_prefill_in_one_line(pd, checkpoint, processor):
    """Last: the refused request stays unanswered on the fleet's prefill worker."""
    prefill = pd.servers[0]
    decode_args = dict(pd_roles("cpu", SERVER_ARGS))["decode"]
    text, images, _ = native_chat_input(processor, CASES["image_data_url"])
    with SglangServer(
        checkpoint,
        extra_args=decode_args,
        name="pd-layout-stock-decode",
        ready_timeout_s=PD_READY_TIMEOUT_S,
        env={"MOSSVL_KV_LAYOUT": "stock"},
    ) as decode:
        assert "PD KV transfer: MOSS-VL KV layout stock, page 128" in server_log(decode)
        direct_pd_request(prefill, decode, text, images)
        deadline = time.monotonic() + 120
        while not REFUSAL.search(server_log(decode)) and time.monotonic() < deadline:
            time.sleep(1)
        log = server_log(decode)
    refusals = [line for line in log.splitlines() if REFUSAL.search(line)]
    assert refusals, log[-3000:]
    line = refusals[-1]
    assert "has [MOSS-VL KV layout mossvl (3 bands x 2 cross-attention layers of 8), page 128" in line
    assert "this decode server has [MOSS-VL KV layout stock, page 128" in line
