"""PD disaggregation when things go wrong, and at page 1: one prefill and one decode worker over ``mooncake_tcp`` behind
smg in PD mode (``serving.fleet --pd``), tiny checkpoint, fp32, ``--page-size 1`` (``test_serving_pd.py`` runs 128).
One fleet for the module; the tests run in file order, the decode worker's kill last but one.

Oracles: the reference transformers model's greedy tokens (computed before any server starts); each worker's own
load report (``/v1/loads``: KV slots in use, running and queued requests, the transfer queues) for "idle again"; the
transfer's state from the decode worker's report (a request in its transfer queue holds preallocated KV slots the
prefill worker has not finished writing), which is when the faults are injected.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time

import pytest
import requests

from moss_vl_reference.tiny_checkpoint import build_or_reuse
from serving.fleet import PATIENT_HEALTH, Fleet
from serving.realtime_client import RealtimeClient, realtime_url
from support.serving import (
    MAX_TOKENS,
    PD_CASES,
    PD_READY_TIMEOUT_S,
    chat_logprobs,
    kv_load,
    load_reference,
    native_chat_input,
    pd_server_args,
    reference_ids,
)

pytestmark = [pytest.mark.timeout(2400), pytest.mark.random_order(disabled=True)]

SERVER_ARGS = pd_server_args(1)
# The request in flight when a fault is injected: a video, whose prefill (vision tower and extend) keeps its KV
# transfer pending longest; many tokens, so it is still decoding if the fault comes late.
FAULTED = "video"
FAULTED_TOKENS = 400
# How soon after the fault each worker must report idle (no KV slot in use, nothing running or queued). Before any
# test, on the 2-core machine at load 10: a cold prefill worker was idle 45 s after the decode worker's kill (its first
# video forward compiled stock's rotary kernel meanwhile); what each test measured is printed and in docs/scale-out.md.
IDLE_BOUND_S = 60.0
# The client's own timeout, far above every bound here: an answer, an error or a closed connection must come first.
CLIENT_TIMEOUT_S = 600.0


@pytest.fixture(scope="module")
def checkpoint():
    return build_or_reuse("tiny")


@pytest.fixture(scope="module")
def processor(checkpoint):
    return load_reference(checkpoint)[1]


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The reference model's greedy tokens for every case, computed before the fleet starts (no server running)."""
    model, processor = load_reference(checkpoint)
    return {name: reference_ids(model, processor, messages)[1] for name, messages in PD_CASES.items()}


@pytest.fixture(scope="module")
def fleet(checkpoint, reference):
    pd = Fleet(
        checkpoint,
        pd=True,
        worker_args=SERVER_ARGS,
        name="test-pd-faults",
        worker_ready_timeout_s=PD_READY_TIMEOUT_S,
        **PATIENT_HEALTH,
    )
    with pd:
        yield pd


def is_idle(load: dict) -> bool:
    transfer = load.get("disaggregation") or {}
    queued = sum(value for key, value in transfer.items() if key.endswith("_queue_reqs"))
    return load["num_used_tokens"] == 0 and load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == queued == 0


def seconds_until_idle(server, since: float, bound_s: float) -> float:
    """Seconds from ``since`` until ``server`` reports idle; fails with its last report after ``bound_s``."""
    while True:
        load = kv_load(server)
        if is_idle(load):
            return time.monotonic() - since
        assert time.monotonic() - since < bound_s, (server.name, load)
        time.sleep(0.1)


def wait_in_transfer(decode, timeout_s: float = 300.0) -> dict:
    """Until the decode worker holds a request whose KV is still being transferred; its report then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        load = kv_load(decode)
        if (load.get("disaggregation") or {}).get("decode_transfer_queue_reqs", 0) > 0:
            return load
        assert load["num_running_reqs"] == 0, f"the request was decoding before its transfer was seen: {load}"
        time.sleep(0.01)
    raise TimeoutError(f"no request in the decode worker's transfer queue after {timeout_s:.0f} s")


def generate_body(processor, messages: list[dict], max_new_tokens: int, stream: bool = False) -> dict:
    text, images, videos = native_chat_input(processor, messages)
    sampling = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    return {"text": text, "image_data": images or None, "video_data": videos or None, "sampling_params": sampling,
            "stream": stream}  # fmt: skip


def test_page_one_answers_through_smg_equal_the_reference_model(fleet, processor, reference):
    for name, messages in PD_CASES.items():
        assert chat_logprobs(fleet.gateway_url, processor, messages, MAX_TOKENS)["output_ids"] == reference[name], name


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_realtime_session_on_a_pd_worker_is_refused_naming_the_reason(fleet, role):
    """Before ``session.created``: ``error{code: unsupported_deployment}`` naming the role, then close 1011."""
    server = dict(zip(["prefill", "decode"], fleet.servers))[role]

    async def first_event_and_close_code():
        client = RealtimeClient(realtime_url(server.base_url))
        first = await asyncio.wait_for(client.connect(), 60)
        await asyncio.wait_for(client.socket.wait_closed(), 60)
        return first, client.socket.close_code

    first, close_code = asyncio.run(first_event_and_close_code())
    assert first["type"] == "error" and first["code"] == "unsupported_deployment", first
    assert f"PD {role} worker (--disaggregation-mode {role})" in first["message"], first
    assert close_code == 1011


def test_a_client_that_closes_its_stream_mid_transfer_frees_both_workers(fleet, processor, reference):
    """The client sends a streamed request on a plain socket and closes it while the KV is in transfer (whether or
    not smg has sent the answer's headers yet)."""
    prefill, decode = fleet.servers
    body = json.dumps(generate_body(processor, PD_CASES[FAULTED], FAULTED_TOKENS, stream=True)).encode()
    head = "POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", fleet.gateway_port), timeout=CLIENT_TIMEOUT_S) as connection:
        connection.sendall(head.encode() + body)
        in_transfer = wait_in_transfer(decode)
    closed_at = time.monotonic()
    freed = {server.name: seconds_until_idle(server, closed_at, IDLE_BOUND_S) for server in fleet.servers}
    print(f"client abort mid-transfer (decode held {in_transfer['num_used_tokens']} slots): idle after {freed}")
    text = PD_CASES["text_only"]
    assert chat_logprobs(fleet.gateway_url, processor, text, MAX_TOKENS)["output_ids"] == reference["text_only"]


def test_the_decode_worker_killed_mid_transfer_fails_the_request_frees_the_prefill_and_serves_again_restarted(
    fleet, processor, reference
):
    prefill, decode = fleet.servers
    body = generate_body(processor, PD_CASES[FAULTED], FAULTED_TOKENS)
    answered = {}

    def generate():
        try:
            response = requests.post(f"{fleet.gateway_url}/generate", json=body, timeout=CLIENT_TIMEOUT_S)
            answered["status"], answered["body"] = response.status_code, response.text[:500]
        except requests.RequestException as error:  # a dropped connection is an error the client sees, not a hang
            answered["error"] = repr(error)
        answered["at"] = time.monotonic()

    client = threading.Thread(target=generate)
    client.start()
    wait_in_transfer(decode)
    os.killpg(decode.process.pid, signal.SIGKILL)  # the launcher's process group: its scheduler dies with it
    killed_at = time.monotonic()
    decode.process.wait(timeout=60)
    client.join(CLIENT_TIMEOUT_S)
    assert not client.is_alive(), f"no answer {CLIENT_TIMEOUT_S:.0f} s after the decode worker died"
    assert "error" in answered or answered["status"] >= 500, answered
    prefill_idle_s = seconds_until_idle(prefill, killed_at, IDLE_BOUND_S)
    print(f"decode killed mid-transfer: client error after {answered['at'] - killed_at:.1f} s ({answered}); "
          f"prefill idle after {prefill_idle_s:.1f} s")  # fmt: skip

    decode.start(port_attempts=1)  # the same port, which smg has on its command line
    fleet.wait_routable(timeout_s=PD_READY_TIMEOUT_S)
    for name in ("text_only", FAULTED):
        answer = chat_logprobs(fleet.gateway_url, processor, PD_CASES[name], MAX_TOKENS)
        assert answer["output_ids"] == reference[name], name
    for server in fleet.servers:
        assert is_idle(kv_load(server)), server.name
