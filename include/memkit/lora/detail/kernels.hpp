// memkit/lora/detail/kernels.hpp — lora_linear's per-element pieces: the dropout rule shared by the host
// loops and the CUDA kernels (so a mask drawn in forward is drawn again, identically, in backward), the
// adapter scale, and the CUDA kernels of dropout, the bias and the masked input gradient.
#pragma once

#include <cmath>
#include <cstdint>

#include "memkit/config.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/random.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/linalg/gemm.hpp"
#include "memkit/lora/bytes.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace lora {

namespace detail {

// Whether dropout keeps element `index` of the adapter's input: one function for host and device.
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE constexpr bool dropout_keeps(std::uint64_t seed, std::uint64_t counter,
                                                                  std::uint64_t index, float p) noexcept {
  return unit_float(random_word(seed, counter, index)) >= p;
}

// Stream tags of the initialisation (counter values, so A's init never collides with dropout streams).
inline constexpr std::uint64_t init_counter = 0x10a1'0000'0000'0001ull;

inline double scale_of(const lora_options& o) {
  return o.use_rslora ? o.alpha / std::sqrt(static_cast<double>(o.rank)) : o.alpha / static_cast<double>(o.rank);
}

template <class T>
linalg::matrix_ref<T> matrix(T* data, std::int64_t rows, std::int64_t cols, memory_kind where) noexcept {
  return {data, rows, cols, cols, where};
}

#if MEMKIT_HAS_CUDA
template <class T>
__global__ void dropout_input_kernel(const T* __restrict__ x, T* __restrict__ out, std::int64_t count,
                                     std::uint64_t seed, std::uint64_t counter, float p, float keep_scale) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i] = dropout_keeps(seed, counter, static_cast<std::uint64_t>(i), p) ? from_float<T>(to_float(x[i]) * keep_scale)
                                                                            : from_float<T>(0.0f);
}

// A template so that a header-only __global__ function is not defined once per translation unit.
template <class Word>
__global__ void write_record_kernel(Word* record, Word seed, Word counter, Word applied, Word tokens) {
  record[0] = seed;
  record[1] = counter;
  record[2] = applied;
  record[3] = tokens;
}

template <class T>
__global__ void add_bias_kernel(T* __restrict__ y, const T* __restrict__ bias, std::int64_t rows, std::int64_t cols) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < rows * cols;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    y[i] = from_float<T>(to_float(y[i]) + to_float(bias[i % cols]));
}

// grad_bias[c] += sum over rows of dy[r, c]: one thread per column, walking the rows (coalesced).
template <class T>
__global__ void bias_grad_kernel(const T* __restrict__ dy, float* __restrict__ grad, std::int64_t rows,
                                 std::int64_t cols) {
  for (std::int64_t c = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; c < cols;
       c += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float sum = 0.0f;
    for (std::int64_t r = 0; r < rows; ++r) sum += to_float(dy[r * cols + c]);
    grad[c] += sum;
  }
}

// dx[row0 + r, c] += keep ? g[r, c] * keep_scale : 0, the mask drawn from the saved record.
template <class T, class G>
__global__ void masked_add_kernel(T* __restrict__ dx, const G* __restrict__ g, std::int64_t rows, std::int64_t cols,
                                  std::int64_t row0, const std::uint64_t* __restrict__ record, float p,
                                  float keep_scale) {
  const std::uint64_t seed = record[0], counter = record[1];
  const bool applied = record[2] != 0;  // a forward without dropout (not training) masks nothing
  const float factor = applied ? keep_scale : 1.0f;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < rows * cols;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const auto index = static_cast<std::uint64_t>(row0 * cols + i);
    if (!applied || dropout_keeps(seed, counter, index, p)) dx[i] = from_float<T>(to_float(dx[i]) + to_float(g[i]) * factor);
  }
}
#endif

}  // namespace detail

}  // namespace lora

MEMKIT_NAMESPACE_END
