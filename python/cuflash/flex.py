"""FlexAttention's interface: ``torch.nn.attention.flex_attention.flex_attention`` on cuflash.

    >>> from cuflash.flex import flex_attention
    >>> out = flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask)

Tensors are (batch, heads, seqlen, head_dim), as FlexAttention's. score_mod and the block mask's
mask_mod are Python callables traced by cuflash (cuflash.mods: what they may use); the block
mask is FlexAttention's BlockMask (``torch.nn.attention.flex_attention.create_block_mask``):
with 128 x 128 blocks (its default) cuflash reads its lists as they are, the backward's (q_*)
lists included; other block sizes are converted to 128 x 128 lists that keep the same pairs.
Under torch autograd, out (and lse) are differentiable with respect to query, key and value.
NumPy and JAX arrays work as with the other functions (JAX under jax.jit and jax.grad too),
without a block mask (BlockMask is torch's).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple, Optional, Tuple

from . import interface as _interface
from .block_sparse import BLOCK_M, BLOCK_N

__all__ = ["flex_attention"]

Tensor = Any


class AuxOutput(NamedTuple):
    """What ``return_aux`` asks for (FlexAttention's AuxOutput where torch has none)."""

    lse: Optional[Tensor] = None
    max_scores: Optional[Tensor] = None


def _fail(error: type, argument: str, message: str):
    raise error(f"{argument}: {message}")


def _is_noop_mask(mask_mod: Callable) -> bool:
    """FlexAttention's noop_mask (a BlockMask made without a mask_mod): every pair kept."""
    return (getattr(mask_mod, "__name__", "") == "noop_mask"
            and getattr(mask_mod, "__module__", "").startswith("torch.nn.attention"))


def _block_mask_arguments(block_mask: Any, seqlen_q: int, seqlen_k: int) -> dict:
    """mask_mod and the eight block lists of a FlexAttention BlockMask, as _prepare takes them."""
    lists = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
             "full_q_num_blocks", "full_q_indices")
    if not all(hasattr(block_mask, name) for name in lists + ("mask_mod", "BLOCK_SIZE")):
        _fail(TypeError, "block_mask", f"expected FlexAttention's BlockMask (torch.nn.attention.flex_attention."
                                       f"create_block_mask), got {type(block_mask).__name__}; cuflash's own block "
                                       f"lists go to flash_attn_func")
    sizes = tuple(int(x) for x in block_mask.BLOCK_SIZE)
    if len(sizes) != 2 or min(sizes) < 1:
        _fail(ValueError, "block_mask", f"BLOCK_SIZE must be two positive sizes, got {sizes}")
    lengths = getattr(block_mask, "seq_lengths", None)
    if lengths is not None and tuple(int(x) for x in lengths) != (seqlen_q, seqlen_k):
        _fail(ValueError, "block_mask", f"made for (Q_LEN, KV_LEN) = {tuple(lengths)}, but query and key have "
                                        f"{seqlen_q} and {seqlen_k} tokens")
    mask_cnt, mask_idx, full_cnt, full_idx, q_mask_cnt, q_mask_idx, q_full_cnt, q_full_idx = (
        getattr(block_mask, name) for name in lists)
    if getattr(block_mask.mask_mod, "__name__", "") == "_sliced_mask_mod_error":
        _fail(ValueError, "block_mask", "a sliced BlockMask (block_mask[...]) has no mask_mod to apply; pass the "
                                        "whole BlockMask, or one made for these sequences")
    mask_mod = None if _is_noop_mask(block_mask.mask_mod) else block_mask.mask_mod
    rows, cols = -(-seqlen_q // BLOCK_M), -(-seqlen_k // BLOCK_N)
    if sizes == (BLOCK_M, BLOCK_N) and _lists_fit(mask_idx, rows, cols) and _lists_fit(full_idx, rows, cols) and (
            _lists_fit(q_mask_idx, cols, rows) and _lists_fit(q_full_idx, cols, rows)):
        return dict(mask_mod=mask_mod, block_sparse=(mask_cnt, mask_idx, full_cnt, full_idx),
                    q_block_sparse=(q_mask_cnt, q_mask_idx, q_full_cnt, q_full_idx))
    # Other block sizes, or 128 x 128 lists of another extent (BlockMask.from_kv_blocks takes
    # lists longer or narrower than its seq_lengths' grid): converted, once per BlockMask.
    forward_lists = (mask_cnt, mask_idx, full_cnt, full_idx)
    versions = tuple(_version(t) for t in forward_lists)
    key = ((seqlen_q, seqlen_k, sizes), mask_mod, forward_lists, versions)
    # Lists without a version counter (inference tensors) cannot tell a change: not kept.
    keep = all(v is not None for t, v in zip(forward_lists, versions) if t is not None)
    cached = _converted_block_mask(block_mask, key) if keep else None
    if cached is None:
        cached = _regrid_block_mask(sizes, mask_mod, mask_cnt, mask_idx, full_cnt, full_idx, seqlen_q, seqlen_k)
        if keep:
            _remember_converted_block_mask(block_mask, key, cached)
    return dict(cached)


def _version(t: Optional[Tensor]) -> Optional[int]:
    """A tensor's version counter (bumped by every in-place change), None where it has none
    (inference-mode tensors raise on reading it)."""
    try:
        return None if t is None else int(t._version)
    except (AttributeError, RuntimeError):
        return None


def _lists_fit(idx: Optional[Tensor], rows: int, cols: int) -> bool:
    """Whether block lists (B, H, rows, cols) have the extents cuflash's 128 x 128 lists have."""
    return idx is None or (len(idx.shape) == 4 and tuple(int(x) for x in idx.shape[2:]) == (rows, cols))


# Converted BlockMasks, kept while the BlockMask lives: a model's layers (and training steps)
# reuse one BlockMask, whose conversion is a few dozen small device operations and a new
# mask_mod wrapper. The key holds the lengths and block sizes, the mask_mod and the lists
# themselves (compared by identity) with their versions, so lists replaced or changed in place
# by torch are converted again (a write torch does not see, through DLPack, is not noticed).
_CONVERTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _compiling() -> bool:
    import torch

    return bool(getattr(torch, "compiler", None) and torch.compiler.is_compiling())


def _converted_block_mask(block_mask: Any, key: tuple) -> Optional[dict]:
    if _compiling():
        return None
    try:
        entry = _CONVERTED.get(block_mask)
    except TypeError:  # neither weakly referenceable nor hashable: not cached
        return None
    if entry is None:
        return None
    (lengths, mask_mod, lists, versions), converted = entry
    same = (lengths == key[0] and mask_mod is key[1] and versions == key[3]
            and all(a is b for a, b in zip(lists, key[2])))
    return converted if same else None


def _remember_converted_block_mask(block_mask: Any, key: tuple, converted: dict) -> None:
    if _compiling():
        return
    try:
        _CONVERTED[block_mask] = (key, converted)
    except TypeError:
        pass


# Block states of a BlockMask's grid: skipped, partial (mask_mod applied), full.
_EMPTY, _PARTIAL, _FULL = 0, 1, 2


_SLAB_ENTRIES = 1 << 22


def _block_states(cnt: Tensor, idx: Tensor, cols: int, state: int, grid: Tensor) -> None:
    """Writes `state` into grid (B, H, rows, cols) at the blocks that (cnt, idx) list (entries past
    the grid, which lists made for longer sequences may hold, name no block here). No host
    synchronisation: a scatter of the greatest state, over slabs of rows so that the int64
    temporaries stay near _SLAB_ENTRIES entries whatever the lists' size."""
    import torch

    rows = min(int(cnt.shape[2]), int(grid.shape[2]))
    slab = max(1, _SLAB_ENTRIES // max(1, int(idx.shape[0]) * int(idx.shape[1]) * int(idx.shape[3])))
    slots = torch.arange(idx.shape[3], device=grid.device)
    for first in range(0, rows, slab):
        last = min(first + slab, rows)
        part_cnt = cnt[:, :, first:last].to(grid.device)
        part_idx = idx[:, :, first:last].to(grid.device).long()
        listed = (slots < part_cnt[..., None]) & (part_idx >= 0) & (part_idx < cols)
        grid[:, :, first:last].scatter_reduce_(3, torch.where(listed, part_idx, 0), (listed * state).to(grid.dtype),
                                               "amax")


def _cover(block: int, size: int, length: int, device: Any) -> Tuple[Tensor, Tensor, int]:
    """For each cuflash block (of `block` tokens) over `length` tokens, the first and last BlockMask
    block (of `size` tokens) that it overlaps, and the most it overlaps (on the host)."""
    import torch

    starts = range(0, length, block)
    span = max(((min(start + block, length) - 1) // size - start // size + 1 for start in starts), default=0)
    start = torch.arange(len(starts), device=device) * block
    end = torch.clamp(start + block, max=length) - 1
    return start // size, end // size, span


def _regrid(states: Tensor, axis: int, first: Tensor, last: Tensor, span: int, reduce: Callable) -> Tensor:
    """`reduce` (torch.minimum or torch.maximum) of the states over each new block's span [first,
    last] of old blocks along `axis` (spans are short: a cuflash block overlaps at most
    128 / size + 1 of them)."""
    import torch

    out = states.index_select(axis, first)
    for offset in range(1, span):
        out = reduce(out, states.index_select(axis, torch.minimum(first + offset, last)))
    return out


def _lists(grid: Tensor, state: int) -> Tuple[Tensor, Tensor]:
    """cnt (B, H, rows) and idx (B, H, rows, cols) int32 of the blocks in `state`, ascending."""
    import torch

    chosen = grid == state
    cnt = chosen.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    idx = torch.where(torch.arange(grid.shape[-1], device=grid.device) < cnt[..., None], idx, 0)
    return cnt.contiguous(), idx.contiguous()


def _regrid_block_mask(sizes: Tuple[int, int], mask_mod: Optional[Callable], mask_cnt: Tensor, mask_idx: Tensor,
                       full_cnt: Optional[Tensor], full_idx: Optional[Tensor], seqlen_q: int, seqlen_k: int) -> dict:
    """A BlockMask of other block sizes, as the lists of cuflash's 128 x 128 blocks and the mask_mod
    that keeps exactly what FlexAttention keeps: a cuflash block is full where every BlockMask
    block it overlaps is full, skipped where every one is skipped, partial otherwise. Where the
    BlockMask's blocks are multiples of 128, a partial block lies in one partial BlockMask block
    and the mask_mod alone decides (as in FlexAttention). Otherwise a partial block may overlap
    blocks of other states, so the mask_mod is wrapped to read each pair's BlockMask block state
    first (full: kept, skipped: not, partial: the mask_mod's answer), since a BlockMask's lists,
    not its mask_mod, decide the pairs of its full and unlisted blocks. Decided by the sizes, not
    by the lists' contents: nothing here waits for the device."""
    import torch

    size_q, size_k = sizes
    if seqlen_q == 0 or seqlen_k == 0:  # nothing to compute, nothing to list
        return dict(mask_mod=mask_mod)
    rows, cols = -(-seqlen_q // size_q), -(-seqlen_k // size_k)
    for cnt, idx in ((mask_cnt, mask_idx), (full_cnt, full_idx)):
        if cnt is None:
            continue
        if cnt.dim() != 3 or idx.dim() != 4 or tuple(idx.shape[:3]) != tuple(cnt.shape):
            _fail(ValueError, "block_mask", f"expected lists of shape (B, H, rows) and (B, H, rows, cols), got "
                                            f"{tuple(cnt.shape)} and {tuple(idx.shape)}")
        if tuple(cnt.shape[:2]) != tuple(mask_cnt.shape[:2]):
            _fail(ValueError, "block_mask", f"its full lists have batch and heads {tuple(cnt.shape[:2])}, its "
                                            f"partial lists {tuple(mask_cnt.shape[:2])}: they must match")
    batch, heads = int(mask_cnt.shape[0]), int(mask_cnt.shape[1])
    states = torch.zeros((batch, heads, rows, cols), dtype=torch.int8, device=mask_cnt.device)
    _block_states(mask_cnt, mask_idx, cols, _PARTIAL, states)
    if full_cnt is not None:
        _block_states(full_cnt, full_idx, cols, _FULL, states)
    row_first, row_last, row_span = _cover(BLOCK_M, size_q, seqlen_q, states.device)
    col_first, col_last, col_span = _cover(BLOCK_N, size_k, seqlen_k, states.device)
    low, high = (_regrid(_regrid(states, 2, row_first, row_last, row_span, reduce), 3, col_first, col_last,
                         col_span, reduce) for reduce in (torch.minimum, torch.maximum))
    grid = torch.where(low == _FULL, _FULL, torch.where(high == _EMPTY, _EMPTY, _PARTIAL)).to(torch.int8)
    if size_q % BLOCK_M or size_k % BLOCK_N:
        mask_mod = _reading_block_states(states, mask_mod, size_q, size_k)
    full_cnt, full_idx = _lists(grid, _FULL)
    mask_cnt, mask_idx = _lists(grid, _PARTIAL)
    by_col = grid.transpose(2, 3)
    q_full_cnt, q_full_idx = _lists(by_col, _FULL)
    q_mask_cnt, q_mask_idx = _lists(by_col, _PARTIAL)
    return dict(mask_mod=mask_mod, block_sparse=(mask_cnt, mask_idx, full_cnt, full_idx),
                q_block_sparse=(q_mask_cnt, q_mask_idx, q_full_cnt, q_full_idx))


def _reading_block_states(states: Tensor, mask_mod: Optional[Callable], size_q: int, size_k: int) -> Callable:
    """mask_mod wrapped to keep a pair by its BlockMask block's state (states (B, H, rows, cols), B
    and H possibly 1): full kept, skipped not, partial as mask_mod says (None: kept)."""
    import torch

    batch, heads = int(states.shape[0]), int(states.shape[1])
    # Batch and head share the first dimension, so that either may be broadcast (size 1).
    table = states.to(torch.int32).reshape(batch * heads, states.shape[2], states.shape[3]).contiguous()

    def block_state_mask(b, h, q_idx, kv_idx):
        slot = (b * heads if batch > 1 else 0) + (h if heads > 1 else 0)
        state = table[slot, q_idx // size_q, kv_idx // size_k]
        if mask_mod is None:
            return state != _EMPTY
        return (state == _FULL) | ((state == _PARTIAL) & mask_mod(b, h, q_idx, kv_idx))

    return block_state_mask


def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod: Optional[Callable] = None,
                   block_mask: Any = None, scale: Optional[float] = None, enable_gqa: bool = False,
                   return_lse: bool = False, kernel_options: Optional[dict] = None, *,
                   return_aux: Any = None):
    """FlexAttention's flex_attention: softmax(score_mod(query @ key^T * scale)) @ value over the
    pairs block_mask keeps.

    Args:
        query: (B, Hq, L, E); key: (B, Hkv, S, E); value: (B, Hkv, S, Ev); float16 or bfloat16.
            Any strides with a contiguous last dimension.
        score_mod: score_mod(score, b, h, q_idx, kv_idx) -> new score (cuflash.mods), or None.
        block_mask: FlexAttention's BlockMask (its mask_mod is applied in the blocks it lists as
            partial), or None (every pair). Block sizes other than 128 x 128 (and 128 x 128
            lists of another extent than the sequences' grid) are converted on the BlockMask's
            device at its first call, and the conversion kept while the BlockMask and its lists
            stay the same (sizes that are not multiples of 128 also wrap the mask_mod to read
            each pair's block state); make it with BLOCK_SIZE=128 to skip that.
        scale: the score's scale; default 1 / sqrt(E).
        enable_gqa: Hq may be a multiple of Hkv (grouped-query attention); else they must match.
        return_lse: also return the log-sum-exp of the scores (B, Hq, L), float32, natural log.
        kernel_options: None; cuflash picks its own tiles (FlexAttention's Triton options have
            no meaning here and are refused rather than ignored).
        return_aux: FlexAttention's AuxRequest: lse=True returns the lse in an AuxOutput;
            max_scores is not computed by cuflash's kernels (NotImplementedError).

    Returns:
        out (B, Hq, L, Ev) in query's dtype: a (B, L, Hq, Ev) buffer seen through a transpose,
        so that ``out.transpose(1, 2).reshape(B, L, -1)`` is free; rows that see no key are 0.
        With return_lse, (out, lse); with return_aux, (out, AuxOutput) as FlexAttention does.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if len(getattr(x, "shape", ())) != 4:
            _fail(ValueError, name, f"expected 4 dimensions (batch, heads, seqlen, head_dim), got shape "
                                    f"{tuple(getattr(x, 'shape', ()))}")
    (batch, heads, seqlen_q, dim), (batch_k, heads_kv, seqlen_k, dim_k) = (
        tuple(int(x) for x in t.shape) for t in (query, key))
    if batch_k != batch or dim_k != dim:
        _fail(ValueError, "key", f"expected shape ({batch}, Hkv, S, {dim}) (batch and head_dim of query, "
                                 f"no broadcasting), got {tuple(key.shape)}")
    if tuple(int(x) for x in value.shape[:3]) != (batch, heads_kv, seqlen_k):
        _fail(ValueError, "value", f"expected shape ({batch}, {heads_kv}, {seqlen_k}, Ev) (batch, heads and "
                                   f"seqlen of key), got {tuple(value.shape)}")
    if heads != heads_kv and not enable_gqa:
        _fail(ValueError, "enable_gqa", f"query has {heads} heads and key {heads_kv}: pass enable_gqa=True for "
                                        f"grouped-query attention")
    if kernel_options is not None:
        _fail(ValueError, "kernel_options", "cuflash picks its own tiles and pipelines; pass None")
    want_lse = bool(return_lse)
    if return_aux is not None:
        if return_lse:
            _fail(ValueError, "return_aux", "give return_aux or return_lse, not both")
        if getattr(return_aux, "max_scores", False):
            _fail(NotImplementedError, "return_aux",
                  "max_scores is not computed by cuflash's kernels; ask for lse only")
        want_lse = bool(getattr(return_aux, "lse", False))
    # cuflash's layout is (batch, seqlen, heads, head_dim): the same memory seen through a swap.
    q, k, v = (x.swapaxes(1, 2) for x in (query, key, value))
    masking = {}
    if block_mask is not None:
        masking = _block_mask_arguments(block_mask, seqlen_q, seqlen_k)
    call = _interface._prepare(q, k, v, softmax_scale=scale, score_mod=score_mod, **masking)
    out, lse = _interface._attention(call)
    out = out.swapaxes(1, 2)
    if return_aux is not None:
        return out, _aux_output(lse if want_lse else None, call.framework.name)
    return (out, lse) if want_lse else out


def _aux_output(lse: Optional[Tensor], framework_name: str):
    """torch's AuxOutput for torch tensors (where torch has one), cuflash's otherwise."""
    if framework_name != "torch":
        return AuxOutput(lse=lse)
    try:
        from torch.nn.attention.flex_attention import AuxOutput as TorchAuxOutput
    except ImportError:
        return AuxOutput(lse=lse)
    return TorchAuxOutput(lse=lse)
