// memkit/quant/matmul.hpp — matrix products with a quantized weight, never dequantizing all of it.
//
//   y  = x  * dequant(W)^T     x [M, K], W [N, K] -> y  [M, N]    (the Linear forward)
//   dx = dy * dequant(W)       dy [M, N]           -> dx [M, K]   (the input gradient; W gets none)
//
// Host: W is dequantized a tile of rows at a time into fp32 workspace (tile_floats values, 256 KiB by
// default, so it stays in cache) and multiplied there; fp32 accumulation throughout.
// CUDA: for M <= small_batch_limit (at most 8) a fused kernel decodes W on the fly (one warp per output
// column for y, one thread per input column for dx), reading the 4-bit codes once; larger batches
// dequantize row tiles (device_tile_floats values, 32 MiB of bf16 by default) into workspace and call cuBLAS (tensor cores for bf16/fp16), accumulating dx in fp32.
// Users of the CUDA large-batch path link CUDA::cublas.
//
// matmul_workspace_bytes() says exactly what a call takes from the workspace resource.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/cublas.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/host_simd.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/quant/blockwise.hpp"
#include "memkit/quant/quantized_tensor.hpp"


MEMKIT_NAMESPACE_BEGIN

namespace quant {

struct matmul_config {
  std::int64_t tile_floats = 1 << 16;   // host: dequantized values per tile (256 KiB of fp32: stays in cache)
  std::int64_t device_tile_floats = 1 << 24;  // CUDA large batch: values per tile (32 MiB of bf16), so each
                                              // cuBLAS call gets hundreds of rows, not a handful
  std::int64_t small_batch_limit = 8;   // CUDA: M up to this (and up to 8) uses the fused kernels
  int host_simd = 2;                    // host fused path: 2 best available, 1 at most AVX2, 0 portable C++
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
// The host forward with a small batch decodes W inside the dot products (workspace: x widened to fp32
// once when it is 16-bit): 4-bit formats, M up to host_fused_rows, rows made of whole blocks.
inline constexpr std::int64_t host_fused_rows = 8;
constexpr bool host_fused(matmul_kind kind, format fmt, std::int64_t block_size, std::int64_t M,
                          std::int64_t K) noexcept {
  return kind == matmul_kind::forward && is_four_bit(fmt) && M <= host_fused_rows && block_size > 0 &&
         K % block_size == 0;
}
}  // namespace detail

namespace detail {
// The CUDA fused kernels keep one accumulator per row of the batch: they serve M up to this many rows,
// and only when config.small_batch_limit allows; larger batches take the tiled cuBLAS path.
inline constexpr int device_fused_rows = 8;
constexpr bool device_fused(std::int64_t M, const matmul_config& config) noexcept {
  return M <= config.small_batch_limit && M <= device_fused_rows;
}
}  // namespace detail

// Workspace bytes of one call: M, N, K as in the header; `fmt` and `block_size` those of W; `on_device`
// selects the CUDA plan; `element_bytes` is sizeof the activation type.
constexpr std::size_t matmul_workspace_bytes(matmul_kind kind, format fmt, std::int64_t block_size, std::int64_t M,
                                             std::int64_t N, std::int64_t K, std::size_t element_bytes,
                                             bool on_device, const matmul_config& config = {}) noexcept {
  const std::int64_t rows = detail::tile_rows(N, K, config, on_device);
  const bool fp32 = element_bytes == 4;
  if (!on_device) {
    if (detail::host_fused(kind, fmt, block_size, M, K)) return fp32 ? 0 : static_cast<std::size_t>(M * K) * 4;
    const std::size_t tile = static_cast<std::size_t>(rows * K) * 4;
    return tile + (kind == matmul_kind::input_grad && !fp32 ? static_cast<std::size_t>(M * K) * 4 : 0);
  }
  if (detail::device_fused(M, config)) return 0;
  const std::size_t tile = static_cast<std::size_t>(rows * K) * element_bytes;
  return tile + (kind == matmul_kind::input_grad && !fp32 ? static_cast<std::size_t>(M * K) * 4 : 0);
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

// Host small-batch forward: each row of W is decoded block by block straight into the dot products.
// Portable version; the AVX2 one below does the same with 8-wide table lookups.
template <format F, class T>
void fused_gemv_host(const float* x, std::int64_t M, const std::uint8_t* codes, const block_scales& scales,
                     std::int64_t block_size, std::int64_t N, std::int64_t K, T* y) {
  for (std::int64_t n = 0; n < N; ++n) {
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

#if MEMKIT_QUANT_X86_SIMD
inline bool cpu_has_avx2_fma_f16c() noexcept {
  static const bool has =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && ::memkit::detail::cpu_has_f16c();
  return has;
}

template <format F, class T>
__attribute__((target("avx2,fma,f16c"))) void fused_gemv_avx2(const float* x, std::int64_t M, const std::uint8_t* codes,
                                                              const block_scales& scales, std::int64_t block_size,
                                                              std::int64_t N, std::int64_t K, T* y) {
  alignas(32) float table[16];
  for (int c = 0; c < 16; ++c) table[c] = code_value<F>(static_cast<std::uint8_t>(c), nullptr);
  const __m256 low_table = _mm256_load_ps(table), high_table = _mm256_load_ps(table + 8);
  const __m128i low_nibble = _mm_set1_epi8(0x0f);
  for (std::int64_t n = 0; n < N; ++n) {
    __m256 acc[host_fused_rows];
    for (__m256& a : acc) a = _mm256_setzero_ps();
    const std::uint8_t* row = codes + n * K / 2;
    for (std::int64_t kb = 0; kb < K; kb += block_size) {
      // Scaled tables: the same single products decode() forms.
      const __m256 scale = _mm256_set1_ps(scales((n * K + kb) / block_size));
      const __m256 low = _mm256_mul_ps(low_table, scale), high = _mm256_mul_ps(high_table, scale);
      for (std::int64_t k = kb; k < kb + block_size; k += 8) {
        std::uint32_t packed;
        std::memcpy(&packed, row + k / 2, 4);
        const __m128i bytes = _mm_cvtsi32_si128(static_cast<int>(packed));
        const __m128i nibbles = _mm_unpacklo_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibble),
                                                  _mm_and_si128(bytes, low_nibble));
        const __m256i index = _mm256_cvtepu8_epi32(nibbles);
        const __m256 w = _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, index), _mm256_permutevar8x32_ps(high, index),
                                          _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));
        for (std::int64_t m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), w, acc[m]);
      }
    }
    for (std::int64_t m = 0; m < M; ++m) {
      const __m128 folded = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
      const __m128 pairs = _mm_add_ps(folded, _mm_movehl_ps(folded, folded));
      const __m128 total = _mm_add_ss(pairs, _mm_movehdup_ps(pairs));
      y[m * N + n] = from_float<T>(_mm_cvtss_f32(total));
    }
  }
}

// AVX-512: one permute looks up 16 values in the whole 16-entry table.
template <format F, class T>
__attribute__((target("avx512f,avx512bw"))) void fused_gemv_avx512(const float* x, std::int64_t M, const std::uint8_t* codes,
                                                                  const block_scales& scales, std::int64_t block_size,
                                                                  std::int64_t N, std::int64_t K, T* y) {
  alignas(64) float table[16];
  for (int c = 0; c < 16; ++c) table[c] = code_value<F>(static_cast<std::uint8_t>(c), nullptr);
  const __m512 base_table = _mm512_load_ps(table);
  const __m128i low_nibble = _mm_set1_epi8(0x0f);
  for (std::int64_t n = 0; n < N; ++n) {
    __m512 acc[host_fused_rows];
    for (__m512& a : acc) a = _mm512_setzero_ps();
    const std::uint8_t* row = codes + n * K / 2;
    for (std::int64_t kb = 0; kb < K; kb += block_size) {
      const __m512 scaled = _mm512_mul_ps(base_table, _mm512_set1_ps(scales((n * K + kb) / block_size)));
      for (std::int64_t k = kb; k < kb + block_size; k += 32) {  // blocks hold a multiple of 32 values
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2));
        const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibble);
        const __m128i low = _mm_and_si128(bytes, low_nibble);
        // The zero-masked forms: GCC 12 warns about the unmasked ones' undefined pass-through operand.
        const __m512 w0 = _mm512_maskz_permutexvar_ps(
            0xffff, _mm512_maskz_cvtepu8_epi32(0xffff, _mm_unpacklo_epi8(high, low)), scaled);
        const __m512 w1 = _mm512_maskz_permutexvar_ps(
            0xffff, _mm512_maskz_cvtepu8_epi32(0xffff, _mm_unpackhi_epi8(high, low)), scaled);
        for (std::int64_t m = 0; m < M; ++m) {
          acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), w0, acc[m]);
          acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k + 16), w1, acc[m]);
        }
      }
    }
    for (std::int64_t m = 0; m < M; ++m) {
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, acc[m]);
      float total = 0.0f;
      for (float lane : lanes) total += lane;
      y[m * N + n] = from_float<T>(total);
    }
  }
}
#endif

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
  const std::int64_t M = in_cols > 0 ? in.size() / in_cols : 0;
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

// y[m, n] for m < M <= 8: one warp per column n; lanes walk K, decoding W[n, k] once for all rows.
template <format F, class T, int MaxRows>
__global__ void fused_gemv_kernel(const T* __restrict__ x, const std::uint8_t* __restrict__ codes, block_scales scales,
                                  std::int64_t block_size, std::int64_t M, std::int64_t N, std::int64_t K,
                                  T* __restrict__ y, code_table<256> map_table, code_table<256> nested_table) {
  __shared__ float map[256];
  __shared__ float nested_map[256];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) map[i] = map_table.value[i];
  stage_nested_map(scales, nested_map, nested_table);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const std::int64_t warps = blockDim.x >> 5;
  for (std::int64_t n = blockIdx.x * warps + (threadIdx.x >> 5); n < N; n += gridDim.x * warps) {
    float acc[MaxRows] = {};
    const std::int64_t row = n * K;
    for (std::int64_t k = lane; k < K; k += 32) {
      const std::int64_t element = row + k;
      const float w = decode<F>(code_at<F>(codes, element), scales(element / block_size), map);
#pragma unroll
      for (int m = 0; m < MaxRows; ++m)
        if (m < M) acc[m] += to_float(x[m * K + k]) * w;
    }
#pragma unroll
    for (int m = 0; m < MaxRows; ++m) {
      if (m >= M) break;
      const float total = warp_sum(acc[m]);
      if (lane == 0) y[m * N + n] = from_float<T>(total);
    }
  }
}

// dx[m, k] for m < M <= 8: one thread per column k, walking the rows of W (coalesced across threads).
template <format F, class T, int MaxRows>
__global__ void fused_gemv_t_kernel(const T* __restrict__ dy, const std::uint8_t* __restrict__ codes,
                                    block_scales scales, std::int64_t block_size, std::int64_t M, std::int64_t N,
                                    std::int64_t K, T* __restrict__ dx, code_table<256> map_table,
                                    code_table<256> nested_table) {
  __shared__ float map[256];
  __shared__ float nested_map[256];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) map[i] = map_table.value[i];
  stage_nested_map(scales, nested_map, nested_table);
  __syncthreads();
  for (std::int64_t k = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; k < K;
       k += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float acc[MaxRows] = {};
    for (std::int64_t n = 0; n < N; ++n) {
      const std::int64_t element = n * K + k;
      const float w = decode<F>(code_at<F>(codes, element), scales(element / block_size), map);
#pragma unroll
      for (int m = 0; m < MaxRows; ++m)
        if (m < M) acc[m] += to_float(dy[m * N + n]) * w;
    }
#pragma unroll
    for (int m = 0; m < MaxRows; ++m)
      if (m < M) dx[m * K + k] = from_float<T>(acc[m]);
  }
}

template <class T>
__global__ void convert_kernel(const float* __restrict__ in, T* __restrict__ out, std::int64_t count) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i] = from_float<T>(in[i]);
}

#endif

}  // namespace detail

// y = x * dequant(w)^T. x: [..., K] (T = float, bf16 or fp16), y: [..., N] of the same T.
template <executor E, format F, float_storage T>
void matmul(const E& exec, tensor_view<const std::type_identity_t<T>> x, const quantized_tensor<F>& w, tensor_view<T> y,
            memory_resource& workspace, const matmul_config& config = {}) {
  constexpr const char* operation = "quant::matmul";
  const auto [M, N, K] = detail::check_matmul(operation, w, x, y, matmul_kind::forward);
  require_accessible(exec, x, operation, "x");
  require_accessible(exec, w.codes(), operation, "w");
  require_accessible(exec, y, operation, "y");
  if (M == 0 || N == 0) return;
  const std::int64_t rows = detail::tile_rows(N, K, config, E::on_device);
  if constexpr (!E::on_device) {
    if constexpr (is_four_bit(F)) {
      if (detail::host_fused(matmul_kind::forward, F, w.block_size(), M, K)) {
        block_scales scales = w.scales();
        scales.nested_map = w.nested_map().value;
        // x widened to fp32 once, not once per row of W.
        const float* wide = nullptr;
        buffer<float> widened;
        if constexpr (std::is_same_v<T, float>) {
          wide = x.data();
        } else {
          widened = buffer<float>(workspace, shape{M * K});
          for (std::int64_t i = 0; i < M * K; ++i) widened.data()[i] = to_float(x[i]);
          wide = widened.data();
        }
#if MEMKIT_QUANT_X86_SIMD
        if (config.host_simd >= 2 && detail::cpu_has_avx512bw()) {
          detail::fused_gemv_avx512<F>(wide, M, w.codes().data(), scales, w.block_size(), N, K, y.data());
          return;
        }
        if (config.host_simd >= 1 && detail::cpu_has_avx2_fma_f16c()) {
          detail::fused_gemv_avx2<F>(wide, M, w.codes().data(), scales, w.block_size(), N, K, y.data());
          return;
        }
#endif
        detail::fused_gemv_host<F>(wide, M, w.codes().data(), scales, w.block_size(), N, K, y.data());
        return;
      }
    }
    buffer<float> tile(workspace, shape{rows * K});
    for (std::int64_t n0 = 0; n0 < N; n0 += rows) {
      const std::int64_t nt = N - n0 < rows ? N - n0 : rows;
      w.dequantize_range(exec, n0 * K, tile.view().flat_slice(0, nt * K));
      for (std::int64_t m = 0; m < M; ++m)
        for (std::int64_t n = 0; n < nt; ++n)
          y[m * N + n0 + n] = from_float<T>(detail::dot(x.data() + m * K, tile.data() + n * K, K));
    }
  } else {
#if MEMKIT_HAS_CUDA
    ::memkit::detail::with_device(exec.device, [&] {
      if (detail::device_fused(M, config)) {
        constexpr int threads = 256;
        detail::fused_gemv_kernel<F, T, detail::device_fused_rows><<<detail::grid_for(N * 32, threads), threads, 0, exec.stream>>>(
            x.data(), w.codes().data(), w.scales(), w.block_size(), M, N, K, y.data(), signed_dynamic_table,
            w.nested_map());
        MEMKIT_CUDA_CHECK(cudaGetLastError());
        return 0;
      }
      buffer<T> tile(workspace, shape{rows * K});
      cublasHandle_t handle = ::memkit::detail::cublas_handle_for(exec.device);
      ::memkit::detail::cublas_check(cublasSetStream(handle, exec.stream), "cublasSetStream");
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
  const auto [M, N, K] = detail::check_matmul(operation, w, dy, dx, matmul_kind::input_grad);
  require_accessible(exec, dy, operation, "dy");
  require_accessible(exec, w.codes(), operation, "w");
  require_accessible(exec, dx, operation, "dx");
  if (M == 0 || K == 0) return;
  const std::int64_t rows = detail::tile_rows(N, K, config, E::on_device);
  if constexpr (!E::on_device) {
    buffer<float> tile(workspace, shape{rows * K});
    buffer<float> accumulator;
    float* acc = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      acc = dx.data();
    } else {
      accumulator = buffer<float>(workspace, shape{M * K});
      acc = accumulator.data();
    }
    for (std::int64_t i = 0; i < M * K; ++i) acc[i] = 0.0f;
    for (std::int64_t n0 = 0; n0 < N; n0 += rows) {
      const std::int64_t nt = N - n0 < rows ? N - n0 : rows;
      w.dequantize_range(exec, n0 * K, tile.view().flat_slice(0, nt * K));
      for (std::int64_t m = 0; m < M; ++m)
        for (std::int64_t n = 0; n < nt; ++n)
          detail::axpy(to_float(dy[m * N + n0 + n]), tile.data() + n * K, acc + m * K, K);
    }
    if constexpr (!std::is_same_v<T, float>)
      for (std::int64_t i = 0; i < M * K; ++i) dx[i] = from_float<T>(acc[i]);
  } else {
#if MEMKIT_HAS_CUDA
    ::memkit::detail::with_device(exec.device, [&] {
      constexpr int threads = 256;
      if (detail::device_fused(M, config)) {
        detail::fused_gemv_t_kernel<F, T, detail::device_fused_rows><<<detail::grid_for(K, threads), threads, 0, exec.stream>>>(
            dy.data(), w.codes().data(), w.scales(), w.block_size(), M, N, K, dx.data(), signed_dynamic_table,
            w.nested_map());
        MEMKIT_CUDA_CHECK(cudaGetLastError());
        return 0;
      }
      buffer<T> tile(workspace, shape{rows * K});
      buffer<float> accumulator;
      void* c = dx.data();
      cudaDataType_t c_type = ::memkit::detail::cuda_type<T>();
      if constexpr (!std::is_same_v<T, float>) {
        accumulator = buffer<float>(workspace, shape{M * K});
        c = accumulator.data();
        c_type = CUDA_R_32F;
      }
      cublasHandle_t handle = ::memkit::detail::cublas_handle_for(exec.device);
      ::memkit::detail::cublas_check(cublasSetStream(handle, exec.stream), "cublasSetStream");
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
      if constexpr (!std::is_same_v<T, float>) {
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
