// Device memory resources and device-side conversions: these need a CUDA device (suite "gpu").
#include <memkit/memkit.hpp>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "support/gpu_test.hpp"

namespace {
__global__ void convert_on_device(const float* input, std::uint16_t* bf16_out, std::uint16_t* fp16_out, int count) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count) {
    bf16_out[i] = memkit::bf16(input[i]).bits;
    fp16_out[i] = memkit::fp16(input[i]).bits;
  }
}

// Every float bit pattern u converts with pack_pair_rn (the low half from u, the high half from ~u, so both
// halves see every pattern) and with float16.hpp's integer rounding; counts the differences and keeps the
// smallest pattern that differs.
template <class T>
__global__ void compare_pair_conversion(unsigned long long* mismatches, unsigned* first_mismatch) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < (std::uint64_t{1} << 32);
       i += std::uint64_t{gridDim.x} * blockDim.x) {
    const auto u = static_cast<std::uint32_t>(i);
    const float low = __uint_as_float(u), high = __uint_as_float(~u);
    const std::uint32_t packed = memkit::detail::pack_pair_rn<T>(low, high);
    const std::uint32_t expected = T(low).bits | (static_cast<std::uint32_t>(T(high).bits) << 16);
    if (packed != expected) {
      atomicAdd(mismatches, 1ull);
      atomicMin(first_mismatch, (packed & 0xffffu) != (expected & 0xffffu) ? u : ~u);
    }
  }
}

template <class T>
void check_pair_conversion_exhaustively() {
  memkit::device_resource device;
  memkit::buffer<unsigned long long> d_count(device, memkit::shape{1});
  memkit::buffer<unsigned> d_first(device, memkit::shape{1});
  MEMKIT_CUDA_CHECK(cudaMemset(d_count.data(), 0, sizeof(unsigned long long)));
  MEMKIT_CUDA_CHECK(cudaMemset(d_first.data(), 0xff, sizeof(unsigned)));
  compare_pair_conversion<T><<<4096, 256>>>(d_count.data(), d_first.data());
  MEMKIT_CUDA_CHECK(cudaGetLastError());
  unsigned long long count = 0;
  unsigned first = 0;
  MEMKIT_CUDA_CHECK(cudaMemcpy(&count, d_count.data(), sizeof count, cudaMemcpyDeviceToHost));
  MEMKIT_CUDA_CHECK(cudaMemcpy(&first, d_first.data(), sizeof first, cudaMemcpyDeviceToHost));
  CAPTURE(first);
  CHECK(count == 0);
}
}  // namespace

MEMKIT_GPU_TEST_CASE("gpu: every CUDA memory resource allocates, is tracked, and releases") {
  memkit::device_resource device;
  memkit::pinned_host_resource pinned;
  memkit::managed_resource managed;
  cudaStream_t stream;
  MEMKIT_CUDA_CHECK(cudaStreamCreate(&stream));
  memkit::device_async_resource async_device(stream);

  memkit::memory_resource* resources[] = {&device, &pinned, &managed, &async_device};
  for (memkit::memory_resource* upstream : resources) {
    memkit::tracking_resource tracker(*upstream, upstream->name());
    {
      memkit::buffer<float> weights(tracker.category(memkit::memory_category::weights), memkit::shape{1 << 20});
      CHECK(weights.data() != nullptr);
      CHECK(weights.view().where() == upstream->kind());
      CHECK(reinterpret_cast<std::uintptr_t>(weights.data()) % memkit::default_alignment == 0);
      CHECK(tracker.current_bytes() == (1u << 20) * sizeof(float));
      MEMKIT_CUDA_CHECK(cudaMemsetAsync(weights.data(), 0, weights.bytes(), stream));
      MEMKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    CHECK(tracker.current_bytes() == 0);
    CHECK(tracker.peak_bytes() == (1u << 20) * sizeof(float));
  }
  MEMKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  MEMKIT_CUDA_CHECK(cudaStreamDestroy(stream));
}

MEMKIT_GPU_TEST_CASE("gpu: device out-of-memory names the request, the category and what was held") {
  memkit::device_resource device;
  memkit::tracking_resource tracker(device, "gpu-oom");
  memkit::buffer<float> weights(tracker.category(memkit::memory_category::weights), memkit::shape{1024});
  const std::size_t absurd = std::size_t{1} << 50;  // 1 PiB
  try {
    (void)tracker.category(memkit::memory_category::activations).allocate(absurd);
    FAIL("a 1 PiB device allocation succeeded");
  } catch (const memkit::out_of_memory& failure) {
    const std::string message = failure.what();
    CHECK(failure.requested_bytes() == absurd);
    CHECK(message.find("for activations from tracker 'gpu-oom'") != std::string::npos);
    CHECK(message.find("weights 4.00 KiB") != std::string::npos);
    CHECK(message.find("cudaMalloc") != std::string::npos);
  }
  // The device is still usable afterwards: the failure did not leave a sticky error behind.
  memkit::buffer<float> after(tracker.category(memkit::memory_category::activations), memkit::shape{16});
  CHECK(after.data() != nullptr);
}

MEMKIT_GPU_TEST_CASE("gpu: device float->bf16/fp16 conversion equals the host conversion") {
  std::mt19937 rng(99);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  const int count = 1 << 20;
  std::vector<float> input(count);
  for (float& x : input) {
    const std::uint32_t bits = any_bits(rng);
    std::memcpy(&x, &bits, sizeof x);
  }
  memkit::device_resource device;
  memkit::buffer<float> d_input(device, memkit::shape{count});
  memkit::buffer<std::uint16_t> d_bf16(device, memkit::shape{count}), d_fp16(device, memkit::shape{count});
  MEMKIT_CUDA_CHECK(cudaMemcpy(d_input.data(), input.data(), d_input.bytes(), cudaMemcpyHostToDevice));
  convert_on_device<<<(count + 255) / 256, 256>>>(d_input.data(), d_bf16.data(), d_fp16.data(), count);
  MEMKIT_CUDA_CHECK(cudaGetLastError());
  std::vector<std::uint16_t> bf16_bits(count), fp16_bits(count);
  MEMKIT_CUDA_CHECK(cudaMemcpy(bf16_bits.data(), d_bf16.data(), d_bf16.bytes(), cudaMemcpyDeviceToHost));
  MEMKIT_CUDA_CHECK(cudaMemcpy(fp16_bits.data(), d_fp16.data(), d_fp16.bytes(), cudaMemcpyDeviceToHost));
  int mismatches = 0;
  for (int i = 0; i < count; ++i)
    if (bf16_bits[i] != memkit::bf16(input[i]).bits || fp16_bits[i] != memkit::fp16(input[i]).bits) ++mismatches;
  CHECK(mismatches == 0);
}

MEMKIT_GPU_TEST_CASE("gpu: the paired conversion instruction gives float16.hpp's bits for every float") {
  check_pair_conversion_exhaustively<memkit::bf16>();
  check_pair_conversion_exhaustively<memkit::fp16>();
}
