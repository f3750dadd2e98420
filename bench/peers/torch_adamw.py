"""PyTorch's fused CPU AdamW with gradient clipping, the baseline of #17's fp32-step target.

One step = torch.nn.utils.clip_grad_norm_(max_norm=1.0) + torch.optim.AdamW(fused=True).step() on one fp32
parameter tensor of N elements (gradients ~ N(0, 0.01^2), as bench/support/adam_bench.hpp draws them).
Prints, per size, the median wall time per parameter of the steps and of the clipping alone, and the median
process CPU time of the steps (steadier on a loaded machine; with --threads 1 it is the one thread's time).
torch is never a memkit dependency: install it in a separate venv (see bench/peers/README.md).

    python bench/peers/torch_adamw.py --threads 1 --sizes 1048576 16777216
"""
import argparse
import statistics
import time

import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 22, 1 << 24, 1 << 26])
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for n in args.sizes:
        generator = torch.Generator().manual_seed(1)
        p = torch.nn.Parameter(0.1 * torch.randn(n, generator=generator))
        p.grad = 0.01 * torch.randn(n, generator=generator)
        grad = p.grad.clone()
        optimizer = torch.optim.AdamW([p], lr=1e-3, weight_decay=1e-2, fused=True)
        optimizer.step()  # first step allocates the moments
        step_seconds, clip_seconds, cpu_seconds = [], [], []
        for _ in range(args.steps):
            p.grad.copy_(grad)  # clipping scales the gradient in place: restore it (not timed)
            cpu_start = time.process_time()
            start = time.perf_counter()
            torch.nn.utils.clip_grad_norm_([p], max_norm=1.0)
            clipped = time.perf_counter()
            optimizer.step()
            done = time.perf_counter()
            cpu_seconds.append(time.process_time() - cpu_start)
            clip_seconds.append(clipped - start)
            step_seconds.append(done - start)
        step = statistics.median(step_seconds) / n * 1e9
        clip = statistics.median(clip_seconds) / n * 1e9
        cpu = statistics.median(cpu_seconds) / n * 1e9
        print(f"n {n}: clip+fused AdamW {step:.3f} ns/param (clip alone {clip:.3f}), CPU {cpu:.3f} ns/param", flush=True)


if __name__ == "__main__":
    main()
