"""torch tensors on the CPU (and on the GPU where a test says so): outputs allocated by torch,
autograd through torch.autograd.Function (gradients of q, k, v and learnable_sink against the
NumPy float64 reference)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import cuflash  # noqa: E402
import attention_reference as ref  # noqa: E402
from conftest import assert_close, assert_lse_close  # noqa: E402


def to_numpy(t: "torch.Tensor") -> np.ndarray:
    return t.detach().float().cpu().numpy().astype(np.float64)


def tensors(generator, shapes, dtype=torch.float16, requires_grad=True):
    return [torch.randn(*s, generator=generator, dtype=torch.float32).to(dtype).requires_grad_(requires_grad)
            for s in shapes]


@pytest.fixture(autouse=True, params=["custom_op", "autograd_function"])
def torch_path(request, monkeypatch):
    """Each test runs through the torch custom ops and through the plain autograd.Function."""
    if request.param == "custom_op" and not hasattr(torch.library, "custom_op"):
        pytest.skip("torch.library.custom_op needs torch >= 2.4")
    monkeypatch.setattr(cuflash.interface, "USE_TORCH_CUSTOM_OPS", request.param == "custom_op")
    return request.param


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_autograd(gen, dtype, causal):
    q, k, v = tensors(gen, [(2, 24, 4, 32), (2, 40, 2, 32), (2, 40, 2, 32)], dtype)
    sink = torch.randn(4, generator=gen).requires_grad_(True)
    out, lse = cuflash.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == (2, 24, 4, 32)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 24) and lse.requires_grad
    assert out.requires_grad and out.grad_fn is not None

    opts = ref.Options(causal=causal, sink=to_numpy(sink))
    qn, kn, vn = (to_numpy(t) for t in (q, k, v))
    expected_out, expected_lse = ref.forward_dense(qn, kn, vn, opts)
    assert_close(to_numpy(out), expected_out, dtype_name(dtype), what="out")
    assert_lse_close(to_numpy(lse), expected_lse)

    dout = torch.randn(out.shape, generator=gen).to(dtype)
    out.backward(dout)
    expected = ref.backward_dense(to_numpy(dout), qn, kn, vn, to_numpy(out), opts)
    for name, tensor, e in zip(("dq", "dk", "dv"), (q, k, v), expected[:3]):
        assert tensor.grad.dtype == dtype
        assert_close(to_numpy(tensor.grad), e, dtype_name(dtype), scale=max(1.0, np.abs(e).max()), what=name)
    assert sink.grad is not None and sink.grad.dtype == sink.dtype
    np.testing.assert_allclose(to_numpy(sink.grad), expected[3], atol=2e-2, rtol=2e-2)


def lse_loss_reference(q, k, v, sink, dout, dlse, causal, softcap=0.0):
    """Gradients of sum(out * dout) + sum(lse * dlse) by torch autograd over a float64 naive
    attention (bottom-right causal, GQA, sink, softcap); rows without a visible key add nothing."""
    q, k, v, sink = (t.detach().double().requires_grad_(True) for t in (q, k, v, sink))
    group = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(group, dim=2) for t in (k, v))
    scores = torch.einsum("bihd,bjhd->bhij", q, kk) / q.shape[-1] ** 0.5
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
        scores = scores.masked_fill(~visible, float("-inf"))
    with_sink = torch.cat([scores, sink[None, :, None, None].expand(*scores.shape[:3], 1)], dim=-1)
    lse = torch.logsumexp(with_sink, dim=-1)
    p = torch.exp(scores - lse[..., None])
    out = torch.einsum("bhij,bjhd->bihd", p, vv)
    loss = (out * dout.double()).sum() + (lse * dlse.double()).sum()
    loss.backward()
    return out.detach(), lse.detach(), [t.grad for t in (q, k, v, sink)]


@pytest.mark.parametrize("causal", [False, True])
def test_gradient_through_lse(gen, causal):
    # A loss that uses lse too (return_lse): its gradient reaches q, k, v and the sink.
    q, k, v = tensors(gen, [(2, 24, 4, 32), (2, 20, 2, 32), (2, 20, 2, 32)])
    sink = torch.randn(4, generator=gen).requires_grad_(True)
    out, lse = cuflash.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink, softcap=5.0)
    assert lse.requires_grad
    dout = torch.randn(out.shape, generator=gen).half()
    dlse = torch.randn(lse.shape, generator=gen)
    ((out * dout).sum() + (lse * dlse).sum()).backward()
    _, _, expected = lse_loss_reference(q, k, v, sink, dout, dlse, causal, softcap=5.0)
    for name, tensor, e in zip(("dq", "dk", "dv", "d_sink"), (q, k, v, sink), expected):
        e = e.numpy()
        assert_close(to_numpy(tensor.grad), e, scale=max(1.0, np.abs(e).max()), what=name)
    # lse alone in the loss (out's gradient then comes as zeros or None), through an expanded
    # gradient (stride 0).
    for t in (q, k, v, sink):
        t.grad = None
    out, lse = cuflash.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink, softcap=5.0)
    lse.sum().backward()
    _, _, expected = lse_loss_reference(q, k, v, sink, torch.zeros(out.shape), torch.ones(lse.shape), causal,
                                        softcap=5.0)
    for name, tensor, e in zip(("dq", "dk", "dv", "d_sink"), (q, k, v, sink), expected):
        e = e.numpy()
        assert_close(to_numpy(tensor.grad), e, scale=max(1.0, np.abs(e).max()), what=name)


def test_flash_attn_backward_takes_dlse(gen):
    q, k, v = tensors(gen, [(1, 16, 2, 32)] * 3, requires_grad=False)
    sink = torch.randn(2, generator=gen)
    out, lse = cuflash.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    dout, dlse = torch.randn(out.shape, generator=gen).half(), torch.randn(lse.shape, generator=gen)
    dq, dk, dv, d_sink = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, learnable_sink=sink,
                                                     dlse=dlse)
    _, _, expected = lse_loss_reference(q, k, v, sink, dout, dlse, True)
    for name, got, e in zip(("dq", "dk", "dv", "d_sink"), (dq, dk, dv, d_sink), expected):
        e = e.numpy()
        assert_close(to_numpy(got), e, scale=max(1.0, np.abs(e).max()), what=name)
    with pytest.raises(ValueError, match="dlse"):
        cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, learnable_sink=sink, dlse=dlse[:, :, :8])


def test_varlen_autograd_with_score_mod(gen):
    lengths = [7, 0, 19]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    q, k, v = tensors(gen, [(26, 4, 32), (26, 4, 32), (26, 4, 32)])
    slopes = torch.tensor(cuflash.scores.alibi_slopes(4))
    out, lse = cuflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True,
                                              score_mod=cuflash.scores.alibi(slopes))
    assert lse.shape == (4, 26)
    dout = torch.randn(out.shape, generator=gen).half()
    out.backward(dout)
    opts = ref.Options(causal=True, score_bias=lambda b, h, i, j: slopes.numpy()[h] * (j - i))
    for b, (start, length) in enumerate(ref.sequences(cu.numpy())):
        if length == 0:
            continue
        rows = slice(start, start + length)
        args = [to_numpy(t[rows]) for t in (q, k, v)]
        expected_out, _ = ref.forward_one(*args, b, opts)
        assert_close(to_numpy(out[rows]), expected_out, what="out")
        dq, dk, dv, _ = ref.backward_one(to_numpy(dout[rows]), *args, to_numpy(out[rows]), b, opts)
        for name, tensor, e in zip(("dq", "dk", "dv"), (q, k, v), (dq, dk, dv)):
            assert_close(to_numpy(tensor.grad[rows]), e, scale=max(1.0, np.abs(e).max()), what=name)


def test_block_sparse_autograd(gen):
    seqlen = 200
    q, k, v = tensors(gen, [(1, seqlen, 2, 32)] * 3)
    cnt = torch.tensor([[[1, 1]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 0], [1, 0]]]], dtype=torch.int32)  # block-diagonal, full
    mask_cnt = torch.tensor([[[0, 1]]], dtype=torch.int32)
    mask_idx = torch.tensor([[[[0, 0], [0, 0]]]], dtype=torch.int32)  # row block 1 sees block 0, masked
    out, _ = cuflash.flash_attn_func(q, k, v, mask_mod=cuflash.masks.sliding_window(150, 0), full_block_cnt=cnt,
                                     full_block_idx=idx, mask_block_cnt=mask_cnt, mask_block_idx=mask_idx)
    out.sum().backward()
    opts = ref.Options(mask=lambda b, i, j: (j >= i - 150) & (j <= i),
                       blocks=ref.block_masks((cnt.numpy(), idx.numpy()), (mask_cnt.numpy(), mask_idx.numpy()),
                                              seqlen, seqlen))
    args = [to_numpy(t) for t in (q, k, v)]
    expected = ref.backward_dense(np.ones(out.shape), *args, to_numpy(out), opts)
    for name, tensor, e in zip(("dq", "dk", "dv"), (q, k, v), expected[:3]):
        assert_close(to_numpy(tensor.grad), e, scale=max(1.0, np.abs(e).max()), what=name)


def test_paged_kv_autograd(gen):
    # As many pages as sequences: read as dense k/v, the pages would go to the wrong sequence.
    page_table = torch.tensor([[1], [0]], dtype=torch.int32)
    q, k_cache, v_cache = tensors(gen, [(2, 9, 4, 32), (2, 24, 2, 32), (2, 24, 2, 32)])
    out, _ = cuflash.flash_attn_varlen_func(q, k_cache, v_cache, page_table=page_table, causal=True)
    dout = torch.randn(out.shape, generator=gen).half()
    out.backward(dout)
    k, v = (to_numpy(t)[page_table[:, 0].long().numpy()] for t in (k_cache, v_cache))
    expected = ref.backward_dense(to_numpy(dout), to_numpy(q), k, v, to_numpy(out), ref.Options(causal=True))
    pages = page_table[:, 0].long().numpy()
    for name, tensor, e in zip(("dq", "dk", "dv"), (q, k_cache, v_cache), expected[:3]):
        if name != "dq":
            e = e[np.argsort(pages)]
        assert_close(to_numpy(tensor.grad), e, scale=max(1.0, np.abs(e).max()), what=name)


def side_tensor_calls(gen):
    """(what, tensor changed, function running a differentiable call that reads it): one per
    kind of tensor a backward reads besides q, k, v and learnable_sink."""
    q, k, v = tensors(gen, [(1, 40, 2, 32)] * 3)
    slopes = torch.tensor(cuflash.scores.alibi_slopes(2))
    bias = torch.randn(40, generator=gen)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    page_table = torch.tensor([[0]], dtype=torch.int32)
    cnt = torch.tensor([[[1]]], dtype=torch.int32)
    idx = torch.tensor([[[[0]]]], dtype=torch.int32)
    packed = [t[0] for t in (q, k, v)]
    return [
        ("built-in score_mod tensor", slopes,
         lambda: cuflash.flash_attn_varlen_func(q, k, v, score_mod=cuflash.scores.alibi(slopes))),
        ("callable's tensor", bias,
         lambda: cuflash.flash_attn_varlen_func(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[j])),
        ("cu_seqlens_q", cu, lambda: cuflash.flash_attn_varlen_func(*packed, cu, cu, 25, 25)),
        ("page_table", page_table, lambda: cuflash.flash_attn_varlen_func(q, k, v, page_table=page_table)),
        ("block list", cnt, lambda: cuflash.flash_attn_func(q, k, v, mask_block_cnt=cnt, mask_block_idx=idx,
                                                           mask_mod=cuflash.masks.causal())),
    ]


def test_side_tensors_changed_in_place_before_backward_are_refused(gen):
    # The backward reads these tensors again: one changed in place after the forward would give
    # gradients of another attention. torch's saved-tensor version check makes it an error.
    for what, tensor, run in side_tensor_calls(gen):
        out, _ = run()
        tensor.add_(0)  # a change in place, even of no value, bumps the version
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
        out, _ = run()  # unchanged since this forward: runs
        out.sum().backward()


def test_no_grad_and_inference_mode(gen):
    q, k, v = tensors(gen, [(1, 8, 2, 32)] * 3)
    with torch.no_grad():
        out, _ = cuflash.flash_attn_func(q, k, v)
    assert not out.requires_grad
    with torch.inference_mode():
        out2, _ = cuflash.flash_attn_func(q.detach(), k.detach(), v.detach())
    assert torch.equal(out, out2)


def test_strided_torch_inputs(gen):
    qkv = torch.randn(2, 20, 3, 4, 64, generator=gen).half()
    q, k, v = qkv.unbind(2)
    out, lse = cuflash.flash_attn_func(q, k, v, causal=True)
    expected_out, expected_lse = ref.forward_dense(to_numpy(q), to_numpy(k), to_numpy(v), ref.Options(causal=True))
    assert_close(to_numpy(out), expected_out, what="out")
    assert_lse_close(to_numpy(lse), expected_lse)


def test_combine(gen):
    out_partial = torch.randn(3, 2, 10, 4, 32, generator=gen)
    lse_partial = torch.randn(3, 2, 10, 4, generator=gen)
    out, lse = cuflash.flash_attn_combine(out_partial, lse_partial, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and lse.shape == (2, 10, 4)
    expected_out, expected_lse = ref.combine(out_partial.numpy(), lse_partial.numpy())
    assert_close(to_numpy(out), expected_out, "bfloat16", what="out")
    assert_lse_close(lse.numpy(), expected_lse)


def test_mixed_frameworks_are_refused(gen):
    q, k, v = tensors(gen, [(1, 8, 2, 32)] * 3, requires_grad=False)
    with pytest.raises(TypeError, match="^k"):
        cuflash.flash_attn_func(q, k.numpy(), v)


def test_numpy_aux_tensor_moves_to_torch(gen):
    q, k, v = tensors(gen, [(1, 12, 4, 32)] * 3, requires_grad=False)
    slopes = cuflash.scores.alibi_slopes(4)  # NumPy
    out, _ = cuflash.flash_attn_varlen_func(q, k, v, score_mod=cuflash.scores.alibi(slopes))
    opts = ref.Options(score_bias=lambda b, h, i, j: slopes[h] * (j - i))
    assert_close(to_numpy(out), ref.forward_dense(*(to_numpy(t) for t in (q, k, v)), opts)[0], what="out")


def test_torch_compile(gen, torch_path):
    if torch_path != "custom_op":
        pytest.skip("torch.compile keeps cuflash in its graph through the custom ops")
    q, k, v = tensors(gen, [(1, 24, 4, 32), (1, 24, 2, 32), (1, 24, 2, 32)])

    def step(q, k, v):
        out, lse = cuflash.flash_attn_func(q, k, v, causal=True)
        return (out.float() ** 2).sum() + lse.sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss = compiled(q, k, v)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    expected = step(q, k, v)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad)


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")
def test_callables_with_torch_pow_and_zero_dim_tensors():
    # torch.pow / ** with 0-d tensors made in the function trace to the products and exp2 they
    # spell; a 0-d tensor that requires grad (a learnable temperature) is refused, not frozen.
    from cuflash import mods

    def same(f, g):
        a, b = mods.trace_score_mod(f), mods.trace_score_mod(g)
        assert (a.code, a.constants) == (b.code, b.constants)

    same(lambda s, b, h, q, k: torch.pow(torch.tensor(2.0), s), lambda s, b, h, q, k: 2.0 ** s)
    same(lambda s, b, h, q, k: torch.tensor(2.0) ** s, lambda s, b, h, q, k: 2.0 ** s)
    same(lambda s, b, h, q, k: torch.pow(s, exponent=2) * torch.tensor(0.5), lambda s, b, h, q, k: s * s * 0.5)

    class Module:
        temperature = torch.nn.Parameter(torch.tensor(0.5))

    module = Module()
    with pytest.raises(TypeError, match="score_mod: a 0-d tensor that requires grad"):
        mods.trace_score_mod(lambda s, b, h, q, k: s * module.temperature)


def test_torch_compile_with_callables(gen, torch_path):
    # Callables go through the custom ops as their programs: a callable traced beforehand
    # (cuflash.mods) compiles into one graph (fullgraph); a plain function is traced by cuflash
    # where the graph breaks. Both match eager, forward and backward.
    if torch_path != "custom_op":
        pytest.skip("torch.compile keeps cuflash in its graph through the custom ops")
    q, k, v = tensors(gen, [(1, 24, 4, 32), (1, 24, 2, 32), (1, 24, 2, 32)])
    bias = torch.randn(24, generator=gen)
    doc = torch.tensor([0] * 10 + [1] * 14, dtype=torch.int32)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx] * (h + 1)

    def mask_mod(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    traced_score, traced_mask = cuflash.mods.trace_score_mod(score_mod), cuflash.mods.trace_mask_mod(mask_mod)

    def step(score, mask):
        def loss(q, k, v):
            # score_mod is an option of flash_attn_varlen_func, mask_mod one of flash_attn_func
            # (the seed's signatures).
            out, lse = cuflash.flash_attn_varlen_func(q, k, v, causal=True, score_mod=score)
            masked, _ = cuflash.flash_attn_func(q, k, v, mask_mod=mask)
            return (out.float() ** 2).sum() + lse.sum() + (masked.float() ** 3).sum()
        return loss

    def grads(loss):
        for t in (q, k, v):
            t.grad = None
        value = loss(q, k, v)
        value.backward()
        return [value.detach()] + [t.grad.clone() for t in (q, k, v)]

    expected = grads(step(score_mod, mask_mod))
    for fullgraph, score, mask in ((True, traced_score, traced_mask), (False, score_mod, mask_mod)):
        torch._dynamo.reset()
        got = grads(torch.compile(step(score, mask), backend="aot_eager", fullgraph=fullgraph))
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)
    # A traced callable's tensors changed in place: the compiled graph reads them as they are.
    compiled = torch.compile(step(traced_score, traced_mask), backend="aot_eager", fullgraph=True)
    bias.mul_(3.0)
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v), step(score_mod, mask_mod)(q, k, v))


def test_opcheck(gen, torch_path):
    if torch_path != "custom_op":
        pytest.skip("custom ops only")
    import cuflash._torch_ops as ops

    q, k, v = tensors(gen, [(1, 16, 2, 32)] * 3)
    sink = torch.randn(2, generator=gen).requires_grad_(True)
    call = cuflash.interface._prepare(q, k, v, causal=True, learnable_sink=sink)
    torch.library.opcheck(torch.ops.cuflash.fwd.default, (q, k, v, sink), ops.flatten(call),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    # With callables: their programs and tensors are arguments of the op.
    bias = torch.randn(16, generator=gen)
    call = cuflash.interface._prepare(q, k, v, learnable_sink=sink, score_mod=lambda s, b, h, i, j: s + bias[j],
                                      mask_mod=lambda b, h, i, j: j <= i + 2)
    torch.library.opcheck(torch.ops.cuflash.fwd.default, (q, k, v, sink), ops.flatten(call),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_mod_tensors_that_require_grad_are_refused(gen):
    # The backward gives no gradient to the tensors a score_mod reads: one that requires grad is
    # refused under grad mode (it would silently never train) and taken as a constant otherwise.
    q, k, v = tensors(gen, [(1, 16, 4, 32), (1, 16, 4, 32), (1, 16, 4, 32)])
    slopes = torch.tensor(cuflash.scores.alibi_slopes(4)).requires_grad_(True)
    # score_mod is an argument of flash_attn_varlen_func (as the seed's interface), which takes
    # fixed-length batches too.
    with pytest.raises(NotImplementedError, match="score_mod: its tensor aux.0. requires grad"):
        cuflash.flash_attn_varlen_func(q, k, v, score_mod=cuflash.scores.alibi(slopes))
    out, _ = cuflash.flash_attn_varlen_func(q, k, v, score_mod=cuflash.scores.alibi(slopes.detach()))
    with torch.no_grad():
        out_no_grad, _ = cuflash.flash_attn_varlen_func(q, k, v, score_mod=cuflash.scores.alibi(slopes))
    assert torch.equal(out.detach(), out_no_grad)


def test_backward_fake_has_the_strides_of_the_op(gen, torch_path, monkeypatch):
    # torch.compile (inductor) checks the real outputs against the fake's strides: the fake
    # gradients must be contiguous as the op's are, also for transposed inputs (what
    # cuflash.flex_attention passes on).
    if torch_path != "custom_op":
        pytest.skip("the fake implementations belong to the custom ops")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cuflash import _torch_ops

    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
               for t in tensors(gen, [(1, 24, 4, 32), (1, 24, 2, 32), (1, 24, 2, 32)]))
    assert not q.is_contiguous()
    calls = []
    real_bwd = _torch_ops.bwd

    def recording_bwd(*args, **kwargs):
        calls.append((args, kwargs))
        return real_bwd(*args, **kwargs)

    monkeypatch.setattr(_torch_ops, "bwd", recording_bwd)
    out, _ = cuflash.flash_attn_func(q, k, v, causal=True)
    out.float().sum().backward()
    (args, kwargs), = calls
    real = real_bwd(*args, **kwargs)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = real_bwd(*fake_args, **kwargs)
    for name, r, f in zip(("dq", "dk", "dv", "d_sink"), real, fake):
        assert (tuple(f.shape), f.stride()) == (tuple(r.shape), r.stride()), name


def test_no_double_backward(gen, torch_path):
    # create_graph=True gives gradients that fail by name when differentiated again, on both
    # paths (the autograd.Function's used to be constants: a gradient penalty lost its term).
    q, k, v = tensors(gen, [(1, 12, 2, 32)] * 3)
    out, _ = cuflash.flash_attn_func(q, k, v)
    dq, = torch.autograd.grad((out.float() ** 2).sum(), q, create_graph=True)
    assert dq.requires_grad
    with pytest.raises(Exception, match="no double backward"):
        (dq.float() ** 2).sum().backward()
    # Without create_graph, nothing changes.
    out, _ = cuflash.flash_attn_func(q, k, v)
    dq, = torch.autograd.grad(out.float().sum(), q)
    assert not dq.requires_grad


def test_buffers_written_in_place_and_autograd(gen):
    # A buffer cuflash writes in place: its version moves (a node that saved it fails its check
    # instead of reading the new contents), and one that requires grad is refused by name.
    q, k, v = tensors(gen, [(1, 12, 2, 32)] * 3, requires_grad=False)
    y = torch.randn(1, 12, 2, 32, generator=gen).to(q.dtype).requires_grad_()
    saved = torch.ones_like(q)
    product = y * saved  # mul saves `saved` for y's gradient
    before = saved._version
    cuflash.interface.flash_attn_forward(q, k, v, out=saved)
    assert saved._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        product.float().sum().backward()
    with pytest.raises(RuntimeError, match="^out: requires grad"):
        cuflash.interface.flash_attn_forward(q, k, v, out=y.exp())
    with torch.no_grad():
        cuflash.interface.flash_attn_forward(q, k, v, out=y.detach().clone().requires_grad_())
    out, lse = cuflash.interface.flash_attn_forward(q, k, v, return_lse=True)
    dout = torch.randn_like(out)
    dq = torch.zeros_like(q)
    before = dq._version
    cuflash.flash_attn_backward(dout, q, k, v, out, lse, dq=dq)
    assert dq._version > before
    partial_out = torch.randn(2, 1, 12, 2, 32, generator=gen)
    partial_lse = torch.randn(2, 1, 12, 2, generator=gen)
    combined = torch.zeros(1, 12, 2, 32)
    before = combined._version
    cuflash.flash_attn_combine(partial_out, partial_lse, out=combined)
    assert combined._version > before
    with pytest.raises(RuntimeError, match="^out: requires grad"):
        cuflash.flash_attn_combine(partial_out, partial_lse, out=torch.zeros(1, 12, 2, 32, requires_grad=True))


def combine_reference(out_partial, lse_partial, merged):
    """float64 torch: softmax over the splits of lse_partial weighting out_partial; rows not
    merged give 0 (their gradients then 0 too)."""
    empty = ~torch.isfinite(lse_partial).any(0)  # no split: out 0, lse -inf, no gradient
    lse_partial = torch.where(empty, 0, lse_partial.double())
    lse = torch.logsumexp(lse_partial, dim=0)
    out = (torch.softmax(lse_partial, dim=0)[..., None] * out_partial.double()).sum(0)
    kept = merged & ~empty
    return torch.where(kept[..., None], out, 0), torch.where(kept, lse, torch.where(merged, float("-inf"), 0))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("layout", ["dense", "dense_seqused", "packed"])
def test_combine_gradients(gen, layout, device):
    """The combine's gradients (the framework's backward over the combine's out and lse) against
    float64 torch autograd; on "cuda" the forward is the sm90 combine kernel."""
    if device == "cuda" and not (torch.cuda.is_available() and cuflash.built_with_cuda):
        pytest.skip("no CUDA device, or cuflash built without CUDA")
    splits, heads, dim = 3, 2, 16
    if layout == "packed":
        cu = torch.tensor([2, 9, 9, 20], dtype=torch.int32)  # rows 0-1 and 20-22 in no sequence
        used = torch.tensor([5, 0, 11], dtype=torch.int32)
        shape, kwargs = (23,), dict(cu_seqlens=cu, seqused=used)
        rows = torch.arange(23)
        merged = ((rows >= 2) & (rows < 7)) | ((rows >= 9) & (rows < 20))
        merged = merged[:, None].expand(23, heads)
    else:
        used = torch.tensor([4, 7], dtype=torch.int32)
        shape, kwargs = (2, 7), dict(seqused=used) if layout == "dense_seqused" else {}
        merged = torch.arange(7)[None, :] < (used[:, None] if kwargs else 7)
        merged = merged[..., None].expand(2, 7, heads)
    kwargs = {name: t.to(device) for name, t in kwargs.items()}
    merged = merged.to(device)
    out_partial = torch.randn((splits, *shape, heads, dim), generator=gen).to(device).requires_grad_()
    lse_partial = (3 * torch.randn((splits, *shape, heads), generator=gen)).to(device)
    lse_partial[1, ..., 0] = float("-inf")  # an empty split in some rows
    lse_partial[:, 0] = float("-inf")  # rows with no split at all: out 0, lse -inf
    lse_partial.requires_grad_()
    dout = torch.randn((*shape, heads, dim), generator=gen).to(device)
    dlse = torch.randn((*shape, heads), generator=gen).to(device)
    out, lse = cuflash.flash_attn_combine(out_partial, lse_partial, **kwargs)
    assert out.requires_grad and lse.requires_grad
    got = torch.autograd.grad((out * dout).sum() + (torch.where(merged & torch.isfinite(lse), lse, 0) * dlse).sum(),
                              (out_partial, lse_partial))
    ref_out, ref_lse = combine_reference(out_partial, lse_partial, merged)
    finite = torch.isfinite(ref_lse)
    expected = torch.autograd.grad((ref_out * dout.double()).sum() + (torch.where(finite, ref_lse, 0) * dlse).sum(),
                                   (out_partial, lse_partial))
    torch.testing.assert_close(torch.where(merged[..., None], out, 0), ref_out.float(), atol=1e-5, rtol=1e-5)
    for name, g, e in zip(("d_out_partial", "d_lse_partial"), got, expected):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, e.float(), atol=1e-4, rtol=1e-4, msg=name)
    # A preallocated out cannot carry the graph: refused by name.
    with pytest.raises(RuntimeError, match="^out: out_partial or lse_partial requires grad"):
        cuflash.flash_attn_combine(out_partial, lse_partial, out=torch.empty((*shape, heads, dim), device=device),
                                   **kwargs)


def test_ring_attention_gradients(gen):
    # Attention over two halves of the keys, merged by flash_attn_combine, has the gradients of
    # attention over all keys (the combine's backward carries the lse gradient back).
    q, k, v = tensors(gen, [(2, 24, 4, 32), (2, 40, 2, 32), (2, 40, 2, 32)])
    halves = [cuflash.flash_attn_func(q, k[:, s], v[:, s]) for s in (slice(0, 17), slice(17, 40))]
    out_partial = torch.stack([o.float() for o, _ in halves])
    lse_partial = torch.stack([lse.transpose(1, 2) for _, lse in halves])  # (B, S, H) per split
    out, _ = cuflash.flash_attn_combine(out_partial, lse_partial, out_dtype=q.dtype)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    got = torch.autograd.grad((out.float() * weights).sum(), (q, k, v))
    whole, _ = cuflash.flash_attn_func(q, k, v)
    expected = torch.autograd.grad((whole.float() * weights).sum(), (q, k, v))
    torch.testing.assert_close(out.float(), whole.float(), atol=2e-2, rtol=2e-2)
    for name, g, e in zip("qkv", got, expected):
        torch.testing.assert_close(g.float(), e.float(), atol=3e-2, rtol=3e-2, msg=f"d{name}")


def test_scalar_tensors_as_floats(gen):
    # A 0-d tensor for softmax_scale is its value; one that requires grad is refused (no gradient
    # for it is computed), not silently left untrained.
    q, k, v = tensors(gen, [(1, 12, 2, 32)] * 3, requires_grad=False)
    got = cuflash.flash_attn_func(q, k, v, softmax_scale=torch.tensor(0.1))[0]
    torch.testing.assert_close(got, cuflash.flash_attn_func(q, k, v, softmax_scale=0.1)[0], atol=0, rtol=0)
    with pytest.raises(NotImplementedError, match="^softmax_scale: requires grad"):
        cuflash.flash_attn_func(q, k, v, softmax_scale=torch.tensor(0.1, requires_grad=True))


def test_flex_attention_under_inductor(gen, torch_path, monkeypatch, tmp_path):
    # torch.compile's default backend (inductor) checks each custom op's outputs against its
    # fake's strides: flex_attention hands the ops transposed views, whose gradients the op
    # returns contiguous. About 40 s of inductor compilation on the CPU.
    if torch_path != "custom_op":
        pytest.skip("torch.compile keeps cuflash in its graph through the custom ops")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # no graph compiled before
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 2, 8, 16, generator=gen).bfloat16().requires_grad_() for _ in range(3))

    def loss(q, k, v):
        return cuflash.flex_attention(q, k, v).float().sum()

    torch.compile(loss)(q, k, v).backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    loss(q, k, v).backward()
    for name, g, t in zip("qkv", got, (q, k, v)):
        torch.testing.assert_close(g, t.grad, atol=0, rtol=0, msg=f"d{name}")
