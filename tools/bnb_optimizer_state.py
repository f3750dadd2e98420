#!/usr/bin/env python3
"""Converts a bitsandbytes AdamW8bit optimizer state_dict (torch) to safetensors and back.

    python tools/bnb_optimizer_state.py to-safetensors optimizer.pt optimizer.safetensors [--names names.json]
    python tools/bnb_optimizer_state.py to-torch optimizer.safetensors optimizer.pt

memkit reads and writes the safetensors side (memkit/optim/bnb_adam_state.hpp); torch and bitsandbytes are
needed only here. The layout, per parameter index i (the order of the optimizer's param_groups):

    state.<i>.step      I64 []        steps taken (bitsandbytes counts per parameter)
    state.<i>.state1    U8 or F32     first moment: uint8 codes (8-bit) or fp32 values (tensors below
                                      min_8bit_size, 4096 by default, keep 32-bit state), the parameter's shape
    state.<i>.state2    U8 or F32     second moment, likewise
    state.<i>.absmax1   F32 [blocks]  8-bit only: one absmax per block of 256 elements
    state.<i>.absmax2   F32 [blocks]
    state.<i>.qmap1     F32 [256]     8-bit only: the signed dynamic map (m)
    state.<i>.qmap2     F32 [256]     8-bit only: the unsigned dynamic map (v)

and __metadata__: format "memkit.bnb_optimizer_state", version "1", block_size "256", param_groups (the
state_dict's param_groups as JSON, betas as a list) and, when given, param_names (a JSON list naming each
index, e.g. PEFT's adapter keys). `to-torch` gives back what AdamW8bit.state_dict() returns, so
optimizer.load_state_dict() takes it. The state of a parameter that never took a step is absent.
"""
import argparse
import json
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "memkit.bnb_optimizer_state"
VERSION = "1"
BLOCK = 256
WRAPPED = "__bnb_optimizer_quant_state__"  # bitsandbytes >= 0.45 nests the quantization state under this key
EIGHT_BIT_KEYS = ("state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2")


def _flat_param_state(entry, index):
    state = {k: v for k, v in entry.items() if k != WRAPPED}
    state.update(entry.get(WRAPPED, {}))
    unknown = set(state) - {"step", *EIGHT_BIT_KEYS}
    if unknown:
        raise ValueError(f"parameter {index}: state keys {sorted(unknown)} are not AdamW8bit's "
                         "(step, state1, state2, absmax1, absmax2, qmap1, qmap2); max_unorm or another optimizer?")
    for key in ("step", "state1", "state2"):
        if key not in state:
            raise ValueError(f"parameter {index}: state lacks '{key}'")
    return state


def state_dict_to_tensors(state_dict, names=None):
    """(tensors, metadata) of the safetensors layout for an AdamW8bit (or 32-bit Adam/AdamW) state_dict."""
    groups = []
    count = 0
    for group in state_dict["param_groups"]:
        g = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()}
        groups.append(g)
        count += len(group["params"])
    if names is not None and len(names) != count:
        raise ValueError(f"{len(names)} names for {count} parameters")
    tensors = {}
    for index, entry in state_dict["state"].items():
        state = _flat_param_state(entry, index)
        prefix = f"state.{int(index)}."
        step = state["step"]
        tensors[prefix + "step"] = torch.tensor(int(step.item() if torch.is_tensor(step) else step), dtype=torch.int64)
        s1 = state["state1"]
        eight_bit = s1.dtype == torch.uint8
        for key in EIGHT_BIT_KEYS if eight_bit else ("state1", "state2"):
            if key not in state:
                raise ValueError(f"parameter {index}: 8-bit state lacks '{key}'")
            value = state[key].detach().to("cpu")
            if key in ("state1", "state2"):
                expected = torch.uint8 if eight_bit else torch.float32
                if value.dtype != expected:
                    raise ValueError(f"parameter {index}: {key} is {value.dtype}, expected {expected}")
            else:
                value = value.float()
            tensors[prefix + key] = value.clone().contiguous()  # clone: qmaps are shared between parameters
        if eight_bit:
            blocks = (s1.numel() + BLOCK - 1) // BLOCK
            for key in ("absmax1", "absmax2"):
                if tensors[prefix + key].numel() != blocks:
                    raise ValueError(f"parameter {index}: {key} has {tensors[prefix + key].numel()} values, "
                                     f"{blocks} blocks of {BLOCK} expected (not blockwise AdamW8bit?)")
    metadata = {"format": FORMAT, "version": VERSION, "block_size": str(BLOCK), "param_groups": json.dumps(groups)}
    if names is not None:
        metadata["param_names"] = json.dumps(list(names))
    return tensors, metadata


def save_state_dict(state_dict, path, names=None):
    tensors, metadata = state_dict_to_tensors(state_dict, names)
    save_file(tensors, path, metadata=metadata)


def load_state_dict(path):
    """The torch state_dict (AdamW8bit.state_dict()'s form) held by a safetensors file of this layout."""
    with safe_open(path, "pt") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path}: metadata format is {metadata.get('format')!r}, not {FORMAT!r}")
        if metadata.get("version") != VERSION:
            raise ValueError(f"{path}: version {metadata.get('version')!r}, this converter reads {VERSION!r}")
        groups = json.loads(metadata["param_groups"])
        for g in groups:
            if "betas" in g:
                g["betas"] = tuple(g["betas"])
        state = {}
        for key in f.keys():
            parts = key.split(".")
            if len(parts) != 3 or parts[0] != "state" or parts[2] not in ("step", *EIGHT_BIT_KEYS):
                raise ValueError(f"{path}: unexpected key {key!r}")
            state.setdefault(int(parts[1]), {})[parts[2]] = f.get_tensor(key)
    out = {}
    for index in sorted(state):
        s = state[index]
        entry = {"step": int(s.pop("step").item())}
        if s:
            entry[WRAPPED] = s
        out[index] = entry
    return {"state": out, "param_groups": groups}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("to-safetensors", help="torch optimizer state_dict (.pt) -> safetensors")
    a.add_argument("source")
    a.add_argument("destination")
    a.add_argument("--names", help="JSON file with a list naming each parameter index")
    b = sub.add_parser("to-torch", help="safetensors -> torch optimizer state_dict (.pt)")
    b.add_argument("source")
    b.add_argument("destination")
    args = parser.parse_args(argv)
    if args.command == "to-safetensors":
        state_dict = torch.load(args.source, map_location="cpu", weights_only=True)
        names = None
        if args.names:
            with open(args.names) as f:
                names = json.load(f)
        save_state_dict(state_dict, args.destination, names)
    else:
        torch.save(load_state_dict(args.source), args.destination)
    return 0


if __name__ == "__main__":
    sys.exit(main())
