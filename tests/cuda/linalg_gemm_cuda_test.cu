// linalg::gemm on a cuda_executor (cuBLAS): its checks on the host, and (suite "gpu") every transpose
// combination and element-type combination against the host gemm, with leading dimensions wider than the
// matrices, beta 0 (C not read) and beta 1, and the empty sum (K = 0).
#include <memkit/linalg/gemm.hpp>
#include <memkit/memory/buffer.hpp>
#include <memkit/memory/resource.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "support/gpu_test.hpp"
#include "support/test_values.hpp"

namespace {

namespace la = memkit::linalg;

template <class T>
la::matrix_ref<T> host_matrix(std::vector<T>& v, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  return {v.data(), rows, cols, ld, memkit::memory_kind::host};
}

}  // namespace

TEST_CASE("linalg::gemm on a cuda_executor refuses pageable host operands before touching the device") {
  std::vector<float> a(6, 1.0f), b(6, 1.0f), c(4, 0.0f);
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  // (a lambda: the macros below would split a template argument list at its commas)
  const auto product = [&](std::int64_t b_rows, std::int64_t b_cols) {
    la::gemm<float, float, float>(gpu, la::transpose::no, la::transpose::no, 1.0f, host_matrix(a, 2, 3, 3),
                                  host_matrix(b, b_rows, b_cols, b_cols), 0.0f, host_matrix(c, 2, 2, 2),
                                  memkit::default_host_resource());
  };
  CHECK_THROWS_WITH_AS(product(3, 2), doctest::Contains("pageable host memory"), memkit::error);
  // The shapes are checked first, with the host path's message.
  CHECK_THROWS_WITH_AS(product(2, 3), doctest::Contains("needs op(A) M x K"), memkit::error);
  static_assert(la::detail::cublas_gemm_types<memkit::bf16, memkit::bf16, float>);
  static_assert(la::detail::cublas_gemm_types<memkit::bf16, memkit::bf16, memkit::bf16>);
  static_assert(!la::detail::cublas_gemm_types<float, float, memkit::bf16>);
  static_assert(!la::detail::cublas_gemm_types<float, memkit::bf16, float>);
}

namespace {

// One product on the device and on the host from the same (rounded) inputs; the result's worst error
// relative to the largest |C| must stay under `tolerance` (both accumulate in fp32; 16-bit C rounds once).
template <class TI, class TC>
void compare(la::transpose op_a, la::transpose op_b, std::int64_t M, std::int64_t N, std::int64_t K, float beta,
             double tolerance) {
  CAPTURE(M);
  CAPTURE(N);
  CAPTURE(K);
  CAPTURE(beta);
  CAPTURE(static_cast<int>(op_a));
  CAPTURE(static_cast<int>(op_b));
  const std::int64_t a_rows = op_a == la::transpose::no ? M : K, a_cols = op_a == la::transpose::no ? K : M;
  const std::int64_t b_rows = op_b == la::transpose::no ? K : N, b_cols = op_b == la::transpose::no ? N : K;
  const std::int64_t lda = a_cols + 3, ldb = b_cols + 5, ldc = N + 2;  // wider than the matrices
  std::vector<TI> a = memkit_test::convert<TI>(memkit_test::uniform_values(std::max<std::int64_t>(1, a_rows * lda), 11));
  std::vector<TI> b = memkit_test::convert<TI>(memkit_test::uniform_values(std::max<std::int64_t>(1, b_rows * ldb), 12));
  std::vector<TC> c = memkit_test::convert<TC>(memkit_test::uniform_values(M * ldc, 13));
  if (beta == 0.0f)  // beta 0 must not read C: NaN there must not reach the result
    for (TC& v : c) v = memkit::from_float<TC>(std::numeric_limits<float>::quiet_NaN());
  std::vector<TC> expected = c;
  la::gemm<TI, TI, TC>(memkit::host, op_a, op_b, 0.75f, host_matrix(a, a_rows, a_cols, lda),
                       host_matrix(b, b_rows, b_cols, ldb), beta, host_matrix(expected, M, N, ldc),
                       memkit::default_host_resource());

  cudaStream_t stream;
  MEMKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const memkit::cuda_executor gpu{0, stream};
  memkit::device_resource device;
  auto upload = [&](const auto& v) {
    using V = typename std::decay_t<decltype(v)>::value_type;
    memkit::buffer<V> out(device, memkit::shape{static_cast<std::int64_t>(v.size())});
    MEMKIT_CUDA_CHECK(cudaMemcpy(out.data(), v.data(), v.size() * sizeof(V), cudaMemcpyHostToDevice));
    return out;
  };
  memkit::buffer<TI> a_d = upload(a), b_d = upload(b);
  memkit::buffer<TC> c_d = upload(c);
  la::gemm<TI, TI, TC>(gpu, op_a, op_b, 0.75f,
                       la::matrix_ref<const TI>(a_d.data(), a_rows, a_cols, lda, memkit::memory_kind::device),
                       la::matrix_ref<const TI>(b_d.data(), b_rows, b_cols, ldb, memkit::memory_kind::device), beta,
                       la::matrix_ref<TC>(c_d.data(), M, N, ldc, memkit::memory_kind::device),
                       memkit::default_host_resource());
  std::vector<TC> got(c.size());
  MEMKIT_CUDA_CHECK(cudaMemcpyAsync(got.data(), c_d.data(), got.size() * sizeof(TC), cudaMemcpyDeviceToHost, stream));
  MEMKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  MEMKIT_CUDA_CHECK(cudaStreamDestroy(stream));
  memkit::release_cublas_resources();

  double worst = 0.0, largest = 1e-6;
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) {
      const double e = memkit::to_float(expected[m * ldc + n]), g = memkit::to_float(got[m * ldc + n]);
      REQUIRE(std::isfinite(g));
      worst = std::max(worst, std::fabs(e - g));
      largest = std::max(largest, std::fabs(e));
    }
  CHECK(worst / largest <= tolerance);
  for (std::int64_t m = 0; m < M; ++m)  // the padding between rows is untouched
    for (std::int64_t n = N; n < ldc; ++n)
      CHECK(std::memcmp(&got[m * ldc + n], &c[m * ldc + n], sizeof(TC)) == 0);
}

template <class TI, class TC>
void every_transpose(double tolerance) {
  for (la::transpose op_a : {la::transpose::no, la::transpose::yes})
    for (la::transpose op_b : {la::transpose::no, la::transpose::yes})
      for (float beta : {0.0f, 1.0f}) {
        compare<TI, TC>(op_a, op_b, 37, 53, 300, beta, tolerance);  // K past the host's depth block
        compare<TI, TC>(op_a, op_b, 5, 3, 0, beta, tolerance);      // empty sum: C = beta * C
      }
}

}  // namespace

// fp32: cuBLAS may use TF32 only when asked (CUBLAS_COMPUTE_32F without _FAST_TF32 keeps fp32 products);
// the summation order differs from the host's, hence 1e-5. 16-bit C: one rounding of the result (2^-8 bf16).
MEMKIT_GPU_TEST_CASE("linalg::gemm on a cuda_executor matches the host gemm: fp32") { every_transpose<float, float>(1e-5); }
MEMKIT_GPU_TEST_CASE("linalg::gemm on a cuda_executor matches the host gemm: bf16 inputs, fp32 C") {
  every_transpose<memkit::bf16, float>(1e-5);
}
MEMKIT_GPU_TEST_CASE("linalg::gemm on a cuda_executor matches the host gemm: bf16") {
  every_transpose<memkit::bf16, memkit::bf16>(1.0 / 128);
}
MEMKIT_GPU_TEST_CASE("linalg::gemm on a cuda_executor matches the host gemm: fp16") {
  every_transpose<memkit::fp16, memkit::fp16>(1.0 / 512);
}
