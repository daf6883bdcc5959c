"""The timeline lines of a diagnostic build (src/sm90/trace_sm90.hpp), read for bench/trace_fwd.py
and bench/trace_bwd.py: each line is "<tag> <kernel> <cta> <warpgroup> <event> <cycles since the
warpgroup's start> <global ns at its start> <global ns at its end>", and "<tag>-call-end" closes
a call."""
import argparse
import collections
import os
import subprocess
import sys

# By event code (trace::Event).
EVENTS = ["start", "tile", "first_s", "first_p", "loop_end", "mma_end", "meet_arrived",
          "meet_done", "epilogue", "end",
          "step", "q", "sdp", "ds", "dq0", "dq1", "step_end", "pds", "mma0", "mma1",
          "turn_wait", "turn", "released", "dq_buffer", "step_cut"]
# The backward's dQ warp records as warpgroup 2 (the MMA warpgroups are 0 and 1).
DQ_WARP = 2
END = EVENTS.index("end")


def last_call(lines, tag):
    """(streams, bounds) of the last call: streams[(kernel, cta, wg)] = [(event, cycles)], bounds
    the warpgroup's (global ns at start, at end); (None, None) when it has no lines."""
    calls, current = [], []
    for line in lines:
        if line.startswith(f"{tag}-call-end"):
            calls.append(current)
            current = []
        elif line.startswith(f"{tag} "):
            current.append(line.split()[1:])
    if not calls or not calls[-1]:
        return None, None
    streams = collections.defaultdict(list)
    bounds = {}
    for kernel, cta, wg, event, cycles, start_ns, end_ns in calls[-1]:
        key = (int(kernel), int(cta), int(wg))
        streams[key].append((int(event), int(cycles)))
        bounds[key] = (int(start_ns), int(end_ns))
    return streams, bounds


def load(lines, tag, build_flag, given_clock):
    """The last call's (streams, bounds) and a cycles-to-microseconds function, or None (after
    saying which build is missing) when there are no lines."""
    streams, bounds = last_call(lines, tag)
    if streams is None:
        print(f"no trace lines: is the extension built with -D{build_flag}=1?")
        return None
    ghz = clock_ghz(streams, bounds, given_clock)
    return streams, bounds, lambda c: c / (ghz * 1e3)


def clock_ghz(streams, bounds, given):
    """The SM clock the cycles ran at: given, or each warpgroup's cycles from its start to its end
    event over the global timer's nanoseconds between the same two points (median)."""
    if given is not None:
        return given
    rates = sorted(stream[-1][1] / (bounds[key][1] - bounds[key][0])
                   for key, stream in streams.items()
                   if stream[-1][0] == END and bounds[key][1] > bounds[key][0])
    ghz = rates[len(rates) // 2] if rates else 1.98
    print(f"SM clock from the global timer: {ghz:.3f} GHz (spans below in microseconds)")
    return ghz


def spans_of(streams, kernel, us):
    """Gaps between consecutive events per warpgroup, named "wg<w> <from> -> <to>", and each MMA
    warpgroup's time from start to end, for one kernel (the dQ warp's spans are named wg2 and
    left out of the totals)."""
    spans = collections.defaultdict(list)
    totals = []
    for key, stream in sorted(streams.items()):
        if key[0] != kernel:
            continue
        if key[2] != DQ_WARP:
            totals.append(us(stream[-1][1]))
        for (e0, c0), (e1, c1) in zip(stream, stream[1:]):
            spans[f"wg{key[2]} {EVENTS[e0]} -> {EVENTS[e1]}"].append(us(c1 - c0))
    return spans, totals


def print_kernel(streams, bounds, kernel, name, us, spans, totals):
    """The kernel's span table (largest total first) and its place on the global time line."""
    print(f"kernel {kernel} ({name}): {len(totals)} warpgroups traced, "
          f"time from start to end {min(totals):.1f}-{max(totals):.1f} us")
    starts = [b[0] for key, b in bounds.items() if key[0] == kernel]
    ends = [b[1] for key, b in bounds.items() if key[0] == kernel]
    t0 = min(starts)
    print(f"  global time: warpgroups start over {(max(starts) - t0) / 1e3:.1f} us, end between "
          f"{(min(ends) - t0) / 1e3:.1f} and {(max(ends) - t0) / 1e3:.1f} us after the first start")
    late = sorted(((b[1] - t0) / 1e3, key[1], key[2]) for key, b in bounds.items() if key[0] == kernel)[-4:]
    print("  last to end (us, cta, wg):", ", ".join(f"{t:.1f} {c} {w}" for t, c, w in late))
    dq_warps = sum(1 for key in streams if key[0] == kernel and key[2] == DQ_WARP)
    for span, values in sorted(spans.items(), key=lambda kv: -sum(kv[1])):
        per = dq_warps if span.startswith(f"wg{DQ_WARP} ") else len(totals)
        print(f"  {span:32s} n={len(values):4d} mean {sum(values) / len(values):7.2f} us"
              f"  min {min(values):7.2f}  max {max(values):7.2f}  total/wg "
              f"{sum(values) / max(per, 1):8.1f} us")
    first = min(key[1] for key in streams if key[0] == kernel)
    stream = streams.get((kernel, first, 0), [])
    print("  first warpgroup's events (us):", " ".join(f"{EVENTS[e]}@{us(c):.1f}" for e, c in stream[:40]))


def add_args(parser):
    """The options both tools take beside the shape (bench_common.add_shape_args)."""
    parser.add_argument("--clock", type=float, default=None,
                        help="SM clock in GHz for the conversion (default: measured against the global timer)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def child_lines(script, args, extra=()):
    """Runs `script` again as the child (--child) on the same shape, in its own process so that
    only its calls print; (its stdout lines, 0), or (None, its exit status) after printing its
    stderr's end."""
    command = [sys.executable, os.path.abspath(script), "--child", "--hdim", str(args.hdim), "--seqlen",
               str(args.seqlen), "--tokens", str(args.tokens), "--causal", str(args.causal), *extra]
    child = subprocess.run(command, capture_output=True, text=True)
    if child.returncode != 0:
        print(child.stderr[-4000:])
        return None, child.returncode
    return child.stdout.splitlines(), 0
