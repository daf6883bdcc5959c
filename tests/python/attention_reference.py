"""NumPy float64 attention, forward and backward: the oracle of the Python tests.

Written from the definitions (DESIGN.md section 1), independently of the C++ reference. All
positions are per sequence; causal / window masks are bottom-right aligned, mask_mod and
score_mod indices top-left, as in FlexAttention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

BLOCK = 128


@dataclass
class Options:
    scale: Optional[float] = None
    causal: bool = False
    window: Tuple[Optional[int], Optional[int]] = (None, None)
    softcap: float = 0.0
    sink: Optional[np.ndarray] = None  # (H,)
    # (b, h, q_idx, kv_idx) -> additive bias (arrays broadcast to (H, Sq, Sk)).
    score_bias: Optional[Callable] = None
    # (b, q_idx, kv_idx) -> keep (bool arrays broadcast to (Sq, Sk)).
    mask: Optional[Callable] = None
    # (b, h) -> (full, partial) bool (Sq, Sk) block-sparse masks; None: no block sparsity.
    blocks: Optional[Callable] = None
    # FlexAttention callables, called with NumPy arrays that broadcast to (H, Sq, Sk):
    # score_mod(score, b, h, q_idx, kv_idx, *aux) -> score; mask_mod(b, h, q_idx, kv_idx, *aux)
    # -> keep. b is a Python int (one sequence at a time). The backward's d score_mod / d score
    # comes from central differences.
    score_mod: Optional[Callable] = None
    mask_mod: Optional[Callable] = None
    aux: Tuple = ()


def _f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def _scores(q, k, b: int, opts: Options):
    """Raw scaled scores, final scores and visibility for one sequence: q (Sq, H, D), k (Sk, Hkv, D)."""
    sq, heads, dim = q.shape
    sk, heads_kv = k.shape[:2]
    kk = np.repeat(k, heads // heads_kv, axis=1)
    scale = opts.scale if opts.scale is not None else 1.0 / np.sqrt(dim)
    raw = np.einsum("ihd,jhd->hij", q, kk) * scale
    tanh = None
    s = raw
    if opts.softcap:
        tanh = np.tanh(raw / opts.softcap)
        s = opts.softcap * tanh
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    h = np.arange(heads)[:, None, None]
    if opts.score_bias is not None:
        s = s + opts.score_bias(b, h, i[None], j[None])
    mod_grad = None
    if opts.score_mod is not None:
        def apply(x):
            with np.errstate(all="ignore"):
                return np.broadcast_to(np.asarray(opts.score_mod(x, b, h, i[None], j[None], *opts.aux),
                                                  dtype=np.float64), x.shape)
        step = 1e-6 * np.maximum(1.0, np.abs(s))
        with np.errstate(all="ignore"):
            mod_grad = (apply(s + step) - apply(s - step)) / (2 * step)
        s = apply(s)
    visible = np.ones((heads, sq, sk), dtype=bool)
    shift = sk - sq
    left, right = opts.window
    if opts.causal:
        right = 0 if right is None or right < 0 else min(right, 0)
    if right is not None and right >= 0:
        visible &= (j <= i + shift + right)[None]
    if left is not None and left >= 0:
        visible &= (j >= i + shift - left)[None]
    mask = np.ones((sq, sk), dtype=bool) if opts.mask is None else np.broadcast_to(opts.mask(b, i, j), (sq, sk))
    if opts.mask_mod is not None:
        mask = mask[None] & np.broadcast_to(np.asarray(opts.mask_mod(b, h, i[None], j[None], *opts.aux), dtype=bool),
                                            (heads, sq, sk))
    mask = np.broadcast_to(mask, (heads, sq, sk))
    if opts.blocks is None:
        visible &= mask
    else:
        for head in range(heads):
            full, partial = opts.blocks(b, head)
            visible[head] &= full[:sq, :sk] | (partial[:sq, :sk] & mask[head])
    if mod_grad is not None:
        tanh = (tanh, mod_grad)
    return raw, tanh, s, visible


def forward_one(q, k, v, b: int, opts: Options):
    """out (Sq, H, Dv), lse (H, Sq) for one sequence (float64)."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    heads = q.shape[1]
    vv = np.repeat(v, heads // k.shape[1], axis=1)
    _, _, s, visible = _scores(q, k, b, opts)
    s = np.where(visible, s, -np.inf)
    row_max = s.max(axis=-1, initial=-np.inf)
    if opts.sink is not None:
        row_max = np.maximum(row_max, _f64(opts.sink)[:, None])
    safe_max = np.where(np.isfinite(row_max), row_max, 0.0)
    total = np.exp(s - safe_max[..., None]).sum(axis=-1)
    if opts.sink is not None:
        total = total + np.exp(_f64(opts.sink)[:, None] - safe_max)
    with np.errstate(divide="ignore"):
        lse = np.log(total) + safe_max
    p = np.where(np.isfinite(lse)[..., None], np.exp(s - np.where(np.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    out = np.einsum("hij,jhd->ihd", p, vv)
    return out, lse


def backward_one(dout, q, k, v, out, b: int, opts: Options, dlse=None):
    """dq, dk, dv, d_sink for one sequence, from the forward's inputs and out (float64); dlse (H,
    Sq): the gradient of lse, for a loss that uses lse too (d lse_i / d s_ij = p_ij)."""
    q, k, v, out, dout = _f64(q), _f64(k), _f64(v), _f64(out), _f64(dout)
    heads, heads_kv = q.shape[1], k.shape[1]
    group = heads // heads_kv
    kk = np.repeat(k, group, axis=1)
    vv = np.repeat(v, group, axis=1)
    _, lse = forward_one(q, k, v, b, opts)
    _, tanh, s, visible = _scores(q, k, b, opts)
    mod_grad = None
    if isinstance(tanh, tuple):
        tanh, mod_grad = tanh
    s = np.where(visible, s, -np.inf)
    finite = np.isfinite(lse)
    p = np.where(finite[..., None], np.exp(s - np.where(finite, lse, 0.0)[..., None]), 0.0)
    dp = np.einsum("ihd,jhd->hij", dout, vv)
    delta = np.einsum("ihd,ihd->hi", dout, out)
    if dlse is not None:
        delta = delta - np.where(finite, _f64(dlse), 0.0)
    ds = p * (dp - delta[..., None])
    if mod_grad is not None:
        ds = np.where(p > 0, ds * mod_grad, 0.0)
    if opts.softcap:
        ds = ds * (1.0 - tanh**2)
    scale = opts.scale if opts.scale is not None else 1.0 / np.sqrt(q.shape[2])
    dq = np.einsum("hij,jhd->ihd", ds, kk) * scale
    dk = np.einsum("hij,ihd->jhd", ds, q) * scale
    dv = np.einsum("hij,ihd->jhd", p, dout)
    sk = k.shape[0]
    dk = dk.reshape(sk, heads_kv, group, dk.shape[-1]).sum(axis=2)
    dv = dv.reshape(sk, heads_kv, group, dv.shape[-1]).sum(axis=2)
    d_sink = None
    if opts.sink is not None:
        p_sink = np.where(finite, np.exp(_f64(opts.sink)[:, None] - np.where(finite, lse, 0.0)), 0.0)
        d_sink = -(p_sink * delta).sum(axis=-1)
    return dq, dk, dv, d_sink


def forward_dense(q, k, v, opts: Options):
    """q (B, Sq, H, D) ... -> out (B, Sq, H, Dv), lse (B, H, Sq)."""
    outs, lses = zip(*(forward_one(q[b], k[b], v[b], b, opts) for b in range(q.shape[0])))
    return np.stack(outs), np.stack(lses)


def backward_dense(dout, q, k, v, out, opts: Options, dlse=None):
    parts = [backward_one(dout[b], q[b], k[b], v[b], out[b], b, opts, None if dlse is None else dlse[b])
             for b in range(q.shape[0])]
    dq, dk, dv = (np.stack([p[i] for p in parts]) for i in range(3))
    d_sink = None if opts.sink is None else np.sum([p[3] for p in parts], axis=0)
    return dq, dk, dv, d_sink


def sequences(cu_seqlens: Sequence[int], seqused: Optional[Sequence[int]] = None) -> List[Tuple[int, int]]:
    """(start, used length) of each packed sequence."""
    spans = []
    for b in range(len(cu_seqlens) - 1):
        start, end = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        length = end - start if seqused is None else int(seqused[b])
        spans.append((start, length))
    return spans


def backward_packed(dout, q, k, v, out, cu_seqlens_q, cu_seqlens_k, opts: Options, dlse=None):
    """dq, dk, dv (and None for d_sink) of packed sequences (q (total_q, H, D), lse and dlse
    (H, total_q)), sequence by sequence; rows outside every sequence get 0."""
    grads = [np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape), None]
    for b, ((q0, sq), (k0, sk)) in enumerate(zip(sequences(cu_seqlens_q), sequences(cu_seqlens_k))):
        rows, keys = slice(q0, q0 + sq), slice(k0, k0 + sk)
        dq, dk, dv, _ = backward_one(dout[rows], q[rows], k[keys], v[keys], out[rows], b, opts,
                                     None if dlse is None else dlse[:, rows])
        grads[0][rows], grads[1][keys], grads[2][keys] = dq, dk, dv
    return grads


def block_masks(cnt_idx_full, cnt_idx_mask, seqlen_q: int, seqlen_k: int):
    """(b, h) -> (full, partial) element masks from FlexAttention block lists (NumPy)."""

    def expand(cnt, idx, b, h):
        rows = -(-seqlen_q // BLOCK)
        cols = -(-seqlen_k // BLOCK)
        grid = np.zeros((rows, cols), dtype=bool)
        if cnt is not None:
            hb = h if cnt.shape[1] > 1 else 0
            for m in range(rows):
                grid[m, idx[b, hb, m, : cnt[b, hb, m]]] = True
        return np.kron(grid, np.ones((BLOCK, BLOCK), dtype=bool)).astype(bool)

    def get(b, h):
        return expand(*cnt_idx_full, b, h), expand(*cnt_idx_mask, b, h)

    return get


def combine(out_partial, lse_partial):
    """Merges (splits, ..., D) partial outputs by their (splits, ...) lse -> out, lse."""
    out_partial, lse_partial = _f64(out_partial), _f64(lse_partial)
    row_max = lse_partial.max(axis=0)
    safe = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.exp(lse_partial - safe)
    total = weights.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.log(total) + safe
        out = np.where(total[..., None] > 0, (weights[..., None] * out_partial).sum(axis=0) / total[..., None], 0.0)
    return out, lse
