"""GPU time of each kernel in one attention call (torch.profiler / CUPTI), with the gaps
between them: where a call's time goes when it runs more than one kernel (split-KV combine,
stream-K tail pieces; the backward's workspace clears, preprocess, main kernel and
postprocess). bf16, non-causal unless --causal. --backward times the backward alone (the
forward runs once, outside the profile); --impl cudnn times PyTorch SDPA's cuDNN backend instead,
whose backward also runs its own preprocess and dQ conversion kernels.

    PYTHONPATH=<package> python3 bench/kernel_times.py --hdim 128 --seqlen 2048 --tokens 16384
    PYTHONPATH=<package> python3 bench/kernel_times.py --hdim 256 --backward --impl cudnn
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
    parser.add_argument("--backward", action="store_true", help="time the backward alone")
    parser.add_argument("--impl", default="cuflash", choices=("cuflash", "cudnn"))
    parser.add_argument("--deterministic", action="store_true", help="cuflash's deterministic backward")
    args = parser.parse_args()
    if args.deterministic and args.impl != "cuflash":
        parser.error("--deterministic is cuflash's option (--impl cuflash)")

    import torch
    import cuflash

    batch, heads = common.shape_of(args)
    q, k, v = (torch.randn(batch, args.seqlen, heads, args.hdim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=args.backward) for _ in range(3))
    causal = bool(args.causal)
    if args.impl == "cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F

        def forward():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=causal).transpose(1, 2)
    else:
        def forward():
            return cuflash.flash_attn_func(q, k, v, causal=causal, deterministic=args.deterministic)[0]
    if args.backward:
        out = forward()
        dout = torch.randn_like(out)
        run = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
    else:
        run = forward
    rows = common.kernel_events(run, args.calls)
    print(f"{args.impl} {'backward' if args.backward else 'forward'} hdim {args.hdim} seqlen {args.seqlen} "
          f"batch {batch} heads {heads} causal {args.causal}"
          f"{' deterministic' if args.deterministic else ''} "
          f"CUFLASH_FWD_STREAM_K={os.environ.get('CUFLASH_FWD_STREAM_K', 'auto')}")
    print("\n".join(common.kernel_event_lines(rows)))


if __name__ == "__main__":
    main()
