"""`./dev.sh gpu OUTDIR`: one short run on a machine with an NVIDIA GPU that measures everything.

Runs, each with a time limit, within a total budget (default 480 s, so one short visit to a GPU machine can
run it, read it and run it again):
  1. the device's name, clocks, driver and the commit the binaries were built from;
  2. the GPU test suite (memkit_cuda_tests --memkit-gpu-suite), and attention::cudnn's tests (memkit_cudnn_tests,
     whole, when the binaries were built with MEMKIT_GPU_CUDNN=1);
  3. every CUDA benchmark (Google Benchmark, JSON);
  4. the PyTorch side of each comparison (bench/peers/gpu_peers.py, with the machine's python3; the peers it
     lacks, Liger and bitsandbytes, from the wheels ./dev.sh gpu-build carries: bench/gpu/peer_wheels.py, installed
     into a temporary folder at the start, for the peer scripts only), and torch's own
     CUDA attention (flash and cuDNN backends) against tests/data/attention's float64 reference
     (bench/peers/sdpa_device.py: the yardstick for memkit's device bounds against torch);
  5. the example's device run (memkit_example_train_llama_cuda --device cuda --short --check);
  6. memory_budget's ground truth (bench/peers/memory_grid.py, its grid v2: real transformers + PEFT (+ bitsandbytes)
     steps, peak memory; commit the rows under tests/data/budget_measured/, annotate them with
     bench/peers/compare_grid.py --annotate and compare with it);
  7. only when asked (--only longctx): #31's longest context of Llama-3.1-8B QLoRA (rank 32, all seven
     projections, batch 1, the MLP tiled by 1,024 tokens) under each of --longctx-caps (default 8 GiB, which
     fits the default budget; 24 / 48 / 80 GiB need hours each, docs/long_context.md), memkit_example_train_llama_cuda
     --max-seq-search (the model built once, one-step runs), with memory_budget's prediction, tokens/s at that
     length and Unsloth's published length beside it, then in what the budget leaves transformers + PEFT + SDPA's
     longest under the same caps (bench/peers/memory_grid.py --longest qlora:GIB --lora-rank 32)
     (docs/long_context.md's GPU table);
and writes OUTDIR/results.md (one Markdown report: tests, the side-by-side table, every benchmark row) and
OUTDIR/results.json (every figure), plus each step's log.

The binaries come from a build directory: by default build-gpu/carry/ (what `./dev.sh gpu-build` stages on
a machine without a GPU, to be carried over), else build-gpu/ itself; --bin-dir names another. Without a GPU
it says so in one line and exits 0. Standard library only: the peers script imports torch, this one does not.
"""
import argparse
import atexit
import datetime
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import attention_matrix  # noqa: E402
import peer_wheels  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]

BENCHMARKS = ["bandwidth", "quant", "adam", "attention", "loss"]


def gpu_present(nvidia_smi):
    if not shutil.which(nvidia_smi):
        return False, f"{nvidia_smi} not found"
    try:
        out = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{nvidia_smi} -L failed: {e}"
    if not re.search(r"^GPU \d+", out, re.M):
        return False, f"{nvidia_smi} -L lists no GPU"
    return True, out.strip()


def find_binaries(bin_dir):
    """Maps a role to a binary path: tests, example and bench_<name>."""
    candidates = [pathlib.Path(bin_dir)] if bin_dir else [ROOT / "build-gpu" / "carry", ROOT / "build-gpu"]
    for base in candidates:
        found = {}
        for role, rel in [("tests", "tests/memkit_cuda_tests"), ("cudnn_tests", "tests/memkit_cudnn_tests"),
                          ("example", "examples/memkit_example_train_llama_cuda")] + [
                (f"bench_{b}", f"bench/memkit_bench_{b}_cuda") for b in BENCHMARKS]:
            for p in (base / rel, base / pathlib.Path(rel).name):
                if p.is_file() and os.access(p, os.X_OK):
                    found[role] = p
                    break
        if found:
            return base, found
    return None, {}


def torch_cudnn_lib():
    """The lib/ folder of the nvidia-cudnn wheel PyTorch depends on, if this python has it (not imported: found)."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("nvidia.cudnn")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        lib = pathlib.Path(location) / "lib"
        if lib.is_dir():
            return str(lib)
    return None


def attention_plan(binary, runner, min_time, report):
    """Lists the attention binary's rows and splits them (attention_split); records the plan in
    report["attention_plan"] and returns the 32K rows, or None where the binary does not list (then it runs whole,
    as before the matrix)."""
    try:
        proc = subprocess.run([binary, "--benchmark_list_tests=true"], capture_output=True, text=True, timeout=60,
                              env=runner.env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = [l.strip() for l in proc.stdout.splitlines() if l.strip().startswith("BM_")]
    if proc.returncode != 0 or not names:
        return None
    short, long = attention_split(names, min_time)
    report["attention_plan"] = {"tflops": attention_matrix.MEMKIT_TFLOPS, "short_rows": len(short),
                                "short_estimate_s": round(sum(e for _, e in short), 1), "long_rows": len(long),
                                "long_estimate_s": round(sum(e for _, e in long), 1)}
    print(f"memkit gpu: attention: {len(short)} rows below 32K (estimate {sum(e for _, e in short):.0f} s), "
          f"{len(long)} at 32K ({sum(e for _, e in long):.0f} s) at {attention_matrix.MEMKIT_TFLOPS:g} TFLOP/s", flush=True)
    return long


class Runner:
    def __init__(self, out_dir, budget, lib_dir):
        self.out = out_dir
        self.deadline = time.monotonic() + budget
        self.steps = []
        self.env = dict(os.environ)
        # The carried libraries (Google Benchmark) and the CUDA Toolkit's (cudart, cuBLAS) where they are.
        paths = [str(p) for p in (lib_dir, pathlib.Path("/usr/local/cuda/lib64"),
                                  pathlib.Path("/usr/local/cuda/targets/x86_64-linux/lib")) if p and p.is_dir()]
        if self.env.get("LD_LIBRARY_PATH"):
            paths.append(self.env["LD_LIBRARY_PATH"])
        # cuDNN for binaries built with MEMKIT_GPU_CUDNN=1: its libraries (about 530 MB) are not carried; the
        # machine's own (beside the CUDA Toolkit) come first, else the ones PyTorch ships (nvidia-cudnn wheel).
        cudnn = torch_cudnn_lib()
        if cudnn:
            paths.append(cudnn)
        self.env["LD_LIBRARY_PATH"] = ":".join(paths)
        # The peer scripts (this python's steps) also see the carried peers' folders (install_peers); the memkit
        # binaries do not.
        self.peer_env = self.env

    def install_peers(self, wheel_dir, report):
        """Unpacks the carried wheels (build-gpu/carry/wheels, ./dev.sh gpu-build) into a temporary folder, checks
        that each imports, and puts those that do on the peer scripts' PYTHONPATH; report["peer_wheels"] says, per
        peer, its version and where it came from, or why it is skipped."""
        started = time.monotonic()
        site = tempfile.mkdtemp(prefix="memkit-peers-")
        atexit.register(shutil.rmtree, site, ignore_errors=True)
        records, paths = peer_wheels.install(wheel_dir, site, python=sys.executable, env=self.env)
        if paths:
            self.peer_env = dict(self.env, PYTHONPATH=os.pathsep.join(
                paths + ([self.env["PYTHONPATH"]] if self.env.get("PYTHONPATH") else [])))
        report["peer_wheels"] = records
        summary = "; ".join(peer_wheel_line(r) for r in records)
        self.steps.append({"step": "peer_wheels", "status": "ok", "seconds": round(time.monotonic() - started, 1)})
        print(f"memkit gpu: peer packages: {summary} ({time.monotonic() - started:.0f} s)", flush=True)

    def left(self):
        return self.deadline - time.monotonic()

    def run(self, name, cmd, limit, cwd=None):
        """Runs cmd with a limit (capped by the budget left); returns (rc or None, output); logs to OUT/name.log."""
        limit = min(limit, self.left())
        if limit < 5:
            self.steps.append({"step": name, "status": "skipped: time budget spent"})
            print(f"memkit gpu: {name}: skipped (time budget spent)", flush=True)
            return None, ""
        started = time.monotonic()
        print(f"memkit gpu: {name} (limit {limit:.0f} s) ...", flush=True)
        try:
            env = self.peer_env if cmd and cmd[0] == sys.executable else self.env
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env, cwd=cwd or ROOT)
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc = None
            output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            output += f"\nmemkit gpu: TIMED OUT after {limit:.0f} s\n"
        seconds = time.monotonic() - started
        (self.out / f"{name}.log").write_text(f"$ {' '.join(map(str, cmd))}\n{output}")
        status = "timed out" if rc is None else ("ok" if rc == 0 else f"exit {rc}")
        self.steps.append({"step": name, "status": status, "seconds": round(seconds, 1)})
        print(f"memkit gpu: {name}: {status} in {seconds:.1f} s", flush=True)
        return rc, output


def peer_wheel_line(r):
    if "skipped" in r:
        return f"{r['peer']} skipped ({r['skipped']})"
    return f"{r['peer']} {r['version']} ({r['source']})"


def device_info(nvidia_smi):
    fields = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.limit,temperature.gpu"
    try:
        line = subprocess.run([nvidia_smi, f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip().splitlines()[0]
        return dict(zip(fields.split(","), [v.strip() for v in line.split(",")]))
    except (OSError, IndexError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}


def build_stamp(base):
    """What the binaries were built from: build-gpu/carry/commit.json (./dev.sh gpu-build), else the tree's commit."""
    try:
        return json.loads((base / "commit.json").read_text())
    except (OSError, ValueError):
        pass
    try:
        describe = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                                  text=True, timeout=10).stdout.strip()
    except OSError:
        describe = "unknown"
    return {"describe": f"{describe} (binaries not stamped: the tree's commit)", "source_dir": str(ROOT)}


def link_source_dir(stamp):
    """The test binaries read tests/data through the source path they were built in; where this tree lies
    elsewhere (binaries carried from another machine), point that path here (a symbolic link) if it is free."""
    source = pathlib.Path(stamp.get("source_dir", str(ROOT)))
    if source == ROOT or source.exists():
        return None
    try:
        source.parent.mkdir(parents=True, exist_ok=True)
        source.symlink_to(ROOT, target_is_directory=True)
        return f"linked {source} -> {ROOT}"
    except OSError as e:
        return f"could not link {source} -> {ROOT} ({e}): cases reading tests/data may fail"


def parse_doctest(output):
    m = re.search(r"test cases:\s*(\d+)\s*\|\s*(\d+) passed\s*\|\s*(\d+) failed(?:\s*\|\s*(\d+) skipped)?", output)
    failed = sorted(set(re.findall(r"TEST CASE:\s+(.*)", output)))
    if not m:
        return {"parsed": False, "failed_cases": failed}
    return {"parsed": True, "cases": int(m[1]), "passed": int(m[2]), "failed": int(m[3]),
            "skipped": int(m[4] or 0), "failed_cases": failed}


def to_ms(b):
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
    return b["real_time"] * scale


def load_bench(path):
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    rows = []
    for b in data.get("benchmarks", []):
        if b.get("run_type") == "aggregate":
            continue
        row = {"name": b["name"], "ms": to_ms(b), "iterations": b.get("iterations")}
        for key, value in b.items():
            if key not in ("name", "run_name", "run_type", "repetitions", "repetition_index", "threads", "iterations",
                           "real_time", "cpu_time", "time_unit", "family_index", "per_family_instance_index", "label",
                           "error_occurred", "error_message") and isinstance(value, (int, float)):
                row[key] = value
        if b.get("error_occurred"):
            row["error"] = b.get("error_message", "error")
        rows.append(row)
    return rows


def side_by_side(memkit, peers):
    """Pairs of (operation, memkit row, peer row, note): the comparisons issue #30 asks for."""
    def mk(bench, pattern):
        for row in memkit.get(bench, []):
            if re.fullmatch(pattern, row["name"]):
                return row
        return None

    def peer(name):
        for row in peers:
            if row.get("name") == name:
                return row
        for row in peers:  # a peer skipped as a whole (bitsandbytes missing) names its rows without shapes
            if "skipped" in row and row.get("name") in (name.split("/")[0], "torch"):
                return row
        return None

    pairs = []
    for case in ("llama2_7b", "llama3_8b"):
        pairs.append((f"linear cross-entropy, frozen head (no d_head), {case}, 8192 tokens, 1/8 of the logits' memory",
                      "memkit NF4 head", mk("loss", rf"loss_bf16/{case}/nf4_head_eighth(/manual_time)?"), "memkit dense head",
                      mk("loss", rf"loss_bf16/{case}/frozen_head_eighth(/manual_time)?")))
    for S in (1024, 4096, 16384):
        for D in (64, 128):
            m = mk("attention", rf"BM_flash_cuda/seq:{S}/head_dim:{D}(/manual_time)?")
            for p in ("sdpa_flash", "sdpa_cudnn"):
                pairs.append((f"attention fwd+bwd, causal bf16, 1x8 heads, seq {S}, head_dim {D}", "memkit", m,
                              p, peer(f"{p}/seq:{S}/head_dim:{D}")))
            # #29: memkit's cuDNN path (binaries built with MEMKIT_GPU_CUDNN=1 only; its counter cudnn is 0 when
            # the row measured the built-in fallback). Runs without it have no row and no pair.
            c = mk("attention", rf"BM_flash_cuda_cudnn/seq:{S}/head_dim:{D}(/manual_time)?")
            if c is not None:
                for p in ("sdpa_flash", "sdpa_cudnn"):
                    pairs.append((f"attention fwd+bwd, causal bf16, 1x8 heads, seq {S}, head_dim {D}",
                                  "memkit cuDNN path", c, p, peer(f"{p}/seq:{S}/head_dim:{D}")))
    for case in ("llama2_7b", "llama3_8b"):
        for variant in ("fused", "fused_eighth", "fused_chunk_256MiB", "fused_chunk_1GiB", "materialized"):
            pairs.append((f"linear cross-entropy fwd+bwd, {case} head, 8192 tokens", f"memkit {variant}",
                          mk("loss", rf"loss_bf16/{case}/{variant}(/manual_time)?"), "torch materialized",
                          peer(f"materialized_ce/{case}")))
    # #30: the staged row pass beside the classic one at the same chunk budget, and next to torch's materialized
    # step, in runs that measured it (older runs have no _staged rows: no pair, so their reports rebuild unchanged).
    for case in ("llama2_7b", "llama3_8b"):
        for variant in ("fused", "fused_eighth", "materialized"):
            staged = mk("loss", rf"loss_bf16/{case}/{variant}_staged(/manual_time)?")
            if staged is None:
                continue
            pairs.append((f"linear cross-entropy fwd+bwd, {case} head, 8192 tokens", f"memkit {variant} (staged row pass)",
                          staged, f"memkit {variant} (classic row pass)",
                          mk("loss", rf"loss_bf16/{case}/{variant}(/manual_time)?")))
            pairs.append((f"linear cross-entropy fwd+bwd, {case} head, 8192 tokens", f"memkit {variant} (staged row pass)",
                          staged, "torch materialized", peer(f"materialized_ce/{case}")))
    # #30: Liger's fused linear cross-entropy (carried as a wheel) beside memkit's fused loss, in runs that recorded it
    # (measured, or skipped with its reason); older runs (liger_kernel never tried) get no pairs and rebuild unchanged.
    if liger_recorded(peers):
        for case in ("llama2_7b", "llama3_8b"):
            for variant in ("fused", "fused_eighth"):
                m = mk("loss", rf"loss_bf16/{case}/{variant}(/manual_time)?")
                for label, name in (("liger flce", "liger_flce"), ("liger flce, fp32 accumulation", "liger_flce_fp32_accum")):
                    pairs.append((f"linear cross-entropy fwd+bwd, {case} head, 8192 tokens", f"memkit {variant}", m,
                                  label, peer(f"{name}/{case}") or peer("liger_flce")))
    for state, peer_name in (("fp32_state", "torch_fused_adamw/fp32"), ("fp32_state", "torch_fused_adamw_clip/fp32"),
                             ("bf16_state", "torch_fused_adamw/fp32"), ("int8_256_state", "bnb_adamw8bit"),
                             ("int8_256_state", "torch_fused_adamw/fp32"), ("int4_state", "torch_fused_adamw/fp32")):
        m = mk("adam", rf"BM_adam_step_cuda<{state}>/4(/manual_time)?")
        if m is not None:
            m = dict(m, ms=m.get("ms_per_step", m["ms"]))
        pairs.append((f"AdamW step, 75.0M fp32 parameters in 48 tensors (ms per step, 4 back to back)",
                      f"memkit {state}", m, peer_name, peer(peer_name)))
    # #30: the prefetching update beside the previous kernel, in runs that measured both (older runs have no
    # previous-kernel rows: no pair, so their reports rebuild unchanged).
    for state in ("fp32_state", "bf16_state", "int8_256_state", "int4_state"):
        m = mk("adam", rf"BM_adam_step_cuda<{state}>/4(/manual_time)?")
        prev = mk("adam", rf"BM_adam_step_cuda_previous<{state}>/4(/manual_time)?")
        if prev is None:
            continue
        if m is not None:
            m = dict(m, ms=m.get("ms_per_step", m["ms"]))
        prev = dict(prev, ms=prev.get("ms_per_step", prev["ms"]))
        pairs.append((f"AdamW step, 75.0M fp32 parameters in 48 tensors (ms per step, 4 back to back)",
                      f"memkit {state} (prefetching update)", m, f"memkit {state} (previous update kernel)", prev))
    for M in (1, 8, 256, 1024, 4096):
        m = mk("quant", rf"BM_cuda_matmul_nf4/{M}(/manual_time)?")
        pairs.append((f"y = x W^T, W 8192x8192, M {M}", "memkit NF4", m, "memkit dense bf16 (cuBLAS)",
                      mk("quant", rf"BM_cuda_matmul_dense_bf16/{M}(/manual_time)?")))
        pairs.append((f"y = x W^T, W 8192x8192, M {M}", "memkit NF4", m, "torch bf16", peer(f"torch_bf16/{M}")))
        previous = mk("quant", rf"BM_cuda_matmul_nf4_shared_codebook/{M}(/manual_time)?")
        if previous is not None:  # #30: the register-codebook GEMV beside the previous shared-memory one (M 1, 8)
            pairs.append((f"y = x W^T, W 8192x8192, M {M}", "memkit NF4 (shuffle codebook)", m,
                          "memkit NF4 (previous: shared-memory codebook)", previous))
        pairs.append((f"y = x W^T, W 8192x8192, M {M}", "memkit NF4", m, "bnb matmul_4bit", peer(f"bnb_matmul_4bit/{M}")))
        m = mk("quant", rf"BM_cuda_matmul_input_grad_nf4/{M}(/manual_time)?")
        pairs.append((f"dx = dy W, W 8192x8192, M {M}", "memkit NF4", m, "memkit dense bf16 (cuBLAS)",
                      mk("quant", rf"BM_cuda_matmul_input_grad_dense_bf16/{M}(/manual_time)?")))
        pairs.append((f"dx = dy W, W 8192x8192, M {M}", "memkit NF4", m, "torch bf16", peer(f"torch_bf16_input_grad/{M}")))
    # #30: Llama-8B layer shapes at training M, the NF4 product and dense bf16 cuBLAS timed in the same iterations
    # (bench/quant_cuda.cu, BM_cuda_matmul_nf4_vs_dense; target: ratio at most 1.25). Older runs have no such rows.
    for row in memkit.get("quant", []):
        shape = re.fullmatch(r"BM_cuda_matmul_nf4_vs_dense/(forward|input_grad)/M:(\d+)/K:(\d+)/N:(\d+)(/manual_time)?",
                             row["name"])
        if shape is None or "dense_ms" not in row:
            continue
        product = "y = x W^T" if shape[1] == "forward" else "dx = dy W"
        pairs.append((f"{product}, K {shape[3]} x N {shape[4]}, M {shape[2]}, same iterations (target ratio <= 1.25)",
                      "memkit NF4", row, "memkit dense bf16 (cuBLAS)", {"ms": row["dense_ms"]}))
    pairs.append(("dequantize NF4 -> bf16, 2^28 values", "memkit", mk("quant", r"BM_cuda_dequantize/nf4(/manual_time)?"),
                  "bnb dequantize_4bit", peer("bnb_dequantize_nf4/2^28")))
    out = []
    for op, mk_label, m, peer_label, p in pairs:
        row = {"operation": op, "memkit": mk_label, "memkit_ms": m["ms"] if m else None, "peer": peer_label,
               "peer_ms": p.get("ms") if p else None, "peer_skipped": p.get("skipped") if p else "not measured"}
        if row["memkit_ms"] and row["peer_ms"]:
            row["ratio"] = row["memkit_ms"] / row["peer_ms"]
        for key in ("TFLOPs", "GFLOPs", "fraction_of_roofline", "peak_workspace_MiB", "cudnn"):
            if m and key in m:
                row[f"memkit_{key}"] = m[key]
            if p and key in p:
                row[f"peer_{key}"] = p[key]
        if p and "peak_MiB" in p:
            row["peer_peak_MiB"] = p["peak_MiB"]
        if m is None and row["peer_ms"] is None:
            continue
        out.append(row)
    return out


# Skipped-row reasons of gpu_peers.py before it timed Liger: runs carrying them never tried liger_kernel.
LIGER_LEGACY = ("liger_kernel not installed", "liger_kernel imports but is not timed yet")


def liger_recorded(peers):
    return any(r.get("name", "").startswith("liger_flce/") or
               (r.get("name") == "liger_flce" and r.get("skipped") not in LIGER_LEGACY) for r in peers)


def loss_table(memkit, peers):
    """#30's linear cross-entropy comparison, per head: memkit's loss rows and the peers' (torch's materialized
    logits, Liger), each with its time and memory beside torch's materialized step. Memory is what the step needs
    beyond its inputs and the gradients it returns: memkit's peak workspace (tracking_resource), the peers' peak
    allocation minus their gradients. Empty for runs that did not record Liger (their reports rebuild unchanged)."""
    if not liger_recorded(peers):
        return []
    out = []
    for case in ("llama2_7b", "llama3_8b"):
        rows = []
        for r in memkit.get("loss", []):
            m = re.fullmatch(rf"loss_bf16/{case}/((?:fused|materialized)\w*)(/manual_time)?", r["name"])
            if m:
                rows.append({"implementation": f"memkit {m[1]}", "ms": r["ms"], "MiB": r.get("peak_workspace_MiB")})
        for name, label in (("materialized_ce", "torch materialized"), ("liger_flce", "liger flce"),
                            ("liger_flce_fp32_accum", "liger flce, fp32 accumulation")):
            r = next((p for p in peers if p.get("name") == f"{name}/{case}"), None)
            if r is None and name.startswith("liger"):
                r = next((p for p in peers if p.get("name") == "liger_flce"), None)
            if r is None:
                continue
            if "skipped" in r:
                rows.append({"implementation": label, "skipped": r["skipped"]})
            else:
                rows.append({"implementation": label, "ms": r["ms"], "loss": r.get("loss"),
                             "MiB": r["peak_MiB"] - r["grads_MiB"] if "grads_MiB" in r else None})
        base = next((r for r in rows if r["implementation"] == "torch materialized" and "ms" in r), None)
        for r in rows:
            r["case"] = case
            if base and r.get("ms"):
                r["time_vs_materialized"] = r["ms"] / base["ms"]
            if base and base.get("MiB") and r.get("MiB") is not None:
                r["memory_vs_materialized"] = r["MiB"] / base["MiB"]
        out += rows
    return out


# #29's attention matrix: the rows below 32K run with the other benchmarks; the 32K rows (two thirds of the matrix's
# time) run after the peers, as many as the budget leaves room for after keeping this much for the later steps.
ATTENTION_LONG_SEQ = 32768
ATTENTION_RESERVE_S = 180


def attention_split(names, min_time):
    """The attention binary's rows (its --benchmark_list_tests) as (rows below 32K, 32K rows), each a list of
    (name, estimated seconds); the 32K rows in the order they are worth running: kernels other than `automatic`
    first (automatic runs the WMMA kernels today), forward + backward before forward, causal first."""
    short, long = [], []
    for name in names:
        m = attention_matrix.parse_memkit(name)
        if m is None:  # not a matrix row: a guess, and it runs with the short part
            short.append((name, 1.0))
            continue
        row = (name, attention_matrix.memkit_row_estimate(m, min_time), m)
        (long if m["seq"] >= ATTENTION_LONG_SEQ else short).append(row)
    long.sort(key=lambda r: (r[2]["variant"] == "automatic", not r[2]["backward"], not r[2]["causal"], r[2]["head_dim"],
                             r[0]))
    return [r[:2] for r in short], [r[:2] for r in long]


def attention_choose(rows, seconds):
    """The first rows (in the given order) whose estimates fit in `seconds`, and the rest."""
    chosen, total = [], 0.0
    for name, estimate in rows:
        if total + estimate > seconds:
            break
        chosen.append((name, estimate))
        total += estimate
    return chosen, rows[len(chosen):]


def exact_filter(names):
    """A --benchmark_filter matching exactly these rows (their names hold no regular-expression syntax)."""
    for n in names:
        if not re.fullmatch(r"[\w/:]+", n):
            raise ValueError(f"benchmark name {n!r} needs escaping")
    return "^(" + "|".join(names) + ")$"


def fmt(v, digits=3):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


# Unsloth's published longest context for Llama-3.1-8B QLoRA (rank 32, all seven projections, batch 1) at 8 to 80
# GB (issue #31, docs/long_context.md): the bar the longctx step's lengths are set beside, by cap in MiB.
UNSLOTH_PUBLISHED = {8192: 2972, 12288: 21848, 16384: 40724, 24576: 78475, 40960: 153977, 49152: 191728, 81920: 342733}

LONGCTX_FOUND = re.compile(r"longest sequence under (\d+) MiB .*?: (\d+) tokens trains a step \((\d+) one-step runs\); "
                           r"memory_budget's memkit runtime predicts (\d+) \(([-+]?[\d.]+)%\)")
LONGCTX_AT = re.compile(r"at (\d+) tokens: (\d+) tokens/s \(one step, ([\d.]+) s\), tracked peak ([\d.]+ \w+) "
                        r"\(memory_budget ([\d.]+ \w+), ([-+]?[\d.]+)%")
LONGCTX_BUILT = re.compile(r"built the model and its optimizer once for the search in ([\d.]+) s")


def parse_longctx(lines):
    """The figures of one train_llama --max-seq-search run from its lines (None where a line is missing)."""
    r = {"found": None, "runs": None, "predicted": None, "prediction_error_pct": None, "tokens_per_s": None,
         "step_seconds": None, "tracked_peak": None, "budget_peak": None, "peak_error_pct": None,
         "build_seconds": None, "checks": None}
    checks = []
    for l in lines:
        m = LONGCTX_FOUND.search(l)
        if m:
            r.update(found=int(m[2]), runs=int(m[3]), predicted=int(m[4]), prediction_error_pct=float(m[5]))
        m = LONGCTX_AT.match(l)
        if m:
            r.update(tokens_per_s=int(m[2]), step_seconds=float(m[3]), tracked_peak=m[4], budget_peak=m[5],
                     peak_error_pct=float(m[6]))
        m = LONGCTX_BUILT.search(l)
        if m:
            r["build_seconds"] = float(m[1])
        if l.startswith("check:"):
            checks.append(l.split()[1] == "ok")
    if checks:
        r["checks"] = "ok" if all(checks) else f"{checks.count(False)} of {len(checks)} failed"
    return r


def peer_longest(grid, cap_mib):
    """transformers + PEFT + SDPA's longest sequence under cap_mib from bench/peers/memory_grid.py's JSON (its
    "longest" entries, caps in GiB): tokens, tokens/s of its longest step, whether the bisection finished."""
    for e in (grid or {}).get("longest", []):
        if round(float(e.get("cap_gib", 0)) * 1024) == cap_mib:
            steps = [t for t in e.get("tries", []) if len(t) > 2 and t[1] == "ok" and t[0] == e.get("longest_tokens")]
            return {"tokens": e.get("longest_tokens"), "complete": e.get("complete"), "granularity": e.get("granularity"),
                    "tokens_per_s": round(steps[0][0] / steps[0][2]) if steps and steps[0][2] > 0 else None}
    return None


def peer_cell(peer):
    if not peer:
        return "not run"
    if "skipped" in peer:
        return f"skipped: {peer['skipped']}"
    tokens = f"{peer['tokens']:,}" if isinstance(peer.get("tokens"), int) else "-"
    speed = f" ({peer['tokens_per_s']:,})" if isinstance(peer.get("tokens_per_s"), int) else ""
    return tokens + speed + ("" if peer.get("complete", True) else ", search cut short")


def longctx_table(rows):
    """results.md's table of the longctx step: memkit's found length beside memory_budget and Unsloth's figure."""
    def count(v):
        return f"{v:,}" if isinstance(v, int) else "-"
    lines = ["| cap | Unsloth (published) | memkit, longest found | vs Unsloth | tokens/s at it | memory_budget | "
             "prediction error | one-step runs | checks | transformers + PEFT + SDPA (tokens/s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        unsloth = UNSLOTH_PUBLISHED.get(r["cap_mib"])
        if "skipped" in r:
            lines.append(f"| {r['cap_mib']} MiB | {count(unsloth)} | skipped: {r['skipped']} | - | - | - | - | - | - | - |")
            continue
        p = r.get("parsed", {})
        found = p.get("found")
        ratio = f"{found / unsloth:.2f}x" if found and unsloth else "-"
        error = f"{p['prediction_error_pct']:+.2f}%" if p.get("prediction_error_pct") is not None else "-"
        lines.append(f"| {r['cap_mib']} MiB | {count(unsloth)} | {count(found)} | {ratio} | {fmt(p.get('tokens_per_s'))} | "
                     f"{count(p.get('predicted'))} | {error} | {fmt(p.get('runs'))} | "
                     f"{p.get('checks') or 'exit ' + str(r.get('status'))} | {peer_cell(r.get('peer'))} |")
    return lines


def sdpa_device_table(rows):
    """results.md's section for bench/peers/sdpa_device.py's rows (none for runs before it existed)."""
    if not rows:
        return []
    info = next((r for r in rows if r.get("name") == "info"), {})
    lines = ["", "## torch's SDPA on the device against the float64 reference (tests/data/attention)", "",
             f"torch {info.get('torch', '?')} (CUDA {info.get('cuda', '?')}, cuDNN {info.get('cudnn', '?')}) on "
             f"{info.get('device', '?')}; max |x - ref| / max |ref| per tensor, lse absolute (the lse the backend's "
             "aten op saves); torch CPU: torch's own CPU run in that dtype, from the file "
             "(bench/peers/sdpa_device.py).",
             "", "| case | backend | out | dq | dk | dv | lse | torch CPU |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("name") == "info":
            continue
        if "skipped" in r:
            lines.append(f"| {r.get('case', r.get('name'))} | {r.get('backend', '-')} | skipped: {r['skipped']} "
                         "| | | | | |")
            continue
        lse = fmt(r["lse"]) if "lse" in r else f"skipped: {r.get('lse_skipped', '?')}"
        backend = r["backend"] + (" (K, V heads repeated)" if r.get("kv_heads") == "repeated" else "")
        lines.append(f"| {r['case']} | {backend} | {fmt(r['out'])} | {fmt(r['dq'])} | {fmt(r['dk'])} | "
                     f"{fmt(r['dv'])} | {lse} | {fmt(r['torch_cpu'])} |")
    return lines


def write_report(out, report):
    (out / "results.json").write_text(json.dumps(report, indent=1))
    lines = ["# memkit GPU measurements", ""]
    info = report["device"]
    lines.append(f"- device: {info.get('name', '?')}, {info.get('memory.total', '?')}, driver {info.get('driver_version', '?')}; "
                 f"clocks SM {info.get('clocks.sm', '?')} (max {info.get('clocks.max.sm', '?')}), memory {info.get('clocks.mem', '?')} "
                 f"(max {info.get('clocks.max.mem', '?')}); power limit {info.get('power.limit', '?')}")
    c = report["commit"]
    lines.append(f"- binaries: {report['binaries']}, built from {c.get('describe')} ({c.get('commit', '?')}), "
                 f"nvcc {c.get('nvcc', '?')}, CUDA architectures {c.get('arch', '?')}, {c.get('built', '?')}")
    lines.append(f"- peers: {report.get('peer_versions', '-')}")
    if report.get("peer_wheels"):
        lines.append(f"- peer packages: {'; '.join(peer_wheel_line(r) for r in report['peer_wheels'])}")
    lines.append(f"- command: `{report['command']}`, {report['date']}, {report['seconds']:.0f} s")
    lines.append("")
    lines.append("## Steps")
    lines.append("")
    lines.append("| step | status | seconds |")
    lines.append("|---|---|---|")
    for s in report["steps"]:
        lines.append(f"| {s['step']} | {s['status']} | {s.get('seconds', '-')} |")
    t = report.get("gpu_suite", {})
    lines.append("")
    if t.get("parsed"):
        lines.append(f"GPU suite: {t['passed']} of {t['cases']} cases passed, {t['failed']} failed"
                     + (f" ({', '.join(t['failed_cases'])})" if t["failed_cases"] else "") + ".")
    else:
        lines.append("GPU suite: no doctest summary (see gpu_suite.log).")
    t = report.get("cudnn_gpu_suite")
    if t is not None:  # only runs whose binaries were built with MEMKIT_GPU_CUDNN=1
        lines.append("")
        lines.append(f"cuDNN path's GPU suite: {t['passed']} of {t['cases']} cases passed, {t['failed']} failed"
                     + (f" ({', '.join(t['failed_cases'])})" if t["failed_cases"] else "") + "." if t.get("parsed")
                     else "cuDNN path's GPU suite: no doctest summary (see cudnn_gpu_suite.log).")
    lines += ["", "## Side by side", "", "ratio = memkit time / peer time (below 1: memkit faster).", "",
              "| operation | memkit | ms | peer | ms | ratio | memkit figure |", "|---|---|---|---|---|---|---|"]
    for r in report["side_by_side"]:
        figure = ", ".join(f"{k[7:]} {fmt(v)}" for k, v in r.items() if k.startswith("memkit_") and k != "memkit_ms")
        peer_ms = fmt(r["peer_ms"]) if r["peer_ms"] is not None else f"skipped: {r['peer_skipped']}"
        lines.append(f"| {r['operation']} | {r['memkit']} | {fmt(r['memkit_ms'])} | {r['peer']} | {peer_ms} | "
                     f"{fmt(r.get('ratio'))} | {figure or '-'} |")
    loss = report.get("loss_peers")
    if loss:  # runs before Liger was carried have none: their reports rebuild unchanged
        lines += ["", "## Linear cross-entropy: memkit, Liger and torch (#30)", "",
                  "bf16 hidden and head, forward + backward into both, 8,192 tokens (bench/loss_cuda.cu's shapes). "
                  "MiB: what the step needs beyond its inputs and the gradients it returns (memkit: peak workspace; "
                  "peers: peak allocation minus their gradients). x materialized: against torch's materialized "
                  "logits + cross-entropy; #30's target for memkit's fused loss is at most 1.2x its time at most "
                  "1/8 of its memory.", "",
                  "| head | implementation | ms | x materialized time | MiB | x materialized memory | loss |",
                  "|---|---|---|---|---|---|---|"]
        for r in loss:
            if "skipped" in r:
                lines.append(f"| {r['case']} | {r['implementation']} | skipped: {r['skipped']} | | | | |")
                continue
            lines.append(f"| {r['case']} | {r['implementation']} | {fmt(r.get('ms'))} | {fmt(r.get('time_vs_materialized'))} | "
                         f"{fmt(r.get('MiB'))} | {fmt(r.get('memory_vs_materialized'))} | {fmt(r.get('loss'), 6)} |")
    attention = report.get("attention")
    if attention:  # runs before #29's matrix have no such rows: their reports rebuild unchanged
        plan = report.get("attention_plan") or {}
        lines += ["", "## Attention against torch's SDPA (#29)", "",
                  "bf16, batch = 16384 / seq (at least 1), heads = 2048 / head_dim; TFLOP/s in FlashAttention's count "
                  "(causal halves it, backward 2.5x forward) for both sides; memkit / peer = peer time / memkit time; "
                  f"target: the issue's, forward + backward against sdpa_flash ({attention_matrix.TARGET_BUILT_IN:g} "
                  f"built-in, {attention_matrix.TARGET_CUDNN:g} cuDNN path)."
                  + (f" 32K rows: {plan['long_run']} of {plan['long_rows']} run (estimate {plan['long_estimate_s']:.0f} s "
                     f"at {plan['tflops']:g} TFLOP/s)." if plan.get("long_rows") else ""), ""]
        lines += attention_matrix.table(attention, fmt)
    lines += ["", "## Every benchmark row", "", "| benchmark | row | ms | counters |", "|---|---|---|---|"]
    for bench, rows in report["benchmarks"].items():
        for r in rows:
            counters = ", ".join(f"{k} {fmt(v)}" for k, v in r.items() if k not in ("name", "ms", "iterations"))
            lines.append(f"| {bench} | {r['name']} | {fmt(r['ms'])} | {counters} |")
    lines += ["", "## Peer rows", "", "| group | row | ms | figures |", "|---|---|---|---|"]
    for r in report["peers"]:
        extra = ", ".join(f"{k} {fmt(v)}" for k, v in r.items() if k not in ("group", "name", "ms"))
        lines.append(f"| {r.get('group')} | {r.get('name')} | {fmt(r.get('ms'))} | {extra} |")
    lines += sdpa_device_table(report.get("sdpa_device"))
    grid = report.get("memory_grid")
    if grid:
        lines += ["", "## memory_budget's ground truth", "",
                  f"{grid['rows']} measured rows and {grid.get('longest', 0)} longest-sequence searches in {grid['file']} "
                  "(bench/peers/compare_grid.py puts memkit-budget beside them)."]
    models = report.get("models")
    if models:
        lines += ["", "## Real model shapes: a QLoRA step at 1 x 2048 tokens (random weights)", ""]
        for m in models:
            lines.append(f"- {m['config']}: " + (m["skipped"] if "skipped" in m else ""))
            for l in m.get("memkit", []):
                lines.append(f"  - memkit: {l.strip()}")
            peer = m.get("peer")
            if peer:
                lines.append("  - transformers + PEFT: " + (peer["skipped"] if "skipped" in peer else
                             f"{fmt(peer['tokens_per_s'])} tokens/s, peak allocated {fmt(peer['peak_allocated_gib'])} GiB, "
                             f"base {peer['base']}"))
    longctx = report.get("long_context")
    if longctx:
        lines += ["", "## The longest context under a cap (#31): Llama-3.1-8B QLoRA r 32, batch 1", ""]
        lines += longctx_table(longctx) + [""]
        for r in longctx:
            lines.append(f"- {r['cap_mib']} MiB: " + (r["skipped"] if "skipped" in r else f"exit {r['status']}"))
            for l in r.get("lines", []):
                lines.append(f"  - {l}")
    ex = report.get("example")
    if ex:
        lines += ["", "## The example on the device", "", "```", ex, "```"]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="gpu-results", help="directory for results.md, results.json, logs")
    parser.add_argument("--bin-dir", help="where the CUDA binaries are (default build-gpu/carry, then build-gpu)")
    parser.add_argument("--budget", type=float, default=480, help="seconds for the whole run (default 480)")
    parser.add_argument("--quick", action="store_true", help="fewer benchmark repetitions and peer shapes")
    parser.add_argument("--only", default="tests,bench,peers,sdpa,example,models,grid",
                        help="comma-separated steps to run")
    parser.add_argument("--benchmark-filter", default=None, help="passed to every benchmark binary")
    parser.add_argument("--longctx-caps", default="8192",
                        help="MiB caps of the longctx step (not run unless --only names it). The default fits one "
                             "visit; 24576,49152,81920 take hours per cap with memkit's attention kernel as "
                             "measured (docs/long_context.md, 'How long the GPU step takes')")
    parser.add_argument("--longctx-mlp-chunk", type=int, default=1024,
                        help="tokens per chunk of the sequence-tiled MLP in the longctx step (default 1024: "
                             "docs/long_context.md)")
    parser.add_argument("--report-from", metavar="RESULTS_JSON",
                        help="measure nothing: rebuild results.md (and the side-by-side table) in OUT from a results.json")
    parser.add_argument("--nvidia-smi", default="nvidia-smi", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.report_from:
        report = json.loads(pathlib.Path(args.report_from).read_text())
        report["side_by_side"] = side_by_side(report["benchmarks"], report["peers"])
        attention = attention_matrix.pairs(report["benchmarks"].get("attention", []), report["peers"])
        if attention or "attention" in report:
            report["attention"] = attention
        loss = loss_table(report["benchmarks"], report["peers"])
        if loss or "loss_peers" in report:
            report["loss_peers"] = loss
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_report(out, report)
        print(f"memkit gpu: rewrote {out / 'results.md'} from {args.report_from}")
        return 0

    present, why = gpu_present(args.nvidia_smi)
    if not present:
        print(f"memkit gpu: no NVIDIA GPU here ({why}): nothing measured")
        return 0
    started = time.monotonic()
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    base, binaries = find_binaries(args.bin_dir)
    if not binaries:
        print("memkit gpu: no CUDA binaries found: run `./dev.sh gpu-build` (here, or on a machine without a GPU "
              "and carry build-gpu/carry), or pass --bin-dir", file=sys.stderr)
        return 1
    runner = Runner(out, args.budget, base / "lib")
    only = set(args.only.split(","))
    report = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": " ".join(["./dev.sh gpu"] + sys.argv[1:]), "device": device_info(args.nvidia_smi),
              "binaries": str(base.relative_to(ROOT) if base.is_relative_to(ROOT) else base),
              "commit": build_stamp(base), "steps": [], "benchmarks": {}, "peers": []}
    report["source_link"] = link_source_dir(report["commit"])
    print(f"memkit gpu: {report['device'].get('name', '?')}, binaries from {report['binaries']} "
          f"({report['commit'].get('describe')}){'; ' + report['source_link'] if report['source_link'] else ''}", flush=True)

    if only & {"peers", "sdpa", "models", "grid", "longctx"}:
        # The wheels beside the binaries (build-gpu/carry/wheels), else build-gpu/carry's where the binaries are
        # build-gpu's own.
        wheels = next((d for d in (base / "wheels", ROOT / "build-gpu" / "carry" / "wheels") if d.is_dir()), None)
        runner.install_peers(wheels, report)
    if "tests" in only and "tests" in binaries:
        rc, output = runner.run("gpu_suite", [binaries["tests"], "--memkit-gpu-suite"], 200)
        report["gpu_suite"] = parse_doctest(output)
    if "tests" in only and "cudnn_tests" in binaries:
        # The whole binary: its host cases (cuDNN finalizes the graphs' descriptors) and its gpu suite.
        runner.run("cudnn_tests", [binaries["cudnn_tests"]], 60)
        rc, output = runner.run("cudnn_gpu_suite", [binaries["cudnn_tests"], "--memkit-gpu-suite"], 120)
        report["cudnn_gpu_suite"] = parse_doctest(output)
    min_time = "0.05" if args.quick else "0.1"
    attention_long = None
    if "bench" in only:
        for b in BENCHMARKS:
            if f"bench_{b}" not in binaries:
                runner.steps.append({"step": f"bench_{b}", "status": "missing binary"})
                continue
            json_path = out / f"bench_{b}.json"
            cmd = [binaries[f"bench_{b}"], f"--benchmark_out={json_path}", "--benchmark_out_format=json",
                   f"--benchmark_min_time={min_time}"]
            if args.benchmark_filter:
                cmd.append(f"--benchmark_filter={args.benchmark_filter}")
            elif b == "attention":
                # The matrix below 32K now, its 32K rows after the peers; a binary that does not list its rows still
                # leaves out the 32K ones (two thirds of the time), which would overrun the step's limit.
                attention_long = attention_plan(binaries[f"bench_{b}"], runner, float(min_time), report)
                cmd.append(f"--benchmark_filter=-seq:{ATTENTION_LONG_SEQ}")
                limit = 2 * report["attention_plan"]["short_estimate_s"] if attention_long is not None else 0
                runner.run(f"bench_{b}", cmd, max(120, limit))
                report["benchmarks"][b] = load_bench(json_path)
                continue
            runner.run(f"bench_{b}", cmd, 120)
            report["benchmarks"][b] = load_bench(json_path)
    if "peers" in only:
        peers_json = out / "peers.json"
        cmd = [sys.executable, str(ROOT / "bench/peers/gpu_peers.py"), "--out", str(peers_json)] + (["--quick"] if args.quick else [])
        runner.run("peers", cmd, 150)
        try:
            report["peers"] = json.loads(peers_json.read_text())
        except (OSError, ValueError):
            report["peers"] = [{"group": "all", "name": "peers", "skipped": "the peers script wrote nothing (see peers.log)"}]
        versions = [f"{r['name']} {r.get('version')}" + (f" (CUDA {r['cuda']}, cuDNN {r['cudnn']})" if "cuda" in r else "")
                    for r in report["peers"] if r.get("group") == "info"]
        report["peer_versions"] = ", ".join(versions) or "-"
    if "sdpa" in only:
        # torch's CUDA SDPA on tests/data/attention's cases: how far torch itself is from the float64 reference.
        sdpa_json = out / "sdpa_device.json"
        runner.run("sdpa_device", [sys.executable, str(ROOT / "bench/peers/sdpa_device.py"), "--out", str(sdpa_json)],
                   90)
        try:
            report["sdpa_device"] = json.loads(sdpa_json.read_text())
        except (OSError, ValueError):
            report["sdpa_device"] = [{"group": "sdpa_device", "name": "all",
                                      "skipped": "the script wrote nothing (see sdpa_device.log)"}]
    if attention_long:
        # #29's 32K rows, in what the budget leaves after ATTENTION_RESERVE_S for the steps below.
        plan = report["attention_plan"]
        if args.quick:
            chosen, left_out, why = [], attention_long, "--quick"
        else:
            chosen, left_out = attention_choose(attention_long, runner.left() - ATTENTION_RESERVE_S)
            why = "the time budget"
        plan.update(long_run=len(chosen), long_left_out=[n for n, _ in left_out])
        if chosen:
            json_path = out / "bench_attention_32k.json"
            runner.run("bench_attention_32k", [binaries["bench_attention"], f"--benchmark_out={json_path}",
                                               "--benchmark_out_format=json", f"--benchmark_min_time={min_time}",
                                               f"--benchmark_filter={exact_filter([n for n, _ in chosen])}"],
                       2 * sum(e for _, e in chosen) + 30)
            report["benchmarks"]["attention"] = report["benchmarks"].get("attention", []) + load_bench(json_path)
        if left_out:
            runner.steps.append({"step": "bench_attention_32k", "status": f"skipped: {len(left_out)} of "
                                 f"{len(attention_long)} rows ({why})"})
    if "example" in only and "example" in binaries:
        rc, output = runner.run("example", [binaries["example"], "--device", "cuda", "--short", "--check",
                                               "--data", str(ROOT / "examples/data")], 120, cwd=out)
        report["example"] = "\n".join(output.strip().splitlines()[-25:])
    if "models" in only and "example" in binaries:
        # #28: a QLoRA step of real model shapes (random weights) in memkit and in transformers + PEFT, same device.
        report["models"] = []
        for config, limit in (("llama-3.2-1b.json", 150), ("llama-3.1-8b.json", 240)):
            if runner.left() < limit + 60:
                report["models"].append({"config": config, "skipped": "not enough of the budget left"})
                continue
            cfg = str(ROOT / "tests/data/configs" / config)
            tag = config.removesuffix(".json")
            rc, output = runner.run(f"models_memkit_{tag}", [binaries["example"], "--device", "cuda", "--init", "random",
                                                          "--config", cfg, "--batch", "1", "--seq", "2048", "--accum", "1",
                                                          "--finetune-steps", "3", "--check", "--out", str(out / tag)],
                                    limit, cwd=out)
            summary = [l for l in output.splitlines() if l.startswith("summary:") or "peak predicted" in l or l.startswith("check:")]
            peer_json = out / f"models_peer_{tag}.json"
            runner.run(f"models_peer_{tag}", [sys.executable, str(ROOT / "bench/peers/qlora_step.py"), "--config", cfg,
                                              "--seq", "2048", "--steps", "3", "--out", str(peer_json)], limit)
            try:
                peer = json.loads(peer_json.read_text())
            except (OSError, ValueError):
                peer = {"skipped": "the peer wrote nothing (see its log)"}
            report["models"].append({"config": config, "memkit": summary, "peer": peer})
    if "grid" in only:
        grid_json = out / "memory_grid.json"
        runner.run("memory_grid", [sys.executable, str(ROOT / "bench/peers/memory_grid.py"), "--out", str(grid_json),
                                   "--budget", str(max(0, min(205, runner.left() - 25)))], 240)
        try:
            grid = json.loads(grid_json.read_text())
            report["memory_grid"] = {"rows": len(grid["rows"]), "longest": len(grid["longest"]), "file": grid_json.name}
        except (OSError, ValueError, KeyError):
            report["memory_grid"] = {"rows": 0, "file": None}
    if "longctx" in only and "example" in binaries:
        # #31: the longest sequence that trains a step under each cap, found by real runs, next to memory_budget.
        report["long_context"] = []
        cfg = str(ROOT / "tests/data/configs/llama-3.1-8b.json")
        for cap in [c for c in args.longctx_caps.split(",") if c]:
            if runner.left() < 120:
                report["long_context"].append({"cap_mib": int(cap), "skipped": "not enough of the budget left"})
                continue
            rc, output = runner.run(f"longctx_{cap}", [binaries["example"], "--device", "cuda", "--init", "random",
                                                       "--config", cfg, "--rank", "32", "--batch", "1", "--accum", "1",
                                                       "--max-seq-search", "--memory-cap", cap, "--check",
                                                       "--mlp-chunk", str(args.longctx_mlp_chunk),
                                                       "--out", str(out / f"longctx_{cap}")],
                                    max(60, runner.left() - 30), cwd=out)
            lines = [l.strip() for l in output.splitlines()
                     if l.startswith(("built the model", "longest sequence", "at ", "memory_budget's breakdown", "check:"))]
            report["long_context"].append({"cap_mib": int(cap), "status": rc, "lines": lines,
                                           "parsed": parse_longctx(lines)})
        # transformers + PEFT + SDPA under the same caps (bench/peers/memory_grid.py's longest search, QLoRA r 32),
        # in what the budget leaves: its figures go beside memkit's.
        searched = [r for r in report["long_context"] if "skipped" not in r]
        if searched and runner.left() > 90:
            peer_json = out / "longctx_peer.json"
            gib = ",".join(f"{r['cap_mib'] / 1024:g}" for r in searched)
            runner.run("longctx_peer", [sys.executable, str(ROOT / "bench/peers/memory_grid.py"), "--out", str(peer_json),
                                        "--models", "llama-3.1-8b", "--longest", f"qlora:{gib}", "--no-rows",
                                        "--lora-rank", "32", "--granularity", "512",
                                        "--budget", str(max(0, runner.left() - 30))], max(60, runner.left() - 15))
            try:
                grid = json.loads(peer_json.read_text())
            except (OSError, ValueError):
                grid = None
            for r in searched:
                r["peer"] = peer_longest(grid, r["cap_mib"]) or {"skipped": "no search (see longctx_peer.log)"}
        else:
            for r in searched:
                r["peer"] = {"skipped": "not enough of the budget left"}
    report["side_by_side"] = side_by_side(report["benchmarks"], report["peers"])
    report["attention"] = attention_matrix.pairs(report["benchmarks"].get("attention", []), report["peers"])
    report["loss_peers"] = loss_table(report["benchmarks"], report["peers"])
    report["steps"] = runner.steps
    report["seconds"] = time.monotonic() - started
    write_report(out, report)
    failed = [s for s in runner.steps if s["status"] not in ("ok",) and not s["status"].startswith("skipped")]
    print(f"memkit gpu: wrote {out / 'results.md'} and results.json in {report['seconds']:.0f} s"
          + (f"; steps not ok: {', '.join(s['step'] + ' (' + s['status'] + ')' for s in failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
