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
clock measured against the global timer (or at --clock GHz). Deterministic runs also show the
dQ warp's waits for each row block's turn (the earlier column blocks' adds), by the step of the
walk they fall on, and what share of the warp's time they take; the kernels whose dQ goes through
one shared-memory buffer show the MMA warpgroups' wait for it in "ds -> dq_buffer":

    PYTHONPATH=<package> python3 bench/trace_bwd.py --hdim 256 --seqlen 2048 [--deterministic]
        [--lists causal|window|document]

The grid view that follows (print_grid) takes every traced CTA together: how many ran at once
over the kernel's span, and where their summed time went (before the first step, steps whose
tile the window cuts, whole steps, after the last step). It covers the whole grid when the build
keeps enough CTAs: -DCUFLASH_TRACE_MAX_CTAS=2048 -DCUFLASH_TRACE_MAX_EVENTS=640 holds a 16k-token
hdim256 backward at 2k (1,664 CTAs) and at 4k causal; at 4k non-causal a CTA's 64 steps overflow
640 events and it is left out.

--lists: the flex backward on a mask's block lists (cuflash.block_sparse.create_block_mask of the
built-in mask_mod: causal, a sliding window of 1024 keys, or 4 to 8 documents per sequence), as
bench_flex.py's cuflash_sparse column; --causal is then ignored.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402
import trace_common  # noqa: E402

STEP, STEP_END = trace_common.EVENTS.index("step"), trace_common.EVENTS.index("step_end")
# A step whose tile the window's edge cuts (causal / local kernels), marked in place of "step".
STEP_CUT = trace_common.EVENTS.index("step_cut")
STEP_MARKS = (STEP, STEP_CUT)
TURN_WAIT, TURN = trace_common.EVENTS.index("turn_wait"), trace_common.EVENTS.index("turn")
# Steps of a walk grouped for the turn waits: [lo, hi).
STEP_BUCKETS = [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 1 << 30)]


def run_calls(args):
    import ctypes

    import torch
    import cuflash

    batch, heads = common.shape_of(args)
    q, k, v = (torch.randn(batch, args.seqlen, heads, args.hdim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    if args.lists:
        mod = lists_mask(args.lists, batch, args.seqlen)
        lists = cuflash.block_sparse.create_block_mask(mod, batch, None, args.seqlen, args.seqlen)
        lists = {name: torch.from_numpy(x).cuda() for name, x in lists._asdict().items()}
        out, _ = cuflash.flash_attn_func(q, k, v, mask_mod=mod, deterministic=args.deterministic, **lists)
    else:
        out, _ = cuflash.flash_attn_func(q, k, v, causal=bool(args.causal), deterministic=args.deterministic)
    dout = torch.randn_like(out)
    libc = ctypes.CDLL(None)  # the launch prints through C stdio: flush it before the marker
    for _ in range(2):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
        libc.fflush(None)
        print("bwdtrace-call-end", flush=True)


def lists_mask(name, batch, seqlen):
    """The built-in mask_mod of --lists."""
    import torch
    import cuflash

    if name == "causal":
        return cuflash.masks.causal()
    if name == "window":
        return cuflash.masks.sliding_window(1024)
    from bench_flex import document_ids

    return cuflash.masks.document(document_ids(batch, seqlen, torch.Generator().manual_seed(seqlen)))


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
        marks = [(e, c) for e, c in stream if e in (*STEP_MARKS, STEP_END)]
        starts = [c for e, c in marks if e in STEP_MARKS]
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
    print_turn_waits(streams, us)
    print_grid(streams, bounds, us)
    return 0


def print_grid(streams, bounds, us, bins=20):
    """The traced CTAs as a whole (MMA warpgroup 0 of each; all of the grid when the build keeps
    enough CTAs, -DCUFLASH_TRACE_MAX_CTAS): how full the SMs were kept from the first start to
    the last end (the CTAs running at once, per twentieth of that span, against the most seen
    together), and where the CTAs' summed time went: before the first step, steps whose tile
    the window cuts, whole steps (each the first of its walk apart), after the last step."""
    keys = [key for key in streams if key[0] == 0 and key[2] == 0 and streams[key][-1][0] == trace_common.END]
    if not keys:
        return
    spans = sorted(bounds[key] for key in keys)
    t0, t1 = spans[0][0], max(end for _, end in spans)
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running, most = 0, 0
    for _, delta in edges:
        running += delta
        most = max(most, running)
    busy = sum(end - start for start, end in spans)
    print(f"grid: {len(keys)} CTAs over {(t1 - t0) / 1e3:.1f} us; at most {most} at once; "
          f"mean running {busy / (t1 - t0):.1f} ({busy / (t1 - t0) / most:.3f} of the most)")
    width = (t1 - t0) / bins
    filled = []
    for b in range(bins):
        lo, hi = t0 + b * width, t0 + (b + 1) * width
        filled.append(sum(max(0, min(end, hi) - max(start, lo)) for start, end in spans) / width)
    print("  CTAs running per twentieth of the span:", " ".join(f"{x:.0f}" for x in filled))
    # The CTAs' time by part, in CTA-microseconds (clock cycles of warpgroup 0).
    parts = {"before the first step": [], "cut steps": [], "first whole steps": [], "whole steps": [],
             "after the last step": []}
    walks = []
    for key in keys:
        stream = streams[key]
        marks = [(e, c) for e, c in stream if e in (*STEP_MARKS, STEP_END)]
        starts = [(e, c) for e, c in marks if e in STEP_MARKS]
        if not starts:
            parts["before the first step"].append(us(stream[-1][1]))
            walks.append(0)
            continue
        ends = [c for e, c in marks if e == STEP_END]
        bounds_of_steps = [c for _, c in starts[1:]] + [ends[-1] if ends else stream[-1][1]]
        parts["before the first step"].append(us(starts[0][1]))
        first_whole = True
        for (event, begin), end in zip(starts, bounds_of_steps):
            if event == STEP_CUT:
                parts["cut steps"].append(us(end - begin))
            else:
                parts["first whole steps" if first_whole else "whole steps"].append(us(end - begin))
                first_whole = False
        parts["after the last step"].append(us(stream[-1][1] - bounds_of_steps[-1]))
        walks.append(len(starts))
    total = sum(sum(v) for v in parts.values())
    print(f"  CTA time: {total / 1e3:.2f} CTA-ms over {sum(walks)} steps ({sum(walks) / len(keys):.1f} per CTA)")
    for name, values in parts.items():
        if values:
            print(f"    {name:22s} n={len(values):6d} mean {sum(values) / len(values):7.2f} us  "
                  f"share {sum(values) / total:.3f}")


def print_turn_waits(streams, us):
    """The dQ warp's waits for the deterministic order's turns: per step of the walk (the k-th
    row block a column block adds), and their share of each warp's time from start to end."""
    by_step = [[] for _ in STEP_BUCKETS]
    shares = []
    for key, stream in streams.items():
        if key[0] != 0 or key[2] != trace_common.DQ_WARP:
            continue
        waits = [us(c1 - c0) for (e0, c0), (e1, c1) in zip(stream, stream[1:]) if e0 == TURN_WAIT and e1 == TURN]
        for step, wait in enumerate(waits):
            next(bucket for bucket, (lo, hi) in zip(by_step, STEP_BUCKETS) if lo <= step < hi).append(wait)
        if waits and stream[-1][0] == trace_common.END and stream[-1][1] > 0:
            shares.append(sum(waits) / us(stream[-1][1]))
    if not shares:
        return
    shares.sort()
    print(f"  dQ warp turn waits: {len(shares)} warps; share of the warp's time: median "
          f"{shares[len(shares) // 2]:.2f}, min {shares[0]:.2f}, max {shares[-1]:.2f}")
    for (lo, hi), waits in zip(STEP_BUCKETS, by_step):
        if waits:
            steps = f"{lo}" if hi == lo + 1 else (f"{lo}-{hi - 1}" if hi < 1 << 30 else f"{lo}+")
            print(f"    steps {steps:>6}: n={len(waits):5d} mean {sum(waits) / len(waits):7.2f} us "
                  f"max {max(waits):7.2f} us")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shape_args(parser, seqlen=2048)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--lists", choices=("causal", "window", "document"), default=None,
                        help="the flex backward on this mask's block lists (see above)")
    trace_common.add_args(parser)
    args = parser.parse_args()
    if args.child:
        run_calls(args)
        return 0
    extra = (["--deterministic"] if args.deterministic else []) + (["--lists", args.lists] if args.lists else [])
    lines, status = trace_common.child_lines(__file__, args, extra)
    if lines is None:
        return status
    mask = f"lists {args.lists}" if args.lists else f"causal {args.causal}"
    print(f"backward hdim {args.hdim} seqlen {args.seqlen} tokens {args.tokens} {mask} "
          f"deterministic {int(args.deterministic)}")
    return analyse(lines, args.clock)


if __name__ == "__main__":
    sys.exit(main())
