"""The MOSS-VL KV layout on both sides of PD (``patches/pd_kv_transfer.py``): a prefill and a decode worker over
``mooncake_tcp`` behind smg (``serving.fleet --pd``), tiny checkpoint, fp32, page 128, the layout on (the default).

Bytes are counted where sglang hands them to Mooncake's transfer engine, whose Python ``TransferEngine`` has no byte
counters (``support/pd_transfer_bytes.py``): the blocks ``batch_transfer_sync_write`` was given whose source lies in
the prefill's registered KV buffers (the first ``2 x L_cross x bands`` regions it registers, before its aux buffers).

Oracles, by hand from the tiny checkpoint's config (8 layers, 2 of them cross-attention, so 3 bands; 2 KV heads of
32 fp32 values, a row of 256 bytes) and the video written here (8 frames of 256 x 256 at 1 fps: 16 x 16 patches merge
into 64 vision tokens plus one separator per frame, 520 vision tokens, ``ceil(520 / 3) = 174`` encoder slots):

* a request moves exactly its slot row's pages in every band of every storage layer, K and V:
  ``pages x 128 x 3 x 2 x 2 x 256`` bytes; the stock pool would move ``ceil((520 + T) / 128)`` pages of 8 layers;
* its greedy tokens and logprobs equal one aggregated server's (the suite's fp32 summation bound);
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

from moss_vl_reference.tiny_checkpoint import build_or_reuse
from serving.fleet import PATIENT_HEALTH, Fleet, pd_roles
from serving.launch import SglangServer
from support.pd_transfer_bytes import KvBytes, counting_env
from support.serving import (
    CASES,
    FP32_ORDER_TOLERANCE,
    MAX_TOKENS,
    PD_READY_TIMEOUT_S,
    chat_logprobs,
    load_reference,
    native_chat_input,
    pd_server_args,
    server_log,
)
from support.videos import write_video

pytestmark = [pytest.mark.timeout(1800), pytest.mark.random_order(disabled=True)]

PAGE = 128
SERVER_ARGS = pd_server_args(PAGE)
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


@pytest.fixture(scope="module")
def aggregated(server_pool, checkpoint, processor, video_case):
    with server_pool.lease(checkpoint, SERVER_ARGS, name="pd-layout-aggregated") as server:
        return chat_logprobs(server.base_url, processor, video_case, MAX_TOKENS)


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
        name="test-pd-layout",
        worker_ready_timeout_s=PD_READY_TIMEOUT_S,
        **PATIENT_HEALTH,
    )
    with fleet:
        yield fleet


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
    counted.take()
    got = chat_logprobs(pd.gateway_url, processor, video_case, MAX_TOKENS)
    assert got["ids"] == aggregated["ids"] and got["output_ids"] == aggregated["output_ids"]
    pairs = list(zip(got["logprobs"] + got["output_logprobs"], aggregated["logprobs"] + aggregated["output_logprobs"]))
    assert max(abs(a - b) for a, b in pairs) <= FP32_ORDER_TOLERANCE

    text_tokens = len(got["ids"])
    assert got["prompt_tokens"] == -(-VISION_TOKENS // BANDS) + text_tokens  # the encoder's slots, by hand
    moved = counted.take()
    layout = pages(got["prompt_tokens"]) * PAGE * BANDS * CROSS * 2 * ROW_BYTES
    stock = pages(VISION_TOKENS + text_tokens) * PAGE * LAYERS * 2 * ROW_BYTES
    print(f"video: {moved} bytes moved, layout {layout}, stock pool {stock} ({moved / stock:.3f}x)")
    assert moved == layout
    assert moved <= 0.35 * stock


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
