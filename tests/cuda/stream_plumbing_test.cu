// Streams, stream-ordered workspace and cuBLAS handles on a device (docs/cuda.md). Suite "gpu": these need a
// CUDA device; the host-side halves of the same rules are in tests/host/stream_ordered_test.cpp and
// tests/cuda/cuda_host_test.cu.
#include <memkit/memkit.hpp>

#include <cstdint>
#include <vector>

#include "support/gpu_test.hpp"

namespace {
__global__ void fill_kernel(float* out, std::int64_t count, float value) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i < count) out[i] = value;
}
}  // namespace

MEMKIT_GPU_TEST_CASE("gpu: device_async_resource allocates and frees on the stream allocate_on names") {
  cudaStream_t own, other;
  MEMKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
  MEMKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  memkit::device_async_resource async_device(own);
  memkit::tracking_resource tracker(async_device, "ordered");
  CHECK(tracker.category(memkit::memory_category::workspace).stream_ordered());
  const std::int64_t count = 1 << 20;
  std::vector<float> host(static_cast<std::size_t>(count));
  for (int round = 0; round < 8; ++round) {  // the pool hands the same bytes back: each round must see its own
    memkit::buffer<float> scratch(tracker.category(memkit::memory_category::workspace), memkit::shape{count},
                                  memkit::on_stream{other});
    fill_kernel<<<static_cast<unsigned>((count + 255) / 256), 256, 0, other>>>(scratch.data(), count,
                                                                              static_cast<float>(round));
    MEMKIT_CUDA_CHECK(cudaGetLastError());
    MEMKIT_CUDA_CHECK(cudaMemcpyAsync(host.data(), scratch.data(), count * sizeof(float), cudaMemcpyDeviceToHost, other));
    MEMKIT_CUDA_CHECK(cudaStreamSynchronize(other));
    int wrong = 0;
    for (float v : host) wrong += v != static_cast<float>(round);
    CHECK(wrong == 0);
  }  // each release is a cudaFreeAsync on `other`, after the copy
  CHECK(tracker.current_bytes() == 0);
  MEMKIT_CUDA_CHECK(cudaStreamSynchronize(other));
  MEMKIT_CUDA_CHECK(cudaStreamDestroy(other));
  MEMKIT_CUDA_CHECK(cudaStreamDestroy(own));
}

MEMKIT_GPU_TEST_CASE("gpu: cuBLAS keeps one workspace per (thread, device, stream), set after the stream") {
  cudaStream_t a, b;
  MEMKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  MEMKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  const memkit::cuda_executor on_a{0, a}, on_b{0, b};
  memkit::release_cublas_resources();
  CHECK(memkit::detail::cublas_workspace_of(on_a) == nullptr);
  const cublasHandle_t handle_a = memkit::detail::cublas_handle_for(on_a);
  const void* workspace_a = memkit::detail::cublas_workspace_of(on_a);
  const cublasHandle_t handle_b = memkit::detail::cublas_handle_for(on_b);
  const void* workspace_b = memkit::detail::cublas_workspace_of(on_b);
  CHECK(workspace_a != nullptr);
  CHECK(workspace_b != nullptr);
  CHECK(workspace_a != workspace_b);  // two streams on one thread never share cuBLAS scratch
  CHECK(handle_a == handle_b);         // one handle per thread and device, pointed at the stream of the call
  cudaStream_t current = nullptr;
  memkit::detail::cublas_check(cublasGetStream(handle_b, &current), "cublasGetStream");
  CHECK(current == b);
  (void)memkit::detail::cublas_handle_for(on_a);
  CHECK(memkit::detail::cublas_workspace_of(on_a) == workspace_a);  // made once, reused
  memkit::detail::cublas_check(cublasGetStream(handle_a, &current), "cublasGetStream");
  CHECK(current == a);
  memkit::release_cublas_resources();
  CHECK(memkit::detail::cublas_workspace_of(on_a) == nullptr);
  MEMKIT_CUDA_CHECK(cudaStreamDestroy(a));
  MEMKIT_CUDA_CHECK(cudaStreamDestroy(b));
}

MEMKIT_GPU_TEST_CASE("gpu: the per-thread default stream executor runs memkit work on this thread's stream") {
  const memkit::cuda_executor exec = memkit::cuda_executor::per_thread_default_stream();
  memkit::device_resource device;
  memkit::buffer<float> out(device, memkit::shape{1000});
  fill_kernel<<<4, 256, 0, exec.stream>>>(out.data(), 1000, 2.5f);
  MEMKIT_CUDA_CHECK(cudaGetLastError());
  exec.synchronize();
  std::vector<float> host(1000);
  MEMKIT_CUDA_CHECK(cudaMemcpy(host.data(), out.data(), host.size() * sizeof(float), cudaMemcpyDeviceToHost));
  int wrong = 0;
  for (float v : host) wrong += v != 2.5f;
  CHECK(wrong == 0);
}
