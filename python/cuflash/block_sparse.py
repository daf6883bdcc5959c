"""Block-sparse attention lists (FlexAttention ``BlockMask`` tensors), built on the CPU.

Forward lists, per (batch, head or 1, row block of ``block_m`` queries):
  ``*_block_cnt`` (B, H_b, ceil(Sq/block_m)) int32 and ``*_block_idx`` (B, H_b, ceil(Sq/block_m),
  ceil(Sk/block_n)) int32: the first cnt entries of idx are the column blocks of that row block.
  ``full`` blocks are computed without the mask_mod, ``mask`` blocks with it, others skipped.
Backward lists (``q_`` prefix) are the transpose: per column block, the row blocks that see it.
They are optional: without them the backward reads the forward lists.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import numpy as np

from ._variants import MaskMod

__all__ = ["BLOCK_M", "BLOCK_N", "BlockLists", "transpose_block_lists", "create_block_mask"]

BLOCK_M = 128
BLOCK_N = 128


class BlockLists(NamedTuple):
    """The four forward lists, in the argument names of flash_attn_func."""

    full_block_cnt: Optional[np.ndarray]
    full_block_idx: Optional[np.ndarray]
    mask_block_cnt: Optional[np.ndarray]
    mask_block_idx: Optional[np.ndarray]


def transpose_block_lists(cnt: Any, idx: Any, num_col_blocks: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Row-block lists (cnt (B, H_b, M), idx (B, H_b, M, N)) -> column-block lists
    (q_cnt (B, H_b, N), q_idx (B, H_b, N, M)), row blocks in ascending order. NumPy in, NumPy out."""
    cnt = np.asarray(cnt)
    idx = np.asarray(idx)
    batch, heads, rows = cnt.shape
    cols = idx.shape[3] if num_col_blocks is None else num_col_blocks
    present = np.zeros((batch, heads, rows, cols), dtype=bool)
    slots = np.arange(idx.shape[3])
    valid = slots[None, None, None, :] < cnt[..., None]
    if np.any(valid & ((idx < 0) | (idx >= cols))):
        raise ValueError(f"block index out of range [0, {cols}) in the first cnt entries of a block list")
    b, h, m, j = np.nonzero(valid)
    present[b, h, m, idx[b, h, m, j]] = True
    by_col = present.transpose(0, 1, 3, 2)  # (B, H_b, N, M)
    q_cnt = by_col.sum(axis=-1).astype(np.int32)
    # Stable sort puts the present row blocks first, in ascending order.
    q_idx = np.argsort(~by_col, axis=-1, kind="stable").astype(np.int32)
    q_idx = np.where(np.arange(rows)[None, None, None, :] < q_cnt[..., None], q_idx, 0).astype(np.int32)
    return np.ascontiguousarray(q_cnt), np.ascontiguousarray(q_idx)


def _mask_function(mask_mod: MaskMod, doc_ids: Optional[np.ndarray]):
    """A NumPy (b, q_idx, kv_idx) -> bool function for a built-in mask_mod (top-left aligned)."""
    if mask_mod.name == "causal":
        return lambda b, qi, ki: ki <= qi
    if mask_mod.name == "sliding_window":
        left, right = mask_mod.scalars
        return lambda b, qi, ki: (ki >= qi - left) & (ki <= qi + right)
    if mask_mod.name == "prefix_lm":
        (prefix,) = mask_mod.scalars
        return lambda b, qi, ki: (ki <= qi) | (ki < prefix)
    if mask_mod.name == "document":
        if doc_ids is None:
            raise ValueError("mask_mod: document() needs its doc_ids to build a block mask")
        return lambda b, qi, ki: doc_ids[b][qi] == doc_ids[b][ki]
    raise ValueError(f"mask_mod: no block-mask rule for {mask_mod!r}")


def _callable_mask_function(mask_mod: Any):
    """A FlexAttention-style mask_mod(b, h, q_idx, kv_idx) -> bool callable, evaluated on NumPy
    integer arrays (it must work elementwise with NumPy operators, as `q_idx >= kv_idx` does)."""

    def keep(b, h, qi, ki):
        try:
            result = mask_mod(np.int64(b), np.int64(h), qi, ki)
        except Exception as error:  # the callable's own failure, named with what it was given
            raise TypeError(f"mask_mod: evaluating it on NumPy index arrays (b, h scalars, q_idx, kv_idx "
                            f"broadcast) failed: {error!r}; write it with elementwise operators, or use a "
                            f"built-in from cuflash.masks") from error
        return np.asarray(result, dtype=bool)

    return keep


def create_block_mask(mask_mod: Any, B: Optional[int], H: Optional[int], Q_LEN: int, KV_LEN: int,
                      device: Any = None, BLOCK_SIZE: Any = (BLOCK_M, BLOCK_N)) -> BlockLists:
    """The forward block lists of a mask, with FlexAttention's ``create_block_mask`` signature:
    full blocks (every in-range pair kept), mask blocks (some kept), the rest skipped. Pass them
    to flash_attn_func together with the same mask_mod.

    mask_mod: a built-in from cuflash.masks (top-left aligned, as FlexAttention's), or a
    callable mask_mod(b, h, q_idx, kv_idx) -> bool that works on NumPy index arrays (int64, as
    torch's create_mask: a callable whose int arithmetic overflows int32 may get lists that
    differ from the 32-bit mask the attention functions apply).
    B, H: batch and heads; None broadcasts (a list of 1 over that dimension; built-ins do not
    depend on the head, so their lists always have one head). Q_LEN, KV_LEN: sequence lengths.
    device: accepted for compatibility; the lists are NumPy arrays, which the attention functions
    move to q's device. BLOCK_SIZE: an int or (block_m, block_n); 128 x 128 only, the blocks the
    attention functions read the arrays as (the arrays do not carry their block size). Lists of
    one batch entry (B None) are repeated over the call's batch.
    Evaluated on the CPU, one row block of pairs at a time: for long sequences prefer the
    mask_mod alone (causal and windows fold into the kernels' own masks, document masks build
    their lists on the GPU), or FlexAttention's create_block_mask on the GPU with
    cuflash.flex_attention."""
    from ._tensors import framework_of

    def is_int(value):
        return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))

    sizes = tuple(BLOCK_SIZE) if isinstance(BLOCK_SIZE, (tuple, list)) else (BLOCK_SIZE, BLOCK_SIZE)
    if len(sizes) != 2 or not all(is_int(x) for x in sizes):
        raise ValueError(f"BLOCK_SIZE: expected an int or (block_m, block_n), got {BLOCK_SIZE!r}")
    block_m, block_n = (int(x) for x in sizes)
    # The attention functions take the four arrays alone, which do not say their block size, and
    # read them as BLOCK_M x BLOCK_N blocks: lists of other blocks would be read wrongly.
    if (block_m, block_n) != (BLOCK_M, BLOCK_N):
        raise ValueError(f"BLOCK_SIZE: cuflash's attention functions read the lists as {BLOCK_M} x {BLOCK_N} "
                         f"blocks, got {BLOCK_SIZE!r} (other block sizes: the C++ API's BlockSparseTensors)")
    for name, value in (("B", B), ("H", H)):
        if value is not None and (not is_int(value) or value < 1):
            raise ValueError(f"{name}: expected a positive int or None (broadcast), got {value!r}")
    for name, value in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if not is_int(value) or value < 0:
            raise ValueError(f"{name}: expected a length (int >= 0), got {value!r}")
    if device is not None and not isinstance(device, str) and type(device).__name__ != "device":
        raise TypeError(f"device: expected None, a device string or a torch.device, got {type(device).__name__}")
    batch = 1 if B is None else int(B)
    if isinstance(mask_mod, MaskMod):
        doc_ids = None
        if mask_mod.aux:
            doc_ids = framework_of(mask_mod.aux[0]).to_numpy(mask_mod.aux[0])
        builtin = _mask_function(mask_mod, doc_ids)
        heads = 1
        keep = lambda b, h, qi, ki: builtin(b, qi, ki)  # noqa: E731
    elif callable(mask_mod):
        heads = 1 if H is None else int(H)
        keep = _callable_mask_function(mask_mod)
    else:
        raise TypeError(f"mask_mod: expected a cuflash.masks object or a callable mask_mod(b, h, q_idx, "
                        f"kv_idx), got {type(mask_mod).__name__}")
    seqlen_q, seqlen_k = int(Q_LEN), int(KV_LEN)
    rows = -(-seqlen_q // block_m)
    cols = -(-seqlen_k // block_n)
    shape = (batch, heads, rows)
    full_cnt = np.zeros(shape, np.int32)
    mask_cnt = np.zeros(shape, np.int32)
    full_idx = np.zeros(shape + (cols,), np.int32)
    mask_idx = np.zeros(shape + (cols,), np.int32)
    k_positions = np.arange(seqlen_k)
    # Keys past seqlen_k in the last column block: kept for "all", not for "any".
    padding = ((0, 0), (0, cols * block_n - seqlen_k))
    for b in range(batch):
        for h in range(heads):
            # One row block at a time: memory of block_m x seqlen_k pairs, whatever the lengths.
            for m in range(rows):
                q_positions = np.arange(m * block_m, min((m + 1) * block_m, seqlen_q))
                kept = np.broadcast_to(keep(b, h, q_positions[:, None], k_positions[None, :]),
                                       (len(q_positions), seqlen_k))
                every = np.pad(kept, padding, constant_values=True).reshape(len(q_positions), cols, block_n).all(axis=(0, 2))
                some = np.pad(kept, padding, constant_values=False).reshape(len(q_positions), cols, block_n).any(axis=(0, 2))
                full = np.flatnonzero(every)
                partial = np.flatnonzero(some & ~every)
                full_cnt[b, h, m], mask_cnt[b, h, m] = len(full), len(partial)
                full_idx[b, h, m, :len(full)] = full
                mask_idx[b, h, m, :len(partial)] = partial
    return BlockLists(full_cnt, full_idx, mask_cnt, mask_idx)
