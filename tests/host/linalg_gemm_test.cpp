// linalg::gemm on the host: every shape that crosses an edge of the blocking (micro-kernel rows and
// columns, the mc / kc / nc blocks, the fp32 accumulator's row chunks), every transpose, fp32 / bf16 /
// fp16 operands, leading dimensions wider than the rows, each instruction set this CPU has, and several
// thread counts. Results are compared with a double-precision reference within a proven fp32 error
// bound; thread counts must give identical bits, and so must the AVX2 and AVX-512 kernels (both sum
// every element as one chain of FMAs in k order, block by block).
#include <doctest/doctest.h>
#include <memkit/core/float16.hpp>
#include <memkit/core/host_simd.hpp>
#include <memkit/core/host_threads.hpp>
#include <memkit/linalg/gemm.hpp>
#include <memkit/memory/tracking.hpp>

#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>
#include "support/host_isa_scope.hpp"

using memkit::bf16;
using memkit::fp16;
using memkit::host_isa;
using memkit::linalg::matrix_ref;
using memkit::linalg::transpose;

namespace {

template <class T>
std::uint32_t bits_of(T value) {
  if constexpr (std::is_same_v<T, float>) return memkit::detail::bit_cast<std::uint32_t>(value);
  else return value.bits;
}

// A rows x cols matrix of normal values stored with leading dimension ld; the padding holds NaN, so a
// kernel that reads or adds it shows up as NaN in the result.
template <class T>
struct test_matrix {
  std::int64_t rows, cols, ld;
  std::vector<T> storage;
  float at(std::int64_t r, std::int64_t c) const { return memkit::to_float(storage[r * ld + c]); }
};

template <class T>
test_matrix<T> random_matrix(std::int64_t rows, std::int64_t cols, std::int64_t padding, std::uint32_t seed) {
  test_matrix<T> m{rows, cols, cols + padding, {}};
  m.storage.assign(static_cast<std::size_t>(rows * m.ld), memkit::from_float<T>(std::nanf("")));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) m.storage[r * m.ld + c] = memkit::from_float<T>(normal(rng));
  return m;
}

template <class T>
matrix_ref<const T> const_ref(const test_matrix<T>& m) {
  return {m.storage.data(), m.rows, m.cols, m.ld, memkit::memory_kind::host};
}

// The instruction sets this CPU can run, each capped in turn with limit_host_isa.
std::vector<host_isa> available_isas() {
  std::vector<host_isa> isas;
  for (host_isa isa : {host_isa::portable, host_isa::avx2, host_isa::avx512})
    if (isa <= memkit::detail::process_host_isa()) isas.push_back(isa);
  return isas;
}

using isa_cap = memkit_test::host_isa_cap;

// Runs one gemm and checks it: against the double reference within
//   |error| <= 2 (K + 4) 2^-24 (|alpha| sum_k |a b| + |beta c|) + (rounding of a 16-bit C) + tiny,
// C's padding untouched, and the workspace exactly gemm_workspace_bytes<TA, TB, TC>. Returns C.
template <class TA, class TB, class TC>
std::vector<TC> run_and_check(transpose op_a, transpose op_b, std::int64_t M, std::int64_t N, std::int64_t K,
                              std::int64_t padding, float alpha, float beta, int threads) {
  const auto A = random_matrix<TA>(op_a == transpose::no ? M : K, op_a == transpose::no ? K : M, padding, 11);
  const auto B = random_matrix<TB>(op_b == transpose::no ? K : N, op_b == transpose::no ? N : K, padding, 12);
  auto C = random_matrix<TC>(M, N, padding, 13);
  if (beta == 0.0f)  // beta 0 must not read C: start from NaN
    for (std::int64_t r = 0; r < M; ++r)
      for (std::int64_t c = 0; c < N; ++c) C.storage[r * C.ld + c] = memkit::from_float<TC>(std::nanf(""));
  const auto before = C.storage;
  memkit::tracking_resource tracker(memkit::default_host_resource(), "gemm");
  const memkit::linalg::gemm_options options{threads};
  memkit::linalg::gemm(memkit::host, op_a, op_b, alpha, const_ref(A), const_ref(B), beta,
                       matrix_ref<TC>{C.storage.data(), M, N, C.ld, memkit::memory_kind::host}, tracker, options);
  CHECK(tracker.peak_bytes() == memkit::linalg::gemm_workspace_bytes<TA, TB, TC>(M, N, K, options));
  CHECK(tracker.peak_bytes() <= memkit::linalg::gemm_workspace_bytes(M, N, K, options));
  CHECK(tracker.current_bytes() == 0);
  const double output_rounding = std::is_same_v<TC, bf16> ? 0x1p-8 : std::is_same_v<TC, fp16> ? 0x1p-11 : 0.0;
  int failures = 0;
  for (std::int64_t m = 0; m < M; ++m) {
    for (std::int64_t n = 0; n < N; ++n) {
      double sum = 0, magnitude = 0;
      for (std::int64_t k = 0; k < K; ++k) {
        const double a = op_a == transpose::no ? A.at(m, k) : A.at(k, m);
        const double b = op_b == transpose::no ? B.at(k, n) : B.at(n, k);
        sum += a * b;
        magnitude += std::abs(a * b);
      }
      const double old_c = beta == 0.0f ? 0.0 : memkit::to_float(before[m * C.ld + n]);
      const double expected = alpha * sum + beta * old_c;
      const double bound = 2.0 * (K + 4) * 0x1p-24 * (std::abs(alpha) * magnitude + std::abs(beta * old_c)) +
                           output_rounding * std::abs(expected) + 1e-30;
      const double got = C.at(m, n);
      if (!(std::abs(got - expected) <= bound) && failures++ < 3) {
        CAPTURE(m);
        CAPTURE(n);
        CAPTURE(expected);
        CAPTURE(bound);
        CHECK(got == expected);
      }
    }
    for (std::int64_t n = N; n < C.ld; ++n)  // the padding is never written
      if (bits_of(C.storage[m * C.ld + n]) != bits_of(before[m * C.ld + n]) && failures++ < 3) CHECK(n < N);
  }
  CHECK(failures == 0);
  return C.storage;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (bits_of(a[i]) != bits_of(b[i]) && !(std::isnan(memkit::to_float(a[i])) && std::isnan(memkit::to_float(b[i]))))
      return false;
  return true;
}

using shape3 = std::array<std::int64_t, 3>;

}  // namespace

TEST_CASE("linalg::gemm matches a double-precision reference across every blocking edge, transpose and instruction set") {
  using blocking = memkit::linalg::detail::gemm_blocking;
  // Each shape crosses some edge: micro-kernel rows (4, 6, 12) and columns (8, 16, 32), mc, kc, nc.
  const std::vector<shape3> shapes = {
      {1, 1, 1},   {7, 5, 3},    {13, 33, 17}, {12, 32, blocking::kc}, {25, 65, blocking::kc + 1},
      {blocking::mc + 1, 47, 31}, {30, blocking::nc + 1, 9}, {6, 17, 2 * blocking::kc + 3}, {4, 129, 0},
  };
  for (host_isa isa : available_isas()) {
    const isa_cap cap(isa);
    for (transpose op_a : {transpose::no, transpose::yes})
      for (transpose op_b : {transpose::no, transpose::yes})
        for (const shape3& dims : shapes) {
          const std::int64_t M = dims[0], N = dims[1], K = dims[2];  // no binding: clang 14 cannot capture one (CAPTURE is a lambda)
          CAPTURE(memkit::to_string(isa));
          CAPTURE(op_a == transpose::yes);
          CAPTURE(op_b == transpose::yes);
          CAPTURE(M);
          CAPTURE(N);
          CAPTURE(K);
          run_and_check<float, float, float>(op_a, op_b, M, N, K, 0, 1.0f, 0.0f, 1);
          run_and_check<float, float, float>(op_a, op_b, M, N, K, 3, 2.0f, -1.0f, 3);
        }
  }
}

TEST_CASE("linalg::gemm takes bf16 and fp16 operands and writes 16-bit C, accumulating in fp32 across K blocks") {
  using blocking = memkit::linalg::detail::gemm_blocking;
  // K over kc with 16-bit C takes the fp32 accumulator (two K blocks are enough to add across them; three took
  // twice the run time, the longest case under ASan); M over its row chunk repacks B per chunk.
  const std::vector<shape3> shapes = {{5, 6, 40}, {29, 70, blocking::kc + 7}, {blocking::accumulator_rows + 5, 40, blocking::kc + 1}};
  for (host_isa isa : available_isas()) {
    const isa_cap cap(isa);
    for (const shape3& dims : shapes)
      for (transpose op : {transpose::no, transpose::yes}) {
        const std::int64_t M = dims[0], N = dims[1], K = dims[2];
        CAPTURE(memkit::to_string(isa));
        CAPTURE(M);
        CAPTURE(N);
        CAPTURE(K);
        run_and_check<bf16, bf16, bf16>(op, transpose::no, M, N, K, 2, 1.0f, 0.0f, 2);
        run_and_check<fp16, bf16, fp16>(transpose::no, op, M, N, K, 1, 0.5f, 1.0f, 1);
        run_and_check<bf16, float, fp16>(op, op, M, N, K, 0, 1.0f, 0.25f, 3);
        run_and_check<float, fp16, float>(op, transpose::no, M, N, K, 5, -1.0f, 0.0f, 2);
        run_and_check<fp16, fp16, bf16>(transpose::no, transpose::yes, M, N, K, 0, 1.0f, 2.0f, 1);
      }
  }
}

TEST_CASE("linalg::gemm gives identical bits for every thread count, and the same bits on AVX2 and AVX-512") {
  // Large enough to split: into columns (N wide), into rows (N narrow), and both.
  const std::vector<shape3> shapes = {{145, 300, 70}, {300, 20, 300}, {100, 70, 600}};
  std::vector<host_isa> vector_isas;
  for (host_isa isa : available_isas())
    if (isa != host_isa::portable) vector_isas.push_back(isa);
  for (const shape3& dims : shapes) {
    const std::int64_t M = dims[0], N = dims[1], K = dims[2];  // no binding: clang 14 cannot capture one (CAPTURE is a lambda)
    CAPTURE(M);
    CAPTURE(N);
    CAPTURE(K);
    for (int threads : {2, 3, 5}) {
      const auto plan = memkit::linalg::detail::plan_gemm(M, N, K, threads, false);
      CHECK(plan.parts() > 1);  // the split is real
    }
    for (host_isa isa : available_isas()) {
      const isa_cap cap(isa);
      CAPTURE(memkit::to_string(isa));
      const auto one = run_and_check<float, float, float>(transpose::no, transpose::yes, M, N, K, 1, 1.5f, 0.5f, 1);
      const auto one_bf16 = run_and_check<bf16, bf16, bf16>(transpose::yes, transpose::no, M, N, K, 0, 1.0f, 0.0f, 1);
      for (int threads : {2, 3, 5}) {
        CAPTURE(threads);
        CHECK(same_bits(one, run_and_check<float, float, float>(transpose::no, transpose::yes, M, N, K, 1, 1.5f, 0.5f, threads)));
        CHECK(same_bits(one_bf16, run_and_check<bf16, bf16, bf16>(transpose::yes, transpose::no, M, N, K, 0, 1.0f, 0.0f, threads)));
      }
    }
    if (vector_isas.size() == 2) {
      std::vector<std::vector<float>> results;
      for (host_isa isa : vector_isas) {
        const isa_cap cap(isa);
        results.push_back(run_and_check<float, float, float>(transpose::yes, transpose::no, M, N, K, 0, 1.0f, -2.0f, 2));
      }
      CHECK(same_bits(results[0], results[1]));
    }
  }
}

TEST_CASE("linalg::gemm's workspace prediction is exact, constexpr, and the plan respects the thread and work limits") {
  using memkit::linalg::gemm_options;
  using memkit::linalg::gemm_workspace_bytes;
  static_assert(gemm_workspace_bytes(0, 10, 10) == 0 && gemm_workspace_bytes(10, 10, 0) == 0);
  static_assert(gemm_workspace_bytes<float, float, bf16>(4096, 4096, 4096, gemm_options{4}) > 0);
  // 16-bit C with K over one block needs the fp32 accumulator; fp32 C does not.
  constexpr auto fp32_bytes = gemm_workspace_bytes<bf16, bf16, float>(1000, 1000, 1000, gemm_options{2});
  constexpr auto bf16_bytes = gemm_workspace_bytes<bf16, bf16, bf16>(1000, 1000, 1000, gemm_options{2});
#if !defined(MEMKIT_USE_CBLAS)
  static_assert(bf16_bytes > fp32_bytes);
  static_assert(gemm_workspace_bytes<float, float, float>(1000, 1000, 1000, gemm_options{2}) == fp32_bytes);
#else  // fp32 goes to cblas_sgemm, which takes no workspace; 16-bit operands still use memkit's kernel
  static_assert(gemm_workspace_bytes<float, float, float>(1000, 1000, 1000, gemm_options{2}) == 0 && fp32_bytes > 0);
#endif
  static_assert(gemm_workspace_bytes(1000, 1000, 1000, gemm_options{2}) == bf16_bytes);
  // A tiny product runs on one thread whatever is asked; a big one uses every thread asked for.
  CHECK(memkit::linalg::detail::plan_gemm(8, 8, 8, 16, false).parts() == 1);
  CHECK(memkit::linalg::detail::plan_gemm(2048, 2048, 2048, 16, false).parts() == 16);
  CHECK(gemm_workspace_bytes(512, 512, 512, gemm_options{0}) ==
        gemm_workspace_bytes(512, 512, 512, gemm_options{memkit::resolve_host_threads(0)}));
}

TEST_CASE("linalg::gemm with K = 0 scales C by beta, and beta 0 writes zeros without reading C") {
  std::vector<float> C = {1.0f, 2.0f, std::nanf(""), 4.0f};
  std::vector<float> empty;
  memkit::linalg::gemm(memkit::host, transpose::no, transpose::no, 1.0f, matrix_ref<const float>{nullptr, 2, 0, 0, memkit::memory_kind::host},
                       matrix_ref<const float>{nullptr, 0, 2, 2, memkit::memory_kind::host}, 3.0f,
                       matrix_ref<float>{C.data(), 2, 2, 2, memkit::memory_kind::host}, memkit::default_host_resource());
  CHECK(C[0] == 3.0f);
  CHECK(C[1] == 6.0f);
  CHECK(std::isnan(C[2]));
  memkit::linalg::gemm(memkit::host, transpose::no, transpose::no, 1.0f, matrix_ref<const float>{nullptr, 2, 0, 0, memkit::memory_kind::host},
                       matrix_ref<const float>{nullptr, 0, 2, 2, memkit::memory_kind::host}, 0.0f,
                       matrix_ref<float>{C.data(), 2, 2, 2, memkit::memory_kind::host}, memkit::default_host_resource());
  for (float c : C) CHECK(c == 0.0f);
}

TEST_CASE("host_isa_in_use never exceeds the CPU, MEMKIT_HOST_ISA or limit_host_isa") {
  const host_isa detected = memkit::detail::detect_host_isa();
  CHECK(memkit::host_isa_in_use() <= detected);
  if (const char* forced = std::getenv("MEMKIT_HOST_ISA"); forced != nullptr && std::string(forced) == "avx2") {
    MESSAGE("MEMKIT_HOST_ISA=avx2: the dispatched kernels run their AVX2 paths");
    CHECK(memkit::host_isa_in_use() <= host_isa::avx2);
  }
  {
    const isa_cap cap(host_isa::portable);
    CHECK(memkit::host_isa_in_use() == host_isa::portable);
  }
  CHECK(memkit::host_isa_in_use() == memkit::detail::process_host_isa());
  CHECK(std::string(memkit::to_string(host_isa::avx2)) == "avx2");
}

TEST_CASE("linalg::gemm rejects mismatched shapes and bad leading dimensions, naming both") {
  std::vector<float> A(6), B(6), C(4);
  const matrix_ref<const float> a{A.data(), 2, 3, 3, memkit::memory_kind::host};
  const matrix_ref<const float> b{B.data(), 2, 3, 3, memkit::memory_kind::host};  // needs 3 x N
  CHECK_THROWS_WITH_AS(memkit::linalg::gemm(memkit::host, transpose::no, transpose::no, 1.0f, a, b, 0.0f,
                                            matrix_ref<float>{C.data(), 2, 2, 2, memkit::memory_kind::host},
                                            memkit::default_host_resource()),
                       doctest::Contains("op(A) is 2 x 3, op(B) is 2 x 3"), memkit::error);
  CHECK_THROWS_WITH_AS(memkit::linalg::gemm(memkit::host, transpose::no, transpose::yes, 1.0f, a,
                                            matrix_ref<const float>{B.data(), 2, 3, 2, memkit::memory_kind::host},
                                            0.0f, matrix_ref<float>{C.data(), 2, 2, 2, memkit::memory_kind::host},
                                            memkit::default_host_resource()),
                       doctest::Contains("leading dimension 2"), memkit::error);
  CHECK_THROWS_WITH_AS(memkit::linalg::gemm(memkit::host, transpose::no, transpose::yes, 1.0f, a, b, 0.0f,
                                            matrix_ref<float>{C.data(), 2, 2, 2, memkit::memory_kind::host},
                                            memkit::default_host_resource(), memkit::linalg::gemm_options{-1}),
                       doctest::Contains("host_threads must be >= 0"), memkit::error);
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
