// memkit/quant/matmul.hpp — matrix products with a quantized weight, never dequantizing all of it.
//
//   y  = x  * dequant(W)^T     x [M, K], W [N, K] -> y  [M, N]    (the Linear forward)
//   dx = dy * dequant(W)       dy [M, N]           -> dx [M, K]   (the input gradient; W gets none)
//
// Host: W is dequantized a tile of rows at a time into fp32 workspace (tile_floats values, 256 KiB by
// default, so it stays in cache) and multiplied there; fp32 accumulation throughout.
// CUDA: for M <= small_batch_limit a fused kernel decodes W on the fly (one warp per output column for
// y, one thread per input column for dx), reading the 4-bit codes once; larger batches dequantize
// row tiles into workspace and call cuBLAS (tensor cores for bf16/fp16), accumulating dx in fp32.
// Users of the CUDA large-batch path link CUDA::cublas.
//
// matmul_workspace_bytes() says exactly what a call takes from the workspace resource.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/quant/blockwise.hpp"
#include "memkit/quant/quantized_tensor.hpp"

#if MEMKIT_HAS_CUDA
#include <cublas_v2.h>
#endif

MEMKIT_NAMESPACE_BEGIN

namespace quant {

struct matmul_config {
  std::int64_t tile_floats = 1 << 16;   // dequantized values per tile (host and CUDA large batch)
  std::int64_t small_batch_limit = 8;   // CUDA: M up to this uses the fused kernels
};

enum class matmul_kind : std::uint8_t { forward, input_grad };

namespace detail {
constexpr std::int64_t tile_rows(std::int64_t K, const matmul_config& config) noexcept {
  const std::int64_t rows = K > 0 ? config.tile_floats / K : 1;
  return rows > 0 ? rows : 1;
}
}  // namespace detail

// Workspace bytes of one call: M, N, K as in the header; `on_device` selects the CUDA plan;
// `element_bytes` is sizeof the activation type.
constexpr std::size_t matmul_workspace_bytes(matmul_kind kind, std::int64_t M, std::int64_t N, std::int64_t K,
                                             std::size_t element_bytes, bool on_device,
                                             const matmul_config& config = {}) noexcept {
  const std::int64_t rows = detail::tile_rows(K, config) < N ? detail::tile_rows(K, config) : N;
  const bool fp32 = element_bytes == 4;
  if (!on_device) {
    const std::size_t tile = static_cast<std::size_t>(rows * K) * 4;
    return tile + (kind == matmul_kind::input_grad && !fp32 ? static_cast<std::size_t>(M * K) * 4 : 0);
  }
  if (M <= config.small_batch_limit) return 0;
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

template <class T>
constexpr cudaDataType_t cuda_type() noexcept {
  if constexpr (std::is_same_v<T, float>) return CUDA_R_32F;
  else if constexpr (std::is_same_v<T, bf16>) return CUDA_R_16BF;
  else return CUDA_R_16F;
}

inline void cublas_check(cublasStatus_t status, const char* call) {
  require(status == CUBLAS_STATUS_SUCCESS, std::string("cuBLAS call ") + call + " failed with status " +
                                               std::to_string(static_cast<int>(status)));
}

// One cuBLAS handle per thread and device, created on first use and kept for the thread's lifetime.
inline cublasHandle_t cublas_handle_for(int device) {
  struct handles {
    cublasHandle_t by_device[64] = {};
    ~handles() {
      for (cublasHandle_t h : by_device)
        if (h) cublasDestroy(h);
    }
  };
  thread_local handles cache;
  require(device >= 0 && device < 64, "quant::matmul: device index out of range");
  if (!cache.by_device[device]) cublas_check(cublasCreate(&cache.by_device[device]), "cublasCreate");
  return cache.by_device[device];
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
  const std::int64_t rows = detail::tile_rows(K, config) < N ? detail::tile_rows(K, config) : N;
  if constexpr (!E::on_device) {
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
      if (M <= config.small_batch_limit && M <= 8) {
        constexpr int threads = 256;
        detail::fused_gemv_kernel<F, T, 8><<<detail::grid_for(N * 32, threads), threads, 0, exec.stream>>>(
            x.data(), w.codes().data(), w.scales(), w.block_size(), M, N, K, y.data(), signed_dynamic_table,
            w.nested_map());
        MEMKIT_CUDA_CHECK(cudaGetLastError());
        return 0;
      }
      buffer<T> tile(workspace, shape{rows * K});
      cublasHandle_t handle = detail::cublas_handle_for(exec.device);
      detail::cublas_check(cublasSetStream(handle, exec.stream), "cublasSetStream");
      const float one = 1.0f, zero = 0.0f;
      for (std::int64_t n0 = 0; n0 < N; n0 += rows) {
        const std::int64_t nt = N - n0 < rows ? N - n0 : rows;
        w.dequantize_range(exec, n0 * K, tile.view().flat_slice(0, nt * K));
        // Column-major view: y^T[nt, M] (ld N) = tile[nt, K] * x^T[K, M].
        detail::cublas_check(
            cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(nt), static_cast<int>(M), static_cast<int>(K),
                         &one, tile.data(), detail::cuda_type<T>(), static_cast<int>(K), x.data(), detail::cuda_type<T>(),
                         static_cast<int>(K), &zero, y.data() + n0, detail::cuda_type<T>(), static_cast<int>(N),
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
  const std::int64_t rows = detail::tile_rows(K, config) < N ? detail::tile_rows(K, config) : N;
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
      if (M <= config.small_batch_limit && M <= 8) {
        detail::fused_gemv_t_kernel<F, T, 8><<<detail::grid_for(K, threads), threads, 0, exec.stream>>>(
            dy.data(), w.codes().data(), w.scales(), w.block_size(), M, N, K, dx.data(), signed_dynamic_table,
            w.nested_map());
        MEMKIT_CUDA_CHECK(cudaGetLastError());
        return 0;
      }
      buffer<T> tile(workspace, shape{rows * K});
      buffer<float> accumulator;
      void* c = dx.data();
      cudaDataType_t c_type = detail::cuda_type<T>();
      if constexpr (!std::is_same_v<T, float>) {
        accumulator = buffer<float>(workspace, shape{M * K});
        c = accumulator.data();
        c_type = CUDA_R_32F;
      }
      cublasHandle_t handle = detail::cublas_handle_for(exec.device);
      detail::cublas_check(cublasSetStream(handle, exec.stream), "cublasSetStream");
      const float one = 1.0f, zero = 0.0f;
      for (std::int64_t n0 = 0; n0 < N; n0 += rows) {
        const std::int64_t nt = N - n0 < rows ? N - n0 : rows;
        w.dequantize_range(exec, n0 * K, tile.view().flat_slice(0, nt * K));
        // Column-major: dx^T[K, M] (+)= tile^T[K, nt] * dy^T[nt, M] (dy columns n0.., ld N).
        detail::cublas_check(
            cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(K), static_cast<int>(M), static_cast<int>(nt),
                         &one, tile.data(), detail::cuda_type<T>(), static_cast<int>(K), dy.data() + n0,
                         detail::cuda_type<T>(), static_cast<int>(N), n0 == 0 ? &zero : &one, c, c_type,
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
