"""The score_mod / mask_mod callables that the GPU tests run through kernels compiled at run time
(cuflash._jit), in one place so that their modules can be built ahead of the tests.

Each distinct structure costs one nvcc run of about a minute; built one after another inside the
tests they add up. `python3 gpu_callables.py` builds every module the GPU tests need at once, in
parallel, into the on-disk cache that the tests then load from (tools/gpu_check.sh runs it before
pytest)."""
from __future__ import annotations

import concurrent.futures
import importlib.util
import time

import numpy as np

import cuflash
from cuflash import _jit, mods

# The shapes the GPU tests use: q, k, v (batch, seqlen, heads, HEAD_DIM) in DTYPE.
DTYPE = "bfloat16"
HEAD_DIM = 64


def alibi_like(slopes):
    """score - slopes[h] * (q_idx - kv_idx): the built-in cuflash.scores.alibi as a program (the
    spelling ``score + slopes[h] * (kv_idx - q_idx)`` would run as the built-in itself)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    return score_mod


def tanh_cap(cap: float):
    """cap * tanh(score * (1 / cap)): the built-in softcap as a program (its derivative is not 1;
    the spelling ``cap * tanh(score / cap)`` would run as the softcap option itself)."""
    return lambda score, b, h, q_idx, kv_idx: cap * mods.tanh(score * (1.0 / cap))


def tanh_cap_bwd(cap: float, factor: float):
    """score_mod_bwd of tanh_cap(cap), times `factor` (a constant: one module for the factors
    other than 1 and cap, which would share their constant's slot)."""

    def score_mod_bwd(grad, score, b, h, q_idx, kv_idx):
        t = mods.tanh(score / cap)
        return grad * (1.0 - t * t) * factor

    return score_mod_bwd


def full_bias(bias):
    """score + bias[b, h, q_idx, kv_idx]: a load with four indices (any bias shape, one module)."""
    return lambda score, b, h, q_idx, kv_idx: score + bias[b, h, q_idx, kv_idx]


# The full bias's shape in the GPU test (batch, heads, seqlen_q, seqlen_k).
FULL_BIAS_SHAPE = (2, 4, 300, 300)


def causal_mask(b, h, q_idx, kv_idx):
    """The causal mask as a program (``kv_idx <= q_idx`` itself would run as the built-in)."""
    return q_idx - kv_idx >= 0


def causal_builtin_spelling(b, h, q_idx, kv_idx):
    """The spelling of the causal mask that runs as the built-in (nothing compiled)."""
    return kv_idx <= q_idx


def causal_mask_on_block_states():
    """causal_mask as cuflash.flex_attention runs it for a BlockMask of 64 x 64 blocks (batch and
    heads 1): wrapped to read each pair's block state, since its 128 x 128 blocks mix states."""
    import torch

    from cuflash.flex import _reading_block_states

    return _reading_block_states(torch.zeros((1, 1, 5, 5), dtype=torch.int8), causal_mask, 64, 64)


def _modules():
    """(score, mask, split, paged, pack_gqa) of the modules the GPU tests build; constants do not
    change a module (the source depends on the program's structure only)."""
    slopes = np.asarray(cuflash.scores.alibi_slopes(4), np.float32)
    alibi = mods.trace_score_mod(alibi_like(slopes))
    causal = mods.trace_mask_mod(causal_mask)
    modules = [
        (alibi, None, False, False, False),
        (alibi, None, False, True, False),  # paged KV
        (alibi, None, False, False, True),  # packed GQA
        (mods.trace_score_mod(tanh_cap(20.0)), None, False, False, False),
        (mods.trace_score_mod(tanh_cap(20.0), bwd=tanh_cap_bwd(20.0, 0.5)), None, False, False, False),
        (None, causal, False, False, False),
        (None, causal, True, False, False),  # split-KV
        (mods.trace_score_mod(full_bias(np.zeros(FULL_BIAS_SHAPE, np.float32))), None, False, False, False),
    ]
    if importlib.util.find_spec("torch") is None:  # flex_attention's BlockMask is torch's
        return modules
    return modules + [(None, mods.trace_mask_mod(causal_mask_on_block_states()), False, False, False)]


def build_all() -> None:
    start = time.time()
    sources = [_jit.kernel_source(score, mask, DTYPE, HEAD_DIM, HEAD_DIM, split, paged, pack_gqa)
               for score, mask, split, paged, pack_gqa in _modules()]
    with concurrent.futures.ThreadPoolExecutor(len(sources)) as pool:
        for path in pool.map(_jit.build, sources):
            print(f"{path} ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    build_all()
