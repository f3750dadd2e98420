"""Issue #29's attention benchmark matrix, shared by bench/gpu/measure.py and bench/peers/gpu_peers.py (standard
library only); bench/attention_cuda.cu registers the same shapes (tests/tools/measure_attention_check.py compares).

Shapes as FlashAttention's own benchmarks: a fixed total of tokens, batch = 16384 / seq (at least 1: seq 32K is
one sequence of 32K tokens) and heads = 2048 / head_dim, so every row fills an H200's 132 SMs (seq 1K: 16 x 16
query tiles of 64 x 16 heads). bf16, causal and not, forward alone and forward + backward.

FLOPs are counted FlashAttention's way (benchmarks/benchmark_flash_attention.py): forward 4 B H S^2 D, halved
when causal; backward 2.5x forward (5 products against the forward's 2), so forward + backward 3.5x. memkit's
own rows before this matrix counted backward as 2x; these rows use FA's count on both sides, and the ratios are
time ratios, independent of any count.
"""
import re

TOKENS = 16384
WIDTH = 2048  # heads x head_dim
SEQS = (1024, 2048, 4096, 8192, 16384, 32768)
HEAD_DIMS = (64, 128)
# head_dims only the mma kernels run: causal forward + backward at two lengths (heads = 2048 // head_dim: 21 at 96)
EXTRA_SEQS = (4096, 16384)
EXTRA_HEAD_DIMS = (96, 256)
PEERS = ("sdpa_flash", "sdpa_cudnn")
# The targets, as memkit's throughput over torch's flash SDPA forward + backward at the same shape.
TARGET_BUILT_IN = 0.5
TARGET_CUDNN = 0.9

# Device time the estimate assumes (FA's count): memkit's WMMA kernels measured 2.6-8.6 TFLOP/s in memkit's
# older 3x count on the H200 (docs/cuda.md), 3.0-10 in FA's; torch's flash backend FA2-class, 300-400.
MEMKIT_TFLOPS = 5.0
TORCH_TFLOPS = 300.0


def peer_shapes(quick=False):
    """(seq, head_dim, causal, passes) the peers time: the matrix (forward + backward and forward alone) and the
    extra head_dims (forward + backward, causal); --quick leaves out seq 32K, as measure.py does on memkit's side."""
    for S in SEQS:
        if quick and S >= 32768:
            continue
        for D in HEAD_DIMS:
            for causal in (True, False):
                yield S, D, causal, (True, False)
    for S in EXTRA_SEQS:
        for D in EXTRA_HEAD_DIMS:
            yield S, D, True, (True,)


def batch(seq):
    return max(1, TOKENS // seq)


def heads(head_dim):
    return WIDTH // head_dim


def flops(seq, head_dim, causal, backward):
    """FlashAttention's count for one call at the matrix's shape: forward, or forward + backward (3.5x)."""
    f = 4 * batch(seq) * heads(head_dim) * seq * seq * head_dim / (2 if causal else 1)
    return 3.5 * f if backward else f


def peer_name(peer, seq, head_dim, causal, backward):
    """The row name gpu_peers.py writes: sdpa_flash/... (forward + backward) or sdpa_flash_forward/..."""
    return f"{peer}{'' if backward else '_forward'}/seq:{seq}/head_dim:{head_dim}/causal:{int(causal)}"


KERNELS = {0: "automatic", 1: "wmma", 2: "mma"}  # attention_kernel's values (include/memkit/attention/bytes.hpp)
MEMKIT_FAMILY = re.compile(r"BM_flash(_forward)?_cuda(?:_(\w+))?")


def parse_memkit(name):
    """A matrix row of bench/attention_cuda.cu, e.g. BM_flash_forward_cuda/seq:4096/head_dim:64/causal:1/kernel:2/
    manual_time, as {seq, head_dim, causal, backward, variant, cudnn}; None for other rows (the B=1 x 8 heads rows
    of runs before this matrix have no causal argument). The variant names the kernel: the family's suffix
    (BM_flash_cuda_mma: mma; BM_flash_cuda_cudnn...: cudnn...) or the kernel argument, else automatic."""
    parts = name.split("/")
    family = MEMKIT_FAMILY.fullmatch(parts[0])
    if not family:
        return None
    args = {}
    for p in parts[1:]:
        if p == "manual_time":
            continue
        key, sep, value = p.partition(":")
        if not sep or not re.fullmatch(r"-?\d+", value):
            return None
        args[key] = int(value)
    if not {"seq", "head_dim", "causal"} <= args.keys():
        return None
    extra = {k: v for k, v in args.items() if k not in ("seq", "head_dim", "causal")}
    variant = family[2] or ""
    if "kernel" in extra:
        variant = "_".join(filter(None, [variant, KERNELS.get(extra.pop("kernel"), "kernel?")]))
    variant = "_".join(filter(None, [variant] + [f"{k}{v}" for k, v in sorted(extra.items())])) or "automatic"
    return {"seq": args["seq"], "head_dim": args["head_dim"], "causal": bool(args["causal"]),
            "backward": family[1] is None, "variant": variant, "cudnn": "cudnn" in variant}


def seconds_estimate(seq, head_dim, causal, backward, tflops, executions):
    """Device seconds of `executions` calls at `tflops` (FA's count)."""
    return executions * flops(seq, head_dim, causal, backward) / (tflops * 1e12)


def memkit_row_estimate(row, min_time):
    """Seconds Google Benchmark spends on one memkit row: time_with_events runs one untimed warm-up per call and
    the benchmark runs at least min_time of timed iterations (a slow row: one call of one iteration, so twice its
    time; a fast row: a few calls growing towards min_time, about 3 min_time), plus ~0.05 s of allocation. A
    cuDNN-path row is assumed as fast as torch's backends, the built-in kernels at MEMKIT_TFLOPS."""
    tflops = TORCH_TFLOPS if row["cudnn"] else MEMKIT_TFLOPS
    one = seconds_estimate(row["seq"], row["head_dim"], row["causal"], row["backward"], tflops, 1)
    return (2 * one if one >= min_time else 3 * min_time + one) + 0.05


def pairs(memkit_rows, peers):
    """results.md's attention table (#29): every matrix row of memkit beside torch's flash and cuDNN SDPA rows of
    the same shape, pass and mask. ratio = peer time / memkit time (memkit's throughput as a fraction of the
    peer's); the target applies to forward + backward against sdpa_flash (cuDNN-path rows: 0.9, others 0.5)."""
    by_name = {p.get("name"): p for p in peers}
    out = []
    for row in memkit_rows:
        m = parse_memkit(row["name"])
        if m is None:
            continue
        entry = dict(m, memkit_ms=row.get("ms"), batch=batch(m["seq"]), heads=heads(m["head_dim"]),
                     memkit_error=row.get("error"))
        count = flops(m["seq"], m["head_dim"], m["causal"], m["backward"])
        entry["memkit_TFLOPs"] = count / (row["ms"] * 1e-3) / 1e12 if row.get("ms") and not row.get("error") else None
        for peer in PEERS:
            p = by_name.get(peer_name(peer, m["seq"], m["head_dim"], m["causal"], m["backward"]))
            ms = p.get("ms") if p else None
            entry[f"{peer}_ms"] = ms
            entry[f"{peer}_TFLOPs"] = count / (ms * 1e-3) / 1e12 if ms else None
            entry[f"{peer}_skipped"] = (p.get("skipped") if p else "not measured") if not ms else None
            entry[f"{peer}_ratio"] = ms / entry["memkit_ms"] if ms and entry["memkit_TFLOPs"] else None
        target = (TARGET_CUDNN if m["cudnn"] else TARGET_BUILT_IN) if m["backward"] else None
        entry["target"] = target
        entry["meets_target"] = (entry["sdpa_flash_ratio"] >= target
                                 if target is not None and entry["sdpa_flash_ratio"] is not None else None)
        out.append(entry)
    out.sort(key=lambda e: (not e["backward"], not e["causal"], e["head_dim"], e["seq"], e["variant"]))
    return out


def table(entries, fmt):
    """The Markdown table of pairs(); fmt formats a number (measure.fmt)."""
    lines = ["| pass | causal | head_dim | seq | batch x heads | memkit kernel | memkit ms | memkit TFLOP/s | "
             "sdpa_flash TFLOP/s | sdpa_cudnn TFLOP/s | memkit / flash | memkit / cudnn | target (of flash) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def peer_cell(e, peer):
        return fmt(e[f"{peer}_TFLOPs"]) if e[f"{peer}_TFLOPs"] else "skipped"

    for e in entries:
        if e["target"] is None:
            target = "-"
        else:
            verdict = "pending" if e["meets_target"] is None else ("met" if e["meets_target"] else "not met")
            target = f"{e['target']:g}: {verdict}"
        memkit_ms = f"error: {e['memkit_error']}" if e["memkit_error"] else fmt(e["memkit_ms"])
        lines.append(f"| {'fwd+bwd' if e['backward'] else 'fwd'} | {'yes' if e['causal'] else 'no'} | {e['head_dim']} | "
                     f"{e['seq']} | {e['batch']} x {e['heads']} | {e['variant']} | {memkit_ms} | "
                     f"{fmt(e['memkit_TFLOPs'])} | {peer_cell(e, 'sdpa_flash')} | {peer_cell(e, 'sdpa_cudnn')} | "
                     f"{fmt(e['sdpa_flash_ratio'])} | {fmt(e['sdpa_cudnn_ratio'])} | {target} |")
    return lines
