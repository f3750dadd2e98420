// memkit/linalg/gemm_bytes.hpp — what a host linalg::gemm takes from its workspace, as constexpr functions:
// gemm_options, the cache blocking and the per-thread plan of a call, and gemm_workspace_bytes. No kernels:
// memory_budget and the other components' byte functions (quant/bytes.hpp, lora/bytes.hpp) include this header
// alone; linalg/gemm.hpp includes it and runs the plan.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/hardware_threads.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace linalg {

struct gemm_options {
  int host_threads = 1;  // 0 = every hardware thread
};

namespace detail {
// Cache blocking of the host kernel. It is the same for every instruction set, so gemm_workspace_bytes is
// one constexpr formula. A block of op(B) (kc x nc, packed into micro-panels of NR columns) is reused for
// every block of op(A) (mc x kc, packed into micro-panels of MR rows, sized for L2); one micro-panel of B
// (kc x NR) stays in L1 while the micro-kernel walks down the rows of the A block.
struct gemm_blocking {
  static constexpr std::int64_t mc = 144;
  static constexpr std::int64_t kc = 512;
  static constexpr std::int64_t nc = 1024;
  static constexpr std::int64_t row_unit = 12;     // every micro-kernel's MR divides it; parts split rows in it
  static constexpr std::int64_t column_unit = 32;  // every micro-kernel's NR divides it; parts split columns in it
  static constexpr std::int64_t accumulator_rows = 4 * mc;  // 16-bit C with K > kc: rows of fp32 partial sums
  static constexpr std::int64_t min_part_work = std::int64_t{1} << 18;  // multiply-adds that pay for a thread
  static_assert(mc % row_unit == 0 && nc % column_unit == 0 && accumulator_rows % mc == 0);
};

constexpr std::int64_t ceil_div(std::int64_t value, std::int64_t divisor) noexcept { return (value + divisor - 1) / divisor; }
constexpr std::int64_t round_up(std::int64_t value, std::int64_t unit) noexcept { return ceil_div(value, unit) * unit; }
constexpr std::int64_t min_of(std::int64_t a, std::int64_t b) noexcept { return b < a ? b : a; }
constexpr std::int64_t max_of(std::int64_t a, std::int64_t b) noexcept { return a < b ? b : a; }

// How one host gemm call splits its work and its workspace. The output is cut into threads_m x threads_n
// parts (rows in row_units, columns in column_units); each part is one thread's and has its own packing
// buffers. K is never split, so every element of C is computed by the same operations in the same order
// whatever the number of parts.
struct gemm_plan {
  std::int64_t threads_m = 0, threads_n = 0;  // parts = threads_m * threads_n
  std::int64_t part_rows = 0, part_cols = 0;  // the most rows / columns of C one part holds
  std::int64_t a_floats = 0, b_floats = 0, acc_floats = 0;  // one part's buffers, each a multiple of 64 bytes
  bool accumulate = false;  // 16-bit C and K > kc: partial sums wait in fp32, not in C
  constexpr std::int64_t parts() const noexcept { return threads_m * threads_n; }
  constexpr std::int64_t part_floats() const noexcept { return a_floats + b_floats + acc_floats; }
};

constexpr gemm_plan plan_gemm(std::int64_t M, std::int64_t N, std::int64_t K, std::int64_t threads,
                              bool c_is_16_bit) noexcept {
  using blocking = gemm_blocking;
  gemm_plan plan;
  if (M <= 0 || N <= 0 || K <= 0) return plan;  // nothing to pack: C = beta * C
  // No more parts than there is work for (M * N * K in double: it can exceed int64).
  const double useful = static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K) /
                        static_cast<double>(blocking::min_part_work);
  if (useful < static_cast<double>(threads)) threads = useful < 1.0 ? 1 : static_cast<std::int64_t>(useful);
  if (threads < 1) threads = 1;
  const std::int64_t row_units = ceil_div(M, blocking::row_unit), column_units = ceil_div(N, blocking::column_unit);
  plan.threads_n = min_of(threads, column_units);
  plan.threads_m = min_of(max_of(threads / plan.threads_n, std::int64_t{1}), row_units);
  plan.part_rows = ceil_div(row_units, plan.threads_m) * blocking::row_unit;
  plan.part_cols = ceil_div(column_units, plan.threads_n) * blocking::column_unit;
  const std::int64_t depth = min_of(K, blocking::kc);
  const std::int64_t block_cols = min_of(plan.part_cols, blocking::nc);
  plan.accumulate = c_is_16_bit && K > blocking::kc;
  plan.a_floats = round_up(min_of(plan.part_rows, blocking::mc) * depth, 16);
  plan.b_floats = round_up(depth * block_cols, 16);
  plan.acc_floats = plan.accumulate ? round_up(min_of(plan.part_rows, blocking::accumulator_rows) * block_cols, 16) : 0;
  return plan;
}

// The thread count a gemm_options asks for (0 = every hardware thread, known only at run time).
constexpr std::int64_t gemm_threads(const gemm_options& options) noexcept {
  if (options.host_threads > 0) return options.host_threads;
  return options.host_threads == 0 ? resolve_host_threads(0) : 1;
}

// MEMKIT_USE_CBLAS: all-fp32 products go to the system's cblas_sgemm.
template <class TA, class TB, class TC>
constexpr bool gemm_uses_cblas(std::int64_t M, std::int64_t N, std::int64_t K) noexcept {
#if defined(MEMKIT_USE_CBLAS)
  return std::is_same_v<TA, float> && std::is_same_v<TB, float> && std::is_same_v<TC, float> && M > 0 && N > 0 &&
         K > 0;
#else
  (void)M, (void)N, (void)K;
  return false;
#endif
}
}  // namespace detail

// Exact bytes a host gemm of op(A) M x K (elements TA) times op(B) K x N (TB) into C (TC) takes from its
// workspace resource. With host_threads = 0 the count depends on the machine, so it is known only at run time.
template <float_storage TA, float_storage TB, float_storage TC>
constexpr std::size_t gemm_workspace_bytes(std::int64_t M, std::int64_t N, std::int64_t K,
                                           const gemm_options& options = {}) noexcept {
  if (detail::gemm_uses_cblas<TA, TB, TC>(M, N, K)) return 0;
  const detail::gemm_plan plan =
      detail::plan_gemm(M, N, K, detail::gemm_threads(options), !std::is_same_v<TC, float>);
  return static_cast<std::size_t>(plan.parts() * plan.part_floats()) * sizeof(float);
}

// The most bytes a host gemm of these dimensions takes, for any element types (16-bit C needs the most).
constexpr std::size_t gemm_workspace_bytes(std::int64_t M, std::int64_t N, std::int64_t K,
                                           const gemm_options& options = {}) noexcept {
  return gemm_workspace_bytes<bf16, bf16, bf16>(M, N, K, options);
}

}  // namespace linalg

MEMKIT_NAMESPACE_END
