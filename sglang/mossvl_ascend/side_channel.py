"""What the plugin attaches to stock sglang objects: one attribute each, named here and nowhere else.

The HTTP process, the scheduler and the forward pass hand values to each other on objects stock sglang already
passes along (a request's ``MultimodalInputs``, the ``ForwardBatch``, the KV pool). Each such value is one
:class:`Attached` below; every module reads and writes it through that record, so a name cannot be misspelt in
one place or written and never read. No torch, no sglang: every layer may import this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Attached(Generic[T]):
    """One value of ours carried on a stock object (``owner``: which stock object)."""

    name: str
    owner: str

    def get(self, obj: Any, default: T | None = None) -> T | None:
        """The value on ``obj`` (None-safe), else ``default``. Reads the instance's own attributes only, so a
        class attribute or a ``__getattr__`` (a test double) never passes for a value we set."""
        if obj is None:
            return default
        return getattr(obj, "__dict__", {}).get(self.name, default)

    def set(self, obj: Any, value: T) -> None:
        setattr(obj, self.name, value)


# A request's MultimodalInputs (``mm_inputs``):
# its vision tokens E, when its encoder row holds fewer slots (the MOSS-VL KV layout's ``ceil(E / bands)``) or a
# realtime step's encoder grew.
VISION_TOKENS: Attached[int] = Attached("mossvl_vision_tokens", "MultimodalInputs")
# a realtime step's encoder row length in slots (whole pages); its vision tokens are slot-major.
ENCODER_ROWS: Attached[int] = Attached("mossvl_encoder_rows", "MultimodalInputs")
# a realtime step's every frame's encoder end so far (int64 tensor, numbered from the first vision token still
# cached: a frame the window evicted ends at or below 0).
FRAME_ENDS: Attached[Any] = Attached("mossvl_frame_ends", "MultimodalInputs")
# a realtime step's new vision tokens (``realtime.sessions.NewVision``), when it has new frames: which tokens its
# first extend writes.
STEP_NEW_VISION: Attached[Any] = Attached("mossvl_step_new_vision", "MultimodalInputs")
# a windowed realtime step's first visible frame per text row (int32 tensor).
WINDOW_STARTS: Attached[Any] = Attached("mossvl_window_starts", "MultimodalInputs")

# sglang's ForwardBatch: the per-forward attention metadata (``attention.metadata.ForwardAttentionMetadata``),
# built once and read by every layer.
ATTENTION_METADATA: Attached[Any] = Attached("mossvl_attention_metadata", "ForwardBatch")

# An attention backend with decode graphs: its static decode inputs (``attention.decode_step.DecodeBuffers``,
# allocated once per graph state) and the view of them the current captured or replayed step reads.
DECODE_BUFFERS: Attached[Any] = Attached("mossvl_decode_buffers", "attention backend")
DECODE_VIEW: Attached[Any] = Attached("mossvl_decode_view", "attention backend")
# ... and, on the NPU, the step's block tables and masks, built inside the recording
# (``attention.decode_graph.StepTables``).
DECODE_TABLES: Attached[Any] = Attached("mossvl_decode_tables", "attention backend")
# stock's NPU graph backend: the per-record KV lengths of the replay about to run (``NPUGraph.update``'s input).
GRAPH_UPDATE: Attached[Any] = Attached("mossvl_graph_update", "NPU graph backend")

# A KV pool shaped by the MOSS-VL layout: how it addresses vision tokens (``attention.kv_layout.EncoderAddressing``)
# and the bytes of its storage layers (what the layout spends, for the start-up log and the tests).
ENCODER_ADDRESSING: Attached[Any] = Attached("mossvl_encoder_addressing", "KV pool")
STORAGE_BYTES: Attached[int] = Attached("mossvl_storage_bytes", "KV pool")
# ... its storage layers themselves (``(k_layers, v_layers)``: what the PD transfer moves, band by band), and for any
# MOSS-VL pool the layout's name (``attention.kv_layout.layout_name``: what the PD peers must agree on).
KV_STORAGE: Attached[Any] = Attached("mossvl_kv_storage", "KV pool")
KV_LAYOUT_NAME: Attached[str] = Attached("mossvl_kv_layout_name", "KV pool")


def encoder_len_of(req: Any) -> int:
    """Stock's own count of a request's encoder rows: the slots at the start of its KV row (``num_image_tokens``
    on its multimodal inputs; under the MOSS-VL KV layout ``ceil(E / bands)``), 0 if none. Read here because the
    radix and the chunked-prefill patches both need it."""
    mm_inputs = getattr(req, "multimodal_inputs", None)
    return (getattr(mm_inputs, "num_image_tokens", None) or 0) if mm_inputs else 0
