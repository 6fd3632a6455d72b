"""The NPU graph runner hooks of ``patches.npu_graph`` against stand-ins of the stock objects they touch (the runner,
its graph backend, the Ascend attention backend, a decode batch): what each replay hands torch_npu's
``NPUGraph.update`` and what goes into the static decode inputs, with the expected values worked out by hand from the
rules in ``attention/decode_graph.py`` (not by the code under test). The hooks themselves run on an Ascend host only;
the math they feed is ``tests/test_decode_graphs.py``'s.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

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


def replay_through_the_hooks(runner, batch) -> list:
    """Stock's execute stand-in: it replays through the graph backend's update method, as every non-DSA model does."""
    handed = []

    def stock_replay_with_input_update(graph_backend, shape_key, seq_lens=None, attr_name=None, **kwargs):
        handed.append(kwargs.get("cpu_update_input", [{attr_name: seq_lens}]))

    def stock_execute(runner, forward_batch):
        npu_graph.update_every_record(
            stock_replay_with_input_update, runner.backend, "key", seq_lens=[0], attr_name="actual_seq_lengths_kv"
        )

    npu_graph.fill_from_the_real_batch(stock_execute, runner, batch)
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
    assert replay_through_the_hooks(runner, batch) == [[{"actual_seq_lengths_kv": [0]}]]
    assert not npu_graph.text_rows_in_the_graph(lambda r, fb: bool(torch.all(fb.encoder_lens > 0)), runner, batch)
