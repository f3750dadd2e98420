// memkit/config.hpp — version, namespace, host/device macros and CUDA error checking.
//
// Every memkit header includes this one first. It decides whether the CUDA paths are compiled:
// they switch on under nvcc (when __CUDACC__ is defined) and stay off under a plain host compiler,
// so the whole host API builds with g++ alone and no CUDA Toolkit on the include path.
#pragma once

#include <stdexcept>
#include <string>

#define MEMKIT_VERSION_MAJOR 0
#define MEMKIT_VERSION_MINOR 1
#define MEMKIT_VERSION_PATCH 0
#define MEMKIT_VERSION (MEMKIT_VERSION_MAJOR * 10000 + MEMKIT_VERSION_MINOR * 100 + MEMKIT_VERSION_PATCH)

// The ABI namespace changes with every minor version, so two vendored copies of memkit in one
// program link as distinct symbols instead of silently violating the one-definition rule.
#define MEMKIT_NAMESPACE_BEGIN \
  namespace memkit {           \
  inline namespace v0_1 {
#define MEMKIT_NAMESPACE_END \
  }                          \
  }

#if defined(__CUDACC__)
#define MEMKIT_HAS_CUDA 1
#include <cuda_runtime.h>
#else
#define MEMKIT_HAS_CUDA 0
#endif

#if MEMKIT_HAS_CUDA
#define MEMKIT_HOST_DEVICE __host__ __device__
#define MEMKIT_DEVICE __device__
#define MEMKIT_FORCEINLINE __forceinline__
#else
#define MEMKIT_HOST_DEVICE
#define MEMKIT_DEVICE
#define MEMKIT_FORCEINLINE inline
#endif

// True while compiling device code (the nvcc device pass); host code and plain g++ see false.
#if defined(__CUDA_ARCH__)
#define MEMKIT_DEVICE_PASS 1
#else
#define MEMKIT_DEVICE_PASS 0
#endif

MEMKIT_NAMESPACE_BEGIN

struct version_info {
  int major, minor, patch;
};
inline constexpr version_info version{MEMKIT_VERSION_MAJOR, MEMKIT_VERSION_MINOR, MEMKIT_VERSION_PATCH};

// Base of every error memkit throws for bad input or a failed operation.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws memkit::error with `message` unless `condition` holds. Host-only: device code never throws.
inline void require(bool condition, const std::string& message) {
  if (!condition) throw error(message);
}

#if MEMKIT_HAS_CUDA
// A failed CUDA runtime call: names the call, where it was made, and CUDA's own message.
class cuda_error : public error {
 public:
  cuda_error(cudaError_t code, const char* call, const char* file, int line)
      : error(std::string("CUDA call `") + call + "` failed at " + file + ":" + std::to_string(line) + ": " +
              cudaGetErrorName(code) + " (" + cudaGetErrorString(code) + ")"),
        code_(code) {}
  cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

namespace detail {
inline void cuda_check(cudaError_t code, const char* call, const char* file, int line) {
  if (code != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error so the next call starts clean
    throw cuda_error(code, call, file, line);
  }
}
}  // namespace detail

#define MEMKIT_CUDA_CHECK(call) ::memkit::detail::cuda_check((call), #call, __FILE__, __LINE__)
#endif

MEMKIT_NAMESPACE_END
