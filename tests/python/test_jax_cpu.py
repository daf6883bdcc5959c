"""Eager JAX arrays on the CPU, outputs returned as JAX arrays: through the XLA FFI handlers
where the build has them, else by DLPack (both paths run here when the handlers are built).
jax.jit and jax.grad: test_jax_jit.py."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed")

import cuflash  # noqa: E402
import attention_reference as ref  # noqa: E402
from combine_reference import jax_combine_direct, jax_combine_loss  # noqa: E402
from conftest import assert_close, assert_lse_close, randn  # noqa: E402
from jax.numpy import tanh as jax_tanh  # noqa: E402  (a jax.numpy function named by a module global)

CPU = jax.devices("cpu")[0]


def on_cpu(*arrays):
    return [jax.device_put(a, CPU) for a in arrays]


@pytest.fixture(params=["ffi", "dlpack"])
def path(request, monkeypatch):
    """Which way eager JAX arrays take: XLA custom calls, or DLPack (the handlers hidden)."""
    from cuflash import _jax

    if request.param == "ffi" and not _jax.available():
        pytest.skip("this build has no XLA FFI handlers (jax was not found when it was configured)")
    if request.param == "dlpack":
        monkeypatch.setattr(_jax, "available", lambda: False)
    return request.param


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_forward_backward(rng, dtype, path):
    q, k, v = randn(rng, (2, 20, 4, 32), dtype), randn(rng, (2, 28, 2, 32), dtype), randn(rng, (2, 28, 2, 32), dtype)
    jq, jk, jv = on_cpu(q, k, v)
    out, lse = cuflash.flash_attn_func(jq, jk, jv, causal=True)
    assert isinstance(out, jax.Array) and isinstance(lse, jax.Array)
    assert out.dtype == jq.dtype and out.shape == (2, 20, 4, 32) and lse.dtype == np.float32
    opts = ref.Options(causal=True)
    expected_out, expected_lse = ref.forward_dense(q, k, v, opts)
    assert_close(np.asarray(out), expected_out, dtype, what="out")
    assert_lse_close(np.asarray(lse), expected_lse)

    dout = randn(rng, out.shape, dtype)
    dq, dk, dv, d_sink = cuflash.flash_attn_backward(jax.device_put(dout, CPU), jq, jk, jv, out, lse, causal=True)
    assert d_sink is None and isinstance(dq, jax.Array)
    expected = ref.backward_dense(dout, q, k, v, np.asarray(out), opts)
    for name, grad, e in zip(("dq", "dk", "dv"), (dq, dk, dv), expected[:3]):
        assert_close(np.asarray(grad), e, dtype, scale=max(1.0, np.abs(e).max()), what=name)


def test_forward_function_and_outputs_in_place(rng, path):
    # flash_attn_forward returns JAX arrays as flash_attn_func does (lse only when asked);
    # JAX arrays are immutable, so preallocated outputs are refused by name.
    q, k, v = (randn(rng, (1, 12, 2, 32)) for _ in range(3))
    jq, jk, jv = on_cpu(q, k, v)
    out, lse = cuflash.flash_attn_func(jq, jk, jv, causal=True)
    out_f, lse_f = cuflash.flash_attn_forward(jq, jk, jv, causal=True, return_lse=True)
    assert isinstance(out_f, jax.Array) and isinstance(lse_f, jax.Array)
    np.testing.assert_array_equal(np.asarray(out_f), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(lse_f), np.asarray(lse))
    assert cuflash.flash_attn_forward(jq, jk, jv)[1] is None
    with pytest.raises(TypeError, match="^out: JAX arrays are immutable"):
        cuflash.flash_attn_forward(jq, jk, jv, out=out)
    with pytest.raises(TypeError, match="^dq: JAX arrays are immutable"):
        cuflash.flash_attn_backward(out, jq, jk, jv, out, lse, dq=jq)


def test_inputs_are_not_modified(rng):
    q, k, v = (randn(rng, (1, 8, 2, 32)) for _ in range(3))
    jq, jk, jv = on_cpu(q, k, v)
    out1, _ = cuflash.flash_attn_func(jq, jk, jv)
    out2, _ = cuflash.flash_attn_func(jq, jk, jv)
    assert np.array_equal(np.asarray(jq), q)
    assert np.array_equal(np.asarray(out1), np.asarray(out2))


def test_varlen_with_score_mod(rng, path):
    q, k, v = (randn(rng, (30, 4, 32)) for _ in range(3))
    cu = np.array([0, 12, 30], np.int32)
    slopes = cuflash.scores.alibi_slopes(4)
    out, lse = cuflash.flash_attn_varlen_func(*on_cpu(q, k, v, cu, cu), score_mod=cuflash.scores.alibi(slopes))
    opts = ref.Options(score_bias=lambda b, h, i, j: slopes[h] * (j - i))
    for b, (start, length) in enumerate(ref.sequences(cu)):
        rows = slice(start, start + length)
        expected_out, expected_lse = ref.forward_one(q[rows], k[rows], v[rows], b, opts)
        assert_close(np.asarray(out)[rows], expected_out, what="out")
        assert_lse_close(np.asarray(lse)[:, rows], expected_lse)


def test_combine(rng):
    out_partial = rng.standard_normal((2, 10, 2, 32)).astype(np.float32)
    lse_partial = rng.standard_normal((2, 10, 2)).astype(np.float32)
    out, lse = cuflash.flash_attn_combine(*on_cpu(out_partial, lse_partial), out_dtype="bfloat16")
    assert isinstance(out, jax.Array) and out.dtype.name == "bfloat16"
    expected_out, expected_lse = ref.combine(out_partial, lse_partial)
    assert_close(np.asarray(out).astype(np.float64), expected_out, "bfloat16", what="out")
    assert_lse_close(np.asarray(lse), expected_lse)
    with pytest.raises(TypeError, match="^out"):
        cuflash.flash_attn_combine(*on_cpu(out_partial, lse_partial), out=jax.numpy.zeros((10, 2, 32)))


@pytest.mark.parametrize("layout", ["dense_seqused", "packed"])
def test_combine_in_jit_and_grad(rng, layout):
    # The combine in jax.numpy under jax.jit matches the kernel on NumPy arrays (merged rows;
    # the rows it does not merge are 0), and jax.grad through it matches the gradients of a
    # direct logsumexp / softmax formulation.
    jnp = jax.numpy
    if layout == "packed":
        shape, cu, used = (23,), np.array([2, 9, 9, 20], np.int32), np.array([5, 0, 11], np.int32)
        kwargs = dict(cu_seqlens=cu, seqused=used)
        rows = np.arange(23)
        merged = (((rows >= 2) & (rows < 7)) | ((rows >= 9) & (rows < 20)))[:, None]
    else:
        shape, used = (2, 7), np.array([4, 7], np.int32)
        kwargs = dict(seqused=used)
        merged = (np.arange(7)[None, :] < used[:, None])[..., None]
    out_partial = rng.standard_normal((3, *shape, 2, 16)).astype(np.float32)
    lse_partial = (3 * rng.standard_normal((3, *shape, 2))).astype(np.float32)
    lse_partial[1, ..., 0] = -np.inf  # an empty split in some rows
    lse_partial[:, 0] = -np.inf  # rows with no split at all
    expected_out, expected_lse = cuflash.flash_attn_combine(out_partial, lse_partial, **kwargs)
    jitted = jax.jit(lambda o, l: cuflash.flash_attn_combine(o, l, **{n: jnp.asarray(t) for n, t in kwargs.items()}))
    out, lse = jitted(*on_cpu(out_partial, lse_partial))
    # Every row as the kernel gives it (past seqused: 0 and -inf; outside every sequence: 0).
    np.testing.assert_allclose(np.asarray(out), expected_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), expected_lse, rtol=1e-5, atol=1e-6)
    # A NaN partial lse reaches the output, as in the kernel (not taken for an empty row).
    row = (3,) if layout == "packed" else (1, 2)  # a merged row
    poisoned = lse_partial.copy()
    poisoned[(0,) + row] = np.nan
    assert np.isnan(np.asarray(jitted(*on_cpu(out_partial, poisoned))[1])[row]).all()

    weights = rng.standard_normal(out.shape).astype(np.float32)

    index = {n: jnp.asarray(t) for n, t in kwargs.items()}
    combine = lambda o, l: cuflash.flash_attn_combine(o, l, **index)  # noqa: E731
    got = jax.jit(jax.grad(jax_combine_loss(jax, combine, weights, merged), argnums=(0, 1)))(
        out_partial, lse_partial)
    expected = jax.grad(jax_combine_loss(jax, jax_combine_direct(jax, merged), weights, merged),
                        argnums=(0, 1))(out_partial, lse_partial)
    for g, e in zip(got, expected):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-5)


def test_traced_values_need_the_handlers(rng, monkeypatch):
    from cuflash import _jax

    monkeypatch.setattr(_jax, "available", lambda: False)
    q = jax.device_put(randn(rng, (1, 8, 2, 32)), CPU)

    @jax.jit
    def attention(x):
        return cuflash.flash_attn_func(x, x, x)[0]

    with pytest.raises(TypeError, match="^q: .*jax"):
        attention(q)


SHARDED_PROGRAM = """
import jax, jax.numpy as jnp, numpy as np, cuflash, ml_dtypes
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
rng = np.random.default_rng(0)
arr = lambda *s: rng.standard_normal(s).astype(ml_dtypes.bfloat16)
one = jax.devices()[0]

def check(name, fn, args, specs, argnums, sharded_grads, exact_grads=True, on=mesh):
    # exact_grads=False: the gradients of k / v whose kv head several shards' query heads read
    # are sums of the shards' rounded parts, within a rounding of one device's.
    def loss(*a):
        out, lse = fn(*a)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))
    spread = [jax.device_put(a, NamedSharding(on, s or P())) for a, s in zip(args, specs)]
    single = [jax.device_put(a, one) for a in args]
    f, g = jax.jit(fn), jax.jit(jax.grad(loss, argnums=argnums))
    got, expected = list(f(*spread)) + list(g(*spread)), list(f(*single)) + list(g(*single))
    for i, (a, b) in enumerate(zip(got, expected)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if exact_grads or i not in (3, 4):  # out, lse, dq and a sink's gradient are exact either way
            np.testing.assert_array_equal(a, b, err_msg=f"{name} {i}")
        else:
            np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2 * max(1.0, np.abs(b).max()), err_msg=f"{name} {i}")
    gathers = ["all-gather" in h.lower(*spread).compile().as_text() for h in (f, g)]
    spec = list(got[0].sharding.spec)
    while spec and spec[-1] is None:
        spec.pop()
    print(name, spec, gathers[0], gathers[1] if sharded_grads else "-")

q, k, v = arr(4, 16, 8, 32), arr(4, 24, 4, 32), arr(4, 24, 4, 32)
dense = P("data", None, "model", None)
check("gqa", lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True), [q, k, v], [dense] * 3, (0, 1, 2), True)
sink = rng.standard_normal(8).astype(np.float32)
check("sink", lambda q, k, v, s: cuflash.flash_attn_func(q, k, v, learnable_sink=s, softcap=20.0),
      [q, k, v, sink], [dense] * 3 + [P("model")], (0, 1, 2, 3), False)
slopes = cuflash.scores.alibi_slopes(8)
check("alibi", lambda q, k, v: cuflash.flash_attn_varlen_func(q, k, v, score_mod=cuflash.scores.alibi(slopes)),
      [q, k, v], [dense] * 3, (0, 1, 2), False)
cu_q, cu_k = np.array([0, 5, 12, 20], np.int32), np.array([0, 9, 13, 30], np.int32)
packed = P(None, "model", None)
check("varlen", lambda q, k, v, a, b: cuflash.flash_attn_varlen_func(q, k, v, a, b, 8, 17, causal=True),
      [arr(20, 8, 32), arr(30, 4, 32), arr(30, 4, 32), cu_q, cu_k], [packed] * 3 + [None, None], (0, 1, 2), True)
table = np.array([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [2, 3, 4, 5]], np.int32)
pages = P(None, None, "model", None)
check("paged", lambda q, k, v, t, u: cuflash.flash_attn_varlen_func(q, k, v, page_table=t, seqused_k=u, causal=True),
      [q, arr(10, 4, 4, 32), arr(10, 4, 4, 32), table, np.array([16, 9, 13, 5], np.int32)],
      [dense, pages, pages, P("data", None), P("data")], (0, 1, 2), False)
check("mqa", lambda q, k, v: cuflash.flash_attn_func(q, k, v), [q, arr(4, 24, 1, 32), arr(4, 24, 1, 32)],
      [dense, P("data"), P("data")], (0, 1, 2), True, exact_grads=False)
check("kv3", lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True), [arr(4, 16, 6, 32), arr(4, 24, 3, 32),
      arr(4, 24, 3, 32)], [dense, P("data"), P("data")], (0, 1, 2), False)  # 3 kv heads on 2 devices
# More shards than kv heads (tensor parallelism past the kv heads): 8 query heads over 4 devices,
# two per shard reading one of 2 kv heads; dense with a sink, and packed sequences.
line = Mesh(np.array(jax.devices()), ("model",))
heads4 = P(None, None, "model", None)
check("gqa4", lambda q, k, v, s: cuflash.flash_attn_func(q, k, v, causal=True, learnable_sink=s),
      [q, arr(4, 24, 2, 32), arr(4, 24, 2, 32), sink], [heads4, None, None, P("model")], (0, 1, 2, 3), True,
      exact_grads=False, on=line)
check("varlen4", lambda q, k, v, a, b: cuflash.flash_attn_varlen_func(q, k, v, a, b, 8, 17, causal=True),
      [arr(20, 8, 32), arr(30, 2, 32), arr(30, 2, 32), cu_q, cu_k], [packed, None, None, None, None], (0, 1, 2), True,
      exact_grads=False, on=line)
# Heads over both axes of the 2 x 2 mesh (4 shards, 2 kv heads): shards 0, 1 read kv head 0 and
# shards 2, 3 kv head 1 (the shard's place taken major axis first); then heads over "model" alone
# with 2 kv heads, whole groups per shard, k / v sharded with them and nothing summed.
both = P(None, None, ("data", "model"), None)
check("gqa22", lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True), [q, arr(4, 24, 2, 32),
      arr(4, 24, 2, 32)], [both, None, None], (0, 1, 2), True, exact_grads=False)
check("groups", lambda q, k, v: cuflash.flash_attn_func(q, k, v), [q, arr(4, 24, 2, 32), arr(4, 24, 2, 32)],
      [dense] * 3, (0, 1, 2), True)
q5, k5 = arr(2, 4, 16, 8, 32), arr(2, 4, 24, 4, 32)
inner = jax.vmap(jax.jit(lambda q, k, v: cuflash.flash_attn_func(q, k, v)[0]))(q5, k5, k5)  # vmap outside jit
np.testing.assert_array_equal(np.asarray(inner, np.float32),
                              np.asarray(jnp.stack([cuflash.flash_attn_func(q5[i], k5[i], k5[i])[0] for i in range(2)]),
                                         np.float32))
f = jax.jit(jax.vmap(lambda q, k, v: cuflash.flash_attn_func(q, k, v)[0]))
spread = [jax.device_put(x, NamedSharding(mesh, P(None, "data", None, "model", None))) for x in (q5, k5, k5)]
np.testing.assert_array_equal(np.asarray(f(*spread), np.float32), np.asarray(f(q5, k5, k5), np.float32))
eager = cuflash.flash_attn_func(*(jax.device_put(x, NamedSharding(mesh, dense)) for x in (q, k, v)))[0]
np.testing.assert_array_equal(np.asarray(eager, np.float32), np.asarray(cuflash.flash_attn_func(q, k, v)[0], np.float32))
try:
    from jax import shard_map
except ImportError:
    from jax.experimental.shard_map import shard_map
local = shard_map(lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True)[0], mesh=mesh,
                  in_specs=(dense,) * 3, out_specs=dense)  # each shard's call by hand, then its gradient
loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)
whole = lambda q, k, v: cuflash.flash_attn_func(q, k, v, causal=True)[0]
for a, b in zip(jax.jit(jax.grad(loss(local), argnums=(0, 1, 2)))(q, k, v), jax.grad(loss(whole), argnums=(0, 1, 2))(q, k, v)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
# shard_map outside jax.jit (its eager mode): the call is staged through jit there.
np.testing.assert_array_equal(np.asarray(local(q, k, v), np.float32), np.asarray(whole(q, k, v), np.float32))
for a, b in zip(jax.grad(loss(local), argnums=(0, 1, 2))(q, k, v), jax.grad(loss(whole), argnums=(0, 1, 2))(q, k, v)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
# vmap of an eager shard_map, and vmap inside one.
stacked = np.asarray(jnp.stack([whole(q5[i], k5[i], k5[i]) for i in range(2)]), np.float32)
np.testing.assert_array_equal(np.asarray(jax.vmap(local)(q5, k5, k5), np.float32), stacked)
spec5 = P(None, "data", None, "model", None)
inner_vmap = shard_map(jax.vmap(whole), mesh=mesh, in_specs=(spec5,) * 3, out_specs=spec5)
np.testing.assert_array_equal(np.asarray(inner_vmap(q5, k5, k5), np.float32), stacked)
# A sink replicated over the shards: its gradient is the sum of the shards' (psum in the backward).
sink = jnp.asarray(rng.standard_normal(8).astype(np.float32))
with_sink = lambda q, k, v, s: cuflash.flash_attn_func(q, k, v, causal=True, learnable_sink=s)[0]
sharded_sink = shard_map(with_sink, mesh=mesh, in_specs=(dense,) * 3 + (P("model"),), out_specs=dense)
batch_only = shard_map(with_sink, mesh=mesh, in_specs=(P("data"),) * 3 + (P(),), out_specs=P("data"))
loss4 = lambda f: lambda q, k, v, s: jnp.sum(f(q, k, v, s).astype(jnp.float32) ** 2)
expected = jax.grad(loss4(with_sink), argnums=(0, 1, 2, 3))(q, k, v, sink)
for f in (sharded_sink, batch_only, jax.jit(sharded_sink)):
    for a, b in zip(jax.grad(loss4(f), argnums=(0, 1, 2, 3))(q, k, v, sink), expected):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-2 * max(1.0, np.abs(b).max()))
print("vmap and eager agree")
"""


def test_sharded_arrays_under_jit():
    # Arrays sharded over a 2 x 2 mesh of CPU devices (batch over "data", heads over "model"):
    # the custom calls run per shard, with the results of one device, bit for bit. Dense GQA
    # and packed sequences stay sharded with no all-gather, forward and backward, also with more
    # head shards than kv heads (MQA, tensor parallelism past the kv heads: k / v whole, their
    # gradients summed, within a rounding); calls whose kernels read batch or head indices
    # elsewhere (a sink's gradient, ALiBi's slopes, pages' gradients) gather what they must. Several CPU devices exist only
    # when XLA is told before jax starts, so this runs in a fresh interpreter. shard_map with
    # jax.grad too, inside jax.jit and outside it (the custom calls' results carry the operands'
    # manual axes).
    import os
    import pathlib
    import subprocess
    import sys

    from cuflash import _jax as cuflash_jax

    if not cuflash_jax.available():
        pytest.skip("this cuflash build has no XLA FFI handlers")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(cuflash.__file__).parents[1]), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", SHARDED_PROGRAM], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["gqa"] == "['data', None, 'model'] False False"
    assert lines["varlen"] == "[None, 'model'] False False"
    # Query heads sharded past the kv heads, k / v whole on every shard: no gather either.
    assert lines["mqa"] == "['data', None, 'model'] False False"
    assert lines["gqa4"] == "[None, None, 'model'] False False"
    assert lines["varlen4"] == "[None, 'model'] False False"
    assert lines["gqa22"] == "[None, None, ('data', 'model')] False False"
    assert lines["groups"] == "['data', None, 'model'] False False"
    assert lines["vmap"] == "and eager agree"


def test_concrete_scalar_arrays_as_floats(rng):
    # softmax_scale / softcap given as 0-d JAX arrays: their values when concrete, refused by name
    # when traced (they set the kernels' constants).
    jnp = jax.numpy
    q = jnp.asarray(randn(rng, (1, 8, 2, 32)), jnp.bfloat16)
    got = cuflash.flash_attn_func(q, q, q, softmax_scale=jnp.float32(0.1), softcap=jnp.asarray(5.0))[0]
    expected = cuflash.flash_attn_func(q, q, q, softmax_scale=0.1, softcap=5.0)[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    with pytest.raises(TypeError, match="^softmax_scale: expected a Python float, got a traced JAX value"):
        jax.jit(lambda q, s: cuflash.flash_attn_func(q, q, q, softmax_scale=s)[0])(q, jnp.float32(0.1))



def test_score_mod_with_jax_numpy_functions(rng, path):
    # jax.numpy / jax.nn functions on the traced values record the same program as cuflash.mods'
    # (reached through jax, jax.numpy, a closure and a module global), and the call gives the
    # same bits; calls on concrete values inside the callable stay JAX's.
    jnp = jax.numpy
    tables = np.asarray(jnp.arange(4, dtype=jnp.float32) * 0.25)
    m = cuflash.mods

    def with_jax(score, b, h, q_idx, kv_idx):
        bias = jnp.where(kv_idx > q_idx, -1.5, 0.5) * float(jnp.sqrt(4.0))
        capped = 3.0 * jax_tanh(score / 3.0)
        s = jnp.maximum(capped + bias, jax.numpy.clip(score, -2.0, 2.0)) - jnp.abs(kv_idx - q_idx) * 0.01
        s = s + jnp.square(score) * jnp.float32(0.125) - jnp.power(score, 3) * 0.01
        return s + jax.nn.sigmoid(score) * tables[h]

    def with_mods(score, b, h, q_idx, kv_idx):
        bias = m.where(kv_idx > q_idx, -1.5, 0.5) * 2.0
        capped = 3.0 * m.tanh(score / 3.0)
        s = m.maximum(capped + bias, m.clamp(score, -2.0, 2.0)) - abs(kv_idx - q_idx) * 0.01
        s = s + score * score * 0.125 - score ** 3 * 0.01
        return s + m.sigmoid(score) * tables[h]

    def masked(b, h, q_idx, kv_idx):
        return jnp.logical_or(jnp.less_equal(kv_idx, q_idx), jnp.equal(h, 0))

    a, b = m.trace_score_mod(with_jax), m.trace_score_mod(with_mods)
    assert (a.code, a.types, a.constants, a.grad) == (b.code, b.types, b.constants, b.grad)
    q, k, v = (on_cpu(randn(rng, (1, 24, 4, 32), "bfloat16"))[0] for _ in range(3))
    got = cuflash.flash_attn_forward(q, k, v, score_mod=with_jax, mask_mod=masked)
    expected = cuflash.flash_attn_forward(q, k, v, score_mod=with_mods,
                                          mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | (h == 0))
    for x, y in zip(got, expected):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_score_mod_with_an_unsupported_jax_function_is_named(rng):
    jnp = jax.numpy
    q = on_cpu(randn(rng, (1, 8, 2, 32), "bfloat16"))[0]
    with pytest.raises(TypeError, match=r"score_mod: jax\.numpy\.sin is not supported on traced values"):
        cuflash.flash_attn_varlen_func(q, q, q, score_mod=lambda score, b, h, q_idx, kv_idx: jnp.sin(score))
