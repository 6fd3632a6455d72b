"""Cross-attention precision cases and their oracles (fp64 reference, dense masked attention in the same dtype).

The fp64 reference is written from first principles: per row, a softmax over the keys it sees only (no mask
value, no -inf arithmetic), rows that see nothing give zeros. The "dense" comparator is what one plain
masked attention in the working dtype achieves on the same rounded inputs (torch SDPA with a bool mask, True =
attend; with softcap, scores -> cap * tanh(scores / cap) -> masked softmax, all in the working dtype): the
error budget of the frame-causal kernel is stated relative to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention


@dataclass(frozen=True)
class CrossCase:
    """One request's cross-attention: ``boundaries[r]`` = end of the encoder prefix new row ``r`` sees."""

    name: str
    boundaries: torch.Tensor  # int64 [rows]
    encoder_len: int


def images_case(num_images=3, tokens=1024, rows_per_image=200) -> CrossCase:
    """A multi-image prompt: after image i come ``rows_per_image`` text rows that see images 0..i."""
    bounds = torch.arange(1, num_images + 1).repeat_interleave(rows_per_image) * tokens
    return CrossCase(f"{num_images}img_x{tokens}", bounds, num_images * tokens)


def video_case(frames=40, tokens_per_frame=257, rows_per_frame=8, question_rows=200) -> CrossCase:
    """A video prompt: a few rows after every frame (frame-causal staircase), then a question seeing all frames."""
    staircase = torch.arange(1, frames + 1).repeat_interleave(rows_per_frame) * tokens_per_frame
    question = torch.full((question_rows,), frames * tokens_per_frame)
    return CrossCase(f"video{frames}x{tokens_per_frame}", torch.cat([staircase, question]), frames * tokens_per_frame)


def random_case(rows=300, encoder_len=700, seed=0) -> CrossCase:
    """Unsorted random boundaries, including rows that see nothing (0) and rows that see everything."""
    gen = torch.Generator().manual_seed(seed)
    bounds = torch.randint(0, encoder_len + 1, (rows,), generator=gen)
    bounds[::17] = 0
    bounds[5::23] = encoder_len
    return CrossCase(f"random{rows}", bounds, encoder_len)


def visibility(boundaries: torch.Tensor, encoder_len: int) -> torch.Tensor:
    """Bool ``[rows, encoder_len]``, True = row sees key (key < boundary)."""
    return torch.arange(encoder_len)[None, :] < boundaries[:, None]


def fp64_reference(q, k, v, boundaries, scale, logit_cap=0.0):
    """q ``[Hq, L, D]``, k/v ``[Hk, S, D]`` -> ``[Hq, L, Dv]`` fp64; row r: softmax over keys [0, boundary_r)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for boundary in boundaries.unique().tolist():
        if boundary == 0:
            continue
        rows = (boundaries == boundary).nonzero().flatten()
        logits = torch.einsum("hld,hsd->hls", q[:, rows], k[:, :boundary]) * scale
        if logit_cap > 0:
            logits = logit_cap * torch.tanh(logits / logit_cap)
        out[:, rows] = torch.softmax(logits, dim=-1) @ v[:, :boundary]
    return out


def dense_same_dtype(q, k, v, boundaries, scale, logit_cap=0.0):
    """One masked attention over the whole ``[rows, encoder]`` box in the inputs' dtype (rows seeing nothing -> 0)."""
    visible = visibility(boundaries, k.shape[1])
    group = q.shape[0] // k.shape[0]
    if logit_cap > 0:
        kk, vv = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        logits = torch.matmul(q, kk.transpose(1, 2)) * scale
        logits = logit_cap * torch.tanh(logits / logit_cap)
        logits = logits.masked_fill(~visible, float("-inf"))
        out = torch.matmul(torch.softmax(logits, dim=-1), vv)
    else:
        out = scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=group > 1)
    return out.masked_fill(~visible.any(-1)[None, :, None], 0.0)


def random_qkv(num_heads, num_kv_heads, rows, encoder_len, head_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(num_heads, rows, head_dim, generator=gen),
        torch.randn(num_kv_heads, encoder_len, head_dim, generator=gen),
        torch.randn(num_kv_heads, encoder_len, head_dim, generator=gen),
    )


def max_error(out, reference, boundaries) -> float:
    """Largest absolute error over rows that see something (rows that see nothing are checked separately)."""
    seen = boundaries > 0
    if not bool(seen.any()):
        return 0.0
    return float((out.double()[:, seen] - reference[:, seen]).abs().max())


def packed_mask(boundaries: torch.Tensor, encoder_len: int) -> torch.Tensor:
    """Stock packed mask of one request (uint8, 1 = visible, row-major ``[rows x encoder_len]``)."""
    return visibility(boundaries, encoder_len).to(torch.uint8).flatten()


def one_request_pool(q, k, v):
    """The request's encoder K/V at shuffled slots of a noisy pool: (k_cache, v_cache, req_to_token row 1)."""
    num_kv_heads, encoder_len, head_dim = k.shape
    rows = q.shape[1]
    gen = torch.Generator().manual_seed(1)
    pool_slots = encoder_len + rows + 16
    k_cache = torch.randn(pool_slots, num_kv_heads, head_dim, generator=gen).to(q.dtype)
    v_cache = torch.randn(pool_slots, num_kv_heads, v.shape[-1], generator=gen).to(q.dtype)
    slots = torch.randperm(pool_slots, generator=gen)[: encoder_len + rows]
    k_cache[slots[:encoder_len]] = k.transpose(0, 1)
    v_cache[slots[:encoder_len]] = v.transpose(0, 1)
    req_to_token = torch.zeros(2, encoder_len + rows, dtype=torch.int32)
    req_to_token[1] = slots.int()
    return k_cache, v_cache, req_to_token


def through_core(q, k, v, boundaries, scale, logit_cap=0.0):
    """One request through the backends' entry: metadata from boundaries (what the prepare_forward_batch hook
    builds), then :func:`mossvl_ascend.attention.core.attention`; returns ``[Hq, L, Dv]``."""
    from mossvl_ascend.attention.core import AttentionLayer, attention
    from mossvl_ascend.attention.metadata import ForwardAttentionMetadata

    rows, encoder_len = q.shape[1], k.shape[1]
    k_cache, v_cache, req_to_token = one_request_pool(q, k, v)
    metadata = ForwardAttentionMetadata.build([rows], [0], [encoder_len], [boundaries.to(torch.int32)])
    out = attention(
        q.transpose(0, 1).contiguous(),
        k_cache,
        v_cache,
        req_to_token,
        torch.tensor([1]),
        metadata,
        AttentionLayer(True, scale, False, logit_cap),
    )
    return out.transpose(0, 1)


def through_stock_method(native, q, k, v, boundaries, scale, logit_cap=0.0):
    """One request through ``run_sdpa_forward_extend`` (the hooked edge) with its packed mask; returns ``[Hq, L, Dv]``.

    The request's encoder K/V sit at shuffled pool slots behind a noisy pool; no text prefix is cached.
    """
    num_heads, rows, _ = q.shape
    num_kv_heads, encoder_len, _ = k.shape
    k_cache, v_cache, req_to_token = one_request_pool(q, k, v)
    query = q.transpose(0, 1).contiguous()
    output = torch.full((rows, num_heads, v.shape[-1]), float("nan"), dtype=q.dtype)
    native.run_sdpa_forward_extend(
        query,
        output,
        k_cache,
        v_cache,
        req_to_token,
        torch.tensor([1]),
        torch.tensor([rows]),
        torch.tensor([0]),
        torch.tensor([rows]),
        torch.tensor([encoder_len]),
        is_cross_attention=True,
        scaling=scale,
        enable_gqa=num_heads != num_kv_heads,
        causal=False,
        logit_cap=logit_cap,
        cross_attention_custom_mask=packed_mask(boundaries, encoder_len),
    )
    return output.transpose(0, 1)


def masked_fp64_reference(q, k, v, attended, scale):
    """q ``[B, Hq, L, D]``, k/v ``[B, Hk, S, D]``, attended bool broadcastable to ``[B, 1, L, S]`` (True = the row
    sees the key) -> (out ``[B, Hq, L, D]``, natural-log lse ``[B, Hq, L]``), fp64; rows that see nothing: 0, -inf."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    logits = torch.matmul(q.double(), k.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~attended, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    return torch.matmul(probs, v), lse


def masked_same_dtype(q, k, v, attended, scale):
    """One dense SDPA in the inputs' dtype with the same bool mask (True = attend); rows that see nothing: 0."""
    attended = attended.expand(q.shape[0], 1, q.shape[2], k.shape[2])
    out = scaled_dot_product_attention(q, k, v, attn_mask=attended, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.masked_fill(~attended.any(-1)[..., None], 0.0)
