"""MOSS-VL served with the MOSS-VL-shaped KV pool (the default off CUDA) and with ``MOSSVL_KV_LAYOUT=stock``.

Stock ``python -m sglang.launch_server`` + the plugin on CPU, tiny checkpoint (8 layers, cross-attention layers 2 and
6: 3 bands), fp32, page size 1. Servers run one at a time:

* the default layout with a small pool (``--max-total-tokens 600``: 800 slots, one long video request at a time):
  video requests with ~350-600 text rows are sent together and fill the pool, then short text requests join while
  videos wait. Every answer must equal the reference model's; the scheduler must have queued (a prefill batch
  formed with requests left waiting) or retracted requests, and the pool must be idle again afterwards. Its
  start-up log gives the capacities, checked against the hand computation from ``--max-total-tokens``, and a
  request's encoder takes ``ceil(E / 3)`` slots;
* ``MOSSVL_KV_LAYOUT=stock``: an image and a video equal the reference, no layout line in the log, ``E`` slots
  per encoder and the stock pool's token count;
* ``MOSSVL_KV_LAYOUT=bogus``: the server refuses to start, naming the variable, and leaves no process behind.

Oracle: greedy ids of the reference transformers model in fp32, computed before any server starts.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from serving.launch import SglangServer
from support.serving import (
    CASES,
    kv_load,
    load_reference,
    long_case,
    openai_client,
    prefill_batches,
    reference_ids,
    retractions,
    served_ids,
    short_case,
    wait_for_load,
)

pytestmark = pytest.mark.timeout(1800)

LAYOUT_ENV = "MOSSVL_KV_LAYOUT"
STOCK_TOKENS = 600
# By hand: the tiny model has 8 layers, 2 of them cross-attention, so bands = ceil(6 / 2) = 3 and a slot stores
# 3 x 2 = 6 layers; 600 tokens x 8 layers hold 600 * 8 / 6 = 800 slots: 800 text tokens or 2400 vision tokens.
LAYERS, CROSS, BANDS = 8, 2, 3
SLOTS = STOCK_TOKENS * LAYERS // (BANDS * CROSS)
assert SLOTS == 800
ARGS = ["--dtype", "float32", "--skip-server-warmup", "--max-total-tokens", str(STOCK_TOKENS)]

# Vision tokens of each encoder by hand: a frame of a 4 x 4 patch grid merges 2 x 2 into 4 tokens, plus one
# separator per frame. The 3-frame video: 3 * 4 + 3 = 15; the 64 x 64 square: 4 + 1 = 5.
VISION_TOKENS = {"video": 15, "image": 5}
PARITY = {"video": CASES["video"], "image": CASES["image_data_url"]}
# Videos with questions of ~350-600 text rows: each takes ~380-630 of the 800 slots.
VIDEO_LOAD = {f"video{i}": long_case(i) for i in (0, 2, 4, 6)} | {"video": CASES["video"]}
TEXT_LOAD = {f"text{i}": short_case(i) for i in (0, 2, 4)} | {"text_only": CASES["text_only"]}

LAYOUT_LINE = re.compile(
    r"MOSS-VL KV layout: the stock pool's bytes \((\d+) tokens x (\d+) layers\) hold (\d+) slots of (\d+) x (\d+) "
    r"layers: (\d+) text tokens or (\d+) vision tokens"
)
SCHEDULER_TOKENS = re.compile(r"max_total_num_tokens=(\d+)")
QUEUE_LINE = re.compile(r"Prefill batch.*?token usage: ([\d.]+), #running-req: \d+, #queue-req: (\d+)")
POOL_FULL_RETRACTION = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")


@pytest.fixture(scope="module")
def reference(checkpoint):
    model, processor = load_reference(checkpoint)
    cases = PARITY | VIDEO_LOAD | TEXT_LOAD
    return {name: reference_ids(model, processor, messages) for name, messages in cases.items()}


def is_idle(load: dict) -> bool:
    return load["num_used_tokens"] == 0 and load["num_running_reqs"] == load["num_waiting_reqs"] == 0


def some_wait_while_others_run(load: dict) -> bool:
    return load["num_waiting_reqs"] > 0 and load["num_running_reqs"] > 0


def videos_then_text(server, rounds: int = 3) -> dict:
    """All video requests at once; once some wait while others run, the text requests; every answer. On a busy
    machine the full pool can last less than one poll of ``/v1/loads``: a round whose videos all finish unseen is
    sent again (at most ``rounds``), each round's answers checked all the same."""
    client, model_name = openai_client(server)
    answers = {}
    with ThreadPoolExecutor(max_workers=len(VIDEO_LOAD) + len(TEXT_LOAD)) as pool:
        for round_no in range(rounds):
            videos = {
                f"{name}#{round_no}": pool.submit(served_ids, client, model_name, messages)
                for name, messages in VIDEO_LOAD.items()
            }
            deadline = time.monotonic() + 300
            full = kv_load(server)
            while not some_wait_while_others_run(full) and time.monotonic() < deadline:
                if all(future.done() for future in videos.values()):
                    break
                time.sleep(0.05)
                full = kv_load(server)
            caught = some_wait_while_others_run(full)
            texts = {}
            if caught:
                texts = {
                    name: pool.submit(served_ids, client, model_name, messages) for name, messages in TEXT_LOAD.items()
                }
            answers |= {name: future.result() for name, future in (videos | texts).items()}
            if caught:
                break
    return {"answers": answers, "full": full, "idle": wait_for_load(server, is_idle, timeout_s=60)}


def parity(server) -> dict:
    client, model_name = openai_client(server)
    return {name: served_ids(client, model_name, messages) for name, messages in PARITY.items()}


def log_text(server) -> str:
    return Path(server.log_path).read_text(errors="replace")


@pytest.fixture(scope="module")
def default_layout(checkpoint, reference):
    with pytest.MonkeyPatch.context() as env:
        env.delenv(LAYOUT_ENV, raising=False)
        with SglangServer(checkpoint, extra_args=ARGS, name="kv-layout-default") as server:
            results = parity(server)
            load = videos_then_text(server)
            log = log_text(server)
            batches, test_retractions = prefill_batches(server), retractions(server)
    return {"parity": results, "load": load, "log": log, "batches": batches, "test_retractions": test_retractions}


@pytest.fixture(scope="module")
def stock_layout(checkpoint, reference, default_layout):
    with pytest.MonkeyPatch.context() as env:
        env.setenv(LAYOUT_ENV, "stock")
        with SglangServer(checkpoint, extra_args=ARGS, name="kv-layout-stock") as server:
            results = parity(server)
            log = log_text(server)
    return {"parity": results, "log": log}


def assert_equal_to_the_reference(answers: dict, reference: dict) -> None:
    for name, answer in answers.items():
        case = name.split("#")[0]  # a video of the n-th round of videos_then_text is "name#n"
        assert answer["prompt_ids"] == reference[case][0], name
        assert answer["completion_ids"] == reference[case][1], name


def encoder_slots(answer: dict) -> int:
    """Prompt slots the server charged beyond the text tokens: the encoder's placeholders."""
    return answer["usage"].prompt_tokens - len(answer["prompt_ids"])


def test_filling_the_pool_with_videos_queues_them_and_text_requests_complete(default_layout, reference):
    load = default_layout["load"]
    assert_equal_to_the_reference(load["answers"], reference)
    log = default_layout["log"]
    # (token usage, waiting requests) of each prefill batch: a batch formed with requests left waiting means the
    # pool could not take them (the chunk and prefill budgets, 4096 and 16384 tokens, exceed the whole pool).
    queued = [(float(usage), int(waiting)) for usage, waiting in QUEUE_LINE.findall(log) if int(waiting) > 0]
    retracted = [int(n) for n in POOL_FULL_RETRACTION.findall(log)]
    print(f"prefill batches that left requests waiting (usage, waiting): {queued}; retractions: {retracted}")
    print(f"while full: {load['full']}")
    assert queued or sum(retracted) > 0
    assert default_layout["test_retractions"] == []  # no forced retraction (SGLANG_TEST_RETRACT unset)
    full = load["full"]
    assert full["num_waiting_reqs"] > 0 and full["num_running_reqs"] > 0  # text requests were sent then
    assert full["max_total_num_tokens"] == full["memory"]["token_capacity"] == SLOTS  # /v1/loads counts slots
    assert 0 < full["num_used_tokens"] <= SLOTS
    assert is_idle(load["idle"]), load["idle"]  # every slot given back, encoder slots included


def test_the_default_layout_logs_its_capacities_from_max_total_tokens(default_layout):
    lines = LAYOUT_LINE.findall(default_layout["log"])
    assert lines, "no MOSS-VL KV layout line in the start-up log"
    assert {tuple(map(int, line)) for line in lines} == {
        (STOCK_TOKENS, LAYERS, SLOTS, BANDS, CROSS, SLOTS, BANDS * SLOTS)
    }
    assert set(map(int, SCHEDULER_TOKENS.findall(default_layout["log"]))) == {SLOTS}  # what the scheduler counts


def test_the_default_layout_charges_ceil_e_over_bands_slots_per_encoder(default_layout, reference):
    assert_equal_to_the_reference(default_layout["parity"], reference)
    for name, answer in default_layout["parity"].items():
        assert encoder_slots(answer) == -(-VISION_TOKENS[name] // BANDS), name


def test_the_stock_layout_serves_the_reference_answers_with_the_stock_pool(stock_layout, reference):
    assert_equal_to_the_reference(stock_layout["parity"], reference)
    log = stock_layout["log"]
    assert "MOSS-VL KV layout:" not in log
    assert set(map(int, SCHEDULER_TOKENS.findall(log))) == {STOCK_TOKENS}
    for name, answer in stock_layout["parity"].items():
        assert encoder_slots(answer) == VISION_TOKENS[name], name


def live_group_members(pgid: int) -> list[str]:
    """Processes of group ``pgid`` that are not zombies (``/proc/*/stat``)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        state, group = fields[0], int(fields[2])
        if group == pgid and state != "Z":
            members.append(stat.parent.name)
    return members


def test_a_bogus_layout_refuses_to_start_naming_the_variable(checkpoint, stock_layout):
    with pytest.MonkeyPatch.context() as env:
        env.setenv(LAYOUT_ENV, "bogus")
        server = SglangServer(checkpoint, extra_args=ARGS, name="kv-layout-bogus", ready_timeout_s=300)
        with pytest.raises(RuntimeError, match="server exited") as failure:
            server.start()
    assert "MOSSVL_KV_LAYOUT" in str(failure.value) or "MOSSVL_KV_LAYOUT" in log_text(server)
    assert "'bogus'" in log_text(server)
    assert server.process.poll() is not None
    assert live_group_members(server.process.pid) == []
