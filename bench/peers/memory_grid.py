"""Ground truth for memory_budget (#33): real training steps with transformers + PEFT on a GPU, peak memory per row.

Models are built from the config.json files in tests/data/ with random weights (no download). Each row is one
configuration, batch 1, SDPA attention, transformers' own loss (labels = input ids):
  full   full fine-tuning in bf16 (torch AdamW fused or foreach: state in the parameters' bf16; or bitsandbytes'
         AdamW8bit) or in fp32 (torch AdamW fused)
  lora   PEFT LoRA, rank 16 (--lora-rank) on all seven projections, adapters as PEFT makes them (fp32), torch AdamW fused
  qlora  the same adapters over bitsandbytes NF4 linears (double quantization, bf16 compute; the embedding,
         norms and LM head stay bf16; no prepare_model_for_kbit_training), torch AdamW fused
a sequence length, and gradient checkpointing on or off. A row runs one warm-up step (so the optimizer state
exists), empties the caching allocator's cache, resets the peak counters, and runs one measured step (forward,
backward, optimizer step, zero_grad), recording:
  allocated  torch.cuda.max_memory_allocated()
  reserved   torch.cuda.max_memory_reserved()
  device     reserved + what the CUDA context and libraries hold outside the allocator (total - free at start,
             less the allocator's reservation then), i.e. what nvidia-smi would show at the peak
The "longest" rows bisect the sequence length (steps of --granularity tokens) for the longest that trains one
full step under a cap (torch.cuda.set_per_process_memory_fraction), with real steps.

Grids (--grid): v1 is the first visit's (2026-11-28: tests/data/budget_measured/h200-2026-11-28.json); v2, the
default, is what v1 did not measure: SmolLM2-360M and Qwen2.5-1.5B with v1's rows, and for every model LoRA at
16K tokens, QLoRA, 8-bit AdamW and fp32 full fine-tuning, and the longest sequence under 24 / 40 / 80 GiB for
Llama-3.1-8B LoRA and QLoRA; all is both. QLoRA and 8-bit AdamW rows need bitsandbytes (skipped, and listed
as skipped in the output, without it). The longest searches run first, then the rows from the smallest model
up, so a run cut short by --budget keeps what matters most.

Writes JSON incrementally to --out (rows so far survive a time-out); --budget bounds the whole run in seconds
(bench/gpu/measure.py gives it what its own budget leaves, at most 205 s). --list prints the plan and exits
(no torch needed); --dry-run (or no GPU) runs every row that can run on the CPU at tiny shapes of the same
families, to check the script. Runs where torch, transformers and peft are installed (a GPU machine's
python3); never a memkit dependency.

    python3 bench/peers/memory_grid.py --out grid.json --budget 200
    python3 bench/peers/memory_grid.py --list
"""
import argparse
import datetime
import gc
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Smallest first: rows run in this order.
MODELS = {
    "smollm2-360m": "tests/data/configs/smollm2-360m.json",
    "qwen2.5-0.5b": "tests/data/configs/qwen2.5-0.5b.json",
    "qwen3-0.6b": "tests/data/configs/qwen3-0.6b.json",
    "llama-3.2-1b": "tests/data/configs/llama-3.2-1b.json",
    "qwen2.5-1.5b": "tests/data/configs/qwen2.5-1.5b.json",
    "llama-3.2-3b": "tests/data/budget_validation/configs/llama-3.2-3b.json",
    "llama-3.1-8b": "tests/data/configs/llama-3.1-8b.json",
}
V1_MODELS = ["qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OPTIMIZERS = {"fused": "torch AdamW fused", "foreach": "torch AdamW foreach", "8bit": "bitsandbytes AdamW8bit"}


def v1_rows(model):
    """The first grid's rows of one model: (method, precision, optimizer, sequence, checkpointing)."""
    rows = [("lora", "bf16", "fused", s, c) for s in (512, 2048) for c in (False, True)]
    rows.append(("lora", "bf16", "fused", 8192, True))
    rows += [("full", "bf16", "fused", s, c) for s in (512, 2048) for c in (False, True)]
    rows.append(("full", "bf16", "foreach", 512, True))
    return rows


def v2_rows(model):
    rows = v1_rows(model) if model not in V1_MODELS else []
    rows.append(("lora", "bf16", "fused", 16384, True))
    rows += [("qlora", "bf16", "fused", 512, False), ("qlora", "bf16", "fused", 2048, True),
             ("qlora", "bf16", "fused", 8192, True)]
    rows.append(("full", "bf16", "8bit", 512, True))
    if model != "llama-3.1-8b":  # fp32 weights, gradients and two moments: 16 bytes per parameter
        rows.append(("full", "fp32", "fused", 512, True))
    return rows


def plan(grid):
    rows = []
    for model in MODELS:
        if grid in ("v1", "all") and model in V1_MODELS:
            rows += [(model,) + r for r in v1_rows(model)]
        if grid in ("v2", "all"):
            rows += [(model,) + r for r in v2_rows(model) if grid == "v2" or (model,) + r not in rows]
    longest = [("llama-3.1-8b", "lora", (24, 40) if grid == "v1" else (24, 40, 80))]
    if grid != "v1":
        longest.append(("llama-3.1-8b", "qlora", (24, 40)))
    return rows, longest


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--budget", type=float, default=200)
    parser.add_argument("--grid", choices=("v1", "v2", "all"), default="v2")
    parser.add_argument("--models", default=",".join(MODELS), help="only these models (rows and longest searches)")
    parser.add_argument("--granularity", type=int, default=1024)
    parser.add_argument("--longest", metavar="METHOD:GIB[,GIB...]",
                        help="instead of the grid's longest searches, Llama-3.1-8B's under these caps (e.g. qlora:8,24; "
                             "bench/gpu/measure.py's longctx step, #31)")
    parser.add_argument("--no-rows", action="store_true", help="only the longest searches")
    parser.add_argument("--lora-rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank; default 16)")
    parser.add_argument("--list", action="store_true", help="print the plan and exit")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks the script runs")
    args = parser.parse_args()
    started = time.monotonic()
    wanted = set(args.models.split(","))
    unknown = wanted - set(MODELS)
    if unknown:
        parser.error(f"unknown models: {', '.join(sorted(unknown))} (known: {', '.join(MODELS)})")
    rows, longest = plan(args.grid)
    if args.longest:
        method, _, caps = args.longest.partition(":")
        if method not in ("lora", "qlora") or not caps:
            parser.error(f"--longest {args.longest}: expected lora:GIB[,GIB...] or qlora:GIB[,GIB...]")
        longest = [("llama-3.1-8b", method, tuple(float(c) if "." in c else int(c) for c in caps.split(",")))]
    if args.no_rows:
        rows = []
    if args.lora_rank < 1:
        parser.error("--lora-rank must be at least 1")
    lora_text = f"r={args.lora_rank} alpha={2 * args.lora_rank} on all seven projections"
    rows = [r for r in rows if r[0] in wanted]
    longest = [l for l in longest if l[0] in wanted]
    if args.list:
        for model, method, precision, impl, seq, ckpt in rows:
            print(f"{model:14} {method:6} {precision:5} {OPTIMIZERS[impl]:24} seq {seq:6} "
                  f"checkpointing {'layer' if ckpt else 'none'}")
        for model, method, caps in longest:
            print(f"longest {model} {method} {lora_text} (checkpointing) under {', '.join(map(str, caps))} GiB")
        print(f"{len(rows)} rows, {sum(len(c) for _, _, c in longest)} longest searches")
        return 0
    if not args.out:
        parser.error("--out is required (unless --list)")

    import torch
    import transformers
    import peft
    try:
        import bitsandbytes as bnb
    except ImportError:
        bnb = None

    dry = args.dry_run or not torch.cuda.is_available()
    dev = torch.device("cpu" if dry else "cuda")
    out = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "script": "bench/peers/memory_grid.py", "argv": sys.argv[1:], "grid": args.grid,
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                        "bitsandbytes": getattr(bnb, "__version__", None), "cuda": torch.version.cuda},
           "device": "cpu (dry run)" if dry else torch.cuda.get_device_name(), "rows": [], "longest": [], "skipped": []}
    if not dry:
        out["device_total_bytes"] = torch.cuda.mem_get_info()[1]

    def save():
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1))

    def left():
        return args.budget - (time.monotonic() - started)

    def needs_bnb(method, impl):
        return method == "qlora" or impl == "8bit"

    def runnable(method, impl):
        """Why a row cannot run here, or None."""
        if needs_bnb(method, impl) and (bnb is None or dry):
            return "bitsandbytes not installed" if bnb is None else "bitsandbytes needs a GPU"
        return None

    def quantize_linears(model):
        """Every decoder linear (not the LM head) becomes a bitsandbytes NF4 Linear4bit, as
        BitsAndBytesConfig(load_in_4bit, nf4, double quant, bf16 compute) loads a checkpoint."""
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if not isinstance(child, torch.nn.Linear) or name == "lm_head":
                    continue
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                                      device=torch.device("meta"))
                q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=True,
                                             quant_type="nf4").to(dev)  # quantized on the move to the GPU
                if child.bias is not None:
                    q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                setattr(module, name, q)
                del child
        gc.collect()
        torch.cuda.empty_cache()

    def build(name, method, precision):
        cfg_dict = json.loads((ROOT / MODELS[name]).read_text())
        if dry:  # tiny shapes of the same family
            cfg_dict.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=1000, head_dim=16)
        cfg = transformers.AutoConfig.for_model(**{k: v for k, v in cfg_dict.items() if k != "architectures"})
        torch.manual_seed(0)
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        with torch.device(dev):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        model.config.use_cache = False
        if method == "qlora":
            quantize_linears(model)
        if method in ("lora", "qlora"):
            model = peft.get_peft_model(model, peft.LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=LORA_TARGETS,
                                                                 lora_dropout=0.0, task_type="CAUSAL_LM"))
        params = [p for p in model.parameters() if p.requires_grad]
        return model, params, cfg_dict["vocab_size"]

    def make_optimizer(params, impl):
        if impl == "8bit":
            return bnb.optim.AdamW8bit(params, lr=1e-5)
        if impl == "fused" and not dry:
            return torch.optim.AdamW(params, lr=1e-5, fused=True)
        return torch.optim.AdamW(params, lr=1e-5, foreach=True)

    def one_step(model, optimizer, seq, vocab):
        ids = torch.randint(0, vocab, (1, seq), device=dev)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    def set_checkpointing(model, on):
        if on:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()
        else:
            model.gradient_checkpointing_disable()

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

    def release():
        gc.collect()
        if not dry:
            torch.cuda.empty_cache()

    # The longest sequence that trains one step under a cap (first: #33's targets rest on them).
    for name, method, caps in longest:
        why = runnable(method, "fused")
        if dry or why:
            out["skipped"].append({"longest": f"{name} {method}", "why": "dry run" if dry else why})
            continue
        if left() < 60:
            break
        model, params, vocab = build(name, method, "bf16")
        optimizer = make_optimizer(params, "fused")
        set_checkpointing(model, True)
        total = torch.cuda.mem_get_info()[1]
        for cap in caps:
            if left() < 45:
                break
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2**30 / total))
            g = args.granularity
            low, high = 0, 262144 // g  # in units of g tokens: low trains, high does not (or is the search's end)
            tries = []
            while high - low > 1 and left() > 30:
                mid = (low + high) // 2
                try:
                    release()
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
                                   "optimizer": OPTIMIZERS["fused"], "dtype": "bf16", "cap_gib": cap, "lora": lora_text,
                                   "longest_tokens": low * g, "granularity": g, "complete": high - low <= 1,
                                   "tries": tries})
            print(f"longest {name} {method} under {cap} GiB: {low * g} tokens", flush=True)
            save()
        torch.cuda.set_per_process_memory_fraction(1.0)
        del model, params, optimizer
        release()

    # The rows, one model build per (model, method, precision).
    groups = {}
    for r in rows:
        groups.setdefault(r[:3], []).append(r[3:])
    for (name, method, precision), items in groups.items():
        runnable_items = []
        for impl, seq, ckpt in items:
            why = runnable(method, impl)
            if why:
                out["skipped"].append({"row": f"{name} {method} {precision} {impl} {seq} {ckpt}", "why": why})
            else:
                runnable_items.append((impl, seq, ckpt))
        if not runnable_items or left() < 20:
            continue
        model = params = optimizer = None
        try:
            model, params, vocab = build(name, method, precision)
            n_train = sum(p.numel() for p in params)
            current = None
            for impl, seq, ckpt in runnable_items:
                if left() < 15:
                    break
                if impl != current:
                    optimizer = None
                    release()
                    optimizer, current = make_optimizer(params, impl), impl
                seq_run = min(seq, 64) if dry else seq
                row = {"model": name, "config": MODELS[name], "method": method, "optimizer": OPTIMIZERS[impl],
                       "lora": lora_text if method != "full" else "",
                       "quantization": "bitsandbytes nf4, double quant, bf16 compute" if method == "qlora" else "",
                       "trainable_parameters": n_train, "batch": 1, "sequence": seq_run,
                       "checkpointing": "layer" if ckpt else "none", "attention": "sdpa",
                       "loss": "transformers ForCausalLMLoss (fp32 upcast of the logits)", "dtype": precision}
                try:
                    set_checkpointing(model, ckpt)
                    row.update(measure(model, optimizer, seq_run, vocab))
                except torch.OutOfMemoryError as e:
                    optimizer.zero_grad(set_to_none=True)
                    row["oom"] = str(e).splitlines()[0][:200]
                out["rows"].append(row)
                print(f"{name} {method} {precision} {impl} seq {seq_run} ckpt {ckpt}: "
                      f"{row.get('allocated', 0) / 2**30:.2f} GiB allocated, {row.get('reserved', 0) / 2**30:.2f} reserved"
                      + (" OOM" if "oom" in row else ""), flush=True)
                save()
        except Exception as e:  # one configuration failing (a library's version) must not lose the others
            out["skipped"].append({"row": f"{name} {method} {precision}", "why": f"{type(e).__name__}: {e}"[:300]})
            print(f"{name} {method} {precision}: {type(e).__name__}: {e}", flush=True)
        finally:
            del model, params, optimizer
            release()
    out["seconds"] = round(time.monotonic() - started, 1)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
