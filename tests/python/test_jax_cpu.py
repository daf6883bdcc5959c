"""Eager JAX arrays on the CPU, outputs returned as JAX arrays: through the XLA FFI handlers
where the build has them, else by DLPack (both paths run here when the handlers are built).
jax.jit and jax.grad: test_jax_jit.py."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed")

import cuflash  # noqa: E402
import attention_reference as ref  # noqa: E402
from conftest import assert_close, assert_lse_close, randn  # noqa: E402

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


def test_traced_values_need_the_handlers(rng, monkeypatch):
    from cuflash import _jax

    monkeypatch.setattr(_jax, "available", lambda: False)
    q = jax.device_put(randn(rng, (1, 8, 2, 32)), CPU)

    @jax.jit
    def attention(x):
        return cuflash.flash_attn_func(x, x, x)[0]

    with pytest.raises(TypeError, match="^q: .*jax"):
        attention(q)


def test_arrays_on_several_devices_are_refused_by_name():
    # A sharded (or replicated) eager array: refused naming the argument. Several CPU devices
    # exist only when XLA is told before jax starts, so this runs in a fresh interpreter.
    import os
    import pathlib
    import subprocess
    import sys

    program = (
        "import jax, jax.numpy as jnp, numpy as np, cuflash\n"
        "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
        "mesh = Mesh(np.array(jax.devices()), ('x',))\n"
        "q = jnp.zeros((2, 8, 2, 32), jnp.bfloat16)\n"
        "k = jax.device_put(q, NamedSharding(mesh, P('x')))\n"
        "try:\n"
        "    cuflash.flash_attn_func(q, k, q)\n"
        "except ValueError as error:\n"
        "    print(error)\n")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(cuflash.__file__).parents[1]), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("k: a JAX array on 2 devices"), result.stdout


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
