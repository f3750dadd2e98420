"""The PyTorch side of `./dev.sh gpu`: the peers of memkit's CUDA benchmarks, timed on the same shapes.

Each row is what a PyTorch user runs today for the operation a memkit benchmark times (bench/*.cu), with
the same shapes, dtypes and timing (CUDA events around the work, after a warm-up):

  attention  torch.nn.functional.scaled_dot_product_attention in bf16 with the flash backend and, where torch
             has it, cuDNN's: issue #29's matrix (bench/gpu/attention_matrix.py, which bench/attention_cuda.cu
             registers too): forward alone and forward + backward, causal and not, head_dim 64 and 128, seq
             1K-32K at batch = 16384 / seq (at least 1), heads = 2048 / head_dim; FlashAttention's FLOP count
  loss       materialized logits: hidden @ head^T in bf16, fp32 cross-entropy, backward into hidden and
             head (bench/loss_cuda.cu's llama2_7b and llama3_8b heads, 8,192 tokens); Liger's
             LigerFusedLinearCrossEntropyLoss on the same inputs, where liger_kernel imports (carried as a
             wheel: bench/gpu/peer_wheels.py), with its default and with fp32 head-gradient accumulation;
             each with the peak memory the step allocates beyond its inputs (peak_MiB, its gradients included:
             grads_MiB) and its loss
  adamw      torch.optim.AdamW(fused=True), with and without clip_grad_norm_, on the 48 fp32 tensors of
             bench/adam_cuda.cu (75.0M parameters), four steps back to back (ms per step)
  matmul     bf16 x @ W^T, W [8192, 8192] (cuBLAS through torch; bench/quant_cuda.cu's dense rows)
  bnb_*      bitsandbytes' 4-bit dequantize and matmul (its GEMV at M = 1), 8-bit AdamW: only where bitsandbytes
             imports (the machine's own, else the wheel ./dev.sh gpu-build carries); otherwise a skipped row says so
  qlora_step end-to-end QLoRA steps of the models issue: skipped until memkit's decoder loads real models

Writes a JSON list of rows {"group", "name", "ms", ...} (or {"group", "name", "skipped": reason}) to --out.
torch is never a memkit dependency: this runs where torch is already installed (a GPU machine's python3).
"""
import argparse
import json
import pathlib
import re
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "gpu"))
import attention_matrix  # noqa: E402
from error_line import error_line  # noqa: E402  (this folder: first on sys.path when run as a script)


LOSS_CASE = re.compile(r'\{"(\w+)", (\d+), (\d+), (\d+)\},')


def loss_cases():
    """bench/loss_cuda.cu's cases as (name, tokens N, hidden H, vocabulary V): the peers' loss rows use its shapes."""
    source = (pathlib.Path(__file__).resolve().parents[1] / "loss_cuda.cu").read_text()
    block = source[source.index("constexpr loss_case cases[] = {"):]
    cases = [(m[1], int(m[2]), int(m[3]), int(m[4])) for m in LOSS_CASE.finditer(block[:block.index("};")])]
    if not cases:
        raise ValueError("bench/loss_cuda.cu: no loss cases found")
    return cases


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    args = parser.parse_args()
    rows = []

    def skipped(group, name, reason):
        rows.append({"group": group, "name": name, "skipped": reason})

    def save():
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)

    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means no peer rows
        skipped("all", "torch", f"torch does not import: {e}")
        save()
        return 0
    if not torch.cuda.is_available():
        skipped("all", "torch", "torch sees no CUDA device")
        save()
        return 0

    dev = torch.device("cuda")
    reps = 5 if args.quick else 10

    def timed(body, repetitions=reps):
        """Median device milliseconds of body() over `repetitions` runs (CUDA events), after one warm-up."""
        body()
        torch.cuda.synchronize()
        times = []
        for _ in range(repetitions):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            body()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        times.sort()
        return times[len(times) // 2]

    def peak_mib(body):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        body()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    rows.append({"group": "info", "name": "torch", "version": torch.__version__, "cuda": torch.version.cuda,
                 "cudnn": torch.backends.cudnn.version(), "device": torch.cuda.get_device_name()})

    # The copy roofline as torch sees it (1 GiB, read + write bytes), to compare with memkit's.
    a = torch.empty(2**30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    ms = timed(lambda: b.copy_(a))
    rows.append({"group": "roofline", "name": "torch_copy_1GiB", "ms": ms, "TBps": 2 * 2**30 / (ms * 1e-3) / 1e12})
    del a, b

    # --- attention ---
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backends = [("sdpa_flash", SDPBackend.FLASH_ATTENTION)]
        if hasattr(SDPBackend, "CUDNN_ATTENTION"):
            backends.append(("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION))
    except Exception as e:  # noqa: BLE001
        backends = []
        skipped("attention", "sdpa", f"torch.nn.attention.sdpa_kernel unavailable: {e}")
    # Per shape, one set of inputs for every backend and pass; a backend that refuses a shape is a skipped row.
    for S, D, causal, passes in attention_matrix.peer_shapes(args.quick):
        B, H = attention_matrix.batch(S), attention_matrix.heads(D)
        try:
            g = torch.Generator(device=dev).manual_seed(0)
            q, k, v, dout = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16, generator=g)
                             for _ in range(4))
        except Exception as e:  # noqa: BLE001 - no inputs: every row of the shape is skipped
            for backward in passes:
                for label, _ in backends:
                    skipped("attention", attention_matrix.peer_name(label, S, D, causal, backward),
                            f"inputs: {error_line(e)}")
            torch.cuda.empty_cache()
            continue
        for backward in passes:
            for label, backend in backends:
                name = attention_matrix.peer_name(label, S, D, causal, backward)
                try:
                    if backward:
                        for t in (q, k, v):
                            t.requires_grad_()

                        def step():
                            with sdpa_kernel(backend):
                                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            q.grad = k.grad = v.grad = None
                            out.backward(dout)
                    else:
                        def step():
                            with torch.no_grad(), sdpa_kernel(backend):
                                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

                    ms = timed(step)
                    flops = attention_matrix.flops(S, D, causal, backward)
                    rows.append({"group": "attention", "name": name, "ms": ms, "batch": B, "heads": H,
                                 "TFLOPs": flops / (ms * 1e-3) / 1e12})
                except Exception as e:  # noqa: BLE001
                    skipped("attention", name, error_line(e))
                finally:
                    q.grad = k.grad = v.grad = None
            for t in (q, k, v):
                t.requires_grad_(False)
        del q, k, v, dout
        torch.cuda.empty_cache()
    save()

    # --- linear cross-entropy: materialized logits, and Liger's fused kernel where it imports ---
    # bench/loss_cuda.cu's shapes: 8,192 tokens, hidden 4,096, the Llama-2 and Llama-3 vocabularies; bf16 hidden and
    # head, forward and backward into both. Liger is timed as users call it (gradients in the head's dtype, bf16)
    # and with accum_dtype=float32 (its head gradient accumulated in fp32, as memkit's d_head is).
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        from importlib.metadata import version as dist_version
        import liger_kernel
        rows.append({"group": "info", "name": "liger_kernel", "version": dist_version("liger-kernel"),
                     "path": str(pathlib.Path(liger_kernel.__file__).parent)})
    except Exception as e:  # noqa: BLE001 - not installed, or a wheel that does not import here
        LigerFusedLinearCrossEntropyLoss = None
        skipped("loss", "liger_flce", f"liger_kernel does not import here ({error_line(e, 120)})")
    for case, N, H, V in loss_cases():
        variants = [("materialized_ce", None)]
        if LigerFusedLinearCrossEntropyLoss is not None:
            variants += [("liger_flce", LigerFusedLinearCrossEntropyLoss()),
                         ("liger_flce_fp32_accum", LigerFusedLinearCrossEntropyLoss(accum_dtype=torch.float32))]
        for label, liger in variants:
            name = f"{label}/{case}"
            try:
                g = torch.Generator(device=dev).manual_seed(0)
                hidden = (0.02 * torch.randn(N, H, device=dev, generator=g)).to(torch.bfloat16).requires_grad_()
                head = (0.02 * torch.randn(V, H, device=dev, generator=g)).to(torch.bfloat16).requires_grad_()
                targets = torch.randint(0, V, (N,), device=dev, generator=g)

                if liger is None:
                    def step():
                        logits = hidden @ head.t()
                        loss = torch.nn.functional.cross_entropy(logits.float(), targets)
                        hidden.grad = head.grad = None
                        loss.backward()
                        return loss
                else:
                    def step(liger=liger):
                        loss = liger(head, hidden, targets)
                        hidden.grad = head.grad = None
                        loss.backward()
                        return loss

                ms = timed(step, repetitions=max(3, reps // 2))
                # No gradients held when the peak's base is taken: peak_MiB is everything the step allocates,
                # its returned gradients included (memkit's caller allocates those beforehand: its peak workspace
                # leaves them out; peak_MiB - grads_MiB is the comparable figure).
                hidden.grad = head.grad = None
                mib = peak_mib(step)
                grads = sum(t.grad.numel() * t.grad.element_size() for t in (hidden, head)) / 2**20
                # The loss on the same inputs (seed 0): every variant's should agree to bf16 rounding.
                rows.append({"group": "loss", "name": name, "ms": ms,
                             "GFLOPs": 3 * 2 * N * V * H / (ms * 1e-3) / 1e9, "peak_MiB": mib, "grads_MiB": grads,
                             "tokens": N, "loss": float(step().detach())})
                del hidden, head, targets
            except Exception as e:  # noqa: BLE001
                skipped("loss", name, error_line(e))
            torch.cuda.empty_cache()
    save()

    # --- AdamW on bench/adam_cuda.cu's 48 tensors ---
    sizes = [(1 << 20) + 21845 * i for i in range(48)]
    g = torch.Generator(device=dev).manual_seed(0)
    params = [torch.nn.Parameter(0.1 * torch.randn(n, device=dev, generator=g)) for n in sizes]
    for p in params:
        p.grad = 0.01 * torch.randn(p.numel(), device=dev, generator=g)
    total = sum(sizes)

    def adam_rows(label, optimizer, clip):
        def four_steps():
            for _ in range(4):
                if clip:
                    torch.nn.utils.clip_grad_norm_(params, max_norm=1.0, foreach=True)
                optimizer.step()
        optimizer.step()  # the first step allocates the state
        ms = timed(four_steps) / 4
        state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                          if torch.is_tensor(t) and t.device.type == "cuda")
        rows.append({"group": "adamw", "name": label, "ms": ms, "ms_per_step": ms, "parameters": total,
                     "state_MiB": state_bytes / 2**20})

    try:
        adam_rows("torch_fused_adamw/fp32", torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, fused=True), False)
        adam_rows("torch_fused_adamw_clip/fp32", torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, fused=True), True)
        adam_rows("torch_foreach_adamw/fp32", torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, foreach=True), False)
    except Exception as e:  # noqa: BLE001
        skipped("adamw", "torch_adamw", f"{type(e).__name__}: {e}")
    save()

    # --- dense bf16 matmul, W [8192, 8192] ---
    W = (0.02 * torch.randn(8192, 8192, device=dev)).to(torch.bfloat16)
    for M in (1, 8, 256, 1024, 4096):
        x = torch.randn(M, 8192, device=dev).to(torch.bfloat16)
        ms = timed(lambda: x @ W.t())
        rows.append({"group": "matmul", "name": f"torch_bf16/{M}", "ms": ms,
                     "TFLOPs": 2 * M * 8192 * 8192 / (ms * 1e-3) / 1e12})
        ms = timed(lambda: x @ W)
        rows.append({"group": "matmul", "name": f"torch_bf16_input_grad/{M}", "ms": ms,
                     "TFLOPs": 2 * M * 8192 * 8192 / (ms * 1e-3) / 1e12})
    save()

    # --- bitsandbytes, where it imports ---
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnbf
    except Exception as e:  # noqa: BLE001
        reason = f"bitsandbytes does not import here ({error_line(e, 120)})"
        for name in ("bnb_dequantize_nf4", "bnb_matmul_4bit", "bnb_adamw8bit"):
            skipped("bnb", name, reason)
    else:
        rows.append({"group": "info", "name": "bitsandbytes", "version": bnb.__version__,
                     "path": str(pathlib.Path(bnb.__file__).parent)})
        try:
            values = torch.randn(2**28, device=dev).to(torch.bfloat16)
            codes, qstate = bnbf.quantize_4bit(values, blocksize=64, quant_type="nf4")
            ms = timed(lambda: bnbf.dequantize_4bit(codes, qstate))
            rows.append({"group": "bnb", "name": "bnb_dequantize_nf4/2^28", "ms": ms})
            del values, codes
            codes, qstate = bnbf.quantize_4bit(W, blocksize=64, quant_type="nf4", compress_statistics=True)
            for M in (1, 8, 256, 1024, 4096):
                x = torch.randn(M, 8192, device=dev).to(torch.bfloat16)
                ms = timed(lambda: bnb.matmul_4bit(x, codes.t(), quant_state=qstate))
                rows.append({"group": "bnb", "name": f"bnb_matmul_4bit/{M}", "ms": ms})
            adam = bnb.optim.AdamW8bit(params, lr=1e-3, weight_decay=1e-2)
            adam_rows("bnb_adamw8bit", adam, False)
        except Exception as e:  # noqa: BLE001
            skipped("bnb", "bnb", error_line(e))
    skipped("qlora_step", "transformers_peft_qlora", "needs memkit's decoder for real models (the models issue), not built yet")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
