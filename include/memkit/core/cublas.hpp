// memkit/core/cublas.hpp — the cuBLAS plumbing memkit's CUDA paths share: element types, status checks,
// and the handle a call runs on. Empty under a plain host compiler.
//
// Handles and workspace (docs/cuda.md, "cuBLAS handles and their workspace"). The rules this follows are
// cuBLAS's own (cuBLAS Library documentation, https://docs.nvidia.com/cuda/cublas/, sections "cuBLAS
// context", "Thread Safety", "Results reproducibility", "cublasSetStream()" and "cublasSetWorkspace()"):
//  - a handle is tied to the device that was current at cublasCreate, so memkit keeps one per device;
//  - sharing a handle between host threads is allowed but not recommended (a configuration change such as
//    cublasSetStream by one thread affects the others), so memkit keeps one per thread (thread_local);
//  - cublasSetStream unconditionally resets the handle's workspace to cuBLAS's default workspace pool, and
//    routines running on concurrent streams that share a handle's workspace may pick different internal
//    implementations (results then vary from run to run). The documented remedies: a separate workspace
//    per stream with cublasSetWorkspace, or one handle per stream. memkit does the first: every call of
//    cublas_handle_for(exec) sets exec.stream and then the workspace this thread keeps for
//    (exec.device, exec.stream), so two streams used from one thread never share cuBLAS scratch memory;
//  - the workspace pointer must be aligned to at least 256 bytes (cudaMalloc's alignment), and the
//    documented recommended size is 32 MiB on Hopper and 4 MiB on earlier architectures; memkit uses
//    32 MiB from compute capability 9.0 on (Hopper and newer), 4 MiB below.
// Each workspace is one cudaMalloc made the first time a thread runs cuBLAS on that (device, stream), kept
// until the thread exits or calls release_cublas_resources(): never on the hot path, and not charged to any
// memkit tracker (like cuBLAS's own default workspace, it belongs to the library, not to the model).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/memory/resource.hpp"

#if MEMKIT_HAS_CUDA
#include <cublas_v2.h>
#endif

MEMKIT_NAMESPACE_BEGIN

namespace detail {
// The most elements one cuBLAS operand may span (#31): its sizes are int, and its kernels are not reliable once
// an operand's span reaches 2^31 elements even with int sizes (NVIDIA/raft#3097: cuBLASLt 13.6 fails with
// CUBLAS_STATUS_EXECUTION_FAILED at exactly 2^31, fine one row below). Long sequences reach it first in the
// MLP: [tokens, 14336] passes it at 149,797 tokens, which is what the sequence-tiled MLP avoids.
inline constexpr std::int64_t cublas_operand_elements = 2147483647;
// Throws memkit::error unless a row-major operand of `rows` rows with leading dimension `ld` spans at most
// cublas_operand_elements; host code, so that the rule is checked without a device.
inline void require_cublas_span(std::int64_t rows, std::int64_t ld, const char* operation, const char* operand) {
  if (rows <= 0 || ld <= cublas_operand_elements / rows) return;
  throw error(std::string(operation) + " (CUDA): " + operand + " spans " + std::to_string(rows) + " x " +
              std::to_string(ld) + " elements, past the 2^31 - 1 one cuBLAS operand may span; split the call (for a "
              "long sequence, tile the MLP: decoder_block::mlp_token_chunk, train_llama --mlp-chunk)");
}

// cuBLAS workspace bytes per (thread, device, stream) for a device of compute capability `major`.x.
constexpr std::size_t cublas_workspace_bytes(int major) noexcept {
  return major >= 9 ? std::size_t{32} << 20 : std::size_t{4} << 20;
}

// One entry per (device, stream) in first-use order: the lookup behind the per-stream cuBLAS workspaces,
// kept free of CUDA calls so that the cuda_host tests can check it without a device.
template <class V>
class per_stream_cache {
 public:
  struct entry {
    int device;
    const void* stream;
    V value;
  };
  // The value for (device, stream), made by make() the first time that pair is seen.
  template <class Make>
  V& get(int device, const void* stream, Make&& make) {
    for (entry& e : entries_)
      if (e.device == device && e.stream == stream) return e.value;
    entries_.push_back(entry{device, stream, make()});
    return entries_.back().value;
  }
  std::vector<entry>& entries() noexcept { return entries_; }
  std::size_t size() const noexcept { return entries_.size(); }

 private:
  std::vector<entry> entries_;
};
}  // namespace detail

#if MEMKIT_HAS_CUDA
namespace detail {

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

// The calling thread's cuBLAS state: one handle per device, one workspace per (device, stream).
struct cublas_thread_state {
  struct workspace {
    void* memory = nullptr;
    std::size_t bytes = 0;
  };
  static constexpr int max_devices = 64;
  cublasHandle_t handles[max_devices] = {};
  per_stream_cache<workspace> workspaces;

  cublas_thread_state() = default;
  cublas_thread_state(const cublas_thread_state&) = delete;
  cublas_thread_state& operator=(const cublas_thread_state&) = delete;
  ~cublas_thread_state() { release(); }

  // Waits for each workspace's device (work still queued may use it), then frees everything.
  void release() noexcept {
    for (auto& e : workspaces.entries()) {
      int previous = 0;
      if (cudaGetDevice(&previous) == cudaSuccess && cudaSetDevice(e.device) == cudaSuccess) {
        (void)cudaDeviceSynchronize();
        (void)cudaFree(e.value.memory);
        (void)cudaSetDevice(previous);
      }
    }
    workspaces.entries().clear();
    for (cublasHandle_t& h : handles)
      if (h) {
        (void)cublasDestroy(h);
        h = nullptr;
      }
  }
};

inline cublas_thread_state& cublas_state() {
  thread_local cublas_thread_state state;
  return state;
}

// The cuBLAS handle for `exec`: this thread's handle for exec.device, set to run on exec.stream with the
// workspace this thread keeps for (exec.device, exec.stream). Call it again before each batch of cuBLAS calls
// (other code on the thread may have pointed the handle at another stream in between).
inline cublasHandle_t cublas_handle_for(const cuda_executor& exec) {
  cublas_thread_state& state = cublas_state();
  require(exec.device >= 0 && exec.device < cublas_thread_state::max_devices,
          "cuBLAS: device index " + std::to_string(exec.device) + " out of range");
  return with_device(exec.device, [&] {
    cublasHandle_t& handle = state.handles[exec.device];
    if (!handle) cublas_check(cublasCreate(&handle), "cublasCreate");
    const auto& ws = state.workspaces.get(exec.device, exec.stream, [&] {
      int major = 0;
      MEMKIT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, exec.device));
      cublas_thread_state::workspace made;
      made.bytes = cublas_workspace_bytes(major);
      MEMKIT_CUDA_CHECK(cudaMalloc(&made.memory, made.bytes));
      return made;
    });
    // cublasSetStream resets the workspace to cuBLAS's default pool: set ours after it.
    cublas_check(cublasSetStream(handle, exec.stream), "cublasSetStream");
    cublas_check(cublasSetWorkspace(handle, ws.memory, ws.bytes), "cublasSetWorkspace");
    return handle;
  });
}

// The workspace cublas_handle_for(exec) sets, or nullptr before the first call for (exec.device, exec.stream).
inline const void* cublas_workspace_of(const cuda_executor& exec) {
  for (auto& e : cublas_state().workspaces.entries())
    if (e.device == exec.device && e.stream == exec.stream) return e.value.memory;
  return nullptr;
}
}  // namespace detail

// Frees the calling thread's cuBLAS handles and per-stream workspaces, after waiting for the devices they are
// on. For a thread about to destroy streams it ran memkit's cuBLAS paths on (a later stream may reuse the
// address of a destroyed one), or to give the memory back; the next cuBLAS path makes them again.
inline void release_cublas_resources() { detail::cublas_state().release(); }
#endif

MEMKIT_NAMESPACE_END
