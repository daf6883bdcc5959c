#!/usr/bin/env python3
"""One cuflash forward and backward on a benchmark-grid shape, for a profiler to capture.

    ncu --set full -k regex:flash_bwd_kernel -c 1 python3 bench/profile_kernel.py --hdim 256 --seqlen 4096

Shapes as bench_fwd.py / bench_bwd.py (bf16, batch * seqlen = 16k tokens, heads * head_dim =
2048). Runs --warmup untimed iterations first so that a profiler filtering with -c / -s sees a
steady-state launch, then one more; prints nothing but the shape.

--decode GROUPS: a GQA decode step as bench_gqa.py times it instead, forward only: --decode-batch
sequences of --seqlen keys, --decode-seqlen-q query rows each, GROUPS query:kv heads (e.g. 32:4),
causal bottom-right, packed GQA and the split-KV heuristic (the forward and the combine kernel).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shape_args(parser, seqlen=4096)
    parser.add_argument("--deterministic", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--decode", default=None, metavar="HQ:HKV", help="a GQA decode step (see above)")
    parser.add_argument("--decode-batch", type=int, default=4)
    parser.add_argument("--decode-seqlen-q", type=int, default=1)
    args = parser.parse_args()

    import torch
    import cuflash

    if args.decode:
        heads, heads_kv = (int(x) for x in args.decode.split(":"))
        torch.manual_seed(0)
        q = torch.randn(args.decode_batch, args.decode_seqlen_q, heads, args.hdim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(args.decode_batch, args.seqlen, heads_kv, args.hdim, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        print(f"decode hdim={args.hdim} seqlen_k={args.seqlen} seqlen_q={args.decode_seqlen_q} "
              f"batch={args.decode_batch} heads={heads}:{heads_kv}", flush=True)
        for _ in range(args.warmup + 1):
            cuflash.flash_attn_func(q, k, v, causal=True, pack_gqa=True, num_splits=0)
        torch.cuda.synchronize()
        return

    batch, nheads = common.shape_of(args)
    torch.manual_seed(0)
    shape = (batch, args.seqlen, nheads, args.hdim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    print(f"hdim={args.hdim} seqlen={args.seqlen} batch={batch} nheads={nheads} causal={args.causal} "
          f"deterministic={args.deterministic}", flush=True)
    for _ in range(args.warmup + 1):
        out, lse = cuflash.flash_attn_func(q, k, v, causal=bool(args.causal))
        if not args.no_backward:
            cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=bool(args.causal),
                                        deterministic=bool(args.deterministic))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
