#include <doctest/doctest.h>
#include <memkit/core/float16.hpp>
#include <memkit/core/host_threads.hpp>
#include <memkit/linalg/gemm.hpp>
#include <memkit/memory/tracking.hpp>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

using memkit::linalg::transpose;

namespace {

// Plain triple loop in double: the reference every gemm result is compared with.
std::vector<double> reference_gemm(transpose op_a, transpose op_b, std::int64_t M, std::int64_t N, std::int64_t K,
                                   const std::vector<float>& A, const std::vector<float>& B) {
  std::vector<double> C(static_cast<std::size_t>(M * N), 0.0);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) {
      double sum = 0;
      for (std::int64_t k = 0; k < K; ++k) {
        const double a = op_a == transpose::no ? A[m * K + k] : A[k * M + m];
        const double b = op_b == transpose::no ? B[k * N + n] : B[n * K + k];
        sum += a * b;
      }
      C[m * N + n] = sum;
    }
  return C;
}

std::vector<float> random_floats(std::size_t count, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  return values;
}

}  // namespace

TEST_CASE("linalg::gemm matches a double-precision reference for every transpose, shape and thread count") {
  memkit::tracking_resource tracker(memkit::default_host_resource(), "gemm");
  for (transpose op_a : {transpose::no, transpose::yes})
    for (transpose op_b : {transpose::no, transpose::yes})
      for (auto [M, N, K] : {std::array<std::int64_t, 3>{1, 1, 1}, {7, 5, 3}, {33, 17, 65}, {4, 129, 0}, {64, 64, 64}})
        for (int threads : {1, 3}) {
          CAPTURE(M); CAPTURE(N); CAPTURE(K); CAPTURE(threads);
          const auto A = random_floats(static_cast<std::size_t>(M * K), 1);
          const auto B = random_floats(static_cast<std::size_t>(K * N), 2);
          std::vector<float> C(static_cast<std::size_t>(M * N), 0.5f);
          const memkit::linalg::matrix_ref<const float> a{A.data(), op_a == transpose::no ? M : K,
                                                          op_a == transpose::no ? K : M,
                                                          op_a == transpose::no ? K : M, memkit::memory_kind::host};
          const memkit::linalg::matrix_ref<const float> b{B.data(), op_b == transpose::no ? K : N,
                                                          op_b == transpose::no ? N : K,
                                                          op_b == transpose::no ? N : K, memkit::memory_kind::host};
          const memkit::linalg::gemm_options options{threads};
          tracker.reset_peak();
          memkit::linalg::gemm(memkit::host, op_a, op_b, 2.0f, a, b, -1.0f,
                               memkit::linalg::matrix_ref<float>{C.data(), M, N, N, memkit::memory_kind::host},
                               tracker, options);
          CHECK(tracker.peak_bytes() == memkit::linalg::gemm_workspace_bytes(M, N, K, options));
          const auto expected = reference_gemm(op_a, op_b, M, N, K, A, B);
          for (std::size_t i = 0; i < C.size(); ++i)
            REQUIRE(C[i] == doctest::Approx(2.0 * expected[i] - 0.5).epsilon(1e-4).scale(K + 1.0));
        }
}

TEST_CASE("linalg::gemm takes bf16 operands and writes bf16, accumulating in fp32; beta 0 never reads C") {
  const std::int64_t M = 5, N = 6, K = 40;
  const auto A = random_floats(M * K, 3), B = random_floats(K * N, 4);
  std::vector<memkit::bf16> a16, b16;
  for (float v : A) a16.push_back(memkit::bf16(v));
  for (float v : B) b16.push_back(memkit::bf16(v));
  std::vector<float> a_rounded, b_rounded;
  for (auto v : a16) a_rounded.push_back(float(v));
  for (auto v : b16) b_rounded.push_back(float(v));
  std::vector<memkit::bf16> C(M * N, memkit::bf16(std::nanf("")));
  memkit::linalg::gemm(memkit::host, transpose::no, transpose::no, 1.0f,
                       memkit::linalg::matrix_ref<const memkit::bf16>{a16.data(), M, K, K, memkit::memory_kind::host},
                       memkit::linalg::matrix_ref<const memkit::bf16>{b16.data(), K, N, N, memkit::memory_kind::host}, 0.0f,
                       memkit::linalg::matrix_ref<memkit::bf16>{C.data(), M, N, N, memkit::memory_kind::host},
                       memkit::default_host_resource());
  const auto expected = reference_gemm(transpose::no, transpose::no, M, N, K, a_rounded, b_rounded);
  for (std::size_t i = 0; i < C.size(); ++i) CHECK(float(C[i]) == doctest::Approx(expected[i]).epsilon(1e-2).scale(1.0));
}

TEST_CASE("linalg::gemm rejects mismatched shapes and bad leading dimensions, naming both") {
  std::vector<float> A(6), B(6), C(4);
  const memkit::linalg::matrix_ref<const float> a{A.data(), 2, 3, 3, memkit::memory_kind::host};
  const memkit::linalg::matrix_ref<const float> b{B.data(), 2, 3, 3, memkit::memory_kind::host};  // needs 3 x N
  CHECK_THROWS_WITH_AS(memkit::linalg::gemm(memkit::host, transpose::no, transpose::no, 1.0f, a, b, 0.0f,
                                            memkit::linalg::matrix_ref<float>{C.data(), 2, 2, 2, memkit::memory_kind::host},
                                            memkit::default_host_resource()),
                       doctest::Contains("op(A) is 2 x 3, op(B) is 2 x 3"), memkit::error);
  CHECK_THROWS_WITH_AS(memkit::linalg::gemm(memkit::host, transpose::no, transpose::yes, 1.0f, a,
                                            memkit::linalg::matrix_ref<const float>{B.data(), 2, 3, 2, memkit::memory_kind::host},
                                            0.0f, memkit::linalg::matrix_ref<float>{C.data(), 2, 2, 2, memkit::memory_kind::host},
                                            memkit::default_host_resource()),
                       doctest::Contains("leading dimension 2"), memkit::error);
  CHECK_THROWS_AS(memkit::linalg::as_matrix(memkit::host_view(A), 4, 2), memkit::error);
}

TEST_CASE("run_in_parts covers every index once for any thread count and rethrows a worker's exception") {
  for (int parts : {1, 2, 3, 7}) {
    std::vector<std::atomic<int>> hits(100);
    memkit::detail::run_in_parts(parts, 100, [&](std::int64_t first, std::int64_t last) {
      for (std::int64_t i = first; i < last; ++i) hits[static_cast<std::size_t>(i)]++;
    });
    for (auto& h : hits) CHECK(h.load() == 1);
  }
  CHECK_THROWS_WITH_AS(memkit::detail::run_in_parts(3, 30,
                                                    [](std::int64_t first, std::int64_t) {
                                                      if (first == 20) throw std::runtime_error("third part failed");
                                                    }),
                       "third part failed", std::runtime_error);
  CHECK(memkit::resolve_host_threads(0) == memkit::hardware_threads());
  CHECK(memkit::resolve_host_threads(3) == 3);
}
