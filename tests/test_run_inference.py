"""inference/run_inference.py: query normalisation (moss_vl_reference/queries_moss_vl.py, with the runner's
generate defaults), device/attention wiring (inference/model_loading.py), and end-to-end runs on the example
query files with the tiny checkpoint.

Oracles: hand-written canonical queries; the reference model's own ``offline_batch_generate`` fed with
queries the test builds itself (absolute paths, placeholders materialised by hand), greedy, float32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import device_utils
from inference import model_loading, run_inference
from moss_vl_reference import queries_moss_vl as queries

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = REPO_ROOT / "inference" / "examples"
MEDIA = EXAMPLES / "media"
SHAPES, SIGN, CLIP = str(MEDIA / "shapes.png"), str(MEDIA / "stop_sign.png"), str(MEDIA / "moving_dot.mp4")
GREEDY_24 = {"max_new_tokens": 24, "do_sample": False}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def image(value) -> dict:
    return {"type": "image", "image": value}


def video(value) -> dict:
    return {"type": "video", "video": value}


# ------------------------------------------------------------------------------ query normalisation


def normalize(raw):
    return queries.normalize_query(raw, run_inference.GENERATE_DEFAULTS)


def test_prompt_without_placeholders_puts_media_first():
    query = normalize({"prompt": "What is it?", "images": ["a.png"], "videos": ["v.mp4"]})
    assert query["messages"] == [{"role": "user", "content": [image("a.png"), video("v.mp4"), text("What is it?")]}]
    assert query["generate_kwargs"] == {"max_new_tokens": 256, "do_sample": False}
    assert query["media_kwargs"] == {}


def test_prompt_placeholders_take_media_in_order_and_system_prompt_leads():
    query = normalize(
        {
            "prompt": "A <|image|> then <|video|> then <|image|>.",
            "images": ["1.png", "2.png"],
            "videos": ["v.mp4"],
            "system_prompt": "Be brief.",
            "generate_kwargs": {"max_new_tokens": 5, "do_sample": True},
            "media_kwargs": {"video_fps": 2},
        }
    )
    assert query["messages"] == [
        {"role": "system", "content": [text("Be brief.")]},
        {
            "role": "user",
            "content": [
                text("A "),
                image("1.png"),
                text(" then "),
                video("v.mp4"),
                text(" then "),
                image("2.png"),
                text("."),
            ],
        },
    ]
    assert query["generate_kwargs"] == {"max_new_tokens": 5, "do_sample": True}
    assert query["media_kwargs"] == {"video_fps": 2}


def test_messages_placeholders_image_url_and_trailing_assistant():
    query = normalize(
        {
            "messages": [
                {"role": "user", "content": "<|image|>How many?"},
                {"role": "assistant", "content": "Three."},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "https://x.org/b.png?s=1"}},
                        "And <|image|>?",
                    ],
                },
                {"role": "assistant", "content": "dataset answer, trimmed"},
            ],
            "images": ["a.png", "c.png"],
            "response": "dropped",
        }
    )
    assert query["messages"] == [
        {"role": "user", "content": [image("a.png"), text("How many?")]},
        {"role": "assistant", "content": [text("Three.")]},
        {"role": "user", "content": [image("https://x.org/b.png?s=1"), text("And "), image("c.png"), text("?")]},
    ]
    assert "response" not in query


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"prompt": "two <|image|> <|image|>", "images": ["a.png"]}, "more <|image|> placeholders"),
        ({"prompt": "one <|image|>", "images": ["a.png", "b.png"]}, "1 image(s) and 0 video(s) have no"),
        ({"messages": [{"role": "user", "content": "hi"}], "videos": ["v.mp4"]}, "0 image(s) and 1 video(s) have no"),
        ({"prompt": "  "}, "non-empty"),
        ({"images": ["a.png"]}, "needs 'messages' or 'prompt'"),
        ({"messages": [{"role": "assistant", "content": "only me"}]}, "at least one user message"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role must be"),
        (
            {"messages": [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}]},
            "unsupported content part type 'audio'",
        ),
        (["not", "an", "object"], "must be a JSON object"),
    ],
)
def test_malformed_queries_name_the_problem(raw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")):
        normalize(raw)


def test_media_paths_resolve_against_the_query_folder(tmp_path):
    query = {
        "messages": [
            {
                "role": "user",
                "content": [
                    image("sub/a.png"),
                    image("/abs/b.png"),
                    image("https://example.org/c.png?x=1&y=2"),
                    image("file://rel/d.png"),
                    video({"video_path": "clips/v.mp4", "fps": 2}),
                    video("../w.mp4"),
                    text("hi"),
                ],
            }
        ],
        "media_kwargs": {},
        "generate_kwargs": {},
    }
    resolved = queries.resolve_query_media_paths(query, tmp_path)
    assert resolved["messages"][0]["content"] == [
        image(str((tmp_path / "sub/a.png").resolve())),
        image("/abs/b.png"),
        image("https://example.org/c.png?x=1&y=2"),
        image(str((tmp_path / "rel/d.png").resolve())),
        video({"video_path": str((tmp_path / "clips/v.mp4").resolve()), "fps": 2}),
        video(str(tmp_path.parent.resolve() / "w.mp4")),
        text("hi"),
    ]
    assert query["messages"][0]["content"][0] == image("sub/a.png"), "the input query must not be modified"


# Upstream's interface, from its own test (OpenMOSS/MOSS-VL inference/tests/test_run_inference.py,
# ResolveQueryMediaPathsTest at 859d7ab1): run_inference.resolve_query_media_paths takes a query as written.
UPSTREAM_REMOTE = "https://example.com/images/sample.jpg?size=large"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (  # an image_url part becomes an image part and keeps its key
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": UPSTREAM_REMOTE}]}]},
            {"messages": [{"role": "user", "content": [{"type": "image", "image_url": UPSTREAM_REMOTE}]}]},
        ),
        (  # remote references with a query string are kept, top-level and in both keys
            {
                "images": [UPSTREAM_REMOTE],
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "image": UPSTREAM_REMOTE},
                            {"type": "image", "image_url": UPSTREAM_REMOTE},
                        ],
                    }
                ],
            },
            None,  # unchanged
        ),
    ],
)
def test_upstream_resolve_query_media_paths_on_queries_as_written(raw, expected):
    resolved = run_inference.resolve_query_media_paths(raw, Path("/tmp/queries"))
    assert resolved == (expected or raw)


def test_upstream_resolve_query_media_paths_resolves_local_references_everywhere():
    base_dir = Path("/tmp/queries")
    raw = {
        "images": ["images/relative.jpg", "/data/images/absolute.jpg"],
        "videos": [{"video_path": "clips/v.mp4", "segments": [[0, 1]]}],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "images/inline.jpg"},
                    {"type": "image", "image_url": "images/url-field.jpg"},
                    {"type": "image_url", "image_url": {"url": "images/wrapped.jpg"}},
                    {"type": "video_url", "video_url": "clips/w.mp4"},
                ],
            }
        ],
    }
    resolved = run_inference.resolve_query_media_paths(raw, base_dir)
    local = lambda rel: str((base_dir / rel).resolve())  # noqa: E731
    assert resolved["images"] == [local("images/relative.jpg"), "/data/images/absolute.jpg"]
    assert resolved["videos"] == [{"video_path": local("clips/v.mp4"), "segments": [[0, 1]]}]
    assert resolved["messages"][0]["content"] == [
        {"type": "image", "image": local("images/inline.jpg")},
        {"type": "image", "image_url": local("images/url-field.jpg")},
        {"type": "image", "image_url": {"url": local("images/wrapped.jpg")}},
        {"type": "video", "video_url": local("clips/w.mp4")},
    ]
    assert raw["images"][0] == "images/relative.jpg", "the input query must not be modified"


def test_the_queries_module_loads_without_torch():
    """The runners' query checks and the demo's data URLs must not pay for importing torch."""
    code = "import sys, moss_vl_reference.queries_moss_vl; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    completed = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0 and completed.stdout.strip() == "[]", completed.stderr


def test_data_urls_carry_the_file_bytes_and_its_mime_type(tmp_path):
    (tmp_path / "a.png").write_bytes(b"\x89PNG fake")
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x01mp4")
    assert queries.file_data_url(tmp_path / "a.png") == "data:image/png;base64,iVBORyBmYWtl"
    assert queries.file_data_url(tmp_path / "clip.mp4") == "data:video/mp4;base64,AAFtcDQ="
    assert queries.data_url(b"hi", "text/plain") == "data:text/plain;base64,aGk="


def test_load_queries_reads_json_lists_and_jsonl(tmp_path):
    (tmp_path / "q.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    (tmp_path / "q.json").write_text('[{"prompt": "a"}, {"prompt": "b"}]')
    (tmp_path / "bad.json").write_text('{"prompt": "a"}')
    assert run_inference.load_queries(tmp_path / "q.jsonl") == [{"prompt": "a"}, {"prompt": "b"}]
    assert run_inference.load_queries(tmp_path / "q.json") == [{"prompt": "a"}, {"prompt": "b"}]
    with pytest.raises(ValueError, match="must hold a list"):
        run_inference.load_queries(tmp_path / "bad.json")


# --------------------------------------------------------- device and attention wiring (stand-ins)


class RecordingLoader:
    """Stand-in for AutoModelForCausalLM/AutoProcessor: records from_pretrained kwargs, returns a model
    stand-in whose .to()/.eval() record the target (no accelerator exists on this machine)."""

    def __init__(self):
        self.calls = []

    def from_pretrained(self, checkpoint, **kwargs):
        self.calls.append(kwargs)
        return self

    def to(self, target):
        self.moved_to = target
        return self

    def eval(self):
        return self


@pytest.fixture
def simulated_device(monkeypatch):
    """Pretend this machine is an NPU/CUDA/CPU host (stand-in: device_utils' probe and accelerator module are
    replaced, the FlashAttention packages count as installed; no kernel ever runs)."""

    def simulate(device_type: str) -> RecordingLoader:
        accelerator = SimpleNamespace(device_count=lambda: 1, get_device_name=lambda index=0: f"{device_type} stand-in")
        monkeypatch.setattr(device_utils, "detect_device_type", lambda: device_type)
        monkeypatch.setattr(device_utils, "_accelerator_module", lambda: None if device_type == "cpu" else accelerator)
        monkeypatch.setattr(device_utils, "flash_kernel_installed", lambda implementation: True)
        loader = RecordingLoader()
        monkeypatch.setattr(model_loading, "AutoModelForCausalLM", loader)
        monkeypatch.setattr(model_loading, "AutoProcessor", RecordingLoader())
        return loader

    return simulate


@pytest.mark.parametrize(
    ("device_type", "overrides", "attn", "target", "dtype"),
    [
        ("npu", {}, "eager", "npu:0", "bfloat16"),
        ("npu", {"attention_backend": "sdpa"}, "sdpa", "npu:0", "bfloat16"),
        ("npu", {"attention_backend": "flash_attention_2"}, "eager", "npu:0", "bfloat16"),
        ("cuda", {}, "flash_attention_2", "cuda:0", "bfloat16"),
        ("cuda", {"device": "cpu"}, "sdpa", "cpu", "float32"),
        ("cpu", {"dtype": "bfloat16"}, "sdpa", "cpu", "bfloat16"),
        ("npu", {"device": "npu:1", "attention_backend": "eager"}, "eager", "npu:1", "bfloat16"),
    ],
)
def test_attention_and_device_reach_from_pretrained(simulated_device, device_type, overrides, attn, target, dtype):
    loader = simulated_device(device_type)
    _, _, metadata = model_loading.load_model("ckpt", **overrides)
    (kwargs,) = loader.calls
    assert kwargs["attn_implementation"] == attn
    assert kwargs["dtype"] == model_loading.DTYPES[dtype]
    assert kwargs["trust_remote_code"] is True
    assert "cross_attention_implementation" not in kwargs
    assert loader.moved_to == target
    assert (metadata["attention_implementation"], metadata["device"], metadata["dtype"]) == (attn, target, dtype)


def test_cross_attention_implementation_forwarded_only_when_given(simulated_device):
    loader = simulated_device("npu")
    model_loading.load_model("ckpt", cross_attention_implementation="sdpa")
    assert loader.calls[0]["attn_implementation"] == "eager"
    assert loader.calls[0]["cross_attention_implementation"] == "sdpa"


def test_missing_accelerator_is_an_error_not_a_fallback(simulated_device):
    simulated_device("cpu")
    with pytest.raises(SystemExit, match="device 'npu' requested, but this machine offers cpu"):
        model_loading.load_model("ckpt", device="npu")


class ScriptedStreamModel:
    """Stand-in model speaking the offline_generate protocol: answers after ``delays[prompt]`` seconds with
    the prompt reversed, in two pieces; a prompt in ``fails`` gets an "[ERROR] " item instead."""

    def __init__(self, delays=None, fails=()):
        self.delays, self.fails = delays or {}, fails

    def offline_generate(self, processor, in_queue, out_queue):
        while not (query := in_queue.get()).get("stop_offline_generate"):
            prompt = query["messages"][-1]["content"][-1]["text"]
            time.sleep(self.delays.get(prompt, 0.0))
            out_queue.put(queries.ROUND_START)
            if prompt in self.fails:
                out_queue.put(f"{queries.ERROR_PREFIX}ValueError: cannot answer {prompt}")
            else:
                answer = prompt[::-1]
                out_queue.put(answer[:2])
                out_queue.put(answer[2:])
            out_queue.put(queries.ROUND_END)


def test_a_query_past_its_deadline_fails_alone_and_its_late_text_goes_nowhere(tmp_path):
    # "slow one" answers 0.3 s into "fast one", which answers 0.6 s after it starts: a shared output queue would
    # hand the late answer to "fast one".
    model = ScriptedStreamModel(delays={"slow one": 1.3, "fast one": 0.6}, fails=("refused",))
    raw = [{"prompt": "slow one"}, {"prompt": "fast one"}, {"prompt": "refused"}, {"prompt": "last"}]
    results = run_inference.run_queries(model, None, raw, tmp_path, timeout_seconds=1.0)
    assert results[0]["error"] == "TimeoutError: no answer within 1 s" and "text" not in results[0]
    assert [r.get("text") for r in results[1:]] == ["eno tsaf", None, "tsal"]
    assert results[2]["error"] == "ValueError: cannot answer refused"
    assert [r["index"] for r in results] == [0, 1, 2, 3]


# ----------------------------------------------------------------- end to end with the tiny model


def run_cli(checkpoint: Path, input_path: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        str(REPO_ROOT / "inference" / "run_inference.py"),
        "--checkpoint",
        str(checkpoint),
        "--input",
        str(input_path),
        *extra,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


# The example files, written out by hand in the reference model's own query format.
ORACLE_QUERIES = {
    "image_queries.json": [
        {
            "prompt": "What shapes are in this picture, and what colour is each?",
            "images": [SHAPES],
            "generate_kwargs": GREEDY_24,
        },
        {
            "messages": [
                {"role": "user", "content": [image(SIGN), text("What does the sign say, and what should a driver do?")]}
            ],
            "generate_kwargs": GREEDY_24,
        },
        {
            "system_prompt": "You are a careful visual assistant. Answer briefly.",
            "prompt": "Compare <|image|> with <|image|>: which one shows a traffic sign?",
            "images": [SHAPES, SIGN],
            "generate_kwargs": GREEDY_24,
        },
    ],
    "video_queries.json": [
        {
            "prompt": "In which direction does the black dot move?",
            "videos": [CLIP],
            "media_kwargs": {"video_fps": 2.0, "max_frames": 8},
            "generate_kwargs": GREEDY_24,
        },
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        video({"video_path": CLIP}),
                        text("What number is written in the corner at the end of the clip?"),
                    ],
                }
            ],
            "generate_kwargs": GREEDY_24,
        },
    ],
    "multiturn_batch.jsonl": [
        {
            "messages": [
                {"role": "user", "content": [image(SHAPES), text("How many shapes do you see?")]},
                {"role": "assistant", "content": "I see three shapes."},
                {"role": "user", "content": [text("And in this one? "), image(SIGN)]},
            ],
            "generate_kwargs": GREEDY_24,
        },
        {
            "messages": [
                {"role": "system", "content": "Answer in one sentence."},
                {"role": "user", "content": [text("Describe the motion in "), video(CLIP)]},
            ],
            "generate_kwargs": GREEDY_24,
        },
        {"prompt": "Write one sentence about traffic safety.", "generate_kwargs": GREEDY_24},
    ],
}


@pytest.fixture(scope="module")
def reference_model(checkpoint):
    from transformers import AutoModelForCausalLM, AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, trust_remote_code=True, dtype="float32", attn_implementation="sdpa"
    ).eval()
    return model, processor


# Upstream's README runs each example with its legacy --mode alias (an upstream command line: --mode first).
UPSTREAM_MODES = {"image_queries.json": "image", "video_queries.json": "video", "multiturn_batch.jsonl": "batch"}


def expected_summary(oracle: dict) -> dict:
    """Upstream's per-result prompt/images/videos, read off the hand-written oracle query."""
    if "messages" in oracle:
        last_user = [m for m in oracle["messages"] if m["role"] == "user"][-1]
        prompt = "".join(part["text"] for part in last_user["content"] if part["type"] == "text")
        parts = [part for m in oracle["messages"] if not isinstance(m["content"], str) for part in m["content"]]
        images = [part["image"] for part in parts if part["type"] == "image"]
        videos = [part["video"] for part in parts if part["type"] == "video"]
        return {"prompt": prompt, "images": images, "videos": videos}
    prompt = oracle["prompt"].replace("<|image|>", "").replace("<|video|>", "")
    return {"prompt": prompt, "images": oracle.get("images", []), "videos": oracle.get("videos", [])}


@pytest.mark.parametrize("example", sorted(ORACLE_QUERIES))
def test_example_file_matches_reference_batch_generate(checkpoint, reference_model, tmp_path, example):
    output = tmp_path / "results.json"
    mode = ["--mode", UPSTREAM_MODES[example]]
    completed = run_cli(
        checkpoint, EXAMPLES / example, *mode, "--output", str(output), "--device", "cpu", "--dtype", "float32"
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "attention implementation: sdpa (--attention-backend auto -> the cpu default)" in completed.stderr
    report = json.loads(output.read_text())
    assert (report["device"], report["dtype"], report["attention_implementation"]) == ("cpu", "float32", "sdpa")
    assert report["num_queries"] == len(ORACLE_QUERIES[example]) and report["num_failed"] == 0

    model, processor = reference_model
    expected = model.offline_batch_generate(processor, ORACLE_QUERIES[example])["results"]
    assert [r["index"] for r in report["results"]] == list(range(len(expected)))
    for result, oracle in zip(report["results"], expected):
        assert "error" not in oracle, oracle
        assert result["text"], result
        assert result["text"] == oracle["text"], f"query {result['index']}"
        assert result["elapsed_seconds"] > 0
        assert result["event_count"] >= 1
    assert report["mode_alias"] == UPSTREAM_MODES[example]
    for result, query in zip(report["results"], ORACLE_QUERIES[example]):
        summary = {key: result[key] for key in ("prompt", "images", "videos")}
        assert summary == expected_summary(query), f"query {result['index']}"


def test_a_missing_media_file_fails_only_its_own_query(checkpoint, tmp_path):
    queries = [
        {"prompt": "Describe.", "images": [SHAPES], "generate_kwargs": {"max_new_tokens": 4}},
        {"prompt": "Describe.", "images": ["media/not_there.png"], "generate_kwargs": {"max_new_tokens": 4}},
        {
            "prompt": "No placeholder for this image.",
            "images": [SHAPES, SIGN],
            "messages": [{"role": "user", "content": "<|image|>"}],
        },
        {"prompt": "Text only.", "generate_kwargs": {"max_new_tokens": 4}},
    ]
    input_path = tmp_path / "mixed.jsonl"
    input_path.write_text("".join(json.dumps(q) + "\n" for q in queries))
    completed = run_cli(checkpoint, input_path, "--device", "cpu")
    assert completed.returncode == 1, completed.stderr[-3000:]
    report = json.loads((tmp_path / "mixed_results.json").read_text())  # the default output path
    results = report["results"]
    assert report["num_failed"] == 2
    assert results[0]["text"] and results[3]["text"] and "error" not in results[0] and "error" not in results[3]
    assert "not found" in results[1]["error"] and str(tmp_path / "media" / "not_there.png") in results[1]["error"]
    assert "text" not in results[1]
    assert "1 image(s) and 0 video(s) have no" in results[2]["error"]
    assert results[2]["query"] == queries[2], "a query that cannot be normalised is reported as written"
