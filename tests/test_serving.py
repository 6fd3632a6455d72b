"""MOSS-VL served end to end: stock ``python -m sglang.launch_server`` + the plugin, on CPU, tiny checkpoint.

Every answer is compared with the reference transformers model (fp32, greedy) token for token: this is the
proof that the frame-causal cross-attention mask survives the whole engine (processor, scheduler, radix cache,
the patched Ascend native attention the CPU server runs). Reference ids are computed before the server starts.
One server per page size for the whole module, from the session's server pool (`tests/support/server_pool.py`):
the page-1 one is the unchunked baseline (`UNCHUNKED_PAGE_ONE_ARGS`: these prompts fit the default chunk anyway)
that `tests/test_serving_paged.py` starts last and `tests/test_serving_chunked.py` borrows too;
`tests/test_serving_cache.py` borrows both, their cache flushed.
"""

from __future__ import annotations

import io
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests
from openai import OpenAI
from PIL import Image

from moss_vl_reference.queries_moss_vl import data_url
from support.serving import (
    CASES,
    GREEDY,
    MAX_TOKENS,
    PAGE_128_ARGS,
    UNCHUNKED_PAGE_ONE_ARGS,
    cached_tokens,
    load_reference,
    reference_ids,
    served_ids,
    to_openai,
)

pytestmark = pytest.mark.timeout(900)

# Non-streamed parity cases, in the order they hit the warm server ("same_images_shifted" after "two_images").
PARITY_ORDER = ["image_data_url", "two_images", "three_turns", "video", "text_only", "same_images_shifted"]


@pytest.fixture(scope="module")
def reference(checkpoint):
    model, processor = load_reference(checkpoint)
    return {name: reference_ids(model, processor, CASES[name]) for name in PARITY_ORDER + ["long_question"]}


# Page size 1 is sglang's CPU default; 128 is the NPU's, where a request's encoder and text share pages.
@pytest.fixture(scope="module", params=[1, 128], ids=lambda size: f"page{size}")
def server(request, checkpoint, reference, server_pool):
    args = UNCHUNKED_PAGE_ONE_ARGS if request.param == 1 else PAGE_128_ARGS
    with server_pool.lease(checkpoint, args, name=f"test-serving-page{request.param}") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="not-needed", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.mark.parametrize("case", PARITY_ORDER)
def test_greedy_tokens_equal_the_reference_model(client, model_name, reference, case):
    served = served_ids(client, model_name, CASES[case])
    expected_prompt, expected_completion = reference[case]
    assert served["prompt_ids"] == expected_prompt, "the server rendered/tokenised another prompt than the reference"
    assert len(served["completion_ids"]) == MAX_TOKENS >= 8
    assert served["completion_ids"] == expected_completion


def test_same_request_twice_hits_the_radix_cache_with_identical_output(client, model_name, reference):
    first = served_ids(client, model_name, CASES["long_question"])
    second = served_ids(client, model_name, CASES["long_question"])
    assert cached_tokens(second["usage"]) >= 128  # at least one whole page, at page size 128 too
    assert first["completion_ids"] == second["completion_ids"] == reference["long_question"][1]


def test_a_text_only_request_gets_no_encoder_tokens(client, model_name, reference):
    """The processor attaches the real checkpoint's placeholder frame to a text-only prompt; the request must still
    have no encoder slots (prompt tokens = text tokens) and answer like the reference, which ignores the frame."""
    served = served_ids(client, model_name, CASES["text_only"])
    assert served["usage"].prompt_tokens == len(reference["text_only"][0])
    assert served["completion_ids"] == reference["text_only"][1]
    image = served_ids(client, model_name, CASES["image_data_url"])
    assert image["usage"].prompt_tokens > len(reference["image_data_url"][0])  # an image request's count has them


def test_streaming_with_usage_equals_the_non_streamed_answer(client, model_name):
    expected = served_ids(client, model_name, CASES["image_data_url"])
    stream = client.chat.completions.create(
        model=model_name,
        messages=to_openai(CASES["image_data_url"]),
        **GREEDY,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    pieces, usage_chunks = [], []
    for chunk in stream:
        pieces += [choice.delta.content or "" for choice in chunk.choices]
        if chunk.usage is not None:
            usage_chunks.append(chunk.usage)
    assert "".join(pieces) == expected["text"]
    assert len(usage_chunks) == 1
    assert usage_chunks[0].completion_tokens == MAX_TOKENS
    assert usage_chunks[0].prompt_tokens == expected["usage"].prompt_tokens


def test_eight_concurrent_mixed_requests_each_equal_the_reference(client, model_name, reference):
    names = (PARITY_ORDER * 2)[:8]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda name: served_ids(client, model_name, CASES[name]), names))
    for name, served in zip(names, results):
        assert served["completion_ids"] == reference[name][1], name


def test_an_idle_cpu_server_leaves_the_cores_free(server):
    """serving.launch starts CPU servers with ``--sleep-on-idle``: once no request is running, the scheduler waits on
    its sockets instead of polling them (without the flag it keeps one whole core busy: 1.01 cores measured)."""
    scheduler = next(p for p in psutil.Process(server.process.pid).children(recursive=True) if "scheduler" in p.name())
    time.sleep(1.5)  # past the last decode step of the previous test
    before = sum(scheduler.cpu_times()[:2])
    time.sleep(3.0)
    assert (sum(scheduler.cpu_times()[:2]) - before) / 3.0 < 0.3


def test_models_and_health(server, client, checkpoint):
    assert [m.id for m in client.models.list().data] == [str(checkpoint)]
    assert requests.get(f"{server.base_url}/health", timeout=30).status_code == 200


def oversized_png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (2100, 2100), (10, 20, 30)).save(buffer, format="PNG")  # tiny preset: max_input_pixels 2048²
    return data_url(buffer.getvalue(), "image/png")


def with_image(url: str) -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}
    ]


BAD_REQUESTS = {
    "invalid_base64": ({"messages": with_image("data:image/png;base64,!!!not-base64***")}, "base64"),
    "data_url_not_an_image": (
        {"messages": with_image(data_url(b"plain text, no pixels", "image/png"))},
        "decode",
    ),
    "missing_image_path": ({"messages": with_image("file:///nonexistent/dir/cat.png")}, "not allowed or not found"),
    "unreachable_image_url": ({"messages": with_image("http://127.0.0.1:9/cat.png")}, "127.0.0.1"),
    "unsupported_content_part": (
        {"messages": [{"role": "user", "content": [{"type": "hologram", "hologram": {"url": "x"}}]}]},
        "hologram",
    ),
    "empty_messages": ({"messages": []}, "empty"),
    "zero_max_tokens": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    "negative_max_tokens": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, "max_tokens"),
    "image_over_the_limit": ({"messages": with_image(oversized_png())}, "max_input_pixels"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_gets_a_4xx_naming_the_problem_and_the_server_keeps_serving(server, client, model_name, case):
    body, expected_words = BAD_REQUESTS[case]
    response = requests.post(
        f"{server.base_url}/v1/chat/completions", json={"model": model_name, **GREEDY, **body}, timeout=300
    )
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    assert expected_words in response.json()["message"]
    valid = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "still there?"}], max_tokens=2, temperature=0
    )
    assert valid.usage.completion_tokens >= 1
