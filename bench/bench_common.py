"""What bench_fwd.py and bench_bwd.py share: the shape grid of DESIGN.md section 6, FLOP counts,
the timing method, the table and the plot.

torch and matplotlib are imported inside the functions that need them, so that the grid and the
FLOP counts can be printed on a machine without either (bench_bwd.py --dry-run).
"""

import datetime
import json
import math
import os
import statistics

TOKENS = 16384  # batch * seqlen
HIDDEN = 2048  # heads * head_dim
BWD_FLOP_FACTOR = 2.5  # backward FLOPs = 2.5 x forward FLOPs (5 matmuls against 2)


def add_grid_args(parser, out_default="."):
    """The options every benchmark takes: output folder, grid, timing, file name tag."""
    parser.add_argument("--out", default=out_default)
    parser.add_argument("--hdims", default="64,128,256")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tag", default="", help="suffix for the output file names")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"), help="element type of q, k, v")


def add_shape_args(parser, seqlen):
    """The options of the one-shape tools (profile_kernel.py, kernel_times.py, trace_fwd.py): a
    point of the grid, batch * seqlen = --tokens and heads * head_dim = HIDDEN."""
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=seqlen)
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--causal", type=int, default=0)


def shape_of(args):
    """(batch, heads) of add_shape_args' options."""
    return max(1, args.tokens // args.seqlen), HIDDEN // args.hdim


def torch_dtype(name):
    """The torch dtype of a --dtype name."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def ints(text):
    return [int(x) for x in text.split(",")]


def bools(text):
    return [bool(int(x)) for x in text.split(",")]


def grid(args):
    """(hdim, seqlen, batch, nheads) over --hdims x --seqlens, with batch * seqlen = TOKENS (batch 1
    beyond TOKENS) and nheads * hdim = HIDDEN."""
    for hdim in ints(args.hdims):
        for seqlen in ints(args.seqlens):
            yield hdim, seqlen, max(1, TOKENS // seqlen), HIDDEN // hdim


def fwd_flops(batch, nheads, seqlen_q, seqlen_k, hdim, causal):
    """4 * B * H * Sq * Sk * D (two matmuls), half of it when causal (the convention of
    FlashAttention's and cuDNN's figures, for square masks: a causal count of other lengths
    would have to say which pairs it counts, so it is refused)."""
    if causal and seqlen_q != seqlen_k:
        raise ValueError(f"causal FLOPs are counted for seqlen_q == seqlen_k, got {seqlen_q} and {seqlen_k}")
    return 4 * batch * nheads * seqlen_q * seqlen_k * hdim // (2 if causal else 1)


def window_pairs(seqlen, left, right):
    """Query-key pairs a local window (left, right) keeps at seqlen_q == seqlen_k: row i sees keys
    max(0, i - left) .. min(seqlen - 1, i + right)."""
    if left < 0 or right < 0:
        raise ValueError(f"window sides must be >= 0, got ({left}, {right})")
    return sum(min(seqlen - 1, i + right) - max(0, i - left) + 1 for i in range(seqlen))


def window_bwd_flops(batch, nheads, seqlen, hdim, left, right):
    """The backward count of a local window: 2.5 x 4 x B x H x D per visible pair (the pairs
    counted exactly; a window is not a square mask)."""
    return int(BWD_FLOP_FACTOR * 4 * batch * nheads * window_pairs(seqlen, left, right) * hdim)


def bwd_flops(batch, nheads, seqlen_q, seqlen_k, hdim, causal):
    """2.5 x the forward count, half of it when causal."""
    return int(BWD_FLOP_FACTOR * fwd_flops(batch, nheads, seqlen_q, seqlen_k, hdim, causal))


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def time_ms(fn, warmup, repeats, groups=5):
    """Median over `groups` of the mean time of `repeats` back-to-back calls. Each group is queued
    behind a sleep kernel, so the host-side cost of a call (argument checks, dispatch) stays out
    of the measurement for every implementation alike."""
    import torch

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


def kernel_events(run, calls):
    """The CUDA kernels (and copies / memsets) of `calls` back-to-back runs of `run` under
    torch.profiler, in start order: (name, duration us, gap us since the previous one's end, None
    for the first). Three runs warm up first, outside the profile."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    rows, previous_end = [], None
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        rows.append((e.name, end - start, None if previous_end is None else start - previous_end))
        previous_end = end
    return rows


def kernel_event_lines(rows, name_width=90):
    """kernel_events' rows as lines: duration, gap, name."""
    return [f"  {duration:9.1f} us{'' if gap is None else f' gap {gap:8.1f} us'}  {name[:name_width]}"
            for name, duration, gap in rows]


def _finite_or_none(value):
    """JSON has no NaN or infinity: a number that is not finite (a failed or skipped
    measurement) is written as null, which `lookup` reads back as NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


def write_json(records, path):
    """The records as strict JSON (allow_nan off: a NaN left in would fail here, not in a reader)."""
    with open(path, "w") as f:
        json.dump(_finite_or_none(records), f, indent=1, allow_nan=False)


class ContextLost(Exception):
    """The CUDA context is unusable after a device fault: nothing after it can be measured."""


def cuda_context_ok():
    import torch

    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
        return True
    except Exception:
        return False


def relative_error(results, reference):
    """max over the tensors of max |x - ref| / max |ref|."""
    worst = 0.0
    for x, r in zip(results, reference):
        scale = r.float().abs().max().item()
        worst = max(worst, (x.float() - r.float()).abs().max().item() / (scale if scale > 0 else 1.0))
    return worst


def checked_time_us(fn, reference, max_err, warmup, repeats, against="the reference"):
    """(us, err, skipped) of one column: its output (a tensor, or a tuple of them) checked against
    `reference` first (max |out - ref| / max |ref|), timed only within max_err; skipped says why
    it was not timed (an output further off, or the error a call raised), None when timed. A device fault that leaves
    the context unusable is raised: nothing after it could be measured."""
    us, err, skipped = float("nan"), None, None
    as_list = lambda x: list(x) if isinstance(x, (tuple, list)) else [x]  # noqa: E731 - several outputs
    try:
        out = fn()
        err = relative_error(as_list(out), as_list(reference))
        del out
        if not err <= max_err:
            skipped = f"output off: max error {err:.3g} relative to {against} > --max-err"
        else:
            us = 1e3 * time_ms(fn, warmup, repeats)
    except Exception as error:  # noqa: BLE001 - the record says why
        skipped = f"{type(error).__name__}: {error}".strip().splitlines()[0][:300]
        if not cuda_context_ok():
            raise
    return us, err, skipped


def by_impl(record):
    return record["impl"]


def lookup(records, value_key, name, hdim, seqlen, causal, label=by_impl):
    """The value of the first record of column `name` at (hdim, seqlen, causal); NaN if none."""
    for r in records:
        if (label(r), r["hdim"], r["seqlen"], r["causal"]) == (name, hdim, seqlen, causal):
            value = r[value_key]
            return float("nan") if value is None else value
    return float("nan")


def grid_keys(records):
    return sorted({(r["hdim"], r["causal"], r["seqlen"]) for r in records})


def table_lines(title, records, value_key, names, ratios, label=by_impl, ratio_width=8):
    """A title, a header and one row per (hdim, causal, seqlen): the value of each column in
    `names`, then each ratio (heading, numerator column, denominator column or a tuple of
    columns, whose best number is taken: DESIGN.md's ratio to the best peer)."""
    lines = [title]
    widths = [max(8, len(n)) for n in names]
    header = f"{'hdim':>4} {'causal':>6} {'seqlen':>6} " + " ".join(f"{n:>{w}}" for n, w in zip(names, widths))
    for heading, _, _ in ratios:
        header += f"  {heading:>{ratio_width}}"
    lines.append(header)
    for hdim, causal, seqlen in grid_keys(records):
        values = [lookup(records, value_key, n, hdim, seqlen, causal, label) for n in names]
        row = f"{hdim:>4} {int(causal):>6} {seqlen:>6} " + " ".join(f"{x:{w}.1f}" for x, w in zip(values, widths))
        for _, num, den in ratios:
            a = lookup(records, value_key, num, hdim, seqlen, causal, label)
            # A tuple of columns: the best of them that has a number (the best peer).
            peers = [lookup(records, value_key, d, hdim, seqlen, causal, label) for d in
                     (den if isinstance(den, tuple) else (den,))]
            peers = [x for x in peers if math.isfinite(x)]
            b = max(peers) if peers else float("nan")
            ratio = a / b if b else float("nan")
            row += f"  {ratio:{ratio_width}.3f}"
        lines.append(row)
    return lines


def plot(path, suptitle, records, value_key, names, label=by_impl):
    """One panel per head dim (columns) and mask (rows: non-causal, causal), TFLOP/s against
    seqlen for each column in `names`. Prints why when matplotlib or the plot fails."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        keys = grid_keys(records)
        hdims = sorted({k[0] for k in keys})
        fig, axes = plt.subplots(2, len(hdims), figsize=(5 * len(hdims), 8), squeeze=False)
        for col, hdim in enumerate(hdims):
            for row, causal in enumerate([False, True]):
                ax = axes[row][col]
                seqlens = sorted({k[2] for k in keys if k[0] == hdim and k[1] == causal})
                for n in names:
                    ax.plot(seqlens, [lookup(records, value_key, n, hdim, s, causal, label) for s in seqlens],
                            marker="o", label=n)
                ax.set_xscale("log", base=2)
                ax.set_title(f"hdim {hdim}, {'causal' if causal else 'non-causal'}")
                ax.set_xlabel("seqlen")
                ax.set_ylabel("TFLOP/s")
                ax.grid(True, alpha=0.3)
                ax.legend()
        fig.suptitle(suptitle)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    except Exception as error:
        print(f"plot skipped: {error}")


def run_settings(args, extra=(), environ=None):
    """What tells one pass of a call from another, for a table's title: the file tag, `extra`
    options, and the CUFLASH_* settings of the environment."""
    environ = os.environ if environ is None else environ
    parts = [f"tag {args.tag}"] if args.tag else []
    parts += list(extra)
    parts += sorted(f"{k}={v}" for k, v in environ.items() if k.startswith("CUFLASH_"))
    return "; ".join(parts)


def titled(title, settings):
    return f"{title}; {settings}" if settings else title


def out_path(args, stem, ext):
    os.makedirs(args.out, exist_ok=True)
    return os.path.join(args.out, f"{stem}{args.tag}.{ext}")
