#!/usr/bin/env python3
"""Backward attention throughput on one GPU: cuflash (default and deterministic=True) next to
PyTorch SDPA's cuDNN and FlashAttention-2 backends, in one process, on the same inputs
(DESIGN.md section 6).

Shapes as bench_fwd.py: bf16 (--dtype fp16 for fp16), batch * seqlen = 16k tokens, heads * head_dim = 2048.
FLOPs = 2.5 * 4 * batch * heads * seqlen_q * seqlen_k * head_dim, half of that when causal.
--window L times the cuflash columns with a local window instead (window_size (L, 0) in the causal
passes, (L, L) in the others; FLOPs = 2.5 * 4 * batch * heads * head_dim * the pairs the window keeps);
SDPA's cuDNN and FlashAttention-2 backends have no window, so the reference is SDPA with the window
as a mask (untimed).

What is timed: the backward alone. Each implementation runs its forward once with autograd on
the shared q, k, v; each timed call is then torch.autograd.grad(out, (q, k, v), dout,
retain_graph=True), which runs that implementation's backward (dq, dk, dv, and whatever
preprocessing and conversion it does) from the saved graph, without the forward.
--cuflash-call direct times cuflash.flash_attn_backward(dout, q, k, v, out, lse) instead.
Timing as bench_fwd.py: median over groups of back-to-back calls queued behind a sleep kernel
(bench_common.time_ms). Inputs (q, k, v, dout) are fresh standard-normal values per shape,
seeded by the shape, so every implementation of a shape sees the same values.

Before timing, each implementation's gradients are checked: finite, within --max-err of a
cuDNN reference (max |g - ref| / max |ref| over dq, dk, dv; FlashAttention-2's where cuDNN
refuses the shape; with --window, SDPA's with the window as a mask; a column further off is recorded as skipped, not timed), and whether a
second call gives bitwise the same result (the deterministic-mode property; the deterministic
column is recorded as skipped, not timed, where it does not). The deterministic column runs after
all the others, so that a hang or a fault there costs only its own numbers.

Writes bwd_sm90.json (records {impl, dtype, hdim, seqlen, batch, nheads, nheads_kv, causal, deterministic,
bwd_tflops, gpu, date} plus skipped (reason or null), grad_err, grad_ref, repeatable),
bwd_sm90.png and bwd_sm90_table.txt to --out (default $OUT), and prints a table with the ratios to cuDNN, to the best peer (cuDNN or FA2) and of
deterministic to default cuflash (target >= 0.85). The JSON is rewritten after every shape, so
a run that is cut short keeps what it measured. --dry-run prints the grid and FLOP counts
without touching a GPU (no torch needed).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402

COLUMNS = ("cuflash", "cuflash_det", "cudnn", "fa2")
METHOD = {
    "autograd": "backward alone: forward once, then per call torch.autograd.grad(out, (q, k, v), dout, "
                "retain_graph=True)",
    "direct": "backward alone: peers through torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) "
              "after one forward; cuflash through cuflash.flash_attn_backward(dout, q, k, v, out, lse)",
}


def label(record):
    """Table / plot column of a record: the deterministic cuflash runs are their own column."""
    return record["impl"] + ("_det" if record["deterministic"] else "")


def make_columns(args):
    """{column: prepare(q, k, v, dout, causal, hdim) -> zero-argument callable returning (dq, dk, dv)},
    {column: reason} for columns that cannot run at all, and the SDPA columns for the reference."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    wanted = check_impls(args)
    columns, unavailable = {}, {}

    def sdpa(backend):
        def prepare(q, k, v, dout, causal, hdim):
            # SDPA takes (batch, heads, seqlen, dim); these are views of the same tensors.
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                    enable_gqa=args.gqa > 1)
            grad_out = dout.transpose(1, 2)
            return lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)

        return prepare

    def sdpa_window(q, k, v, dout, causal, hdim):
        # A local window as an explicit mask: the memory-efficient kernel where it takes the
        # shape, else the math path (an untimed reference only).
        left, right = window_of(args, causal)
        rows = torch.arange(q.shape[1], device=q.device)
        keep = (rows[None, :] >= rows[:, None] - left) & (rows[None, :] <= rows[:, None] + right)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep,
                enable_gqa=args.gqa > 1)
        grad_out = dout.transpose(1, 2)
        return lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)

    if args.window > 0:
        # SDPA's cuDNN and FlashAttention-2 backends take no local window: the cuflash columns
        # alone are timed, checked against the masked reference.
        references = {"sdpa_masked": sdpa_window}
        for c in ("cudnn", "fa2"):
            if c in wanted:
                unavailable[c] = f"SDPA's {c} backend has no local window (--window)"
    else:
        references = {"cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "fa2": sdpa(SDPBackend.FLASH_ATTENTION)}
        for c in ("cudnn", "fa2"):
            if c in wanted:
                columns[c] = references[c]

    cuflash_wanted = [c for c in ("cuflash", "cuflash_det") if c in wanted]
    if cuflash_wanted:
        try:
            import cuflash

            built = set(cuflash.built_kernels())
        except Exception as error:  # the table says why a column is missing
            print(f"cuflash unavailable: {error}")
            for c in cuflash_wanted:
                unavailable[c] = f"cuflash unavailable: {type(error).__name__}: {error}"
            cuflash = None

        def cuflash_column(deterministic):
            def prepare(q, k, v, dout, causal, hdim):
                names = [f"{d} {args.dtype} hdim{hdim}" for d in ("fwd", "bwd")]
                missing = [name for name in names if name not in built]
                if missing:
                    raise NotImplementedError(f"not built: {', '.join(missing)} not in cuflash.built_kernels() "
                                              "(CUFLASH_KERNEL_SET / CUFLASH_HDIMS)")
                # The mask: causal, or with --window the local window in its place.
                mask = dict(causal=causal) if args.window <= 0 else dict(window_size=window_of(args, causal))
                if args.cuflash_call == "direct":
                    with torch.no_grad():
                        out, lse = cuflash.flash_attn_func(q, k, v, softcap=args.softcap, **mask)

                    def run():
                        dq, dk, dv, _ = cuflash.flash_attn_backward(dout, q, k, v, out, lse,
                                                                    softcap=args.softcap,
                                                                    deterministic=deterministic, **mask)
                        return dq, dk, dv

                    return run
                out, _ = cuflash.flash_attn_func(q, k, v, softcap=args.softcap,
                                                 deterministic=deterministic, **mask)
                return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

            return prepare

        if cuflash is not None:
            for c in cuflash_wanted:
                columns[c] = cuflash_column(c == "cuflash_det")
    return columns, unavailable, references


def check_impls(args):
    """The --impls columns, in table order."""
    wanted = args.impls.split(",")
    for c in wanted:
        if c not in COLUMNS:
            raise SystemExit(f"--impls: unknown column {c!r}; expected some of {', '.join(COLUMNS)}")
    return [c for c in COLUMNS if c in wanted]


def make_inputs(hdim, seqlen, batch, nheads, dtype, gqa=1):
    """q, k, v (requiring grad) and dout, standard normal, seeded by the shape; k and v with
    nheads / gqa heads."""
    import torch

    torch.manual_seed(1_000_003 * hdim + seqlen)
    shape = (batch, seqlen, nheads, hdim)
    kv_shape = (batch, seqlen, nheads // gqa, hdim)
    q, dout = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(kv_shape, device="cuda", dtype=dtype) for _ in range(2))
    for x in (q, k, v):
        x.requires_grad_(True)
    return q, k, v, dout


def window_of(args, causal):
    """The (left, right) local window of --window: (L, 0) where the pass is causal (a causal mask
    that sees L keys back), (L, L) where it is not."""
    return (args.window, 0 if causal else args.window)


def window_label(args):
    """How the tables name --window's masks."""
    return f"window ({args.window}, 0) causal / ({args.window}, {args.window}) not"


def shape_flops(args, batch, nheads, seqlen, hdim, causal):
    """The backward FLOPs of one shape: the causal convention, or the window's pairs counted."""
    if args.window > 0:
        return common.window_bwd_flops(batch, nheads, seqlen, hdim, *window_of(args, causal))
    return common.bwd_flops(batch, nheads, seqlen, seqlen, hdim, causal)


def reference_grads(references, q, k, v, dout, causal, hdim):
    """The first reference's gradients that runs (cuDNN's, FlashAttention-2's when cuDNN refuses
    the shape; with --window the masked SDPA reference), untimed; None if none does."""
    for name in references:
        try:
            grads = references[name](q, k, v, dout, causal, hdim)()
            return name, [g.detach().clone() for g in grads]
        except Exception:
            continue
    return None, None


def measure(name, prepare, q, k, v, dout, causal, hdim, flops, args, reference):
    """(tflops, skipped reason, grad_err, repeatable) of one column at one shape."""
    import torch

    fn = None
    try:
        fn = prepare(q, k, v, dout, causal, hdim)
        first = [g.detach().clone() for g in fn()]
        second = fn()
        repeatable = all(torch.equal(a, b) for a, b in zip(first, second))
        del second
        if not all(torch.isfinite(g).all().item() for g in first):
            return float("nan"), "non-finite gradients", None, repeatable
        if name == "cuflash_det" and not repeatable:
            return float("nan"), "deterministic=True gave different gradients in two calls", None, repeatable
        err = None
        if reference is not None:
            err = common.relative_error(first, reference)
            if not err <= args.max_err:  # NaN included
                return float("nan"), f"gradients off: max error {err:.3g} relative to the reference > --max-err", \
                    err, repeatable
        del first
        ms = common.time_ms(fn, args.warmup, args.repeats)
        return flops / ms / 1e9, None, err, repeatable
    except Exception as error:
        reason = f"{type(error).__name__}: {error}".strip().splitlines()[0][:300]
        if not common.cuda_context_ok():
            raise common.ContextLost(reason)
        return float("nan"), reason, None, None
    finally:
        del fn


def dry_run(args):
    columns = check_impls(args)
    window = f"; {window_label(args)}" if args.window > 0 else ""
    print(f"dry run: no GPU work. columns: {', '.join(columns)}; {METHOD[args.cuflash_call]}{window}")
    print(f"{'hdim':>4} {'seqlen':>6} {'batch':>5} {'nheads':>6} {'causal':>6} {'fwd GFLOP':>10} {'bwd GFLOP':>10}")
    count, total_flops = 0, 0
    for hdim, seqlen, batch, nheads in common.grid(args):
        for causal in common.bools(args.causal):
            bwd = shape_flops(args, batch, nheads, seqlen, hdim, causal)
            fwd = bwd / common.BWD_FLOP_FACTOR
            print(f"{hdim:>4} {seqlen:>6} {batch:>5} {nheads:>6} {int(causal):>6} {fwd / 1e9:10.1f} {bwd / 1e9:10.1f}")
            count += 1
            total_flops += bwd
    calls = args.warmup + 5 * args.repeats + 2
    passes = 1 + ("cuflash_det" in columns and len(columns) > 1)
    seconds = (len(columns) * calls + passes) * total_flops / 400e12 + len(columns) * count * 5 * 0.02
    print(f"{count} shapes x {len(columns)} columns; per column and shape {calls} backward calls "
          f"(2 checks, {args.warmup} warm-up, 5 groups of {args.repeats}), per shape and pass one cuDNN "
          f"reference; about {seconds:.0f} s of GPU time at 400 TFLOP/s, sleep kernels included; "
          f"output to {args.out}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_grid_args(parser, out_default=os.environ.get("OUT", "."))
    parser.add_argument("--impls", default=",".join(COLUMNS),
                        help="columns to measure, comma-separated, of " + ", ".join(COLUMNS))
    parser.add_argument("--cuflash-call", choices=sorted(METHOD), default="autograd",
                        help="autograd: time torch.autograd.grad on cuflash's output like the peers; "
                             "direct: time cuflash.flash_attn_backward")
    parser.add_argument("--max-err", type=float, default=0.05,
                        help="gradients further than this from the reference (cuDNN's; relative to its max) "
                             "are recorded as skipped, not timed")
    parser.add_argument("--softcap", type=float, default=0.0,
                        help="softcap of the cuflash columns (the peers have none; the cuflash gradients are "
                             "then not checked against theirs): what it measures is the cost of the tanh and "
                             "its derivative")
    parser.add_argument("--gqa", type=int, default=1,
                        help="query heads per kv head (k and v get nheads / GQA heads; SDPA with enable_gqa)")
    parser.add_argument("--window", type=int, default=0,
                        help="a local window of this many keys back from each query in the cuflash columns: "
                             "window_size (L, 0) in the causal passes, (L, L) in the others; the SDPA "
                             "peers have none (not timed), the gradients are checked against SDPA with the "
                             "window as a mask; FLOPs count the window's pairs")
    parser.add_argument("--dry-run", action="store_true", help="print the grid and FLOP counts, touch no GPU")
    args = parser.parse_args()
    for hdim in common.ints(args.hdims):
        if args.gqa < 1 or (common.HIDDEN // hdim) % args.gqa:
            raise SystemExit(f"--gqa {args.gqa}: must divide the {common.HIDDEN // hdim} heads of hdim {hdim}")
    if args.window < 0:
        raise SystemExit(f"--window {args.window}: must be >= 1 (0: no window)")
    if args.window > 0:
        # A window as long as the keys is dropped by the API (the plain causal or full kernels
        # would be timed under the window's name), and the masked reference has no fused kernel
        # for grouped heads (the math path in fp32 would not fit at long sequences).
        short = [n for n in common.ints(args.seqlens) if n <= args.window]
        if short:
            raise SystemExit(f"--window {args.window}: must be below every --seqlens value (got {short})")
        if args.gqa > 1:
            raise SystemExit("--window: not with --gqa > 1 (the masked SDPA reference has no grouped-head kernel)")
    if args.dry_run:
        dry_run(args)
        return 0

    import torch

    gpu = torch.cuda.get_device_name()
    date = common.utc_now()
    columns, unavailable, references = make_columns(args)
    wanted = check_impls(args)
    # Everything else first, the deterministic column in a pass of its own after it.
    passes = [[c for c in wanted if c != "cuflash_det"], [c for c in wanted if c == "cuflash_det"]]
    records = []
    json_path = common.out_path(args, "bwd_sm90", "json")
    lost = None
    gqa = f", {args.gqa} query heads per kv head" if args.gqa > 1 else ""
    print(f"backward, {args.dtype}{gqa}, {gpu}, {date}; {METHOD[args.cuflash_call]}")

    def record(name, hdim, seqlen, batch, nheads, causal, tflops, skipped, err=None, ref=None, repeatable=None):
        impl = "cuflash" if name.startswith("cuflash") else name
        records.append(dict(impl=impl, dtype=args.dtype, hdim=hdim, seqlen=seqlen, batch=batch, nheads=nheads,
                            nheads_kv=nheads // args.gqa,
                            causal=causal, deterministic=name == "cuflash_det", bwd_tflops=tflops, gpu=gpu,
                            date=date, skipped=skipped, grad_err=err, grad_ref=ref if err is not None else None,
                            repeatable=repeatable, softcap=args.softcap if impl == "cuflash" else 0.0,
                            window=list(window_of(args, causal)) if args.window > 0 else None))
        shown = f"skipped: {skipped}" if skipped else f"{tflops:7.1f} TFLOP/s"
        extra = "" if err is None else f"  err vs {ref} {err:.2e}"
        extra += "" if repeatable is None else f"  repeatable {repeatable}"
        print(f"{name:>12} hdim={hdim} seqlen={seqlen} causal={int(causal)}: {shown}{extra}", flush=True)

    for names in passes:
        if not names:
            continue
        for hdim, seqlen, batch, nheads in common.grid(args):
            q = k = v = dout = None
            if lost is None:
                try:
                    q, k, v, dout = make_inputs(hdim, seqlen, batch, nheads, common.torch_dtype(args.dtype), args.gqa)
                except Exception as error:
                    lost = f"inputs: {type(error).__name__}: {error}"
            for causal in common.bools(args.causal):
                flops = shape_flops(args, batch, nheads, seqlen, hdim, causal)
                ref_name, reference = (None, None) if lost else reference_grads(references, q, k, v, dout, causal, hdim)
                for name in names:
                    if name in unavailable or lost:
                        reason = unavailable.get(name) or f"not run: CUDA context lost earlier ({lost})"
                        record(name, hdim, seqlen, batch, nheads, causal, float("nan"), reason)
                        continue
                    # With --softcap the cuflash gradients are of another function than the peers':
                    # their error is recorded, not checked (the GPU tests check softcap gradients).
                    checked = reference
                    if args.softcap > 0 and name.startswith("cuflash") and reference is not None:
                        checked = None
                    try:
                        tflops, skipped, err, repeatable = measure(name, columns[name], q, k, v, dout, causal, hdim,
                                                                   flops, args, checked)
                    except common.ContextLost as error:
                        lost = f"{name} hdim={hdim} seqlen={seqlen} causal={int(causal)}: {error}"
                        tflops, skipped, err, repeatable = float("nan"), f"device fault: {error}", None, None
                    record(name, hdim, seqlen, batch, nheads, causal, tflops, skipped, err, ref_name, repeatable)
                del reference
            del q, k, v, dout
            common.write_json(records, json_path)

    common.write_json(records, json_path)
    names = wanted
    extra = [f"softcap {args.softcap:g}"] if args.softcap > 0 else []
    if args.window > 0:
        extra.append(window_label(args))
    settings = common.run_settings(args, extra)
    title = common.titled(f"backward TFLOP/s, {args.dtype}, {gpu}, {date}", settings)
    lines = common.table_lines(f"{title}; {METHOD[args.cuflash_call]}", records,
                               "bwd_tflops", names,
                               [("cuflash/cudnn", "cuflash", "cudnn"), ("cuflash/best", "cuflash", ("cudnn", "fa2")),
                                ("det/cuflash", "cuflash_det", "cuflash")],
                               label=label, ratio_width=13)
    # The skipped columns' reasons go into the table file too, so that a pass without numbers
    # says why.
    skipped = sorted({r["skipped"] for r in records if r["skipped"]})
    if skipped:
        lines.append(f"{sum(1 for r in records if r['skipped'])} skipped (reasons in bwd_sm90{args.tag}.json), e.g.:")
        lines += [f"  {reason}" for reason in skipped[:8]]
    text = "\n".join(lines)
    print("\n" + text)
    with open(common.out_path(args, "bwd_sm90_table", "txt"), "w") as f:
        f.write(text + "\n")
    common.plot(common.out_path(args, "bwd_sm90", "png"), f"backward, {args.dtype}, {gpu}, {date}", records,
                "bwd_tflops", names, label=label)
    if lost:
        print(f"CUDA context lost: {lost}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
