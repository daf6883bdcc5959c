"""JAX: cuflash as XLA custom calls (jax.ffi), so that it runs inside jax.jit and under jax.grad.

The extension's XLA FFI handlers (python/src/jax_ffi.cpp) run the CPU reference on the CPU
backend and the sm_90a kernels on the GPU backend, on the stream that XLA gives. They are
registered with JAX on first use. ``jax.custom_vjp`` gives the gradients of q, k, v and
learnable_sink, with the cotangent of lse (a loss that uses lse) taken as the backward's dlse.

Imported only when JAX arrays reach cuflash (jax is already imported then). Eager JAX arrays
take the same path as traced ones; the extension built without the handlers (no jax at
configure time) keeps the DLPack path for eager arrays and refuses traced ones.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import numpy as np

from . import _C, _jax_sharding
from .block_sparse import BLOCK_M, BLOCK_N

FORWARD_TARGET = "cuflash_forward"
BACKWARD_TARGET = "cuflash_backward"

# The optional operands after q, k, v (forward) or q, k, v, out, dout, lse (backward): bit i of
# the `operands` attribute says that OPTIONAL_OPERANDS[i] is passed (python/src/jax_ffi.cpp).
OPTIONAL_OPERANDS = ("learnable_sink", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "page_table",
                     "mask_block_cnt", "mask_block_idx", "full_block_cnt", "full_block_idx",
                     "q_mask_block_cnt", "q_mask_block_idx", "q_full_block_cnt", "q_full_block_idx", "dlse")
_FIRST_BLOCK_LIST = OPTIONAL_OPERANDS.index("mask_block_cnt")
_FIRST_BACKWARD_LIST = OPTIONAL_OPERANDS.index("q_mask_block_cnt")

_registered = False


def available() -> bool:
    """Whether this build has the XLA FFI handlers (jaxlib's headers were found when it was
    configured)."""
    return hasattr(_C, "jax_ffi_handlers")


def unavailable_message() -> str:
    return ("this cuflash build has no XLA FFI handlers for jax (jaxlib's headers were not found when it was "
            "configured): install jax, then rebuild cuflash (pip install . finds them through jax.ffi.include_dir())")


def _jax():
    return sys.modules["jax"]


def is_tracer(x: Any) -> bool:
    core = getattr(_jax(), "core", None)
    tracer = getattr(core, "Tracer", None)
    return tracer is not None and isinstance(x, tracer)


def _register() -> None:
    """Registers the handlers with XLA (once): the CPU ones, and the CUDA ones in a CUDA build."""
    global _registered
    if _registered:
        return
    if not available():
        raise NotImplementedError(f"jax: {unavailable_message()}")
    jax = _jax()
    handlers = _C.jax_ffi_handlers()
    for kind, target in (("forward", FORWARD_TARGET), ("backward", BACKWARD_TARGET)):
        jax.ffi.register_ffi_target(target, handlers[f"{kind}_cpu"], platform="cpu")
        if f"{kind}_cuda" in handlers:
            jax.ffi.register_ffi_target(target, handlers[f"{kind}_cuda"], platform="CUDA")
    _registered = True


# ---------------------------------------------------------------------------------------------
# The static part of a call (the custom calls' attributes and the result shapes)


@dataclass(frozen=True)
class _Static:
    dtype: str
    out_shape: Tuple[int, ...]
    lse_shape: Tuple[int, ...]
    num_heads: int
    seqlen_k: int
    softmax_scale: Optional[float]
    causal: bool
    window_left: int
    window_right: int
    softcap: float
    score_mod_kind: int
    score_mod_scalars: Tuple[float, ...]
    num_score_aux: int
    mask_mod_kind: int
    mask_mod_scalars: Tuple[float, ...]
    num_mask_aux: int
    max_seqlen_q: Optional[int]
    max_seqlen_k: Optional[int]
    num_splits: int
    pack_gqa: Optional[bool]
    deterministic: bool
    # Traced callables: [result, grad, code...] (empty: none), and the path of the module
    # compiled for them for the GPU ("": none), which the GPU handlers open.
    score_mod_program: Tuple[int, ...] = ()
    mask_mod_program: Tuple[int, ...] = ()
    expression_module: str = ""

    def attributes(self, operand_bits: int, forward: bool) -> dict:
        attrs = dict(
            operands=np.int64(operand_bits),
            max_seqlen_q=np.int64(-1 if self.max_seqlen_q is None else self.max_seqlen_q),
            max_seqlen_k=np.int64(-1 if self.max_seqlen_k is None else self.max_seqlen_k),
            has_softmax_scale=np.bool_(self.softmax_scale is not None),
            softmax_scale=np.float32(0.0 if self.softmax_scale is None else self.softmax_scale),
            causal=np.bool_(self.causal),
            window_left=np.int64(self.window_left),
            window_right=np.int64(self.window_right),
            softcap=np.float32(self.softcap),
            score_mod_kind=np.int64(self.score_mod_kind),
            score_mod_scalars=np.asarray(self.score_mod_scalars, dtype=np.float64).reshape(-1),
            score_mod_num_aux=np.int64(self.num_score_aux),
            mask_mod_kind=np.int64(self.mask_mod_kind),
            mask_mod_scalars=np.asarray(self.mask_mod_scalars, dtype=np.float64).reshape(-1),
            mask_mod_num_aux=np.int64(self.num_mask_aux),
            score_mod_program=np.asarray(self.score_mod_program, dtype=np.int32).reshape(-1),
            mask_mod_program=np.asarray(self.mask_mod_program, dtype=np.int32).reshape(-1),
            expression_module=self.expression_module,
            block_m=np.int64(BLOCK_M),
            block_n=np.int64(BLOCK_N),
        )
        if forward:
            attrs.update(num_splits=np.int64(self.num_splits),
                         pack_gqa=np.int64(-1 if self.pack_gqa is None else int(self.pack_gqa)))
        else:
            attrs.update(deterministic=np.bool_(self.deterministic))
        return attrs


def _static(call) -> _Static:
    score_kind, score_scalars, score_aux = call.score_mod
    mask_kind, mask_scalars, mask_aux = call.mask_mod
    return _Static(
        dtype=call.dtype, out_shape=tuple(call.out_shape), lse_shape=tuple(call.lse_shape), num_heads=call.num_heads,
        seqlen_k=call.seqlen_k, softmax_scale=call.softmax_scale, causal=call.causal, window_left=call.window_left,
        window_right=call.window_right, softcap=float(call.softcap), score_mod_kind=int(score_kind),
        score_mod_scalars=tuple(float(s) for s in score_scalars), num_score_aux=len(score_aux),
        mask_mod_kind=int(mask_kind), mask_mod_scalars=tuple(float(s) for s in mask_scalars),
        num_mask_aux=len(mask_aux), max_seqlen_q=call.max_seqlen_q, max_seqlen_k=call.max_seqlen_k,
        num_splits=call.num_splits, pack_gqa=call.pack_gqa, deterministic=call.deterministic,
        score_mod_program=tuple(int(x) for x in call.score_program),
        mask_mod_program=tuple(int(x) for x in call.mask_program),
        expression_module=call.expression_module)


def _extras(call) -> Tuple[Optional[Any], ...]:
    """The optional operands other than learnable_sink, in OPTIONAL_OPERANDS order."""
    lists = list(call.block_sparse) if call.block_sparse else [None] * 8
    return (call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_q, call.seqused_k, call.page_table, *lists)


def _aux(call) -> Tuple[Any, ...]:
    return tuple(call.score_mod[2]) + tuple(call.mask_mod[2])


def _operands(sink, extras, aux, forward: bool) -> Tuple[List[Any], int]:
    """The optional operands passed and their bits (the q_ block lists go to the backward only)."""
    operands, bits = [], 0
    for i, tensor in enumerate((sink,) + tuple(extras)):
        if tensor is None or (forward and i >= _FIRST_BACKWARD_LIST):
            continue
        operands.append(tensor)
        bits |= 1 << i
    return operands + list(aux), bits


# ---------------------------------------------------------------------------------------------
# The custom calls


def _varying(x) -> frozenset:
    """The manual mesh axes (inside shard_map) that x's values vary over."""
    jax = _jax()
    axes = getattr(jax.typeof(x), "manual_axis_type", None) if hasattr(jax, "typeof") else None
    return frozenset(getattr(axes, "varying", None) or ())


def _result(shape, dtype, *operands):
    """A custom call's result type: inside shard_map, varying over every manual mesh axis that an
    operand varies over (the values depend on all of them); the custom_vjp's backward then sums
    each gradient over the axes its primal does not vary over."""
    jax = _jax()
    varying = frozenset().union(*(_varying(x) for x in operands if x is not None))
    if not varying:
        return jax.ShapeDtypeStruct(shape, dtype)
    from jax.sharding import NamedSharding, PartitionSpec

    typed = next(jax.typeof(x) for x in operands if x is not None and _varying(x))
    axes = type(typed.manual_axis_type)(varying=varying)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(typed.sharding.mesh, PartitionSpec()),
                                manual_axis_type=axes)


def _summed_to(grad, primal):
    """A gradient varying over manual axes its primal does not vary over (a replicated k under
    shard_map): summed over them, as the primal's uses on every shard add up."""
    if grad is None:
        return None
    extra = _varying(grad) - _varying(primal)
    return _jax().lax.psum(grad, tuple(sorted(extra))) if extra else grad


def _forward_ffi(static: _Static, bits: int, group: int, q, k, v, *operands):
    """The forward custom call on arrays whose shapes `static` describes (a whole call, or one
    shard of it: _jax_sharding)."""
    jax = _jax()
    results = (_result(static.out_shape, q.dtype, q, k, v, *operands),
               _result(static.lse_shape, np.float32, q, k, v, *operands))
    call = jax.ffi.ffi_call(FORWARD_TARGET, results, vmap_method="sequential")
    return tuple(call(q, k, v, *operands, **static.attributes(bits, forward=True)))


def _backward_ffi(static: _Static, bits: int, group: int, q, k, v, out, dout, lse, *operands):
    jax = _jax()
    everything = (q, k, v, out, dout, lse) + operands
    results = [_result(t.shape, t.dtype, *everything) for t in (q, k, v)]
    if bits & 1:  # learnable_sink: its gradient
        results.append(_result((static.num_heads,), np.float32, *everything))
    call = jax.ffi.ffi_call(BACKWARD_TARGET, tuple(results), vmap_method="sequential")
    return tuple(call(q, k, v, out, dout, lse, *operands, **static.attributes(bits, forward=False)))


@functools.lru_cache(maxsize=None)
def _not_differentiable(forward: bool):
    """A custom call whose own derivative fails by name, as under torch, instead of with XLA's
    generic message. Only a second-order gradient (jax.hessian, a gradient penalty)
    differentiates them: the first order goes through the custom_vjp below."""
    jax = _jax()

    @functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
    def call(static, bits, group, *arrays):
        return _jax_sharding.call(_forward_ffi if forward else _backward_ffi, forward, static, bits, group, *arrays)

    @call.defjvp
    def _(static, bits, group, primals, tangents):
        from .interface import NO_DOUBLE_BACKWARD

        raise NotImplementedError(NO_DOUBLE_BACKWARD)

    return call


def _forward_call(static: _Static, q, k, v, sink, extras, aux):
    _register()
    operands, bits = _operands(sink, extras, aux, forward=True)
    group = static.num_heads // k.shape[-2]
    out, lse = _not_differentiable(True)(static, bits, group, q, k, v, *operands)
    cu_seqlens_q = extras[0]
    if cu_seqlens_q is not None:
        rows = _rows_in_sequences(cu_seqlens_q, out.shape[0])
        out, lse = _zero_outside(out, rows[:, None, None]), _zero_outside(lse, rows[None, :])
    return out, lse


def combine(out_partial, lse_partial, out_dtype: str, cu_seqlens=None, seqused=None):
    """flash_attn_combine in jax.numpy (traceable, differentiable): out = sum_s exp(lse_s - lse)
    out_s with lse = logsumexp_s lse_s; rows with every split empty (lse_s -inf) give out 0 and
    lse -inf, and rows the combine does not merge (past seqused, outside every packed sequence)
    give 0 in both, as the kernel's outputs allocated by cuflash."""
    jnp = _jax().numpy
    highest = jnp.max(lse_partial, axis=0)
    # Rows with some split that saw keys; NaN and +inf pass through as in the kernel.
    seen = highest != -jnp.inf
    shift = jnp.where(seen, highest, 0.0)
    shifted = jnp.exp(lse_partial - shift)  # empty splits: 0
    total = jnp.sum(shifted, axis=0)
    lse = jnp.where(seen, jnp.log(jnp.where(seen, total, 1.0)) + shift, -jnp.inf)
    weights = jnp.where(seen, shifted / jnp.where(seen, total, 1.0), 0.0)
    # An empty split's partial output need not be finite: it weighs 0 and is not read.
    partial = jnp.where(weights[..., None] != 0, out_partial, 0.0)
    out = jnp.sum(weights[..., None] * partial, axis=0)
    masks = _merged_rows(lse.shape, cu_seqlens, seqused)
    if masks is not None:
        merged, inside = masks
        out = jnp.where(merged[..., None], out, 0.0)
        # Rows of a sequence past its seqused: out 0 and lse -inf (no key seen), as the kernel
        # writes them; rows outside every sequence are not written: 0 as allocated.
        lse = jnp.where(merged, lse, jnp.where(inside, -jnp.inf, 0.0))
    return out.astype(out_dtype), lse


def _merged_rows(shape, cu_seqlens, seqused):
    """(merged, inside) for an lse of `shape` ((batch, seqlen, heads) or packed (total, heads)),
    broadcasting against it: the rows the combine merges, and the rows of some sequence (merged
    or past its seqused); None: every row is merged."""
    jnp = _jax().numpy
    if len(shape) == 3:
        if seqused is None:
            return None
        merged = (jnp.arange(shape[1], dtype=np.int32)[None, :] < seqused[:, None])[..., None]
        return merged, jnp.ones_like(merged)
    rows = jnp.arange(shape[0], dtype=np.int32)
    cu = jnp.asarray([0, shape[0]], np.int32) if cu_seqlens is None else cu_seqlens
    segment = jnp.clip(jnp.searchsorted(cu[1:], rows, side="right"), 0, cu.shape[0] - 2)
    inside = _rows_in_sequences(cu, shape[0])
    merged = inside if seqused is None else inside & (rows - cu[segment] < seqused[segment])
    return merged[:, None], inside[:, None]


def _rows_in_sequences(cu_seqlens, total: int):
    """Which of `total` packed rows lie in a sequence of cu_seqlens, [cu_seqlens[0], cu_seqlens[-1])."""
    jnp = _jax().numpy
    rows = jnp.arange(total, dtype=np.int32)
    return (rows >= cu_seqlens[0]) & (rows < cu_seqlens[-1])


def _zero_outside(x, inside):
    """x with 0 where `inside` is False. The kernels (and the CPU reference) write no row outside
    the sequences of a padded packed batch, and XLA's result buffers hold whatever was there: the
    other frameworks' packed outputs start as zeros, these are zeroed after."""
    jnp = _jax().numpy
    return jnp.where(inside, x, jnp.zeros((), x.dtype))


def _backward_block_lists(extras):
    """The backward's column-block lists: the transposed forward lists when none were given."""
    lists = list(extras[_FIRST_BLOCK_LIST - 1:])
    if all(t is None for t in lists[:4]) or any(t is not None for t in lists[4:]):
        return tuple(extras)
    # The forward lists' own column count (validated: over seqlen_k, max_seqlen_k with
    # cu_seqlens_k, or max_pages * page_size with a page table).
    forward_idx = lists[1] if lists[1] is not None else lists[3]
    col_blocks = int(forward_idx.shape[3])
    for i in (0, 2):
        if lists[i] is not None:
            lists[4 + i], lists[5 + i] = transpose_block_lists(lists[i], lists[i + 1], col_blocks)
    return tuple(extras[:_FIRST_BLOCK_LIST - 1]) + tuple(lists)


def transpose_block_lists(cnt, idx, num_col_blocks: int):
    """block_sparse.transpose_block_lists in jax.numpy (works on traced lists): row-block lists
    (cnt (B, H_b, M), idx (B, H_b, M, N)) -> column-block lists (q_cnt (B, H_b, N),
    q_idx (B, H_b, N, M)), row blocks in ascending order."""
    jnp = _jax().numpy
    rows = cnt.shape[2]
    slots = jnp.arange(idx.shape[3], dtype=np.int32)
    valid = slots[None, None, None, :] < cnt[..., None]  # (B, H_b, M, N_slots)
    columns = jnp.arange(num_col_blocks, dtype=np.int32)
    hits = valid[..., None] & (idx[..., None] == columns)  # (B, H_b, M, N_slots, N)
    by_col = jnp.swapaxes(jnp.any(hits, axis=3), 2, 3)  # (B, H_b, N, M)
    q_cnt = jnp.sum(by_col, axis=-1, dtype=np.int32)
    q_idx = jnp.argsort(~by_col, axis=-1, stable=True).astype(np.int32)
    q_idx = jnp.where(jnp.arange(rows)[None, None, None, :] < q_cnt[..., None], q_idx, 0).astype(np.int32)
    return q_cnt, q_idx


def _backward_call(static: _Static, q, k, v, sink, extras, aux, out, dout, lse, dlse=None):
    """dlse: the gradient reaching lse (lse's shape, float32), or None."""
    _register()
    extras = _backward_block_lists(extras) + (dlse,)
    operands, bits = _operands(sink, extras, aux, forward=False)
    group = static.num_heads // k.shape[-2]
    grads = _not_differentiable(False)(static, bits, group, q, k, v, out, dout, lse, *operands)
    dq, dk, dv = grads[:3]
    cu_seqlens_q, cu_seqlens_k, page_table = extras[0], extras[1], extras[4]
    if cu_seqlens_q is not None:
        dq = _zero_outside(dq, _rows_in_sequences(cu_seqlens_q, dq.shape[0])[:, None, None])
    if cu_seqlens_k is not None and page_table is None:
        rows = _rows_in_sequences(cu_seqlens_k, dk.shape[0])[:, None, None]
        dk, dv = _zero_outside(dk, rows), _zero_outside(dv, rows)
    return dq, dk, dv, (grads[3] if sink is not None else None)


# ---------------------------------------------------------------------------------------------
# Differentiation: jax.custom_vjp over q, k, v and learnable_sink


@functools.lru_cache(maxsize=None)
def _attention_fn():
    """The custom_vjp function, made on first use so that importing cuflash needs no jax."""
    jax = _jax()
    from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def attention(static, q, k, v, sink, extras, aux):
        return _forward_call(static, q, k, v, sink, extras, aux)

    def forward(static, q, k, v, sink, extras, aux):
        # The tensors a score_mod / mask_mod reads get no gradient (the backward computes those of
        # q, k, v and the sink only): one being differentiated (a learnable bias table) is
        # refused, as under torch, rather than given a zero gradient that never trains it.
        for i, primal in enumerate(aux):
            if getattr(primal, "perturbed", False):
                argument = "score_mod" if i < static.num_score_aux else "mask_mod"
                raise NotImplementedError(
                    f"{argument}: its tensor aux[{i if i < static.num_score_aux else i - static.num_score_aux}] is "
                    f"differentiated, but cuflash computes the gradients of q, k, v and learnable_sink only; "
                    f"pass it through jax.lax.stop_gradient (a constant)")
        q, k, v, sink, extras, aux = custom_vjp_primal_tree_values((q, k, v, sink, extras, aux))
        out, lse = _forward_call(static, q, k, v, sink, extras, aux)
        return (out, lse), (q, k, v, sink, extras, aux, out, lse)

    def backward(static, residuals, cotangents):
        q, k, v, sink, extras, aux, out, lse = residuals
        dout, dlse = cotangents
        # A loss that uses lse: dlse enters the backward's preprocess (dPsum = rowsum(dO * O) - dlse).
        dlse = None if isinstance(dlse, SymbolicZero) else dlse.astype(np.float32)
        if isinstance(dout, SymbolicZero):
            dout = jax.numpy.zeros(out.shape, out.dtype)
        dq, dk, dv, d_sink = _backward_call(static, q, k, v, sink, extras, aux, out, dout, lse, dlse)
        dq, dk, dv, d_sink = (_summed_to(g, p) for g, p in ((dq, q), (dk, k), (dv, v), (d_sink, sink)))
        if d_sink is not None:
            d_sink = d_sink.astype(sink.dtype)
        return dq, dk, dv, d_sink, None, None

    attention.defvjp(forward, backward, symbolic_zeros=True)
    return attention


def _check_platform(call) -> None:
    """Eager arrays: the device must be one that this build has handlers for."""
    if is_tracer(call.q):
        return
    platform = list(call.q.devices())[0].platform
    if platform == "gpu" and not _C.built_with_cuda:
        raise NotImplementedError("device: JAX arrays on a GPU were passed, but cuflash was built without CUDA "
                                  "(nvcc not found or CUFLASH_ENABLE_CUDA=OFF)")
    if platform not in ("cpu", "gpu"):
        raise ValueError(f"q: expected a JAX array on the CPU or a CUDA GPU, got platform {platform}")


def _traced_by_eager_shard_map(*values: Any) -> bool:
    """Whether a value is traced by shard_map outside jax.jit, directly or under tracers of
    transformations inside it (vmap's, jvp's). shard_map's eager mode has no rule for a
    custom_vjp with symbolic zeros, so a call there is staged through jax.jit (under which
    shard_map sees only the staged computation)."""
    tracer = getattr(_jax().core, "Tracer", ())

    def traced(value: Any, depth: int) -> bool:
        if any(c.__name__ == "ShardMapTracer" for c in type(value).__mro__):
            return True
        if depth >= 16 or not isinstance(value, tracer):
            return False
        return any(traced(getattr(value, name), depth + 1) for name in ("val", "primal", "tangent")
                   if getattr(value, name, None) is not None)

    return any(traced(v, 0) for v in values if v is not None)


@functools.lru_cache(maxsize=None)
def _staged_attention_fn():
    return _jax().jit(_attention_fn(), static_argnums=0)


def attention(call) -> Tuple[Any, Any]:
    """(out, lse) of a checked call whose tensors are JAX arrays (traced or not)."""
    _check_platform(call)
    operands = (call.q, call.k, call.v, call.learnable_sink, _extras(call), _aux(call))
    leaves = _jax().tree_util.tree_leaves(operands)
    function = _staged_attention_fn() if _traced_by_eager_shard_map(*leaves) else _attention_fn()
    return function(_static(call), *operands)


def backward(call, out, dout, lse, dlse=None) -> Tuple[Any, Any, Any, Optional[Any]]:
    """(dq, dk, dv, d_sink) of a checked call (flash_attn_backward); d_sink is float32."""
    _check_platform(call)
    return _backward_call(_static(call), call.q, call.k, call.v, call.learnable_sink, _extras(call), _aux(call),
                          out, dout, lse, dlse)
