"""JAX inside jax.jit and under jax.grad on the CPU backend: cuflash as XLA custom calls (the
extension's FFI handlers on the C++ reference), against the NumPy float64 reference. The GPU
backend's counterparts are in test_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed")
jnp = jax.numpy

import cuflash  # noqa: E402
from cuflash import _jax as cuflash_jax  # noqa: E402
import attention_reference as ref  # noqa: E402
from conftest import assert_close, assert_lse_close, randn  # noqa: E402
from test_backward import check_grads  # noqa: E402
from test_forward import (document_ids, packed, random_block_lists, split_full_and_mask,  # noqa: E402
                          varlen_block_lists_case, varlen_reference)

if not cuflash_jax.available():
    pytest.skip("this cuflash build has no XLA FFI handlers (jax was not found when it was configured)",
                allow_module_level=True)

CPU = jax.devices("cpu")[0]


def on_cpu(*arrays):
    return [None if a is None else jax.device_put(a, CPU) for a in arrays]


def f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def loss_grads(fn, argnums, *args, dout):
    """Gradients of sum(out * dout) (out = fn(*args)[0]) through jax.jit(jax.grad(...))."""
    dout = jax.device_put(dout, CPU)

    def loss(*a):
        out = fn(*a)[0]
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=argnums))(*args)


SHAPES = [
    (2, 20, 28, 4, 2, 32, 32),   # GQA
    (1, 33, 17, 4, 4, 64, 32),   # Sq > Sk, head_dim != head_dim_v
    (2, 16, 16, 4, 1, 32, 32),   # MQA
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_forward_and_grad(rng, shape, dtype, causal):
    batch, seqlen_q, seqlen_k, heads, heads_kv, dim, dim_v = shape
    q = randn(rng, (batch, seqlen_q, heads, dim), dtype)
    k = randn(rng, (batch, seqlen_k, heads_kv, dim), dtype)
    v = randn(rng, (batch, seqlen_k, heads_kv, dim_v), dtype)
    jq, jk, jv = on_cpu(q, k, v)

    def attention(q, k, v):
        return cuflash.flash_attn_func(q, k, v, causal=causal)

    out, lse = jax.jit(attention)(jq, jk, jv)
    assert isinstance(out, jax.Array) and out.dtype == jq.dtype and out.shape == (batch, seqlen_q, heads, dim_v)
    assert lse.dtype == np.float32 and lse.shape == (batch, heads, seqlen_q)
    opts = ref.Options(causal=causal)
    expected_out, expected_lse = ref.forward_dense(q, k, v, opts)
    assert_close(f64(out), expected_out, dtype, what="out")
    assert_lse_close(np.asarray(lse), expected_lse)

    dout = randn(rng, out.shape, dtype)
    grads = loss_grads(attention, (0, 1, 2), jq, jk, jv, dout=dout)
    for g, x in zip(grads, (jq, jk, jv)):
        assert g.dtype == x.dtype and g.shape == x.shape
    expected = ref.backward_dense(dout, q, k, v, np.asarray(out), opts)
    check_grads([f64(g) for g in grads] + [None], expected, dtype)


@pytest.mark.parametrize("softcap,window,scale", [(5.0, (None, None), None), (0.0, (6, 2), 0.3),
                                                  (3.0, (4, None), 0.2)])
def test_options_forward_and_grad(rng, softcap, window, scale):
    q, k, v = randn(rng, (2, 24, 4, 32)), randn(rng, (2, 30, 2, 32)), randn(rng, (2, 30, 2, 32))
    jq, jk, jv = on_cpu(q, k, v)

    def attention(q, k, v):
        return cuflash.flash_attn_func(q, k, v, softmax_scale=scale, window_size=window, softcap=softcap)

    out, lse = jax.jit(attention)(jq, jk, jv)
    opts = ref.Options(scale=scale, window=window, softcap=softcap)
    expected_out, expected_lse = ref.forward_dense(q, k, v, opts)
    assert_close(f64(out), expected_out, what="out")
    assert_lse_close(np.asarray(lse), expected_lse)
    dout = randn(rng, out.shape)
    grads = loss_grads(attention, (0, 1, 2), jq, jk, jv, dout=dout)
    check_grads([f64(g) for g in grads] + [None], ref.backward_dense(dout, q, k, v, np.asarray(out), opts))


@pytest.mark.parametrize("sink_dtype", ["float32", "bfloat16"])
def test_learnable_sink_grad(rng, sink_dtype):
    q, k, v = randn(rng, (2, 30, 4, 32)), randn(rng, (2, 20, 2, 32)), randn(rng, (2, 20, 2, 32))
    sink = randn(rng, (4,), sink_dtype)
    jq, jk, jv, jsink = on_cpu(q, k, v, sink)

    def attention(q, k, v, sink):
        return cuflash.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)

    out, lse = jax.jit(attention)(jq, jk, jv, jsink)
    opts = ref.Options(causal=True, sink=sink)
    expected_out, expected_lse = ref.forward_dense(q, k, v, opts)
    assert_close(f64(out), expected_out, what="out")
    assert_lse_close(np.asarray(lse), expected_lse)
    dout = randn(rng, out.shape)
    dq, dk, dv, d_sink = loss_grads(attention, (0, 1, 2, 3), jq, jk, jv, jsink, dout=dout)
    assert d_sink.dtype == jsink.dtype and d_sink.shape == (4,)
    expected = ref.backward_dense(dout, q, k, v, np.asarray(out), opts)
    check_grads([f64(dq), f64(dk), f64(dv), np.asarray(d_sink, np.float32)], expected)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_forward_and_grad(rng, causal):
    lengths_q, lengths_k = [5, 0, 21, 9], [9, 4, 21, 1]
    q, cu_q = packed(rng, lengths_q, 4, 32)
    k, cu_k = packed(rng, lengths_k, 2, 32)
    v = randn(rng, k.shape)
    jq, jk, jv, jcu_q, jcu_k = on_cpu(q, k, v, cu_q, cu_k)

    def attention(q, k, v, cu_q, cu_k):  # cu_seqlens are traced operands
        return cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal)

    out, lse = jax.jit(attention)(jq, jk, jv, jcu_q, jcu_k)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    opts = ref.Options(causal=causal)
    expected_out, expected_lse, _ = varlen_reference(q, k, v, cu_q, cu_k, opts)
    assert_close(f64(out), expected_out, what="out")
    assert_lse_close(np.asarray(lse), expected_lse)

    dout = randn(rng, out.shape)
    grads = loss_grads(attention, (0, 1, 2), jq, jk, jv, jcu_q, jcu_k, dout=dout)
    expected = ref.backward_packed(dout, q, k, v, np.asarray(out), cu_q, cu_k, opts)
    check_grads([f64(g) for g in grads] + [None], expected)


def test_padded_packed_rows_are_zero(rng):
    # Rows outside the sequences of a padded packed batch (before cu_seqlens[0], past
    # cu_seqlens[-1]) are written by no kernel: out, lse and the gradients there are 0 (as the
    # other frameworks give), not what XLA's result buffers held.
    q = jax.device_put(randn(rng, (24, 2, 32)).astype(jnp.bfloat16), CPU)
    k = jax.device_put(randn(rng, (30, 2, 32)).astype(jnp.bfloat16), CPU)
    cu_q, cu_k = (jax.device_put(np.array(c, np.int32), CPU) for c in ([2, 7, 14], [0, 10, 25]))

    def attention(q, k):
        return cuflash.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 7, 15)

    jnp.full((1 << 18,), jnp.nan).block_until_ready()  # leave NaN in freed host memory
    out, lse = jax.jit(attention)(q, k)
    inside_q = (np.arange(24) >= 2) & (np.arange(24) < 14)
    assert np.all(np.asarray(out, np.float32)[~inside_q] == 0)
    assert np.all(np.asarray(lse)[:, ~inside_q] == 0)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))

    def loss(q, k):
        out, lse = attention(q, k)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    dq, dk = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, k)
    dq, dk = np.asarray(dq, np.float32), np.asarray(dk, np.float32)
    assert np.all(np.isfinite(dq)) and np.all(np.isfinite(dk))
    assert np.all(dq[~inside_q] == 0) and np.all(dk[25:] == 0)
    eager = cuflash.flash_attn_varlen_func(*(np.asarray(x) for x in (q, k, k, cu_q, cu_k)), 7, 15)
    assert_close(f64(out), f64(eager[0]), what="out against eager")


def test_varlen_seqused_with_constant_index_arrays(rng):
    # Index arrays captured by the traced function (constants of the computation), NumPy aux.
    lengths = [7, 12, 3]
    q, cu = packed(rng, lengths, 4, 32)
    k, v = randn(rng, q.shape), randn(rng, q.shape)
    seqused = np.array([5, 12, 0], np.int32)
    jcu, jseqused = on_cpu(cu, seqused)
    slopes = cuflash.scores.alibi_slopes(4)

    @jax.jit
    def attention(q, k, v):
        return cuflash.flash_attn_varlen_func(q, k, v, jcu, jcu, seqused_q=jseqused, seqused_k=jseqused,
                                              score_mod=cuflash.scores.alibi(slopes))

    out, lse = attention(*on_cpu(q, k, v))
    opts = ref.Options(score_bias=lambda b, h, i, j: slopes[h] * (j - i))
    expected_out, expected_lse, valid = varlen_reference(q, k, v, cu, cu, opts, seqused, seqused)
    assert_close(f64(out)[valid], expected_out[valid], what="out")
    assert_lse_close(np.asarray(lse)[:, valid], expected_lse[:, valid])


def test_document_mask_grad(rng):
    batch, seqlen = 2, 40
    q, k, v = (randn(rng, (batch, seqlen, 2, 32)) for _ in range(3))
    doc = document_ids(rng, batch, seqlen)
    jq, jk, jv, jdoc = on_cpu(q, k, v, doc)

    def attention(q, k, v, doc):  # the aux tensor is a traced operand
        return cuflash.flash_attn_func(q, k, v, mask_mod=cuflash.masks.document(doc))

    out, _ = jax.jit(attention)(jq, jk, jv, jdoc)
    opts = ref.Options(mask=lambda b, i, j: doc[b][i] == doc[b][j])
    assert_close(f64(out), ref.forward_dense(q, k, v, opts)[0], what="out")
    dout = randn(rng, out.shape)
    grads = loss_grads(attention, (0, 1, 2), jq, jk, jv, jdoc, dout=dout)
    check_grads([f64(g) for g in grads] + [None], ref.backward_dense(dout, q, k, v, np.asarray(out), opts))


def test_callables_forward_and_grad(rng):
    # score_mod / mask_mod as Python callables under jax.jit and jax.grad: traced into expression
    # programs, their tensors (a NumPy table closed over, a traced bias, document ids) operands of
    # the custom calls; against the NumPy reference calling the same functions.
    batch, seqlen = 2, 40
    q, k, v = (randn(rng, (batch, seqlen, 2, 32)) for _ in range(3))
    doc = document_ids(rng, batch, seqlen)
    slopes = np.array([0.3, -0.2], np.float32)
    bias = rng.standard_normal(seqlen).astype(np.float32)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * 0.9 + slopes[h] * (kv_idx - q_idx) / 8

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) | (kv_idx < 3)

    jq, jk, jv, jbias = on_cpu(q, k, v, bias)

    def attention(q, k, v, bias):  # bias: a traced value the score_mod closes over
        return cuflash.flash_attn_varlen_func(
            q, k, v, causal=True, score_mod=lambda s, b, h, i, j: score_mod(s, b, h, i, j) + bias[j])

    def masked(q, k, v):
        return cuflash.flash_attn_func(q, k, v, mask_mod=mask_mod)

    opts = ref.Options(causal=True, score_mod=lambda s, b, h, i, j: score_mod(s, b, h, i, j) + bias[j])
    out, lse = jax.jit(attention)(jq, jk, jv, jbias)
    expected_out, expected_lse = ref.forward_dense(q, k, v, opts)
    assert_close(f64(out), expected_out, what="out")
    assert_lse_close(f64(lse), expected_lse)
    dout = randn(rng, out.shape)
    grads = loss_grads(attention, (0, 1, 2), jq, jk, jv, jbias, dout=dout)
    check_grads([f64(g) for g in grads] + [None], ref.backward_dense(dout, q, k, v, np.asarray(out), opts))

    opts = ref.Options(mask_mod=mask_mod)
    out, _ = jax.jit(masked)(jq, jk, jv)
    assert_close(f64(out), ref.forward_dense(q, k, v, opts)[0], what="out")
    grads = loss_grads(masked, (0, 1, 2), jq, jk, jv, dout=dout)
    check_grads([f64(g) for g in grads] + [None], ref.backward_dense(dout, q, k, v, np.asarray(out), opts))
    # Eager arrays take the same custom calls.
    eager, _ = masked(jq, jk, jv)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(out))
    # The bias traced as a differentiated value is refused by name (no gradient of mod tensors).
    with pytest.raises(NotImplementedError, match="^score_mod: its tensor aux"):
        jax.grad(lambda b: jnp.sum(attention(jq, jk, jv, b)[0].astype(jnp.float32)))(jbias)


@pytest.mark.parametrize("traced_lists", [False, True])
def test_block_sparse_grad(rng, traced_lists):
    # The backward's column-block lists are the forward lists transposed in jax.numpy.
    batch, seqlen = 1, 260
    q, k, v = (randn(rng, (batch, seqlen, 2, 32)) for _ in range(3))
    cnt, idx = random_block_lists(rng, batch, 1, 3, 3, density=0.7)
    full_cnt, full_idx, mask_cnt, mask_idx = split_full_and_mask(rng, cnt, idx)
    lists = on_cpu(full_cnt, full_idx, mask_cnt, mask_idx)
    mask_mod = cuflash.masks.sliding_window(1000, 50)

    def attention(q, k, v, *lists):
        return cuflash.flash_attn_func(q, k, v, mask_mod=mask_mod, full_block_cnt=lists[0], full_block_idx=lists[1],
                                       mask_block_cnt=lists[2], mask_block_idx=lists[3])

    fn = attention if traced_lists else (lambda q, k, v: attention(q, k, v, *lists))
    args = on_cpu(q, k, v) + (lists if traced_lists else [])
    out, _ = jax.jit(fn)(*args)
    opts = ref.Options(mask=lambda b, i, j: j <= i + 50,
                       blocks=ref.block_masks((full_cnt, full_idx), (mask_cnt, mask_idx), seqlen, seqlen))
    assert_close(f64(out), ref.forward_dense(q, k, v, opts)[0], what="out")
    dout = randn(rng, out.shape)
    grads = loss_grads(fn, (0, 1, 2), *args, dout=dout)
    check_grads([f64(g) for g in grads] + [None], ref.backward_dense(dout, q, k, v, np.asarray(out), opts))


@pytest.mark.parametrize("jit", [False, True])
def test_numpy_block_lists_with_jax_inputs(rng, jit):
    """create_block_mask's NumPy lists beside JAX q: moved to q's device (eager) or taken as
    constants (under jax.jit), forward and backward. Lists from a causal document mask with the
    document mask alone as mask_mod, so the result depends on the lists being read."""
    batch, seqlen = 2, 300
    ids = document_ids(rng, batch, seqlen)
    lists = cuflash.block_sparse.create_block_mask(
        lambda b, h, q_idx, kv_idx: (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx), batch, None, seqlen, seqlen)
    q, k, v = (randn(rng, (batch, seqlen, 2, 32)) for _ in range(3))

    def attention(q, k, v):
        return cuflash.flash_attn_func(q, k, v, mask_mod=cuflash.masks.document(ids), **lists._asdict())

    fn = jax.jit(attention) if jit else attention
    args = on_cpu(q, k, v)
    out, _ = fn(*args)
    opts = ref.Options(mask=lambda b, i, j: ids[b][i] == ids[b][j],
                       blocks=ref.block_masks((lists.full_block_cnt, lists.full_block_idx),
                                              (lists.mask_block_cnt, lists.mask_block_idx), seqlen, seqlen))
    assert_close(f64(out), ref.forward_dense(q, k, v, opts)[0], what="out")
    dout = randn(rng, out.shape)
    grads = loss_grads(fn, (0, 1, 2), *args, dout=dout)
    check_grads([f64(g) for g in grads] + [None], ref.backward_dense(dout, q, k, v, np.asarray(out), opts))


def test_transpose_block_lists_matches_numpy(rng):
    cnt, idx = random_block_lists(rng, 2, 3, 4, 5)
    expected = cuflash.block_sparse.transpose_block_lists(cnt, idx)
    actual = jax.jit(lambda c, i: cuflash_jax.transpose_block_lists(c, i, 5))(*on_cpu(cnt, idx))
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(np.asarray(a), e)


def test_paged_kv_forward_and_grad(rng):
    batch, page_size, max_pages, heads_kv = 2, 8, 3, 2
    num_pages = batch * max_pages + 1
    q = randn(rng, (batch, 5, 4, 32))
    k_cache, v_cache = (randn(rng, (num_pages, page_size, heads_kv, 32)) for _ in range(2))
    page_table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    seqused_k = np.array([20, 11], np.int32)
    args = on_cpu(q, k_cache, v_cache, page_table, seqused_k)

    def attention(q, k, v, page_table, seqused_k):
        return cuflash.flash_attn_varlen_func(q, k, v, seqused_k=seqused_k, page_table=page_table, causal=True)

    out, _ = jax.jit(attention)(*args)
    opts = ref.Options(causal=True)
    for b in range(batch):
        keys = k_cache[page_table[b]].reshape(-1, heads_kv, 32)[: seqused_k[b]]
        values = v_cache[page_table[b]].reshape(-1, heads_kv, 32)[: seqused_k[b]]
        expected_out, _ = ref.forward_one(q[b], keys, values, b, opts)
        assert_close(f64(out)[b], expected_out, what="out")
    # Gradients land in the pages the keys came from; the unused third page of sequence 1 and
    # the page no sequence lists get none.
    dout = randn(rng, q.shape)
    grads = loss_grads(attention, (0, 1, 2), *args, dout=dout)
    expected = [np.zeros(q.shape), np.zeros(k_cache.shape), np.zeros(v_cache.shape), None]
    for b in range(batch):
        n = seqused_k[b]
        keys = k_cache[page_table[b]].reshape(-1, heads_kv, 32)[:n]
        values = v_cache[page_table[b]].reshape(-1, heads_kv, 32)[:n]
        dq, dk, dv, _ = ref.backward_one(dout[b], q[b], keys, values, np.asarray(out)[b], b, opts)
        expected[0][b] = dq
        for grad, rows in ((expected[1], dk), (expected[2], dv)):
            padded = np.zeros((max_pages * page_size, heads_kv, 32))
            padded[:n] = rows
            np.add.at(grad, page_table[b], padded.reshape(max_pages, page_size, heads_kv, 32))
    check_grads([f64(g) for g in grads] + [None], expected)


def test_varlen_block_lists_backward(rng):
    # flash_attn_backward with cu_seqlens and the forward lists alone: the column-block lists,
    # transposed in jax.numpy, count the forward lists' columns (over max_seqlen_k: 3), not
    # total_k (6).
    from cuflash import interface

    q, k, v, cu_q, cu_k, (full_cnt, full_idx, mask_cnt, mask_idx) = varlen_block_lists_case(rng, heads=2)
    hints = dict(max_seqlen_q=300, max_seqlen_k=300)
    out, lse = interface._forward(q, k, v, None, True, (None, None), None, 0.0, 1, None, False, cu_seqlens_q=cu_q,
                                  cu_seqlens_k=cu_k, block_sparse=(mask_cnt, mask_idx, full_cnt, full_idx), **hints)
    dout = randn(rng, out.shape)
    args = on_cpu(dout, q, k, v, out, lse, cu_q, cu_k, full_cnt, full_idx, mask_cnt, mask_idx)

    @jax.jit
    def backward(dout, q, k, v, out, lse, cu_q, cu_k, full_cnt, full_idx, mask_cnt, mask_idx):
        return cuflash.flash_attn_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True, full_block_cnt=full_cnt,
                                           full_block_idx=full_idx, mask_block_cnt=mask_cnt,
                                           mask_block_idx=mask_idx, **hints)[:3]

    grads = backward(*args)
    opts = ref.Options(causal=True, blocks=ref.block_masks((full_cnt, full_idx), (mask_cnt, mask_idx), 300, 300))
    expected = ref.backward_packed(dout, q, k, v, out, cu_q, cu_k, opts)
    check_grads([f64(g) for g in grads] + [None], expected)


@pytest.mark.parametrize("causal", [False, True])
def test_gradient_of_lse(rng, causal):
    # A loss that uses lse as well as out, under jax.jit(jax.grad): the cotangent of lse is the
    # backward's dlse. Causal with Sq > Sk: the first rows see no key (lse -inf), and the sink's
    # gradient takes the lse term too.
    sink = None if causal else randn(rng, (4,), "float32")
    q = randn(rng, (2, 30, 4, 32))
    k, v = randn(rng, (2, 20, 2, 32)), randn(rng, (2, 20, 2, 32))
    dout, dlse = randn(rng, q.shape), randn(rng, (2, 4, 30), "float32")
    args = on_cpu(q, k, v, sink)
    jdout, jdlse = on_cpu(dout, dlse)

    def loss(q, k, v, sink):
        out, lse = cuflash.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink, softcap=3.0)
        # Rows without keys have lse -inf; their term is left out of the loss (its gradient is 0).
        lse_term = jnp.where(jnp.isneginf(lse), 0.0, lse * jdlse)
        return jnp.sum(out.astype(jnp.float32) * jdout.astype(jnp.float32)) + jnp.sum(lse_term)

    argnums = (0, 1, 2) if causal else (0, 1, 2, 3)
    grads = list(jax.jit(jax.grad(loss, argnums=argnums))(*args))
    out, lse = cuflash.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink, softcap=3.0)
    assert np.isneginf(lse).any() == causal
    opts = ref.Options(causal=causal, sink=sink, softcap=3.0)
    expected = ref.backward_dense(dout, q, k, v, out, opts, dlse=np.where(np.isneginf(lse), 0.0, dlse))
    check_grads([f64(g) for g in grads[:3]] + [None if causal else np.asarray(grads[3])], expected)

    # Packed sequences (lse (H, total_q)), through flash_attn_backward's dlse inside jit.
    lengths = [7, 0, 12]
    qp, cu_q = packed(rng, lengths, 2, 32)
    kp, cu_k = packed(rng, lengths, 2, 32)
    vp = randn(rng, kp.shape)
    out, lse = cuflash.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, max(lengths), max(lengths), causal=causal)
    dout, dlse = randn(rng, out.shape), randn(rng, lse.shape, "float32")

    @jax.jit
    def backward(dout, q, k, v, out, lse, cu_q, cu_k, dlse):
        return cuflash.flash_attn_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(lengths), max(lengths),
                                           causal=causal, dlse=dlse)[:3]

    grads = backward(*on_cpu(dout, qp, kp, vp, out, lse, cu_q, cu_k, dlse))
    expected = ref.backward_packed(dout, qp, kp, vp, out, cu_q, cu_k, ref.Options(causal=causal), dlse)
    check_grads([f64(g) for g in grads] + [None], expected)


def test_explicit_backward_inside_jit(rng):
    q, k, v = randn(rng, (1, 20, 2, 32)), randn(rng, (1, 24, 2, 32)), randn(rng, (1, 24, 2, 32))
    dout = randn(rng, (1, 20, 2, 32))

    @jax.jit
    def forward_backward(q, k, v, dout):
        out, lse = cuflash.flash_attn_func(q, k, v, causal=True)
        return (out,) + cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True)[:3]

    out, dq, dk, dv = forward_backward(*on_cpu(q, k, v, dout))
    expected = ref.backward_dense(dout, q, k, v, np.asarray(out), ref.Options(causal=True))
    check_grads([f64(dq), f64(dk), f64(dv), None], expected)


def test_score_mod_bwd_inside_jit(rng):
    # A hand-written gradient of twice the true one: dq and dk double, against the NumPy arrays'
    # backward with the traced derivative.
    q, k, v = randn(rng, (1, 20, 2, 32)), randn(rng, (1, 24, 2, 32)), randn(rng, (1, 24, 2, 32))
    dout = randn(rng, (1, 20, 2, 32))
    bias = rng.standard_normal(24).astype(np.float32)
    score_mod = lambda s, b, h, i, j, bias: s + bias[j]  # noqa: E731
    double = lambda g, s, b, h, i, j, bias: g * 2.0  # noqa: E731

    @jax.jit
    def forward_backward(q, k, v, dout, bias):
        out, lse = cuflash.flash_attn_varlen_func(q, k, v, causal=True, score_mod=score_mod, aux_tensors=[bias])
        return (out,) + cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, score_mod=score_mod,
                                                    score_mod_bwd=double, aux_tensors=[bias])[:3]

    out, dq, dk, dv = forward_backward(*on_cpu(q, k, v, dout, bias))
    out = np.asarray(out)
    _, lse = cuflash.flash_attn_varlen_func(q, k, v, causal=True, score_mod=score_mod, aux_tensors=[bias])
    expected = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, score_mod=score_mod,
                                           aux_tensors=[bias])
    for a, e in zip((dq, dk), expected[:2]):
        np.testing.assert_allclose(f64(a), f64(e) * 2.0, rtol=0, atol=2.0 ** -23)
    np.testing.assert_array_equal(np.asarray(dv), expected[2])


def test_flex_attention_interface(rng):
    # FlexAttention's (batch, heads, seqlen, head_dim) layout under jax.jit and jax.grad: the
    # same attention as the seed's functions on swapped axes.
    q, k, v = (randn(rng, (2, 4, 20, 32)), randn(rng, (2, 2, 24, 32)), randn(rng, (2, 2, 24, 32)))
    score_mod = lambda s, b, h, i, j: s - 0.1 * h * abs(i - j)  # noqa: E731

    def loss(fn):
        def f(q, k, v):
            return jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    flex = lambda q, k, v: cuflash.flex_attention(q, k, v, score_mod=score_mod, enable_gqa=True)  # noqa: E731
    seed = lambda q, k, v: cuflash.flash_attn_varlen_func(  # noqa: E731
        *(t.swapaxes(1, 2) for t in (q, k, v)), score_mod=score_mod)[0].swapaxes(1, 2)
    got, expected = loss(flex)(*on_cpu(q, k, v)), loss(seed)(*on_cpu(q, k, v))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(expected[0]))
    for g, e in zip(got[1], expected[1]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))
    # return_aux gives cuflash's AuxOutput of JAX arrays (torch's is for torch tensors).
    request = type("AuxRequest", (), {"lse": True, "max_scores": False})()
    out, aux = cuflash.flex_attention(*on_cpu(q, k, v), enable_gqa=True, return_aux=request)
    assert isinstance(aux, cuflash.flex.AuxOutput) and isinstance(aux.lse, jax.Array)
    assert aux.lse.shape == (2, 4, 20)


def test_vjp_vmap_and_eager_grad(rng):
    q, k, v = (randn(rng, (3, 1, 12, 2, 32)) for _ in range(3))
    jq, jk, jv = on_cpu(q, k, v)
    # vmap over a leading axis (the custom call runs once per entry).
    out, lse = jax.jit(jax.vmap(lambda q, k, v: cuflash.flash_attn_func(q, k, v)))(jq, jk, jv)
    for i in range(3):
        expected_out, expected_lse = ref.forward_dense(q[i], k[i], v[i], ref.Options())
        assert_close(f64(out[i]), expected_out, what="out")
        assert_lse_close(np.asarray(lse[i]), expected_lse)
    # jax.vjp and jax.grad without jit.
    (out0, _), vjp = jax.vjp(lambda q, k, v: cuflash.flash_attn_func(q, k, v), jq[0], jk[0], jv[0])
    dout = randn(rng, out0.shape)
    dlse = randn(rng, (1, 2, 12), "float32")
    grads = vjp((jax.device_put(dout, CPU), jax.device_put(dlse, CPU)))
    expected = ref.backward_dense(dout, q[0], k[0], v[0], np.asarray(out0), ref.Options(), dlse=dlse)
    check_grads([f64(g) for g in grads] + [None], expected)
    eager = jax.grad(lambda q: jnp.sum(cuflash.flash_attn_func(q, jk[0], jv[0])[0].astype(jnp.float32)))(jq[0])
    expected = ref.backward_dense(np.ones(out0.shape), q[0], k[0], v[0], np.asarray(out0), ref.Options())
    assert_close(f64(eager), expected[0], scale=max(1.0, np.abs(expected[0]).max()), what="dq")


def test_errors_name_the_argument(rng):
    q, k = on_cpu(randn(rng, (1, 8, 4, 32)), randn(rng, (1, 8, 3, 32)))

    with pytest.raises(ValueError, match="^k"):
        jax.jit(lambda q, k: cuflash.flash_attn_func(q, k, k))(q, k)  # 4 heads over 3 kv heads
    with pytest.raises(TypeError, match="^k"):
        jax.jit(lambda q: cuflash.flash_attn_func(q, q.astype(jnp.float32), q))(q)
    with pytest.raises(ValueError, match="^cu_seqlens_q"):
        jax.jit(lambda q, cu: cuflash.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu))(q, jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(TypeError, match="^cu_seqlens_k"):
        jax.jit(lambda q, cu: cuflash.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu.astype(jnp.float32)))(
            q, jnp.array([0, 8], jnp.int32))
    with pytest.raises(TypeError, match="^causal"):
        jax.jit(lambda q: cuflash.flash_attn_func(q, q, q, causal=1))(q)
    with pytest.raises(TypeError, match="^out_partial: expected dtype float32"):
        jax.jit(lambda o, l: cuflash.flash_attn_combine(o, l))(jnp.zeros((2, 8, 4, 32), jnp.bfloat16),
                                                               jnp.zeros((2, 8, 4)))


def test_mod_tensors_are_not_differentiated(rng):
    # The backward computes the gradients of q, k, v and the sink only: differentiating a tensor
    # a score_mod reads (a learnable bias table) is refused by name, not given a zero gradient;
    # as a constant it is fine.
    q = jax.device_put(randn(rng, (16, 2, 32)), CPU)
    cu = jax.device_put(np.array([0, 8, 16], np.int32), CPU)

    def loss(slopes, q):
        out, _ = cuflash.flash_attn_varlen_func(q, q, q, cu, cu, 8, 8, score_mod=cuflash.scores.alibi(slopes))
        return jnp.sum(out.astype(jnp.float32))

    slopes = jnp.array([0.5, 0.25])
    with pytest.raises(NotImplementedError, match=r"^score_mod: its tensor aux\[0\] is differentiated"):
        jax.grad(loss)(slopes, q)
    with pytest.raises(NotImplementedError, match="^score_mod: "):
        jax.jit(jax.grad(loss))(slopes, q)
    dq = jax.grad(loss, argnums=1)(slopes, q)
    dq_constant = jax.grad(lambda s, q: loss(jax.lax.stop_gradient(s), q), argnums=(0, 1))(slopes, q)
    np.testing.assert_array_equal(np.asarray(dq), np.asarray(dq_constant[1]))


def test_no_second_order_gradients(rng):
    # A gradient of a gradient fails by name (the backward custom call has no derivative), as
    # under torch; the first order is unchanged.
    q = jax.device_put(randn(rng, (1, 8, 2, 16)).astype(jnp.bfloat16), CPU)

    def loss(q):
        return jnp.sum(cuflash.flash_attn_func(q, q, q)[0].astype(jnp.float32) ** 2)

    assert jax.jit(jax.grad(loss))(q).shape == q.shape
    with pytest.raises(NotImplementedError, match="no double backward"):
        jax.grad(lambda q: jnp.sum(jax.grad(loss)(q).astype(jnp.float32) ** 2))(q)
