"""Forward pass on the CPU (the C++ reference behind the Python API) against NumPy float64."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
import attention_reference as ref
from conftest import assert_close, assert_lse_close, randn


def qkv(rng, batch, seqlen_q, seqlen_k, heads, heads_kv, dim, dim_v=None, dtype="float16"):
    dim_v = dim if dim_v is None else dim_v
    return (randn(rng, (batch, seqlen_q, heads, dim), dtype), randn(rng, (batch, seqlen_k, heads_kv, dim), dtype),
            randn(rng, (batch, seqlen_k, heads_kv, dim_v), dtype))


def check_dense(q, k, v, opts, dtype="float16", **kwargs):
    out, lse = cuflash.flash_attn_func(q, k, v, **kwargs)
    expected_out, expected_lse = ref.forward_dense(q, k, v, opts)
    assert out.dtype == q.dtype
    assert lse.dtype == np.float32
    assert_close(out, expected_out, dtype, what="out")
    assert_lse_close(lse, expected_lse)
    return out, lse


SHAPES = [  # batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v
    (2, 64, 64, 4, 4, 64, 64),
    (1, 17, 33, 6, 2, 32, 32),     # GQA, odd lengths
    (2, 33, 17, 4, 1, 128, 64),    # MQA, Sq > Sk, head_dim != head_dim_v
    (1, 1, 129, 8, 8, 64, 64),     # decode
    (1, 130, 200, 2, 2, 256, 256),  # largest head_dim, more than one 128-block
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_dense(rng, shape, causal):
    q, k, v = qkv(rng, *shape)
    check_dense(q, k, v, ref.Options(causal=causal), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16(rng, causal):
    q, k, v = qkv(rng, 2, 40, 56, 4, 2, 64, dtype="bfloat16")
    out, _ = check_dense(q, k, v, ref.Options(causal=causal), dtype="bfloat16", causal=causal)
    assert out.dtype.name == "bfloat16"


def test_softmax_scale(rng):
    q, k, v = qkv(rng, 1, 24, 40, 2, 2, 64)
    check_dense(q, k, v, ref.Options(scale=0.3), softmax_scale=0.3)


@pytest.mark.parametrize("window", [(8, 0), (4, 4), (None, 3), (5, None), (0, 0), (-1, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_window(rng, window, causal):
    q, k, v = qkv(rng, 2, 48, 64, 4, 2, 32)
    check_dense(q, k, v, ref.Options(causal=causal, window=window), causal=causal, window_size=window)


def test_fully_masked_rows(rng):
    # Sq > Sk with causal: the first Sq - Sk queries see no key: out 0, lse -inf.
    q, k, v = qkv(rng, 1, 40, 24, 2, 2, 32)
    out, lse = check_dense(q, k, v, ref.Options(causal=True), causal=True)
    assert np.all(np.asarray(out[:, :16], dtype=np.float32) == 0)
    assert np.all(np.isneginf(lse[:, :, :16]))


@pytest.mark.parametrize("softcap", [5.0, 30.0])
def test_softcap(rng, softcap):
    q, k, v = qkv(rng, 1, 32, 48, 4, 4, 64)
    q *= 4  # large scores, so that the cap matters
    check_dense(q, k, v, ref.Options(softcap=softcap, causal=True), softcap=softcap, causal=True)


@pytest.mark.parametrize("sink_dtype", ["float32", "bfloat16", "float16"])
def test_learnable_sink(rng, sink_dtype):
    q, k, v = qkv(rng, 2, 40, 24, 4, 2, 32)
    sink = randn(rng, (4,), sink_dtype)
    # causal with Sq > Sk: rows without any key have lse == sink and out == 0.
    out, lse = check_dense(q, k, v, ref.Options(causal=True, sink=sink), causal=True, learnable_sink=sink)
    np.testing.assert_allclose(lse[0, :, 0], np.asarray(sink, dtype=np.float64), rtol=1e-6)
    # A strided sink (every other entry of a longer one) is read as its values.
    wide = np.repeat(sink, 2)
    strided_out, strided_lse = cuflash.flash_attn_func(q, k, v, causal=True, learnable_sink=wide[::2])
    np.testing.assert_array_equal(strided_out, out)
    np.testing.assert_array_equal(strided_lse, lse)


@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("pack_gqa", [None, False, True])
def test_num_splits_and_pack_gqa(rng, num_splits, pack_gqa):
    q, k, v = qkv(rng, 1, 9, 300, 8, 2, 64)
    check_dense(q, k, v, ref.Options(causal=True), causal=True, num_splits=num_splits, pack_gqa=pack_gqa)


def test_func_and_varlen_func_share_options(rng):
    # Every option both functions take, on the dense layout: the two give the reference, bitwise alike.
    q, k, v = qkv(rng, 2, 40, 48, 4, 2, 32)
    q *= 4  # large scores, so that softcap matters
    sink = randn(rng, (4,), "float32")
    options = dict(softmax_scale=0.3, causal=True, window_size=(12, None), learnable_sink=sink, softcap=5.0,
                   num_splits=3, pack_gqa=True, deterministic=True)
    out, lse = check_dense(q, k, v, ref.Options(scale=0.3, causal=True, window=(12, None), sink=sink, softcap=5.0),
                           **options)
    varlen_out, varlen_lse = cuflash.flash_attn_varlen_func(q, k, v, **options)
    np.testing.assert_array_equal(varlen_out, out)
    np.testing.assert_array_equal(varlen_lse, lse)


def test_strided_inputs(rng):
    # q, k, v slices of a packed qkv tensor: strided batch / sequence / head dims, no copies.
    qkv_packed = randn(rng, (2, 30, 3, 4, 64))
    q, k, v = qkv_packed[:, :, 0], qkv_packed[:, :, 1], qkv_packed[:, :, 2]
    assert not q.flags.c_contiguous
    check_dense(q, k, v, ref.Options(causal=True), causal=True)


def test_last_dim_not_contiguous(rng):
    q, k, v = qkv(rng, 1, 16, 16, 2, 2, 32)
    q_t = np.ascontiguousarray(q.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)  # stride(-1) != 1
    check_dense(q_t, k, v, ref.Options())


def test_read_only_inputs(rng):
    q, k, v = qkv(rng, 1, 16, 16, 2, 2, 32)
    for t in (q, k, v):
        t.flags.writeable = False
    check_dense(q, k, v, ref.Options())


# ----------------------------------------------------------------------------------------------
# varlen and paged KV


def packed(rng, lengths, heads, dim, dtype="float16"):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return randn(rng, (int(cu[-1]), heads, dim), dtype), cu


def varlen_reference(q, k, v, cu_q, cu_k, opts, seqused_q=None, seqused_k=None):
    heads, dim_v = q.shape[1], v.shape[2]
    out = np.zeros((q.shape[0], heads, dim_v))
    lse = np.full((heads, q.shape[0]), -np.inf)
    valid = np.zeros(q.shape[0], dtype=bool)
    for b, ((sq0, sq), (sk0, sk)) in enumerate(zip(ref.sequences(cu_q, seqused_q), ref.sequences(cu_k, seqused_k))):
        o, l = ref.forward_one(q[sq0:sq0 + sq], k[sk0:sk0 + sk], v[sk0:sk0 + sk], b, opts)
        out[sq0:sq0 + sq] = o
        lse[:, sq0:sq0 + sq] = l
        valid[sq0:sq0 + sq] = True
    return out, lse, valid


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_kv", [4, 1])
def test_varlen(rng, causal, heads_kv):
    lengths_q = [5, 0, 33, 17]
    lengths_k = [9, 4, 33, 1]
    q, cu_q = packed(rng, lengths_q, 4, 64)
    k, cu_k = packed(rng, lengths_k, heads_kv, 64)
    v = randn(rng, k.shape)
    out, lse = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal)
    expected_out, expected_lse, _ = varlen_reference(q, k, v, cu_q, cu_k, ref.Options(causal=causal))
    assert out.shape == (q.shape[0], 4, 64) and lse.shape == (4, q.shape[0])
    assert_close(out, expected_out, what="out")
    assert_lse_close(lse, expected_lse)


def test_varlen_without_max_seqlen(rng):
    q, cu_q = packed(rng, [7, 20], 2, 32)
    k, cu_k = packed(rng, [30, 3], 2, 32)
    v = randn(rng, k.shape)
    out, lse = cuflash.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, window_size=(4, 1))
    expected_out, expected_lse, _ = varlen_reference(q, k, v, cu_q, cu_k, ref.Options(window=(4, 1)))
    assert_close(out, expected_out, what="out")
    assert_lse_close(lse, expected_lse)


def test_seqused(rng):
    q, cu_q = packed(rng, [12, 20, 8], 4, 32)
    k, cu_k = packed(rng, [16, 25, 8], 2, 32)
    v = randn(rng, k.shape)
    seqused_q = np.array([10, 20, 0], np.int32)
    seqused_k = np.array([16, 7, 3], np.int32)
    out, lse = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, seqused_q=seqused_q, seqused_k=seqused_k,
                                              causal=True)
    expected_out, expected_lse, valid = varlen_reference(q, k, v, cu_q, cu_k, ref.Options(causal=True),
                                                         seqused_q, seqused_k)
    # Rows past seqused_q are not part of the result.
    assert_close(out[valid], expected_out[valid], what="out")
    assert_lse_close(lse[:, valid], expected_lse[:, valid])


def test_varlen_q_dense_k(rng):
    # Packed q with fixed-length k (cu_seqlens_k omitted).
    q, cu_q = packed(rng, [3, 11], 2, 32)
    k = randn(rng, (2, 14, 2, 32))
    v = randn(rng, (2, 14, 2, 32))
    out, lse = cuflash.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, causal=True)
    cu_k = np.array([0, 14, 28], np.int32)
    expected_out, expected_lse, _ = varlen_reference(q, k.reshape(28, 2, 32), v.reshape(28, 2, 32), cu_q, cu_k,
                                                     ref.Options(causal=True))
    assert_close(out, expected_out, what="out")
    assert_lse_close(lse, expected_lse)


@pytest.mark.parametrize("page_size", [16, 1])
def test_paged_kv(rng, page_size):
    batch, heads, heads_kv, dim = 3, 4, 2, 32
    seqused_k = np.array([40, 7, 64], np.int32)
    max_pages = 64 // page_size
    num_pages = batch * max_pages + 5
    k_cache = randn(rng, (num_pages, page_size, heads_kv, dim))
    v_cache = randn(rng, (num_pages, page_size, heads_kv, dim))
    page_table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    q = randn(rng, (batch, 5, heads, dim))
    out, lse = cuflash.flash_attn_varlen_func(q, k_cache, v_cache, seqused_k=seqused_k, page_table=page_table,
                                              causal=True)
    check_paged(out, lse, q, k_cache, v_cache, page_table, seqused_k, ref.Options(causal=True))


def check_paged(out, lse, q, k_cache, v_cache, page_table, seqused_k, opts):
    """out / lse of a paged call against the reference on each sequence's keys from its pages."""
    for b in range(q.shape[0]):
        keys = k_cache[page_table[b]].reshape(-1, *k_cache.shape[2:])[: seqused_k[b]]
        values = v_cache[page_table[b]].reshape(-1, *v_cache.shape[2:])[: seqused_k[b]]
        o, l = ref.forward_one(q[b], keys, values, b, opts)
        assert_close(out[b], o, what=f"out[{b}]")
        assert_lse_close(lse[b], l, what=f"lse[{b}]")


# ----------------------------------------------------------------------------------------------
# Built-in mask_mod / score_mod variants


def document_ids(rng, batch, length):
    ids = np.zeros((batch, length), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, length), size=3, replace=False))
        ids[b] = np.searchsorted(cuts, np.arange(length), side="right")
    return ids


@pytest.mark.parametrize("causal", [False, True])
def test_mask_document(rng, causal):
    q, k, v = qkv(rng, 2, 50, 50, 4, 2, 32)
    doc = document_ids(rng, 2, 50)
    opts = ref.Options(causal=causal, mask=lambda b, i, j: doc[b][i] == doc[b][j])
    check_dense(q, k, v, opts, causal=causal, mask_mod=cuflash.masks.document(doc))


def test_mask_document_int64_ids(rng):
    q, k, v = qkv(rng, 1, 20, 20, 2, 2, 32)
    doc = document_ids(rng, 1, 24).astype(np.int64)  # converted; L may exceed the sequence
    opts = ref.Options(mask=lambda b, i, j: doc[b][i] == doc[b][j])
    check_dense(q, k, v, opts, mask_mod=cuflash.masks.document(doc))


def test_mask_prefix_lm(rng):
    q, k, v = qkv(rng, 1, 40, 40, 2, 2, 32)
    opts = ref.Options(mask=lambda b, i, j: (j <= i) | (j < 12))
    check_dense(q, k, v, opts, mask_mod=cuflash.masks.prefix_lm(12))


def test_mask_causal_top_left(rng):
    # mask_mod causal is top-left aligned: with Sk > Sq it differs from causal=True.
    q, k, v = qkv(rng, 1, 20, 36, 2, 2, 32)
    check_dense(q, k, v, ref.Options(mask=lambda b, i, j: j <= i), mask_mod=cuflash.masks.causal())


def test_mask_sliding_window(rng):
    q, k, v = qkv(rng, 2, 45, 45, 2, 1, 32)
    opts = ref.Options(mask=lambda b, i, j: (j >= i - 6) & (j <= i + 2))
    check_dense(q, k, v, opts, mask_mod=cuflash.masks.sliding_window(6, 2))


def test_mask_with_window_intersects(rng):
    q, k, v = qkv(rng, 1, 30, 30, 2, 2, 32)
    opts = ref.Options(window=(3, 3), mask=lambda b, i, j: (j <= i) | (j < 5))
    check_dense(q, k, v, opts, window_size=(3, 3), mask_mod=cuflash.masks.prefix_lm(5))


def varlen_case(rng, heads=4, heads_kv=2, dim=32):
    q, cu_q = packed(rng, [9, 30, 1], heads, dim)
    k, cu_k = packed(rng, [12, 30, 20], heads_kv, dim)
    v = randn(rng, k.shape)
    return q, k, v, cu_q, cu_k


def check_varlen(q, k, v, cu_q, cu_k, opts, **kwargs):
    out, lse = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, **kwargs)
    expected_out, expected_lse, _ = varlen_reference(q, k, v, cu_q, cu_k, opts)
    assert_close(out, expected_out, what="out")
    assert_lse_close(lse, expected_lse)


@pytest.mark.parametrize("causal", [False, True])
def test_score_alibi(rng, causal):
    q, k, v, cu_q, cu_k = varlen_case(rng)
    slopes = cuflash.scores.alibi_slopes(4)
    opts = ref.Options(causal=causal, score_bias=lambda b, h, i, j: slopes[h] * (j - i))
    check_varlen(q, k, v, cu_q, cu_k, opts, causal=causal, score_mod=cuflash.scores.alibi(slopes))


def test_score_alibi_from_aux_tensors(rng):
    q, k, v, cu_q, cu_k = varlen_case(rng)
    slopes = rng.uniform(0.01, 0.5, size=4).astype(np.float32)
    opts = ref.Options(score_bias=lambda b, h, i, j: slopes[h] * (j - i))
    check_varlen(q, k, v, cu_q, cu_k, opts, score_mod=cuflash.scores.alibi(), aux_tensors=[slopes])


def test_score_alibi_after_softcap(rng):
    # The built-in score_mod on the soft-capped score (DESIGN.md section 1).
    q, k, v, cu_q, cu_k = varlen_case(rng)
    slopes = cuflash.scores.alibi_slopes(4)
    opts = ref.Options(causal=True, softcap=5.0, score_bias=lambda b, h, i, j: slopes[h] * (j - i))
    check_varlen(q, k, v, cu_q, cu_k, opts, causal=True, softcap=5.0, score_mod=cuflash.scores.alibi(slopes))


def test_score_alibi_dense(rng):
    q, k, v = qkv(rng, 2, 20, 28, 4, 4, 32)
    slopes = cuflash.scores.alibi_slopes(4)
    out, lse = cuflash.flash_attn_varlen_func(q, k, v, score_mod=cuflash.scores.alibi(list(slopes)))
    expected_out, expected_lse = ref.forward_dense(
        q, k, v, ref.Options(score_bias=lambda b, h, i, j: slopes[h] * (j - i)))
    assert_close(out, expected_out, what="out")
    assert_lse_close(lse, expected_lse)


def test_score_relative_bias(rng):
    q, k, v, cu_q, cu_k = varlen_case(rng)
    radius = 5
    table = rng.standard_normal((4, 2 * radius + 1)).astype(np.float32)
    opts = ref.Options(causal=True, score_bias=lambda b, h, i, j: table[h, np.clip(j - i, -radius, radius) + radius])
    check_varlen(q, k, v, cu_q, cu_k, opts, causal=True, score_mod=cuflash.scores.relative_bias(table))


def test_alibi_slopes():
    slopes = cuflash.scores.alibi_slopes(8)
    np.testing.assert_allclose(slopes, [2.0 ** (-(i + 1)) for i in range(8)], rtol=1e-6)
    assert cuflash.scores.alibi_slopes(12).shape == (12,)


# ----------------------------------------------------------------------------------------------
# Block sparsity (FlexAttention BlockMask lists, 128 x 128 blocks)


def random_block_lists(rng, batch, heads_b, rows, cols, density=0.5):
    cnt = np.zeros((batch, heads_b, rows), np.int32)
    idx = np.zeros((batch, heads_b, rows, cols), np.int32)
    for b in range(batch):
        for h in range(heads_b):
            for m in range(rows):
                chosen = np.flatnonzero(rng.random(cols) < density)
                cnt[b, h, m] = len(chosen)
                idx[b, h, m, : len(chosen)] = rng.permutation(chosen)
    return cnt, idx


def split_full_and_mask(rng, cnt, idx):
    """Splits each row's blocks into a full and a mask list."""
    full_cnt, mask_cnt = np.zeros_like(cnt), np.zeros_like(cnt)
    full_idx, mask_idx = np.zeros_like(idx), np.zeros_like(idx)
    for pos in np.ndindex(cnt.shape):
        blocks = idx[pos][: cnt[pos]]
        is_full = rng.random(len(blocks)) < 0.5
        full, mask = blocks[is_full], blocks[~is_full]
        full_cnt[pos], mask_cnt[pos] = len(full), len(mask)
        full_idx[pos][: len(full)] = full
        mask_idx[pos][: len(mask)] = mask
    return full_cnt, full_idx, mask_cnt, mask_idx


@pytest.mark.parametrize("heads_b", [1, 4])
@pytest.mark.parametrize("with_mask_mod", [False, True])
def test_block_sparse(rng, heads_b, with_mask_mod):
    batch, seqlen_q, seqlen_k = 2, 300, 260
    q, k, v = qkv(rng, batch, seqlen_q, seqlen_k, 4, 2, 32)
    cnt, idx = random_block_lists(rng, batch, heads_b, 3, 3, density=0.7)
    full_cnt, full_idx, mask_cnt, mask_idx = split_full_and_mask(rng, cnt, idx)
    mask_mod = cuflash.masks.sliding_window(100, 40) if with_mask_mod else None
    mask = (lambda b, i, j: (j >= i - 100) & (j <= i + 40)) if with_mask_mod else None
    opts = ref.Options(causal=True, mask=mask,
                       blocks=ref.block_masks((full_cnt, full_idx), (mask_cnt, mask_idx), seqlen_q, seqlen_k))
    check_dense(q, k, v, opts, causal=True, mask_mod=mask_mod, full_block_cnt=full_cnt, full_block_idx=full_idx,
                mask_block_cnt=mask_cnt, mask_block_idx=mask_idx)


def internal_forward(q, k, v, causal=False, **specific):
    from cuflash import interface

    return interface._forward(q, k, v, None, causal, (None, None), None, 0.0, 1, None, False, **specific)


def varlen_block_lists_case(rng, heads=4):
    """Three packed sequences (q 130 / 300 / 40 rows, k 200 / 300 / 169 keys: total_k 669 is 6
    blocks, the longest 3) and broadcast lists for 128 x 128 blocks over the longest (3 x 3):
    q, k, v, cu_q, cu_k and (full_cnt, full_idx, mask_cnt, mask_idx)."""
    q, cu_q = packed(rng, [130, 300, 40], heads, 32)
    k, cu_k = packed(rng, [200, 300, 169], 2, 32)
    v = randn(rng, k.shape)
    cnt, idx = random_block_lists(rng, 3, 1, 3, 3, density=0.7)
    return q, k, v, cu_q, cu_k, split_full_and_mask(rng, cnt, idx)


def test_block_sparse_varlen(rng):
    # Lists per sequence, counted over the longest (max_seqlen_q / max_seqlen_k): positions in
    # each sequence's blocks count from its start.
    q, k, v, cu_q, cu_k, (full_cnt, full_idx, mask_cnt, mask_idx) = varlen_block_lists_case(rng)
    opts = ref.Options(causal=True, mask=lambda b, i, j: (j >= i - 100) & (j <= i + 40),
                       blocks=ref.block_masks((full_cnt, full_idx), (mask_cnt, mask_idx), 300, 300))
    # The public signatures are the seed's, whose varlen function takes no lists: the internal
    # forward (as the seed's _flash_attn_fwd) takes both.
    lists = (mask_cnt, mask_idx, full_cnt, full_idx)
    out, lse = internal_forward(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=300,
                                max_seqlen_k=300, mask_mod=cuflash.masks.sliding_window(100, 40), block_sparse=lists)
    expected_out, expected_lse, _ = varlen_reference(q, k, v, cu_q, cu_k, opts)
    assert_close(out, expected_out, what="out")
    assert_lse_close(lse, expected_lse)
    # On the CPU the hints may be left out: the longest sequences are read from cu_seqlens (on
    # the GPU that read would wait for the device, so there the hints are required).
    for hints in ({"max_seqlen_k": 300}, {"max_seqlen_q": 300}, {}):
        out_read, lse_read = internal_forward(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                              mask_mod=cuflash.masks.sliding_window(100, 40), block_sparse=lists,
                                              **hints)
        np.testing.assert_array_equal(out_read, out)
        np.testing.assert_array_equal(lse_read, lse)
    # Lists counted over other lengths than the longest sequences are refused by shape.
    with pytest.raises(ValueError, match="block"):
        internal_forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=600, max_seqlen_k=300,
                         block_sparse=lists)


def test_block_sparse_paged(rng):
    # Lists over the keys the page table addresses (max_pages * page_size = 320: 3 column
    # blocks), against the same lists on the keys gathered from the pages.
    batch, heads, heads_kv, dim, page_size, max_pages = 2, 4, 2, 32, 32, 10
    seqused_k = np.array([300, 170], np.int32)
    num_pages = batch * max_pages + 3
    k_cache = randn(rng, (num_pages, page_size, heads_kv, dim))
    v_cache = randn(rng, (num_pages, page_size, heads_kv, dim))
    page_table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    q = randn(rng, (batch, 150, heads, dim))
    cnt, idx = random_block_lists(rng, batch, heads, 2, 3, density=0.7)
    full_cnt, full_idx, mask_cnt, mask_idx = split_full_and_mask(rng, cnt, idx)
    out, lse = internal_forward(q, k_cache, v_cache, seqused_k=seqused_k, page_table=page_table,
                                block_sparse=(mask_cnt, mask_idx, full_cnt, full_idx), mask_mod=cuflash.masks.causal())
    opts = ref.Options(mask=lambda b, i, j: j <= i,
                       blocks=ref.block_masks((full_cnt, full_idx), (mask_cnt, mask_idx), 150, max_pages * page_size))
    check_paged(out, lse, q, k_cache, v_cache, page_table, seqused_k, opts)


def test_block_mask_builder_matches_mask(rng):
    doc = document_ids(rng, 2, 300)
    mask_mod = cuflash.masks.document(doc)
    lists = cuflash.block_sparse.create_block_mask(mask_mod, 2, None, 300, 300)
    q, k, v = qkv(rng, 2, 300, 300, 2, 2, 32)
    opts = ref.Options(mask=lambda b, i, j: doc[b][i] == doc[b][j])
    check_dense(q, k, v, opts, mask_mod=mask_mod, **lists._asdict())


def test_block_mask_builder_takes_flexattention_arguments(rng):
    # FlexAttention's create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE): a
    # callable mask_mod(b, h, q_idx, kv_idx) evaluated per head, B / H None broadcast, and the
    # same lists from the callable as from the built-in.
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    built_in = cuflash.block_sparse.create_block_mask(cuflash.masks.causal(), None, None, 300, 200,
                                                      BLOCK_SIZE=128)
    from_callable = cuflash.block_sparse.create_block_mask(causal, None, None, 300, 200, device="cpu")
    for a, b in zip(built_in, from_callable):
        np.testing.assert_array_equal(a, b)
    assert built_in.mask_block_cnt.shape == (1, 1, 3) and built_in.mask_block_idx.shape == (1, 1, 3, 2)
    # Row block 0 (rows 0-127) sees column block 0 in part; row block 2 sees both column blocks whole.
    assert list(built_in.mask_block_cnt[0, 0]) == [1, 1, 0]
    assert list(built_in.full_block_cnt[0, 0]) == [0, 1, 2]

    # A head-dependent callable gets one list per head; head 0's (causal) drive a causal call.
    def every_other_head_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) | (h % 2 == 1)

    lists = cuflash.block_sparse.create_block_mask(every_other_head_causal, 2, 2, 256, 256, BLOCK_SIZE=(128, 128))
    assert lists.full_block_cnt.shape == (2, 2, 2)
    assert list(lists.full_block_cnt[0, 1]) == [2, 2] and list(lists.full_block_cnt[0, 0]) == [0, 1]
    q, k, v = qkv(rng, 2, 256, 256, 2, 2, 32)
    opts = ref.Options(mask=lambda b, i, j: j <= i)
    check_dense(q[:, :, :1], k[:, :, :1], v[:, :, :1], opts, mask_mod=cuflash.masks.causal(),
                **{name: np.ascontiguousarray(x[:, :1]) for name, x in lists._asdict().items()})

    # Lists of one batch entry (B=None, or FlexAttention's BlockMask with B=1) hold for every
    # sequence of the call.
    q, k, v = qkv(rng, 3, 300, 200, 2, 2, 32)
    check_dense(q, k, v, ref.Options(mask=lambda b, i, j: j <= i), mask_mod=cuflash.masks.causal(),
                **built_in._asdict())

    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        cuflash.block_sparse.create_block_mask(causal, 1, 1, 64, 64, BLOCK_SIZE=(128, 128, 1))
    # The attention functions read the arrays as 128 x 128 blocks: other sizes are refused (they
    # would be read wrongly where the block counts happen to agree, e.g. 200 for 256 keys).
    for size in (200, (64, 128), 2.9, True):
        with pytest.raises(ValueError, match="^BLOCK_SIZE: "):
            cuflash.block_sparse.create_block_mask(causal, 1, 1, 256, 256, BLOCK_SIZE=size)
    with pytest.raises(ValueError, match="H: expected"):
        cuflash.block_sparse.create_block_mask(causal, 1, 0, 64, 64)
    with pytest.raises(ValueError, match="B: expected"):
        cuflash.block_sparse.create_block_mask(causal, True, 1, 64, 64)
    with pytest.raises(TypeError, match="mask_mod: evaluating it"):
        cuflash.block_sparse.create_block_mask(lambda b, h, q_idx, kv_idx: undefined_name, 1, 1, 64, 64)  # noqa: F821


def test_transpose_block_lists(rng):
    cnt, idx = random_block_lists(rng, 2, 3, 4, 5)
    q_cnt, q_idx = cuflash.block_sparse.transpose_block_lists(cnt, idx)
    assert q_cnt.shape == (2, 3, 5) and q_idx.shape == (2, 3, 5, 4)
    for b, h, n in np.ndindex(2, 3, 5):
        expected = [m for m in range(4) if n in idx[b, h, m, : cnt[b, h, m]]]
        assert list(q_idx[b, h, n, : q_cnt[b, h, n]]) == expected


# ----------------------------------------------------------------------------------------------
# Combine


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("out_dtype", [None, "float16", "bfloat16"])
def test_combine(rng, varlen, out_dtype):
    shape = (3, 37, 4, 64) if varlen else (3, 2, 19, 4, 64)
    out_partial = rng.standard_normal(shape).astype(np.float32)
    lse_partial = rng.standard_normal(shape[:-1]).astype(np.float32) * 3
    lse_partial[0, 1] = -np.inf  # one split that saw no key
    lse_partial.reshape(3, -1, 4)[:, 2] = -np.inf  # a row that no split saw
    dtype = None if out_dtype is None else (out_dtype if out_dtype == "float16" else
                                            pytest.importorskip("ml_dtypes").bfloat16)
    out, lse = cuflash.flash_attn_combine(out_partial, lse_partial, out_dtype=dtype)
    expected_out, expected_lse = ref.combine(out_partial, lse_partial)
    assert out.shape == shape[1:] and lse.shape == shape[1:-1]
    assert lse.dtype == np.float32
    tolerance = {None: "float16", "float16": "float16", "bfloat16": "bfloat16"}[out_dtype]
    assert_close(out, expected_out, tolerance, what="out")
    assert_lse_close(lse, expected_lse)


def test_combine_into_out_without_lse(rng):
    out_partial = rng.standard_normal((2, 1, 8, 2, 32)).astype(np.float32)
    lse_partial = rng.standard_normal((2, 1, 8, 2)).astype(np.float32)
    out = np.empty((1, 8, 2, 32), np.float16)
    result, lse = cuflash.flash_attn_combine(out_partial, lse_partial, out=out, return_lse=False)
    assert result is out and lse is None
    assert_close(out, ref.combine(out_partial, lse_partial)[0], what="out")
    # out_dtype names the dtype of an out allocated by the call: with out given, only its own.
    assert cuflash.flash_attn_combine(out_partial, lse_partial, out=out, out_dtype="float16")[0] is out
    with pytest.raises(TypeError, match="^out_dtype: float32 differs from out's dtype float16"):
        cuflash.flash_attn_combine(out_partial, lse_partial, out=out, out_dtype="float32")


def test_combine_into_padded_and_permuted_out(rng):
    out_partial = rng.standard_normal((2, 1, 8, 2, 32)).astype(np.float32)
    lse_partial = rng.standard_normal((2, 1, 8, 2)).astype(np.float32)
    expected = ref.combine(out_partial, lse_partial)[0]
    padded = np.zeros((1, 8, 2, 48), np.float32)[..., :32]
    permuted = np.zeros((1, 2, 8, 32), np.float32).transpose(0, 2, 1, 3)
    for out in (padded, permuted):
        result, _ = cuflash.flash_attn_combine(out_partial, lse_partial, out=out)
        assert result is out
        assert_close(out, expected, what="out")


def test_combine_matches_split_attention(rng):
    # Two halves of the keys attended separately, then combined, equal attention over all keys.
    q, k, v = qkv(rng, 1, 16, 64, 2, 2, 32)
    parts = [ref.forward_dense(q, k[:, s], v[:, s], ref.Options()) for s in (slice(0, 40), slice(40, 64))]
    out_partial = np.stack([p[0] for p in parts]).astype(np.float32)
    lse_partial = np.stack([p[1].transpose(0, 2, 1) for p in parts]).astype(np.float32)  # (splits, B, S, H)
    out, lse = cuflash.flash_attn_combine(out_partial, lse_partial)
    expected_out, expected_lse = ref.forward_dense(q, k, v, ref.Options())
    assert_close(out, expected_out, what="out")
    assert_lse_close(lse, expected_lse.transpose(0, 2, 1))


def test_combine_varlen_cu_seqlens(rng):
    out_partial = rng.standard_normal((4, 20, 2, 32)).astype(np.float32)
    lse_partial = rng.standard_normal((4, 20, 2)).astype(np.float32)
    cu = np.array([0, 5, 5, 20], np.int32)
    out, lse = cuflash.flash_attn_combine(out_partial, lse_partial, cu_seqlens=cu)
    expected_out, expected_lse = ref.combine(out_partial, lse_partial)
    assert_close(out, expected_out, what="out")
    assert_lse_close(lse, expected_lse)


# ----------------------------------------------------------------------------------------------
# flash_attn_forward: every option at once, outputs in place


def test_forward_function_matches_func(rng):
    q, k, v = qkv(rng, 2, 33, 40, 4, 2, 32)
    sink = rng.standard_normal(4).astype(np.float32)
    options = dict(causal=True, window_size=(9, None), softcap=20.0, learnable_sink=sink)
    out, lse = cuflash.flash_attn_func(q, k, v, **options)
    out_f, lse_f = cuflash.flash_attn_forward(q, k, v, return_lse=True, **options)
    np.testing.assert_array_equal(out_f, out)
    np.testing.assert_array_equal(lse_f, lse)
    # Without return_lse (the default, as the seed's) no lse is computed.
    out_f, lse_f = cuflash.flash_attn_forward(q, k, v, **options)
    assert lse_f is None
    np.testing.assert_array_equal(out_f, out)


def test_forward_into_preallocated_out_and_lse(rng):
    # A permuted out and an lse padded along its rows: written in place and returned; the
    # padding is left alone; values as allocated outputs get them.
    q, k, v = qkv(rng, 2, 33, 40, 4, 2, 32, dim_v=64)
    expected_out, expected_lse = cuflash.flash_attn_func(q, k, v, causal=True)
    out = np.full((2, 4, 33, 64), 7, np.float16).transpose(0, 2, 1, 3)
    lse_buffer = np.full((2, 4, 40), 5, np.float32)
    lse = lse_buffer[:, :, :33]
    result, result_lse = cuflash.flash_attn_forward(q, k, v, causal=True, out=out, lse=lse)
    assert result is out and result_lse is lse  # lse given: written whatever return_lse says
    np.testing.assert_array_equal(out, expected_out)
    np.testing.assert_array_equal(lse, expected_lse)
    assert np.all(lse_buffer[:, :, 33:] == 5)


def test_forward_into_preallocated_varlen_out_leaves_unowned_rows(rng):
    # Packed rows past cu_seqlens_q[-1] belong to no sequence: an allocated out has them zeroed,
    # a caller's out keeps what it held there.
    q, cu_q = packed(rng, [6, 11], 4, 32)
    k, cu_k = packed(rng, [9, 13], 2, 32)
    v = randn(rng, k.shape)
    q_pad = np.concatenate([q, randn(rng, (5, 4, 32))])
    expected, _ = cuflash.flash_attn_varlen_func(q_pad, k, v, cu_q, cu_k, 11, 13)
    out = np.full(expected.shape, 3, np.float16)
    result, lse = cuflash.flash_attn_forward(q_pad, k, v, cu_q, cu_k, 11, 13, out=out)
    assert result is out and lse is None
    np.testing.assert_array_equal(out[:17], expected[:17])
    assert np.all(out[17:] == 3) and np.all(expected[17:] == 0)


def test_forward_mask_mod_and_block_lists_over_packed_sequences(rng):
    # What neither public signature of the seed takes together: a mask_mod, block lists and
    # packed sequences.
    q, k, v, cu_q, cu_k, (full_cnt, full_idx, mask_cnt, mask_idx) = varlen_block_lists_case(rng)
    opts = ref.Options(causal=True, mask=lambda b, i, j: (j >= i - 100) & (j <= i + 40),
                       blocks=ref.block_masks((full_cnt, full_idx), (mask_cnt, mask_idx), 300, 300))
    out, lse = cuflash.flash_attn_forward(q, k, v, cu_q, cu_k, 300, 300, causal=True,
                                          mask_mod=cuflash.masks.sliding_window(100, 40),
                                          full_block_cnt=full_cnt, full_block_idx=full_idx,
                                          mask_block_cnt=mask_cnt, mask_block_idx=mask_idx, return_lse=True)
    expected_out, expected_lse, _ = varlen_reference(q, k, v, cu_q, cu_k, opts)
    assert_close(out, expected_out, what="out")
    assert_lse_close(lse, expected_lse)


def test_forward_score_mod_over_fixed_length(rng):
    q, k, v = qkv(rng, 2, 30, 30, 4, 4, 32)
    slopes = cuflash.scores.alibi_slopes(4)
    opts = ref.Options(causal=True, score_bias=lambda b, h, i, j: slopes[h] * (j - i))
    out, lse = cuflash.flash_attn_forward(q, k, v, causal=True, score_mod=cuflash.scores.alibi(slopes),
                                          return_lse=True)
    expected_out, expected_lse = ref.forward_dense(q, k, v, opts)
    assert_close(out, expected_out, what="out")
    assert_lse_close(lse, expected_lse)


def test_forward_refuses_wrong_outputs(rng):
    q, k, v = qkv(rng, 1, 16, 16, 2, 2, 32)
    with pytest.raises(ValueError, match="^out: expected shape"):
        cuflash.flash_attn_forward(q, k, v, out=np.empty((1, 16, 2, 16), np.float16))
    with pytest.raises(TypeError, match="^out: expected dtype float16"):
        cuflash.flash_attn_forward(q, k, v, out=np.empty((1, 16, 2, 32), np.float32))
    with pytest.raises(ValueError, match="^lse: expected shape"):
        cuflash.flash_attn_forward(q, k, v, lse=np.empty((1, 16, 2), np.float32))
    with pytest.raises(TypeError, match="^lse: expected dtype float32"):
        cuflash.flash_attn_forward(q, k, v, lse=np.empty((1, 2, 16), np.float16))
    with pytest.raises(TypeError, match="^return_lse: expected a bool"):
        cuflash.flash_attn_forward(q, k, v, return_lse=1)
    with pytest.raises(ValueError, match="^out: is read-only"):
        cuflash.flash_attn_forward(q, k, v, out=np.broadcast_to(np.empty((1, 1, 2, 32), np.float16), (1, 16, 2, 32)))
    # An output that starts where an input or the other output does (out=q, lse in out).
    with pytest.raises(ValueError, match="^out: shares its memory with q"):
        cuflash.flash_attn_forward(q, k, v, out=q)
    buffer = np.empty(16 * 2 * 32, np.float16)
    with pytest.raises(ValueError, match="^lse: shares its memory with out"):
        cuflash.flash_attn_forward(q, k, v, out=buffer.reshape(1, 16, 2, 32),
                                   lse=buffer[:64].view(np.float32).reshape(1, 2, 16))
    # Two elements at one address: refused by the C++ checks, by name.
    base = np.empty((1, 1, 2, 32), np.float16)
    overlapping = np.lib.stride_tricks.as_strided(base, (1, 16, 2, 32), (0, 0, 64, 2), writeable=True)
    with pytest.raises(ValueError, match="^out: expected a non-zero stride"):
        cuflash.flash_attn_forward(q, k, v, out=overlapping)


# ----------------------------------------------------------------------------------------------
# Package surface


def test_package_surface():
    assert callable(cuflash.flash_attn_func) and cuflash.flash_attn_func.__doc__
    assert isinstance(cuflash.__version__, str) and cuflash.__version__
    assert isinstance(cuflash.built_kernels(), list)
    assert isinstance(cuflash.cuda_available(), bool)
    assert repr(cuflash.masks.prefix_lm(3)) == "cuflash.masks.prefix_lm(3.0)"


def test_import_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, cuflash; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_gpu_inputs_with_unaligned_strides_are_copied():
    # On the GPU the kernels read q / k / v / dout by TMA, whose strides are multiples of 16
    # bytes: other layouts go in as contiguous copies (the C++ API refuses them instead). A
    # framework that says its arrays live on the GPU shows which inputs are copied.
    from cuflash import interface
    from cuflash._tensors import NumpyFramework

    class OnGpu(NumpyFramework):
        def device(self, x):
            return ("cuda", 0)

        def contiguous(self, x):
            return ("copied", np.ascontiguousarray(x))

    framework = OnGpu()
    heads_130 = np.zeros((2, 10, 4, 130), np.float16)[..., :128]  # head stride 130 elements
    assert interface._maybe_contiguous(framework, heads_130)[0] == "copied"
    aligned = np.zeros((2, 10, 4, 136), np.float16)[..., :128]  # 136 elements: 272 bytes
    assert interface._maybe_contiguous(framework, aligned) is aligned
    # A dimension of size 1 is never stepped over, whatever its stride.
    one_head = np.lib.stride_tricks.as_strided(np.zeros((2, 10, 1, 128), np.float16),
                                               strides=(10 * 128 * 2, 128 * 2, 3 * 2, 2))
    assert interface._maybe_contiguous(framework, one_head) is one_head
    # On the CPU (the reference) any stride is read as it is.
    assert interface._maybe_contiguous(NumpyFramework(), heads_130) is heads_130

    # A start that is not 16-byte aligned (a view from an element offset) is copied too.
    class OnGpuAt(OnGpu):
        def __init__(self, offset):
            self.offset = offset

        def address(self, x):
            return 4096 + self.offset

    contiguous = np.zeros((2, 10, 4, 128), np.float16)
    assert OnGpuAt(2).address(contiguous) % 16 == 2
    assert interface._maybe_contiguous(OnGpuAt(2), contiguous)[0] == "copied"
    assert interface._maybe_contiguous(OnGpuAt(16), contiguous) is contiguous
