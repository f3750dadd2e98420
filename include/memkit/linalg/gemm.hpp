// memkit/linalg/gemm.hpp — general matrix product, C = alpha * op(A) * op(B) + beta * C.
//
// The one GEMM memkit's components share (lora_linear's dense products, the loss's logits chunks, the
// quantized matmul's dequantized tiles). Matrices are row-major with a leading dimension, elements are
// fp32, bf16 or fp16, and every product accumulates in fp32. op(A) is M x K, op(B) is K x N, C is M x N.
// As in BLAS, beta == 0 overwrites C without reading it.
//
// Host: operands are converted to fp32 while they are packed into workspace, so 16-bit inputs cost no
// separate conversion pass; gemm_workspace_bytes() says exactly what a call takes from the workspace
// resource. Threads: gemm_options::host_threads (0 = every hardware thread); the result does not
// depend on the thread count.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/host_threads.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace linalg {

enum class transpose : std::uint8_t { no, yes };

// A row-major matrix: `rows` x `cols`, consecutive rows `ld` elements apart (ld >= cols), in `where` memory.
template <class T>
struct matrix_ref {
  T* data = nullptr;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t ld = 0;
  memory_kind where = memory_kind::host;

  // A matrix_ref<T> converts to a matrix_ref<const T>.
  template <class U>
    requires(!std::is_same_v<U, T> && std::is_convertible_v<U (*)[], T (*)[]>)
  constexpr matrix_ref(const matrix_ref<U>& other) noexcept
      : data(other.data), rows(other.rows), cols(other.cols), ld(other.ld), where(other.where) {}
  constexpr matrix_ref() = default;
  constexpr matrix_ref(T* data_, std::int64_t rows_, std::int64_t cols_, std::int64_t ld_, memory_kind where_) noexcept
      : data(data_), rows(rows_), cols(cols_), ld(ld_), where(where_) {}
};

// A contiguous view seen as a rows x cols matrix (its element count must be rows * cols).
template <class T>
matrix_ref<T> as_matrix(tensor_view<T> view, std::int64_t rows, std::int64_t cols) {
  // rows == size / cols first, so rows * cols cannot overflow.
  require(rows >= 0 && cols >= 0 && (cols == 0 || rows == view.size() / cols) && rows * cols == view.size(),
          "linalg::as_matrix: a view of " + std::to_string(view.size()) + " elements is not a " +
              std::to_string(rows) + " x " + std::to_string(cols) + " matrix");
  return {view.data(), rows, cols, cols, view.where()};
}

struct gemm_options {
  int host_threads = 1;  // 0 = every hardware thread
};

namespace detail {
struct gemm_dims {
  std::int64_t M, N, K;
};
}  // namespace detail

// Exact bytes a host gemm of op(A) M x K times op(B) K x N takes from its workspace resource.
constexpr std::size_t gemm_workspace_bytes(std::int64_t M, std::int64_t N, std::int64_t K,
                                           const gemm_options& options = {}) noexcept {
  if (M <= 0 || N <= 0) return 0;
  const std::int64_t threads = std::min<std::int64_t>(std::max(options.host_threads, 1), M);
  // op(B) packed as fp32 [K, N], and one fp32 row accumulator per thread.
  return static_cast<std::size_t>(K * N + threads * N) * sizeof(float);
}

namespace detail {

template <class TA, class TB, class TC>
gemm_dims check_gemm(transpose op_a, transpose op_b, const matrix_ref<const TA>& A, const matrix_ref<const TB>& B,
                     const matrix_ref<TC>& C) {
  const auto valid = [](const char* name, std::int64_t rows, std::int64_t cols, std::int64_t ld, const void* data) {
    require(rows >= 0 && cols >= 0 && ld >= cols && (rows == 0 || cols == 0 || data != nullptr),
            std::string("linalg::gemm: matrix ") + name + " is " + std::to_string(rows) + " x " + std::to_string(cols) +
                " with leading dimension " + std::to_string(ld) + " (needs ld >= cols and data for a non-empty matrix)");
  };
  valid("A", A.rows, A.cols, A.ld, A.data);
  valid("B", B.rows, B.cols, B.ld, B.data);
  valid("C", C.rows, C.cols, C.ld, C.data);
  const std::int64_t M = op_a == transpose::no ? A.rows : A.cols;
  const std::int64_t K = op_a == transpose::no ? A.cols : A.rows;
  const std::int64_t KB = op_b == transpose::no ? B.rows : B.cols;
  const std::int64_t N = op_b == transpose::no ? B.cols : B.rows;
  require(K == KB && C.rows == M && C.cols == N,
          "linalg::gemm: op(A) is " + std::to_string(M) + " x " + std::to_string(K) + ", op(B) is " +
              std::to_string(KB) + " x " + std::to_string(N) + " and C is " + std::to_string(C.rows) + " x " +
              std::to_string(C.cols) + "; needs op(A) M x K, op(B) K x N, C M x N");
  return {M, N, K};
}

template <class T>
inline float element(const matrix_ref<const T>& m, transpose op, std::int64_t row, std::int64_t col) noexcept {
  return op == transpose::no ? to_float(m.data[row * m.ld + col]) : to_float(m.data[col * m.ld + row]);
}

}  // namespace detail

// C = alpha * op(A) * op(B) + beta * C on the host. `workspace` supplies gemm_workspace_bytes(M, N, K, options).
template <float_storage TA, float_storage TB, float_storage TC>
void gemm(const host_executor& exec, transpose op_a, transpose op_b, float alpha, matrix_ref<const TA> A,
          matrix_ref<const TB> B, float beta, matrix_ref<TC> C, memory_resource& workspace,
          const gemm_options& options = {}) {
  const auto [M, N, K] = detail::check_gemm(op_a, op_b, A, B, C);
  const char* operation = "linalg::gemm";
  require(exec.can_access(A.where) && exec.can_access(B.where) && exec.can_access(C.where),
          std::string(operation) + ": an operand is in device memory, which the host executor cannot access");
  require(options.host_threads >= 0,
          std::string(operation) + ": host_threads must be >= 0, got " + std::to_string(options.host_threads));
  if (M == 0 || N == 0) return;
  const std::int64_t threads = std::min<std::int64_t>(resolve_host_threads(options.host_threads), M);
  const gemm_options used{static_cast<int>(threads)};
  buffer<float> scratch(workspace, shape{static_cast<std::int64_t>(gemm_workspace_bytes(M, N, K, used) / sizeof(float))});
  float* packed_b = scratch.data();
  for (std::int64_t k = 0; k < K; ++k)
    for (std::int64_t n = 0; n < N; ++n) packed_b[k * N + n] = detail::element(B, op_b, k, n);
  // One part per thread, each with its own accumulator row: part p computes rows [M*p/threads, M*(p+1)/threads).
  ::memkit::detail::run_in_parts(static_cast<int>(threads), threads, [&](std::int64_t first_part, std::int64_t last_part) {
    for (std::int64_t part = first_part; part < last_part; ++part) {
      float* acc = packed_b + K * N + part * N;
      for (std::int64_t m = M * part / threads; m < M * (part + 1) / threads; ++m) {
        std::fill(acc, acc + N, 0.0f);
        for (std::int64_t k = 0; k < K; ++k) {
          const float a = detail::element(A, op_a, m, k);
          const float* b = packed_b + k * N;
          for (std::int64_t n = 0; n < N; ++n) acc[n] += a * b[n];
        }
        TC* c = C.data + m * C.ld;
        for (std::int64_t n = 0; n < N; ++n)
          c[n] = from_float<TC>(beta == 0.0f ? alpha * acc[n] : alpha * acc[n] + beta * to_float(c[n]));
      }
    }
  });
}

}  // namespace linalg

MEMKIT_NAMESPACE_END
