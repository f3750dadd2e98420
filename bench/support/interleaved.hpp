// bench/support/interleaved.hpp — two operations timed alternately inside one benchmark, so that both see
// the same machine load: #17's targets are ratios (a quantized step over the fp32 step, a quantize over the
// STREAM triad), and on a shared machine only a ratio measured this way means anything.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <ctime>
#include <utility>
#include <vector>

namespace memkit_bench {

inline double median_of(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n == 0 ? 0.0 : n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// CPU time in seconds: CLOCK_PROCESS_CPUTIME_ID (all of this process's threads: an operation that starts its
// own threads) or CLOCK_THREAD_CPUTIME_ID (the calling thread: one benchmark thread of several). Unlike wall
// time it does not count the time other processes held the core, so on a loaded machine it is the steadier
// measure.
inline double cpu_seconds(clockid_t clock) {
  timespec t{};
  clock_gettime(clock, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Median wall and CPU seconds of each of two operations.
struct interleaved_seconds {
  double first = 0.0, second = 0.0;          // wall
  double first_cpu = 0.0, second_cpu = 0.0;  // CPU time
};

namespace detail {
struct timings {
  clockid_t clock;
  std::vector<double> wall, cpu;
  template <class Op>
  void run(Op& op) {
    const double cpu_start = cpu_seconds(clock);
    const auto start = std::chrono::steady_clock::now();
    op();
    benchmark::ClobberMemory();
    wall.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    cpu.push_back(cpu_seconds(clock) - cpu_start);
  }
};
}  // namespace detail

// Runs `first` and `second` once per benchmark iteration, swapping which runs first every iteration, and
// returns the median times of each (a median shrugs off an iteration preempted by another process); CPU times
// from `clock` (cpu_seconds).
template <class First, class Second>
interleaved_seconds time_interleaved(benchmark::State& state, First first, Second second,
                                     clockid_t clock = CLOCK_PROCESS_CPUTIME_ID) {
  detail::timings a{clock, {}, {}}, b{clock, {}, {}};
  bool first_leads = true;
  for (auto _ : state) {
    if (first_leads) {
      a.run(first);
      b.run(second);
    } else {
      b.run(second);
      a.run(first);
    }
    first_leads = !first_leads;
  }
  return {median_of(std::move(a.wall)), median_of(std::move(b.wall)), median_of(std::move(a.cpu)), median_of(std::move(b.cpu))};
}

}  // namespace memkit_bench
