"""The C++ functors generated from traced callables (cuflash._codegen), for the GPU's run-time
compilation: compiled here as host C++ (the functions are __host__ __device__ under nvcc, plain
inline in host code) and evaluated through ctypes against the callables run on NumPy."""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from cuflash import _codegen, mods

ROOT = Path(__file__).resolve().parents[2]
CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

HARNESS = r"""
extern "C" double cf_eval(int which, const float* k, const void* const* aux, const int* shapes,
                          float s, int b, int h, int q_idx, int kv_idx) {
  cuflash::ModParams p;
  for (int i = 0; i < cuflash::ModParams::kMaxScalars; ++i) p.scalars[i] = k[i];
  for (int i = 0; i < cuflash::ModParams::kMaxAux; ++i) {
    p.aux[i] = aux[i];
    for (int d = 0; d < 4; ++d) p.aux_shape[i][d] = shapes[4 * i + d];
  }
  auto sw = GeneratedSwitch::from(p);
  double result = 0;
  sw.visit([&](auto const& mod) { result = EVAL; });
  return result;
}
"""


def compile_functor(tmp_path, traced):
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = _codegen.functor_source(traced, "Generated")
    if traced.role == "score":
        evaluate = "which == 0 ? mod.score(s, b, h, q_idx, kv_idx) : mod.grad(s, b, h, q_idx, kv_idx)"
    else:
        evaluate = "mod.visible(b, h, q_idx, kv_idx) ? 1.0 : 0.0"
    path = tmp_path / "functor.cpp"
    path.write_text(source + HARNESS.replace("EVAL", evaluate))
    library = tmp_path / "functor.so"
    result = subprocess.run([CXX, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Werror", "-Wno-unused-variable",
                             f"-I{ROOT / 'src'}", f"-I{ROOT / 'include'}", str(path), "-o", str(library)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr + "\n" + source
    lib = ctypes.CDLL(str(library))
    lib.cf_eval.restype = ctypes.c_double
    lib.cf_eval.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_void_p),
                            ctypes.POINTER(ctypes.c_int), ctypes.c_float] + [ctypes.c_int] * 4

    constants = (ctypes.c_float * 16)(*(traced.constants + [0.0] * (16 - len(traced.constants))))
    tensors = [np.ascontiguousarray(a, dtype=np.float32 if kind == "float" else np.int32)
               for a, kind in zip(traced.aux, traced.aux_kinds)]
    pointers = (ctypes.c_void_p * 4)(*([t.ctypes.data for t in tensors] + [None] * (4 - len(tensors))))
    shapes = []
    for i in range(4):
        shape = list(tensors[i].shape) if i < len(tensors) else []
        shapes += shape + [1] * (4 - len(shape))
    shapes = (ctypes.c_int * 16)(*shapes)

    def evaluate(which, s, b, h, q_idx, kv_idx):
        return lib.cf_eval(which, constants, pointers, shapes, s, b, h, q_idx, kv_idx)

    evaluate.keep = (lib, tensors, constants, pointers, shapes)
    return evaluate


rng = np.random.default_rng(3)
SLOPES = rng.random(4).astype(np.float32)
TABLE = rng.standard_normal((4, 9)).astype(np.float32)
DOC = np.sort(rng.integers(0, 3, (2, 16))).astype(np.int32)
ALLOWED = rng.random((4, 16, 16)) < 0.5
BIAS = rng.standard_normal((2, 4, 16, 16)).astype(np.float32)  # FlexAttention's full bias

SCORE_MODS = [
    lambda s, b, h, i, j: s + SLOPES[h] * (j - i),
    lambda s, b, h, i, j: s + TABLE[h, mods.clamp(j - i, -4, 4) + 4],
    lambda s, b, h, i, j: 3.0 * mods.tanh(s / 3.0),
    lambda s, b, h, i, j: s * mods.sigmoid(s) + mods.exp2(-abs(s)) - mods.log(1.0 + s * s),
    lambda s, b, h, i, j: mods.where((i // 3) % 2 == b, s * 0.5, mods.maximum(s, -0.25) + h),
    lambda s, b, h, i, j: mods.sqrt(s * s + 1.0) / (1.0 + abs(j - i)) + mods.exp(mods.minimum(s, 1.0)),
    lambda s, b, h, i, j: s + BIAS[b, h, i, j] * SLOPES[h],
]

MASK_MODS = [
    lambda b, h, i, j: j <= i,
    lambda b, h, i, j: (j <= i) & (DOC[b, i] == DOC[b, j]),
    lambda b, h, i, j: ALLOWED[h, i, j] | ~((i - j) % 4 != 0),
    lambda b, h, i, j: mods.where(h > 1, j >= i - 2, (j < 3) | (j <= i)),
]


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
@pytest.mark.parametrize("index", range(len(SCORE_MODS)))
def test_generated_score_functor(tmp_path, index):
    fn = SCORE_MODS[index]
    traced = mods.trace_score_mod(fn)
    evaluate = compile_functor(tmp_path, traced)
    for _ in range(200):
        s = float(rng.standard_normal() * 3)
        b, h, i, j = int(rng.integers(0, 2)), int(rng.integers(0, 4)), int(rng.integers(0, 16)), int(rng.integers(0, 16))
        s32 = float(np.float32(s))
        expected = float(fn(np.float64(s32), b, h, np.int64(i), np.int64(j)))
        assert math.isclose(evaluate(0, s32, b, h, i, j), expected, rel_tol=1e-4, abs_tol=1e-4)
        step = 1e-4 * max(1.0, abs(s32))
        numeric = (float(fn(np.float64(s32 + step), b, h, np.int64(i), np.int64(j)))
                   - float(fn(np.float64(s32 - step), b, h, np.int64(i), np.int64(j)))) / (2 * step)
        assert math.isclose(evaluate(1, s32, b, h, i, j), numeric, rel_tol=1e-3, abs_tol=1e-3)


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
@pytest.mark.parametrize("index", range(len(MASK_MODS)))
def test_generated_mask_functor(tmp_path, index):
    fn = MASK_MODS[index]
    traced = mods.trace_mask_mod(fn)
    evaluate = compile_functor(tmp_path, traced)
    for b in range(2):
        for h in range(4):
            for i in range(16):
                for j in range(16):
                    assert evaluate(0, 0.0, b, h, i, j) == float(bool(fn(b, h, np.int64(i), np.int64(j))))


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_generated_loads_clamp_indices(tmp_path):
    traced = mods.trace_score_mod(lambda s, b, h, i, j: s + SLOPES[j])  # j past 3 reads the last slope
    evaluate = compile_functor(tmp_path, traced)
    assert math.isclose(evaluate(0, 0.0, 0, 0, 0, 10), float(SLOPES[3]), rel_tol=1e-6)
    assert math.isclose(evaluate(0, 0.0, 0, 0, 0, 2), float(SLOPES[2]), rel_tol=1e-6)
    # Every dimension of a 4-D tensor is clamped on its own: h + 5 past 3 reads head 3's row.
    traced = mods.trace_score_mod(lambda s, b, h, i, j: s + BIAS[b, h + 5, i, j + 20])
    evaluate = compile_functor(tmp_path / "bias", traced)
    assert math.isclose(evaluate(0, 0.0, 1, 0, 7, 0), float(BIAS[1, 3, 7, 15]), rel_tol=1e-6)


def wrap32(x):
    """Two's complement wrap into int32 (Python ints or NumPy int64 arrays)."""
    return ((x + 2 ** 31) % 2 ** 32) - 2 ** 31


# Integer arithmetic past int32, with its value under 32-bit wrapping: the generated code and the
# CPU reference (test_callables.py) both wrap.
OVERFLOWING = [
    (lambda b, h, i, j: i * 2000000000 + j, lambda b, h, i, j: wrap32(wrap32(i * 2000000000) + j)),
    (lambda b, h, i, j: (j - i * 1500000000) - 1500000000,
     lambda b, h, i, j: wrap32(wrap32(j - wrap32(i * 1500000000)) - 1500000000)),
    (lambda b, h, i, j: (i * 2000000000) // (j - 17), lambda b, h, i, j: wrap32(wrap32(i * 2000000000) // (j - 17))),
    (lambda b, h, i, j: (i * 2000000000) % (j + 5), lambda b, h, i, j: wrap32(i * 2000000000) % (j + 5)),
    (lambda b, h, i, j: -(i * 1073741824) + abs(j * 1073741824 - 2147483647 - 1),
     lambda b, h, i, j: wrap32(wrap32(-wrap32(i * 1073741824)) + wrap32(abs(wrap32(wrap32(j * 1073741824) - 2147483647 - 1))))),
    (lambda b, h, i, j: (-2147483647 - 1 + i * 0) // -1, lambda b, h, i, j: -2147483648),
]


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
@pytest.mark.parametrize("index", range(len(OVERFLOWING)))
def test_generated_int_arithmetic_wraps(tmp_path, index):
    fn, expected = OVERFLOWING[index]
    # The value reaches the float result in two exact 16-bit halves (a float holds 24 bits).
    halves = [(lambda s, b, h, i, j: fn(b, h, i, j) // 65536, lambda x: x // 65536),
              (lambda s, b, h, i, j: fn(b, h, i, j) % 65536, lambda x: x % 65536)]
    for half, (score_mod, part) in enumerate(halves):
        evaluate = compile_functor(tmp_path / str(half), mods.trace_score_mod(score_mod))
        for i in range(0, 12):
            for j in range(0, 12):
                assert evaluate(0, 0.0, 0, 0, i, j) == float(part(expected(0, 0, i, j))), (half, i, j)


HOOKS_HARNESS = r"""
extern "C" int cf_hook(int which, const void* const* aux, const int* shapes, int a0, int a1, int* lo, int* hi) {
  cuflash::ModParams p;
  for (int i = 0; i < cuflash::ModParams::kMaxAux; ++i) {
    p.aux[i] = aux[i];
    for (int d = 0; d < 4; ++d) p.aux_shape[i][d] = shapes[4 * i + d];
  }
  auto sw = GeneratedSwitch::from(p);
  int result = 0;
  sw.visit([&](auto const& mod) {
    if (which == 0) result = mod.all_visible(a0, a1, *lo, *hi) ? 1 : 0;
    if (which == 1) mod.col_range(a0, a1, *lo, *hi);
    if (which == 2) mod.row_range(a0, a1, *lo, *hi);
  });
  return result;
}
"""

TABLE_DOC = np.repeat(np.arange(5), 64)[None, :].repeat(2, axis=0).astype(np.int32)  # (2, 320)

# Masks whose block-level hooks come from the program's intervals, with whether the hooks must
# narrow (causal-like programs of positions) or may leave everything (tables, b, h).
HOOK_MASKS = [
    ("causal", lambda b, h, i, j: j <= i, True),
    ("window", lambda b, h, i, j: (j <= i) & (i - j <= 40), True),
    ("bidirectional", lambda b, h, i, j: abs(i - j) <= 17, True),
    ("prefix", lambda b, h, i, j: (j <= i) | (j < 30), True),
    ("chunked", lambda b, h, i, j: i // 64 == j // 64, True),
    ("shifted", lambda b, h, i, j: j * 2 - 5 <= i + 3, True),
    ("capped", lambda b, h, i, j: j <= mods.minimum(i, 100), True),
    ("selected", lambda b, h, i, j: j <= mods.where(i > 50, i, 50), True),
    ("negated", lambda b, h, i, j: ~(j > i) & ~(j < i - 90), True),
    ("dilated", lambda b, h, i, j: ((i - j) % 4 == 0) & (j <= i), True),
    ("per_head", lambda b, h, i, j: mods.where(h > 1, j <= i, j >= i), False),
    ("document", lambda b, h, i, j: (TABLE_DOC[b, i] == TABLE_DOC[b, j]) & (j <= i), True),
    ("table_only", lambda b, h, i, j: TABLE_DOC[b, i] == TABLE_DOC[b, j], False),
    ("positions_free", lambda b, h, i, j: TABLE_DOC[b, 5] == h, False),
]


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
@pytest.mark.parametrize("name, fn, narrows", HOOK_MASKS, ids=[m[0] for m in HOOK_MASKS])
def test_generated_mask_hooks_are_sound(tmp_path, name, fn, narrows):
    """all_visible only where every element is visible; col_range / row_range keep every column /
    row that some element of the rectangle sees; for programs of positions they do narrow."""
    traced = mods.trace_mask_mod(fn)
    source = _codegen.functor_source(traced, "Generated") + HOOKS_HARNESS
    path = tmp_path / "hooks.cpp"
    path.write_text(source)
    library = tmp_path / "hooks.so"
    result = subprocess.run([CXX, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Werror", f"-I{ROOT / 'src'}",
                             f"-I{ROOT / 'include'}", str(path), "-o", str(library)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr + "\n" + source
    lib = ctypes.CDLL(str(library))
    tensors = [np.ascontiguousarray(a, dtype=np.int32) for a in traced.aux]
    pointers = (ctypes.c_void_p * 4)(*([t.ctypes.data for t in tensors] + [None] * (4 - len(tensors))))
    shape_list = []
    for i in range(4):
        shape = list(tensors[i].shape) if i < len(tensors) else []
        shape_list += shape + [1] * (4 - len(shape))
    shapes = (ctypes.c_int * 16)(*shape_list)

    def hook(which, a0, a1, lo, hi):
        lo_, hi_ = ctypes.c_int(lo), ctypes.c_int(hi)
        flag = lib.cf_hook(which, pointers, shapes, a0, a1, ctypes.byref(lo_), ctypes.byref(hi_))
        return flag, lo_.value, hi_.value

    length = 320
    positions = np.arange(length)
    b, h = np.arange(2)[:, None, None, None], np.arange(4)[None, :, None, None]
    seen = np.broadcast_to(np.asarray(fn(b, h, positions[:, None], positions[None, :]), dtype=bool),
                           (2, 4, length, length)).any(axis=(0, 1))  # (q, kv): seen for some b, h
    every = np.broadcast_to(np.asarray(fn(b, h, positions[:, None], positions[None, :]), dtype=bool),
                            (2, 4, length, length)).all(axis=(0, 1))
    generator = np.random.default_rng(7)
    narrowed = 0
    for _ in range(300):
        r0, r1 = sorted(generator.integers(0, length, 2))
        c0, c1 = sorted(generator.integers(0, length, 2))
        if generator.random() < 0.3:  # whole rows or columns, as the kernels ask
            c0, c1 = 0, length - 1
        flag, _, _ = hook(0, int(r0), int(r1), int(c0), int(c1))
        if flag:
            assert every[r0:r1 + 1, c0:c1 + 1].all(), (name, r0, r1, c0, c1)
        _, begin, end = hook(1, int(r0), int(r1), int(c0), int(c1) + 1)
        assert c0 <= begin and end <= c1 + 1
        columns = np.flatnonzero(seen[r0:r1 + 1, c0:c1 + 1].any(axis=0)) + c0
        assert all(begin <= c < end for c in columns), (name, r0, r1, c0, c1, begin, end)
        _, begin_r, end_r = hook(2, int(c0), int(c1), int(r0), int(r1) + 1)
        assert r0 <= begin_r and end_r <= r1 + 1
        rows = np.flatnonzero(seen[r0:r1 + 1, c0:c1 + 1].any(axis=1)) + r0
        assert all(begin_r <= r < end_r for r in rows), (name, r0, r1, c0, c1, begin_r, end_r)
        narrowed += (begin, end) != (c0, c1 + 1) or (begin_r, end_r) != (r0, r1 + 1) or flag
    assert (narrowed > 0) == narrows
    if name == "causal":  # exact for a row interval: the keys up to the last row
        assert hook(1, 100, 163, 0, length)[1:] == (0, 164)
        assert hook(2, 100, 163, 0, length)[1:] == (100, length)
        assert hook(0, 200, 263, 0, 200)[0] == 1 and hook(0, 200, 263, 0, 201)[0] == 0


def random_mask_source(generator, depth=3):
    """A random mask_mod body over b, h, i (q_idx), j (kv_idx): int arithmetic (+ - * // % min
    max abs neg where) under comparisons and & | ~."""

    def integer(d):
        if d == 0 or generator.random() < 0.25:
            return str(generator.choice(["i", "j", "i", "j", "h", str(int(generator.integers(-7, 10)))]))
        kind = generator.integers(0, 9)
        a, b = integer(d - 1), integer(d - 1)
        if kind < 5:
            return f"({a} {['+', '-', '*', '//', '%'][kind]} {b})"
        if kind == 5:
            return f"mods.{generator.choice(['minimum', 'maximum'])}({a}, {b})"
        if kind == 6:
            return f"abs({a})"
        if kind == 7:
            return f"(-{a})"
        return f"mods.where({boolean(d - 1)}, {a}, {b})"

    def boolean(d):
        kind = generator.integers(0, 4) if d > 0 else 0
        if kind <= 1:
            return f"({integer(d)} {generator.choice(['<', '<=', '>', '>=', '==', '!='])} {integer(d)})"
        if kind == 2:
            return f"({boolean(d - 1)} {generator.choice(['&', '|'])} {boolean(d - 1)})"
        return f"(~{boolean(d - 1)})"

    return boolean(depth)


FUZZ_HARNESS = r"""
extern "C" int cf_fuzz(int index, int which, int b, int h, int a0, int a1, int* lo, int* hi) {
  int result = 0;
  auto run = [&](auto const& sw) {
    sw.visit([&](auto const& mod) {
      if (which == 0) result = mod.all_visible(a0, a1, *lo, *hi) ? 1 : 0;
      if (which == 1) mod.col_range(a0, a1, *lo, *hi);
      if (which == 2) mod.row_range(a0, a1, *lo, *hi);
      if (which == 3) result = mod.visible(b, h, a0, a1) ? 1 : 0;
    });
  };
  cuflash::ModParams p;
  switch (index) {
CASES
  }
  return result;
}
"""


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_generated_mask_hooks_fuzz(tmp_path):
    """The interval hooks of 60 random programs of positions (wrapping int arithmetic, floor
    division and modulo by values that may be 0 or negative, selects): never a claim the point
    functor contradicts on any rectangle tried."""
    generator = np.random.default_rng(11)
    traced = []
    while len(traced) < 60:
        body = random_mask_source(generator)
        fn = eval(f"lambda b, h, i, j: {body}", {"mods": mods})  # noqa: S307 (generated here)
        try:
            t = mods.trace_mask_mod(fn)
        except TypeError:
            continue
        if t.num_ops <= mods.MAX_OPS:
            traced.append((body, t))
    sources = [_codegen.functor_source(t, f"Fuzz{k}") for k, (_, t) in enumerate(traced)]
    cases = "\n".join(f"    case {k}: run(Fuzz{k}Switch::from(p)); break;" for k in range(len(traced)))
    path = tmp_path / "fuzz.cpp"
    path.write_text("\n".join(sources) + FUZZ_HARNESS.replace("CASES", cases))
    library = tmp_path / "fuzz.so"
    result = subprocess.run([CXX, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{ROOT / 'src'}",
                             f"-I{ROOT / 'include'}", str(path), "-o", str(library)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    lib = ctypes.CDLL(str(library))

    def call(index, which, b, h, a0, a1, lo=0, hi=0):
        lo_, hi_ = ctypes.c_int(lo), ctypes.c_int(hi)
        flag = lib.cf_fuzz(index, which, b, h, a0, a1, ctypes.byref(lo_), ctypes.byref(hi_))
        return flag, lo_.value, hi_.value

    length = 40
    for k, (body, _) in enumerate(traced):
        visible = np.array([[[[call(k, 3, b, h, q, kv)[0] for kv in range(length)] for q in range(length)]
                             for h in range(3)] for b in range(2)], dtype=bool)
        seen, every = visible.any(axis=(0, 1)), visible.all(axis=(0, 1))
        for _ in range(40):
            r0, r1 = sorted(int(x) for x in generator.integers(0, length, 2))
            c0, c1 = sorted(int(x) for x in generator.integers(0, length, 2))
            if call(k, 0, 0, 0, r0, r1, c0, c1)[0]:
                assert every[r0:r1 + 1, c0:c1 + 1].all(), (body, r0, r1, c0, c1)
            _, begin, end = call(k, 1, 0, 0, r0, r1, c0, c1 + 1)
            columns = np.flatnonzero(seen[r0:r1 + 1, c0:c1 + 1].any(axis=0)) + c0
            assert c0 <= begin and end <= c1 + 1 and all(begin <= c < end for c in columns), (body, r0, r1, c0, c1)
            _, begin, end = call(k, 2, 0, 0, c0, c1, r0, r1 + 1)
            rows = np.flatnonzero(seen[r0:r1 + 1, c0:c1 + 1].any(axis=1)) + r0
            assert r0 <= begin and end <= r1 + 1 and all(begin <= r < end for r in rows), (body, r0, r1, c0, c1)


def test_source_depends_on_structure_only():
    a = _codegen.functor_source(mods.trace_score_mod(lambda s, b, h, i, j: s * 2.0), "F")
    b = _codegen.functor_source(mods.trace_score_mod(lambda s, b, h, i, j: s * 5.0), "F")
    assert a == b


NVCC = shutil.which("nvcc")

DEVICE_KERNEL = r"""
__global__ void use_generated(ScoreSwitch score, MaskSwitch mask, float* out) {
  int const i = threadIdx.x, j = blockIdx.x;
  float value = 0.f, grad = 0.f;
  bool visible = false;
  score.visit([&](auto const& mod) {
    value = mod.score(out[i], 0, 1, i, j);
    grad = mod.grad(out[i], 0, 1, i, j);
  });
  mask.visit([&](auto const& mod) {
    int lo = 0, hi = j + 1;
    mod.col_range(i, i + 63, lo, hi);
    mod.row_range(lo, hi, lo, hi);
    visible = mod.visible(0, 1, i, j) && !mod.all_visible(i, i + 63, lo, hi);
  });
  out[i + j] = visible ? value * grad : 0.f;
}
"""


@pytest.mark.skipif(NVCC is None, reason="no nvcc")
def test_generated_functors_compile_as_sm90a_device_code(tmp_path):
    score = mods.trace_score_mod(SCORE_MODS[3])
    mask = mods.trace_mask_mod(MASK_MODS[1])
    path = tmp_path / "generated.cu"
    path.write_text(_codegen.functor_source(score, "Score") + _codegen.functor_source(mask, "Mask") + DEVICE_KERNEL)
    result = subprocess.run([NVCC, "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
                             "-Werror", "all-warnings", f"-I{ROOT / 'src'}", f"-I{ROOT / 'include'}", "-c", str(path),
                             "-o", str(tmp_path / "generated.o")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
