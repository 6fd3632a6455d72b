"""The KV-layout benchmark's capacity figures equal a hand computation, and ``--quick`` prints them without a server.

Oracle: MOSS-VL-Instruct's published shape (``mossvl_upstream_facts.md`` §1: 48 layers, cross-attention every fourth
layer from 2, 8 KV heads of 128) and the KV arithmetic of ``ascend_perf_anchors.md`` §5.4 (bf16; a 256-frame video
at the default pixel budget: 39.5 GB stock, 10.3 GB exact, 1 vs 3 requests in 40 GB), written out by hand below.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.bench_kv_layout import (
    IMAGE_QUESTION,
    REPO_ROOT,
    VIDEO_256_448,
    VIDEO_256_DEFAULT,
    bound,
    budgets,
    decode_steps,
)
from moss_vl_reference.configuration_moss_vl import MossVLTextConfig

BUDGET_GB = 40.0
# bf16 K and V of 8 heads x 128 in each of 48 layers.
STOCK_TOKEN_BYTES = 48 * 2 * 8 * 128 * 2
STOCK_TOKENS = 40_000_000_000 // STOCK_TOKEN_BYTES
# A slot stores 3 bands x 12 layers = 36 layers; whole pages of 128.
SLOTS = STOCK_TOKENS * 48 // 36 // 128 * 128


def instruct():
    return next(b for b in budgets(max_total_tokens=1024, instruct_budget_gb=BUDGET_GB) if b.name == "MOSS-VL-Instruct")


def test_the_default_text_config_is_instructs():
    config = MossVLTextConfig()
    assert config.num_hidden_layers == 48
    assert config.cross_attention_layers == list(range(2, 48, 4))
    assert (config.num_key_value_heads, config.head_dim) == (8, 128)


def test_instruct_capacity_equals_the_hand_computation():
    row = instruct().capacity_row()
    assert STOCK_TOKEN_BYTES == 196_608  # 192 KiB, the figure
    assert (row["stock_token_bytes"], row["stock_tokens"], row["slots"]) == (STOCK_TOKEN_BYTES, 203_450, 271_232)
    assert (row["stock_tokens"], row["slots"]) == (STOCK_TOKENS, SLOTS)
    assert (row["text_stock"], row["text_ours"]) == (203_450, 271_232)
    assert (row["vision_stock"], row["vision_ours"]) == (203_450, 3 * 271_232)
    assert (row["L"], row["cross"], row["self"], row["bands"]) == (48, 12, 36, 3)


@pytest.mark.parametrize(
    ("request_kv", "hand_bound"),
    [
        # (196,864 + 4,048) * 48 / (196,864 * 12 + 4,048 * 36)
        (VIDEO_256_DEFAULT, 9_643_776 / 2_508_096),
        # (50,432 + 4,048) * 48 / (50,432 * 12 + 4,048 * 36): the "3.5x"
        (VIDEO_256_448, 2_615_040 / 750_912),
        # (197 + 2,000) * 48 / (197 * 12 + 2,000 * 36): the "1.42x"
        (IMAGE_QUESTION, 105_456 / 74_364),
    ],
    ids=["video-default-pixels", "video-448", "image"],
)
def test_the_bounds_equal_the_hand_computation(request_kv, hand_bound):
    assert bound(MossVLTextConfig(), request_kv) == pytest.approx(hand_bound, rel=1e-12)


def test_instruct_requests_in_40_gb_match_the_anchors():
    rows = {row["E"]: row for row in map(instruct().request_row, (VIDEO_256_DEFAULT, VIDEO_256_448, IMAGE_QUESTION))}
    video, image = rows[196_864], rows[197]
    # 200,912 tokens x 192 KiB; 65,622 slots (ceil(196,864 / 3)) + 4,048 text, 144 KiB each
    assert video["stock_gb"] == pytest.approx(200_912 * 196_608 / 1e9) == pytest.approx(39.50, abs=0.005)
    assert video["ours_gb"] == pytest.approx((65_622 + 4_048) * 147_456 / 1e9) == pytest.approx(10.27, abs=0.005)
    assert (video["stock_requests"], video["ours_requests"]) == (1, 3)
    # 203,450 // 2,197 and 271,232 // (66 + 2,000): the anchors' ~93 and ~130
    assert (image["stock_requests"], image["ours_requests"]) == (92, 131)


def test_decode_steps_are_read_from_sglangs_decode_lines():
    log = (
        "[2026-12-02 00:38:08] Prefill batch, #new-seq: 1, #new-token: 27, #cached-token: 0, token usage: 0.00, "
        "#running-req: 0, #queue-req: 3, #pending-token: 0, cpu graph: False, input throughput (token/s): 10.36\n"
        "[2026-12-02 00:38:09] Decode batch, #running-req: 13, #token: 8099, token usage: 0.95, cpu graph: False, "
        "gen throughput (token/s): 88.10, #queue-req: 2\n"
        "[2026-12-02 00:38:09] Decode batch, #running-req: 12, #token: 7480, token usage: 0.87, cpu graph: False, "
        "gen throughput (token/s): 80.00, #queue-req: 0\n"
    )
    assert decode_steps(log) == [(13, 2), (12, 0)]


def test_quick_prints_the_capacity_tables_and_no_result():
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_kv_layout", "--quick"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    lines = completed.stdout.strip().splitlines()
    assert "RESULT" not in completed.stdout
    assert any(line.startswith("| MOSS-VL-Instruct | 48 | 12 / 36 | 3 |") for line in lines)
    assert any(line.startswith("| bench | 10 | 2 / 8 | 4 |") for line in lines)
    assert lines[-1].startswith("| (b) one 448x448 image") and lines[-1].endswith("| 92 | 131 | 1.42 | 1.42 |")
