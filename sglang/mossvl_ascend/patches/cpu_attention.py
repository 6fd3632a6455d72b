"""CPU serving of MOSS-VL: torch_native attention runs the same attention core as the Ascend backend.

Catalog entry: ``PATCHES`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.attention.sglang_layer import encoder_decoder_attention
from mossvl_ascend.patch_record import CPU, Patch

TORCH_NATIVE_CLASS = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"


def _through_attention_core(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    """AROUND hook shared by forward_extend and forward_decode (the batch's mode picks the math)."""
    if forward_batch.encoder_lens is None:
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
        swa_out_cache_loc=backend.swa_out_cache_loc,
    )


PATCHES = tuple(
    Patch(
        title=f"CPU serving: MOSS-VL {mode} through the attention core",
        target=f"{TORCH_NATIVE_CLASS}.forward_{mode}",
        kind=HookType.AROUND,
        hook=_through_attention_core,
        platforms=frozenset({CPU}),
        why=(
            "CPU serving of MOSS-VL is a feature: engineers without an Ascend card run the model on `--device cpu` "
            "(which resolves to `torch_native`), and this project's end-to-end tests run the NPU attention code "
            "that way. Stock `TorchNativeAttnBackend` has the right windows but no cross-attention visibility at "
            "all (every text row would see every frame), and it is different code from what runs on the NPU."
        ),
        how=(
            "a batch with `forward_batch.encoder_lens` is handed to "
            "`attention.sglang_layer.encoder_decoder_attention`: "
            "the same KV write, metadata and batched core the Ascend backend hook runs; only the KV pool class and "
            "the device primitive differ. Every other batch goes to the stock method."
        ),
        upstream="not an upstream bug: stock has no MOSS-VL CPU path",
        remove_when="sglang's torch_native backend applies MOSS-VL's frame-causal visibility itself",
    )
    for mode in ("extend", "decode")
)
