"""The NPU graph runner hooks of ``patches.npu_graph`` against stand-ins of the stock objects they touch (the runner,
its graph backend, the Ascend attention backend, a decode batch): what each replay hands torch_npu's
``NPUGraph.update`` and what goes into the static decode inputs, with the expected values worked out by hand from the
rules in ``attention/decode_graph.py`` (not by the code under test). The hooks themselves run on an Ascend host only;
the math they feed is ``tests/test_decode_graphs.py``'s.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.runner_backend_utils import CUDA_GRAPH_CAPTURE_FAILED_MSG

from mossvl_ascend import side_channel
from mossvl_ascend.attention.decode_step import DecodeBuffers
from mossvl_ascend.attention.kv_layout import EncoderAddressing
from mossvl_ascend.patches import npu_graph

PAGE = 128
SLOTS = 4096


class DecodeMode:
    def is_decode(self):
        return True


def decode_batch(vision: list[int], seq_lens: list[int]):
    return SimpleNamespace(
        batch_size=len(vision),
        encoder_lens=torch.tensor(vision),
        encoder_lens_cpu=list(vision),
        seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=torch.tensor(seq_lens),
        forward_mode=DecodeMode(),
        mm_inputs=[None] * len(vision),
    )


def runner_with_buffers():
    pool = SimpleNamespace()
    side_channel.ENCODER_ADDRESSING.set(pool, EncoderAddressing(bands=3, band_stride=SLOTS))
    attn_backend = SimpleNamespace(token_to_kv_pool=pool, page_size=PAGE)
    side_channel.DECODE_BUFFERS.set(attn_backend, DecodeBuffers(8, "cpu"))
    text = SimpleNamespace(cross_attention_layers=[1, 3], num_hidden_layers=4)
    model_runner = SimpleNamespace(
        attn_backend=attn_backend, model_config=SimpleNamespace(hf_config=SimpleNamespace(text_config=text))
    )
    return SimpleNamespace(capture_bs=[1, 2, 4, 8], model_runner=model_runner, backend=SimpleNamespace())


def hooked(method: str, original):
    """``original`` (a stand-in of the stock method ``method``) as the plugin's AROUND patch of it wraps it; the
    stand-in itself where no patch targets that method."""
    for patch in npu_graph.PATCHES:
        if patch.target.endswith(f".{method}"):
            return functools.partial(patch.hook, original)
    return original


def replay_through_the_hooks(runner, batch, stock_bucket: int | None = None) -> list:
    """Stock's execute stand-in: ``load_batch`` pads the batch to a bucket (``stock_bucket``, else the smallest
    captured one that holds it), then the replay goes through the graph backend's update method, as every non-DSA
    model's does. Returns what each replay handed ``NPUGraph.update``."""
    handed = []

    def stock_replay_with_input_update(graph_backend, shape_key, seq_lens=None, attr_name=None, **kwargs):
        handed.append(kwargs.get("cpu_update_input", [{attr_name: seq_lens}]))

    def stock_load_batch(runner, forward_batch):
        runner.raw_bs = forward_batch.batch_size
        runner.bs = stock_bucket or min(bs for bs in runner.capture_bs if bs >= forward_batch.batch_size)

    def stock_execute(runner, forward_batch):
        hooked("load_batch", stock_load_batch)(runner, forward_batch)
        seq_lens = forward_batch.seq_lens_cpu.tolist() + [0] * (runner.bs - runner.raw_bs)
        replay = hooked("replay_with_input_update", stock_replay_with_input_update)
        replay(runner.backend, "key", seq_lens=seq_lens, attr_name="actual_seq_lengths_kv")

    hooked("execute", stock_execute)(runner, batch)
    return handed


def test_a_replay_hands_update_one_dict_per_layer_with_its_own_kind_of_lengths():
    runner = runner_with_buffers()
    # image: E 300 -> 100 encoder slots (3 bands), text 60; text-only: E 0, text 40; E 130 -> 44 slots, text 300;
    # three rows replay in the bucket of 4: one padding row.
    handed = replay_through_the_hooks(runner, decode_batch([300, 0, 130], [60, 40, 300]))
    self_lengths = [100 + 60, 40, 44 + 300, 1]  # R % 128 + seq_len; a padding row decodes one token
    cross_lengths = [3 * 128, 1, 3 * 128, 1]  # 3 bands x ceil(R / 128) pages; no vision: one hidden key
    assert handed == [
        [
            {"actual_seq_lengths_kv": self_lengths},
            {"actual_seq_lengths_kv": cross_lengths},
            {"actual_seq_lengths_kv": self_lengths},
            {"actual_seq_lengths_kv": cross_lengths},
        ]
    ]
    table = side_channel.DECODE_BUFFERS.get(runner.model_runner.attn_backend).table
    # columns: vision, encoder rows, lower, slot-major, gate
    assert table[:, :4].tolist() == [[300, 0, 130, 0], [100, 0, 44, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0]]


def test_the_rows_fill_the_bucket_stock_chose():
    """Under DP attention stock pads every rank to the bucket of the largest rank's batch (``load_batch``:
    ``_pad_to_bucket(_max_dp_batch_size(...))``): one request here and three on another rank replay in the bucket of
    4, not the bucket of 1 this rank alone would take. Every column past the batch is a padding row (a previous
    step's rows are gone) and every recorded call gets a length per row of the bucket."""
    runner = runner_with_buffers()
    replay_through_the_hooks(runner, decode_batch([300, 0, 130], [60, 40, 300]))
    handed = replay_through_the_hooks(runner, decode_batch([130], [9]), stock_bucket=4)
    self_lengths, cross_lengths = [44 + 9, 1, 1, 1], [3 * 128, 1, 1, 1]
    assert handed == [[{"actual_seq_lengths_kv": lengths} for lengths in [self_lengths, cross_lengths] * 2]]
    table = side_channel.DECODE_BUFFERS.get(runner.model_runner.attn_backend).table
    assert table[:, :4].tolist() == [[130, 0, 0, 0], [44, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]


def test_a_capture_that_fails_on_the_card_says_which_bucket_and_the_way_out_in_one_line():
    """A kernel or CANN version we did not foresee fails inside stock's capture loop: the user gets one line naming
    the bucket, the error and ``--disable-cuda-graph``, through stock's own wrapper (which re-raises a RuntimeError
    with its multi-line advice)."""
    runner = runner_with_buffers()
    backend = runner.model_runner.attn_backend
    card_error = "EZ9999: Inner Error!\nThe tiling of aclnnFusedInferAttentionScoreV3 failed [op trace follows]"

    def stock_capture(runner):
        # the capture loop picks the bucket's view outside the recording, then the recorded forward fails
        hooked("init_forward_metadata_out_graph", lambda backend, batch, in_capture=False: None)(
            backend, decode_batch([0] * 4, [1] * 4), True
        )
        raise RuntimeError(card_error)

    def stock_runner_init(runner):
        try:
            hooked("capture", stock_capture)(runner)
        except RuntimeError as e:
            raise Exception(f"Capture cuda graph failed: {e}\n{CUDA_GRAPH_CAPTURE_FAILED_MSG}")

    with pytest.raises(Exception) as failed:
        stock_runner_init(runner)
    line = str(failed.value)
    assert "\n" not in line
    assert "batch size 4" in line and "RuntimeError: EZ9999: Inner Error!" in line and "--disable-cuda-graph" in line
    assert failed.value.__cause__ is not None and str(failed.value.__cause__) == card_error


def test_the_pending_update_is_gone_after_the_replay():
    runner = runner_with_buffers()
    replay_through_the_hooks(runner, decode_batch([300], [5]))
    handed = []
    npu_graph.update_every_record(
        lambda graph_backend, key, **kwargs: handed.append(kwargs), runner.backend, "key", seq_lens=[7]
    )
    assert handed == [{"seq_lens": [7]}]


def test_a_batch_with_a_text_only_request_can_replay_and_keeps_its_encoder_lengths():
    runner = runner_with_buffers()
    batch = decode_batch([300, 0], [60, 40])
    encoder_lens = batch.encoder_lens

    def stock_can_run_graph(runner, forward_batch):
        return bool(torch.all(forward_batch.encoder_lens > 0))

    assert not stock_can_run_graph(runner, batch)
    assert npu_graph.text_rows_in_the_graph(stock_can_run_graph, runner, batch)
    assert batch.encoder_lens is encoder_lens


def test_a_backend_without_decode_buffers_is_left_to_stock():
    runner = runner_with_buffers()
    side_channel.DECODE_BUFFERS.set(runner.model_runner.attn_backend, None)
    batch = decode_batch([300, 0], [60, 40])
    assert replay_through_the_hooks(runner, batch) == [[{"actual_seq_lengths_kv": [60, 40]}]]
    assert not npu_graph.text_rows_in_the_graph(lambda r, fb: bool(torch.all(fb.encoder_lens > 0)), runner, batch)
