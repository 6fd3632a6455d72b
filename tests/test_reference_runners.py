"""Runner APIs of the reference model: offline batch, queue protocol, realtime session, online loop.

Oracle: `generate()` on the same processed inputs (greedy, fp32)."""

import queue
import threading
import time
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoProcessor

from moss_vl_reference.tiny_checkpoint import build_or_reuse

ASSETS = Path(__file__).parent / "assets"
GENERATE = {"max_new_tokens": 6, "eos_token_id": []}


@pytest.fixture(scope="module")
def processor():
    return AutoProcessor.from_pretrained(build_or_reuse("tiny"), trust_remote_code=True, frame_extract_num_threads=1)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(
        build_or_reuse("tiny"), trust_remote_code=True, dtype=torch.float32
    ).eval()


def image_query(text: str) -> dict:
    content = [{"type": "image", "image": str(ASSETS / "square_64.png")}, {"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": content}], "generate_kwargs": {"vision_chunked_length": 64}}


def direct_answer(model, processor, messages, images=(), videos=()) -> str:
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=list(images) or None, videos=list(videos) or None)
    out = model.generate(**inputs, **GENERATE)
    return processor.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def test_offline_batch_generate_answers_each_query_like_generate(model, processor):
    queries = [
        image_query("What is red?"),
        {"prompt": "Describe <|image|> briefly.", "images": [str(ASSETS / "gradient_96x64.png")]},
        {"prompt": "<|image|>", "images": ["/missing/dog.png"]},
    ]
    results = model.offline_batch_generate(processor, queries, vision_chunked_length=64, **GENERATE)["results"]
    assert results[0]["text"] == direct_answer(
        model, processor, queries[0]["messages"], images=[str(ASSETS / "square_64.png")]
    )
    prompt_form = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Describe "},
                {"type": "image"},
                {"type": "text", "text": " briefly."},
            ],
        }
    ]
    assert results[1]["text"] == direct_answer(
        model, processor, prompt_form, images=[str(ASSETS / "gradient_96x64.png")]
    )
    assert results[2]["text"] == "" and "dog.png" in results[2]["error"]


def test_offline_generate_queue_protocol(model, processor):
    inbox, outbox = queue.Queue(), queue.Queue()
    worker = threading.Thread(
        target=model.offline_generate, args=(processor, inbox, outbox), kwargs={"vision_chunked_length": 64, **GENERATE}
    )
    worker.start()
    inbox.put(image_query("What is red?"))
    inbox.put({"prompt": "<|video|>", "videos": ["/missing/clip.mp4"]})
    inbox.put({"stop_offline_generate": True})
    worker.join(timeout=60)
    assert not worker.is_alive()
    items = []
    while not outbox.empty():
        items.append(outbox.get())
    first_end = items.index("<|round_end|>")
    assert items[0] == "<|round_start|>"
    expected = direct_answer(
        model, processor, image_query("What is red?")["messages"], images=[str(ASSETS / "square_64.png")]
    )
    assert "".join(items[1:first_end]) == expected
    assert items[first_end + 1 :] == ["<|round_start|>", items[first_end + 2], "<|round_end|>"]
    assert items[first_end + 2].startswith("[ERROR] FileNotFoundError") and "clip.mp4" in items[first_end + 2]


def frames(count: int) -> list:
    return [Image.new("RGB", (64, 64), (60 * i, 255 - 60 * i, 40)) for i in range(count)]


def wait_for(condition, seconds: float = 30.0):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.05)


def test_online_generate_runs_the_stream_on_upstream_messages_until_stopped(model, processor):
    """Upstream's queue protocol: a settings message, frames (a subtitle as `text`), a prompt, a bad message (its
    own error piece, the stream goes on), then the stop message ends the loop and the stream."""
    inbox, outbox = queue.Queue(), queue.Queue()
    worker = threading.Thread(
        target=model.online_generate, args=(processor, inbox, outbox), kwargs={"max_new_tokens": 4}
    )
    worker.start()
    inbox.put({"initial_prompt": "Describe.", "system_prompt": None, "frame_queue_size": 4, "max_tokens_per_turn": 0})
    first, second = frames(2)
    inbox.put({"frame": first, "timestamp": 0.0})
    inbox.put({"frame": second, "timestamp": 1.0, "text": "a subtitle", "drop_oldest": False})
    inbox.put({"prompt": "Again?", "drop_oldest": False})
    inbox.put({"neither": True})
    wait_for(lambda: outbox.qsize() >= 8)
    inbox.put({"stop_online_generate": True})
    worker.join(timeout=60)
    assert not worker.is_alive()
    pieces = [outbox.get() for _ in range(outbox.qsize())]
    assert pieces[0] == "<|round_start|>", "the initial prompt opens a round"
    assert sum(p.startswith("[ERROR] ValueError") for p in pieces) == 1


def test_close_ends_a_stream_in_the_middle_of_a_long_turn(model, processor):
    """A turn limit of 100000 tokens would run for minutes; close() ends the stream after its current step."""
    session = model.create_realtime_session(processor, max_new_tokens=100_000)
    session.start()
    session.push_frame(frames(1)[0], timestamp=0.0)
    session.push_prompt("Talk forever.")
    wait_for(lambda: len(session.generated) > 5)
    started = time.monotonic()
    session.close(timeout=30)
    assert time.monotonic() - started < 10 and not session.active
    assert len(session.generated) < 1000
