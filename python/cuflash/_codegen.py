"""C++ source of a traced score_mod / mask_mod (cuflash.mods.TracedMod): a functor with the
interface of the built-ins (src/variants/builtin_mods.hpp) and a "switch" type that the flex
kernels visit (as ScoreModSwitch / MaskModSwitch), for compilation at run time.

The program becomes straight-line code, one local per register. Float constants and the tensors
come from ModParams at run time (scalars, aux, aux_shape), so the source (and a compiled kernel)
depends only on the program's structure (TracedMod.structure_key), not on constant values or
tensor contents. A mask functor has no block-level narrowing: col_range / row_range leave the
ranges as they are and all_visible is false, so every element is asked, unless the program reads
q_idx or kv_idx: then the hooks come from its evaluation over intervals (`_mask_hooks`). Tensor indices are
clamped into range (the CPU reference raises an error instead). Integer arithmetic wraps (32-bit
two's complement, through unsigned arithmetic, which C++ defines), as the CPU reference's does.

Functions are `CUFLASH_EXPR_FN`: __host__ __device__ and force-inlined under nvcc (the WGMMA
pipeline must not cross a call, DESIGN.md section 7), plain inline functions in host C++, which
is how the tests check the generated code without a GPU.
"""

from __future__ import annotations

from typing import List

from . import mods as _m

_PRELUDE = r"""
#ifndef CUFLASH_EXPR_PRELUDE
#define CUFLASH_EXPR_PRELUDE
#include <cmath>
#include "api/params.hpp"
#ifdef __CUDACC__
#define CUFLASH_EXPR_FN __host__ __device__ __forceinline__
#else
#define CUFLASH_EXPR_FN inline
#endif
namespace cuflash::expr {
CUFLASH_EXPR_FN int clamp_index(int i, int n) { return i < 0 ? 0 : (i >= n ? n - 1 : i); }
// Wrapping int arithmetic (signed overflow would be undefined).
CUFLASH_EXPR_FN int iadd(int a, int b) { return static_cast<int>(static_cast<unsigned>(a) + static_cast<unsigned>(b)); }
CUFLASH_EXPR_FN int isub(int a, int b) { return static_cast<int>(static_cast<unsigned>(a) - static_cast<unsigned>(b)); }
CUFLASH_EXPR_FN int imul(int a, int b) { return static_cast<int>(static_cast<unsigned>(a) * static_cast<unsigned>(b)); }
CUFLASH_EXPR_FN int ineg(int a) { return static_cast<int>(0u - static_cast<unsigned>(a)); }
// Python's floor division and modulo on ints; 0 for a zero divisor (the CPU reference raises).
// INT_MIN // -1 wraps to INT_MIN.
CUFLASH_EXPR_FN int floordiv(int a, int b) {
  if (b == 0) return 0;
  if (b == -1) return ineg(a);
  int q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
CUFLASH_EXPR_FN int floormod(int a, int b) { return b == 0 ? 0 : isub(a, imul(b, floordiv(a, b))); }
CUFLASH_EXPR_FN int imin(int a, int b) { return a < b ? a : b; }
CUFLASH_EXPR_FN int imax(int a, int b) { return a > b ? a : b; }
CUFLASH_EXPR_FN int iabs(int a) { return a < 0 ? ineg(a) : a; }
CUFLASH_EXPR_FN float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// A mask program evaluated over a rectangle of positions (q_idx in [q0, q1], kv_idx in [k0, k1],
// any b and h), for the block-level hooks: an int as the interval of its values (the int32 range
// where an operation may wrap), a bool as which of false / true it may be, a float as unknown.
// Every operation gives an interval that holds each value it takes on the rectangle (and on any
// rectangle inside it), so that "never true" and "never false" are safe to act on.
struct IInt { long long lo, hi; };
struct IBool { bool f, t; };
struct IFloat {};
constexpr long long kIntMin = -2147483648LL, kIntMax = 2147483647LL;
CUFLASH_EXPR_FN long long lmin(long long a, long long b) { return a < b ? a : b; }
CUFLASH_EXPR_FN long long lmax(long long a, long long b) { return a > b ? a : b; }
CUFLASH_EXPR_FN IInt iv_int(long long lo, long long hi) {
  return (lo < kIntMin || hi > kIntMax) ? IInt{kIntMin, kIntMax} : IInt{lo, hi};
}
CUFLASH_EXPR_FN IInt iv_any() { return {kIntMin, kIntMax}; }
CUFLASH_EXPR_FN IInt iv_add(IInt a, IInt b) { return iv_int(a.lo + b.lo, a.hi + b.hi); }
CUFLASH_EXPR_FN IInt iv_sub(IInt a, IInt b) { return iv_int(a.lo - b.hi, a.hi - b.lo); }
CUFLASH_EXPR_FN IInt iv_mul(IInt a, IInt b) {
  long long const p0 = a.lo * b.lo, p1 = a.lo * b.hi, p2 = a.hi * b.lo, p3 = a.hi * b.hi;
  return iv_int(lmin(lmin(p0, p1), lmin(p2, p3)), lmax(lmax(p0, p1), lmax(p2, p3)));
}
CUFLASH_EXPR_FN IInt iv_neg(IInt a) { return iv_int(-a.hi, -a.lo); }
CUFLASH_EXPR_FN IInt iv_abs(IInt a) {
  if (a.lo >= 0) return a;
  if (a.hi <= 0) return iv_neg(a);
  return iv_int(0, lmax(-a.lo, a.hi));
}
CUFLASH_EXPR_FN IInt iv_min(IInt a, IInt b) { return {lmin(a.lo, b.lo), lmin(a.hi, b.hi)}; }
CUFLASH_EXPR_FN IInt iv_max(IInt a, IInt b) { return {lmax(a.lo, b.lo), lmax(a.hi, b.hi)}; }
CUFLASH_EXPR_FN long long floordiv_ll(long long a, long long b) {
  long long q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
// Floor division is monotone in each operand while the divisor keeps its sign: the extremes
// are at the corners. A divisor interval holding 0 gives any value.
CUFLASH_EXPR_FN IInt iv_floordiv(IInt a, IInt b) {
  if (b.lo <= 0 && b.hi >= 0) return iv_any();
  long long const q0 = floordiv_ll(a.lo, b.lo), q1 = floordiv_ll(a.lo, b.hi), q2 = floordiv_ll(a.hi, b.lo),
                  q3 = floordiv_ll(a.hi, b.hi);
  return iv_int(lmin(lmin(q0, q1), lmin(q2, q3)), lmax(lmax(q0, q1), lmax(q2, q3)));
}
CUFLASH_EXPR_FN IInt iv_floormod(IInt a, IInt b) {
  if (b.lo == b.hi && b.lo != 0) {
    long long const c = b.lo;
    if (floordiv_ll(a.lo, c) == floordiv_ll(a.hi, c)) {  // within one period: follows a
      long long const r0 = a.lo - c * floordiv_ll(a.lo, c), r1 = a.hi - c * floordiv_ll(a.hi, c);
      return {lmin(r0, r1), lmax(r0, r1)};
    }
    return c > 0 ? IInt{0, c - 1} : IInt{c + 1, 0};
  }
  if (b.lo > 0) return {0, b.hi - 1};
  if (b.hi < 0) return {b.lo + 1, 0};
  return iv_any();
}
CUFLASH_EXPR_FN IInt iv_select(IBool c, IInt x, IInt y) {
  if (!c.f) return x;
  if (!c.t) return y;
  return {lmin(x.lo, y.lo), lmax(x.hi, y.hi)};
}
CUFLASH_EXPR_FN IBool bv_select(IBool c, IBool x, IBool y) {
  if (!c.f) return x;
  if (!c.t) return y;
  return {x.f || y.f, x.t || y.t};
}
CUFLASH_EXPR_FN IInt iv_from_bool(IBool a) { return {a.f ? 0 : 1, a.t ? 1 : 0}; }
CUFLASH_EXPR_FN IBool iv_lt(IInt a, IInt b) { return {a.hi >= b.lo, a.lo < b.hi}; }
CUFLASH_EXPR_FN IBool iv_le(IInt a, IInt b) { return {a.hi > b.lo, a.lo <= b.hi}; }
CUFLASH_EXPR_FN IBool iv_eq(IInt a, IInt b) {
  return {!(a.lo == a.hi && b.lo == b.hi && a.lo == b.lo), a.lo <= b.hi && b.lo <= a.hi};
}
CUFLASH_EXPR_FN IBool bv_not(IBool a) { return {a.t, a.f}; }
CUFLASH_EXPR_FN IBool bv_and(IBool a, IBool b) { return {a.f || b.f, a.t && b.t}; }
CUFLASH_EXPR_FN IBool bv_or(IBool a, IBool b) { return {a.f && b.f, a.t || b.t}; }

// The runtime state of one expression: its float constants and tensors (from ModParams).
struct ExprState {
  float k[cuflash::ModParams::kMaxScalars];
  const void* aux[cuflash::ModParams::kMaxAux];
  int shape[cuflash::ModParams::kMaxAux][4];

  CUFLASH_EXPR_FN static ExprState from(cuflash::ModParams const& mod) {
    ExprState state{};
    for (int i = 0; i < cuflash::ModParams::kMaxScalars; ++i) state.k[i] = mod.scalars[i];
    for (int i = 0; i < cuflash::ModParams::kMaxAux; ++i) {
      state.aux[i] = mod.aux[i];
      for (int d = 0; d < 4; ++d) state.shape[i][d] = mod.aux_shape[i][d] > 0 ? mod.aux_shape[i][d] : 1;
    }
    return state;
  }
  // Row-major offset of (i0, i1, i2, i3) in tensor `slot`, each index clamped into range (the
  // dimensions past a tensor's own have size 1 and index 0).
  CUFLASH_EXPR_FN long long offset(int slot, int i0, int i1, int i2, int i3) const {
    return ((static_cast<long long>(clamp_index(i0, shape[slot][0])) * shape[slot][1] +
             clamp_index(i1, shape[slot][1])) * shape[slot][2] + clamp_index(i2, shape[slot][2])) *
               shape[slot][3] + clamp_index(i3, shape[slot][3]);
  }
  CUFLASH_EXPR_FN float load_float(int slot, int i0, int i1, int i2, int i3) const {
    return static_cast<float const*>(aux[slot])[offset(slot, i0, i1, i2, i3)];
  }
  CUFLASH_EXPR_FN int load_int(int slot, int i0, int i1, int i2, int i3) const {
    return static_cast<int const*>(aux[slot])[offset(slot, i0, i1, i2, i3)];
  }
};
}  // namespace cuflash::expr
#endif
"""

_C_TYPES = {"float": "float", "int": "int", "bool": "bool"}
_BINARY = {_m.ADD: "+", _m.SUB: "-", _m.MUL: "*", _m.DIV: "/", _m.LT: "<", _m.LE: "<=", _m.GT: ">",
           _m.GE: ">=", _m.EQ: "==", _m.NE: "!=", _m.AND: "&&", _m.OR: "||"}
_FLOAT_CALLS = {_m.EXP: "expf", _m.EXP2: "exp2f", _m.LOG: "logf", _m.TANH: "tanhf", _m.SQRT: "sqrtf",
                _m.SIGMOID: "cuflash::expr::sigmoid", _m.ABS: "fabsf", _m.MIN: "fminf", _m.MAX: "fmaxf"}
_INT_CALLS = {_m.ABS: "cuflash::expr::iabs", _m.MIN: "cuflash::expr::imin", _m.MAX: "cuflash::expr::imax",
              _m.FLOORDIV: "cuflash::expr::floordiv", _m.MOD: "cuflash::expr::floormod"}
_INT_WRAPPING = {_m.ADD: "cuflash::expr::iadd", _m.SUB: "cuflash::expr::isub", _m.MUL: "cuflash::expr::imul"}


def _body(traced: "_m.TracedMod", output: int) -> List[str]:
    """Statements computing the registers that `output` depends on, then its return."""
    code, types = traced.code, traced.types
    lines = []
    for r in sorted(_needed(traced, output)):
        word, a, b, c = code[4 * r: 4 * r + 4]
        op, t = word & 0xFF, types[r]
        if op == _m.SCORE:
            e = "s"
        elif op == _m.BATCH:
            e = "b"
        elif op == _m.HEAD:
            e = "h"
        elif op == _m.Q_IDX:
            e = "q_idx"
        elif op == _m.KV_IDX:
            e = "kv_idx"
        elif op == _m.INT:
            e = str(int(a))
        elif op == _m.BOOL:
            e = "true" if a else "false"
        elif op == _m.FLOAT:
            e = f"st.k[{a}]"
        elif op == _m.LOAD:
            slot = _m.load_slot(word)
            index = ", ".join(f"r{x}" if x >= 0 else "0" for x in (a, b, c, _m.load_fourth_index(word)))
            e = f"st.load_{'float' if t == 'float' else 'int'}({slot}, {index})"
        elif op in _INT_WRAPPING and t == "int":
            e = f"{_INT_WRAPPING[op]}(r{a}, r{b})"
        elif op in _BINARY:
            e = f"(r{a} {_BINARY[op]} r{b})"
        elif op in (_m.FLOORDIV, _m.MOD):
            e = f"{_INT_CALLS[op]}(r{a}, r{b})"
        elif op in (_m.MIN, _m.MAX, _m.ABS):
            calls = _FLOAT_CALLS if t == "float" else _INT_CALLS
            e = f"{calls[op]}(r{a}, r{b})" if op != _m.ABS else f"{calls[op]}(r{a})"
        elif op in _FLOAT_CALLS:
            e = f"{_FLOAT_CALLS[op]}(r{a})"
        elif op == _m.NEG:
            e = f"cuflash::expr::ineg(r{a})" if t == "int" else f"(-r{a})"
        elif op == _m.TO_FLOAT:
            e = f"static_cast<float>(r{a})"
        elif op == _m.TO_INT:
            e = f"static_cast<int>(r{a})"
        elif op == _m.NOT:
            e = f"(!r{a})"
        elif op == _m.WHERE:
            e = f"(r{a} ? r{b} : r{c})"
        else:  # pragma: no cover (the tracer emits nothing else)
            raise AssertionError(f"no C++ for opcode {op}")
        lines.append(f"    {_C_TYPES[t]} const r{r} = {e};")
    lines.append(f"    return r{output};")
    return lines


def _needed(traced: "_m.TracedMod", output: int, through_loads: bool = True) -> set:
    """The registers that register `output` depends on, itself included (without the index
    registers of tensor reads unless `through_loads`)."""
    code = traced.code
    needed = set()
    stack = [output]
    while stack:
        r = stack.pop()
        if r in needed:
            continue
        needed.add(r)
        word, a, b, c = code[4 * r: 4 * r + 4]
        if word & 0xFF not in (_m.INT, _m.FLOAT, _m.BOOL) and (through_loads or word & 0xFF != _m.LOAD):
            fourth = _m.load_fourth_index(word) if word & 0xFF == _m.LOAD else -1
            stack.extend(x for x in (a, b, c, fourth) if x >= 0)
    return needed


_INTERVAL_TYPES = {"int": "cuflash::expr::IInt", "bool": "cuflash::expr::IBool", "float": "cuflash::expr::IFloat"}
_INTERVAL_INT = {_m.ADD: "iv_add", _m.SUB: "iv_sub", _m.MUL: "iv_mul", _m.MIN: "iv_min", _m.MAX: "iv_max",
                 _m.FLOORDIV: "iv_floordiv", _m.MOD: "iv_floormod"}
_INTERVAL_COMPARE = {_m.LT: ("iv_lt", False), _m.LE: ("iv_le", False), _m.GT: ("iv_lt", True),
                     _m.GE: ("iv_le", True), _m.EQ: ("iv_eq", False), _m.NE: ("iv_eq", False)}


def _interval_body(traced: "_m.TracedMod") -> List[str]:
    """Statements evaluating a mask program over the rectangle (q0..q1, k0..k1) as intervals
    (the prelude's IInt / IBool / IFloat), then the return of the result's IBool."""
    code, types = traced.code, traced.types
    lines = []
    for r in sorted(_needed(traced, traced.result, through_loads=False)):
        word, a, b, c = code[4 * r: 4 * r + 4]
        op, t = word & 0xFF, types[r]
        ns = "cuflash::expr::"
        if t == "float":
            e = f"{ns}IFloat{{}}"  # floats carry no bounds
        elif op == _m.Q_IDX:
            e = f"{ns}IInt{{q0, q1}}"
        elif op == _m.KV_IDX:
            e = f"{ns}IInt{{k0, k1}}"
        elif op in (_m.BATCH, _m.HEAD):
            e = f"{ns}IInt{{0, {ns}kIntMax}}"
        elif op == _m.INT:
            e = f"{ns}IInt{{{int(a)}, {int(a)}}}"
        elif op == _m.BOOL:
            e = f"{ns}IBool{{{'false' if a else 'true'}, {'true' if a else 'false'}}}"
        elif op == _m.LOAD:
            e = f"{ns}iv_any()" if t == "int" else f"{ns}IBool{{true, true}}"
        elif op in _INTERVAL_INT:
            e = f"{ns}{_INTERVAL_INT[op]}(v{a}, v{b})"
        elif op == _m.NEG:
            e = f"{ns}iv_neg(v{a})"
        elif op == _m.ABS:
            e = f"{ns}iv_abs(v{a})"
        elif op == _m.TO_INT:
            e = f"{ns}iv_from_bool(v{a})"
        elif op in _INTERVAL_COMPARE:
            if types[a] == "float":
                e = f"{ns}IBool{{true, true}}"
            else:
                fn, swap = _INTERVAL_COMPARE[op]
                e = f"{ns}{fn}(v{b}, v{a})" if swap else f"{ns}{fn}(v{a}, v{b})"
                if op == _m.NE:
                    e = f"{ns}bv_not({e})"
        elif op == _m.AND:
            e = f"{ns}bv_and(v{a}, v{b})"
        elif op == _m.OR:
            e = f"{ns}bv_or(v{a}, v{b})"
        elif op == _m.NOT:
            e = f"{ns}bv_not(v{a})"
        elif op == _m.WHERE:
            e = f"{ns}{'iv_select' if t == 'int' else 'bv_select'}(v{a}, v{b}, v{c})"
        else:  # pragma: no cover (the tracer emits nothing else of int or bool type)
            raise AssertionError(f"no interval rule for opcode {op}")
        lines.append(f"    {_INTERVAL_TYPES[t]} const v{r} = {e};")
        lines.append(f"    (void)v{r};")
    lines.append(f"    return v{traced.result};")
    return lines


def _mask_hooks(traced: "_m.TracedMod") -> List[str]:
    """The block-level hooks of a mask functor (see src/variants/builtin_mods.hpp), from the
    program's interval evaluation: all_visible where it is never false on the rectangle, and
    col_range / row_range trimmed at both ends to where it is not never true, by bisection
    (a rectangle inside one where it is never true is one too). A program whose result depends
    on q_idx and kv_idx only through tensor reads (whose values are unknown here) gives none:
    every block is visited and asked element by element."""
    leaves = {traced.code[4 * r] & 0xFF for r in _needed(traced, traced.result, through_loads=False)}
    if not leaves & {_m.Q_IDX, _m.KV_IDX}:
        return [
            "  // No position in the program: every block is visited and asked element by element.",
            "  CUFLASH_EXPR_FN void col_range(int, int, int&, int&) const {}",
            "  CUFLASH_EXPR_FN void row_range(int, int, int&, int&) const {}",
            "  CUFLASH_EXPR_FN bool all_visible(int, int, int, int) const { return false; }",
        ]
    return [
        "  // The program over q_idx in [q0, q1], kv_idx in [k0, k1], any b and h.",
        "  CUFLASH_EXPR_FN cuflash::expr::IBool verdict(int q0, int q1, int k0, int k1) const {",
        "    (void)q0; (void)q1; (void)k0; (void)k1;",
        *_interval_body(traced),
        "  }",
        "  CUFLASH_EXPR_FN bool never(int q0, int q1, int k0, int k1) const { return !verdict(q0, q1, k0, k1).t; }",
        "  CUFLASH_EXPR_FN bool all_visible(int row_min, int row_max, int col_first, int col_last) const {",
        "    return !verdict(row_min, row_max, col_first, col_last).f;",
        "  }",
        "  CUFLASH_EXPR_FN void col_range(int row_min, int row_max, int& col_begin, int& col_end) const {",
        "    if (col_begin >= col_end) return;",
        "    // The most leading columns no row sees: [col_begin, lo) with lo the largest that holds.",
        "    int lo = col_begin, hi = col_end;",
        "    while (lo < hi) {",
        "      int const mid = lo + (hi - lo + 1) / 2;",
        "      if (never(row_min, row_max, col_begin, mid - 1)) lo = mid; else hi = mid - 1;",
        "    }",
        "    col_begin = lo;",
        "    // The most trailing ones: [hi2, col_end) with hi2 the smallest that holds.",
        "    int lo2 = col_begin, hi2 = col_end;",
        "    while (lo2 < hi2) {",
        "      int const mid = lo2 + (hi2 - lo2) / 2;",
        "      if (never(row_min, row_max, mid, col_end - 1)) hi2 = mid; else lo2 = mid + 1;",
        "    }",
        "    col_end = hi2;",
        "  }",
        "  CUFLASH_EXPR_FN void row_range(int col_min, int col_max, int& row_begin, int& row_end) const {",
        "    if (row_begin >= row_end) return;",
        "    int lo = row_begin, hi = row_end;",
        "    while (lo < hi) {",
        "      int const mid = lo + (hi - lo + 1) / 2;",
        "      if (never(row_begin, mid - 1, col_min, col_max)) lo = mid; else hi = mid - 1;",
        "    }",
        "    row_begin = lo;",
        "    int lo2 = row_begin, hi2 = row_end;",
        "    while (lo2 < hi2) {",
        "      int const mid = lo2 + (hi2 - lo2) / 2;",
        "      if (never(mid, row_end - 1, col_min, col_max)) hi2 = mid; else lo2 = mid + 1;",
        "    }",
        "    row_end = hi2;",
        "  }",
    ]


def functor_source(traced: "_m.TracedMod", name: str) -> str:
    """C++ of `name` (the functor) and `name`Switch (what the flex kernels visit)."""
    signature = "int b, int h, int q_idx, int kv_idx"
    unused = "    (void)b; (void)h; (void)q_idx; (void)kv_idx;"
    if traced.role == "score":
        functor = "\n".join([
            f"struct {name} {{",
            "  cuflash::expr::ExprState st;",
            f"  CUFLASH_EXPR_FN float score(float s, {signature}) const {{",
            unused, "    (void)s;",
            *_body(traced, traced.result),
            "  }",
            f"  CUFLASH_EXPR_FN float grad(float s, {signature}) const {{",
            unused, "    (void)s;",
            *_body(traced, traced.grad),
            "  }",
            "};",
            f"struct {name}Switch {{",
            "  static constexpr bool kUnitGrad = false;",
            f"  {name} mod;",
            f"  CUFLASH_EXPR_FN static {name}Switch from(cuflash::ModParams const& p) {{ return {{ {{cuflash::expr::ExprState::from(p)}} }}; }}",
            "  template <class Fn>",
            "  CUFLASH_EXPR_FN void visit(Fn&& fn) const { fn(mod); }",
            "};",
        ])
    else:
        functor = "\n".join([
            f"struct {name} {{",
            "  cuflash::expr::ExprState st;",
            f"  CUFLASH_EXPR_FN bool visible({signature}) const {{",
            unused,
            *_body(traced, traced.result),
            "  }",
            *_mask_hooks(traced),
            "};",
            f"struct {name}Switch {{",
            f"  {name} mod;",
            f"  CUFLASH_EXPR_FN static {name}Switch from(cuflash::ModParams const& p) {{ return {{ {{cuflash::expr::ExprState::from(p)}} }}; }}",
            "  template <class Fn>",
            "  CUFLASH_EXPR_FN void visit(Fn&& fn) const { fn(mod); }",
            "};",
        ])
    # No function name here: the module (and its cache key) depends on the structure alone.
    header = f"// {traced.role}_mod of structure {traced.structure_key()} (generated by cuflash)"
    return "\n".join([_PRELUDE, header, functor, ""])
