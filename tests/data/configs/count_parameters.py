#!/usr/bin/env python3
"""Counts the parameters of every config.json here the way the released checkpoints hold them.

Each model is built from its config on PyTorch's meta device (no memory, no weights), as transformers
instantiates it; parameters shared by tying (the LM head and the token embedding) are counted once.
Families transformers does not ship (Qwen-1's remote code) are skipped. Reference data for
tests/host/budget_models_test.cpp; never run by the test suite.

    /work/venv/bin/python tests/data/configs/count_parameters.py [config.json ...]
"""
import json
import pathlib
import sys

import torch
import transformers

HERE = pathlib.Path(__file__).resolve().parent


def build(config_path):
    raw = json.loads(config_path.read_text())
    if raw.get("model_type") == "qwen":
        return None  # trust_remote_code only
    config = transformers.AutoConfig.for_model(**raw)
    with torch.device("meta"):
        if raw["model_type"] in ("bert", "roberta"):
            return transformers.AutoModel.from_config(config)  # the encoder and its pooler
        if raw["model_type"] == "gemma3":
            return transformers.Gemma3ForConditionalGeneration(config)  # image encoder + language model
        return transformers.AutoModelForCausalLM.from_config(config)


def count(model):
    seen = set()
    total = 0
    for parameter in model.parameters():  # parameters() yields a tied tensor once
        if id(parameter) not in seen:
            seen.add(id(parameter))
            total += parameter.numel()
    return total


def main(paths):
    paths = [pathlib.Path(p) for p in paths] or sorted(HERE.glob("*.json"))
    print(f"# transformers {transformers.__version__}, torch {torch.__version__}")
    for path in paths:
        model = build(path)
        print(f"{path.name}\t{'-' if model is None else count(model)}")


if __name__ == "__main__":
    main(sys.argv[1:])
