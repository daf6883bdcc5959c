#!/usr/bin/env python3
"""The GEMM loops of each kernel in a SASS listing (`cuobjdump -sass OBJ`), on the CPU.

A loop is the span from a backward branch's target to the branch. Printed, per kernel, for each
loop holding at least --min-hgmma HGMMAs and --min-ex2 MUFU.EX2s (the forward's n-block loop, or
a backward step): its instruction count, HGMMAs, exponentials, R2UR moves (descriptors rebuilt
from vector registers), and where the WARPGROUP.DEPBAR waits stand against the first and last
exponential (a wait before the first one means the softmax does not run under that GEMM).

    cuobjdump -sass build/CMakeFiles/cuflash.dir/src/instantiations/flash_fwd_hdim128_bf16_sm90.cu.o > s.txt
    python3 tools/sass_loops.py s.txt --kernel 'ELb0ELb0EEEEEEEvNT_6ParamsE$'

The input is cuobjdump's listing (kernels under "Function :" headers, branch targets as
addresses); nvdisasm's label form is not read. Spans that hold an EXIT (retry stubs placed
after the kernel's end that branch back) are left out; nested loops are listed each on its own.
cuobjdump and nvdisasm come with a full CUDA toolkit, or from PyPI (the wheels
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm, whose bin/ folder goes on PATH).
"""
import argparse
import re
import sys

FUNCTION = re.compile(r"Function : (\S+)")
INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def functions(lines):
    """{kernel name: [(address, instruction text)]} in listing order."""
    out, current = {}, None
    for line in lines:
        m = FUNCTION.search(line)
        if m:
            current = m.group(1)
            out[current] = []
            continue
        m = INSTRUCTION.match(line)
        if m and current is not None:
            out[current].append((int(m.group(1), 16), m.group(2)))
    return out


def loops(instructions, min_hgmma=8, min_ex2=32):
    """The loops of one kernel as dicts (start, end, instructions, hgmma, ex2, r2ur, depbar,
    first_ex2, last_ex2), positions counted from the loop's first instruction."""
    index = {address: i for i, (address, _) in enumerate(instructions)}
    found = []
    for i, (address, text) in enumerate(instructions):
        m = BRANCH.search(text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= address or target not in index:
            continue
        body = [t for _, t in instructions[index[target]:i + 1]]
        # A span holding an EXIT is no loop: ptxas puts retry stubs (a barrier's phase check)
        # after the kernel's end, branching back into the code.
        if any(re.search(r"\bEXIT\b", t) for t in body):
            continue
        hgmma = sum("HGMMA" in t for t in body)
        ex2 = [j for j, t in enumerate(body) if "MUFU.EX2" in t]
        if hgmma < min_hgmma or len(ex2) < min_ex2:
            continue
        found.append({
            "start": target,
            "end": address,
            "instructions": len(body),
            "hgmma": hgmma,
            "ex2": len(ex2),
            "r2ur": sum(re.match(r"(@!?U?P\w+\s+)?R2UR\b", t) is not None for t in body),
            "depbar": [j for j, t in enumerate(body) if "WARPGROUP.DEPBAR" in t],
            "first_ex2": ex2[0],
            "last_ex2": ex2[-1],
        })
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("listing", help="cuobjdump -sass output")
    parser.add_argument("--kernel", default="", help="regex on the mangled kernel name")
    parser.add_argument("--min-hgmma", type=int, default=8)
    parser.add_argument("--min-ex2", type=int, default=32)
    args = parser.parse_args(argv)
    with open(args.listing) as f:
        kernels = functions(f)
    pattern = re.compile(args.kernel)
    shown = 0
    for name, instructions in kernels.items():
        if not pattern.search(name):
            continue
        shown += 1
        print(f"{name}: {len(instructions)} instructions")
        for loop in loops(instructions, args.min_hgmma, args.min_ex2):
            print(f"  loop {loop['start']:#x}-{loop['end']:#x}: {loop['instructions']} instructions, "
                  f"HGMMA {loop['hgmma']}, MUFU.EX2 {loop['ex2']}, R2UR {loop['r2ur']}, "
                  f"DEPBAR at {loop['depbar']}, exponentials {loop['first_ex2']}-{loop['last_ex2']}")
    if shown == 0:
        print("sass_loops: no kernel matches", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
