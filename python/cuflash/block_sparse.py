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


def create_block_mask(mask_mod: MaskMod, batch: int, seqlen_q: int, seqlen_k: int,
                      block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> BlockLists:
    """Evaluates a built-in mask_mod on the CPU and returns the forward block lists (head dim
    1, broadcast over heads): full blocks (every in-range pair kept), mask blocks (some kept),
    the rest skipped. Pass them to flash_attn_func together with the same mask_mod."""
    from ._tensors import framework_of

    if not isinstance(mask_mod, MaskMod):
        raise TypeError(f"mask_mod: expected a cuflash.masks object, got {type(mask_mod).__name__}")
    doc_ids = None
    if mask_mod.aux:
        doc_ids = framework_of(mask_mod.aux[0]).to_numpy(mask_mod.aux[0])
    keep = _mask_function(mask_mod, doc_ids)
    rows = -(-seqlen_q // block_m)
    cols = -(-seqlen_k // block_n)
    shape = (batch, 1, rows)
    full_cnt = np.zeros(shape, np.int32)
    mask_cnt = np.zeros(shape, np.int32)
    full_idx = np.zeros(shape + (cols,), np.int32)
    mask_idx = np.zeros(shape + (cols,), np.int32)
    q_positions = np.arange(seqlen_q)
    k_positions = np.arange(seqlen_k)
    for b in range(batch):
        kept = keep(b, q_positions[:, None], k_positions[None, :])
        kept = np.broadcast_to(kept, (seqlen_q, seqlen_k))
        for m in range(rows):
            for n in range(cols):
                block = kept[m * block_m:(m + 1) * block_m, n * block_n:(n + 1) * block_n]
                if block.all():
                    full_idx[b, 0, m, full_cnt[b, 0, m]] = n
                    full_cnt[b, 0, m] += 1
                elif block.any():
                    mask_idx[b, 0, m, mask_cnt[b, 0, m]] = n
                    mask_cnt[b, 0, m] += 1
    return BlockLists(full_cnt, full_idx, mask_cnt, mask_idx)
