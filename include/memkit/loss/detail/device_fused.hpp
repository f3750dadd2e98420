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

// --- The staged row pass (cross_entropy_options::row_pass = staged, #30). The classic kernel above reads each
// row three times (max and sum of z, sum of exp, gradient) and writes it twice (the capped values back into
// the logits, then the gradient). Both kernels below write nothing back: they keep `capped` in shared memory
// or recompute it from the raw logit (math.capped, the same function: the same bits).

// Four gradients (or zeros) in one store: 16 bytes for fp32, 8 for 16-bit types; `i` counts groups of four.
template <class D>
MEMKIT_DEVICE void store_four(D* g, std::int64_t i, float a, float b, float c, float d) {
  if constexpr (std::is_same_v<D, float>) {
    reinterpret_cast<float4*>(g)[i] = make_float4(a, b, c, d);
  } else {
    const D parts[4] = {from_float<D>(a), from_float<D>(b), from_float<D>(c), from_float<D>(d)};
    uint2 bits;
    static_assert(sizeof(bits) == sizeof(parts));
    __builtin_memcpy(&bits, parts, sizeof(bits));
    reinterpret_cast<uint2*>(g)[i] = bits;
  }
}

// A row whose target is ignored (or out of range): zero gradient.
template <class D>
MEMKIT_DEVICE void zero_row(D* g, std::int64_t V, bool vector) {
  if (vector)
    for (std::int64_t i = threadIdx.x; i < V / 4; i += blockDim.x) store_four(g, i, 0.0f, 0.0f, 0.0f, 0.0f);
  else
    for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) g[j] = from_float<D>(0.0f);
}

// Each row staged once in dynamic shared memory (V floats: the launch checks them against the device's opt-in
// limit), read from global memory once (16-byte loads when `vector`: V % 4 == 0 and both rows 16- / 8-byte
// aligned) and its gradient written once. The reductions walk the staged row in the classic kernel's order
// (thread k takes j = k, k + blockDim.x, ..., then block_reduce), and each element's math is the same row_math
// call on the same value, so loss and gradient have the classic kernel's bits (the GPU test checks it).
template <class D>
__global__ void __launch_bounds__(logit_row_threads)
    logit_rows_staged_kernel(const float* logits, D* gradient, std::int64_t rows, std::int64_t V,
                             const std::int32_t* __restrict__ targets, std::int64_t ignore_index, row_math math,
                             const int* __restrict__ counters, float* __restrict__ row_loss,
                             const float* __restrict__ row_scale, bool per_token, bool vector) {
  extern __shared__ float4 staged4[];
  float* staged = reinterpret_cast<float*>(staged4);
  __shared__ float scratch[32];
  const int counted = counters[0];
  const float mean_scale = counted > 0 ? 1.0f / static_cast<float>(counted) : 0.0f;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    // Not __restrict__: with fp32 hidden the gradient is written over these logits (after the row is staged).
    const float* z = logits + r * V;
    D* g = gradient + r * V;
    const std::int64_t t = targets[r];
    if (t == ignore_index || t < 0 || t >= V) {  // as in the classic kernel
      zero_row(g, V, vector);
      if (threadIdx.x == 0) row_loss[r] = per_token && t != ignore_index ? NAN : 0.0f;
      continue;
    }
    const float scale = row_scale != nullptr ? row_scale[r] : mean_scale;
    if (vector) {
      const float4* z4 = reinterpret_cast<const float4*>(z);
#pragma unroll 4
      for (std::int64_t i = threadIdx.x; i < V / 4; i += blockDim.x) {
        const float4 raw = z4[i];
        staged4[i] = make_float4(math.capped(raw.x), math.capped(raw.y), math.capped(raw.z), math.capped(raw.w));
      }
    } else {
      for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) staged[j] = math.capped(z[j]);
    }
    __syncthreads();
    float largest = -INFINITY, z_sum = 0.0f;
    for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const float value = staged[j];
      largest = fmaxf(largest, value);
      z_sum += value;
    }
    largest = block_reduce(largest, max_op{}, -INFINITY, scratch);
    z_sum = block_reduce(z_sum, sum_op{}, 0.0f, scratch);
    float sum = 0.0f;
    for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) sum += expf(staged[j] - largest);
    sum = block_reduce(sum, sum_op{}, 0.0f, scratch);
    const float lse = largest + logf(sum);
    if (threadIdx.x == 0) row_loss[r] = math.token_loss(lse, staged[t], z_sum);
    if (vector) {
      for (std::int64_t i = threadIdx.x; i < V / 4; i += blockDim.x) {
        const float4 v = staged4[i];
        const std::int64_t j = 4 * i;
        store_four(g, i, math.gradient(v.x, lse, j == t, scale), math.gradient(v.y, lse, j + 1 == t, scale),
                   math.gradient(v.z, lse, j + 2 == t, scale), math.gradient(v.w, lse, j + 3 == t, scale));
      }
    } else {
      for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x)
        g[j] = from_float<D>(math.gradient(staged[j], lse, j == t, scale));
    }
    __syncthreads();  // the next row overwrites `staged`
  }
}

// online_softmax::merge over the block (blockDim.x a multiple of 32); every thread gets the result. The order is
// fixed by blockDim, as block_reduce's.
MEMKIT_DEVICE inline void block_reduce_softmax(online_softmax& state, float* scratch /* 64 floats */) {
  for (int offset = 16; offset > 0; offset >>= 1)
    state.merge(__shfl_xor_sync(0xffffffffu, state.max, offset), __shfl_xor_sync(0xffffffffu, state.sum, offset));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) {
    scratch[warp] = state.max;
    scratch[32 + warp] = state.sum;
  }
  __syncthreads();
  const bool held = lane < static_cast<int>(blockDim.x >> 5);
  state = held ? online_softmax{scratch[lane], scratch[32 + lane]} : online_softmax{};
  for (int offset = 16; offset > 0; offset >>= 1)
    state.merge(__shfl_xor_sync(0xffffffffu, state.max, offset), __shfl_xor_sync(0xffffffffu, state.sum, offset));
}

// A row too long for shared memory (Llama 3's 128,256 fp32 logits are 501 KiB): two reads, one write. Pass 1
// forms the max, the sum of exp and the sum of z in one read (online_softmax, common.hpp: the sum is rescaled when the max
// grows); pass 2 recomputes `capped` and writes the gradient. Against the classic kernel two reductions change
// order, so the bits differ (not the math): the sum of exp is accumulated against a running max instead of the
// row's max (each rescale rounds once more), and with `vector` each thread takes four consecutive values
// (j = 4k .. 4k + 3, then 4 (k + blockDim.x) ...) for both sums. Both stay within the tolerances the GPU tests
// hold the device to against the host (whose exp and order differ anyway). 42-44 registers (sm_90): one 1,024-thread
// CTA per SM with four 16-byte loads in flight per thread (64 KiB per SM); capping it at 32 registers for two CTAs
// spilled 20-92 bytes per thread, with unrolling by 2 or 4.
template <class D>
__global__ void __launch_bounds__(logit_row_threads)
    logit_rows_two_pass_kernel(const float* logits, D* gradient, std::int64_t rows, std::int64_t V,
                               const std::int32_t* __restrict__ targets, std::int64_t ignore_index, row_math math,
                               const int* __restrict__ counters, float* __restrict__ row_loss,
                               const float* __restrict__ row_scale, bool per_token, bool vector) {
  __shared__ float scratch[64];
  const int counted = counters[0];
  const float mean_scale = counted > 0 ? 1.0f / static_cast<float>(counted) : 0.0f;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* z = logits + r * V;  // not __restrict__: fp32 gradients overwrite it in pass 2
    D* g = gradient + r * V;
    const std::int64_t t = targets[r];
    if (t == ignore_index || t < 0 || t >= V) {
      zero_row(g, V, vector);
      if (threadIdx.x == 0) row_loss[r] = per_token && t != ignore_index ? NAN : 0.0f;
      continue;
    }
    const float scale = row_scale != nullptr ? row_scale[r] : mean_scale;
    // Read before pass 2 can overwrite it (the reductions' barriers order the two).
    const float z_target = threadIdx.x == 0 ? math.capped(z[t]) : 0.0f;
    online_softmax softmax;
    float z_sum = 0.0f;
    if (vector) {
      const float4* z4 = reinterpret_cast<const float4*>(z);
#pragma unroll 4
      for (std::int64_t i = threadIdx.x; i < V / 4; i += blockDim.x) {
        const float4 raw = z4[i];
        const float a = math.capped(raw.x), b = math.capped(raw.y), c = math.capped(raw.z), d = math.capped(raw.w);
        softmax.add4(a, b, c, d);
        z_sum += (a + b) + (c + d);
      }
    } else {
      for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        const float value = math.capped(z[j]);
        softmax.add(value);
        z_sum += value;
      }
    }
    block_reduce_softmax(softmax, scratch);
    z_sum = block_reduce(z_sum, sum_op{}, 0.0f, scratch);
    const float lse = softmax.lse();
    if (threadIdx.x == 0) row_loss[r] = math.token_loss(lse, z_target, z_sum);
    if (vector) {
      const float4* z4 = reinterpret_cast<const float4*>(z);
#pragma unroll 4
      for (std::int64_t i = threadIdx.x; i < V / 4; i += blockDim.x) {
        const float4 raw = z4[i];
        const std::int64_t j = 4 * i;
        store_four(g, i, math.gradient(math.capped(raw.x), lse, j == t, scale),
                   math.gradient(math.capped(raw.y), lse, j + 1 == t, scale),
                   math.gradient(math.capped(raw.z), lse, j + 2 == t, scale),
                   math.gradient(math.capped(raw.w), lse, j + 3 == t, scale));
      }
    } else {
      for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x)
        g[j] = from_float<D>(math.gradient(math.capped(z[j]), lse, j == t, scale));
    }
    // No barrier needed before the next row: its reductions' first barrier guards `scratch`.
  }
}

// Shared memory the staged kernel needs for a row of V logits, and whether the device gives it (its opt-in
// per-block limit, less the kernel's static shared memory: 227 KiB - 128 B on sm_90, 58,080 floats).
template <class D>
bool staged_row_fits(int device, std::int64_t V) {
  int limit = 0;
  MEMKIT_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attributes{};
  MEMKIT_CUDA_CHECK(cudaFuncGetAttributes(&attributes, logit_rows_staged_kernel<D>));
  return static_cast<std::size_t>(V) * sizeof(float) + attributes.sharedSizeBytes <= static_cast<std::size_t>(limit);
}

// Which row kernel a call runs, decided once per call (the buffers and V are the same for every chunk).
struct row_pass_plan {
  device_row_pass pass = device_row_pass::classic;
  bool staged = false;  // staged pass, the row fits in shared memory: logit_rows_staged_kernel (else two-pass)
  bool vector = false;  // 16-byte loads of the logits, 4-element stores of the gradient
};

template <class D>
row_pass_plan plan_row_pass(const cuda_executor& exec, device_row_pass pass, const float* logits, const D* gradient,
                            std::int64_t V) {
  row_pass_plan plan{pass};
  if (pass == device_row_pass::classic) return plan;
  // Every row starts aligned when the buffers do and V % 4 == 0.
  const auto aligned = [](const void* p, std::size_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; };
  plan.vector = V % 4 == 0 && aligned(logits, 16) && aligned(gradient, 4 * sizeof(D));
  plan.staged = staged_row_fits<D>(exec.device, V);
  if (plan.staged)
    MEMKIT_CUDA_CHECK(cudaFuncSetAttribute(logit_rows_staged_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(V * static_cast<std::int64_t>(sizeof(float)))));
  return plan;
}

// The row pass over `rows` rows of a chunk, with the kernel the plan names.
template <class D>
void launch_row_pass(const cuda_executor& exec, const row_pass_plan& plan, float* logits, D* gradient,
                     std::int64_t rows, std::int64_t V, const std::int32_t* targets, std::int64_t ignore_index,
                     const row_math& math, const int* counters, float* row_loss, const float* row_scale,
                     bool per_token) {
  const int grid = ::memkit::detail::grid_for(rows, 1);
  if (plan.pass == device_row_pass::classic)
    logit_rows_kernel<D><<<grid, logit_row_threads, 0, exec.stream>>>(logits, gradient, rows, V, targets, ignore_index,
                                                                      math, counters, row_loss, row_scale, per_token);
  else if (plan.staged)
    logit_rows_staged_kernel<D><<<grid, logit_row_threads, static_cast<std::size_t>(V) * sizeof(float), exec.stream>>>(
        logits, gradient, rows, V, targets, ignore_index, math, counters, row_loss, row_scale, per_token, plan.vector);
  else
    logit_rows_two_pass_kernel<D><<<grid, logit_row_threads, 0, exec.stream>>>(
        logits, gradient, rows, V, targets, ignore_index, math, counters, row_loss, row_scale, per_token, plan.vector);
  MEMKIT_CUDA_CHECK(cudaGetLastError());
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
  const row_pass_plan row_pass = plan_row_pass<T>(exec, options.row_pass, logits.data(), gradient, V);
  for (std::int64_t first = 0; first < N; first += c) {
    const std::int64_t rows = std::min(c, N - first);
    const T* x = hidden.data() + first * H;
    // Column-major views: logits^T [V, rows] (ld V) = head rows^T * x^T, tile by tile.
    for (std::int64_t n0 = 0; n0 < V; n0 += tile) {
      const std::int64_t nt = std::min(tile, V - n0);
      device_gemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, nt, rows, H, head_rows(n0, nt), t_type, H, x, t_type, H, 0.0f,
                  logits.data() + n0, CUDA_R_32F, V);
    }
    launch_row_pass<T>(exec, row_pass, logits.data(), gradient, rows, V, targets.data() + first,
                       options.ignore_index, math, counters.data(), row_loss + first,
                       row_scale != nullptr ? row_scale + first : nullptr, per_token);
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
