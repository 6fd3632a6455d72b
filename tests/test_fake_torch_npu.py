"""The STAND-IN ``torch_npu.npu_fused_infer_attention_score`` (tests/fake_torch_npu.py) on its own, then the
attention core's NPU primitive through it.

Oracle: a dense fp64 attention written here (explicit logits, explicit attended set, per-row softmax and
log-sum-exp); the Ascend mask polarity (True = masked out) is exercised both ways, so a stand-in or caller that
inverted it fails. The core through the NPU primitive must equal the core through the CPU primitive.
"""

from __future__ import annotations

import pytest
import torch

from fake_torch_npu import installed_fake_torch_npu
from mossvl_ascend.attention import primitives
from mossvl_ascend.attention.blocks import frame_causal_cross_attention, plan_frame_causal_blocks


def dense_fp64(q, k, v, attended, scale):
    """q [B, N, S, D], k/v [B, Nk, Skv, D], attended bool [B, 1, S, Skv] -> out fp64, lse fp64 [B, N, S]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    logits = torch.einsum("bnsd,bnkd->bnsk", q.double(), k) * scale
    out = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=torch.float64)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float64)
    for b in range(q.shape[0]):
        for s in range(q.shape[2]):
            keys = attended[b, 0, s].nonzero().flatten()
            if keys.numel():
                row = logits[b, :, s, keys]
                lse[b, :, s] = torch.logsumexp(row, dim=-1)
                out[b, :, s] = torch.einsum("nk,nkd->nd", torch.softmax(row, dim=-1), v[b][:, keys])
    return out, lse


@pytest.fixture()
def torch_npu():
    with installed_fake_torch_npu() as module:
        yield module


def qkv(batch, heads, kv_heads, rows, keys, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, heads, rows, dim, generator=gen),
        torch.randn(batch, kv_heads, keys, dim, generator=gen),
        torch.randn(batch, kv_heads, keys, dim, generator=gen),
    )


@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (8, 1)], ids=["8:2", "4:4", "8:1"])
def test_mask_true_means_masked_out_and_lse_is_returned(torch_npu, heads):
    q, k, v = qkv(2, *heads, rows=5, keys=11)
    masked_out = torch.rand(2, 1, 5, 11, generator=torch.Generator().manual_seed(1)) < 0.4
    masked_out[0, 0, 2] = True  # a row that sees nothing
    out, lse = torch_npu.npu_fused_infer_attention_score(
        q,
        k,
        v,
        num_heads=heads[0],
        num_key_value_heads=heads[1],
        input_layout="BNSD",
        scale=0.3,
        atten_mask=masked_out,
        softmax_lse_flag=True,
    )
    expected, expected_lse = dense_fp64(q, k, v, ~masked_out, 0.3)
    assert lse.shape == (2, heads[0], 5, 1) and lse.dtype == torch.float32
    seen = (~masked_out).any(-1).expand(2, heads[0], 5)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[..., 0].double()[seen], expected_lse[seen], atol=1e-5, rtol=1e-5)


def test_paged_cache_through_block_table_and_kv_lengths(torch_npu):
    """Keys read in place from pages [num_blocks, block_size, Nk * D]; positions >= actual_seq_lengths_kv unseen."""
    batch, heads, kv_heads, dim, block_size = 3, 4, 2, 8, 4
    gen = torch.Generator().manual_seed(2)
    k_pages = torch.randn(10, block_size, kv_heads * dim, generator=gen)
    v_pages = torch.randn(10, block_size, kv_heads * dim, generator=gen)
    block_table = torch.tensor([[7, 2, 0], [5, 9, 1], [3, 0, 0]], dtype=torch.int32)
    kv_lens = [10, 12, 3]
    q = torch.randn(batch, heads, 1, dim, generator=gen)
    out, lse = torch_npu.npu_fused_infer_attention_score(
        q,
        k_pages,
        v_pages,
        num_heads=heads,
        num_key_value_heads=kv_heads,
        input_layout="BNSD",
        scale=0.5,
        block_table=block_table,
        block_size=block_size,
        actual_seq_lengths_kv=kv_lens,
        softmax_lse_flag=True,
    )
    for b in range(batch):
        rows = torch.cat([torch.arange(p * block_size, (p + 1) * block_size) for p in block_table[b].tolist()])
        k = k_pages.view(-1, kv_heads, dim)[rows].transpose(0, 1)[None]
        v = v_pages.view(-1, kv_heads, dim)[rows].transpose(0, 1)[None]
        attended = (torch.arange(k.shape[2]) < kv_lens[b]).view(1, 1, 1, -1)
        expected, expected_lse = dense_fp64(q[b : b + 1], k, v, attended, 0.5)
        torch.testing.assert_close(out[b : b + 1].double(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[b : b + 1, ..., 0].double(), expected_lse, atol=1e-5, rtol=1e-5)


def test_unsupported_arguments_raise(torch_npu):
    q, k, v = qkv(1, 2, 2, 3, 4)
    with pytest.raises(NotImplementedError, match="pse_shift"):
        torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=2, input_layout="BNSD", pse_shift=q)
    with pytest.raises(ValueError, match="non-contiguous"):
        torch_npu.npu_fused_infer_attention_score(q, k.transpose(2, 3), v, num_heads=2, input_layout="BNSD")


def test_npu_primitive_equals_cpu_primitive_including_blind_rows(torch_npu):
    q, k, v = qkv(2, 8, 2, 6, 9, seed=3)
    visible = torch.rand(2, 1, 6, 9, generator=torch.Generator().manual_seed(4)) < 0.5
    visible[1, 0, 4] = False
    npu_out, npu_lse = primitives.npu_attention_with_lse(q, k, v, 0.25, visible=visible)
    cpu_out, cpu_lse = primitives.attention_with_lse(q, k, v, 0.25, visible=visible)
    seen = visible.any(-1).expand(2, 8, 6)
    torch.testing.assert_close(npu_out[seen[..., None].expand_as(npu_out)], cpu_out[seen[..., None].expand_as(cpu_out)])
    torch.testing.assert_close(npu_lse[seen], cpu_lse[seen])


def test_frame_causal_blocks_through_the_npu_primitive(torch_npu, monkeypatch):
    """The whole LSE-merged block path with the NPU primitive standing in for the CPU one: same result."""
    gen = torch.Generator().manual_seed(5)
    boundaries = torch.randint(0, 120, (90,), generator=gen)
    q, k, v = torch.randn(8, 90, 16, generator=gen), torch.randn(2, 120, 16, generator=gen), torch.randn(2, 120, 16)
    plan = plan_frame_causal_blocks(boundaries, leaf_rows=8)
    assert len(plan.blocks) > 3
    expected = frame_causal_cross_attention(q, k, v, boundaries, 0.25, plan=plan)
    calls = []

    def npu_primitive(*args, **kwargs):
        calls.append(1)
        return primitives.npu_attention_with_lse(*args, **kwargs)

    monkeypatch.setitem(primitives.FUSED_ATTENTION_BY_DEVICE, "cpu", npu_primitive)
    out = frame_causal_cross_attention(q, k, v, boundaries, 0.25, plan=plan)
    assert len(calls) == len(plan.blocks)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
