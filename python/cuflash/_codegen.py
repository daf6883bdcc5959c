"""C++ source of a traced score_mod / mask_mod (cuflash.mods.TracedMod): a functor with the
interface of the built-ins (src/variants/builtin_mods.hpp) and a "switch" type that the flex
kernels visit (as ScoreModSwitch / MaskModSwitch), for compilation at run time.

The program becomes straight-line code, one local per register. Float constants and the tensors
come from ModParams at run time (scalars, aux, aux_shape), so the source (and a compiled kernel)
depends only on the program's structure (TracedMod.structure_key), not on constant values or
tensor contents. A mask functor has no block-level narrowing: col_range / row_range leave the
ranges as they are and all_visible is false, so every element is asked. Tensor indices are
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

// The runtime state of one expression: its float constants and tensors (from ModParams).
struct ExprState {
  float k[cuflash::ModParams::kMaxScalars];
  const void* aux[cuflash::ModParams::kMaxAux];
  int shape[cuflash::ModParams::kMaxAux][3];

  CUFLASH_EXPR_FN static ExprState from(cuflash::ModParams const& mod) {
    ExprState state{};
    for (int i = 0; i < cuflash::ModParams::kMaxScalars; ++i) state.k[i] = mod.scalars[i];
    for (int i = 0; i < cuflash::ModParams::kMaxAux; ++i) {
      state.aux[i] = mod.aux[i];
      for (int d = 0; d < 3; ++d) state.shape[i][d] = mod.aux_shape[i][d] > 0 ? mod.aux_shape[i][d] : 1;
    }
    return state;
  }
  // Row-major offset of (i0, i1, i2) in tensor `slot`, each index clamped into range.
  CUFLASH_EXPR_FN long long offset(int slot, int i0, int i1, int i2) const {
    return (static_cast<long long>(clamp_index(i0, shape[slot][0])) * shape[slot][1] +
            clamp_index(i1, shape[slot][1])) * shape[slot][2] + clamp_index(i2, shape[slot][2]);
  }
  CUFLASH_EXPR_FN float load_float(int slot, int i0, int i1, int i2) const {
    return static_cast<float const*>(aux[slot])[offset(slot, i0, i1, i2)];
  }
  CUFLASH_EXPR_FN int load_int(int slot, int i0, int i1, int i2) const {
    return static_cast<int const*>(aux[slot])[offset(slot, i0, i1, i2)];
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
    needed = set()
    stack = [output]
    while stack:
        r = stack.pop()
        if r in needed:
            continue
        needed.add(r)
        word, a, b, c = code[4 * r: 4 * r + 4]
        op = word & 0xFF
        if op not in (_m.INT, _m.FLOAT, _m.BOOL):
            stack.extend(x for x in (a, b, c) if x >= 0)
    lines = []
    for r in sorted(needed):
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
            slot = (word >> 8) & 0xFF
            index = ", ".join(f"r{x}" if x >= 0 else "0" for x in (a, b, c))
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
            "  // No block-level knowledge: every block is visited and asked element by element.",
            "  CUFLASH_EXPR_FN void col_range(int, int, int&, int&) const {}",
            "  CUFLASH_EXPR_FN void row_range(int, int, int&, int&) const {}",
            "  CUFLASH_EXPR_FN bool all_visible(int, int, int, int) const { return false; }",
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
