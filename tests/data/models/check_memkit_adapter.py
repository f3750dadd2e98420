#!/usr/bin/env python3
"""Hands an adapter memkit trained to PEFT and records PEFT's logits for it (run once; the result is committed).

    MEMKIT_MODELS_EXPORT_DIR=/tmp/memkit_trained build/tests/memkit_host_tests -tc='*memkit trains*'
    /tmp/venv/bin/python tests/data/models/check_memkit_adapter.py /tmp/memkit_trained

The memkit test trains a LoRA adapter (fp32, r 4, alpha 8, all seven projections) on qwen3_qknorm for three
AdamW steps and writes it with peft::adapter_writer, plus memkit's logits on the reference ids. This script
loads the adapter with PeftModel.from_pretrained onto the transformers model of the same checkpoint, runs
the reference ids, prints how far PEFT's logits are from memkit's, and copies the adapter and PEFT's logits
to qwen3_qknorm/memkit_trained/ (adapter_config.json, adapter_model.safetensors, peft_logits.safetensors),
where the test reads them back: memkit's logits with the committed adapter must be PEFT's.
"""
import os
import shutil
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))


def main(exported):
    model_dir = os.path.join(HERE, "qwen3_qknorm")
    ids = load_file(os.path.join(model_dir, "reference.safetensors"))["ids"].to(torch.int64)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, exported).eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().contiguous()
    memkit = load_file(os.path.join(exported, "memkit_logits.safetensors"))["logits"]
    err = (logits - memkit).abs().max().item()
    scale = logits.abs().max().item()
    print(f"PEFT {__import__('peft').__version__} on the memkit-trained adapter: max |PEFT - memkit| = {err:.3g} "
          f"(max |logit| {scale:.3f}, relative {err / scale:.3g})")
    out = os.path.join(model_dir, "memkit_trained")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(os.path.join(exported, f), os.path.join(out, f))
    save_file({"logits": logits}, os.path.join(out, "peft_logits.safetensors"))
    with open(os.path.join(out, "result.txt"), "w") as f:
        f.write(f"max |PEFT logit - memkit logit| = {err:.3g}, max |logit| = {scale:.4f}, relative {err / scale:.3g}\n")


if __name__ == "__main__":
    main(sys.argv[1])
