"""MOSS-VL served with chunked prefill and mixed chunks: token-exact against the reference model (fp32).

Stock ``python -m sglang.launch_server`` + the plugin on CPU, tiny checkpoint (encoders of 5-17 vision tokens,
2-6 KV slots; prompts of 23-86 text rows; the long prompts below have ~300). Servers run one at a time (each
holds its model and KV pool on the 2 cores and 24 GiB the suite has):

* ``--chunked-prefill-size -1`` (unchunked): the baseline for prompt logprobs and short-request TTFT;
* ``--chunked-prefill-size 1``, with the radix cache on and with ``--disable-radix-cache``: the
  first chunk of a vision request is its encoder plus one text row (the cut right after the encoder: a chunk never
  ends inside or right at the end of an encoder), then one-row chunks. On both, a long request is aborted between
  two of its chunks: the KV pool must return to idle (encoder slots included) and the next request stay exact;
* ``--chunked-prefill-size 16 --enable-mixed-chunk``: cuts through the middle of each question, and the decode
  rows of running requests ride in the same forward as a prefill chunk.

Oracle: greedy ids of the reference transformers model in fp32 (computed before any server starts), and the
unchunked server for prompt logprobs. The server log must show the chunks (prefill batch sizes), so silently
disabled chunking fails.
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from openai import APIConnectionError

from moss_vl_reference.tiny_checkpoint import PRESETS
from mossvl_ascend.attention.kv_layout import LayerBands, encoder_row_len
from serving.launch import REPO_ROOT
from support.serving import (
    CASES,
    FP32_ORDER_TOLERANCE,
    GREEDY,
    MAX_TOKENS,
    UNCHUNKED_PAGE_ONE_ARGS,
    chat_logprobs,
    kv_load,
    load_reference,
    long_case,
    openai_client,
    prefill_batches,
    reference_ids,
    retractions,
    served_ids,
    short_case,
    to_openai,
    wait_for_load,
)

pytestmark = pytest.mark.timeout(1800)

PARITY_ORDER = ["image_data_url", "two_images", "three_turns", "video", "text_only", "same_images_shifted"]
BASE_ARGS = ["--dtype", "float32", "--skip-server-warmup"]
ONE_ROW_CONFIGS = {
    "radix": ["--chunked-prefill-size", "1"],
    "no_radix": ["--chunked-prefill-size", "1", "--disable-radix-cache"],
}
# Encoder slots of the tiny checkpoint's video (15 vision tokens) and three-turn prompt (17) in the served KV layout
# (the MOSS-VL layout, the default off CUDA: a slot holds `bands` vision tokens).
TINY_BANDS = LayerBands(
    PRESETS["tiny"]["text"]["num_hidden_layers"], tuple(PRESETS["tiny"]["text"]["cross_attention_layers"])
).bands
VIDEO_ENCODER_SLOTS = encoder_row_len(15, TINY_BANDS)
THREE_TURN_ENCODER_SLOTS = encoder_row_len(17, TINY_BANDS)
MID_QUESTION_MIXED = ["--chunked-prefill-size", "16", "--enable-mixed-chunk"]
FIGURES = REPO_ROOT / "build" / "serving_chunked_figures.json"


LOAD = {f"long{i}": long_case(i) for i in range(8)} | {f"short{i}": short_case(i) for i in range(8)}


@pytest.fixture(scope="module")
def reference(checkpoint):
    model, processor = load_reference(checkpoint)
    cases = {name: CASES[name] for name in PARITY_ORDER} | LOAD
    return {name: reference_ids(model, processor, messages) for name, messages in cases.items()}


def all_prompt_logprobs(server, processor) -> dict:
    return {name: chat_logprobs(server.base_url, processor, CASES[name]) for name in PARITY_ORDER}


ABORTED = "long1"  # an image and ~300 text rows: ~300 one-row chunks
ABORT_AFTER_USED_TOKENS = 40  # the encoder (13) + its first row, then >= 26 one-row chunks


def abort_between_chunks(server, client, model_name) -> dict:
    """Abort a one-row-chunked request mid-prefill (``/abort_request`` with its rid), wait for the scheduler to go
    idle, then run a parity case on the same server.

    sglang's idle self-check (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE``, on by default, on CPU too) stops the
    scheduler on a leaked KV slot; the server's exit is then recorded with its log tail, so only the abort test
    fails and says why.
    """
    rid = f"abort-{server.port}"
    measured = {"idle_before": kv_load(server)}
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(
            client.chat.completions.create,
            model=model_name,
            messages=to_openai(LOAD[ABORTED]),
            **GREEDY,
            extra_body={"rid": rid},
        )
        measured["at_abort"] = wait_for_load(server, lambda load: load["num_used_tokens"] >= ABORT_AFTER_USED_TOKENS)
        requests.post(f"{server.base_url}/abort_request", json={"rid": rid}, timeout=30).raise_for_status()
        try:
            aborted = pending.result().choices[0]
            measured["finish_reason"], measured["text"] = aborted.finish_reason, aborted.message.content
            measured["idle_after"] = wait_for_load(
                server,
                lambda load: load["num_used_tokens"] == 0 and load["num_running_reqs"] == load["num_waiting_reqs"] == 0,
            )
            measured["following"] = served_ids(client, model_name, CASES["two_images"])
        except (requests.RequestException, APIConnectionError):
            measured["server_stopped"] = server.log_tail(3000)
    return measured


def streamed_ttft(client, model_name, messages) -> tuple[float, str]:
    """(seconds to the first content chunk, full text) of one streamed greedy completion."""
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=model_name, messages=to_openai(messages), **GREEDY, stream=True, extra_body={"ignore_eos": True}
    )
    first, pieces = None, []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                first = first if first is not None else time.perf_counter() - started
                pieces.append(choice.delta.content)
    return first, "".join(pieces)


def run_load(client, model_name, call) -> dict:
    """All 16 long and short requests at once (long ones first in the queue)."""
    with ThreadPoolExecutor(max_workers=len(LOAD)) as pool:
        futures = {name: pool.submit(call, client, model_name, messages) for name, messages in LOAD.items()}
        return {name: future.result() for name, future in futures.items()}


def flush_radix_cache(server) -> None:
    response = requests.post(f"{server.base_url}/flush_cache?timeout=60", timeout=120)
    response.raise_for_status()


def short_ttft_median(results: dict) -> float:
    return statistics.median(results[f"short{i}"][0] for i in range(8))


@pytest.fixture(scope="module")
def unchunked(checkpoint, processor, reference, server_pool):
    """Baseline figures of the unchunked server: prompt logprobs per case, short-request TTFT under load."""
    # The paged module's page-1 baseline server, lent by the pool (its shared-server group ran before this module).
    with server_pool.lease(checkpoint, UNCHUNKED_PAGE_ONE_ARGS, name="chunked-baseline") as server:
        client, model_name = openai_client(server)
        logprobs = all_prompt_logprobs(server, processor)
        load = run_load(client, model_name, streamed_ttft)
        batches = prefill_batches(server)
    return {"logprobs": logprobs, "load": load, "batches": batches}


def served_cases(client, model_name) -> dict:
    return {name: served_ids(client, model_name, CASES[name]) for name in PARITY_ORDER}


@pytest.fixture(scope="module")
def one_row(checkpoint, processor, reference, unchunked, server_pool):
    """Everything measured on each one-row-chunk server (each is stopped before the next server starts)."""
    results = {}
    for config, flags in ONE_ROW_CONFIGS.items():
        with server_pool.lease(checkpoint, BASE_ARGS + flags, name=f"chunked-one-row-{config}") as server:
            client, model_name = openai_client(server)
            served = served_cases(client, model_name)
            batches = prefill_batches(server)
            logprobs = all_prompt_logprobs(server, processor)
            abort = abort_between_chunks(server, client, model_name)
        results[config] = {"served": served, "batches": batches, "logprobs": logprobs, "abort": abort}
    return results


@pytest.fixture(scope="module")
def mixed(checkpoint, reference, unchunked, one_row, server_pool):
    """Everything measured on the chunk-16 + mixed-chunk server."""
    with server_pool.lease(checkpoint, BASE_ARGS + MID_QUESTION_MIXED, name="chunked-mixed") as server:
        client, model_name = openai_client(server)
        served = served_cases(client, model_name)
        batches = prefill_batches(server)
        load = run_load(client, model_name, lambda c, m, messages: served_ids(c, m, messages))
        load_batches = prefill_batches(server)[len(batches) :]
        flush_radix_cache(server)  # the TTFT round starts cold, as on the unchunked server
        streamed = run_load(client, model_name, streamed_ttft)
    return {"served": served, "batches": batches, "load": load, "load_batches": load_batches, "streamed": streamed}


RETRACT_CONFIGS = {
    # Chunked, radix cache on: a resumed request finds its encoder (and prompt) in the cache.
    "chunk16_radix": ["--chunked-prefill-size", "16"],
    # Chunked, radix cache off: a resumed request re-runs its encoder, in chunks again; the
    # requests arrive together, so a vision request may find the chunk budget taken and wait for the next round.
    "chunk16_no_radix": ["--chunked-prefill-size", "16", "--disable-radix-cache"],
}


@pytest.fixture(scope="module")
def retracting(checkpoint, reference, unchunked, one_row, mixed, server_pool):
    """The parity cases at once on servers that retract a running request every 3 forwards.

    ``SGLANG_TEST_RETRACT=1`` is sglang's own switch: the scheduler calls the real ``ScheduleBatch.retract_decode``
    every ``SGLANG_TEST_RETRACT_INTERVAL`` (3) forwards, which frees a decoding request's KV (encoder included,
    nothing kept in the radix cache) and re-queues it; it is prefilled again with its output so far.
    """
    results = {}
    for name, flags in RETRACT_CONFIGS.items():
        retract = {"SGLANG_TEST_RETRACT": "1"}
        with server_pool.lease(checkpoint, BASE_ARGS + flags, env=retract, name=f"retract-{name}") as server:
            client, model_name = openai_client(server)
            with ThreadPoolExecutor(max_workers=len(PARITY_ORDER)) as pool:
                futures = {case: pool.submit(served_ids, client, model_name, CASES[case]) for case in PARITY_ORDER}
                served = {case: future.result() for case, future in futures.items()}
            batches = prefill_batches(server)
            retracted = retractions(server)
        results[name] = {"served": served, "retracted": retracted, "batches": batches}
    return results


def assert_parity(served, reference):
    for name in PARITY_ORDER:
        assert served[name]["prompt_ids"] == reference[name][0], name
        assert len(served[name]["completion_ids"]) == MAX_TOKENS
        assert served[name]["completion_ids"] == reference[name][1], name


def test_unchunked_baseline_prefills_each_prompt_whole(unchunked, reference):
    # The three-turn prompt (86 text rows + its 17-token encoder's slots) went in one prefill.
    assert (
        max(tokens for _, tokens, _ in unchunked["batches"])
        >= len(reference["three_turns"][0]) + THREE_TURN_ENCODER_SLOTS
    )


@pytest.mark.parametrize("config", list(ONE_ROW_CONFIGS))
def test_one_row_chunks_equal_the_reference_and_the_log_shows_them(one_row, reference, config):
    assert_parity(one_row[config]["served"], reference)
    tokens = [t for _, t, _ in one_row[config]["batches"]]
    # Each vision request: one first chunk = encoder slots + 1 row (the video, three turns), then one-row chunks;
    # text-only requests are all one-row chunks.
    assert VIDEO_ENCODER_SLOTS + 1 in tokens and THREE_TURN_ENCODER_SLOTS + 1 in tokens
    text_rows_after_the_first = sum(len(reference[name][0]) for name in PARITY_ORDER) - len(PARITY_ORDER)
    assert tokens.count(1) >= 0.8 * text_rows_after_the_first  # (a few rows may come from the radix cache)
    assert max(tokens) <= max(VIDEO_ENCODER_SLOTS, THREE_TURN_ENCODER_SLOTS) + 1


@pytest.mark.parametrize("config", list(ONE_ROW_CONFIGS))
def test_one_row_chunks_give_the_unchunked_prompt_logprobs(one_row, unchunked, reference, config):
    for name in PARITY_ORDER:
        chunked, baseline = one_row[config]["logprobs"][name], unchunked["logprobs"][name]
        # Both scored exactly the reference prompt's text tokens.
        assert chunked["ids"] == baseline["ids"] == reference[name][0], name
        assert len(chunked["logprobs"]) == len(baseline["logprobs"]) > 10, name
        # fp32 summation order only (see FP32_ORDER_TOLERANCE); test_one_row_chunks_equal_the_reference... checks ids.
        assert max(abs(a - b) for a, b in zip(chunked["logprobs"], baseline["logprobs"])) <= FP32_ORDER_TOLERANCE, name


@pytest.mark.parametrize("config", list(ONE_ROW_CONFIGS))
def test_a_request_aborted_between_chunks_frees_its_kv_and_the_next_one_is_exact(one_row, reference, config):
    abort = one_row[config]["abort"]
    assert abort["idle_before"]["num_used_tokens"] == 0
    # Aborted mid-prefill: past the encoder and its first chunk, far from the end of the prompt, nothing decoded.
    assert ABORT_AFTER_USED_TOKENS <= abort["at_abort"]["num_used_tokens"] < len(reference[ABORTED][0]) / 2
    assert abort["at_abort"]["num_running_reqs"] == 0
    assert "server_stopped" not in abort, abort.get("server_stopped")
    assert (abort["finish_reason"], abort["text"]) == ("abort", "")
    # Every KV slot it held (encoder included) is free again; the scheduler's strict idle leak check would also
    # have stopped the server.
    assert abort["idle_after"]["num_used_tokens"] == 0, abort["idle_after"]
    assert abort["following"]["prompt_ids"] == reference["two_images"][0]
    assert abort["following"]["completion_ids"] == reference["two_images"][1]


def test_mid_question_chunks_with_mixed_batches_equal_the_reference(mixed, reference):
    assert_parity(mixed["served"], reference)
    tokens = [t for _, t, _ in mixed["batches"]]
    assert tokens.count(16) >= len(PARITY_ORDER)  # every prompt (>= 23 rows) was cut at 16 at least once
    # The three-turn encoder + 1 row could exceed the budget, nothing else.
    assert max(tokens) <= max(16, THREE_TURN_ENCODER_SLOTS + 1)


def test_long_and_short_requests_at_once_equal_the_reference_and_short_ttft_is_reported(mixed, reference, unchunked):
    for name, result in mixed["load"].items():
        assert result["completion_ids"] == reference[name][1], name
    # Prefill chunks ran while other requests were decoding (with --enable-mixed-chunk they share the forward).
    assert any(running > 0 for _, _, running in mixed["load_batches"])
    for name, (_, text) in mixed["streamed"].items():
        assert text == unchunked["load"][name][1], name
    figures = {
        "short_ttft_median_s": {
            "unchunked": short_ttft_median(unchunked["load"]),
            "chunk16_mixed": short_ttft_median(mixed["streamed"]),
        },
        "long_ttft_median_s": {
            "unchunked": statistics.median(unchunked["load"][f"long{i}"][0] for i in range(8)),
            "chunk16_mixed": statistics.median(mixed["streamed"][f"long{i}"][0] for i in range(8)),
        },
        "long_prompt_rows": [len(reference[f"long{i}"][0]) for i in range(8)],
    }
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    FIGURES.write_text(json.dumps(figures, indent=2))
    print("chunked serving figures:", json.dumps(figures))


@pytest.mark.parametrize("config", list(RETRACT_CONFIGS))
def test_retracted_requests_resume_with_the_reference_tokens(retracting, reference, config):
    assert sum(retracting[config]["retracted"]) >= 3, retracting[config]["retracted"]  # real retractions happened
    assert 16 in [tokens for _, tokens, _ in retracting[config]["batches"]]  # and chunks
    assert_parity(retracting[config]["served"], reference)
