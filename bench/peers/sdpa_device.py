"""torch's own attention on a GPU against tests/data/attention's float64 reference: the yardstick for memkit's
device bounds (tests/cuda/attention_test.cu, "gpu: flash attention forward and backward agree with PyTorch's SDPA").

For every case of tests/data/attention/torch_sdpa.safetensors it regenerates q, k, v and dout exactly as the C++
helper does (make_attention_data.generated, imported, and checked against the bit sums the file records), runs
torch.nn.functional.scaled_dot_product_attention forward and backward on the GPU in the case's dtype with one backend
forced (flash, and cuDNN where torch has it), once per document of a packed row, and writes per case and backend the
worst relative errors of out, dq, dk, dv (max |x - ref| / max |ref|, as the tests measure) and the absolute error of
the lse the backend's own aten op saves, against the float64 reference:

    python3 bench/peers/sdpa_device.py --out sdpa_device.json     # bench/gpu/measure.py's `sdpa_device` step

A case a backend refuses (fp32 on flash and cuDNN; a sliding window's mask on flash) is a row marked skipped with
torch's reason. Without a CUDA device (or without torch / numpy) it says so in one line and exits 0. Standard
library, torch and numpy only (the file is read without the safetensors package: a GPU machine's python may lack it).
--device cpu runs the same code on the CPU's flash backend: its errors are the file's own torch_error figures (a
check of this script where there is no GPU).
"""
import argparse
import json
import os
import struct
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
from error_line import error_line  # noqa: E402  (this folder: first on sys.path when run as a script)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA_DIR = os.path.join(ROOT, "tests", "data", "attention")
LABELS = ("out", "lse", "dq", "dk", "dv")


def read_safetensors(path, torch):
    """{name: tensor} and the metadata of a safetensors file (F32 and I32 tensors, as make_attention_data writes)."""
    with open(path, "rb") as f:
        blob = f.read()
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + header_len])
    metadata = header.pop("__metadata__", {})
    dtypes = {"F32": torch.float32, "I32": torch.int32}
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        raw = bytearray(blob[base + begin:base + end])
        tensors[name] = torch.frombuffer(raw, dtype=dtypes[info["dtype"]]).reshape(info["shape"]) if raw else \
            torch.zeros(info["shape"], dtype=dtypes[info["dtype"]])
    return tensors, metadata


def write_rows(out, rows):
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


def one_line_exit(message, out, rows):
    print(f"sdpa_device: {message}: nothing measured")
    write_rows(out, rows)
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="JSON list of rows (also written on the no-GPU path, with one skipped row)")
    parser.add_argument("--data", default=os.path.join(DATA_DIR, "torch_sdpa.safetensors"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: the CPU flash backend, which must reproduce the file's torch_error (a self-check)")
    args = parser.parse_args()

    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        sys.path.insert(0, DATA_DIR)
        import make_attention_data as data  # the generator and the mask rule, shared with the file's writer
    except Exception as e:  # noqa: BLE001 - any import failure means no rows
        reason = error_line(e, 1000)
        return one_line_exit(f"torch (or numpy) does not import ({reason})", args.out,
                             [{"group": "sdpa_device", "name": "all", "skipped": f"import failed: {reason}"}])
    if args.device == "cuda" and not torch.cuda.is_available():
        return one_line_exit("torch sees no CUDA device", args.out,
                             [{"group": "sdpa_device", "name": "all", "skipped": "torch sees no CUDA device"}])
    device = torch.device(args.device)

    tensors, metadata = read_safetensors(args.data, torch)
    cases = json.loads(metadata["cases"])
    backends = [("flash", SDPBackend.FLASH_ATTENTION)]
    if args.device == "cuda" and hasattr(SDPBackend, "CUDNN_ATTENTION"):
        backends.append(("cudnn", SDPBackend.CUDNN_ATTENTION))
    rows = [{"group": "sdpa_device", "name": "info", "torch": torch.__version__,
             "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
             "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if args.device == "cuda" else None,
             "reference_torch": metadata.get("torch")}]

    def call(q, k, v, c, backend, expand):
        """One document's SDPA with one backend forced: memkit's mask rule (data.memkit_mask) only where there is a
        window (flash on CUDA takes no mask), is_causal otherwise; GQA by enable_gqa, or (`expand`, for a backend
        that refuses it) by repeating K and V heads, whose gradients autograd then sums."""
        kwargs = dict(scale=c["scale"] or None)
        if expand:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        else:
            kwargs["enable_gqa"] = True
        with sdpa_kernel([backend]):
            if c["window"] == 0:
                return F.scaled_dot_product_attention(q, k, v, is_causal=c["causal"], **kwargs)
            mask = data.memkit_mask(q.shape[-2], c["causal"], c["window"]).to(q.device)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)

    def saved_lse(q, k, v, c, name):
        """The logsumexp the backend's aten op saves for its backward ([b, H, s], fp32), K and V heads repeated."""
        if args.device == "cpu":
            return data.flash_lse(q, k, v, c["causal"], c["window"], c["scale"])
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scale = c["scale"] or None
        if name == "flash":
            if c["window"]:
                raise RuntimeError("the CUDA flash op takes no mask")
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, c["causal"], False, scale=scale)[1]
        bias = None
        if c["window"]:
            bias = torch.zeros(q.shape[-2], q.shape[-2], dtype=q.dtype, device=q.device).masked_fill(
                ~data.memkit_mask(q.shape[-2], c["causal"], c["window"]).to(q.device), float("-inf"))
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0,
                                                                  c["causal"] and not c["window"], False,
                                                                  scale=scale)[1]

    for c in cases:
        name, dtype = c["name"], data.TORCH_DTYPE[c["dtype"]]
        B, Hq, Hkv, S, D = c["batch"], c["query_heads"], c["kv_heads"], c["sequence"], c["head_dim"]
        inputs = [data.generated(c["seed"], counter, shape, dtype)
                  for counter, shape in enumerate(((B, Hq, S, D), (B, Hkv, S, D), (B, Hkv, S, D), (B, Hq, S, D)))]
        bits = [str(data.bit_sum(t)) for t in inputs]
        if bits != [c["input_bits"][x] for x in ("q", "k", "v", "dout")]:
            print(f"sdpa_device: {name}: the regenerated inputs differ from the file's (bit sums)", file=sys.stderr)
            return 1
        ref = {label: tensors[f"{name}.{label}"].double() for label in LABELS}
        offsets = tensors[f"{name}.document_offsets"].tolist() if c["document_offsets"] else [[0, S]] * B

        def run(backend, backend_name, expand):
            """out, lse, dq, dk, dv and a note on the lse (None: measured) of one backend on this case."""
            q, k, v = (t.to(device).requires_grad_(True) for t in inputs[:3])
            dout = inputs[3].to(device)
            out = torch.zeros_like(q)
            lse = torch.zeros(B, Hq, S, dtype=torch.float64)
            pieces, lse_note = [], None
            for b in range(B):
                for lo, hi in zip(offsets[b][:-1], offsets[b][1:]):
                    if hi == lo:
                        continue
                    sl = (slice(b, b + 1), slice(None), slice(lo, hi))
                    o = call(q[sl], k[sl], v[sl], c, backend, expand)
                    pieces.append((o, dout[sl]))
                    out[sl] = o.detach()
                    if lse_note is None:
                        try:
                            with torch.no_grad():
                                lse[sl] = saved_lse(q[sl], k[sl], v[sl], c, backend_name).double().cpu().reshape(
                                    1, Hq, hi - lo)
                        except Exception as e:  # noqa: BLE001 - the lse op's own refusal: noted, not fatal
                            lse_note = error_line(e, 160)
            grads = torch.autograd.grad([o for o, _ in pieces], (q, k, v), [g for _, g in pieces])
            if args.device == "cuda":
                torch.cuda.synchronize()
            return out, lse, grads, lse_note

        for backend_name, backend in backends:
            row = {"group": "sdpa_device", "name": f"{backend_name}/{name}", "case": name, "dtype": c["dtype"],
                   "backend": backend_name, "torch_cpu": max(c["torch_error"][x] for x in ("out", "dq", "dk", "dv"))}
            try:
                try:
                    out, lse, grads, lse_note = run(backend, backend_name, False)
                except RuntimeError:
                    if Hq == Hkv:
                        raise
                    out, lse, grads, lse_note = run(backend, backend_name, True)  # no enable_gqa on this backend
                    row["kv_heads"] = "repeated"
            except Exception as e:  # noqa: BLE001 - a backend that refuses a case is a skipped row
                row["skipped"] = error_line(e)
                rows.append(row)
                continue
            got = dict(zip(("out", "dq", "dk", "dv"), (out, *grads)))
            for label, x in got.items():
                row[label] = data.scaled_error(x.detach().cpu(), ref[label])
            if lse_note is None:
                row["lse"] = float((lse - ref["lse"]).abs().max())
            else:
                row["lse_skipped"] = lse_note
            rows.append(row)
    write_rows(args.out, rows)
    measured = [r for r in rows[1:] if "skipped" not in r]
    print(f"sdpa_device: {len(measured)} of {len(rows) - 1} case x backend rows measured on {rows[0]['device']}"
          + (f", wrote {args.out}" if args.out else ""))
    for r in rows[1:]:
        if "skipped" in r:
            print(f"  {r['name']}: skipped: {r['skipped']}")
        else:
            lse_text = f"{r['lse']:.2g}" if "lse" in r else "-"
            print(f"  {r['name']}: out {r['out']:.2g} dq {r['dq']:.2g} dk {r['dk']:.2g} dv {r['dv']:.2g} "
                  f"lse {lse_text} (torch CPU {r['torch_cpu']:.2g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
