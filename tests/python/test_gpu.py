"""CUDA arrays (torch, CuPy, JAX) on the sm_90a kernels, against the NumPy float64 reference.

Skipped without a GPU. A configuration that this build does not contain (see
cuflash.built_kernels()) skips with the library's NotImplementedError message.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import cuflash
import attention_reference as ref
from combine_reference import jax_combine_direct, jax_combine_loss
from conftest import assert_close, assert_lse_close

# The configuration of the "ci" kernel set: bf16, head_dim 128.
SHAPE = (2, 200, 300, 8, 2, 128)  # batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim


def torch_cuda():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not cuflash.built_with_cuda:
        pytest.skip("cuflash was built without CUDA")
    return torch


@contextlib.contextmanager
def skip_if_not_built():
    # Under jax.jit the dispatch error reaches Python as an XLA runtime error (UNIMPLEMENTED) when
    # the result is first read, so the blocks below wait for their results inside this guard.
    try:
        yield
    except Exception as error:  # noqa: BLE001 - re-raised unless it is the not-built error
        if isinstance(error, NotImplementedError) or "is not in this build" in str(error):
            pytest.skip(f"not in this build: {error}")
        raise


def reference_inputs(rng, dtype):
    batch, seqlen_q, seqlen_k, heads, heads_kv, dim = SHAPE
    import ml_dtypes

    cast = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    return [rng.standard_normal(s).astype(cast) for s in
            ((batch, seqlen_q, heads, dim), (batch, seqlen_k, heads_kv, dim), (batch, seqlen_k, heads_kv, dim))]


def to_f64(t) -> np.ndarray:
    return t.detach().float().cpu().numpy().astype(np.float64)


@pytest.mark.parametrize("causal", [False, True])
def test_torch_forward_backward(rng, causal):
    torch = torch_cuda()
    q, k, v = (torch.from_numpy(x.astype(np.float32)).cuda().bfloat16().requires_grad_(True)
               for x in reference_inputs(rng, "bfloat16"))
    check_torch_autograd(torch, q, k, v, ref.Options(causal=causal), causal=causal)


def check_torch_autograd(torch, q, k, v, opts, **kwargs):
    """cuflash.flash_attn_func(q, k, v, **kwargs) and its backward under autograd (bf16 CUDA
    tensors that require grad) against the reference with `opts`."""
    with skip_if_not_built():
        out, lse = cuflash.flash_attn_func(q, k, v, **kwargs)
    assert out.is_cuda and out.dtype == torch.bfloat16 and lse.is_cuda
    args = [to_f64(t) for t in (q, k, v)]
    expected_out, expected_lse = ref.forward_dense(*args, opts)
    assert_close(to_f64(out), expected_out, "bfloat16", what="out")
    assert_lse_close(to_f64(lse), expected_lse)

    dout = torch.randn_like(out)
    with skip_if_not_built():
        out.backward(dout)
    expected = ref.backward_dense(to_f64(dout), *args, to_f64(out), opts)
    for name, tensor, e in zip(("dq", "dk", "dv"), (q, k, v), expected[:3]):
        assert_close(to_f64(tensor.grad), e, "bfloat16", scale=max(1.0, np.abs(e).max()), what=name)


@pytest.mark.parametrize("deterministic", [False, True])
def test_torch_gradient_through_lse(rng, deterministic):
    """A loss that uses lse too: sum(out * dout) + sum(lse * dlse) under autograd on the GPU."""
    torch = torch_cuda()
    q, k, v = (torch.from_numpy(x.astype(np.float32)).cuda().bfloat16().requires_grad_(True)
               for x in reference_inputs(rng, "bfloat16"))
    sink = torch.from_numpy(rng.standard_normal(q.shape[2]).astype(np.float32)).cuda().requires_grad_(True)
    with skip_if_not_built():
        out, lse = cuflash.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, deterministic=deterministic)
        dout, dlse = torch.randn_like(out), torch.randn_like(lse)
        ((out.float() * dout.float()).sum() + (lse * dlse).sum()).backward()
    args = [to_f64(t) for t in (q, k, v)]
    opts = ref.Options(causal=True, sink=to_f64(sink))
    expected = ref.backward_dense(to_f64(dout), *args, to_f64(out), opts, dlse=to_f64(dlse))
    for name, tensor, e in zip(("dq", "dk", "dv"), (q, k, v), expected[:3]):
        assert_close(to_f64(tensor.grad), e, "bfloat16", scale=max(1.0, np.abs(e).max()), what=name)
    np.testing.assert_allclose(to_f64(sink.grad), expected[3], atol=2e-2 * max(1.0, np.abs(expected[3]).max()),
                               rtol=2e-2)


def test_torch_document_mask(rng):
    """A document mask on the GPU, forward and backward under autograd: the kernels run on the
    block lists that dispatch builds from the ids (documents longer than a 128-row block, so
    some blocks are skipped and some need no per-element check), against the reference."""
    torch = torch_cuda()
    batch, seqlen, heads, dim = 2, 700, 2, 128
    ids = np.zeros((batch, seqlen), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seqlen), size=3, replace=False))
        for cut in cuts:
            ids[b, cut:] += 1
    q, k, v = (torch.from_numpy(rng.standard_normal((batch, seqlen, heads, dim)).astype(np.float32))
               .cuda().bfloat16().requires_grad_(True) for _ in range(3))
    doc = torch.from_numpy(ids).cuda()
    opts = ref.Options(causal=True, mask=lambda b, i, j: ids[b][i] == ids[b][j])
    check_torch_autograd(torch, q, k, v, opts, causal=True, mask_mod=cuflash.masks.document(doc))


def test_torch_workspace_from_caching_allocator(rng, monkeypatch):
    # The workspace of torch calls comes from torch's caching allocator (one request per call
    # that needs workspace: the causal forward's tile counter, the backward's dQ accumulator), is
    # returned to it when the call returns, and the results are those of the reference.
    torch = torch_cuda()
    from cuflash import _tensors

    requested = []
    original = _tensors.TorchFramework.workspace_allocator

    def recording(self, like):
        allocate = original(self, like)
        assert allocate is not None

        def wrapped(nbytes):
            requested.append(nbytes)
            return allocate(nbytes)

        return wrapped

    monkeypatch.setattr(_tensors.TorchFramework, "workspace_allocator", recording)
    # Any head dim whose bf16 forward and backward this build holds.
    built = set(cuflash.built_kernels())
    dims = [d for d in (128, 64, 96, 192, 256) if {f"fwd bf16 hdim{d}", f"bwd bf16 hdim{d}"} <= built]
    if not dims:
        pytest.skip("no head dim with both bf16 kernels in this build")
    shapes = ((2, 200, 4, dims[0]), (2, 300, 2, dims[0]), (2, 300, 2, dims[0]))
    q, k, v = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)).cuda().bfloat16().requires_grad_(True)
               for s in shapes)
    with skip_if_not_built():
        out, lse = cuflash.flash_attn_func(q, k, v, causal=True)
    assert len(requested) == 1 and requested[0] > 0
    dout = torch.randn_like(out)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    with skip_if_not_built():
        out.backward(dout)
    torch.cuda.synchronize()
    assert len(requested) == 2 and requested[1] > 0
    # What stays allocated is the three gradients; the workspace went back to the cache.
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (q, k, v))
    assert torch.cuda.memory_allocated() - allocated <= grads + 4096
    opts = ref.Options(causal=True)
    args = [to_f64(t) for t in (q, k, v)]
    expected_out, expected_lse = ref.forward_dense(*args, opts)
    assert_close(to_f64(out), expected_out, "bfloat16", what="out")
    assert_lse_close(to_f64(lse), expected_lse)
    expected = ref.backward_dense(to_f64(dout), *args, to_f64(out), opts)
    for name, tensor, e in zip(("dq", "dk", "dv"), (q, k, v), expected[:3]):
        assert_close(to_f64(tensor.grad), e, "bfloat16", scale=max(1.0, np.abs(e).max()), what=name)


def test_torch_workspace_allocator_too_small(monkeypatch):
    # An allocator that returns less than it was asked for is refused by name.
    torch = torch_cuda()
    from cuflash import _tensors

    monkeypatch.setattr(_tensors.TorchFramework, "workspace_allocator",
                        lambda self, like: lambda nbytes: torch.empty(1, dtype=torch.uint8, device=like.device))
    q = torch.randn(1, 256, 2, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="workspace_allocator: asked for"), skip_if_not_built():
        cuflash.flash_attn_func(q, q, q, causal=True)
        torch.cuda.synchronize()


def test_torch_cpu_tensors_have_no_workspace_allocator():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from cuflash import _tensors

    assert _tensors.TorchFramework().workspace_allocator(torch.zeros(1)) is None


@pytest.mark.parametrize("deterministic", [False, True])
def test_torch_paged_kv_backward(rng, deterministic):
    """Paged KV under autograd on the GPU: the gradients of the page pools against the CPU
    reference's, with pages in shuffled order, a page two sequences share (its gradient is the
    sum), a page no sequence lists (zeros), a partly used last page (seqused_k) and GQA."""
    torch = torch_cuda()
    batch, seqlen_q, heads, heads_kv, dim, page_size, max_pages = 2, 150, 4, 2, 64, 64, 4
    num_pages = batch * max_pages + 1
    table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    table[1, 0] = table[0, 0]  # shared: sequence 1 reads sequence 0's first page
    seqused_k = np.array([max_pages * page_size - 7, 3 * page_size - 40], np.int32)
    q = rng.standard_normal((batch, seqlen_q, heads, dim)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((num_pages, page_size, heads_kv, dim)).astype(np.float32)
                        for _ in range(2))
    dout = rng.standard_normal((batch, seqlen_q, heads, dim)).astype(np.float32)

    def run(device):
        tensors = [torch.from_numpy(x).to(device).bfloat16().requires_grad_(True) for x in (q, k_cache, v_cache)]
        out, _ = cuflash.flash_attn_varlen_func(
            *tensors, seqused_k=torch.from_numpy(seqused_k).to(device),
            page_table=torch.from_numpy(table).to(device), causal=True, deterministic=deterministic)
        grads = torch.autograd.grad(out, tensors, torch.from_numpy(dout).to(device).bfloat16())
        return [to_f64(out)] + [to_f64(g) for g in grads], [g.detach().clone() for g in grads]

    expected, _ = run("cpu")
    with skip_if_not_built():
        actual, raw = run("cuda")
    for name, a, e in zip(("out", "dq", "dk_cache", "dv_cache"), actual, expected):
        assert_close(a, e, "bfloat16", scale=max(1.0, np.abs(e).max()), what=name)
    if deterministic:
        _, again = run("cuda")
        for name, a, b in zip(("dq", "dk_cache", "dv_cache"), raw, again):
            assert torch.equal(a, b), f"{name} differs between two deterministic runs"


@pytest.mark.parametrize("case", ["fp16_softcap", "sink_fp32", "packed_q_sink_softcap", "d256_local", "d96_gqa4"])
def test_torch_paged_kv_backward_options(rng, case):
    """The paged backward with the options beside pages: fp16, softcap, a learnable sink (its
    gradient too), packed queries, a window, head dims 96 / 256; out, lse and every gradient
    against the CPU reference."""
    torch = torch_cuda()
    dtype = torch.float16 if case.startswith("fp16") else torch.bfloat16
    dim = {"d256_local": 256, "packed_q_sink_softcap": 64, "d96_gqa4": 96}.get(case, 128)
    heads, heads_kv = (8, 2) if case == "d96_gqa4" else (4, 2)
    batch, seqlen_q, page_size, max_pages = 3, 90, 32, 6
    num_pages = batch * max_pages + 2
    table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    seqused_k = np.array([max_pages * page_size - 5, 0, 2 * page_size + 3], np.int32)  # one without keys
    packed = case.startswith("packed")
    lengths_q = np.array([40, 17, 33])
    q_shape = (int(lengths_q.sum()), heads, dim) if packed else (batch, seqlen_q, heads, dim)
    q = rng.standard_normal(q_shape).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((num_pages, page_size, heads_kv, dim)).astype(np.float32)
                        for _ in range(2))
    sink = rng.standard_normal(heads).astype(np.float32) if "sink" in case else None
    options = dict(softcap=20.0 if "softcap" in case else 0.0, causal=case != "d256_local",
                   window_size=(100, 0) if case == "d256_local" else (None, None))
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)

    def run(device):
        tensors = [torch.from_numpy(x).to(device).to(dtype).requires_grad_(True) for x in (q, k_cache, v_cache)]
        if sink is not None:
            tensors.append(torch.from_numpy(sink).to(device).requires_grad_(True))
        extra = dict(cu_seqlens_q=torch.from_numpy(cu_q).to(device), max_seqlen_q=int(lengths_q.max())) if packed else {}
        out, lse = cuflash.flash_attn_varlen_func(
            *tensors[:3], seqused_k=torch.from_numpy(seqused_k).to(device), page_table=torch.from_numpy(table).to(device),
            learnable_sink=tensors[3] if sink is not None else None, **options, **extra)
        dout = torch.from_numpy(rng_dout(out.shape)).to(device).to(dtype)
        finite = torch.isfinite(lse)
        loss = (out.float() * dout.float()).sum() + torch.where(finite, lse, torch.zeros_like(lse)).sum() * 0.5
        grads = torch.autograd.grad(loss, tensors)
        return [to_f64(out), to_f64(lse)] + [to_f64(g) for g in grads]

    def rng_dout(shape):
        return np.random.default_rng(11).standard_normal(tuple(shape)).astype(np.float32)

    expected = run("cpu")
    with skip_if_not_built():
        actual = run("cuda")
    names = ("out", "lse", "dq", "dk_cache", "dv_cache", "d_sink")
    dtype_name = "float16" if dtype == torch.float16 else "bfloat16"
    for name, a, e in zip(names, actual, expected):
        if name == "lse":
            assert_lse_close(a, e)
        else:
            assert_close(a, e, dtype_name, scale=max(1.0, np.abs(e).max()), what=name)


def check_paged_autograd(rng, seqlen_q, page_size, max_pages, unused_tail, attend):
    """Paged KV under autograd on the GPU against the CPU reference: batch 2, 4 query heads on 2
    kv heads, head dim 128, shuffled pages with 3 spare, the second sequence's last unused_tail
    keys unused. attend(device, q, k_cache, v_cache, seqused_k, page_table) -> out; out and the
    gradients of q and the pages are compared. A kernel missing from the build skips."""
    torch = torch_cuda()
    batch, heads, heads_kv, dim = 2, 4, 2, 128
    num_pages = batch * max_pages + 3
    table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    seqused_k = np.array([max_pages * page_size, max_pages * page_size - unused_tail], np.int32)
    q = rng.standard_normal((batch, seqlen_q, heads, dim)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((num_pages, page_size, heads_kv, dim)).astype(np.float32)
                        for _ in range(2))
    dout = rng.standard_normal((batch, seqlen_q, heads, dim)).astype(np.float32)

    def run(device):
        tensors = [torch.from_numpy(x).to(device).bfloat16().requires_grad_(True) for x in (q, k_cache, v_cache)]
        out = attend(device, *tensors, torch.from_numpy(seqused_k).to(device), torch.from_numpy(table).to(device))
        grads = torch.autograd.grad(out, tensors, torch.from_numpy(dout).to(device).bfloat16())
        return [to_f64(out)] + [to_f64(g) for g in grads]

    expected = run("cpu")
    try:
        actual = run("cuda")
    except NotImplementedError as error:
        if "is not in this build" not in str(error):
            raise
        pytest.skip(f"not in this build: {error}")
    for name, a, e in zip(("out", "dq", "dk_cache", "dv_cache"), actual, expected):
        assert_close(a, e, "bfloat16", scale=max(1.0, np.abs(e).max()), what=name)


def test_torch_paged_kv_builtin_mods(rng):
    """Paged KV with a built-in score_mod under autograd on the GPU (the flex_paged forward
    kernel, then the paged backward over the flex backward): ALiBi with a local window."""
    slopes = cuflash.scores.alibi_slopes(4)  # NumPy: moved to q's device

    def attend(device, q, k_cache, v_cache, seqused_k, page_table):
        return cuflash.flash_attn_varlen_func(q, k_cache, v_cache, seqused_k=seqused_k, page_table=page_table,
                                              window_size=(100, 10), score_mod=cuflash.scores.alibi(slopes))[0]

    check_paged_autograd(rng, seqlen_q=130, page_size=16, max_pages=20, unused_tail=45, attend=attend)


def test_torch_paged_kv_block_lists(rng):
    """Block lists over paged keys under autograd on the GPU (the flex_paged forward with the
    lists counted over max_pages * page_size keys, then the paged backward over the flex
    backward, which tabulates the forward lists): per-head lists with a causal mask_mod. The
    public signatures are the seed's (no lists beside a page table), so the internal forward
    takes them."""
    from cuflash import interface

    batch, heads, rows, cols = 2, 4, 2, 3  # ceil(200 / 128) row blocks, ceil(10 * 32 / 128) columns
    cnt = np.zeros((batch, heads, rows), np.int32)
    idx = np.zeros((batch, heads, rows, cols), np.int32)
    for b, h, m in np.ndindex(batch, heads, rows):
        chosen = rng.permutation(np.flatnonzero(rng.random(cols) < 0.7))
        cnt[b, h, m] = len(chosen)
        idx[b, h, m, : len(chosen)] = chosen

    def attend(device, q, k_cache, v_cache, seqused_k, page_table):
        torch = torch_cuda()
        lists = (torch.from_numpy(cnt).to(device), torch.from_numpy(idx).to(device), None, None)
        return interface._forward(q, k_cache, v_cache, None, False, (None, None), None, 0.0, 1, None, False,
                                  seqused_k=seqused_k, page_table=page_table, mask_mod=cuflash.masks.causal(),
                                  block_sparse=lists)[0]

    check_paged_autograd(rng, seqlen_q=200, page_size=32, max_pages=10, unused_tail=100, attend=attend)


def test_torch_with_numpy_block_lists(rng):
    """create_block_mask returns NumPy lists, which the attention functions move to q's framework
    and device: CUDA torch inputs, forward and backward. The lists come from a causal document mask
    and the mask_mod is the document mask alone, so the result depends on the lists (blocks above
    the diagonal are skipped, the diagonal's partial blocks keep their upper part): against the
    reference with the same blocks."""
    torch = torch_cuda()
    batch, seqlen, heads, dim = 2, 300, 2, 64
    ids = np.zeros((batch, seqlen), np.int32)
    for b in range(batch):
        ids[b] = np.searchsorted(np.sort(rng.choice(np.arange(1, seqlen), size=3, replace=False)), np.arange(seqlen),
                                 side="right")
    lists = cuflash.block_sparse.create_block_mask(
        lambda b, h, q_idx, kv_idx: (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx), batch, None, seqlen, seqlen)
    assert isinstance(lists.mask_block_cnt, np.ndarray)
    q, k, v = (torch.from_numpy(rng.standard_normal((batch, seqlen, heads, dim)).astype(np.float32)).cuda().bfloat16()
               .requires_grad_(True) for _ in range(3))
    dout = torch.from_numpy(rng.standard_normal((batch, seqlen, heads, dim)).astype(np.float32)).cuda().bfloat16()
    with skip_if_not_built():
        out, _ = cuflash.flash_attn_func(q, k, v, mask_mod=cuflash.masks.document(ids), **lists._asdict())
        out.backward(dout)
        torch.cuda.synchronize()
    opts = ref.Options(mask=lambda b, i, j: ids[b][i] == ids[b][j],
                       blocks=ref.block_masks((lists.full_block_cnt, lists.full_block_idx),
                                              (lists.mask_block_cnt, lists.mask_block_idx), seqlen, seqlen))
    args = [to_f64(t) for t in (q, k, v)]
    expected_out, _ = ref.forward_dense(*args, opts)
    assert_close(to_f64(out), expected_out, "bfloat16", what="out")
    expected = ref.backward_dense(to_f64(dout), *args, to_f64(out), opts)
    for name, tensor, e in zip(("dq", "dk", "dv"), (q, k, v), expected[:3]):
        assert_close(to_f64(tensor.grad), e, "bfloat16", scale=max(1.0, np.abs(e).max()), what=name)


def test_torch_side_stream(rng):
    torch = torch_cuda()
    q, k, v = (torch.from_numpy(x.astype(np.float32)).cuda().bfloat16() for x in reference_inputs(rng, "bfloat16"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), skip_if_not_built():
        out, _ = cuflash.flash_attn_func(q, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    expected_out, _ = ref.forward_dense(*(to_f64(t) for t in (q, k, v)), ref.Options())
    assert_close(to_f64(out), expected_out, "bfloat16", what="out")


def test_torch_outputs_in_place(rng):
    # flash_attn_forward / flash_attn_backward into the caller's CUDA tensors (permuted out,
    # lse padded along its rows, dq permuted), equal to what the allocating calls return.
    torch = torch_cuda()
    q, k, v = (torch.from_numpy(x.astype(np.float32)).cuda().bfloat16() for x in reference_inputs(rng, "bfloat16"))
    batch, seqlen_q, _, heads, _, dim = SHAPE
    with skip_if_not_built():
        expected_out, expected_lse = cuflash.flash_attn_func(q, k, v, causal=True)
    out = torch.full((batch, heads, seqlen_q, dim), 7.0, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    lse_buffer = torch.full((batch, heads, seqlen_q + 8), 5.0, device="cuda")
    lse = lse_buffer[:, :, :seqlen_q]
    result, result_lse = cuflash.flash_attn_forward(q, k, v, causal=True, out=out, lse=lse)
    assert result is out and result_lse is lse
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    assert bool((lse_buffer[:, :, seqlen_q:] == 5).all())
    # Deterministic, so that the two backward calls can be compared bit for bit.
    dout = torch.randn_like(expected_out)
    expected = cuflash.flash_attn_backward(dout, q, k, v, expected_out, expected_lse, causal=True,
                                           deterministic=True)
    dq = torch.zeros((batch, heads, seqlen_q, dim), dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, deterministic=True, dq=dq)
    assert grads[0] is dq
    for g, e in zip(grads[:3], expected[:3]):
        assert torch.equal(g, e)


def test_torch_split_kv_leaves_rows_past_the_last_sequence(rng):
    # A padded packed batch under split-KV: the combine writes only the sequences' rows, so the
    # rows past cu_seqlens_q[-1] keep the zeros the package allocates (and a caller's out its
    # own values), as on the CPU.
    torch = torch_cuda()
    lengths_q, lengths_k = [70, 130], [300, 200]
    heads, dim = 4, 128
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lengths_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths_k)]), dtype=torch.int32)
    q = torch.randn(sum(lengths_q) + 9, heads, dim).bfloat16()
    k = torch.randn(sum(lengths_k) + 5, heads, dim).bfloat16()
    v = torch.randn_like(k)
    cpu_out, cpu_lse = cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 130, 300, num_splits=3)
    with skip_if_not_built():
        out, lse = cuflash.flash_attn_varlen_func(q.cuda(), k.cuda(), v.cuda(), cu_q.cuda(), cu_k.cuda(), 130, 300,
                                                  num_splits=3)
    rows = sum(lengths_q)
    assert bool((out[rows:] == 0).all()) and bool((lse[:, rows:] == 0).all())
    assert_close(to_f64(out[:rows]), to_f64(cpu_out[:rows]), "bfloat16", what="out")
    assert_lse_close(to_f64(lse[:, :rows]), to_f64(cpu_lse[:, :rows]))
    given = torch.full(out.shape, 3.0, dtype=torch.bfloat16, device="cuda")
    cuflash.flash_attn_forward(q.cuda(), k.cuda(), v.cuda(), cu_q.cuda(), cu_k.cuda(), 130, 300, num_splits=3,
                               out=given)
    assert bool((given[rows:] == 3).all()) and torch.equal(given[:rows], out[:rows])


def test_torch_empty_calls(rng):
    # No sequences (batch 0), no queries (seqlen_q 0: dk = dv = 0) and no keys (seqlen_k 0:
    # out 0, lse the sink's logit (-inf without one), dq = 0), forward and backward, with a sink
    # (d_sink 0: out is 0, so every row's dPsum is).
    torch = torch_cuda()
    heads, dim = 4, 128
    sink = torch.randn(heads, device="cuda")
    for batch, seqlen_q, seqlen_k in ((0, 16, 16), (2, 0, 40), (2, 24, 0)):
        q, k, v = (torch.randn(batch, s, heads, dim, device="cuda").bfloat16() for s in (seqlen_q, seqlen_k, seqlen_k))
        with skip_if_not_built():
            out, lse = cuflash.flash_attn_func(q, k, v, learnable_sink=sink)
        assert out.shape == (batch, seqlen_q, heads, dim) and lse.shape == (batch, heads, seqlen_q)
        assert bool((out == 0).all()), "no query sees a key here"
        _, cpu_lse = cuflash.flash_attn_func(q.cpu(), k.cpu(), v.cpu(), learnable_sink=sink.cpu())
        assert torch.allclose(lse.cpu(), cpu_lse)
        dout = torch.randn_like(out)
        dq, dk, dv, d_sink = cuflash.flash_attn_backward(dout, q, k, v, out, lse, learnable_sink=sink)
        for grad, tensor in ((dq, q), (dk, k), (dv, v)):
            assert grad.shape == tensor.shape and bool((grad == 0).all())
        assert d_sink.shape == (heads,) and bool((d_sink == 0).all())


def test_torch_size_one_dimensions_with_any_stride(rng):
    # Decoding: q of one row per sequence, the row dimension given stride 1 (as some DLPack
    # exporters give size-1 dimensions); the kernels never step over it, so it runs as it is.
    torch = torch_cuda()
    base = torch.randn(2, 1, 8, 128, device="cuda").bfloat16()
    q = base.as_strided((2, 1, 8, 128), (1024, 1, 128, 1))
    k = torch.randn(2, 300, 2, 128, device="cuda").bfloat16()
    v = torch.randn_like(k)
    with skip_if_not_built():
        out, lse = cuflash.flash_attn_func(q, k, v)
        expected_out, expected_lse = cuflash.flash_attn_func(base.contiguous(), k, v)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)


def check_gpu_against_cpu(run, grad_names):
    """run(device) -> [out, lse, *gradients] in bfloat16 on the GPU (a kernel missing from the
    build skips) against the CPU reference: out and each gradient by the accuracy rule (a
    gradient relative to its largest value), lse by its own."""
    with skip_if_not_built():
        gpu = run("cuda")
    cpu = run("cpu")
    assert_close(to_f64(gpu[0]), to_f64(cpu[0]), "bfloat16", what="out")
    assert_lse_close(to_f64(gpu[1]), to_f64(cpu[1]))
    for name, g, c in zip(grad_names, gpu[2:], cpu[2:]):
        expected = to_f64(c)
        assert_close(to_f64(g), expected, "bfloat16", scale=max(1.0, np.abs(expected).max()), what=name)


@pytest.mark.parametrize("mod", ["alibi", "prefix_lm", "document"])
def test_torch_flex_with_sink_seqused_and_lse_gradient(rng, mod):
    # The flex kernels (a score_mod or a mask_mod) with what their GPU tests in C++ leave out: a
    # learnable sink, seqused_q / seqused_k over packed sequences with GQA, and a gradient reaching
    # lse; GPU against the CPU reference, forward and backward (d_sink too).
    torch = torch_cuda()
    heads, heads_kv, dim = 4, 2, 128
    lengths = [300, 170]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    seqused_q = torch.tensor([230, 170], dtype=torch.int32)
    seqused_k = torch.tensor([300, 90], dtype=torch.int32)
    total = sum(lengths)
    q = torch.from_numpy(rng.standard_normal((total, heads, dim)).astype(np.float32)).bfloat16()
    k = torch.from_numpy(rng.standard_normal((total, heads_kv, dim)).astype(np.float32)).bfloat16()
    v = torch.from_numpy(rng.standard_normal((total, heads_kv, dim)).astype(np.float32)).bfloat16()
    sink = torch.from_numpy(rng.standard_normal(heads).astype(np.float32))
    if mod == "alibi":
        mods = dict(score_mod=cuflash.scores.alibi(cuflash.scores.alibi_slopes(heads)), causal=True)
    elif mod == "prefix_lm":
        mods = dict(mask_mod=cuflash.masks.prefix_lm(64))
    else:
        ids = np.repeat(np.arange(8), 40)[None, :300].repeat(2, axis=0).astype(np.int32)
        mods = dict(mask_mod=cuflash.masks.document(ids))

    def run(device):
        moved = [t.to(device) for t in (q, k, v, cu, seqused_q, seqused_k, sink)]
        qd, kd, vd, cud, sqd, skd, sinkd = moved
        common = dict(cu_seqlens_q=cud, cu_seqlens_k=cud, max_seqlen_q=300, max_seqlen_k=300, seqused_q=sqd,
                      seqused_k=skd, learnable_sink=sinkd, **mods)
        out, lse = cuflash.flash_attn_forward(qd, kd, vd, return_lse=True, **common)
        dout = torch.from_numpy(np.random.default_rng(7).standard_normal(out.shape).astype(np.float32))
        dlse = torch.from_numpy(np.random.default_rng(8).standard_normal(lse.shape).astype(np.float32))
        dlse = torch.where(torch.isfinite(lse.cpu()), dlse, torch.zeros_like(dlse))
        grads = cuflash.flash_attn_backward(dout.bfloat16().to(device), qd, kd, vd, out, lse, dlse=dlse.to(device),
                                            **common)
        return [out, lse, *grads]

    check_gpu_against_cpu(run, ("dq", "dk", "dv", "d_sink"))


@pytest.mark.parametrize("case", ["causal_gqa", "paged_packed_gqa", "prefix_lm_split3"])
def test_torch_varlen_without_max_seqlen_hints(rng, case):
    # Packed queries in device memory without max_seqlen_q (the seed interface's default): the
    # forward walks its row-block list, built on the GPU from cu_seqlens_q, rather than batch x
    # total_q rows, and the backward its row-block and column-block lists
    # (sm90/varlen_block_list_sm90.hpp). 40 sequences, one without queries and one
    # longer than the rest; out, lse and the gradients against the CPU reference.
    torch = torch_cuda()
    heads, heads_kv, dim = 4, 2, 128
    lengths = rng.integers(0, 150, size=40)
    lengths[3], lengths[7] = 0, 700
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    total = int(lengths.sum())
    q = torch.from_numpy(rng.standard_normal((total, heads, dim)).astype(np.float32)).bfloat16()
    paged = case.startswith("paged")
    if paged:
        page_size, max_pages = 64, 12
        num_pages = len(lengths) * max_pages
        table = torch.from_numpy(rng.permutation(num_pages).reshape(len(lengths), max_pages).astype(np.int32))
        seqused_k = torch.from_numpy(rng.integers(0, max_pages * page_size, size=len(lengths)).astype(np.int32))
        k, v = (torch.from_numpy(rng.standard_normal((num_pages, page_size, heads_kv, dim)).astype(np.float32))
                .bfloat16() for _ in range(2))
    else:
        k, v = (torch.from_numpy(rng.standard_normal((total, heads_kv, dim)).astype(np.float32)).bfloat16()
                for _ in range(2))
    dout = torch.from_numpy(rng.standard_normal((total, heads, dim)).astype(np.float32)).bfloat16()

    def run(device):
        qd, kd, vd = (t.to(device).requires_grad_(True) for t in (q, k, v))
        cud = cu.to(device)
        if paged:
            extra = dict(cu_seqlens_q=cud, page_table=table.to(device), seqused_k=seqused_k.to(device),
                         pack_gqa=True)
        else:
            extra = dict(cu_seqlens_q=cud, cu_seqlens_k=cud)
        if case == "prefix_lm_split3":
            out, lse = cuflash.flash_attn_forward(qd, kd, vd, return_lse=True, mask_mod=cuflash.masks.prefix_lm(48),
                                                  num_splits=3, **extra)
            grads = cuflash.flash_attn_backward(dout.to(device), qd, kd, vd, out, lse,
                                                mask_mod=cuflash.masks.prefix_lm(48), **extra)
        else:
            out, lse = cuflash.flash_attn_varlen_func(qd, kd, vd, causal=True, **extra)
            grads = torch.autograd.grad(out, (qd, kd, vd), dout.to(device))
        return [out, lse, *grads]

    check_gpu_against_cpu(run, ("dq", "dk", "dv"))


@pytest.mark.parametrize("causal", [True, False])
def test_torch_deterministic_backward_with_a_short_max_seqlen_hint(rng, causal):
    # max_seqlen_q below the longest packed sequence (the host cannot check a hint against
    # device cu_seqlens): the deterministic backward walks only the row blocks the hint counts,
    # as the forward computes only those, instead of running past its semaphores (a hang or a
    # write out of bounds). What it returns for such a call is not specified; it must return,
    # without NaN where the hint's rows reach. Non-causal, the deterministic walks are rotated
    # (each column block starts at another row block), over the hint's row blocks too.
    torch = torch_cuda()
    lengths = [400, 100]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lengths), 4, 128, device="cuda").bfloat16() for _ in range(3))
    with skip_if_not_built():
        out, lse = cuflash.flash_attn_varlen_func(q, k, v, cu, cu, 400, 400, causal=causal)
        grads = cuflash.flash_attn_backward(torch.randn_like(out), q, k, v, out, lse, cu, cu, 128, 400,
                                            causal=causal, deterministic=True)
    torch.cuda.synchronize()
    assert all(bool(torch.isfinite(g[:128].float()).all()) for g in grads[:3])


def test_torch_check_inputs_reads_device_index_tensors(monkeypatch):
    # CUFLASH_CHECK_INPUTS=1: index tensors in device memory are read back and checked as host
    # ones, so bad values fail naming the argument before any kernel runs.
    torch = torch_cuda()
    monkeypatch.setenv("CUFLASH_CHECK_INPUTS", "1")
    heads, dim = 2, 128
    q, k, v = (torch.randn(300, heads, dim, device="cuda").bfloat16() for _ in range(3))
    cu = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
    with skip_if_not_built():
        out, lse = cuflash.flash_attn_varlen_func(q, k, v, cu, cu, 200, 200)
    monkeypatch.delenv("CUFLASH_CHECK_INPUTS")
    unchecked, _ = cuflash.flash_attn_varlen_func(q, k, v, cu, cu, 200, 200)
    assert torch.equal(out, unchecked)
    monkeypatch.setenv("CUFLASH_CHECK_INPUTS", "1")
    bad = torch.tensor([0, 200, 100], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="^cu_seqlens_q: expected non-decreasing offsets"):
        cuflash.flash_attn_varlen_func(q, k, v, bad, cu, 200, 200)
    with pytest.raises(ValueError, match="^max_seqlen_q: expected at least 200"):
        cuflash.flash_attn_varlen_func(q, k, v, cu, cu, 128, 200)
    with pytest.raises(ValueError, match="^cu_seqlens_k: expected non-decreasing offsets"):
        cuflash.flash_attn_backward(torch.randn_like(out), q, k, v, out, lse, cu, bad, 200, 200)
    # A page number past the pages, and a block index past the column blocks.
    k_pages, v_pages = (torch.randn(4, 64, heads, dim, device="cuda").bfloat16() for _ in range(2))
    page_table = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32, device="cuda")
    qd = torch.randn(2, 64, heads, dim, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="^page_table: "):
        cuflash.flash_attn_varlen_func(qd, k_pages, v_pages, page_table=page_table)
    cnt = torch.ones(2, 1, 1, dtype=torch.int32, device="cuda")
    idx = torch.full((2, 1, 1, 1), 3, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="^mask_block_idx: "):
        cuflash.flash_attn_func(qd, qd, qd, mask_mod=cuflash.masks.causal(), mask_block_cnt=cnt, mask_block_idx=idx)
    # flash_attn_combine's sequences too.
    out_partial = torch.randn(2, 300, heads, dim, device="cuda")
    lse_partial = torch.randn(2, 300, heads, device="cuda")
    with pytest.raises(ValueError, match="^cu_seqlens: "):
        cuflash.flash_attn_combine(out_partial, lse_partial, cu_seqlens=bad)


def test_torch_combine_many_splits_and_empty_splits(rng):
    # More than 32 splits (the kernel weighs them in groups of 32), splits that saw no key (lse
    # -inf) whose partials hold NaN, which must not reach the output, and a row that no split saw.
    torch = torch_cuda()
    splits, batch, seqlen, heads, dim = 40, 2, 3, 4, 128
    out_partial = rng.standard_normal((splits, batch, seqlen, heads, dim)).astype(np.float32)
    lse_partial = (rng.standard_normal((splits, batch, seqlen, heads)) * 3).astype(np.float32)
    empty = rng.random(lse_partial.shape) < 0.3
    empty[:, 1, 2, 3] = True
    lse_partial[empty] = -np.inf
    expected_out, expected_lse = ref.combine(out_partial, lse_partial)
    out_partial[empty] = np.nan
    for out_dtype in (None, torch.bfloat16):
        out, lse = cuflash.flash_attn_combine(torch.from_numpy(out_partial).cuda(),
                                              torch.from_numpy(lse_partial).cuda(), out_dtype=out_dtype)
        assert bool(torch.isfinite(out).all())
        assert_close(to_f64(out), expected_out, "float16" if out_dtype is None else "bfloat16", what="out")
        assert_lse_close(to_f64(lse), expected_lse)
        assert bool((out[1, 2, 3] == 0).all()) and float(lse[1, 2, 3]) == -np.inf


def test_torch_gpu_matches_cpu_reference(rng):
    torch = torch_cuda()
    q, k, v = (torch.from_numpy(x.astype(np.float32)).bfloat16() for x in reference_inputs(rng, "bfloat16"))
    cpu_out, cpu_lse = cuflash.flash_attn_func(q, k, v, causal=True)
    with skip_if_not_built():
        gpu_out, gpu_lse = cuflash.flash_attn_func(q.cuda(), k.cuda(), v.cuda(), causal=True)
    assert_close(to_f64(gpu_out), to_f64(cpu_out), "bfloat16", what="out")
    assert_lse_close(to_f64(gpu_lse), to_f64(cpu_lse))


@pytest.mark.parametrize("pack_gqa", [False, True])
def test_torch_window_sides_of_int_max(rng, pack_gqa):
    # A window side of 2^31 - 1 ("unbounded" to a caller) with more queries than keys: the
    # forward's window arithmetic overflowed int and hid every key (out 0, lse -inf); the sides
    # past the sequences are now no bound, as on the CPU.
    torch = torch_cuda()
    big = 2**31 - 1
    q = torch.from_numpy(rng.standard_normal((2, 256, 8, 128)).astype(np.float32)).bfloat16()
    k, v = (torch.from_numpy(rng.standard_normal((2, 64, 2, 128)).astype(np.float32)).bfloat16() for _ in range(2))
    for window, causal in (((big, 0), False), ((big, big), False), ((big, -1), True)):
        cpu_out, cpu_lse = cuflash.flash_attn_func(q, k, v, window_size=window, causal=causal)
        with skip_if_not_built():
            gpu_out, gpu_lse = cuflash.flash_attn_func(q.cuda(), k.cuda(), v.cuda(), window_size=window,
                                                       causal=causal, pack_gqa=pack_gqa)
        assert_close(to_f64(gpu_out), to_f64(cpu_out), "bfloat16", what=f"out {window} causal={causal}")
        assert_lse_close(to_f64(gpu_lse), to_f64(cpu_lse))


@pytest.mark.parametrize("paged", [False, True])
def test_torch_kvcache_append_and_decode(rng, paged):
    # flash_attn_with_kvcache on CUDA tensors: the append (torch's indexed store on the device)
    # and the split-KV decode against the same call on the CPU, caches compared too.
    torch = torch_cuda()
    batch, heads, heads_kv, dim, page_size, max_pages, new = 3, 8, 2, 128, 64, 8, 2
    capacity = page_size * max_pages
    lengths = np.array([0, 200, capacity - new], np.int32)
    rows = batch * max_pages + 1 if paged else batch
    table = rng.permutation(rows)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32) if paged else None
    shape = (rows, page_size, heads_kv, dim) if paged else (batch, capacity, heads_kv, dim)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in
              ((batch, new, heads, dim), shape, shape, (batch, new, heads_kv, dim), (batch, new, heads_kv, dim))]

    def run(device):
        q, k_cache, v_cache, k, v = (torch.from_numpy(x).to(device).bfloat16() for x in arrays)
        out, lse = cuflash.flash_attn_with_kvcache(
            q, k_cache, v_cache, k=k, v=v, cache_seqlens=torch.from_numpy(lengths).to(device),
            page_table=None if table is None else torch.from_numpy(table).to(device), causal=True,
            return_softmax_lse=True)
        return [to_f64(t) for t in (out, lse, k_cache, v_cache)]

    expected = run("cpu")
    with skip_if_not_built():
        actual = run("cuda")
    assert_close(actual[0], expected[0], "bfloat16", what="out")
    assert_lse_close(actual[1], expected[1])
    for name, a, e in zip(("k_cache", "v_cache"), actual[2:], expected[2:]):
        np.testing.assert_array_equal(a, e, err_msg=name)


def test_cupy(rng):
    cupy = pytest.importorskip("cupy", reason="cupy is not installed")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    if not cuflash.built_with_cuda:
        pytest.skip("cuflash was built without CUDA")
    q, k, v = reference_inputs(rng, "float16")
    with skip_if_not_built():
        out, lse = cuflash.flash_attn_func(*(cupy.asarray(x) for x in (q, k, v)), causal=True)
    assert isinstance(out, cupy.ndarray) and out.dtype == np.float16
    expected_out, expected_lse = ref.forward_dense(q, k, v, ref.Options(causal=True))
    assert_close(cupy.asnumpy(out), expected_out, "float16", what="out")
    assert_lse_close(cupy.asnumpy(lse), expected_lse)


def jax_gpu_device():
    """jax and its first GPU device, with a cuflash build with CUDA."""
    jax = pytest.importorskip("jax", reason="jax is not installed")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        pytest.skip("no JAX GPU device")
    if not cuflash.built_with_cuda:
        pytest.skip("cuflash was built without CUDA")
    return jax, gpus[0]


def jax_gpu():
    """jax_gpu_device, with the XLA FFI handlers in the build."""
    jax, gpu = jax_gpu_device()
    from cuflash import _jax

    if not _jax.available():
        pytest.skip("this cuflash build has no XLA FFI handlers (jax was not found when it was configured)")
    return jax, gpu


def test_jax(rng):
    jax, gpu = jax_gpu_device()
    q, k, v = reference_inputs(rng, "bfloat16")
    with skip_if_not_built():
        out, lse = cuflash.flash_attn_func(*(jax.device_put(x, gpu) for x in (q, k, v)))
    assert isinstance(out, jax.Array)
    expected_out, expected_lse = ref.forward_dense(q, k, v, ref.Options())
    assert_close(np.asarray(out).astype(np.float64), expected_out, "bfloat16", what="out")
    assert_lse_close(np.asarray(lse), expected_lse)


@pytest.mark.parametrize("causal", [False, True])
def test_jax_jit_forward_grad(rng, causal):
    # The CUDA FFI handlers, on XLA's stream, with workspace from XLA's allocator.
    jax, gpu = jax_gpu()
    jnp = jax.numpy
    q, k, v = reference_inputs(rng, "bfloat16")
    jq, jk, jv = (jax.device_put(x, gpu) for x in (q, k, v))
    dout = rng.standard_normal(q.shape[:-1] + (v.shape[-1],)).astype(q.dtype)
    jdout = jax.device_put(dout, gpu)

    def attention(q, k, v):
        return cuflash.flash_attn_func(q, k, v, causal=causal)

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v)[0].astype(jnp.float32) * jdout.astype(jnp.float32))

    with skip_if_not_built():
        out, lse = jax.jit(attention)(jq, jk, jv)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jq, jk, jv)
        jax.block_until_ready((out, lse, grads))
    assert list(out.devices())[0] == gpu and out.dtype == jq.dtype
    opts = ref.Options(causal=causal)
    expected_out, expected_lse = ref.forward_dense(q, k, v, opts)
    assert_close(np.asarray(out).astype(np.float64), expected_out, "bfloat16", what="out")
    assert_lse_close(np.asarray(lse), expected_lse)
    expected = ref.backward_dense(dout, q, k, v, np.asarray(out), opts)
    for name, grad, e in zip(("dq", "dk", "dv"), grads, expected[:3]):
        assert grad.dtype == jq.dtype
        assert_close(np.asarray(grad).astype(np.float64), e, "bfloat16", scale=max(1.0, np.abs(e).max()), what=name)


def test_jax_combine_eager_jit_and_grad(rng):
    # flash_attn_combine on JAX GPU arrays (JAX arrays always take the jax.numpy combine, which
    # jit, grad and shard_map can trace): eager and under jax.jit against the NumPy path (the CPU
    # kernel), and jax.grad through it against a direct logsumexp / softmax form, all on the GPU.
    jax, gpu = jax_gpu_device()
    used = np.array([4, 7], np.int32)
    merged = (np.arange(7)[None, :] < used[:, None])[..., None]
    out_partial = rng.standard_normal((3, 2, 7, 2, 64)).astype(np.float32)
    lse_partial = (3 * rng.standard_normal((3, 2, 7, 2))).astype(np.float32)
    lse_partial[1, ..., 0] = -np.inf  # an empty split in some rows
    lse_partial[:, 0, 0] = -np.inf  # a row with no split at all
    expected_out, expected_lse = cuflash.flash_attn_combine(out_partial, lse_partial, seqused=used)
    jo, jl, ju = (jax.device_put(x, gpu) for x in (out_partial, lse_partial, used))
    out, lse = cuflash.flash_attn_combine(jo, jl, seqused=ju)
    assert list(out.devices())[0] == gpu
    np.testing.assert_allclose(np.asarray(out), expected_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), expected_lse, rtol=1e-5, atol=1e-6)
    out, lse = jax.jit(lambda o, l: cuflash.flash_attn_combine(o, l, seqused=ju))(jo, jl)
    np.testing.assert_allclose(np.asarray(out), expected_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), expected_lse, rtol=1e-5, atol=1e-6)

    weights = jax.device_put(rng.standard_normal(expected_out.shape).astype(np.float32), gpu)
    keep_rows = jax.device_put(merged, gpu)

    combine = lambda o, l: cuflash.flash_attn_combine(o, l, seqused=ju)  # noqa: E731
    got = jax.jit(jax.grad(jax_combine_loss(jax, combine, weights, keep_rows), argnums=(0, 1)))(jo, jl)
    direct = jax_combine_direct(jax, keep_rows)
    expected = jax.jit(jax.grad(jax_combine_loss(jax, direct, weights, keep_rows), argnums=(0, 1)))(jo, jl)
    for g, e in zip(got, expected):
        assert list(g.devices())[0] == gpu and np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-5)


def test_jax_jit_callable_score_mod(rng):
    # A score_mod callable under jax.jit and jax.grad on the GPU backend: the kernels compiled at
    # run time for it (the structure gpu_callables builds ahead), launched by the CUDA FFI
    # handlers; against the built-in it spells out.
    jax, gpu = jax_gpu()
    jnp = jax.numpy
    import gpu_callables

    q, k, v = (jax.device_put(rng.standard_normal((2, 256, 4, gpu_callables.HEAD_DIM)).astype(np.float32), gpu)
               .astype(jnp.bfloat16) for _ in range(3))
    slopes = np.asarray(cuflash.scores.alibi_slopes(4), np.float32)

    def loss(score_mod):
        def f(q, k, v):
            return jnp.sum(cuflash.flash_attn_varlen_func(q, k, v, score_mod=score_mod)[0].astype(jnp.float32) ** 2)
        return f

    with skip_if_not_built():  # the built-in (the hdim64 flex kernels; an error surfaces when read)
        expected = jax.block_until_ready(
            jax.jit(jax.value_and_grad(loss(cuflash.scores.alibi(slopes)), argnums=(0, 1, 2)))(q, k, v))
    try:
        got = jax.block_until_ready(
            jax.jit(jax.value_and_grad(loss(gpu_callables.alibi_like(slopes)), argnums=(0, 1, 2)))(q, k, v))
    except RuntimeError as error:
        if "not found" in str(error):  # nvcc or the CUTLASS headers
            pytest.skip(str(error))
        raise
    np.testing.assert_allclose(float(got[0]), float(expected[0]), rtol=2e-2)
    for name, g, e in zip(("dq", "dk", "dv"), got[1], expected[1]):
        e = np.asarray(e).astype(np.float64)
        assert_close(np.asarray(g).astype(np.float64), e, "bfloat16", scale=max(1.0, np.abs(e).max()), what=name)


def test_jax_jit_varlen_sink_grad(rng):
    jax, gpu = jax_gpu()
    jnp = jax.numpy
    import ml_dtypes

    heads, heads_kv, dim = 8, 2, 128
    lengths_q, lengths_k = [70, 0, 200], [90, 33, 160]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]), heads, dim)).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal((int(cu_k[-1]), heads_kv, dim)).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((int(cu_k[-1]), heads_kv, dim)).astype(ml_dtypes.bfloat16)
    sink = rng.standard_normal(heads).astype(np.float32)
    dout = rng.standard_normal(q.shape).astype(ml_dtypes.bfloat16)
    # The loss uses lse too: its cotangent reaches the kernels' preprocess as dlse.
    dlse = rng.standard_normal((heads, q.shape[0])).astype(np.float32)
    args = [jax.device_put(x, gpu) for x in (q, k, v, sink, cu_q, cu_k)]
    jdout, jdlse = jax.device_put(dout, gpu), jax.device_put(dlse, gpu)

    def attention(q, k, v, sink, cu_q, cu_k):
        return cuflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                              learnable_sink=sink)

    def loss(*a):
        out, lse = attention(*a)
        return jnp.sum(out.astype(jnp.float32) * jdout.astype(jnp.float32)) + jnp.sum(lse * jdlse)

    with skip_if_not_built():
        out, lse = jax.jit(attention)(*args)
        dq, dk, dv, d_sink = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
        jax.block_until_ready((out, lse, dq, dk, dv, d_sink))
    opts = ref.Options(causal=True, sink=sink)
    out_np = np.asarray(out)
    expected = [np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape), np.zeros(heads)]
    for b, ((q0, sq), (k0, sk)) in enumerate(zip(ref.sequences(cu_q), ref.sequences(cu_k))):
        rows, keys = slice(q0, q0 + sq), slice(k0, k0 + sk)
        expected_out, expected_lse = ref.forward_one(q[rows], k[keys], v[keys], b, opts)
        assert_close(out_np[rows].astype(np.float64), expected_out, "bfloat16", what="out")
        assert_lse_close(np.asarray(lse)[:, rows], expected_lse)
        grads = ref.backward_one(dout[rows], q[rows], k[keys], v[keys], out_np[rows], b, opts, dlse=dlse[:, rows])
        expected[0][rows], expected[1][keys], expected[2][keys] = grads[:3]
        expected[3] += grads[3]
    for name, grad, e in zip(("dq", "dk", "dv"), (dq, dk, dv), expected[:3]):
        assert_close(np.asarray(grad).astype(np.float64), e, "bfloat16", scale=max(1.0, np.abs(e).max()), what=name)
    np.testing.assert_allclose(np.asarray(d_sink), expected[3], atol=2e-2 * max(1.0, np.abs(expected[3]).max()),
                               rtol=2e-2, err_msg="d_sink")
