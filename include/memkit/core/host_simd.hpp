// memkit/core/host_simd.hpp — which x86 vector instruction set memkit's run-time dispatched host kernels use.
//
// Kernels that exist in several widths (the GEMM micro-kernel, the 4-bit and 8-bit codecs) are compiled for
// each with __attribute__((target)) and chosen when they run, so one binary built for baseline x86-64 runs
// the AVX-512 kernel on a CPU that has it and the AVX2 kernel on one that has only AVX2. host_isa_in_use()
// is that choice: the widest set this CPU supports, capped by
//   - the environment variable MEMKIT_HOST_ISA (portable, avx2 or avx512), read once per process: run a
//     program as it would run on an older CPU (CTest runs the AVX2 test binary this way), and
//   - limit_host_isa(), for tests and benchmarks that compare the paths inside one process.
// Under nvcc and on other architectures every dispatched kernel takes its portable C++ path.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "memkit/config.hpp"

#if !MEMKIT_HAS_CUDA && defined(__GNUC__) && defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define MEMKIT_X86_DISPATCH 1
#else
#define MEMKIT_X86_DISPATCH 0
#endif

MEMKIT_NAMESPACE_BEGIN

// Ordered: each level includes the one below it.
enum class host_isa : std::uint8_t {
  portable,  // plain C++ (what the compiler's own target flags make of it)
  avx2,      // AVX2 + FMA + F16C (Haswell, Zen 1 and later)
  avx512,    // AVX-512 F + BW + DQ + VL (Skylake-X, Ice Lake, Zen 4 and later)
};

constexpr const char* to_string(host_isa isa) noexcept {
  switch (isa) {
    case host_isa::portable: return "portable";
    case host_isa::avx2: return "avx2";
    case host_isa::avx512: return "avx512";
  }
  return "unknown";
}

namespace detail {

#if MEMKIT_X86_DISPATCH
// F16C from CPUID leaf 1 (ECX bit 29): clang 14's __builtin_cpu_supports does not know "f16c".
inline bool cpu_has_f16c() noexcept {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
}
#endif

inline host_isa detect_host_isa() noexcept {
#if MEMKIT_X86_DISPATCH
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl"))
    return host_isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c()) return host_isa::avx2;
#endif
  return host_isa::portable;
}

// MEMKIT_HOST_ISA's cap; an unknown value is ignored (no cap), so a typo never slows a program down silently
// to the portable path.
inline host_isa environment_isa_cap() noexcept {
  const char* value = std::getenv("MEMKIT_HOST_ISA");
  if (value == nullptr) return host_isa::avx512;
  if (std::strcmp(value, "portable") == 0) return host_isa::portable;
  if (std::strcmp(value, "avx2") == 0) return host_isa::avx2;
  return host_isa::avx512;
}

inline host_isa min_isa(host_isa a, host_isa b) noexcept { return a < b ? a : b; }

// The CPU's widest set capped by the environment, computed once.
inline host_isa process_host_isa() noexcept {
  static const host_isa isa = min_isa(detect_host_isa(), environment_isa_cap());
  return isa;
}

inline std::atomic<host_isa>& host_isa_limit() noexcept {
  static std::atomic<host_isa> limit{host_isa::avx512};
  return limit;
}

}  // namespace detail

// The instruction set dispatched host kernels use now.
inline host_isa host_isa_in_use() noexcept {
  return detail::min_isa(detail::process_host_isa(), detail::host_isa_limit().load(std::memory_order_relaxed));
}

// Caps host_isa_in_use() for the whole process (host_isa::avx512 lifts the cap); returns the previous cap.
// Meant for tests and benchmarks that run each path in turn; results never depend on it beyond the
// documented differences between paths.
inline host_isa limit_host_isa(host_isa cap) noexcept { return detail::host_isa_limit().exchange(cap); }

MEMKIT_NAMESPACE_END
