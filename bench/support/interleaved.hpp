// bench/support/interleaved.hpp — two operations timed alternately inside one benchmark, so that both see
// the same machine load: #17's targets are ratios (a quantized step over the fp32 step, a quantize over the
// STREAM triad), and on a shared machine only a ratio measured this way means anything.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <utility>
#include <vector>

namespace memkit_bench {

inline double median_of(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n == 0 ? 0.0 : n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

template <class Op>
double seconds_of(Op& op) {
  const auto start = std::chrono::steady_clock::now();
  op();
  benchmark::ClobberMemory();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The median seconds of each of two operations.
struct interleaved_seconds {
  double first = 0.0, second = 0.0;
};

// Runs `first` and `second` once per benchmark iteration, swapping which runs first every iteration, and
// returns the median time of each (a median shrugs off an iteration preempted by another process).
template <class First, class Second>
interleaved_seconds time_interleaved(benchmark::State& state, First first, Second second) {
  std::vector<double> first_seconds, second_seconds;
  bool first_leads = true;
  for (auto _ : state) {
    if (first_leads) {
      first_seconds.push_back(seconds_of(first));
      second_seconds.push_back(seconds_of(second));
    } else {
      second_seconds.push_back(seconds_of(second));
      first_seconds.push_back(seconds_of(first));
    }
    first_leads = !first_leads;
  }
  return {median_of(std::move(first_seconds)), median_of(std::move(second_seconds))};
}

}  // namespace memkit_bench
