"""MOSS-VL's text-row gate for chunks, mixed batches and resumed requests.

The gate turns a text row's cross-attention residual on or off (on iff the row sees at least one frame).

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import torch
from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.attention.metadata import decode_row_gate, visible_frame_counts_of, visible_frames_of_rows
from mossvl_ascend.attention.sglang_layer import captured_decode_view
from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch


def text_row_gate(model, forward_batch) -> torch.Tensor:
    """Bool ``[rows, 1]``: True where a row's cross-attention residual is kept (it sees at least one frame)."""
    if forward_batch.forward_mode.is_decode():
        view = captured_decode_view(forward_batch)
        if view is not None:
            return view.row_gate
        return torch.tensor(decode_row_gate(forward_batch), device=forward_batch.seq_lens.device).reshape(-1, 1)
    parts = []
    for i in range(forward_batch.batch_size):
        q_len = forward_batch.extend_seq_lens_cpu[i]
        counts = visible_frame_counts_of(forward_batch, i)
        if forward_batch.encoder_lens_cpu[i] == 0:
            parts.append(torch.zeros(q_len, dtype=torch.bool))
        elif counts is None:
            parts.append(torch.ones(q_len, dtype=torch.bool))
        else:
            parts.append(visible_frames_of_rows(counts, forward_batch.extend_prefix_lens_cpu[i], q_len).cpu() > 0)
    return torch.cat(parts).to(forward_batch.seq_lens.device).reshape(-1, 1)


PATCHES = (
    Patch(
        title="Text-row gate for chunks, mixed batches and resumed requests",
        target="sglang.srt.models.moss_vl.MossVLForConditionalGeneration.get_full_text_row_masked_out_mask",
        kind=HookType.REPLACE,
        hook=text_row_gate,
        platforms=ON_NPU_AND_CPU,
        why=(
            "stock reads each extend row's visible-frame count as `visible_frame_counts[prefix : prefix + rows]` "
            "and, at the end of a request's last prefill chunk, shrinks `visible_frame_counts` to its last element. "
            "Two lifecycle paths then break: the decode rows of a mixed batch (`--enable-mixed-chunk`) are extend "
            "rows at a text offset past the prompt, and a retracted request prefilled again reads its whole prompt "
            "from the shrunk one-element tensor; both slices come out empty (a tensor-size error), and a resumed "
            "request would lose the per-row visibility of its prompt even if it did not fail."
        ),
        how=(
            "the same gate (a row keeps its cross-attention residual iff it sees at least one frame; a request "
            "without visibility data sees every frame; rows of a request without encoder tokens are gated off; "
            "decode rows see the last prompt row's count), with rows read through "
            "`attention.metadata.visible_frames_of_rows` (rows past the prompt see its last entry) and without the "
            "shrink: the per-row counts stay with the request until it finishes, so a resumed prefill recomputes "
            "exactly the rows of the first one."
        ),
        upstream="open in 0.5.23",
        remove_when="stock's gate handles rows past the prompt (mixed chunks) and keeps the counts a re-prefill needs",
    ),
)
