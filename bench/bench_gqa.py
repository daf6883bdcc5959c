"""GQA forward with short query lengths (decode and short prompts): cuflash with pack_gqa on and
off, next to PyTorch SDPA's cuDNN and FlashAttention-2 backends on the same inputs, K / V not
expanded (each reads the kv heads once, as cuflash does).

Shapes: head dim 128, 32 query heads on 8 kv heads (group 4) or 64 on 8 (group 8), seqlen_k 8k,
batch 8, seqlen_q 1 .. 128, causal with q's rows the last of the keys (bottom-right, cuflash's
rule for seqlen_q < seqlen_k). Columns:
  cuflash_packed / cuflash_unpacked  flash_attn_varlen_func(causal=True, pack_gqa=True / False)
  cuflash_split   pack_gqa=True with num_splits=0 (the split-KV heuristic: with few kv heads and
                  short q, too few CTAs fill the SMs otherwise)
  cudnn    SDPA, cuDNN backend, enable_gqa; seqlen_q 1 needs no mask, longer q a boolean
           bottom-right mask built once outside the timing (PyTorch's cuDNN path has no
           bottom-right causal flag: torch's causal_lower_right falls back to such a mask there)
  fa2      aten._scaled_dot_product_flash_attention(is_causal=True), whose causal is
           bottom-right, on the kv heads as they are (FlashAttention-2 reads grouped heads)
Reported: microseconds per call and the K/V bandwidth it reaches (K and V bytes read once over the
call's time), the figure of merit when seqlen_q is small. Before timing, each column's output is
checked against a float32 computation of the same attention (max |out - ref| / max |ref|): a
column further than --max-err off, or one that fails, is recorded as skipped (us null), not timed.
Writes gqa_sm90{tag}.json (records {impl, dtype, hdim, seqlen_q, seqlen_k, batch, nheads,
nheads_kv, causal, us, kv_gbps, max_err, skipped, gpu, date}) to --out.

--packed runs the cuflash columns on the same batch laid out as packed sequences (cu_seqlens_q /
cu_seqlens_k) without max_seqlen hints, as a server that keeps its lengths on the GPU calls it: the
host then knows only the totals, and the split-KV heuristic (cuflash_split) and pack_gqa=None read
the typical sequence, the totals over the batch. It adds the column cuflash_split_hints (the same
call with max_seqlen_q / max_seqlen_k) and writes gqa_sm90_packed{tag}.json, whose cuflash records
carry packed: true. The peers stay the dense batch (packed: false).

--splits 4,8,16 adds a column cuflash_split<N> per count: the split call with num_splits=N (hinted
when --packed), next to the heuristic's choice. --kernel-times prints, per point, each kernel of
the split call (hinted when --packed) and of cuDNN's with the gaps between them (torch.profiler):
how much of a decode is the forward kernel, the combine and the launches between them.

--score-mod alibi runs cuflash with the built-in ALiBi score_mod (the flex kernels, packed and
unpacked; each packed row's slope is its own head's) and writes gqa_sm90_alibi{tag}.json; the
peers stay the plain causal call, a bound on what the mod-free decode costs, and only the cuflash
columns are checked (against the reference with the ALiBi bias).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402


def reference(q, k, v, bias=None):
    """float32 softmax(q k^T / sqrt(d) + bias) v with bottom-right causal, over the kv heads
    expanded to the query heads; one batch entry at a time to bound the score matrix."""
    import torch

    group = q.shape[2] // k.shape[2]
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    rows = torch.arange(seqlen_q, device=q.device)[:, None] + (seqlen_k - seqlen_q)
    visible = torch.arange(seqlen_k, device=q.device)[None, :] <= rows
    outs = []
    for b in range(q.shape[0]):
        qb = q[b].float().transpose(0, 1)  # (H, Sq, D)
        kb = k[b].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vb = v[b].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qb @ kb.transpose(1, 2) / math.sqrt(q.shape[-1])
        if bias is not None:
            scores = scores + bias
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append((torch.softmax(scores, dim=-1) @ vb).transpose(0, 1))
    return torch.stack(outs)


def packed_call(cuflash, q, k, v, packed, hints, **kwargs):
    """A cuflash call on the dense batch q (batch, seqlen_q, ...), k / v (batch, seqlen_k, ...), or
    (packed) on the same tokens as packed sequences, cu_seqlens_q / cu_seqlens_k on the GPU and the
    max_seqlen hints only with `hints`; its output in q's (batch, seqlen_q, ...) shape either way."""
    import torch

    if not packed:
        return lambda: cuflash.flash_attn_varlen_func(q, k, v, **kwargs)[0]
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    cu_q, cu_k = (torch.arange(0, (batch + 1) * n, n, device=q.device, dtype=torch.int32)
                  for n in (seqlen_q, seqlen_k))
    qp, kp, vp = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
    lengths = dict(max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k) if hints else {}
    return lambda: cuflash.flash_attn_varlen_func(qp, kp, vp, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **lengths,
                                                  **kwargs)[0].view(q.shape[:3] + v.shape[3:])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".")
    parser.add_argument("--tag", default="", help="suffix for the output file names")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"), help="element type of q, k, v")
    parser.add_argument("--seqlens-q", default="1,4,16,64,128")
    parser.add_argument("--seqlen-k", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--groups", default="32:8,64:8", help="heads:heads_kv pairs")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--max-err", type=float, default=0.05,
                        help="outputs further than this from the float32 reference (relative to its max) are "
                             "recorded as skipped, not timed")
    parser.add_argument("--score-mod", choices=("none", "alibi"), default="none")
    parser.add_argument("--packed", action="store_true",
                        help="cuflash on packed sequences without max_seqlen hints (see above)")
    parser.add_argument("--splits", default="", help="num_splits values, each its own column (see above)")
    parser.add_argument("--kernel-times", action="store_true",
                        help="each kernel of the split call and of cuDNN's, per point (see above)")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash

    gpu = torch.cuda.get_device_name()
    date = common.utc_now()
    hdim, dtype = 128, common.torch_dtype(args.dtype)
    suffix = ("" if args.score_mod == "none" else f"_{args.score_mod}") + ("_packed" if args.packed else "")
    json_path = common.out_path(args, f"gqa_sm90{suffix}", "json")
    records = []
    forced_splits = common.ints(args.splits) if args.splits else []
    names = ("cuflash_packed", "cuflash_unpacked", "cuflash_split") + (("cuflash_split_hints",) if args.packed else ())
    names += tuple(f"cuflash_split{n}" for n in forced_splits)
    names += ("cudnn", "fa2")
    layout = "packed sequences without hints" if args.packed else "dense batch"
    print(f"GQA forward, {args.dtype}, hdim {hdim}, seqlen_k {args.seqlen_k}, batch {args.batch}, causal "
          f"(bottom-right), score_mod {args.score_mod}, cuflash on the {layout}; {gpu}, {date}")
    print(f"{'heads':>7} {'sq':>4} " + " ".join(f"{n + ' us':>17}" for n in names) + f" {'packed GB/s':>12}")
    for pair in args.groups.split(","):
        heads, heads_kv = (int(x) for x in pair.split(":"))
        for seqlen_q in common.ints(args.seqlens_q):
            gen = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(args.batch, seqlen_q, heads, hdim, device="cuda", dtype=dtype, generator=gen)
            k, v = (torch.randn(args.batch, args.seqlen_k, heads_kv, hdim, device="cuda", dtype=dtype,
                                generator=gen) for _ in range(2))
            kv_bytes = 2 * k.numel() * k.element_size()
            score_mod, bias = None, None
            expected = reference(q, k, v)
            if args.score_mod == "alibi":
                slopes = torch.tensor(cuflash.scores.alibi_slopes(heads), device="cuda", dtype=torch.float32)
                score_mod = cuflash.scores.alibi(slopes)
                # cuflash.scores.alibi: score + slopes[h] * (kv_idx - q_idx), q_idx the row in q.
                rows = torch.arange(seqlen_q, device="cuda")[:, None]
                cols = torch.arange(args.seqlen_k, device="cuda")[None, :]
                bias = slopes[:, None, None] * (cols - rows)
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            mask = None
            if seqlen_q > 1:  # bottom-right causal as a boolean mask, built once
                rows = torch.arange(seqlen_q, device="cuda")[:, None] + (args.seqlen_k - seqlen_q)
                mask = torch.arange(args.seqlen_k, device="cuda")[None, :] <= rows

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True).transpose(1, 2)

            def fa2():
                return torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, is_causal=True)[0].transpose(1, 2)

            cuflash_columns = [("cuflash_packed", True, 1, False), ("cuflash_unpacked", False, 1, False),
                               ("cuflash_split", True, 0, False)]
            if args.packed:
                cuflash_columns.append(("cuflash_split_hints", True, 0, True))
            cuflash_columns += [(f"cuflash_split{n}", True, n, args.packed) for n in forced_splits]
            columns = {name: packed_call(cuflash, q, k, v, args.packed, hints, causal=True, pack_gqa=pack,
                                         num_splits=splits, score_mod=score_mod)
                       for name, pack, splits, hints in cuflash_columns}
            columns.update(cudnn=cudnn, fa2=fa2)
            checked = {name: reference(q, k, v, bias) if bias is not None and name.startswith("cuflash")
                       else expected for name in columns}
            times = {}
            for name, fn in columns.items():
                us, err, skipped = common.checked_time_us(fn, checked[name], args.max_err, args.warmup, args.repeats)
                if skipped:
                    print(f"{name} heads {pair} sq {seqlen_q}: skipped: {skipped}")
                times[name] = us
                records.append(dict(impl=name, dtype=args.dtype, hdim=hdim, seqlen_q=seqlen_q,
                                    seqlen_k=args.seqlen_k, batch=args.batch, nheads=heads, nheads_kv=heads_kv,
                                    causal=True, us=us, kv_gbps=kv_bytes / us / 1e3, max_err=err,
                                    skipped=skipped, gpu=gpu, date=date,
                                    packed=args.packed and name.startswith("cuflash")))
            print(f"{heads:>3}:{heads_kv:<3} {seqlen_q:>4} " + " ".join(f"{times[n]:>17.1f}" for n in names) +
                  f" {kv_bytes / times['cuflash_packed'] / 1e3:>12.0f}", flush=True)
            if args.kernel_times:
                for name in ("cuflash_split_hints" if args.packed else "cuflash_split", "cudnn"):
                    if math.isnan(times[name]):
                        continue  # skipped above: its call failed or its output was off
                    print(f"  kernels of {name}, {heads}:{heads_kv} sq {seqlen_q}, two calls:")
                    print("\n".join(common.kernel_event_lines(common.kernel_events(columns[name], 2), 70)),
                          flush=True)
            common.write_json(records, json_path)


if __name__ == "__main__":
    main()
