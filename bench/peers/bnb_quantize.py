"""bitsandbytes' CPU 8-bit blockwise quantize (the dynamic map), the baseline of #17's int8-quantize target.

Times bitsandbytes.functional.quantize_blockwise on a CPU fp32 tensor of N values ~ N(0, 1) (as
bench/quant_host.cpp draws them), block 64 by default, one thread; prints the median ns per value.
Compare with memkit_bench_quant_host's BM_quantize_vs_triad<INT8, float> ns_per_value (same N, block 64).

    python bench/peers/bnb_quantize.py --threads 1 --block 64
"""
import argparse
import statistics
import time

import torch
import bitsandbytes
import bitsandbytes.functional as F


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--values", type=int, default=1 << 24)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"bitsandbytes {bitsandbytes.__version__}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    x = torch.randn(args.values, generator=torch.Generator().manual_seed(1))
    F.quantize_blockwise(x, blocksize=args.block)  # warm-up (builds the code map)
    seconds = []
    for _ in range(args.runs):
        start = time.perf_counter()
        F.quantize_blockwise(x, blocksize=args.block)
        seconds.append(time.perf_counter() - start)
    print(f"int8 quantize_blockwise, block {args.block}: {statistics.median(seconds) / args.values * 1e9:.3f} ns/value")


if __name__ == "__main__":
    main()
