"""The vision tower's rotary cos/sin in the activations' dtype on Ascend NPUs.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

from typing import Callable

import torch
from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.patch_record import NPU, Patch


def rotary_in_activation_dtype(
    original: Callable, block, x: torch.Tensor, cu_seqlens, position_embeddings, *args, **kwargs
):
    """AROUND hook on ``MossVLVisionBlock.forward``: cos/sin cast to the block input's dtype before attention."""
    position_embeddings = tuple(table.to(x.dtype) for table in position_embeddings)
    return original(block, x, cu_seqlens, position_embeddings, *args, **kwargs)


PATCHES = (
    Patch(
        title="The NPU vision rotary gets cos/sin in the activations' dtype",
        target="sglang.srt.models.moss_vl.MossVLVisionBlock.forward",
        kind=HookType.AROUND,
        hook=rotary_in_activation_dtype,
        platforms=frozenset({NPU}),
        why=(
            "`MossVLVisionModel.forward` builds the rotary table from an fp32 `inv_freq` and hands fp32 cos/sin to "
            "every block; on an NPU `VisionAttention` rotates bf16/fp16 q/k with `apply_rotary_pos_emb_npu`, i.e. "
            "`torch_npu.npu_rotary_mul(q, cos, sin)`, whose kernel (aclnnRotaryPositionEmbedding) takes cos/sin of "
            "x's dtype only. Qwen2.5-VL casts them to the activations' dtype right after building them; MossVL does "
            "not. Found by the stand-in (`tests/test_npu_route_layers.py`); not run on hardware."
        ),
        how=(
            "cast the (cos, sin) pair to the block input's dtype on the way into each vision block; on CPU and CUDA "
            "nothing is applied (their rotary computes in fp32 from any dtype)"
        ),
        upstream="open in sglang 0.5.23 (`models/moss_vl.py`, `MossVLVisionModel.forward`)",
        remove_when="`MossVLVisionModel.forward` casts position_embeddings to the input dtype, as qwen2_5_vl.py does",
    ),
)
