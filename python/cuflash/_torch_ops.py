"""torch custom ops (torch.library): cuflash::fwd and cuflash::bwd, with fake (meta)
implementations and autograd, so that torch.compile keeps cuflash calls in its graph.

Imported only when torch tensors reach cuflash (torch is already imported then). Arguments
are the checked call flattened into types a torch schema can hold; the op re-derives the call
from them.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ._tensors import note_loaded_modules
from ._variants import MaskMod, ScoreMod, from_kind

from . import interface as _interface

note_loaded_modules()


def _mod(cls, kind, scalars, aux, program, structure):
    """The score_mod / mask_mod of a call from the op's arguments: a built-in, or a callable
    traced before (its program)."""
    if not kind:
        return None
    if kind == _interface._EXPRESSION_KIND:
        return _interface._CheckedExpression(cls.role, list(program), list(scalars), list(aux), structure)
    return from_kind(cls, kind, scalars, aux)


def _call(q, k, v, learnable_sink, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
          max_seqlen_k, page_table, softmax_scale, causal, window_left, window_right, softcap, score_mod_kind,
          score_mod_scalars, mask_mod_kind, mask_mod_scalars, aux, num_score_aux, block_sparse, block_sparse_slots,
          num_splits, pack_gqa, score_mod_program, mask_mod_program, score_mod_structure,
          mask_mod_structure, deterministic=False):
    score_mod = _mod(ScoreMod, score_mod_kind, score_mod_scalars, aux[:num_score_aux], score_mod_program,
                     score_mod_structure)
    mask_mod = _mod(MaskMod, mask_mod_kind, mask_mod_scalars, aux[num_score_aux:], mask_mod_program,
                    mask_mod_structure)
    lists = [None] * 8
    for slot, tensor in zip(block_sparse_slots, block_sparse):
        lists[slot] = tensor
    return _interface._prepare(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, page_table=page_table, softmax_scale=softmax_scale,
        causal=causal, window_size=(window_left, window_right), learnable_sink=learnable_sink, softcap=softcap,
        num_splits=num_splits, pack_gqa=pack_gqa, deterministic=deterministic, score_mod=score_mod,
        mask_mod=mask_mod, block_sparse=tuple(lists[:4]), q_block_sparse=tuple(lists[4:]))


def flatten(call) -> dict:
    """The op arguments (after q, k, v, learnable_sink) of a checked call."""
    score_kind, score_scalars, score_aux = call.score_mod
    mask_kind, mask_scalars, mask_aux = call.mask_mod
    return dict(
        cu_seqlens_q=call.cu_seqlens_q, cu_seqlens_k=call.cu_seqlens_k, seqused_q=call.seqused_q,
        seqused_k=call.seqused_k, max_seqlen_q=call.max_seqlen_q, max_seqlen_k=call.max_seqlen_k,
        page_table=call.page_table, softmax_scale=call.softmax_scale, causal=call.causal,
        window_left=call.window_left, window_right=call.window_right, softcap=call.softcap,
        score_mod_kind=score_kind, score_mod_scalars=[float(s) for s in score_scalars], mask_mod_kind=mask_kind,
        mask_mod_scalars=[float(s) for s in mask_scalars], aux=list(score_aux) + list(mask_aux),
        num_score_aux=len(score_aux), block_sparse=[t for t in call.block_sparse if t is not None],
        block_sparse_slots=[i for i, t in enumerate(call.block_sparse) if t is not None], num_splits=call.num_splits,
        pack_gqa=call.pack_gqa, score_mod_program=list(call.score_program), mask_mod_program=list(call.mask_program),
        score_mod_structure="" if call.score_traced is None else call.score_traced.structure_key(),
        mask_mod_structure="" if call.mask_traced is None else call.mask_traced.structure_key(),
        deterministic=call.deterministic)


@torch.library.custom_op("cuflash::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, learnable_sink: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
        cu_seqlens_k: Optional[Tensor], seqused_q: Optional[Tensor], seqused_k: Optional[Tensor],
        max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], page_table: Optional[Tensor],
        softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
        score_mod_kind: int, score_mod_scalars: List[float], mask_mod_kind: int, mask_mod_scalars: List[float],
        aux: List[Tensor], num_score_aux: int, block_sparse: List[Tensor], block_sparse_slots: List[int],
        num_splits: int, pack_gqa: Optional[bool], score_mod_program: List[int], mask_mod_program: List[int],
        score_mod_structure: str, mask_mod_structure: str, deterministic: bool) -> Tuple[Tensor, Tensor]:
    # `deterministic` is for the backward only.
    call = _call(q, k, v, learnable_sink, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                 max_seqlen_k, page_table, softmax_scale, causal, window_left, window_right, softcap,
                 score_mod_kind, score_mod_scalars, mask_mod_kind, mask_mod_scalars, aux, num_score_aux,
                 block_sparse, block_sparse_slots, num_splits, pack_gqa, score_mod_program, mask_mod_program,
                 score_mod_structure, mask_mod_structure)
    return _interface._run_forward(call)


@fwd.register_fake
def _(q, k, v, learnable_sink, cu_seqlens_q, *args):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if cu_seqlens_q is None:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("cuflash::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
        learnable_sink: Optional[Tensor],
        cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], seqused_q: Optional[Tensor],
        seqused_k: Optional[Tensor], page_table: Optional[Tensor], max_seqlen_q: Optional[int],
        max_seqlen_k: Optional[int], softmax_scale: Optional[float], causal: bool, window_left: int,
        window_right: int, softcap: float, score_mod_kind: int, score_mod_scalars: List[float], mask_mod_kind: int,
        mask_mod_scalars: List[float], aux: List[Tensor], num_score_aux: int, block_sparse: List[Tensor],
        block_sparse_slots: List[int], num_splits: int, pack_gqa: Optional[bool], score_mod_program: List[int],
        mask_mod_program: List[int], score_mod_structure: str, mask_mod_structure: str,
        deterministic: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    # num_splits and pack_gqa are the forward's: the backward ignores them, but a callable's
    # kernels are compiled in one module per form, which the forward's call found or built.
    call = _call(q, k, v, learnable_sink, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                 max_seqlen_k, page_table, softmax_scale, causal, window_left, window_right, softcap, score_mod_kind,
                 score_mod_scalars, mask_mod_kind, mask_mod_scalars, aux, num_score_aux, block_sparse,
                 block_sparse_slots, num_splits, pack_gqa, score_mod_program, mask_mod_program, score_mod_structure,
                 mask_mod_structure, deterministic)
    # The gradients reaching out and lse may be views the kernels cannot read by TMA (a slice of
    # a concatenation): copied as the inputs of the other paths are.
    dout, dlse = (_interface._maybe_contiguous(call.framework, t) for t in (dout, dlse))
    dq, dk, dv, d_sink = _interface._run_backward(call, out, dout, lse, dlse)
    if d_sink is None:
        d_sink = q.new_zeros((0,), dtype=torch.float32)
    return dq, dk, dv, d_sink


@bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, learnable_sink, *args):
    # Contiguous, as the real op allocates them (not q's strides: q may be a transposed view).
    heads = 0 if learnable_sink is None else q.shape[-2]
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty((heads,), dtype=torch.float32))


def _no_double_backward(ctx, *grads):
    raise NotImplementedError(_interface.NO_DOUBLE_BACKWARD)


# The backward's gradients are not differentiable again: differentiating them (a gradient
# penalty, a Hessian-vector product) fails by name instead of with torch's generic message.
torch.library.register_autograd("cuflash::bwd", _no_double_backward)


_FWD_INPUTS = ("q", "k", "v", "learnable_sink", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k",
               "max_seqlen_q", "max_seqlen_k", "page_table", "softmax_scale", "causal", "window_left",
               "window_right", "softcap", "score_mod_kind", "score_mod_scalars", "mask_mod_kind",
               "mask_mod_scalars", "aux", "num_score_aux", "block_sparse", "block_sparse_slots", "num_splits", "pack_gqa",
               "score_mod_program", "mask_mod_program", "score_mod_structure", "mask_mod_structure", "deterministic")
_TENSOR_INPUTS = ("q", "k", "v", "learnable_sink", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k",
                  "page_table")
_OPTIONS = ("max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "window_left", "window_right", "softcap",
            "score_mod_kind", "score_mod_scalars", "mask_mod_kind", "mask_mod_scalars", "num_score_aux", "num_splits",
            "pack_gqa", "score_mod_program", "mask_mod_program", "score_mod_structure", "mask_mod_structure")


def _setup_context(ctx, inputs, output):
    named = dict(zip(_FWD_INPUTS, inputs))
    out, lse = output
    # The lists of tensors (mods' tensors, block lists) are saved too, so that one changed in
    # place before the backward is an error (torch's version check), not wrong gradients.
    ctx.save_for_backward(*(named[n] for n in _TENSOR_INPUTS), out, lse, *named["aux"], *named["block_sparse"])
    ctx.options = {n: named[n] for n in _OPTIONS}
    ctx.num_aux = len(named["aux"])
    ctx.block_sparse_slots = named["block_sparse_slots"]
    ctx.deterministic = named["deterministic"]
    # torch treats an input list of tensors (an empty one too) as a list, which takes a list of
    # gradients of its length; any other list is one value, which takes None.
    ctx.list_lengths = {name: len(value) for name, value in named.items()
                        if isinstance(value, list) and all(isinstance(x, Tensor) for x in value)}


def _backward(ctx, dout, dlse):
    # dlse, the gradient of lse (zeros or None when the loss does not use it), enters the
    # backward's preprocess only: dPsum = rowsum(dO * O) - dlse.
    saved = ctx.saved_tensors
    q, k, v, sink, cu_q, cu_k, used_q, used_k, page_table, out, lse = saved[:11]
    aux, block_sparse = list(saved[11:11 + ctx.num_aux]), list(saved[11 + ctx.num_aux:])
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, d_sink = bwd(dout, q, k, v, out, lse, dlse, sink, cu_q, cu_k, used_q, used_k, page_table, aux=aux,
                             block_sparse=block_sparse,
                             block_sparse_slots=ctx.block_sparse_slots, deterministic=ctx.deterministic, **ctx.options)
    grads = {name: [None] * length for name, length in ctx.list_lengths.items()}
    grads.update(q=dq, k=dk, v=dv, learnable_sink=None if sink is None else d_sink.to(sink.dtype))
    return tuple(grads.get(name) for name in _FWD_INPUTS)


torch.library.register_autograd("cuflash::fwd", _backward, setup_context=_setup_context)


def attention(call) -> Tuple[Tensor, Tensor]:
    """Runs a checked call through the custom op (autograd included)."""
    return fwd(call.q, call.k, call.v, call.learnable_sink, **flatten(call))
