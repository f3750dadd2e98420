// Host memory bandwidth: memcpy (copy) and STREAM triad, on 1..N threads. These are the host
// rooflines the other memkit benchmarks report against (bench/support/roofline.hpp).
// And the FMA peak on 1..N threads (BM_host_fma_peak): whether a compute-bound kernel can scale with the
// threads at all (vCPUs that are hyperthreads of one core would share its FMA units; on the 2-vCPU machine of
// docs/performance.md the peak doubles with the second thread).
#include <benchmark/benchmark.h>

#include <cstring>
#include <immintrin.h>
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

// Twelve independent FMA chains of 16- or 8-float vectors (more than latency x throughput of two FMA ports),
// `steps` times each. Written once with GCC's vector extension and inlined into the two entry points below,
// whose target attributes choose the instructions (`acc * m + c` is contracted into one FMA, as g++ does by
// default in C++; the entry points' disassembly shows vfmadd on zmm and ymm registers).
typedef float floats16 __attribute__((vector_size(64)));
typedef float floats8 __attribute__((vector_size(32)));
template <class Vector>
[[gnu::always_inline]] inline float fma_chains(std::int64_t steps, float step) {
  constexpr int lanes = sizeof(Vector) / sizeof(float);
  Vector acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = Vector{} + step * static_cast<float>(i + 1);
  const Vector m = Vector{} + (1.0f - step), c = Vector{} + step;
  for (std::int64_t k = 0; k < steps; ++k)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = acc[i] * m + c;
  float sum = 0;
  for (int i = 0; i < 12; ++i)
    for (int l = 0; l < lanes; ++l) sum += acc[i][l];
  return sum;
}
__attribute__((target("avx512f"))) float fma_chains_avx512(std::int64_t steps, float step) { return fma_chains<floats16>(steps, step); }
__attribute__((target("avx2,fma"))) float fma_chains_avx2(std::int64_t steps, float step) { return fma_chains<floats8>(steps, step); }

void BM_host_fma_peak(benchmark::State& state) {
  const bool avx512 = __builtin_cpu_supports("avx512f");
  if (!avx512 && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) {
    state.SkipWithError("no AVX2 + FMA");
    return;
  }
  constexpr std::int64_t steps = 1 << 22;
  for (auto _ : state) {
    float step = 1e-4f;
    benchmark::DoNotOptimize(step);  // an input the compiler cannot see, so the call is not hoisted
    benchmark::DoNotOptimize(avx512 ? fma_chains_avx512(steps, step) : fma_chains_avx2(steps, step));
  }
  const double flops = 2.0 * 12 * (avx512 ? 16 : 8) * static_cast<double>(steps);
  state.counters["FLOPs"] = benchmark::Counter(flops * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.SetLabel(avx512 ? "avx512 fp32 FMA" : "avx2 fp32 FMA");
}

}  // namespace

BENCHMARK(BM_host_copy)->ThreadRange(1, 2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_host_triad)->ThreadRange(1, 2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_host_fma_peak)->ThreadRange(1, 2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
