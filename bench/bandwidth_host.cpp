// Host memory bandwidth: memcpy (copy) and STREAM triad, on 1..N threads. These are the host
// rooflines the other memkit benchmarks report against (bench/support/roofline.hpp).
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "support/roofline.hpp"

namespace {

constexpr std::size_t kArrayBytes = 256u << 20;  // far beyond any last-level cache
constexpr std::size_t kCount = kArrayBytes / sizeof(float);

struct arrays {
  std::vector<float> a = std::vector<float>(kCount, 0.0f), b = std::vector<float>(kCount, 1.0f),
                     c = std::vector<float>(kCount, 2.0f);
};
arrays& shared_arrays() {
  static arrays data;
  return data;
}

// Each benchmark thread works on its own slice, so Threads(n) measures n cores streaming at once.
void BM_host_copy(benchmark::State& state) {
  arrays& data = shared_arrays();
  const std::size_t begin = kCount * state.thread_index() / state.threads();
  const std::size_t end = kCount * (state.thread_index() + 1) / state.threads();
  const memkit_bench::roofline_timer timer(memkit_bench::measured_host_bandwidth());
  for (auto _ : state) {
    std::memcpy(data.a.data() + begin, data.b.data() + begin, (end - begin) * sizeof(float));
    benchmark::ClobberMemory();
  }
  const double bytes = 2.0 * (end - begin) * sizeof(float);  // read + write
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  timer.finish(state, bytes);
}

void BM_host_triad(benchmark::State& state) {
  arrays& data = shared_arrays();
  const std::size_t begin = kCount * state.thread_index() / state.threads();
  const std::size_t end = kCount * (state.thread_index() + 1) / state.threads();
  float* a = data.a.data();
  const float* b = data.b.data();
  const float* c = data.c.data();
  const memkit_bench::roofline_timer timer(memkit_bench::measured_host_bandwidth());
  for (auto _ : state) {
    for (std::size_t i = begin; i < end; ++i) a[i] = b[i] + 3.0f * c[i];
    benchmark::ClobberMemory();
  }
  const double bytes = 3.0 * (end - begin) * sizeof(float);  // two reads + one write
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  timer.finish(state, bytes);
}

}  // namespace

BENCHMARK(BM_host_copy)->ThreadRange(1, 2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_host_triad)->ThreadRange(1, 2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
