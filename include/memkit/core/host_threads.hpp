// memkit/core/host_threads.hpp — memkit's host threads: split a range of work over std::threads.
//
// Every threaded host path (the optimizer step, the GEMM, attention, the loss) splits its work with
// run_in_parts, so a user sets one number (`host_threads`, 0 = every hardware thread) and gets the same
// behaviour everywhere. Work is split into contiguous, disjoint ranges decided only by the count and the
// number of parts, so a result that is computed range by range is the same for any thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <system_error>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/hardware_threads.hpp"

MEMKIT_NAMESPACE_BEGIN

// The one check of a `host_threads` option, which every component that takes one applies: 0 (every hardware
// thread) or a positive count.
inline void require_host_threads(const std::string& operation, int host_threads) {
  if (host_threads < 0)
    throw error(operation + ": host_threads must be >= 0 (0: every hardware thread), got " + std::to_string(host_threads));
}

namespace detail {

// Runs work(first, last) over `parts` contiguous, disjoint ranges of [0, count), the calling thread taking
// the first. A thread that cannot be started has its range run on the calling thread instead: every range
// runs exactly once, so a failure to start threads never leaves a step half applied. If any range throws,
// every started thread is still joined and the first exception is rethrown on the calling thread.
template <class Work>
void run_in_parts(int parts, std::int64_t count, Work&& work) {
  parts = static_cast<int>(std::min<std::int64_t>(std::max(parts, 1), std::max<std::int64_t>(count, 1)));
  const auto bound = [&](int part) { return count * part / parts; };
  if (parts == 1) {
    work(std::int64_t{0}, count);
    return;
  }
  std::exception_ptr first_error;
  std::mutex error_mutex;
  const auto guarded = [&](std::int64_t first, std::int64_t last) {
    try {
      work(first, last);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(error_mutex);
      if (!first_error) first_error = std::current_exception();
    }
  };
  {
    std::vector<std::thread> threads;
    struct join_all {
      std::vector<std::thread>& threads;
      ~join_all() {
        for (std::thread& thread : threads) thread.join();
      }
    } joiner{threads};
    threads.reserve(static_cast<std::size_t>(parts - 1));
    for (int part = 1; part < parts; ++part) {
      try {
        threads.emplace_back([&guarded, first = bound(part), last = bound(part + 1)] { guarded(first, last); });
      } catch (const std::system_error&) {
        guarded(bound(part), bound(part + 1));
      }
    }
    guarded(std::int64_t{0}, bound(1));
  }
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace detail

MEMKIT_NAMESPACE_END
