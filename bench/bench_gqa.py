"""GQA forward with short query lengths (decode and short prompts): cuflash with pack_gqa on and
off, and PyTorch SDPA (cuDNN backend, on K/V expanded to every query head) on the same inputs.

Shapes: head dim 128, 32 query heads on 8 kv heads (group 4) or 64 on 8 (group 8), seqlen_k 8k,
batch 8, seqlen_q 1 .. 128. Reported: microseconds per call and the K/V bandwidth it reaches
(K and V bytes read once over the call's time), the figure of merit when seqlen_q is small.
Writes gqa_sm90.json (records {impl, dtype, hdim, seqlen_q, seqlen_k, batch, nheads, nheads_kv,
causal, us, kv_gbps, gpu, date}).

--score-mod alibi runs cuflash with the built-in ALiBi score_mod (the flex kernels, packed and
unpacked; each packed row's slope is its own head's) and writes gqa_sm90_alibi.json; the cuDNN
column stays the plain causal call, a bound on what the mod-free decode costs.
"""

from __future__ import annotations

import argparse
import json
import os

import bench_common as common


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=".")
    parser.add_argument("--seqlens-q", default="1,4,16,64,128")
    parser.add_argument("--seqlen-k", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--groups", default="32:8,64:8", help="heads:heads_kv pairs")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--score-mod", choices=("none", "alibi"), default="none")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    import cuflash

    gpu = torch.cuda.get_device_name()
    date = common.utc_now()
    hdim, dtype = 128, torch.bfloat16
    records = []
    print(f"GQA forward, bf16, hdim {hdim}, seqlen_k {args.seqlen_k}, batch {args.batch}, causal, "
          f"score_mod {args.score_mod}; {gpu}, {date}")
    print(f"{'heads':>7} {'sq':>4} {'packed us':>10} {'unpacked us':>12} {'cudnn us':>9} "
          f"{'packed GB/s':>12}")
    for pair in args.groups.split(","):
        heads, heads_kv = (int(x) for x in pair.split(":"))
        for seqlen_q in common.ints(args.seqlens_q):
            gen = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(args.batch, seqlen_q, heads, hdim, device="cuda", dtype=dtype, generator=gen)
            k = torch.randn(args.batch, args.seqlen_k, heads_kv, hdim, device="cuda", dtype=dtype,
                            generator=gen)
            v = torch.randn_like(k)
            kv_bytes = 2 * k.numel() * k.element_size()
            times = {}
            score_mod = None
            if args.score_mod == "alibi":
                score_mod = cuflash.scores.alibi(
                    torch.tensor(cuflash.scores.alibi_slopes(heads), device="cuda"))
            for name, pack in (("cuflash_packed", True), ("cuflash_unpacked", False)):
                times[name] = 1e3 * common.time_ms(
                    lambda: cuflash.flash_attn_varlen_func(q, k, v, causal=True, pack_gqa=pack,
                                                           score_mod=score_mod),
                    args.warmup, args.repeats)
            group = heads // heads_kv
            ke = k.repeat_interleave(group, dim=2).transpose(1, 2)
            ve = v.repeat_interleave(group, dim=2).transpose(1, 2)
            qt = q.transpose(1, 2)

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    # bottom-right causal, as cuflash's: q's rows are the last of the keys
                    return F.scaled_dot_product_attention(
                        qt, ke, ve, attn_mask=causal_lower_right(seqlen_q, args.seqlen_k))

            try:
                times["cudnn"] = 1e3 * common.time_ms(cudnn, args.warmup, args.repeats)
            except Exception as error:  # noqa: BLE001 - the table says why
                print(f"cudnn: {error}")
                times["cudnn"] = float("nan")
            print(f"{heads:>3}:{heads_kv:<3} {seqlen_q:>4} {times['cuflash_packed']:>10.1f} "
                  f"{times['cuflash_unpacked']:>12.1f} {times['cudnn']:>9.1f} "
                  f"{kv_bytes / times['cuflash_packed'] / 1e3:>12.0f}")
            for impl, us in times.items():
                records.append(dict(impl=impl, dtype="bf16", hdim=hdim, seqlen_q=seqlen_q,
                                    seqlen_k=args.seqlen_k, batch=args.batch, nheads=heads,
                                    nheads_kv=heads_kv, causal=True, us=us,
                                    kv_gbps=kv_bytes / us / 1e3, gpu=gpu, date=date))
    suffix = "" if args.score_mod == "none" else f"_{args.score_mod}"
    with open(os.path.join(args.out, f"gqa_sm90{suffix}.json"), "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
