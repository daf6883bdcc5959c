"""cuflash inside CUDA graphs (torch.cuda.graph): captured once, replayed on new values.

Serving stacks capture decode steps, and training loops whole steps, into CUDA graphs. A capture
fails on any host synchronisation or allocation outside the stream-ordered pools, and a replay
silently reuses whatever the capture froze (a split count chosen from lengths, a pointer of a
freed workspace). So each test fills the static inputs with values the capture never saw,
replays, and compares with the same call run eagerly on those values: bit for bit where the
kernels are deterministic (the forward, the deterministic backward, the decode), and under
DESIGN.md section 5's rule against the CPU reference otherwise. Skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import attention_reference as ref
import cuflash
from conftest import assert_close, assert_lse_close
from test_gpu import skip_if_not_built, to_f64, torch_cuda


def capture(torch, step):
    """A graph of step(), after one warm-up run on a side stream (the first call loads kernels
    and grows the caching allocator's pools, which a capture must not do), and the tensors the
    captured step returned."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def fill(torch, rng, *tensors):
    """New values in place (a replay reads the static tensors' memory)."""
    with torch.no_grad():
        for t in tensors:
            t.copy_(torch.from_numpy(rng.standard_normal(tuple(t.shape)).astype(np.float32)))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_graph_forward_backward(rng, causal, deterministic):
    torch = torch_cuda()
    batch, seqlen_q, seqlen_k, heads, heads_kv, dim = 2, 333, 517, 8, 2, 128
    q = torch.empty(batch, seqlen_q, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(batch, seqlen_k, heads_kv, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.empty_like(k, requires_grad=True)
    dout = torch.empty(batch, seqlen_q, heads, dim, device="cuda", dtype=torch.bfloat16)
    fill(torch, rng, q, k, v, dout)

    def step():
        for t in (q, k, v):
            t.grad = None
        out, lse = cuflash.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
        out.backward(dout)
        return out, lse, q.grad, k.grad, v.grad

    with skip_if_not_built():
        graph, captured = capture(torch, step)
    for _ in range(2):
        fill(torch, rng, q, k, v, dout)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.detach().clone() for t in captured]
        eager = [t.detach().clone() for t in step()]
        for name, a, e in zip(("out", "lse"), replayed[:2], eager[:2]):
            assert torch.equal(a, e), f"{name}: the replay differs from the eager call"
        if deterministic:
            for name, a, e in zip(("dq", "dk", "dv"), replayed[2:], eager[2:]):
                assert torch.equal(a, e), f"{name}: the deterministic replay differs from the eager call"
        else:
            args = [to_f64(t) for t in (q, k, v)]
            opts = ref.Options(causal=causal)
            expected = ref.backward_dense(to_f64(dout), *args, to_f64(replayed[0]), opts)
            for name, a, e in zip(("dq", "dk", "dv"), replayed[2:], expected[:3]):
                assert_close(to_f64(a), e, "bfloat16", scale=max(1.0, np.abs(e).max()), what=name)


def test_graph_varlen_with_new_lengths(rng):
    # The lengths are device values the kernels read at run time: a replay with other sequence
    # boundaries (same total, max_seqlen bounding them) attends within the new boundaries.
    torch = torch_cuda()
    heads, dim, total, max_seqlen = 4, 128, 600, 320
    q = torch.empty(total, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(total, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.empty_like(k, requires_grad=True)
    dout = torch.empty(total, heads, dim, device="cuda", dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, 100, 300, 600], dtype=torch.int32, device="cuda")
    fill(torch, rng, q, k, v, dout)

    def step():
        for t in (q, k, v):
            t.grad = None
        out, lse = cuflash.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                                  causal=True, deterministic=True)
        out.backward(dout)
        return out, lse, q.grad, k.grad, v.grad

    with skip_if_not_built():
        graph, captured = capture(torch, step)
    for boundaries in ([0, 320, 321, 600], [0, 0, 280, 600]):
        cu_seqlens.copy_(torch.tensor(boundaries, dtype=torch.int32))
        fill(torch, rng, q, k, v, dout)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.detach().clone() for t in captured]
        eager = [t.detach().clone() for t in step()]
        for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), replayed, eager):
            assert torch.equal(a, e), f"{name}: the replay with cu_seqlens {boundaries} differs from the eager call"
        expected_out = np.concatenate([
            ref.forward_dense(*(to_f64(t)[None, lo:hi] for t in (q, k, v)), ref.Options(causal=True))[0][0]
            for lo, hi in zip(boundaries[:-1], boundaries[1:]) if hi > lo])
        assert_close(to_f64(replayed[0]), expected_out, "bfloat16", what=f"out with cu_seqlens {boundaries}")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_graph_forward_split_and_packed(rng, num_splits):
    # Split-KV (its partial outputs and the combine kernel) and packed GQA under capture.
    torch = torch_cuda()
    q = torch.empty(3, 4, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(3, 700, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.empty_like(k)
    fill(torch, rng, q, k, v)

    def step():
        return cuflash.flash_attn_func(q, k, v, causal=True, num_splits=num_splits, pack_gqa=True)

    with skip_if_not_built():
        graph, captured = capture(torch, step)
    fill(torch, rng, q, k, v)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [t.clone() for t in captured]
    for name, a, e in zip(("out", "lse"), replayed, step()):
        assert torch.equal(a, e), f"{name}: the replay differs from the eager call"


@pytest.mark.parametrize("paged", [False, True])
def test_graph_decode_steps_with_kvcache(rng, paged):
    # A decode loop as servers run it: one captured step (append this token's k / v at each
    # sequence's length, attend, split count chosen by the library), replayed for several tokens
    # with the lengths advanced on the device between replays. Checked against the same steps
    # run eagerly on the CPU, outputs and caches.
    torch = torch_cuda()
    batch, heads, heads_kv, dim, page_size, max_pages = 3, 8, 2, 128, 64, 6
    capacity = page_size * max_pages
    start = np.array([0, 150, capacity - 4], np.int32)
    rows = batch * max_pages + 1 if paged else batch
    table = rng.permutation(rows)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32) if paged else None
    shape = (rows, page_size, heads_kv, dim) if paged else (batch, capacity, heads_kv, dim)
    caches = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    tokens = [[rng.standard_normal(s).astype(np.float32) for s in
               ((batch, 1, heads, dim), (batch, 1, heads_kv, dim), (batch, 1, heads_kv, dim))] for _ in range(4)]

    def state(device):
        k_cache, v_cache = (torch.from_numpy(c).to(device).bfloat16() for c in caches)
        lengths = torch.from_numpy(start.copy()).to(device)
        pages = None if table is None else torch.from_numpy(table).to(device)
        return k_cache, v_cache, lengths, pages

    def decode(q, k, v, k_cache, v_cache, lengths, pages):
        return cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lengths,
                                               page_table=pages, causal=True, return_softmax_lse=True)

    # The CPU run of every step.
    k_cache, v_cache, lengths, pages = state("cpu")
    expected = []
    for q, k, v in tokens:
        out, lse = decode(*(torch.from_numpy(x).bfloat16() for x in (q, k, v)), k_cache, v_cache, lengths, pages)
        expected.append((to_f64(out), to_f64(lse)))
        lengths += 1
    expected_caches = (to_f64(k_cache), to_f64(v_cache))

    k_cache, v_cache, lengths, pages = state("cuda")
    q, k, v = (torch.empty(s.shape, device="cuda", dtype=torch.bfloat16) for s in tokens[0])
    warm = [t.clone() for t in (k_cache, v_cache)]  # the warm-up's append, undone below
    with skip_if_not_built():
        graph, (out, lse) = capture(torch, lambda: decode(q, k, v, k_cache, v_cache, lengths, pages))
    k_cache.copy_(warm[0])
    v_cache.copy_(warm[1])  # the capture itself appended nothing: it ran no kernel
    for i, token in enumerate(tokens):
        for static, value in zip((q, k, v), token):
            static.copy_(torch.from_numpy(value))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(to_f64(out), expected[i][0], "bfloat16", what=f"out of step {i}")
        assert_lse_close(to_f64(lse), expected[i][1], what=f"lse of step {i}")
        lengths += 1
    for name, a, e in zip(("k_cache", "v_cache"), (k_cache, v_cache), expected_caches):
        np.testing.assert_array_equal(to_f64(a), e, err_msg=name)


def test_torch_compile_reduce_overhead(rng):
    # torch.compile's "reduce-overhead" mode: inductor around the custom ops, the step run
    # through CUDA graph trees. Outputs and gradients of new inputs each call, against eager.
    torch = torch_cuda()

    def step(q, k, v):
        out, lse = cuflash.flash_attn_func(q, k, v, causal=True, deterministic=True)
        return (out.float() ** 2).sum() + lse.sum()

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # the first calls record, the later ones replay
        q = torch.randn(2, 256, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, 384, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(2, 384, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with skip_if_not_built():
            loss = compiled(q, k, v)
            loss.backward()
        got = [loss.detach().clone()] + [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        expected = step(q, k, v)
        expected.backward()
        torch.testing.assert_close(got[0], expected.detach())
        for name, g, t in zip(("dq", "dk", "dv"), got[1:], (q, k, v)):
            assert torch.equal(g, t.grad), f"{name}: the compiled step differs from the eager one"
