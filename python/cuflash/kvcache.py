"""Decoding with a KV cache: new keys and values appended into the cache, then attention over it.

    >>> out = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
    ...                                       cache_seqlens=lengths, causal=True)

The cache is dense, (batch, max_seqlen, heads_kv, head_dim), or paged, (num_pages, page_size,
heads_kv, head_dim) with a page table (batch, max_pages). `cache_seqlens` says how many keys each
sequence holds before the call; the new keys of sequence b go to positions cache_seqlens[b] ..
cache_seqlens[b] + seqlen_new - 1 (in place, by the framework's own indexed store on the
cache's device: no host synchronisation, nothing read back), and the queries attend to the
cache_seqlens[b] + seqlen_new keys that then hold (the attention is flash_attn_varlen_func with
seqused_k and the page table; causal masks align bottom-right, so the new queries are the last
rows). torch, NumPy and CuPy arrays; JAX arrays are immutable: without k / v only (append with
jax.Array.at[...].set, which is functional).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import interface as _interface
from ._tensors import framework_of, loaded_module

__all__ = ["flash_attn_with_kvcache"]

Tensor = Any
_fail = _interface._fail
_shape = _interface._shape


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    cache_seqlens: Any = None,
    page_table: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    learnable_sink: Optional[Tensor] = None,
    softcap: float = 0.0,
    num_splits: int = 0,
    pack_gqa: Optional[bool] = None,
    return_softmax_lse: bool = False,
):
    """Appends k / v into the cache at cache_seqlens, then attends q over the cache.

    Args:
        q: (batch, seqlen_q, num_heads, head_dim), float16 or bfloat16.
        k_cache, v_cache: (batch, max_seqlen, num_heads_kv, head_dim / head_dim_v), or with
            page_table (num_pages, page_size, num_heads_kv, head_dim / head_dim_v); written in
            place where k / v are given.
        k, v: (batch, seqlen_new, num_heads_kv, head_dim / head_dim_v) new keys and values, or
            None (attention over the cache as it is).
        cache_seqlens: keys each sequence holds before the call: an int (every sequence), a
            (batch,) int32 tensor on q's device, or None (the whole cache, without k / v).
        page_table: (batch, max_pages) int32 page numbers into the caches.
        softmax_scale, causal, window_size, learnable_sink, softcap, pack_gqa: as in
            flash_attn_func.
        num_splits: split-KV count; <= 0 (the default here, as decoding wants) picks one by
            heuristic.
        return_softmax_lse: also return the lse (batch, num_heads, seqlen_q), float32.

    Returns:
        out (batch, seqlen_q, num_heads, head_dim_v), or (out, lse) with return_softmax_lse.

    The positions written must lie in the cache: cache_seqlens[b] + seqlen_new <= max_seqlen (or
    max_pages * page_size). Checked where cache_seqlens is an int or in host memory; in device
    memory it is trusted (CUFLASH_CHECK_INPUTS=1 checks the attention's seqused_k), and a page
    table's entries for the positions written must name pages of the pool.
    """
    framework = _interface._check_tensor(q, "q")
    for tensor, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        _interface._check_tensor(tensor, name, framework)
    if framework.name == "jax" and k is not None:
        _fail(TypeError, "k_cache", "JAX arrays are immutable and cannot be appended to in place: append with "
                                    "k_cache.at[...].set(k), then call flash_attn_varlen_func with seqused_k "
                                    "(or call this without k / v)")
    if (k is None) != (v is None):
        _fail(ValueError, "k" if k is None else "v", "k and v are given together (new keys and their values)")
    if len(_shape(q)) != 4:
        _fail(ValueError, "q", f"expected (batch, seqlen_q, num_heads, head_dim), got shape {_shape(q)}")
    batch = _shape(q)[0]
    paged = page_table is not None
    for tensor, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if len(_shape(tensor)) != 4:
            layout = "(num_pages, page_size" if paged else "(batch, max_seqlen"
            _fail(ValueError, name, f"expected {layout}, num_heads_kv, head_dim), got shape {_shape(tensor)}")
    if paged:
        _interface._check_tensor(page_table, "page_table", framework)
        if len(_shape(page_table)) != 2 or _shape(page_table)[0] != batch:
            _fail(ValueError, "page_table", f"expected shape ({batch}, max_pages), got {_shape(page_table)}")
        capacity = _shape(page_table)[1] * _shape(k_cache)[1]
    else:
        if _shape(k_cache)[0] != batch:
            _fail(ValueError, "k_cache", f"expected {batch} sequences (q's batch), got shape {_shape(k_cache)}")
        capacity = _shape(k_cache)[1]
    seqlen_new = 0
    if k is not None:
        for new, cache, name in ((k, k_cache, "k"), (v, v_cache, "v")):
            _interface._check_tensor(new, name, framework)
            expected = (batch, None) + tuple(_shape(cache)[2:])
            got = _shape(new)
            if len(got) != 4 or got[0] != batch or got[2:] != expected[2:]:
                _fail(ValueError, name, f"expected shape ({batch}, seqlen_new, {expected[2]}, {expected[3]}) (q's "
                                        f"batch, the cache's heads and head dim), got {got}")
            if framework.dtype(new) != framework.dtype(cache):
                _fail(TypeError, name, f"expected the cache's dtype {framework.dtype(cache)}, got "
                                       f"{framework.dtype(new)}")
        if _shape(v)[1] != _shape(k)[1]:
            _fail(ValueError, "v", f"expected {_shape(k)[1]} new rows (k's), got {_shape(v)[1]}")
        seqlen_new = _shape(k)[1]
        if cache_seqlens is None:
            _fail(ValueError, "cache_seqlens", "appending k / v needs the lengths the caches hold (where to write)")
    lengths = _cache_lengths(framework, cache_seqlens, batch, q, capacity, seqlen_new)
    if lengths is None:
        seqused_k = None
    else:
        seqused_k = lengths if seqlen_new == 0 else _add(framework, lengths, seqlen_new)

    def prepare():
        return _named_for_caches(lambda: _interface._prepare(
            q, k_cache, v_cache, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            learnable_sink=learnable_sink, softcap=softcap, num_splits=num_splits, pack_gqa=pack_gqa,
            seqused_k=seqused_k, page_table=page_table))

    # Every check of the attention runs before the caches are written: a call that is refused
    # leaves them as they were.
    call = prepare()
    if page_table is not None and seqused_k is not None:
        _check_pages(framework, page_table, seqused_k, _shape(k_cache)[0], _shape(k_cache)[1])
    if k is not None and seqlen_new > 0:
        _append(framework, k_cache, v_cache, k, v, lengths, page_table, seqlen_new)
        if call.k is not k_cache or call.v is not v_cache:  # the attention reads copies: made again
            call = prepare()
    out, lse = _interface._attention(call)
    return (out, lse) if return_softmax_lse else out


def _named_for_caches(prepare: Any) -> Any:
    """prepare(), with the attention's errors about its k / v named as this function's caches
    (k and v are the new keys here)."""
    try:
        return prepare()
    except (TypeError, ValueError, NotImplementedError) as error:
        message = str(error)
        for name in ("k", "v"):
            if message.startswith(f"{name}: "):
                raise type(error)(f"{name}_cache: {message[len(name) + 2:]}") from None
        raise


def _cache_lengths(framework: Any, cache_seqlens: Any, batch: int, q: Tensor, capacity: int,
                   seqlen_new: int) -> Optional[Tensor]:
    """cache_seqlens as a (batch,) int32 tensor of q's framework and device (None: none given),
    checked against the capacity where its values are on the host."""
    if cache_seqlens is None:
        return None
    if framework_of(cache_seqlens) is None:
        length = _interface._check_int(cache_seqlens, "cache_seqlens", minimum=0)
        if length + seqlen_new > capacity:
            _fail(ValueError, "cache_seqlens", f"{length} keys plus {seqlen_new} new ones exceed the cache's "
                                               f"{capacity} positions")
        return framework.from_numpy(np.full((batch,), length, np.int32), like=q)
    lengths = _interface._index_tensor(framework, cache_seqlens, "cache_seqlens", (batch,),
                                       framework.device(q), "(batch,)")
    if framework.device(lengths)[0] == "cpu":
        host = framework.to_numpy(lengths)
        if np.any(host < 0) or np.any(host.astype(np.int64) + seqlen_new > capacity):
            # The first entry out of range, whichever side.
            worst = int(np.argmax((host < 0) | (host.astype(np.int64) + seqlen_new > capacity)))
            _fail(ValueError, "cache_seqlens", f"expected lengths in [0, {capacity - seqlen_new}] (the cache's "
                                               f"{capacity} positions less {seqlen_new} new keys), got "
                                               f"cache_seqlens[{worst}] = {int(host[worst])}")
    return lengths


def _check_pages(framework: Any, page_table: Tensor, used: Tensor, num_pages: int, page_size: int) -> None:
    """The pages each sequence's used keys lie in name pages of the pool, where the table and
    the lengths are in host memory (the attention checks them only after the append)."""
    if framework.device(page_table)[0] != "cpu":
        return
    table, used = framework.to_numpy(page_table), framework.to_numpy(used).astype(np.int64)
    for b in range(table.shape[0]):
        pages = table[b, : -(-int(used[b]) // page_size)]
        bad = np.flatnonzero((pages < 0) | (pages >= num_pages))
        if bad.size:
            _fail(ValueError, "page_table", f"expected page_table[{b}, {int(bad[0])}] in [0, num_pages = {num_pages}) "
                                            f"(a page sequence {b} uses), got {int(pages[bad[0]])}")


def _add(framework: Any, lengths: Tensor, count: int) -> Tensor:
    """lengths + count, int32, on the lengths' device."""
    if framework.name == "torch":
        return (lengths + count).to(lengths.dtype)
    return (lengths + np.int32(count)).astype(np.int32)


def _append(framework: Any, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, lengths: Tensor,
            page_table: Optional[Tensor], seqlen_new: int) -> None:
    """k_cache / v_cache at (sequence b, position lengths[b] + j) = k / v[b, j], in place."""
    batch = _shape(k)[0]
    if framework.name == "torch":
        import torch

        device = k_cache.device
        seq = torch.arange(batch, device=device)[:, None].expand(batch, seqlen_new)
        pos = lengths.to(device).long()[:, None] + torch.arange(seqlen_new, device=device)[None, :]
        if page_table is None:
            index = (seq, pos)
        else:
            page_size = k_cache.shape[1]
            index = (page_table.to(device).long()[seq, pos // page_size], pos % page_size)
        k_cache.index_put_(index, k)
        v_cache.index_put_(index, v)
        return
    xp = np if framework.name == "numpy" else loaded_module("cupy")
    if framework.name == "numpy":
        for cache, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
            if not cache.flags.writeable:
                _fail(ValueError, name, "is read-only; appending writes into it")
    seq = xp.broadcast_to(xp.arange(batch)[:, None], (batch, seqlen_new))
    pos = lengths.astype(xp.int64)[:, None] + xp.arange(seqlen_new)[None, :]
    if page_table is None:
        index = (seq, pos)
    else:
        page_size = _shape(k_cache)[1]
        index = (page_table.astype(xp.int64)[seq, pos // page_size], pos % page_size)
    k_cache[index] = k
    v_cache[index] = v
