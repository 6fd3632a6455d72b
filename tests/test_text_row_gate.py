"""Visible-frame counts of rows past the prompt: chunks, mixed-batch decode rows, resumed requests (issue 10 item 4).

Real sglang ``ForwardBatch`` and ``MultimodalInputs``; the hooked method is MOSS-VL's stock
``get_full_text_row_masked_out_mask`` replaced through ``HookRegistry`` as the plugin does. Oracle: per-row lists
written out by hand from the HF rule (a row keeps its cross-attention residual iff it sees a frame; a token past
the prompt copies the last prompt row's visibility). The stock gate on the same batch is the control.
"""

import inspect

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from mossvl_ascend.attention.metadata import visible_frames_of_rows
from mossvl_ascend.patches import text_row_gate
from support.hooks import patches_applied

PROMPT_COUNTS = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])


def mm_input(counts):
    from sglang.srt.managers.schedule_batch import MultimodalInputs

    inputs = MultimodalInputs(mm_items=[])
    inputs.visible_frame_counts = counts
    return inputs


def mixed_batch():
    """A: prompt rows [1, 5) of a chunked prefill; B: a decode row at text offset 10 whose counts stock shrank to
    one element; C: a decode row of a text-only request; D: a resumed request's whole prompt plus 2 output rows."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    prefix, extend = [1, 10, 4, 0], [4, 1, 1, 10]
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.MIXED, batch_size=4, input_ids=torch.zeros(sum(extend), dtype=torch.long),
        req_pool_indices=torch.arange(4), seq_lens=torch.tensor(prefix) + torch.tensor(extend),
        out_cache_loc=torch.zeros(sum(extend), dtype=torch.long), seq_lens_sum=sum(prefix) + sum(extend),
    )  # fmt: skip
    forward_batch.encoder_lens = torch.tensor([12, 12, 0, 12])
    forward_batch.encoder_lens_cpu = [12, 12, 0, 12]
    forward_batch.extend_prefix_lens_cpu = prefix
    forward_batch.extend_seq_lens_cpu = extend
    forward_batch.extend_seq_lens = torch.tensor(extend)
    forward_batch.mm_inputs = [mm_input(PROMPT_COUNTS), mm_input(torch.tensor([3])), None, mm_input(PROMPT_COUNTS)]
    return forward_batch


EXPECTED_GATE = (
    [False, True, True, True] + [True] + [False] + [False, False, True, True, True, True, True, True, True, True]
)


def test_rows_past_the_prompt_see_the_last_prompt_row():
    assert visible_frames_of_rows(PROMPT_COUNTS, 6, 4).tolist() == [2, 2, 2, 2]
    assert visible_frames_of_rows(PROMPT_COUNTS, 1, 4).tolist() == [0, 1, 1, 1]
    assert visible_frames_of_rows(torch.tensor([3]), 10, 2).tolist() == [3, 3]


def test_gate_of_a_mixed_batch_with_chunk_decode_and_resumed_rows():
    from sglang.srt.models.moss_vl import MossVLForConditionalGeneration

    with patches_applied(*text_row_gate.PATCHES):
        forward_batch = mixed_batch()
        gate = MossVLForConditionalGeneration.get_full_text_row_masked_out_mask(None, forward_batch)
        assert gate.flatten().tolist() == EXPECTED_GATE
        # The per-row counts stay (a resumed prefill needs them).
        assert torch.equal(forward_batch.mm_inputs[3].visible_frame_counts, PROMPT_COUNTS)


def test_decode_gate_reads_the_last_prompt_row():
    from sglang.srt.models.moss_vl import MossVLForConditionalGeneration

    forward_batch = mixed_batch()
    forward_batch.forward_mode = ForwardMode.DECODE
    forward_batch.mm_inputs[0] = mm_input(torch.tensor([2, 0]))  # last prompt row sees no frame
    with patches_applied(*text_row_gate.PATCHES):
        gate = MossVLForConditionalGeneration.get_full_text_row_masked_out_mask(None, forward_batch)
    assert gate.flatten().tolist() == [False, True, False, True]


def test_stock_gate_fails_on_the_same_mixed_batch():
    from sglang.srt.models.moss_vl import MossVLForConditionalGeneration

    stock = inspect.unwrap(MossVLForConditionalGeneration.get_full_text_row_masked_out_mask)
    with pytest.raises(RuntimeError):
        stock(None, mixed_batch())
