// memkit/loss/detail/device_fused.hpp — the CUDA path of fused_linear_cross_entropy (under nvcc only): cuBLAS
// for the products, and kernels for counting the targets, the row softmax / gradient (row_math, the same
// per-element formulas as the host's) and the final mean, all on the executor's stream.
// Not a public header: fused_linear_cross_entropy.hpp includes it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/loss/bytes.hpp"
#include "memkit/loss/detail/common.hpp"

#if MEMKIT_HAS_CUDA
#include "memkit/core/cublas.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/quant/detail/matmul_kernels.hpp"
#endif

MEMKIT_NAMESPACE_BEGIN
namespace loss::detail {

#if MEMKIT_HAS_CUDA
inline constexpr int loss_block_threads = 256;
// The row pass: one CTA per token row, as wide as a CTA goes. A chunk has a few hundred rows, so 256-thread
// CTAs left an H200 at 17% occupancy and 4% of its memory bandwidth (120 us for 174 rows of 32,000 logits).
inline constexpr int logit_row_threads = 1024;

struct sum_op {
  template <class V>
  MEMKIT_DEVICE V operator()(V a, V b) const { return a + b; }
};
struct max_op {
  MEMKIT_DEVICE float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Reduces one value per thread over the block (blockDim.x a multiple of 32, at most 1024); every thread gets
// the result. The order is fixed by blockDim, so the result is the same on every run.
template <class V, class Op>
MEMKIT_DEVICE V block_reduce(V value, Op op, V identity, V* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : identity;
  for (int offset = 16; offset > 0; offset >>= 1) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// counters[0] = tokens whose target is not ignore_index and in range; counters[1] = 1 if one is out of range.
// (Kernels here are templates so that a header included by several .cu files defines each once.)
template <int Unused = 0>
__global__ void count_targets_kernel(const std::int32_t* __restrict__ targets, std::int64_t N, std::int64_t V,
                                     std::int64_t ignore_index, int* __restrict__ counters) {
  __shared__ int scratch[32];
  int counted = 0, bad = 0;
  for (std::int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    const std::int64_t t = targets[i];
    if (t == ignore_index) continue;
    if (t < 0 || t >= V) bad = 1;
    else ++counted;
  }
  counted = block_reduce(counted, sum_op{}, 0, scratch);
  bad = block_reduce(bad, sum_op{}, 0, scratch);
  if (threadIdx.x == 0) {
    counters[0] = counted;
    counters[1] = bad;
  }
}

// One block per token row: raw fp32 logits in, their gradient (times 1 / counted, or with reduction none the row's
// own d_loss when row_scale is given) out as D, which may be the same memory when D is float.
template <class D>
__global__ void __launch_bounds__(logit_row_threads) logit_rows_kernel(float* logits, D* gradient, std::int64_t rows, std::int64_t V,
                                  const std::int32_t* __restrict__ targets, std::int64_t ignore_index, row_math math,
                                  const int* __restrict__ counters, float* __restrict__ row_loss,
                                  const float* __restrict__ row_scale, bool per_token) {
  __shared__ float scratch[32];
  const int counted = counters[0];
  const float mean_scale = counted > 0 ? 1.0f / static_cast<float>(counted) : 0.0f;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float* z = logits + r * V;
    D* g = gradient + r * V;
    const std::int64_t t = targets[r];
    if (t == ignore_index || t < 0 || t >= V) {  // out of range: counted as bad, the (row's) loss becomes NaN
      for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) g[j] = from_float<D>(0.0f);
      if (threadIdx.x == 0) row_loss[r] = per_token && t != ignore_index ? NAN : 0.0f;
      continue;
    }
    const float scale = row_scale != nullptr ? row_scale[r] : mean_scale;
    float largest = -INFINITY, z_sum = 0.0f;
    for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const float value = math.capped(z[j]);
      z[j] = value;
      largest = fmaxf(largest, value);
      z_sum += value;
    }
    largest = block_reduce(largest, max_op{}, -INFINITY, scratch);
    z_sum = block_reduce(z_sum, sum_op{}, 0.0f, scratch);
    float sum = 0.0f;
    for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) sum += expf(z[j] - largest);
    sum = block_reduce(sum, sum_op{}, 0.0f, scratch);  // its barriers also make every z[j] visible
    const float lse = largest + logf(sum);
    if (threadIdx.x == 0) row_loss[r] = math.token_loss(lse, z[t], z_sum);
    __syncthreads();  // z[t] is read before it is overwritten
    for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) g[j] = from_float<D>(math.gradient(z[j], lse, j == t, scale));
  }
}

// loss = sum of row losses / counted (0 when nothing is counted, NaN when a target was out of range).
template <int Unused = 0>
__global__ void mean_loss_kernel(const float* __restrict__ row_loss, std::int64_t N, const int* __restrict__ counters,
                                 float* __restrict__ loss) {
  __shared__ double scratch[32];
  double total = 0;
  for (std::int64_t i = threadIdx.x; i < N; i += blockDim.x) total += row_loss[i];
  total = block_reduce(total, sum_op{}, 0.0, scratch);
  if (threadIdx.x == 0)
    loss[0] = counters[1] != 0 ? NAN : counters[0] > 0 ? static_cast<float>(total / counters[0]) : 0.0f;
}

// C (col-major m x n, ld ldc) = alpha * op(A) * op(B) + beta * C on the executor's stream, fp32 accumulation.
inline void device_gemm(cublasHandle_t handle, cublasOperation_t op_a, cublasOperation_t op_b, std::int64_t m,
                        std::int64_t n, std::int64_t k, const void* a, cudaDataType_t a_type, std::int64_t lda,
                        const void* b, cudaDataType_t b_type, std::int64_t ldb, float beta, void* c,
                        cudaDataType_t c_type, std::int64_t ldc) {
  const float one = 1.0f;
  ::memkit::detail::cublas_check(
      cublasGemmEx(handle, op_a, op_b, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &one, a, a_type,
                   static_cast<int>(lda), b, b_type, static_cast<int>(ldb), &beta, c, c_type, static_cast<int>(ldc),
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

// The device path. `head_rows(first, count)` returns a device pointer to rows of the head in T (a dense
// head's own rows, or a dequantized tile); `tile` is how many rows it serves at once (V for a dense head).
template <class T, class HeadRows>
void device_fused(const cuda_executor& exec, const tensor_view<const T>& hidden, HeadRows&& head_rows,
                  std::int64_t tile, const tensor_view<const std::int32_t>& targets,
                  const tensor_view<const float>& d_loss, const tensor_view<float>& loss,
                  const tensor_view<T>& d_hidden, const tensor_view<float>& d_head, const cross_entropy_options& options,
                  const loss_dims& dims, memory_resource& workspace) {
  const std::int64_t N = dims.N, H = dims.H, V = dims.V;  // not a binding: clang < 16 cannot capture one in a lambda
  constexpr bool fp32 = std::is_same_v<T, float>;
  const cudaDataType_t t_type = ::memkit::detail::cuda_type<T>();
  const std::int64_t c = chunk_tokens(N, V, sizeof(T), options, true);
  // Every cuBLAS operand below spans at most INT32_MAX elements: the chunk's logits by the chunk rule
  // (max_chunk_tokens), the head and a chunk's hidden checked here (either past it needs an H past V).
  ::memkit::detail::require_cublas_span(V, H, "fused_linear_cross_entropy", "the head");
  ::memkit::detail::require_cublas_span(c, H, "fused_linear_cross_entropy", "a chunk's hidden");
  const cudaStream_t stream = exec.stream;
  // Workspace stream-ordered on exec.stream (docs/cuda.md, "Workspace").
  const on_stream ordered{exec.stream};
  // Reduction none: the rows' losses go straight into `loss`, each gradient scaled by the row's d_loss.
  const bool per_token = options.reduction == reduction_mode::none;
  const float* row_scale = per_token && !d_loss.is_none() ? d_loss.data() : nullptr;
  buffer<float> logits(workspace, shape{c * V}, ordered);
  buffer<float> row_loss_buffer;
  if (!per_token) row_loss_buffer = buffer<float>(workspace, shape{N}, ordered);
  float* row_loss = per_token ? loss.data() : row_loss_buffer.data();
  buffer<int> counters(workspace, shape{2}, ordered);
  buffer<T> gradient16;
  if constexpr (!fp32) gradient16 = buffer<T>(workspace, shape{c * V}, ordered);
  T* gradient = fp32 ? reinterpret_cast<T*>(logits.data()) : gradient16.data();
  buffer<float> accumulator;
  if (!fp32 && !d_hidden.is_none() && tile < V) accumulator = buffer<float>(workspace, shape{c * H}, ordered);

  count_targets_kernel<><<<1, loss_block_threads, 0, stream>>>(targets.data(), N, V, options.ignore_index,
                                                             counters.data());
  MEMKIT_CUDA_CHECK(cudaGetLastError());
  cublasHandle_t handle = ::memkit::detail::cublas_handle_for(exec);  // on exec.stream, its own workspace
  const row_math math = make_row_math(options, V);
  for (std::int64_t first = 0; first < N; first += c) {
    const std::int64_t rows = std::min(c, N - first);
    const T* x = hidden.data() + first * H;
    // Column-major views: logits^T [V, rows] (ld V) = head rows^T * x^T, tile by tile.
    for (std::int64_t n0 = 0; n0 < V; n0 += tile) {
      const std::int64_t nt = std::min(tile, V - n0);
      device_gemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, nt, rows, H, head_rows(n0, nt), t_type, H, x, t_type, H, 0.0f,
                  logits.data() + n0, CUDA_R_32F, V);
    }
    logit_rows_kernel<T><<<::memkit::detail::grid_for(rows, 1), logit_row_threads, 0, stream>>>(
        logits.data(), gradient, rows, V, targets.data() + first, options.ignore_index, math, counters.data(),
        row_loss + first, row_scale != nullptr ? row_scale + first : nullptr, per_token);
    MEMKIT_CUDA_CHECK(cudaGetLastError());
    // d_head^T [H, V] += x^T [H, rows] * gradient [rows, V]   (before d_hidden, which may alias hidden)
    if (!d_head.is_none())
      device_gemm(handle, CUBLAS_OP_N, CUBLAS_OP_T, H, V, rows, x, t_type, H, gradient, t_type, V, 1.0f, d_head.data(),
                  CUDA_R_32F, H);
    if (d_hidden.is_none()) continue;
    T* dx = d_hidden.data() + first * H;
    if (tile >= V) {  // d_hidden^T [H, rows] = head^T [H, V] * gradient^T [V, rows]
      device_gemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, H, rows, V, head_rows(0, V), t_type, H, gradient, t_type, V, 0.0f,
                  dx, t_type, H);
      continue;
    }
    void* acc = fp32 ? static_cast<void*>(dx) : static_cast<void*>(accumulator.data());
    for (std::int64_t n0 = 0; n0 < V; n0 += tile) {
      const std::int64_t nt = std::min(tile, V - n0);
      device_gemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, H, rows, nt, head_rows(n0, nt), t_type, H, gradient + n0, t_type,
                  V, n0 == 0 ? 0.0f : 1.0f, acc, CUDA_R_32F, H);
    }
    if constexpr (!fp32) {
      quant::detail::convert_kernel<T><<<::memkit::detail::grid_for(rows * H, loss_block_threads), loss_block_threads,
                                         0, stream>>>(accumulator.data(), dx, rows * H);
      MEMKIT_CUDA_CHECK(cudaGetLastError());
    }
  }
  if (per_token) return;
  mean_loss_kernel<><<<1, loss_block_threads, 0, stream>>>(row_loss, N, counters.data(), loss.data());
  MEMKIT_CUDA_CHECK(cudaGetLastError());
}
#endif

}  // namespace loss::detail
MEMKIT_NAMESPACE_END
