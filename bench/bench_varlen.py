"""Varlen forward and backward (packed sequences, cu_seqlens in device memory): cuflash with and
without the max_seqlen hints, next to PyTorch's FlashAttention-2 varlen kernels on the same inputs.

Without max_seqlen_q / max_seqlen_k the longest sequence is not known on the host (reading
cu_seqlens would wait for the device); the seed's interface then takes the total as the bound.
cuflash's kernels walk lists of the blocks that hold rows, built on the GPU
(src/sm90/varlen_block_list_sm90.hpp), rather than batch x ceil(total / block) blocks per head.
Columns:
  cuflash_hints    flash_attn_varlen_func / flash_attn_backward with max_seqlen_q, max_seqlen_k
  cuflash_nohints  the same without the hints
  fa2              aten._flash_attention_forward / _backward with cum_seq_q / cum_seq_k (needs the
                   maxima)
--directions fwd,bwd: the forward, and the backward alone (after one forward of each column's own).
Layouts (--layouts): "uniform:N:L" N sequences of L tokens; "mixed:N:L" N sequences of lengths
drawn uniformly in [L / 16, L] (fixed seed); "skewed:N:L" one sequence of L tokens and N - 1 of
L / 1024 (at least 1), where the mean length the no-hint choices read understates the longest. FLOPs count each sequence's own square (half of it
causal; the backward 2.5 times the forward). Each column's output (the backward: dq, dk, dv) is
checked against FA2's (max |x - fa2| / max |fa2|) before it is timed. Writes varlen_sm90{tag}.json
(records {impl, direction, dtype, hdim, layout, batch, total_q, nheads, causal, us, fwd_tflops or
bwd_tflops, max_err, skipped, gpu, date}) to --out.
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
    if kind == "skewed":
        return [length] + [max(1, length // 1024)] * (count - 1)
    raise ValueError(f"--layouts: expected uniform:N:L, mixed:N:L or skewed:N:L, got {layout!r}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".")
    parser.add_argument("--tag", default="")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--hdims", default="128")
    parser.add_argument("--nheads", type=int, default=16)
    parser.add_argument("--layouts", default="uniform:64:1024,mixed:64:2048,uniform:16:4096")
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--directions", default="fwd", help="fwd, bwd or both (fwd,bwd)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--max-err", type=float, default=0.02)
    args = parser.parse_args()

    import numpy as np
    import torch

    gpu = torch.cuda.get_device_name()
    date = common.utc_now()
    dtype = common.torch_dtype(args.dtype)
    json_path = common.out_path(args, "varlen_sm90", "json")
    names = ("cuflash_hints", "cuflash_nohints", "fa2")
    directions = args.directions.split(",")
    if any(d not in ("fwd", "bwd") for d in directions):
        raise SystemExit(f"--directions: expected fwd and / or bwd, got {args.directions!r}")
    records = []
    print(f"varlen {' and '.join(directions)}, {args.dtype}, {args.nheads} heads; {gpu}, {date}")
    print(f"{'dir':>3} {'hdim':>4} {'layout':>18} {'causal':>6} " + " ".join(f"{n + ' TF/s':>20}" for n in names) +
          f" {'nohints/fa2':>12}")
    for hdim in common.ints(args.hdims):
        for layout in args.layouts.split(","):
            lengths = lengths_of(layout, np.random.default_rng(0))
            cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
            total, longest = int(sum(lengths)), int(max(lengths))
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, dout = (torch.randn(total, args.nheads, hdim, device="cuda", dtype=dtype, generator=gen)
                             for _ in range(4))
            for causal, direction in ((c, d) for c in common.bools(args.causal) for d in directions):
                flops = sum(common.fwd_flops(1, args.nheads, n, n, hdim, causal) for n in lengths)
                if direction == "bwd":
                    flops = sum(common.bwd_flops(1, args.nheads, n, n, hdim, causal) for n in lengths)
                columns = forward_columns(q, k, v, cu, longest, causal) if direction == "fwd" else \
                    backward_columns(q, k, v, dout, cu, longest, causal)
                expected = columns["fa2"]()
                tflops = {}
                for name, fn in columns.items():
                    us, err, skipped = common.checked_time_us(fn, expected, args.max_err, args.warmup, args.repeats,
                                                              against="FA2's")
                    if skipped:
                        print(f"{name} {direction} {layout} causal {causal}: skipped: {skipped}")
                    tflops[name] = flops / us / 1e6
                    records.append(dict(impl=name, direction=direction, dtype=args.dtype, hdim=hdim, layout=layout,
                                        batch=len(lengths), total_q=total, nheads=args.nheads, causal=causal, us=us,
                                        **{f"{direction}_tflops": tflops[name]}, max_err=err, skipped=skipped,
                                        gpu=gpu, date=date))
                print(f"{direction:>3} {hdim:>4} {layout:>18} {int(causal):>6} " +
                      " ".join(f"{tflops[n]:>20.1f}" for n in names) +
                      f" {tflops['cuflash_nohints'] / tflops['fa2']:>12.3f}", flush=True)
                common.write_json(records, json_path)


def forward_columns(q, k, v, cu, longest, causal):
    import torch

    import cuflash

    return {
        "cuflash_hints": lambda: cuflash.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)[0],
        "cuflash_nohints": lambda: cuflash.flash_attn_varlen_func(q, k, v, cu, cu, causal=causal)[0],
        "fa2": lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, causal,
                                                               False)[0],
    }


def backward_columns(q, k, v, dout, cu, longest, causal):
    """The backward alone: each column's own forward once, then its backward timed."""
    import torch

    import cuflash

    with torch.no_grad():
        out, lse = cuflash.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)
        fa2_out, fa2_lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, causal, False)

    def cuflash_backward(**hints):
        return cuflash.flash_attn_backward(dout, q, k, v, out, lse, cu, cu, causal=causal, **hints)[:3]

    return {
        "cuflash_hints": lambda: cuflash_backward(max_seqlen_q=longest, max_seqlen_k=longest),
        "cuflash_nohints": lambda: cuflash_backward(),
        "fa2": lambda: torch.ops.aten._flash_attention_backward(
            dout, q, k, v, fa2_out, fa2_lse, cu, cu, longest, longest, 0.0, causal, seed, offset)[:3],
    }


if __name__ == "__main__":
    main()
