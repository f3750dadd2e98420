#!/usr/bin/env python3
"""The peer of `train_llama --init random --config FILE --device cuda`: a QLoRA step in transformers + PEFT
(+ bitsandbytes) on the same shapes, for the side-by-side in ./dev.sh gpu (bench/gpu/measure.py, step "models").

    python3 bench/peers/qlora_step.py --config tests/data/configs/llama-3.2-1b.json --seq 2048 --steps 3 --out row.json

The model is built from the config with random weights in bf16 on the GPU; with bitsandbytes importable the
seven projections of every block become NF4 Linear4bit (block 64, double quantization, compute bf16) and the
optimizer is bitsandbytes' AdamW8bit (memkit's recipe); without it, LoRA runs over the bf16 base with torch's
AdamW, and the row says so. LoRA r 8, alpha 16 on the seven projections (PEFT), gradient checkpointing per
block, SDPA attention, batch 1. Writes one JSON row: tokens/s over the timed steps (the first is a warm-up) and
torch.cuda.max_memory_allocated.
"""
import argparse
import json
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    row = {"group": "models", "name": f"transformers+peft QLoRA step, {args.config.split('/')[-1]}, 1 x {args.seq}"}
    try:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig, AutoModelForCausalLM
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        try:
            import bitsandbytes as bnb
        except ImportError:
            bnb = None
        config = AutoConfig.from_pretrained(args.config)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        if bnb is not None:
            for layer in model.model.layers:
                for parent in (layer.self_attn, layer.mlp):
                    for name in projections:
                        dense = getattr(parent, name, None)
                        if dense is None:
                            continue
                        q = bnb.nn.Linear4bit(dense.in_features, dense.out_features, bias=dense.bias is not None,
                                              compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4")
                        q.weight = bnb.nn.Params4bit(dense.weight.data.to("cpu"), requires_grad=False, quant_type="nf4",
                                                     compress_statistics=True, blocksize=64)
                        if dense.bias is not None:
                            q.bias = torch.nn.Parameter(dense.bias.data.clone(), requires_grad=False)
                        setattr(parent, name, q.to("cuda"))
                        del dense
            torch.cuda.empty_cache()
        for p in model.parameters():
            p.requires_grad_(False)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=projections, task_type="CAUSAL_LM"))
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = bnb.optim.AdamW8bit(params, lr=2e-4) if bnb is not None else torch.optim.AdamW(params, lr=2e-4)
        ids = torch.randint(0, config.vocab_size, (1, args.seq), device="cuda")
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        timed = times[1:] or times
        row.update({"ms": 1000 * sum(timed) / len(timed), "tokens_per_s": args.seq * len(timed) / sum(timed),
                    "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                    "base": "NF4 (bitsandbytes)" if bnb is not None else "bf16 (bitsandbytes not importable)",
                    "loss": float(loss)})
    except Exception as e:  # the row says why, the run goes on
        row["skipped"] = f"{type(e).__name__}: {e}"
    with open(args.out, "w") as f:
        json.dump(row, f, indent=1)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
