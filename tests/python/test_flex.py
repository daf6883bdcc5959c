"""cuflash.flex_attention against torch's own FlexAttention on the CPU (its unfused reference
implementation) for outputs and lse, and against float64 torch operations for gradients, with
score_mod, BlockMask, GQA and the interface's errors."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
flex = pytest.importorskip("torch.nn.attention.flex_attention", reason="this torch has no FlexAttention")

import cuflash  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")


def inputs(gen, batch=2, heads=4, heads_kv=2, seqlen_q=200, seqlen_k=300, dim=32, dim_v=32):
    shapes = [(batch, heads, seqlen_q, dim), (batch, heads_kv, seqlen_k, dim), (batch, heads_kv, seqlen_k, dim_v)]
    return [torch.randn(*s, generator=gen).half().requires_grad_(True) for s in shapes]


def naive(q, k, v, score_mod=None, mask_mod=None, scale=None):
    """out, lse of plain torch operations in float64 (differentiable): the gradients' reference
    (torch's FlexAttention has no backward on the CPU)."""
    q, k, v = (t.double() for t in (q, k, v))
    batch, heads, seqlen_q, dim = q.shape
    group = heads // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    s = q @ k.transpose(-1, -2) * (dim ** -0.5 if scale is None else scale)
    b, h, i, j = (torch.arange(n).reshape([-1 if d == axis else 1 for d in range(4)])
                  for axis, n in enumerate(s.shape))
    if score_mod is not None:
        s = score_mod(s, b, h, i, j)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, i, j).expand(s.shape), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    seen = torch.isfinite(lse)
    p = torch.where(seen[..., None], torch.exp(s - torch.where(seen, lse, 0.0)[..., None]), 0.0)
    return p @ v, lse


def run_both(q, k, v, score_mod=None, mask_mod=None, **kwargs):
    """(out, lse, dq, dk, dv) of the reference and of cuflash's flex_attention for one loss that
    uses out and lse; the outputs also against torch's flex_attention."""
    results = []
    for name in ("reference", "cuflash"):
        for t in (q, k, v):
            t.grad = None
        if name == "reference":
            out, lse = naive(q, k, v, score_mod, mask_mod, kwargs.get("scale"))
        else:
            out, lse = cuflash.flex_attention(q, k, v, score_mod=score_mod, return_lse=True, **kwargs)
        # One dout for both: float16 values.
        weights = torch.linspace(-1, 1, out.numel()).half().reshape(out.shape).to(out.dtype)
        ((out * weights).sum() + (torch.where(torch.isinf(lse), 0, lse) * 0.5).sum()).backward()
        results.append([out.detach().float(), lse.detach().float()] + [t.grad.clone().float() for t in (q, k, v)])
    with torch.no_grad():
        out, lse = flex.flex_attention(q.detach(), k.detach(), v.detach(), score_mod=score_mod, return_lse=True,
                                       **kwargs)
    check(results[1][:2], [out, lse])
    return results


def run_against_lists(q, k, v, block_mask, listed):
    """(out, lse, dq, dk, dv) of float64 torch operations masked by `listed` (the pairs a BlockMask's
    lists keep, which torch's eager CPU FlexAttention does not read) and of cuflash given the
    BlockMask, for one loss of out and lse."""
    results = []
    for name in ("reference", "cuflash"):
        for t in (q, k, v):
            t.grad = None
        if name == "reference":
            out, lse = naive(q, k, v, mask_mod=listed)
        else:
            out, lse = cuflash.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
        weights = torch.linspace(-1, 1, out.numel()).half().reshape(out.shape).to(out.dtype)
        ((out * weights).sum() + (torch.where(torch.isinf(lse), 0, lse) * 0.5).sum()).backward()
        results.append([out.detach().float(), lse.detach().float()] + [t.grad.clone().float() for t in (q, k, v)])
    return results


def check(expected, got):
    for name, e, g in zip(("out", "lse", "dq", "dk", "dv"), expected, got):
        assert g.shape == e.shape, name
        # float16 outputs and gradients (one rounding) against float64 / float32 ones.
        scale = max(1.0, float(e[torch.isfinite(e)].abs().max()))
        torch.testing.assert_close(g.float(), e.float(), atol=4e-3 * scale, rtol=4e-3, msg=name)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def test_dense(gen):
    q, k, v = inputs(gen, heads_kv=4)
    check(*run_both(q, k, v))


def test_score_mod_gqa_and_causal_block_mask(gen):
    q, k, v = inputs(gen)
    bias = torch.randn(300, generator=gen)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx] - (h + 1) * 0.1 * torch.abs(q_idx - kv_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx + 100 >= kv_idx

    block_mask = flex.create_block_mask(causal, B=None, H=None, Q_LEN=200, KV_LEN=300, device="cpu")
    check(*run_both(q, k, v, score_mod=score_mod, mask_mod=causal, block_mask=block_mask, enable_gqa=True,
                    scale=0.3))


def test_document_mask_per_batch_and_head(gen):
    # A BlockMask of every batch entry and head, rows of the second sequence masked out entirely.
    q, k, v = inputs(gen, seqlen_q=300)
    doc = torch.tensor([[0] * 130 + [1] * 170, [0] * 300], dtype=torch.int32)

    def document(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & ((h != 3) | (b == 0) | (q_idx < 256))

    block_mask = flex.create_block_mask(document, B=2, H=4, Q_LEN=300, KV_LEN=300, device="cpu")
    expected, got = run_both(q, k, v, mask_mod=document, block_mask=block_mask, enable_gqa=True)
    check(expected, got)
    assert torch.isinf(got[1][1, 3, 256:]).all() and not got[0][1, 3, 256:].any()


def test_and_masks_and_or_masks(gen):
    # FlexAttention's mask combinators trace as they are (their b.new_ones / new_zeros start, the
    # functions they hold in their closure).
    q, k, v = inputs(gen, heads_kv=4, seqlen_q=300)
    doc = torch.tensor([[0] * 130 + [1] * 170, [0] * 300], dtype=torch.int32)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def document(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    def near(b, h, q_idx, kv_idx):
        return abs(q_idx - kv_idx) <= 8

    for mask_mod in (flex.and_masks(causal, document), flex.or_masks(flex.and_masks(causal, document), near)):
        block_mask = flex.create_block_mask(mask_mod, 2, None, 300, 300, device="cpu")
        check(*run_both(q, k, v, mask_mod=mask_mod, block_mask=block_mask))


def test_block_mask_without_a_mask_mod(gen):
    q, k, v = inputs(gen, heads_kv=4)
    block_mask = flex.create_block_mask(flex.noop_mask, None, None, 200, 300, device="cpu")
    check(*run_both(q, k, v, block_mask=block_mask))


def test_block_lists_narrower_than_the_mask(gen):
    # Lists alone decide what is computed (as FlexAttention's compiled kernels do; its eager CPU
    # path ignores them): each row block sees only the key blocks listed, here the diagonal block
    # and the first one, with the noop mask_mod.
    q, k, v = inputs(gen, heads_kv=4, seqlen_q=300, seqlen_k=300)
    rows = 3
    counts = torch.full((1, 1, rows), 2, dtype=torch.int32)
    counts[0, 0, 0] = 1
    indices = torch.zeros((1, 1, rows, rows), dtype=torch.int32)
    for m in range(1, rows):
        indices[0, 0, m, :2] = torch.tensor([0, m])
    block_mask = flex.BlockMask.from_kv_blocks(counts, indices, seq_lengths=(300, 300))

    def listed(b, h, q_idx, kv_idx):
        return (kv_idx // 128 == q_idx // 128) | (kv_idx < 128)

    check(*run_against_lists(q, k, v, block_mask, listed))


@pytest.mark.parametrize("extent", ["narrower", "longer"])
def test_block_lists_of_128_for_another_grid(gen, extent):
    # 128 x 128 lists whose extent is not the sequences' grid (BlockMask.from_kv_blocks takes
    # them): converted as other block sizes are, keeping the pairs they list within the lengths.
    q, k, v = inputs(gen, heads_kv=4, seqlen_q=300, seqlen_k=300)
    rows, cols = (3, 2) if extent == "narrower" else (5, 4)
    counts = torch.full((1, 1, rows), 1, dtype=torch.int32)
    indices = torch.zeros((1, 1, rows, cols), dtype=torch.int32)
    for m in range(rows):
        indices[0, 0, m, 0] = min(m, cols - 1)  # the diagonal block, or the last column there is
    block_mask = flex.BlockMask.from_kv_blocks(counts, indices, seq_lengths=(300, 300))

    def listed(b, h, q_idx, kv_idx):
        return kv_idx // 128 == torch.clamp(q_idx // 128, max=cols - 1)

    check(*run_against_lists(q, k, v, block_mask, listed))


def test_converted_block_masks_are_kept(gen, monkeypatch):
    # A BlockMask is converted once while its lists stay as they are (the same lists and mask_mod
    # wrapper come back), and again after its lists change in place; the conversion's slabs of
    # rows give the lists one slab gives.
    doc = torch.tensor([[0] * 70 + [1] * 230], dtype=torch.int32)

    def document(b, h, q_idx, kv_idx):
        return doc[0, q_idx] == doc[0, kv_idx]

    block_mask = flex.create_block_mask(document, B=None, H=None, Q_LEN=300, KV_LEN=300, device="cpu",
                                        BLOCK_SIZE=64)
    first = cuflash.flex._block_mask_arguments(block_mask, 300, 300)
    again = cuflash.flex._block_mask_arguments(block_mask, 300, 300)
    assert again["mask_mod"] is first["mask_mod"]
    assert all(a is b for a, b in zip(again["block_sparse"], first["block_sparse"]))
    monkeypatch.setattr(cuflash.flex, "_SLAB_ENTRIES", 7)
    block_mask.full_kv_num_blocks.zero_()  # the full blocks now unlisted: converted again
    changed = cuflash.flex._block_mask_arguments(block_mask, 300, 300)
    assert changed["mask_mod"] is not first["mask_mod"]
    assert int(changed["block_sparse"][2].sum()) == 0
    monkeypatch.setattr(cuflash.flex, "_SLAB_ENTRIES", 1 << 22)
    assert all(torch.equal(a, b) for a, b in zip(
        changed["block_sparse"], cuflash.flex._regrid_block_mask(
            (64, 64), document, block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
            block_mask.full_kv_indices, 300, 300)["block_sparse"]))
    q, k, v = inputs(gen, batch=1, heads_kv=4, seqlen_q=300, seqlen_k=300)
    partial = block_mask.kv_num_blocks.clone()  # the lists' pairs: partial blocks, as the mask says

    def listed(b, h, q_idx, kv_idx):
        row, col = q_idx // 64, kv_idx // 64
        slots = torch.arange(block_mask.kv_indices.shape[-1])
        hit = ((block_mask.kv_indices[0, 0, row] == col[..., None]) & (slots < partial[0, 0, row][..., None])).any(-1)
        return hit & document(b, h, q_idx, kv_idx)

    check(*run_against_lists(q, k, v, block_mask, listed))


def test_block_mask_made_in_inference_mode(gen):
    # Inference tensors have no version counter: such a BlockMask is converted at every call
    # (not kept), as it was before the conversions were kept.
    q, k, v = inputs(gen, heads_kv=4, seqlen_q=256, seqlen_k=256)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    with torch.inference_mode():
        block_mask = flex.create_block_mask(causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64)
        got = cuflash.flex_attention(q, k, v, block_mask=block_mask)
        again = cuflash.flex_attention(q, k, v, block_mask=block_mask)
    expected = cuflash.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)[0].transpose(1, 2)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    torch.testing.assert_close(again, expected, atol=0, rtol=0)


@pytest.mark.parametrize("block_size", [64, (64, 128), (128, 32), 256, (256, 64), (96, 80)])
def test_block_sizes_other_than_128(gen, block_size):
    # A BlockMask made with other blocks: converted to 128 x 128 lists; the mask_mod is used as it
    # is for multiples of 128, else wrapped to read the block states.
    q, k, v = inputs(gen, seqlen_q=300, seqlen_k=333)
    doc = torch.tensor([[0] * 70 + [1] * 263, [0] * 200 + [1] * 133], dtype=torch.int32)

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx + 33)

    block_mask = flex.create_block_mask(document_causal, B=2, H=None, Q_LEN=300, KV_LEN=333, device="cpu",
                                        BLOCK_SIZE=block_size)
    check(*run_both(q, k, v, mask_mod=document_causal, block_mask=block_mask, enable_gqa=True))
    sizes = block_size if isinstance(block_size, tuple) else (block_size, block_size)
    converted = cuflash.flex._block_mask_arguments(block_mask, 300, 333)["mask_mod"]
    assert (converted is document_causal) == (sizes[0] % 128 == 0 and sizes[1] % 128 == 0)


@pytest.mark.parametrize("with_mask_mod", [False, True])
def test_block_lists_of_64_decide_their_pairs(gen, with_mask_mod):
    # Lists of 64 x 64 blocks that the mask_mod does not describe: FlexAttention's compiled
    # kernels keep every pair of a full block and none of an unlisted one, whatever the mask_mod
    # says; a 128 x 128 block of cuflash mixes such blocks, so the conversion reads their states.
    q, k, v = inputs(gen, heads_kv=4, seqlen_q=200, seqlen_k=260)
    rows, cols = 4, 5
    gen_lists = torch.Generator().manual_seed(7)
    states = torch.randint(0, 3, (1, 4, rows, cols), generator=gen_lists)  # 0 skipped, 1 partial, 2 full
    states[0, 1, 2] = 0  # a row block that sees no key

    def lists(state):
        chosen = states == state
        cnt = chosen.sum(-1, dtype=torch.int32)
        idx = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return cnt, idx

    (mask_cnt, mask_idx), (full_cnt, full_idx) = lists(1), lists(2)

    def band(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx) % 3 != 0

    mask_mod = band if with_mask_mod else None
    block_mask = flex.BlockMask.from_kv_blocks(mask_cnt, mask_idx, full_cnt, full_idx, BLOCK_SIZE=64,
                                               mask_mod=mask_mod, seq_lengths=(200, 260))
    expanded = states.repeat_interleave(64, dim=2).repeat_interleave(64, dim=3)[..., :200, :260]

    def listed(b, h, q_idx, kv_idx):
        state = expanded[0, h, q_idx, kv_idx]
        partial = band(b, h, q_idx, kv_idx) if with_mask_mod else True
        return (state == 2) | ((state == 1) & partial)

    results = run_against_lists(q, k, v, block_mask, listed)
    check(*results)
    assert torch.isinf(results[1][1][:, 1, 128:192]).all()
    # Full and partial lists of other batch / head extents are refused by name, not broadcast.
    uneven = flex.BlockMask.from_kv_blocks(mask_cnt, mask_idx, full_cnt[:, :1], full_idx[:, :1], BLOCK_SIZE=64,
                                           mask_mod=mask_mod, seq_lengths=(200, 260))
    with pytest.raises(ValueError, match="^block_mask: its full lists have batch and heads"):
        cuflash.flex_attention(q, k, v, block_mask=uneven)


def test_return_aux_and_layout(gen):
    q, k, v = inputs(gen, heads_kv=4)
    out, aux = cuflash.flex_attention(q, k, v, return_aux=flex.AuxRequest(lse=True))
    expected, expected_lse = flex.flex_attention(q.detach(), k.detach(), v.detach(), return_lse=True)
    torch.testing.assert_close(aux.lse, expected_lse, atol=1e-4, rtol=1e-4)
    # (B, L, H, E) memory: the usual transpose back to tokens is free.
    assert out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
    assert cuflash.flex_attention(q, k, v).shape == (2, 4, 200, 32)


def test_errors_name_the_argument(gen):
    q, k, v = inputs(gen)
    with pytest.raises(ValueError, match="^enable_gqa: query has 4 heads and key 2"):
        cuflash.flex_attention(q, k, v)
    with pytest.raises(ValueError, match="^kernel_options: "):
        cuflash.flex_attention(q, k, v, enable_gqa=True, kernel_options={"BLOCK_M": 64})
    with pytest.raises(NotImplementedError, match="^return_aux: max_scores"):
        cuflash.flex_attention(q, k, v, enable_gqa=True, return_aux=flex.AuxRequest(lse=True, max_scores=True))
    other = flex.create_block_mask(flex.noop_mask, None, None, 256, 300, device="cpu")
    with pytest.raises(ValueError, match=r"^block_mask: made for \(Q_LEN, KV_LEN\) = \(256, 300\)"):
        cuflash.flex_attention(q, k, v, enable_gqa=True, block_mask=other)
    with pytest.raises(TypeError, match="^block_mask: expected FlexAttention's BlockMask"):
        cuflash.flex_attention(q, k, v, enable_gqa=True,
                               block_mask=cuflash.block_sparse.create_block_mask(cuflash.masks.causal(), 2, 1, 200, 300))
    with pytest.raises(ValueError, match="^query: expected 4 dimensions"):
        cuflash.flex_attention(q[0], k, v)
    with pytest.raises(ValueError, match=r"^key: expected shape \(2, Hkv, S, 32\)"):
        cuflash.flex_attention(q, k[:1], v[:1], enable_gqa=True)
    with pytest.raises(ValueError, match=r"^value: expected shape \(2, 2, 300, Ev\)"):
        cuflash.flex_attention(q, k, v[:, :, :100], enable_gqa=True)
    whole = flex.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, 2, 4, 200, 300, device="cpu")
    with pytest.raises(ValueError, match=r"^block_mask: a sliced BlockMask"):
        cuflash.flex_attention(q, k, v, enable_gqa=True, block_mask=whole[:, :, :1])


@pytest.mark.parametrize("lengths", [(200, 300), (300, 300), (1, 129), (128, 256)])
def test_cuflash_block_mask_matches_torchs(lengths):
    # cuflash.block_sparse.create_block_mask (NumPy, for every framework) lists the blocks torch's
    # does, in ascending order. A last block cut short by the sequence's end is full here when
    # every pair in range is kept; torch lists it as partial (it counts the pairs past the end).
    seqlen_q, seqlen_k = lengths
    doc = torch.tensor([[0] * 100 + [1] * 200, [0] * 150 + [2] * 150], dtype=torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx + 40 * h)

    ours = cuflash.block_sparse.create_block_mask(mask_mod, 2, 3, seqlen_q, seqlen_k)
    theirs = flex.create_block_mask(mask_mod, 2, 3, seqlen_q, seqlen_k, device="cpu")

    def blocks(cnt, idx, position):
        return list(idx[position][:cnt[position]])

    full, partial = (ours.full_block_cnt, ours.full_block_idx), (ours.mask_block_cnt, ours.mask_block_idx)
    their_full = (theirs.full_kv_num_blocks.numpy(), theirs.full_kv_indices.numpy())
    their_partial = (theirs.kv_num_blocks.numpy(), theirs.kv_indices.numpy())
    for position in np.ndindex(*ours.full_block_cnt.shape):
        mine_full, mine_partial = blocks(*full, position), blocks(*partial, position)
        assert mine_full == sorted(mine_full) and mine_partial == sorted(mine_partial)
        assert sorted(mine_full + mine_partial) == sorted(blocks(*their_full, position) + blocks(*their_partial, position))
        assert set(blocks(*their_full, position)) <= set(mine_full)
