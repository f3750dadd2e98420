// memkit/quant/detail/matmul_host.hpp — the host kernels of quant::matmul: the fused small-batch products that
// decode W inside the dot products (portable, AVX2 + FMA and AVX-512, chosen at run time), and the large-batch
// forward that decodes W's codes straight into linalg's packed GEMM panels. quant/matmul.hpp plans the calls
// and says which path a call takes. Not a public header: include memkit/quant/matmul.hpp.
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/host_simd.hpp"
#include "memkit/linalg/gemm.hpp"
#include "memkit/quant/blockwise.hpp"
#include "memkit/quant/bytes.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace quant::detail {


// The host forward with a small batch decodes W inside the dot products (workspace: x in fp32, in the
// order the kernel's lanes read it, once per call): 4-bit formats, rows made of whole blocks, M up to
// host_fused_limit. The kernels take up to host_fused_rows rows of x per pass over W; a batch of up to
// host_fused_limit rows makes a few passes, which costs less than decoding W into the GEMM path's packed
// panels, so the time grows smoothly with M instead of jumping at M = 9 (4096 x 4096, one thread:
// docs/performance.md, "Dequantizing matmul at batch 1-8").
inline constexpr std::int64_t host_fused_rows = 8;

// Host paths split the output columns (rows of W) into `parts` ranges of whole 32-column units.
inline constexpr std::int64_t host_column_unit = 32;
constexpr std::int64_t host_column_parts(std::int64_t N, std::int64_t threads) noexcept {
  const std::int64_t units = (N + host_column_unit - 1) / host_column_unit;
  return threads < 1 ? 1 : threads < units ? threads : units;
}
constexpr std::int64_t host_part_begin(std::int64_t N, std::int64_t parts, std::int64_t part) noexcept {
  const std::int64_t units = (N + host_column_unit - 1) / host_column_unit;
  const std::int64_t begin = units * part / parts * host_column_unit;
  return begin < N ? begin : N;
}

// The host forward beyond the fused path is one blocked GEMM (linalg's) with B = dequant(W)^T, its threads
// splitting y's columns. Each slice of up to host_forward_rows rows of x is packed once into the
// micro-kernel's row panels; each depth block x column block of W^T is decoded from the codes (up to 32
// rows of W at a time, into a per-part buffer of decode_floats) and transposed in registers straight into
// the packed column panels: no dequantized tile, no second packing pass, and x is not packed again for
// every tile of W. Its plan (host_forward_plan) and that of matmul_input_grad's tiles (host_tiled_plan) are in
// quant/bytes.hpp, with host_fused_limit.

// --- the fused small-batch forward ---

// Dot product of n floats against n values of T, fp32, 16 independent partial sums (vectorizes).
template <class T>
inline float dot(const T* a, const float* b, std::int64_t n) noexcept {
  float partial[16] = {};
  const std::int64_t whole = n - n % 16;
  for (std::int64_t i = 0; i < whole; i += 16)
    for (int j = 0; j < 16; ++j) partial[j] += to_float(a[i + j]) * b[i + j];
  float sum = 0.0f;
  for (int j = 0; j < 16; ++j) sum += partial[j];
  for (std::int64_t r = whole; r < n; ++r) sum += to_float(a[r]) * b[r];
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, std::int64_t n) noexcept {
  for (std::int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// Host small-batch forward, y[m, n] for n in [n0, n1): each row of W is decoded block by block straight
// into the dot products of all M rows of x. Portable version; the vector ones below do the same with
// wider lookups, several columns at once and two accumulators per row.
template <format F, class T>
void fused_gemv_host(const float* x, std::int64_t M, const std::uint8_t* codes, const block_scales& scales,
                     std::int64_t block_size, std::int64_t N, std::int64_t K, std::int64_t n0, std::int64_t n1, T* y) {
  for (std::int64_t n = n0; n < n1; ++n) {
    float acc[host_fused_rows] = {};
    for (std::int64_t kb = 0; kb < K; kb += block_size) {
      const float scale = scales((n * K + kb) / block_size);
      float table[16];
      for (int c = 0; c < 16; ++c) table[c] = decode<F>(static_cast<std::uint8_t>(c), scale, nullptr);
      const std::uint8_t* bytes = codes + (n * K + kb) / 2;
      for (std::int64_t j = 0; j < block_size; j += 2) {
        const std::uint8_t byte = bytes[j / 2];
        const float w0 = table[byte >> 4], w1 = table[byte & 0x0f];
        for (std::int64_t m = 0; m < M; ++m)
          acc[m] += x[m * K + kb + j] * w0 + x[m * K + kb + j + 1] * w1;
      }
    }
    for (std::int64_t m = 0; m < M; ++m) y[m * N + n] = from_float<T>(acc[m]);
  }
}

// The vector fused kernels decode 16 weights from their 8 bytes broadcast to every 64-bit lane: a variable
// shift brings a different nibble to the low 4 bits of each 32-bit lane (the permute reads only those), so
// a step costs a broadcast load, a shift and a permute, and no widening. The lanes come out in this order
// (lane j holds element fused_lane_element(j) of the 16; AVX2's two vectors of 8 are lanes 0-7 and 8-15),
// and x is stored in the same order beforehand (fused_input_layout), once per call, so each product still
// pairs x[k] with W[n, k].
constexpr int fused_lane_element(int lane) noexcept {
  const int half = lane & 1, nibble = lane >> 1;  // nibble `nibble` (from bit 0) of 32-bit half `half`
  const int byte = 4 * half + nibble / 2;
  return 2 * byte + (nibble % 2 == 0 ? 1 : 0);    // the even element of a byte sits in its high nibble
}

// x as the fused kernels read it: fp32, and for the vector kernels each 16 values in fused_lane_element order.
template <class T>
void fused_input_layout(host_isa isa, const T* x, std::int64_t count, float* out) {
  if (isa != host_isa::portable && count % 16 == 0) {
    for (std::int64_t i = 0; i < count; i += 16)
      for (int lane = 0; lane < 16; ++lane) out[i + lane] = to_float(x[i + fused_lane_element(lane)]);
    return;
  }
  for (std::int64_t i = 0; i < count; ++i) out[i] = to_float(x[i]);
}

#if MEMKIT_QUANT_X86_SIMD
// 32 4-bit codes (16 bytes, the even element in the high nibble) looked up in a block's scaled table:
// the values of elements 0-15 into `first`, 16-31 into `second`.
__attribute__((target("avx512f,avx512bw"))) inline void lookup32_avx512(const std::uint8_t* bytes16, __m512 scaled,
                                                                       __m512& first, __m512& second) noexcept {
  const __m128i low_nibble = _mm_set1_epi8(0x0f);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes16));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibble);
  const __m128i low = _mm_and_si128(bytes, low_nibble);
  // The zero-masked forms: GCC 12 warns about the unmasked ones' undefined pass-through operand.
  first = _mm512_maskz_permutexvar_ps(0xffff, _mm512_maskz_cvtepu8_epi32(0xffff, _mm_unpacklo_epi8(high, low)), scaled);
  second = _mm512_maskz_permutexvar_ps(0xffff, _mm512_maskz_cvtepu8_epi32(0xffff, _mm_unpackhi_epi8(high, low)), scaled);
}

// 16 4-bit codes (8 bytes) looked up in a block's scaled table held as two 8-entry halves: two permutes and
// a blend per 8 values; elements 0-7 into `first`, 8-15 into `second`.
__attribute__((target("avx2,fma"))) inline void lookup16_avx2(const std::uint8_t* bytes8, __m256 low_half,
                                                             __m256 high_half, __m256& first, __m256& second) noexcept {
  const __m128i low_nibble = _mm_set1_epi8(0x0f);
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes8));
  const __m128i nibbles = _mm_unpacklo_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibble),
                                            _mm_and_si128(bytes, low_nibble));
  __m256 values[2];
  for (int h = 0; h < 2; ++h) {
    const __m256i index = _mm256_cvtepu8_epi32(h == 0 ? nibbles : _mm_srli_si128(nibbles, 8));
    values[h] = _mm256_blendv_ps(_mm256_permutevar8x32_ps(low_half, index), _mm256_permutevar8x32_ps(high_half, index),
                                 _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));
  }
  first = values[0];
  second = values[1];
}

// `count` values of a 4-bit W from flat element `first` (both multiples of 32, so 32 values never straddle
// a block) decoded to fp32 into `out`: each block's 16-entry table scaled once (the single products
// decode() forms), then looked up.
template <format F>
__attribute__((target("avx512f,avx512bw"))) void decode4_avx512(const std::uint8_t* codes, const block_scales& scales,
                                                                int block_shift, std::int64_t first, std::int64_t count,
                                                                float* out) {
  alignas(64) float table[16];
  for (int c = 0; c < 16; ++c) table[c] = code_value<F>(static_cast<std::uint8_t>(c), nullptr);
  const __m512 base_table = _mm512_load_ps(table);
  __m512 scaled = base_table;
  std::int64_t block = -1;
  for (std::int64_t k = 0; k < count; k += 32) {
    if (((first + k) >> block_shift) != block) {
      block = (first + k) >> block_shift;
      scaled = _mm512_mul_ps(base_table, _mm512_set1_ps(scales(block)));
    }
    __m512 v0, v1;
    lookup32_avx512(codes + (first + k) / 2, scaled, v0, v1);
    _mm512_storeu_ps(out + k, v0);
    _mm512_storeu_ps(out + k + 16, v1);
  }
}

// decode4_avx512's AVX2 + FMA twin (8-float vectors, the table in two halves). The loops repeat because each
// is compiled for its own target attribute: GCC inlines intrinsics only into functions of the same target.
template <format F>
__attribute__((target("avx2,fma"))) void decode4_avx2(const std::uint8_t* codes, const block_scales& scales,
                                                      int block_shift, std::int64_t first, std::int64_t count,
                                                      float* out) {
  alignas(32) float table[16];
  for (int c = 0; c < 16; ++c) table[c] = code_value<F>(static_cast<std::uint8_t>(c), nullptr);
  const __m256 low_table = _mm256_load_ps(table), high_table = _mm256_load_ps(table + 8);
  __m256 low = low_table, high = high_table;
  std::int64_t block = -1;
  for (std::int64_t k = 0; k < count; k += 16) {
    if (((first + k) >> block_shift) != block) {
      block = (first + k) >> block_shift;
      const __m256 scale = _mm256_set1_ps(scales(block));
      low = _mm256_mul_ps(low_table, scale);
      high = _mm256_mul_ps(high_table, scale);
    }
    __m256 v0, v1;
    lookup16_avx2(codes + (first + k) / 2, low, high, v0, v1);
    _mm256_storeu_ps(out + k, v0);
    _mm256_storeu_ps(out + k + 8, v1);
  }
}

// The fused kernels for one group of Cols columns [n, n + Cols) of W over depth [k0, k1) (whole blocks) and
// Rows rows of x (in fused_input_layout order): the accumulators (one vector per row and column, `lanes`
// floats, at saved + (c * Rows + r) * lanes) start from zero when k0 is 0 and are stored back at the end.
// 16 weights come from their 8 bytes broadcast to every 64-bit lane: a variable shift brings a different
// nibble to the low bits of each 32-bit lane, where the table permute reads it (no widening, no masking).
template <format F>
struct fused_avx512 {
  static constexpr int lanes = 16;
  template <int Rows, int Cols>
  __attribute__((target("avx512f,avx512bw"))) static void run(const float* x, const std::uint8_t* codes,
                                                             const block_scales& scales, int block_shift,
                                                             std::int64_t K, std::int64_t n, std::int64_t k0,
                                                             std::int64_t k1, float* saved) {
    alignas(64) float table[16];
    for (int c = 0; c < 16; ++c) table[c] = code_value<F>(static_cast<std::uint8_t>(c), nullptr);
    const __m512 base_table = _mm512_load_ps(table);
    const __m512i shifts = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
    const std::int64_t block_size = std::int64_t{1} << block_shift;
    __m512 acc[Rows][Cols];
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < Cols; ++c) acc[r][c] = k0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(saved + (c * Rows + r) * 16);
    for (std::int64_t kb = k0; kb < k1; kb += block_size) {
      __m512 scaled[Cols];
      for (int c = 0; c < Cols; ++c)
        scaled[c] = _mm512_mul_ps(base_table, _mm512_set1_ps(scales(((n + c) * K + kb) >> block_shift)));
      for (std::int64_t k = kb; k < kb + block_size; k += 16) {
        __m512 xs[Rows];
        for (int r = 0; r < Rows; ++r) xs[r] = _mm512_loadu_ps(x + r * K + k);
        for (int c = 0; c < Cols; ++c) {
          std::int64_t bytes;
          std::memcpy(&bytes, codes + ((n + c) * K + k) / 2, sizeof bytes);
          // The zero-masked forms: GCC 12 warns about the unmasked ones' undefined pass-through operand.
          const __m512 w = _mm512_maskz_permutexvar_ps(
              0xffff, _mm512_maskz_srlv_epi32(0xffff, _mm512_set1_epi64(bytes), shifts), scaled[c]);
          for (int r = 0; r < Rows; ++r) acc[r][c] = _mm512_fmadd_ps(xs[r], w, acc[r][c]);
        }
      }
    }
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < Cols; ++c) _mm512_store_ps(saved + (c * Rows + r) * 16, acc[r][c]);
  }
};

// AVX2 + FMA: the same 16 lanes as two vectors of 8 (shifts 0-12 and 16-28), each looked up with two
// 8-entry permutes and a blend on the nibble's high bit.
template <format F>
struct fused_avx2 {
  static constexpr int lanes = 8;
  template <int Rows, int Cols>
  __attribute__((target("avx2,fma"))) static void run(const float* x, const std::uint8_t* codes,
                                                     const block_scales& scales, int block_shift, std::int64_t K,
                                                     std::int64_t n, std::int64_t k0, std::int64_t k1, float* saved) {
    alignas(32) float table[16];
    for (int c = 0; c < 16; ++c) table[c] = code_value<F>(static_cast<std::uint8_t>(c), nullptr);
    const __m256 low_table = _mm256_load_ps(table), high_table = _mm256_load_ps(table + 8);
    const __m256i shifts[2] = {_mm256_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12), _mm256_setr_epi32(16, 16, 20, 20, 24, 24, 28, 28)};
    const std::int64_t block_size = std::int64_t{1} << block_shift;
    __m256 acc[Rows][Cols];
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < Cols; ++c) acc[r][c] = k0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(saved + (c * Rows + r) * 8);
    for (std::int64_t kb = k0; kb < k1; kb += block_size) {
      __m256 low[Cols], high[Cols];  // scaled tables: the same single products decode() forms
      for (int c = 0; c < Cols; ++c) {
        const __m256 scale = _mm256_set1_ps(scales(((n + c) * K + kb) >> block_shift));
        low[c] = _mm256_mul_ps(low_table, scale);
        high[c] = _mm256_mul_ps(high_table, scale);
      }
      for (std::int64_t k = kb; k < kb + block_size; k += 16)
        for (int h = 0; h < 2; ++h)
          for (int c = 0; c < Cols; ++c) {
            std::int64_t bytes;
            std::memcpy(&bytes, codes + ((n + c) * K + k) / 2, sizeof bytes);
            const __m256i index = _mm256_srlv_epi32(_mm256_set1_epi64x(bytes), shifts[h]);
            const __m256 w = _mm256_blendv_ps(_mm256_permutevar8x32_ps(low[c], index), _mm256_permutevar8x32_ps(high[c], index),
                                              _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));
            for (int r = 0; r < Rows; ++r) acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8 * h), w, acc[r][c]);
          }
    }
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < Cols; ++c) _mm256_store_ps(saved + (c * Rows + r) * 8, acc[r][c]);
  }
};

// y[r, n] for n in [n0, n1) with a fused kernel: columns in groups of up to 32, depth in chunks of whole
// blocks whose Rows rows of x fit 16 KiB (L1), so x is read from L1 for every column and not from L2; each
// group's accumulators wait in `partial` between chunks, so every lane still sums its products in k order.
template <class Kernel, int Rows, int Cols, class T>
void fused_columns(const float* x, const std::uint8_t* codes, const block_scales& scales, std::int64_t block_size,
                   std::int64_t N, std::int64_t K, std::int64_t n0, std::int64_t n1, T* y) {
  constexpr int lanes = Kernel::lanes;
  constexpr std::int64_t span = 32 / Cols * Cols;
  const int block_shift = std::countr_zero(static_cast<std::uint64_t>(block_size));  // a power of two
  const std::int64_t fit = (std::int64_t{4096} / Rows) / block_size * block_size;
  const std::int64_t chunk = fit > block_size ? fit : block_size;
  alignas(64) float partial[span * Rows * lanes];
  std::int64_t n = n0;
  while (n + Cols <= n1) {
    const std::int64_t end = n + span < n1 ? n + span : n1 - (n1 - n) % Cols;
    for (std::int64_t k0 = 0; k0 < K; k0 += chunk)
      for (std::int64_t group = n; group < end; group += Cols)
        Kernel::template run<Rows, Cols>(x, codes, scales, block_shift, K, group, k0, k0 + chunk < K ? k0 + chunk : K,
                                         partial + (group - n) * Rows * lanes);
    for (std::int64_t column = n; column < end; ++column)
      for (int r = 0; r < Rows; ++r) {
        const std::int64_t c = (column - n) % Cols, group = (column - n) - c;
        const float* sums = partial + (group * Rows + c * Rows + r) * lanes;
        float total = 0.0f;
        for (int lane = 0; lane < lanes; ++lane) total += sums[lane];
        y[r * N + column] = from_float<T>(total);
      }
    n = end;
  }
  if constexpr (Cols > 1)
    if (n < n1) fused_columns<Kernel, Rows, 1>(x, codes, scales, block_size, N, K, n, n1, y);
}

// Columns per group, per row count: at least 8 accumulator chains where registers allow, and each x
// vector used for as many columns as the 32 (AVX-512) or 16 (AVX2) vector registers hold.
constexpr int fused_columns_avx512(int rows) noexcept { return rows == 1 ? 8 : rows == 2 ? 6 : rows <= 4 ? 4 : rows <= 6 ? 3 : 2; }
constexpr int fused_columns_avx2(int rows) noexcept { return rows == 1 ? 3 : rows <= 3 ? 2 : 1; }

// The vector kernel for M rows (1..host_fused_rows), as a compile-time row count.
template <format F, class T, int Rows = 1>
void fused_gemv_simd(host_isa isa, const float* x, std::int64_t M, const std::uint8_t* codes, const block_scales& scales,
                     std::int64_t block_size, std::int64_t N, std::int64_t K, std::int64_t n0, std::int64_t n1, T* y) {
  if constexpr (Rows < host_fused_rows) {
    if (M > Rows) return fused_gemv_simd<F, T, Rows + 1>(isa, x, M, codes, scales, block_size, N, K, n0, n1, y);
  }
  if (isa == host_isa::avx512)
    fused_columns<fused_avx512<F>, Rows, fused_columns_avx512(Rows)>(x, codes, scales, block_size, N, K, n0, n1, y);
  else
    fused_columns<fused_avx2<F>, Rows, fused_columns_avx2(Rows)>(x, codes, scales, block_size, N, K, n0, n1, y);
}
#endif

// `count` values of W from flat element `first` decoded to fp32, by the vector decoder of the instruction
// set `Kernel` is for where the run is whole 32-value steps of a 4-bit format, by dequantize_host otherwise.
template <class Kernel, format F>
void decode_for_gemm(const std::uint8_t* codes, const block_scales& scales, std::int64_t block_size,
                     std::int64_t first, std::int64_t count, float* out) {
#if MEMKIT_QUANT_X86_SIMD && MEMKIT_X86_DISPATCH
  if constexpr (is_four_bit(F)) {
    if (first % 32 == 0 && count % 32 == 0) {
      const int shift = std::countr_zero(static_cast<std::uint64_t>(block_size));  // a power of two
      if constexpr (std::is_same_v<Kernel, linalg::detail::gemm_kernel_avx512>)
        return decode4_avx512<F>(codes, scales, shift, first, count, out);
      if constexpr (std::is_same_v<Kernel, linalg::detail::gemm_kernel_avx2>)
        return decode4_avx2<F>(codes, scales, shift, first, count, out);
    }
  }
#endif
  dequantize_host<F>(codes, scales, block_size, first, count, out, signed_dynamic_table.value);
}

// y = x * dequant(W)^T on the host with linalg's micro-kernel `Kernel` (see host_forward_plan).
template <class Kernel, format F, class T>
void host_forward_gemm(const T* x, const std::uint8_t* codes, const block_scales& scales, std::int64_t block_size,
                       T* y, std::int64_t M, std::int64_t N, std::int64_t K, const host_forward_plan& plan,
                       float* scratch) {
  using blocking = linalg::detail::gemm_blocking;
  constexpr std::int64_t MR = Kernel::mr, NR = Kernel::nr;
  static_assert(NR <= blocking::column_unit);
  float* packed_x = scratch;
  float* decoded = packed_x + plan.x_floats();
  float* gemm_scratch = decoded + plan.gemm.parts() * plan.decode_floats;
  // Each slice of rows of x is packed once: depth block pc holds x_rows x kc at packed_x + x_rows * pc, as
  // MR-row panels; then one gemm over all of W for that slice (planned for a full slice: a shorter last one
  // fits its buffers).
  const linalg::matrix_ref<const T> X(x, M, K, K, memory_kind::host);
  const std::int64_t depth_blocks = linalg::detail::ceil_div(K, blocking::kc);
  const std::int64_t pack_parts = plan.gemm.parts() < depth_blocks ? plan.gemm.parts() : depth_blocks;
  for (std::int64_t m0 = 0; m0 < M; m0 += plan.rows) {
    const std::int64_t rows = M - m0 < plan.rows ? M - m0 : plan.rows;
    ::memkit::detail::run_in_parts(static_cast<int>(pack_parts), depth_blocks, [&](std::int64_t first, std::int64_t last) {
      for (std::int64_t b = first; b < last; ++b) {
        const std::int64_t pc = b * blocking::kc, kc = K - pc < blocking::kc ? K - pc : blocking::kc;
        linalg::detail::pack_a<MR>(X, linalg::transpose::no, m0, rows, pc, kc, packed_x + plan.x_rows * pc);
      }
    });
    linalg::detail::gemm_blocked_with<Kernel>(
        1.0f, 0.0f, linalg::matrix_ref<T>(y + m0 * N, rows, N, N, memory_kind::host), {rows, N, K}, plan.gemm,
        gemm_scratch,
        [&](std::int64_t, std::int64_t ic, std::int64_t, std::int64_t pc, std::int64_t kc, float*) {
          return static_cast<const float*>(packed_x + plan.x_rows * pc + ic * kc);
        },
        [&](std::int64_t part, std::int64_t pc, std::int64_t kc, std::int64_t jc, std::int64_t nc, float* b_pack) {
          float* decoded_rows = decoded + part * plan.decode_floats;
          for (std::int64_t p = 0; p < nc; p += NR) {
            const std::int64_t count = nc - p < NR ? nc - p : NR;
            for (std::int64_t j = 0; j < count; ++j)
              decode_for_gemm<Kernel, F>(codes, scales, block_size, (jc + p + j) * K + pc, kc, decoded_rows + j * kc);
            Kernel::pack_rows(decoded_rows, kc, count, kc, b_pack + p * kc);
          }
        });
  }
}

}  // namespace quant::detail

MEMKIT_NAMESPACE_END
