// memkit/linalg/gemm.hpp — general matrix product, C = alpha * op(A) * op(B) + beta * C.
//
// The one GEMM memkit's components share (lora_linear's dense products, the loss's logits chunks, the
// quantized matmul's dequantized tiles). Matrices are row-major with a leading dimension, elements are
// fp32, bf16 or fp16, and every product accumulates in fp32. op(A) is M x K, op(B) is K x N, C is M x N.
// As in BLAS, beta == 0 overwrites C without reading it.
//
// Host: a cache-blocked GEMM in the BLIS/GotoBLAS structure. Blocks of op(A) and op(B) are packed into
// fp32 micro-panels in workspace (16-bit inputs are converted while packing, so they cost no separate
// pass; a transposed fp32 B is transposed 16 x 16 or 8 x 8 in registers), and a register-blocked
// micro-kernel computes MR x NR tiles of C: 12 x 32 with AVX-512, 6 x 16 with AVX2 + FMA, 4 x 8 in
// portable C++, chosen at run time (core/host_simd.hpp). Callers that produce their operands' panels
// themselves (quant::matmul decodes its 4-bit weight straight into them) use gemm_blocked_with. gemm_workspace_bytes()
// (linalg/gemm_bytes.hpp) says exactly what a call takes from the workspace resource. Threads: gemm_options::host_threads (0 = every
// hardware thread) split C into column (and, for narrow C, row) ranges; K is never split, so the result
// is the same for every thread count, and the AVX2 and AVX-512 kernels give the same bits (one FMA chain
// per element and depth block, in k order).
//
// Opt-in: define MEMKIT_USE_CBLAS (CMake: -DMEMKIT_USE_CBLAS=ON, which finds OpenBLAS) and all-fp32
// products call the system's cblas_sgemm instead; 16-bit operands keep using the kernel here.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/host_simd.hpp"
#include "memkit/core/host_threads.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/linalg/gemm_bytes.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"

#if defined(MEMKIT_USE_CBLAS)
#include <cblas.h>
#endif

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

namespace detail {

struct gemm_dims {
  std::int64_t M, N, K;
};

template <class TA, class TB, class TC>
gemm_dims check_gemm(transpose op_a, transpose op_b, const matrix_ref<const TA>& A, const matrix_ref<const TB>& B,
                     const matrix_ref<TC>& C) {
  // The messages are built only for a failed check: a small gemm must not pay for string formatting.
  const auto valid = [](const char* name, std::int64_t rows, std::int64_t cols, std::int64_t ld, const void* data) {
    if (rows >= 0 && cols >= 0 && ld >= cols && (rows == 0 || cols == 0 || data != nullptr)) return;
    throw error(std::string("linalg::gemm: matrix ") + name + " is " + std::to_string(rows) + " x " +
                std::to_string(cols) + " with leading dimension " + std::to_string(ld) +
                " (needs ld >= cols and data for a non-empty matrix)");
  };
  valid("A", A.rows, A.cols, A.ld, A.data);
  valid("B", B.rows, B.cols, B.ld, B.data);
  valid("C", C.rows, C.cols, C.ld, C.data);
  const std::int64_t M = op_a == transpose::no ? A.rows : A.cols;
  const std::int64_t K = op_a == transpose::no ? A.cols : A.rows;
  const std::int64_t KB = op_b == transpose::no ? B.rows : B.cols;
  const std::int64_t N = op_b == transpose::no ? B.cols : B.rows;
  if (K != KB || C.rows != M || C.cols != N)
    throw error("linalg::gemm: op(A) is " + std::to_string(M) + " x " + std::to_string(K) + ", op(B) is " +
                std::to_string(KB) + " x " + std::to_string(N) + " and C is " + std::to_string(C.rows) + " x " +
                std::to_string(C.cols) + "; needs op(A) M x K, op(B) K x N, C M x N");
  return {M, N, K};
}

// --- Packing: op(A) and op(B) blocks converted to fp32 into the layout the micro-kernels stream. ---

// count values widened to fp32 (a plain copy for fp32, which g++ does not vectorize on its own here).
template <class T>
inline void widen(const T* __restrict source, std::int64_t count, float* __restrict target) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(target, source, static_cast<std::size_t>(count) * sizeof(float));
  } else {
    for (std::int64_t j = 0; j < count; ++j) target[j] = to_float(source[j]);
  }
}

// Rows [row0, row0 + rows) x depth [k0, k0 + depth) of op(A), as panels of MR rows: for each k the MR values
// of the panel's rows. A last, partial panel leaves its missing rows unwritten: the micro-kernel for fewer
// rows never reads them.
template <std::int64_t MR, class TA>
void pack_a(const matrix_ref<const TA>& A, transpose op, std::int64_t row0, std::int64_t rows, std::int64_t k0,
            std::int64_t depth, float* out) noexcept {
  for (std::int64_t p = 0; p < rows; p += MR) {
    const std::int64_t panel_rows = std::min(MR, rows - p);
    float* panel = out + p * depth;
    if (op == transpose::no) {
      // Row by row in k, so the panel is written in order while MR rows are read as parallel streams.
      const TA* rows_of[MR];
      for (std::int64_t r = 0; r < MR; ++r) rows_of[r] = A.data + (row0 + p + std::min(r, panel_rows - 1)) * A.ld + k0;
      for (std::int64_t k = 0; k < depth; ++k)
        for (std::int64_t r = 0; r < MR; ++r) panel[k * MR + r] = to_float(rows_of[r][k]);
    } else {
      for (std::int64_t k = 0; k < depth; ++k) {
        const TA* source = A.data + (k0 + k) * A.ld + row0 + p;
        for (std::int64_t r = 0; r < panel_rows; ++r) panel[k * MR + r] = to_float(source[r]);
      }
    }
  }
}

// Depth [k0, k0 + depth) x columns [col0, col0 + cols) of op(B), as panels of NR columns: for each k the NR
// values of the panel's columns, a last partial panel padded with zeros (the micro-kernel computes whole
// panels; the padding columns are never stored).
template <std::int64_t NR, class TB>
void pack_b(const matrix_ref<const TB>& B, transpose op, std::int64_t k0, std::int64_t depth, std::int64_t col0,
            std::int64_t cols, float* out) noexcept {
  const std::int64_t whole = cols - cols % NR;
  if (op == transpose::no) {
    // Row by row, so B is read in order (the hardware prefetcher follows one stream, not depth of them).
    for (std::int64_t k = 0; k < depth; ++k) {
      const TB* source = B.data + (k0 + k) * B.ld + col0;
      for (std::int64_t p = 0; p < whole; p += NR) widen(source + p, NR, out + p * depth + k * NR);
      if (whole < cols) {
        float* target = out + whole * depth + k * NR;
        widen(source + whole, cols - whole, target);
        for (std::int64_t j = cols - whole; j < NR; ++j) target[j] = 0.0f;
      }
    }
    return;
  }
  for (std::int64_t p = 0; p < cols; p += NR) {
    const std::int64_t panel_cols = std::min(NR, cols - p);
    float* panel = out + p * depth;
    for (std::int64_t j = 0; j < panel_cols; ++j) {
      const TB* source = B.data + (col0 + p + j) * B.ld + k0;
      for (std::int64_t k = 0; k < depth; ++k) panel[k * NR + j] = to_float(source[k]);
    }
    for (std::int64_t k = 0; panel_cols < NR && k < depth; ++k)
      for (std::int64_t j = panel_cols; j < NR; ++j) panel[k * NR + j] = 0.0f;
  }
}

// One NR-column panel of op(B) from `rows` <= NR fp32 source rows holding op(B)'s columns (depth values
// each, `ld` apart: a transposed B, or rows just decoded from a quantized weight): panel[k][j] = row j's
// value k, the columns past `rows` zero. This plain version does depths [k_begin, depth); the vector kernels
// below transpose 16 x 16 (AVX-512) or 8 x 8 (AVX2) squares in registers and leave it only the tail.
template <std::int64_t NR>
void pack_rows_scalar(const float* source, std::int64_t ld, std::int64_t rows, std::int64_t depth,
                      std::int64_t k_begin, float* panel) noexcept {
  for (std::int64_t k = k_begin; k < depth; ++k) {
    for (std::int64_t j = 0; j < rows; ++j) panel[k * NR + j] = source[j * ld + k];
    for (std::int64_t j = rows; j < NR; ++j) panel[k * NR + j] = 0.0f;
  }
}

// --- Micro-kernels: tile[r][j] = sum over k of a[k][r] * b[k][j], for `Rows` <= MR rows and all NR columns,
//     every sum one chain of multiply-adds in k order (fused where the instruction set has FMA). ---

using gemm_micro_kernel = void (*)(std::int64_t depth, const float* a, const float* b, float* tile);

#if MEMKIT_HAS_CUDA
#define MEMKIT_GEMM_UNROLL
#else
#define MEMKIT_GEMM_UNROLL _Pragma("GCC unroll 16")
#endif

// Plain C++: what the compiler's own target makes of it (SSE2 on baseline x86-64).
struct gemm_kernel_portable {
  static constexpr std::int64_t mr = 4, nr = 8;
  template <int Rows>
  static void run(std::int64_t depth, const float* a, const float* b, float* tile) noexcept {
    float acc[Rows][nr] = {};
    for (std::int64_t k = 0; k < depth; ++k, a += mr, b += nr) {
      MEMKIT_GEMM_UNROLL
      for (int r = 0; r < Rows; ++r)
        for (int j = 0; j < nr; ++j) acc[r][j] += a[r] * b[j];
    }
    for (int r = 0; r < Rows; ++r)
      for (int j = 0; j < nr; ++j) tile[r * nr + j] = acc[r][j];
  }
  static void pack_rows(const float* source, std::int64_t ld, std::int64_t rows, std::int64_t depth,
                        float* panel) noexcept {
    pack_rows_scalar<nr>(source, ld, rows, depth, 0, panel);
  }
};

#if MEMKIT_X86_DISPATCH
// AVX2 + FMA: 6 x 16, twelve ymm accumulators.
struct gemm_kernel_avx2 {
  static constexpr std::int64_t mr = 6, nr = 16;
  template <int Rows>
  __attribute__((target("avx2,fma"))) static void run(std::int64_t depth, const float* a, const float* b,
                                                      float* tile) noexcept {
    __m256 c0[Rows], c1[Rows];
    MEMKIT_GEMM_UNROLL
    for (int r = 0; r < Rows; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
    for (std::int64_t k = 0; k < depth; ++k, a += mr, b += nr) {
      const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
      MEMKIT_GEMM_UNROLL
      for (int r = 0; r < Rows; ++r) {
        const __m256 ar = _mm256_broadcast_ss(a + r);
        c0[r] = _mm256_fmadd_ps(ar, b0, c0[r]);
        c1[r] = _mm256_fmadd_ps(ar, b1, c1[r]);
      }
    }
    MEMKIT_GEMM_UNROLL
    for (int r = 0; r < Rows; ++r) {
      _mm256_storeu_ps(tile + r * nr, c0[r]);
      _mm256_storeu_ps(tile + r * nr + 8, c1[r]);
    }
  }
  // pack_rows_scalar's panel, 8 x 8 squares transposed in registers (24 shuffles per 64 values).
  __attribute__((target("avx2,fma"))) static void pack_rows(const float* source, std::int64_t ld, std::int64_t rows,
                                                            std::int64_t depth, float* panel) noexcept {
    std::int64_t k = 0;
    for (; k + 8 <= depth; k += 8)
      for (std::int64_t g = 0; g < nr; g += 8) {
        __m256 r[8], t[8];
        MEMKIT_GEMM_UNROLL
        for (int j = 0; j < 8; ++j) r[j] = g + j < rows ? _mm256_loadu_ps(source + (g + j) * ld + k) : _mm256_setzero_ps();
        MEMKIT_GEMM_UNROLL
        for (int j = 0; j < 8; j += 2) {
          t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
          t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
        }
        MEMKIT_GEMM_UNROLL
        for (int j = 0; j < 8; j += 4) {
          r[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
          r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xee);
          r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
          r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xee);
        }
        MEMKIT_GEMM_UNROLL
        for (int i = 0; i < 4; ++i) {
          _mm256_storeu_ps(panel + (k + i) * nr + g, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
          _mm256_storeu_ps(panel + (k + i + 4) * nr + g, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
        }
      }
    pack_rows_scalar<nr>(source, ld, rows, depth, k, panel);
  }
};

// AVX-512: 12 x 32, twenty-four zmm accumulators.
struct gemm_kernel_avx512 {
  static constexpr std::int64_t mr = 12, nr = 32;
  template <int Rows>
  __attribute__((target("avx512f"))) static void run(std::int64_t depth, const float* a, const float* b,
                                                     float* tile) noexcept {
    __m512 c0[Rows], c1[Rows];
    MEMKIT_GEMM_UNROLL
    for (int r = 0; r < Rows; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
    for (std::int64_t k = 0; k < depth; ++k, a += mr, b += nr) {
      const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
      MEMKIT_GEMM_UNROLL
      for (int r = 0; r < Rows; ++r) {
        const __m512 ar = _mm512_set1_ps(a[r]);
        c0[r] = _mm512_fmadd_ps(ar, b0, c0[r]);
        c1[r] = _mm512_fmadd_ps(ar, b1, c1[r]);
      }
    }
    MEMKIT_GEMM_UNROLL
    for (int r = 0; r < Rows; ++r) {
      _mm512_storeu_ps(tile + r * nr, c0[r]);
      _mm512_storeu_ps(tile + r * nr + 16, c1[r]);
    }
  }
  // pack_rows_scalar's panel, 16 x 16 squares transposed in registers (64 shuffles per 256 values; the
  // zero-masked forms: GCC 12 warns about the unmasked ones' undefined pass-through operand).
  __attribute__((target("avx512f"))) static void pack_rows(const float* source, std::int64_t ld, std::int64_t rows,
                                                           std::int64_t depth, float* panel) noexcept {
    std::int64_t k = 0;
    for (; k + 16 <= depth; k += 16)
      for (std::int64_t g = 0; g < nr; g += 16) {
        __m512 r[16], t[16];
        MEMKIT_GEMM_UNROLL
        for (int j = 0; j < 16; ++j) r[j] = g + j < rows ? _mm512_loadu_ps(source + (g + j) * ld + k) : _mm512_setzero_ps();
        MEMKIT_GEMM_UNROLL
        for (int j = 0; j < 16; j += 2) {  // pairs of rows interleaved
          t[j] = _mm512_maskz_unpacklo_ps(0xffff, r[j], r[j + 1]);
          t[j + 1] = _mm512_maskz_unpackhi_ps(0xffff, r[j], r[j + 1]);
        }
        MEMKIT_GEMM_UNROLL
        for (int j = 0; j < 16; j += 4) {  // quadruples: each 128-bit lane holds one k of four rows
          r[j] = _mm512_castpd_ps(_mm512_maskz_unpacklo_pd(0xff, _mm512_castps_pd(t[j]), _mm512_castps_pd(t[j + 2])));
          r[j + 1] = _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(0xff, _mm512_castps_pd(t[j]), _mm512_castps_pd(t[j + 2])));
          r[j + 2] = _mm512_castpd_ps(_mm512_maskz_unpacklo_pd(0xff, _mm512_castps_pd(t[j + 1]), _mm512_castps_pd(t[j + 3])));
          r[j + 3] = _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(0xff, _mm512_castps_pd(t[j + 1]), _mm512_castps_pd(t[j + 3])));
        }
        MEMKIT_GEMM_UNROLL
        for (int j = 0; j < 8; j += 4)  // 128-bit lanes gathered from row groups 0-3 with 4-7, 8-11 with 12-15
          for (int i = 0; i < 4; ++i) {
            t[2 * j + i] = _mm512_maskz_shuffle_f32x4(0xffff, r[2 * j + i], r[2 * j + i + 4], 0x88);
            t[2 * j + i + 4] = _mm512_maskz_shuffle_f32x4(0xffff, r[2 * j + i], r[2 * j + i + 4], 0xdd);
          }
        MEMKIT_GEMM_UNROLL
        for (int i = 0; i < 8; ++i) {
          r[i] = _mm512_maskz_shuffle_f32x4(0xffff, t[i], t[i + 8], 0x88);
          r[i + 8] = _mm512_maskz_shuffle_f32x4(0xffff, t[i], t[i + 8], 0xdd);
        }
        MEMKIT_GEMM_UNROLL
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(panel + (k + i) * nr + g, r[i]);
      }
    pack_rows_scalar<nr>(source, ld, rows, depth, k, panel);
  }
};
#endif

template <class Kernel, std::size_t... Rows>
constexpr std::array<gemm_micro_kernel, sizeof...(Rows)> gemm_kernels(std::index_sequence<Rows...>) noexcept {
  return {&Kernel::template run<static_cast<int>(Rows) + 1>...};
}

// Where one tile's sums go. Without accumulation (fp32 C, or K within one block) C itself holds the running
// result: the first depth block writes alpha * S + beta * C (never reading C when beta is 0) and later blocks
// add alpha * S. With accumulation (16-bit C, K > kc) fp32 partial sums wait in `acc` and C is written once,
// from the last block: (sum of alpha * S) + beta * C.
template <class TC>
void store_tile(const float* tile, std::int64_t nr, std::int64_t rows, std::int64_t cols, TC* c, std::int64_t ldc,
                float* acc, std::int64_t ld_acc, bool accumulate, bool first, bool last, float alpha, float beta) noexcept {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* s = tile + r * nr;
    TC* c_row = c + r * ldc;
    if (!accumulate) {
      if (!first) {
        for (std::int64_t j = 0; j < cols; ++j) c_row[j] = from_float<TC>(to_float(c_row[j]) + alpha * s[j]);
      } else if (beta == 0.0f) {
        for (std::int64_t j = 0; j < cols; ++j) c_row[j] = from_float<TC>(alpha * s[j]);
      } else {
        for (std::int64_t j = 0; j < cols; ++j) c_row[j] = from_float<TC>(alpha * s[j] + beta * to_float(c_row[j]));
      }
      continue;
    }
    float* acc_row = acc + r * ld_acc;
    if (first) {
      for (std::int64_t j = 0; j < cols; ++j) acc_row[j] = alpha * s[j];
    } else if (!last) {
      for (std::int64_t j = 0; j < cols; ++j) acc_row[j] += alpha * s[j];
    } else if (beta == 0.0f) {
      for (std::int64_t j = 0; j < cols; ++j) c_row[j] = from_float<TC>(acc_row[j] + alpha * s[j]);
    } else {
      for (std::int64_t j = 0; j < cols; ++j)
        c_row[j] = from_float<TC>((acc_row[j] + alpha * s[j]) + beta * to_float(c_row[j]));
    }
  }
}

// The blocked host gemm with one instruction set's micro-kernel, its operands supplied already packed:
//   a_block(part, ic, mc, pc, kc, a_pack) -> const float*: rows [ic, ic + mc) x depth [pc, pc + kc) of op(A)
//     as MR-row panels (pack_a's layout), packed into a_pack (plan.a_floats floats) or found elsewhere;
//   b_block(part, pc, kc, jc, nc, b_pack): depth [pc, pc + kc) x columns [jc, jc + nc) of op(B) as
//     NR-column panels (pack_b's layout) into b_pack.
// `workspace` holds plan.parts() parts; `part` tells the hooks which one runs (a part is one thread's).
template <class Kernel, class TC, class ABlock, class BBlock>
void gemm_blocked_with(float alpha, float beta, const matrix_ref<TC>& C, const gemm_dims& dims, const gemm_plan& plan,
                       float* workspace, const ABlock& a_block, const BBlock& b_block) {
  using blocking = gemm_blocking;
  constexpr std::int64_t MR = Kernel::mr, NR = Kernel::nr;
  static_assert(blocking::row_unit % MR == 0 && blocking::column_unit % NR == 0);
  static constexpr auto kernels = gemm_kernels<Kernel>(std::make_index_sequence<static_cast<std::size_t>(MR)>{});
  // Plain copies: clang before 16 cannot capture structured bindings in the lambda below.
  const std::int64_t M = dims.M, N = dims.N, K = dims.K;
  const std::int64_t row_units = ceil_div(M, blocking::row_unit), column_units = ceil_div(N, blocking::column_unit);
  const std::int64_t ld_acc = std::min(plan.part_cols, blocking::nc);
  ::memkit::detail::run_in_parts(static_cast<int>(plan.parts()), plan.parts(), [&](std::int64_t first_part,
                                                                                  std::int64_t last_part) {
    alignas(64) float tile[MR * NR];
    for (std::int64_t part = first_part; part < last_part; ++part) {
      const std::int64_t pm = part / plan.threads_n, pn = part % plan.threads_n;
      const std::int64_t r0 = std::min(M, row_units * pm / plan.threads_m * blocking::row_unit);
      const std::int64_t r1 = std::min(M, row_units * (pm + 1) / plan.threads_m * blocking::row_unit);
      const std::int64_t c0 = std::min(N, column_units * pn / plan.threads_n * blocking::column_unit);
      const std::int64_t c1 = std::min(N, column_units * (pn + 1) / plan.threads_n * blocking::column_unit);
      float* a_pack = workspace + part * plan.part_floats();
      float* b_pack = a_pack + plan.a_floats;
      float* acc = b_pack + plan.b_floats;
      const std::int64_t chunk = plan.accumulate ? blocking::accumulator_rows : r1 - r0;
      for (std::int64_t rc = r0; rc < r1; rc += chunk) {
        const std::int64_t rc_end = std::min(r1, rc + chunk);
        for (std::int64_t jc = c0; jc < c1; jc += blocking::nc) {
          const std::int64_t nc = std::min(blocking::nc, c1 - jc);
          for (std::int64_t pc = 0; pc < K; pc += blocking::kc) {
            const std::int64_t kc = std::min(blocking::kc, K - pc);
            const bool first = pc == 0, last = pc + kc == K;
            b_block(part, pc, kc, jc, nc, b_pack);
            for (std::int64_t ic = rc; ic < rc_end; ic += blocking::mc) {
              const std::int64_t mc = std::min(blocking::mc, rc_end - ic);
              const float* a_panels = a_block(part, ic, mc, pc, kc, a_pack);
              for (std::int64_t jr = 0; jr < nc; jr += NR) {
                const std::int64_t cols = std::min(NR, nc - jr);
                for (std::int64_t ir = 0; ir < mc; ir += MR) {
                  const std::int64_t rows = std::min(MR, mc - ir);
                  TC* c_tile = C.data + (ic + ir) * C.ld + jc + jr;
                  kernels[static_cast<std::size_t>(rows - 1)](kc, a_panels + ir * kc, b_pack + jr * kc, tile);
                  store_tile(tile, NR, rows, cols, c_tile, C.ld,
                             acc + (ic + ir - rc) * ld_acc + jr, ld_acc, plan.accumulate, first, last, alpha, beta);
                }
              }
            }
          }
        }
      }
    }
  });
}

// The blocked host gemm of matrices A and B, packed as it goes.
template <class Kernel, class TA, class TB, class TC>
void gemm_blocked(transpose op_a, transpose op_b, float alpha, const matrix_ref<const TA>& A,
                  const matrix_ref<const TB>& B, float beta, const matrix_ref<TC>& C, const gemm_dims& dims,
                  const gemm_plan& plan, float* workspace) {
  constexpr std::int64_t MR = Kernel::mr, NR = Kernel::nr;
  gemm_blocked_with<Kernel>(
      alpha, beta, C, dims, plan, workspace,
      [&](std::int64_t, std::int64_t ic, std::int64_t mc, std::int64_t pc, std::int64_t kc, float* a_pack) {
        pack_a<MR>(A, op_a, ic, mc, pc, kc, a_pack);
        return static_cast<const float*>(a_pack);
      },
      [&](std::int64_t, std::int64_t pc, std::int64_t kc, std::int64_t jc, std::int64_t nc, float* b_pack) {
        if constexpr (std::is_same_v<TB, float>) {
          if (op_b == transpose::yes) {  // B's rows are op(B)'s columns: transposed in registers
            for (std::int64_t p = 0; p < nc; p += NR)
              Kernel::pack_rows(B.data + (jc + p) * B.ld + pc, B.ld, std::min(NR, nc - p), kc, b_pack + p * kc);
            return;
          }
        }
        pack_b<NR>(B, op_b, pc, kc, jc, nc, b_pack);
      });
}

template <class Kernel>
struct gemm_kernel_tag {
  using type = Kernel;
};

// body(gemm_kernel_tag<Kernel>{}) with this CPU's micro-kernel (core/host_simd.hpp): for callers that pack
// their own operands for gemm_blocked_with.
template <class Body>
decltype(auto) with_gemm_kernel(Body&& body) {
#if MEMKIT_X86_DISPATCH
  switch (host_isa_in_use()) {
    case host_isa::avx512: return body(gemm_kernel_tag<gemm_kernel_avx512>{});
    case host_isa::avx2: return body(gemm_kernel_tag<gemm_kernel_avx2>{});
    case host_isa::portable: break;
  }
#endif
  return body(gemm_kernel_tag<gemm_kernel_portable>{});
}

// The host gemm on caller-given scratch (plan.parts() * plan.part_floats() floats of a plan_gemm plan), with
// this CPU's micro-kernel (core/host_simd.hpp). For memkit's own callers that run many products on one
// workspace, e.g. quant::matmul's dequantized tiles, one product per thread. Never calls cblas.
template <class TA, class TB, class TC>
void gemm_host_on_scratch(transpose op_a, transpose op_b, float alpha, const matrix_ref<const TA>& A,
                          const matrix_ref<const TB>& B, float beta, const matrix_ref<TC>& C, const gemm_dims& dims,
                          const gemm_plan& plan, float* scratch) {
  with_gemm_kernel([&](auto kernel) {
    gemm_blocked<typename decltype(kernel)::type>(op_a, op_b, alpha, A, B, beta, C, dims, plan, scratch);
  });
}

}  // namespace detail

// C = alpha * op(A) * op(B) + beta * C on the host. `workspace` supplies gemm_workspace_bytes<TA, TB, TC>(M, N,
// K, options). With MEMKIT_USE_CBLAS defined, all-fp32 products call the system's cblas_sgemm instead (no
// workspace; its own threads, e.g. OPENBLAS_NUM_THREADS, and its own summation order).
template <float_storage TA, float_storage TB, float_storage TC>
void gemm(const host_executor& exec, transpose op_a, transpose op_b, float alpha, matrix_ref<const TA> A,
          matrix_ref<const TB> B, float beta, matrix_ref<TC> C, memory_resource& workspace,
          const gemm_options& options = {}) {
  const auto dims = detail::check_gemm(op_a, op_b, A, B, C);
  const std::int64_t M = dims.M, N = dims.N, K = dims.K;  // not a binding: clang < 16 cannot capture one in a lambda
  const char* operation = "linalg::gemm";
  if (!exec.can_access(A.where) || !exec.can_access(B.where) || !exec.can_access(C.where))
    throw error(std::string(operation) + ": an operand is in device memory, which the host executor cannot access");
  require_host_threads(operation, options.host_threads);
  if (M == 0 || N == 0) return;
  if (K == 0) {  // an empty sum: C = beta * C, and C is not read when beta is 0
    for (std::int64_t m = 0; m < M; ++m)
      for (std::int64_t n = 0; n < N; ++n)
        C.data[m * C.ld + n] = from_float<TC>(beta == 0.0f ? 0.0f : beta * to_float(C.data[m * C.ld + n]));
    return;
  }
#if defined(MEMKIT_USE_CBLAS)
  if constexpr (detail::gemm_uses_cblas<TA, TB, TC>(1, 1, 1)) {
    constexpr std::int64_t blas_int_max = 2147483647;
    require(M <= blas_int_max && N <= blas_int_max && K <= blas_int_max && A.ld <= blas_int_max &&
                B.ld <= blas_int_max && C.ld <= blas_int_max,
            std::string(operation) + ": MEMKIT_USE_CBLAS: a dimension or leading dimension exceeds BLAS's int range");
    cblas_sgemm(CblasRowMajor, op_a == transpose::no ? CblasNoTrans : CblasTrans,
                op_b == transpose::no ? CblasNoTrans : CblasTrans, static_cast<int>(M), static_cast<int>(N),
                static_cast<int>(K), alpha, A.data, static_cast<int>(A.ld), B.data, static_cast<int>(B.ld), beta,
                C.data, static_cast<int>(C.ld));
    return;
  }
#endif
  const detail::gemm_plan plan =
      detail::plan_gemm(M, N, K, resolve_host_threads(options.host_threads), !std::is_same_v<TC, float>);
  buffer<float> scratch(workspace, shape{plan.parts() * plan.part_floats()});
  detail::gemm_host_on_scratch(op_a, op_b, alpha, A, B, beta, C, dims, plan, scratch.data());
}

}  // namespace linalg

MEMKIT_NAMESPACE_END

// ---------------------------------------------------------------------------------------------------------
// CUDA: linalg::gemm on a cuda_executor, through cuBLAS (nvcc only). The one device GEMM of memkit's layers
// (lora_linear's products, the example model's projections). Row-major C = alpha op(A) op(B) + beta C is
// cuBLAS's column-major C^T = op(B)^T op(A)^T: cublasGemmEx with the operands swapped, fp32 accumulation
// (CUBLAS_COMPUTE_32F), on exec.stream with the handle and per-stream workspace of core/cublas.hpp. The
// signature is the host one so that code generic over the executor calls one function; the device product
// takes nothing from `workspace` (cuBLAS uses the per-stream workspace core/cublas.hpp keeps) and ignores
// `options` (host threads). Element types: A and B of one type (cublasGemmEx takes both inputs in one
// type); fp32 inputs need an fp32 C; 16-bit inputs give a C of their own type or fp32.
#if MEMKIT_HAS_CUDA
#include "memkit/core/cublas.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace linalg {

namespace detail {
template <class TA, class TB, class TC>
inline constexpr bool cublas_gemm_types =
    std::is_same_v<TA, TB> && (std::is_same_v<TC, float> || (!std::is_same_v<TA, float> && std::is_same_v<TC, TA>));

// C = beta * C for an empty sum (K == 0), C not read when beta is 0 (as the host path).
template <class TC>
__global__ void gemm_scale_kernel(TC* c, std::int64_t rows, std::int64_t cols, std::int64_t ld, float beta) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < rows * cols;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    TC& e = c[(i / cols) * ld + i % cols];
    e = from_float<TC>(beta == 0.0f ? 0.0f : beta * to_float(e));
  }
}
}  // namespace detail

template <float_storage TA, float_storage TB, float_storage TC>
void gemm(const cuda_executor& exec, transpose op_a, transpose op_b, float alpha, matrix_ref<const TA> A,
          matrix_ref<const TB> B, float beta, matrix_ref<TC> C, memory_resource& /*workspace*/,
          const gemm_options& /*options*/ = {}) {
  static_assert(detail::cublas_gemm_types<TA, TB, TC>,
                "linalg::gemm (CUDA): cuBLAS takes A and B in one type, and fp32 inputs need an fp32 C");
  const auto dims = detail::check_gemm(op_a, op_b, A, B, C);
  const std::int64_t M = dims.M, N = dims.N, K = dims.K;
  const char* operation = "linalg::gemm (CUDA)";
  if (!exec.can_access(A.where) || !exec.can_access(B.where) || !exec.can_access(C.where))
    throw error(std::string(operation) + ": an operand is in pageable host memory, which a CUDA executor cannot access");
  if (M == 0 || N == 0) return;
  constexpr std::int64_t int_max = 2147483647;
  require(M <= int_max && N <= int_max && K <= int_max && A.ld <= int_max && B.ld <= int_max && C.ld <= int_max,
          std::string(operation) + ": a dimension or leading dimension exceeds cuBLAS's int range");
  ::memkit::detail::require_cublas_span(A.rows, A.ld, "linalg::gemm", "A");
  ::memkit::detail::require_cublas_span(B.rows, B.ld, "linalg::gemm", "B");
  ::memkit::detail::require_cublas_span(C.rows, C.ld, "linalg::gemm", "C");
  ::memkit::detail::with_device(exec.device, [&] {
    if (K == 0) {
      detail::gemm_scale_kernel<TC><<<::memkit::detail::grid_for(M * N, 256), 256, 0, exec.stream>>>(C.data, M, N, C.ld, beta);
      MEMKIT_CUDA_CHECK(cudaGetLastError());
      return 0;
    }
    cublasHandle_t handle = ::memkit::detail::cublas_handle_for(exec);  // on exec.stream, its own workspace
    ::memkit::detail::cublas_check(
        cublasGemmEx(handle, op_b == transpose::yes ? CUBLAS_OP_T : CUBLAS_OP_N,
                     op_a == transpose::yes ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M),
                     static_cast<int>(K), &alpha, B.data, ::memkit::detail::cuda_type<TB>(), static_cast<int>(B.ld),
                     A.data, ::memkit::detail::cuda_type<TA>(), static_cast<int>(A.ld), &beta, C.data,
                     ::memkit::detail::cuda_type<TC>(), static_cast<int>(C.ld), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
    return 0;
  });
}

}  // namespace linalg

MEMKIT_NAMESPACE_END
#endif
