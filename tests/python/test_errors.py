"""Every argument check raises ValueError / TypeError whose message starts with the argument."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import _C
from conftest import randn


def expect_error(argument, call, *args, exception=(ValueError, TypeError), **kwargs):
    with pytest.raises(exception) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert message.startswith(argument), f"message does not start with {argument!r}: {message!r}"
    return message


@pytest.fixture
def dense(rng):
    """q, k, v: (2, 16, 4, 32), (2, 24, 2, 32), (2, 24, 2, 32) float16."""
    return (randn(rng, (2, 16, 4, 32)), randn(rng, (2, 24, 2, 32)), randn(rng, (2, 24, 2, 32)))


@pytest.fixture
def varlen(rng):
    cu_q = np.array([0, 5, 16], np.int32)
    cu_k = np.array([0, 10, 24], np.int32)
    return (randn(rng, (16, 4, 32)), randn(rng, (24, 2, 32)), randn(rng, (24, 2, 32)), cu_q, cu_k)


# ----------------------------------------------------------------------------------------------
# Tensors: kind, rank, shape, dtype


def test_not_a_tensor(dense):
    q, k, v = dense
    expect_error("q", cuflash.flash_attn_func, q.tolist(), k, v, exception=TypeError)
    expect_error("k", cuflash.flash_attn_func, q, None, v, exception=TypeError)
    expect_error("v", cuflash.flash_attn_func, q, k, "v", exception=TypeError)


def test_rank(dense, varlen):
    q, k, v = dense
    expect_error("q", cuflash.flash_attn_func, q[0], k, v, exception=ValueError)
    expect_error("k", cuflash.flash_attn_func, q, k[0], v, exception=ValueError)
    vq, vk, vv, cu_q, cu_k = varlen
    expect_error("q", cuflash.flash_attn_varlen_func, q, vk, vv, cu_q, cu_k, exception=ValueError)
    expect_error("k", cuflash.flash_attn_varlen_func, vq, k, v, cu_q, cu_k, exception=ValueError)


def test_shapes(dense):
    q, k, v = dense
    expect_error("k", cuflash.flash_attn_func, q, k[:1], v, exception=ValueError)
    expect_error("v", cuflash.flash_attn_func, q, k, v[:, :20], exception=ValueError)
    expect_error("v", cuflash.flash_attn_func, q, k, v[:, :, :1], exception=ValueError)
    # num_heads must be divisible by num_heads_kv
    expect_error("k", cuflash.flash_attn_func, q[:, :, :3], k, v, exception=ValueError)


def test_head_dims(rng):
    def run(dim, dim_v):
        q = randn(rng, (1, 4, 2, dim))
        k = randn(rng, (1, 4, 2, dim))
        v = randn(rng, (1, 4, 2, dim_v))
        cuflash.flash_attn_func(q, k, v)

    message = expect_error("q", run, 264, 64, exception=ValueError)
    assert "256" in message
    message = expect_error("q", run, 20, 32, exception=ValueError)
    assert "multiple of 8" in message
    expect_error("v", run, 32, 12, exception=ValueError)


def test_dtypes(dense):
    q, k, v = dense
    expect_error("q", cuflash.flash_attn_func, q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                 exception=TypeError)
    expect_error("k", cuflash.flash_attn_func, q, k.astype(np.float32), v, exception=TypeError)
    expect_error("v", cuflash.flash_attn_func, q, k, v.astype(np.float32), exception=TypeError)


def test_cu_seqlens(varlen):
    q, k, v, cu_q, cu_k = varlen
    f = cuflash.flash_attn_varlen_func
    expect_error("cu_seqlens_q", f, q, k, v, cu_q.astype(np.int64), cu_k, exception=TypeError)
    expect_error("cu_seqlens_k", f, q, k, v, cu_q, cu_k.astype(np.int64), exception=TypeError)
    expect_error("cu_seqlens_k", f, q, k, v, cu_q, cu_k[:2], exception=ValueError)
    expect_error("cu_seqlens_q", f, q, k, v, cu_q.reshape(1, 3), cu_k, exception=ValueError)
    strided = np.zeros(6, np.int32)[::2]
    strided[:] = cu_q
    message = expect_error("cu_seqlens_q", f, q, k, v, strided, cu_k, exception=ValueError)
    assert "got strides (2,)" in message
    expect_error("cu_seqlens_q", f, q, k, v, list(cu_q), cu_k, exception=TypeError)


def test_seqused(varlen):
    q, k, v, cu_q, cu_k = varlen
    f = cuflash.flash_attn_varlen_func
    expect_error("seqused_q", f, q, k, v, cu_q, cu_k, seqused_q=np.array([1, 2, 3], np.int32), exception=ValueError)
    expect_error("seqused_k", f, q, k, v, cu_q, cu_k, seqused_k=np.array([1, 2], np.int64), exception=TypeError)


def test_max_seqlen(varlen):
    q, k, v, cu_q, cu_k = varlen
    f = cuflash.flash_attn_varlen_func
    expect_error("max_seqlen_q", f, q, k, v, cu_q, cu_k, max_seqlen_q=-1, exception=ValueError)
    expect_error("max_seqlen_k", f, q, k, v, cu_q, cu_k, max_seqlen_k=3.5, exception=TypeError)
    # Lengths are int32 in the kernels: larger hints are refused by name, not by the binding.
    expect_error("max_seqlen_q", f, q, k, v, cu_q, cu_k, max_seqlen_q=2**31, exception=ValueError)
    expect_error("max_seqlen_k", f, q, k, v, cu_q, cu_k, max_seqlen_k=2**64, exception=ValueError)


def test_any_non_positive_num_splits_picks_the_heuristic(dense):
    expected, _ = cuflash.flash_attn_func(*dense, num_splits=0)
    out, _ = cuflash.flash_attn_func(*dense, num_splits=-2**40)
    np.testing.assert_array_equal(out, expected)


def test_page_table(rng):
    q = randn(rng, (2, 4, 2, 32))
    k = randn(rng, (8, 16, 2, 32))
    v = randn(rng, (8, 16, 2, 32))
    table = np.arange(8, dtype=np.int32).reshape(2, 4)
    f = cuflash.flash_attn_varlen_func
    f(q, k, v, page_table=table)  # valid
    expect_error("page_table", f, q, k, v, page_table=table.astype(np.int64), exception=TypeError)
    expect_error("page_table", f, q, k, v, page_table=table[:1], exception=ValueError)
    message = expect_error("page_table", f, q, k, v, page_table=np.asfortranarray(table), exception=ValueError)
    assert "got strides (1, 2)" in message
    expect_error("page_table", f, q[0:1].reshape(4, 2, 32), k, v, cu_seqlens_q=np.array([0, 4], np.int32),
                 cu_seqlens_k=np.array([0, 128], np.int32), page_table=table[:1], exception=ValueError)
    expect_error("v", f, q, k, v[:, :8], page_table=table, exception=ValueError)


def test_learnable_sink(dense):
    q, k, v = dense
    expect_error("learnable_sink", cuflash.flash_attn_func, q, k, v, learnable_sink=np.zeros(3, np.float32),
                 exception=ValueError)
    expect_error("learnable_sink", cuflash.flash_attn_func, q, k, v, learnable_sink=np.zeros(4, np.int32),
                 exception=TypeError)
    expect_error("learnable_sink", cuflash.flash_attn_func, q, k, v, learnable_sink=[0.0] * 4, exception=TypeError)


# ----------------------------------------------------------------------------------------------
# Scalar options


@pytest.mark.parametrize("argument, value, exception", [
    ("softmax_scale", "0.1", TypeError),
    ("softmax_scale", float("nan"), ValueError),
    ("causal", "yes", TypeError),
    ("causal", None, TypeError),
    ("window_size", 5, TypeError),
    ("window_size", (1, 2, 3), TypeError),
    ("window_size", (1.5, None), TypeError),
    ("window_size", (-3, 0), ValueError),
    ("window_size", (2**31, 0), ValueError),
    ("window_size", (None, 2**40), ValueError),
    ("softcap", "big", TypeError),
    ("softcap", -1.0, ValueError),
    ("softcap", 1e-50, ValueError),  # 0 in float32: softcap off, not what was asked
    ("softcap", 1e-40, ValueError),  # subnormal in float32, flushed to 0 by the kernels
    ("num_splits", 1.5, TypeError),
    ("num_splits", 1000, ValueError),
    ("pack_gqa", 1, TypeError),
    ("deterministic", None, TypeError),
])
def test_scalar_options(dense, argument, value, exception):
    expect_error(argument, cuflash.flash_attn_func, *dense, exception=exception, **{argument: value})


# ----------------------------------------------------------------------------------------------
# score_mod / mask_mod / aux_tensors


def test_untraceable_callables_are_refused(dense, varlen):
    # Callables are traced (cuflash.mods; tests/python/test_callables.py): what cannot be recorded
    # is a TypeError naming the argument.
    message = expect_error("mask_mod", cuflash.flash_attn_func, *dense,
                           mask_mod=lambda b, h, q, kv: q >= kv if q > 0 else True, exception=TypeError)
    assert "cuflash.mods.where" in message
    message = expect_error("score_mod", cuflash.flash_attn_varlen_func, *varlen,
                           score_mod=lambda s, b, h, q: s, exception=TypeError)
    assert "(score, b, h, q_idx, kv_idx" in message


def test_wrong_variant_kind(dense, varlen):
    expect_error("mask_mod", cuflash.flash_attn_func, *dense, mask_mod=cuflash.scores.alibi([0.1] * 4),
                 exception=TypeError)
    expect_error("score_mod", cuflash.flash_attn_varlen_func, *varlen, score_mod=cuflash.masks.causal(),
                 exception=TypeError)
    expect_error("mask_mod", cuflash.flash_attn_func, *dense, mask_mod="causal", exception=TypeError)



def test_aux_tensors(varlen):
    f = cuflash.flash_attn_varlen_func
    slopes = np.full(4, 0.1, np.float32)
    expect_error("aux_tensors", f, *varlen, aux_tensors=[slopes], exception=ValueError)
    expect_error("aux_tensors", f, *varlen, score_mod=cuflash.scores.alibi(), aux_tensors=[], exception=ValueError)
    expect_error("aux_tensors", f, *varlen, score_mod=cuflash.scores.alibi(slopes), aux_tensors=[slopes],
                 exception=ValueError)
    expect_error("aux_tensors", f, *varlen, score_mod=cuflash.scores.alibi(), aux_tensors=slopes, exception=TypeError)
    expect_error("score_mod", f, *varlen, score_mod=cuflash.scores.alibi(), exception=ValueError)


def test_variant_tensors(dense, varlen):
    expect_error("score_mod slopes", cuflash.flash_attn_varlen_func, *varlen,
                 score_mod=cuflash.scores.alibi([0.1] * 3), exception=ValueError)
    expect_error("score_mod table", cuflash.flash_attn_varlen_func, *varlen,
                 score_mod=cuflash.scores.relative_bias(np.zeros((3, 5), np.float32)), exception=ValueError)
    expect_error("mask_mod doc_ids", cuflash.flash_attn_func, *dense,
                 mask_mod=cuflash.masks.document(np.zeros((1, 24), np.int32)), exception=ValueError)
    expect_error("mask_mod doc_ids", cuflash.flash_attn_func, *dense,
                 mask_mod=cuflash.masks.document(np.zeros((2, 20), np.int32)), exception=ValueError)
    expect_error("mask_mod doc_ids", cuflash.flash_attn_func, *dense,
                 mask_mod=cuflash.masks.document(np.zeros((2, 24), np.float32)), exception=TypeError)


def test_variant_factories():
    expect_error("left", cuflash.masks.sliding_window, -1, 0, exception=ValueError)
    expect_error("right", cuflash.masks.sliding_window, 2, 1.5, exception=TypeError)
    expect_error("n", cuflash.masks.prefix_lm, 1.5, exception=TypeError)
    expect_error("doc_ids", cuflash.masks.document, "ids", exception=TypeError)
    expect_error("slopes", cuflash.scores.alibi, "slopes", exception=TypeError)
    expect_error("slopes", cuflash.scores.alibi, np.zeros((2, 2)), exception=ValueError)
    expect_error("table", cuflash.scores.relative_bias, np.zeros((2, 4)), exception=ValueError)
    expect_error("num_heads", cuflash.scores.alibi_slopes, 0, exception=ValueError)


# ----------------------------------------------------------------------------------------------
# Block sparsity


def test_block_sparse(dense):
    cnt = np.ones((2, 1, 1), np.int32)
    idx = np.zeros((2, 1, 1, 1), np.int32)
    f = cuflash.flash_attn_func
    f(*dense, mask_block_cnt=cnt, mask_block_idx=idx)  # valid
    expect_error("mask_block_idx", f, *dense, mask_block_cnt=cnt, exception=ValueError)
    expect_error("full_block_cnt", f, *dense, full_block_idx=idx, exception=ValueError)
    expect_error("mask_block_cnt", f, *dense, mask_block_cnt=cnt.astype(np.int64), mask_block_idx=idx,
                 exception=TypeError)
    expect_error("mask_block_cnt", f, *dense, mask_block_cnt=np.ones((2, 3, 1), np.int32), mask_block_idx=idx,
                 exception=ValueError)
    expect_error("mask_block_cnt", f, *dense, mask_block_cnt=np.ones((2, 1, 2), np.int32), mask_block_idx=idx,
                 exception=ValueError)
    expect_error("mask_block_idx", f, *dense, mask_block_cnt=cnt, mask_block_idx=np.zeros((2, 1, 1, 2), np.int32),
                 exception=ValueError)
    expect_error("full_block_cnt", f, *dense, mask_block_cnt=cnt, mask_block_idx=idx,
                 full_block_cnt=np.ones((2, 4, 1), np.int32), full_block_idx=np.zeros((2, 4, 1, 1), np.int32),
                 exception=ValueError)


def test_block_index_out_of_range():
    with pytest.raises(ValueError):
        cuflash.block_sparse.transpose_block_lists(np.ones((1, 1, 1), np.int32), np.full((1, 1, 1, 1), 3, np.int32))


# ----------------------------------------------------------------------------------------------
# flash_attn_backward


def test_backward_inputs(dense):
    q, k, v = dense
    out = np.zeros((2, 16, 4, 32), np.float16)
    lse = np.zeros((2, 4, 16), np.float32)
    f = cuflash.flash_attn_backward
    expect_error("lse", f, out, q, k, v, out, lse[:, :, :8], exception=ValueError)
    expect_error("lse", f, out, q, k, v, out, lse.astype(np.float16), exception=TypeError)
    expect_error("dout", f, out.astype(np.float32), q, k, v, out, lse, exception=TypeError)
    expect_error("out", f, out, q, k, v, out[:, :8], lse, exception=ValueError)
    expect_error("q_mask_block_idx", f, out, q, k, v, out, lse, mask_block_cnt=np.ones((2, 1, 1), np.int32),
                 mask_block_idx=np.zeros((2, 1, 1, 1), np.int32), q_mask_block_cnt=np.ones((2, 1, 1), np.int32),
                 exception=ValueError)


# ----------------------------------------------------------------------------------------------
# Combine


def test_combine(rng):
    out_partial = rng.standard_normal((2, 1, 8, 2, 32)).astype(np.float32)
    lse_partial = rng.standard_normal((2, 1, 8, 2)).astype(np.float32)
    f = cuflash.flash_attn_combine
    expect_error("out_partial", f, out_partial[0, 0], lse_partial, exception=ValueError)
    expect_error("lse_partial", f, out_partial, lse_partial[0, 0], exception=ValueError)
    expect_error("out_partial", f, out_partial.astype(np.float16), lse_partial, exception=TypeError)
    expect_error("lse_partial", f, out_partial, lse_partial.astype(np.float64), exception=TypeError)
    expect_error("lse_partial", f, out_partial, lse_partial[:, :, :4], exception=ValueError)
    expect_error("out_partial", f, np.zeros((300, 1, 1, 1, 8), np.float32), np.zeros((300, 1, 1, 1), np.float32),
                 exception=ValueError)
    message = expect_error("out_partial", f, np.swapaxes(out_partial, -1, -2), lse_partial[..., :1].repeat(32, -1),
                           exception=ValueError)
    assert "got strides" in message
    expect_error("out", f, out_partial, lse_partial, out=np.zeros((1, 8, 2, 16), np.float16), exception=ValueError)
    expect_error("out", f, out_partial, lse_partial, out=np.zeros((1, 8, 2, 32), np.int32), exception=TypeError)
    # out is written: a broadcast view (read-only in NumPy) or overlapping strides are refused.
    broadcast = np.broadcast_to(np.zeros((1, 1, 2, 32), np.float32), (1, 8, 2, 32))
    message = expect_error("out", f, out_partial, lse_partial, out=broadcast, exception=ValueError)
    assert "dimension 1 has size 8 and stride 0" in message
    read_only = np.zeros((1, 8, 2, 32), np.float32)
    read_only.setflags(write=False)
    message = expect_error("out", f, out_partial, lse_partial, out=read_only, exception=ValueError)
    assert "read-only" in message
    overlapping = np.lib.stride_tricks.as_strided(np.zeros(512, np.float32), (1, 8, 2, 32), (0, 64 * 4, 16 * 4, 4))
    message = expect_error("out", f, out_partial, lse_partial, out=overlapping, exception=ValueError)
    assert "dimension 2 (stride 16) starts inside the span of dimension 3 (size 32 x stride 1)" in message
    expect_error("out_dtype", f, out_partial, lse_partial, out_dtype=np.int32, exception=TypeError)
    expect_error("return_lse", f, out_partial, lse_partial, return_lse="yes", exception=TypeError)
    expect_error("cu_seqlens", f, out_partial, lse_partial, cu_seqlens=np.array([0, 8], np.int32),
                 exception=ValueError)
    packed_out, packed_lse = out_partial[:, 0], lse_partial[:, 0]
    expect_error("cu_seqlens", f, packed_out, packed_lse, cu_seqlens=np.array([0, 8], np.int64), exception=TypeError)
    expect_error("cu_seqlens", f, packed_out, packed_lse, cu_seqlens=[0, 8], exception=TypeError)
    expect_error("seqused", f, packed_out, packed_lse, cu_seqlens=np.array([0, 3, 8], np.int32),
                 seqused=np.array([1], np.int32), exception=ValueError)


# ----------------------------------------------------------------------------------------------
# Errors from the C++ library keep their message and name the argument


def test_cpp_errors_are_translated(dense):
    q, k, v = dense
    out = np.empty((2, 16, 4, 32), np.float16)
    with pytest.raises(ValueError) as info:
        _C.forward(q, k[:1], v, out)  # unchecked: the C++ validation catches it
    assert info.value.argument == "k"
    assert "k" in str(info.value)

    # Outputs whose elements overlap are refused by the C++ validation as well.
    overlapping = np.lib.stride_tricks.as_strided(out, (2, 16, 4, 32), (0, 128 * 2, 32 * 2, 2))
    with pytest.raises(ValueError) as info:
        _C.forward(q, k, v, overlapping)
    assert info.value.argument == "out"
    assert "dimension 0 has size 2 and stride 0" in str(info.value)
