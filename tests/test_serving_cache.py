"""Radix-cache correctness of the served model: cache on (page size 1 and 128, the NPU page size) and off.

A three-turn conversation whose later turns reuse the first turn's image (so the encoder prefix and the cached
text are real radix hits, and extends run with a cached text prefix) must equal the reference model on every
server; the cold server with the cache off is the control. A request whose encoder is longer than one 128-slot
page is sent twice: with page size 128 the radix match ends inside the encoder span and must be dropped
(stock sglang would trip its whole-encoder assertion), with identical output. One server in use at a time.
"""

from __future__ import annotations

import pytest
from openai import OpenAI
from PIL import Image

from mossvl_ascend.attention.kv_layout import LayerBands, encoder_row_len
from support.serving import (
    ASSETS,
    FP32_REPORTING_ARGS,
    MAX_TOKENS,
    PAGE_128_ARGS,
    UNCHUNKED_PAGE_ONE_ARGS,
    cached_tokens,
    load_reference,
    reference_ids,
    served_ids,
)

pytestmark = pytest.mark.timeout(900)

# The first two are tests/test_serving.py's servers (the same arguments): the session's pool lends them, flushed. The
# page-1 one is used after the page-128 one, so that it is the one still alive for tests/test_serving_chunked.py
# (next in the shared-server group) when the radix-off server starts.
SERVERS = {
    "radix_page128": PAGE_128_ARGS,
    "radix_page1": UNCHUNKED_PAGE_ONE_ARGS,
    "radix_off": [*FP32_REPORTING_ARGS, "--disable-radix-cache"],
}

LONG_QUESTION = (
    "Look at the picture carefully and describe every shape, every colour, where each object sits, how large it "
    "is compared with the others, whether anything overlaps, and what a person would notice first when looking "
    "at it for the first time, then say which part of the picture is the brightest and which is the darkest."
)
FIRST_TURN = {
    "role": "user",
    "content": [
        {"type": "image", "image": str(ASSETS / "square_64.png")},
        {"type": "text", "text": LONG_QUESTION},
    ],
}
CONVERSATION_TURNS = [
    [FIRST_TURN],
    [
        FIRST_TURN,
        {"role": "assistant", "content": "A red square on a dark background."},
        {"role": "user", "content": "Where exactly is the square?"},
    ],
    [
        FIRST_TURN,
        {"role": "assistant", "content": "A red square on a dark background."},
        {"role": "user", "content": "Where exactly is the square?"},
        {"role": "assistant", "content": "In the middle."},
        {"role": "user", "content": "And its colour again?"},
    ],
]


# Two 512x512 images: 2 x (16x16 merged tokens + separator) vision tokens.
LONG_ENCODER_VISION_TOKENS = 2 * 257


@pytest.fixture(scope="module")
def long_encoder_request(tmp_path_factory):
    """Two 512x512 images, whose encoder is longer than one 128-slot page in either KV layout (the MOSS-VL layout
    keeps three vision tokens per slot on the tiny model: 172 encoder slots)."""
    media = tmp_path_factory.mktemp("media")
    parts = []
    for seed in (64, 32):
        path = media / f"noise_512_{seed}.png"
        Image.effect_noise((512, 512), seed).convert("RGB").save(path)
        parts.append({"type": "image", "image": str(path)})
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe them."}]}]


@pytest.fixture(scope="module")
def long_encoder_slots(checkpoint):
    """The encoder slots of that request in the served KV layout (the default MOSS-VL layout off CUDA)."""
    from transformers import AutoConfig

    text_config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=True).text_config
    return encoder_row_len(LONG_ENCODER_VISION_TOKENS, LayerBands.of_text_config(text_config).bands)


@pytest.fixture(scope="module")
def reference(checkpoint, long_encoder_request):
    model, processor = load_reference(checkpoint)
    return {
        "turns": [reference_ids(model, processor, messages) for messages in CONVERSATION_TURNS],
        "long_encoder": reference_ids(model, processor, long_encoder_request),
    }


@pytest.fixture(scope="module", params=list(SERVERS))
def served(request, checkpoint, reference, server_pool):
    with server_pool.lease(checkpoint, SERVERS[request.param], name=f"test-cache-{request.param}") as server:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="not-needed", max_retries=0, timeout=300)
        yield request.param, client, client.models.list().data[0].id


def test_multi_turn_conversation_equals_the_reference(served, reference):
    config, client, model_name = served
    answers = [served_ids(client, model_name, messages) for messages in CONVERSATION_TURNS]
    assert answers[0]["usage"].prompt_tokens > 128 + 1, "turn 1 must span more than a 128-token page"
    for turn, (answer, (prompt_ids, completion_ids)) in enumerate(zip(answers, reference["turns"])):
        assert answer["prompt_ids"] == prompt_ids, f"turn {turn}"
        assert len(answer["completion_ids"]) == MAX_TOKENS
        assert answer["completion_ids"] == completion_ids, f"{config}: turn {turn} differs from the reference"
    later_hits = [cached_tokens(answer["usage"]) for answer in answers[1:]]
    if config == "radix_off":
        assert later_hits == [0, 0]
    else:
        assert all(hit > 0 for hit in later_hits), f"{config}: later turns should reuse the cached prefix: {later_hits}"


def test_encoder_longer_than_a_page_twice(served, reference, long_encoder_request, long_encoder_slots):
    config, client, model_name = served
    assert long_encoder_slots > 128
    first = served_ids(client, model_name, long_encoder_request)
    second = served_ids(client, model_name, long_encoder_request)
    expected = reference["long_encoder"][1]
    assert first["completion_ids"] == second["completion_ids"] == expected
    if config == "radix_page128":
        # The first page of the encoder is page-aligned, its rest is not: a partial encoder must never be reused.
        assert cached_tokens(second["usage"]) == 0
    elif config == "radix_page1":
        assert cached_tokens(second["usage"]) > long_encoder_slots
