// Device memory bandwidth: cudaMemcpy device-to-device, and a vectorized copy kernel, timed with
// CUDA events. Reports bytes/s and the fraction of the data-sheet peak (2 x memory clock x bus
// width); memkit's device kernels report against the measured copy figure.
#include <benchmark/benchmark.h>
#include <memkit/memkit.hpp>

#include <cstdio>
#include <string>

#include "support/roofline.hpp"

namespace {

constexpr std::size_t kBytes = std::size_t{1} << 30;  // 1 GiB per buffer

double datasheet_peak_bytes_per_second() {
  int clock_khz = 0, bus_bits = 0;
  MEMKIT_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, 0));
  MEMKIT_CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0));
  return 2.0 * clock_khz * 1e3 * bus_bits / 8.0;
}

__global__ void copy_kernel(const float4* __restrict__ in, float4* __restrict__ out, std::size_t count) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < count;
       i += std::size_t{gridDim.x} * blockDim.x)
    out[i] = in[i];
}

template <class Body>
void time_with_events(benchmark::State& state, Body&& body, double bytes) {
  cudaEvent_t start, stop;
  MEMKIT_CUDA_CHECK(cudaEventCreate(&start));
  MEMKIT_CUDA_CHECK(cudaEventCreate(&stop));
  body();  // warm-up
  double total_seconds = 0.0;
  for (auto _ : state) {
    MEMKIT_CUDA_CHECK(cudaEventRecord(start));
    body();
    MEMKIT_CUDA_CHECK(cudaEventRecord(stop));
    MEMKIT_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    MEMKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(ms / 1e3);
    total_seconds += ms / 1e3;
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  // The device copy's roofline is the data sheet; later device benchmarks use the measured copy.
  memkit_bench::roofline_timer::report(state, bytes * static_cast<double>(state.iterations()), total_seconds,
                                       datasheet_peak_bytes_per_second());
  MEMKIT_CUDA_CHECK(cudaEventDestroy(start));
  MEMKIT_CUDA_CHECK(cudaEventDestroy(stop));
}

void BM_device_memcpy(benchmark::State& state) {
  memkit::device_resource device;
  memkit::buffer<std::byte> a(device, memkit::shape{static_cast<std::int64_t>(kBytes)}),
      b(device, memkit::shape{static_cast<std::int64_t>(kBytes)});
  time_with_events(state, [&] { MEMKIT_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), kBytes, cudaMemcpyDeviceToDevice)); },
                   2.0 * kBytes);
}

void BM_device_copy_kernel(benchmark::State& state) {
  memkit::device_resource device;
  memkit::buffer<float4> a(device, memkit::shape{static_cast<std::int64_t>(kBytes / sizeof(float4))}),
      b(device, memkit::shape{static_cast<std::int64_t>(kBytes / sizeof(float4))});
  int sms = 0;
  MEMKIT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  time_with_events(state, [&] { copy_kernel<<<sms * 8, 256>>>(a.data(), b.data(), a.size()); }, 2.0 * kBytes);
}

bool have_device() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (!have_device()) {
    std::printf("memkit_bench_bandwidth_cuda: no CUDA device; nothing measured\n");
    return 0;
  }
  benchmark::RegisterBenchmark("BM_device_memcpy", BM_device_memcpy)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_device_copy_kernel", BM_device_copy_kernel)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
