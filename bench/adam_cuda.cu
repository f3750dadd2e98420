// CUDA AdamW step throughput for fp32, bf16, 8-bit (block 256 and 2048) and 4-bit state on the same fp32
// parameters and gradients, timed with CUDA events. Reports bytes moved per second (the byte model of
// support/adam_bench.hpp, shared with bench/adam_host.cpp) and the fraction of the measured
// device-to-device copy bandwidth. The parameters are split into 48 tensors of 1..2M elements, so the
// multi-tensor launches are exercised. /1 rows time one step from an idle device, /4 rows four steps
// enqueued back to back (ms_per_step: the device's time per step).
#include <benchmark/benchmark.h>
#include <memkit/memkit.hpp>

#include <cstdint>
#include <vector>

#include "support/adam_bench.hpp"
#include "support/cuda_timing.hpp"

namespace {

// The host-generated parameters and gradients, made once per process: every flavour, and each of Google
// Benchmark's calls of a benchmark function, steps the same values (generating them took most of a run).
const memkit_bench::adam_inputs& shared_inputs(std::int64_t total) {
  static const memkit_bench::adam_inputs inputs = memkit_bench::make_adam_inputs(total);
  return inputs;
}

// prefetch false: the previous update kernel (adam_options::device_prefetch_update), for #30's comparison.
template <class S, bool Prefetch = true>
void BM_adam_step_cuda(benchmark::State& state) {
  memkit::device_resource device;
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  std::vector<std::int64_t> sizes;
  std::int64_t total = 0;
  for (int i = 0; i < 48; ++i) {
    sizes.push_back((std::int64_t{1} << 20) + 21845 * i);
    total += sizes.back();
  }
  memkit::buffer<float> p(device, memkit::shape{total}), g(device, memkit::shape{total});
  {
    const auto& inputs = shared_inputs(total);
    MEMKIT_CUDA_CHECK(cudaMemcpy(p.data(), inputs.params.data(), p.bytes(), cudaMemcpyDefault));
    MEMKIT_CUDA_CHECK(cudaMemcpy(g.data(), inputs.grads.data(), g.bytes(), cudaMemcpyDefault));
  }
  S adam(gpu, device, sizes, memkit::optim::adam_options{.device_prefetch_update = Prefetch});
  std::vector<memkit::optim::adam_param<float, float>> params;
  std::int64_t offset = 0;
  for (std::int64_t n : sizes) {
    params.push_back({p.view().flat_slice(offset, n), memkit::tensor_view<const float>(g.view()).flat_slice(offset, n)});
    offset += n;
  }
  const std::vector<memkit::optim::adam_group> groups{memkit::optim::adam_group{}};
  // Steps per timed iteration (the argument): 1 times one step from an idle device, so the host's work before
  // the first kernel (argument checks, launch set-up) counts; 4 enqueues steps back to back, as a training
  // loop does, so that work overlaps the previous step's kernels and the figure is the device's.
  const int steps = static_cast<int>(state.range(0));
  const double bytes = static_cast<double>(steps) * static_cast<double>(total) * memkit_bench::adam_step_bytes_per_parameter<S>();
  const double seconds = memkit_bench::time_with_events(
      state, [&] { for (int s = 0; s < steps; ++s) adam.step(gpu, params, groups); }, gpu.stream);
  memkit_bench::report_adam_state_counters(state, bytes / steps, total, adam);
  state.counters["ms_per_step"] = seconds * 1e3 / static_cast<double>(state.iterations() * steps);
  memkit_bench::report_device_throughput(state, bytes, seconds, memkit_bench::measured_device_bandwidth());
}

using namespace memkit_bench::adam_flavours;

}  // namespace

int main(int argc, char** argv) {
  return memkit_bench::run_cuda_benchmarks(argc, argv, "memkit_bench_adam_cuda", [] {
    benchmark::RegisterBenchmark("BM_adam_step_cuda<fp32_state>", BM_adam_step_cuda<fp32_state>)->UseManualTime()->Unit(benchmark::kMillisecond)->Arg(1)->Arg(4);
    benchmark::RegisterBenchmark("BM_adam_step_cuda<bf16_state>", BM_adam_step_cuda<bf16_state>)->UseManualTime()->Unit(benchmark::kMillisecond)->Arg(1)->Arg(4);
    benchmark::RegisterBenchmark("BM_adam_step_cuda<int8_256_state>", BM_adam_step_cuda<int8_256_state>)->UseManualTime()->Unit(benchmark::kMillisecond)->Arg(1)->Arg(4);
    benchmark::RegisterBenchmark("BM_adam_step_cuda<int8_2048_state>", BM_adam_step_cuda<int8_2048_state>)->UseManualTime()->Unit(benchmark::kMillisecond)->Arg(1)->Arg(4);
    benchmark::RegisterBenchmark("BM_adam_step_cuda<int4_state>", BM_adam_step_cuda<int4_state>)->UseManualTime()->Unit(benchmark::kMillisecond)->Arg(1)->Arg(4);
    // The previous update kernel, side by side (four steps back to back: the device's time).
    benchmark::RegisterBenchmark("BM_adam_step_cuda_previous<fp32_state>", BM_adam_step_cuda<fp32_state, false>)->UseManualTime()->Unit(benchmark::kMillisecond)->Arg(4);
    benchmark::RegisterBenchmark("BM_adam_step_cuda_previous<bf16_state>", BM_adam_step_cuda<bf16_state, false>)->UseManualTime()->Unit(benchmark::kMillisecond)->Arg(4);
    benchmark::RegisterBenchmark("BM_adam_step_cuda_previous<int8_256_state>", BM_adam_step_cuda<int8_256_state, false>)->UseManualTime()->Unit(benchmark::kMillisecond)->Arg(4);
    benchmark::RegisterBenchmark("BM_adam_step_cuda_previous<int4_state>", BM_adam_step_cuda<int4_state, false>)->UseManualTime()->Unit(benchmark::kMillisecond)->Arg(4);
  });
}
