#!/usr/bin/env python3
"""Writes PyTorch's scaled-dot-product attention results under tests/data/attention/ (run once; outputs committed).

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install torch safetensors numpy \
        --index-url https://download.pytorch.org/whl/cpu
    /tmp/venv/bin/python tests/data/attention/make_attention_data.py

memkit's tests never run it. tests/host/attention_torch_test.cpp and tests/cuda/attention_test.cu read
torch_sdpa.safetensors and hold memkit's forward and backward to torch's numbers.

Inputs. q [B, Hq, S, D], k and v [B, Hkv, S, D] and dout [B, Hq, S, D] are not stored: they are drawn by memkit's
counter-based generator, which this script reproduces bit for bit (memkit::random_word, core/random.hpp):

    x = (unit_float(random_word(seed, counter, i)) - 0.5f) * 3.4641016f      (fp32, uniform, variance 1)

with counter 0, 1, 2, 3 for q, k, v, dout and i the row-major index, then rounded to the case's dtype (bf16 / fp16:
round to nearest even, as torch's .to() and memkit::from_float both do). The file keeps, per input, the sum of its
elements' bit patterns (fp32: uint32, 16-bit types: uint16) as a decimal string, so the tests can tell that they
regenerated exactly the inputs torch saw. That keeps the file to the references alone.

References, per case "<name>." (all F32):
  out [B, Hq, S, D], lse [B, Hq, S], dq [B, Hq, S, D], dk / dv [B, Hkv, S, D]
  document_offsets I32 [B, N + 1] for the packed cases.
They are computed in float64 from the (rounded) inputs, then stored as fp32 (a relative rounding of 6e-8, far below
every tolerance):

    with torch.nn.attention.sdpa_kernel([SDPBackend.FLASH_ATTENTION]):   # torch's flash backend (CPU, float64)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    lse = torch.logsumexp(scores.masked_fill(~mask, -inf), dim=-1),  scores = scale * q @ k^T (k heads repeated)

and lse is checked to agree within 1e-12 with the logsumexp the flash kernel itself saves
(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu; the measured difference is in the case's
"lse_vs_flash_kernel_float64").

with mask the boolean [S, S] matrix of memkit's rule (docs/attention.md): query i sees key j when
(!causal or j <= i) and (window == 0 or |i - j| < window). A causal case without a window passes is_causal=True
and no mask instead (torch's own causal convention: the same top-left triangle). A packed case runs the call once
per document (the slices [o[d], o[d+1]) of a row) and writes each result into its place in the row.

The metadata (safetensors "__metadata__") holds "cases" (a JSON list of the problems: name, dtype, batch,
query_heads, kv_heads, sequence, head_dim, causal, window, scale (0: 1/sqrt(D)), seed, document_offsets,
input_bits, torch_error and lse_vs_flash_kernel_float64), "torch" (the version), "call" (the call above) and "generator".

torch_error: how far torch's own run in the case's dtype (the same call, flash backend, on the rounded inputs in
bf16 / fp32 on the CPU) is from the float64 reference, as max |x - ref| / max |ref| per tensor (out, dq, dk, dv) and
max |x - ref| for the lse its flash kernel saves: a yardstick for memkit's errors in the tests.
"""
import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
OUTPUT = os.path.join(HERE, "torch_sdpa.safetensors")

# name, dtype, B, Hq, Hkv, S, D, causal, window, scale, document_offsets (flattened [B, N + 1]) or None.
# Lengths 1, 20, 24, 33, 40, 70, 77, 130 (inside, across and two past the 64-row tiles of the host and the CUDA
# kernels; 32 rows for fp32 on CUDA); head_dim 64, 128, 96 (the CUDA mma kernels run bf16 at 64, 96, 128, the WMMA
# kernel the rest), 32 and, in fp32, 16 and 40 (not a multiple of 16); GQA 4 -> 2 (tells h / (Hq / Hkv) from other head mappings), MQA
# 2 -> 1; sliding windows, causal and two-sided; an explicit scale; packed documents with documents of length 1 and
# empty ones. Sizes are small on purpose: the references are stored as fp32 and the file stays under 1 MiB.
CASES = [
    ("fp32_causal_gqa_d16_s77", "fp32", 1, 4, 2, 77, 16, True, 0, 0.0, None),
    ("fp32_full_mqa_d40_s70", "fp32", 1, 2, 1, 70, 40, False, 0, 0.0, None),
    ("fp32_window_d128_s33", "fp32", 1, 1, 1, 33, 128, True, 9, 0.0, None),
    ("fp32_len1_d64", "fp32", 2, 2, 1, 1, 64, True, 0, 0.0, None),
    ("fp32_packed_gqa_window_d16_s40", "fp32", 2, 4, 2, 40, 16, False, 12, 0.0, [0, 1, 25, 40, 0, 33, 40, 40]),
    ("bf16_causal_gqa_d64_s20", "bf16", 1, 4, 2, 20, 64, True, 0, 0.0, None),
    ("bf16_window_full_d128_s77", "bf16", 1, 1, 1, 77, 128, False, 20, 0.0, None),
    ("bf16_causal_mqa_d96_s20", "bf16", 1, 2, 1, 20, 96, True, 0, 0.0, None),
    ("bf16_window_causal_d64_s130", "bf16", 1, 1, 1, 130, 64, True, 33, 0.0, None),
    ("bf16_scale_full_mqa_d128_s20", "bf16", 1, 2, 1, 20, 128, False, 0, 0.3, None),
    ("bf16_len1_d128", "bf16", 1, 2, 1, 1, 128, False, 0, 0.0, None),
    ("bf16_packed_mqa_d64_s77", "bf16", 1, 2, 1, 77, 64, True, 0, 0.0, [0, 1, 70, 77]),
    ("bf16_packed_gqa_window_d32_s24", "bf16", 2, 4, 2, 24, 32, False, 5, 0.0, [0, 1, 10, 24, 0, 24, 24, 24]),
]

TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
AMPLITUDE = np.float32(3.4641016)  # sqrt(12): uniform on [-sqrt 3, sqrt 3), variance 1


def mix64(z):
    """memkit's detail::mix64 (SplitMix64's finaliser) on numpy uint64, wrapping like C++."""
    z = (z + np.uint64(0x9E3779B97F4A7C15)).astype(np.uint64)
    z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)).astype(np.uint64)
    z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)).astype(np.uint64)
    return z ^ (z >> np.uint64(31))


def generated(seed, counter, shape, dtype):
    """The input memkit's tests regenerate (see the module docstring), as a torch tensor of `dtype`."""
    count = int(np.prod(shape))
    with np.errstate(over="ignore"):
        key = mix64(np.array([seed], dtype=np.uint64) ^ mix64(np.array([counter], dtype=np.uint64)))
        bits = (mix64(key + np.arange(count, dtype=np.uint64)) >> np.uint64(32)).astype(np.uint32)
    u = (bits >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 16777216.0)
    x = (u - np.float32(0.5)) * AMPLITUDE
    return torch.from_numpy(x.astype(np.float32).reshape(shape)).to(dtype)


def bit_sum(t):
    """Sum of the elements' bit patterns, as memkit's test computes it."""
    if t.dtype == torch.float32:
        return int(t.contiguous().view(torch.int32).numpy().astype(np.uint32).astype(np.uint64).sum())
    return int(t.contiguous().view(torch.int16).numpy().astype(np.uint16).astype(np.uint64).sum())


def memkit_mask(S, causal, window):
    i = torch.arange(S).unsqueeze(1)
    j = torch.arange(S).unsqueeze(0)
    mask = torch.ones(S, S, dtype=torch.bool)
    if causal:
        mask &= j <= i
    if window > 0:
        mask &= (i - j).abs() < window
    return mask


def sdpa(q, k, v, causal, window, scale):
    """The call the references come from, on one document: [Bq, H, s, D] slices; torch's flash backend (its CPU
    kernel, which runs float64 too), so that no other backend is picked silently."""
    S = q.shape[-2]
    kwargs = dict(scale=scale if scale > 0 else None, enable_gqa=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        if causal and window == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=memkit_mask(S, causal, window), **kwargs)


def flash_lse(q, k, v, causal, window, scale):
    """The logsumexp torch's CPU flash kernel saves for its backward (the aten op under the call above; it takes no
    enable_gqa, so k and v heads are repeated, and an additive mask)."""
    Hq, Hkv, S = q.shape[1], k.shape[1], q.shape[2]
    k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
    mask = torch.zeros(S, S, dtype=q.dtype).masked_fill(~memkit_mask(S, causal, window), float("-inf"))
    _, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                       scale=scale if scale > 0 else None)
    return lse


def logsumexp(q, k, causal, window, scale):
    Hq, Hkv, S, D = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    s = scale if scale > 0 else 1.0 / math.sqrt(D)
    kk = k.repeat_interleave(Hq // Hkv, dim=1)
    scores = (q @ kk.transpose(-1, -2)) * s
    scores = scores.masked_fill(~memkit_mask(S, causal, window), float("-inf"))
    return torch.logsumexp(scores, dim=-1)


def attention(q, k, v, dout, causal, window, scale, offsets):
    """out, lse, dq, dk, dv in q's dtype, per document when `offsets` (list of rows) is given, and the flash
    kernel's own logsumexp (float64 for float64 inputs, else fp32)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    B, S = q.shape[0], q.shape[2]
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[:3], dtype=torch.float64)
    kernel_lse = torch.zeros(q.shape[:3], dtype=torch.float64)
    pieces = []
    for b in range(B):
        row = offsets[b] if offsets is not None else [0, S]
        for d in range(len(row) - 1):
            lo, hi = row[d], row[d + 1]
            if hi == lo:
                continue
            sl = (slice(b, b + 1), slice(None), slice(lo, hi))
            o = sdpa(q[sl], k[sl], v[sl], causal, window, scale)
            pieces.append((sl, o))
            with torch.no_grad():
                out[sl] = o
                lse[sl] = logsumexp(q[sl].double(), k[sl].double(), causal, window, scale)
                kernel_lse[sl] = flash_lse(q[sl], k[sl], v[sl], causal, window, scale).double()
    # One backward over every document's output, each getting its slice of dout.
    total = sum((o * dout[sl]).sum() for sl, o in pieces)
    dq, dk, dv = torch.autograd.grad(total, (q, k, v))
    return (out.detach(), lse, dq, dk, dv), kernel_lse


def scaled_error(x, ref):
    """max |x - ref| / max |ref|, or max |x - ref| where ref is zero but for float64 rounding (below 1e-12): dq and dk
    of a length-1 sequence, whose one weight is 1 so that dS = P (dP - delta) = 0 (the tests do the same)."""
    largest = float(ref.abs().max())
    return float((x.double() - ref).abs().max()) / (largest if largest >= 1e-12 else 1.0)


def main():
    torch.manual_seed(0)
    tensors, cases = {}, []
    for n, (name, dtype, B, Hq, Hkv, S, D, causal, window, scale, flat) in enumerate(CASES):
        seed = 1000 + n
        td = TORCH_DTYPE[dtype]
        q = generated(seed, 0, (B, Hq, S, D), td)
        k = generated(seed, 1, (B, Hkv, S, D), td)
        v = generated(seed, 2, (B, Hkv, S, D), td)
        dout = generated(seed, 3, (B, Hq, S, D), td)
        offsets = None
        if flat is not None:
            width = len(flat) // B
            offsets = [flat[b * width:(b + 1) * width] for b in range(B)]
            tensors[name + ".document_offsets"] = torch.tensor(flat, dtype=torch.int32).reshape(B, width)
        ref, ref_kernel_lse = attention(q.double(), k.double(), v.double(), dout.double(), causal, window, scale,
                                        offsets)
        mine, mine_lse = attention(q, k, v, dout, causal, window, scale, offsets)  # torch in the case's own dtype
        labels = ("out", "lse", "dq", "dk", "dv")
        for label, t in zip(labels, ref):
            tensors[f"{name}.{label}"] = t.float().contiguous()
        torch_error = {label: scaled_error(x, r) for label, x, r in zip(labels, mine, ref) if label != "lse"}
        torch_error["lse"] = float((mine_lse - ref[1]).abs().max())  # the kernel's own lse in this dtype
        # The stored lse (logsumexp above) against the one torch's flash kernel saves, both float64.
        lse_check = float((ref_kernel_lse - ref[1]).abs().max())
        assert lse_check < 1e-12, (name, lse_check)
        cases.append(dict(name=name, dtype=dtype, batch=B, query_heads=Hq, kv_heads=Hkv, sequence=S, head_dim=D,
                          causal=causal, window=window, scale=scale, seed=seed,
                          document_offsets=flat is not None,
                          input_bits={lab: str(bit_sum(t)) for lab, t in zip(("q", "k", "v", "dout"), (q, k, v, dout))},
                          torch_error=torch_error, lse_vs_flash_kernel_float64=lse_check))
        print(f"{name}: torch {dtype} vs float64 " + " ".join(f"{k} {v:.3g}" for k, v in torch_error.items()) +
              f"; lse vs the flash kernel's (float64) {lse_check:.2g}")
    metadata = {
        "cases": json.dumps(cases),
        "torch": torch.__version__,
        "call": "with torch.nn.attention.sdpa_kernel([SDPBackend.FLASH_ATTENTION]): "
                "torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask or None, "
                "is_causal=(causal and window == 0), scale=(scale or None), enable_gqa=True) in float64 on the CPU, "
                "per document; dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout); "
                "lse = torch.logsumexp(scale * q @ repeat_interleave(k)^T masked with -inf, dim=-1), equal within "
                "1e-12 to the logsumexp of torch.ops.aten._scaled_dot_product_flash_attention_for_cpu (float64)",
        "generator": "x = (unit_float(random_word(seed, counter, i)) - 0.5f) * 3.4641016f, counter q 0 k 1 v 2 dout 3, "
                     "rounded to the dtype to nearest even",
    }
    # Reruns give the same tensors and metadata values; the header's bytes may differ (the safetensors library
    # orders the metadata keys through a hash map).
    save_file(tensors, OUTPUT, metadata=metadata)
    with open(os.path.join(HERE, "versions.json"), "w") as f:
        json.dump({"torch": torch.__version__, "numpy": np.__version__}, f, indent=1)
        f.write("\n")
    print(f"{OUTPUT}: {os.path.getsize(OUTPUT)} bytes, {len(cases)} cases")


if __name__ == "__main__":
    main()
