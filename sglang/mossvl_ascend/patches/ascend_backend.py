"""MOSS-VL batches in the Ascend attention backend go to the encoder-aware attention core.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.attention.sglang_layer import encoder_decoder_attention, graph_step_tables
from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch

ASCEND_BACKEND_MODULE = "sglang.srt.hardware_backend.npu.attention.ascend_backend"


def _takes_encoder_decoder_route(backend, forward_batch) -> bool:
    return forward_batch.encoder_lens is not None and not backend.use_mla and not backend.graph_mode


def _encoder_decoder_forward(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    """AROUND hook shared by forward_extend and forward_decode (the batch's mode picks the math)."""
    tables = graph_step_tables(backend, forward_batch) if forward_batch.encoder_lens is not None else None
    if tables is None and not _takes_encoder_decoder_route(backend, forward_batch):
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    return encoder_decoder_attention(
        backend.token_to_kv_pool,
        backend.req_to_token_pool,
        q,
        k,
        v,
        layer,
        forward_batch,
        save_kv_cache,
        swa_out_cache_loc=backend.forward_metadata.swa_out_cache_loc,
        graph_tables=tables,
    )


PATCHES = tuple(
    Patch(
        title=f"Ascend backend: MOSS-VL {mode} through the attention core",
        target=f"{ASCEND_BACKEND_MODULE}.AscendAttnBackend.forward_{mode}",
        kind=HookType.AROUND,
        hook=_encoder_decoder_forward,
        # Wherever the Ascend backend imports: on the NPU, and on CPU test hosts with a torch_npu stand-in.
        platforms=ON_NPU_AND_CPU,
        requires_module=ASCEND_BACKEND_MODULE,
        why=(
            "stock 0.5.23 calls `AscendTorchNativeAttnBackend.run_sdpa_forward_extend` without any cross-attention "
            "visibility, so MOSS-VL's frame-causal mask is dropped on the NPU; with `ASCEND_USE_FIA=1` or "
            "`ASCEND_USE_FA=1` stock takes fused branches that ignore `encoder_lens` (text queries would attend the "
            "encoder slots as if they were text)."
        ),
        how=(
            "a batch with `forward_batch.encoder_lens` on a non-MLA model in eager mode runs "
            "`attention.sglang_layer.encoder_decoder_attention`: KV write through the pool's `set_kv_buffer` "
            "(encoder slots for cross-attention layers, nothing when k/v are None), then the batched attention core "
            "with this forward's metadata (decode: every token sees all frames; a mixed batch (`--enable-mixed-chunk`) "
            "is an extend whose decode rows are one-row extends, instead of the fused `forward_mixed` that ignores "
            "the encoder). A decode step the NPU graph runner captures (`graph_mode`, with the step's tables from "
            "`patches.npu_graph`) runs `attention.decode_graph`: one paged fused call per layer. Other batches and "
            "MLA models go to the stock method."
        ),
        upstream="not upstream in 0.5.23",
        remove_when="`forward_extend` passes MOSS-VL's visibility and encoder batches cannot reach the FIA/FA branches",
    )
    for mode in ("extend", "decode", "mixed")
)
