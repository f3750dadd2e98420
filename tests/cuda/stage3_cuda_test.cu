// distributed::stage3_parameters on a CUDA device (suite "gpu"), one rank: gather into the slot, gradients
// written into the gathered gradient buffer, release (the rank-ordered reduction over all_to_all), step on
// the own slice; parameters bit-identical to adam_state on the host after several steps, the last gather a
// prefetch on a second stream that the main stream waits for. Through
// single_communicator and, when libnccl is linked, a 1-rank nccl_communicator.
#include <memkit/distributed/communicator.hpp>
#include <memkit/distributed/nccl_communicator.hpp>
#include <memkit/distributed/stage3.hpp>
#include <memkit/memory/resource.hpp>
#include <memkit/optim/adam_state.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "support/gpu_test.hpp"

namespace {

template <class C>
int stage3_device_mismatches(const C& comm, const memkit::cuda_executor& exec) {
  memkit::device_resource device;
  memkit::device_async_resource async(exec.stream);
  memkit::layers::memory_resources memory{&device, &device, &device, &async};
  const std::vector<memkit::shape> dims{memkit::shape{300, 7}, memkit::shape{5000}, memkit::shape{64}};
  std::vector<memkit::layers::basic_parameter<float>> params;
  params.reserve(dims.size());
  std::vector<std::vector<float>> ref_values;
  std::vector<std::int64_t> sizes;
  for (std::size_t i = 0; i < dims.size(); ++i) {
    std::string name = "p";  // two steps: GCC 12 at -O3 flags "p" + std::to_string(i) with a false -Wrestrict
    name += std::to_string(i);
    params.emplace_back(name, dims[i], memory, memkit::layers::trainability::bf16_master);
    std::vector<float> v(static_cast<std::size_t>(dims[i].numel()));
    for (std::size_t j = 0; j < v.size(); ++j) v[j] = memkit::unit_float(memkit::random_word(9, i, j)) - 0.5f;
    params.back().assign(v.data());
    ref_values.push_back(v);
    sizes.push_back(dims[i].numel());
  }
  memkit::optim::adam_options options;
  options.max_grad_norm = 0.0f;
  std::vector<memkit::layers::basic_parameter<float>*> pointers;
  for (auto& p : params) pointers.push_back(&p);
  memkit::distributed::stage3_parameters<float> runtime(exec, comm, memory, {{pointers, 0, {}, {}, {}}}, options, 1);
  memkit::optim::adam_state<float> reference(memkit::host, memkit::default_host_resource(), sizes, options);
  const std::vector<memkit::optim::adam_group> groups{{.lr = 1e-2f, .weight_decay = 0.01f}};
  for (int s = 0; s < 4; ++s) {
    std::vector<std::vector<float>> grads;
    runtime.gather(exec, comm, 0, true);
    for (std::size_t i = 0; i < params.size(); ++i) {
      std::vector<float> g(ref_values[i].size());
      for (std::size_t j = 0; j < g.size(); ++j) g[j] = 0.01f * (memkit::unit_float(memkit::random_word(10 + s, i, j)) - 0.5f);
      MEMKIT_CUDA_CHECK(cudaMemcpyAsync(params[i].grad.data(), g.data(), g.size() * sizeof(float), cudaMemcpyHostToDevice, exec.stream));
      MEMKIT_CUDA_CHECK(cudaStreamSynchronize(exec.stream));
      grads.push_back(std::move(g));
    }
    runtime.release(exec, comm, 0);
    runtime.step(exec, comm, groups);
    std::vector<memkit::optim::adam_param<float, float>> list;
    for (std::size_t i = 0; i < params.size(); ++i)
      list.push_back({memkit::host_view(ref_values[i].data(), dims[i]), memkit::host_view(std::as_const(grads[i]).data(), dims[i]),
                      memkit::tensor_view<float>(), 0});
    reference.step(memkit::host, list, groups);
  }
  int mismatches = 0;
  // The last gather as a prefetch on a second stream: gather() on the main stream waits for it (an event).
  cudaStream_t side_stream;
  MEMKIT_CUDA_CHECK(cudaStreamCreate(&side_stream));
  const memkit::cuda_executor side{exec.device, side_stream};
  runtime.prefetch(side, comm, 0);
  runtime.gather(exec, comm, 0, false);
  for (std::size_t i = 0; i < params.size(); ++i) {
    std::vector<float> v(ref_values[i].size());
    MEMKIT_CUDA_CHECK(cudaMemcpyAsync(v.data(), params[i].value.data(), v.size() * sizeof(float), cudaMemcpyDeviceToHost, exec.stream));
    MEMKIT_CUDA_CHECK(cudaStreamSynchronize(exec.stream));
    for (std::size_t j = 0; j < v.size(); ++j) mismatches += std::memcmp(&v[j], &ref_values[i][j], sizeof(float)) != 0;
  }
  runtime.release(exec, comm, 0);
  MEMKIT_CUDA_CHECK(cudaStreamSynchronize(exec.stream));
  MEMKIT_CUDA_CHECK(cudaStreamDestroy(side_stream));
  CHECK(runtime.prefetches() == 1);
  CHECK(params[0].value.data() == nullptr);  // released: the tensors' own buffers are empty again
  return mismatches;
}

}  // namespace

MEMKIT_GPU_TEST_CASE("gpu: stage3_parameters on the device (one rank) steps bit-identically to adam_state on the host") {
  cudaStream_t stream;
  MEMKIT_CUDA_CHECK(cudaStreamCreate(&stream));
  const memkit::cuda_executor exec{0, stream};
  CHECK(stage3_device_mismatches(memkit::distributed::single_communicator{}, exec) == 0);
#if MEMKIT_HAS_NCCL && defined(MEMKIT_TEST_WITH_NCCL)
  int device = 0;
  ncclComm_t comm = nullptr;
  REQUIRE(ncclCommInitAll(&comm, 1, &device) == ncclSuccess);
  CHECK(stage3_device_mismatches(memkit::distributed::nccl_communicator(comm), exec) == 0);
  CHECK(ncclCommDestroy(comm) == ncclSuccess);
#endif
  MEMKIT_CUDA_CHECK(cudaStreamDestroy(stream));
}
