#!/usr/bin/env python3
"""Generates the PEFT / bitsandbytes reference data under tests/data/peft/ (run once; outputs are committed).

    /work/venv/bin/python tests/data/peft/make_peft_data.py

Needs torch, transformers, peft and bitsandbytes (CPU backend); memkit's tests never run it.

llama_tiny/      a random 2-layer LlamaForCausalLM (hidden 48) whose mlp.down_proj layers are replaced by
                 bitsandbytes NF4 Linear4bit layers (a QLoRA base); LoRA on q_proj, v_proj, down_proj.
  adapter_fp32/          save_pretrained of the fp32 adapter: r 8, alpha 16, rank_pattern v_proj: 4,
                         alpha_pattern layers.1.self_attn.q_proj: 4, bias "lora_only" (v_proj's bias trains)
  adapter_bf16_rslora/   the same weights cast to bf16, saved with use_rslora true
  reference.safetensors  the base weights (dense F32, or the NF4 keys bitsandbytes writes) and, per adapted
                         module M, M.x (the module's input in a forward pass) and M.y (PEFT's output for it)
qlora_resume/    a 1-layer Llama (hidden 256) with an NF4 down_proj, LoRA r 16 (v_proj r 8, bias trains),
                 trained 5 steps by bitsandbytes' AdamW8bit on a causal-LM loss (real backward, CPU), then
                 10 more steps with synthetic gradients (see synthetic_gradient) that memkit can replay.
  adapter_step5/         the adapter after step 5 (PEFT's save_pretrained)
  optimizer_step5.safetensors   the AdamW8bit state after step 5, via tools/bnb_optimizer_state.py
  final_step15.safetensors      the trainable parameters (PEFT key names) and, via the same converter,
                                the optimizer state after step 15 (keys prefixed "optimizer.")
  trajectory.json        what bitsandbytes' own 8-bit run differs from a 32-bit AdamW run over the same 10
                         steps (the tolerance memkit's replay is held to), and the hyperparameters
"""
import json
import os
import shutil
import sys

import numpy as np
import torch
from torch import nn

import bitsandbytes as bnb
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "tools"))
import bnb_optimizer_state  # noqa: E402  (tools/bnb_optimizer_state.py: state_dict <-> safetensors)


def mix64(z):
    """memkit's detail::mix64 (SplitMix64's finaliser) on numpy uint64, wrapping like C++."""
    z = (z + np.uint64(0x9E3779B97F4A7C15)).astype(np.uint64)
    z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)).astype(np.uint64)
    z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)).astype(np.uint64)
    return z ^ (z >> np.uint64(31))


def synthetic_gradient(tensor, step, count, scale):
    """The gradient memkit's test replays: for element i of tensor t at optimizer step s,
    bits = memkit::random_word(seed 9, counter 1000*s + t, i); u = unit_float(bits) (exact in fp32);
    g = ((u - 0.5f) * scale) * (1 + (i / 256) % 4), all in fp32 so C++ computes the same bits."""
    with np.errstate(over="ignore"):
        key = mix64(np.array([9], dtype=np.uint64) ^ mix64(np.array([1000 * step + tensor], dtype=np.uint64)))
        bits = (mix64(key + np.arange(count, dtype=np.uint64)) >> np.uint64(32)).astype(np.uint32)
    u = (bits >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 16777216.0)
    g = (u - np.float32(0.5)) * np.float32(scale)
    g = g * (np.float32(1.0) + ((np.arange(count) // 256) % 4).astype(np.float32))
    return torch.from_numpy(g.astype(np.float32))


def tiny_llama(hidden, intermediate, layers, heads, kv_heads, seed):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         attention_bias=True, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).float().eval()
    model.name_or_path = f"memkit-tests/llama-tiny-{hidden}"  # PEFT records it as base_model_name_or_path
    for layer in model.model.layers:  # the QLoRA base: NF4 down_proj, double quantization, block 64
        dense = layer.mlp.down_proj
        q = bnb.nn.Linear4bit(dense.in_features, dense.out_features, bias=False, compute_dtype=torch.float32,
                              compress_statistics=True, quant_type="nf4")
        q.weight = bnb.nn.Params4bit(dense.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                     compress_statistics=True, blocksize=64)
        q = q.to("cpu")
        # Keep bitsandbytes' generic path (dequantize, fp32 matmul): on CPUs with AVX512-BF16 its inference
        # path would repack the weight and compute in bf16, which is not what the reference should hold.
        q.support_avx512bf16_for_cpu = False
        layer.mlp.down_proj = q
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def clean_dir(path):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def save_adapter(peft_model, path):
    peft_model.save_pretrained(path)
    os.remove(os.path.join(path, "README.md"))  # PEFT's model-card template: not test data


def make_llama_tiny():
    out = os.path.join(HERE, "llama_tiny")
    clean_dir(out)
    model = tiny_llama(hidden=48, intermediate=64, layers=2, heads=4, kv_heads=2, seed=0)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj", "down_proj"],
                        bias="lora_only", rank_pattern={"v_proj": 4}, alpha_pattern={"layers.1.self_attn.q_proj": 4},
                        task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    torch.manual_seed(1)
    # Trained-looking adapters: PEFT initialises B to zero, which would make every output equal the base's.
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0.0, 0.2)
        if name.endswith("base_layer.bias"):
            p.data.normal_(0.0, 0.1)
    peft_model.eval()

    captured = {}
    handles = []
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
            path = name.removeprefix("base_model.model.")

            def hook(mod, inputs, output, path=path):
                captured[path] = (inputs[0].reshape(-1, inputs[0].shape[-1]).detach().clone(),
                                  output.reshape(-1, output.shape[-1]).detach().clone())

            handles.append(module.register_forward_hook(hook))
    torch.manual_seed(2)
    input_ids = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        peft_model(input_ids=input_ids)
    for h in handles:
        h.remove()

    save_adapter(peft_model, os.path.join(out, "adapter_fp32"))
    reference = {}
    base_state = model.state_dict()  # the unwrapped model's keys carry PEFT's base_layer
    for path, (x, y) in captured.items():
        reference[path + ".x"] = x.contiguous()
        reference[path + ".y"] = y.contiguous()
        prefix = path + ".base_layer."
        for key, value in base_state.items():
            if key.startswith(prefix) and not isinstance(value, (str, bytes)):
                reference[path + "." + key[len(prefix):]] = value.detach().clone().contiguous()
    save_file(reference, os.path.join(out, "reference.safetensors"), metadata={"format": "pt"})
    # The same adapter in bf16 with rsLoRA scaling (alpha / sqrt(r)).
    peft_model.peft_config["default"].use_rslora = True
    for name, p in peft_model.named_parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    save_adapter(peft_model, os.path.join(out, "adapter_bf16_rslora"))

    print("llama_tiny:", sorted(captured))


def trainable(peft_model):
    return [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]


def peft_key(name):
    """The key PEFT's save_pretrained writes for a parameter name (adapter name removed)."""
    return name.replace(".default.", ".")


def make_qlora_resume():
    out = os.path.join(HERE, "qlora_resume")
    clean_dir(out)
    model = tiny_llama(hidden=256, intermediate=520, layers=1, heads=4, kv_heads=2, seed=3)
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                        bias="lora_only", rank_pattern={"v_proj": 8}, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    params = trainable(peft_model)
    hyper = dict(lr=2e-3, betas=(0.9, 0.995), eps=1e-8, weight_decay=0.01)
    optimizer = bnb.optim.AdamW8bit([p for _, p in params], **hyper)

    torch.manual_seed(4)
    tokens = torch.randint(0, 64, (2, 16))
    peft_model.train()
    losses = []
    for _ in range(5):  # a real QLoRA run: causal-LM loss through the NF4 base, backward, 8-bit AdamW
        optimizer.zero_grad()
        loss = peft_model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print("qlora_resume: losses of steps 1-5", losses)
    save_adapter(peft_model, os.path.join(out, "adapter_step5"))
    names = [peft_key(n) for n, _ in params]
    state5 = optimizer.state_dict()
    bnb_optimizer_state.save_state_dict(state5, os.path.join(out, "optimizer_step5.safetensors"), names)

    # A 32-bit AdamW continuing from the same point (the dequantized moments): the yardstick of the
    # 8-bit run's own deviation.
    params32 = [p.detach().clone() for _, p in params]
    reference32 = []
    for i, p in enumerate(params32):
        s = optimizer.state[params[i][1]]
        if s["state1"].dtype == torch.uint8:
            m = bnb.functional.dequantize_blockwise(s["state1"], absmax=s["absmax1"], code=s["qmap1"], blocksize=256)
            v = bnb.functional.dequantize_blockwise(s["state2"], absmax=s["absmax2"], code=s["qmap2"], blocksize=256)
        else:
            m, v = s["state1"].clone(), s["state2"].clone()
        reference32.append([p, m.float().clone(), v.float().clone()])

    scales = [1e-2 if "lora_A" in n else 3e-3 for n, _ in params]
    for step in range(6, 16):
        for t, (_, p) in enumerate(params):
            p.grad = synthetic_gradient(t, step, p.numel(), scales[t]).reshape(p.shape)
        optimizer.step()
        b1, b2 = hyper["betas"]
        for t, (p, m, v) in enumerate(reference32):
            g = synthetic_gradient(t, step, p.numel(), scales[t]).reshape(p.shape).double()
            pd, md, vd = p.double(), m.double(), v.double()
            pd.mul_(1 - hyper["lr"] * hyper["weight_decay"])
            md.mul_(b1).add_(g, alpha=1 - b1)
            vd.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (vd.sqrt() / (1 - b2 ** step) ** 0.5).add_(hyper["eps"])
            pd.addcdiv_(md, denom, value=-hyper["lr"] / (1 - b1 ** step))
            p.copy_(pd)
            m.copy_(md)
            v.copy_(vd)

    final = {}
    for (name, p) in params:
        final[peft_key(name)] = p.detach().clone().contiguous()
    state15 = bnb_optimizer_state.state_dict_to_tensors(optimizer.state_dict(), names)
    for key, value in state15[0].items():
        final["optimizer." + key] = value
    save_file(final, os.path.join(out, "final_step15.safetensors"), metadata={"format": "pt"})

    deviation = {}
    for t, (name, p) in enumerate(params):
        p32 = reference32[t][0]
        diff = (p.detach().double() - p32.double()).abs()
        deviation[peft_key(name)] = {
            "numel": p.numel(),
            "state_bits": 8 if optimizer.state[p]["state1"].dtype == torch.uint8 else 32,
            "max_abs_param_diff": diff.max().item(),
            "mean_abs_param_diff": diff.mean().item(),
            "mean_rel_param_diff": (diff / p32.double().abs().clamp_min(1e-12)).mean().item(),
        }
    with open(os.path.join(out, "trajectory.json"), "w") as f:
        json.dump({"hyperparameters": {**hyper, "betas": list(hyper["betas"])}, "block_size": 256,
                   "min_8bit_size": 4096, "steps": {"real_loss": [1, 5], "synthetic_gradients": [6, 15]},
                   "gradient_scales": dict(zip(names, scales)), "losses_steps_1_to_5": losses,
                   "bnb8_vs_fp32_adamw_after_step15": deviation,
                   "versions": {"torch": torch.__version__, "bitsandbytes": bnb.__version__,
                                "peft": __import__("peft").__version__}}, f, indent=2)
    print("qlora_resume:", json.dumps(deviation, indent=1))


if __name__ == "__main__":
    torch.set_num_threads(1)
    make_llama_tiny()
    make_qlora_resume()
