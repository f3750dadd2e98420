// memkit/layers/tensor_ops.hpp — the small tensor operations every hand-written layer uses, on either executor.
//
//   for_each_index(exec, count, f)   f(i) for i in [0, count): a loop on the host, a grid-stride kernel on
//                                    exec.stream under nvcc (f holds plain pointers and sizes)
//   copy_view(exec, from, to)        to = from, ordered on exec's stream
//   zero_view(exec, to)              to = 0, ordered on exec's stream (memset / cudaMemsetAsync)
//   copy_in(host, to) / copy_out(from)   setup-time copies between the host and host or device memory
//   cmat / mat                       a contiguous row-major block as a linalg matrix
//   with_last(s, n) / rows_of(s)     a shape with its last extent replaced / the product of all but the last
//
// This is how every layer keeps one implementation of its elementwise and per-row math: one
// MEMKIT_HOST_DEVICE function object per element, row or column, run by for_each_index.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/linalg/gemm.hpp"
#include "memkit/memory/resource.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace layers {

// f(i) for i in [0, count): in order on the host; one thread per index on exec.stream on a CUDA executor
// (f is copied to the device, so it holds plain pointers and sizes; it must not depend on the order).
template <executor E, class F>
void for_each_index(const E& exec, std::int64_t count, const F& f);

// to = from (same element count), ordered on exec's stream.
template <executor E, class T>
void copy_view(const E& exec, tensor_view<const T> from, tensor_view<T> to);

// Zeroes a view, ordered on exec's stream.
template <executor E, class T>
void zero_view(const E& exec, tensor_view<T> to);

// Setup-time copies between the host and a view in host or device memory (synchronous: cudaMemcpy on the
// legacy default stream, so ordered after everything enqueued on blocking streams).
template <class T>
void copy_in(const T* host, tensor_view<T> to);
template <class T>
std::vector<std::remove_const_t<T>> copy_out(tensor_view<T> from);

// A contiguous row-major block as a linalg matrix, in `where` memory.
template <class T>
linalg::matrix_ref<const T> cmat(const T* data, std::int64_t rows, std::int64_t cols, memory_kind where) {
  return {data, rows, cols, cols, where};
}
template <class T>
linalg::matrix_ref<T> mat(T* data, std::int64_t rows, std::int64_t cols, memory_kind where) {
  return {data, rows, cols, cols, where};
}

// The shape `s` with its last extent replaced.
inline shape with_last(shape s, std::int64_t last) {
  s.extents[s.rank - 1] = last;
  return s;
}
// The rows of a tensor of shape `s`: every extent but the last, multiplied.
inline std::int64_t rows_of(const shape& s) { return s.numel() / s[s.rank - 1]; }

// ---- implementation ----------------------------------------------------------------------------------------
#if MEMKIT_HAS_CUDA
template <class F>
__global__ void for_each_kernel(std::int64_t count, F f) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    f(i);
}
#endif

template <executor E, class F>
void for_each_index(const E& exec, std::int64_t count, const F& f) {
  if constexpr (!E::on_device) {
    (void)exec;
    for (std::int64_t i = 0; i < count; ++i) f(i);
  } else {
#if MEMKIT_HAS_CUDA
    if (count <= 0) return;
    detail::with_device(exec.device, [&] {
      for_each_kernel<F><<<detail::grid_for(count, 256), 256, 0, exec.stream>>>(count, f);
      MEMKIT_CUDA_CHECK(cudaGetLastError());
      return 0;
    });
#endif
  }
}

template <executor E, class T>
void copy_view(const E& exec, tensor_view<const T> from, tensor_view<T> to) {
  require(from.size() == to.size(), "layers::copy_view: the views differ in size");
  if constexpr (!E::on_device) {
    (void)exec;
    std::copy(from.begin(), from.end(), to.begin());
  } else {
#if MEMKIT_HAS_CUDA
    MEMKIT_CUDA_CHECK(cudaMemcpyAsync(to.data(), from.data(), from.bytes(), cudaMemcpyDefault, exec.stream));
#endif
  }
}

template <executor E, class T>
void zero_view(const E& exec, tensor_view<T> to) {
  if constexpr (!E::on_device) {
    (void)exec;
    if (!to.empty()) std::memset(static_cast<void*>(to.data()), 0, to.bytes());
  } else {
#if MEMKIT_HAS_CUDA
    if (!to.empty()) MEMKIT_CUDA_CHECK(cudaMemsetAsync(static_cast<void*>(to.data()), 0, to.bytes(), exec.stream));
#endif
  }
}

template <class T>
void copy_in(const T* host, tensor_view<T> to) {
  if (to.where() == memory_kind::host) {
    if (!to.empty()) std::memcpy(static_cast<void*>(to.data()), host, to.bytes());
    return;
  }
#if MEMKIT_HAS_CUDA
  MEMKIT_CUDA_CHECK(cudaMemcpy(to.data(), host, to.bytes(), cudaMemcpyHostToDevice));
#else
  throw error("layers::copy_in: device memory in a build without CUDA");
#endif
}

template <class T>
std::vector<std::remove_const_t<T>> copy_out(tensor_view<T> from) {
  std::vector<std::remove_const_t<T>> out(static_cast<std::size_t>(from.size()));
  if (from.where() == memory_kind::host) {
    if (!from.empty()) std::memcpy(static_cast<void*>(out.data()), from.data(), from.bytes());
    return out;
  }
#if MEMKIT_HAS_CUDA
  MEMKIT_CUDA_CHECK(cudaMemcpy(out.data(), from.data(), from.bytes(), cudaMemcpyDeviceToHost));
#else
  throw error("layers::copy_out: device memory in a build without CUDA");
#endif
  return out;
}

}  // namespace layers
MEMKIT_NAMESPACE_END
