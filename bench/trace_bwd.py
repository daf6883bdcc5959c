#!/usr/bin/env python3
"""Where a backward step's time goes, from a diagnostic build's timeline (src/sm90/trace_sm90.hpp).

Needs the extension built with -DCUFLASH_BWD_TRACE=1. Runs one bf16 forward and two backward
calls (a warm-up, then the one analysed) on the benchmark's shape (16k tokens, heads * head_dim
= 2048) in a child process, collects the lines the main kernel's launch prints for its first
CTAs (trace::kMaxCtas, about two waves) and shows, per MMA warpgroup, the mean time of each stage
of a step (one row block of a column block: Q landed and S issued, S and dP done, P and dS
stored, dQ handed out, every MMA done; in the sliced hdim256 kernels also both warpgroups' dS
stored (pds), dV_0 / dQ_0 done (mma0) and dK_0 / dQ_1 done (mma1), so that the dQ halves' stores
(mma0 -> dq0, mma1 -> dq1) show apart from the MMAs) in microseconds, SM cycles converted at the
clock measured against the global timer (or at --clock GHz):

    PYTHONPATH=<package> python3 bench/trace_bwd.py --hdim 256 --seqlen 2048 [--deterministic]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402
import trace_common  # noqa: E402

STEP, STEP_END = trace_common.EVENTS.index("step"), trace_common.EVENTS.index("step_end")


def run_calls(args):
    import ctypes

    import torch
    import cuflash

    batch, heads = common.shape_of(args)
    q, k, v = (torch.randn(batch, args.seqlen, heads, args.hdim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    out, _ = cuflash.flash_attn_func(q, k, v, causal=bool(args.causal), deterministic=args.deterministic)
    dout = torch.randn_like(out)
    libc = ctypes.CDLL(None)  # the launch prints through C stdio: flush it before the marker
    for _ in range(2):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
        libc.fflush(None)
        print("bwdtrace-call-end", flush=True)


def analyse(lines, clock_ghz):
    loaded = trace_common.load(lines, "bwdtrace", "CUFLASH_BWD_TRACE", clock_ghz)
    if loaded is None:
        return 1
    streams, bounds, us = loaded
    spans, totals = trace_common.spans_of(streams, 0, us)
    trace_common.print_kernel(streams, bounds, 0, "main", us, spans, totals)
    # Whole steps (step to step) and what lies outside them: before the first step (K / V loads,
    # the first Q) and after the last (the dK / dV epilogue).
    steps, before, after = [], [], []
    for key, stream in streams.items():
        marks = [(e, c) for e, c in stream if e in (STEP, STEP_END)]
        starts = [c for e, c in marks if e == STEP]
        steps += [us(b - a) for a, b in zip(starts, starts[1:])]
        if starts:
            before.append(us(starts[0]))
            ends = [c for e, c in marks if e == STEP_END]
            if ends and stream[-1][0] == trace_common.END:
                after.append(us(stream[-1][1] - ends[-1]))
    if steps:
        print(f"  step to step: n={len(steps)} mean {sum(steps) / len(steps):.2f} us "
              f"(min {min(steps):.2f}, max {max(steps):.2f})")
    if before:
        print(f"  start to first step: mean {sum(before) / len(before):.2f} us; last step's end to the "
              f"warpgroup's end (epilogue): mean {sum(after) / max(len(after), 1):.2f} us")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shape_args(parser, seqlen=2048)
    parser.add_argument("--deterministic", action="store_true")
    trace_common.add_args(parser)
    args = parser.parse_args()
    if args.child:
        run_calls(args)
        return 0
    lines, status = trace_common.child_lines(__file__, args, ["--deterministic"] if args.deterministic else [])
    if lines is None:
        return status
    print(f"backward hdim {args.hdim} seqlen {args.seqlen} tokens {args.tokens} causal {args.causal} "
          f"deterministic {int(args.deterministic)}")
    return analyse(lines, args.clock)


if __name__ == "__main__":
    sys.exit(main())
