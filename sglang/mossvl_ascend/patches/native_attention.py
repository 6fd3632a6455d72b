"""The stock native extend method as an edge of the MOSS-VL attention core.

On an Ascend NPU stock sglang sends every MossVL attention to ``AscendTorchNativeAttnBackend`` because
``forward_batch.encoder_lens`` is set. Our Ascend and CPU backend hooks call the attention core
(:mod:`mossvl_ascend.attention`) directly; this hook keeps the stock method correct for any other caller of it.

Layout the math relies on (``ScheduleBatch.prepare_encoder_info_extend``): a request's KV slots are
``req_to_token[req, :encoder_len]`` for the vision encoder tokens followed by its text tokens; ``seq_lens`` /
``extend_prefix_lens`` / ``extend_seq_lens`` count text tokens only.

Catalog entries: ``PATCHES`` and ``VERIFIED`` below (rendered into ``sglang/PATCHES.md``).
"""

from __future__ import annotations

import inspect

from sglang.srt.plugins.hook_registry import HookType

from mossvl_ascend.attention.core import AttentionLayer, attention
from mossvl_ascend.attention.metadata import ForwardAttentionMetadata
from mossvl_ascend.patch_record import ON_NPU_AND_CPU, Patch, Verified

NATIVE_BACKEND = "sglang.srt.hardware_backend.npu.attention.ascend_torch_native_backend.AscendTorchNativeAttnBackend"


def _route_encoder_batches_extend(original, backend, *args, cross_attention_custom_mask=None, **kwargs):
    """AROUND hook: encoder-decoder batches through the attention core, others stock.

    Arguments are bound against the stock signature, so callers pass them positionally or by keyword exactly as
    for the stock method; ``cross_attention_custom_mask`` (stock packed mask, 1 = visible) is the one added.
    """
    bound = inspect.signature(original).bind(backend, *args, **kwargs)
    bound.apply_defaults()
    params = bound.arguments
    if params["encoder_lens"] is None:
        if cross_attention_custom_mask is not None:
            raise ValueError("cross-attention visibility given for a batch without encoder_lens")
        return original(backend, *args, **kwargs)
    if params["logit_cap"] > 0 and params["logit_capping_method"] != "tanh":
        raise NotImplementedError(f"logit capping method {params['logit_capping_method']!r} (only tanh)")
    query = params["query"]
    extend_lens = params["extend_seq_lens"].tolist()
    prefix_lens = params["extend_prefix_lens"].tolist()
    for req_idx, (prefix_len, extend_len, seq_len) in enumerate(
        zip(prefix_lens, extend_lens, params["seq_lens"].tolist())
    ):
        if prefix_len + extend_len != seq_len:
            raise ValueError(
                f"request {req_idx}: extend_prefix_len {prefix_len} + extend_seq_len {extend_len} != seq_len {seq_len}"
            )
    metadata = ForwardAttentionMetadata.from_packed_mask(
        extend_lens,
        prefix_lens,
        params["encoder_lens"].tolist(),
        cross_attention_custom_mask if params["is_cross_attention"] else None,
        query.device,
    )
    scale = params["scaling"] if params["scaling"] is not None else query.shape[-1] ** -0.5
    layer = AttentionLayer(params["is_cross_attention"], scale, params["causal"], params["logit_cap"])
    # Stock applies no sliding window to encoder batches either.
    params["output"][:] = attention(
        query,
        params["k_cache"],
        params["v_cache"],
        params["req_to_token"],
        params["req_pool_indices"],
        metadata,
        layer,
        full_to_swa_mapping=params["full_to_swa_mapping"],
    )
    return params["output"]


PATCHES = (
    Patch(
        title="The stock native extend method as an edge of the attention core",
        target=f"{NATIVE_BACKEND}.run_sdpa_forward_extend",
        kind=HookType.AROUND,
        hook=_route_encoder_batches_extend,
        platforms=ON_NPU_AND_CPU,
        why=(
            "stock 0.5.23 (a) has no `cross_attention_custom_mask` parameter, so frame-causal visibility is never "
            "applied and every text token sees every frame; (b) pads cross-attention queries to the full text "
            "length, which is what made the source PR read mask rows with the wrong query length once a text prefix "
            "is cached; (c) reads self-attention keys over `[encoder_len, encoder_len + extend_len)` instead of "
            "`[encoder_len, encoder_len + seq_len)`, so with a cached text prefix (multi-turn, chunked prefill, "
            "retract) new tokens miss the prefix and the causal diagonal is misplaced. Our Ascend and CPU hooks call "
            "the attention core directly; this hook keeps the stock method correct for any other caller, with the "
            "interface the source PR's review thread defined."
        ),
        how=(
            "the hook adds the keyword `cross_attention_custom_mask=` (packed uint8, 1 = visible, per request "
            "`[extend_seq_len x encoder_len]` row-major, batch order, requests without encoder tokens or new tokens "
            "contribute nothing). Batches with `encoder_lens` go to `attention.core.attention`: the mask becomes "
            "per-row boundaries once (`ForwardAttentionMetadata.from_packed_mask`; a row that is not an encoder "
            "prefix, or a size that disagrees with the batch, raises ValueError naming the request), cross-attention "
            "is frame-causal blocks merged by log-sum-exp in fp32, self-attention reads `[encoder_len, encoder_len + "
            "seq_len)` with query i seeing keys `j <= prefix_len + i`; rows that see nothing give zeros. Every other "
            "batch goes to the stock method."
        ),
        upstream="not upstream in 0.5.23 (the source PR patched the file in its fork)",
        remove_when="`run_sdpa_forward_extend` accepts MOSS-VL visibility and reads the right windows",
    ),
)

VERIFIED = (
    Verified(
        title="Cross-attention mask built for non-flashinfer prefill backends",
        target="sglang.srt.models.moss_vl.MossVLForConditionalGeneration.prepare_forward_batch",
        why_it_was_patched="the source PR's fork returned early from the mask builder unless prefill was flashinfer.",
        status=(
            "already correct: 0.5.23 has no backend gate; the packed mask is built on every extend with vision "
            "input. Off CUDA the plugin replaces the builder anyway (`compact_visibility`); the stock builder still "
            "feeds the stock method's edge correctly."
        ),
        pinned_by=("tests/test_native_attention.py::test_stock_mask_builder_feeds_the_native_backend",),
    ),
    Verified(
        title="Decode cross-attention over cached encoder K/V",
        target=f"{NATIVE_BACKEND}.run_sdpa_forward_decode",
        why_it_was_patched="the source PR guarded decode with k = v = None (encoder K/V already cached).",
        status=(
            "already correct on CPU: cross-attention reads the cached encoder slots without a mask, self-attention "
            "`[encoder_len, encoder_len + seq_len)`. The plugin's routes nevertheless run decode through the "
            "attention core, so the NPU never depends on SDPA over zero keys."
        ),
        pinned_by=("tests/test_native_attention.py::test_stock_decode_already_reads_the_right_windows",),
    ),
)
