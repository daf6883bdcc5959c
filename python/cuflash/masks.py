"""Built-in mask_mod variants for ``flash_attn_func(..., mask_mod=...)``.

A mask_mod keeps the (q_idx, kv_idx) pairs for which it is true, as in FlexAttention. Its
indices are top-left aligned (q_idx and kv_idx both count from the start of the sequence),
and it intersects with ``causal`` / ``window_size`` (bottom-right aligned) and with the
sequence lengths.

    >>> out, lse = cuflash.flash_attn_func(q, k, v, mask_mod=cuflash.masks.document(doc_ids))
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

from ._variants import MaskMod

__all__ = ["MaskMod", "causal", "sliding_window", "prefix_lm", "document"]

# MaskModKind values of include/cuflash/options.hpp.
_CAUSAL, _SLIDING_WINDOW, _PREFIX_LM, _DOCUMENT = 1, 2, 3, 4


def _non_negative_int(value: Any, argument: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{argument}: expected an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{argument}: expected a value >= 0, got {value}")
    return int(value)


def causal() -> MaskMod:
    """Keeps kv_idx <= q_idx (top-left aligned, unlike the ``causal=True`` option, which is
    bottom-right aligned; the two agree when seqlen_q == seqlen_k)."""
    return MaskMod("causal", _CAUSAL)


def sliding_window(left: int, right: int = 0) -> MaskMod:
    """Keeps q_idx - left <= kv_idx <= q_idx + right (top-left aligned)."""
    return MaskMod(
        "sliding_window",
        _SLIDING_WINDOW,
        (float(_non_negative_int(left, "left")), float(_non_negative_int(right, "right"))),
    )


def prefix_lm(n: int) -> MaskMod:
    """Prefix-LM: keeps kv_idx <= q_idx, and every key of the first `n` (the prefix)."""
    return MaskMod("prefix_lm", _PREFIX_LM, (float(_non_negative_int(n, "n")),))


def document(doc_ids: Optional[Any] = None) -> MaskMod:
    """Document masking: keeps pairs whose document ids match, doc[b, q_idx] == doc[b, kv_idx].

    `doc_ids`: int32 tensor (batch, L) with L >= max(seqlen_q, seqlen_k), on q's device (a
    NumPy array is moved there). Without it, the ids come from the call's ``aux_tensors``.
    """
    if doc_ids is None:
        return MaskMod("document", _DOCUMENT, num_aux=1)
    from ._tensors import framework_of

    if framework_of(doc_ids) is None:
        raise TypeError(f"doc_ids: expected a tensor or array, got {type(doc_ids).__name__}")
    return MaskMod("document", _DOCUMENT, aux=(doc_ids,), num_aux=1)
