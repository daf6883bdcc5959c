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
