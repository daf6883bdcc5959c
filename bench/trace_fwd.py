#!/usr/bin/env python3
"""Where a forward tile's time goes, from a diagnostic build's timeline (src/sm90/trace_sm90.hpp).

Needs the extension built with -DCUFLASH_FWD_TRACE=1. Runs one bf16 forward call (after a
warm-up) on the benchmark's shape (16k tokens, heads * head_dim = 2048) in a child process,
collects the lines the launch prints and shows, per kernel (0 plain, 1 stream-K pieces) and
MMA warpgroup, the mean time of each stage of a tile in microseconds (SM cycles converted at the
clock measured against the global timer, or at --clock GHz):

    PYTHONPATH=<package> CUFLASH_FWD_STREAM_K=always python3 bench/trace_fwd.py --seqlen 2048
"""
import argparse
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402
import trace_common  # noqa: E402


def run_calls(args):
    import torch
    import cuflash

    batch, heads = common.shape_of(args)
    q, k, v = (torch.randn(batch, args.seqlen, heads, args.hdim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    libc = ctypes.CDLL(None)  # the kernels' printf goes through C stdio: flush it before the marker
    for _ in range(2):
        cuflash.flash_attn_func(q, k, v, causal=bool(args.causal))
        torch.cuda.synchronize()
        libc.fflush(None)
        print("fwdtrace-call-end", flush=True)


def analyse(lines, clock_ghz, n_blocks):
    # The last call's lines only (the first is a warm-up).
    loaded = trace_common.load(lines, "fwdtrace", "CUFLASH_FWD_TRACE", clock_ghz)
    if loaded is None:
        return 1
    streams, bounds, us = loaded
    for kernel in sorted({key[0] for key in streams}):
        spans, totals = trace_common.spans_of(streams, kernel, us)
        name = "plain" if kernel == 0 else "stream-K pieces"
        trace_common.print_kernel(streams, bounds, kernel, name, us, spans, totals)
        loop = spans.get("wg0 first_p -> loop_end")
        if loop and n_blocks > 1:
            print(f"  loop per n-block (whole tiles): {sum(loop) / len(loop) / (n_blocks - 1):.3f} us")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shape_args(parser, seqlen=2048)
    trace_common.add_args(parser)
    args = parser.parse_args()
    if args.child:
        run_calls(args)
        return 0
    lines, status = trace_common.child_lines(__file__, args)
    if lines is None:
        return status
    print(f"hdim {args.hdim} seqlen {args.seqlen} tokens {args.tokens} causal {args.causal} "
          f"CUFLASH_FWD_STREAM_K={os.environ.get('CUFLASH_FWD_STREAM_K', 'auto')}")
    return analyse(lines, args.clock, (args.seqlen + 127) // 128)


if __name__ == "__main__":
    sys.exit(main())
