// memkit/quant/matmul.hpp — matrix products with a quantized weight, never dequantizing all of it.
//
//   y  = x  * dequant(W)^T     x [M, K], W [N, K] -> y  [M, N]    (the Linear forward)
//   dx = dy * dequant(W)       dy [M, N]           -> dx [M, K]   (the input gradient; W gets none)
//
// Host: batches of up to 32 rows (4-bit W, rows of whole blocks) decode W inside the dot products, up to 8
// rows per pass over W, several columns at a time, depth in L1-sized chunks (AVX-512, AVX2 + FMA or
// portable, chosen at run time by core/host_simd.hpp). Larger forward batches are linalg GEMMs whose B
// panels are decoded straight from W's codes (x packed once per 288 rows; no dequantized tile); the input gradient
// dequantizes tiles of W's rows (at least host_gemm_min_rows) and multiplies them with linalg's GEMM. All
// paths split the output columns over matmul_config::host_threads threads (core/host_threads.hpp), never
// the sum, so results do not depend on the thread count; fp32 accumulation throughout.
// CUDA: for M <= small_batch_limit (at most 8) a fused kernel decodes W on the fly (one warp per output
// column for y, one thread per input column for dx), reading the 4-bit codes once; larger batches
// dequantize row tiles (device_tile_floats values, 128 MiB of bf16 by default: the whole W of a layer up to
// 8192 x 8192) into workspace and call cuBLAS (tensor cores for bf16/fp16). One tile is one dequantize and one
// cuBLAS call that writes y or dx directly; when W takes several tiles, a 16-bit dx is accumulated in fp32.
// That workspace is allocated and released on the executor's stream, so the CUDA tiled path needs a
// stream-ordered workspace resource (device_async_resource, or a tracker over one) and refuses any other:
// a plain device_resource would free it with cudaFree, which waits for the whole device (docs/cuda.md).
// Users of the CUDA large-batch path link CUDA::cublas.
//
// matmul_workspace_bytes() says exactly what a call takes from the workspace resource.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/device_vector.hpp"
#include "memkit/core/cublas.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/host_simd.hpp"
#include "memkit/core/host_threads.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/linalg/gemm.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/quant/blockwise.hpp"
#include "memkit/quant/quantized_tensor.hpp"


MEMKIT_NAMESPACE_BEGIN

namespace quant {

struct matmul_config {
  std::int64_t tile_floats = 1 << 16;   // host input gradient: dequantized values per tile (256 KiB of fp32)
  std::int64_t device_tile_floats = 1 << 26;  // CUDA large batch: values per tile (128 MiB of bf16): the whole
                                              // W of layers up to 8192 x 8192, so a training-shape product is one
                                              // dequantize and one cuBLAS call (4 tiles of 2^24 took 1.5-2.2x
                                              // dense bf16 at M = 1024 on an H200; docs/cuda.md)
  std::int64_t small_batch_limit = 8;   // CUDA: M up to this (and up to 8) uses the fused kernels
  int host_simd = 2;                    // host fused path: 2 best available, 1 at most AVX2, 0 portable C++
  int host_threads = 1;                 // host: threads over output columns, 0 = every hardware thread
};

enum class matmul_kind : std::uint8_t { forward, input_grad };

namespace detail {
// Rows of W dequantized per tile: at least one, at most N.
constexpr std::int64_t tile_rows(std::int64_t N, std::int64_t K, const matmul_config& config, bool on_device) noexcept {
  const std::int64_t floats = on_device ? config.device_tile_floats : config.tile_floats;
  const std::int64_t rows = K > 0 ? floats / K : 1;
  return rows < 1 ? 1 : rows < N ? rows : N;
}
}  // namespace detail

namespace detail {
// The host forward with a small batch decodes W inside the dot products (workspace: x in fp32, in the
// order the kernel's lanes read it, once per call): 4-bit formats, rows made of whole blocks, M up to
// host_fused_limit. The kernels take up to host_fused_rows rows of x per pass over W; a batch of up to
// host_fused_limit rows makes a few passes, which costs less than decoding W into the GEMM path's packed
// panels, so the time grows smoothly with M instead of jumping at M = 9 (4096 x 4096, one thread:
// docs/performance.md, "Dequantizing matmul at batch 1-8").
inline constexpr std::int64_t host_fused_rows = 8;
inline constexpr std::int64_t host_fused_limit = 32;
constexpr bool host_fused(matmul_kind kind, format fmt, std::int64_t block_size, std::int64_t M,
                          std::int64_t K) noexcept {
  return kind == matmul_kind::forward && is_four_bit(fmt) && M <= host_fused_limit && block_size > 0 &&
         K % block_size == 0;
}
}  // namespace detail

namespace detail {
// The host's threads (0 = every hardware thread, known only at run time).
constexpr std::int64_t host_matmul_threads(const matmul_config& config) noexcept {
  if (config.host_threads > 0) return config.host_threads;
  return config.host_threads == 0 ? resolve_host_threads(0) : 1;
}

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
// every tile of W.
// x is packed host_forward_rows rows at a time (so the workspace does not grow with the batch: 4.5 MiB of
// packed x for K = 4096), W decoded again for each such slice of rows.
inline constexpr std::int64_t host_forward_rows = 288;
struct host_forward_plan {
  linalg::detail::gemm_plan gemm{};  // one slice's product; its a_floats are 0: the A panels are the packed x
  std::int64_t rows = 0;             // rows of x per slice
  std::int64_t x_rows = 0;           // rows rounded up to linalg's row unit: packed x holds x_rows x K
  std::int64_t depth = 0;            // K
  std::int64_t decode_floats = 0;    // one part's decoded rows of W
  constexpr std::int64_t x_floats() const noexcept { return linalg::detail::round_up(x_rows * depth, 16); }
  constexpr std::int64_t floats() const noexcept {
    return x_floats() + gemm.parts() * (gemm.part_floats() + decode_floats);
  }
};
constexpr host_forward_plan plan_host_forward(std::int64_t M, std::int64_t N, std::int64_t K, bool y_is_16_bit,
                                              const matmul_config& config) noexcept {
  using blocking = linalg::detail::gemm_blocking;
  host_forward_plan plan;
  plan.rows = M < host_forward_rows ? M : host_forward_rows;
  plan.gemm = linalg::detail::plan_gemm(plan.rows, N, K, host_matmul_threads(config), y_is_16_bit);
  plan.gemm.a_floats = 0;
  plan.depth = K;
  plan.x_rows = linalg::detail::round_up(plan.rows, blocking::row_unit);
  plan.decode_floats = linalg::detail::round_up(blocking::column_unit * (K < blocking::kc ? K : blocking::kc), 16);
  return plan;
}

// The tiles of matmul_input_grad: each holds `rows` rows of W dequantized (at least host_gemm_min_rows, so
// packing dy for each tile stays small against the tile's products), multiplied into dx by linalg's gemm.
inline constexpr std::int64_t host_gemm_min_rows = 128;
struct host_tiled_plan {
  std::int64_t rows = 0;
  std::int64_t tile_floats = 0;      // the tile, rounded up to 64 bytes
  linalg::detail::gemm_plan gemm{};  // the product with a full tile
  constexpr std::int64_t part_floats() const noexcept { return tile_floats + gemm.parts() * gemm.part_floats(); }
};
// The input gradient: one tile of `rows` rows of W, multiplied into the fp32 dx (or its fp32 accumulator)
// by a gemm whose threads split dx's columns.
constexpr host_tiled_plan plan_host_input_grad(std::int64_t M, std::int64_t N, std::int64_t K,
                                               const matmul_config& config) noexcept {
  host_tiled_plan plan;
  const std::int64_t cache_rows = tile_rows(N, K, config, false);
  const std::int64_t rows = cache_rows > host_gemm_min_rows ? cache_rows : host_gemm_min_rows;
  plan.rows = rows < N ? rows : N;
  plan.tile_floats = linalg::detail::round_up(plan.rows * K, 16);
  plan.gemm = linalg::detail::plan_gemm(M, K, plan.rows, host_matmul_threads(config), false);
  return plan;
}
}  // namespace detail

namespace detail {
// The CUDA fused kernels keep one accumulator per row of the batch: they serve M up to this many rows,
// and only when config.small_batch_limit allows; larger batches take the tiled cuBLAS path.
inline constexpr int device_fused_rows = 8;
constexpr bool device_fused(std::int64_t M, const matmul_config& config) noexcept {
  return M <= config.small_batch_limit && M <= device_fused_rows;
}

// The tiled input-gradient kernel's geometry: a block of 256 threads owns 256 columns of dx; W is read in
// tiles of 8 KiB of codes (64 rows of 4-bit or 32 rows of int8 codes), 16 bytes per load.
inline constexpr int gemv_t_columns = 256;
inline constexpr int gemv_t_tile_bytes = 8192;

// Whether W's rows start 16-byte aligned, as the tiled kernel loads them (the codes pointer is checked too).
template <format F>
constexpr bool gemv_t_vector(std::int64_t K) noexcept {
  return K % codes_per_16_bytes<F> == 0;
}

// Ranges of W's rows the tiled kernel splits N into, so that small K still gives enough blocks: about 264
// blocks (two per SM of a 132-SM H100), at least 256 rows per range. A function of the shape alone, so
// the sums (and their bits) do not depend on the GPU.
constexpr std::int64_t gemv_t_splits(std::int64_t N, std::int64_t K) noexcept {
  constexpr std::int64_t target_blocks = 264, min_rows = 256;
  const std::int64_t column_blocks = (K + gemv_t_columns - 1) / gemv_t_columns;
  const std::int64_t wanted = (target_blocks + column_blocks - 1) / column_blocks;
  const std::int64_t most = (N + min_rows - 1) / min_rows;
  const std::int64_t splits = wanted < most ? wanted : most;
  return splits > 1 ? splits : 1;
}
}  // namespace detail

// Workspace bytes of one call: M, N, K as in the header; `fmt` and `block_size` those of W; `on_device`
// selects the CUDA plan; `element_bytes` is sizeof the activation type.
constexpr std::size_t matmul_workspace_bytes(matmul_kind kind, format fmt, std::int64_t block_size, std::int64_t M,
                                             std::int64_t N, std::int64_t K, std::size_t element_bytes,
                                             bool on_device, const matmul_config& config = {}) noexcept {
  if (M == 0 || N == 0 || K == 0) return 0;  // an empty product only writes zeros (or nothing)
  const std::int64_t rows = detail::tile_rows(N, K, config, on_device);
  const bool fp32 = element_bytes == 4;
  if (!on_device) {
    if (detail::host_fused(kind, fmt, block_size, M, K)) return static_cast<std::size_t>(M * K) * 4;
    if (kind == matmul_kind::forward)
      return static_cast<std::size_t>(detail::plan_host_forward(M, N, K, !fp32, config).floats()) * 4;
    const detail::host_tiled_plan plan = detail::plan_host_input_grad(M, N, K, config);
    return static_cast<std::size_t>(plan.part_floats()) * 4 + (fp32 ? 0 : static_cast<std::size_t>(M * K) * 4);
  }
  if (detail::device_fused(M, config)) {
    // The tiled input-gradient kernel's partial sums, when it splits N (a function of the shape alone).
    if (kind != matmul_kind::input_grad || M == 0 || N == 0 || K == 0) return 0;
    const bool tiled = fmt == format::int8 ? detail::gemv_t_vector<format::int8>(K) : detail::gemv_t_vector<format::nf4>(K);
    const std::int64_t splits = tiled ? detail::gemv_t_splits(N, K) : 1;
    return splits > 1 ? static_cast<std::size_t>(splits * M * K) * 4 : 0;
  }
  const std::size_t tile = static_cast<std::size_t>(rows * K) * element_bytes;
  // A 16-bit dx summed over several tiles is accumulated in fp32; one tile writes dx directly.
  return tile + (kind == matmul_kind::input_grad && !fp32 && rows < N ? static_cast<std::size_t>(M * K) * 4 : 0);
}

namespace detail {

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

struct matmul_dims {
  std::int64_t M, N, K;
};

template <format F, class T>
matmul_dims check_matmul(const char* operation, const quantized_tensor<F>& w, const tensor_view<const T>& in,
                         const tensor_view<T>& out, matmul_kind kind) {
  const shape& ws = w.logical_shape();
  require(ws.rank == 2, std::string(operation) + ": the weight must be a matrix [N, K], has shape " + to_string(ws));
  const std::int64_t N = ws[0], K = ws[1];
  const std::int64_t in_cols = kind == matmul_kind::forward ? K : N;
  const std::int64_t out_cols = kind == matmul_kind::forward ? N : K;
  const shape& is = in.shape();
  require(is.rank >= 1 && is[is.rank - 1] == in_cols,
          std::string(operation) + ": input has shape " + to_string(is) + " but the weight " + to_string(ws) +
              " needs a last dimension of " + std::to_string(in_cols));
  // Rows: the product of the leading dimensions (not size / in_cols, which is 0 / 0 when K or N is 0).
  std::int64_t M = 1;
  for (int d = 0; d + 1 < is.rank; ++d) M *= is[d];
  require(out.size() == M * out_cols && out.shape()[out.shape().rank - 1] == out_cols,
          std::string(operation) + ": output has shape " + to_string(out.shape()) + " but needs " +
              std::to_string(M) + " rows of " + std::to_string(out_cols));
  return {M, N, K};
}

#if MEMKIT_HAS_CUDA
MEMKIT_DEVICE MEMKIT_FORCEINLINE float warp_sum(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// y[m, n] for m < M <= MaxRows: one warp per row n of W; lanes take 16 bytes of codes at a time (32 4-bit
// or 16 int8 weights, all in one quantization block since blocks are powers of two >= 32) with the
// matching 16-byte loads of x, decode each weight once for all rows (code value from shared memory times
// the block's scale, the rounding of decode()), and the warp adds its lanes' sums. Rows whose length or
// alignment does not allow 16-byte loads take one weight per lane at a time.
template <format F, class T, int MaxRows>
__global__ void fused_gemv_kernel(const T* __restrict__ x, const std::uint8_t* __restrict__ codes,
                                  block_scales scales, std::int64_t block_size, std::int64_t M,
                                  std::int64_t N, std::int64_t K, T* __restrict__ y,
                                  code_table<256> map_table, code_table<256> nested_table) {
  constexpr int entries = F == format::int8 ? 256 : 16;
  constexpr int per_load = codes_per_16_bytes<F>;
  constexpr int words_per_8 = F == format::int8 ? 2 : 1;  // 32-bit words of codes per 8 weights
  __shared__ float table[entries];
  __shared__ float nested_map[256];
  stage_code_values<F>(table, map_table);
  stage_nested_map(scales, nested_map, nested_table);
  __syncthreads();
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int shift = block_shift(block_size);
  const std::int64_t warps = blockDim.x >> 5;
  const bool vector = K % per_load == 0 && ::memkit::detail::vector_aligned(codes, x);
  for (std::int64_t n = blockIdx.x * warps + (threadIdx.x >> 5); n < N; n += gridDim.x * warps) {
    float acc[MaxRows] = {};
    const std::int64_t row = n * K;
    if (vector) {
      const uint4* row_codes = reinterpret_cast<const uint4*>(codes + (F == format::int8 ? row : row / 2));
      for (std::int64_t chunk = lane; chunk < K / per_load; chunk += 32) {
        const uint4 packed = __ldg(row_codes + chunk);
        const std::uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
        const std::int64_t k0 = chunk * per_load;
        const float scale = scales((row + k0) >> shift);
#pragma unroll
        for (int part = 0; part < per_load / 8; ++part) {
          float w[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) w[j] = stored_product(table[code_in_words<F>(words + part * words_per_8, j)], scale);
#pragma unroll
          for (int m = 0; m < MaxRows; ++m) {
            if (m >= M) break;
            float xv[8];
            ::memkit::detail::load_floats<T, 8, true>(x + m * K + k0 + 8 * part, xv);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[m] += xv[j] * w[j];
          }
        }
      }
    } else {
      for (std::int64_t k = lane; k < K; k += 32) {
        const std::int64_t element = row + k;
        const float w = stored_product(table[code_at<F>(codes, element)], scales(element >> shift));
#pragma unroll
        for (int m = 0; m < MaxRows; ++m)
          if (m < M) acc[m] += to_float(x[m * K + k]) * w;
      }
    }
#pragma unroll
    for (int m = 0; m < MaxRows; ++m) {
      if (m >= M) break;
      const float total = warp_sum(acc[m]);
      if (lane == 0) y[m * N + n] = from_float<T>(total);
    }
  }
}

// dx[m, k] for m < M <= MaxRows when W's rows do not allow 16-byte loads (gemv_t_vector is false): one
// thread per column k, walking the rows of W (coalesced across threads).
template <format F, class T, int MaxRows>
__global__ void __launch_bounds__(256) fused_gemv_t_kernel(const T* __restrict__ dy, const std::uint8_t* __restrict__ codes,
                                                           block_scales scales, std::int64_t block_size, std::int64_t M,
                                                           std::int64_t N, std::int64_t K, T* __restrict__ dx,
                                                           code_table<256> map_table, code_table<256> nested_table) {
  constexpr int entries = F == format::int8 ? 256 : 16;
  __shared__ float table[entries];
  __shared__ float nested_map[256];
  stage_code_values<F>(table, map_table);
  stage_nested_map(scales, nested_map, nested_table);
  __syncthreads();
  const int shift = block_shift(block_size);
  for (std::int64_t k = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; k < K;
       k += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float acc[MaxRows] = {};
    for (std::int64_t n = 0; n < N; ++n) {
      const std::int64_t element = n * K + k;
      const float w = stored_product(table[code_at<F>(codes, element)], scales(element >> shift));
#pragma unroll
      for (int m = 0; m < MaxRows; ++m)
        if (m < M) acc[m] += to_float(dy[m * N + n]) * w;
    }
#pragma unroll
    for (int m = 0; m < MaxRows; ++m)
      if (m < M) dx[m * K + k] = from_float<T>(acc[m]);
  }
}

// dx[m, k] = sum_n dy[m, n] W[n, k] for m < M <= MaxRows, W's rows 16-byte aligned. Block (x, y) owns
// columns [256x, 256x + 256) and the y-th range of rows_per_split rows. It walks its rows in tiles loaded
// with 16-byte loads one tile ahead (registers) and read back from shared memory: thread t owns the 8
// columns 8 (t % 32) .. + 8 and rows t / 32, t / 32 + 8, ... of each tile, so each weight is decoded once
// (code value times the block's scale, the rounding of decode()) for all M rows of dy. The 8 row phases
// are added in a fixed order; one range writes dx, several write fp32 partial sums [range][m][k] that
// gemv_t_reduce_kernel adds in range order: the same bits every run.
template <format F, class T, int MaxRows>
__global__ void __launch_bounds__(256) fused_gemv_t_tiled_kernel(const T* __restrict__ dy,
                                                                 const std::uint8_t* __restrict__ codes,
                                                                 block_scales scales, std::int64_t block_size,
                                                                 std::int64_t M, std::int64_t N, std::int64_t K,
                                                                 T* __restrict__ dx, float* __restrict__ partial,
                                                                 std::int64_t rows_per_split, code_table<256> map_table,
                                                                 code_table<256> nested_table) {
  constexpr int entries = F == format::int8 ? 256 : 16;
  constexpr int row_bytes = F == format::int8 ? gemv_t_columns : gemv_t_columns / 2;  // one row's codes in a tile
  constexpr int tile_rows = gemv_t_tile_bytes / row_bytes;
  constexpr int vectors_per_row = row_bytes / 16;
  constexpr int loads = gemv_t_tile_bytes / 16 / 256;  // 16-byte loads per thread per tile
  constexpr int words_per_8 = F == format::int8 ? 2 : 1;
  __shared__ float table[entries];
  __shared__ float nested_map[256];
  __shared__ uint4 tile[gemv_t_tile_bytes / 16];
  __shared__ float dy_tile[MaxRows][tile_rows];
  __shared__ float sums[MaxRows][gemv_t_columns];
  stage_code_values<F>(table, map_table);
  stage_nested_map(scales, nested_map, nested_table);
  const int t = static_cast<int>(threadIdx.x), lane = t & 31, phase = t >> 5;
  const int shift = block_shift(block_size);
  const std::int64_t first_column = static_cast<std::int64_t>(blockIdx.x) * gemv_t_columns;
  const std::int64_t n_begin = static_cast<std::int64_t>(blockIdx.y) * rows_per_split;
  const std::int64_t n_end = N - n_begin < rows_per_split ? N : n_begin + rows_per_split;
  const std::int64_t row_stride = F == format::int8 ? K : K / 2;  // bytes of codes per row of W
  const std::int64_t first_byte = F == format::int8 ? first_column : first_column / 2;
  const std::int64_t valid_bytes = row_stride - first_byte < row_bytes ? row_stride - first_byte : row_bytes;
  uint4 next[loads];
  auto load_tile = [&](std::int64_t n0) {
#pragma unroll
    for (int i = 0; i < loads; ++i) {
      const int q = t + 256 * i, r = q / vectors_per_row, c = q % vectors_per_row;
      next[i] = make_uint4(0u, 0u, 0u, 0u);
      if (n0 + r < n_end && 16 * c < valid_bytes)
        next[i] = __ldg(reinterpret_cast<const uint4*>(codes + (n0 + r) * row_stride + first_byte) + c);
    }
  };
  float acc[MaxRows][8] = {};
  const std::int64_t column = first_column + 8 * lane;  // this thread's first column; K % 8 == 0
  if (n_begin < n_end) load_tile(n_begin);
  for (std::int64_t n0 = n_begin; n0 < n_end; n0 += tile_rows) {
    __syncthreads();  // the previous tile is consumed (and the tables staged, the first time)
#pragma unroll
    for (int i = 0; i < loads; ++i) tile[t + 256 * i] = next[i];
    for (int i = t; i < MaxRows * tile_rows; i += 256) {
      const int m = i / tile_rows, r = i % tile_rows;
      dy_tile[m][r] = m < M && n0 + r < n_end ? to_float(dy[m * N + n0 + r]) : 0.0f;
    }
    __syncthreads();
    if (n0 + tile_rows < n_end) load_tile(n0 + tile_rows);  // in flight while this tile is used
    if (column >= K) continue;
    for (int r = phase; r < tile_rows && n0 + r < n_end; r += 8) {
      const float scale = scales(((n0 + r) * K + column) >> shift);  // 8 columns, one block (blocks >= 32)
      std::uint32_t words[2];
      if constexpr (F == format::int8) {
        const uint2 raw = reinterpret_cast<const uint2*>(tile)[r * (row_bytes / 8) + lane];
        words[0] = raw.x;
        words[1] = raw.y;
      } else {
        words[0] = reinterpret_cast<const std::uint32_t*>(tile)[r * (row_bytes / 4) + lane];
        words[1] = 0u;
      }
      float w[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) w[j] = stored_product(table[code_in_words<F>(words, j)], scale);
      (void)words_per_8;
#pragma unroll
      for (int m = 0; m < MaxRows; ++m) {
        if (m >= M) break;
        const float d = dy_tile[m][r];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[m][j] += d * w[j];
      }
    }
  }
  // The row phases' sums, added in phase order.
  for (int p = 0; p < 8; ++p) {
    if (phase == p) {
#pragma unroll
      for (int m = 0; m < MaxRows; ++m) {
        if (m >= M) break;
#pragma unroll
        for (int j = 0; j < 8; ++j) sums[m][8 * lane + j] = p == 0 ? acc[m][j] : sums[m][8 * lane + j] + acc[m][j];
      }
    }
    __syncthreads();
  }
  const std::int64_t k = first_column + t;
  if (k >= K) return;
  for (int m = 0; m < M; ++m) {
    if (partial != nullptr) partial[(static_cast<std::int64_t>(blockIdx.y) * M + m) * K + k] = sums[m][t];
    else dx[m * K + k] = from_float<T>(sums[m][t]);
  }
}

// dx = the sum over ranges of the tiled kernel's partial sums, in range order.
template <class T>
__global__ void gemv_t_reduce_kernel(const float* __restrict__ partial, std::int64_t splits, std::int64_t count,
                                     T* __restrict__ dx) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float sum = partial[i];
    for (std::int64_t s = 1; s < splits; ++s) sum += partial[s * count + i];
    dx[i] = from_float<T>(sum);
  }
}

template <class T>
__global__ void convert_kernel(const float* __restrict__ in, T* __restrict__ out, std::int64_t count) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i] = from_float<T>(in[i]);
}

#endif

// An empty sum is zero: the output of a product whose inner dimension (K for y, N for dx) is 0.
template <executor E, float_storage T>
void write_zeros(const E& exec, tensor_view<T> out) {
  if constexpr (!E::on_device) {
    (void)exec;
    for (std::int64_t i = 0; i < out.size(); ++i) out[i] = from_float<T>(0.0f);
  } else {
#if MEMKIT_HAS_CUDA
    // +0.0 is all zero bits in fp32, bf16 and fp16 alike.
    ::memkit::detail::with_device(exec.device, [&] {
      MEMKIT_CUDA_CHECK(cudaMemsetAsync(out.data(), 0, static_cast<std::size_t>(out.size()) * sizeof(T), exec.stream));
      return 0;
    });
#endif
  }
}

}  // namespace detail

// y = x * dequant(w)^T. x: [..., K] (T = float, bf16 or fp16), y: [..., N] of the same T.
template <executor E, format F, float_storage T>
void matmul(const E& exec, tensor_view<const std::type_identity_t<T>> x, const quantized_tensor<F>& w, tensor_view<T> y,
            memory_resource& workspace, const matmul_config& config = {}) {
  constexpr const char* operation = "quant::matmul";
  // Named variables, not a structured binding: clang before 16 cannot capture bindings in the lambdas below.
  const detail::matmul_dims dims = detail::check_matmul(operation, w, x, y, matmul_kind::forward);
  const std::int64_t M = dims.M, N = dims.N, K = dims.K;
  require_accessible(exec, x, operation, "x");
  require_accessible(exec, w.codes(), operation, "w");
  require_accessible(exec, y, operation, "y");
  if (M == 0 || N == 0) return;
  if (K == 0) return detail::write_zeros(exec, y);
  if constexpr (!E::on_device) {
    if constexpr (is_four_bit(F)) {
      if (detail::host_fused(matmul_kind::forward, F, w.block_size(), M, K)) {
        block_scales scales = w.scales();
        scales.nested_map = w.nested_map().value;
#if MEMKIT_QUANT_X86_SIMD
        host_isa isa = host_isa_in_use();
        if (config.host_simd < 2 && isa == host_isa::avx512) isa = host_isa::avx2;
        if (config.host_simd < 1) isa = host_isa::portable;
#else
        const host_isa isa = host_isa::portable;
#endif
        // x in fp32 and in the order the kernel's lanes take it, once, not once per row of W.
        buffer<float> widened(workspace, shape{M * K});
        detail::fused_input_layout(isa, x.data(), M * K, widened.data());
        const float* wide = widened.data();
        const std::int64_t parts = detail::host_column_parts(N, detail::host_matmul_threads(config));
        ::memkit::detail::run_in_parts(static_cast<int>(parts), parts, [&](std::int64_t first, std::int64_t last) {
          const std::int64_t n0 = detail::host_part_begin(N, parts, first), n1 = detail::host_part_begin(N, parts, last);
          // Passes over this part of W, each with up to host_fused_rows rows of x, as even as can be.
          const std::int64_t passes = (M + detail::host_fused_rows - 1) / detail::host_fused_rows;
          for (std::int64_t pass = 0; pass < passes; ++pass) {
            const std::int64_t m0 = M * pass / passes, rows = M * (pass + 1) / passes - m0;
            const float* x_rows = wide + m0 * K;
            T* y_rows = y.data() + m0 * N;
#if MEMKIT_QUANT_X86_SIMD
            if (isa != host_isa::portable) {
              detail::fused_gemv_simd<F>(isa, x_rows, rows, w.codes().data(), scales, w.block_size(), N, K, n0, n1, y_rows);
              continue;
            }
#endif
            detail::fused_gemv_host<F>(x_rows, rows, w.codes().data(), scales, w.block_size(), N, K, n0, n1, y_rows);
          }
        });
        return;
      }
    }
    const detail::host_forward_plan plan = detail::plan_host_forward(M, N, K, !std::is_same_v<T, float>, config);
    buffer<float> scratch(workspace, shape{plan.floats()});
    block_scales scales = w.scales();
    scales.nested_map = w.nested_map().value;
    linalg::detail::with_gemm_kernel([&](auto kernel) {
      detail::host_forward_gemm<typename decltype(kernel)::type, F>(x.data(), w.codes().data(), scales, w.block_size(),
                                                                    y.data(), M, N, K, plan, scratch.data());
    });
  } else {
#if MEMKIT_HAS_CUDA
    // The tiled path's workspace is allocated and released on exec.stream (docs/cuda.md, "Workspace").
    if (!detail::device_fused(M, config)) ::memkit::detail::require_stream_ordered(workspace, operation);
    ::memkit::detail::with_device(exec.device, [&] {
      if (detail::device_fused(M, config)) {
        constexpr int threads = 256;
        detail::fused_gemv_kernel<F, T, detail::device_fused_rows><<<detail::grid_for(N * 32, threads), threads, 0, exec.stream>>>(
            x.data(), w.codes().data(), w.scales(), w.block_size(), M, N, K, y.data(), signed_dynamic_table,
            w.nested_map());
        MEMKIT_CUDA_CHECK(cudaGetLastError());
        return 0;
      }
      const std::int64_t rows = detail::tile_rows(N, K, config, true);
      buffer<T> tile(workspace, shape{rows * K}, on_stream{exec.stream});
      cublasHandle_t handle = ::memkit::detail::cublas_handle_for(exec);  // on exec.stream, its own workspace
      const float one = 1.0f, zero = 0.0f;
      for (std::int64_t n0 = 0; n0 < N; n0 += rows) {
        const std::int64_t nt = N - n0 < rows ? N - n0 : rows;
        w.dequantize_range(exec, n0 * K, tile.view().flat_slice(0, nt * K));
        // Column-major view: y^T[nt, M] (ld N) = tile[nt, K] * x^T[K, M].
        ::memkit::detail::cublas_check(
            cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(nt), static_cast<int>(M), static_cast<int>(K),
                         &one, tile.data(), ::memkit::detail::cuda_type<T>(), static_cast<int>(K), x.data(), ::memkit::detail::cuda_type<T>(),
                         static_cast<int>(K), &zero, y.data() + n0, ::memkit::detail::cuda_type<T>(), static_cast<int>(N),
                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            "cublasGemmEx");
      }
      return 0;
    });
#endif
  }
}

// dx = dy * dequant(w). dy: [..., N], dx: [..., K] of the same T.
template <executor E, format F, float_storage T>
void matmul_input_grad(const E& exec, tensor_view<const std::type_identity_t<T>> dy, const quantized_tensor<F>& w,
                       tensor_view<T> dx,
                       memory_resource& workspace, const matmul_config& config = {}) {
  constexpr const char* operation = "quant::matmul_input_grad";
  // Named variables, not a structured binding: clang before 16 cannot capture bindings in the lambdas below.
  const detail::matmul_dims dims = detail::check_matmul(operation, w, dy, dx, matmul_kind::input_grad);
  const std::int64_t M = dims.M, N = dims.N, K = dims.K;
  require_accessible(exec, dy, operation, "dy");
  require_accessible(exec, w.codes(), operation, "w");
  require_accessible(exec, dx, operation, "dx");
  if (M == 0 || K == 0) return;
  if (N == 0) return detail::write_zeros(exec, dx);
  const std::int64_t rows = detail::tile_rows(N, K, config, E::on_device);
  if constexpr (!E::on_device) {
    (void)rows;
    buffer<float> accumulator;
    float* acc = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      acc = dx.data();
    } else {
      accumulator = buffer<float>(workspace, shape{M * K});
      acc = accumulator.data();
    }
    {
      // dx (+)= dy[:, n0 .. n0 + nt) * tile, tile by tile, the gemm's threads splitting dx's columns.
      const detail::host_tiled_plan plan = detail::plan_host_input_grad(M, N, K, config);
      buffer<float> scratch(workspace, shape{plan.part_floats()});
      float* tile = scratch.data();
      for (std::int64_t n0 = 0; n0 < N; n0 += plan.rows) {
        const std::int64_t nt = N - n0 < plan.rows ? N - n0 : plan.rows;
        w.dequantize_range(exec, n0 * K, tensor_view<float>(tile, shape{nt * K}, memory_kind::host));
        linalg::detail::gemm_host_on_scratch(
            linalg::transpose::no, linalg::transpose::no, 1.0f, linalg::matrix_ref<const T>(dy.data() + n0, M, nt, N, memory_kind::host),
            linalg::matrix_ref<const float>(tile, nt, K, K, memory_kind::host), n0 == 0 ? 0.0f : 1.0f,
            linalg::matrix_ref<float>(acc, M, K, K, memory_kind::host), {M, K, nt},
            plan.gemm, tile + plan.tile_floats);  // planned for a full tile: a shallower one fits its buffers
      }
    }
    if constexpr (!std::is_same_v<T, float>)
      for (std::int64_t i = 0; i < M * K; ++i) dx[i] = from_float<T>(acc[i]);
  } else {
#if MEMKIT_HAS_CUDA
    // The tiled path's workspace, and the fused kernel's partial sums when it splits N, are allocated and
    // released on exec.stream.
    if (matmul_workspace_bytes(matmul_kind::input_grad, F, w.block_size(), M, N, K, sizeof(T), true, config) > 0)
      ::memkit::detail::require_stream_ordered(workspace, operation);
    ::memkit::detail::with_device(exec.device, [&] {
      constexpr int threads = 256;
      if (detail::device_fused(M, config)) {
        if (detail::gemv_t_vector<F>(K) && ::memkit::detail::vector_aligned(w.codes().data())) {
          const std::int64_t splits = detail::gemv_t_splits(N, K);
          const std::int64_t rows_per_split = (N + splits - 1) / splits;
          buffer<float> partial;
          if (splits > 1) partial = buffer<float>(workspace, shape{splits * M * K}, on_stream{exec.stream});
          const dim3 grid(static_cast<unsigned>((K + detail::gemv_t_columns - 1) / detail::gemv_t_columns),
                          static_cast<unsigned>(splits));
          detail::fused_gemv_t_tiled_kernel<F, T, detail::device_fused_rows><<<grid, threads, 0, exec.stream>>>(
              dy.data(), w.codes().data(), w.scales(), w.block_size(), M, N, K, dx.data(), partial.data(),
              rows_per_split, signed_dynamic_table, w.nested_map());
          MEMKIT_CUDA_CHECK(cudaGetLastError());
          if (splits > 1) {
            detail::gemv_t_reduce_kernel<T><<<detail::grid_for(M * K, threads), threads, 0, exec.stream>>>(
                partial.data(), splits, M * K, dx.data());
            MEMKIT_CUDA_CHECK(cudaGetLastError());
          }
          return 0;
        }
        detail::fused_gemv_t_kernel<F, T, detail::device_fused_rows><<<detail::grid_for(K, threads), threads, 0, exec.stream>>>(
            dy.data(), w.codes().data(), w.scales(), w.block_size(), M, N, K, dx.data(), signed_dynamic_table,
            w.nested_map());
        MEMKIT_CUDA_CHECK(cudaGetLastError());
        return 0;
      }
      buffer<T> tile(workspace, shape{rows * K}, on_stream{exec.stream});
      buffer<float> accumulator;
      void* c = dx.data();
      cudaDataType_t c_type = ::memkit::detail::cuda_type<T>();
      const bool accumulate_fp32 = !std::is_same_v<T, float> && rows < N;  // one tile: cuBLAS writes dx itself
      if (accumulate_fp32) {
        accumulator = buffer<float>(workspace, shape{M * K}, on_stream{exec.stream});
        c = accumulator.data();
        c_type = CUDA_R_32F;
      }
      cublasHandle_t handle = ::memkit::detail::cublas_handle_for(exec);  // on exec.stream, its own workspace
      const float one = 1.0f, zero = 0.0f;
      for (std::int64_t n0 = 0; n0 < N; n0 += rows) {
        const std::int64_t nt = N - n0 < rows ? N - n0 : rows;
        w.dequantize_range(exec, n0 * K, tile.view().flat_slice(0, nt * K));
        // Column-major: dx^T[K, M] (+)= tile^T[K, nt] * dy^T[nt, M] (dy columns n0.., ld N).
        ::memkit::detail::cublas_check(
            cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(K), static_cast<int>(M), static_cast<int>(nt),
                         &one, tile.data(), ::memkit::detail::cuda_type<T>(), static_cast<int>(K), dy.data() + n0,
                         ::memkit::detail::cuda_type<T>(), static_cast<int>(N), n0 == 0 ? &zero : &one, c, c_type,
                         static_cast<int>(K), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            "cublasGemmEx");
      }
      if (accumulate_fp32) {
        detail::convert_kernel<T><<<detail::grid_for(M * K, threads), threads, 0, exec.stream>>>(
            accumulator.data(), dx.data(), M * K);
        MEMKIT_CUDA_CHECK(cudaGetLastError());
      }
      return 0;
    });
#endif
  }
}

}  // namespace quant

MEMKIT_NAMESPACE_END
