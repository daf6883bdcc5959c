"""cuflash: FlashAttention for NVIDIA Hopper (sm_90a), with a CPU reference implementation.

    >>> import cuflash
    >>> out, lse = cuflash.flash_attn_func(q, k, v, causal=True)

Tensors of torch, NumPy and CuPy cross by DLPack; CPU arrays run on the reference
implementation, CUDA arrays on the Hopper kernels. torch is optional: with it, outputs are
differentiable through torch.autograd. JAX arrays run as XLA custom calls, also inside jax.jit
and under jax.grad (when the build found jax; else eagerly, by DLPack).
"""

from . import _C, block_sparse, flex, kvcache, masks, mods, scores
from ._tensors import note_loaded_modules
from .flex import flex_attention
from .kvcache import flash_attn_with_kvcache
from .interface import (flash_attn_backward, flash_attn_combine, flash_attn_forward, flash_attn_func,
                        flash_attn_varlen_func)

__version__ = _C.version()

note_loaded_modules()

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_combine",
    "flash_attn_forward",
    "flash_attn_backward",
    "flash_attn_with_kvcache",
    "flex_attention",
    "flex",
    "kvcache",
    "masks",
    "scores",
    "mods",
    "block_sparse",
    "built_kernels",
    "cuda_available",
    "built_with_cuda",
]

built_with_cuda: bool = _C.built_with_cuda


def built_kernels() -> list:
    """The kernel configurations this build holds, e.g. ["fwd bf16 hdim128", ...]."""
    return list(_C.built_kernels())


def cuda_available() -> bool:
    """Whether this build has the CUDA kernels and a usable CUDA device is present."""
    return bool(_C.cuda_available())
