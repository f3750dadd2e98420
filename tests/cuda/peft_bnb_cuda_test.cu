// PEFT adapters and bitsandbytes optimizer state with device memory (suite "gpu": these need a device):
// an AdamW8bit state imported into a device adam_state steps there exactly as on the host and exports the
// same file; a PEFT adapter loads into device buffers.
#include <memkit/core/random.hpp>
#include <memkit/io/safetensors.hpp>
#include <memkit/peft/peft.hpp>
#include <memkit/memory/buffer.hpp>
#include <memkit/memory/resource.hpp>
#include <memkit/optim/bnb_adam_state.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <unistd.h>
#include <vector>

#include "host/adam_support.hpp"
#include "support/gpu_test.hpp"

namespace {

const std::string peft_data = std::string(MEMKIT_TEST_SOURCE_DIR) + "/tests/data/peft";

template <class T>
memkit::buffer<T> to_device(memkit::memory_resource& resource, const std::vector<T>& values) {
  memkit::buffer<T> out(resource, memkit::shape{static_cast<std::int64_t>(values.size())});
  MEMKIT_CUDA_CHECK(cudaMemcpy(out.data(), values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice));
  return out;
}
template <class T>
std::vector<T> to_host(const T* data, std::size_t count) {
  std::vector<T> out(count);
  MEMKIT_CUDA_CHECK(cudaMemcpy(out.data(), data, count * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

}  // namespace

MEMKIT_GPU_TEST_CASE("gpu: an AdamW8bit state imported into device memory steps and exports as on the host") {
  memkit::device_resource device;
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  const std::string file = peft_data + "/qlora_resume/optimizer_step5.safetensors";
  std::vector<std::int64_t> sizes;
  const memkit::safetensors::reader in(file);
  for (int i = 0; in.find("state." + std::to_string(i) + ".state1"); ++i)
    sizes.push_back(in.info("state." + std::to_string(i) + ".state1").numel());
  memkit::optim::adam_state<std::int8_t, 256> host_state(memkit::host, memkit::default_host_resource(), sizes);
  memkit::optim::adam_state<std::int8_t, 256> device_state(gpu, device, sizes);
  const auto info = memkit::optim::load_bnb_adam_state(memkit::host, host_state, file);
  const auto device_info = memkit::optim::load_bnb_adam_state(gpu, device_state, file);
  CHECK(device_info.step == 5);
  CHECK(device_state.control(gpu).step == 5);
  CHECK(device_state.tensor_state(1).m_codes.where() == memkit::memory_kind::device);

  std::vector<std::vector<float>> params, grads;
  std::vector<memkit::buffer<float>> device_params, device_grads;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    params.emplace_back(static_cast<std::size_t>(sizes[t]));
    grads.emplace_back(static_cast<std::size_t>(sizes[t]));
    for (std::size_t i = 0; i < params[t].size(); ++i) {
      params[t][i] = 0.01f * static_cast<float>((i * 7 + t) % 13) - 0.06f;
      grads[t][i] = memkit::unit_float(memkit::random_word(3, t, i)) * 2e-3f - 1e-3f;
    }
    device_params.push_back(to_device(device, params[t]));
    device_grads.push_back(to_device(device, grads[t]));
  }
  for (int step = 0; step < 3; ++step) {
    std::vector<memkit::optim::adam_param<float, float>> on_host, on_device;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      on_host.push_back({memkit::host_view(params[t]), memkit::host_view(static_cast<const std::vector<float>&>(grads[t])), {},
                         info.group_of_tensor[t]});
      on_device.push_back({device_params[t].view(), device_grads[t].view(), {}, info.group_of_tensor[t]});
    }
    host_state.step(memkit::host, on_host, info.groups);
    device_state.step(gpu, on_device, info.groups);
  }
  gpu.synchronize();
  // The whole state as save() writes it (control block, moments, scales); the raw arenas differ in the
  // gradient-norm scratch, which after a step holds each path's own leftovers.
  CHECK(adam_test::saved_image(memkit::host, host_state) == adam_test::saved_image(gpu, device_state));
  for (std::size_t t = 0; t < sizes.size(); ++t)
    CHECK(std::memcmp(to_host(device_params[t].data(), params[t].size()).data(), params[t].data(), params[t].size() * 4) == 0);

  const std::string exported = "/tmp/memkit_test_gpu_bnb_" + std::to_string(::getpid()) + ".safetensors";
  memkit::optim::save_bnb_adam_state(gpu, device_state, exported, info);
  memkit::optim::adam_state<std::int8_t, 256> back(memkit::host, memkit::default_host_resource(), sizes);
  CHECK(memkit::optim::load_bnb_adam_state(memkit::host, back, exported).step == 8);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    std::vector<float> m_a, v_a, m_b, v_b;
    host_state.read_moments(memkit::host, t, m_a, v_a);
    back.read_moments(memkit::host, t, m_b, v_b);
    CHECK(m_a == m_b);
    CHECK(v_a == v_b);
  }
  std::remove(exported.c_str());
}

MEMKIT_GPU_TEST_CASE("gpu: a PEFT adapter loads into device buffers, and is saved from them") {
  memkit::device_resource device;
  const memkit::peft::adapter_file adapter(peft_data + "/llama_tiny/adapter_fp32");
  const memkit::peft::lora_module& m = adapter.module("model.layers.0.self_attn.v_proj");
  memkit::buffer<float> A(device, memkit::shape{m.rank, m.in_features}), B(device, memkit::shape{m.out_features, m.rank}),
      bias(device, memkit::shape{m.out_features});
  adapter.load(std::vector<memkit::peft::lora_tensors<float>>{{m.path, A.view(), B.view(), bias.view()}});
  CHECK(to_host(A.data(), static_cast<std::size_t>(A.view().size())) == adapter.read<float>(m.a_key()));
  CHECK(to_host(B.data(), static_cast<std::size_t>(B.view().size())) == adapter.read<float>(m.b_key()));
  CHECK(to_host(bias.data(), static_cast<std::size_t>(m.out_features)) == adapter.read<float>(m.bias_key()));

  const std::string dir = "/tmp/memkit_test_gpu_peft_" + std::to_string(::getpid());
  memkit::peft::adapter_writer writer(adapter.config());
  writer.add<float>(m.path, A.view(), B.view(), bias.view());
  writer.write(dir);
  const memkit::peft::adapter_file again(dir);
  CHECK(again.read<float>(m.b_key()) == adapter.read<float>(m.b_key()));
  std::remove((dir + "/adapter_config.json").c_str());
  std::remove((dir + "/adapter_model.safetensors").c_str());
  std::remove(dir.c_str());
}
