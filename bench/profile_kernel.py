#!/usr/bin/env python3
"""One cuflash forward and backward on a benchmark-grid shape, for a profiler to capture.

    ncu --set full -k regex:flash_bwd_kernel -c 1 python3 bench/profile_kernel.py --hdim 256 --seqlen 4096

Shapes as bench_fwd.py / bench_bwd.py (bf16, batch * seqlen = 16k tokens, heads * head_dim =
2048). Runs --warmup untimed iterations first so that a profiler filtering with -c / -s sees a
steady-state launch, then one more; prints nothing but the shape.
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
    args = parser.parse_args()

    import torch
    import cuflash

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
