"""STAND-IN for ``torch_npu`` (and the import-only part of ``sgl_kernel_npu``) in CPU tests.

Importing ``sglang.srt.hardware_backend.npu.attention.ascend_backend`` needs ``torch_npu`` and
``sgl_kernel_npu.attention.sinks_attention``. This stand-in lets that real sglang module import
on a CPU machine and implements, as pure-torch reference code, only the ops the MOSS-VL paths
reach: the paged KV-cache write ``torch_npu._npu_reshape_and_cache`` used by
``NPUMHATokenToKVPool.set_kv_buffer``, and ``torch_npu.npu_fused_infer_attention_score`` in the
subset the attention core calls (documented semantics as read from the torch_npu API reference;
see :func:`_npu_fused_infer_attention_score`), plus the ops the ``forward_npu`` branches of stock
layers on the MOSS-VL route call (norms, swiglu, the vision rotary, the vision tower's TND attention,
the ascend sampler's top-k/top-p filter: the block after the attention op). Every other ``torch_npu`` attribute raises
NotImplementedError naming itself, so a test that strays onto a fused NPU kernel fails loudly
instead of computing something plausible. No ``torch.npu`` namespace is installed: sglang's
``is_npu()`` must keep answering False on this machine.

Use :func:`installed_fake_torch_npu` (a context manager) so the stand-in lives in
``sys.modules`` only for a test's duration.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import sys
import types

import torch

# sglang modules whose import binds the stand-in; dropped again on exit so later tests (and
# other test files) never see a module that captured the fake.
_MODULES_BOUND_TO_FAKE = ("sglang.srt.hardware_backend.npu.attention.ascend_backend",)


# Dtypes the ops take on Atlas A2/A3 (910B) without quantisation arguments: FIA's query is float16 or bfloat16 only
# (torch_npu FIA page, parameter "query"); ATB ReshapeAndCache takes float16, bfloat16 or int8, one dtype for all
# four tensors (ATB ReshapeAndCacheOperation page, input table).
_FIA_DTYPES = (torch.float16, torch.bfloat16)
_RESHAPE_AND_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.int8)
# The "optimised" causal mask that sparse_mode 2/3/4 take (FIA page, sparse_mode; Q_S > 1 constraints): S = 2048.
COMPRESSED_MASK_SIZE = 2048
_INT_MAX = 2147483647


class RefusedByNpu(RuntimeError):
    """What the real op raises for an input its documentation rules out (the message names the rule)."""


def _npu_reshape_and_cache(*, key, value, key_cache, value_cache, slot_indices, dtypes=_RESHAPE_AND_CACHE_DTYPES):
    """STAND-IN for ``torch_npu._npu_reshape_and_cache``, written from the CANN ATB API reference,
    "ReshapeAndCacheOperation" (8.0.RC2.2): token t is written to row ``slot % block_size`` of block
    ``slot // block_size``.

    key/value ``[num_tokens, num_heads, head_dim]``; key/value_cache ``[num_blocks, block_size, num_heads,
    head_dim]``; slot_indices int32 ``[num_tokens]`` (slotMapping). Refuses (RefusedByNpu) a dtype outside
    float16 / bfloat16 / int8 (no float32) or the four tensors not sharing one, slots that are not int32 or not
    one per token, head shapes that differ from the cache's, and a slot outside the cache. ``dtypes`` widens the
    accepted set for a caller that asks for it (:func:`installed_fake_torch_npu`).
    """
    tensors = {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache}
    for name, tensor in tensors.items():
        if tensor.dtype not in dtypes:
            raise RefusedByNpu(f"ReshapeAndCache: {name} is {tensor.dtype}; it takes {dtypes}")
    if len({tensor.dtype for tensor in tensors.values()}) != 1:
        raise RefusedByNpu(
            f"ReshapeAndCache: one dtype for all four tensors, got {[t.dtype for t in tensors.values()]}"
        )
    if slot_indices.dtype != torch.int32 or slot_indices.shape != (key.shape[0],):
        raise RefusedByNpu(
            f"ReshapeAndCache: slotMapping must be int32 [num_tokens], got {slot_indices.dtype} "
            f"{tuple(slot_indices.shape)} for {key.shape[0]} tokens"
        )
    for name, tensor, cache in (("key", key, key_cache), ("value", value, value_cache)):
        if tensor.dim() != 3 or cache.dim() != 4 or tensor.shape[1:] != cache.shape[2:]:
            raise RefusedByNpu(f"ReshapeAndCache: {name} {tuple(tensor.shape)} does not fit cache {tuple(cache.shape)}")
    slots = slot_indices.long()
    capacity = key_cache.shape[0] * key_cache.shape[1]
    if slots.numel() and not bool(((slots >= 0) & (slots < capacity)).all()):
        raise RefusedByNpu(f"ReshapeAndCache: a slot outside the cache's {capacity} slots")
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value


def _npu_fused_infer_attention_score(
    query,
    key,
    value,
    *,
    atten_mask=None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    block_table=None,
    block_size=0,
    num_heads=1,
    num_key_value_heads=0,
    scale=1.0,
    pre_tokens=_INT_MAX,
    next_tokens=_INT_MAX,
    input_layout="BSH",
    sparse_mode=0,
    inner_precise=0,
    softmax_lse_flag=False,
    **unsupported,
):
    """STAND-IN for ``torch_npu.npu_fused_infer_attention_score`` (FIA), written from the torch_npu API reference
    page of that name (Ascend/op-plugin ``docs/context/torch_npu-npu_fused_infer_attention_score.md``: sections
    参数说明 (parameters), 输出说明 (outputs), 约束说明 (constraints: "当Q_S大于1时" / "当Q_S等于1时", page attention).
    Pure torch, fp32 math, output in the query's dtype. Subset: ``input_layout="BNSD"``; other keywords raise
    NotImplementedError naming them.

    - query ``[B, N, Q_S, D]``, key/value ``[B, KV_N, KV_S, D]`` (identical shapes), float16 / bfloat16 only, all
      one dtype, contiguous; ``num_heads`` = N; ``num_key_value_heads`` (0 = N) divides N with N / KV_N <= 64;
      N <= 256, D <= 512, and D 16-aligned when Q_S > 1.
    - paged (``block_table`` int32 ``[B, >= maxBlockNumPerSeq]``, non-empty, with ``block_size`` and the required
      ``actual_seq_lengths_kv``): key/value are the cache ``[num_blocks, block_size, KV_N * D]``; batch b's key
      position j is row ``j % block_size`` of block ``block_table[b, j // block_size]``. block_size: Q_S = 1 a
      non-zero multiple of 16 up to 512; Q_S > 1 a multiple of 128 in [128, 512]. KV_S = table width x block_size.
    - ``actual_seq_lengths`` (per batch query rows; ignored when Q_S = 1) and ``actual_seq_lengths_kv`` (per batch
      keys): one value for every batch, or the first B of a longer list; each <= the padded S. Rows past a batch's
      query length are padding: the stand-in returns NaN there, a value callers must not use.
    - ``atten_mask`` bool/int8/uint8 (int values 0/1), contiguous, **1/True = masked out**. Q_S = 1: ``(B, KV_S)``,
      ``(B, 1, KV_S)`` or ``(B, 1, 1, KV_S)``, sparse_mode ignored. Q_S > 1 by ``sparse_mode``: 0 = the full mask
      ``(Q_S, KV_S)``, ``(B|1, Q_S, KV_S)`` or ``(B|1, 1, Q_S, KV_S)`` (or none), keeping keys j with
      ``i - pre_tokens <= j <= i + next_tokens``; 1 = the full mask (required), pre/next_tokens ignored; 2
      (leftUpCausal, j <= i) and 3 (rightDownCausal, j <= i + KV_len - Q_len per batch) take the compressed
      2048 x 2048 mask (True above the diagonal), pre/next_tokens ignored; 4 (band) is not modelled.
    - returns ``(attention_out [B, N, Q_S, D], softmax_lse)``: the LSE is fp32 ``[B, N, Q_S, 1]``, natural log of the
      sum of exp of the scaled, masked logits, when ``softmax_lse_flag``, else the documented ``[1]`` zero tensor.
      Empty keys (KV_S = 0) give a zero output (documented); a row with no attended key is not specified by the
      documentation: NaN output and LSE here.
    """
    if unsupported:
        raise NotImplementedError(f"stand-in npu_fused_infer_attention_score: unsupported {sorted(unsupported)}")
    if input_layout != "BNSD":
        raise NotImplementedError(f"stand-in npu_fused_infer_attention_score: layout {input_layout}")
    if inner_precise not in (0, 1, 2, 3):
        raise RefusedByNpu(f"FIA: inner_precise {inner_precise} (0-3)")
    _refuse_fia_tensors(query, key, value, atten_mask)
    batch, heads, rows, dim = query.shape
    kv_heads = num_key_value_heads or num_heads
    _refuse_fia_heads(heads, num_heads, kv_heads, rows, dim)
    if block_table is None:
        if key.shape != value.shape or key.dim() != 4 or key.shape[0] != batch or key.shape[3] != dim:
            raise RefusedByNpu(f"FIA: key {tuple(key.shape)} and value {tuple(value.shape)} must be identical BNSD")
        if key.shape[1] != kv_heads:
            raise RefusedByNpu(f"FIA: num_key_value_heads {kv_heads} but key has {key.shape[1]} heads")
    else:
        key, value = _paged_keys(key, value, block_table, block_size, actual_seq_lengths_kv, batch, rows, kv_heads, dim)
    keys = key.shape[2]
    query_lens = _per_batch(actual_seq_lengths if rows > 1 else None, batch, rows, "actual_seq_lengths")
    key_lens = _per_batch(actual_seq_lengths_kv, batch, keys, "actual_seq_lengths_kv")
    attended = _attended(atten_mask, sparse_mode, pre_tokens, next_tokens, batch, rows, keys, query_lens, key_lens)
    group = heads // kv_heads
    logits = torch.einsum("bnsd,bnkd->bnsk", query.float(), key.float().repeat_interleave(group, 1)) * scale
    logits = logits.masked_fill(~attended, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    probs = torch.exp(logits - lse)
    out = torch.einsum("bnsk,bnkd->bnsd", probs, value.float().repeat_interleave(group, 1))
    unspecified = ~attended.any(dim=-1, keepdim=True)  # rows that see no key, padding rows included
    if keys == 0:
        out = torch.zeros_like(out)
    out = out.masked_fill(unspecified & (keys > 0), float("nan")).to(query.dtype)
    lse = lse.masked_fill(unspecified, float("nan"))
    return out, (lse if softmax_lse_flag else torch.zeros(1))


def _refuse_fia_tensors(query, key, value, atten_mask):
    """Dtypes and contiguity (FIA page, parameters query / key / value / atten_mask)."""
    if query.dtype not in _FIA_DTYPES:
        raise RefusedByNpu(f"FIA: query is {query.dtype}; Atlas A2/A3 take float16 or bfloat16")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise RefusedByNpu(
            f"FIA: key {key.dtype} / value {value.dtype} differ from query {query.dtype} (no quant args)"
        )
    tensors = {"query": query, "key": key, "value": value, "atten_mask": atten_mask}
    for name, tensor in tensors.items():
        if tensor is not None and not tensor.is_contiguous():
            raise RefusedByNpu(f"FIA: {name} is non-contiguous (non-contiguous tensors not supported)")
    if atten_mask is not None:
        if atten_mask.dtype not in (torch.bool, torch.int8, torch.uint8):
            raise RefusedByNpu(f"FIA: atten_mask is {atten_mask.dtype}; it takes bool, int8 or uint8")
        if atten_mask.dtype != torch.bool and not bool(((atten_mask == 0) | (atten_mask == 1)).all()):
            raise RefusedByNpu("FIA: int8/uint8 atten_mask values must be 0 or 1")


def _refuse_fia_heads(heads, num_heads, kv_heads, rows, dim):
    """num_heads / num_key_value_heads and the N, D limits (FIA page, parameters and the Q_S constraints)."""
    if heads != num_heads:
        raise RefusedByNpu(f"FIA: num_heads {num_heads} but query has {heads} heads (BNSD)")
    if heads % kv_heads or heads // kv_heads > 64:
        raise RefusedByNpu(f"FIA: num_heads {heads} / num_key_value_heads {kv_heads}: must divide, ratio <= 64")
    if heads > 256 or dim > 512:
        raise RefusedByNpu(f"FIA: N {heads} (<= 256), D {dim} (<= 512)")
    if rows > 1 and dim % 16:
        raise RefusedByNpu(f"FIA: Q_S > 1 with float16/bfloat16 needs D 16-aligned, got {dim}")


def _paged_keys(k_cache, v_cache, block_table, block_size, kv_lengths, batch, rows, kv_heads, dim):
    """Key/value ``[B, KV_N, KV_S, D]`` read through the block table (FIA page, page attention constraints)."""
    if kv_lengths is None:
        raise RefusedByNpu("FIA: page attention requires actual_seq_lengths_kv")
    if rows == 1 and not (0 < block_size <= 512 and block_size % 16 == 0):
        raise RefusedByNpu(
            f"FIA: Q_S = 1 page attention, float16/bfloat16: block_size 16-aligned, <= 512, got {block_size}"
        )
    if rows > 1 and not (128 <= block_size <= 512 and block_size % 128 == 0):
        raise RefusedByNpu(f"FIA: Q_S > 1 page attention: block_size a multiple of 128 in [128, 512], got {block_size}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != batch:
        raise RefusedByNpu(
            f"FIA: block_table must be int32 [B, blocks], got {block_table.dtype} {tuple(block_table.shape)}"
        )
    lengths = _per_batch(kv_lengths, batch, _INT_MAX, "actual_seq_lengths_kv")  # bounded by the table below
    blocks_needed = [-(-length // block_size) for length in lengths]
    if block_table.shape[1] == 0 or block_table.shape[1] < max(blocks_needed):
        raise RefusedByNpu(f"FIA: block_table width {block_table.shape[1]} (non-empty, >= {max(blocks_needed)} blocks)")
    if k_cache.dim() != 3:
        raise NotImplementedError("stand-in FIA: only the (blocknum, blocksize, H) cache layout is modelled")
    if k_cache.shape != v_cache.shape or k_cache.shape[1:] != (block_size, kv_heads * dim):
        raise RefusedByNpu(
            f"FIA: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must both be "
            f"(blocknum, {block_size}, {kv_heads * dim})"
        )
    if kv_heads * dim > 65535 or k_cache.numel() > _INT_MAX:
        raise RefusedByNpu("FIA: KV_N * D <= 65535 and each cache's numel within int32")
    if k_cache.shape[0] < sum(blocks_needed):
        raise RefusedByNpu(f"FIA: blocknum {k_cache.shape[0]} < the {sum(blocks_needed)} blocks the lengths need")
    positions = torch.arange(block_table.shape[1] * block_size)
    blocks = block_table.long()[:, positions // block_size]  # [B, KV_S]
    key = k_cache[blocks, positions % block_size].view(batch, -1, kv_heads, dim).transpose(1, 2)
    value = v_cache[blocks, positions % block_size].view(batch, -1, kv_heads, dim).transpose(1, 2)
    return key, value


def _per_batch(lengths, batch, padded, name):
    """Per batch lengths: None = the padded S, one value for all, or the first B of a longer list."""
    if lengths is None:
        return [padded] * batch
    lengths = [int(length) for length in lengths]
    if len(lengths) == 1:
        lengths = lengths * batch
    if len(lengths) < batch or any(not 0 <= length <= padded for length in lengths[:batch]):
        raise RefusedByNpu(f"FIA: {name} {lengths} for batch {batch}, each in [0, {padded}]")
    return lengths[:batch]


def _attended(mask, sparse_mode, pre_tokens, next_tokens, batch, rows, keys, query_lens, key_lens):
    """Bool ``[B, 1, Q_S, KV_S]``, True where the op computes the (row, key) pair."""
    row = torch.arange(rows).view(1, 1, rows, 1)
    col = torch.arange(keys).view(1, 1, 1, keys)
    q_len = torch.tensor(query_lens).view(batch, 1, 1, 1)
    kv_len = torch.tensor(key_lens).view(batch, 1, 1, 1)
    attended = (row < q_len) & (col < kv_len)
    if rows == 1:  # IncreFlashAttention: sparse_mode and pre/next_tokens have no effect
        shapes = [(batch, keys), (batch, 1, keys), (batch, 1, 1, keys)]
        return attended & _kept_by(mask, shapes, batch, rows, keys)
    if sparse_mode not in (0, 1, 2, 3, 4):
        raise RefusedByNpu(f"FIA: Q_S > 1 supports sparse_mode 0-4, got {sparse_mode}")
    if sparse_mode == 4:
        raise NotImplementedError("stand-in FIA: sparse_mode 4 (band) is not modelled")
    if sparse_mode in (2, 3):
        _refuse_unless_compressed_causal(mask, sparse_mode)
        limit = row if sparse_mode == 2 else row + kv_len - q_len
        return attended & (col <= limit)
    if sparse_mode == 1 and mask is None:
        raise RefusedByNpu("FIA: sparse_mode 1 (allMask) requires the full atten_mask")
    full = [(rows, keys), (batch, rows, keys), (1, rows, keys), (batch, 1, rows, keys), (1, 1, rows, keys)]
    attended = attended & _kept_by(mask, full, batch, rows, keys)
    if sparse_mode == 0 and mask is not None:
        attended = attended & (col >= row - pre_tokens) & (col <= row + next_tokens)
    return attended


def _kept_by(mask, shapes, batch, rows, keys):
    """The pairs a user mask keeps (False = keep, 1/True = masked out), broadcast to ``[B|1, 1, Q_S, KV_S]``."""
    if mask is None:
        return torch.ones(1, 1, 1, 1, dtype=torch.bool)
    if tuple(mask.shape) not in {tuple(shape) for shape in shapes}:
        raise RefusedByNpu(f"FIA: atten_mask shape {tuple(mask.shape)} is not one of {shapes}")
    leading = mask.shape[0] if mask.dim() > 2 or rows == 1 else 1
    return (mask == 0).reshape(leading, 1, rows, keys)


def _refuse_unless_compressed_causal(mask, sparse_mode):
    """sparse_mode 2/3 take the optimised 2048 x 2048 mask (shape (S, S), (1, S, S) or (1, 1, S, S)), which the
    caller must make lower-triangular: True (masked out) exactly above the diagonal."""
    size = COMPRESSED_MASK_SIZE
    if mask is None or tuple(mask.shape) not in {(size, size), (1, size, size), (1, 1, size, size)}:
        shape = None if mask is None else tuple(mask.shape)
        raise RefusedByNpu(f"FIA: sparse_mode {sparse_mode} needs the compressed {size} x {size} mask, got {shape}")
    expected = torch.ones(size, size, dtype=torch.bool).triu_(1)
    if not torch.equal(mask.reshape(size, size) != 0, expected):
        raise RefusedByNpu(f"FIA: sparse_mode {sparse_mode} mask must be True exactly above the diagonal")


# ---- STAND-INs for the torch_npu ops that stock sglang's forward_npu branches call on the MOSS-VL route (norms,
# activation, vision rotary, vision attention, sampler). Each is written from the torch_npu API reference page its
# docstring cites, computes in fp32 (fp64 for an fp64 oracle is the tests' job) and refuses what the page excludes.

_NPU_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_NPU_HALVES = (torch.float16, torch.bfloat16)


def _require(condition: bool, op: str, what: str):
    if not condition:
        raise ValueError(f"stand-in torch_npu.{op}: {what}")


def _rms_normalized(x: torch.Tensor, gamma: torch.Tensor, epsilon: float):
    """(x / Rms(x) * gamma in x's dtype, 1 / Rms(x) fp32 keepdim) with Rms over the last dim, in fp32."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return (x32 * rstd * gamma.float()).to(x.dtype), rstd


def _npu_rms_norm(x, gamma, epsilon=1e-6):
    """STAND-IN ``torch_npu.npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd)``.

    Source: Ascend/op-plugin ``docs/context/（beta）torch_npu-npu_rms_norm.md`` (参数说明, 返回值说明, 约束说明):
    self fp16/bf16/fp32 with 2-8 dims; gamma the same dtype, normally self's last dim;
    y = x / Rms(x) * g with Rms(x) = sqrt(mean(x^2) + eps); the second output is 1 / Rms(x) (fp32: the RmsNorm
    registration on hiascend's ``PT_LMTMOG_000112`` page declares rstd DT_FLOAT for every input dtype).
    """
    _require(x.dtype in _NPU_FLOATS, "npu_rms_norm", f"self dtype {x.dtype}")
    _require(2 <= x.dim() <= 8, "npu_rms_norm", f"self has {x.dim()} dims, the op takes 2-8")
    _require(gamma.dtype == x.dtype, "npu_rms_norm", f"gamma dtype {gamma.dtype} differs from self {x.dtype}")
    _require(gamma.shape[-1] == x.shape[-1], "npu_rms_norm", f"gamma {tuple(gamma.shape)} vs self {tuple(x.shape)}")
    return _rms_normalized(x, gamma, epsilon)


def _npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    """STAND-IN ``torch_npu.npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06) -> (y, rstd, x)``.

    Sources: the AddRmsNorm formula of hicann/ops-nn ``norm/add_rms_norm_quant_v2/docs/aclnnAddRmsNormQuantV2.md``
    (功能描述: x = x1 + x2, then RmsNorm of x) and mindspore ``ops.add_rms_norm`` (the same Ascend kernel: x1, x2,
    gamma fp16/bf16/fp32, one dtype). Outputs: y (x1's dtype), rstd (fp32), and the sum x rounded to x1's dtype,
    which is what the next layer receives as its residual.
    """
    _require(x1.dtype in _NPU_FLOATS, "npu_add_rms_norm", f"x1 dtype {x1.dtype}")
    _require(x2.dtype == x1.dtype == gamma.dtype, "npu_add_rms_norm", f"dtypes {x1.dtype}/{x2.dtype}/{gamma.dtype}")
    _require(x1.shape == x2.shape, "npu_add_rms_norm", f"x1 {tuple(x1.shape)} vs x2 {tuple(x2.shape)}")
    total = (x1.float() + x2.float()).to(x1.dtype)
    y, rstd = _rms_normalized(total, gamma, epsilon)
    return y, rstd, total


def _npu_swiglu(x, dim=-1):
    """STAND-IN ``torch_npu.npu_swiglu(input, dim=-1) -> Tensor``.

    Source: Ascend/op-plugin ``docs/context/（beta）torch_npu-npu_swiglu.md`` (计算公式, 参数说明): input split in
    halves A, B along ``dim``; out = A * sigmoid(A) * B; input 1-8 dims, fp32/fp16/bf16, ``dim`` even-sized,
    no non-contiguous and no empty tensor; out has input's dtype.
    """
    _require(x.dtype in _NPU_FLOATS, "npu_swiglu", f"input dtype {x.dtype}")
    _require(1 <= x.dim() <= 8 and x.numel() > 0, "npu_swiglu", f"input shape {tuple(x.shape)}")
    _require(x.is_contiguous(), "npu_swiglu", "non-contiguous input")
    _require(x.shape[dim] % 2 == 0, "npu_swiglu", f"dim {dim} of {tuple(x.shape)} is odd")
    a, b = x.float().chunk(2, dim=dim)
    return (a * torch.sigmoid(a) * b).to(x.dtype)


def _npu_rotary_mul(x, r1, r2, rotary_mode="half"):
    """STAND-IN ``torch_npu.npu_rotary_mul(input, r1, r2, rotary_mode='half') -> Tensor``.

    Source: Ascend/op-plugin ``docs/context/torch_npu-npu_rotary_mul.md`` (功能说明, 参数说明, 约束说明):
    output = r1 * input + r2 * rotate(input), rotate = concat(-x2, x1) of input's halves ('half') or of its even/odd
    lanes re-interleaved ('interleave'); input, r1, r2 4-D fp16/bf16/fp32; output input's shape and dtype; BSND
    input with r1/r2 shaped 1S1D, BS1D or BSND (half mode), D even and < 896, B and N < 1000. The kernel's aclnn page
    (repo-mirror-test/ops-transformer ``posembedding/rotary_position_embedding/docs/aclnnRotaryPositionEmbedding.md``,
    parameter table and 约束说明) adds: cos and sin of x's dtype ("与x数据类型一致") and of one shape.
    """
    op = "npu_rotary_mul"
    _require(rotary_mode in ("half", "interleave"), op, f"rotary_mode {rotary_mode!r}")
    _require(x.dim() == r1.dim() == r2.dim() == 4, op, f"dims {x.dim()}/{r1.dim()}/{r2.dim()}, all must be 4")
    _require(x.dtype in _NPU_FLOATS, op, f"input dtype {x.dtype}")
    _require(r1.dtype == r2.dtype == x.dtype, op, f"r1/r2 dtypes {r1.dtype}/{r2.dtype} differ from input {x.dtype}")
    _require(r1.shape == r2.shape, op, f"r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} differ")
    batch, seq, heads, dim = x.shape
    _require(dim % 2 == 0 and dim < 896 and batch < 1000 and heads < 1000, op, f"BSND input {tuple(x.shape)}")
    for name, r in (("r1", r1), ("r2", r2)):
        _require(r.shape[1] == seq and r.shape[3] == dim, op, f"{name} {tuple(r.shape)} vs input {tuple(x.shape)}")
        _require(r.shape[0] in (1, batch) and r.shape[2] in (1, heads), op, f"{name} layout {tuple(r.shape)}")
    x32 = x.float()
    if rotary_mode == "half":
        first, second = x32.chunk(2, dim=-1)
        rotated = torch.cat((-second, first), dim=-1)
    else:
        rotated = torch.stack((-x32[..., 1::2], x32[..., ::2]), dim=-1).flatten(-2)
    return (r1.float() * x32 + r2.float() * rotated).to(x.dtype)


def _npu_fused_infer_attention_score_tnd(
    query, key, value, *, actual_seq_lengths, actual_seq_lengths_kv, num_heads, num_key_value_heads=0, scale=1.0,
    sparse_mode=0, input_layout="TND", softmax_lse_flag=False, **unsupported,
):  # fmt: skip
    """STAND-IN for ``npu_fused_infer_attention_score`` in the varlen ``input_layout="TND"`` form the vision tower
    calls (``VisionAscendAttention``): no mask, ``sparse_mode=0``.

    Source: Ascend/op-plugin ``docs/context/torch_npu-npu_fused_infer_attention_score.md`` (参数说明, 输出说明):
    query ``[T, N, D]`` and key/value ``[T_kv, N_kv, D]``, fp16/bf16 only, contiguous; with TND,
    ``actual_seq_lengths`` is required, its element count is the batch and each element is the running sum of the
    lengths so far (non-decreasing, non-negative), likewise ``actual_seq_lengths_kv``; ``num_heads`` divisible by
    ``num_key_value_heads`` (0 means equal) with a ratio of at most 64; sparse mode 0 without a mask attends every
    key of the same batch entry. Returns ``(attention_out [T, N, D], softmax_lse)``, the latter fp32 ``[T, N, 1]``
    with the flag, else a ``[1]`` zero tensor.
    """
    op = "npu_fused_infer_attention_score(TND)"
    _require(not unsupported, op, f"unsupported keywords {sorted(unsupported)}")
    _require(input_layout == "TND" and sparse_mode == 0, op, f"layout {input_layout}, sparse_mode {sparse_mode}")
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        _require(tensor.dtype in _NPU_HALVES, op, f"{name} dtype {tensor.dtype}: the op takes fp16/bf16")
        _require(tensor.is_contiguous() and tensor.dim() == 3, op, f"{name} must be a contiguous [T, N, D]")
    _require(key.shape == value.shape, op, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    kv_heads = num_key_value_heads or num_heads
    _require(query.shape[1] == num_heads and key.shape[1] == kv_heads, op, "head counts differ from the tensors")
    _require(num_heads % kv_heads == 0 and num_heads // kv_heads <= 64, op, f"GQA {num_heads}:{kv_heads}")
    ends_q, ends_kv = list(actual_seq_lengths), list(actual_seq_lengths_kv)
    for name, ends, rows in (("", ends_q, query.shape[0]), ("_kv", ends_kv, key.shape[0])):
        _require(len(ends) == len(ends_q), op, "actual_seq_lengths and actual_seq_lengths_kv have different batches")
        _require(all(0 <= a <= b for a, b in zip([0] + ends, ends)), op, f"actual_seq_lengths{name} {ends}")
        _require(ends[-1] == rows, op, f"actual_seq_lengths{name} ends at {ends[-1]}, the tensor has {rows} rows")
    out = torch.empty(query.shape, dtype=torch.float32)
    lse = torch.empty(query.shape[0], num_heads, 1, dtype=torch.float32)
    for q0, q1, k0, k1 in zip([0] + ends_q, ends_q, [0] + ends_kv, ends_kv):
        q = query[q0:q1].float().transpose(0, 1)
        k = key[k0:k1].float().repeat_interleave(num_heads // kv_heads, 1).transpose(0, 1)
        v = value[k0:k1].float().repeat_interleave(num_heads // kv_heads, 1).transpose(0, 1)
        logits = q @ k.transpose(1, 2) * scale
        lse[q0:q1] = torch.logsumexp(logits, dim=-1).transpose(0, 1).unsqueeze(-1)
        out[q0:q1] = (torch.softmax(logits, dim=-1) @ v).transpose(0, 1)
    return out.to(query.dtype), (lse if softmax_lse_flag else torch.zeros(1))


def _with_tnd_layout(bnsd_stand_in):
    """One ``npu_fused_infer_attention_score``: the TND calls of the vision tower go to the TND stand-in, every
    other layout to ``bnsd_stand_in``."""

    def npu_fused_infer_attention_score(*args, input_layout="BSH", **kwargs):
        if input_layout == "TND":
            return _npu_fused_infer_attention_score_tnd(*args, input_layout=input_layout, **kwargs)
        return bnsd_stand_in(*args, input_layout=input_layout, **kwargs)

    return npu_fused_infer_attention_score


def _npu_top_k_top_p(logits, p, k):
    """STAND-IN ``torch_npu.npu_top_k_top_p(logits, p, k) -> Tensor``.

    Source: Ascend/op-plugin ``docs/context/torch_npu-npu_top_k_top_p.md`` (计算公式, 参数说明): logits 2-D
    fp32/fp16/bf16; p 1-D of logits' dtype, one value in [0, 1] per row; k 1-D int32 in [1, 1024] and at most the
    vocabulary. Sort ascending (stable); values below the row's k-th largest become -inf; softmax of what is left,
    cumulated from the smallest; positions whose running sum is <= 1 - p become -inf, the largest always stays;
    scattered back to the original order. Non-contiguous inputs are allowed.
    """
    op = "npu_top_k_top_p"
    _require(logits.dim() == 2 and logits.dtype in _NPU_FLOATS, op, f"logits {logits.dtype}{tuple(logits.shape)}")
    _require(p.dtype == logits.dtype and p.shape == logits.shape[:1], op, f"p {p.dtype}{tuple(p.shape)}")
    _require(k.dtype == torch.int32 and k.shape == logits.shape[:1], op, f"k {k.dtype}{tuple(k.shape)}")
    _require(bool(((k >= 1) & (k <= min(1024, logits.shape[1]))).all()), op, f"k values {k.tolist()}")
    _require(bool(((p >= 0) & (p <= 1)).all()), op, f"p values {p.tolist()}")
    values, indices = logits.float().sort(dim=-1, stable=True)
    kth_largest = values.gather(1, (logits.shape[1] - k.long()).unsqueeze(1))
    values = values.masked_fill(values < kth_largest, float("-inf"))
    running = values.softmax(dim=-1).cumsum(dim=-1)
    outside_p = running <= 1 - p.float().unsqueeze(1)
    outside_p[:, -1] = False
    values = values.masked_fill(outside_p, float("-inf"))
    return torch.empty_like(values).scatter_(1, indices, values).to(logits.dtype)


# ---- STAND-INs for the W8A8_DYNAMIC linear (stock ``NPUW8A8Int8DynamicLinearMethod.apply``, reached as
# ``torch.ops.npu.<op>``): integer semantics exact, the float epilogue in fp32.

_INT8_MAX = 127


def _npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None):
    """STAND-IN ``torch_npu.npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None) ->
    (y, scale)``, per-token symmetric INT8 without smoothing.

    Sources: torch_npu API reference "torch_npu.npu_dynamic_quant" (hiascend Pytorch 7.0.0 ``ptaoplist_001228``;
    6.0.RC3 ``ptaoplist_000784``) and the kernel's aclnn page (hicann/ops-nn ``quant/dynamic_quant/README.md``,
    aclnnDynamicQuant): ``scale = rowMax(abs(x)) / 127`` (fp32, shape ``x.shape[:-1]``), ``y = round(x / scale)``
    (int8, x's shape); x float16 / bfloat16 only, 2-8 dims. The pages do not say how ties round: half to even here
    (ties need ``x / scale`` exactly on .5, which per-layer tests do not rely on). A row of zeros (scale 0) is not
    specified either: zeros here. The 6.0.RC3 page also caps x's last dim at 11264 on Atlas A2; the 7.0.0 and
    aclnn pages no longer list it, so it is not refused (MOSS-VL's down_proj input is 12288: check on hardware).
    """
    op = "npu_dynamic_quant"
    if smooth_scales is not None or group_index is not None:
        raise NotImplementedError("stand-in npu_dynamic_quant: smooth_scales / group_index are not modelled")
    _require(dst_type in (None, torch.int8), op, f"dst_type {dst_type}: only int8 is modelled")
    _require(x.dtype in _NPU_HALVES, op, f"x dtype {x.dtype}: the op takes float16 or bfloat16")
    _require(2 <= x.dim() <= 8, op, f"x has {x.dim()} dims, the op takes 2-8")
    largest = x.abs().amax(dim=-1).float()  # exact: a max of x's own values
    scale = largest / _INT8_MAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    y = torch.round(x.float() / divisor).clamp_(-_INT8_MAX - 1, _INT8_MAX).to(torch.int8)
    return y, scale


# torch_npu quant_matmul page, table 2 (Atlas A2/A3), the rows with a float output: (scale dtypes, bias dtypes,
# pertoken_scale required). bf16 output: scale fp32/bf16, bias int32/bf16/fp32/None, pertoken fp32 or None; fp16
# output with pertoken_scale: scale fp32 only (fp16 output without it needs npu_trans_quant_param: not modelled).
_QUANT_MATMUL_FLOAT_ROWS = {
    torch.bfloat16: ((torch.float32, torch.bfloat16), (torch.int32, torch.bfloat16, torch.float32), False),
    torch.float16: ((torch.float32,), (torch.int32, torch.bfloat16, torch.float32), True),
}


def _npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None, **unsupported):
    """STAND-IN ``torch_npu.npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
    output_dtype=None, ...)`` for int8 x int8 with a float16 / bfloat16 output.

    Source: Ascend/op-plugin ``docs/context/torch_npu-npu_quant_matmul.md`` (计算公式, 参数说明, 约束说明 and its
    table 2 for Atlas A2/A3): ``out = x1 @ x2 * scale [* pertoken_scale] + bias`` (bias bf16/fp32; an int32 bias is
    added to the integer product before scaling); x1 ``[m, k]`` and x2 ``[k, n]`` int8, 2-6 dims, the last dims of
    both at most 65535; scale 1-D ``(1,)`` or ``(n,)``; pertoken_scale fp32 1-D ``(m,)``; bias 1-D ``(n,)``.
    Accumulation is exact integer arithmetic (int32 cannot overflow at k <= 65535: 128 * 127 * 65535 < 2**31; done
    in fp64, exact below 2**53); the scaling epilogue runs in fp32 and rounds once to the output dtype. int8/int32
    outputs, int64 scales, offsets, int4 (int32 x1/x2) and batched bias raise NotImplementedError; dtype
    combinations outside table 2 raise ValueError.
    """
    op = "npu_quant_matmul"
    if unsupported or offset is not None:
        raise NotImplementedError(f"stand-in npu_quant_matmul: {sorted(unsupported) or 'offset'} not modelled")
    if output_dtype not in _QUANT_MATMUL_FLOAT_ROWS:
        raise NotImplementedError(f"stand-in npu_quant_matmul: output_dtype {output_dtype} not modelled")
    if x1.dtype == torch.int32 or x2.dtype == torch.int32 or scale.dtype == torch.int64:
        raise NotImplementedError("stand-in npu_quant_matmul: int4 inputs / int64 scales are not modelled")
    scale_dtypes, bias_dtypes, pertoken_required = _QUANT_MATMUL_FLOAT_ROWS[output_dtype]
    _require(x1.dtype == x2.dtype == torch.int8, op, f"x1 {x1.dtype} / x2 {x2.dtype}: int8 (one dtype)")
    _require(2 <= x1.dim() <= 6 and 2 <= x2.dim() <= 6, op, f"dims {x1.dim()} / {x2.dim()}: 2-6")
    _require(x1.shape[-1] <= 65535 and x2.shape[-1] <= 65535, op, "last dims of x1 and x2 at most 65535")
    _require(x1.shape[-1] == x2.shape[-2], op, f"x1 {tuple(x1.shape)} @ x2 {tuple(x2.shape)}: k differs")
    m, n = x1.shape[-2], x2.shape[-1]
    _require(scale.dtype in scale_dtypes, op, f"scale {scale.dtype} with output {output_dtype}: {scale_dtypes}")
    _require(scale.dim() == 1 and scale.shape[0] in (1, n), op, f"scale shape {tuple(scale.shape)}: (1,) or ({n},)")
    if pertoken_scale is None:
        _require(not pertoken_required, op, f"output {output_dtype} with a float32 scale needs pertoken_scale")
    else:
        _require(pertoken_scale.dtype == torch.float32, op, f"pertoken_scale dtype {pertoken_scale.dtype}: float32")
        _require(pertoken_scale.shape == (m,), op, f"pertoken_scale {tuple(pertoken_scale.shape)}: ({m},)")
    if bias is not None:
        _require(bias.dtype in bias_dtypes, op, f"bias dtype {bias.dtype}: {bias_dtypes}")
        _require(bias.shape == (n,), op, f"bias {tuple(bias.shape)}: ({n},) (3-D bias not modelled)")
    product = x1.double() @ x2.double()
    if bias is not None and bias.dtype == torch.int32:
        product = product + bias.double()
    out = product.float() * scale.float()
    if pertoken_scale is not None:
        out = out * pertoken_scale.unsqueeze(-1)
    if bias is not None and bias.dtype != torch.int32:
        out = out + bias.float()
    return out.to(output_dtype)


class _FakeTorchNpu(types.ModuleType):
    """Module whose unknown public attributes raise NotImplementedError naming themselves."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(f"torch_npu.{name} is not implemented by the CPU stand-in (tests/fake_torch_npu.py)")


def _import_only(name: str):
    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"{name} is import-only in the CPU stand-in")

    unavailable.__name__ = name.rsplit(".", 1)[-1]
    return unavailable


def build_fake_modules() -> dict[str, types.ModuleType]:
    """The stand-in modules, keyed by import name."""
    torch_npu = _FakeTorchNpu("torch_npu")
    torch_npu.__doc__ = "STAND-IN torch_npu (tests/fake_torch_npu.py)"
    torch_npu._npu_reshape_and_cache = _npu_reshape_and_cache
    torch_npu.npu_fused_infer_attention_score = _npu_fused_infer_attention_score
    torch_npu.npu_fused_infer_attention_score = _with_tnd_layout(torch_npu.npu_fused_infer_attention_score)
    torch_npu.npu_rms_norm = _npu_rms_norm
    torch_npu.npu_add_rms_norm = _npu_add_rms_norm
    torch_npu.npu_swiglu = _npu_swiglu
    torch_npu.npu_rotary_mul = _npu_rotary_mul
    torch_npu.npu_top_k_top_p = _npu_top_k_top_p
    torch_npu.npu_dynamic_quant = _npu_dynamic_quant
    torch_npu.npu_quant_matmul = _npu_quant_matmul

    kernel = types.ModuleType("sgl_kernel_npu")
    attention = types.ModuleType("sgl_kernel_npu.attention")
    sinks = types.ModuleType("sgl_kernel_npu.attention.sinks_attention")
    for fn in ("attention_sinks_prefill_triton", "attention_sinks_triton"):
        setattr(sinks, fn, _import_only(f"sgl_kernel_npu.attention.sinks_attention.{fn}"))
    kernel.__path__ = []
    attention.__path__ = []
    kernel.attention = attention
    attention.sinks_attention = sinks
    modules = {
        "torch_npu": torch_npu,
        "sgl_kernel_npu": kernel,
        "sgl_kernel_npu.attention": attention,
        "sgl_kernel_npu.attention.sinks_attention": sinks,
    }
    # A spec lets importlib.util.find_spec (used by transformers' availability probes) answer.
    for name, module in modules.items():
        module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    return modules


@contextlib.contextmanager
def installed_fake_torch_npu(*, float32_kv_cache: bool = False):
    """Install the stand-in into ``sys.modules``; restore the previous state on exit.

    Yields the fake ``torch_npu`` module. ``float32_kv_cache=True`` lets ReshapeAndCache write float32 pools, which
    a 910B refuses: only tests/test_ascend_backend.py asks for it, to check the Ascend backend's routing against the
    fp32 reference through a float32 NPU pool (its attention runs on the CPU kernel).
    """
    fakes = build_fake_modules()
    if float32_kv_cache:
        fakes["torch_npu"]._npu_reshape_and_cache = functools.partial(
            _npu_reshape_and_cache, dtypes=(*_RESHAPE_AND_CACHE_DTYPES, torch.float32)
        )
    touched = tuple(fakes) + _MODULES_BOUND_TO_FAKE
    saved = {name: sys.modules[name] for name in touched if name in sys.modules}
    for name in _MODULES_BOUND_TO_FAKE:
        sys.modules.pop(name, None)
    sys.modules.update(fakes)
    try:
        yield fakes["torch_npu"]
    finally:
        for name in touched:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
