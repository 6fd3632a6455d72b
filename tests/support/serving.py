"""Shared pieces of the end-to-end serving tests: chat cases, the reference oracle, OpenAI request helpers.

A case is a list of chat messages in the reference processor's form (``{"type": "image", "image": path}``,
``{"type": "video", "video": path}``); ``to_openai`` turns it into the OpenAI wire form with data URLs.
The oracle is the reference transformers model in fp32, greedy, never stopping at EOS, so the server's
completion ids must equal it token for token.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import requests
import torch
from openai import OpenAI

from moss_vl_reference.queries_moss_vl import file_data_url

ASSETS = Path(__file__).resolve().parents[1] / "assets"
MAX_TOKENS = 10
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS}
# sglang extensions: return ids, never stop early, report radix-cache hits.
TOKEN_IDS = {"return_token_ids": True, "return_prompt_token_ids": True, "ignore_eos": True}
# The served modules' base: fp32, no warm-up request before /health answers, the cached token count in each answer's
# usage. The pool lends a live server only to equal arguments, so the modules that share servers build theirs from
# these lists.
FP32_REPORTING_ARGS = ["--dtype", "float32", "--skip-server-warmup", "--enable-cache-report"]
# The logprob baseline of the paged and the chunked modules (and test_serving.py's page-1 server): fp32 at page 1,
# prefill never chunked, one server lent to all by the pool. An explicit ``--chunked-prefill-size -1`` makes stock CPU
# memory resolution compute a negative ``--mem-fraction-static`` (it sizes activation memory from the chunk size): the
# value stock resolves with its default chunk size is given instead. ``--page-size 1`` is the CPU default.
UNCHUNKED_PAGE_ONE_ARGS = [
    *FP32_REPORTING_ARGS,
    *("--page-size", "1", "--chunked-prefill-size", "-1", "--mem-fraction-static", "0.71"),
]
# tests/test_serving.py's and tests/test_serving_cache.py's page-128 server.
PAGE_128_ARGS = [*FP32_REPORTING_ARGS, "--page-size", "128"]
# Page 128 chunked, the paged module's and the decode-graph module's eager baseline (one server lent to both). Two
# pages per chunk: with --enable-mixed-chunk stock takes one token per running request off the chunk budget and
# rounds a new request up to whole pages, so a one-page budget admits nothing while any request decodes.
PAGE_128_CHUNKED = ["--page-size", "128", "--chunked-prefill-size", "256", "--enable-mixed-chunk"]
# Chunked (or page-128) prompts against the unchunked baseline in fp32: a chunk and a whole prompt reduce attention and
# the logits in a different order. On the tiny checkpoints' logits (|logit| up to ~44) 8 fp32 ulps are 3.05e-5
# (measured in fp64 by test_realtime_stream's oracle); the largest gaps seen are 1.24e-5 (three turns, one-row chunks)
# and 1.05e-5 (a video's long question, 256-row chunks at page 128). A mask or wrong-row bug moves a logprob by orders
# of magnitude more, and the ids are checked against the reference model besides.
FP32_ORDER_TOLERANCE = 3.05e-5


def image(name: str, text: str) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": str(ASSETS / name)}, {"type": "text", "text": text}]}


CASES = {
    "image_data_url": [image("square_64.png", "What is in this image?")],
    "two_images": [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": str(ASSETS / "square_64.png")},
                {"type": "image", "image": str(ASSETS / "gradient_96x64.png")},
                {"type": "text", "text": "Compare the two images."},
            ],
        }
    ],
    "three_turns": [
        image("square_64.png", "What is the first picture?"),
        {"role": "assistant", "content": "A square."},
        image("gradient_96x64.png", "And this one?"),
        {"role": "assistant", "content": "A gradient."},
        image("tiny_8x8.png", "Which of the three is smallest?"),
    ],
    "video": [
        {
            "role": "user",
            "content": [
                {"type": "video", "video": str(ASSETS / "moving_square_3s.mp4")},
                {"type": "text", "text": "What moves in this video?"},
            ],
        }
    ],
    "text_only": [{"role": "user", "content": "Tell me about cats."}],
    # The two images of "two_images" again, after other text: on a warm server the radix cache must not reuse
    # encoder keys rotated for the earlier positions.
    "same_images_shifted": [
        {"role": "system", "content": "You are a careful assistant who looks twice."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Here are two pictures."},
                {"type": "image", "image": str(ASSETS / "square_64.png")},
                {"type": "image", "image": str(ASSETS / "gradient_96x64.png")},
                {"type": "text", "text": "Compare the two images."},
            ],
        },
    ],
}


def long_question(i: int) -> str:
    words = " ".join(f"detail {k} of scene {i}" for k in range(40 + 5 * i))
    return f"Question {i}: look closely at every frame and list each {words}. What changes?"


def long_case(i: int) -> list[dict]:
    """A video (even i) or an image (odd i) with a question of ~300 text rows: chunked at any size, several pages."""
    media = (
        {"type": "video", "video": str(ASSETS / "moving_square_3s.mp4")}
        if i % 2 == 0
        else {"type": "image", "image": str(ASSETS / "gradient_96x64.png")}
    )
    return [{"role": "user", "content": [media, {"type": "text", "text": long_question(i)}]}]


# Longer than a 128-token page (the NPU's): the radix cache keeps whole pages only.
CASES["long_question"] = long_case(1)


def short_case(i: int) -> list[dict]:
    """A short text-only (even i) or one-image (odd i) request."""
    if i % 2 == 0:
        return [{"role": "user", "content": f"Say hi number {i}."}]
    return [image("square_64.png", f"Short look {i}?")]


# The cases a PD fleet answers one at a time (tests/test_serving_pd*.py).
PD_CASES = {
    "image": CASES["image_data_url"],
    "two_images": CASES["two_images"],
    "video": CASES["video"],
    "text_only": CASES["text_only"],
    "two_turns": CASES["three_turns"][:3],
}
# A PD worker's start on the 2-core machine: 60-90 s idle; beside the rest of the suite, over 240 s was seen.
PD_READY_TIMEOUT_S = 900.0


def pd_server_args(page_size: int) -> list[str]:
    """The PD tests' worker (and aggregated oracle) arguments: fp32, the given page size, 8192 slots, 4096 context."""
    return ["--dtype", "float32", "--page-size", str(page_size), "--skip-server-warmup"] + [
        "--max-total-tokens",
        "8192",
        "--context-length",
        "4096",
    ]


def to_openai(messages: list[dict]) -> list[dict]:
    """Reference-form messages -> OpenAI chat messages with media inlined as data URLs."""
    converted = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [_openai_part(part) for part in content]
        converted.append({"role": message["role"], "content": content})
    return converted


def _openai_part(part: dict) -> dict:
    if part["type"] == "image":
        return {"type": "image_url", "image_url": {"url": file_data_url(part["image"])}}
    if part["type"] == "video":
        return {"type": "video_url", "video_url": {"url": file_data_url(part["video"])}}
    return part


def load_reference(checkpoint: Path):
    from transformers import AutoModelForCausalLM, AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True, dtype=torch.float32).eval()
    return model, processor


def reference_ids(model, processor, messages: list[dict], max_tokens: int = MAX_TOKENS) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy completion ids) of the reference model, never stopping at EOS."""
    inputs, _ = model.processor_inputs(processor, {"messages": messages})
    sequences = model.generate(**inputs, max_new_tokens=max_tokens, eos_token_id=[])
    prompt_len = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), sequences[0, prompt_len:].tolist()


def reference_prompt_logprobs(model, inputs) -> torch.Tensor:
    """log p(token_t | tokens_<t) for t >= 1, fp64 ``[prompt_len - 1]``, of the reference model on ``inputs``."""
    with torch.no_grad():
        logits = model(**inputs).logits[0].double()
    ids = inputs["input_ids"][0]
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]


def reference_in_fp32_and_bf16(checkpoint: Path, messages: list[dict]) -> dict:
    """Prompt ids, the prompt's chat text, the processor inputs, and the reference model's prompt logprobs in fp32 and
    in bf16 (the bf16 model's own spread is the tolerance a bf16 server is held to)."""
    model, processor = load_reference(checkpoint)
    inputs, _ = model.processor_inputs(processor, {"messages": messages})
    fp32 = reference_prompt_logprobs(model, inputs)
    bf16_inputs = {
        key: value.to(torch.bfloat16) if torch.is_tensor(value) and value.is_floating_point() else value
        for key, value in inputs.items()
    }
    bf16 = reference_prompt_logprobs(model.to(torch.bfloat16), bf16_inputs)
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return {"ids": inputs["input_ids"][0].tolist(), "fp32": fp32, "bf16": bf16, "text": text, "inputs": inputs}


def assert_within_the_bf16_spread(prompt_entries: list, reference: dict, label: str) -> None:
    """A bf16 server's prompt logprobs (sglang's ``input_token_logprobs``, the first one None) against the fp32
    reference: mean error within 1.5x the bf16 reference model's own + 0.01, worst token within 1.5x + 0.05."""
    logprobs = torch.tensor([entry[0] for entry in prompt_entries[1:]], dtype=torch.float64)
    served_error = (logprobs - reference["fp32"]).abs()
    dtype_error = (reference["bf16"] - reference["fp32"]).abs()
    print(
        f"{label} bf16 prompt logprob error vs fp32: mean {served_error.mean():.4f} max {served_error.max():.4f}; "
        f"reference model in bf16: mean {dtype_error.mean():.4f} max {dtype_error.max():.4f}"
    )
    assert torch.isfinite(logprobs).all()
    assert served_error.mean() <= 1.5 * dtype_error.mean() + 0.01
    assert served_error.max() <= 1.5 * dtype_error.max() + 0.05


def served_ids(client, model_name: str, messages: list[dict], **overrides) -> dict:
    """One non-streamed greedy chat completion -> prompt/completion ids, text and usage."""
    response = client.chat.completions.create(
        model=model_name, messages=to_openai(messages), **{**GREEDY, **overrides}, extra_body=TOKEN_IDS
    )
    choice = response.choices[0].model_dump()
    return {
        "prompt_ids": choice["prompt_token_ids"],
        "completion_ids": choice["response_token_ids"],
        "text": response.choices[0].message.content,
        "usage": response.usage,
    }


# Stock sglang's prefill log line (``scheduler_components/metrics_reporter.py``): ``#new-token`` is the sum over the
# batch's requests of the tokens the engine extended (``PrefillAdder``: ``len(fill_ids) - prefix_len``, what it
# computed, not what it found in the cache), ``#cached-token`` their matched prefixes.
PREFILL_LINE = re.compile(
    r"Prefill batch.*?#new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+),.*?#running-req: (\d+)"
)
RETRACTION_LINE = re.compile(r"Testing retraction\. #retracted_reqs: (\d+)")


def openai_client(server, api_key: str = "not-needed") -> tuple[OpenAI, str]:
    """An OpenAI client of ``server`` (no retries; ``api_key`` for a server started with ``--api-key``) and the name
    of the model it serves."""
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key=api_key, max_retries=0, timeout=600)
    return client, client.models.list().data[0].id


def server_log(server) -> str:
    """What ``server`` logged for this user: since the lease began for a pooled server (``support.server_pool``), the
    whole log for one started alone."""
    if hasattr(server, "log_text"):
        return server.log_text()
    return server.log_path.read_text(errors="replace")


@dataclass(frozen=True)
class EnginePrefill:
    """One prefill batch as the engine logged it."""

    new_seqs: int
    new_tokens: int  # tokens the engine computed in this batch (its requests' extends)
    cached_tokens: int  # tokens its requests took from the cache instead
    running_reqs: int


def engine_prefills(log_text: str) -> list[EnginePrefill]:
    """Every prefill batch in a server log, from stock sglang's own counts (not from anything the plugin logs): the
    independent record of how much work each step of a request really cost."""
    return [EnginePrefill(*map(int, m.groups())) for m in PREFILL_LINE.finditer(log_text)]


def prefill_batches(server) -> list[tuple[int, int, int]]:
    """(#new-seq, #new-token, #running-req) of every prefill batch the server logged (for this user)."""
    return [(b.new_seqs, b.new_tokens, b.running_reqs) for b in engine_prefills(server_log(server))]


def retractions(server) -> list[int]:
    """The requests retracted at each of sglang's test retractions (``SGLANG_TEST_RETRACT=1``) the server logged
    (for this user)."""
    return [int(n) for n in RETRACTION_LINE.findall(server_log(server))]


def cached_tokens(usage) -> int:
    details = usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0


def greedy_with_logprobs(base_url: str, text, image_data, video_data, max_new_tokens: int, top_logprobs_num: int = 0):
    """Native ``/generate``, greedy, never stopping at EOS, with every prompt and output token's logprob (and its
    ``top_logprobs_num`` most likely tokens, if any): ``text`` one string (-> its answer) or a list (a batch request
    -> a list of answers), media as stock's request takes it."""
    body = {
        "text": text,
        "image_data": image_data,
        "video_data": video_data,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if top_logprobs_num:
        body["top_logprobs_num"] = top_logprobs_num
    response = requests.post(f"{base_url}/generate", json=body, timeout=600)
    response.raise_for_status()
    return response.json()


def logprob_fields(answer: dict) -> tuple[list, list, int]:
    """One answer's ``(input_token_logprobs, output_token_logprobs, prompt_tokens)``."""
    meta = answer["meta_info"]
    return meta["input_token_logprobs"], meta["output_token_logprobs"], meta["prompt_tokens"]


def served_token_logprobs(base_url: str, text: str, image_urls=(), video_urls=(), max_new_tokens: int = 1):
    """sglang's ``(input_token_logprobs, output_token_logprobs, prompt_tokens)`` (``[logprob, token id, ...]`` per
    token, the first prompt logprob None) for ``text`` with its media placeholders, the media as URLs."""
    answer = greedy_with_logprobs(base_url, text, list(image_urls) or None, list(video_urls) or None, max_new_tokens)
    return logprob_fields(answer)


def served_prompt_logprobs(base_url: str, text: str, image_urls=(), video_urls=()) -> list[list]:
    """The prompt half of :func:`served_token_logprobs`, one greedy token."""
    return served_token_logprobs(base_url, text, image_urls, video_urls)[0]


def native_chat_input(processor, messages: list[dict]) -> tuple[str, list[str], list[str]]:
    """A chat as native ``/generate`` takes it: the chat template's text with its media placeholders, and the image
    and video data URLs (the path sglang accepts for a video as well as for images)."""
    media = [part for m in to_openai(messages) if isinstance(m["content"], list) for part in m["content"]]
    return (
        processor.apply_chat_template(messages, add_generation_prompt=True),
        [p["image_url"]["url"] for p in media if p["type"] == "image_url"],
        [p["video_url"]["url"] for p in media if p["type"] == "video_url"],
    )


def token_logprobs_of(prompt: list, output: list, prompt_tokens: int) -> dict:
    """sglang's ``[logprob, token id, ...]`` entries of one answer -> ids and logprobs of its prompt text and output."""
    return {
        "ids": [entry[1] for entry in prompt],
        "logprobs": [entry[0] for entry in prompt if entry[0] is not None],
        "output_ids": [entry[1] for entry in output],
        "output_logprobs": [entry[0] for entry in output],
        "prompt_tokens": prompt_tokens,
    }


def chat_logprobs(base_url: str, processor, messages: list[dict], max_new_tokens: int = 1) -> dict:
    """Ids and logprobs of a chat's prompt text tokens and of ``max_new_tokens`` greedy tokens: native ``/generate``."""
    text, image_urls, video_urls = native_chat_input(processor, messages)
    return token_logprobs_of(*served_token_logprobs(base_url, text, image_urls, video_urls, max_new_tokens))


def batch_chat_logprobs(base_url: str, processor, chats: list[list[dict]], max_new_tokens: int) -> list[dict]:
    """:func:`chat_logprobs` of several chats sent as one native batch request (a list of texts with per-text media).
    On a server started with stock's ``SGLANG_ENABLE_COLOCATED_BATCH_GEN=1`` the tokenizer blocks the scheduler's
    input while it processes the batch and releases all of it at once: the chats are scheduled together, whatever
    each one's media processing costs."""
    inputs = [native_chat_input(processor, messages) for messages in chats]
    images, videos = [i for _, i, _ in inputs], [v for _, _, v in inputs]
    # Per text a list, empty when it has none: stock's request decoder picks a media field's shape by its first
    # entry, so a leading null would read the field as one flat list of media.
    answers = greedy_with_logprobs(
        base_url,
        [text for text, _, _ in inputs],
        images if any(images) else None,
        videos if any(videos) else None,
        max_new_tokens,
    )
    return [token_logprobs_of(*logprob_fields(answer)) for answer in answers]


def kv_load(server) -> dict:
    """The scheduler's load report (``/v1/loads``): ``num_used_tokens`` = KV slots neither free nor evictable."""
    response = requests.get(f"{server.base_url}/v1/loads", timeout=30)
    response.raise_for_status()
    return response.json()["loads"][0]


def wait_for_load(server, done, timeout_s: float = 60.0) -> dict:
    """Poll ``/v1/loads`` until ``done(load)`` or the timeout; returns the last report either way."""
    deadline = time.monotonic() + timeout_s
    load = kv_load(server)
    while not done(load) and time.monotonic() < deadline:
        time.sleep(0.2)
        load = kv_load(server)
    return load
