"""The backward's process-wide launch settings on the GPU, against each other.

CUFLASH_BWD_DQ_CONVERT, CUFLASH_BWD_DQ_CLEAR and CUFLASH_BWD_ORDER are read once per process, so each setting runs in
a child process of its own on the same inputs (seeded on the device) and the parent compares the
gradients: bit for bit where the backward is deterministic, within a bf16 rounding of each other
otherwise. The shape takes several waves of CTAs (4 x 8 heads x 16 column blocks at hdim128),
so that the dQ conversion overlapped with the main kernel starts on heads while others still run.
Skipped without a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from test_gpu import torch_cuda

# argv: output path, causal (0 / 1), deterministic (0 / 1), head dim (heads * dim = 1024), query and
# key lengths. Exit 3: the kernel is not in this build.
CHILD = r"""
import sys

import numpy as np
import torch

import cuflash

path, causal, deterministic, dim = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1", int(sys.argv[4])
seqlen_q, seqlen_k = int(sys.argv[5]), int(sys.argv[6])
gen = torch.Generator(device="cuda").manual_seed(7)
batch, heads = 4, 1024 // dim
q, dout, k, v = (torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                 for seqlen in (seqlen_q, seqlen_q, seqlen_k, seqlen_k))
for t in (q, k, v):
    t.requires_grad_(True)
try:
    out, _ = cuflash.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
except Exception as error:  # noqa: BLE001 - a build without the kernel is a skip, the rest fails
    if isinstance(error, NotImplementedError) or "is not in this build" in str(error):
        print(error)
        sys.exit(3)
    raise
np.savez(path, **{name: g.float().cpu().numpy() for name, g in zip(("dq", "dk", "dv"), grads)})
"""


def gradients(tmp_path, settings: dict[str, str], causal: bool, deterministic: bool,
              dim: int = 128, seqlen_q: int = 2048, seqlen_k: int = 2048) -> dict[str, np.ndarray]:
    """dq, dk, dv of the child's call under `settings` (environment variables)."""
    tag = "_".join(f"{key}={value}" for key, value in sorted(settings.items())).replace(":", "-")
    path = tmp_path / f"grads_{tag}_{int(causal)}{int(deterministic)}_{dim}_{seqlen_q}_{seqlen_k}.npz"
    env = dict(os.environ, **settings)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    argv = [str(path), str(int(causal)), str(int(deterministic)), str(dim), str(seqlen_q), str(seqlen_k)]
    result = subprocess.run([sys.executable, "-c", CHILD, *argv], env=env, capture_output=True, text=True, timeout=120)
    if result.returncode == 3:
        pytest.skip(f"not in this build: {result.stdout.strip()}")
    assert result.returncode == 0, f"child under {settings} failed:\n{result.stdout}\n{result.stderr}"
    with np.load(path) as saved:
        return {name: saved[name] for name in ("dq", "dk", "dv")}


@pytest.mark.parametrize("causal", [False, True])
def test_dq_conversion_overlapped_or_after_gives_the_same_bits(tmp_path, causal):
    """Deterministic: the conversion overlapped with the main kernel (the default) and after it
    read the same sums, so dq (and dk, dv) agree bit for bit."""
    torch_cuda()
    overlap = gradients(tmp_path, {"CUFLASH_BWD_DQ_CONVERT": "overlap"}, causal, deterministic=True)
    after = gradients(tmp_path, {"CUFLASH_BWD_DQ_CONVERT": "after"}, causal, deterministic=True)
    for name in ("dq", "dk", "dv"):
        assert np.array_equal(overlap[name], after[name]), name


def test_heads_order_with_idle_heads_and_overlapped_conversion(tmp_path):
    """Causal, heads launched inner in groups of 3 of the 8 heads, so the last group has an idle
    head slot (which must count into no head's dQ counter), with the overlapped conversion: dq
    matches the column order's within a bf16 rounding (its fp32 sums add in another order), dk and
    dv bit for bit (each is one CTA's, whatever the launch order). A miscounted slot would convert
    a head early, which is a race: a pass is evidence, not proof."""
    torch_cuda()
    heads = gradients(tmp_path, {"CUFLASH_BWD_ORDER": "heads:3", "CUFLASH_BWD_DQ_CONVERT": "overlap"}, causal=True,
                      deterministic=False)
    columns = gradients(tmp_path, {"CUFLASH_BWD_ORDER": "columns", "CUFLASH_BWD_DQ_CONVERT": "overlap"}, causal=True,
                        deterministic=False)
    scale = float(np.abs(columns["dq"]).max())
    assert np.all(np.isfinite(heads["dq"]))
    np.testing.assert_allclose(heads["dq"], columns["dq"], rtol=1e-2, atol=1e-3 * scale)
    for name in ("dk", "dv"):
        assert np.array_equal(heads[name], columns[name]), name


@pytest.mark.parametrize("dim", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_dq_first_store_or_memset_gives_the_same_values(tmp_path, causal, dim):
    """Deterministic: dq_accum from the first column block's stores (hdims 128 and 256, whose dQ
    leaves by bulk copies; the default at 256 with causal or local masks up to 2k rows) and from a
    memset add the same sums in the same order,
    so the gradients agree value for value (a first store of -0.0 may keep its sign where
    0.0 + -0.0 gave +0.0, which compares equal)."""
    torch_cuda()
    first = gradients(tmp_path, {"CUFLASH_BWD_DQ_CLEAR": "first"}, causal, deterministic=True, dim=dim)
    memset = gradients(tmp_path, {"CUFLASH_BWD_DQ_CLEAR": "memset"}, causal, deterministic=True, dim=dim)
    for name in ("dq", "dk", "dv"):
        assert np.array_equal(first[name], memset[name]), name


@pytest.mark.parametrize("lengths", [(2048, 2048), (192, 4096), (4096, 192)])
@pytest.mark.parametrize("dim", [128, 256])
def test_dq_first_store_without_determinism(tmp_path, dim, lengths):
    """Non-deterministic, non-causal: with first stores the column blocks of a head walk the row
    blocks rotated (the first to take a row block's ticket, once its first dQ piece is ready,
    stores; the others add once that has landed), with the memset ascending, so every gradient
    sums in another order: each within a bf16 rounding of the memset's. The heads of 2k x 2k
    straddle the launch windows that the rotation groups follow; 192 query rows against 4k keys
    make groups too large to rotate (ascending walks, tickets taken early); 4k rows against 192
    keys a group of two or three column blocks."""
    torch_cuda()
    seqlen_q, seqlen_k = lengths
    first = gradients(tmp_path, {"CUFLASH_BWD_DQ_CLEAR": "first"}, False, deterministic=False, dim=dim,
                      seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    memset = gradients(tmp_path, {"CUFLASH_BWD_DQ_CLEAR": "memset"}, False, deterministic=False, dim=dim,
                       seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    for name in ("dq", "dk", "dv"):
        scale = float(np.abs(memset[name]).max())
        assert np.all(np.isfinite(first[name])), name
        np.testing.assert_allclose(first[name], memset[name], rtol=1e-2, atol=1e-3 * scale, err_msg=name)
