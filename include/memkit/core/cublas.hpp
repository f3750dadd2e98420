// memkit/core/cublas.hpp — the cuBLAS plumbing memkit's CUDA paths share: element types, status checks,
// and the handle a call runs on. Empty under a plain host compiler.
#pragma once

#include <string>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/float16.hpp"

#if MEMKIT_HAS_CUDA
#include <cublas_v2.h>
#endif

MEMKIT_NAMESPACE_BEGIN

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
  require(device >= 0 && device < 64, "cuBLAS: device index " + std::to_string(device) + " out of range");
  if (!cache.by_device[device]) cublas_check(cublasCreate(&cache.by_device[device]), "cublasCreate");
  return cache.by_device[device];
}
}  // namespace detail
#endif

MEMKIT_NAMESPACE_END
