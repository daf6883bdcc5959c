#!/usr/bin/env python3
"""Forward attention throughput on one GPU: cuflash next to PyTorch SDPA's cuDNN and
FlashAttention-2 backends, in one process, on the same inputs (DESIGN.md section 6).

Shapes follow FlashAttention's benchmark: bf16, batch * seqlen = 16k tokens, heads * head_dim
= 2048. FLOPs = 4 * batch * heads * seqlen_q * seqlen_k * head_dim, half of that when causal.
Each timing is the median over groups of back-to-back calls timed with CUDA events after warm-up
(see time_ms).

Writes fwd_sm90.json (records {impl, dtype, hdim, seqlen, batch, nheads, causal, fwd_tflops,
gpu, date}) and fwd_sm90.png to --out, and prints a table with the ratio to cuDNN.
"""

import argparse
import datetime
import json
import os
import statistics

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F

TOKENS = 16384
HIDDEN = 2048


def time_ms(fn, warmup, repeats, groups=5):
    """Median over `groups` of the mean time of `repeats` back-to-back calls. Each group is queued
    behind a sleep kernel, so the host-side cost of a call (argument checks, dispatch) stays out
    of the measurement for every implementation alike."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    means = []
    for _ in range(groups):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(40_000_000)  # ~20 ms at 1.98 GHz: time for the host to queue the calls
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        means.append(start.elapsed_time(end) / repeats)
    return statistics.median(means)


def make_impls():
    impls = {}
    try:
        import cuflash

        def run_cuflash(q, k, v, causal):
            return cuflash.flash_attn_func(q, k, v, causal=causal)

        impls["cuflash"] = run_cuflash
    except Exception as error:  # the table says why a column is missing
        print(f"cuflash unavailable: {error}")

    def sdpa(backend):
        def run(q, k, v, causal):
            with sdpa_kernel(backend):
                # SDPA takes (batch, heads, seqlen, dim); these are views of the same tensors.
                return F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)

        return run

    impls["cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    impls["fa2"] = sdpa(SDPBackend.FLASH_ATTENTION)
    return impls


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=".")
    parser.add_argument("--hdims", default="64,128,256")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tag", default="", help="suffix for the output file names")
    args = parser.parse_args()

    gpu = torch.cuda.get_device_name()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    impls = make_impls()
    records = []
    torch.manual_seed(0)
    for hdim in [int(x) for x in args.hdims.split(",")]:
        for seqlen in [int(x) for x in args.seqlens.split(",")]:
            batch, nheads = TOKENS // seqlen, HIDDEN // hdim
            shape = (batch, seqlen, nheads, hdim)
            q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for causal in [bool(int(x)) for x in args.causal.split(",")]:
                flops = 4 * batch * nheads * seqlen * seqlen * hdim // (2 if causal else 1)
                for name, fn in impls.items():
                    try:
                        with torch.no_grad():
                            ms = time_ms(lambda: fn(q, k, v, causal), args.warmup, args.repeats)
                        tflops = flops / ms / 1e9
                    except Exception as error:
                        print(f"{name} hdim={hdim} seqlen={seqlen} causal={causal}: {type(error).__name__}: {error}")
                        tflops = float("nan")
                    records.append(dict(impl=name, dtype="bf16", hdim=hdim, seqlen=seqlen, batch=batch,
                                        nheads=nheads, causal=causal, fwd_tflops=tflops, gpu=gpu, date=date))

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"fwd_sm90{args.tag}.json"), "w") as f:
        json.dump(records, f, indent=1)

    def lookup(impl, hdim, seqlen, causal):
        for r in records:
            if (r["impl"], r["hdim"], r["seqlen"], r["causal"]) == (impl, hdim, seqlen, causal):
                return r["fwd_tflops"]
        return float("nan")

    names = list(impls)
    keys = sorted({(r["hdim"], r["causal"], r["seqlen"]) for r in records})
    print(f"\nforward TFLOP/s, bf16, {gpu}, {date}")
    print(f"{'hdim':>4} {'causal':>6} {'seqlen':>6} " + " ".join(f"{n:>8}" for n in names) + "  cuflash/cudnn")
    for hdim, causal, seqlen in keys:
        values = [lookup(n, hdim, seqlen, causal) for n in names]
        ratio = lookup("cuflash", hdim, seqlen, causal) / lookup("cudnn", hdim, seqlen, causal)
        print(f"{hdim:>4} {int(causal):>6} {seqlen:>6} " + " ".join(f"{x:8.1f}" for x in values) + f"  {ratio:8.3f}")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        hdims = sorted({k[0] for k in keys})
        fig, axes = plt.subplots(2, len(hdims), figsize=(5 * len(hdims), 8), squeeze=False)
        for col, hdim in enumerate(hdims):
            for row, causal in enumerate([False, True]):
                ax = axes[row][col]
                seqlens = sorted({k[2] for k in keys if k[0] == hdim and k[1] == causal})
                for n in names:
                    ax.plot(seqlens, [lookup(n, hdim, s, causal) for s in seqlens], marker="o", label=n)
                ax.set_xscale("log", base=2)
                ax.set_title(f"hdim {hdim}, {'causal' if causal else 'non-causal'}")
                ax.set_xlabel("seqlen")
                ax.set_ylabel("TFLOP/s")
                ax.grid(True, alpha=0.3)
                ax.legend()
        fig.suptitle(f"forward, bf16, {gpu}, {date}")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, f"fwd_sm90{args.tag}.png"), dpi=100)
    except Exception as error:
        print(f"plot skipped: {error}")


if __name__ == "__main__":
    main()
