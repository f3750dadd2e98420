// distributed::sharded_adam_state on a CUDA device (suite "gpu"): one rank, through single_communicator and,
// when libnccl is linked, through a 1-rank nccl_communicator; parameters bit-identical to adam_state on
// the host after several steps (a NaN step included), for every flavour.
#include <memkit/distributed/communicator.hpp>
#include <memkit/distributed/nccl_communicator.hpp>
#include <memkit/distributed/sharded_adam_state.hpp>
#include <memkit/memory/buffer.hpp>
#include <memkit/memory/resource.hpp>
#include <memkit/optim/adam_state.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "support/gpu_test.hpp"
#include "support/sharded_scenario.hpp"

namespace {

template <class State, int Block, class C>
int device_mismatches(const C& comm, const memkit::cuda_executor& exec) {
  using S = memkit::distributed::sharded_adam_state<State, Block>;
  const auto& sizes = sharded_test::sizes;
  memkit::optim::adam_options options;
  options.max_grad_norm = 0.02f;
  memkit::device_resource device;
  S state(exec, comm, device, sizes, options);
  memkit::optim::adam_state<State, Block> reference(memkit::host, memkit::default_host_resource(), sizes, options);
  std::vector<float> flat(static_cast<std::size_t>(state.flat_size()), 0.0f), grads(flat.size());
  std::vector<std::vector<float>> ref_params(sizes.size()), ref_grads(sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i)
    for (float x : memkit_test::standard_normal(sizes[i], 3000 + static_cast<unsigned>(i))) {
      ref_params[i].push_back(0.1f * x);
      flat[static_cast<std::size_t>(state.flat_offset(i)) + ref_params[i].size() - 1] = 0.1f * x;
    }
  memkit::buffer<float> d_params(device, memkit::shape{state.flat_size()}), d_grads(device, memkit::shape{state.flat_size()});
  MEMKIT_CUDA_CHECK(cudaMemcpyAsync(d_params.data(), flat.data(), d_params.bytes(), cudaMemcpyHostToDevice, exec.stream));
  const memkit::distributed::sharded_step_options step_options{.tensor_groups = sharded_test::tensor_groups};
  for (int s = 0; s < 5; ++s) {
    std::fill(grads.begin(), grads.end(), 0.0f);
    std::vector<memkit::optim::adam_param<float, float>> params;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      ref_grads[i].resize(static_cast<std::size_t>(sizes[i]));
      for (std::int64_t j = 0; j < sizes[i]; ++j) {
        const float g = s == 2 && i == 4 && j == 17 ? std::numeric_limits<float>::quiet_NaN()
                                                    : sharded_test::local_gradient(s, i, j, 0);
        ref_grads[i][static_cast<std::size_t>(j)] = g;
        grads[static_cast<std::size_t>(state.flat_offset(i) + j)] = g;
      }
      params.push_back({memkit::host_view(ref_params[i]), memkit::host_view(std::as_const(ref_grads[i])), {},
                        sharded_test::tensor_groups[i]});
    }
    MEMKIT_CUDA_CHECK(cudaMemcpyAsync(d_grads.data(), grads.data(), d_grads.bytes(), cudaMemcpyHostToDevice, exec.stream));
    state.step_full_gradients(exec, comm, d_params.view(), d_grads.view(), sharded_test::groups, step_options);
    reference.step(memkit::host, params, sharded_test::groups);
  }
  MEMKIT_CUDA_CHECK(cudaMemcpyAsync(flat.data(), d_params.data(), d_params.bytes(), cudaMemcpyDeviceToHost, exec.stream));
  exec.synchronize();
  CHECK(state.report(exec).skipped_steps == 1);
  int mismatches = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i)
    for (std::int64_t j = 0; j < sizes[i]; ++j)
      if (std::memcmp(&flat[static_cast<std::size_t>(state.flat_offset(i) + j)], &ref_params[i][static_cast<std::size_t>(j)],
                      sizeof(float)) != 0)
        ++mismatches;
  return mismatches;
}

template <class C>
void every_flavour(const C& comm, const memkit::cuda_executor& exec) {
  CHECK(device_mismatches<float, 0>(comm, exec) == 0);
  CHECK(device_mismatches<memkit::bf16, 0>(comm, exec) == 0);
  CHECK(device_mismatches<std::int8_t, 256>(comm, exec) == 0);
  CHECK(device_mismatches<memkit::optim::four_bit, 128>(comm, exec) == 0);
}

}  // namespace

MEMKIT_GPU_TEST_CASE("gpu: sharded_adam_state on the device (one rank) steps bit-identically to adam_state on the host") {
  cudaStream_t stream;
  MEMKIT_CUDA_CHECK(cudaStreamCreate(&stream));
  const memkit::cuda_executor exec{0, stream};
  every_flavour(memkit::distributed::single_communicator{}, exec);
#if MEMKIT_HAS_NCCL && defined(MEMKIT_TEST_WITH_NCCL)
  int device = 0;
  ncclComm_t comm = nullptr;
  REQUIRE(ncclCommInitAll(&comm, 1, &device) == ncclSuccess);
  every_flavour(memkit::distributed::nccl_communicator(comm), exec);
  CHECK(ncclCommDestroy(comm) == ncclSuccess);
#endif
  MEMKIT_CUDA_CHECK(cudaStreamDestroy(stream));
}
