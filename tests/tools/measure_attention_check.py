"""#29's attention matrix without a GPU: bench/gpu/attention_matrix.py agrees with what bench/attention_cuda.cu
registers, its FLOP count is FlashAttention's, memkit's row names pair with the peers' (bench/peers/gpu_peers.py
writes them with attention_matrix.peer_name), the table and targets, and measure.py's split of the rows by the
time budget. The figures below are made up to exercise the code: none is a measurement. Run by
tests/tools/gpu_script.cmake."""
import pathlib
import re
import sys
import tempfile

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
import attention_matrix as am  # noqa: E402
import measure  # noqa: E402


def expect(ok, what):
    if not ok:
        raise SystemExit(f"measure_attention_check: FAIL: {what}")


# The C++ registration holds the same shapes (the one place they are written twice: C++ and Python).
cu = (ROOT / "bench" / "attention_cuda.cu").read_text()
m = re.search(r"constexpr std::int64_t tokens = (\d+), width = (\d+);", cu)
expect(m and (int(m[1]), int(m[2])) == (am.TOKENS, am.WIDTH), f"tokens / width in attention_cuda.cu: {m and m.groups()}")
for name, values in (("seqs", am.SEQS), ("head_dims", am.HEAD_DIMS), ("extra_seqs", am.EXTRA_SEQS),
                     ("extra_head_dims", am.EXTRA_HEAD_DIMS)):
    m = re.search(r"\b" + name + r"\{([\d, ]+)\}", cu)
    expect(m and tuple(int(v) for v in m[1].split(",")) == values, f"{name} in attention_cuda.cu: {m and m[1]}")
registrations = re.findall(r'RegisterBenchmark\("(\w+)",[^;]*?ArgNames\(\{([^}]*)\}', cu, re.S)
expect({f for f, _ in registrations} >= {"BM_flash_cuda", "BM_flash_cuda_mma", "BM_flash_forward_cuda",
                                          "BM_flash_cuda_cudnn", "BM_flash_forward_cuda_cudnn"}, f"{registrations}")
for family, names in registrations:
    expect(names.startswith('"seq", "head_dim", "causal"'), f"{family}'s arguments do not start seq, head_dim, causal")
    expect(am.MEMKIT_FAMILY.fullmatch(family) is not None, f"{family} is not a family the pairing reads")
expect("(backward ? 3.5 : 1.0) * 4.0 * double(B * heads)" in cu and "(o.causal ? 2 : 1)" in cu,
       "attention_cuda.cu's TFLOPs counter is not FlashAttention's count")

# Shapes and FlashAttention's count: 4 B H S^2 D, causal halved, forward + backward 3.5x.
expect((am.batch(1024), am.heads(128), am.batch(16384), am.batch(32768), am.heads(64)) == (16, 16, 1, 1, 32), "shapes")
expect(am.flops(1024, 128, False, False) == 4 * 16 * 16 * 1024**2 * 128, "forward count")
expect(am.flops(1024, 128, True, False) == am.flops(1024, 128, False, False) / 2, "causal halves")
expect(am.flops(2048, 64, True, True) == 3.5 * am.flops(2048, 64, True, False), "backward 2.5x forward")
expect(am.flops(32768, 64, False, False) == 4 * 32 * 32768**2 * 64, "32K is one sequence")

# memkit's row names (Google Benchmark's, /manual_time included) as the pairing reads them.
P = am.parse_memkit
expect(P("BM_flash_cuda/seq:1024/head_dim:64/causal:1/manual_time") ==
       {"seq": 1024, "head_dim": 64, "causal": True, "backward": True, "variant": "automatic", "cudnn": False}, "automatic")
expect(P("BM_flash_cuda_mma/seq:8192/head_dim:128/causal:0/manual_time")["variant"] == "mma", "mma family")
f = P("BM_flash_forward_cuda/seq:4096/head_dim:64/causal:0/kernel:2/manual_time")
expect(f["variant"] == "mma" and not f["backward"] and not f["causal"], f"forward, kernel 2: {f}")
expect(P("BM_flash_forward_cuda/seq:4096/head_dim:64/causal:0/kernel:0")["variant"] == "automatic", "kernel 0")
c = P("BM_flash_cuda_cudnn/seq:4096/head_dim:128/causal:1/manual_time")
expect(c["variant"] == "cudnn" and c["cudnn"] and c["backward"], f"a cuDNN family: {c}")
expect(P("BM_flash_forward_cuda_cudnn/seq:4096/head_dim:128/causal:1")["cudnn"], "a cuDNN forward family")
for old in ("BM_flash_cuda/seq:1024/head_dim:64/manual_time", "BM_flash_forward_cuda/seq:1024/head_dim:64/kernel:1",
            "BM_adam_step_cuda<fp32_state>/4/manual_time", "BM_flash_cuda/seq:x/head_dim:64/causal:1"):
    expect(P(old) is None, f"not a matrix row: {old}")
expect(am.peer_name("sdpa_flash", 1024, 64, True, True) == "sdpa_flash/seq:1024/head_dim:64/causal:1", "peer name")
expect(am.peer_name("sdpa_cudnn", 1024, 64, False, False) == "sdpa_cudnn_forward/seq:1024/head_dim:64/causal:0",
       "peer forward name")

# Pairing: every memkit kernel beside both peers of the same shape, pass and mask.
memkit_rows = [{"name": "BM_flash_cuda/seq:4096/head_dim:128/causal:1/manual_time", "ms": 40.0},
               {"name": "BM_flash_cuda_cudnn/seq:4096/head_dim:128/causal:1/manual_time", "ms": 2.0},
               {"name": "BM_flash_forward_cuda/seq:4096/head_dim:128/causal:1/kernel:2/manual_time", "ms": 1.0},
               {"name": "BM_flash_cuda_mma/seq:32768/head_dim:64/causal:0/manual_time", "ms": 0.0, "error": "oom"},
               {"name": "BM_flash_cuda/seq:1024/head_dim:64/manual_time", "ms": 1.0}]  # an older run's row
peers = [{"name": "sdpa_flash/seq:4096/head_dim:128/causal:1", "ms": 2.0},
         {"name": "sdpa_cudnn/seq:4096/head_dim:128/causal:1", "skipped": "RuntimeError: no kernel"},
         {"name": "sdpa_flash_forward/seq:4096/head_dim:128/causal:1", "ms": 0.5},
         {"name": "sdpa_flash/seq:4096/head_dim:128/causal:0", "ms": 3.0}]
entries = am.pairs(memkit_rows, peers)
expect([(e["variant"], e["backward"]) for e in entries] ==
       [("automatic", True), ("cudnn", True), ("mma", True), ("mma", False)], f"order: {entries}")
auto, cudnn, oom, fwd = entries
count = am.flops(4096, 128, True, True)
expect(abs(auto["memkit_TFLOPs"] - count / 40e-3 / 1e12) < 1e-9 and abs(auto["sdpa_flash_TFLOPs"] - count / 2e-3 / 1e12)
       < 1e-9, "TFLOP/s from one count on both sides")
expect(auto["sdpa_flash_ratio"] == 0.05 and auto["target"] == 0.5 and auto["meets_target"] is False, f"built-in: {auto}")
expect(auto["sdpa_cudnn_ratio"] is None and auto["sdpa_cudnn_skipped"] == "RuntimeError: no kernel", "a skipped peer")
expect(cudnn["sdpa_flash_ratio"] == 1.0 and cudnn["target"] == 0.9 and cudnn["meets_target"] is True, f"cuDNN: {cudnn}")
expect(fwd["target"] is None and fwd["sdpa_flash_ratio"] == 0.5, f"forward rows have no target: {fwd}")
expect(oom["memkit_TFLOPs"] is None and oom["meets_target"] is None and oom["sdpa_flash_skipped"] == "not measured",
       f"a failed row: {oom}")
lines = am.table(entries, measure.fmt)
expect(lines[0].startswith("| pass | causal | head_dim | seq | batch x heads | memkit kernel |"), lines[0])
expect(lines[2] == "| fwd+bwd | yes | 128 | 4096 | 4 x 16 | automatic | 40 | 24.1 | 481 | skipped | 0.05 | - | 0.5: not met |",
       lines[2])
expect(lines[3].endswith("| cudnn | 2 | 481 | 481 | skipped | 1 | - | 0.9: met |"), lines[3])
expect(lines[4] == "| fwd+bwd | no | 64 | 32768 | 1 x 32 | mma | error: oom | - | skipped | skipped | - | - | 0.5: pending |",
       lines[4])
expect(lines[5].startswith("| fwd | yes | 128 | 4096 | 4 x 16 | mma | 1 |") and lines[5].endswith("| 0.5 | - | - |"),
       lines[5])

# results.md carries the section only where a run has matrix rows (older reports rebuild unchanged: gpu_script.cmake).
with tempfile.TemporaryDirectory() as tmp:
    report = {"device": {}, "commit": {}, "binaries": "b", "command": "c", "date": "d", "seconds": 1.0, "steps": [],
              "side_by_side": [], "benchmarks": {"attention": memkit_rows}, "peers": peers, "attention": entries,
              "attention_plan": {"tflops": 5.0, "long_rows": 24, "long_run": 10, "long_estimate_s": 95.8}}
    measure.write_report(pathlib.Path(tmp), report)
    md = (pathlib.Path(tmp) / "results.md").read_text()
    expect("## Attention against torch's SDPA (#29)" in md and "32K rows: 10 of 24 run (estimate 96 s at 5 TFLOP/s)."
           in md and "\n".join(lines) in md, "results.md's attention section")
    report.update(attention=[], benchmarks={})
    measure.write_report(pathlib.Path(tmp), report)
    expect("## Attention" not in (pathlib.Path(tmp) / "results.md").read_text(), "no section without matrix rows")

# measure.py's split: below 32K with the other benchmarks; the 32K rows by worth, as many as the budget allows.
names = [f"BM_flash_cuda/seq:{S}/head_dim:64/causal:1/manual_time" for S in (1024, 32768)] + [
    "BM_flash_forward_cuda/seq:32768/head_dim:64/causal:1/kernel:2/manual_time",
    "BM_flash_cuda_mma/seq:32768/head_dim:64/causal:0/manual_time",
    "BM_flash_cuda_mma/seq:32768/head_dim:64/causal:1/manual_time", "BM_other/7"]
short, long = measure.attention_split(names, 0.1)
expect([n for n, _ in short] == [names[0], "BM_other/7"] and short[1][1] == 1.0, f"short part: {short}")
expect([n for n, _ in long] == [names[4], names[3], names[2], names[1]], f"32K order: {long}")
one = am.seconds_estimate(32768, 64, True, True, am.MEMKIT_TFLOPS, 1)
expect(abs(long[0][1] - (2 * one + 0.05)) < 1e-9, "a slow row: warm-up + one timed call")
fast = am.memkit_row_estimate(P(names[0]), 0.1)
expect(abs(fast - (0.3 + am.seconds_estimate(1024, 64, True, True, am.MEMKIT_TFLOPS, 1) + 0.05)) < 1e-9, "a fast row")
chosen, rest = measure.attention_choose(long, long[0][1] + long[1][1] + 0.01)
expect([n for n, _ in chosen] == [names[4], names[3]] and len(rest) == 2, f"chosen: {chosen}")
expect(measure.attention_choose(long, 0) == ([], long), "nothing fits")
cudnn_row = P("BM_flash_cuda_cudnn/seq:32768/head_dim:64/causal:1")
expect(abs(am.memkit_row_estimate(cudnn_row, 0.1) - (0.3 + am.seconds_estimate(32768, 64, True, True, am.TORCH_TFLOPS, 1)
                                                     + 0.05)) < 1e-9, "a cuDNN-path row is estimated at torch's rate")
shapes = list(am.peer_shapes())
expect(len(shapes) == 6 * 2 * 2 + 4 and (4096, 96, True, (True,)) in shapes and (32768, 128, False, (True, False)) in
       shapes, f"the peers' shapes: {shapes}")
expect(all(S < 32768 for S, *_ in am.peer_shapes(quick=True)) and len(list(am.peer_shapes(quick=True))) == 24,
       "--quick leaves out 32K")
expect(am.heads(96) == 21 and am.heads(256) == 8, "heads of the extra head_dims")
expect(measure.exact_filter(names[:2]) == f"^({names[0]}|{names[1]})$", measure.exact_filter(names[:2]))
try:
    measure.exact_filter(["BM_x<float>(1)"])
    expect(False, "a name with regular-expression syntax was accepted")
except ValueError:
    pass
print("measure_attention_check: ok")
