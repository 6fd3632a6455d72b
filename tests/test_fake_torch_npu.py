"""The STAND-INs of ``torch_npu.npu_fused_infer_attention_score`` (FIA) and ``torch_npu._npu_reshape_and_cache``
(tests/fake_torch_npu.py) on their own, in the dtypes a 910B takes (bf16, fp16), and what they refuse.

Oracle: a dense fp64 attention written here (explicit logits, an explicit attended set built from the documented
rule of each argument, per-row softmax and natural-log log-sum-exp) on the same rounded inputs. The Ascend mask
polarity (True = masked out) is exercised both ways, so a stand-in that inverted it fails; the LSE is compared in
natural log; paged keys are located independently of the stand-in's block arithmetic.
"""

from __future__ import annotations

import pytest
import torch

from fake_torch_npu import COMPRESSED_MASK_SIZE, RefusedByNpu, installed_fake_torch_npu

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Output tolerance of one rounding of an fp32 result to the dtype (values stay below ~4 here): 2^-8 and 2^-11 relative.
OUT_ATOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3}


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


def qkv(batch, heads, kv_heads, rows, keys, dim=16, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(batch, n, s, dim, generator=gen).to(dtype)
        for n, s in ((heads, rows), (kv_heads, keys), (kv_heads, keys))
    )


def fia(torch_npu, q, k, v, **kwargs):
    kwargs.setdefault("num_heads", q.shape[1])
    kwargs.setdefault("num_key_value_heads", k.shape[1])
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, input_layout="BNSD", softmax_lse_flag=kwargs.pop("lse", True), **kwargs
    )


def assert_rows_match(out, lse, expected, expected_lse, rows_seen):
    """Rows that see a key equal the fp64 reference (out in its dtype's rounding, lse fp32 natural log)."""
    seen = rows_seen.expand(expected_lse.shape)
    torch.testing.assert_close(out.double()[seen], expected[seen], atol=OUT_ATOL[out.dtype], rtol=0)
    torch.testing.assert_close(lse[..., 0].double()[seen], expected_lse[seen], atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF.keys())
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (8, 1)], ids=["8:2", "4:4", "8:1"])
def test_mask_true_means_masked_out_and_lse_is_natural_log(torch_npu, heads, dtype):
    q, k, v = qkv(2, *heads, rows=5, keys=11, dtype=dtype)
    masked_out = torch.rand(2, 1, 5, 11, generator=torch.Generator().manual_seed(1)) < 0.4
    masked_out[0, 0, 2] = True  # a row that sees nothing
    out, lse = fia(torch_npu, q, k, v, scale=0.3, atten_mask=masked_out)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.shape == (2, heads[0], 5, 1) and lse.dtype == torch.float32
    expected, expected_lse = dense_fp64(q, k, v, ~masked_out, 0.3)
    assert_rows_match(out, lse, expected, expected_lse, (~masked_out).any(-1))
    assert out[0, :, 2].isnan().all() and lse[0, :, 2].isnan().all()  # unspecified: callers must replace it


def test_lse_flag_off_returns_the_documented_one_element_zero(torch_npu):
    q, k, v = qkv(1, 2, 2, 3, 4)
    out, lse = fia(torch_npu, q, k, v, lse=False)
    assert lse.shape == (1,) and lse.dtype == torch.float32 and lse.item() == 0
    expected, _ = dense_fp64(q, k, v, torch.ones(1, 1, 3, 4, dtype=torch.bool), 1.0)
    torch.testing.assert_close(out.double(), expected, atol=OUT_ATOL[out.dtype], rtol=0)


@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF.keys())
def test_per_batch_lengths_cut_rows_and_keys(torch_npu, dtype):
    """actual_seq_lengths / actual_seq_lengths_kv per batch entry (BNSD): keys past an entry's length are unseen,
    rows past its query length are padding (NaN here: callers must not read them)."""
    q, k, v = qkv(3, 4, 2, rows=6, keys=9, dtype=dtype, seed=2)
    query_lens, key_lens = [6, 2, 4], [9, 3, 7]
    out, lse = fia(torch_npu, q, k, v, scale=0.5, actual_seq_lengths=query_lens, actual_seq_lengths_kv=key_lens)
    attended = torch.zeros(3, 1, 6, 9, dtype=torch.bool)
    for b, (rows, keys) in enumerate(zip(query_lens, key_lens)):
        attended[b, 0, :rows, :keys] = True
    expected, expected_lse = dense_fp64(q, k, v, attended, 0.5)
    assert_rows_match(out, lse, expected, expected_lse, attended.any(-1))
    assert out[1, :, 2:].isnan().all()


def compressed_causal_mask():
    return torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool).triu_(1)


@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF.keys())
def test_compressed_causal_mask_modes_align_per_batch(torch_npu, dtype):
    """sparse_mode 3 (rightDownCausal) with the 2048^2 mask: row i of entry b sees keys j <= i + kv_b - q_b (rows
    after a cached prefix); sparse_mode 2 (leftUpCausal): j <= i. pre/next_tokens are ignored by both (stock passes
    next_tokens=0 with mode 3)."""
    q, k, v = qkv(3, 8, 2, rows=5, keys=12, dtype=dtype, seed=3)
    query_lens, key_lens = [5, 3, 4], [12, 3, 9]
    row, col = torch.arange(5)[:, None], torch.arange(12)[None, :]
    for mode in (2, 3):
        out, lse = fia(
            torch_npu,
            q,
            k,
            v,
            scale=0.25,
            atten_mask=compressed_causal_mask(),
            sparse_mode=mode,
            next_tokens=0,
            actual_seq_lengths=query_lens,
            actual_seq_lengths_kv=key_lens,
        )
        attended = torch.zeros(3, 1, 5, 12, dtype=torch.bool)
        for b, (rows, keys) in enumerate(zip(query_lens, key_lens)):
            prefix = keys - rows if mode == 3 else 0
            attended[b, 0] = (row < rows) & (col < keys) & (col <= row + prefix)
        expected, expected_lse = dense_fp64(q, k, v, attended, 0.25)
        assert_rows_match(out, lse, expected, expected_lse, attended.any(-1))


def test_default_mode_band_of_pre_and_next_tokens(torch_npu):
    """sparse_mode 0 with a mask: only keys between pre_tokens before and next_tokens after the row are computed."""
    q, k, v = qkv(1, 2, 2, rows=6, keys=6, seed=4)
    no_mask = torch.zeros(6, 6, dtype=torch.bool)
    out, lse = fia(torch_npu, q, k, v, atten_mask=no_mask, pre_tokens=2, next_tokens=0)
    row, col = torch.arange(6)[:, None], torch.arange(6)[None, :]
    attended = ((col <= row) & (col >= row - 2))[None, None]
    expected, expected_lse = dense_fp64(q, k, v, attended, 1.0)
    assert_rows_match(out, lse, expected, expected_lse, attended.any(-1))


def paged_pool(num_blocks, block_size, kv_heads, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads * dim)
    return torch.randn(*shape, generator=gen).to(dtype), torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF.keys())
@pytest.mark.parametrize("block_size", [16, 128])
def test_paged_cache_through_block_table_and_kv_lengths(torch_npu, block_size, dtype):
    """Decode (Q_S = 1) from pages [num_blocks, block_size, Nk * D] with many slots per page: batch b's key j is
    slot j % block_size of its (j // block_size)-th listed page; keys >= actual_seq_lengths_kv unseen; a mask
    [B, 1, 1, KV_S] (True = masked out) hides a prefix."""
    batch, heads, kv_heads, dim = 3, 8, 2, 16
    k_pages, v_pages = paged_pool(12, block_size, kv_heads, dim, dtype, seed=5)
    block_table = torch.tensor([[7, 2, 0], [5, 9, 1], [3, 0, 0]], dtype=torch.int32)
    kv_lens = [2 * block_size + 3, 3 * block_size, 5]
    hidden = torch.tensor([4, 0, 1])
    masked_out = (torch.arange(3 * block_size)[None, :] < hidden[:, None]).view(batch, 1, 1, -1)
    q = torch.randn(batch, heads, 1, dim, generator=torch.Generator().manual_seed(6)).to(dtype)
    out, lse = fia(
        torch_npu,
        q,
        k_pages,
        v_pages,
        num_key_value_heads=kv_heads,
        scale=0.5,
        block_table=block_table,
        block_size=block_size,
        actual_seq_lengths_kv=kv_lens,
        atten_mask=masked_out,
    )
    for b in range(batch):
        pages = block_table[b].tolist()
        keys = torch.stack([k_pages[pages[j // block_size], j % block_size] for j in range(kv_lens[b])])
        values = torch.stack([v_pages[pages[j // block_size], j % block_size] for j in range(kv_lens[b])])
        k = keys.view(-1, kv_heads, dim).transpose(0, 1)[None]
        v = values.view(-1, kv_heads, dim).transpose(0, 1)[None]
        attended = (torch.arange(kv_lens[b]) >= hidden[b]).view(1, 1, 1, -1)
        expected, expected_lse = dense_fp64(q[b : b + 1], k, v, attended, 0.5)
        assert_rows_match(out[b : b + 1], lse[b : b + 1], expected, expected_lse, attended.any(-1))


REFUSALS = {
    "fp32 query": ({"dtype": torch.float32}, {}, "float16 or bfloat16"),
    "GQA ratio 128": ({"heads": (128, 1)}, {}, "ratio <= 64"),
    "N above 256": ({"heads": (512, 8)}, {}, "N 512"),
    "D above 512": ({"dim": 528}, {}, "D 528"),
    "D not 16-aligned with Q_S > 1": ({"dim": 24}, {}, "16-aligned"),
    "[B,1,1,S] mask with Q_S > 1": ({}, {"atten_mask": torch.zeros(2, 1, 1, 7, dtype=torch.bool)}, "shape"),
    "non-contiguous mask": ({}, {"atten_mask": torch.zeros(2, 1, 7, 4, dtype=torch.bool).transpose(2, 3)}, "mask"),
    "int8 mask value 2": ({}, {"atten_mask": torch.full((4, 7), 2, dtype=torch.int8)}, "0 or 1"),
    "causal mode with a rows x keys mask": (
        {},
        {"atten_mask": torch.ones(4, 7).bool().triu(1), "sparse_mode": 3},
        "compressed",
    ),
    "causal mode with inverted mask": ({}, {"atten_mask": ~compressed_causal_mask(), "sparse_mode": 3}, "diagonal"),
    "sparse_mode 5": ({}, {"atten_mask": compressed_causal_mask(), "sparse_mode": 5}, "sparse_mode"),
    "kv length beyond S": ({}, {"actual_seq_lengths_kv": [7, 8]}, "actual_seq_lengths_kv"),
}


@pytest.mark.parametrize("case", REFUSALS, ids=REFUSALS)
def test_refuses_what_a_910b_refuses(torch_npu, case):
    shape, kwargs, message = REFUSALS[case]
    heads = shape.get("heads", (4, 2))
    q, k, v = qkv(2, *heads, rows=4, keys=7, dim=shape.get("dim", 16), dtype=shape.get("dtype", torch.bfloat16))
    with pytest.raises(RefusedByNpu, match=message):
        fia(torch_npu, q, k, v, **kwargs)


def test_q_s_1_takes_an_unaligned_head_dim_and_ignores_sparse_mode(torch_npu):
    """Decode has no 16-alignment rule on D, and sparse_mode has no effect there (so no compressed mask either)."""
    q, k, v = qkv(2, 4, 2, rows=1, keys=7, dim=24)
    out, lse = fia(torch_npu, q, k, v, sparse_mode=3, actual_seq_lengths_kv=[7, 3])
    attended = (torch.arange(7)[None, :] < torch.tensor([7, 3])[:, None]).view(2, 1, 1, 7)
    expected, expected_lse = dense_fp64(q, k, v, attended, 1.0)
    assert_rows_match(out, lse, expected, expected_lse, attended.any(-1))


PAGED_REFUSALS = {
    "block size 4": ({"block_size": 4}, "block_size"),
    "block size 0": ({"block_size": 0}, "block_size"),
    "block size 1024": ({"block_size": 1024}, "block_size"),
    "Q_S > 1 with block size 16": ({"block_size": 16, "rows": 2}, "multiple of 128"),
    "empty block table": ({"table": torch.zeros(2, 0, dtype=torch.int32), "kv_lens": [0, 0]}, "non-empty"),
    "int64 block table": ({"table": torch.zeros(2, 2, dtype=torch.int64)}, "int32"),
    "no kv lengths": ({"kv_lens": None}, "requires actual_seq_lengths_kv"),
    "table narrower than the lengths": ({"table": torch.zeros(2, 1, dtype=torch.int32)}, "width"),
}


@pytest.mark.parametrize("case", PAGED_REFUSALS, ids=PAGED_REFUSALS)
def test_paged_refusals(torch_npu, case):
    change, message = PAGED_REFUSALS[case]
    block_size, rows = change.get("block_size", 16), change.get("rows", 1)
    k_pages, v_pages = paged_pool(8, max(block_size, 1), 2, 16, torch.bfloat16, seed=7)
    q = torch.randn(2, 4, rows, 16).to(torch.bfloat16)
    table = change.get("table", torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
    kv_lens = change.get("kv_lens", [block_size + 1, 3])
    with pytest.raises(RefusedByNpu, match=message):
        fia(torch_npu, q, k_pages, v_pages, num_key_value_heads=2, block_table=table, block_size=block_size,
            actual_seq_lengths_kv=kv_lens)  # fmt: skip


@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF.keys())
def test_reshape_and_cache_writes_each_token_at_its_page_and_row(torch_npu, dtype):
    block_size, heads, dim = 16, 2, 8
    key_cache = torch.zeros(6, block_size, heads, dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([0, 17, 95, 40, 41], dtype=torch.int32)
    key, value = torch.randn(5, heads, dim).to(dtype), torch.randn(5, heads, dim).to(dtype)
    torch_npu._npu_reshape_and_cache(
        key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_indices=slots
    )
    for token, slot in enumerate(slots.tolist()):
        assert torch.equal(key_cache[slot // block_size, slot % block_size], key[token])
        assert torch.equal(value_cache[slot // block_size, slot % block_size], value[token])
    written = torch.zeros(6 * block_size, dtype=torch.bool)
    written[slots.long()] = True
    assert not key_cache.view(-1, heads, dim)[~written].any()


def test_reshape_and_cache_refuses_fp32_and_int64_slots(torch_npu):
    cache = torch.zeros(2, 16, 2, 8)
    key = torch.randn(3, 2, 8)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(RefusedByNpu, match="float32"):
        torch_npu._npu_reshape_and_cache(key=key, value=key, key_cache=cache, value_cache=cache, slot_indices=slots)
    half_cache, half_key = cache.bfloat16(), key.bfloat16()
    with pytest.raises(RefusedByNpu, match="int32"):
        torch_npu._npu_reshape_and_cache(
            key=half_key, value=half_key, key_cache=half_cache, value_cache=half_cache, slot_indices=slots.long()
        )


def test_unknown_arguments_and_layouts_raise(torch_npu):
    q, k, v = qkv(1, 2, 2, 3, 4)
    with pytest.raises(NotImplementedError, match="pse_shift"):
        fia(torch_npu, q, k, v, pse_shift=q)
    with pytest.raises(NotImplementedError, match="BSH"):
        torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=2, input_layout="BSH")
    with pytest.raises(RefusedByNpu, match="non-contiguous"):
        fia(torch_npu, q, k.transpose(2, 3).contiguous().transpose(2, 3), v)
