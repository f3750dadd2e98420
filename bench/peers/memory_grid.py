"""Ground truth for memory_budget (#33): real training steps with transformers + PEFT on a GPU, peak memory per row.

Models are built from the config.json files in tests/data/ with random weights (no download), in bf16. Each row
is one configuration: full fine-tuning (torch AdamW, fused or foreach, state in the parameters' bf16) or LoRA
(PEFT, rank 16 on all seven projections, adapters as PEFT makes them), batch 1, a sequence length, gradient
checkpointing on or off, SDPA attention, transformers' own loss (labels = input ids). A row runs one warm-up
step (so the optimizer state exists), empties the caching allocator's cache, resets the peak counters, and
runs one measured step (forward, backward, optimizer step, zero_grad), recording:
  allocated  torch.cuda.max_memory_allocated()
  reserved   torch.cuda.max_memory_reserved()
  device     reserved + what the CUDA context and libraries hold outside the allocator (total - free at start,
             less the allocator's reservation then), i.e. what nvidia-smi would show at the peak
The "longest" rows bisect the sequence length (steps of --granularity tokens) for the longest that trains one
full step under a cap (torch.cuda.set_per_process_memory_fraction), with real steps.

Writes JSON incrementally to --out (rows so far survive a time-out); --budget bounds the whole run in seconds.
Runs where torch, transformers and peft are installed (a GPU machine's python3); never a memkit dependency.

    python3 bench/peers/memory_grid.py --out grid.json --budget 200
"""
import argparse
import datetime
import gc
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]

MODELS = {
    "qwen2.5-0.5b": "tests/data/configs/qwen2.5-0.5b.json",
    "qwen3-0.6b": "tests/data/configs/qwen3-0.6b.json",
    "llama-3.2-1b": "tests/data/configs/llama-3.2-1b.json",
    "llama-3.2-3b": "tests/data/budget_validation/configs/llama-3.2-3b.json",
    "llama-3.1-8b": "tests/data/configs/llama-3.1-8b.json",
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, default=200)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seqs", default="512,2048")
    parser.add_argument("--long-seq", type=int, default=8192, help="one more LoRA row with checkpointing at this length")
    parser.add_argument("--caps-gib", default="24,40")
    parser.add_argument("--longest-models", default="llama-3.1-8b:lora")
    parser.add_argument("--granularity", type=int, default=1024)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks the script runs")
    args = parser.parse_args()
    started = time.monotonic()

    import torch
    import transformers
    import peft

    dry = args.dry_run or not torch.cuda.is_available()
    dev = torch.device("cpu" if dry else "cuda")
    out = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "script": "bench/peers/memory_grid.py", "argv": sys.argv[1:],
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                        "cuda": torch.version.cuda},
           "device": "cpu (dry run)" if dry else torch.cuda.get_device_name(), "rows": [], "longest": []}
    if not dry:
        free, total = torch.cuda.mem_get_info()
        out["device_total_bytes"] = total

    def save():
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1))

    def left():
        return args.budget - (time.monotonic() - started)

    def build(name, method):
        cfg_dict = json.loads((ROOT / MODELS[name]).read_text())
        if dry:  # tiny shapes of the same family
            cfg_dict.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=1000, head_dim=16)
        cfg = transformers.AutoConfig.for_model(**{k: v for k, v in cfg_dict.items() if k != "architectures"})
        torch.manual_seed(0)
        with torch.device(dev):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
        model.config.use_cache = False
        if method == "lora":
            model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS,
                                                                 lora_dropout=0.0, task_type="CAUSAL_LM"))
        params = [p for p in model.parameters() if p.requires_grad]
        return model, params, cfg_dict["vocab_size"] if not dry else 1000

    def one_step(model, optimizer, seq, vocab):
        ids = torch.randint(0, vocab, (1, seq), device=dev)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    def set_checkpointing(model, on):
        base = model
        if on:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if hasattr(base, "enable_input_require_grads"):
                base.enable_input_require_grads()
        else:
            base.gradient_checkpointing_disable()

    def measure(model, optimizer, seq, vocab):
        one_step(model, optimizer, seq, vocab)  # warm-up: the optimizer state exists afterwards
        if dry:
            t0 = time.perf_counter()
            one_step(model, optimizer, seq, vocab)
            return {"allocated": 0, "reserved": 0, "device": 0, "step_s": time.perf_counter() - t0}
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        outside = (total - free) - torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        one_step(model, optimizer, seq, vocab)
        torch.cuda.synchronize()
        step = time.perf_counter() - t0
        reserved = torch.cuda.max_memory_reserved()
        return {"allocated": torch.cuda.max_memory_allocated(), "reserved": reserved, "device": reserved + outside,
                "outside_allocator": outside, "step_s": step}

    seqs = [int(s) for s in args.seqs.split(",")]
    for name in args.models.split(","):
        for method, optimizers in (("lora", ("fused",)), ("full", ("fused", "foreach"))):
            if left() < 20:
                break
            model = params = None
            try:
                model, params, vocab = build(name, method)
                n_train = sum(p.numel() for p in params)
                for impl in optimizers:
                    optimizer = torch.optim.AdamW(params, lr=1e-5, **({"fused": True} if impl == "fused" and not dry else {"foreach": True}))
                    plan = [(s, c) for s in seqs for c in (False, True)]
                    if method == "lora" and impl == "fused":
                        plan.append((args.long_seq, True))
                    if impl == "foreach":
                        plan = [(seqs[0], True)]  # one row: foreach's temporaries against fused's
                    for seq, ckpt in plan:
                        if left() < 15:
                            break
                        seq_run = min(seq, 64) if dry else seq
                        row = {"model": name, "config": MODELS[name], "method": method, "optimizer": f"torch AdamW {impl}",
                               "lora": "r=16 alpha=32 on all seven projections" if method == "lora" else "",
                               "trainable_parameters": n_train, "batch": 1, "sequence": seq_run,
                               "checkpointing": "layer" if ckpt else "none", "attention": "sdpa",
                               "loss": "transformers ForCausalLMLoss (fp32 upcast of the logits)", "dtype": "bf16"}
                        try:
                            set_checkpointing(model, ckpt)
                            row.update(measure(model, optimizer, seq_run, vocab))
                        except torch.OutOfMemoryError as e:
                            row["oom"] = str(e).splitlines()[0][:200]
                        out["rows"].append(row)
                        print(f"{name} {method} {impl} seq {seq_run} ckpt {ckpt}: "
                              f"{row.get('allocated', 0) / 2**30:.2f} GiB allocated, {row.get('reserved', 0) / 2**30:.2f} reserved"
                              + (f" OOM" if "oom" in row else ""), flush=True)
                        save()
                    del optimizer
            finally:
                del model, params
                gc.collect()
                if not dry:
                    torch.cuda.empty_cache()

    # The longest sequence that trains one step under a cap.
    caps = [int(c) for c in args.caps_gib.split(",") if c]
    for item in [m for m in args.longest_models.split(",") if m]:
        name, method = item.split(":")
        if left() < 30 or dry:
            break
        model, params, vocab = build(name, method)
        optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
        set_checkpointing(model, True)
        total = torch.cuda.mem_get_info()[1]
        for cap in caps:
            if left() < 20:
                break
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2**30 / total))
            g = args.granularity
            low, high = 0, 262144 // g  # in units of g tokens: low trains, high does not (or is the search's end)
            tries = []
            while high - low > 1 and left() > 10:
                mid = (low + high) // 2
                try:
                    gc.collect()
                    torch.cuda.empty_cache()
                    t0 = time.perf_counter()
                    one_step(model, optimizer, mid * g, vocab)
                    torch.cuda.synchronize()
                    tries.append([mid * g, "ok", round(time.perf_counter() - t0, 2)])
                    low = mid
                except torch.OutOfMemoryError:
                    optimizer.zero_grad(set_to_none=True)
                    tries.append([mid * g, "oom"])
                    high = mid
            out["longest"].append({"model": name, "config": MODELS[name], "method": method, "checkpointing": "layer",
                                   "optimizer": "torch AdamW fused", "cap_gib": cap, "longest_tokens": low * g,
                                   "granularity": g, "complete": high - low <= 1, "tries": tries})
            print(f"longest {name} {method} under {cap} GiB: {low * g} tokens", flush=True)
            save()
        torch.cuda.set_per_process_memory_fraction(1.0)
        del model, params, optimizer
        gc.collect()
        torch.cuda.empty_cache()
    out["seconds"] = round(time.monotonic() - started, 1)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
