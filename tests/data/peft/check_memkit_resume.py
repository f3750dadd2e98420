#!/usr/bin/env python3
"""Hands memkit's resumed QLoRA run back to PEFT + bitsandbytes and checks that it continues.

    MEMKIT_PEFT_EXPORT_DIR=/tmp/memkit_resume build/tests/memkit_host_tests -tc='*continues its trajectory*'
    /work/venv/bin/python tests/data/peft/check_memkit_resume.py /tmp/memkit_resume

The memkit test imports bitsandbytes' AdamW8bit state after step 5 (qlora_resume/), takes steps 6-15 in
memkit, and (with MEMKIT_PEFT_EXPORT_DIR set) writes the adapter with memkit's peft::adapter_writer and the
optimizer state with optim::save_bnb_adam_state. This script
  1. loads that adapter with PeftModel.from_pretrained (is_trainable) onto the same NF4 base, checks every
     LoRA parameter arrived exactly, and runs a forward pass;
  2. converts the optimizer state with tools/bnb_optimizer_state.py and loads it into a fresh
     bitsandbytes AdamW8bit over the PEFT model's trainable parameters;
  3. continues for steps 16-20 with the same synthetic gradients, and compares the parameters with
     bitsandbytes' own run continued from its own step-15 state (qlora_resume/final_step15.safetensors).
It prints a summary; memkit_resume_result.txt beside this script holds the last one (committed).
"""
import json
import os
import sys
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import bitsandbytes as bnb
from peft import PeftModel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_peft_data as gen  # noqa: E402  (tiny_llama, synthetic_gradient, peft_key, bnb_optimizer_state)

conv = gen.bnb_optimizer_state


def model_with_adapter(adapter_dir):
    base = gen.tiny_llama(hidden=256, intermediate=520, layers=1, heads=4, kv_heads=2, seed=3)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    params = [(gen.peft_key(n), p) for n, p in model.named_parameters() if p.requires_grad]
    return model, params


def continue_run(params, state_dict, hyper, first_step, last_step):
    optimizer = bnb.optim.AdamW8bit([p for _, p in params], **hyper)
    optimizer.load_state_dict(state_dict)
    scales = [1e-2 if "lora_A" in n else 3e-3 for n, _ in params]
    for step in range(first_step, last_step + 1):
        for t, (_, p) in enumerate(params):
            p.grad = gen.synthetic_gradient(t, step, p.numel(), scales[t]).reshape(p.shape)
        optimizer.step()
    return optimizer


def main(export_dir):
    torch.set_num_threads(1)
    lines = []
    resume = os.path.join(HERE, "qlora_resume")
    with safe_open(os.path.join(resume, "optimizer_step5.safetensors"), "pt") as f:
        metadata = f.metadata()
    group = json.loads(metadata["param_groups"])[0]
    hyper = dict(lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"], weight_decay=group["weight_decay"])

    # 1. memkit's adapter in PEFT.
    adapter_dir = os.path.join(export_dir, "adapter_step15")
    model, params = model_with_adapter(adapter_dir)
    config = model.peft_config["default"]
    assert (config.r, config.lora_alpha, config.rank_pattern, config.bias, sorted(config.target_modules)) == \
        (16, 32, {"v_proj": 8}, "lora_only", ["down_proj", "q_proj", "v_proj"]), config
    written = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    assert sorted(written) == sorted(n for n, _ in params), "memkit's adapter keys differ from PEFT's trainable parameters"
    for name, p in params:
        assert torch.equal(p.detach(), written[name]), f"{name} did not load exactly"
    with torch.no_grad():
        logits = model(input_ids=torch.arange(16).reshape(1, 16)).logits
    assert torch.isfinite(logits).all()
    lines.append(f"adapter: PeftModel.from_pretrained read memkit's config (r 16, alpha 32, rank_pattern, bias lora_only) and "
                 f"loaded all {len(params)} tensors of memkit's adapter exactly; "
                 f"forward ok (logits {tuple(logits.shape)})")

    # 2-3. memkit's optimizer state in bitsandbytes, continued.
    state_memkit = conv.load_state_dict(os.path.join(export_dir, "optimizer_step15.safetensors"))
    steps = {entry["step"] for entry in state_memkit["state"].values()}
    assert steps == {15}, steps
    optimizer = continue_run(params, state_memkit, hyper, 16, 20)
    assert all(optimizer.state[p]["step"] == 20 for _, p in params)

    # bitsandbytes' own run from its own step 15.
    final = load_file(os.path.join(resume, "final_step15.safetensors"))
    base_run_dir = tempfile.mkdtemp()
    own_state_path = os.path.join(base_run_dir, "own_step15.safetensors")
    save_file({k[len("optimizer."):]: v for k, v in final.items() if k.startswith("optimizer.")}, own_state_path,
              metadata=metadata)
    reference_model, reference_params = model_with_adapter(os.path.join(resume, "adapter_step5"))
    with torch.no_grad():
        for name, p in reference_params:
            p.copy_(final[name])
    continue_run(reference_params, conv.load_state_dict(own_state_path), hyper, 16, 20)

    total_abs = total_rel = total = 0.0
    for (name, p), (_, q) in zip(params, reference_params):
        diff = (p.detach().double() - q.detach().double()).abs()
        rel = diff / q.detach().double().abs().clamp_min(1e-12)
        total_abs += diff.sum().item()
        total_rel += rel.sum().item()
        total += p.numel()
        lines.append(f"  {name:66s} {p.numel():5d} el  |diff| max {diff.max().item():.3g} mean {diff.mean().item():.3g} "
                     f"rel {rel.mean().item():.3g}")
    lines.insert(1, "optimizer: bitsandbytes AdamW8bit.load_state_dict took memkit's state (step 15) and stepped to 20; "
                    "parameters after step 20, memkit-resumed (steps 6-15 in memkit) vs bitsandbytes throughout:")
    lines.append(f"  all: mean |diff| {total_abs / total:.3g}, mean rel {total_rel / total:.3g} over {int(total)} parameters "
                 f"(bitsandbytes' 8-bit vs 32-bit tolerance: < 6e-5 / < 6e-4)")
    lines.append(f"versions: torch {torch.__version__}, bitsandbytes {bnb.__version__}, "
                 f"peft {__import__('peft').__version__}")
    ok = total_abs / total < 6e-5 and total_rel / total < 6e-4
    lines.append("PASS" if ok else "FAIL")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    with open(os.path.join(HERE, "memkit_resume_result.txt"), "w") as f:
        f.write("# python tests/data/peft/check_memkit_resume.py <dir written by the memkit test> (see its docstring)\n" + text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
