// memkit/core/execution.hpp — where an operation runs: the host, or a CUDA device and stream.
//
// Every memkit operation takes its executor as an explicit argument. The host executor runs on the
// calling thread and returns when the work is done. The CUDA executor enqueues work on its stream
// and returns at once: nothing in memkit synchronizes the device unless the caller asks
// (cuda_executor::synchronize). Each executor knows which kinds of memory it can touch, so an
// operation checks its arguments before launching anything.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>

#include "memkit/config.hpp"
#include "memkit/core/tensor_view.hpp"

MEMKIT_NAMESPACE_BEGIN

struct host_executor {
  static constexpr bool on_device = false;
  static constexpr const char* name() noexcept { return "host"; }
  // Device memory is not addressable from the CPU; managed memory is, and so is pinned memory.
  static constexpr bool can_access(memory_kind kind) noexcept { return kind != memory_kind::device; }
};

inline constexpr host_executor host{};

#if MEMKIT_HAS_CUDA
// A device and a stream, both the caller's explicit choice: there is no default. A null stream handle means
// the legacy default stream, or this thread's default stream when the translation unit is compiled with
// `nvcc --default-stream per-thread`; which one depends on a compiler flag of the file that makes the
// executor, so memkit refuses a literal null and offers the two special handles by name, whose meaning no
// flag changes (docs/cuda.md, "Streams"):
//   cuda_executor{device, stream}                      a stream you created (cudaStreamCreate...)
//   cuda_executor::legacy_default_stream(device)       cudaStreamLegacy: waits for, and is waited on by,
//                                                      every blocking stream of the device
//   cuda_executor::per_thread_default_stream(device)   cudaStreamPerThread: the calling thread's own default
//                                                      stream; each thread that uses it gets a different one
struct cuda_executor {
  static constexpr bool on_device = true;
  static constexpr const char* name() noexcept { return "cuda"; }
  // Pageable host memory is not addressable from kernels; pinned host memory is (unified addressing).
  static constexpr bool can_access(memory_kind kind) noexcept { return kind != memory_kind::host; }

  int device;
  cudaStream_t stream;

  constexpr cuda_executor(int device_index, cudaStream_t stream_handle) noexcept
      : device(device_index), stream(stream_handle) {}
  // `{device, nullptr}` does not compile (nor does `{device, 0}`: ambiguous): name the default stream you mean.
  cuda_executor(int, std::nullptr_t) = delete;

  static cuda_executor legacy_default_stream(int device_index = 0) noexcept { return {device_index, cudaStreamLegacy}; }
  static cuda_executor per_thread_default_stream(int device_index = 0) noexcept {
    return {device_index, cudaStreamPerThread};
  }

  // Blocks until all work enqueued on this executor's stream has finished.
  void synchronize() const { MEMKIT_CUDA_CHECK(cudaStreamSynchronize(stream)); }
};

namespace detail {
// Grid size for a grid-stride kernel over `work_items` with `threads` per CTA: one thread per item,
// at least one CTA, and at most 65535 * 8 CTAs (many times what any GPU runs at once; the kernel's
// stride loop covers the rest).
inline int grid_for(std::int64_t work_items, int threads) {
  const std::int64_t needed = (work_items + threads - 1) / threads;
  return static_cast<int>(needed < 65535 * 8 ? (needed > 0 ? needed : 1) : 65535 * 8);
}
}  // namespace detail
#endif

template <class E>
concept executor = requires(memory_kind kind) {
  { E::on_device } -> std::convertible_to<bool>;
  { E::can_access(kind) } -> std::convertible_to<bool>;
  { E::name() } -> std::convertible_to<const char*>;
};

// Throws memkit::error unless `exec` can touch the memory behind `view`.
template <executor E, class T>
void require_accessible(const E&, const tensor_view<T>& view, const char* operation, const char* argument) {
  if (view.empty() || view.is_none() || E::can_access(view.where())) return;  // nothing to touch
  throw error(std::string(operation) + ": `" + argument + "` is in " + to_string(view.where()) + " memory, which the " +
              E::name() + " executor cannot access" +
              (E::on_device ? " (use device, managed or pinned_host memory)" : " (copy it to host memory first)"));
}

MEMKIT_NAMESPACE_END
