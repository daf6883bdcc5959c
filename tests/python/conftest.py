from __future__ import annotations

import zlib

import numpy as np
import pytest

TOLERANCE = {  # (atol, rtol) of a 16-bit output against the float64 reference
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
}


def numpy_dtype(name: str):
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 NumPy arrays need ml_dtypes")
        return ml_dtypes.bfloat16
    return np.dtype(name)


def randn(rng: np.random.Generator, shape, dtype: str = "float16", scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(numpy_dtype(dtype))


def assert_close(actual, expected, dtype: str = "float16", scale: float = 1.0, what: str = ""):
    """|actual - expected| <= atol * scale + rtol * |expected|, with NaN never allowed."""
    actual = np.asarray(actual).astype(np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert not np.isnan(actual).any(), f"{what}: NaN in the result"
    atol, rtol = TOLERANCE[dtype]
    both_inf = np.isinf(actual) & np.isinf(expected) & (np.sign(actual) == np.sign(expected))
    error = np.where(both_inf, 0.0, np.abs(actual - expected))
    bound = atol * scale + rtol * np.abs(np.where(both_inf, 0.0, expected))
    worst = np.unravel_index(np.argmax(error - bound), error.shape) if error.size else ()
    assert (error <= bound).all(), (
        f"{what}: max error {error.max():.3g} at {worst}: got {actual[worst]}, expected {expected[worst]}")


def assert_lse_close(actual, expected, what: str = "lse"):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert not np.isnan(actual).any(), f"{what}: NaN in the result"
    assert np.array_equal(np.isneginf(actual), np.isneginf(expected)), f"{what}: -inf rows differ"
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], atol=1e-4, rtol=1e-4, err_msg=what)


@pytest.fixture
def rng(request) -> np.random.Generator:
    # A seed per test, stable across runs.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
