// Host AdamW step throughput for fp32, bf16, 8-bit (block 256 and 2048) and 4-bit state, on the same
// fp32 parameters and gradients. Reports the bytes one step moves per second and the fraction of the
// measured host bandwidth (STREAM triad, all threads; the step runs on one thread). The byte model is
// in support/adam_bench.hpp, shared with bench/adam_cuda.cu.
#include <benchmark/benchmark.h>
#include <memkit/memkit.hpp>

#include <cstdint>
#include <vector>

#include "support/adam_bench.hpp"
#include "support/roofline.hpp"

namespace {

template <class S>
void BM_adam_step_host(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  auto [p, g] = memkit_bench::make_adam_inputs(n);
  S adam(memkit::host, memkit::default_host_resource(), std::vector<std::int64_t>{n});
  const std::vector<memkit::adam_param<float, float>> params{{memkit::host_view(p), memkit::host_view(g)}};
  const std::vector<memkit::adam_group> groups{memkit::adam_group{}};
  adam.step(memkit::host, params, groups);  // warm-up: first touch of the state
  const double bytes = static_cast<double>(n) * memkit_bench::adam_step_bytes_per_parameter<S>();
  const memkit_bench::roofline_timer timer(memkit_bench::measured_host_bandwidth());
  for (auto _ : state) {
    adam.step(memkit::host, params, groups);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  memkit_bench::report_adam_state_counters(state, bytes, n, adam);
  state.counters["ns_per_param"] =
      benchmark::Counter(static_cast<double>(n) * 1e-9, benchmark::Counter::kIsIterationInvariantRate |
                                                             benchmark::Counter::kInvert);
  timer.finish(state, bytes);
}

using namespace memkit_bench::adam_flavours;

}  // namespace

// 16M parameters (64 MiB per fp32 array: far beyond the caches); the smoke test runs the 64Ki size.
BENCHMARK_TEMPLATE(BM_adam_step_host, fp32_state)->Arg(1 << 16)->Arg(1 << 24)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_adam_step_host, bf16_state)->Arg(1 << 16)->Arg(1 << 24)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_adam_step_host, int8_256_state)->Arg(1 << 16)->Arg(1 << 24)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_adam_step_host, int8_2048_state)->Arg(1 << 16)->Arg(1 << 24)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_adam_step_host, int4_state)->Arg(1 << 16)->Arg(1 << 24)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_MAIN();
