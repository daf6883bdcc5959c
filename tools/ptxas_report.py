#!/usr/bin/env python3
"""ptxas's resource report for kernel instantiations, on the CPU, before any GPU run.

Re-runs the build's own nvcc command of each instantiation source that matches SOURCE_REGEX
(from `ninja -t commands` of a configured build folder) with -Xptxas=-v, into a scratch object,
and prints per kernel its registers, spills and stack, and every ptxas "Potential Performance
Loss" (C75xx: WGMMAs serialized, for whatever reason ptxas gives). Exits 1 when any kernel has
serialized WGMMAs, so that a change can be gated on it:

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


def report_of(source, args, scratch):
    args = list(args)
    for flag in ("-MD",):
        while flag in args:
            args.remove(flag)
    for flag in ("-MT", "-MF"):
        while flag in args:
            i = args.index(flag)
            del args[i : i + 2]
    obj = os.path.join(scratch, os.path.basename(source) + ".o")
    args[args.index("-o") + 1] = obj
    args.insert(1, "-Xptxas=-v")
    result = subprocess.run(args, capture_output=True, text=True)
    return source, result.returncode, result.stdout + result.stderr


def demangle(names):
    if not names:
        return {}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    short = {}
    for mangled, name in zip(names, out):
        name = name.split("(", 1)[0]
        for ns in NAMESPACES:
            name = name.replace(ns, "")
        # A kernel's collective types repeat its mainloop's arguments: keep the first mention.
        name = re.sub(r", Epilogue\w*<.*", "> >", name)
        short[mangled] = name
    return short


def parse(log):
    """[(mangled, {'regs', 'spill_st', 'spill_ld', 'stack'})] in order, and {mangled: [C75xx messages]}."""
    kernels, current, losses = [], None, {}
    for line in log.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            current = {"name": m.group(1), "regs": None, "spill_st": 0, "spill_ld": 0, "stack": 0}
            kernels.append(current)
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
    return [k for k in kernels if k["regs"] is not None], losses


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source_regex", help="regex on the instantiation file names, e.g. 'flash_bwd_hdim256_bf16'")
    parser.add_argument("--build", default="build", help="a configured build folder (ninja)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--match", default="", help="regex on the demangled kernel names to print")
    opts = parser.parse_args()

    commands = compile_commands(opts.build, opts.source_regex)
    if not commands:
        sys.exit(f"no nvcc command in {opts.build} compiles a file matching '{opts.source_regex}'")
    serialized = 0
    failed = 0
    with tempfile.TemporaryDirectory() as scratch, concurrent.futures.ThreadPoolExecutor(opts.jobs) as pool:
        for source, rc, log in pool.map(lambda item: report_of(*item, scratch), sorted(commands.items())):
            print(f"== {os.path.basename(source)}")
            if rc != 0:
                failed += 1
                print(log[-4000:])
                continue
            kernels, losses = parse(log)
            names = demangle([k["name"] for k in kernels] + list(losses))
            for k in kernels:
                name = names[k["name"]]
                if opts.match and not re.search(opts.match, name):
                    continue
                print(f"  regs {k['regs']:3d}  spill st/ld {k['spill_st']:4d}/{k['spill_ld']:<4d} stack {k['stack']:4d}  {name[:230]}")
                for loss in losses.get(k["name"], []):
                    serialized += 1
                    print(f"      SERIALIZED {loss}")
            for mangled in losses:
                if mangled not in {k["name"] for k in kernels}:
                    serialized += len(losses[mangled])
                    print(f"      SERIALIZED in {names[mangled][:200]}: {losses[mangled]}")
    print(f"{len(commands)} file(s); {failed} failed to compile; {serialized} report(s) of serialized WGMMAs")
    sys.exit(1 if serialized or failed else 0)


if __name__ == "__main__":
    main()
