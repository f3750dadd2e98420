// distributed::nccl_communicator on one GPU as a 1-rank communicator (suite "gpu"), and the communicator
// concept under nvcc. Built wherever <nccl.h> is; the NCCL case is compiled in only when CMake found
// libnccl (MEMKIT_TEST_WITH_NCCL), otherwise CTest lists memkit.nccl as Skipped with the reason.
#include <memkit/distributed/communicator.hpp>
#include <memkit/distributed/nccl_communicator.hpp>
#include <memkit/distributed/stage3.hpp>
#include <memkit/memory/buffer.hpp>
#include <memkit/memory/resource.hpp>

#include <cstdint>
#include <vector>

#include "support/gpu_test.hpp"

static_assert(memkit::distributed::communicator<memkit::distributed::single_communicator, memkit::cuda_executor>);
#if MEMKIT_HAS_NCCL
static_assert(memkit::distributed::communicator<memkit::distributed::nccl_communicator, memkit::cuda_executor>);
static_assert(memkit::distributed::ordered_communicator<memkit::distributed::nccl_communicator, memkit::cuda_executor>);
#endif

#if MEMKIT_HAS_NCCL && defined(MEMKIT_TEST_WITH_NCCL)
namespace {
template <class T>
std::vector<T> to_host(const memkit::buffer<T>& b, cudaStream_t stream) {
  std::vector<T> out(static_cast<std::size_t>(b.size()));
  MEMKIT_CUDA_CHECK(cudaMemcpyAsync(out.data(), b.data(), b.bytes(), cudaMemcpyDeviceToHost, stream));
  MEMKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}
template <class T>
void from_host(memkit::buffer<T>& b, const std::vector<T>& values, cudaStream_t stream) {
  MEMKIT_CUDA_CHECK(cudaMemcpyAsync(b.data(), values.data(), b.bytes(), cudaMemcpyHostToDevice, stream));
}
}  // namespace

MEMKIT_GPU_TEST_CASE("gpu: nccl_communicator on one rank: all_reduce, reduce_scatter, all_gather, broadcast") {
  int device = 0;
  ncclComm_t comm = nullptr;
  REQUIRE(ncclCommInitAll(&comm, 1, &device) == ncclSuccess);
  cudaStream_t stream;
  MEMKIT_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    const memkit::distributed::nccl_communicator nccl(comm);
    CHECK(nccl.rank() == 0);
    CHECK(nccl.size() == 1);
    const memkit::cuda_executor exec{device, stream};
    memkit::device_resource resource;
    const std::int64_t n = 5000;
    std::vector<float> values(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) values[static_cast<std::size_t>(i)] = 0.25f * static_cast<float>(i) - 7.0f;
    memkit::buffer<float> a(resource, memkit::shape{n}), b(resource, memkit::shape{n});
    from_host(a, values, stream);
    nccl.all_reduce(exec, a.data(), b.data(), n);  // out of place
    nccl.all_reduce(exec, a.data(), a.data(), n);  // in place
    CHECK(to_host(a, stream) == values);
    CHECK(to_host(b, stream) == values);
    MEMKIT_CUDA_CHECK(cudaMemsetAsync(b.data(), 0, b.bytes(), stream));
    nccl.reduce_scatter(exec, a.data(), b.data(), n);
    CHECK(to_host(b, stream) == values);
    memkit::buffer<double> d(resource, memkit::shape{3});
    from_host(d, std::vector<double>{1.5, -2.0, 1e300}, stream);
    nccl.all_reduce(exec, d.data(), d.data(), 3);
    CHECK(to_host(d, stream) == std::vector<double>{1.5, -2.0, 1e300});
    memkit::buffer<memkit::bf16> h(resource, memkit::shape{4});
    const std::vector<memkit::bf16> halves{memkit::bf16(1.0f), memkit::bf16(-3.5f), memkit::bf16(0.0f), memkit::bf16(2.0f)};
    from_host(h, halves, stream);
    nccl.all_reduce(exec, h.data(), h.data(), 4);
    nccl.all_gather(exec, h.data(), h.data(), 4);  // in place: rank 0's part starts at recv
    nccl.broadcast(exec, h.data(), 4, 0);
    const auto back = to_host(h, stream);
    for (std::size_t i = 0; i < 4; ++i) CHECK(back[i].bits == halves[i].bits);
    // all_to_all (ncclSend/ncclRecv in a group) and the stage-3 reduction over it: on one rank, copies.
    MEMKIT_CUDA_CHECK(cudaMemsetAsync(b.data(), 0, b.bytes(), stream));
    nccl.all_to_all(exec, a.data(), b.data(), n);
    CHECK(to_host(b, stream) == values);
    memkit::buffer<float> staging(resource, memkit::shape{n});
    MEMKIT_CUDA_CHECK(cudaMemsetAsync(b.data(), 0, b.bytes(), stream));
    memkit::distributed::ordered_reduce_scatter(exec, nccl, memkit::tensor_view<const float>(a.view()), b.view(), staging.view());
    CHECK(to_host(b, stream) == values);
  }
  MEMKIT_CUDA_CHECK(cudaStreamDestroy(stream));
  CHECK(ncclCommDestroy(comm) == ncclSuccess);
}
#endif
