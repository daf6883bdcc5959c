"""Kernels compiled at run time for score_mod / mask_mod callables (cuflash._jit): source
generation and, where nvcc and the CUTLASS headers are present, a real build of a module whose
launchers load and match the extension's parameter layouts. No GPU is needed; the GPU run of
such a module is in test_gpu_callables_jit (skipped without a device)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import cuflash
import gpu_callables
from cuflash import _C, _jit, mods
from test_gpu import skip_if_not_built


def _alibi_like(slopes):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return score_mod


def _prefix_causal(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < 16)


def test_kernel_head_dims_follow_dispatch():
    assert _jit.kernel_head_dims(64, 64) == (64, 64)
    assert _jit.kernel_head_dims(80, 80) == (96, 96)
    assert _jit.kernel_head_dims(128, 64) == (128, 128)
    assert _jit.kernel_head_dims(160, 128) == (192, 128)
    assert _jit.kernel_head_dims(192, 192) == (192, 192)
    assert _jit.kernel_head_dims(200, 256) == (256, 256)
    assert _jit.kernel_head_dims(192, 136) == (192, 192)
    assert _jit.kernel_head_dims(200, 128) == (256, 256)
    with pytest.raises(_jit.JitError, match="head dims 264 / 64"):
        _jit.kernel_head_dims(264, 64)


def test_kernel_source_instantiates_the_flex_templates():
    score = mods.trace_score_mod(_alibi_like(np.ones(4, np.float32)))
    mask = mods.trace_mask_mod(_prefix_causal)
    both = _jit.kernel_source(score, mask, "bfloat16", 64, 64)
    assert "FlexVariantOf<CuflashExprScoreSwitch, CuflashExprMaskSwitch>" in both
    assert "run_flash_fwd_sm90<cutlass::bfloat16_t, 64, 64" in both
    assert "run_bwd_flex<cutlass::bfloat16_t, 64, 64, CuflashExprVariant>" in both
    assert 'extern "C" void cuflash_expression_forward' in both
    assert 'extern "C" void cuflash_expression_backward' in both
    # One side a callable: the built-in switch serves the other.
    score_only = _jit.kernel_source(score, None, "float16", 100, 100)
    assert "FlexVariantOf<CuflashExprScoreSwitch, cuflash::variants::MaskModSwitch>" in score_only
    assert "cutlass::half_t, 128, 128" in score_only
    # The source depends on the program's structure, not its constants.
    other = mods.trace_score_mod(_alibi_like(np.full(4, 3.0, np.float32)))
    assert _jit.kernel_source(other, mask, "bfloat16", 64, 64) == both
    # Split-KV and paged KV: the forward in that form (a module of its own), the same backward.
    assert "kSplit = false, kPaged = false" in both
    split_paged = _jit.kernel_source(score, mask, "bfloat16", 64, 64, split=True, paged=True)
    assert "kSplit = true, kPaged = true" in split_paged
    assert "kSplit, CuflashExprVariant, kPaged, kPackGqa>" in split_paged
    assert split_paged != both
    assert _jit.kernel_source(score, mask, "bfloat16", 64, 64, paged=True) not in (both, split_paged)
    # Packed GQA: the forward with packed tiles, its launcher refusing unpacked calls by name.
    assert "kPackGqa = false" in both
    packed = _jit.kernel_source(score, mask, "bfloat16", 64, 64, pack_gqa=True)
    assert "kPackGqa = true" in packed
    assert '"pack_gqa"' in packed and packed != both
    with pytest.raises(_jit.JitError, match="float16 or bfloat16"):
        _jit.kernel_source(score, None, "float32", 64, 64)


def test_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("CUFLASH_JIT_CALLABLES", raising=False)
    assert _jit.enabled()
    monkeypatch.setenv("CUFLASH_JIT_CALLABLES", "0")
    assert not _jit.enabled()
    monkeypatch.setenv("CUFLASH_JIT_CALLABLES", "1")
    assert _jit.enabled()


def _toolchain_or_skip():
    try:
        _jit._nvcc()
        _jit._cutlass_include()
        _jit._kernel_includes()
    except _jit.JitError as error:
        pytest.skip(str(error))


def _torch_gpu_jit_or_skip(monkeypatch):
    """torch, on a GPU build with a device and the toolchain for callables (else the test skips),
    with CUFLASH_JIT_CALLABLES unset."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not (torch.cuda.is_available() and cuflash.built_with_cuda):
        pytest.skip("no CUDA device or a build without CUDA")
    _toolchain_or_skip()
    monkeypatch.delenv("CUFLASH_JIT_CALLABLES", raising=False)
    return torch


def test_build_and_load_a_module(tmp_path, monkeypatch):
    """Compiles forward and backward for one callable pair (about a minute on two cores)."""
    _toolchain_or_skip()
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    score = mods.trace_score_mod(_alibi_like(np.ones(4, np.float32)))
    mask = mods.trace_mask_mod(_prefix_causal)
    forward, backward = _jit.expression_kernels(score, mask, "bfloat16", 64, 64, _C.kernel_params_abi())
    assert forward and backward and forward != backward
    built = list((tmp_path / "kernels").glob("cuflash_expr_*.so"))
    assert len(built) == 1
    # Cached: the same structure reuses the module, in this process and on disk.
    assert _jit.expression_kernels(score, mask, "bfloat16", 64, 64, _C.kernel_params_abi()) == (forward, backward)
    # A module built against other parameter layouts is refused (a fresh copy: a loaded module
    # keeps the result of its first check).
    copy = built[0].with_name("cuflash_expr_copy.so")
    shutil.copyfile(built[0], copy)
    with pytest.raises(_jit.JitError, match="other parameter layouts"):
        _jit.load(copy, _C.kernel_params_abi() ^ 1)


def test_gpu_callables_jit(monkeypatch):
    """On a GPU: callables through kernels compiled at run time match the built-ins, forward and
    backward; with CUFLASH_JIT_CALLABLES=0 they are refused by name."""
    torch = _torch_gpu_jit_or_skip(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 300, 4, gpu_callables.HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                           generator=gen).requires_grad_()
               for _ in range(3))
    slopes = torch.tensor(cuflash.scores.alibi_slopes(4), device="cuda")
    # score_mod is an option of flash_attn_varlen_func (which takes fixed-length batches too),
    # mask_mod one of flash_attn_func, as in the seed's signatures.
    # The built-ins compared against (hdim64 flex and softcap kernels) first: a build without
    # them skips.
    with skip_if_not_built():
        expected, _ = cuflash.flash_attn_varlen_func(q, k, v, score_mod=cuflash.scores.alibi(slopes), causal=True)
        softcapped, _ = cuflash.flash_attn_varlen_func(q, k, v, softcap=20.0)
        causal, _ = cuflash.flash_attn_func(q, k, v, mask_mod=cuflash.masks.causal())
    out, _ = cuflash.flash_attn_varlen_func(q, k, v, score_mod=gpu_callables.alibi_like(slopes), causal=True)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.float().sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
    # A score_mod with a derivative that is not 1 (the backward multiplies dS by it), against the
    # built-in softcap: 20 * tanh(score / 20) of the scaled score is softcap = 20.
    out, _ = cuflash.flash_attn_varlen_func(q, k, v, score_mod=gpu_callables.tanh_cap(20.0))
    expected = softcapped
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.float().sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
    # The same with a hand-written score_mod_bwd (flash_attn_backward): a multiple of the true
    # derivative scales dq and dk by it and leaves dv.
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen)
    lse = cuflash.flash_attn_varlen_func(q, k, v, score_mod=gpu_callables.tanh_cap(20.0))[1]
    args = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach())
    traced = cuflash.flash_attn_backward(*args, score_mod=gpu_callables.tanh_cap(20.0))
    for factor in (0.5, 2.0):
        written = cuflash.flash_attn_backward(*args, score_mod=gpu_callables.tanh_cap(20.0),
                                              score_mod_bwd=gpu_callables.tanh_cap_bwd(20.0, factor))
        for got, want in zip(written[:2], traced[:2]):
            torch.testing.assert_close(got.float(), want.float() * factor, atol=5e-2, rtol=5e-2)
        torch.testing.assert_close(written[2], traced[2], atol=0, rtol=0)
    # A mask callable alone, against the built-in causal mask.
    out, _ = cuflash.flash_attn_func(q, k, v, mask_mod=gpu_callables.causal_mask)
    torch.testing.assert_close(out, causal, atol=2e-2, rtol=2e-2)
    # Split-KV: the module's forward in split form, then the combine.
    out, _ = cuflash.flash_attn_func(q, k, v, mask_mod=gpu_callables.causal_mask, num_splits=3)
    torch.testing.assert_close(out, causal, atol=2e-2, rtol=2e-2)
    # Paged KV: the same keys through a shuffled page table with a spare page, forward and the
    # gradient of q, against the unpaged call.
    page_size, pages = 64, 5  # 320 key slots per sequence for its 300 keys
    order = torch.randperm(2 * pages + 1, generator=torch.Generator().manual_seed(1))[: 2 * pages]
    page_table = order.reshape(2, pages).to(device="cuda", dtype=torch.int32)
    caches = []
    for x in (k, v):
        cache = torch.zeros(2 * pages + 1, page_size, *x.shape[2:], device="cuda", dtype=x.dtype)
        padded = torch.nn.functional.pad(x.detach(), (0, 0, 0, 0, 0, pages * page_size - x.shape[1]))
        cache[page_table.flatten().long()] = padded.reshape(2 * pages, page_size, *x.shape[2:])
        caches.append(cache)
    seqused_k = torch.full((2,), k.shape[1], device="cuda", dtype=torch.int32)
    with skip_if_not_built():  # the paged forward of the build (hdim64 paged kernels)
        paged_out, _ = cuflash.flash_attn_varlen_func(q, *caches, page_table=page_table, seqused_k=seqused_k,
                                                     score_mod=gpu_callables.alibi_like(slopes), causal=True)
    dense_out, _ = cuflash.flash_attn_varlen_func(q, k, v, score_mod=gpu_callables.alibi_like(slopes), causal=True)
    torch.testing.assert_close(paged_out, dense_out, atol=2e-2, rtol=2e-2)
    (paged_dq,) = torch.autograd.grad(paged_out.float().sum(), (q,))
    (dense_dq,) = torch.autograd.grad(dense_out.float().sum(), (q,))
    torch.testing.assert_close(paged_dq, dense_dq, atol=5e-2, rtol=5e-2)
    # Packed GQA (pack_gqa=True, two query heads per kv head): the module's packed forward, each
    # row's callable seeing its own head (per-head slopes), against the built-in ALiBi unpacked;
    # the backward (one head per tile, as always) through the same module.
    k2, v2 = (x.detach()[:, :, :2].clone().requires_grad_() for x in (k, v))
    with skip_if_not_built():  # the built-in unpacked flex kernel compared against
        expected, _ = cuflash.flash_attn_varlen_func(q, k2, v2, score_mod=cuflash.scores.alibi(slopes),
                                                     causal=True, pack_gqa=False)
    out, _ = cuflash.flash_attn_varlen_func(q, k2, v2, score_mod=gpu_callables.alibi_like(slopes), causal=True,
                                            pack_gqa=True)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    grads = torch.autograd.grad(out.float().sum(), (q, k2, v2))
    expected_grads = torch.autograd.grad(expected.float().sum(), (q, k2, v2))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
    monkeypatch.setenv("CUFLASH_JIT_CALLABLES", "0")
    with pytest.raises(NotImplementedError, match="^mask_mod: .*CUFLASH_JIT_CALLABLES=0"):
        cuflash.flash_attn_func(q, k, v, mask_mod=gpu_callables.causal_mask)
    # A callable that spells a built-in runs as it where the build has its kernels (this build's
    # hdim64 flex kernels), with nothing to compile.
    call = cuflash.interface._prepare(q, k, v, mask_mod=gpu_callables.causal_builtin_spelling)
    assert call.mask_program == [] and call.mask_traced is None
    out, _ = cuflash.flash_attn_func(q, k, v, mask_mod=gpu_callables.causal_builtin_spelling)
    torch.testing.assert_close(out, causal, atol=0, rtol=0)


def test_gpu_callable_full_bias(monkeypatch):
    """On a GPU: a score_mod reading a 4-dimensional bias (FlexAttention's bias[b, h, q_idx,
    kv_idx]) against PyTorch's attention with that bias as its float mask, forward and backward."""
    torch = _torch_gpu_jit_or_skip(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(2)
    batch, heads, seqlen, _ = gpu_callables.FULL_BIAS_SHAPE
    q, k, v = (torch.randn(batch, seqlen, heads, gpu_callables.HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                           generator=gen).requires_grad_()
               for _ in range(3))
    bias = torch.randn(gpu_callables.FULL_BIAS_SHAPE, device="cuda", generator=gen)
    with skip_if_not_built():  # the hdim64 flex kernels of the build (the callable's templates)
        out, _ = cuflash.flash_attn_varlen_func(q, k, v, score_mod=gpu_callables.full_bias(bias))
    qf, kf, vf = (x.detach().float().transpose(1, 2).requires_grad_() for x in (q, k, v))
    expected = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=bias)
    torch.testing.assert_close(out.float(), expected.transpose(1, 2), atol=2e-2, rtol=2e-2)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.sum(), (qf, kf, vf))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got.float(), want.transpose(1, 2), atol=5e-2, rtol=5e-2)


def test_gpu_callable_under_torch_compile(monkeypatch):
    """On a GPU: a traced callable inside torch.compile(fullgraph=True) runs the kernels compiled
    for it from within the custom ops, forward and backward, as eager does."""
    torch = _torch_gpu_jit_or_skip(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, 200, 4, gpu_callables.HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                           generator=gen).requires_grad_()
               for _ in range(3))
    slopes = torch.tensor(cuflash.scores.alibi_slopes(4), device="cuda")
    traced = mods.trace_score_mod(gpu_callables.alibi_like(slopes))

    def loss(q, k, v):
        out, lse = cuflash.flash_attn_varlen_func(q, k, v, score_mod=traced, causal=True)
        return (out.float() ** 2).sum() + lse.sum()

    def grads(fn):
        value = fn(q, k, v)
        return [value.detach()] + list(torch.autograd.grad(value, (q, k, v)))

    with skip_if_not_built():  # the hdim64 flex kernels of the build (the callable's templates)
        expected = grads(loss)
    torch._dynamo.reset()
    got = grads(torch.compile(loss, backend="aot_eager", fullgraph=True))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("block_size", [128, 64, 256])
def test_gpu_flex_attention_with_a_block_mask(monkeypatch, block_size):
    """On a GPU: cuflash.flex_attention with torch's BlockMask (lists made on the GPU) and its
    mask_mod callable, against the causal kernels on the same memory, forward and backward. Other
    block sizes are converted on the GPU (64: the mask_mod wrapped to read the block states)."""
    torch = _torch_gpu_jit_or_skip(monkeypatch)
    flex = pytest.importorskip("torch.nn.attention.flex_attention", reason="this torch has no FlexAttention")
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(2, 4, 300, gpu_callables.HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                           generator=gen).requires_grad_()
               for _ in range(3))
    block_mask = flex.create_block_mask(gpu_callables.causal_mask, None, None, 300, 300, device="cuda",
                                        BLOCK_SIZE=block_size)
    with skip_if_not_built():  # the hdim64 flex kernels of the build, and its plain causal kernel
        out, lse = cuflash.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
        expected, expected_lse = cuflash.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, expected_lse, atol=1e-3, rtol=1e-3)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.float().sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
