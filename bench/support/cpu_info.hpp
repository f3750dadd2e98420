// bench/support/cpu_info.hpp — names the CPU a host benchmark ran on, in the benchmark's context block
// (a host figure means nothing without it: AVX-512 or only AVX2, how many cores, which generation).
#pragma once

#include <benchmark/benchmark.h>

#include <fstream>
#include <string>

#include "memkit/core/host_simd.hpp"

namespace memkit_bench {

// "model name" from /proc/cpuinfo (what lscpu prints as Model name), or "unknown".
inline std::string cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "unknown";
}

// Adds cpu_model and memkit_host_isa (the widest instruction set memkit's dispatched kernels may use here,
// after MEMKIT_HOST_ISA) to the context every benchmark binary prints first.
inline void add_cpu_context() {
  benchmark::AddCustomContext("cpu_model", cpu_model());
  benchmark::AddCustomContext("memkit_host_isa", memkit::to_string(memkit::host_isa_in_use()));
#if defined(MEMKIT_BENCH_SMOKE_BUILD)
  benchmark::AddCustomContext("memkit_build", "smoke build (-O1, for the test suite): these figures mean nothing; "
                                              "./dev.sh bench builds for speed");
#endif
}

}  // namespace memkit_bench
