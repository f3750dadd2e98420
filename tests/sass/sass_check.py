#!/usr/bin/env python3
"""memkit's static CUDA kernel check: no GPU needed.

Compiles tests/sass/hot_kernels.cu (one instantiation of each hot kernel) for sm_80 and sm_90 with
`-Xptxas -v`, disassembles the object with `cuobjdump -sass`, and checks every kernel against its rules:

  no_local   no stack frame, no spill stores/loads, no LDL/STL in the SASS (a local array or a spill puts
             per-thread memory traffic in the hot loop)
  no_fp64    no FP64 instruction (DADD/DMUL/DFMA/DSETP/DMNMX/DSET, F2F/I2F/F2I to or from F64, MUFU.*64H):
             FP64 runs at a fraction of the FP32 rate, and on consumer parts at 1/64
  ldg128     at least one 128-bit global load (LDG.E.128...): the kernel reads 16 bytes per thread per load
  stg128     at least one 128-bit global store (STG.E.128...)
  lds<=N     at most N shared-memory loads (LDS) in the whole kernel: for kernels whose code lookups moved out
             of shared memory into registers or shuffles, what stays is a bounded prologue or a per-block
             scale lookup, never one LDS per decoded element
  mma        tensor-core MMA instructions (HMMA): the products run on the tensor cores
  ldsm       ldmatrix (LDSM): MMA operands go from shared memory to registers in the fragment layout, one
             instruction per four 8x8 matrices, instead of element loads
  async_copy asynchronous global -> shared copies (LDGSTS: cp.async, or UTMALDG: TMA): tiles arrive while the
             tensor cores work, without passing through registers

A rule a kernel does not meet yet is listed in EXEMPTIONS with the fix it waits for; the check fails when
a rule is broken without an exemption, and also when an exemption is no longer needed (remove it), so the
list always shows exactly what is left. It prints a table per kernel: registers, local bytes, 128-bit
loads and stores, FP64 instructions, and the static occupancy on sm_80 and sm_90 computed from the
registers, the shared memory (static, plus the launch's dynamic bytes where KERNELS gives them) and the
launch's block size with the documented per-SM limits.

Exit status: 0 when every rule holds or is exempt, 1 otherwise, 2 when the tools fail.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys

MMA_RULES = frozenset({"no_local", "no_fp64", "mma", "ldsm", "async_copy"})


def mma_kernels(label, pattern, padded_rows, extra_bytes=0, head_dims=(256, 128, 96, 64), outputs=None):
    """KERNELS rows of one bf16 mma attention kernel per head_dim: 128 threads, MMA_RULES, dynamic shared memory
    of padded_rows rows of (head_dim + 8) bf16 values plus extra_bytes (the kernels' mma_*_smem_bytes)."""
    return [(f"{label}<bf16,{d}>", pattern.format(d=d, outputs=outputs), 128, MMA_RULES,
             padded_rows * (d + 8) * 2 + extra_bytes) for d in head_dims]


MMA_KEY_PASS = ("attention::detail::mma_key_pass_kernel<memkit::v0_1::bf16, {d}, "
                "(memkit::v0_1::attention::detail::key_pass_outputs){outputs}>")

# --- The kernels: label, the demangled name's kernel and template arguments, threads per block at launch,
#     and the rules. Every kernel compiled from hot_kernels.cu must be listed, and every listed one found.
KERNELS = [
    # label, name pattern (demangled, up to the closing '>' of the template), block threads, rules
    ("adam_norm<f32>", "detail::adam_norm_kernel<float>", 256, {"no_local", "ldg128"}),
    ("adam_norm<bf16>", "detail::adam_norm_kernel<memkit::v0_1::bf16>", 256, {"no_local", "ldg128"}),
    # lds<=96: each requantized moment reads its bucket's two thresholds as one 8-byte pair (128 LDS before).
    ("adam8_update<f32,f32>", "detail::adam_update_kernel<signed char, 256, 256, float, float, true>", 256,
     {"no_local", "no_fp64", "ldg128", "stg128", "lds<=96"}),
    ("adam8_update<bf16,bf16>", "detail::adam_update_kernel<signed char, 256, 256, memkit::v0_1::bf16, memkit::v0_1::bf16, true>", 256,
     {"no_local", "no_fp64", "ldg128", "stg128", "lds<=96"}),
    # lds<=16: the 4-bit tables and midpoints in registers (a shuffle per dequantized moment, two per new code from
    # count_below16); the 16 LDS left decode a tensor's last, partial block (202 LDS before).
    ("adam4_update<f32,f32>", "detail::adam_update_kernel<memkit::v0_1::optim::four_bit, 128, 256, float, float, true>", 256,
     {"no_local", "no_fp64", "ldg128", "stg128", "lds<=16"}),
    ("adam4_update<bf16,bf16>", "detail::adam_update_kernel<memkit::v0_1::optim::four_bit, 128, 256, memkit::v0_1::bf16, memkit::v0_1::bf16, true>", 256,
     {"no_local", "no_fp64", "ldg128", "stg128", "lds<=16"}),
    ("adam32_update<f32,f32>", "detail::adam_update_kernel<float, 0, 256, float, float, true>", 256,
     {"no_local", "no_fp64", "ldg128", "stg128"}),
    ("adam16_update<bf16,bf16>", "detail::adam_update_kernel<memkit::v0_1::bf16, 0, 256, memkit::v0_1::bf16, memkit::v0_1::bf16, true>", 256,
     {"no_local", "no_fp64", "ldg128", "stg128"}),
    # The previous update kernels (adam_options::device_prefetch_update = false), for the benchmark's comparison.
    ("adam8_update_previous<f32,f32>", "detail::adam_update_kernel<signed char, 256, 256, float, float, false>", 256,
     {"no_local", "no_fp64", "ldg128", "stg128"}),
    ("adam8_update_previous<bf16,bf16>", "detail::adam_update_kernel<signed char, 256, 256, memkit::v0_1::bf16, memkit::v0_1::bf16, false>", 256,
     {"no_local", "no_fp64", "ldg128", "stg128"}),
    ("adam4_update_previous<f32,f32>", "detail::adam_update_kernel<memkit::v0_1::optim::four_bit, 128, 256, float, float, false>", 256,
     {"no_local", "no_fp64", "ldg128", "stg128"}),
    ("adam4_update_previous<bf16,bf16>", "detail::adam_update_kernel<memkit::v0_1::optim::four_bit, 128, 256, memkit::v0_1::bf16, memkit::v0_1::bf16, false>", 256,
     {"no_local", "no_fp64", "ldg128", "stg128"}),
    ("adam32_update_previous<f32,f32>", "detail::adam_update_kernel<float, 0, 256, float, float, false>", 256,
     {"no_local", "no_fp64", "ldg128", "stg128"}),
    ("adam16_update_previous<bf16,bf16>", "detail::adam_update_kernel<memkit::v0_1::bf16, 0, 256, memkit::v0_1::bf16, memkit::v0_1::bf16, false>", 256,
     {"no_local", "no_fp64", "ldg128", "stg128"}),
    ("grad_accumulate<f32,bf16>", "detail::accumulate_kernel<float, memkit::v0_1::bf16>", 256, {"no_local", "no_fp64"}),
    ("quantize<nf4,bf16>", "quant::detail::quantize_kernel<(memkit::v0_1::quant::format)0, memkit::v0_1::bf16>", 256,
     {"no_local", "ldg128"}),
    ("quantize<fp4,f32>", "quant::detail::quantize_kernel<(memkit::v0_1::quant::format)1, float>", 256,
     {"no_local", "ldg128"}),
    ("quantize<int8,f32>", "quant::detail::quantize_kernel<(memkit::v0_1::quant::format)2, float>", 256,
     {"no_local", "ldg128"}),
    ("dequantize<int8,f32> (head/tail)", "quant::detail::dequantize_kernel<(memkit::v0_1::quant::format)2, float>", 256,
     {"no_local"}),
    ("dequantize<nf4,bf16> (head/tail)", "quant::detail::dequantize_kernel<(memkit::v0_1::quant::format)0, memkit::v0_1::bf16>", 256,
     {"no_local"}),
    # The dequantize body loads each lane's codes for one 16-byte store (2-8 bytes, a warp's loads contiguous):
    # 16-byte code loads per lane left the stores scattered, 0.40 of the copy roofline on an H200 against 0.91.
    ("dequantize_vector<nf4,bf16,4>", "quant::detail::dequantize_vector_kernel<(memkit::v0_1::quant::format)0, memkit::v0_1::bf16, 4>", 256,
     {"no_local", "stg128"}),
    ("dequantize_vector<nf4,bf16,8> (double-quantized scales)", "quant::detail::dequantize_vector_kernel<(memkit::v0_1::quant::format)0, memkit::v0_1::bf16, 8>", 256,
     {"no_local", "stg128"}),
    ("dequantize_vector<int8,f32,4>", "quant::detail::dequantize_vector_kernel<(memkit::v0_1::quant::format)2, float, 4>", 256,
     {"no_local", "stg128"}),
    ("gemv<nf4,bf16>", "quant::detail::fused_gemv_kernel<(memkit::v0_1::quant::format)0, memkit::v0_1::bf16, 8>", 256,
     {"no_local", "ldg128"}),
    ("gemv<fp4,f16>", "quant::detail::fused_gemv_kernel<(memkit::v0_1::quant::format)1, memkit::v0_1::fp16, 8>", 256,
     {"no_local", "ldg128"}),
    # The register codebook (one shuffle per weight); the LDS left are the double-quantized scales' nested map.
    ("gemv_shuffle<nf4,bf16>", "quant::detail::fused_gemv_shuffle_kernel<(memkit::v0_1::quant::format)0, memkit::v0_1::bf16, 8>", 256,
     {"no_local", "ldg128", "lds<=8"}),
    ("gemv_shuffle<fp4,f16>", "quant::detail::fused_gemv_shuffle_kernel<(memkit::v0_1::quant::format)1, memkit::v0_1::fp16, 8>", 256,
     {"no_local", "ldg128", "lds<=8"}),
    ("gemv_t<nf4,bf16> (unaligned K)", "quant::detail::fused_gemv_t_kernel<(memkit::v0_1::quant::format)0, memkit::v0_1::bf16, 8>", 256,
     {"no_local"}),
    ("gemv_t_tiled<nf4,bf16>", "quant::detail::fused_gemv_t_tiled_kernel<(memkit::v0_1::quant::format)0, memkit::v0_1::bf16, 8>", 256,
     {"no_local", "ldg128"}),
    ("gemv_t_tiled<int8,f32>", "quant::detail::fused_gemv_t_tiled_kernel<(memkit::v0_1::quant::format)2, float, 8>", 256,
     {"no_local", "ldg128"}),
    ("gemv_t_reduce<bf16>", "quant::detail::gemv_t_reduce_kernel<memkit::v0_1::bf16>", 256, {"no_local"}),
    # The fused loss's row pass (#30). classic: one CTA of 1,024 threads per row, scalar loads, three reads and two
    # writes. staged: the row in dynamic shared memory (Llama 2's 32,000 fp32 logits, 128,000 bytes: one CTA per
    # SM), 16-byte loads; two_pass: rows too long to stage (Llama 3's 128,256), 16-byte loads, no shared row.
    # bf16 gradients are stored four at a time (8 bytes: STG.64), fp32 ones as STG.128.
    ("loss_rows_classic<f32>", "loss::detail::logit_rows_kernel<float>", 1024, {"no_local", "no_fp64"}),
    ("loss_rows_classic<bf16>", "loss::detail::logit_rows_kernel<memkit::v0_1::bf16>", 1024, {"no_local", "no_fp64"}),
    ("loss_rows_staged<f32>", "loss::detail::logit_rows_staged_kernel<float>", 1024,
     {"no_local", "no_fp64", "ldg128", "stg128"}, 32000 * 4),
    ("loss_rows_staged<bf16>", "loss::detail::logit_rows_staged_kernel<memkit::v0_1::bf16>", 1024,
     {"no_local", "no_fp64", "ldg128"}, 32000 * 4),
    ("loss_rows_two_pass<f32>", "loss::detail::logit_rows_two_pass_kernel<float>", 1024,
     {"no_local", "no_fp64", "ldg128", "stg128"}),
    ("loss_rows_two_pass<bf16>", "loss::detail::logit_rows_two_pass_kernel<memkit::v0_1::bf16>", 1024,
     {"no_local", "no_fp64", "ldg128"}),
    # Attention (issue 29). An optional fifth field: the launch's dynamic shared bytes, for the occupancy.
    # mma: (64 query rows + 2 x 64 K rows + 2 x 64 V rows) x (head_dim + 8) x 2 bytes (mma_forward_smem_bytes).
    # head_dim 256: Q's fragments re-read from shared memory per key tile (O alone takes 128 registers); 168,960
    # bytes of shared memory, above sm_80's 163 KiB opt-in (occupancy 0 there: the launch refuses with a message).
    *mma_kernels("attention_fwd_mma", "attention::detail::mma_forward_kernel<memkit::v0_1::bf16, {d}>", 320),
    ("attention_fwd_wmma<bf16>", "attention::detail::flash_forward_kernel<memkit::v0_1::bf16>", 128,
     {"no_local", "no_fp64", "mma", "ldsm", "async_copy"}, 3 * 16384 + 16384 + 8192 + 32768 + 768 + 512),
    # Backward's key pass. mma: (2 x 64 rows of K and V + 2 x 64 Q + 2 x 64 dO) x (head_dim + 8) x 2 bytes, plus
    # 2 x 2 x 64 floats of lse and delta (mma_key_pass_smem_bytes); WMMA (key_pass_smem<bf16>, head_dim 128): K, V
    # 16 KiB each, Q, dO 8 KiB each, fp32 S^T and dP^T 8 KiB each, P^T, dS^T 4 KiB each, fp32 dK, dV 32 KiB each,
    # lse/delta 256 B, row spans 512 B.
    # head_dim 256: one launch for dV and one for dK (key_pass_outputs 1 and 2), the query tile in halves.
    *mma_kernels("attention_dv_mma", MMA_KEY_PASS, 384, 1024, head_dims=(256,), outputs=1),
    *mma_kernels("attention_dk_mma", MMA_KEY_PASS, 384, 1024, head_dims=(256,), outputs=2),
    *mma_kernels("attention_dkdv_mma", MMA_KEY_PASS, 384, 1024, head_dims=(128, 96, 64), outputs=0),
    ("attention_dkdv_wmma<bf16>", "attention::detail::flash_key_pass_kernel<memkit::v0_1::bf16>", 128,
     {"no_local", "no_fp64", "mma", "ldsm", "async_copy"}, 2 * 16384 + 4 * 8192 + 2 * 4096 + 2 * 32768 + 256 + 512),
    # Backward's dq pass. mma: (2 x 64 rows of Q and dO + 2 x 64 K + 2 x 64 V) x (head_dim + 8) x 2 bytes
    # (mma_query_pass_smem_bytes); WMMA (query_pass_smem<bf16>, head_dim 128): Q, dO 16 KiB each, K, V 8 KiB each,
    # fp32 S and dP 8 KiB each, dS 4 KiB, fp32 dQ 32 KiB, lse/delta 512 B, row spans 512 B.
    # head_dim 256: the key tile in halves (dQ alone takes 128 registers).
    *mma_kernels("attention_dq_mma", "attention::detail::mma_query_pass_kernel<memkit::v0_1::bf16, {d}>", 384),
    ("attention_dq_wmma<bf16>", "attention::detail::flash_query_pass_kernel<memkit::v0_1::bf16>", 128,
     {"no_local", "no_fp64", "mma", "ldsm", "async_copy"}, 2 * 16384 + 4 * 8192 + 4096 + 32768 + 512 + 512),
]

# --- Rules today's kernels break, each with the fix it waits for (issue 14). Remove an entry with its fix:
#     the check fails on an entry that is no longer needed.
EXEMPTIONS = {
    # `automatic` still runs this kernel until the mma kernel has passed on a GPU; then it leaves the table.
    ("attention_fwd_wmma<bf16>", "ldsm"): "WMMA loads its fragments from generic pointers: attention_kernel::mma",
    ("attention_fwd_wmma<bf16>", "async_copy"): "plain tile loads through registers: attention_kernel::mma",
    ("attention_dkdv_wmma<bf16>", "ldsm"): "WMMA loads its fragments from generic pointers: attention_kernel::mma",
    ("attention_dkdv_wmma<bf16>", "async_copy"): "plain tile loads through registers: attention_kernel::mma",
    ("attention_dq_wmma<bf16>", "ldsm"): "WMMA loads its fragments from generic pointers: attention_kernel::mma",
    ("attention_dq_wmma<bf16>", "async_copy"): "plain tile loads through registers: attention_kernel::mma",
}

# --- Documented per-SM limits (CUDA C++ Programming Guide, "Compute Capabilities", and the occupancy
#     calculator's allocation granularities for compute capability 8.0 and 9.0).
LIMITS = {
    "sm_80": dict(registers=65536, max_warps=64, max_threads=2048, max_blocks=32, shared=164 * 1024),
    "sm_90": dict(registers=65536, max_warps=64, max_threads=2048, max_blocks=32, shared=228 * 1024),
}
REGISTER_UNIT_PER_WARP = 256  # registers are allocated to a warp in units of 256 (8 per thread)
SHARED_UNIT = 128             # shared memory is allocated to a block in units of 128 bytes
SHARED_RESERVED = 1024        # bytes the system reserves per resident block (compute capability 8.0+)
ARCHS = ("sm_80", "sm_90")

FP64_PATTERN = re.compile(r"^(DADD|DMUL|DFMA|DSETP|DMNMX|DSET|DMMA)\b|^(F2F|I2F|F2I)\.[\w.]*F64|^MUFU\.\w+64H")
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")


def ceil_to(value, unit):
    return (value + unit - 1) // unit * unit


def occupancy(arch, registers, shared, threads):
    """Resident warps per SM over the maximum, and the limiting resource."""
    limits = LIMITS[arch]
    warps = (threads + 31) // 32
    by_threads = min(limits["max_blocks"], limits["max_warps"] // warps)
    per_warp = ceil_to(max(registers, 1) * 32, REGISTER_UNIT_PER_WARP)
    by_registers = (limits["registers"] // per_warp) // warps
    by_shared = limits["shared"] // ceil_to(shared + SHARED_RESERVED, SHARED_UNIT)
    blocks = min(by_threads, by_registers, by_shared)
    limiter = "warps" if blocks == by_threads else "registers" if blocks == by_registers else "shared"
    return blocks * warps / limits["max_warps"], limiter


def demangle(names, cxxfilt):
    if not names:
        return {}
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.splitlines()))


def parse_ptxas(log):
    """{(arch, mangled): {registers, shared, stack, spill_stores, spill_loads}} from -Xptxas -v."""
    info, current = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\d+)'", line)
        if m:
            current = (m.group(2), m.group(1))
            info[current] = dict(registers=0, shared=0, stack=0, spill_stores=0, spill_loads=0)
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            info[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            info[current]["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            info[current]["shared"] = int(s.group(1)) if s else 0
    return info


def parse_sass(text):
    """{(arch, mangled): {ldg128, stg128, fp64, local}} from cuobjdump -sass."""
    counts, arch, function = {}, None, None
    for line in text.splitlines():
        m = re.match(r"\s*arch = (sm_\d+)", line)
        if m:
            arch = m.group(1)
            continue
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            function = (arch, m.group(1))
            counts[function] = dict(ldg128=0, stg128=0, fp64=0, local=0, lds=0, shfl=0, fp64_ops=set(), hmma=0, ldsm=0, async_copy=0)
            continue
        if function is None:
            continue
        m = INSTRUCTION.search(line)
        if not m:
            continue
        op = m.group(1)
        c = counts[function]
        if op.startswith("LDG") and not op.startswith("LDGSTS") and ".128" in op:  # LDGSTS: async_copy
            c["ldg128"] += 1
        if op.startswith("STG") and ".128" in op:
            c["stg128"] += 1
        if op == "LDS" or op.startswith("LDS."):
            c["lds"] += 1
        if op.startswith("SHFL"):
            c["shfl"] += 1
        if op.startswith("LDL") or op.startswith("STL"):
            c["local"] += 1
        if op.startswith("HMMA"):
            c["hmma"] += 1
        if op.startswith("LDSM"):
            c["ldsm"] += 1
        if op.startswith("LDGSTS") or op.startswith("UTMALDG"):
            c["async_copy"] += 1
        if FP64_PATTERN.match(op):
            c["fp64"] += 1
            c["fp64_ops"].add(op.split(".")[0])
    return counts


def broken_rules(rules, p, s):
    broken = []
    if "no_local" in rules and (p["stack"] or p["spill_stores"] or p["spill_loads"] or s["local"]):
        broken.append("no_local")
    if "no_fp64" in rules and s["fp64"]:
        broken.append("no_fp64")
    if "ldg128" in rules and not s["ldg128"]:
        broken.append("ldg128")
    if "stg128" in rules and not s["stg128"]:
        broken.append("stg128")
    for rule in rules:
        if rule.startswith("lds<=") and s["lds"] > int(rule[5:]):
            broken.append(rule)
    for rule, count in (("mma", "hmma"), ("ldsm", "ldsm"), ("async_copy", "async_copy")):
        if rule in rules and not s[count]:
            broken.append(rule)
    return broken


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump"))
    parser.add_argument("--cxxfilt", default=shutil.which("c++filt") or "c++filt")
    parser.add_argument("--include", default=os.path.join(here, "..", "..", "include"))
    parser.add_argument("--source", default=os.path.join(here, "hot_kernels.cu"))
    parser.add_argument("--work", default=os.path.join(os.getcwd(), "sass_check"))
    parser.add_argument("--markdown", help="also write the table as Markdown to this file")
    parser.add_argument("--no-exemptions", action="store_true",
                        help="apply every rule, ignoring EXEMPTIONS (shows what the exempt kernels break)")
    args = parser.parse_args()
    if args.no_exemptions:
        EXEMPTIONS.clear()
    if not args.cuobjdump:
        print("sass_check: cuobjdump not found (./dev.sh installs it)", file=sys.stderr)
        return 2
    os.makedirs(args.work, exist_ok=True)
    obj = os.path.join(args.work, "hot_kernels.o")
    command = [args.nvcc, "-std=c++20", "-O3", "-DNDEBUG", "-I", args.include, "-c", args.source, "-o", obj,
               "-Xptxas", "-v", "-Werror=all-warnings"]
    for arch in ARCHS:
        command += ["-gencode", f"arch=compute_{arch[3:]},code={arch}"]
    compiled = subprocess.run(command, capture_output=True, text=True)
    if compiled.returncode != 0:
        print(" ".join(command), file=sys.stderr)
        print(compiled.stdout + compiled.stderr, file=sys.stderr)
        return 2
    ptxas = parse_ptxas(compiled.stdout + compiled.stderr)
    # cuobjdump needs nvdisasm, which the pip wheels install next to it.
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(os.path.abspath(args.cuobjdump)) + os.pathsep + env.get("PATH", "")
    dumped = subprocess.run([args.cuobjdump, "-sass", obj], capture_output=True, text=True, env=env)
    if dumped.returncode != 0:
        print(dumped.stdout + dumped.stderr, file=sys.stderr)
        return 2
    sass = parse_sass(dumped.stdout)
    names = demangle(sorted({name for _, name in ptxas}), args.cxxfilt)

    failures, rows, seen = [], [], set()
    for label, pattern, threads, rules, *dynamic in KERNELS:
        dynamic_shared = dynamic[0] if dynamic else 0
        matches = sorted({mangled for mangled, pretty in names.items() if pattern + "(" in pretty})
        if len(matches) != 1:
            failures.append(f"{label}: {len(matches)} compiled kernels match '{pattern}' (expected 1)")
            continue
        mangled = matches[0]
        seen.add(mangled)
        row = dict(label=label, threads=threads, arch={})
        broken_any = set()
        for arch in ARCHS:
            p, s = ptxas.get((arch, mangled)), sass.get((arch, mangled))
            if p is None or s is None:
                failures.append(f"{label}: no {arch} code found")
                continue
            occ, limiter = occupancy(arch, p["registers"], p["shared"] + dynamic_shared, threads)
            row["arch"][arch] = dict(p, **s, occupancy=occ, limiter=limiter)
            broken_any.update(broken_rules(rules, p, s))
        status = []
        for rule in sorted(rules):
            exempt = (label, rule) in EXEMPTIONS
            if rule in broken_any and not exempt:
                failures.append(f"{label}: breaks {rule}")
                status.append(f"{rule}:FAIL")
            elif rule in broken_any:
                status.append(f"{rule}:exempt")
            elif exempt:
                failures.append(f"{label}: meets {rule} now; remove its exemption ({EXEMPTIONS[(label, rule)]})")
                status.append(f"{rule}:STALE-EXEMPTION")
        row["status"] = " ".join(status) if status else "ok"
        rows.append(row)
    for mangled, pretty in names.items():
        if mangled not in seen:
            failures.append(f"kernel without rules in sass_check.py: {pretty}")
    for key in EXEMPTIONS:
        if key[0] not in {k[0] for k in KERNELS}:
            failures.append(f"exemption for an unknown kernel: {key}")

    header = ["kernel", "threads", "regs 80/90", "stack+spill B 80/90", "LDL+STL", "LDG.128", "STG.128", "LDS", "SHFL", "FP64",
              "HMMA", "LDSM", "LDGSTS", "occupancy 80", "occupancy 90", "rules"]
    table = []
    for r in rows:
        a, b = r["arch"].get("sm_80"), r["arch"].get("sm_90")
        if a is None or b is None:
            continue
        local = lambda x: x["stack"] + x["spill_stores"] + x["spill_loads"]
        fp64 = str(b["fp64"]) + (" (" + ",".join(sorted(b["fp64_ops"])) + ")" if b["fp64"] else "")
        table.append([r["label"], str(r["threads"]), f"{a['registers']}/{b['registers']}", f"{local(a)}/{local(b)}",
                      str(b["local"]), str(b["ldg128"]), str(b["stg128"]), str(b["lds"]), str(b["shfl"]), fp64, str(b["hmma"]),
                      str(b["ldsm"]), str(b["async_copy"]), f"{a['occupancy']:.0%} ({a['limiter']})",
                      f"{b['occupancy']:.0%} ({b['limiter']})", r["status"]])
    widths = [max(len(h), *(len(t[i]) for t in table)) if table else len(h) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths)))
    print("(LDL+STL, LDG.128, STG.128, LDS, SHFL, FP64, HMMA, LDSM, LDGSTS (+UTMALDG): instruction counts in the sm_90 SASS; stack+spill B: ptxas's stack frame"
          " plus spill bytes; occupancy: resident warps / 64 at the launch's block size, and what limits it)")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n")
            for t in table:
                f.write("| " + " | ".join(t) + " |\n")
    exempt = sum(1 for r in rows for s in r["status"].split() if s.endswith(":exempt"))
    print(f"sass_check: {len(rows)} kernels, {exempt} exempt rule violations left (fixes pending), {len(failures)} failures")
    for f in failures:
        print("FAIL: " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
