#!/usr/bin/env python3
"""Where the flex forward's time goes on block lists: per shape, the plain kernel (causal=True /
window_size) against the flex kernel driven by the mask's block lists, and by the same blocks
moved all into the full list (no mask_mod evaluated: a timing bound, its output is not the
mask's) or all into the mask list (every block asks the mask_mod, whose all_visible hook lets
interior blocks skip the per-element check). bf16, 16k tokens, heads * head_dim = 2048:

    PYTHONPATH=<package> python3 bench/probe_flex_lists.py --hdims 64,128 --seqlens 2048,8192 [--window 1024]
        [--backward]

--backward: each column runs its forward once with autograd, then times the backward alone
(torch.autograd.grad of the output, as bench_flex.py --backward). --deterministic (with
--backward): two more columns, plain_det and sparse_det, the same calls with deterministic=True.

Prints each column's time and its ratio to the plain kernel's (bench_common.time_ms).
"""
import argparse
import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402


def merged(full_cnt, full_idx, mask_cnt, mask_idx):
    """Both lists of each row block as one ascending list: (counts, indices), shaped as given."""
    counts = full_cnt + mask_cnt
    indices = np.zeros_like(full_idx)
    for b in range(full_cnt.shape[0]):
        for h in range(full_cnt.shape[1]):
            for r in range(full_cnt.shape[2]):
                blocks = sorted(list(full_idx[b, h, r, :full_cnt[b, h, r]]) + list(mask_idx[b, h, r, :mask_cnt[b, h, r]]))
                indices[b, h, r, :len(blocks)] = blocks
    return counts, indices


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hdims", default="64,128")
    parser.add_argument("--seqlens", default="2048,8192")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--backward", action="store_true", help="time the backward alone (see above)")
    parser.add_argument("--deterministic", action="store_true", help="with --backward: deterministic columns too")
    args = parser.parse_args()
    if args.deterministic and not args.backward:
        parser.error("--deterministic: only with --backward (the forward has no deterministic mode)")

    import torch
    import cuflash
    from cuflash import block_sparse

    W = args.window
    for hdim in (int(h) for h in args.hdims.split(",")):
        for seqlen in (int(s) for s in args.seqlens.split(",")):
            batch, heads = common.TOKENS // seqlen, common.HIDDEN // hdim
            q, k, v = (torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=torch.bfloat16)
                       .requires_grad_(args.backward) for _ in range(3))
            dout = torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=torch.bfloat16)
            for mask in ("causal", "window"):
                mod = cuflash.masks.causal() if mask == "causal" else cuflash.masks.sliding_window(W)
                lists = block_sparse.create_block_mask(mod, batch, None, seqlen, seqlen)
                all_cnt, all_idx = merged(lists.full_block_cnt, lists.full_block_idx, lists.mask_block_cnt,
                                          lists.mask_block_idx)
                none = np.zeros_like(all_cnt)
                gpu = lambda x: torch.from_numpy(np.ascontiguousarray(x)).cuda()  # noqa: E731
                layouts = {
                    "sparse": (lists.full_block_cnt, lists.full_block_idx, lists.mask_block_cnt, lists.mask_block_idx),
                    "all_full": (all_cnt, all_idx, none, all_idx),
                    "all_mask": (none, all_idx, all_cnt, all_idx),
                }
                plain_kw = {"causal": True} if mask == "causal" else {"window_size": (W, 0)}
                columns = {"plain": lambda: cuflash.flash_attn_func(q, k, v, **plain_kw)}
                for name, (fc, fi, mc, mi) in layouts.items():
                    fc, fi, mc, mi = (gpu(x) for x in (fc, fi, mc, mi))
                    columns[name] = lambda fc=fc, fi=fi, mc=mc, mi=mi, mod=mod, det=False: cuflash.flash_attn_func(
                        q, k, v, mask_mod=mod, full_block_cnt=fc, full_block_idx=fi, mask_block_cnt=mc,
                        mask_block_idx=mi, deterministic=det)
                if args.deterministic:
                    columns["plain_det"] = lambda: cuflash.flash_attn_func(q, k, v, deterministic=True, **plain_kw)
                    columns["sparse_det"] = functools.partial(columns["sparse"], det=True)
                if args.backward:
                    def backward_of(fn):
                        out = fn()
                        out = out[0] if isinstance(out, tuple) else out
                        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                    columns = {name: backward_of(fn) for name, fn in columns.items()}
                plain = None
                for name, fn in columns.items():
                    ms = common.time_ms(fn, 3, 10)
                    plain = plain or ms
                    print(f"{'bwd' if args.backward else 'fwd'} hdim {hdim} seqlen {seqlen} {mask:>7} {name:>10}: {ms * 1000:8.1f} us  "
                          f"({plain / ms:.3f} of plain)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
