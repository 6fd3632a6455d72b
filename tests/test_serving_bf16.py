"""MOSS-VL served in bf16 at page size 128 with a long multi-image prompt: prompt logprobs stay within bf16's own
tolerance.

The prompt has three images with about 170 text rows after each (511 prompt rows, more than a leaf of 192 rows,
so the frame-causal staircase is cut into several blocks merged by log-sum-exp). Oracle: the reference transformers
model in fp32 (log-probabilities of every prompt token given the ones before). The tolerance is the dtype's own:
the same reference model run in bf16 on the same inputs gives an error E against fp32; the server in bf16 must stay
within 1.5 E + 0.01 (mean over the prompt) and 1.5 E_max + 0.05 (worst token). A merge that loses or misweighs a
block, or a mask read with the wrong polarity, moves many tokens by far more (and the prompt ids must match).
"""

from __future__ import annotations

import pytest

from moss_vl_reference.queries_moss_vl import file_data_url
from serving.launch import SglangServer
from support.serving import ASSETS, assert_within_the_bf16_spread, reference_in_fp32_and_bf16, served_prompt_logprobs

pytestmark = pytest.mark.timeout(900)

FILLER = " ".join(["The scene shows shapes and colours that change slowly across the frame."] * 6)
MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "image", "image": str(ASSETS / "square_64.png")},
            {"type": "text", "text": "First picture. " + FILLER},
            {"type": "image", "image": str(ASSETS / "gradient_96x64.png")},
            {"type": "text", "text": "Second picture. " + FILLER},
            {"type": "image", "image": str(ASSETS / "square_64.png")},
            {"type": "text", "text": "Third picture. " + FILLER + " Compare them."},
        ],
    }
]
IMAGES = [part["image"] for part in MESSAGES[0]["content"] if part["type"] == "image"]


@pytest.fixture(scope="module")
def reference(checkpoint):
    expected = reference_in_fp32_and_bf16(checkpoint, MESSAGES)
    visible_frames = (~expected["inputs"]["cross_attention_mask"][0, 0]).sum(-1)
    assert len(expected["ids"]) > 192 and visible_frames.unique().numel() == 4  # a staircase over 3 images
    return expected


@pytest.fixture(scope="module")
def served(checkpoint, reference):
    # The NPU's settings: bf16 and 128-slot pages (the prompt spans four pages, its encoder shares the first).
    bf16_args = ["--dtype", "bfloat16", "--skip-server-warmup", "--page-size", "128"]
    with SglangServer(checkpoint, extra_args=bf16_args, name="test-bf16") as server:
        return served_prompt_logprobs(
            server.base_url, reference["text"], image_urls=[file_data_url(path) for path in IMAGES]
        )


def test_bf16_prompt_logprobs_within_the_dtype_tolerance(reference, served):
    served_ids = [entry[1] for entry in served]
    assert served_ids == reference["ids"]
    assert_within_the_bf16_spread(served, reference, "served")
