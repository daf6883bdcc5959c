"""flash_attn_with_kvcache: new keys appended into a dense or paged cache in place, then attention
over what each sequence holds, against the NumPy float64 reference on the concatenated keys."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
import attention_reference as ref
from conftest import assert_close, assert_lse_close, randn

BATCH, HEADS, HEADS_KV, DIM = 3, 4, 2, 32


def make_case(rng, paged, seqlen_new, page_size=16, max_pages=6):
    """q, caches (with the page table when paged), new keys, lengths, and per sequence the keys
    the attention must see (the cache's first lengths[b] then the new ones)."""
    capacity = max_pages * page_size
    lengths = np.array([0, 37, capacity - seqlen_new], np.int32)
    q = randn(rng, (BATCH, max(seqlen_new, 1), HEADS, DIM))
    keys = [randn(rng, (lengths[b], HEADS_KV, DIM)) for b in range(BATCH)]
    values = [randn(rng, (lengths[b], HEADS_KV, DIM)) for b in range(BATCH)]
    k_new, v_new = randn(rng, (BATCH, seqlen_new, HEADS_KV, DIM)), randn(rng, (BATCH, seqlen_new, HEADS_KV, DIM))
    junk = np.float16(7.0)  # positions past the lengths: must not be read, must stay as they were
    if paged:
        num_pages = BATCH * max_pages + 2
        table = rng.permutation(num_pages)[: BATCH * max_pages].reshape(BATCH, max_pages).astype(np.int32)
        k_cache = np.full((num_pages, page_size, HEADS_KV, DIM), junk, np.float16)
        v_cache = k_cache.copy()
        for b in range(BATCH):
            for j in range(lengths[b]):
                page, slot = table[b, j // page_size], j % page_size
                k_cache[page, slot], v_cache[page, slot] = keys[b][j], values[b][j]
    else:
        table = None
        k_cache = np.full((BATCH, capacity, HEADS_KV, DIM), junk, np.float16)
        v_cache = k_cache.copy()
        for b in range(BATCH):
            k_cache[b, : lengths[b]], v_cache[b, : lengths[b]] = keys[b], values[b]
    seen = [(np.concatenate([keys[b], k_new[b]]), np.concatenate([values[b], v_new[b]])) for b in range(BATCH)]
    return q, k_cache, v_cache, k_new, v_new, lengths, table, seen


def cache_rows(cache, table, b, count, page_size):
    """The first `count` positions of sequence b in a dense or paged cache."""
    if table is None:
        return cache[b, :count]
    return np.stack([cache[table[b, j // page_size], j % page_size] for j in range(count)]) if count else cache[:0, 0]


def expected_attention(q, seen, opts):
    outs, lses = [], []
    for b, (keys, values) in enumerate(seen):
        out, lse = ref.forward_dense(q[b:b + 1], keys[None], values[None], opts)
        outs.append(out[0])
        lses.append(lse[0])
    return np.stack(outs), np.stack(lses)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("seqlen_new", [1, 5])
def test_append_then_attend_numpy(rng, paged, seqlen_new):
    q, k_cache, v_cache, k_new, v_new, lengths, table, seen = make_case(rng, paged, seqlen_new)
    before = k_cache.copy()
    out, lse = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths,
                                               page_table=table, causal=True, return_softmax_lse=True)
    expected_out, expected_lse = expected_attention(q, seen, ref.Options(causal=True))
    assert_close(out, expected_out, what="out")
    assert_lse_close(lse, expected_lse)
    page_size = k_cache.shape[1]
    for b in range(BATCH):
        rows = cache_rows(k_cache, table, b, lengths[b] + seqlen_new, page_size)
        np.testing.assert_array_equal(rows, seen[b][0])
        np.testing.assert_array_equal(cache_rows(v_cache, table, b, lengths[b] + seqlen_new, page_size), seen[b][1])
    # Nothing but the appended positions changed.
    assert int(np.sum(np.any(k_cache != before, axis=(-1, -2)))) <= BATCH * seqlen_new


def test_cache_as_it_is_and_an_int_length(rng):
    # No k / v: attention over the first cache_seqlens keys (an int: every sequence), with a
    # window and softcap; then None: the whole cache.
    q, k_cache, v_cache, _, _, _, _, _ = make_case(rng, False, 1)
    k_cache[:] = randn(rng, k_cache.shape)
    v_cache[:] = randn(rng, v_cache.shape)
    out = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=50, window_size=(20, 0), softcap=10.0)
    expected, _ = ref.forward_dense(q, k_cache[:, :50], v_cache[:, :50],
                                    ref.Options(window=(20, 0), softcap=10.0))
    assert_close(out, expected, what="out")
    out = cuflash.flash_attn_with_kvcache(q, k_cache, v_cache)
    expected, _ = ref.forward_dense(q, k_cache, v_cache, ref.Options())
    assert_close(out, expected, what="out, whole cache")


def test_torch_append_under_autograd(rng):
    torch = pytest.importorskip("torch")
    q, k_cache, v_cache, k_new, v_new, lengths, table, seen = make_case(rng, True, 3)
    tq = torch.from_numpy(q.astype(np.float32)).bfloat16().requires_grad_()
    tk_cache, tv_cache = (torch.from_numpy(c.astype(np.float32)).bfloat16() for c in (k_cache, v_cache))
    tk, tv = (torch.from_numpy(x.astype(np.float32)).bfloat16().requires_grad_() for x in (k_new, v_new))
    out = cuflash.flash_attn_with_kvcache(tq, tk_cache, tv_cache, k=tk, v=tv, cache_seqlens=torch.from_numpy(lengths),
                                          page_table=torch.from_numpy(table), causal=True)
    expected, _ = expected_attention(q, seen, ref.Options(causal=True))
    assert_close(out.detach().float().numpy(), expected, "bfloat16", what="out")
    # The new keys reach the output through the cache: their gradient flows.
    out.float().sum().backward()
    assert tq.grad is not None and tk.grad is not None and float(tk.grad.abs().sum()) > 0


def test_errors_name_the_argument(rng):
    q, k_cache, v_cache, k_new, v_new, lengths, _, _ = make_case(rng, False, 2)
    with pytest.raises(ValueError, match="^v: k and v are given together"):
        cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new)
    with pytest.raises(ValueError, match="^cache_seqlens: appending k / v needs"):
        cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new)
    with pytest.raises(ValueError, match=r"^cache_seqlens: expected lengths in \[0, 94\]"):
        cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths + 1)
    negative = lengths.copy()
    negative[-1] = -3
    # The entry out of range is named, not the largest one.
    named = rf"^cache_seqlens: expected lengths in \[0, 94\].*got cache_seqlens\[{len(lengths) - 1}\] = -3$"
    with pytest.raises(ValueError, match=named):
        cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=negative)
    with pytest.raises(ValueError, match="^cache_seqlens: 95 keys plus 2 new ones exceed"):
        cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=95)
    with pytest.raises(ValueError, match="^k: expected shape"):
        cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new[:, :, :1], v=v_new, cache_seqlens=lengths)
    with pytest.raises(TypeError, match="^k: expected the cache's dtype"):
        cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new.astype(np.float32), v=v_new,
                                        cache_seqlens=lengths)
    k_cache.flags.writeable = False
    with pytest.raises(ValueError, match="^k_cache: is read-only"):
        cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths)


def test_refused_calls_leave_the_cache(rng):
    # The attention's checks run before anything is appended; its errors about the caches name
    # them (k and v are the new keys here).
    q, k_cache, v_cache, k_new, v_new, lengths, table, _ = make_case(rng, True, 2)
    before = (k_cache.copy(), v_cache.copy())
    with pytest.raises(ValueError, match="^softcap"):
        cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths,
                                        page_table=table, softcap=-1.0)
    with pytest.raises(ValueError, match="^page_table"):
        cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths,
                                        page_table=table + 1000)
    np.testing.assert_array_equal(k_cache, before[0])
    np.testing.assert_array_equal(v_cache, before[1])
    q, k_cache, v_cache, k_new, v_new, lengths, _, _ = make_case(rng, False, 2)
    with pytest.raises(ValueError, match="^k_cache: "):
        cuflash.flash_attn_with_kvcache(q[..., :16], k_cache, v_cache, cache_seqlens=lengths)
