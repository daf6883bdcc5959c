#!/usr/bin/env python3
"""Masked attention on one GPU: cuflash's flex kernels (built-in mask_mods) next to PyTorch
FlexAttention (torch.compile'd Triton with a BlockMask), forward (or with --backward the
backward alone), in one process, same inputs.

Masks (top-left aligned, seqlen_q == seqlen_k):
  causal     kv <= q                     cuflash.masks.causal()
  window     q - W <= kv <= q            cuflash.masks.sliding_window(W)
  document   doc[q] == doc[kv]           cuflash.masks.document(doc_ids); 4 to 8 random documents
                                          per sequence, different per batch row
Columns: cuflash_flex (mask_mod alone; at these equal lengths causal and window fold into a
window and run on the plain kernels, document builds its block lists from the ids), cuflash_sparse
(the flex kernel driven by the mask's block lists, cuflash.block_sparse.create_block_mask, as
FlexAttention is given its BlockMask), for causal and window cuflash_plain (causal=True /
window_size=(W, 0)), and flexattention.

Shapes as bench_fwd.py (bf16, or --dtype fp16; batch * seqlen = 16k tokens, heads * head_dim =
2048). TFLOP/s count only the visible (q, kv) pairs: 4 * B * H * D * visible / time, the same
count for every column of a mask, so ratios are time ratios. Timing: bench_common.time_ms. Outputs are checked
against FlexAttention's (max abs difference relative to its max) before timing: a column further
than --max-err off, or one that fails, is recorded as skipped (fwd_tflops / bwd_tflops null, the
reason in skipped), not timed.

--deterministic (with --backward): two more cuflash columns, cuflash_flex_det and
cuflash_sparse_det: what the fixed dQ order costs over each.

--flex-api: two more columns through the kernels compiled at run time for the mask_mod callable
(cuflash._jit; the first call of each mask and head dim builds them, about a minute, before
timing): cuflash_flex_api, cuflash.flex_attention given FlexAttention's own arguments (the
callable in the same BlockMask), and cuflash_callable, the callable alone (no block lists: the
blocks skipped are those its program's intervals decide). The three mask_mods below are
spellings that run as cuflash's built-ins (nothing compiled); spell them otherwise (e.g.
qi - ki >= 0) to time the compiled path.

--backward: each column runs its forward once with autograd, then each timed call is
torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), as bench_bwd.py; FLOPs are 2.5x the
forward's, and max_err compares dq, dk, dv with FlexAttention's.

Writes flex_sm90.json (or flex_bwd_sm90.json; records {impl, mask, dtype, hdim, seqlen, batch,
nheads, fwd_tflops or bwd_tflops, max_err, skipped, gpu, date}) and prints a table with the ratio of
cuflash flex to FlexAttention.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402

MASKS = ("causal", "window", "document")


def document_ids(batch, seqlen, gen):
    """(batch, seqlen) int32 document ids: 4 to 8 documents of random lengths per row."""
    import torch

    rows = []
    for _ in range(batch):
        docs = int(torch.randint(4, 9, (1,), generator=gen))
        cuts = torch.sort(torch.randperm(seqlen - 1, generator=gen)[: docs - 1] + 1).values
        ids = torch.zeros(seqlen, dtype=torch.int32)
        for cut in cuts.tolist():
            ids[cut:] += 1
        rows.append(ids)
    return torch.stack(rows).cuda()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_grid_args(parser, out_default=os.environ.get("OUT", "."))
    parser.set_defaults(hdims="128", seqlens="2048,8192")
    parser.add_argument("--masks", default=",".join(MASKS))
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--max-err", type=float, default=0.05,
                        help="columns further than this from FlexAttention's results (relative to their max) "
                             "are recorded as skipped, not timed")
    parser.add_argument("--backward", action="store_true", help="time the backward alone (see above)")
    parser.add_argument("--deterministic", action="store_true",
                        help="with --backward: block-list and deterministic cuflash columns (see above)")
    parser.add_argument("--flex-api", action="store_true",
                        help="a cuflash.flex_attention column with FlexAttention's arguments (see above)")
    args = parser.parse_args()
    if args.deterministic and not args.backward:
        parser.error("--deterministic: only with --backward (the forward has no deterministic mode)")
    metric = "bwd_tflops" if args.backward else "fwd_tflops"

    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    import cuflash

    # Each (mask, shape) is a compilation of its own (dynamic=False); past dynamo's recompile
    # limit (8) FlexAttention would run unfused (the scores materialised), timing the wrong thing.
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 256)
    flex = torch.compile(flex_attention, dynamic=False)
    gpu = torch.cuda.get_device_name()
    date = common.utc_now()
    records = []
    json_path = common.out_path(args, "flex_bwd_sm90" if args.backward else "flex_sm90", "json")
    print(f"masked {'backward' if args.backward else 'forward'}, {args.dtype}, {gpu}, {date}")
    for hdim, seqlen, batch, nheads in common.grid(args):
        gen = torch.Generator().manual_seed(seqlen * 7 + hdim)
        q, k, v = (torch.randn(batch, seqlen, nheads, hdim, generator=gen).to("cuda", common.torch_dtype(args.dtype))
                   .requires_grad_(args.backward) for _ in range(3))
        dout = torch.randn(batch, seqlen, nheads, hdim, generator=gen).to("cuda", common.torch_dtype(args.dtype))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # FlexAttention takes (B, H, S, D)
        for mask in args.masks.split(","):
            W = args.window
            if mask == "causal":
                def mask_mod(b, h, qi, ki):
                    return ki <= qi
                columns = {"cuflash_flex": lambda: cuflash.flash_attn_func(q, k, v, mask_mod=cuflash.masks.causal()),
                           "cuflash_plain": lambda: cuflash.flash_attn_func(q, k, v, causal=True)}
            elif mask == "window":
                def mask_mod(b, h, qi, ki):
                    return (ki <= qi) & (qi - ki <= W)
                columns = {"cuflash_flex": lambda: cuflash.flash_attn_func(
                               q, k, v, mask_mod=cuflash.masks.sliding_window(W)),
                           "cuflash_plain": lambda: cuflash.flash_attn_func(q, k, v, window_size=(W, 0))}
            elif mask == "document":
                doc = document_ids(batch, seqlen, gen)

                def mask_mod(b, h, qi, ki):
                    return doc[b, qi] == doc[b, ki]
                columns = {"cuflash_flex": lambda: cuflash.flash_attn_func(
                    q, k, v, mask_mod=cuflash.masks.document(doc))}
            else:
                raise SystemExit(f"--masks: unknown mask {mask!r}; choose from {', '.join(MASKS)}")
            # The flex kernel driven by the mask's block lists (what FlexAttention is given): for
            # causal and window, whose cuflash_flex column runs the plain kernels at equal lengths
            # (the mask_mod folded into a window), this is the flex kernel's own speed.
            cu_mask = {"causal": lambda: cuflash.masks.causal(),
                       "window": lambda: cuflash.masks.sliding_window(W),
                       "document": lambda: cuflash.masks.document(doc)}[mask]()
            lists = cuflash.block_sparse.create_block_mask(cu_mask, batch, None, seqlen, seqlen)
            lists = {name: torch.from_numpy(x).cuda() for name, x in lists._asdict().items()}
            columns["cuflash_sparse"] = lambda m=cu_mask, ls=lists: cuflash.flash_attn_func(
                q, k, v, mask_mod=m, **ls)
            if args.deterministic:
                columns["cuflash_flex_det"] = lambda m=cu_mask: cuflash.flash_attn_func(
                    q, k, v, mask_mod=m, deterministic=True)
                columns["cuflash_sparse_det"] = lambda m=cu_mask, ls=lists: cuflash.flash_attn_func(
                    q, k, v, mask_mod=m, deterministic=True, **ls)
            block_mask = create_block_mask(mask_mod, batch, None, seqlen, seqlen, device="cuda")
            columns["flexattention"] = lambda: flex(qt, kt, vt, block_mask=block_mask)
            if args.flex_api:
                columns["cuflash_flex_api"] = lambda: cuflash.flex_attention(qt, kt, vt, block_mask=block_mask)
                columns["cuflash_callable"] = lambda m=mask_mod: cuflash.flash_attn_func(q, k, v, mask_mod=m)
            # Visible pairs, for the FLOP count.
            qi = torch.arange(seqlen, device="cuda")
            visible = 0
            for b in range(batch):
                visible += int(mask_mod(b, 0, qi[:, None], qi[None, :]).sum())
            flops = 4 * nheads * hdim * visible * (2.5 if args.backward else 1)

            def output(fn):
                out = fn()
                return out[0] if isinstance(out, tuple) else out.transpose(1, 2)  # (B, S, H, D)

            if args.backward:
                # The forward once; each call then runs that column's backward alone.
                def timed(fn):
                    out = output(fn)
                    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

                def results(fn):
                    return [g.float() for g in fn()]
            else:
                def timed(fn):
                    return fn

                def results(fn):
                    return [output(fn).float()]

            fns = {name: timed(fn) for name, fn in columns.items()}
            try:
                expected = results(fns["flexattention"])
            except Exception as error:  # the columns are then timed unchecked; FlexAttention's skipped
                print(f"{mask:>9} hdim={hdim} seqlen={seqlen}: no FlexAttention reference: "
                      f"{type(error).__name__}: {error}", flush=True)
                expected = None
            for name, fn in fns.items():
                tflops, err, skipped = float("nan"), None, None
                try:
                    got = results(fn)
                    err = None if expected is None else common.relative_error(got, expected)
                    del got
                    if err is not None and not err <= args.max_err:  # NaN included
                        skipped = f"results off: max error {err:.3g} relative to FlexAttention's > --max-err"
                    else:
                        tflops = flops / common.time_ms(fn, args.warmup, args.repeats) / 1e9
                except Exception as error:
                    skipped = f"{type(error).__name__}: {error}".strip().splitlines()[0][:300]
                    if not common.cuda_context_ok():
                        raise
                records.append({"impl": name, "mask": mask, "dtype": args.dtype, "hdim": hdim, "seqlen": seqlen,
                                "batch": batch, "nheads": nheads, metric: tflops, "max_err": err,
                                "skipped": skipped, "gpu": gpu, "date": date})
                shown = f"skipped: {skipped}" if skipped else f"{tflops:7.1f} TFLOP/s  err " + (
                    "unchecked" if err is None else f"{err:.1e}")
                print(f"{mask:>9} hdim={hdim} seqlen={seqlen} {name:>14}: {shown}", flush=True)
            common.write_json(records, json_path)
    det_header = f" {'flex_det/flex':>14} {'sparse_det/sparse':>18}" if args.deterministic else ""
    det_header += f" {'flex_api/FlexAttention':>23} {'callable/FlexAttention':>23}" if args.flex_api else ""
    print(f"\n{'mask':>9} {'hdim':>4} {'seqlen':>6} {'flex/FlexAttention':>19} {'flex/plain':>11}"
          f" {'sparse/FlexAttention':>21}{det_header}")
    for hdim, seqlen, _, _ in common.grid(args):
        for mask in args.masks.split(","):
            get = {r["impl"]: r[metric] for r in records
                   if r["mask"] == mask and r["hdim"] == hdim and r["seqlen"] == seqlen}
            if not get:
                continue
            plain = get.get("cuflash_plain")
            ratio_plain = f"{get['cuflash_flex'] / plain:11.3f}" if plain else f"{'':>11}"
            det = ""
            if args.deterministic:
                det = (f" {get['cuflash_flex_det'] / get['cuflash_flex']:14.3f}"
                       f" {get['cuflash_sparse_det'] / get['cuflash_sparse']:18.3f}")
            if args.flex_api:
                det += (f" {get['cuflash_flex_api'] / get['flexattention']:23.3f}"
                        f" {get['cuflash_callable'] / get['flexattention']:23.3f}")
            print(f"{mask:>9} {hdim:>4} {seqlen:>6} {get['cuflash_flex'] / get['flexattention']:19.3f} {ratio_plain}"
                  f" {get['cuflash_sparse'] / get['flexattention']:21.3f}{det}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
