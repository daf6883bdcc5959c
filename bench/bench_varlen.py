"""Varlen forward (packed sequences, cu_seqlens in device memory): cuflash with and without the
max_seqlen hints, next to PyTorch's FlashAttention-2 varlen forward on the same inputs.

Without max_seqlen_q the longest sequence is not known on the host (reading cu_seqlens would wait
for the device); the seed's interface then takes total_q as the bound. cuflash's forward walks a
list of the row blocks that hold rows, built on the GPU (src/sm90/varlen_row_blocks_sm90.hpp),
rather than batch x ceil(total_q / block_m) row blocks per head. Columns:
  cuflash_hints    flash_attn_varlen_func(..., max_seqlen_q, max_seqlen_k)
  cuflash_nohints  flash_attn_varlen_func(...) without the hints
  fa2              aten._flash_attention_forward with cum_seq_q / cum_seq_k (needs the maxima)
Layouts (--layouts): "uniform:N:L" N sequences of L tokens; "mixed:N:L" N sequences of lengths
drawn uniformly in [L / 16, L] (fixed seed). FLOPs count each sequence's own square (half of it
causal). Each column's output is checked against FA2's (max |out - fa2| / max |fa2|) before it is
timed. Writes varlen_sm90{tag}.json (records {impl, dtype, hdim, layout, batch, total_q, nheads,
causal, us, fwd_tflops, max_err, skipped, gpu, date}) to --out.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402


def lengths_of(layout, rng):
    kind, count, length = layout.split(":")
    count, length = int(count), int(length)
    if kind == "uniform":
        return [length] * count
    if kind == "mixed":
        return [int(x) for x in rng.integers(max(1, length // 16), length + 1, size=count)]
    raise ValueError(f"--layouts: expected uniform:N:L or mixed:N:L, got {layout!r}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".")
    parser.add_argument("--tag", default="")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--hdims", default="128")
    parser.add_argument("--nheads", type=int, default=16)
    parser.add_argument("--layouts", default="uniform:64:1024,mixed:64:2048,uniform:16:4096")
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--max-err", type=float, default=0.02)
    args = parser.parse_args()

    import numpy as np
    import torch

    import cuflash

    gpu = torch.cuda.get_device_name()
    date = common.utc_now()
    dtype = common.torch_dtype(args.dtype)
    json_path = common.out_path(args, "varlen_sm90", "json")
    names = ("cuflash_hints", "cuflash_nohints", "fa2")
    records = []
    print(f"varlen forward, {args.dtype}, {args.nheads} heads; {gpu}, {date}")
    print(f"{'hdim':>4} {'layout':>18} {'causal':>6} " + " ".join(f"{n + ' TF/s':>20}" for n in names) +
          f" {'nohints/fa2':>12}")
    for hdim in common.ints(args.hdims):
        for layout in args.layouts.split(","):
            lengths = lengths_of(layout, np.random.default_rng(0))
            cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
            total, longest = int(sum(lengths)), int(max(lengths))
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(total, args.nheads, hdim, device="cuda", dtype=dtype, generator=gen)
                       for _ in range(3))
            for causal in common.bools(args.causal):
                flops = sum(common.fwd_flops(1, args.nheads, n, n, hdim, causal) for n in lengths)
                columns = {
                    "cuflash_hints": lambda: cuflash.flash_attn_varlen_func(
                        q, k, v, cu, cu, longest, longest, causal=causal)[0],
                    "cuflash_nohints": lambda: cuflash.flash_attn_varlen_func(q, k, v, cu, cu, causal=causal)[0],
                    "fa2": lambda: torch.ops.aten._flash_attention_forward(
                        q, k, v, cu, cu, longest, longest, 0.0, causal, False)[0],
                }
                expected = columns["fa2"]()
                tflops = {}
                for name, fn in columns.items():
                    us, err, skipped = common.checked_time_us(fn, expected, args.max_err, args.warmup, args.repeats,
                                                              against="FA2's")
                    if skipped:
                        print(f"{name} {layout} causal {causal}: skipped: {skipped}")
                    tflops[name] = flops / us / 1e6
                    records.append(dict(impl=name, dtype=args.dtype, hdim=hdim, layout=layout, batch=len(lengths),
                                        total_q=total, nheads=args.nheads, causal=causal, us=us,
                                        fwd_tflops=tflops[name], max_err=err, skipped=skipped, gpu=gpu, date=date))
                print(f"{hdim:>4} {layout:>18} {int(causal):>6} " + " ".join(f"{tflops[n]:>20.1f}" for n in names) +
                      f" {tflops['cuflash_nohints'] / tflops['fa2']:>12.3f}", flush=True)
                common.write_json(records, json_path)


if __name__ == "__main__":
    main()
