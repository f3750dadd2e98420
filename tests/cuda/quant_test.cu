// Quantization on CUDA: the device results must equal the host reference bit for bit.
// Cases in the "gpu" suite need a device; the others check the nvcc build of the shared math and run anywhere.
#include <memkit/memkit.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "support/gpu_test.hpp"
#include "support/test_values.hpp"

namespace q = memkit::quant;

namespace {

template <class T>
std::vector<T> to_host(const T* device_pointer, std::size_t count) {
  std::vector<T> out(count);
  if (count) MEMKIT_CUDA_CHECK(cudaMemcpy(out.data(), device_pointer, count * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

template <class T>
memkit::buffer<T> to_device(memkit::memory_resource& resource, const std::vector<T>& values) {
  memkit::buffer<T> out(resource, memkit::shape{static_cast<std::int64_t>(values.size())});
  if (!values.empty())
    MEMKIT_CUDA_CHECK(cudaMemcpy(out.data(), values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice));
  return out;
}

// Random normal values with adversarial ones mixed in: exact ties for every threshold, zeros of both signs,
// all-zero blocks, subnormals, huge values, block-maximum duplicates.
std::vector<float> adversarial_input(std::int64_t count, std::int64_t block_size, unsigned seed) {
  std::vector<float> values = memkit_test::standard_normal(count, seed);
  const float specials[] = {0.0f, -0.0f, 1e-40f, -1e-40f, 3e38f, -3e38f, 0.8614784181118011f, -0.8480964004993439f,
                            0.03979014977812767f, 0.583333f, -0.0859375f, 0.00260417f, 1.0f, -1.0f};
  for (std::int64_t i = 0; i < count; i += 7) values[static_cast<std::size_t>(i)] = specials[(i / 7) % 14];
  // Blocks scaled by 2 so that x * (1/absmax) hits thresholds exactly, and one all-zero block.
  const std::int64_t blocks = q::block_count(count, block_size);
  for (std::int64_t b = 1; b < blocks; b += 3) {
    const std::int64_t begin = b * block_size;
    const std::int64_t end = std::min(count, begin + block_size);
    for (std::int64_t i = begin; i < end; ++i) values[static_cast<std::size_t>(i)] = 2.0f * specials[6 + i % 8];
    values[static_cast<std::size_t>(begin)] = 2.0f;
  }
  if (blocks > 2)
    for (std::int64_t i = 2 * block_size; i < std::min(count, 3 * block_size); ++i) values[static_cast<std::size_t>(i)] = 0.0f;
  return values;
}

// adversarial_input in the input type. fp16 cannot hold the +-3e38 specials (they would round to Inf, which
// the host reference refuses): they become fp16's largest finite magnitude, still the block maximum.
template <class In>
std::vector<In> adversarial_input_as(std::int64_t count, std::int64_t block_size, unsigned seed) {
  std::vector<float> values = adversarial_input(count, block_size, seed);
  if constexpr (std::is_same_v<In, memkit::fp16>)
    for (float& v : values) v = std::fmax(-65504.0f, std::fmin(v, 65504.0f));
  return memkit_test::convert<In>(values);
}

template <class In, class Out>
void check_host_device_equal(q::format fmt, std::int64_t count, std::int64_t block_size, unsigned seed) {
  CAPTURE(q::to_string(fmt));
  CAPTURE(count);
  CAPTURE(block_size);
  const std::vector<In> input = adversarial_input_as<In>(count, block_size, seed);
  const std::int64_t bytes = q::code_bytes(fmt, count), blocks = q::block_count(count, block_size);

  std::vector<std::uint8_t> host_codes(static_cast<std::size_t>(bytes));
  std::vector<float> host_absmax(static_cast<std::size_t>(blocks));
  q::quantize_blockwise(memkit::host, fmt, memkit::host_view(input.data(), {count}), block_size,
                        memkit::host_view(host_codes), memkit::host_view(host_absmax));

  memkit::device_resource device;
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  auto d_input = to_device(device, input);
  memkit::buffer<std::uint8_t> d_codes(device, {bytes});
  memkit::buffer<float> d_absmax(device, {blocks});
  q::quantize_blockwise(gpu, fmt, d_input.view(), block_size, d_codes.view(), d_absmax.view());
  gpu.synchronize();
  CHECK(to_host(d_codes.data(), static_cast<std::size_t>(bytes)) == host_codes);
  const std::vector<float> device_absmax = to_host(d_absmax.data(), static_cast<std::size_t>(blocks));
  CHECK(std::memcmp(device_absmax.data(), host_absmax.data(), host_absmax.size() * sizeof(float)) == 0);

  // Whole-tensor and tile dequantization, including unaligned starts that take the generic kernel.
  for (std::int64_t first : {std::int64_t{0}, std::int64_t{1}, std::int64_t{8}, count / 3}) {
    const std::int64_t n = count - first;
    if (n <= 0) continue;
    std::vector<Out> host_out(static_cast<std::size_t>(n));
    q::dequantize_blockwise(memkit::host, fmt, memkit::host_view(host_codes.data(), {bytes}),
                            memkit::host_view(host_absmax.data(), {blocks}), block_size, first,
                            memkit::host_view(host_out));
    memkit::buffer<Out> d_out(device, {n});
    q::dequantize_blockwise(gpu, fmt, memkit::tensor_view<const std::uint8_t>(d_codes.view()),
                            memkit::tensor_view<const float>(d_absmax.view()), block_size, first, d_out.view());
    gpu.synchronize();
    const std::vector<Out> device_out = to_host(d_out.data(), static_cast<std::size_t>(n));
    CHECK(std::memcmp(device_out.data(), host_out.data(), host_out.size() * sizeof(Out)) == 0);
  }
}

}  // namespace

TEST_CASE("quant cuda build: the shared per-element math compiles under nvcc and matches the tables") {
  for (int code = 0; code < 16; ++code) {
    CHECK(q::encode<q::format::nf4>(q::nf4_codebook[code], nullptr) == code);
    CHECK(q::decode<q::format::nf4>(static_cast<std::uint8_t>(code), 2.0f, nullptr) == 2.0f * q::nf4_codebook[code]);
    if (code != 8) CHECK(q::encode<q::format::fp4>(q::fp4_codebook[code], nullptr) == code);
  }
  CHECK(q::encode<q::format::int8>(0.0f, q::dynamic_map_signed.data()) == 127);
}

// Runs without a device: the host half of the GPU comparison below must accept its inputs in every type.
TEST_CASE("quant cuda test inputs: the host reference quantizes every adversarial input the GPU case uses") {
  auto host_quantizes = [](auto tag, std::int64_t count, std::int64_t block) {
    using In = decltype(tag);
    const std::vector<In> input = adversarial_input_as<In>(count, block, 7);
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(q::code_bytes(q::format::nf4, count)));
    std::vector<float> absmax(static_cast<std::size_t>(q::block_count(count, block)));
    q::quantize_blockwise(memkit::host, q::format::nf4, memkit::host_view(input.data(), {count}), block,
                          memkit::host_view(codes), memkit::host_view(absmax));
  };
  for (std::int64_t block : {32, 64, 256, 4096})
    for (std::int64_t count : {1, 33, 4097, 100003}) {
      CAPTURE(block);
      CAPTURE(count);
      CHECK_NOTHROW(host_quantizes(float{}, count, block));
      CHECK_NOTHROW(host_quantizes(memkit::bf16{}, count, block));
      CHECK_NOTHROW(host_quantizes(memkit::fp16{}, count, block));
    }
}

MEMKIT_GPU_TEST_CASE("gpu: blockwise quantize and dequantize equal the host bit for bit") {
  unsigned seed = 1;
  for (q::format fmt : {q::format::nf4, q::format::fp4, q::format::int8}) {
    for (std::int64_t block : {32, 64, 256, 4096}) {
      for (std::int64_t count : {1, 33, 4097, 100003}) {
        check_host_device_equal<float, float>(fmt, count, block, ++seed);
        check_host_device_equal<memkit::bf16, memkit::bf16>(fmt, count, block, ++seed);
        check_host_device_equal<memkit::fp16, memkit::fp16>(fmt, count, block, ++seed);
        check_host_device_equal<memkit::bf16, float>(fmt, count, block, ++seed);
      }
    }
  }
}

MEMKIT_GPU_TEST_CASE("gpu: a non-finite value marks its block's absmax as NaN") {
  std::vector<float> input(1000, 0.5f);
  input[700] = std::numeric_limits<float>::infinity();
  memkit::device_resource device;
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  auto d_input = to_device(device, input);
  memkit::buffer<std::uint8_t> d_codes(device, {500});
  memkit::buffer<float> d_absmax(device, {16});
  q::quantize_blockwise(gpu, q::format::nf4, d_input.view(), 64, d_codes.view(), d_absmax.view());
  gpu.synchronize();
  const std::vector<float> absmax = to_host(d_absmax.data(), 16);
  CHECK(q::find_nonfinite_block(memkit::host_view(absmax.data(), {16})) == 10);
  CHECK(std::isnan(absmax[10]));
}

MEMKIT_GPU_TEST_CASE("gpu: double-quantized scales and quantized_tensor equal the host bit for bit") {
  memkit::device_resource device;
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  for (std::int64_t blocks : {1, 255, 257, 70000}) {
    CAPTURE(blocks);
    std::mt19937 rng(static_cast<unsigned>(blocks));
    std::uniform_real_distribution<float> uniform(0.0f, 3.0f);
    std::vector<float> absmax(static_cast<std::size_t>(blocks));
    for (float& a : absmax) a = uniform(rng);
    const std::int64_t groups = q::nested_group_count(blocks);
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(blocks));
    std::vector<float> group(static_cast<std::size_t>(groups));
    float offset = 0;
    q::quantize_scales(memkit::host, memkit::host_view(absmax.data(), {blocks}), memkit::host_view(codes),
                       memkit::host_view(group), memkit::host_view(&offset, {1}));
    auto d_absmax = to_device(device, absmax);
    memkit::buffer<std::uint8_t> d_codes(device, {blocks});
    memkit::buffer<float> d_group(device, {groups});
    memkit::buffer<float> d_offset(device, {1});
    q::quantize_scales(gpu, memkit::tensor_view<const float>(d_absmax.view()), d_codes.view(), d_group.view(),
                       d_offset.view());
    gpu.synchronize();
    CHECK(to_host(d_codes.data(), codes.size()) == codes);
    CHECK(to_host(d_group.data(), group.size()) == group);
    CHECK(to_host(d_offset.data(), 1)[0] == offset);
  }
  // A whole tensor with double quantization, quantized and dequantized on both sides.
  const memkit::shape dims{300, 515};
  const std::vector<float> data = adversarial_input(dims.numel(), 64, 99);
  const auto on_host = q::quantized_tensor<q::NF4>::quantize(memkit::host, memkit::host_view(data.data(), dims),
                                                             {64, true}, memkit::default_host_resource());
  auto d_data = to_device(device, data);
  const auto on_device = q::quantized_tensor<q::NF4>::quantize(gpu, d_data.view().reshaped(dims), {64, true}, device);
  on_device.require_finite(gpu, "w");
  CHECK(to_host(on_device.codes().data(), static_cast<std::size_t>(on_device.codes().size())) ==
        std::vector<std::uint8_t>(on_host.codes().begin(), on_host.codes().end()));
  std::vector<memkit::bf16> host_out(static_cast<std::size_t>(dims.numel()));
  on_host.dequantize(memkit::host, memkit::host_view(host_out));
  memkit::buffer<memkit::bf16> d_out(device, {dims.numel()});
  on_device.dequantize(gpu, d_out.view());
  gpu.synchronize();
  const std::vector<memkit::bf16> device_out = to_host(d_out.data(), host_out.size());
  CHECK(std::memcmp(device_out.data(), host_out.data(), host_out.size() * sizeof(memkit::bf16)) == 0);
}

namespace {
// Counts the entries of `device` that differ from `host` by more than tolerance * (|host| + the sum of the
// magnitudes of the products that make the entry): out[r, c] = sum over i of a[r, i] * b(i, c). The two
// sides sum in different orders, and the CUDA large-batch path rounds the dequantized weight to T first.
template <class T, class B>
int count_outside_bound(const std::vector<T>& device, const std::vector<T>& host, const std::vector<T>& a,
                        std::int64_t rows, std::int64_t inner, std::int64_t cols, B b, double tolerance) {
  int outside = 0;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      double magnitude = 0;
      for (std::int64_t i = 0; i < inner; ++i)
        magnitude += std::fabs(static_cast<double>(memkit::to_float(a[static_cast<std::size_t>(r * inner + i)])) * b(i, c));
      const double expected = memkit::to_float(host[static_cast<std::size_t>(r * cols + c)]);
      const double got = memkit::to_float(device[static_cast<std::size_t>(r * cols + c)]);
      if (!(std::fabs(got - expected) <= tolerance * (std::fabs(expected) + magnitude))) ++outside;
    }
  return outside;
}

// The CUDA matmul against the host one (both fp32-accumulated; summation order differs).
template <class T>
void check_matmul_gpu(std::int64_t M, std::int64_t N, std::int64_t K, const q::matmul_config& config = {}) {
  CAPTURE(M);
  CAPTURE(N);
  CAPTURE(K);
  memkit::device_resource device;
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  std::vector<float> weights = memkit_test::standard_normal(N * K, 5);
  const auto w_host = q::quantized_tensor<q::NF4>::quantize(memkit::host, memkit::host_view(weights.data(), {N, K}),
                                                            {64, true}, memkit::default_host_resource());
  std::vector<float> dense(static_cast<std::size_t>(N * K));  // for the error bound only
  w_host.dequantize(memkit::host, memkit::host_view(dense));
  auto d_weights = to_device(device, weights);
  const auto w_dev = q::quantized_tensor<q::NF4>::quantize(gpu, d_weights.view().reshaped({N, K}), {64, true}, device);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<T> x(static_cast<std::size_t>(M * K)), dy(static_cast<std::size_t>(M * N));
  for (T& v : x) v = memkit::from_float<T>(uniform(rng));
  for (T& v : dy) v = memkit::from_float<T>(uniform(rng));
  std::vector<T> y_host(static_cast<std::size_t>(M * N)), dx_host(static_cast<std::size_t>(M * K));
  q::matmul(memkit::host, memkit::host_view(x.data(), {M, K}), w_host, memkit::host_view(y_host.data(), {M, N}),
            q::matmul_config{}, memkit::default_host_resource());
  q::matmul_input_grad(memkit::host, memkit::host_view(dy.data(), {M, N}), w_host,
                       memkit::host_view(dx_host.data(), {M, K}), q::matmul_config{}, memkit::default_host_resource());
  auto d_x = to_device(device, x);
  auto d_dy = to_device(device, dy);
  memkit::buffer<T> d_y(device, {M, N}), d_dx(device, {M, K});
  memkit::device_async_resource workspace(gpu.stream);  // the tiled path's workspace is stream-ordered
  q::matmul(gpu, memkit::tensor_view<const T>(d_x.view().reshaped({M, K})), w_dev, d_y.view(), config, workspace);
  q::matmul_input_grad(gpu, memkit::tensor_view<const T>(d_dy.view().reshaped({M, N})), w_dev, d_dx.view(),
                       config, workspace);
  gpu.synchronize();
  const std::vector<T> y_dev = to_host(d_y.data(), y_host.size()), dx_dev = to_host(d_dx.data(), dx_host.size());
  // fp32: accumulation order only; 16-bit: a few units of 2^-9 from the rounded weights and outputs.
  const double tolerance = sizeof(T) == 4 ? 1e-4 : 1e-2;
  CHECK(count_outside_bound(y_dev, y_host, x, M, K, N,
                            [&](std::int64_t k, std::int64_t n) { return dense[static_cast<std::size_t>(n * K + k)]; },
                            tolerance) == 0);
  CHECK(count_outside_bound(dx_dev, dx_host, dy, M, N, K,
                            [&](std::int64_t n, std::int64_t k) { return dense[static_cast<std::size_t>(n * K + k)]; },
                            tolerance) == 0);
}
}  // namespace

// Runs without a device: the bound the GPU matmul case applies accepts the host result and rejects one
// entry that is off by 5% of the products' magnitudes (a vacuous bound would accept it).
TEST_CASE("quant cuda test: the matmul error bound rejects a wrong entry") {
  const std::int64_t M = 3, N = 5, K = 64;
  const std::vector<float> x = memkit_test::uniform_values(M * K, 1), w = memkit_test::uniform_values(N * K, 2);
  auto weight = [&](std::int64_t k, std::int64_t n) { return w[static_cast<std::size_t>(n * K + k)]; };
  std::vector<float> y(static_cast<std::size_t>(M * N));
  double magnitude_of_entry_7 = 0;
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) {
      double sum = 0, magnitude = 0;
      for (std::int64_t k = 0; k < K; ++k) {
        sum += static_cast<double>(x[static_cast<std::size_t>(m * K + k)]) * weight(k, n);
        magnitude += std::fabs(static_cast<double>(x[static_cast<std::size_t>(m * K + k)]) * weight(k, n));
      }
      y[static_cast<std::size_t>(m * N + n)] = static_cast<float>(sum);
      if (m * N + n == 7) magnitude_of_entry_7 = magnitude;
    }
  CHECK(count_outside_bound(y, y, x, M, K, N, weight, 1e-4) == 0);
  std::vector<float> wrong = y;
  wrong[7] += static_cast<float>(0.05 * magnitude_of_entry_7);
  CHECK(count_outside_bound(wrong, y, x, M, K, N, weight, 1e-4) == 1);
  CHECK(count_outside_bound(wrong, y, x, M, K, N, weight, 1e-2) == 1);
}

MEMKIT_GPU_TEST_CASE("gpu: quantized matmul (fused small batch and cuBLAS large batch) matches the host") {
  check_matmul_gpu<float>(1, 96, 256);
  check_matmul_gpu<memkit::bf16>(4, 130, 200);
  check_matmul_gpu<memkit::bf16>(64, 256, 512);
  q::matmul_config uneven_tiles;  // several cuBLAS tiles of 100 rows, the last one of 56
  uneven_tiles.device_tile_floats = 100 * 512;
  check_matmul_gpu<memkit::bf16>(64, 256, 512, uneven_tiles);
  check_matmul_gpu<memkit::fp16>(33, 100, 96);
  check_matmul_gpu<float>(20, 64, 130);
}

// #30: the register-codebook GEMV (the default for 4-bit formats) keeps the previous shared-memory kernel's
// per-lane order and expressions, so both give the same bits: plain and double-quantized scales, 16-byte and
// scalar rows (K % 32 != 0), rows of several load groups (K > 4096) and a partial last group.
template <q::format F, class T>
void check_gemv_kernels_agree(std::int64_t M, std::int64_t N, std::int64_t K, bool double_quant) {
  CAPTURE(M);
  CAPTURE(N);
  CAPTURE(K);
  CAPTURE(double_quant);
  memkit::device_resource device;
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  auto d_weights = to_device(device, memkit_test::standard_normal(N * K, 11));
  const auto w = q::quantized_tensor<F>::quantize(gpu, d_weights.view().reshaped({N, K}), {64, double_quant}, device);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<T> x(static_cast<std::size_t>(M * K));
  for (T& v : x) v = memkit::from_float<T>(uniform(rng));
  auto d_x = to_device(device, x);
  memkit::buffer<T> y_shuffle(device, {M, N}), y_shared(device, {M, N});
  memkit::device_async_resource workspace(gpu.stream);
  q::matmul_config shuffle, shared;
  shuffle.device_gemv_shuffle = true;
  q::matmul(gpu, memkit::tensor_view<const T>(d_x.view().reshaped({M, K})), w, y_shuffle.view(), shuffle, workspace);
  q::matmul(gpu, memkit::tensor_view<const T>(d_x.view().reshaped({M, K})), w, y_shared.view(), shared, workspace);
  gpu.synchronize();
  const std::vector<T> a = to_host(y_shuffle.data(), static_cast<std::size_t>(M * N));
  const std::vector<T> b = to_host(y_shared.data(), static_cast<std::size_t>(M * N));
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

MEMKIT_GPU_TEST_CASE("gpu: the shuffle-codebook GEMV gives the shared-memory kernel's bits") {
  for (bool double_quant : {false, true}) {
    check_gemv_kernels_agree<q::NF4, memkit::bf16>(1, 37, 9216, double_quant);  // 3 load groups, the last partial
    check_gemv_kernels_agree<q::NF4, memkit::bf16>(8, 70, 512, double_quant);
    check_gemv_kernels_agree<q::NF4, float>(3, 33, 200, double_quant);          // the scalar path
    check_gemv_kernels_agree<q::FP4, memkit::fp16>(5, 64, 4160, double_quant);
  }
}

MEMKIT_GPU_TEST_CASE("gpu: empty tensors: K = 0 and N = 0 products write zeros, zero blocks write a zero offset") {
  cudaStream_t stream;
  MEMKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const memkit::cuda_executor gpu{0, stream};
  memkit::device_resource device;
  memkit::device_async_resource workspace(stream);
  const auto empty_input = memkit::tensor_view<const float>(nullptr, memkit::shape{0}, memkit::memory_kind::device);
  auto all_zero = [](const memkit::buffer<memkit::bf16>& out) {
    const std::vector<memkit::bf16> host = to_host(out.data(), static_cast<std::size_t>(out.size()));
    int nonzero = 0;
    for (memkit::bf16 v : host) nonzero += v.bits != 0;
    return nonzero == 0;
  };
  for (std::int64_t M : {1, 40}) {  // the fused kernels and the cuBLAS path
    CAPTURE(M);
    q::quantized_tensor<q::NF4> w_no_k(device, memkit::shape{8, 0}, {64, true});
    w_no_k.quantize_into(gpu, empty_input.reshaped({8, 0}), "weight", workspace);
    memkit::buffer<memkit::bf16> y(device, memkit::shape{M, 8});
    MEMKIT_CUDA_CHECK(cudaMemsetAsync(y.data(), 0xff, y.bytes(), stream));  // NaN until written
    q::matmul(gpu, memkit::tensor_view<const memkit::bf16>(nullptr, memkit::shape{M, 0}, memkit::memory_kind::device),
              w_no_k, y.view(), q::matmul_config{}, workspace);
    q::quantized_tensor<q::NF4> w_no_n(device, memkit::shape{0, 16}, {64, true});
    w_no_n.quantize_into(gpu, empty_input.reshaped({0, 16}), "weight", workspace);
    memkit::buffer<memkit::bf16> dx(device, memkit::shape{M, 16});
    MEMKIT_CUDA_CHECK(cudaMemsetAsync(dx.data(), 0xff, dx.bytes(), stream));
    q::matmul_input_grad(
        gpu, memkit::tensor_view<const memkit::bf16>(nullptr, memkit::shape{M, 0}, memkit::memory_kind::device), w_no_n,
        dx.view(), q::matmul_config{}, workspace);
    gpu.synchronize();
    CHECK(all_zero(y));
    CHECK(all_zero(dx));
  }
  // Zero blocks: the offset starts as NaN (what the allocation may hold) and must read 0 afterwards.
  q::quantized_tensor<q::NF4> w(device, memkit::shape{0, 64}, {64, true});
  MEMKIT_CUDA_CHECK(cudaMemsetAsync(w.offset_view().data(), 0xff, sizeof(float), stream));
  w.quantize_into(gpu, empty_input.reshaped({0, 64}), "weight", workspace);
  CHECK_NOTHROW(w.require_finite(gpu, "empty"));
  CHECK(to_host(std::as_const(w).offset_view().data(), 1)[0] == 0.0f);
  MEMKIT_CUDA_CHECK(cudaStreamDestroy(stream));
}
