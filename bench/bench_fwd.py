#!/usr/bin/env python3
"""Forward attention throughput on one GPU: cuflash next to PyTorch SDPA's cuDNN and
FlashAttention-2 backends, in one process, on the same inputs (DESIGN.md section 6).

Shapes follow FlashAttention's benchmark: bf16 (--dtype fp16 for fp16), batch * seqlen = 16k tokens, heads * head_dim
= 2048. FLOPs = 4 * batch * heads * seqlen_q * seqlen_k * head_dim, half of that when causal
(with --hdim-v, V's head dim counts for the P V half).
Each timing is the median over groups of back-to-back calls timed with CUDA events after warm-up
(see bench_common.time_ms).

Before timing, each column's output is checked: finite, and within --max-err of cuDNN's (max
|out - ref| / max |ref|; FlashAttention-2's where cuDNN refuses the shape). A column further off
is recorded as skipped, not timed.

Writes fwd_sm90.json (records {impl, dtype, hdim, seqlen, batch, nheads, causal, fwd_tflops,
gpu, date} plus skipped (reason or null) and out_err, and hdim_v under --hdim-v; rewritten after
every shape, so a run cut short keeps what it measured) and fwd_sm90.png to --out, and prints a
table with the ratios to cuDNN and to the best peer (cuDNN or FA2). --impls times only the columns named (cuflash, cudnn, fa2; all
three by default), in that order.
"""

import argparse
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402


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
                # SDPA takes and gives (batch, heads, seqlen, dim): views of the same tensors.
                return F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)

        return run

    impls["cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    impls["fa2"] = sdpa(SDPBackend.FLASH_ATTENTION)
    return impls


def reference_output(q, k, v, causal):
    """cuDNN's output (FlashAttention-2's where cuDNN refuses the shape), untimed; None if both fail."""
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        try:
            with torch.no_grad(), sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     is_causal=causal)
            return out.transpose(1, 2).clone()
        except Exception:
            continue
    return None


def measure(fn, q, k, v, causal, flops, args, reference):
    """(tflops, skipped reason, out_err) of one column at one shape: its output checked against
    the reference before it is timed."""
    try:
        with torch.no_grad():
            out = fn(q, k, v, causal)  # (batch, seqlen, heads, dim), cuflash's with its lse
            out = out[0] if isinstance(out, tuple) else out
            if not torch.isfinite(out).all().item():
                return float("nan"), "non-finite output", None
            err = None if reference is None else common.relative_error([out], [reference])
            del out
            if err is not None and not err <= args.max_err:  # NaN included
                return float("nan"), f"output off: max error {err:.3g} relative to the reference > --max-err", err
            ms = common.time_ms(lambda: fn(q, k, v, causal), args.warmup, args.repeats)
        return flops / ms / 1e9, None, err
    except Exception as error:
        reason = f"{type(error).__name__}: {error}".strip().splitlines()[0][:300]
        if not common.cuda_context_ok():
            raise common.ContextLost(reason)
        return float("nan"), reason, None


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    common.add_grid_args(parser)
    parser.add_argument("--impls", default="cuflash,cudnn,fa2", help="the columns to time, comma-separated")
    parser.add_argument("--max-err", type=float, default=0.05,
                        help="outputs further than this from cuDNN's (relative to its max) are recorded as "
                             "skipped, not timed")
    parser.add_argument("--hdim-v", type=int, default=0,
                        help="V's head dim (such as 128 under --hdims 192); 0: each --hdims value")
    args = parser.parse_args()

    gpu = torch.cuda.get_device_name()
    date = common.utc_now()
    impls = make_impls()
    wanted = [name.strip() for name in args.impls.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in ("cuflash", "cudnn", "fa2")]
    if unknown:
        raise SystemExit(f"--impls: unknown column(s) {', '.join(unknown)}; expected some of cuflash, cudnn, fa2")
    impls = {name: impls[name] for name in wanted if name in impls}
    if not impls:
        raise SystemExit(f"--impls {args.impls}: none of these columns can run here (see above)")
    records = []
    json_path = common.out_path(args, "fwd_sm90", "json")
    lost = None
    torch.manual_seed(0)
    for hdim, seqlen, batch, nheads in common.grid(args):
        hdim_v = args.hdim_v or hdim
        dtype = common.torch_dtype(args.dtype)
        if lost is None:
            q, k = (torch.randn((batch, seqlen, nheads, hdim), device="cuda", dtype=dtype) for _ in range(2))
            v = torch.randn((batch, seqlen, nheads, hdim_v), device="cuda", dtype=dtype)
        for causal in common.bools(args.causal):
            # Q K^T over hdim, P V over hdim_v: half the count at each.
            flops = (common.fwd_flops(batch, nheads, seqlen, seqlen, hdim, causal) +
                     common.fwd_flops(batch, nheads, seqlen, seqlen, hdim_v, causal)) // 2
            reference = None if lost else reference_output(q, k, v, causal)
            for name, fn in impls.items():
                tflops, skipped, err = float("nan"), None, None
                if lost:
                    skipped = f"not run: CUDA context lost earlier ({lost})"
                else:
                    try:
                        tflops, skipped, err = measure(fn, q, k, v, causal, flops, args, reference)
                    except common.ContextLost as error:
                        lost = f"{name} hdim={hdim} seqlen={seqlen} causal={int(causal)}: {error}"
                        skipped = f"device fault: {error}"
                if skipped:
                    print(f"{name} hdim={hdim} seqlen={seqlen} causal={causal}: skipped: {skipped}")
                record = dict(impl=name, dtype=args.dtype, hdim=hdim, seqlen=seqlen, batch=batch,
                              nheads=nheads, causal=causal, fwd_tflops=tflops, gpu=gpu, date=date,
                              skipped=skipped, out_err=err)
                if hdim_v != hdim:
                    record["hdim_v"] = hdim_v
                records.append(record)
            del reference
        common.write_json(records, json_path)

    names = list(impls)
    title = common.titled(f"forward TFLOP/s, {args.dtype}, {gpu}, {date}",
                          common.run_settings(args, [f"hdim_v {args.hdim_v}"] if args.hdim_v else []))
    lines = common.table_lines(title, records, "fwd_tflops", names, [("cuflash/cudnn", "cuflash", "cudnn"),
                                                                      ("cuflash/best", "cuflash", ("cudnn", "fa2"))],
                               ratio_width=13)
    print("\n" + "\n".join(lines))
    with open(common.out_path(args, "fwd_sm90_table", "txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    common.plot(common.out_path(args, "fwd_sm90", "png"), f"forward, {args.dtype}, {gpu}, {date}", records,
                "fwd_tflops", names)


if __name__ == "__main__":
    main()
