#!/usr/bin/env python3
"""The SASS instructions where a kernel's warps stall most, from Nsight Compute's source page.

    ncu --import report.ncu-rep --page source --csv --print-source sass > source.csv
    python3 bench/ncu_stall_top.py source.csv --top 40 [--dump sass.txt]

Prints one line per instruction, most sampled first: its share of all stall samples, the
address, the SASS, and the stall reasons that hold at least 5% of its samples. --dump writes
every instruction in address order the same way (to add samples up over a loop or a role's
code, matched against a local `nvdisasm -g` of the same build). Column names vary between
Nsight Compute versions, so they are found by substring.
"""

import argparse
import csv
import sys


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--dump", help="write every instruction, in address order, to this file")
    args = parser.parse_args()
    with open(args.csv, newline="") as f:
        lines = [line for line in f if line.strip()]
    # Anything before the header row (ncu's own messages) is skipped.
    start = next((i for i, line in enumerate(lines) if "Source" in line and "Address" in line), None)
    if start is None:
        print("no source table in", args.csv)
        return 1
    rows = list(csv.DictReader(lines[start:]))
    columns = list(rows[0].keys()) if rows else []
    total_col = next((c for c in columns if "Warp Stall Sampling (All" in c), None)
    if total_col is None:
        print("no 'Warp Stall Sampling (All Samples)' column; columns:", ", ".join(columns))
        return 1
    reason_cols = [c for c in columns if c != total_col and "stall" in c.lower() and "Not-issued" not in c]
    total = sum(number(r[total_col]) for r in rows) or 1.0

    def line(r):
        samples = number(r[total_col])
        reasons = sorted(((number(r[c]), c) for c in reason_cols), reverse=True)
        shown = ", ".join(f"{c.split('(')[0].strip()} {v / samples:.0%}" for v, c in reasons
                          if samples and v >= 0.05 * samples)
        return f"{samples / total:6.2%}  {r.get('Address', ''):>8}  {r.get('Source', '')[:70]:<70}  {shown}"

    if args.dump:
        with open(args.dump, "w") as f:
            f.write(f"{len(rows)} instructions, {total:.0f} stall samples, in address order\n")
            for r in rows:
                f.write(line(r) + "\n")
    rows.sort(key=lambda r: number(r[total_col]), reverse=True)
    print(f"{len(rows)} instructions, {total:.0f} stall samples; top {args.top}:")
    for r in rows[: args.top]:
        print(line(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
