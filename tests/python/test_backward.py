"""Backward pass on the CPU through cuflash.flash_attn_backward (NumPy, no autograd) against the
NumPy float64 reference gradients."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
import attention_reference as ref
from conftest import assert_close, randn
from test_forward import document_ids, packed, random_block_lists, split_full_and_mask


def grad_scale(x) -> float:
    return max(1.0, float(np.abs(x).max()))


def check_grads(actual, expected, dtype="float16"):
    for name, a, e in zip(("dq", "dk", "dv"), actual[:3], expected[:3]):
        assert a.dtype == np.dtype(a.dtype)  # same dtype as the input, checked by the caller
        assert_close(a, e, dtype, scale=grad_scale(e), what=name)
    if expected[3] is not None:
        assert actual[3] is not None and actual[3].dtype == np.float32
        np.testing.assert_allclose(actual[3], expected[3], atol=2e-3 * grad_scale(expected[3]), rtol=1e-2,
                                   err_msg="d_sink")


def run_dense(rng, shape, opts: ref.Options, dtype="float16", **kwargs):
    batch, seqlen_q, seqlen_k, heads, heads_kv, dim, dim_v = shape
    q = randn(rng, (batch, seqlen_q, heads, dim), dtype)
    k = randn(rng, (batch, seqlen_k, heads_kv, dim), dtype)
    v = randn(rng, (batch, seqlen_k, heads_kv, dim_v), dtype)
    out, lse = cuflash.flash_attn_func(q, k, v, **kwargs)
    dout = randn(rng, out.shape, dtype)
    backward_kwargs = {key: value for key, value in kwargs.items() if key not in ("num_splits", "pack_gqa")}
    grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, **backward_kwargs)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
    check_grads(grads, ref.backward_dense(dout, q, k, v, out, opts), dtype)


SHAPES = [
    (2, 32, 32, 4, 4, 64, 64),
    (1, 17, 40, 6, 2, 32, 32),   # GQA
    (2, 40, 17, 4, 1, 64, 32),   # MQA, Sq > Sk, head_dim != head_dim_v
    (1, 130, 140, 2, 2, 128, 128),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_dense(rng, shape, causal):
    run_dense(rng, shape, ref.Options(causal=causal), causal=causal)


def test_bfloat16(rng):
    run_dense(rng, (1, 24, 24, 2, 2, 32, 32), ref.Options(causal=True), dtype="bfloat16", causal=True)


@pytest.mark.parametrize("window", [(8, 0), (3, 5)])
def test_window(rng, window):
    run_dense(rng, (1, 40, 48, 4, 2, 32, 32), ref.Options(window=window), window_size=window)


def test_softcap(rng):
    run_dense(rng, (1, 24, 32, 2, 2, 64, 64), ref.Options(softcap=2.0, scale=0.5), softcap=2.0, softmax_scale=0.5)


def test_learnable_sink(rng):
    sink = randn(rng, (4,), "float32")
    run_dense(rng, (2, 30, 20, 4, 2, 32, 32), ref.Options(causal=True, sink=sink), causal=True, learnable_sink=sink)


def test_deterministic(rng):
    run_dense(rng, (1, 20, 20, 2, 2, 32, 32), ref.Options(), deterministic=True)


def test_document_mask(rng):
    doc = document_ids(rng, 2, 36)
    opts = ref.Options(mask=lambda b, i, j: doc[b][i] == doc[b][j])
    run_dense(rng, (2, 36, 36, 2, 2, 32, 32), opts, mask_mod=cuflash.masks.document(doc))


def test_block_sparse(rng):
    batch, seqlen = 1, 260
    cnt, idx = random_block_lists(rng, batch, 1, 3, 3, density=0.7)
    full_cnt, full_idx, mask_cnt, mask_idx = split_full_and_mask(rng, cnt, idx)
    opts = ref.Options(mask=lambda b, i, j: j <= i + 50,
                       blocks=ref.block_masks((full_cnt, full_idx), (mask_cnt, mask_idx), seqlen, seqlen))
    # The backward's q-direction lists are built by transposition inside flash_attn_backward.
    run_dense(rng, (batch, seqlen, seqlen, 2, 2, 32, 32), opts, mask_mod=cuflash.masks.sliding_window(1000, 50),
              full_block_cnt=full_cnt, full_block_idx=full_idx, mask_block_cnt=mask_cnt, mask_block_idx=mask_idx)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen(rng, causal):
    lengths_q, lengths_k = [5, 0, 21], [9, 4, 21]
    q, cu_q = packed(rng, lengths_q, 4, 32)
    k, cu_k = packed(rng, lengths_k, 2, 32)
    v = randn(rng, k.shape)
    slopes = cuflash.scores.alibi_slopes(4)
    kwargs = dict(causal=causal, score_mod=cuflash.scores.alibi(slopes))
    out, lse = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), **kwargs)
    dout = randn(rng, out.shape)
    grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                        **kwargs)
    opts = ref.Options(causal=causal, score_bias=lambda b, h, i, j: slopes[h] * (j - i))
    expected = ref.backward_packed(dout, q, k, v, out, cu_q, cu_k, opts)
    check_grads(grads, expected)


@pytest.mark.parametrize("causal", [False, True])
def test_gradient_of_lse(rng, causal):
    # dlse: a loss that also uses lse. Causal (Sq > Sk, no sink): the first rows see no key, their
    # lse is -inf and their dlse (NaN here) must not be read.
    sink = None if causal else randn(rng, (4,), "float32")
    q = randn(rng, (2, 30, 4, 32))
    k, v = randn(rng, (2, 20, 2, 32)), randn(rng, (2, 20, 2, 32))
    out, lse = cuflash.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink, softcap=3.0)
    dout = randn(rng, out.shape)
    dlse = randn(rng, lse.shape, "float32")
    dlse[np.isneginf(lse)] = np.nan
    assert np.isneginf(lse).any() == causal
    grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, learnable_sink=sink, softcap=3.0,
                                        dlse=dlse)
    opts = ref.Options(causal=causal, sink=sink, softcap=3.0)
    check_grads(grads, ref.backward_dense(dout, q, k, v, out, opts, dlse=dlse))
    # Without dlse the gradients differ (the same call drops its term).
    plain = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, learnable_sink=sink, softcap=3.0)
    assert not np.allclose(plain[0], grads[0])

    lengths = [7, 0, 12]
    qp, cu_q = packed(rng, lengths, 2, 32)
    kp, cu_k = packed(rng, lengths, 2, 32)
    vp = randn(rng, kp.shape)
    out, lse = cuflash.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, max(lengths), max(lengths), causal=causal)
    dout = randn(rng, out.shape)
    dlse = randn(rng, lse.shape, "float32")
    grads = cuflash.flash_attn_backward(dout, qp, kp, vp, out, lse, cu_q, cu_k, max(lengths), max(lengths),
                                        causal=causal, dlse=dlse)
    check_grads(grads, ref.backward_packed(dout, qp, kp, vp, out, cu_q, cu_k, ref.Options(causal=causal), dlse))


def test_gradient_of_lse_checked(rng):
    q = randn(rng, (1, 8, 2, 32))
    out, lse = cuflash.flash_attn_func(q, q, q)
    for bad, message in ((np.zeros((1, 2, 4), np.float32), r"dlse: expected shape \(1, 2, 8\)"),
                         (np.zeros((1, 2, 8), np.float16), "dlse: expected dtype float32")):
        with pytest.raises((ValueError, TypeError), match=message):
            cuflash.flash_attn_backward(out, q, q, q, out, lse, dlse=bad)


def test_document_ids_cover_the_longest_packed_sequence(rng):
    # Without max_seqlen hints the document ids need to cover the longest sequence, read from the
    # host cu_seqlens (as the C++ API does), not every packed row: two sequences of 4 take (2, 4).
    cu = np.array([0, 4, 8], np.int32)
    q, k, v = (randn(rng, (8, 2, 32)) for _ in range(3))
    doc = np.array([[0, 0, 1, 1], [0, 1, 1, 1]], np.int32)
    mask_mod = cuflash.masks.document(doc)
    from cuflash import interface

    # flash_attn_varlen_func keeps the seed's signature (no mask_mod): the forward as the torch
    # ops run it.
    out, lse = interface._run_forward(interface._prepare(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                         mask_mod=mask_mod))
    dout = randn(rng, out.shape)
    grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, cu, cu, mask_mod=mask_mod)
    opts = ref.Options(mask=lambda b, i, j: doc[b][i] == doc[b][j])
    expected = [np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape), None]
    for b, (start, length) in enumerate(ref.sequences(cu)):
        rows = slice(start, start + length)
        expected[0][rows], expected[1][rows], expected[2][rows], _ = ref.backward_one(
            dout[rows], q[rows], k[rows], v[rows], out[rows], b, opts)
    check_grads(grads, expected)
    with pytest.raises(ValueError, match="mask_mod doc_ids"):
        cuflash.flash_attn_backward(dout, q, k, v, out, lse, cu, cu, mask_mod=cuflash.masks.document(doc[:, :3]))


def test_varlen_rows_past_the_last_sequence(rng):
    # A padded batch: 7 query and 5 key rows after the last sequence belong to none. The outputs
    # that the package allocates hold zeros there (not whatever the memory held), forward and
    # backward; the sequences' rows are as without the padding.
    lengths_q, lengths_k = [6, 11], [9, 13]
    q, cu_q = packed(rng, lengths_q, 4, 32)
    k, cu_k = packed(rng, lengths_k, 2, 32)
    q_pad = np.concatenate([q, randn(rng, (7, 4, 32))])
    k_pad = np.concatenate([k, randn(rng, (5, 2, 32))])
    v_pad = randn(rng, k_pad.shape)
    out, lse = cuflash.flash_attn_varlen_func(q_pad, k_pad, v_pad, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                              causal=True)
    rows = int(cu_q[-1])
    assert np.all(out[rows:] == 0) and np.all(lse[:, rows:] == 0)
    out_seq, lse_seq = cuflash.flash_attn_varlen_func(q, k, v_pad[:int(cu_k[-1])], cu_q, cu_k, max(lengths_q),
                                                      max(lengths_k), causal=True)
    np.testing.assert_array_equal(out[:rows], out_seq)
    np.testing.assert_array_equal(lse[:, :rows], lse_seq)
    dout = randn(rng, out.shape)
    dq, dk, dv, _ = cuflash.flash_attn_backward(dout, q_pad, k_pad, v_pad, out, lse, cu_q, cu_k, max(lengths_q),
                                                max(lengths_k), causal=True)
    keys = int(cu_k[-1])
    assert np.all(dq[rows:] == 0) and np.all(dk[keys:] == 0) and np.all(dv[keys:] == 0)
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(g.astype(np.float32)))


def test_empty_calls(rng):
    # No sequences, no queries or no keys: empty outputs, or zeros where nothing is seen (out 0,
    # lse the sink's logit, every gradient 0), forward and backward.
    sink = rng.standard_normal(4).astype(np.float32)
    for batch, seqlen_q, seqlen_k in ((0, 16, 16), (2, 0, 40), (2, 24, 0)):
        q, k, v = (randn(rng, (batch, s, 4, 64)) for s in (seqlen_q, seqlen_k, seqlen_k))
        out, lse = cuflash.flash_attn_func(q, k, v, learnable_sink=sink)
        assert out.shape == (batch, seqlen_q, 4, 64) and lse.shape == (batch, 4, seqlen_q)
        assert np.all(out == 0)
        np.testing.assert_array_equal(lse, np.broadcast_to(sink[None, :, None], lse.shape))
        dq, dk, dv, d_sink = cuflash.flash_attn_backward(randn(rng, out.shape), q, k, v, out, lse,
                                                         learnable_sink=sink)
        for grad, x in ((dq, q), (dk, k), (dv, v)):
            assert grad.shape == x.shape and np.all(grad == 0)
        assert np.all(d_sink == 0)
    # Batch 0 with the index tensors that come with it (NumPy gives empty arrays strides of 0):
    # block lists, seqused over zero sequences, a page table of no rows.
    q = np.zeros((0, 200, 2, 32), np.float16)
    cnt, idx = np.zeros((0, 1, 2), np.int32), np.zeros((0, 1, 2, 2), np.int32)
    assert cuflash.flash_attn_func(q, q, q, mask_block_cnt=cnt, mask_block_idx=idx)[0].shape == q.shape
    packed, cu = np.zeros((0, 2, 32), np.float16), np.zeros(1, np.int32)
    for used in ("seqused_q", "seqused_k"):
        assert cuflash.flash_attn_varlen_func(packed, packed, packed, cu, cu, **{used: np.zeros(0, np.int32)})[0].shape \
            == packed.shape
    pages = np.zeros((4, 16, 2, 32), np.float16)
    assert cuflash.flash_attn_varlen_func(q[:, :5], pages, pages, page_table=np.zeros((0, 3), np.int32))[0].shape \
        == (0, 5, 2, 32)
    # A document mask over a sequence without queries: the ids cover max_seqlen_q = 0 (a hint of
    # 0, or read from cu_seqlens) and the keys.
    rows, keys = randn(rng, (4, 2, 32)), randn(rng, (3, 2, 32))
    doc = np.zeros((1, 3), np.int32)
    for hint in (None, 0):
        out, _ = cuflash.flash_attn_forward(rows, keys, keys, np.array([0, 0], np.int32), np.array([0, 3], np.int32),
                                            max_seqlen_q=hint, mask_mod=cuflash.masks.document(doc))
        assert np.all(out == 0)


def test_backward_into_preallocated_grads(rng):
    # dq, dk, dv given (permuted and padded views): written in place, returned, equal to the
    # gradients allocated by the call; wrong shapes and dtypes refused by name.
    q = randn(rng, (2, 20, 4, 32))
    k, v = randn(rng, (2, 28, 2, 32)), randn(rng, (2, 28, 2, 64))
    out, lse = cuflash.flash_attn_func(q, k, v, causal=True)
    dout = randn(rng, out.shape)
    expected = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    dq = np.full((2, 4, 20, 32), 9, np.float16).transpose(0, 2, 1, 3)
    dk_buffer = np.full((2, 28, 2, 40), 9, np.float16)
    dk = dk_buffer[..., :32]
    dv = np.full((2, 28, 2, 64), 9, np.float16)
    grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, dq=dq, dk=dk, dv=dv)
    assert grads[0] is dq and grads[1] is dk and grads[2] is dv and grads[3] is None
    for g, e in zip(grads[:3], expected[:3]):
        np.testing.assert_array_equal(g, e)
    assert np.all(dk_buffer[..., 32:] == 9)
    # One of the three given, the others allocated.
    dq_only = np.empty_like(q)
    grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, dq=dq_only)
    assert grads[0] is dq_only
    for g, e in zip(grads[:3], expected[:3]):
        np.testing.assert_array_equal(g, e)
    with pytest.raises(ValueError, match="^dk: expected shape"):
        cuflash.flash_attn_backward(dout, q, k, v, out, lse, dk=np.empty((2, 28, 2, 64), np.float16))
    with pytest.raises(TypeError, match="^dv: expected dtype float16"):
        cuflash.flash_attn_backward(dout, q, k, v, out, lse, dv=np.empty(v.shape, np.float32))
    # A gradient that starts where an input or another gradient does.
    with pytest.raises(ValueError, match="^dk: shares its memory with k"):
        cuflash.flash_attn_backward(dout, q, k, v, out, lse, dk=k)
    with pytest.raises(ValueError, match="^dq: shares its memory with dout"):
        cuflash.flash_attn_backward(dout, q, k, v, out, lse, dq=dout[..., :32])
    shared = np.empty(k.shape, np.float16)
    with pytest.raises(ValueError, match="^dv: shares its memory with dk"):
        cuflash.flash_attn_backward(dout[..., :32], q, k, v[..., :32], out[..., :32], lse, dk=shared,
                                    dv=np.lib.stride_tricks.as_strided(shared, k.shape, shared.strides))


def test_varlen_preallocated_grads_keep_unowned_rows(rng):
    # Rows past the last sequence belong to none: a caller's dq / dk / dv keep what they held.
    q, cu_q = packed(rng, [6, 11], 4, 32)
    k, cu_k = packed(rng, [9, 13], 2, 32)
    q_pad = np.concatenate([q, randn(rng, (3, 4, 32))])
    k_pad = np.concatenate([k, randn(rng, (4, 2, 32))])
    v_pad = randn(rng, k_pad.shape)
    out, lse = cuflash.flash_attn_varlen_func(q_pad, k_pad, v_pad, cu_q, cu_k, 11, 13)
    dout = randn(rng, out.shape)
    expected = cuflash.flash_attn_backward(dout, q_pad, k_pad, v_pad, out, lse, cu_q, cu_k, 11, 13)
    dq, dk, dv = (np.full(x.shape, 4, np.float16) for x in (q_pad, k_pad, v_pad))
    cuflash.flash_attn_backward(dout, q_pad, k_pad, v_pad, out, lse, cu_q, cu_k, 11, 13, dq=dq, dk=dk, dv=dv)
    np.testing.assert_array_equal(dq[:17], expected[0][:17])
    np.testing.assert_array_equal(dk[:22], expected[1][:22])
    np.testing.assert_array_equal(dv[:22], expected[2][:22])
    assert np.all(dq[17:] == 4) and np.all(dk[22:] == 4) and np.all(dv[22:] == 4)


@pytest.mark.parametrize("page_size,max_pages", [(8, 3), (24, 1)])
def test_paged_kv(rng, page_size, max_pages):
    # The gradients of a paged forward (the path torch autograd takes, and flash_attn_backward
    # with page_table) land in the pages that each sequence's keys came from; (24, 1) has as
    # many pages as sequences.
    from cuflash import interface

    batch, heads, heads_kv, dim = 2, 4, 2, 32
    num_pages = batch * max_pages
    page_table = rng.permutation(num_pages).reshape(batch, max_pages).astype(np.int32)
    k_cache = randn(rng, (num_pages, page_size, heads_kv, dim))
    v_cache = randn(rng, (num_pages, page_size, heads_kv, dim))
    q = randn(rng, (batch, 9, heads, dim))
    call = interface._prepare(q, k_cache, v_cache, page_table=page_table, causal=True)
    out, lse = interface._run_forward(call)
    dout = randn(rng, out.shape)
    dq, dk, dv, _ = cuflash.flash_attn_backward(dout, q, k_cache, v_cache, out, lse, causal=True,
                                                page_table=page_table)

    k = k_cache[page_table].reshape(batch, max_pages * page_size, heads_kv, dim)
    v = v_cache[page_table].reshape(batch, max_pages * page_size, heads_kv, dim)
    expected = ref.backward_dense(dout, q, k, v, out, ref.Options(causal=True))
    assert_close(dq, expected[0], scale=grad_scale(expected[0]), what="dq")
    for name, actual, e in (("dk", dk, expected[1]), ("dv", dv, expected[2])):
        pages = np.zeros(actual.shape, np.float64)
        pages[page_table] = e.reshape(batch, max_pages, page_size, heads_kv, dim)
        assert_close(actual, pages, scale=grad_scale(e), what=name)
