// Checks of the nvcc compilation that need no device: they run on every machine with the toolkit.
#include <doctest/doctest.h>
#include <memkit/memkit.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>

static_assert(MEMKIT_HAS_CUDA == 1, "nvcc must switch the CUDA paths on");

namespace {
std::uint16_t bits_of(__nv_bfloat16 value) { return static_cast<__nv_bfloat16_raw>(value).x; }
std::uint16_t bits_of(__half value) { return static_cast<__half_raw>(value).x; }
float float_from_bits(std::uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}
}  // namespace

TEST_CASE("float16: memkit's conversions match CUDA's __float2bfloat16 / __float2half bit for bit") {
  // Every 251st float bit pattern (all exponents, signs and mantissa regions), plus random ones.
  int bf16_mismatches = 0, fp16_mismatches = 0, back_mismatches = 0;
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  auto check_one = [&](std::uint32_t bits) {
    const float x = float_from_bits(bits);
    if (memkit::float_to_bf16_bits(x) != bits_of(__float2bfloat16(x))) ++bf16_mismatches;
    if (memkit::float_to_fp16_bits(x) != bits_of(__float2half(x))) ++fp16_mismatches;
  };
  for (std::uint64_t bits = 0; bits <= 0xffffffffull; bits += 251) check_one(static_cast<std::uint32_t>(bits));
  for (int i = 0; i < 1000000; ++i) check_one(any_bits(rng));
  for (std::uint32_t raw = 0; raw <= 0xffff; ++raw) {
    const auto r = static_cast<std::uint16_t>(raw);
    const float ours_b = memkit::bf16::from_bits(r), cuda_b = __bfloat162float(__nv_bfloat16_raw{r});
    const float ours_h = memkit::fp16::from_bits(r), cuda_h = __half2float(__half_raw{r});
    // CUDA may change a NaN's payload when widening; NaN must stay NaN, everything else bit-exact.
    const auto same = [](float a, float b) { return std::isnan(a) ? std::isnan(b) : std::memcmp(&a, &b, 4) == 0; };
    if (!same(ours_b, cuda_b) || !same(ours_h, cuda_h)) ++back_mismatches;
  }
  CHECK(bf16_mismatches == 0);
  CHECK(fp16_mismatches == 0);
  CHECK(back_mismatches == 0);
}

TEST_CASE("float16: memkit and CUDA 16-bit types convert into each other without changing bits") {
  const memkit::bf16 b(3.140625f);
  const memkit::fp16 h(-0.333f);
  CHECK(bits_of(memkit::to_cuda(b)) == b.bits);
  CHECK(bits_of(memkit::to_cuda(h)) == h.bits);
  CHECK(memkit::from_cuda(memkit::to_cuda(b)).bits == b.bits);
  CHECK(memkit::from_cuda(memkit::to_cuda(h)).bits == h.bits);
}

TEST_CASE("MEMKIT_CUDA_CHECK: a failed call throws cuda_error naming the call, file, line and CUDA's message") {
  const int line = __LINE__ + 2;
  try {
    MEMKIT_CUDA_CHECK(cudaErrorInvalidValue);
    FAIL("no exception");
  } catch (const memkit::cuda_error& failure) {
    const std::string message = failure.what();
    CHECK(failure.code() == cudaErrorInvalidValue);
    CHECK(message.find("CUDA call `cudaErrorInvalidValue` failed at ") == 0);
    CHECK(message.find("cuda_host_test.cu:" + std::to_string(line)) != std::string::npos);
    CHECK(message.find("cudaErrorInvalidValue (invalid argument)") != std::string::npos);
  }
  CHECK_NOTHROW(MEMKIT_CUDA_CHECK(cudaSuccess));
}

TEST_CASE("cuda_executor: refuses pageable host memory, accepts device, managed and pinned memory") {
  float value = 0.0f;
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  const auto view_in = [&](memkit::memory_kind kind) { return memkit::tensor_view<float>(&value, {1}, kind); };
  CHECK_NOTHROW(memkit::require_accessible(gpu, view_in(memkit::memory_kind::device), "op", "x"));
  CHECK_NOTHROW(memkit::require_accessible(gpu, view_in(memkit::memory_kind::managed), "op", "x"));
  CHECK_NOTHROW(memkit::require_accessible(gpu, view_in(memkit::memory_kind::pinned_host), "op", "x"));
  CHECK_THROWS_WITH_AS(memkit::require_accessible(gpu, view_in(memkit::memory_kind::host), "adam_step", "grads"),
                       "adam_step: `grads` is in host memory, which the cuda executor cannot access "
                       "(use device, managed or pinned_host memory)",
                       memkit::error);
  static_assert(memkit::executor<memkit::cuda_executor>);
}

// The stream is always the caller's explicit choice (docs/cuda.md, "Streams").
static_assert(!std::is_default_constructible_v<memkit::cuda_executor>, "a cuda_executor must name its stream");
static_assert(!std::is_constructible_v<memkit::cuda_executor, int, std::nullptr_t>,
              "a null stream means legacy or per-thread depending on a compiler flag: name it instead");
static_assert(std::is_constructible_v<memkit::cuda_executor, int, cudaStream_t>);

TEST_CASE("cuda_executor: the named default streams are CUDA's special handles, whatever --default-stream says") {
  const memkit::cuda_executor legacy = memkit::cuda_executor::legacy_default_stream(1);
  const memkit::cuda_executor per_thread = memkit::cuda_executor::per_thread_default_stream();
  CHECK(legacy.device == 1);
  CHECK(legacy.stream == cudaStreamLegacy);
  CHECK(per_thread.device == 0);
  CHECK(per_thread.stream == cudaStreamPerThread);
  CHECK(legacy.stream != nullptr);
  CHECK(per_thread.stream != nullptr);
}

namespace {
// Host memory that calls itself device memory and is not stream-ordered (as device_resource is not): lets the
// CUDA entry points run their argument checks here, where no device exists.
class fake_device_memory final : public memkit::memory_resource {
 public:
  memkit::memory_kind kind() const noexcept override { return memkit::memory_kind::device; }
  const char* name() const noexcept override { return "fake_device"; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override { return heap_.allocate(bytes, alignment); }
  void do_deallocate(void* pointer, std::size_t bytes, std::size_t alignment) noexcept override {
    heap_.deallocate(pointer, bytes, alignment);
  }

 private:
  memkit::host_resource heap_;
};
}  // namespace

TEST_CASE("CUDA workspace: matmul's tiled path and quantize_into refuse a resource that is not stream-ordered") {
  namespace q = memkit::quant;
  fake_device_memory fake;
  memkit::tracking_resource tracker(fake, "fake");
  memkit::memory_resource& workspace = tracker.category(memkit::memory_category::workspace);
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  q::quantized_tensor<q::NF4> w(fake, memkit::shape{64, 64}, {64, true});
  memkit::buffer<memkit::bf16> x(fake, memkit::shape{16, 64}), y(fake, memkit::shape{16, 64});
  // M = 16 takes the tiled cuBLAS path, whose tile would be freed with a synchronizing cudaFree.
  CHECK_THROWS_WITH_AS(q::matmul(gpu, memkit::tensor_view<const memkit::bf16>(x.view()), w, y.view(), q::matmul_config{},
                                 workspace),
                       doctest::Contains("quant::matmul (CUDA): the workspace resource (workspace) is not stream-ordered"),
                       memkit::error);
  CHECK_THROWS_WITH_AS(
      q::matmul_input_grad(gpu, memkit::tensor_view<const memkit::bf16>(y.view()), w, x.view(), q::matmul_config{}, workspace),
      doctest::Contains("quant::matmul_input_grad (CUDA): the workspace resource (workspace) is not stream-ordered"),
      memkit::error);
  memkit::buffer<float> input(fake, memkit::shape{64, 64});
  CHECK_THROWS_WITH_AS(w.quantize_into(gpu, memkit::tensor_view<const float>(input.view()), "weight", workspace),
                       doctest::Contains("quantized_tensor::quantize_into (CUDA): the workspace resource (workspace) "
                                         "is not stream-ordered"),
                       memkit::error);
  CHECK(tracker.current_bytes() == 0);  // refused before anything was allocated
}
