// Device memory bandwidth: cudaMemcpy device-to-device, and a vectorized copy kernel, timed with
// CUDA events. Reports bytes/s and the fraction of the data-sheet peak (2 x memory clock x bus
// width); memkit's device kernels report against the measured copy figure.
#include <benchmark/benchmark.h>
#include <memkit/memkit.hpp>

#include <string>

#include "support/cuda_timing.hpp"

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

// The device copy's roofline is the data sheet; memkit's device benchmarks report against the measured copy.
template <class Body>
void time_copy(benchmark::State& state, Body&& body, double bytes) {
  const double seconds = memkit_bench::time_with_events(state, body);
  memkit_bench::report_device_throughput(state, bytes, seconds, datasheet_peak_bytes_per_second());
}

void BM_device_memcpy(benchmark::State& state) {
  memkit::device_resource device;
  memkit::buffer<std::byte> a(device, memkit::shape{static_cast<std::int64_t>(kBytes)}),
      b(device, memkit::shape{static_cast<std::int64_t>(kBytes)});
  time_copy(state, [&] { MEMKIT_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), kBytes, cudaMemcpyDeviceToDevice)); },
            2.0 * kBytes);
}

void BM_device_copy_kernel(benchmark::State& state) {
  memkit::device_resource device;
  memkit::buffer<float4> a(device, memkit::shape{static_cast<std::int64_t>(kBytes / sizeof(float4))}),
      b(device, memkit::shape{static_cast<std::int64_t>(kBytes / sizeof(float4))});
  int sms = 0;
  MEMKIT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  time_copy(state,
            [&] {
              copy_kernel<<<sms * 8, 256>>>(a.data(), b.data(), static_cast<std::size_t>(a.size()));
              MEMKIT_CUDA_CHECK(cudaGetLastError());
            },
            2.0 * kBytes);
}

}  // namespace

int main(int argc, char** argv) {
  return memkit_bench::run_cuda_benchmarks(argc, argv, "memkit_bench_bandwidth_cuda", [] {
    benchmark::RegisterBenchmark("BM_device_memcpy", BM_device_memcpy)->UseManualTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_device_copy_kernel", BM_device_copy_kernel)->UseManualTime()->Unit(benchmark::kMillisecond);
  });
}
