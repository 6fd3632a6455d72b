"""realtime_inference/replay_proactive_videoqa.py on a 20-sample synthetic frame-input-format file and the
tiny-realtime checkpoint.

Oracles: the file the generator script wrote (question ids, user texts, frame counts); for each sample the session
the client drove (captured): its frames in the stream's text, and the replies equal to what the stream generated
(control tokens removed). Resuming is checked by counting the sessions a second run opens.
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoProcessor

from moss_vl_reference.tiny_checkpoint import build_or_reuse
from realtime_inference import replay_proactive_videoqa as replay

REPO_ROOT = Path(__file__).resolve().parents[1]
GENERATOR = REPO_ROOT / "realtime_inference" / "examples" / "make_proactive_videoqa_sample.py"


@pytest.fixture(scope="module")
def rt_model():
    checkpoint = build_or_reuse("tiny-realtime")
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, trust_remote_code=True, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    return model, AutoProcessor.from_pretrained(checkpoint, trust_remote_code=True)


class CapturingModel:
    def __init__(self, model):
        self.model, self.sessions = model, []

    def create_realtime_session(self, processor, **kwargs):
        self.sessions.append(self.model.create_realtime_session(processor, **kwargs))
        return self.sessions[-1]


def options(input_path: Path, output: Path) -> argparse.Namespace:
    return replay.parse_args(["--checkpoint", "unused", "--input", str(input_path), "--output", str(output)])


def user_texts(sample: dict) -> list[str]:
    return [replay.turn_parts(turn)[0] for turn in sample["conversation"] if turn["role"] == "user"]


def test_replay_writes_pred_jsonl_records_errors_and_resumes(rt_model, tmp_path):
    model, processor = rt_model
    generated = subprocess.run(
        [sys.executable, str(GENERATOR), "--out", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert generated.returncode == 0, generated.stderr
    input_path = Path(generated.stdout.strip().splitlines()[-1])
    samples = json.loads(input_path.read_text())
    assert len(samples) == 20
    broken = samples[5]["conversation"][-2]["content"][0]["image"]
    (tmp_path / broken).rename(tmp_path / (broken + ".moved"))  # one sample loses a frame: it alone fails
    output = tmp_path / "pred.jsonl"
    args = options(input_path, output)
    assert args.sec_per_frame == 1.0, "seconds per frame come from the file name"
    args.max_new_tokens = 6

    capturing = CapturingModel(model)
    assert replay.replay_file(capturing, processor, args) == {"done": 19, "skipped": 0, "failed": 1}
    records = [json.loads(line) for line in output.read_text().splitlines()]
    errors = [json.loads(line) for line in (tmp_path / "pred.jsonl.errors.jsonl").read_text().splitlines()]
    assert errors == [{"question_id": "synthetic-005", "error": f"frame not found: {tmp_path / broken}"}]
    by_id = {sample["question_id"]: sample for sample in samples}
    assert [r["question_id"] for r in records] == [s["question_id"] for s in samples if s is not samples[5]]
    sessions = [s for s in capturing.sessions]
    del sessions[5]
    replies_seen = 0
    for record, session in zip(records, sessions):
        sample = by_id[record["question_id"]]
        turns = record["model_response_list"]
        assert all(set(turn) == {"role", "content", "time"} for turn in turns)
        assert [t["time"] for t in turns] == sorted(t["time"] for t in turns)
        assert [t["content"] for t in turns if t["role"] == "user"] == [t for t in user_texts(sample) if t]
        frames = sum(len(replay.turn_parts(t)[1]) for t in sample["conversation"] if t["role"] == "user")
        stream_text = processor.tokenizer.decode(session.stream.tokens)
        assert stream_text.count("<|image_pad|>") == frames
        assert f"{(frames - 1):.1f} seconds" in stream_text, "frame i is stamped i x 1 s"
        replies = "".join(t["content"] for t in turns if t["role"] == "assistant")
        spoken = re.sub(r"<\|[^|]+\|>|<go>", "", processor.tokenizer.decode(session.generated))
        assert replies.replace(" ", "") == spoken.replace(" ", "").strip()
        replies_seen += sum(t["role"] == "assistant" for t in turns)
    assert replies_seen > 0
    assert "Subtitle: keep the change." in processor.tokenizer.decode(sessions[0].stream.tokens)

    (tmp_path / (broken + ".moved")).rename(tmp_path / broken)
    again = CapturingModel(model)
    assert replay.replay_file(again, processor, args) == {"done": 1, "skipped": 19, "failed": 0}
    assert len(again.sessions) == 1, "finished samples are not replayed"
    assert [json.loads(line)["question_id"] for line in output.read_text().splitlines()][-1] == "synthetic-005"


def test_seconds_per_frame_must_be_known(tmp_path):
    unnamed = tmp_path / "frames.json"
    unnamed.write_text("[]")
    with pytest.raises(SystemExit):
        replay.parse_args(["--checkpoint", "x", "--input", str(unnamed), "--output", str(tmp_path / "p.jsonl")])
    assert replay.sec_per_frame_from_name(Path("ego-0.5_sec_per_frame-frame_input_format.json")) == 0.5
