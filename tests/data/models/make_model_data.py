#!/usr/bin/env python3
"""Writes the Hugging Face reference models under tests/data/models/ (run once; the outputs are committed).

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install torch transformers safetensors
    /tmp/venv/bin/python tests/data/models/make_model_data.py

memkit's tests never run it. Each directory is a small seeded random model of one family, saved by
transformers' save_pretrained exactly as a downloaded checkpoint is laid out (config.json, model.safetensors
or shards + index), and reference.safetensors with what transformers computes for it:

  ids           I32 [2, 16]     the fixed token ids every test feeds
  logits_fp32   F32 [2, 16, V]  LlamaForCausalLM & co. in fp32, eager attention, on the CPU
  loss_fp32     F32 [1]         its causal-LM loss with labels = ids (next-token, mean over 30 positions)
  logits_bf16   F32 [2, 16, V]  the same model cast to bf16 (the values are bf16)

and in adapter/ a PEFT LoRA adapter (save_pretrained: r 4, lora_alpha 8, all seven projections, A and B
drawn N(0, 0.1) so the adapter changes the output), with in reference.safetensors

  logits_lora_fp32   F32 [2, 16, V]  PeftModel's logits
  loss_lora_fp32     F32 [1]         its loss
  grad.<module>.lora_A / .lora_B     d loss / d A, d B after one backward of that loss (fp32)

For llama_llama3_bias and qwen2_tied, adapter_qv/ is a PEFT adapter on q_proj and v_proj only (r 8, v_proj
rank 4 by rank_pattern, alpha 16), with logits_lora_qv_fp32 its logits.

For llama_tied_bf16 and qwen2_tied, bnb4/ is the same model as transformers saves it loaded with
BitsAndBytesConfig(load_in_4bit, nf4, double quantization, compute dtype fp32) on the CPU: bitsandbytes'
4-bit serialization (needs bitsandbytes importable: PYTHONPATH=.whl/site, see bench/peers/README.md), with

  logits_bnb4_fp32   F32 [2, 16, V]  the 4-bit model's logits (bitsandbytes' dequantize + fp32 matmul)
  logits_qlora_fp32  F32 [2, 16, V]  PEFT with adapter/ over that 4-bit model

Weights are drawn wider than transformers' init (std 0.08, RMSNorm weights 1 + N(0, 0.1), biases N(0, 0.05)) so
every term of the math moves the logits. Each model exercises the options of its family:

  llama_llama3_bias   llama: rope_type llama3 (factor 8, original context 16), rope_theta 500000, head_dim 32
                      given (not hidden / heads), attention_bias and mlp_bias, untied; fp32, three shards
  llama_tied_bf16     llama: tie_word_embeddings (Llama 3.2), stored BF16, intermediate 128
  mistral_window      mistral: sliding_window 5 (shorter than the 16 tokens, so it changes the result); F16
  qwen2_tied          qwen2: q/k/v biases, tied embeddings (the small Qwen2.5 sizes); fp32, intermediate 128
  qwen3_qknorm        qwen3: per-head q/k RMSNorm, head_dim 32, sliding window 6 from layer 1 on
                      (use_sliding_window, max_window_layers 1); fp32
"""
import json
import os
import shutil

import torch
from safetensors.torch import save_file
from peft import LoraConfig, get_peft_model
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config)

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB, BATCH, SEQ = 128, 2, 16

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, attn_implementation="eager")

# The two models with a bitsandbytes reference have every row a whole number of 64-element blocks:
# bitsandbytes 0.50.2's native CPU dequantize_4bit misplaces the scales when a row's length is not a multiple
# of the block size (quantize/dequantize round trip of a [64, 96] weight: max error 0.163, vs 0.035 for
# [64, 128]), so its CPU logits for down_proj [64, 96] are not NF4's. memkit dequantizes the same file
# correctly (max error 0.044 against the fp32 weight); the reference must not carry the peer's bug.
ALIGNED = dict(COMMON, intermediate_size=128)

MODELS = {
    "llama_llama3_bias": (LlamaConfig(**COMMON, head_dim=32, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 16}),
                          torch.float32, "100KB"),
    "llama_tied_bf16": (LlamaConfig(**ALIGNED, tie_word_embeddings=True), torch.bfloat16, None),
    "mistral_window": (MistralConfig(**COMMON, sliding_window=5, tie_word_embeddings=False), torch.float16, None),
    "qwen2_tied": (Qwen2Config(**ALIGNED, tie_word_embeddings=True), torch.float32, None),
    "qwen3_qknorm": (Qwen3Config(**COMMON, head_dim=32, use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                 tie_word_embeddings=False),
                     torch.float32, None),
}


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_reference(out, ids, seed):
    """PEFT LoRA on the saved fp32 model: the adapter directory, the adapted logits and loss, and the LoRA
    gradients of one backward."""
    base = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    base.name_or_path = "memkit-tests/" + os.path.basename(out)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS, lora_dropout=0.0,
                                                 task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(500 + seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    peft_model.save_pretrained(os.path.join(out, "adapter"))
    os.remove(os.path.join(out, "adapter", "README.md"))  # PEFT's model card template
    peft_model.train()  # dropout is 0: train mode only enables the gradients' bookkeeping
    r = peft_model(input_ids=ids, labels=ids)
    r.loss.backward()
    tensors = {"logits_lora_fp32": r.logits.detach().float().contiguous(),
               "loss_lora_fp32": r.loss.detach().float().reshape(1).contiguous()}
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            # base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight -> model.layers.0.self_attn.q_proj.lora_A
            module = name.split("base_model.model.", 1)[1].replace(".default.weight", "")
            tensors["grad." + module] = p.grad.detach().float().contiguous()
    return tensors


def bnb4_reference(out, ids):
    """bitsandbytes' 4-bit serialization of the checkpoint and its logits, bare and with the PEFT adapter."""
    import bitsandbytes as bnb
    from peft import PeftModel
    from transformers import BitsAndBytesConfig
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.float32)
    load = lambda: AutoModelForCausalLM.from_pretrained(out, quantization_config=q, device_map="cpu", dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    model = load()
    for m in model.modules():  # the generic path (dequantize, fp32 matmul), not a CPU's bf16 repacking
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    model.save_pretrained(os.path.join(out, "bnb4"))
    os.remove(os.path.join(out, "bnb4", "generation_config.json"))
    with torch.no_grad():
        bare = model(input_ids=ids).logits.float().contiguous()
        peft_model = PeftModel.from_pretrained(model, os.path.join(out, "adapter")).eval()
        adapted = peft_model(input_ids=ids).logits.float().contiguous()
    return {"logits_bnb4_fp32": bare, "logits_qlora_fp32": adapted}


def lora_subset_reference(out, ids, seed):
    """A PEFT adapter on q_proj and v_proj only (PEFT's usual target), v_proj at rank 4 (rank_pattern), and its logits."""
    base = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    base.name_or_path = "memkit-tests/" + os.path.basename(out)
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 rank_pattern={"v_proj": 4}, lora_dropout=0.0, task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(900 + seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    peft_model.save_pretrained(os.path.join(out, "adapter_qv"))
    os.remove(os.path.join(out, "adapter_qv", "README.md"))
    with torch.no_grad():
        return {"logits_lora_qv_fp32": peft_model.eval()(input_ids=ids).logits.float().contiguous()}


def main():
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g, dtype=torch.int64)
    for seed, (name, (config, dtype, shard)) in enumerate(MODELS.items()):
        out = os.path.join(HERE, name)
        for entry in os.listdir(out) if os.path.isdir(out) else []:  # memkit_trained/ is check_memkit_adapter.py's
            if entry != "memkit_trained":
                path = os.path.join(out, entry)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float().eval()
        randomize(model, 100 + seed)
        model.to(dtype).save_pretrained(out, max_shard_size=shard) if shard else model.to(dtype).save_pretrained(out)
        # The reference runs on what was saved: reload the checkpoint, so 16-bit files are compared exactly.
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            r = model(input_ids=ids, labels=ids)
            logits_fp32, loss_fp32 = r.logits.float(), r.loss.float()
            logits_bf16 = model.to(torch.bfloat16)(input_ids=ids).logits.float()
        tensors = {"ids": ids.to(torch.int32).contiguous(), "logits_fp32": logits_fp32.contiguous(),
                   "loss_fp32": loss_fp32.reshape(1).contiguous(), "logits_bf16": logits_bf16.contiguous()}
        tensors.update(lora_reference(out, ids, seed))
        if name in ("llama_tied_bf16", "qwen2_tied"):
            tensors.update(bnb4_reference(out, ids))
        if name in ("llama_llama3_bias", "qwen2_tied"):
            tensors.update(lora_subset_reference(out, ids, seed))
        save_file(tensors, os.path.join(out, "reference.safetensors"))
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(out, extra)):
                os.remove(os.path.join(out, extra))
        files = sorted(os.listdir(out))
        print(f"{name}: {files}, loss {loss_fp32.item():.6f}, max |logit| {logits_fp32.abs().max().item():.3f}, "
              f"bf16 max err {(logits_bf16 - logits_fp32).abs().max().item():.4f}")
    with open(os.path.join(HERE, "versions.json"), "w") as f:
        import transformers
        json.dump({"torch": torch.__version__, "transformers": transformers.__version__}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
