"""Built-in score_mod / mask_mod objects: a kind (the C++ ScoreModKind / MaskModKind value),
scalars and aux tensors. cuflash.masks and cuflash.scores make them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Tuple


@dataclass(frozen=True)
class BuiltinVariant:
    """Base of the built-in score and mask modifications.

    `aux` holds the tensors that the variant reads; an empty `aux` on a variant that needs
    `num_aux` tensors takes them from the call's `aux_tensors` argument instead.
    """

    name: str
    kind: int
    scalars: Tuple[float, ...] = ()
    aux: Tuple[Any, ...] = field(default=(), repr=False)
    num_aux: int = 0

    role = "variant"

    def __repr__(self) -> str:
        args = ", ".join(repr(s) for s in self.scalars)
        if self.aux:
            shapes = ", ".join(f"<{type(a).__name__} {tuple(a.shape)}>" for a in self.aux)
            args = f"{args}, {shapes}" if args else shapes
        return f"cuflash.{self.role}s.{self.name}({args})"


@dataclass(frozen=True, repr=False)
class ScoreMod(BuiltinVariant):
    """A built-in score_mod (FlexAttention semantics: it sees the scaled, soft-capped score)."""

    role = "score"


@dataclass(frozen=True, repr=False)
class MaskMod(BuiltinVariant):
    """A built-in mask_mod (FlexAttention semantics: True keeps (q_idx, kv_idx))."""

    role = "mask"


_SCORE_NAMES = {1: "alibi", 2: "relative_bias"}
_MASK_NAMES = {1: "causal", 2: "sliding_window", 3: "prefix_lm", 4: "document"}


def from_kind(cls: type, kind: int, scalars, aux) -> "BuiltinVariant":
    """Rebuilds a built-in variant from its C++ kind, scalars and aux tensors."""
    names = _SCORE_NAMES if cls is ScoreMod else _MASK_NAMES
    return cls(names[kind], kind, tuple(float(s) for s in scalars), tuple(aux), len(aux))
