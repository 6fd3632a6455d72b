"""The vision tower's attention on CPU: each frame (each ``cu_seqlens`` segment) attends within itself, computed per
segment instead of as one masked attention over every frame of the batch.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.patch_record import CPU, Patch


def segment_attention(backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Attention of ``[s, heads, head_size]`` q/k/v where the tokens of each segment (consecutive, ``lengths`` long)
    see only their own segment; -> ``[s, heads, head_size]``. Segments of one length (a video's frames, a stream's
    frames of one size) go through one batched call; no mask is built."""
    heads, kv_heads, size = backend.num_heads, backend.num_kv_heads, backend.head_size

    def attend(n: int, length: int, q_part, k_part, v_part):
        # [n * length, h, d] -> [n, h, length, d]
        shaped = [
            part.reshape(n, length, h, size).transpose(1, 2)
            for part, h in ((q_part, heads), (k_part, kv_heads), (v_part, kv_heads))
        ]
        out = F.scaled_dot_product_attention(*shaped, dropout_p=backend.dropout, is_causal=False, scale=backend.scale)
        return out.transpose(1, 2).reshape(n * length, heads, size)

    if len(set(lengths)) == 1:
        return attend(len(lengths), lengths[0], q, k, v)
    parts = zip(q.split(lengths), k.split(lengths), v.split(lengths))
    return torch.cat([attend(1, length, *part) for length, part in zip(lengths, parts)])


def per_segment_on_cpu(
    original: Callable,
    backend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bsz: int,
    cu_seqlens: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    **kwargs,
):
    """AROUND hook on ``VisionSdpaAttention.forward``: a flattened batch of segments (stock's block-diagonal mask) is
    attended per segment; any other call (not flattened, an explicit mask, single-precision softmax, no segments)
    goes to stock."""
    flattened_segments = backend.flatten_batch and bsz == 1 and cu_seqlens is not None
    if not flattened_segments or attention_mask is not None or backend.softmax_in_single_precision:
        return original(backend, q, k, v, bsz, cu_seqlens=cu_seqlens, attention_mask=attention_mask, **kwargs)
    lengths = cu_seqlens.diff().tolist()
    return segment_attention(backend, q, k, v, lengths)


PATCHES = (
    Patch(
        title="CPU vision tower: attention per frame, no mask over the whole batch of frames",
        target="sglang.srt.layers.attention.vision.VisionSdpaAttention.forward",
        kind=HookType.AROUND,
        hook=per_segment_on_cpu,
        platforms=frozenset({CPU}),
        why=(
            "On CPU the vision tower runs `VisionSdpaAttention`: every frame of a batch (MossVL's `cu_seqlens` has "
            "one segment per frame) goes into one SDPA over all of them with a dense `[1, s, s]` block-diagonal mask, "
            "so n frames cost n times the attention they need, and each distinct `cu_seqlens` tuple keeps its mask in "
            "an `lru_cache` of 128 (realtime batches of several sessions' frames keep making new ones: server memory "
            "that grows for as long as new combinations appear). A py-spy profile of 8 realtime sessions at 2 fps "
            "found that SDPA at 42% of the scheduler's time."
        ),
        how=(
            "when the call is a flattened batch (MossVL's `flatten_batch=True`, bsz 1) with `cu_seqlens`, no explicit "
            "mask and the default softmax, the segments are "
            "attended separately: equal lengths as one batched SDPA over `[segments, heads, length, head_size]`, "
            "unequal ones one call each; the mask is never built. On NPU the vision backend is `ascend_attn` (varlen "
            "by `cu_seqlens`) and CUDA runs stock, so neither is touched"
        ),
        upstream="open in sglang 0.5.23 (`layers/attention/vision.py`, `VisionSdpaAttention.forward`)",
        remove_when="stock's SDPA vision backend attends per `cu_seqlens` segment instead of building a dense mask",
    ),
)
