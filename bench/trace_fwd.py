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
import collections
import ctypes
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402

EVENTS = ["start", "tile", "first_s", "first_p", "loop_end", "mma_end", "meet_arrived",
          "meet_done", "epilogue", "end"]


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
    # Keep the last call's lines only (the first is a warm-up).
    calls, current = [], []
    for line in lines:
        if line.startswith("fwdtrace-call-end"):
            calls.append(current)
            current = []
        elif line.startswith("fwdtrace "):
            current.append(line.split()[1:])
    if not calls or not calls[-1]:
        print("no trace lines: is the extension built with -DCUFLASH_FWD_TRACE=1?")
        return 1
    streams = collections.defaultdict(list)  # (kernel, cta, wg) -> [(event, cycles)]
    bounds = {}  # (kernel, cta, wg) -> (global ns at start, at end)
    for kernel, cta, wg, event, cycles, start_ns, end_ns in calls[-1]:
        key = (int(kernel), int(cta), int(wg))
        streams[key].append((int(event), int(cycles)))
        bounds[key] = (int(start_ns), int(end_ns))
    if clock_ghz is None:
        # The SM clock these cycles ran at: each warpgroup's cycles from its start to its end
        # event over the global timer's nanoseconds between the same two points (median).
        rates = sorted(stream[-1][1] / (bounds[key][1] - bounds[key][0])
                       for key, stream in streams.items()
                       if stream[-1][0] == EVENTS.index("end") and bounds[key][1] > bounds[key][0])
        clock_ghz = rates[len(rates) // 2] if rates else 1.98
        print(f"SM clock from the global timer: {clock_ghz:.3f} GHz (spans below in microseconds)")
    us = lambda c: c / (clock_ghz * 1e3)  # noqa: E731
    for kernel in sorted({key[0] for key in streams}):
        spans = collections.defaultdict(list)
        totals = []
        for key, stream in sorted(streams.items()):
            if key[0] != kernel:
                continue
            totals.append(us(stream[-1][1]))
            # A tile's stages: the gaps between consecutive events from one "tile" to the next.
            for (e0, c0), (e1, c1) in zip(stream, stream[1:]):
                spans[f"wg{key[2]} {EVENTS[e0]} -> {EVENTS[e1]}"].append(us(c1 - c0))
        name = "plain" if kernel == 0 else "stream-K pieces"
        print(f"kernel {kernel} ({name}): {len(totals)} warpgroups traced, "
              f"time from start to end {min(totals):.1f}-{max(totals):.1f} us")
        # One time line for the kernel's CTAs (global timer): when the warpgroups start and end.
        starts = [b[0] for key, b in bounds.items() if key[0] == kernel]
        ends = [b[1] for key, b in bounds.items() if key[0] == kernel]
        t0 = min(starts)
        print(f"  global time: warpgroups start over {(max(starts) - t0) / 1e3:.1f} us, end between "
              f"{(min(ends) - t0) / 1e3:.1f} and {(max(ends) - t0) / 1e3:.1f} us after the first start")
        late = sorted(((b[1] - t0) / 1e3, key[1], key[2]) for key, b in bounds.items() if key[0] == kernel)[-4:]
        print("  last to end (us, cta, wg):", ", ".join(f"{t:.1f} {c} {w}" for t, c, w in late))
        for span, values in sorted(spans.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {span:32s} n={len(values):4d} mean {sum(values) / len(values):7.2f} us"
                  f"  min {min(values):7.2f}  max {max(values):7.2f}  total/wg "
                  f"{sum(values) / len(totals):8.1f} us")
        loop = spans.get("wg0 first_p -> loop_end")
        if loop and n_blocks > 1:
            print(f"  loop per n-block (whole tiles): {sum(loop) / len(loop) / (n_blocks - 1):.3f} us")
        for key, stream in sorted(streams.items()):
            if key[0] == kernel and key[1] == min(k[1] for k in streams if k[0] == kernel) and key[2] == 0:
                print("  first warpgroup's events (us):",
                      " ".join(f"{EVENTS[e]}@{us(c):.1f}" for e, c in stream[:40]))
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shape_args(parser, seqlen=2048)
    parser.add_argument("--clock", type=float, default=None,
                        help="SM clock in GHz for the conversion (default: measured against the global timer)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_calls(args)
        return 0
    child = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--hdim", str(args.hdim),
                            "--seqlen", str(args.seqlen), "--tokens", str(args.tokens),
                            "--causal", str(args.causal)], capture_output=True, text=True)
    if child.returncode != 0:
        print(child.stderr[-4000:])
        return child.returncode
    print(f"hdim {args.hdim} seqlen {args.seqlen} tokens {args.tokens} causal {args.causal} "
          f"CUFLASH_FWD_STREAM_K={os.environ.get('CUFLASH_FWD_STREAM_K', 'auto')}")
    return analyse(child.stdout.splitlines(), args.clock, (args.seqlen + 127) // 128)


if __name__ == "__main__":
    sys.exit(main())
