"""Two MOSS-VL workers behind sglang's gateway (smg, ``cache_aware``) on loopback: ``serving.fleet`` as
``make serve-fleet`` starts it, workers at page size 128, fp32, one fleet for the whole module.

Oracles: the reference transformers model (greedy ids of each chat, computed before any server starts), the reference
stream for the realtime scripts (``support.realtime``), a direct request to a worker, smg's own report of the
worker it chose (``x-smg-routed-worker-id``), and each worker's own log of the realtime sessions it stepped and its
``/v1/loads``. The worker kill runs last (the module keeps its order).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from openai import OpenAI

from moss_vl_reference.tiny_checkpoint import build_or_reuse
from realtime_inference import replay_proactive_videoqa as replay
from serving.fleet import ROUTED_WORKER_HEADER, Fleet
from serving.realtime_client import GATEWAY_PATH, RealtimeClient, realtime_url
from support.realtime import SCRIPTS, TURN_LIMIT, play, reference_generated, served_turn_texts, turn_texts
from support.serving import CASES, GREEDY, TOKEN_IDS, load_reference, reference_ids, to_openai

pytestmark = [pytest.mark.timeout(1800), pytest.mark.random_order(disabled=True)]

WORKER_ARGS = ["--dtype", "float32", "--page-size", "128", "--enable-cache-report", "--skip-server-warmup"]
WORKER_ARGS += ["--max-total-tokens", "8192", "--context-length", "4096"]
SYSTEM = {"role": "system", "content": "Answer briefly."}  # the realtime checkpoint's template adds its own without
CHATS = {"image": [SYSTEM, *CASES["image_data_url"]], "video": [SYSTEM, *CASES["video"]]}
# The three-turn conversation, one request per user turn, each the one before plus an answer and a new image.
TURNS = [[SYSTEM, *CASES["three_turns"][:end]] for end in (1, 3, 5)]
# A request that never waits past this, whatever a worker does (a kill included): a chat here takes ~1-3 s.
REQUEST_BOUND_S = 60.0
PVQA_GENERATOR = Path(__file__).resolve().parents[1] / "realtime_inference/examples/make_proactive_videoqa_sample.py"
PVQA_TURN_TOKENS = TURN_LIMIT  # a served turn that reaches its limit ends the session: leave room for silence
STEP_LINE = re.compile(r"realtime step mossvl-realtime:(\w+):\d+: extended")
# A fresh session holds two 128-slot pages: 0.0156 of a worker's KV token usage here (measured). smg's KV ceiling for
# the spread test sits between one and two sessions' usage (the test checks that against the worker's report).
SESSION_CEILING = 0.025


@pytest.fixture(scope="module")
def checkpoint():
    return build_or_reuse("tiny-realtime")


@pytest.fixture(scope="module")
def pvqa(tmp_path_factory):
    """The 20-sample synthetic ProactiveVideoQA file (frames beside it)."""
    folder = tmp_path_factory.mktemp("pvqa")
    made = subprocess.run([sys.executable, str(PVQA_GENERATOR), "--out", str(folder)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    return Path(made.stdout.strip().splitlines()[-1])


def replay_options(input_path: Path, output: Path, *extra: str):
    options = replay.parse_args(["--input", str(input_path), "--output", str(output), *extra])
    options.max_new_tokens = PVQA_TURN_TOKENS
    return options


@pytest.fixture(scope="module")
def reference(checkpoint, pvqa):
    """Computed before the fleet starts (the reference runs alone on the CPU)."""
    model, processor = load_reference(checkpoint)
    transformers_pred = pvqa.parent / "transformers-pred.jsonl"
    replayed = replay.replay_file(model, processor, replay_options(pvqa, transformers_pred, "--checkpoint", "unused"))
    assert replayed == {"done": 20, "skipped": 0, "failed": 0}
    return {
        "model": (model, processor),
        "turns": [reference_ids(model, processor, messages) for messages in TURNS],
        "streams": {name: reference_generated(model, processor, script) for name, script in SCRIPTS.items()},
        "tokenizer": processor.tokenizer,
        "pred": pred_records(transformers_pred),
    }


def pred_records(path: Path) -> dict[str, dict]:
    return {record["question_id"]: record for record in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def fleet(checkpoint, reference):
    with Fleet(checkpoint, workers=2, policy="cache_aware", worker_args=WORKER_ARGS, name="test-fleet") as fleet:
        fleet.model_name = requests.get(f"{fleet.gateway_url}/v1/models", timeout=30).json()["data"][0]["id"]
        yield fleet


def chat(base_url: str, model: str, messages: list[dict], **extra) -> requests.Response:
    body = {"model": model, "messages": to_openai(messages), **GREEDY, **TOKEN_IDS, **extra}
    response = requests.post(f"{base_url}/v1/chat/completions", json=body, timeout=REQUEST_BOUND_S)
    response.raise_for_status()
    return response


def ids_of(response: requests.Response) -> tuple[list[int], list[int]]:
    choice = response.json()["choices"][0]
    return choice["prompt_token_ids"], choice["response_token_ids"]


def streamed_text(base_url: str, model: str, messages: list[dict]) -> str:
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=REQUEST_BOUND_S)
    stream = client.chat.completions.create(
        model=model, messages=to_openai(messages), stream=True, extra_body={"ignore_eos": True}, **GREEDY
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


@pytest.mark.parametrize("name", sorted(CHATS))
def test_routed_chat_equals_the_reference_and_a_direct_request(fleet, reference, name):
    expected = reference_ids(*reference["model"], CHATS[name])  # here, so a case the reference cannot run fails alone
    routed = chat(fleet.gateway_url, fleet.model_name, CHATS[name])
    direct = chat(fleet.servers[0].base_url, fleet.model_name, CHATS[name])
    assert ids_of(routed) == expected
    assert ids_of(direct) == expected
    assert routed.headers[ROUTED_WORKER_HEADER] in [server.base_url for server in fleet.servers]
    text = routed.json()["choices"][0]["message"]["content"]
    assert streamed_text(fleet.gateway_url, fleet.model_name, CHATS[name]) == text


def test_a_three_turn_image_conversation_stays_on_one_worker(fleet, reference):
    """Each turn repeats the ones before: cache_aware sends it where that prefix is. (The prompts here are under one
    128-slot page, so no radix hit is reported at this page size; bench_fleet measures the cached ratio.)"""
    routed = []
    for messages, expected in zip(TURNS, reference["turns"]):
        response = chat(fleet.gateway_url, fleet.model_name, messages)
        assert ids_of(response) == expected
        routed.append(response.headers[ROUTED_WORKER_HEADER])
    assert len(set(routed)) == 1, routed


async def open_session(url: str) -> RealtimeClient:
    client = RealtimeClient(url, headers={"Authorization": "Bearer none"})  # smg relays only a client with one
    await client.open(max_new_tokens=TURN_LIMIT, temperature=0.0)
    await client.settle()
    return client


async def play_and_close(client: RealtimeClient, script) -> RealtimeClient:
    await play(client, script)
    await client.close()
    return client


def test_four_realtime_sessions_through_the_gateway_spread_over_both_workers_equal_the_reference_and_leave_them_idle(
    fleet, reference
):
    """smg 1.13 places a session on the realtime worker with the fewest HTTP requests in flight, not counting open
    sessions, so without its overload veto all four land on one worker (measured [4, 0] and [0, 4]). With the veto a
    worker whose polled KV usage reached the ceiling takes no new session: the ceiling here sits between one and two
    fresh sessions' usage, so each worker takes two."""
    url = realtime_url(fleet.gateway_url, GATEWAY_PATH, model=fleet.model_name)
    names = sorted(SCRIPTS)
    for server in fleet.servers:
        assert wait_idle(server)["num_used_tokens"] == 0, server.base_url
    before = [worker_sessions(server) for server in fleet.servers]

    async def all_sessions():
        # Opened one after another, each given time to show in smg's next poll of the workers' loads, then played.
        clients = []
        for _ in names:
            clients.append(await open_session(url))
            await asyncio.sleep(2 * fleet.load_poll_s + 1)
            if len(clients) == 1:
                usage = max(load_of(server)["token_usage"] for server in fleet.servers)
                assert usage < SESSION_CEILING <= 2 * usage, f"one fresh session uses {usage} of a worker's KV"
        return await asyncio.gather(*(play_and_close(client, SCRIPTS[name]) for client, name in zip(clients, names)))

    fleet.restart_gateway(kv_ceiling=SESSION_CEILING)
    try:
        clients = dict(zip(names, asyncio.run(all_sessions())))
    finally:
        fleet.restart_gateway(kv_ceiling=Fleet.kv_ceiling)
    for name, client in clients.items():
        assert served_turn_texts(client) == turn_texts(reference["tokenizer"], reference["streams"][name]), name
    opened = [len(worker_sessions(server) - seen) for server, seen in zip(fleet.servers, before)]
    assert sum(opened) == len(names) and min(opened) >= 1, f"sessions per worker: {opened}"
    for server in fleet.servers:
        assert wait_idle(server)["num_used_tokens"] == 0, server.base_url


def worker_sessions(server) -> set[str]:
    """The realtime sessions a worker has stepped, from its log (the plugin logs every step with its session)."""
    return set(STEP_LINE.findall(server.log_path.read_text(errors="replace")))


def load_of(server) -> dict:
    """The worker's own load report (sglang's ``/v1/loads``, the one smg polls)."""
    return requests.get(f"{server.base_url}/v1/loads", timeout=30).json()["loads"][0]


def wait_idle(server, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        load = load_of(server)
        if load["num_used_tokens"] == 0 or time.monotonic() > deadline:
            return load
        time.sleep(0.2)


def test_the_served_replay_at_concurrency_4_through_the_gateway_equals_the_transformers_replay_and_resumes(
    fleet, reference, pvqa
):
    served_pred = pvqa.parent / "served-pred.jsonl"
    options = replay_options(pvqa, served_pred, "--server", fleet.gateway_url, "--concurrency", "4")
    assert replay.replay_file_served(options) == {"done": 20, "skipped": 0, "failed": 0}
    assert pred_records(served_pred) == reference["pred"]
    lines = served_pred.read_text().splitlines(keepends=True)
    served_pred.write_text("".join(lines[:-3]))  # as if the run had stopped three samples short
    assert replay.replay_file_served(options) == {"done": 3, "skipped": 17, "failed": 0}
    assert pred_records(served_pred) == reference["pred"]
    assert len(served_pred.read_text().splitlines()) == 20


def timed(call):
    started = time.monotonic()
    try:
        return call(), time.monotonic() - started
    except Exception as error:  # noqa: BLE001  (what a client saw is the result here)
        return error, time.monotonic() - started


def test_a_worker_killed_mid_run_every_later_request_succeeds_and_none_hangs(fleet, reference):
    survivor, victim = fleet.servers
    image = CHATS["image"]
    expected = reference_ids(*reference["model"], image)
    with ThreadPoolExecutor(6) as pool:
        in_flight = [pool.submit(timed, lambda: chat(fleet.gateway_url, fleet.model_name, image)) for _ in range(4)]
        in_flight += [pool.submit(timed, lambda: streamed_text(fleet.gateway_url, fleet.model_name, image))]
        time.sleep(0.5)
        killed_at = time.monotonic()
        os.killpg(victim.process.pid, signal.SIGKILL)
        results = [future.result(timeout=REQUEST_BOUND_S + 30) for future in in_flight]
    assert all(seconds < REQUEST_BOUND_S for _, seconds in results), results
    while any(worker["url"] == victim.base_url for worker in fleet.routable_workers()):
        assert time.monotonic() - killed_at < 10, "the dead worker is still routable 10 s after the kill"
        time.sleep(0.1)
    later = [timed(lambda: chat(fleet.gateway_url, fleet.model_name, image)) for _ in range(4)]
    for response, seconds in later:
        assert not isinstance(response, Exception), response
        assert ids_of(response) == expected
        assert seconds < REQUEST_BOUND_S
    assert survivor.process.poll() is None
