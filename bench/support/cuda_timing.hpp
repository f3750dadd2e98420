// bench/support/cuda_timing.hpp — timing device work with CUDA events, and the measured device roofline.
// For CUDA benchmarks only (registered with UseManualTime): a host clock would time the launch, not the work.
#pragma once

#include <benchmark/benchmark.h>
#include <memkit/config.hpp>
#include <memkit/memory/buffer.hpp>
#include <memkit/memory/resource.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>

#include "support/roofline.hpp"

namespace memkit_bench {

// A pair of CUDA events around work enqueued on one stream.
class event_timer {
 public:
  event_timer() {
    MEMKIT_CUDA_CHECK(cudaEventCreate(&start_));
    MEMKIT_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~event_timer() {
    (void)cudaEventDestroy(start_);
    (void)cudaEventDestroy(stop_);
  }
  event_timer(const event_timer&) = delete;
  event_timer& operator=(const event_timer&) = delete;

  // Seconds of device time that the work `body` enqueues on `stream` takes (waits for it to finish).
  template <class Body>
  double seconds(Body&& body, cudaStream_t stream = nullptr) {
    MEMKIT_CUDA_CHECK(cudaEventRecord(start_, stream));
    body();
    MEMKIT_CUDA_CHECK(cudaEventRecord(stop_, stream));
    MEMKIT_CUDA_CHECK(cudaEventSynchronize(stop_));
    float ms = 0;
    MEMKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
    return ms / 1e3;
  }

 private:
  cudaEvent_t start_{}, stop_{};
};

// Runs `body` (which enqueues work on `stream`) once untimed as a warm-up, then once per benchmark
// iteration between two CUDA events; each iteration's device time goes to SetIterationTime. Returns the
// total device seconds of the timed iterations, for the roofline report.
template <class Body>
double time_with_events(benchmark::State& state, Body&& body, cudaStream_t stream = nullptr) {
  event_timer timer;
  body();
  double total_seconds = 0.0;
  for (auto _ : state) {
    const double seconds = timer.seconds(body, stream);
    state.SetIterationTime(seconds);
    total_seconds += seconds;
  }
  return total_seconds;
}

// Bytes/s and the fraction of `roofline_bytes_per_second` for a loop timed by time_with_events.
inline void report_device_throughput(benchmark::State& state, double bytes_per_iteration, double seconds,
                                     double roofline_bytes_per_second) {
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes_per_iteration) * state.iterations());
  roofline_timer::report(state, bytes_per_iteration * static_cast<double>(state.iterations()), seconds,
                         roofline_bytes_per_second);
}

// Best-of-5 cudaMemcpy device to device of 1 GiB (read + write bytes per second) on the current device: the roofline
// memkit's memory-bound kernels report against. Measured once per process and cached.
inline double measured_device_bandwidth() {
  static const double bandwidth = [] {
    constexpr std::size_t bytes = std::size_t{1} << 30;
    memkit::device_resource device;
    memkit::buffer<std::byte> a(device, memkit::shape{static_cast<std::int64_t>(bytes)}),
        b(device, memkit::shape{static_cast<std::int64_t>(bytes)});
    event_timer timer;
    double best_seconds = 1e30;
    for (int round = 0; round < 5; ++round)
      best_seconds = std::min(best_seconds, timer.seconds([&] {
        MEMKIT_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice));
      }));
    return 2.0 * static_cast<double>(bytes) / best_seconds;
  }();
  return bandwidth;
}

// True when a CUDA device is present.
inline bool have_cuda_device() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// The body of a CUDA benchmark's main(): registers the benchmarks (`register_benchmarks()`) and runs them
// when a device is present; otherwise prints a note and measures nothing (CI machines have no GPU).
template <class Register>
int run_cuda_benchmarks(int argc, char** argv, const char* program, Register&& register_benchmarks) {
  benchmark::Initialize(&argc, argv);
  if (!have_cuda_device()) {
    std::printf("%s: no CUDA device; nothing measured\n", program);
    return 0;
  }
  register_benchmarks();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace memkit_bench
