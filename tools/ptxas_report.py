#!/usr/bin/env python3
"""ptxas's resource report for kernel instantiations, on the CPU, before any GPU run.

Re-runs the build's own nvcc command of each instantiation source that matches SOURCE_REGEX
(from `ninja -t commands` of a configured build folder) with -Xptxas=-v, into a scratch object,
and prints per kernel its registers, spills and stack, and every ptxas "Potential Performance
Loss" (C75xx: WGMMAs serialized, for whatever reason ptxas gives). Exits 1 when any kernel has
serialized WGMMAs or a file gives no report, so that a change can be gated on it:

    python3 tools/ptxas_report.py --build /tmp/bcheck 'flash_bwd_hdim(128|256)_bf16_sm90\\.cu$'

Only sources the build folder compiles can be reported (configure it with the kernel set and
head dims wanted). Register counts of warp-specialized kernels are the launch maximum; which
role spills shows only in the SASS (spills after USETMAXREG.DEALLOC belong to the producer).
"""
import argparse
import concurrent.futures
import os
import re
import shlex
import subprocess
import sys
import tempfile

NAMESPACES = ("cuflash::sm90::bwd::", "cuflash::sm90::", "cuflash::variants::", "cuflash::", "cutlass::", "cute::")


def compile_commands(build, source_regex):
    out = subprocess.run(["ninja", "-C", build, "-t", "commands"], check=True, capture_output=True, text=True).stdout
    pattern = re.compile(source_regex)
    commands = {}
    for line in out.splitlines():
        if "nvcc" not in line or " -c " not in line:
            continue
        args = shlex.split(line)
        source = args[args.index("-c") + 1]
        if pattern.search(os.path.basename(source)) and source not in commands:
            commands[source] = args
    return commands


def report_of(source, args, scratch, build_dir):
    # Without the dependency-file flags (-MD; -MT / -MF and their values).
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("-MT", "-MF"):
            skip = True
        elif a != "-MD":
            kept.append(a)
    args = kept
    obj = os.path.join(scratch, os.path.basename(source) + ".o")
    args[args.index("-o") + 1] = obj
    # After nvcc itself, which a compiler launcher (ccache) may precede.
    nvcc = next((i for i, a in enumerate(args) if os.path.basename(a) == "nvcc"), 0)
    args.insert(nvcc + 1, "-Xptxas=-v")
    result = subprocess.run(args, capture_output=True, text=True, cwd=build_dir)
    return source, result.returncode, result.stdout + result.stderr


def demangle(names):
    if not names:
        return {}
    # -p: without the parameter list (a split at "(" would cut casts inside template arguments).
    out = subprocess.run(["c++filt", "-p"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    if len(out) != len(names):
        return {n: n for n in names}
    short = {}
    for mangled, name in zip(names, out):
        for ns in NAMESPACES:
            name = name.replace(ns, "")
        # A kernel's collective types repeat its mainloop's arguments: keep the first mention.
        name = re.sub(r", Epilogue\w*<.*", "> >", name)
        short[mangled] = name
    return short


def parse(log):
    """The kernels in order, each {'name', 'regs', 'spill_st', 'spill_ld', 'stack', 'callee_spill'}, and
    {mangled: [C75xx messages]}. The properties of a function that is not inlined follow its
    caller's; their spills count as the last kernel's callee spills."""
    blocks, current, losses = [], None, {}
    for line in log.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            current = {"name": m.group(1), "regs": None, "spill_st": 0, "spill_ld": 0, "stack": 0, "callee_spill": 0}
            blocks.append(current)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current is not None:
            current["stack"], current["spill_st"], current["spill_ld"] = map(int, m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current is not None:
            current["regs"] = int(m.group(1))
            continue
        m = re.search(r"\((C75\d\d)\) Potential Performance Loss: (.*?) in the function '(\S+)'", line)
        if m:
            losses.setdefault(m.group(3), []).append(f"{m.group(1)}: {m.group(2)}")
    # Device functions have properties too; only kernels (entry functions) have registers.
    kernels = []
    for block in blocks:
        if block["regs"] is not None:
            kernels.append(block)
        elif kernels:
            kernels[-1]["callee_spill"] += block["spill_st"] + block["spill_ld"]
    return kernels, losses


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source_regex", help="regex on the instantiation file names, e.g. 'flash_bwd_hdim256_bf16'")
    parser.add_argument("--build", default="build", help="a configured build folder (ninja)")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                        help="parallel compiles (each flash file takes a few GB)")
    parser.add_argument("--match", default="", help="regex on the demangled kernel names to print")
    opts = parser.parse_args()

    commands = compile_commands(opts.build, opts.source_regex)
    if not commands:
        sys.exit(f"no nvcc command in {opts.build} compiles a file matching '{opts.source_regex}'")
    serialized = 0
    failed = 0
    with tempfile.TemporaryDirectory() as scratch, concurrent.futures.ThreadPoolExecutor(opts.jobs) as pool:
        for source, rc, log in pool.map(lambda item: report_of(*item, scratch, opts.build), sorted(commands.items())):
            print(f"== {os.path.basename(source)}")
            kernels, losses = parse(log)
            if rc != 0 or not kernels:
                # No report at all (a cache hit, a PTX-only build) is no evidence either.
                failed += 1
                print(log[-4000:] if rc != 0 else "  no ptxas report for this file")
                continue
            names = demangle([k["name"] for k in kernels] + list(losses))
            # Every report counts, whatever --match prints.
            serialized += sum(len(v) for v in losses.values())
            for k in kernels:
                name = names[k["name"]]
                if opts.match and not re.search(opts.match, name):
                    continue
                callee = f" (+{k['callee_spill']} B spilled in called functions)" if k["callee_spill"] else ""
                print(f"  regs {k['regs']:3d}  spill st/ld {k['spill_st']:4d}/{k['spill_ld']:<4d} stack {k['stack']:4d}  "
                      f"{name[:230]}{callee}")
                for loss in losses.get(k["name"], []):
                    print(f"      PERFORMANCE LOSS {loss}")
            for mangled in losses:
                if mangled not in {k["name"] for k in kernels}:
                    print(f"      PERFORMANCE LOSS in {names[mangled][:200]}: {losses[mangled]}")
    print(f"{len(commands)} file(s); {failed} without a report (compile failure or no ptxas output); "
          f"{serialized} ptxas performance-loss report(s) (C75xx: serialized WGMMAs)")
    sys.exit(1 if serialized or failed else 0)


if __name__ == "__main__":
    main()
