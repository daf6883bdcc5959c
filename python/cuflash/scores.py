"""Built-in score_mod variants for ``flash_attn_varlen_func(..., score_mod=...)``.

A score_mod sees the scaled (and soft-capped) score s of query q_idx and key kv_idx of head h
and returns a new score, as in FlexAttention; q_idx and kv_idx count from the start of each
sequence.

    >>> out, lse = cuflash.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k,
    ...                                           score_mod=cuflash.scores.alibi(slopes))
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ._tensors import framework_of
from ._variants import ScoreMod

__all__ = ["ScoreMod", "alibi", "relative_bias", "alibi_slopes"]

# ScoreModKind values of include/cuflash/options.hpp.
_ALIBI, _RELATIVE_BIAS = 1, 2


def _fp32_tensor(x: Any, argument: str, ndim: int) -> Any:
    framework = framework_of(x)
    if framework is None:
        if isinstance(x, (list, tuple)):
            x = np.asarray(x, dtype=np.float32)
            framework = framework_of(x)
        else:
            raise TypeError(f"{argument}: expected a tensor, an array or a list, got {type(x).__name__}")
    if len(x.shape) != ndim:
        raise ValueError(f"{argument}: expected {ndim} dimension(s), got shape {tuple(x.shape)}")
    if framework.dtype(x) != "float32":
        x = framework.astype(x, "float32")
    return framework.contiguous(x)


def alibi(slopes: Optional[Any] = None) -> ScoreMod:
    """ALiBi: s + slopes[h] * (kv_idx - q_idx).

    `slopes`: (num_heads,) float32 tensor (other float dtypes and lists are converted), on q's
    device (a NumPy array is moved there). Without it, the slopes come from ``aux_tensors``.
    """
    if slopes is None:
        return ScoreMod("alibi", _ALIBI, num_aux=1)
    return ScoreMod("alibi", _ALIBI, aux=(_fp32_tensor(slopes, "slopes", 1),), num_aux=1)


def relative_bias(table: Optional[Any] = None) -> ScoreMod:
    """Learned relative-position bias: s + table[h, clamp(kv_idx - q_idx, -R, R) + R].

    `table`: (num_heads, 2R+1) float32 tensor, on q's device (a NumPy array is moved there).
    Without it, the table comes from ``aux_tensors``.
    """
    if table is None:
        return ScoreMod("relative_bias", _RELATIVE_BIAS, num_aux=1)
    table = _fp32_tensor(table, "table", 2)
    if table.shape[1] % 2 != 1:
        raise ValueError(f"table: expected an odd second dimension 2R+1, got shape {tuple(table.shape)}")
    return ScoreMod("relative_bias", _RELATIVE_BIAS, aux=(table,), num_aux=1)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi paper's head slopes, 2^(-8 h / n) for a power of two n (interleaved otherwise),
    as a float32 NumPy array of shape (num_heads,)."""

    def power_of_two_slopes(n: int):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if num_heads <= 0:
        raise ValueError(f"num_heads: expected a positive int, got {num_heads}")
    closest = 2 ** int(np.floor(np.log2(num_heads)))
    slopes = power_of_two_slopes(closest)
    if closest < num_heads:
        slopes += power_of_two_slopes(2 * closest)[0::2][: num_heads - closest]
    return np.asarray(slopes, dtype=np.float32)
