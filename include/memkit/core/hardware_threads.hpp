// memkit/core/hardware_threads.hpp — how many host threads a `host_threads` option means (0 = every hardware
// thread). A header of its own, so that the byte functions (linalg/gemm_bytes.hpp, quant/bytes.hpp), which
// memory_budget includes, do not pull in the threading of core/host_threads.hpp.
#pragma once

#include <cstdint>

// std::thread::hardware_concurrency is declared by <thread>, which in C++20 also brings <stop_token>, <chrono>
// and <semaphore> (a third of a byte header's compile time). libstdc++ declares std::thread alone in
// <bits/std_thread.h>; other standard libraries get <thread>.
#if defined(__GLIBCXX__) && __has_include(<bits/std_thread.h>)
#include <bits/std_thread.h>
#else
#include <thread>
#endif

#include "memkit/config.hpp"

MEMKIT_NAMESPACE_BEGIN

inline std::int64_t hardware_threads() noexcept {
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? n : 1;
}

// The thread count a `host_threads` option asks for: 0 means every hardware thread; never below 1.
inline int resolve_host_threads(int host_threads) noexcept {
  const std::int64_t wanted = host_threads > 0 ? host_threads : hardware_threads();
  return static_cast<int>(wanted > 1 ? wanted : 1);
}

MEMKIT_NAMESPACE_END
