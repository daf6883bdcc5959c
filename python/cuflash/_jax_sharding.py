"""Sharding rules for cuflash's XLA custom calls: under jax.jit with arrays sharded over a mesh,
attention stays sharded over its batch and heads instead of being gathered onto every device.

Each custom call (python/cuflash/_jax.py) is wrapped in ``custom_partitioning`` with a Shardy
rule in einsum notation. Dense q, k, v, out are (batch, seqlen, heads, dim) and lse (batch,
heads, seqlen); packed ones (total, heads, dim) and (heads, total); paged k / v (pages,
page_size, heads, dim). The query heads are the kv heads times the GQA group, ``(h g)``: the kv
heads ``h`` may be sharded, the group ``g`` not, so that every shard holds whole groups. The
batch ``b`` may be sharded in dense layouts (a page table's rows and seqused follow it).
Sequence, row, page and head-dim factors are never sharded. Where the kernels read a batch or
head index from elsewhere (a score_mod / mask_mod, its tensors, block lists), the batch and heads
are not sharded either; nor is the batch of packed sequences (cu_seqlens hold the whole batch)
or of a backward with a learnable sink or pages (their gradients sum over the batch). Each shard
then runs the custom call on its own part, with the shapes of that part. With one device, and
under jax.vmap (which custom_partitioning does not batch), the custom calls run unpartitioned.
GQA heads are sharded by kv head where every mesh axis divides the kv heads. Where the axes that
shard q's heads do not divide the kv heads but leave each shard query heads of one kv head (MQA
on any axis; GQA with more shards than kv heads, as tensor parallelism past the kv heads has),
k and v stay whole on every shard, each shard attends with the one kv head its query heads read,
and in the backward each shard's dK / dV of that head is summed over the head axes (psum, in
float32 from the shards' rounded parts).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, List, Tuple

import numpy as np

_OPTIONAL = ("learnable_sink", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "page_table",
             "mask_block_cnt", "mask_block_idx", "full_block_cnt", "full_block_idx",
             "q_mask_block_cnt", "q_mask_block_idx", "q_full_block_cnt", "q_full_block_idx", "dlse")


def _jax():
    return sys.modules["jax"]


def _present(bits: int) -> List[str]:
    return [name for i, name in enumerate(_OPTIONAL) if bits >> i & 1]


def _layout(static: Any, bits: int) -> Tuple[bool, bool, bool]:
    """(packed q, packed k, paged k / v) of a call."""
    present = _present(bits)
    return "cu_seqlens_q" in present, "cu_seqlens_k" in present, "page_table" in present


def _heads_split(mesh: Any, kv_heads: int, group: int) -> bool:
    """Whether the query heads may be sharded as kv heads x group: the mesh's axes together must
    divide the kv heads, else Shardy may shard h over more devices than it has heads and split an
    axis across the compound factor (sub-axes, which custom_partitioning cannot take). Otherwise
    the query heads are a factor of their own, which the partition below shards by whole groups
    or by one kv head per shard where the axes allow."""
    return group == 1 or kv_heads % int(np.prod(list(mesh.shape.values()))) == 0


def _rule(static: Any, bits: int, forward: bool, group: int, ranks: List[int],
          heads_split: bool = True) -> Tuple[str, dict]:
    """The einsum-like Shardy rule of a custom call (operand ranks `ranks`) and its options."""
    packed_q, packed_k, paged = _layout(static, bits)
    present = _present(bits)
    fresh = (f"x{i}" for i in range(1000))  # never-sharded factors of the index tensors
    batch = "b" if not packed_q else None
    # The query heads: kv heads x group, as a compound factor only where both exceed 1 (Shardy
    # takes no factor of size 1 in a compound); MQA's heads are the group alone; GQA heads the
    # mesh cannot split by kv head are a factor of their own. Those two may be sharded with k / v
    # whole on every shard (the partition below decides whether the axes allow it).
    heads = "h" if group == 1 else "g" if static.num_heads == group else "(h g)" if heads_split else "hq"
    q = f"tq {heads} d" if packed_q else f"b s {heads} d"
    kv_rows = "p z" if paged else ("tk" if packed_k else "b t")
    k, v = f"{kv_rows} h d", f"{kv_rows} h e"
    out = f"tq {heads} e" if packed_q else f"b s {heads} e"
    lse = f"{heads} tq" if packed_q else f"b {heads} s"
    operands = [q, k, v] if forward else [q, k, v, out, out, lse]
    for name in present:
        if name == "learnable_sink":
            operands.append(heads)
        elif name in ("seqused_q", "seqused_k"):
            operands.append(batch or next(fresh))
        elif name == "page_table":
            operands.append(f"{batch or next(fresh)} {next(fresh)}")
        elif name == "dlse":
            operands.append(lse)
        else:  # cu_seqlens and block lists
            operands.append(" ".join(next(fresh) for _ in range(ranks[len(operands)])))
    while len(operands) < len(ranks):  # the tensors a score_mod / mask_mod reads
        operands.append(" ".join(next(fresh) for _ in range(ranks[len(operands)])))
    results = [out, lse] if forward else [q, k, v] + ([heads] if "learnable_sink" in present else [])
    factors = []  # in order of first appearance, the order Shardy numbers them in
    for text in operands + results:
        factors += [f for f in text.replace("(", " ").replace(")", " ").split() if f not in factors]
    replicated = {"s", "t", "d", "e", "tq", "tk", "p", "z"} | {f for f in factors if f.startswith("x")}
    if heads != "g":  # the group inside the compound (h g) is never sharded
        replicated.add("g")
    if static.num_heads == group or heads == "hq":  # one kv head, or heads the mesh cannot split
        replicated.add("h")
    # The kernels read batch and head indices for mods, their tensors and block lists, which
    # hold the whole batch and all heads.
    if (static.score_mod_kind or static.mask_mod_kind or static.num_score_aux or static.num_mask_aux
            or any(name.endswith(("_cnt", "_idx")) for name in present)):
        replicated |= {"b", "h", "g", "hq"}
    # cu_seqlens hold the whole batch; the backward sums over the batch for a sink's gradient and
    # for the pages' (a page may serve sequences of several batch shards).
    if packed_q or packed_k or (not forward and ("learnable_sink" in present or paged)):
        replicated.add("b")
    options = dict(need_replication_factors=tuple(f for f in factors if f in replicated))
    if heads == "(h g)":
        options["g"] = group
    return f"{', '.join(operands)} -> {', '.join(results)}", options


def _dims(side: str) -> List[Tuple[str, ...]]:
    """Per tensor of one side of a rule, its dimensions as factor tuples ("(h g)" -> ("h", "g"))."""
    tensors = []
    for text in side.split(", "):
        dims, group = [], None
        for token in text.replace("(", " ( ").replace(")", " ) ").split():
            if token == "(":
                group = []
            elif token == ")":
                dims.append(tuple(group))
                group = None
            elif group is not None:
                group.append(token)
            else:
                dims.append((token,))
        tensors.append(dims)
    return tensors


def _local_static(static: Any, q: Any, v: Any, packed_q: bool) -> Any:
    """The static part of a shard's call: its output shapes and head count."""
    heads = q.shape[-2]
    out_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    lse_shape = (heads, q.shape[0]) if packed_q else (q.shape[0], heads, q.shape[1])
    return dataclasses.replace(static, out_shape=out_shape, lse_shape=lse_shape, num_heads=heads)


def call(call_fn: Any, forward: bool, static: Any, bits: int, group: int, *arrays: Any) -> Any:
    """call_fn(static, bits, group, *arrays), partitioned where several devices may shard it.
    With one device there is nothing to partition; under jax.vmap (which custom_partitioning
    does not batch) the custom call runs as before, once per batch entry."""
    jax = _jax()
    if jax.device_count() == 1 or any(_is_batched(x) for x in arrays):
        return call_fn(static, bits, group, *arrays)
    return _batchable(call_fn, forward, static, bits, group)(*arrays)


@functools.lru_cache(maxsize=256)
def _batchable(call_fn: Any, forward: bool, static: Any, bits: int, group: int) -> Any:
    """The partitioned call with a batching rule: a jax.vmap that reaches it from outside a
    jax.jit (where the batch tracers are out of _is_batched's sight) runs the unpartitioned
    custom call once per batch entry, as without sharding."""
    jax = _jax()
    partitioned = _partitioned(call_fn, forward)

    @jax.custom_batching.custom_vmap
    def batchable(*arrays):
        return partitioned(static, bits, group, *arrays)

    @batchable.def_vmap
    def _(axis_size, in_batched, *arrays):
        outs = jax.vmap(lambda *a: call_fn(static, bits, group, *a),
                        in_axes=tuple(0 if batched else None for batched in in_batched))(*arrays)
        return outs, tuple(True for _ in outs)

    return batchable


def _is_batched(x: Any) -> bool:
    try:
        from jax._src.interpreters.batching import BatchTracer
    except ImportError:  # another JAX layout: treat every tracer as possibly batched
        return isinstance(x, _jax().core.Tracer)
    return isinstance(x, BatchTracer)


@functools.lru_cache(maxsize=None)
def _partitioned(call_fn: Any, forward: bool) -> Any:
    """call_fn(static, bits, group, q, k, v, *operands) as a custom_partitioning function:
    sharded by the rule above, each shard calling call_fn with its own static part."""
    from jax._src.interpreters import mlir
    from jax.experimental.custom_partitioning import custom_partitioning

    wrapped = custom_partitioning(call_fn, static_argnums=(0, 1, 2))

    def sharding_rule(static, bits, group, mesh, operand_types, result_types):
        ranks = [mlir.ir.RankedTensorType(t).rank for t in operand_types]
        kv_heads = mlir.ir.RankedTensorType(operand_types[1]).shape[-2]
        return _rule(static, bits, forward, group, ranks, _heads_split(mesh, kv_heads, group))

    def partition(static, bits, group, mesh, arg_shapes, result_shape):
        # The shardings this call runs with, whatever the operands came with: the batch and the
        # kv heads on the mesh axes that shard them in q (where the rule lets them be sharded
        # and the axes divide them), every other dimension whole; the partitioner reshards the
        # operands to match.
        from jax.sharding import NamedSharding, PartitionSpec

        rule, options = _rule(static, bits, forward, group, [len(a.shape) for a in arg_shapes],
                              _heads_split(mesh, arg_shapes[1].shape[-2], group))
        operand_dims, result_dims = (_dims(side) for side in rule.split(" -> "))
        replicated = set(options["need_replication_factors"])
        # A sharding without a partition spec (GSPMD's, inside a partly manual shard_map): whole.
        q_spec = tuple(getattr(arg_shapes[0].sharding, "spec", None) or ()) + (None,) * 4
        q_dims = operand_dims[0]
        kv_heads = arg_shapes[1].shape[-2]
        axes = {}
        # "q": query heads of their own factor (MQA's "g", GQA's "hq") sharded, where every
        # shard holds whole groups (the axes divide the kv heads: k / v sharded alike) or query
        # heads of one kv head (their count divides the group: k / v whole).
        for factor, q_dim in (("b", ("b",)), ("h", ("h", "g")), ("h", ("h",)), ("q", ("g",)), ("q", ("hq",))):
            if q_dim not in q_dims or (q_dim[0] if factor == "q" else factor) in replicated:
                continue
            dim = q_dims.index(q_dim)
            names = q_spec[dim]
            names = () if names is None else (names,) if isinstance(names, str) else tuple(names)
            count = int(np.prod([mesh.shape[n] for n in names])) if names else 1
            extent = arg_shapes[0].shape[dim] if factor in ("b", "q") else kv_heads
            if not names or extent % count != 0:
                continue
            if factor == "q" and kv_heads % count == 0:
                factor = "h"  # whole groups: the kv heads split with them
            elif factor == "q" and group % (extent // count) != 0:
                continue  # a shard's query heads would straddle kv heads: whole heads
            axes[factor] = names

        def sharding(dims):
            return NamedSharding(mesh, PartitionSpec(*(
                axes.get("b") if dim == ("b",) else axes.get("h") if dim in (("h",), ("h", "g"))
                else axes.get("h") or axes.get("q") if dim in (("g",), ("hq",)) else None
                for dim in dims)))

        arg_shardings = tuple(sharding(dims) for dims in operand_dims)
        result_shardings = tuple(sharding(dims) for dims in result_dims)
        packed_q = _layout(static, bits)[0]

        if "q" in axes:
            return mesh, _one_kv_head_per_shard(call_fn, forward, static, bits, group, packed_q, mesh,
                                                axes["q"]), result_shardings, arg_shardings

        def lower_fn(q, k, v, *operands):
            return call_fn(_local_static(static, q, v, packed_q), bits, group, q, k, v, *operands)

        return mesh, lower_fn, result_shardings, arg_shardings

    wrapped.def_partition(partition=partition, sharding_rule=sharding_rule)
    return wrapped


def _one_kv_head_per_shard(call_fn: Any, forward: bool, static: Any, bits: int, group: int, packed_q: bool,
                           mesh: Any, names: Tuple[str, ...]) -> Any:
    """The per-shard function where q's heads are sharded over `names` and k / v are whole: the
    shard's query heads (local_heads of them, dividing the group) read kv head
    shard * local_heads // group, which the shard slices out. Backward: dK / dV of that head go
    to its place in zeros of every kv head and are summed over the head axes, in float32."""
    jax = _jax()
    lax, jnp = jax.lax, jax.numpy

    def lower_fn(q, k, v, *operands):
        local_heads = q.shape[-2]
        shard = 0
        for name in names:  # the shard's place along q's heads, major axis first
            shard = shard * mesh.shape[name] + lax.axis_index(name)
        kv_head = shard * local_heads // group
        k1, v1 = (lax.dynamic_slice_in_dim(x, kv_head, 1, axis=x.ndim - 2) for x in (k, v))
        results = call_fn(_local_static(static, q, v1, packed_q), bits, local_heads, q, k1, v1, *operands)
        if forward:
            return results
        dq, dk1, dv1, *rest = results

        def summed(whole, part):
            placed = lax.dynamic_update_slice_in_dim(jnp.zeros(whole.shape, jnp.float32), part.astype(jnp.float32),
                                                     kv_head, axis=whole.ndim - 2)
            return lax.psum(placed, names).astype(whole.dtype)

        return (dq, summed(k, dk1), summed(v, dv1), *rest)

    return lower_fn
