"""Python callables as score_mod / mask_mod (FlexAttention semantics).

A score_mod maps the scaled (and soft-capped) score of query ``q_idx`` and key ``kv_idx`` of
batch entry ``b`` and head ``h`` to a new score; a mask_mod says whether ``(q_idx, kv_idx)`` is
kept. Both are plain Python functions:

    >>> def score_mod(score, b, h, q_idx, kv_idx):
    ...     return score + slopes[h] * (kv_idx - q_idx)          # ALiBi
    >>> def mask_mod(b, h, q_idx, kv_idx):
    ...     return (kv_idx <= q_idx) & (doc[b, q_idx] == doc[b, kv_idx])

cuflash calls the function once with symbolic arguments and records what it computes into a
small expression program (`trace_score_mod`, `trace_mask_mod`); the program runs on the CPU
reference and, compiled at run time, on the GPU. The backward's d score_mod / d score comes from
symbolic differentiation of the program, or from a hand-written ``score_mod_bwd(grad, score, b,
h, q_idx, kv_idx[, *aux_tensors])`` (`flash_attn_backward`) that returns the gradient of the
score given ``grad``, the gradient of the new score. Such a function must be linear in ``grad``,
as the gradient of a function of one score is: sums of terms ``grad * x`` or ``grad / x`` with
``x`` free of grad, and ``where(cond, ..., 0.0)`` of those with ``cond`` free of grad
(TypeError otherwise, naming what is not).

What a callable may use:

* arithmetic ``+ - * / // % **`` (a small whole exponent), unary ``-``, ``abs``; comparisons
  ``< <= > >= == !=``; ``& | ~`` on booleans (comparisons); Python int / float / bool constants;
* the functions of this module: `where`, `exp`, `exp2`, `log`, `sqrt`, `tanh`, `sigmoid`,
  `minimum`, `maximum`, `clamp` (also NumPy's, torch's and ``jax.numpy``'s functions of the same
  names, their ``power`` / ``pow`` and ``square``, and ``jax.nn.sigmoid``: JAX's reached through
  the module ``jax`` / ``jax.numpy`` or by name from the function's closure or module globals);
  concrete 0-d arrays of any framework as constants;
* tensors read by indexing with integer expressions, ``table[h]``, ``doc[b, q_idx]``,
  ``bias[b, h, q_idx, kv_idx]`` (1 to 4 dimensions, every dimension indexed): tensors the function
  closes over (or reads as module globals), or the call's ``aux_tensors``, which arrive as extra
  trailing arguments, ``score_mod(score, b, h, q_idx, kv_idx, *aux_tensors)``. Float tensors are
  read as float32, integer and bool tensors as int32. An index out of range is an error on the
  CPU; on the GPU it is clamped into range. Integer arithmetic is 32-bit and wraps (two's
  complement), on the CPU reference as on the GPU.

Python control flow on traced values (``if``, ``and`` / ``or`` / ``not``, ``while``,
``int(x)``) cannot be recorded: it raises TypeError naming the argument; use `where` and
``& | ~`` instead. Limits per callable: 64 instructions (the derivative's included), 16 float
constants, 4 tensors (ValueError beyond).

The same functions work on NumPy arrays (and numbers), so one callable can be checked against a
NumPy reference by calling it with broadcast index arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import math
import numbers
import struct
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "where", "exp", "exp2", "log", "sqrt", "tanh", "sigmoid", "minimum", "maximum", "clamp",
    "TracedMod", "trace_score_mod", "trace_mask_mod",
    "MAX_OPS", "MAX_CONSTANTS", "MAX_AUX",
]

MAX_OPS = 64
MAX_CONSTANTS = 16
MAX_AUX = 4
MAX_AUX_DIMS = 4

# Opcodes of an expression program: cuflash::ExprOp in include/cuflash/expression.hpp.
SCORE, BATCH, HEAD, Q_IDX, KV_IDX, INT, FLOAT, LOAD, BOOL = 0, 1, 2, 3, 4, 5, 6, 7, 8
# The incoming gradient of a score_mod_bwd while it is traced; never in an emitted program (the
# program holds the derivative, d score_mod_bwd / d grad, which is free of it).
GRAD = 9
ADD, SUB, MUL, DIV, FLOORDIV, MOD, MIN, MAX = 10, 11, 12, 13, 14, 15, 16, 17
NEG, ABS, EXP, EXP2, LOG, TANH, SIGMOID, SQRT, TO_FLOAT, TO_INT = 20, 21, 22, 23, 24, 25, 26, 27, 28, 29
LT, LE, GT, GE, EQ, NE = 30, 31, 32, 33, 34, 35
AND, OR, NOT, WHERE = 40, 41, 42, 43

_OP_NAMES = {
    SCORE: "score", GRAD: "grad", BATCH: "b", HEAD: "h", Q_IDX: "q_idx", KV_IDX: "kv_idx", INT: "int", FLOAT: "float",
    LOAD: "load", BOOL: "bool", ADD: "add", SUB: "sub", MUL: "mul", DIV: "div", FLOORDIV: "floordiv",
    MOD: "mod", MIN: "min", MAX: "max", NEG: "neg", ABS: "abs", EXP: "exp", EXP2: "exp2", LOG: "log",
    TANH: "tanh", SIGMOID: "sigmoid", SQRT: "sqrt", TO_FLOAT: "to_float", TO_INT: "to_int", LT: "lt",
    LE: "le", GT: "gt", GE: "ge", EQ: "eq", NE: "ne", AND: "and", OR: "or", NOT: "not", WHERE: "where",
}

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


# A load's opcode word: the tensor slot in bits 8..15, the fourth index register plus one in
# bits 16..23 (0: none); cuflash::expr_load_slot / expr_load_fourth_index on the C++ side.
def load_word(slot: int, fourth: int) -> int:
    return LOAD | (slot << 8) | ((fourth + 1) << 16)


def load_slot(word: int) -> int:
    return (word >> 8) & 0xFF


def load_fourth_index(word: int) -> int:
    """A load's fourth index register, -1 if none."""
    return ((word >> 16) & 0xFF) - 1


_FLOAT_UNARY = (EXP, EXP2, LOG, TANH, SIGMOID, SQRT)


class TraceError(TypeError):
    """A callable did something that cannot be recorded (the message names the argument)."""


# ---------------------------------------------------------------------------------------------
# The graph and its symbolic values


@dataclass
class _Node:
    op: int
    args: Tuple[int, ...]  # operand node ids
    imm: int               # INT / BOOL value, FLOAT constant index, LOAD slot
    type: str              # "bool", "int" or "float"


class _Graph:
    def __init__(self, argument: str):
        self.argument = argument
        self.nodes: List[_Node] = []
        self.memo: Dict[Tuple, int] = {}
        self.constants: List[float] = []
        self.constant_ids: Dict[bytes, int] = {}
        self.slots: List["_AuxProxy"] = []

    def fail(self, message: str) -> None:
        raise TraceError(f"{self.argument}: {message}")

    def node(self, op: int, args: Tuple[int, ...] = (), imm: int = 0, type: str = "float") -> "Sym":
        key = (op, args, imm, type)
        index = self.memo.get(key)
        if index is None:
            index = len(self.nodes)
            self.nodes.append(_Node(op, args, imm, type))
            self.memo[key] = index
        return Sym(self, index)

    def constant(self, value: Any) -> "Sym":
        if isinstance(value, (bool, np.bool_)):
            return self.node(BOOL, imm=int(bool(value)), type="bool")
        if isinstance(value, numbers.Integral):
            value = int(value)
            if not _INT32_MIN <= value <= _INT32_MAX:
                self.fail(f"integer constant {value} does not fit in int32")
            return self.node(INT, imm=value, type="int")
        if isinstance(value, numbers.Real):
            return self.float_constant(float(value))
        self.fail(f"cannot use a {type(value).__name__} in a traced expression (expected a number, "
                  f"a traced value or a tensor element)")

    def float_constant(self, value: float) -> "Sym":
        key = struct.pack("<d", value)
        index = self.constant_ids.get(key)
        if index is None:
            index = len(self.constants)
            self.constants.append(value)
            self.constant_ids[key] = index
        return self.node(FLOAT, imm=index, type="float")

    def lift(self, x: Any) -> "Sym":
        if isinstance(x, Sym):
            if x.graph is not self:
                self.fail("a traced value from another trace was used")
            return x
        return self.constant(_concrete_scalar(x, self))

    # Conversions between the three types.
    def to_float(self, x: "Sym") -> "Sym":
        node = x.node
        if x.type == "float":
            return x
        if node.op in (INT, BOOL):
            return self.float_constant(float(node.imm))
        return self.node(TO_FLOAT, (x.index,), type="float")

    def to_int(self, x: "Sym") -> "Sym":
        if x.type == "int":
            return x
        if x.type == "float":
            self.fail("expected an integer expression, got a float one (indices and // % take integers)")
        if x.node.op == BOOL:
            return self.node(INT, imm=x.node.imm, type="int")
        return self.node(TO_INT, (x.index,), type="int")

    def to_type(self, x: "Sym", type: str) -> "Sym":
        if type == "float":
            return self.to_float(x)
        if type == "int":
            return self.to_int(x)
        return x


def _graph_of(*values: Any) -> Optional[_Graph]:
    for v in values:
        if isinstance(v, Sym):
            return v.graph
    return None


def _numeric_type(*syms: "Sym") -> str:
    return "float" if any(s.type == "float" for s in syms) else "int"


# Arithmetic of two booleans as NumPy and torch (hence FlexAttention) do it: + and max are or,
# * and min are and, - raises there (refused here); / // % take them as 0 and 1.
_BOOL_ARITH = {ADD: OR, MAX: OR, MUL: AND, MIN: AND}


def _arith(op: int, x: Any, y: Any) -> "Sym":
    g = _graph_of(x, y)
    a, b = g.lift(x), g.lift(y)
    if a.type == "bool" and b.type == "bool":
        if op == SUB:
            g.fail("- of two booleans (comparisons) is not defined in NumPy / torch; use & | ~ or "
                   "cuflash.mods.where")
        if op in _BOOL_ARITH:
            return g.node(_BOOL_ARITH[op], (a.index, b.index), type="bool")
    if op == DIV:
        t = "float"
    elif op in (FLOORDIV, MOD):
        if a.type == "float" or b.type == "float":
            g.fail("// and % take integer operands")
        t = "int"
    else:
        t = _numeric_type(a, b)
    a, b = g.to_type(a, t), g.to_type(b, t)
    return g.node(op, (a.index, b.index), type=t)


def _compare(op: int, x: Any, y: Any) -> "Sym":
    g = _graph_of(x, y)
    a, b = g.lift(x), g.lift(y)
    if a.type == "bool" and b.type == "bool" and op in (EQ, NE):
        t = "int"
    else:
        t = _numeric_type(a, b)
    a, b = g.to_type(a, t), g.to_type(b, t)
    return g.node(op, (a.index, b.index), type="bool")


def _logical(op: int, x: Any, y: Any) -> "Sym":
    g = _graph_of(x, y)
    a, b = g.lift(x), g.lift(y)
    if a.type != "bool" or b.type != "bool":
        g.fail("& and | take boolean operands (comparisons); bitwise operations on integers are not supported")
    return g.node(op, (a.index, b.index), type="bool")


def _unary(op: int, x: "Sym") -> "Sym":
    g = x.graph
    if op in _FLOAT_UNARY:
        x = g.to_float(x)
        return g.node(op, (x.index,), type="float")
    if op == NOT:
        if x.type != "bool":
            g.fail("~ takes a boolean operand (a comparison); bitwise operations on integers are not supported")
        return g.node(NOT, (x.index,), type="bool")
    if x.type == "bool":
        if op == ABS:
            return x
        g.fail("- of a boolean (a comparison) is not defined as in NumPy / torch; use ~ for not")
    x = g.to_type(x, _numeric_type(x))
    return g.node(op, (x.index,), type=x.type)


def _control_flow_error(sym: "Sym", what: str):
    sym.graph.fail(f"{what} of a traced value is not supported: Python control flow (if, while, and, or, "
                   f"not, chained comparisons) cannot depend on q_idx, kv_idx, score...; use "
                   f"cuflash.mods.where(cond, a, b) and & | ~ instead")


class Sym:
    """A traced value of a score_mod / mask_mod: score, b, h, q_idx, kv_idx and what is computed
    from them."""

    __slots__ = ("graph", "index")
    __array_priority__ = 1000  # NumPy defers binary operators to us

    def __init__(self, graph: _Graph, index: int):
        self.graph = graph
        self.index = index

    @property
    def node(self) -> _Node:
        return self.graph.nodes[self.index]

    @property
    def type(self) -> str:
        return self.node.type

    def __repr__(self) -> str:
        return f"<traced {self.type} {_OP_NAMES[self.node.op]}>"

    __add__ = lambda self, o: _arith(ADD, self, o)
    __radd__ = lambda self, o: _arith(ADD, o, self)
    __sub__ = lambda self, o: _arith(SUB, self, o)
    __rsub__ = lambda self, o: _arith(SUB, o, self)
    __mul__ = lambda self, o: _arith(MUL, self, o)
    __rmul__ = lambda self, o: _arith(MUL, o, self)
    __truediv__ = lambda self, o: _arith(DIV, self, o)
    __rtruediv__ = lambda self, o: _arith(DIV, o, self)
    __floordiv__ = lambda self, o: _arith(FLOORDIV, self, o)
    __rfloordiv__ = lambda self, o: _arith(FLOORDIV, o, self)
    __mod__ = lambda self, o: _arith(MOD, self, o)
    __rmod__ = lambda self, o: _arith(MOD, o, self)
    __lt__ = lambda self, o: _compare(LT, self, o)
    __le__ = lambda self, o: _compare(LE, self, o)
    __gt__ = lambda self, o: _compare(GT, self, o)
    __ge__ = lambda self, o: _compare(GE, self, o)
    __eq__ = lambda self, o: _compare(EQ, self, o)
    __ne__ = lambda self, o: _compare(NE, self, o)
    __and__ = lambda self, o: _logical(AND, self, o)
    __rand__ = lambda self, o: _logical(AND, o, self)
    __or__ = lambda self, o: _logical(OR, self, o)
    __ror__ = lambda self, o: _logical(OR, o, self)
    __neg__ = lambda self: _unary(NEG, self)
    __pos__ = lambda self: self
    __abs__ = lambda self: _unary(ABS, self)
    __invert__ = lambda self: _unary(NOT, self)
    __hash__ = None  # == is symbolic

    def __pow__(self, exponent: Any) -> "Sym":
        exponent = _concrete_scalar(exponent, self.graph)
        whole = (isinstance(exponent, numbers.Real) and not isinstance(exponent, bool) and
                 float(exponent).is_integer())
        if whole and 1 <= exponent <= 8:
            result = self
            for _ in range(int(exponent) - 1):
                result = result * self
            return result
        if isinstance(exponent, numbers.Real) and float(exponent) == 0.5:
            return sqrt(self)
        self.graph.fail(f"** takes a whole exponent in 1..8 (or 0.5), got {exponent!r}")

    def __rpow__(self, base: Any) -> "Sym":
        base = _concrete_scalar(base, self.graph)
        if isinstance(base, numbers.Real) and float(base) == 2.0:
            return exp2(self)
        if isinstance(base, numbers.Real) and float(base) > 0:
            return exp(self * math.log(float(base)))
        self.graph.fail(f"{base!r} ** (traced value) needs a positive base")

    def __bool__(self):
        _control_flow_error(self, "the truth value")

    def __index__(self):
        self.graph.fail("a traced value cannot index a tensor that was not recorded: close over the "
                        "tensor in the function itself, or pass it in aux_tensors (it then arrives as "
                        "an extra argument)")

    def __int__(self):
        _control_flow_error(self, "int()")

    def __float__(self):
        self.graph.fail("float() / math functions of a traced value are not supported; use cuflash.mods "
                        "(exp, log, tanh, ...)")

    def __getitem__(self, _):
        self.graph.fail("a traced value cannot be indexed (only tensors can)")

    def __iter__(self):
        self.graph.fail("a traced value is a scalar: it cannot be iterated")

    # torch's b.new_ones((), dtype=torch.bool, device=b.device) / new_zeros: the constants
    # FlexAttention's and_masks, or_masks and noop_mask start from.
    @property
    def device(self) -> None:
        return None

    def new_ones(self, size: Any = (), dtype: Any = None, **_: Any) -> "Sym":
        return self._new_constant(1, size, dtype, "new_ones")

    def new_zeros(self, size: Any = (), dtype: Any = None, **_: Any) -> "Sym":
        return self._new_constant(0, size, dtype, "new_zeros")

    def _new_constant(self, value: int, size: Any, dtype: Any, name: str) -> "Sym":
        size = (size,) if isinstance(size, numbers.Integral) else tuple(size)
        if size not in ((), (1,)):
            self.graph.fail(f"{name} makes a scalar only (size ()), got size {size}")
        if dtype is None:
            kind = self.type
        else:
            try:  # NumPy dtypes and names
                kind = {"b": "bool", "i": "int", "u": "int", "f": "float"}.get(np.dtype(dtype).kind, "")
            except TypeError:  # torch dtypes: torch.bool, torch.int32, torch.float32, ...
                kind = str(dtype).rsplit(".", 1)[-1]
        if kind == "bool":
            return self.graph.constant(bool(value))
        if kind.startswith(("int", "uint")):
            return self.graph.constant(int(value))
        if kind.startswith(("float", "bfloat")):
            return self.graph.float_constant(float(value))
        self.graph.fail(f"{name}: dtype {dtype} is not supported")

    # NumPy functions (np.exp, np.where, np.maximum, ...) on traced values.
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        function = _NUMPY_UFUNCS.get(ufunc.__name__)
        if method != "__call__" or kwargs or function is None:
            self.graph.fail(f"numpy.{ufunc.__name__} is not supported on traced values")
        return function(*inputs)

    def __array_function__(self, func, types_, args, kwargs):
        function = {"where": where, "clip": clamp}.get(func.__name__)
        if function is None:
            self.graph.fail(f"numpy.{func.__name__} is not supported on traced values")
        return function(*args, **kwargs)

    # torch functions (torch.where, torch.exp, ...) on traced values.
    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        function = _TORCH_FUNCTIONS.get(name)
        if function is None:
            graph = _graph_of(*args)
            message = f"torch.{name} is not supported on traced values"
            if graph is not None:
                graph.fail(message)
            raise TraceError(message)
        return function(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------
# Functions (symbolic on traced values, NumPy otherwise)


def _is_traced(*values: Any) -> bool:
    return any(isinstance(v, Sym) for v in values)


def _concrete_scalar(x: Any, graph: "_Graph") -> Any:
    """x, or a concrete 0-d array's value as a Python number (np.float32(0.5), jnp.float32(0.5),
    torch.tensor(2.0) made in the function). A tensor that requires grad is refused (as a
    constant it would get no gradient), and so is a tensor the function reads from outside (it
    is read by indexing)."""
    if isinstance(x, (Sym, numbers.Number, str, bytes)) or x is None:
        return x
    if isinstance(x, _AuxProxy):
        graph.fail(f"{x._name} {x.shape} is read from outside the function, which cuflash does by indexing "
                   f"(t[h], t[b, q_idx]); a 0-d one cannot be indexed: pass its value as a Python number")
    if getattr(x, "ndim", None) != 0 or not hasattr(x, "item"):
        return x
    if getattr(x, "requires_grad", False):
        graph.fail("a 0-d tensor that requires grad cannot be a constant of a traced expression (it would get "
                   "no gradient: cuflash computes the gradients of q, k, v and learnable_sink only)")
    try:
        return x.item()
    except Exception:  # noqa: BLE001 (a traced JAX value has no concrete item())
        graph.fail(f"a {type(x).__name__} without a concrete value cannot be a constant of a traced expression")


def power(x: Any, exponent: Any) -> Any:
    """x ** exponent (numpy.power / torch.pow / jax.numpy.power): traced bases take a whole
    exponent in 1..8 or 0.5, traced exponents a positive base."""
    if isinstance(x, Sym):
        return x ** exponent
    if isinstance(exponent, Sym):
        return exponent.__rpow__(x)
    return np.power(x, exponent)


def where(condition: Any, x: Any, y: Any) -> Any:
    """x where condition holds, else y (torch.where / numpy.where)."""
    if not _is_traced(condition, x, y):
        return np.where(condition, x, y)
    g = _graph_of(condition, x, y)
    c, a, b = g.lift(condition), g.lift(x), g.lift(y)
    if c.type != "bool":
        g.fail("where: the condition must be a boolean expression (a comparison)")
    t = "bool" if a.type == b.type == "bool" else _numeric_type(a, b)
    a, b = g.to_type(a, t), g.to_type(b, t)
    return g.node(WHERE, (c.index, a.index, b.index), type=t)


def _float_function(op: int, numpy_function: Callable) -> Callable:
    def function(x: Any) -> Any:
        if isinstance(x, Sym):
            return _unary(op, x)
        return numpy_function(np.asarray(x, dtype=np.float64) if isinstance(x, (int, float)) else x)

    return function


def _numpy_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


exp = _float_function(EXP, np.exp)
exp.__doc__ = "e ** x."
exp2 = _float_function(EXP2, np.exp2)
exp2.__doc__ = "2 ** x."
log = _float_function(LOG, np.log)
log.__doc__ = "Natural logarithm."
sqrt = _float_function(SQRT, np.sqrt)
sqrt.__doc__ = "Square root."
tanh = _float_function(TANH, np.tanh)
tanh.__doc__ = "Hyperbolic tangent."
sigmoid = _float_function(SIGMOID, _numpy_sigmoid)
sigmoid.__doc__ = "1 / (1 + exp(-x))."


def minimum(x: Any, y: Any) -> Any:
    """Element-wise minimum."""
    if not _is_traced(x, y):
        return np.minimum(x, y)
    return _arith(MIN, x, y)


def maximum(x: Any, y: Any) -> Any:
    """Element-wise maximum."""
    if not _is_traced(x, y):
        return np.maximum(x, y)
    return _arith(MAX, x, y)


def clamp(x: Any, min: Any = None, max: Any = None) -> Any:  # noqa: A002 (torch.clamp's names)
    """x limited to [min, max] (either bound may be None)."""
    if min is not None:
        x = maximum(x, min)
    if max is not None:
        x = minimum(x, max)
    return x


def _abs(x):
    return abs(x)


_NUMPY_UFUNCS = {
    "add": lambda a, b: _arith(ADD, a, b), "subtract": lambda a, b: _arith(SUB, a, b),
    "multiply": lambda a, b: _arith(MUL, a, b), "true_divide": lambda a, b: _arith(DIV, a, b),
    "divide": lambda a, b: _arith(DIV, a, b), "floor_divide": lambda a, b: _arith(FLOORDIV, a, b),
    "remainder": lambda a, b: _arith(MOD, a, b), "maximum": maximum, "minimum": minimum, "fmax": maximum,
    "fmin": minimum, "negative": lambda a: -a, "absolute": _abs, "exp": exp, "exp2": exp2, "log": log,
    "sqrt": sqrt, "tanh": tanh, "less": lambda a, b: _compare(LT, a, b),
    "less_equal": lambda a, b: _compare(LE, a, b), "greater": lambda a, b: _compare(GT, a, b),
    "greater_equal": lambda a, b: _compare(GE, a, b), "equal": lambda a, b: _compare(EQ, a, b),
    "not_equal": lambda a, b: _compare(NE, a, b), "logical_and": lambda a, b: _logical(AND, a, b),
    "logical_or": lambda a, b: _logical(OR, a, b), "bitwise_and": lambda a, b: _logical(AND, a, b),
    "bitwise_or": lambda a, b: _logical(OR, a, b), "logical_not": lambda a: ~a, "invert": lambda a: ~a,
    "power": power, "square": lambda a: a * a,
}

_TORCH_FUNCTIONS = dict(_NUMPY_UFUNCS)
_TORCH_FUNCTIONS.update({
    "where": where, "clamp": clamp, "clip": clamp, "sigmoid": sigmoid, "abs": _abs, "neg": lambda a: -a,
    "pow": lambda a, b=None, exponent=None: power(a, exponent if b is None else b),
    "__pow__": power, "__rpow__": lambda a, b: power(b, a),
    "add": lambda a, b, alpha=1: _arith(ADD, a, b if alpha == 1 else b * alpha),
    "sub": lambda a, b, alpha=1: _arith(SUB, a, b if alpha == 1 else b * alpha),
    "mul": lambda a, b: _arith(MUL, a, b), "div": lambda a, b: _arith(DIV, a, b),
    "lt": lambda a, b: _compare(LT, a, b), "le": lambda a, b: _compare(LE, a, b),
    "gt": lambda a, b: _compare(GT, a, b), "ge": lambda a, b: _compare(GE, a, b),
    "eq": lambda a, b: _compare(EQ, a, b), "ne": lambda a, b: _compare(NE, a, b),
    "__add__": lambda a, b: a + b, "__radd__": lambda a, b: b + a, "__sub__": lambda a, b: a - b,
    "__rsub__": lambda a, b: b - a, "__mul__": lambda a, b: a * b, "__rmul__": lambda a, b: b * a,
    "__truediv__": lambda a, b: a / b, "__getitem__": lambda t, i: _torch_getitem(t, i),
})


def _clip(x: Any, min: Any = None, max: Any = None, *, a_min: Any = None, a_max: Any = None) -> Any:  # noqa: A002
    # jax.numpy.clip's names, old (a_min / a_max) and new (min / max).
    return clamp(x, a_min if min is None else min, a_max if max is None else max)


# jax.numpy functions on traced values. JAX has no dispatch protocol for foreign types (its
# functions convert their arguments to arrays), so a traced callable sees the modules jax /
# jax.numpy / jax.nn and the functions it names from them through stand-ins (_jax_stand_in)
# that send traced arguments here and everything else to JAX.
_JAX_NUMPY_FUNCTIONS = dict(_NUMPY_UFUNCS)
_JAX_NUMPY_FUNCTIONS.update({"where": where, "clip": _clip, "abs": _abs, "mod": _NUMPY_UFUNCS["remainder"],
                             "pow": power})
_JAX_NN_FUNCTIONS = {"sigmoid": sigmoid}


def _jax_dispatch(symbolic: Optional[Callable], real: Callable, qualified_name: str = "") -> Callable:
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if _is_traced(*args, *kwargs.values()):
            if symbolic is None:
                message = f"{qualified_name} is not supported on traced values"
                graph = _graph_of(*args, *kwargs.values())
                if graph is not None:
                    graph.fail(message)
                raise TraceError(message)
            return symbolic(*args, **kwargs)
        return real(*args, **kwargs)

    dispatch.__name__ = getattr(real, "__name__", "function")
    dispatch.__wrapped__ = real
    return dispatch


class _JaxModuleStandIn:
    """jax / jax.numpy / jax.nn as a traced callable sees them: the functions in `functions` take
    traced values, attributes of `nested` are stand-ins too, everything else is the module's."""

    def __init__(self, module: Any, functions: Dict[str, Callable], nested: Dict[str, Any]):
        self._module, self._functions, self._nested = module, functions, nested

    def __getattr__(self, name: str) -> Any:
        if name in self._nested:
            return self._nested[name]
        value = getattr(self._module, name)
        if callable(value) and not isinstance(value, type):
            # Functions without a traced form fail by name when given traced values.
            return _jax_dispatch(self._functions.get(name), value, f"{self._module.__name__}.{name}")
        return value

    def __repr__(self) -> str:
        return f"<{self._module.__name__} while a callable is traced>"


@functools.lru_cache(maxsize=None)
def _jax_module_stand_ins(jax: Any) -> Tuple[Tuple[Any, "_JaxModuleStandIn"], ...]:
    """(module, stand-in) for jax, jax.numpy and jax.nn, made once (so that every reference to a
    module in a traced callable sees the same stand-in)."""
    jnp, nn = getattr(jax, "numpy", None), getattr(jax, "nn", None)
    jnp_stand_in = _JaxModuleStandIn(jnp, _JAX_NUMPY_FUNCTIONS, {})
    nn_stand_in = _JaxModuleStandIn(nn, _JAX_NN_FUNCTIONS, {})
    return ((jax, _JaxModuleStandIn(jax, {}, {"numpy": jnp_stand_in, "nn": nn_stand_in})),
            (jnp, jnp_stand_in), (nn, nn_stand_in))


def _jax_stand_in(value: Any) -> Any:
    """The stand-in for `value` where it is jax, jax.numpy, jax.nn or one of the functions of the
    last two that traced values need; else None (JAX not loaded, or another value)."""
    from ._tensors import loaded_module

    jax = loaded_module("jax")
    if jax is None or isinstance(value, (numbers.Number, str, bytes, type(None))):
        return None
    modules = _jax_module_stand_ins(jax)
    for module, stand_in in modules:
        if value is module:
            return stand_in
    if not callable(value):
        return None
    name = getattr(value, "__name__", None)
    for (module, stand_in), functions in zip(modules[1:], (_JAX_NUMPY_FUNCTIONS, _JAX_NN_FUNCTIONS)):
        if isinstance(name, str) and name in functions and getattr(module, name, None) is value:
            return _jax_dispatch(functions[name], value)
    return None


def _torch_getitem(tensor, index):
    graph = _graph_of(*(index if isinstance(index, tuple) else (index,)))
    message = ("a traced value cannot index a tensor that was not recorded: close over the tensor in the "
               "function itself, or pass it in aux_tensors (it then arrives as an extra argument)")
    if graph is not None:
        graph.fail(message)
    raise TraceError(message)


# ---------------------------------------------------------------------------------------------
# Tensors read by a callable


def _value_kind(framework, tensor) -> str:
    dtype = framework.dtype(tensor)
    if dtype in ("float16", "bfloat16", "float32", "float64"):
        return "float"
    if dtype == "bool":
        return "bool"
    if dtype in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32"):
        return "int"
    return ""


class _AuxProxy:
    """Stands for a tensor while a callable is traced: indexing it records a load."""

    def __init__(self, graph: _Graph, tensor: Any, framework: Any, name: str):
        kind = _value_kind(framework, tensor)
        if not kind:
            graph.fail(f"{name}: expected a float, integer or bool tensor, got dtype {framework.dtype(tensor)}")
        self._graph = graph
        self._tensor = tensor
        self._name = name
        self._kind = kind
        self.shape = tuple(int(s) for s in tensor.shape)
        self.ndim = len(self.shape)
        self.dtype = getattr(tensor, "dtype", None)
        self._slot: Optional[int] = None

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    def __repr__(self) -> str:
        return f"<traced tensor {self._name} {self.shape}>"

    def __getitem__(self, index: Any) -> Sym:
        g = self._graph
        index = index if isinstance(index, tuple) else (index,)
        if not 1 <= self.ndim <= MAX_AUX_DIMS:
            g.fail(f"{self._name}: tensors of 1 to {MAX_AUX_DIMS} dimensions can be read, got shape {self.shape}"
                   f"{' (fold the leading ones into one first, t.reshape(-1, *t.shape[-3:]))' if self.ndim else ''}")
        if len(index) != self.ndim:
            g.fail(f"{self._name}: index every dimension of a tensor of shape {self.shape} (one element at a "
                   f"time), got {len(index)} index(es)")
        concrete = self._concrete_element(index)
        if concrete is not None:
            return concrete
        regs = []
        for d, i in enumerate(index):
            if isinstance(i, (slice, type(Ellipsis))) or i is None:
                g.fail(f"{self._name}: slices cannot be traced; index one element with integer expressions")
            if isinstance(i, numbers.Integral) and not isinstance(i, (bool, np.bool_)) and i < 0:
                i = int(i) + self.shape[d]  # Python's negative index, on the shape at trace time
            sym = g.lift(i)
            if sym.type == "float":
                g.fail(f"{self._name}: indices must be integer expressions, got a float one")
            regs.append(g.to_int(sym).index)
        if self._slot is None:
            self._slot = len(g.slots)
            g.slots.append(self)
        regs += [-1] * (MAX_AUX_DIMS - len(regs))
        load_type = "int" if self._kind == "bool" else self._kind
        value = g.node(LOAD, tuple(regs), imm=self._slot, type=load_type)
        if self._kind == "bool":
            return g.node(NE, (value.index, g.constant(0).index), type="bool")
        return value

    def _concrete_element(self, index: Tuple[Any, ...]) -> Any:
        """The element itself where the tensor is a NumPy array and every index a plain integer (a
        setting read at trace time, say `float(CONFIG[0])`, which then enters the program as a
        constant); None otherwise: the program reads the element (device tensors are not read
        back here, and a torch tensor that requires grad must stay visible to the refusal)."""
        if not isinstance(self._tensor, np.ndarray) or len(index) != self.ndim or not all(
                isinstance(i, numbers.Integral) and not isinstance(i, (bool, np.bool_)) for i in index):
            return None
        try:
            return self._tensor[tuple(int(i) for i in index)].item()
        except IndexError:
            self._graph.fail(f"{self._name}: index {tuple(index)} is out of range for shape {self.shape}")

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        self._graph.fail(f"{self._name}: only indexing (and .shape) of a tensor can be traced, not .{name}")


def _is_tensor(x: Any) -> bool:
    from ._tensors import framework_of

    return not isinstance(x, (numbers.Number, str, bytes)) and framework_of(x) is not None


def _with_proxies(fn: Callable, make_proxy: Callable[[Any, str], Any],
                  _copies: Optional[Dict[int, Callable]] = None) -> Callable:
    """A copy of a plain function whose closure cells and referenced globals that hold tensors
    hold proxies instead; the same for the plain functions it calls through its closure or its
    module's globals (helpers that close over tables themselves), each copied once."""
    if not isinstance(fn, types.FunctionType):
        return fn
    copies = {} if _copies is None else _copies
    if id(fn) in copies:
        return copies[id(fn)]
    copies[id(fn)] = fn  # a function that reaches itself keeps its original while being copied

    def substitute(value: Any, name: str, same_module_only: bool) -> Any:
        stand_in = _jax_stand_in(value)
        if stand_in is not None:
            return stand_in
        if _is_tensor(value):
            return make_proxy(value, name)
        if isinstance(value, types.FunctionType) and (not same_module_only or value.__module__ == fn.__module__):
            return _with_proxies(value, make_proxy, copies)
        if not same_module_only and type(value) in (tuple, list) and any(
                isinstance(x, types.FunctionType) for x in value):
            # Functions a closure holds together (FlexAttention's and_masks / or_masks).
            new = [substitute(x, name, same_module_only) if isinstance(x, types.FunctionType) else x for x in value]
            return value if all(a is b for a, b in zip(new, value)) else type(value)(new)
        return value

    code = fn.__code__
    changed = False
    closure = fn.__closure__
    if closure:
        cells = []
        for name, cell in zip(code.co_freevars, closure):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                cells.append(cell)
                continue
            new = substitute(value, name, same_module_only=False)
            cells.append(cell if new is value else types.CellType(new))
            changed |= new is not value
        closure = tuple(cells)
    globals_ = fn.__globals__
    replaced = {}
    for name in code.co_names:
        if name in globals_:
            new = substitute(globals_[name], name, same_module_only=True)
            if new is not globals_[name]:
                replaced[name] = new
    if replaced:
        globals_ = dict(globals_)
        globals_.update(replaced)
        changed = True
    if not changed:
        return fn
    copy = types.FunctionType(code, globals_, fn.__name__, fn.__defaults__, closure)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copies[id(fn)] = copy
    return copy


# ---------------------------------------------------------------------------------------------
# Tracing


@dataclass(eq=False)
class TracedMod:
    """A traced score_mod or mask_mod: its expression program and the tensors it reads.

    ``code`` holds 4 int32 per instruction (opcode word, a, b, c; instruction i writes register
    i): leaves (SCORE, BATCH, HEAD, Q_IDX, KV_IDX; INT / BOOL with the value in a; FLOAT with the
    index of a float constant in a; LOAD with the tensor slot in bits 8..15 of the opcode word,
    the index registers in a, b, c, -1 when unused, and a fourth index register plus one in bits
    16..23, 0 when unused) and operations on earlier registers.
    ``result`` is the register of the value, ``grad`` (score_mod) that of d value / d score.
    """

    role: str                      # "score" or "mask"
    name: str                      # the callable's name
    code: List[int]
    types: List[str]               # type of each register
    result: int
    grad: int
    constants: List[float]
    aux: List[Any] = field(repr=False)  # the tensors read, by slot
    aux_kinds: List[str] = field(default_factory=list)  # "float", "int" or "bool" per slot
    aux_ranks: List[int] = field(default_factory=list)  # dimensions of each tensor
    uses_aux_tensors: bool = False  # whether the call's aux_tensors were passed as arguments
    grad_written: bool = False      # score_mod: `grad` from a hand-written score_mod_bwd

    @property
    def num_ops(self) -> int:
        return len(self.code) // 4

    def __post_init__(self):
        # Hashed once, when traced (torch.compile reads it as a plain attribute).
        text = repr((self.role, self.code, self.result, self.grad, self.aux_kinds, self.aux_ranks))
        self._structure_key = hashlib.sha256(text.encode()).hexdigest()[:16]

    def structure_key(self) -> str:
        """A hash of what the compiled GPU functor depends on (the program and the tensors'
        kinds and ranks, not the constants' values nor the tensors' contents)."""
        return self._structure_key

    def __setstate__(self, state):
        # Unpickled (another process traced it, e.g. a data-parallel worker's parent): known
        # by structure here too, as the torch custom ops find it.
        self.__dict__.update(state)
        _register_structure(self)

    def __repr__(self) -> str:
        return f"<cuflash.mods.TracedMod {self.role}_mod {self.name}: {self.num_ops} ops>"


def _accepts(fn: Callable, count: int) -> bool:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True  # builtins without a signature: let the call decide
    try:
        signature.bind(*([None] * count))
        return True
    except TypeError:
        return False


def _takes_aux(fn: Callable, base: Sequence[str], aux_tensors: List[Any], argument: str) -> bool:
    """Whether ``fn`` takes the aux_tensors as trailing arguments after ``base`` (TypeError when it
    takes neither form)."""
    if aux_tensors and _accepts(fn, len(base) + len(aux_tensors)):
        return True
    if not _accepts(fn, len(base)):
        extra = f"[, *aux_tensors ({len(aux_tensors)})]" if aux_tensors else "[, *aux_tensors]"
        raise TypeError(f"{argument}: expected a function of ({', '.join(base)}{extra}), "
                        f"got {_name(fn)}{_signature_text(fn)}")
    return False


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _trace(fn: Callable, role: str, argument: str, aux_tensors: Optional[Sequence[Any]],
           bwd: Optional[Callable] = None, bwd_argument: str = "score_mod_bwd") -> TracedMod:
    from ._tensors import framework_of

    if isinstance(fn, TracedMod):
        if bwd is not None:
            raise TypeError(f"{bwd_argument}: {fn!r} is already traced with its derivative; pass the "
                            f"function itself, or give bwd to cuflash.mods.trace_score_mod")
        return fn
    if not callable(fn):
        raise TypeError(f"{argument}: expected a callable, got {type(fn).__name__}")
    if bwd is not None and not callable(bwd):
        raise TypeError(f"{bwd_argument}: expected a callable, got {type(bwd).__name__}")
    name = _name(fn)
    base = ("score", "b", "h", "q_idx", "kv_idx") if role == "score" else ("b", "h", "q_idx", "kv_idx")
    aux_tensors = list(aux_tensors or [])
    uses_aux = _takes_aux(fn, base, aux_tensors, argument)
    bwd_uses_aux = bwd is not None and _takes_aux(bwd, ("grad",) + base, aux_tensors, bwd_argument)

    graph = _Graph(argument)

    proxies: Dict[int, _AuxProxy] = {}

    def make_proxy(tensor: Any, label: str) -> _AuxProxy:
        # One proxy (one aux slot, one copy to the device) per tensor, however many of the
        # traced functions read it.
        if id(tensor) not in proxies:
            proxies[id(tensor)] = _AuxProxy(graph, tensor, framework_of(tensor), label)
        return proxies[id(tensor)]

    args: List[Any] = []
    if role == "score":
        args.append(graph.node(SCORE, type="float"))
    args += [graph.node(op, type="int") for op in (BATCH, HEAD, Q_IDX, KV_IDX)]
    aux_args = []
    if uses_aux or bwd_uses_aux:
        for i, tensor in enumerate(aux_tensors):
            if framework_of(tensor) is None:
                raise TypeError(f"aux_tensors[{i}]: expected a tensor or array, got {type(tensor).__name__}")
            aux_args.append(make_proxy(tensor, f"aux_tensors[{i}]"))
    value = _call_traced(graph, fn, argument, make_proxy, args + (aux_args if uses_aux else []))
    if role == "mask":
        if isinstance(value, (bool, np.bool_)):
            value = graph.constant(bool(value))
        if not isinstance(value, Sym) or value.type != "bool":
            got = (("an " if value.type == "int" else "a ") + f"{value.type} expression" if isinstance(value, Sym)
                   else type(value).__name__)
            raise TraceError(f"{argument}: {name} must return a boolean expression (comparisons combined with "
                             f"& | ~), got {got}")
        result = graph.lift(value)
        grad = None
    else:
        if isinstance(value, (bool, np.bool_)) or (isinstance(value, Sym) and value.type == "bool"):
            raise TraceError(f"{argument}: {name} must return a float expression (the new score), got a "
                             f"boolean; a mask belongs in mask_mod (or use where(cond, score, -inf))")
        if not isinstance(value, (Sym, numbers.Real)):
            raise TraceError(f"{argument}: {name} must return a float expression (the new score), got "
                             f"{type(value).__name__}")
        result = graph.to_float(graph.lift(value))
        if bwd is None:
            grad = _derivative(graph, result)
        else:
            graph.argument = bwd_argument
            grad_in = graph.node(GRAD, type="float")
            value = _call_traced(graph, bwd, bwd_argument, make_proxy,
                                 [grad_in] + args + (aux_args if bwd_uses_aux else []))
            grad = _derivative_of_linear(graph, value, _name(bwd))
            graph.argument = argument
    traced = _emit(graph, role, name, result, grad, uses_aux or bwd_uses_aux)
    traced.grad_written = bwd is not None
    return traced


def _call_traced(graph: _Graph, fn: Callable, argument: str, make_proxy: Callable, args: List[Any]) -> Any:
    """fn called with symbolic arguments (the tensors it closes over read through proxies)."""
    try:
        value = _with_proxies(fn, make_proxy)(*args)
    except TraceError:
        raise
    except Exception as error:  # noqa: BLE001 (any failure of the user's code is reported by name)
        raise TraceError(f"{argument}: tracing {_name(fn)} failed: {type(error).__name__}: {error}. Callables are "
                         f"traced once with symbolic values: use arithmetic, comparisons, & | ~, "
                         f"cuflash.mods functions and indexing of tensors that the function closes over "
                         f"directly (not inside a list, dict or object) or receives from aux_tensors") from error
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    return value


def _is_zero(node: _Node, graph: _Graph) -> bool:
    return ((node.op == FLOAT and graph.constants[node.imm] == 0.0) or (node.op == INT and node.imm == 0))


def _derivative_of_linear(graph: _Graph, value: Any, name: str) -> Sym:
    """d value / d grad of a traced score_mod_bwd, checked to be linear in grad (value = grad *
    d, d free of grad), so that the kernels' dS * d is what the function computes."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, Sym) and value.type == "bool"):
        graph.fail(f"{name} must return a float expression (the gradient of the score), got a boolean")
    if not isinstance(value, (Sym, numbers.Real)):
        graph.fail(f"{name} must return a float expression (the gradient of the score), got {type(value).__name__}")
    result = graph.lift(value)
    # Per node: "free" of grad, "linear" in it (grad times something free of it), or the name of
    # the operation that made it neither.
    kind: Dict[int, str] = {}
    for index in range(result.index + 1):
        node = graph.nodes[index]
        operands = [a for a in node.args if a >= 0]
        kinds = [kind[a] for a in operands]
        linear_or_zero = [k == "linear" or _is_zero(graph.nodes[a], graph) for a, k in zip(operands, kinds)]
        broken = next((k for k in kinds if k not in ("free", "linear")), None)
        if node.op == GRAD:
            k = "linear"
        elif broken is not None:
            k = broken
        elif "linear" not in kinds:
            k = "free"
        elif node.op in (ADD, SUB) and all(linear_or_zero):
            k = "linear"
        elif node.op == MUL and kinds.count("linear") == 1:
            k = "linear"
        elif node.op == DIV and kinds == ["linear", "free"]:
            k = "linear"
        elif node.op == NEG:
            k = "linear"
        elif node.op == WHERE and kinds[0] == "free" and all(linear_or_zero[1:]):
            k = "linear"
        else:
            k = _OP_NAMES[node.op] + (" of grad and a term free of it" if node.op in (ADD, SUB) else
                                      " of two terms in grad" if node.op == MUL else
                                      " by a term in grad" if node.op == DIV else
                                      " with a condition on grad or a branch free of it" if node.op == WHERE else
                                      " of grad")
        kind[index] = k
    if kind[result.index] == "free" and not _is_zero(result.node, graph):
        graph.fail(f"{name} must return grad times the derivative of score_mod; its result does not depend on grad")
    if kind[result.index] not in ("free", "linear"):
        graph.fail(f"{name} must be linear in grad (the gradient of a function of one score is grad times "
                   f"its derivative): sums of grad * x and grad / x with x free of grad, and "
                   f"where(cond, ..., 0.0) of those with cond free of grad; it uses {kind[result.index]}")
    return _derivative(graph, graph.to_float(result), variable=GRAD)


def _signature_text(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _derivative(graph: _Graph, result: Sym, variable: int = SCORE) -> Sym:
    """d result / d score (or d result / d grad), built into the same graph (reverse of nothing:
    forward-mode over the nodes in creation order, which is topological)."""
    d: Dict[int, Optional[Sym]] = {}
    one = lambda: graph.float_constant(1.0)  # noqa: E731

    def add(x, y):
        if x is None:
            return y
        if y is None:
            return x
        return x + y

    def mul(x, y):  # y may be None (zero)
        if x is None or y is None:
            return None
        return x * y

    def select(c, x, y):
        if x is None and y is None:
            return None
        zero = graph.float_constant(0.0)
        return where(c, zero if x is None else x, zero if y is None else y)

    for index in range(result.index + 1):
        node = graph.nodes[index]
        if node.type != "float":
            d[index] = None
            continue
        op = node.op
        x = Sym(graph, index)
        args = [Sym(graph, a) for a in node.args]
        da = [d.get(a) for a in node.args]
        if op == variable:
            g = one()
        elif op in (SCORE, GRAD, FLOAT, TO_FLOAT, LOAD):
            g = None
        elif op == ADD:
            g = add(da[0], da[1])
        elif op == SUB:
            g = add(da[0], None if da[1] is None else -da[1])
        elif op == MUL:
            g = add(mul(args[1], da[0]), mul(args[0], da[1]))
        elif op == DIV:
            numerator = add(da[0], None if da[1] is None else -(x * da[1]))
            g = None if numerator is None else numerator / args[1]
        elif op == NEG:
            g = None if da[0] is None else -da[0]
        elif op == ABS:
            g = None if da[0] is None else where(args[0] >= 0.0, da[0], -da[0])
        elif op == EXP:
            g = mul(x, da[0])
        elif op == EXP2:
            g = mul(x * math.log(2.0), da[0])
        elif op == LOG:
            g = None if da[0] is None else da[0] / args[0]
        elif op == TANH:
            g = mul(1.0 - x * x, da[0])
        elif op == SIGMOID:
            g = mul(x * (1.0 - x), da[0])
        elif op == SQRT:
            g = None if da[0] is None else da[0] * 0.5 / x
        elif op == MIN:
            g = select(args[0] <= args[1], da[0], da[1])
        elif op == MAX:
            g = select(args[0] >= args[1], da[0], da[1])
        elif op == WHERE:
            g = select(args[0], da[1], da[2])
        else:  # pragma: no cover (every float op is listed above)
            raise AssertionError(f"no derivative rule for {_OP_NAMES[op]}")
        d[index] = g
    grad = d[result.index]
    return graph.float_constant(0.0) if grad is None else graph.to_float(grad)


def _emit(graph: _Graph, role: str, name: str, result: Sym, grad: Optional[Sym], uses_aux: bool) -> TracedMod:
    """The live nodes as a program: renumbered registers, used constants and tensor slots."""
    roots = [result.index] + ([grad.index] if grad is not None else [])
    live = set()
    stack = list(roots)
    while stack:
        i = stack.pop()
        if i in live or i < 0:
            continue
        live.add(i)
        stack.extend(a for a in graph.nodes[i].args if a >= 0)
    order = sorted(live)
    register = {old: new for new, old in enumerate(order)}
    constant_index: Dict[int, int] = {}
    constants: List[float] = []
    slot_index: Dict[int, int] = {}
    aux: List[Any] = []
    aux_kinds: List[str] = []
    code: List[int] = []
    types_: List[str] = []
    for old in order:
        node = graph.nodes[old]
        a = [register[x] if x >= 0 else -1 for x in node.args] + [-1] * (3 - len(node.args))
        word = node.op
        fourth = a.pop() if len(a) > 3 else -1  # a load's fourth index: in the opcode word
        if node.op in (INT, BOOL):
            a[0] = node.imm
        elif node.op == FLOAT:
            if node.imm not in constant_index:
                constant_index[node.imm] = len(constants)
                constants.append(graph.constants[node.imm])
            a[0] = constant_index[node.imm]
        elif node.op == LOAD:
            if node.imm not in slot_index:
                slot_index[node.imm] = len(aux)
                proxy = graph.slots[node.imm]
                aux.append(proxy._tensor)
                aux_kinds.append(proxy._kind)
            word = load_word(slot_index[node.imm], fourth)
        code += [word] + a
        types_.append(node.type)
    argument = graph.argument
    if len(order) > MAX_OPS:
        raise ValueError(f"{argument}: {name} needs {len(order)} instructions"
                         f"{' (with its derivative)' if role == 'score' else ''}, more than the limit of "
                         f"{MAX_OPS}; simplify it or use a built-in")
    if len(constants) > MAX_CONSTANTS:
        raise ValueError(f"{argument}: {name} uses {len(constants)} distinct float constants, more than the "
                         f"limit of {MAX_CONSTANTS}; read them from a tensor instead")
    if len(aux) > MAX_AUX:
        raise ValueError(f"{argument}: {name} reads {len(aux)} tensors, more than the limit of {MAX_AUX}; "
                         f"stack them into one")
    traced = TracedMod(role=role, name=name, code=code, types=types_, result=register[result.index],
                       grad=register[grad.index] if grad is not None else -1, constants=constants, aux=aux,
                       aux_kinds=aux_kinds, aux_ranks=[len(a.shape) for a in aux], uses_aux_tensors=uses_aux)
    _register_structure(traced)
    return traced


# Every structure traced in this process, by key: what a call that carries a program and its key
# (the torch custom ops) compiles for the GPU.
_STRUCTURES: Dict[str, TracedMod] = {}


def _register_structure(traced: TracedMod) -> None:
    # The structure, without the constants and tensors (which it would keep alive).
    if traced.structure_key() not in _STRUCTURES:
        _STRUCTURES[traced.structure_key()] = dataclasses.replace(traced, constants=[], aux=[])


def structure_of(key: str) -> Optional[TracedMod]:
    """The traced structure of `key` (TracedMod.structure_key), if one was traced in this process."""
    return _STRUCTURES.get(key)


def trace_score_mod(fn: Callable, aux_tensors: Optional[Sequence[Any]] = None,
                    argument: str = "score_mod", bwd: Optional[Callable] = None) -> TracedMod:
    """Traces ``fn(score, b, h, q_idx, kv_idx[, *aux_tensors])`` into a program with its
    derivative with respect to score: symbolic, or that of ``bwd(grad, score, b, h, q_idx,
    kv_idx[, *aux_tensors])``, a hand-written gradient linear in grad (see the module's notes).
    Raises TypeError (naming `argument`, or score_mod_bwd for bwd) for what cannot be traced and
    ValueError past the limits."""
    return _trace(fn, "score", argument, aux_tensors, bwd)


def trace_mask_mod(fn: Callable, aux_tensors: Optional[Sequence[Any]] = None,
                   argument: str = "mask_mod") -> TracedMod:
    """Traces ``fn(b, h, q_idx, kv_idx[, *aux_tensors])`` into a program returning a boolean."""
    return _trace(fn, "mask", argument, aux_tensors)
