"""FlexAttention's interface: ``torch.nn.attention.flex_attention.flex_attention`` on cuflash.

    >>> from cuflash.flex import flex_attention
    >>> out = flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask)

Tensors are (batch, heads, seqlen, head_dim), as FlexAttention's. score_mod and the block mask's
mask_mod are Python callables traced by cuflash (cuflash.mods: what they may use); the block
mask is FlexAttention's BlockMask (``torch.nn.attention.flex_attention.create_block_mask``,
128 x 128 blocks), whose lists cuflash reads as they are, the backward's (q_*) lists included.
Under torch autograd, out (and lse) are differentiable with respect to query, key and value.
NumPy and JAX arrays work as with the other functions (JAX under jax.jit and jax.grad too),
without a block mask (BlockMask is torch's).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

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
    if sizes != (BLOCK_M, BLOCK_N):
        _fail(ValueError, "block_mask", f"cuflash reads block lists of {BLOCK_M} x {BLOCK_N} blocks, got BLOCK_SIZE "
                                        f"{sizes}; create the BlockMask with BLOCK_SIZE=128")
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
    return dict(mask_mod=mask_mod, block_sparse=(mask_cnt, mask_idx, full_cnt, full_idx),
                q_block_sparse=(q_mask_cnt, q_mask_idx, q_full_cnt, q_full_idx))


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
        block_mask: FlexAttention's BlockMask with 128 x 128 blocks (its mask_mod is applied in
            the blocks it lists as partial), or None (every pair).
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
        return out, _aux_output(lse if want_lse else None)
    return (out, lse) if want_lse else out


def _aux_output(lse: Optional[Tensor]):
    try:
        from torch.nn.attention.flex_attention import AuxOutput as TorchAuxOutput
    except ImportError:
        return AuxOutput(lse=lse)
    return TorchAuxOutput(lse=lse)
