// bench/support/openblas_spin.hpp — keeps OpenBLAS's idle worker threads from taking the cores memkit's
// threads need in the interleaved OpenBLAS-vs-memkit benchmarks (gemm_host, matmul_host).
// After each call OpenBLAS's workers spin for a while before they sleep (OPENBLAS_THREAD_TIMEOUT, 2^n cycles,
// read once when the library loads). In an interleaved multi-threaded row on a machine with few cores, memkit's
// run that follows OpenBLAS's then shares its cores with spinning threads: measured on the 2-vCPU Cascade Lake,
// quant::matmul at batch 64 on 2 threads took 30.6 ms that way and 18.4 ms with the spin cut short (one thread:
// 29.5-34.4 ms). So the benchmark sets the shortest spin and starts itself again, unless the variable is set.
#pragma once

#include <cstdlib>
#include <unistd.h>

namespace memkit_bench {

inline void restart_with_short_openblas_spin(char** argv) {
  if (std::getenv("OPENBLAS_THREAD_TIMEOUT") != nullptr) return;
  ::setenv("OPENBLAS_THREAD_TIMEOUT", "4", 1);
  ::execv("/proc/self/exe", argv);  // returns only if it failed: then run as we are
}

// The spin setting the run had, for the benchmark's context block.
inline const char* openblas_thread_timeout() {
  const char* value = std::getenv("OPENBLAS_THREAD_TIMEOUT");
  return value != nullptr ? value : "OpenBLAS default";
}

}  // namespace memkit_bench
