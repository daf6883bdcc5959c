"""The public attention functions: flash_attn_func, flash_attn_varlen_func, flash_attn_combine.

Signatures and defaults follow the seed interface (FlashAttention 3's Hopper interface).
Tensors may come from torch, NumPy, CuPy (by DLPack) or JAX; outputs are allocated with the
input's framework. CPU arrays run on the C++ reference implementation, CUDA arrays on the
sm_90a kernels. torch tensors get autograd (dq, dk, dv and d(learnable_sink)). JAX arrays run as
XLA custom calls (python/cuflash/_jax.py), eagerly or traced (inside jax.jit, under jax.grad /
jax.vjp, with the same gradients), where the extension was built with jax's headers.

Arguments are checked before any work starts; a bad one raises ValueError or TypeError whose
message begins with the argument's name. A configuration that this build does not contain
raises NotImplementedError naming the build option.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from . import _C, _jit
from . import mods as _mods
from . import masks, scores
from ._tensors import TRACED, Framework, _dtype_name, framework_of, loaded_module
from ._variants import BuiltinVariant, MaskMod, ScoreMod
from .block_sparse import BLOCK_M, BLOCK_N

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_combine", "flash_attn_backward"]

Tensor = Any  # a torch.Tensor, numpy.ndarray, cupy.ndarray or jax.Array

_INPUT_DTYPES = ("float16", "bfloat16")
_SINK_DTYPES = ("float32", "bfloat16", "float16")
_MAX_HEAD_DIM = 256
_HEAD_DIM_MULTIPLE = 8  # 16 bytes of 16-bit elements
_MAX_SPLITS = 256
_INT32_MAX = 2**31 - 1  # lengths and window sides are int32 in the C++ parameters
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # float32's smallest normal value


# ---------------------------------------------------------------------------------------------
# Argument checks


def _fail(exception: type, argument: str, message: str):
    raise exception(f"{argument}: {message}")


def _check_tensor(x: Any, argument: str, framework: Optional[Framework] = None) -> Framework:
    """`x` is an array cuflash knows and, when given, of the same framework as q."""
    own = framework_of(x)
    if own is None:
        _fail(TypeError, argument, f"expected a tensor or array (torch, numpy, cupy or jax), got {type(x).__name__}")
    if framework is not None and own is not framework:
        _fail(TypeError, argument, f"expected a {framework.name} array like q, got a {own.name} array")
    if own.name == "jax" and not own._is_tracer(x) and len(x.devices()) > 1 and not _jax_ffi_available():
        # The XLA custom calls partition over a mesh (_jax_sharding); the DLPack path cannot.
        _fail(ValueError, argument, f"a JAX array on {len(x.devices())} devices (sharded or replicated), which "
                                    f"this build takes only through its XLA custom calls; "
                                    f"{_jax_unavailable_message()}")
    if own.name == "jax" and not _jax_ffi_available():
        from . import _jax

        if _jax.is_tracer(x):
            _fail(TypeError, argument, f"traced JAX values (inside jax.jit or jax.grad) run as XLA custom calls, "
                                       f"but {_jax.unavailable_message()}; or call cuflash eagerly")
    return own


def _jax_unavailable_message() -> str:
    from . import _jax

    return _jax.unavailable_message()


def _jax_ffi_available() -> bool:
    from . import _jax

    return _jax.available()


def _uses_jax_ffi(framework: Framework) -> bool:
    """JAX arrays, traced or not, run as XLA custom calls when the extension has the handlers."""
    return framework.name == "jax" and _jax_ffi_available()


def _check_bool(value: Any, argument: str, optional: bool = False) -> Optional[bool]:
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    expected = "a bool or None" if optional else "a bool"
    _fail(TypeError, argument, f"expected {expected}, got {type(value).__name__}")


def _check_int(value: Any, argument: str, optional: bool = False, minimum: Optional[int] = None,
               maximum: Optional[int] = None) -> Optional[int]:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        expected = "an int or None" if optional else "an int"
        _fail(TypeError, argument, f"expected {expected}, got {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        _fail(ValueError, argument, f"expected a value >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        _fail(ValueError, argument, f"expected a value <= {maximum}, got {value}")
    return value


def _check_float(value: Any, argument: str, optional: bool = False) -> Optional[float]:
    if value is None and optional:
        return None
    own = None if isinstance(value, (bool, numbers.Real)) else framework_of(value)
    if own is not None and tuple(getattr(value, "shape", (None,))) == () and own.dtype(value).startswith(("float", "bfloat", "int", "uint")):
        # A concrete 0-d numeric array (jnp.float32(0.1), a torch scalar tensor): its value.
        if own.name == "jax" and own._is_tracer(value):
            _fail(TypeError, argument, "expected a Python float, got a traced JAX value: it sets the kernels' "
                                       "constants, so it must be concrete (a static argument under jax.jit)")
        if own.requires_grad(value):
            _fail(NotImplementedError, argument, "requires grad, but cuflash computes no gradient for it; pass a "
                                                 "float (or a tensor that does not require grad)")
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        expected = "a float or None" if optional else "a float"
        _fail(TypeError, argument, f"expected {expected}, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        _fail(ValueError, argument, f"expected a finite value, got {value}")
    return value


def _check_window(window_size: Any) -> Tuple[int, int]:
    """(left, right) with None (or -1) for unbounded -> C++ convention, -1 for unbounded."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        _fail(TypeError, "window_size", f"expected a (left, right) pair of int or None, got {window_size!r}")
    bounds = []
    for side, value in zip(("left", "right"), window_size):
        if value is None:
            bounds.append(-1)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            _fail(TypeError, "window_size", f"{side} must be an int or None, got {type(value).__name__}")
        if value < -1:
            _fail(ValueError, "window_size", f"{side} must be >= 0 (or None / -1 for unbounded), got {value}")
        if value > _INT32_MAX:
            _fail(ValueError, "window_size", f"{side} must be at most {_INT32_MAX} (or None for unbounded), got {value}")
        bounds.append(int(value))
    return bounds[0], bounds[1]


def _shape(x: Tensor) -> Tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _check_shape(x: Tensor, argument: str, expected: Tuple[int, ...], what: str = "") -> None:
    if _shape(x) != tuple(expected):
        detail = f" {what}" if what else ""
        _fail(ValueError, argument, f"expected shape {tuple(expected)}{detail}, got {_shape(x)}")


def _check_dtype(framework: Framework, x: Tensor, argument: str, allowed: Sequence[str]) -> str:
    dtype = framework.dtype(x)
    if dtype not in allowed:
        _fail(TypeError, argument, f"expected dtype {' or '.join(allowed)}, got {dtype}")
    return dtype


def _same_device(a: Tuple[str, int], b: Tuple[str, int]) -> bool:
    """Traced JAX values have no device of their own (XLA places them): they match any."""
    return a == b or TRACED in (a, b)


def _check_device(framework: Framework, x: Tensor, argument: str, device: Tuple[str, int]) -> None:
    own = framework.device(x)
    if not _same_device(own, device):
        _fail(ValueError, argument, f"expected a tensor on {_device_str(device)} like q, got {_device_str(own)}")


def _device_str(device: Tuple[str, int]) -> str:
    return "cpu" if device[0] == "cpu" else f"{device[0]}:{device[1]}"


def _maybe_contiguous(framework: Framework, x: Optional[Tensor]) -> Optional[Tensor]:
    """Copies only when the kernels cannot read the input as it is: a strided last dimension, or
    on the GPU a start address or another stride that is not a multiple of 16 bytes (TMA's rule;
    the C++ API refuses those naming the argument, here a contiguous copy, freshly allocated and
    so aligned, stands in)."""
    if x is None or len(x.shape) == 0:
        return x
    shape, strides = _shape(x), framework.strides(x)
    if strides[-1] != 1 and shape[-1] > 1:
        return framework.contiguous(x)
    if framework.device(x)[0] == "cuda":
        itemsize = 2 if framework.dtype(x) == "bfloat16" else np.dtype(framework.dtype(x)).itemsize
        multiple = max(1, 16 // itemsize)
        if any(stride % multiple != 0 for stride, size in zip(strides[:-1], shape[:-1]) if size > 1):
            return framework.contiguous(x)
        address = framework.address(x)
        if address is not None and address % 16 != 0 and _numel(shape) > 0:
            return framework.contiguous(x)
    return x


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def _check_distinct_elements(framework: Framework, x: Tensor, argument: str) -> None:
    """An output the caller hands in: no two of its elements may share memory, the rule of the
    C++ validation. Checked here too because a NumPy broadcast view, the usual way to get such
    an array, is read-only and would otherwise fail at the DLPack boundary without naming out."""
    shape, strides = _shape(x), framework.strides(x)
    if 0 in shape:
        return
    layout = f"got shape {shape} with strides {strides}"
    dims = sorted((d for d in reversed(range(len(shape))) if shape[d] > 1), key=lambda d: abs(strides[d]))
    for i, d in enumerate(dims):
        if strides[d] == 0:
            _fail(ValueError, argument, f"expected a non-zero stride on every dimension of size > 1 (an output's "
                                        f"elements must not share memory), {layout}: dimension {d} has size "
                                        f"{shape[d]} and stride 0")
        inner = dims[i - 1] if i else None
        if inner is not None and abs(strides[d]) < shape[inner] * abs(strides[inner]):
            _fail(ValueError, argument, f"expected strides under which distinct elements do not overlap (an "
                                        f"output's elements must not share memory), {layout}: dimension {d} "
                                        f"(stride {strides[d]}) starts inside the span of dimension {inner} "
                                        f"(size {shape[inner]} x stride {strides[inner]})")


def _index_tensor(framework: Framework, x: Optional[Tensor], argument: str, expected: Tuple[int, ...],
                  device: Tuple[str, int], what: str) -> Optional[Tensor]:
    """cu_seqlens / seqused: int32, 1-D contiguous, on q's device."""
    if x is None:
        return None
    _check_tensor(x, argument, framework)
    _check_shape(x, argument, expected, what)
    _check_dtype(framework, x, argument, ("int32",))
    if expected[0] > 1 and framework.strides(x)[0] != 1:
        _fail(ValueError, argument, f"expected a contiguous tensor (stride 1), got strides {framework.strides(x)}")
    _check_device(framework, x, argument, device)
    return x


# ---------------------------------------------------------------------------------------------
# A checked call: everything the extension needs, forward and backward


@dataclass
class _Call:
    framework: Framework
    q: Tensor
    k: Tensor
    v: Tensor
    device: Tuple[str, int]
    dtype: str
    batch: int
    seqlen_q: Optional[int]  # None when q is packed
    seqlen_k: int
    total_q: int
    num_heads: int
    num_heads_kv: int
    head_dim: int
    head_dim_v: int
    cu_seqlens_q: Optional[Tensor] = None
    cu_seqlens_k: Optional[Tensor] = None
    seqused_q: Optional[Tensor] = None
    seqused_k: Optional[Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_k: Optional[int] = None
    page_table: Optional[Tensor] = None
    learnable_sink: Optional[Tensor] = None
    softmax_scale: Optional[float] = None
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    score_mod: Tuple[int, List[float], List[Tensor]] = (0, [], [])
    mask_mod: Tuple[int, List[float], List[Tensor]] = (0, [], [])
    # Traced callables (cuflash.mods): [result, grad, code...] of the expression program, else [].
    score_program: List[int] = field(default_factory=list)
    mask_program: List[int] = field(default_factory=list)
    # On the GPU: the traced callables, and the (forward, backward) launchers compiled for them
    # at run time (cuflash._jit); 0: the library's own kernels.
    score_traced: Any = None
    mask_traced: Any = None
    expression_kernels: Tuple[int, int] = (0, 0)
    # JAX: the compiled module's path instead (the custom calls' GPU handlers open it).
    expression_module: str = ""
    # mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx, then the q_ (backward) lists.
    block_sparse: List[Optional[Tensor]] = field(default_factory=list)
    num_splits: int = 1
    pack_gqa: Optional[bool] = None
    deterministic: bool = False

    @property
    def out_shape(self) -> Tuple[int, ...]:
        rows = (self.total_q,) if self.cu_seqlens_q is not None else (self.batch, self.seqlen_q)
        return rows + (self.num_heads, self.head_dim_v)

    @property
    def lse_shape(self) -> Tuple[int, ...]:
        if self.cu_seqlens_q is not None:
            return (self.num_heads, self.total_q)
        return (self.batch, self.num_heads, self.seqlen_q)

    def stream(self) -> int:
        return self.framework.stream(self.q)

    def export(self, x: Optional[Tensor]) -> Any:
        return None if x is None else self.framework.export(x)

    def common_kwargs(self) -> dict:
        """Arguments that _C.forward and _C.backward share."""
        ex = self.export
        score_kind, score_scalars, score_aux = self.score_mod
        mask_kind, mask_scalars, mask_aux = self.mask_mod
        return dict(
            cu_seqlens_q=ex(self.cu_seqlens_q),
            cu_seqlens_k=ex(self.cu_seqlens_k),
            seqused_q=ex(self.seqused_q),
            seqused_k=ex(self.seqused_k),
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=self.max_seqlen_k,
            softmax_scale=self.softmax_scale,
            causal=self.causal,
            window_left=self.window_left,
            window_right=self.window_right,
            softcap=self.softcap,
            score_mod_kind=score_kind,
            score_mod_scalars=list(score_scalars),
            score_mod_aux=[ex(a) for a in score_aux],
            mask_mod_kind=mask_kind,
            mask_mod_scalars=list(mask_scalars),
            mask_mod_aux=[ex(a) for a in mask_aux],
            block_sparse=[ex(t) for t in self.block_sparse],
            block_m=BLOCK_M,
            block_n=BLOCK_N,
            score_mod_program=list(self.score_program),
            mask_mod_program=list(self.mask_program),
        )


def _resolve_variant(mod: Any, argument: str, cls: type, aux_tensors: Optional[List[Tensor]],
                     call: _Call, bwd: Optional[Callable] = None) -> Tuple[Tuple[int, List[float], List[Tensor]], bool]:
    """A cuflash.scores / cuflash.masks object -> (kind, scalars, aux); also whether it took
    its tensors from aux_tensors. A Python callable is traced (cuflash.mods), with `bwd`, a
    score_mod's hand-written gradient, when given: its program goes to call.score_program /
    call.mask_program."""
    if mod is None:
        if bwd is not None:
            _fail(ValueError, "score_mod_bwd", "given without a score_mod: it is the gradient of a score_mod callable")
        return (0, [], []), False
    if isinstance(mod, _CheckedExpression):
        return _resolve_checked_expression(mod, argument, call), False
    module = "cuflash.scores" if cls is ScoreMod else "cuflash.masks"
    if not isinstance(mod, cls):
        other = MaskMod if cls is ScoreMod else ScoreMod
        if isinstance(mod, other):
            _fail(TypeError, argument, f"{mod!r} is a {other.role}_mod, not a {cls.role}_mod")
        if callable(mod) or isinstance(mod, _mods.TracedMod):
            return _resolve_callable(mod, argument, cls, aux_tensors, call, bwd)
        _fail(TypeError, argument, f"expected a callable, a {module} object or None, got {type(mod).__name__}")
    if bwd is not None:
        _fail(TypeError, "score_mod_bwd", f"takes a score_mod that is a Python callable; the built-in {mod!r} "
                                          f"has its own derivative")

    framework = call.framework
    aux = list(mod.aux)
    from_aux_tensors = False
    if mod.num_aux and not aux:
        if aux_tensors is None or len(aux_tensors) != mod.num_aux:
            got = 0 if aux_tensors is None else len(aux_tensors)
            _fail(ValueError, "aux_tensors" if aux_tensors is not None else argument,
                  f"{mod!r} reads {mod.num_aux} tensor(s): pass them to it or in aux_tensors (got {got})")
        aux = list(aux_tensors)
        from_aux_tensors = True

    resolved = []
    for i, tensor in enumerate(aux):
        name = f"{argument} aux[{i}]"
        own = framework_of(tensor)
        if own is None:
            _fail(TypeError, name, f"expected a tensor or array, got {type(tensor).__name__}")
        if own is not framework or not _same_device(own.device(tensor), call.device):
            if own.name != "numpy":
                _fail(ValueError, name, f"expected a tensor on {_device_str(call.device)} like q, "
                                        f"got a {own.name} array on {_device_str(own.device(tensor))}")
            tensor = framework.from_numpy(tensor, like=call.q)
        resolved.append(framework.contiguous(tensor))
    aux = resolved

    heads, batch = call.num_heads, call.batch
    if mod.name == "alibi":
        aux[0] = _aux_dtype(framework, aux[0], name=f"{argument} slopes", dtype="float32")
        _check_shape(aux[0], f"{argument} slopes", (heads,), "(num_heads,)")
    elif mod.name == "relative_bias":
        aux[0] = _aux_dtype(framework, aux[0], name=f"{argument} table", dtype="float32")
        shape = _shape(aux[0])
        if len(shape) != 2 or shape[0] != heads or shape[1] % 2 != 1:
            _fail(ValueError, f"{argument} table", f"expected shape (num_heads={heads}, 2R+1), got {shape}")
    elif mod.name == "document":
        aux[0] = _aux_dtype(framework, aux[0], name=f"{argument} doc_ids", dtype="int32")
        shape = _shape(aux[0])
        # The ids cover the longest sequence: packed lengths from the max_seqlen hints, else
        # read from host cu_seqlens (the bound total_q / total_k where they are on the device),
        # paged keys as the page table addresses them (max_pages * page_size), as the C++ API.
        def packed_longest(hint, cu_seqlens, bound):
            if hint is not None:
                return hint
            host = _host_longest(call, cu_seqlens)
            return bound if host is None else host

        seqlen_k = _addressed_keys(call)
        longest = max(
            call.seqlen_q if call.cu_seqlens_q is None else packed_longest(call.max_seqlen_q, call.cu_seqlens_q,
                                                                            call.total_q),
            seqlen_k if call.cu_seqlens_k is None else packed_longest(call.max_seqlen_k, call.cu_seqlens_k, seqlen_k))
        if len(shape) != 2 or shape[0] != batch or shape[1] < longest:
            _fail(ValueError, f"{argument} doc_ids",
                  f"expected shape (batch={batch}, L) with L >= max(seqlen_q, seqlen_k) = {longest}, got {shape}")
    return (mod.kind, list(mod.scalars), aux), from_aux_tensors


def _addressed_keys(call: _Call) -> int:
    """Keys a sequence can hold: seqlen_k, or with a page table max_pages * page_size."""
    if call.page_table is not None:
        return int(call.page_table.shape[1]) * int(call.k.shape[1])
    return call.seqlen_k


def _host_longest(call: _Call, cu_seqlens: Tensor) -> Optional[int]:
    """The longest packed sequence, read from cu_seqlens when it is on the host; else None."""
    if call.device[0] != "cpu":
        return None
    try:
        offsets = np.asarray(call.framework.to_numpy(cu_seqlens), np.int64)
    except Exception:  # a traced array (JAX under jit) has no host values
        return None
    return int(np.max(np.diff(offsets))) if offsets.size >= 2 else None


def _resolve_callable(mod: Any, argument: str, cls: type, aux_tensors: Optional[List[Tensor]],
                      call: _Call, bwd: Optional[Callable] = None) -> Tuple[Tuple[int, List[float], List[Tensor]], bool]:
    """Traces a score_mod / mask_mod callable into an expression program; its tensors move to
    q's framework and device as float32 (float tensors) or int32 (integer and bool tensors)."""
    role = "score" if cls is ScoreMod else "mask"
    if isinstance(mod, _mods.TracedMod) and mod.role != role:
        _fail(TypeError, argument, f"{mod!r} is a traced {mod.role}_mod, not a {role}_mod")
    traced = _mods._trace(mod, role, argument, aux_tensors, bwd)
    framework = call.framework
    aux = []
    for i, (tensor, kind) in enumerate(zip(traced.aux, traced.aux_kinds)):
        own = framework_of(tensor)
        if own is framework and framework.name == "torch" and not _same_device(own.device(tensor), call.device):
            # A torch tensor on another device: moved by torch, so that a tensor that requires grad
            # still does (and is refused by _refuse_mod_tensor_grads, not silently left untrained).
            tensor = tensor.to(call.q.device)
        elif own is not framework or not _same_device(own.device(tensor), call.device):
            # A tensor of another framework or device (e.g. a NumPy table): copied to q's.
            tensor = framework.from_numpy(np.ascontiguousarray(own.to_numpy(tensor)), like=call.q)
        if _numel(_shape(tensor)) == 0:
            _fail(ValueError, argument, f"reads tensor aux[{i}], which is empty (shape {_shape(tensor)})")
        if kind == "float":
            if framework.dtype(tensor) != "float32":
                tensor = framework.astype(tensor, "float32")
        else:
            tensor = _to_int32(framework, tensor, f"{argument} aux[{i}]")
        aux.append(framework.contiguous(tensor))
    # JAX under jax.jit: the arrays' device is not known while tracing; the backend's decides
    # whether the kernels for the callable are compiled (a CPU computation ignores them).
    on_gpu = call.device[0] == "cuda" or (call.device == TRACED and loaded_module("jax").default_backend() == "gpu")
    builtin = (_builtin_mask(traced, aux, argument, call, on_gpu) if role == "mask" else
               _builtin_score(traced, aux, argument, call, on_gpu) if not traced.grad_written else None)
    if builtin is not None:
        return builtin, traced.uses_aux_tensors
    if on_gpu:
        if not _C.built_with_cuda:
            _fail(NotImplementedError, argument, "this cuflash was built without CUDA: Python callables run on "
                                                 "the CPU reference (pass CPU tensors)")
        if not _jit.enabled():
            _fail(NotImplementedError, argument,
                  "Python callables on the GPU need kernels compiled at run time, which CUFLASH_JIT_CALLABLES=0 "
                  "turns off: unset it, pass CPU tensors (the CPU reference), or use a built-in from "
                  "cuflash.scores / cuflash.masks")
        _set_traced(call, role, traced)
    program = [traced.result, traced.grad] + list(traced.code)
    if role == "score":
        call.score_program = program
    else:
        call.mask_program = program
    return (_EXPRESSION_KIND, [float(c) for c in traced.constants], aux), traced.uses_aux_tensors


# ScoreModKind / MaskModKind::kExpression (include/cuflash/options.hpp).
_EXPRESSION_KIND = 100


def _opcode(code: List[int], register: int) -> int:
    """The operation of a program's instruction `register` (mods: the opcode word's low byte)."""
    return code[4 * register] & 0xFF


def _builtin_kernels_built(call: _Call, families: Sequence[str]) -> bool:
    """Whether this build holds the forward kernels of `families` ("flex", "softcap") for the
    call's dtype, head dims and form (paged, an explicit split, packed GQA asked for), as
    built_kernels names them; the backward kernels are built with them. A callable that spells a
    built-in runs as the built-in only then: else it is compiled at run time as any callable (a
    build of other head dims or dtypes must not refuse what it used to run)."""
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(call.dtype)
    try:
        head_dim, head_dim_v = _jit.kernel_head_dims(call.head_dim, call.head_dim_v)
    except _jit.JitError:
        return False
    if dtype is None:
        return False
    dims = f"hdim{head_dim}" if head_dim == head_dim_v else f"hdim{head_dim}x{head_dim_v}"
    form = ((["paged"] if call.page_table is not None else []) + (["split"] if call.num_splits > 1 else [])
            + (["packgqa"] if call.pack_gqa is True and call.num_heads != call.num_heads_kv else []))
    built = set(_C.built_kernels())
    return all(" ".join(["fwd", dtype, dims, family] + form) in built for family in families)


def _builtin_score(traced: Any, aux: List[Tensor], argument: str, call: _Call,
                   on_gpu: bool) -> Optional[Tuple[int, List[float], List[Tensor]]]:
    """The built-in score_mod a traced one spells exactly, resolved, or None: ``score +
    slopes[h] * (kv_idx - q_idx)`` of a float (num_heads,) table (cuflash.scores.alibi, operands of
    + and * in either order), and ``cap * tanh(score / cap)`` without the softcap option (which
    it becomes: no score_mod). They run on the built-in kernels (the backward of ALiBi needs no
    per-element derivative), with nothing to compile."""
    code = traced.code

    def op(register: int) -> int:
        return _opcode(code, register)

    def operands(register: int, expected: int) -> Optional[List[int]]:
        return code[4 * register + 1: 4 * register + 3] if op(register) == expected else None

    def ordered(pair: Optional[List[int]], first_op: int) -> Optional[List[int]]:
        if pair is None:
            return None
        return pair if op(pair[0]) == first_op else pair[::-1] if op(pair[1]) == first_op else None

    def constant(register: int) -> Optional[float]:
        return traced.constants[code[4 * register + 1]] if op(register) == _mods.FLOAT else None

    cap = ordered(operands(traced.result, _mods.MUL), _mods.FLOAT)
    tanh = cap and operands(cap[1], _mods.TANH)
    quotient = tanh and operands(tanh[0], _mods.DIV)
    if quotient and op(quotient[0]) == _mods.SCORE and call.softcap == 0.0:
        value = constant(cap[0])
        # A cap float32 holds exactly (the option is a float32): the same scores bit for bit.
        if (value is not None and constant(quotient[1]) == value
                and 0 < value <= float(np.finfo(np.float32).max) and float(np.float32(value)) == value
                and (not on_gpu or _builtin_kernels_built(call, ("softcap", "flex")))):
            call.softcap = value
            return 0, [], []
    add = ordered(operands(traced.result, _mods.ADD), _mods.SCORE)
    product = add and ordered(operands(add[1], _mods.MUL), _mods.LOAD)
    if not product:
        return None
    slot, (head, *_) = _mods.load_slot(code[4 * product[0]]), code[4 * product[0] + 1: 4 * product[0] + 4]
    distance = operands(product[1], _mods.TO_FLOAT)
    difference = distance and operands(distance[0], _mods.SUB)
    if not (difference and op(difference[0]) == _mods.KV_IDX and op(difference[1]) == _mods.Q_IDX
            and op(head) == _mods.HEAD and traced.aux_ranks[slot] == 1 and traced.aux_kinds[slot] == "float"):
        return None
    if on_gpu and not _builtin_kernels_built(call, ("flex",)):
        return None
    try:
        resolved, _ = _resolve_variant(scores.alibi(aux[slot]), argument, ScoreMod, None, call)
    except ValueError:  # a table that is not one slope per head: the callable as it is
        return None
    return resolved


def _builtin_mask(traced: Any, aux: List[Tensor], argument: str, call: _Call,
                  on_gpu: bool) -> Optional[Tuple[int, List[float], List[Tensor]]]:
    """The built-in mask a traced mask_mod spells exactly, resolved, or None: ``kv_idx <= q_idx``
    (cuflash.masks.causal), that and ``q_idx - kv_idx <= W`` (or ``< W + 1``; either order of &;
    cuflash.masks.sliding_window(W)), and ``ids[b, q_idx] == ids[b, kv_idx]`` of an integer
    (batch, L) table with L covering the sequences (cuflash.masks.document). Those run on the
    built-in kernels (the plain ones for causal and windows at equal lengths; document block
    lists made on the GPU), with nothing to compile."""
    code = traced.code

    def op(register: int) -> int:
        return _opcode(code, register)

    def args(register: int) -> List[int]:
        return code[4 * register + 1: 4 * register + 4]

    def is_causal(register: int) -> bool:
        first, second, _ = args(register)
        return (op(register), op(first), op(second)) in ((_mods.LE, _mods.KV_IDX, _mods.Q_IDX),
                                                         (_mods.GE, _mods.Q_IDX, _mods.KV_IDX))

    def window(register: int) -> Optional[int]:
        """W of ``q_idx - kv_idx <= W`` / ``< W + 1`` (or with the sides swapped), else None."""
        if op(register) not in (_mods.LE, _mods.LT, _mods.GE, _mods.GT):
            return None
        first, second, _ = args(register)
        if op(register) in (_mods.GE, _mods.GT):  # W >= q - kv is q - kv <= W
            first, second = second, first
        distance = args(first)
        if not (op(first) == _mods.SUB and op(distance[0]) == _mods.Q_IDX and op(distance[1]) == _mods.KV_IDX
                and op(second) == _mods.INT):
            return None
        bound = code[4 * second + 1] - (1 if op(register) in (_mods.LT, _mods.GT) else 0)
        return bound if bound >= 0 else None

    result = traced.result
    if op(result) not in (_mods.LE, _mods.GE, _mods.EQ, _mods.AND):  # the operands below are registers
        return None
    first, second, _ = args(result)
    if op(result) in (_mods.LE, _mods.GE) and is_causal(result):
        builtin = masks.causal()
    elif op(result) == _mods.AND:
        parts = [(first, second), (second, first)]
        bounds = [window(w) for c, w in parts if op(c) in (_mods.LE, _mods.GE) and is_causal(c)]
        if not bounds or bounds[0] is None:
            return None
        builtin = masks.sliding_window(bounds[0])
    elif op(result) == _mods.EQ and op(first) == op(second) == _mods.LOAD and code[4 * first] == code[4 * second]:
        slot = _mods.load_slot(code[4 * first])
        (b0, i0, _), (b1, i1, _) = args(first), args(second)
        if not (traced.aux_ranks[slot] == 2 and traced.aux_kinds[slot] != "float"
                and op(b0) == op(b1) == _mods.BATCH and {op(i0), op(i1)} == {_mods.Q_IDX, _mods.KV_IDX}):
            return None
        builtin = masks.document(aux[slot])
    else:
        return None
    if on_gpu and not _builtin_kernels_built(call, ("flex",)):
        return None
    try:
        resolved, _ = _resolve_variant(builtin, argument, MaskMod, None, call)
    except ValueError:  # a table that does not cover the sequences: the callable as it is
        return None
    return resolved


def _set_traced(call: _Call, role: str, traced: Any) -> None:
    if role == "score":
        call.score_traced = traced
    else:
        call.mask_traced = traced


@dataclass(frozen=True)
class _CheckedExpression:
    """A callable as the torch custom ops carry it, traced and checked before: its program,
    constants and tensors (converted), and the key of its structure ("" off the GPU)."""
    role: str
    program: List[int]
    scalars: List[float]
    aux: List[Tensor]
    structure: str


def _resolve_checked_expression(mod: _CheckedExpression, argument: str, call: _Call
                                ) -> Tuple[int, List[float], List[Tensor]]:
    if mod.role == "score":
        call.score_program = list(mod.program)
    else:
        call.mask_program = list(mod.program)
    if mod.structure:
        traced = _mods.structure_of(mod.structure)
        if traced is None:
            _fail(RuntimeError, argument, f"no callable of structure {mod.structure} was traced in this process")
        _set_traced(call, mod.role, traced)
    return _EXPRESSION_KIND, list(mod.scalars), list(mod.aux)


_INT32_RANGE = (-(2 ** 31), 2 ** 31 - 1)


def _to_int32(framework: Framework, x: Tensor, name: str) -> Tensor:
    """An integer or boolean tensor a mod reads, as int32. Values int32 cannot hold would wrap
    (two document ids could become one): refused, by reading them (a device synchronisation for
    GPU tensors; int32 tensors skip it). Traced JAX values cannot be read, and are converted."""
    own = framework.dtype(x)
    if own == "int32":
        return x
    if own in ("int64", "uint32", "uint64") and framework.device(x) != TRACED:
        values = framework.to_numpy(x)
        if values.size and (int(values.min()) < _INT32_RANGE[0] or int(values.max()) > _INT32_RANGE[1]):
            _fail(ValueError, name, f"holds values outside int32 ({int(values.min())} .. {int(values.max())}); "
                                    f"the kernels read it as int32")
    return framework.contiguous(framework.astype(x, "int32"))


def _aux_dtype(framework: Framework, x: Tensor, name: str, dtype: str) -> Tensor:
    own = framework.dtype(x)
    if own == dtype:
        return x
    if dtype == "int32" and own in ("int64", "uint32", "uint64", "int16", "int8", "uint8"):
        return _to_int32(framework, x, name)
    if dtype == "float32" and own in ("float64", "float16", "bfloat16"):
        return framework.contiguous(framework.astype(x, dtype))
    _fail(TypeError, name, f"expected dtype {dtype}, got {own}")


def _block_list_on_device(tensor: Any, framework: Framework, call: _Call) -> Any:
    """A NumPy block list (what cuflash.create_block_mask returns) as an array of q's framework on
    q's device, as create_block_mask's docstring promises; any other array as given, for the
    caller's checks (a list of another framework or device is refused by name there). A JAX q
    spread over several devices keeps its lists as given: one device's copy would not match its
    sharding, so the caller refuses the NumPy list by name, asking for a JAX array."""
    own = framework_of(tensor)
    if own is None or own.name != "numpy" or own is framework:
        return tensor
    if framework.name == "jax" and not framework._is_tracer(call.q) and len(call.q.devices()) > 1:
        return tensor
    return framework.from_numpy(np.ascontiguousarray(tensor), like=call.q)


def _check_block_sparse(call: _Call, lists: Sequence[Optional[Tensor]], names: Sequence[str],
                        transposed: bool) -> List[Optional[Tensor]]:
    """(mask_cnt, mask_idx, full_cnt, full_idx) forward or q_ lists: int32, paired, shaped as
    FlexAttention's BlockMask for block size BLOCK_M x BLOCK_N."""
    framework = call.framework
    # Lists are per sequence: with cu_seqlens they count blocks over the longest sequence (the
    # max_seqlen hints; on the CPU read from cu_seqlens when not given), with a page table over
    # the keys it addresses (max_pages * page_size).
    def longest(length, cu_seqlens, hint, side, block, blocks):
        if cu_seqlens is None or hint is not None:
            return length if cu_seqlens is None else hint
        host = _host_longest(call, cu_seqlens)
        if host is not None:
            return host
        _fail(ValueError, f"max_seqlen_{side}", f"block sparsity with cu_seqlens_{side} on the GPU (or traced) needs "
                                                f"max_seqlen_{side}: the lists count ceil(max_seqlen_{side} / {block}) "
                                                f"{blocks} blocks per sequence, and reading cu_seqlens_{side} would "
                                                f"wait for the device")

    seqlen_q = longest(call.seqlen_q, call.cu_seqlens_q, call.max_seqlen_q, "q", BLOCK_M, "row")
    seqlen_k = longest(_addressed_keys(call), call.cu_seqlens_k, call.max_seqlen_k, "k", BLOCK_N, "column")
    rows = -(-seqlen_q // BLOCK_M)
    cols = -(-seqlen_k // BLOCK_N)
    if transposed:
        rows, cols = cols, rows
    checked: List[Optional[Tensor]] = []
    heads_b = None
    for pair in ((0, 1), (2, 3)):
        cnt, idx = lists[pair[0]], lists[pair[1]]
        cnt_name, idx_name = names[pair[0]], names[pair[1]]
        if (cnt is None) != (idx is None):
            missing = cnt_name if cnt is None else idx_name
            given = idx_name if cnt is None else cnt_name
            _fail(ValueError, missing, f"must be given together with {given}")
        if cnt is None:
            checked += [None, None]
            continue
        cnt = _block_list_on_device(cnt, framework, call)
        idx = _block_list_on_device(idx, framework, call)
        for tensor, name in ((cnt, cnt_name), (idx, idx_name)):
            _check_tensor(tensor, name, framework)
            _check_dtype(framework, tensor, name, ("int32",))
            _check_device(framework, tensor, name, call.device)
        h = int(cnt.shape[1]) if len(cnt.shape) == 3 else -1
        if h not in (1, call.num_heads):
            _fail(ValueError, cnt_name, f"expected shape (batch={call.batch} or 1, 1 or num_heads={call.num_heads}, "
                                        f"{rows}), got {_shape(cnt)}")
        # Lists of one batch entry (FlexAttention's BlockMask with B=1, create_block_mask with
        # B=None) hold for every sequence: repeated over the batch (the kernels read one per
        # sequence; the lists are small).
        if call.batch != 1 and int(cnt.shape[0]) == 1 and len(idx.shape) == 4 and int(idx.shape[0]) == 1:
            cnt, idx = framework.broadcast_first(cnt, call.batch), framework.broadcast_first(idx, call.batch)
        if heads_b is not None and h != heads_b:
            _fail(ValueError, cnt_name, f"head dimension {h} differs from the other list's {heads_b}")
        heads_b = h
        block = f"for {BLOCK_M}x{BLOCK_N} blocks"
        _check_shape(cnt, cnt_name, (call.batch, h, rows), block)
        _check_shape(idx, idx_name, (call.batch, h, rows, cols), block)
        checked += [framework.contiguous(cnt), framework.contiguous(idx)]
    return checked


def _prepare(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
             max_seqlen_q=None, max_seqlen_k=None, page_table=None, softmax_scale=None, causal=False,
             window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
             deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
             block_sparse=(None, None, None, None), q_block_sparse=(None, None, None, None)) -> _Call:
    """Checks every argument (the seed interface's checks, as ValueError / TypeError naming the
    argument) and returns the call's description."""
    framework = _check_tensor(q, "q")
    _check_tensor(k, "k", framework)
    _check_tensor(v, "v", framework)
    q, k, v = (_maybe_contiguous(framework, t) for t in (q, k, v))

    if cu_seqlens_q is None:
        if len(q.shape) != 4:
            _fail(ValueError, "q", f"expected 4 dimensions (batch, seqlen, num_heads, head_dim), got shape {_shape(q)}")
        batch, seqlen_q = int(q.shape[0]), int(q.shape[1])
        total_q = batch * seqlen_q
    else:
        _check_tensor(cu_seqlens_q, "cu_seqlens_q", framework)
        if len(cu_seqlens_q.shape) != 1 or cu_seqlens_q.shape[0] < 1:
            _fail(ValueError, "cu_seqlens_q", f"expected shape (batch_size + 1,), got {_shape(cu_seqlens_q)}")
        if len(q.shape) != 3:
            _fail(ValueError, "q", f"expected 3 dimensions (total_q, num_heads, head_dim) with cu_seqlens_q, "
                                   f"got shape {_shape(q)}")
        batch = int(cu_seqlens_q.shape[0]) - 1
        seqlen_q = None
        total_q = int(q.shape[0])
    num_heads, head_dim = int(q.shape[-2]), int(q.shape[-1])

    if page_table is not None:
        if cu_seqlens_k is not None:
            _fail(ValueError, "page_table", "is not supported with cu_seqlens_k")
        _check_tensor(page_table, "page_table", framework)
        _check_dtype(framework, page_table, "page_table", ("int32",))
        if len(page_table.shape) != 2 or int(page_table.shape[0]) != batch:
            _fail(ValueError, "page_table", f"expected shape (batch_size={batch}, max_num_pages_per_seq), "
                                            f"got {_shape(page_table)}")
        if framework.strides(page_table)[-1] != 1 and page_table.shape[-1] > 1 and _numel(_shape(page_table)) > 0:
            _fail(ValueError, "page_table", f"expected the last dimension to be contiguous (stride 1), "
                                            f"got strides {framework.strides(page_table)}")
        if len(k.shape) != 4:
            _fail(ValueError, "k", f"expected 4 dimensions (num_pages, page_size, num_heads_kv, head_dim) "
                                   f"with page_table, got shape {_shape(k)}")
        num_pages, page_size = int(k.shape[0]), int(k.shape[1])
        seqlen_k = num_pages * page_size
    else:
        expected_ndim = 3 if cu_seqlens_k is not None else 4
        if len(k.shape) != expected_ndim:
            layout = ("(total_k, num_heads_kv, head_dim) with cu_seqlens_k" if cu_seqlens_k is not None
                      else "(batch, seqlen_k, num_heads_kv, head_dim)")
            _fail(ValueError, "k", f"expected {expected_ndim} dimensions {layout}, got shape {_shape(k)}")
        seqlen_k = int(k.shape[-3])
    num_heads_kv = int(k.shape[-2])
    head_dim_v = int(v.shape[-1]) if len(v.shape) else 0

    if cu_seqlens_k is None:
        if page_table is None:
            _check_shape(k, "k", (batch, seqlen_k, num_heads_kv, head_dim), "(batch, seqlen_k, num_heads_kv, head_dim)")
            _check_shape(v, "v", (batch, seqlen_k, num_heads_kv, head_dim_v),
                         "(batch, seqlen_k, num_heads_kv, head_dim_v)")
        else:
            _check_shape(k, "k", (num_pages, page_size, num_heads_kv, head_dim),
                         "(num_pages, page_size, num_heads_kv, head_dim)")
            _check_shape(v, "v", (num_pages, page_size, num_heads_kv, head_dim_v),
                         "(num_pages, page_size, num_heads_kv, head_dim_v)")
    else:
        _check_shape(k, "k", (seqlen_k, num_heads_kv, head_dim), "(total_k, num_heads_kv, head_dim)")
        _check_shape(v, "v", (seqlen_k, num_heads_kv, head_dim_v), "(total_k, num_heads_kv, head_dim_v)")

    dtype = _check_dtype(framework, q, "q", _INPUT_DTYPES)
    for tensor, name in ((k, "k"), (v, "v")):
        if framework.dtype(tensor) != dtype:
            _fail(TypeError, name, f"expected the dtype of q ({dtype}), got {framework.dtype(tensor)}")
    device = framework.device(q)
    if device[0] not in ("cpu", "cuda") and device != TRACED:
        _fail(ValueError, "q", f"expected a CPU or CUDA tensor, got {_device_str(device)}")
    _check_device(framework, k, "k", device)
    _check_device(framework, v, "v", device)

    cu_seqlens_q = _index_tensor(framework, cu_seqlens_q, "cu_seqlens_q", (batch + 1,), device, "(batch_size + 1,)")
    cu_seqlens_k = _index_tensor(framework, cu_seqlens_k, "cu_seqlens_k", (batch + 1,), device, "(batch_size + 1,)")
    seqused_q = _index_tensor(framework, seqused_q, "seqused_q", (batch,), device, "(batch_size,)")
    seqused_k = _index_tensor(framework, seqused_k, "seqused_k", (batch,), device, "(batch_size,)")
    if page_table is not None:
        _check_device(framework, page_table, "page_table", device)
    max_seqlen_q = _check_int(max_seqlen_q, "max_seqlen_q", optional=True, minimum=0, maximum=_INT32_MAX)
    max_seqlen_k = _check_int(max_seqlen_k, "max_seqlen_k", optional=True, minimum=0, maximum=_INT32_MAX)

    if learnable_sink is not None:
        _check_tensor(learnable_sink, "learnable_sink", framework)
        _check_shape(learnable_sink, "learnable_sink", (num_heads,), "(num_heads,)")
        _check_dtype(framework, learnable_sink, "learnable_sink", _SINK_DTYPES)
        _check_device(framework, learnable_sink, "learnable_sink", device)
        if num_heads > 1 and framework.strides(learnable_sink)[0] != 1:
            learnable_sink = framework.contiguous(learnable_sink)  # the kernels read it contiguous

    if num_heads_kv == 0 or num_heads % num_heads_kv != 0:
        _fail(ValueError, "k", f"num_heads ({num_heads}) must be divisible by num_heads_kv ({num_heads_kv})")
    for dim, name, argument in ((head_dim, "head_dim", "q"), (head_dim_v, "head_dim_v", "v")):
        if dim > _MAX_HEAD_DIM:
            _fail(ValueError, argument, f"{name} must be less than or equal to {_MAX_HEAD_DIM}, got {dim}")
        if dim % _HEAD_DIM_MULTIPLE != 0 or dim == 0:
            _fail(ValueError, argument, f"{name} must be a positive multiple of {_HEAD_DIM_MULTIPLE}, got {dim}")

    softmax_scale = _check_float(softmax_scale, "softmax_scale", optional=True)
    causal = _check_bool(causal, "causal")
    window_left, window_right = _check_window(window_size)
    if causal:
        window_right = 0  # as in the seed: causal overrides the window's right side
    softcap = _check_float(softcap, "softcap", optional=True) or 0.0
    if softcap < 0:
        _fail(ValueError, "softcap", f"expected a value >= 0 (0 disables it), got {softcap}")
    if 0 < softcap < _FLOAT32_TINY:
        # The kernels take it as float32 and flush subnormals: it would read as 0 (softcap off,
        # not what was asked) or divide by 0.
        _fail(ValueError, "softcap", f"{softcap} is below float32's smallest normal value "
                                     f"({_FLOAT32_TINY:.3g}), which the kernels read as 0; "
                                     f"pass 0 to disable it")
    num_splits = _check_int(num_splits, "num_splits")
    if num_splits > _MAX_SPLITS:
        _fail(ValueError, "num_splits", f"expected at most {_MAX_SPLITS}, got {num_splits}")
    num_splits = max(num_splits, 0)  # every value <= 0 picks the heuristic
    pack_gqa = _check_bool(pack_gqa, "pack_gqa", optional=True)
    deterministic = _check_bool(deterministic, "deterministic")
    if aux_tensors is not None:
        if not isinstance(aux_tensors, (list, tuple)):
            _fail(TypeError, "aux_tensors", f"expected a list of tensors or None, got {type(aux_tensors).__name__}")
        if score_mod is None and mask_mod is None:
            _fail(ValueError, "aux_tensors", "given without a score_mod that reads them")

    call = _Call(
        framework=framework, q=q, k=k, v=v, device=device, dtype=dtype, batch=batch, seqlen_q=seqlen_q,
        seqlen_k=seqlen_k, total_q=total_q, num_heads=num_heads, num_heads_kv=num_heads_kv, head_dim=head_dim,
        head_dim_v=head_dim_v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
        seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, page_table=page_table,
        learnable_sink=learnable_sink, softmax_scale=softmax_scale, causal=causal, window_left=window_left,
        window_right=window_right, softcap=softcap, num_splits=num_splits, pack_gqa=pack_gqa,
        deterministic=deterministic)

    call.score_mod, score_used_aux = _resolve_variant(score_mod, "score_mod", ScoreMod, aux_tensors, call,
                                                      score_mod_bwd)
    # A built-in mask_mod takes aux_tensors only when the score_mod did not; callables share them.
    mask_is_builtin = isinstance(mask_mod, BuiltinVariant)
    call.mask_mod, mask_used_aux = _resolve_variant(
        mask_mod, "mask_mod", MaskMod, None if score_used_aux and mask_is_builtin else aux_tensors, call)
    if aux_tensors is not None and not (score_used_aux or mask_used_aux):
        _fail(ValueError, "aux_tensors", "no score_mod / mask_mod reads them: the built-ins were given their "
                                         "tensors, and callables take them as extra trailing parameters")
    if _uses_jax_ffi(framework):
        # The custom calls name the compiled module (the handlers open it); other frameworks
        # compile when the call first runs (_expression_kernels).
        _compile_expressions(call, lambda *args, **form: str(_jit.expression_module(*args, **form)),
                             lambda path: setattr(call, "expression_module", path))

    if any(t is not None for t in block_sparse) or any(t is not None for t in q_block_sparse):
        forward_lists = _check_block_sparse(
            call, block_sparse, ("mask_block_cnt", "mask_block_idx", "full_block_cnt", "full_block_idx"),
            transposed=False)
        q_lists = [None] * 4
        if any(t is not None for t in q_block_sparse):
            q_lists = _check_block_sparse(
                call, q_block_sparse, ("q_mask_block_cnt", "q_mask_block_idx", "q_full_block_cnt",
                                       "q_full_block_idx"), transposed=True)
        call.block_sparse = forward_lists + q_lists
    return call


# ---------------------------------------------------------------------------------------------
# Running the extension


# Packed rows past the last sequence (cu_seqlens[-1] < total, a padded batch) belong to no
# sequence and the kernels do not write them: outputs that hold such rows are allocated zeroed
# (out, lse and dq with cu_seqlens_q, dk and dv with cu_seqlens_k), so that those rows read 0
# rather than whatever the memory held (NaN in a gradient reaches the weights through autograd).
# Finding them would need cu_seqlens on the host; the fill costs less than that synchronisation.
def _output_alloc(framework, packed: bool):
    return framework.zeros if packed else framework.empty


def _compile_expressions(call: _Call, compile_fn, store) -> None:
    """Compiles the kernels of a call's traced callables (none: nothing to do) by `compile_fn`
    and hands the result to `store`; a compile failure is a RuntimeError naming the callable."""
    if call.score_traced is None and call.mask_traced is None:
        return
    # Callables split (num_splits > 1) and pack GQA groups (pack_gqa=True) only when asked: the
    # heuristics leave them at one split, unpacked, so the kernel's form is known here.
    form = dict(split=call.num_splits > 1, paged=call.page_table is not None,
                pack_gqa=call.pack_gqa is True and call.num_heads != call.num_heads_kv)
    try:
        store(compile_fn(call.score_traced, call.mask_traced, call.dtype, call.head_dim, call.head_dim_v, **form))
    except _jit.JitError as error:
        _fail(RuntimeError, "score_mod" if call.score_traced is not None else "mask_mod", str(error))


def _expression_kernels(call: _Call) -> Tuple[int, int]:
    """The (forward, backward) launchers compiled for the call's callables on the GPU ((0, 0):
    the library's own kernels). Compiled (or found in the cache) when a call first runs, which
    for torch is inside the custom ops, where torch.compile does not trace."""
    if call.expression_kernels == (0, 0):
        _compile_expressions(call, lambda *args, **form: _jit.expression_kernels(*args, _C.kernel_params_abi(), **form),
                             lambda kernels: setattr(call, "expression_kernels", tuple(kernels)))
    return call.expression_kernels


def _run_forward(call: _Call, out: Optional[Tensor] = None, lse: Optional[Tensor] = None,
                 return_lse: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """out / lse: the caller's buffers (checked by _check_output), else allocated here; without
    return_lse and a caller's lse, no lse is written (None)."""
    framework = call.framework
    given = [out, lse]
    alloc = _output_alloc(framework, call.cu_seqlens_q is not None)
    if out is None:
        out = alloc(call.out_shape, call.dtype, like=call.q)
    if lse is None and return_lse:
        lse = alloc(call.lse_shape, "float32", like=call.q)
    stream = call.stream()
    _C.forward(call.export(call.q), call.export(call.k), call.export(call.v), call.export(out),
               lse=call.export(lse), learnable_sink=call.export(call.learnable_sink),
               page_table=call.export(call.page_table), num_splits=call.num_splits, pack_gqa=call.pack_gqa,
               stream=stream, expression_kernel=_expression_kernels(call)[0],
               workspace_allocator=framework.workspace_allocator(call.q), **call.common_kwargs())
    out, lse = framework.finish([out, lse], stream, like=call.q)
    framework.mark_written(given)
    return out, lse


def _run_backward(call: _Call, out: Tensor, dout: Tensor, lse: Tensor, dlse: Optional[Tensor] = None,
                  grads: Sequence[Optional[Tensor]] = (None, None, None)
                  ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """dlse: the gradient reaching lse (lse's shape, float32, last dim contiguous), or None.
    grads: the caller's dq, dk, dv buffers (checked by _check_output), each None to allocate."""
    framework = call.framework
    dq, dk, dv = grads
    if dq is None:
        dq = _output_alloc(framework, call.cu_seqlens_q is not None)(_shape(call.q), call.dtype, like=call.q)
    # Paged k / v: every page row is written (pages no sequence reads get zeros).
    alloc_kv = _output_alloc(framework, call.cu_seqlens_k is not None and call.page_table is None)
    if dk is None:
        dk = alloc_kv(_shape(call.k), call.dtype, like=call.q)
    if dv is None:
        dv = alloc_kv(_shape(call.v), call.dtype, like=call.q)
    d_sink = None
    if call.learnable_sink is not None:
        d_sink = framework.zeros((call.num_heads,), "float32", like=call.q)
    stream = call.stream()
    _C.backward(call.export(call.q), call.export(call.k), call.export(call.v), call.export(out),
                call.export(dout), call.export(lse), call.export(dq), call.export(dk), call.export(dv),
                learnable_sink=call.export(call.learnable_sink), d_sink=call.export(d_sink), dlse=call.export(dlse),
                page_table=call.export(call.page_table), deterministic=call.deterministic, stream=stream,
                expression_kernel=_expression_kernels(call)[1],
                workspace_allocator=framework.workspace_allocator(call.q), **call.common_kwargs())
    dq, dk, dv, d_sink = framework.finish([dq, dk, dv, d_sink], stream, like=call.q)
    framework.mark_written(grads)
    return dq, dk, dv, d_sink


def _check_output(call: _Call, x: Optional[Tensor], argument: str, shape: Tuple[int, ...], dtype: str
                  ) -> Optional[Tensor]:
    """A caller's preallocated output: the call's framework and device, `shape` and `dtype`. Its
    strides are free as long as the last dimension is contiguous and no two elements share
    memory (the C++ API checks both). JAX arrays are immutable: refused."""
    if x is None:
        return None
    framework = call.framework
    _check_tensor(x, argument, framework)
    if framework.name == "jax":
        _fail(TypeError, argument, "JAX arrays are immutable and cannot be written in place; leave it None "
                                   "(the result is returned)")
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        _fail(ValueError, argument, "is read-only; expected a writable array")
    _check_device(framework, x, argument, call.device)
    _check_shape(x, argument, shape)
    if framework.dtype(x) != dtype:
        _fail(TypeError, argument, f"expected dtype {dtype}, got {framework.dtype(x)}")
    _refuse_grad_output(framework, x, argument)
    return x


def _refuse_grad_output(framework: Any, x: Tensor, argument: str) -> None:
    """A buffer written in place must not require grad (with grad mode on): autograd cannot
    follow the write, as torch's own out= arguments refuse."""
    if framework.requires_grad(x):
        _fail(RuntimeError, argument, "requires grad: cuflash writes it in place, which autograd cannot follow "
                                      "(as torch's out= arguments); pass a tensor that does not require grad, "
                                      "or leave it None and use the result")


def _check_outputs_apart(call: _Call, outputs: Sequence[Tuple[Optional[Tensor], str]],
                         inputs: Sequence[Tuple[Optional[Tensor], str]]) -> None:
    """Preallocated outputs must not share memory with the inputs or with each other (the kernels
    read the inputs while they write, and write the outputs at once). What is checked is the
    common slip, an output that starts where an input or another output does (out=q, dq=dk);
    interleaved views of one buffer, such as the gradients of a packed qkv tensor, start apart
    and are fine."""
    if all(tensor is None for tensor, _ in outputs):
        return
    framework = call.framework

    def start(tensor: Optional[Tensor]) -> Optional[int]:
        return None if tensor is None or _numel(_shape(tensor)) == 0 else framework.address(tensor)

    taken = {}  # start address -> the first argument there; inputs may share (q = k = v)
    for tensor, name in inputs:
        taken.setdefault(start(tensor), name)
    for tensor, name in outputs:
        address = start(tensor)
        if address is None:
            continue
        if address in taken:
            _fail(ValueError, name, f"shares its memory with {taken[address]} (it starts at the same address); "
                                    f"outputs must not overlap the inputs or each other")
        taken[address] = name


def _check_backward_inputs(call: _Call, out: Tensor, dout: Tensor, lse: Tensor, dlse: Optional[Tensor] = None
                           ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    framework = call.framework
    named = [(out, "out"), (dout, "dout"), (lse, "lse")] + ([(dlse, "dlse")] if dlse is not None else [])
    for tensor, name in named:
        _check_tensor(tensor, name, framework)
        _check_device(framework, tensor, name, call.device)
    _check_shape(out, "out", call.out_shape)
    _check_shape(dout, "dout", call.out_shape)
    _check_shape(lse, "lse", call.lse_shape)
    for tensor, name in ((out, "out"), (dout, "dout")):
        if framework.dtype(tensor) != call.dtype:
            _fail(TypeError, name, f"expected the dtype of q ({call.dtype}), got {framework.dtype(tensor)}")
    _check_dtype(framework, lse, "lse", ("float32",))
    if dlse is not None:
        _check_shape(dlse, "dlse", call.lse_shape)
        _check_dtype(framework, dlse, "dlse", ("float32",))
        dlse = _maybe_contiguous(framework, dlse)
    out, dout, lse = (_maybe_contiguous(framework, t) for t in (out, dout, lse))
    return out, dout, lse, dlse


# ---------------------------------------------------------------------------------------------
# torch autograd


_autograd_function = None

NO_DOUBLE_BACKWARD = ("cuflash's attention backward is not differentiable (no double backward): the gradients "
                      "of q, k, v and learnable_sink cannot be differentiated again (torch's create_graph=True, "
                      "JAX's grad of grad, gradient penalties, Hessian-vector products)")


def _not_differentiable_again(torch: Any, grads: Sequence[Optional[Tensor]]) -> Tuple[Optional[Tensor], ...]:
    """Under create_graph=True, the gradients wrapped so that differentiating them fails by name
    (torch's DelayedError, as once_differentiable does) instead of silently dropping the
    second-order terms; as they are otherwise."""
    present = [g for g in grads if g is not None]
    if not torch.is_grad_enabled() or not present:
        return tuple(grads)
    wrapped = torch._C._functions.DelayedError(NO_DOUBLE_BACKWARD.encode(), len(present))(
        *[g.detach().requires_grad_() for g in present])
    wrapped = iter(wrapped if isinstance(wrapped, tuple) else (wrapped,))
    return tuple(None if g is None else next(wrapped) for g in grads)


def _side_tensors(call: _Call) -> List[Tensor]:
    """The tensors of a call besides q, k, v and learnable_sink that its backward reads again."""
    tensors = [call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_q, call.seqused_k, call.page_table]
    tensors += list(call.score_mod[2]) + list(call.mask_mod[2]) + list(call.block_sparse)
    return [t for t in tensors if t is not None]


def _torch_function():
    """The torch.autograd.Function, made on first use so that importing cuflash needs no torch."""
    global _autograd_function
    if _autograd_function is not None:
        return _autograd_function
    import torch

    class FlashAttnFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, learnable_sink, call):
            call = replace(call, q=q, k=k, v=v, learnable_sink=learnable_sink)
            out, lse = _run_forward(call)
            # The sequence, page, mod and block-list tensors are saved too, so that one changed in
            # place before the backward is an error (torch's version check), not wrong gradients.
            ctx.save_for_backward(q, k, v, out, lse, learnable_sink, *_side_tensors(call))
            ctx.call = call
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            # Gradients of an output the loss does not use come as zeros (materialized) or None;
            # dlse enters the preprocess only (dPsum = rowsum(dO * O) - dlse).
            q, k, v, out, lse, learnable_sink = ctx.saved_tensors[:6]
            call = replace(ctx.call, q=q, k=k, v=v, learnable_sink=learnable_sink)
            if dout is None:
                dout = call.framework.zeros(_shape(out), call.dtype, like=out)
            dout = _maybe_contiguous(call.framework, dout)
            dlse = _maybe_contiguous(call.framework, dlse)
            with torch.no_grad():
                dq, dk, dv, d_sink = _run_backward(call, out, dout, lse, dlse)
                if d_sink is not None:
                    d_sink = d_sink.to(learnable_sink.dtype)
            return _not_differentiable_again(torch, (dq, dk, dv, d_sink)) + (None,)

    _autograd_function = FlashAttnFunction
    return FlashAttnFunction


# torch tensors go through the custom ops cuflash::fwd / cuflash::bwd (python/cuflash/_torch_ops.py)
# where torch.library.custom_op exists (torch >= 2.4), so that torch.compile keeps them in its
# graph; else through the autograd.Function above.
USE_TORCH_CUSTOM_OPS = True


def _torch_custom_ops():
    torch = loaded_module("torch")
    if not USE_TORCH_CUSTOM_OPS or not hasattr(torch.library, "custom_op"):
        return None
    from . import _torch_ops

    return _torch_ops


def _refuse_mod_tensor_grads(call: _Call) -> None:
    """Under torch grad mode, a tensor that a score_mod / mask_mod reads and that requires grad is
    refused: the backward computes the gradients of q, k, v and learnable_sink only, and that
    tensor's would silently stay None (a learnable bias table that never trains)."""
    if not loaded_module("torch").is_grad_enabled():
        return
    for argument, (_, _, aux) in (("score_mod", call.score_mod), ("mask_mod", call.mask_mod)):
        for i, tensor in enumerate(aux):
            if getattr(tensor, "requires_grad", False):
                _fail(NotImplementedError, argument,
                      f"its tensor aux[{i}] requires grad, but cuflash computes the gradients of q, k, v "
                      f"and learnable_sink only; pass it detached (a constant) or call under torch.no_grad()")


def _attention(call: _Call) -> Tuple[Tensor, Tensor]:
    if call.framework.name == "torch":
        _refuse_mod_tensor_grads(call)
        ops = _torch_custom_ops()
        if ops is not None:
            return ops.attention(call)
        return _torch_function().apply(call.q, call.k, call.v, call.learnable_sink, call)
    if _uses_jax_ffi(call.framework):
        from . import _jax

        return _jax.attention(call)
    return _run_forward(call)


def _forward(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float], causal: bool,
             window_size: Tuple[Optional[int], Optional[int]], learnable_sink: Optional[Tensor], softcap: float,
             num_splits: int, pack_gqa: Optional[bool], deterministic: bool, **specific: Any) -> Tuple[Tensor, Tensor]:
    """The forward of flash_attn_func and flash_attn_varlen_func. The options both take come
    positionally, in the order both signatures (the seed's) give them, so that each is named
    once per function (test_signature.py checks the order); what only one of them takes
    (sequence layout, score_mod, mask_mod, block sparsity) comes by name."""
    call = _prepare(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                    learnable_sink=learnable_sink, softcap=softcap, num_splits=num_splits, pack_gqa=pack_gqa,
                    deterministic=deterministic, **specific)
    return _attention(call)


# ---------------------------------------------------------------------------------------------
# Public functions


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    learnable_sink: Optional[Tensor] = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    mask_mod: Optional[MaskMod] = None,
    full_block_cnt: Optional[Tensor] = None,
    full_block_idx: Optional[Tensor] = None,
    mask_block_cnt: Optional[Tensor] = None,
    mask_block_idx: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Exact attention (FlashAttention) over fixed-length batches.

    Args:
        q: (batch, seqlen_q, num_heads, head_dim), float16 or bfloat16.
        k: (batch, seqlen_k, num_heads_kv, head_dim); num_heads must be a multiple of
            num_heads_kv (MHA, GQA, MQA).
        v: (batch, seqlen_k, num_heads_kv, head_dim_v). head_dim and head_dim_v are at most
            256 and multiples of 8. The last dimension of q, k, v must be contiguous (it is
            copied otherwise); other strides are free.
        softmax_scale: scale of q k^T; default 1 / sqrt(head_dim).
        causal: causal mask, aligned bottom-right (key j visible to query i iff
            j <= i + seqlen_k - seqlen_q).
        window_size: (left, right) sliding window, bottom-right aligned; None (or -1) means
            unbounded on that side. With causal, right is 0.
        learnable_sink: (num_heads,) logit per head that joins the softmax denominator only
            (float32, bfloat16 or float16). Differentiable.
        softcap: if > 0, scores become softcap * tanh(score / softcap).
        num_splits: split-KV count (flash decoding); <= 0 picks one by heuristic.
        pack_gqa: put the query heads that share a kv head into the same row tiles (GQA/MQA);
            None: when that fills the tiles better (short seqlen_q, e.g. decode), except for
            callables (packed only when True). With block sparsity the lists must be broadcast
            over heads and their row blocks hold whole packed tiles (128 / group query rows).
        deterministic: bitwise reproducible backward.
        mask_mod: mask_mod(b, h, q_idx, kv_idx) -> bool, a Python callable (traced once into
            an expression program, see cuflash.mods; tensors it reads are closed over), or a
            built-in from cuflash.masks (document, prefix_lm, causal, sliding_window). It
            intersects with causal / window_size. Callables run on the CPU reference for CPU
            tensors and on kernels compiled at run time for CUDA tensors (see cuflash._jit).
        full_block_cnt, full_block_idx, mask_block_cnt, mask_block_idx: FlexAttention
            BlockMask lists for 128 x 128 blocks (see cuflash.block_sparse): int32
            (batch, 1 or num_heads, ceil(seqlen_q/128)) counts and
            (batch, 1 or num_heads, ceil(seqlen_q/128), ceil(seqlen_k/128)) column-block
            indices of the blocks computed without (full) or with (mask) the mask_mod; other
            blocks are skipped. The backward tabulates these on the GPU (no transposed lists needed).

    Returns:
        (out, lse): out (batch, seqlen_q, num_heads, head_dim_v) in q's dtype and lse
        (batch, num_heads, seqlen_q) float32, the log-sum-exp of each row's scores (-inf for a
        row with no visible key, whose out is 0). Arrays of q's framework and device; with
        torch, out and lse are differentiable with respect to q, k, v and learnable_sink.

    JAX: works inside jax.jit and under jax.grad / jax.vjp (out and lse differentiable with
    respect to q, k, v and learnable_sink).
    learnable_sink, the block lists and mask_mod tensors may be traced; the other options must
    be Python values.
    """
    return _forward(q, k, v, softmax_scale, causal, window_size, learnable_sink, softcap, num_splits, pack_gqa,
                    deterministic, mask_mod=mask_mod,
                    block_sparse=(mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx))


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    seqused_q: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    page_table: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    learnable_sink: Optional[Tensor] = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    score_mod: Optional[ScoreMod] = None,
    aux_tensors: Optional[List[Tensor]] = None,
) -> Tuple[Tensor, Tensor]:
    """Exact attention over packed variable-length sequences (and paged KV).

    Args:
        q: (total_q, num_heads, head_dim) with cu_seqlens_q, else (batch, seqlen_q,
            num_heads, head_dim); float16 or bfloat16.
        k, v: (total_k, num_heads_kv, head_dim / head_dim_v) with cu_seqlens_k;
            (num_pages, page_size, num_heads_kv, head_dim / head_dim_v) with page_table;
            else (batch, seqlen_k, num_heads_kv, head_dim / head_dim_v).
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 cumulative sequence starts.
        max_seqlen_q, max_seqlen_k: upper bounds of the sequence lengths (hints). With
            cu_seqlens on the GPU and no hint, the forward and the backward walk lists of the
            blocks that hold rows, built on the GPU, and the kernel choices (tiles, pack_gqa=None,
            num_splits <= 0, where dQ's accumulator starts) read the mean length; with lengths
            far apart the hints choose better (README). A hint below a sequence's length is
            trusted on the GPU (the rows past it are not computed) and refused when cu_seqlens
            are in host memory.
        seqused_q, seqused_k: (batch,) int32: use only this many tokens of each sequence.
        page_table: (batch, max_num_pages_per_seq) int32 page numbers into k / v (not with
            cu_seqlens_k).
        softmax_scale, causal, window_size, learnable_sink, softcap, num_splits, pack_gqa,
        deterministic: as in flash_attn_func.
        score_mod: score_mod(score, b, h, q_idx, kv_idx[, *aux_tensors]) -> new score, a
            Python callable (traced once into an expression program with its derivative, see
            cuflash.mods), or a built-in from cuflash.scores (alibi, relative_bias); with
            softcap, score_mod takes the soft-capped score. Callables run on the CPU reference for CPU tensors and on kernels
            compiled at run time for CUDA tensors (nvcc and the CUTLASS headers needed then;
            see cuflash._jit).
        aux_tensors: tensors a score_mod reads: extra trailing arguments of a callable, or the
            tensors of a built-in made without them (e.g. cuflash.scores.alibi() with
            aux_tensors=[slopes]).

    Returns:
        (out, lse): out (total_q, num_heads, head_dim_v) (or (batch, seqlen_q, ...) for
        fixed-length q) in q's dtype and lse (num_heads, total_q) (or (batch, num_heads,
        seqlen_q)) float32. With torch, out and lse are differentiable with respect to q, k, v
        and learnable_sink.

    JAX: as flash_attn_func (jax.jit, jax.grad); cu_seqlens_*, seqused_*, page_table and
    aux_tensors may be traced, max_seqlen_* must be Python ints. With page_table the gradients
    of k and v are those of the pages (a page several sequences list gets the sum).
    """
    return _forward(q, k, v, softmax_scale, causal, window_size, learnable_sink, softcap, num_splits, pack_gqa,
                    deterministic, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                    seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                    page_table=page_table, score_mod=score_mod, aux_tensors=aux_tensors)


def flash_attn_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    seqused_q: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    page_table: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    learnable_sink: Optional[Tensor] = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
    aux_tensors: Optional[List[Tensor]] = None,
    full_block_cnt: Optional[Tensor] = None,
    full_block_idx: Optional[Tensor] = None,
    mask_block_cnt: Optional[Tensor] = None,
    mask_block_idx: Optional[Tensor] = None,
    return_lse: bool = False,
    out: Optional[Tensor] = None,
    lse: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """The forward pass without autograd, with every option at once (the seed's internal
    forward): flash_attn_backward's counterpart, for NumPy, CuPy and JAX arrays or explicit use.
    With torch tensors the results carry no autograd graph (flash_attn_func and
    flash_attn_varlen_func record one).

    Takes q, k, v in any of flash_attn_varlen_func's layouts (fixed-length, packed with
    cu_seqlens_*, paged) with every option of flash_attn_func and flash_attn_varlen_func:
    score_mod, mask_mod and the block lists combine with packed and paged sequences here.

    Args (beyond those of flash_attn_func / flash_attn_varlen_func):
        return_lse: compute and return lse; without it (and without a caller's lse) no lse is
            written and None is returned in its place.
        out: a preallocated output, out's shape ((batch, seqlen_q, num_heads, head_dim_v), or
            (total_q, num_heads, head_dim_v) with cu_seqlens_q) in q's dtype on q's device,
            written in place and returned. Any strides with a contiguous last dimension and no
            two elements at one address (on the GPU, strides that are multiples of 16 bytes and a
            16-byte aligned start, else refused by name); it must not overlap q, k or v (one that
            starts where they do is refused). Packed rows past
            cu_seqlens_q[-1] belong to no sequence and are left as they were (an allocated out
            has them zeroed).
        lse: a preallocated lse (lse's shape, float32), written in place and returned, whatever
            return_lse says. Same rules as out.
        JAX arrays cannot be written in place: out and lse are refused with them.

    Returns:
        (out, lse): as flash_attn_varlen_func's, lse None when neither return_lse nor lse is
        given.
    """
    call = _prepare(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                    seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                    page_table=page_table, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                    learnable_sink=learnable_sink, softcap=softcap, num_splits=num_splits, pack_gqa=pack_gqa,
                    score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux_tensors,
                    block_sparse=(mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx))
    return_lse = _check_bool(return_lse, "return_lse")
    out = _check_output(call, out, "out", call.out_shape, call.dtype)
    lse = _check_output(call, lse, "lse", call.lse_shape, "float32")
    _check_outputs_apart(call, [(out, "out"), (lse, "lse")], [(call.q, "q"), (call.k, "k"), (call.v, "v")])
    if _uses_jax_ffi(call.framework):
        from . import _jax

        result, result_lse = _jax.attention(call)
        return result, result_lse if return_lse else None
    return _run_forward(call, out, lse, return_lse)


def flash_attn_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    seqused_q: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    learnable_sink: Optional[Tensor] = None,
    softcap: float = 0.0,
    deterministic: bool = False,
    score_mod: Optional[ScoreMod] = None,
    score_mod_bwd: Optional[Callable] = None,
    mask_mod: Optional[MaskMod] = None,
    aux_tensors: Optional[List[Tensor]] = None,
    full_block_cnt: Optional[Tensor] = None,
    full_block_idx: Optional[Tensor] = None,
    mask_block_cnt: Optional[Tensor] = None,
    mask_block_idx: Optional[Tensor] = None,
    q_full_block_cnt: Optional[Tensor] = None,
    q_full_block_idx: Optional[Tensor] = None,
    q_mask_block_cnt: Optional[Tensor] = None,
    q_mask_block_idx: Optional[Tensor] = None,
    page_table: Optional[Tensor] = None,
    dlse: Optional[Tensor] = None,
    dq: Optional[Tensor] = None,
    dk: Optional[Tensor] = None,
    dv: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """The backward pass without autograd (for NumPy, CuPy and JAX arrays, or explicit use;
    JAX arrays may be traced, inside jax.jit).

    Takes the forward's inputs, options, out and lse, the gradient dout of out and optionally
    dlse, the gradient of lse (lse's shape, float32; for a loss that uses lse as well). The
    block-sparse backward lists (q_* : per column block, the row blocks that see it) are
    optional: without them the backward reads the forward lists (tabulated on the GPU). With
    page_table (as the forward's, k and v the pages), dk and dv are the gradients of the pages: a
    page several sequences list gets the sum.

    score_mod_bwd: with a score_mod callable, its hand-written gradient
    ``score_mod_bwd(grad, score, b, h, q_idx, kv_idx[, *aux_tensors])``: the gradient of the
    score score_mod took, given ``grad``, that of the score it returned (None: score_mod's
    derivative is traced). It must be linear in grad, as such a gradient is (cuflash.mods);
    TypeError otherwise, and with a built-in score_mod (which has its own).

    dq, dk, dv: preallocated gradients, each of its input's shape and q's dtype on q's device,
    written in place and returned (None: allocated). Any strides with a contiguous last
    dimension and no two elements at one address (on the GPU, strides that are multiples of 16
    bytes and a 16-byte aligned start, else refused by name); they must not overlap each other or
    any input (one that starts where another does is refused). Packed rows past cu_seqlens_q[-1] (dq) or cu_seqlens_k[-1] (dk, dv) belong to no
    sequence and are left as they were (allocated gradients have them zeroed). JAX arrays
    cannot be written in place: refused with them.

    Returns:
        (dq, dk, dv, d_sink): gradients of q, k, v in their dtype, and of learnable_sink as
        (num_heads,) float32 (None without a sink).
    """
    call = _prepare(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                    seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                    page_table=page_table, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                    learnable_sink=learnable_sink, softcap=softcap, deterministic=deterministic,
                    score_mod=score_mod, score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, aux_tensors=aux_tensors,
                    block_sparse=(mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx),
                    q_block_sparse=(q_mask_block_cnt, q_mask_block_idx, q_full_block_cnt, q_full_block_idx))
    out, dout, lse, dlse = _check_backward_inputs(call, out, dout, lse, dlse)
    grads = [_check_output(call, g, name, _shape(x), call.dtype)
             for g, name, x in ((dq, "dq", call.q), (dk, "dk", call.k), (dv, "dv", call.v))]
    _check_outputs_apart(call, list(zip(grads, ("dq", "dk", "dv"))),
                         [(call.q, "q"), (call.k, "k"), (call.v, "v"), (out, "out"), (dout, "dout"), (lse, "lse"),
                          (dlse, "dlse")])
    if _uses_jax_ffi(call.framework):
        from . import _jax

        return _jax.backward(call, out, dout, lse, dlse)
    return _run_backward(call, out, dout, lse, dlse, grads)


def flash_attn_combine(
    out_partial: Tensor,
    lse_partial: Tensor,
    out: Optional[Tensor] = None,
    out_dtype: Optional[Any] = None,
    cu_seqlens: Optional[Tensor] = None,
    seqused: Optional[Tensor] = None,
    return_lse: bool = True,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Merges split attention results (e.g. from split-KV or from several devices) by their
    log-sum-exp. JAX arrays are merged in jax.numpy, so also inside jax.jit, under jax.grad and
    in shard_map.

    Args:
        out_partial: float32 (num_splits, batch, seqlen, num_heads, head_dim), or
            (num_splits, total_q, num_heads, head_dim) for packed sequences.
        lse_partial: float32 (num_splits, batch, seqlen, num_heads) or
            (num_splits, total_q, num_heads).
        out: optional preallocated output of shape out_partial.shape[1:].
        out_dtype: dtype of a newly allocated out (torch / numpy dtype or a name such as
            "bfloat16"); default out_partial's dtype (float32). With out given it must be out's
            dtype, or None.
        cu_seqlens: (batch + 1,) int32, for packed sequences.
        seqused: (batch,) int32: rows past a sequence's used length are not combined.
        return_lse: also return the combined lse.

    Returns:
        (out, lse): out with shape out_partial.shape[1:], and lse float32 with shape
        lse_partial.shape[1:] (None when return_lse is False). With torch tensors that require
        grad (partials of attention calls, as in ring attention), out and lse are differentiable
        with respect to out_partial and lse_partial (out must then be None); rows the combine
        does not merge get zero gradients. Rows past a sequence's seqused give out 0 and lse
        -inf; rows outside every packed sequence are not written: 0 in outputs allocated here,
        as they were in a given out.
    """
    framework = _check_tensor(out_partial, "out_partial")
    _check_tensor(lse_partial, "lse_partial", framework)
    if len(out_partial.shape) not in (4, 5):
        _fail(ValueError, "out_partial", f"must have 4 or 5 dimensions, got shape {_shape(out_partial)}")
    if len(lse_partial.shape) not in (3, 4):
        _fail(ValueError, "lse_partial", f"must have 3 or 4 dimensions, got shape {_shape(lse_partial)}")
    _check_dtype(framework, out_partial, "out_partial", ("float32",))
    _check_dtype(framework, lse_partial, "lse_partial", ("float32",))
    if _shape(lse_partial) != _shape(out_partial)[:-1]:
        _fail(ValueError, "lse_partial", f"expected shape {_shape(out_partial)[:-1]} (out_partial.shape[:-1]), "
                                         f"got {_shape(lse_partial)}")
    device = framework.device(out_partial)
    _check_device(framework, lse_partial, "lse_partial", device)
    if framework.name != "jax" and framework.strides(out_partial)[-1] != 1 and out_partial.shape[-1] > 1:
        _fail(ValueError, "out_partial", f"expected the last dimension to be contiguous (stride 1), "
                                         f"got strides {framework.strides(out_partial)}")
    num_splits = int(out_partial.shape[0])
    if num_splits < 1 or num_splits > _MAX_SPLITS:
        _fail(ValueError, "out_partial", f"num_splits (dimension 0) must be in [1, {_MAX_SPLITS}], got {num_splits}")
    is_varlen = len(out_partial.shape) == 4
    if cu_seqlens is not None:
        _check_tensor(cu_seqlens, "cu_seqlens", framework)
    if is_varlen:
        # Packed rows without cu_seqlens form one sequence.
        batch = int(cu_seqlens.shape[0]) - 1 if cu_seqlens is not None and len(cu_seqlens.shape) == 1 else 1
    else:
        batch = int(out_partial.shape[1])
        if cu_seqlens is not None:
            _fail(ValueError, "cu_seqlens", "needs the packed layout (num_splits, total_q, num_heads, head_dim)")
    if cu_seqlens is not None:
        if len(cu_seqlens.shape) != 1 or cu_seqlens.shape[0] < 1:
            _fail(ValueError, "cu_seqlens", f"expected shape (batch_size + 1,), got {_shape(cu_seqlens)}")
        _index_tensor(framework, cu_seqlens, "cu_seqlens", (batch + 1,), device, "(batch_size + 1,)")
    if seqused is not None:
        _check_tensor(seqused, "seqused", framework)
        _index_tensor(framework, seqused, "seqused", (batch,), device, "(batch_size,)")
    return_lse = _check_bool(return_lse, "return_lse")

    out_shape = _shape(out_partial)[1:]
    given_out = out
    if framework.name == "jax":
        if out is not None:
            _fail(TypeError, "out", "JAX arrays are immutable: leave out=None")
        from . import _jax

        # In jax.numpy: under jax.jit, jax.grad and shard_map (a ring attention's merge).
        dtype = "float32" if out_dtype is None else _dtype_arg(out_dtype)
        out, lse = _jax.combine(out_partial, lse_partial, dtype, cu_seqlens, seqused)
        return out, lse if return_lse else None
    alloc = _combine_alloc(framework, out_partial, seqused)
    differentiable = framework.requires_grad(out_partial) or framework.requires_grad(lse_partial)
    if out is None:
        dtype = "float32" if out_dtype is None else _dtype_arg(out_dtype)
        if differentiable:  # ring attention: partials of attention calls merged by their lse
            out, lse = _combine_function().apply(out_partial, lse_partial, dtype, cu_seqlens, seqused)
            return out, lse if return_lse else None
        out = alloc(out_shape, dtype, like=out_partial)
    else:
        if differentiable:
            _fail(RuntimeError, "out", "out_partial or lse_partial requires grad, and autograd cannot follow a "
                                       "write into a preallocated out; leave out None")
        _check_tensor(out, "out", framework)
        if framework.name == "jax":
            _fail(TypeError, "out", "JAX arrays are immutable: leave out=None")
        _check_shape(out, "out", out_shape, "(out_partial.shape[1:])")
        _check_dtype(framework, out, "out", ("float16", "bfloat16", "float32"))
        _check_device(framework, out, "out", device)
        _check_distinct_elements(framework, out, "out")
        _refuse_grad_output(framework, out, "out")
        if out_dtype is not None and _dtype_arg(out_dtype) != framework.dtype(out):
            _fail(TypeError, "out_dtype", f"{_dtype_arg(out_dtype)} differs from out's dtype "
                                          f"{framework.dtype(out)} (out_dtype is for an out allocated here)")
        if framework.name == "numpy" and not out.flags.writeable:
            _fail(ValueError, "out", "expected a writable array, got a read-only NumPy array (flags.writeable "
                                     "is False, e.g. a view of a read-only buffer); pass a writable one or "
                                     "leave out=None")
    lse = alloc(_shape(lse_partial)[1:], "float32", like=out_partial) if return_lse else None
    out, lse = _run_combine(framework, out_partial, lse_partial, out, lse, cu_seqlens, seqused)
    framework.mark_written([given_out])
    return out, lse


def _run_combine(framework: Any, out_partial: Tensor, lse_partial: Tensor, out: Tensor, lse: Optional[Tensor],
                 cu_seqlens: Optional[Tensor], seqused: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """The combine kernel into out / lse; (out, lse) as the caller's framework returns them
    (JAX: arrays made from the buffers written)."""
    stream = framework.stream(out_partial)
    ex = framework.export
    _C.combine(ex(out_partial), ex(lse_partial), ex(out), lse=None if lse is None else ex(lse),
               cu_seqlens=None if cu_seqlens is None else ex(cu_seqlens),
               seqused=None if seqused is None else ex(seqused), stream=stream)
    out, lse = framework.finish([out, lse], stream, like=out_partial)
    return out, lse


def _combine_alloc(framework: Any, out_partial: Tensor, seqused: Optional[Tensor]) -> Callable:
    """The allocator of the combine's outputs. Rows it does not merge (past seqused, outside every
    packed sequence) are not written: zeros where there can be such rows, as in the attention's
    packed outputs."""
    packed = len(out_partial.shape) == 4
    return framework.zeros if (packed or seqused is not None) else framework.empty


def _combined_rows(torch: Any, lse: Tensor, cu_seqlens: Optional[Tensor], seqused: Optional[Tensor]) -> Tensor:
    """Which rows the combine merges, as a bool tensor broadcasting against lse (batch, seqlen,
    heads) or packed (total, heads): the rows of each sequence below its seqused, and for packed
    rows those inside a cu_seqlens segment (all rows one sequence without cu_seqlens)."""
    device = lse.device
    if lse.dim() == 3:  # dense: (batch, seqlen, heads)
        if seqused is None:
            return torch.ones((1, 1, 1), dtype=torch.bool, device=device)
        return (torch.arange(lse.shape[1], device=device)[None, :] < seqused.to(device).long()[:, None])[..., None]
    rows = torch.arange(lse.shape[0], device=device)
    cu = (torch.tensor([0, lse.shape[0]], device=device) if cu_seqlens is None else cu_seqlens.to(device).long())
    segment = torch.clamp(torch.searchsorted(cu[1:], rows, right=True), max=cu.shape[0] - 2)
    inside = (rows >= cu[0]) & (rows < cu[-1])
    if seqused is not None:
        inside &= rows - cu[segment] < seqused.to(device).long()[segment]
    return inside[:, None]


@functools.lru_cache(maxsize=None)
def _combine_function():
    """torch.autograd.Function of flash_attn_combine, made on first use (importing cuflash needs
    no torch). The forward runs the combine kernel; the backward is elementwise torch: with
    w_s = exp(lse_s - lse), d out_s = w_s dout and d lse_s = w_s (<dout, out_s - out> + dlse), zero
    in the rows the combine does not merge."""
    import torch

    class CombineFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out_partial, lse_partial, out_dtype, cu_seqlens, seqused):
            framework = framework_of(out_partial)
            alloc = _combine_alloc(framework, out_partial, seqused)
            out = alloc(_shape(out_partial)[1:], out_dtype, like=out_partial)
            lse = alloc(_shape(lse_partial)[1:], "float32", like=out_partial)
            out, lse = _run_combine(framework, out_partial, lse_partial, out, lse, cu_seqlens, seqused)
            ctx.save_for_backward(out_partial, lse_partial, lse, *(t for t in (cu_seqlens, seqused) if t is not None))
            ctx.has_index = (cu_seqlens is not None, seqused is not None)
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            out_partial, lse_partial, lse, *index = ctx.saved_tensors
            cu_seqlens = index.pop(0) if ctx.has_index[0] else None
            seqused = index.pop(0) if ctx.has_index[1] else None
            merged = _combined_rows(torch, lse, cu_seqlens, seqused)
            finite = torch.isfinite(lse)
            weights = torch.where(finite & merged, torch.exp(lse_partial - torch.where(finite, lse, 0.0)), 0.0)
            d_lse_partial = weights * (0.0 if dlse is None else torch.where(merged, dlse, 0.0))
            d_out_partial = None
            if dout is not None:
                dout = dout.float()
                d_out_partial = weights[..., None] * dout
                out = (weights[..., None] * torch.nan_to_num(out_partial)).sum(0)
                inner = (dout * (torch.nan_to_num(out_partial) - out)).sum(-1)
                d_lse_partial = d_lse_partial + weights * inner
            grads = _not_differentiable_again(torch, (d_out_partial, d_lse_partial))
            return grads + (None, None, None)

    return CombineFunction


def _dtype_arg(dtype: Any) -> str:
    name = _dtype_name(dtype)
    if name not in ("float16", "bfloat16", "float32"):
        _fail(TypeError, "out_dtype", f"expected float16, bfloat16 or float32, got {dtype!r}")
    return name
