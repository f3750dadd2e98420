// bench/support/roofline.hpp — the measured memory-bandwidth rooflines every memkit benchmark
// reports against. Kernels in memkit are memory-bound, so "fraction of measured bandwidth" is the
// honest efficiency figure; it is measured on the machine at hand, not taken from a data sheet.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <thread>
#include <vector>

namespace memkit_bench {

// Best-of-5 STREAM triad (a = b + s*c, 3 arrays of 64 MiB, all hardware threads), in bytes/s.
// Computed once per process and cached.
inline double measured_host_bandwidth() {
  static const double bandwidth = [] {
    const std::size_t count = (64u << 20) / sizeof(float);
    std::vector<float> a(count), b(count, 1.0f), c(count, 2.0f);
    const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
    double best = 0.0;
    for (int round = 0; round < 5; ++round) {
      const auto start = std::chrono::steady_clock::now();
      std::vector<std::thread> workers;
      for (unsigned t = 0; t < threads; ++t)
        workers.emplace_back([&, t] {
          const std::size_t begin = count * t / threads, end = count * (t + 1) / threads;
          for (std::size_t i = begin; i < end; ++i) a[i] = b[i] + 3.0f * c[i];
        });
      for (auto& w : workers) w.join();
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      best = std::max(best, 3.0 * count * sizeof(float) / seconds);
    }
    benchmark::DoNotOptimize(a.data());
    return best;
  }();
  return bandwidth;
}

// Times one benchmark thread's loop with a wall clock, so a benchmark can report how close it came
// to a roofline: start it right before `for (auto _ : state)`, call finish() right after.
// Per-thread fractions are summed by Google Benchmark, giving the whole run's fraction.
class roofline_timer {
 public:
  // The roofline is passed in (and so measured, once) before the clock starts.
  explicit roofline_timer(double roofline_bytes_per_second)
      : roofline_(roofline_bytes_per_second), start_(std::chrono::steady_clock::now()) {}

  // `bytes_per_iteration`: bytes this thread read plus wrote per iteration.
  void finish(benchmark::State& state, double bytes_per_iteration) const {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    report(state, bytes_per_iteration * static_cast<double>(state.iterations()), seconds, roofline_);
  }

  // For loops timed another way (CUDA events): total bytes moved over total seconds.
  static void report(benchmark::State& state, double bytes, double seconds, double roofline_bytes_per_second) {
    state.counters["roofline_GBps"] =
        benchmark::Counter(roofline_bytes_per_second / 1e9, benchmark::Counter::kAvgThreads);
    state.counters["fraction_of_roofline"] = bytes / seconds / roofline_bytes_per_second;
  }

 private:
  double roofline_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace memkit_bench
