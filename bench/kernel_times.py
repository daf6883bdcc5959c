"""GPU time of each kernel in one cuflash forward call (torch.profiler / CUPTI), with the gaps
between them: where a call's time goes when it runs more than one kernel (split-KV combine,
stream-K tail pieces). bf16, non-causal unless --causal.

    PYTHONPATH=<package> python3 bench/kernel_times.py --hdim 128 --seqlen 2048 --tokens 16384
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    common.add_shape_args(parser, seqlen=2048)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    import cuflash

    batch, heads = common.shape_of(args)
    q, k, v = (torch.randn(batch, args.seqlen, heads, args.hdim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    run = lambda: cuflash.flash_attn_func(q, k, v, causal=bool(args.causal))  # noqa: E731
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            run()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    print(f"hdim {args.hdim} seqlen {args.seqlen} batch {batch} heads {heads} causal {args.causal} "
          f"CUFLASH_FWD_STREAM_K={os.environ.get('CUFLASH_FWD_STREAM_K', 'auto')}")
    previous_end = None
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        gap = "" if previous_end is None else f" gap {start - previous_end:8.1f} us"
        print(f"  {end - start:9.1f} us{gap}  {e.name[:90]}")
        previous_end = end


if __name__ == "__main__":
    main()
