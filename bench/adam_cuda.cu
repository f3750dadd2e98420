// CUDA AdamW step throughput for fp32, bf16, 8-bit (block 256 and 2048) and 4-bit state on the same fp32
// parameters and gradients, timed with CUDA events. Reports bytes moved per second (same byte model as
// bench/adam_host.cpp) and the fraction of the measured device-to-device copy bandwidth. The parameters
// are split into 48 tensors of 1..2M elements, so the multi-tensor launches are exercised.
#include <benchmark/benchmark.h>
#include <memkit/memkit.hpp>

#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "support/roofline.hpp"

namespace {

double measured_device_copy_bandwidth() {
  static const double bandwidth = [] {
    constexpr std::size_t bytes = std::size_t{1} << 30;
    memkit::device_resource device;
    memkit::buffer<std::byte> a(device, memkit::shape{static_cast<std::int64_t>(bytes)}),
        b(device, memkit::shape{static_cast<std::int64_t>(bytes)});
    cudaEvent_t start, stop;
    MEMKIT_CUDA_CHECK(cudaEventCreate(&start));
    MEMKIT_CUDA_CHECK(cudaEventCreate(&stop));
    float best_ms = 1e30f;
    for (int round = 0; round < 5; ++round) {
      MEMKIT_CUDA_CHECK(cudaEventRecord(start));
      MEMKIT_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice));
      MEMKIT_CUDA_CHECK(cudaEventRecord(stop));
      MEMKIT_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      MEMKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      if (ms < best_ms) best_ms = ms;
    }
    MEMKIT_CUDA_CHECK(cudaEventDestroy(start));
    MEMKIT_CUDA_CHECK(cudaEventDestroy(stop));
    return 2.0 * bytes / (best_ms / 1e3);
  }();
  return bandwidth;
}

template <class S>
double moment_bytes_per_parameter() {
  using traits = memkit::adam_state_traits<typename S::state_type>;
  if constexpr (!traits::quantized) return 2.0 * 2.0 * sizeof(typename traits::moment_type);
  else return 2.0 * 2.0 * traits::bits / 8.0 + 2.0 * 2.0 * sizeof(float) / S::block_size;
}

template <class S>
void BM_adam_step_cuda(benchmark::State& state) {
  memkit::device_resource device;
  memkit::cuda_executor gpu{};
  std::vector<std::int64_t> sizes;
  std::int64_t total = 0;
  for (int i = 0; i < 48; ++i) {
    sizes.push_back((std::int64_t{1} << 20) + 21845 * i);
    total += sizes.back();
  }
  memkit::buffer<float> p(device, memkit::shape{total}), g(device, memkit::shape{total});
  {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> values(static_cast<std::size_t>(total));
    for (float& x : values) x = 0.1f * normal(rng);
    MEMKIT_CUDA_CHECK(cudaMemcpy(p.data(), values.data(), values.size() * sizeof(float), cudaMemcpyDefault));
    for (float& x : values) x = 0.01f * normal(rng);
    MEMKIT_CUDA_CHECK(cudaMemcpy(g.data(), values.data(), values.size() * sizeof(float), cudaMemcpyDefault));
  }
  S adam(gpu, device, sizes);
  std::vector<memkit::adam_param<float, float>> params;
  std::int64_t offset = 0;
  for (std::int64_t n : sizes) {
    params.push_back({p.view().flat_slice(offset, n), memkit::tensor_view<const float>(g.view()).flat_slice(offset, n)});
    offset += n;
  }
  const std::vector<memkit::adam_group> groups{memkit::adam_group{}};
  adam.step(gpu, params, groups);  // warm-up
  const double bytes = static_cast<double>(total) * (4.0 + 4.0 + 8.0 + moment_bytes_per_parameter<S>());
  cudaEvent_t start, stop;
  MEMKIT_CUDA_CHECK(cudaEventCreate(&start));
  MEMKIT_CUDA_CHECK(cudaEventCreate(&stop));
  double seconds = 0.0;
  for (auto _ : state) {
    MEMKIT_CUDA_CHECK(cudaEventRecord(start, gpu.stream));
    adam.step(gpu, params, groups);
    MEMKIT_CUDA_CHECK(cudaEventRecord(stop, gpu.stream));
    MEMKIT_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    MEMKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(ms / 1e3);
    seconds += ms / 1e3;
  }
  MEMKIT_CUDA_CHECK(cudaEventDestroy(start));
  MEMKIT_CUDA_CHECK(cudaEventDestroy(stop));
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["bytes_per_param"] = bytes / static_cast<double>(total);
  state.counters["state_bytes"] = static_cast<double>(adam.bytes());
  memkit_bench::roofline_timer::report(state, bytes * static_cast<double>(state.iterations()), seconds,
                                       measured_device_copy_bandwidth());
}

using fp32_state = memkit::adam_state<float>;
using bf16_state = memkit::adam_state<memkit::bf16>;
using int8_256_state = memkit::adam_state<std::int8_t, 256>;
using int8_2048_state = memkit::adam_state<std::int8_t, 2048>;
using int4_state = memkit::adam_state<memkit::four_bit, 128>;

bool have_device() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (!have_device()) {
    std::printf("memkit_bench_adam_cuda: no CUDA device; nothing to measure\n");
    return 0;
  }
  benchmark::RegisterBenchmark("BM_adam_step_cuda<fp32_state>", BM_adam_step_cuda<fp32_state>)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_adam_step_cuda<bf16_state>", BM_adam_step_cuda<bf16_state>)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_adam_step_cuda<int8_256_state>", BM_adam_step_cuda<int8_256_state>)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_adam_step_cuda<int8_2048_state>", BM_adam_step_cuda<int8_2048_state>)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_adam_step_cuda<int4_state>", BM_adam_step_cuda<int4_state>)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
