"""score_mod / mask_mod as Python callables (cuflash.mods), on the CPU reference: forward and
gradients against the NumPy reference (which calls the same callables with NumPy arrays), equality
with the built-ins they spell out, and the errors for what cannot be traced."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

import cuflash
import attention_reference as ref
import gpu_callables
from cuflash import mods
from conftest import assert_close, assert_lse_close, randn
from test_backward import check_grads
from test_forward import document_ids
from test_gpu import skip_if_not_built


def qkv(rng, batch=2, seqlen_q=24, seqlen_k=24, heads=4, heads_kv=2, dim=32, dtype="float16"):
    return (randn(rng, (batch, seqlen_q, heads, dim), dtype), randn(rng, (batch, seqlen_k, heads_kv, dim), dtype),
            randn(rng, (batch, seqlen_k, heads_kv, dim), dtype))


def run(rng, opts: ref.Options, q, k, v, function="varlen", **kwargs):
    """Forward and backward through cuflash, checked against the NumPy reference."""
    if function == "varlen":
        out, lse = cuflash.flash_attn_varlen_func(q, k, v, **kwargs)
    elif function == "forward":
        out, lse = cuflash.flash_attn_forward(q, k, v, return_lse=True, **kwargs)
    else:
        out, lse = cuflash.flash_attn_func(q, k, v, **kwargs)
    expected_out, expected_lse = ref.forward_dense(q, k, v, opts)
    assert_close(out, expected_out, "float16", what="out")
    assert_lse_close(lse, expected_lse)
    dout = randn(rng, out.shape)
    backward_kwargs = {key: value for key, value in kwargs.items() if key not in ("num_splits", "pack_gqa")}
    grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, **backward_kwargs)
    check_grads(grads, ref.backward_dense(dout, q, k, v, out, opts))
    return out, lse, grads


# --- score_mod ---------------------------------------------------------------------------------


SCORE_MODS = {
    "alibi_closure": lambda slopes, table: (
        lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx)),
    "relative_table": lambda slopes, table: (
        lambda score, b, h, q_idx, kv_idx: score + table[h, mods.clamp(kv_idx - q_idx, -3, 3) + 3]),
    "softcap": lambda slopes, table: (lambda score, b, h, q_idx, kv_idx: 2.0 * mods.tanh(score / 2.0)),
    "nonlinear": lambda slopes, table: (
        lambda score, b, h, q_idx, kv_idx: score * mods.sigmoid(score) + 0.1 * mods.exp2(-abs(score)) - 0.5),
    "where_branches": lambda slopes, table: (
        lambda score, b, h, q_idx, kv_idx: mods.where(kv_idx > q_idx, score * 0.5, score + h * 0.25)),
    "min_max_log": lambda slopes, table: (
        lambda score, b, h, q_idx, kv_idx: mods.maximum(score, -1.0) + mods.log(1.0 + mods.minimum(score * score, 4.0))),
    "batch_and_integer_ops": lambda slopes, table: (
        lambda score, b, h, q_idx, kv_idx: score - ((q_idx // 4) % 3) * 0.1 + b * 0.2 - (kv_idx - q_idx) / 8),
    "square_and_division": lambda slopes, table: (
        lambda score, b, h, q_idx, kv_idx: score ** 2 / 4.0 - score / (1.0 + (kv_idx % 2))),
}


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
@pytest.mark.parametrize("causal", [False, True])
def test_score_mod_callable(rng, name, causal):
    q, k, v = qkv(rng, seqlen_q=20, seqlen_k=28)
    slopes = cuflash.scores.alibi_slopes(4)
    table = rng.standard_normal((4, 7)).astype(np.float32)
    score_mod = SCORE_MODS[name](slopes, table)
    run(rng, ref.Options(causal=causal, score_mod=score_mod), q, k, v, causal=causal, score_mod=score_mod)


def test_score_mod_aux_tensors_are_trailing_arguments(rng):
    q, k, v = qkv(rng)
    slopes = cuflash.scores.alibi_slopes(4)
    bias = rng.standard_normal((2, 4, 24)).astype(np.float32)

    def score_mod(score, b, h, q_idx, kv_idx, slopes, bias):
        return score + slopes[h] * (kv_idx - q_idx) + bias[b, h, kv_idx]

    run(rng, ref.Options(score_mod=score_mod, aux=(slopes, bias)), q, k, v, score_mod=score_mod,
        aux_tensors=[slopes, bias])


def test_score_mod_reads_a_full_bias(rng):
    # FlexAttention's bias[b, h, q_idx, kv_idx], and a 4-dimensional boolean mask indexed by
    # expressions.
    q, k, v = qkv(rng, seqlen_q=20, seqlen_k=28)
    bias = rng.standard_normal((2, 4, 20, 28)).astype(np.float32)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, q_idx, kv_idx]

    run(rng, ref.Options(score_mod=score_mod), q, k, v, score_mod=score_mod)
    keep = rng.random((2, 2, 20, 28)) > 0.3
    keep[..., 0] = True  # every row sees a key

    def mask_mod(b, h, q_idx, kv_idx):
        return keep[b, h // 2, q_idx, kv_idx]

    run(rng, ref.Options(mask_mod=mask_mod), q, k, v, function="dense", mask_mod=mask_mod)


def test_score_mod_reads_module_globals(rng):
    q, k, v = qkv(rng)
    global GLOBAL_SLOPES
    GLOBAL_SLOPES = np.linspace(0.1, 0.8, 4).astype(np.float64)  # float64: read as float32
    try:
        run(rng, ref.Options(score_mod=_global_alibi), q, k, v, score_mod=_global_alibi)
    finally:
        del GLOBAL_SLOPES


def _global_alibi(score, b, h, q_idx, kv_idx):
    return score + GLOBAL_SLOPES[h] * (kv_idx - q_idx)


def test_score_mod_numpy_functions(rng):
    q, k, v = qkv(rng)

    def score_mod(score, b, h, q_idx, kv_idx):
        return np.where(q_idx >= kv_idx, np.tanh(score), np.exp(score) - 1.0)

    run(rng, ref.Options(score_mod=score_mod), q, k, v, score_mod=score_mod)


def test_power_and_square_record_products():
    # np.power / np.square (and concrete 0-d arrays as constants) trace to the products ** gives.
    def spelled(score, b, h, q_idx, kv_idx):
        return np.square(score) * np.float32(0.5) + np.power(score, 3) - np.power(2.0, score)

    def plain(score, b, h, q_idx, kv_idx):
        return score * score * 0.5 + score ** 3 - 2.0 ** score

    a, b = mods.trace_score_mod(spelled), mods.trace_score_mod(plain)
    assert (a.code, a.types, a.constants, a.grad) == (b.code, b.types, b.constants, b.grad)
    # Concrete 0-d bases and exponents in either position (np.power and ** dispatch to each other).
    spellings = [lambda s, b, h, q, k: np.power(np.float32(2), s), lambda s, b, h, q, k: np.power(np.array(2.0), s),
                 lambda s, b, h, q, k: np.float32(2) ** s]
    for f in spellings:
        t = mods.trace_score_mod(f)
        u = mods.trace_score_mod(lambda s, b, h, q, k: 2.0 ** s)
        assert (t.code, t.constants) == (u.code, u.constants)
    for f in (lambda s, b, h, q, k: np.power(s, 2.0), lambda s, b, h, q, k: s ** np.array(2)):
        t = mods.trace_score_mod(f)
        u = mods.trace_score_mod(lambda s, b, h, q, k: s * s)
        assert (t.code, t.constants) == (u.code, u.constants)


def test_zero_dim_tensors_read_from_outside_are_named():
    # A 0-d array the function closes over is a tensor it reads (by indexing), not a constant.
    z = np.array(0.5)
    with pytest.raises(TypeError, match=r"score_mod: z \(\) is read from outside the function"):
        mods.trace_score_mod(lambda s, b, h, q_idx, kv_idx: s * z)


def test_score_mod_masking_with_minus_inf(rng):
    q, k, v = qkv(rng)

    def score_mod(score, b, h, q_idx, kv_idx):
        return mods.where(kv_idx <= q_idx, score, -math.inf)

    run(rng, ref.Options(score_mod=score_mod), q, k, v, score_mod=score_mod)


def test_score_mod_matches_builtin_alibi(rng):
    q, k, v = qkv(rng)
    slopes = cuflash.scores.alibi_slopes(4)
    dout = randn(rng, (2, 24, 4, 32))
    results = []
    for score_mod in (cuflash.scores.alibi(slopes), lambda s, b, h, i, j: s + slopes[h] * (j - i)):
        out, lse = cuflash.flash_attn_varlen_func(q, k, v, causal=True, score_mod=score_mod)
        grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, score_mod=score_mod)
        results.append((out, lse) + tuple(grads[:3]))
    for builtin, traced in zip(*results):
        np.testing.assert_array_equal(np.asarray(builtin), np.asarray(traced))


def test_score_mod_varlen(rng):
    lengths_q, lengths_k = [5, 0, 9], [7, 3, 9]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = randn(rng, (int(cu_q[-1]), 4, 32))
    k = randn(rng, (int(cu_k[-1]), 2, 32))
    v = randn(rng, (int(cu_k[-1]), 2, 32))
    slopes = cuflash.scores.alibi_slopes(4)
    builtin = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, score_mod=cuflash.scores.alibi(slopes))
    traced = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9,
                                            score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i))
    for a, b in zip(builtin, traced):
        np.testing.assert_array_equal(a, b)


# --- mask_mod ----------------------------------------------------------------------------------


def test_mask_mod_document_closure(rng):
    q, k, v = qkv(rng, seqlen_q=40, seqlen_k=40)
    doc = document_ids(rng, 2, 40)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    run(rng, ref.Options(mask_mod=mask_mod), q, k, v, function="dense", mask_mod=mask_mod)


def test_mask_mod_matches_builtins(rng):
    q, k, v = qkv(rng, seqlen_q=30, seqlen_k=30)
    doc = document_ids(rng, 2, 30).astype(np.int64)  # int64: read as int32
    pairs = [
        (cuflash.masks.causal(), lambda b, h, i, j: j <= i),
        (cuflash.masks.document(doc.astype(np.int32)), lambda b, h, i, j: doc[b, i] == doc[b, j]),
        (cuflash.masks.sliding_window(4, 1), lambda b, h, i, j: (i - j <= 4) & (j - i <= 1)),
        (cuflash.masks.prefix_lm(5), lambda b, h, i, j: (j <= i) | (j < 5)),
    ]
    dout = randn(rng, (2, 30, 4, 32))
    for builtin, traced in pairs:
        results = []
        for mask_mod in (builtin, traced):
            out, lse = cuflash.flash_attn_func(q, k, v, mask_mod=mask_mod)
            grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, mask_mod=mask_mod)
            results.append((out, lse) + tuple(grads[:3]))
        for a, b in zip(*results):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=repr(builtin))


def test_score_callables_that_spell_alibi_run_as_it(rng):
    # score + slopes[h] * (kv_idx - q_idx) (operands of + and * in either order) becomes the
    # built-in ALiBi; other spellings, other tables and a hand-written score_mod_bwd keep the
    # program.
    q, k, v = qkv(rng, seqlen_q=30, seqlen_k=40)
    slopes = cuflash.scores.alibi_slopes(4)
    builtin = cuflash.scores.alibi(slopes)
    cases = [
        (lambda s, b, h, i, j: s + slopes[h] * (j - i), True),
        (lambda s, b, h, i, j: (j - i) * slopes[h] + s, True),
        (lambda s, b, h, i, j: s - slopes[h] * (i - j), False),
        (lambda s, b, h, i, j: s + slopes[b] * (j - i), False),
        (lambda s, b, h, i, j: s + slopes[h] * (j - i) * 1, False),
    ]
    expected = cuflash.flash_attn_varlen_func(q, k, v, score_mod=builtin)
    for score_mod, lowered in cases:
        call = cuflash.interface._prepare(q, k, v, score_mod=score_mod)
        assert (call.score_program == []) == lowered and (call.score_mod[0] == builtin.kind) == lowered
        if lowered:
            got = cuflash.flash_attn_varlen_func(q, k, v, score_mod=score_mod)
            for g, e in zip(got, expected):
                np.testing.assert_array_equal(g, e)
    # A hand-written gradient keeps the program, given beside score_mod or traced with it.
    call = cuflash.interface._prepare(q, k, v, score_mod=cases[0][0],
                                      score_mod_bwd=lambda g, s, b, h, i, j: g * 2.0)
    assert call.score_program != []
    traced = mods.trace_score_mod(cases[0][0], bwd=lambda g, s, b, h, i, j: g * 2.0)
    assert cuflash.interface._prepare(q, k, v, score_mod=traced).score_program != []
    traced = mods.trace_score_mod(lambda s, b, h, i, j: 2.0 * mods.tanh(s / 2.0), bwd=lambda g, s, b, h, i, j: g)
    call = cuflash.interface._prepare(q, k, v, score_mod=traced)
    assert call.score_program != [] and call.softcap == 0.0
    # cap * tanh(score / cap) becomes the softcap option (not beside one: it would cap twice).
    for score_mod in (lambda s, b, h, i, j: 7.5 * mods.tanh(s / 7.5), lambda s, b, h, i, j: mods.tanh(s / 7.5) * 7.5):
        call = cuflash.interface._prepare(q, k, v, score_mod=score_mod)
        assert call.score_program == [] and call.score_mod[0] == 0 and call.softcap == 7.5
        got = cuflash.flash_attn_varlen_func(q, k, v, score_mod=score_mod)
        for g, e in zip(got, cuflash.flash_attn_varlen_func(q, k, v, softcap=7.5)):
            np.testing.assert_array_equal(g, e)
    # Not another cap, nor beside the option, nor a cap the float32 option would change.
    for score_mod, softcap in ((lambda s, b, h, i, j: 7.5 * mods.tanh(s / 7.0), 0.0),
                               (lambda s, b, h, i, j: 7.5 * mods.tanh(s / 7.5), 30.0),
                               (lambda s, b, h, i, j: 0.3 * mods.tanh(s / 0.3), 0.0),
                               (lambda s, b, h, i, j: 1e39 * mods.tanh(s / 1e39), 0.0),
                               (lambda s, b, h, i, j: 1e-50 * mods.tanh(s / 1e-50), 0.0)):
        call = cuflash.interface._prepare(q, k, v, score_mod=score_mod, softcap=softcap)
        assert call.score_program != [] and call.softcap == softcap
    short = slopes[:2]
    call = cuflash.interface._prepare(q, k, v, score_mod=lambda s, b, h, i, j: s + short[h] * (j - i))
    assert call.score_program != []


def test_builtin_spellings_need_the_builtin_kernels(monkeypatch):
    # On the GPU a callable runs as the built-in it spells only where this build holds that
    # kernel for the call's dtype, head dims and form; else it is compiled as any callable.
    q, k, v = qkv(np.random.default_rng(0), dim=64)
    call = cuflash.interface._prepare(q, k, v)
    names = ["fwd fp16 hdim64 flex", "fwd fp16 hdim64 softcap", "fwd bf16 hdim128 flex paged split"]
    monkeypatch.setattr(cuflash.interface, "_C", type("Built", (), {"built_kernels": staticmethod(lambda: names)}))
    assert cuflash.interface._builtin_kernels_built(call, ("flex",))
    assert cuflash.interface._builtin_kernels_built(call, ("softcap", "flex"))
    names.remove("fwd fp16 hdim64 flex")
    assert not cuflash.interface._builtin_kernels_built(call, ("softcap", "flex"))
    call.page_table, call.num_splits, call.head_dim, call.head_dim_v, call.dtype = object(), 3, 128, 128, "bfloat16"
    assert cuflash.interface._builtin_kernels_built(call, ("flex",))
    call.pack_gqa = True  # packed GQA asked for (4 query heads per 2 kv heads): its own kernel
    assert not cuflash.interface._builtin_kernels_built(call, ("flex",))


def test_mask_callables_that_spell_a_builtin_run_as_it(rng):
    # kv_idx <= q_idx and ids[b, q_idx] == ids[b, kv_idx] become the built-in masks (nothing to
    # compile on the GPU, the built-ins' block skipping); other spellings stay programs. Either
    # way the result is the mask's.
    q, k, v = qkv(rng, seqlen_q=40, seqlen_k=40)
    doc = np.sort(rng.integers(0, 3, (2, 40))).astype(np.int64)
    cases = [
        (lambda b, h, i, j: j <= i, cuflash.masks.causal(), True),
        (lambda b, h, i, j: i >= j, cuflash.masks.causal(), True),
        (lambda b, h, i, j: doc[b, i] == doc[b, j], cuflash.masks.document(doc.astype(np.int32)), True),
        (lambda b, h, i, j: doc[b, j] == doc[b, i], cuflash.masks.document(doc.astype(np.int32)), True),
        (lambda b, h, i, j: (i >= j) & (i - j <= 7), cuflash.masks.sliding_window(7), True),
        (lambda b, h, i, j: (i - j < 8) & (j <= i), cuflash.masks.sliding_window(7), True),
        (lambda b, h, i, j: (7 >= i - j) & (i >= j), cuflash.masks.sliding_window(7), True),
        (lambda b, h, i, j: (i >= j) & (j - i <= 7), cuflash.masks.causal(), False),
        (lambda b, h, i, j: (i >= j) & (i - j <= 7 + 0 * b), cuflash.masks.sliding_window(7), False),
        (lambda b, h, i, j: i - j >= 0, cuflash.masks.causal(), False),
        (lambda b, h, i, j: doc[b, i] == doc[b, j + 0], cuflash.masks.document(doc.astype(np.int32)), False),
    ]
    for mask_mod, builtin, lowered in cases:
        call = cuflash.interface._prepare(q, k, v, mask_mod=mask_mod)
        assert (call.mask_program == []) == lowered
        assert (call.mask_mod[0] == builtin.kind) == lowered
        out, lse = cuflash.flash_attn_func(q, k, v, mask_mod=mask_mod)
        expected_out, expected_lse = cuflash.flash_attn_func(q, k, v, mask_mod=builtin)
        np.testing.assert_allclose(out.astype(np.float32), expected_out.astype(np.float32), atol=1e-3, rtol=1e-3)
        if lowered:
            np.testing.assert_array_equal(out, expected_out)
    # A table that does not cover the sequences (one row for two sequences) is the callable's
    # (the CPU reference refuses the read past its end, as for any callable).
    short = doc[:1]
    call = cuflash.interface._prepare(q, k, v, mask_mod=lambda b, h, i, j: short[0 * b, i] == short[0 * b, j])
    assert call.mask_program != []
    call = cuflash.interface._prepare(q, k, v, mask_mod=lambda b, h, i, j: short[b, i] == short[b, j])
    assert call.mask_program != []


def test_mask_mod_per_head_and_bool_table(rng):
    q, k, v = qkv(rng, seqlen_q=16, seqlen_k=20)
    allowed = rng.random((4, 16, 20)) < 0.6  # bool: read as int32, compared with 0
    allowed[:, :, 0] = True

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed[h, q_idx, kv_idx] & ~((h == 1) & (kv_idx > q_idx + 2))

    run(rng, ref.Options(mask_mod=mask_mod), q, k, v, function="dense", mask_mod=mask_mod)


def _module_bias(h, q_idx, kv_idx):
    return _MODULE_TABLE[h] * (kv_idx - q_idx)


_MODULE_TABLE = np.array([0.25, -0.5, 0.125, 0.0], np.float32)


def test_helpers_that_close_over_tensors(rng):
    # A callable that calls helpers holding their own tensors (a nested function's closure, a
    # module-level function reading a module global): the helpers' tensors are traced too.
    q, k, v = qkv(rng, seqlen_q=20, seqlen_k=20)
    doc = document_ids(rng, 2, 20)
    scale = np.array([1.0, 0.5, 2.0, 1.5], np.float32)

    def same_document(b, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * scale[h] + _module_bias(h, q_idx, kv_idx)

    def mask_mod(b, h, q_idx, kv_idx):
        return same_document(b, q_idx, kv_idx) | (kv_idx == 0)

    run(rng, ref.Options(score_mod=score_mod), q, k, v, function="varlen", score_mod=score_mod)
    run(rng, ref.Options(mask_mod=mask_mod), q, k, v, function="dense", mask_mod=mask_mod)


_CONFIG = np.array([0.75, 3.0], np.float32)


def _temperature():
    return float(_CONFIG[0])  # a setting read while tracing


def _config_bias(h, kv_idx):
    return _MODULE_TABLE[h] * kv_idx + _CONFIG[1] * 0.01


def test_helpers_read_settings_and_share_tables(rng):
    # A helper that reads a NumPy setting with plain indices gets its value (a constant of the
    # program); one table read by several functions takes one slot (the limit is 4 tensors).
    q, k, v = qkv(rng, seqlen_q=16, seqlen_k=16)

    def score_mod(score, b, h, q_idx, kv_idx):
        return (score * _temperature() + _config_bias(h, kv_idx) + _module_bias(h, q_idx, kv_idx)
                + _MODULE_TABLE[h] + _config_bias(h, q_idx))

    traced = mods.trace_score_mod(score_mod)
    assert len(traced.aux) == 1  # _MODULE_TABLE, read by three functions
    run(rng, ref.Options(score_mod=score_mod), q, k, v, function="varlen", score_mod=score_mod)


def test_mask_mod_boolean_arithmetic_as_numpy(rng):
    # + and * of two comparisons are or / and, as in NumPy and torch (FlexAttention's masks), not
    # Python's int arithmetic (True + True == 2).
    q, k, v = qkv(rng, seqlen_q=20, seqlen_k=20)

    def mask_mod(b, h, q_idx, kv_idx):
        return (((kv_idx <= q_idx) + (kv_idx < 5)) * (q_idx - kv_idx < 9) + abs(kv_idx == q_idx)
                + ((q_idx > 3) // (kv_idx >= 0) > 0))

    run(rng, ref.Options(mask_mod=mask_mod), q, k, v, function="dense", mask_mod=mask_mod)


def test_mask_mod_with_causal_and_window_options(rng):
    q, k, v = qkv(rng, seqlen_q=18, seqlen_k=26)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx + kv_idx) % 3 != 0

    opts = ref.Options(causal=True, window=(6, None), mask_mod=mask_mod)
    run(rng, opts, q, k, v, function="dense", causal=True, window_size=(6, None), mask_mod=mask_mod)


def test_mask_mod_fully_masked_rows(rng):
    q, k, v = qkv(rng, seqlen_q=12, seqlen_k=12)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= 4) & (kv_idx < q_idx)

    out, lse, _ = run(rng, ref.Options(mask_mod=mask_mod), q, k, v, function="dense", mask_mod=mask_mod)
    assert np.isneginf(lse[:, :, :4]).all() and (np.asarray(out[:, :4], dtype=np.float64) == 0).all()
    assert np.isfinite(lse[:, :, 4:]).all()


def test_new_ones_and_new_zeros_start_a_mask(rng):
    # torch's b.new_ones((), dtype=torch.bool) idiom (FlexAttention's and_masks / or_masks), with
    # NumPy dtypes here; functions a closure holds in a tuple are traced too.
    q, k, v = qkv(rng, seqlen_q=20, seqlen_k=20)
    parts = (lambda b, h, i, j: j <= i, lambda b, h, i, j: i - j <= 5)

    def both(b, h, i, j):
        result = b.new_ones((), dtype=np.bool_, device=b.device)
        for part in parts:
            result = result & part(b, h, i, j)
        return result

    def either(b, h, i, j):
        result = b.new_zeros((), dtype="bool")
        for part in parts:
            result = result | part(b, h, i, j)
        return result

    for mask_mod, expected in ((both, lambda b, i, j: (j <= i) & (i - j <= 5)),
                               (either, lambda b, i, j: (j <= i) | (i - j <= 5))):
        run(rng, ref.Options(mask=expected), q, k, v, function="func", mask_mod=mask_mod)
    with pytest.raises(TypeError, match="new_ones makes a scalar only"):
        mods.trace_mask_mod(lambda b, h, i, j: b.new_ones((2,), dtype=np.bool_) & (j <= i))


def test_mask_mod_constant_true(rng):
    q, k, v = qkv(rng)
    plain = cuflash.flash_attn_func(q, k, v)
    traced = cuflash.flash_attn_func(q, k, v, mask_mod=lambda b, h, i, j: True)
    for a, b in zip(plain, traced):
        np.testing.assert_array_equal(a, b)


def test_score_and_mask_mod_together_share_aux_tensors(rng):
    q, k, v = qkv(rng, seqlen_q=32, seqlen_k=32)
    doc = document_ids(rng, 2, 32)
    slopes = cuflash.scores.alibi_slopes(4)

    def score_mod(score, b, h, q_idx, kv_idx, slopes, doc):
        return score + slopes[h] * (kv_idx - q_idx)

    def mask_mod(b, h, q_idx, kv_idx, slopes, doc):
        return doc[b, q_idx] == doc[b, kv_idx]

    opts = ref.Options(score_mod=score_mod, mask_mod=mask_mod, aux=(slopes, doc))
    out, lse = cuflash.flash_attn_varlen_func(q, k, v, score_mod=score_mod, aux_tensors=[slopes, doc])
    expected = ref.forward_dense(q, k, v, ref.Options(score_mod=score_mod, aux=(slopes, doc)))
    assert_close(out, expected[0], what="out")
    dout = randn(rng, out.shape)
    out, lse = ref.forward_dense(q, k, v, opts)
    out = out.astype(np.float16)
    lse = lse.astype(np.float32)
    grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, score_mod=score_mod, mask_mod=mask_mod,
                                        aux_tensors=[slopes, doc])
    check_grads(grads, ref.backward_dense(dout, q, k, v, out, opts))


def test_traced_mod_object_is_accepted(rng):
    q, k, v = qkv(rng)
    slopes = cuflash.scores.alibi_slopes(4)
    traced = mods.trace_score_mod(lambda s, b, h, i, j: s + slopes[h] * (j - i))
    assert traced.num_ops <= mods.MAX_OPS and traced.role == "score"
    a = cuflash.flash_attn_varlen_func(q, k, v, score_mod=traced)
    b = cuflash.flash_attn_varlen_func(q, k, v, score_mod=cuflash.scores.alibi(slopes))
    np.testing.assert_array_equal(a[0], b[0])


def test_integer_arithmetic_wraps_at_32_bits(rng):
    # As in the kernels compiled for the GPU (test_codegen.py): i * 2000000000 overflows int32
    # from i = 2 on, and the mask and bias follow the wrapped value.
    from test_codegen import wrap32

    q, k, v = qkv(rng)

    def mask_mod(b, h, q_idx, kv_idx):
        return ((q_idx * 2000000000 + kv_idx) % 3 != 0) | (kv_idx == 0)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + ((q_idx * 1500000000 - kv_idx * 1000000007) // 100000000) * 0.01

    def expected_mask(b, h, i, j):
        return (wrap32(wrap32(i * 2000000000) + j) % 3 != 0) | (j == 0)

    def expected_score(score, b, h, i, j):
        return score + (wrap32(wrap32(i * 1500000000) - wrap32(j * 1000000007)) // 100000000) * 0.01

    opts = ref.Options(score_mod=expected_score, mask_mod=expected_mask)
    run(rng, opts, q, k, v, function="forward", score_mod=score_mod, mask_mod=mask_mod)


# --- score_mod_bwd: a hand-written gradient ---------------------------------------------------
# --- score_mod_bwd: a hand-written gradient ---------------------------------------------------


def backward_with(rng, score_mod, score_mod_bwd, aux_tensors=None, causal=True):
    """Gradients of one call's backward with score_mod's traced derivative and with score_mod_bwd."""
    q, k, v = qkv(rng, seqlen_q=20, seqlen_k=28)
    out, lse = cuflash.flash_attn_varlen_func(q, k, v, causal=causal, score_mod=score_mod, aux_tensors=aux_tensors)
    dout = randn(rng, out.shape)
    args = (dout, q, k, v, out, lse)
    kwargs = dict(causal=causal, score_mod=score_mod, aux_tensors=aux_tensors)
    traced = cuflash.flash_attn_backward(*args, **kwargs)
    written = cuflash.flash_attn_backward(*args, score_mod_bwd=score_mod_bwd, **kwargs)
    return traced, written


def test_score_mod_bwd_of_the_true_derivative_matches_the_traced_one(rng):
    slopes = rng.uniform(0.5, 2.0, 4).astype(np.float32)
    bias = rng.standard_normal((4, 28)).astype(np.float32)

    def score_mod(score, b, h, q_idx, kv_idx, bias):
        return 3.0 * mods.tanh(score * slopes[h] / 3.0) + bias[h, kv_idx]

    def score_mod_bwd(grad, score, b, h, q_idx, kv_idx, bias):
        t = mods.tanh(score * slopes[h] / 3.0)
        return mods.where(kv_idx >= 0, grad * (1.0 - t * t), 0.0) * slopes[h]

    traced, written = backward_with(rng, score_mod, score_mod_bwd, aux_tensors=[bias])
    for name, a, e in zip(("dq", "dk", "dv"), written[:3], traced[:3]):
        assert_close(a, e, "float16", scale=max(1.0, float(np.abs(e.astype(np.float64)).max())), what=name)


def test_score_mod_bwd_is_what_runs(rng):
    # A gradient of half the true one: dq and dk halve (exactly, a power of two, but for one
    # float16 subnormal step), dv is unchanged.
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + (kv_idx - q_idx) * 0.125

    def half(grad, score, b, h, q_idx, kv_idx):
        return grad * 0.25 + grad / 4.0

    traced, written = backward_with(rng, score_mod, half)
    for a, e in zip(written[:2], traced[:2]):
        np.testing.assert_allclose(a.astype(np.float64), e.astype(np.float64) * 0.5, rtol=0, atol=2.0 ** -24)
    np.testing.assert_array_equal(written[2], traced[2])
    # A gradient of zero: dq and dk vanish.
    traced, written = backward_with(rng, score_mod, lambda grad, score, b, h, q_idx, kv_idx: 0.0)
    assert not written[0].any() and not written[1].any()
    np.testing.assert_array_equal(written[2], traced[2])


def test_score_mod_bwd_program():
    traced = mods.trace_score_mod(lambda s, b, h, i, j: s * 2.0 + j,
                                  bwd=lambda g, s, b, h, i, j: mods.where(i >= j, -g * 3.0, 0.0))
    assert mods.GRAD not in traced.code[::4]  # the incoming gradient is not in the program
    auto = mods.trace_score_mod(lambda s, b, h, i, j: s * 2.0 + j)
    assert traced.structure_key() != auto.structure_key()  # compiled separately on the GPU


SCORE_MOD_BWD_ERRORS = [
    (lambda g, s, b, h, i, j: g * g, "mul of two terms in grad"),
    (lambda g, s, b, h, i, j: g + 1.0, "add of grad and a term free of it"),
    (lambda g, s, b, h, i, j: mods.exp(g), "exp of grad"),
    (lambda g, s, b, h, i, j: mods.where(g > 0, g, 0.0), "gt of grad"),
    (lambda g, s, b, h, i, j: mods.where(i > j, g, s), "where with a condition on grad or a branch free of it"),
    (lambda g, s, b, h, i, j: 1.0 / g, "div by a term in grad"),
    (lambda g, s, b, h, i, j: s * 2.0, "does not depend on grad"),
    (lambda g, s, b, h, i, j: i > j, "must return a float expression"),
    (lambda g, s, b, h, i: g, "expected a function of (grad, score, b, h, q_idx, kv_idx"),
    (lambda g, s, b, h, i, j: g if s > 0 else -g, "control flow"),
]


@pytest.mark.parametrize("bwd, fragment", SCORE_MOD_BWD_ERRORS, ids=range(len(SCORE_MOD_BWD_ERRORS)))
def test_score_mod_bwd_errors(bwd, fragment):
    q, k, v = _qkv_small()
    dout = np.ones((1, 8, 2, 16), np.float16)
    out, lse = cuflash.flash_attn_func(q, k, v)
    with pytest.raises(TypeError, match="^score_mod_bwd: ") as info:
        cuflash.flash_attn_backward(dout, q, k, v, out, lse, score_mod=lambda s, b, h, i, j: s, score_mod_bwd=bwd)
    assert fragment in str(info.value)


def test_score_mod_bwd_needs_a_callable_score_mod():
    q, k, v = _qkv_small()
    dout = np.ones((1, 8, 2, 16), np.float16)
    out, lse = cuflash.flash_attn_func(q, k, v)
    args = (dout, q, k, v, out, lse)
    bwd = lambda g, s, b, h, i, j: g  # noqa: E731
    with pytest.raises(ValueError, match="^score_mod_bwd: given without a score_mod"):
        cuflash.flash_attn_backward(*args, score_mod_bwd=bwd)
    with pytest.raises(TypeError, match="^score_mod_bwd: takes a score_mod that is a Python callable"):
        cuflash.flash_attn_backward(*args, score_mod=cuflash.scores.alibi(cuflash.scores.alibi_slopes(2)),
                                    score_mod_bwd=bwd)
    with pytest.raises(TypeError, match="^score_mod_bwd: .* is already traced"):
        cuflash.flash_attn_backward(*args, score_mod=mods.trace_score_mod(lambda s, b, h, i, j: s),
                                    score_mod_bwd=bwd)
    with pytest.raises(TypeError, match="^score_mod_bwd: expected a callable"):
        cuflash.flash_attn_backward(*args, score_mod=lambda s, b, h, i, j: s, score_mod_bwd=2.0)


# --- the tracer ---------------------------------------------------------------------------------


def test_derivative_is_symbolic():
    traced = mods.trace_score_mod(lambda s, b, h, i, j: s + (j - i) * 0.5)
    # d/ds of s + bias is the constant 1: no score in the derivative's register.
    op, a = traced.code[4 * traced.grad], traced.code[4 * traced.grad + 1]
    assert op == mods.FLOAT and traced.constants[a] == 1.0


def test_structures_are_kept_without_constants_or_tensors():
    # The torch custom ops carry a callable's program and structure key; the GPU compiles the
    # structure found by that key, which keeps no tensor alive.
    table = np.arange(5, dtype=np.float32)
    traced = mods.trace_score_mod(lambda s, b, h, i, j: s * 0.5 + table[j])
    structure = mods.structure_of(traced.structure_key())
    assert structure.code == traced.code and structure.types == traced.types
    assert structure.aux == [] and structure.constants == []
    assert structure.structure_key() == traced.structure_key()
    # A traced callable from another process (unpickled) is known by its structure too.
    mods._STRUCTURES.pop(traced.structure_key())
    copy = pickle.loads(pickle.dumps(traced))
    assert mods.structure_of(traced.structure_key()).code == traced.code
    np.testing.assert_array_equal(copy.aux[0], table)
    q, k, v = _qkv_small()
    checked = cuflash.interface._CheckedExpression("score", [traced.result, traced.grad] + traced.code,
                                                   traced.constants, [table], "0123456789abcdef")
    with pytest.raises(RuntimeError, match="^score_mod: no callable of structure 0123456789abcdef"):
        cuflash.flash_attn_varlen_func(q, k, v, score_mod=checked)


def test_program_is_deduplicated():
    traced = mods.trace_mask_mod(lambda b, h, i, j: (j <= i) & (j <= i) | (j <= i))
    assert traced.num_ops == 5  # q_idx, kv_idx, le, and, or


def test_structure_key_ignores_constant_values_and_tensor_contents():
    a = mods.trace_score_mod(lambda s, b, h, i, j: s * 2.0)
    b = mods.trace_score_mod(lambda s, b, h, i, j: s * 3.0)
    c = mods.trace_score_mod(lambda s, b, h, i, j: s + 3.0)
    assert a.structure_key() == b.structure_key() != c.structure_key()


def test_numpy_evaluation_of_mods_functions():
    x = np.array([-2.0, 0.0, 3.0])
    np.testing.assert_allclose(mods.sigmoid(x), 1 / (1 + np.exp(-x)))
    np.testing.assert_allclose(mods.clamp(x, -1, 1), [-1, 0, 1])
    np.testing.assert_array_equal(mods.where(x > 0, x, 0.0), [0, 0, 3])


# --- errors -------------------------------------------------------------------------------------


def _qkv_small():
    rng = np.random.default_rng(0)
    return qkv(rng, batch=1, seqlen_q=8, seqlen_k=8, heads=2, heads_kv=2, dim=16)


ERRORS = [
    ("score_mod", lambda s, b, h, i, j: s if i > j else -s, TypeError, "control flow"),
    ("score_mod", lambda s, b, h, i: s, TypeError, "expected a function of (score, b, h, q_idx, kv_idx"),
    ("score_mod", lambda s, b, h, i, j: i > j, TypeError, "must return a float expression"),
    ("score_mod", lambda s, b, h, i, j: "x", TypeError, "must return a float expression"),
    ("score_mod", lambda s, b, h, i, j: math.exp(s), TypeError, "cuflash.mods"),
    ("score_mod", lambda s, b, h, i, j: s ** 2.5, TypeError, "whole exponent"),
    ("score_mod", lambda s, b, h, i, j: s + (i & j), TypeError, "boolean operands"),
    ("score_mod", lambda s, b, h, i, j: s + (s // 2), TypeError, "integer operands"),
    ("mask_mod", lambda b, h, i, j: i - j, TypeError, "must return a boolean expression"),
    ("mask_mod", lambda b, h, i, j: (i > j) and (j > 0), TypeError, "control flow"),
    ("mask_mod", lambda b, h, i, j, k: i > j, TypeError, "expected a function of (b, h, q_idx, kv_idx"),
    ("mask_mod", lambda b, h, i, j: mods.where(i, True, False), TypeError, "condition must be a boolean"),
    ("mask_mod", lambda b, h, i, j: (i > j) - (j > 0), TypeError, "two booleans"),
    ("mask_mod", lambda b, h, i, j: ~-(i > j), TypeError, "- of a boolean"),
]


@pytest.mark.parametrize("argument, mod, error, fragment", ERRORS, ids=range(len(ERRORS)))
def test_untraceable_callables_raise_by_name(argument, mod, error, fragment):
    q, k, v = _qkv_small()
    dout = np.ones((1, 8, 2, 16), np.float16)
    out, lse = cuflash.flash_attn_func(q, k, v)
    with pytest.raises(error, match=f"^{argument}: ") as info:
        cuflash.flash_attn_backward(dout, q, k, v, out, lse, **{argument: mod})
    assert fragment in str(info.value)


def test_integer_tensors_outside_int32_are_refused():
    # The kernels read integer tensors as int32: int64 values it cannot hold would wrap (two
    # documents would merge), so they are refused by name; values that fit are taken.
    q, k, v = _qkv_small()
    doc = np.array([[2 ** 32 + 1] * 4 + [1] * 4], np.int64)
    with pytest.raises(ValueError, match="^mask_mod doc_ids: holds values outside int32"):
        cuflash.flash_attn_func(q, k, v, mask_mod=cuflash.masks.document(doc))
    with pytest.raises(ValueError, match=r"^mask_mod aux\[0\]: holds values outside int32"):
        cuflash.flash_attn_func(q, k, v, mask_mod=lambda b, h, i, j: doc[b, i] == doc[b, j])
    fits = np.array([[-5] * 4 + [2 ** 31 - 1] * 4], np.int64)
    expected, _ = cuflash.flash_attn_func(q, k, v, mask_mod=cuflash.masks.document(fits.astype(np.int32)))
    for mask_mod in (cuflash.masks.document(fits), lambda b, h, i, j: fits[b, i] == fits[b, j]):
        out, _ = cuflash.flash_attn_func(q, k, v, mask_mod=mask_mod)
        np.testing.assert_array_equal(out, expected)


def test_empty_tensor_read_by_a_callable_is_refused():
    q, k, v = _qkv_small()
    table = np.zeros((0,), np.float32)
    with pytest.raises(ValueError, match=r"^score_mod: reads tensor aux\[0\], which is empty"):
        cuflash.flash_attn_varlen_func(q, k, v, score_mod=lambda s, b, h, i, j: s + table[h])


def test_tensor_indexing_errors():
    q, k, v = _qkv_small()
    table = np.zeros((2, 8), np.float32)
    with pytest.raises(TypeError, match="^score_mod: .*index every dimension"):
        cuflash.flash_attn_varlen_func(q, k, v, score_mod=lambda s, b, h, i, j: s + table[h])
    with pytest.raises(TypeError, match="^score_mod: .*slices"):
        cuflash.flash_attn_varlen_func(q, k, v, score_mod=lambda s, b, h, i, j: s + table[h, :])
    with pytest.raises(TypeError, match="^score_mod: .*integer expressions"):
        cuflash.flash_attn_varlen_func(q, k, v, score_mod=lambda s, b, h, i, j: s + table[h, s])
    # Out of range on the CPU: an error naming the tensor (the fourth index of a 4-D one too).
    with pytest.raises(ValueError, match="out of range"):
        cuflash.flash_attn_varlen_func(q, k, v, score_mod=lambda s, b, h, i, j: s + table[h, j + 1])
    bias = np.zeros((1, 2, 8, 8), np.float32)
    with pytest.raises(ValueError, match="out of range for dimension 3"):
        cuflash.flash_attn_varlen_func(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[b, h, i, j + 1])
    # Five dimensions: refused, saying how to fold them.
    five = np.zeros((1, 1, 2, 8, 8), np.float32)
    with pytest.raises(TypeError, match=r"^score_mod: .*1 to 4 dimensions.*reshape\(-1"):
        cuflash.flash_attn_varlen_func(q, k, v, score_mod=lambda s, b, h, i, j: s + five[0, b, h, i, j])


def test_limits_raise_value_error():
    q, k, v = _qkv_small()

    def long(s, b, h, i, j):
        for n in range(70):
            s = s + (i + n)
        return s

    with pytest.raises(ValueError, match="^score_mod: .*limit of 64"):
        cuflash.flash_attn_varlen_func(q, k, v, score_mod=long)

    def many_constants(s, b, h, i, j):
        for n in range(20):
            s = s * (1.0 + n / 100)
        return s

    with pytest.raises(ValueError, match="^score_mod: .*16"):
        cuflash.flash_attn_varlen_func(q, k, v, score_mod=many_constants)
    t0, t1, t2, t3, t4 = (np.zeros(8, np.float32) for _ in range(5))

    def many_tensors(s, b, h, i, j):
        return s + t0[i] + t1[i] + t2[i] + t3[i] + t4[i]

    with pytest.raises(ValueError, match="^score_mod: .*reads 5 tensors"):
        cuflash.flash_attn_varlen_func(q, k, v, score_mod=many_tensors)


def test_tensor_inside_a_list_is_not_traced():
    q, k, v = _qkv_small()
    tensors = [np.zeros(8, np.float32)]
    with pytest.raises(TypeError, match="^score_mod: .*closes over directly"):
        cuflash.flash_attn_varlen_func(q, k, v, score_mod=lambda s, b, h, i, j: s + tensors[0][i])


def test_aux_tensors_without_a_reader():
    q, k, v = _qkv_small()
    with pytest.raises(ValueError, match="^aux_tensors: "):
        cuflash.flash_attn_varlen_func(q, k, v, score_mod=lambda s, b, h, i, j: s, aux_tensors=[np.zeros(2)])


@pytest.mark.parametrize("causal", [False, True])
def test_score_mod_callable_after_softcap(rng, causal):
    # DESIGN.md section 1: the score_mod sees the soft-capped score; the gradient carries both
    # derivatives.
    q, k, v = qkv(rng, seqlen_q=20, seqlen_k=28)
    slopes = cuflash.scores.alibi_slopes(4)
    score_mod = SCORE_MODS["nonlinear"](slopes, None)
    run(rng, ref.Options(causal=causal, softcap=3.0, score_mod=score_mod), q, k, v, causal=causal, softcap=3.0,
        score_mod=score_mod)


def test_gpu_callables(rng):
    """On a GPU build with a device: callables run on kernels compiled at run time, or, where
    the toolchain for that is missing, raise an error naming the argument; never a silently
    wrong result."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not (torch.cuda.is_available() and cuflash.built_with_cuda):
        pytest.skip("no CUDA device or a build without CUDA")
    q, k, v = (torch.randn(2, 256, 4, gpu_callables.HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    slopes = torch.tensor(cuflash.scores.alibi_slopes(4), device="cuda")
    with skip_if_not_built():  # the built-in compared against (the hdim64 flex kernel)
        expected, _ = cuflash.flash_attn_varlen_func(q, k, v, score_mod=cuflash.scores.alibi(slopes))
    try:
        out, _ = cuflash.flash_attn_varlen_func(q, k, v, score_mod=gpu_callables.alibi_like(slopes))
    except NotImplementedError as error:  # turned off (CUFLASH_JIT_CALLABLES=0)
        assert str(error).startswith("score_mod: ") and "CUFLASH_JIT_CALLABLES=0" in str(error)
        return
    except RuntimeError as error:
        assert str(error).startswith("score_mod: ")
        if "not found" in str(error):  # nvcc or the CUTLASS headers
            pytest.skip(str(error))
        raise
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
