"""MOSS-VL served at the NPU's page size: ``--page-size 128`` against ``--page-size 1``, fp32, tiny checkpoint.

At page size 128 a request's encoder (vision) slots and its text slots share pages, and every paged allocation path
of an encoder-decoder request (extend, chunked continuation, decode, the decode rows of a mixed chunk, retraction and
resumption) must address the whole row ``[encoder | text]``. Servers run one at a time:

* ``page128`` with ``--chunked-prefill-size 256 --enable-mixed-chunk``, radix cache on and off: the long prompts
  (~300 rows) are cut into two-page chunks and decode rows ride with other requests' chunks;
* the same with sglang's retraction test switch, radix cache on and off: running requests lose their KV and are
  prefilled again, at page 128;
* ``page1``: page size 1, unchunked: the baseline for prompt and decode logprobs, started last so that the chunked
  module, next in the session, borrows it from the server pool as its own unchunked baseline.

Oracles: greedy ids of the reference transformers model in fp32 (computed before any server starts), and the page-1
server's logprobs (within fp32 summation order: ``FP32_ORDER_TOLERANCE``). The radix-cache figures (hits, repeated
answers equal) are written to ``build/serving_paged_figures.json``: they decide whether the radix cache can be the
NPU default.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from serving.launch import REPO_ROOT
from support.serving import (
    CASES,
    FP32_ORDER_TOLERANCE,
    FP32_REPORTING_ARGS,
    PAGE_128_CHUNKED,
    UNCHUNKED_PAGE_ONE_ARGS,
    cached_tokens,
    chat_logprobs,
    load_reference,
    long_case,
    openai_client,
    prefill_batches,
    reference_ids,
    retractions,
    served_ids,
    short_case,
)

pytestmark = pytest.mark.timeout(1800)

MAX_TOKENS = 40  # enough decode steps for several rows to cross a page boundary
PARITY_ORDER = ["image_data_url", "two_images", "three_turns", "video", "text_only", "same_images_shifted"]
PAGED_CASES = {name: CASES[name] for name in PARITY_ORDER} | {
    **{f"long{i}": long_case(i) for i in range(4)},
    **{f"short{i}": short_case(i) for i in range(4)},
}
RADIX = {"radix": [], "no_radix": ["--disable-radix-cache"]}
FIGURES = REPO_ROOT / "build" / "serving_paged_figures.json"
REPEATS = 2  # rounds of all cases at once on the radix server after the first


@pytest.fixture(scope="module")
def reference(checkpoint):
    model, processor = load_reference(checkpoint)
    return {
        name: reference_ids(model, processor, messages, max_tokens=MAX_TOKENS) for name, messages in PAGED_CASES.items()
    }


def all_at_once(server) -> dict:
    client, model_name = openai_client(server)
    with ThreadPoolExecutor(max_workers=len(PAGED_CASES)) as pool:
        futures = {
            name: pool.submit(served_ids, client, model_name, messages, max_tokens=MAX_TOKENS)
            for name, messages in PAGED_CASES.items()
        }
        return {name: future.result() for name, future in futures.items()}


def all_logprobs(server, processor) -> dict:
    return {
        name: chat_logprobs(server.base_url, processor, messages, max_new_tokens=MAX_TOKENS)
        for name, messages in PAGED_CASES.items()
    }


@pytest.fixture(scope="module")
def page_128(checkpoint, processor, reference, server_pool):
    """Per radix setting: all cases at once (REPEATS + 1 rounds with the radix cache on), then logprobs one by one."""
    results = {}
    for config, flags in RADIX.items():
        args = FP32_REPORTING_ARGS + PAGE_128_CHUNKED + flags
        with server_pool.lease(checkpoint, args, name=f"paged-{config}") as server:
            rounds = [all_at_once(server) for _ in range(1 + (REPEATS if config == "radix" else 0))]
            results[config] = {
                "rounds": rounds,
                "logprobs": all_logprobs(server, processor),
                "batches": prefill_batches(server),
            }
    return results


@pytest.fixture(scope="module")
def retracting(checkpoint, reference, page_128, server_pool):
    """All cases at once on page-128 servers that retract a running request every 3 forwards (sglang's own
    ``SGLANG_TEST_RETRACT`` switch calls the real ``ScheduleBatch.retract_decode``)."""
    results = {}
    for config, flags in RADIX.items():
        args = FP32_REPORTING_ARGS + PAGE_128_CHUNKED + flags
        retract = {"SGLANG_TEST_RETRACT": "1"}
        with server_pool.lease(checkpoint, args, env=retract, name=f"paged-retract-{config}") as server:
            served = all_at_once(server)
            retracted = retractions(server)
        results[config] = {"served": served, "retracted": retracted}
    return results


@pytest.fixture(scope="module")
def page_one(checkpoint, processor, reference, retracting, server_pool):
    """Started after the page-128 servers: this module's last server is the unchunked page-1 baseline that the next
    modules of its shared-server group borrow (test_serving.py, test_serving_cache.py, test_serving_chunked.py)."""
    with server_pool.lease(checkpoint, UNCHUNKED_PAGE_ONE_ARGS, name="paged-page1") as server:
        return all_logprobs(server, processor)


def assert_tokens_equal_the_reference(served: dict, reference: dict) -> None:
    for name, answer in served.items():
        assert answer["prompt_ids"] == reference[name][0], name
        assert answer["completion_ids"] == reference[name][1], name


def max_logprob_gap(a: dict, b: dict) -> float:
    assert a["ids"] == b["ids"] and a["output_ids"] == b["output_ids"]
    assert len(a["logprobs"]) == len(b["logprobs"]) > 10 and len(a["output_logprobs"]) == MAX_TOKENS
    pairs = list(zip(a["logprobs"], b["logprobs"])) + list(zip(a["output_logprobs"], b["output_logprobs"]))
    return max(abs(x - y) for x, y in pairs)


def test_the_cases_cross_page_boundaries_while_decoding(page_one, reference):
    """The scenario is real: text longer than the encoder in every vision case, and decode rows that cross a
    128-slot page boundary (the stock bug's two symptoms). The served prompt counts encoder slots and text rows."""
    crossing = 0
    for name, logprobs in page_one.items():
        text_rows, row = len(logprobs["ids"]), logprobs["prompt_tokens"]
        assert text_rows == len(reference[name][0])
        encoder = row - text_rows
        assert (encoder > 0) == (name not in ("text_only", "short0", "short2")), (name, encoder)
        assert text_rows > encoder
        crossing += any((row + step) % 128 == 0 for step in range(MAX_TOKENS))
    assert crossing >= 2


@pytest.mark.parametrize("config", list(RADIX))
def test_page_128_chunked_and_mixed_equal_the_reference(page_128, reference, config):
    for served in page_128[config]["rounds"]:
        assert_tokens_equal_the_reference(served, reference)
    tokens = [t for _, t, _ in page_128[config]["batches"]]
    assert tokens.count(256) >= 4  # each long prompt was cut at two pages
    assert any(running > 0 for _, _, running in page_128[config]["batches"])  # chunks beside decoding requests


@pytest.mark.parametrize("config", list(RADIX))
def test_page_128_logprobs_equal_page_1(page_128, page_one, config):
    gaps = {name: max_logprob_gap(page_128[config]["logprobs"][name], page_one[name]) for name in PAGED_CASES}
    assert max(gaps.values()) <= FP32_ORDER_TOLERANCE, gaps


def test_radix_cache_at_page_128_hits_whole_pages_and_repeats_every_answer(page_128, reference):
    rounds = page_128["radix"]["rounds"]
    hits = [sum(cached_tokens(answer["usage"]) for answer in served.values()) for served in rounds]
    assert min(hits[1:]) >= 128 * 4  # each long prompt's pages came from the cache on the repeats
    mismatches = sum(
        answer["completion_ids"] != reference[name][1] for served in rounds for name, answer in served.items()
    )
    figures = {
        "page_size": 128,
        "requests": len(rounds) * len(PAGED_CASES),
        "greedy_mismatches": mismatches,
        "cached_tokens_per_round": hits,
        "prompt_tokens_per_round": [sum(a["usage"].prompt_tokens for a in served.values()) for served in rounds],
    }
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    FIGURES.write_text(json.dumps(figures, indent=2))
    print("paged radix figures:", json.dumps(figures))
    assert mismatches == 0


@pytest.mark.parametrize("config", list(RADIX))
def test_retracted_requests_resume_exactly_at_page_128(retracting, reference, config):
    assert sum(retracting[config]["retracted"]) >= 3, retracting[config]["retracted"]
    assert_tokens_equal_the_reference(retracting[config]["served"], reference)
