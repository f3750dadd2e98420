// memkit/models/llama on a CUDA device against the same transformers / PEFT / bitsandbytes references as the
// host test (tests/host/models_llama_test.cpp, tests/data/models/): every tensor streamed from the checkpoint
// into device memory, the forward on a cuda_executor (cuBLAS in fp32, memkit's attention and kernels), the
// logits copied back.
#include <memkit/models/llama/load.hpp>

#include <memkit/layers/parameters.hpp>
#include <memkit/linalg/gemm.hpp>
#include <memkit/memory/tracking.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "support/gpu_test.hpp"
#include "support/tracked_memory.hpp"

namespace llama = memkit::models::llama;

namespace {

using memkit::shape;
using memkit::tensor_view;

const std::string models_dir = std::string(MEMKIT_TEST_SOURCE_DIR) + "/tests/data/models/";
constexpr std::int64_t batch = 2, seq = 16;

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::abs(double(x)));
  return m;
}
double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double(a[i]) - double(b[i])));
  return m;
}

struct device_memory {
  memkit::cuda_executor exec = memkit::cuda_executor::legacy_default_stream();
  memkit::device_async_resource device{exec.stream, exec.device};
  memkit::tracking_resource tracker{device, "models-cuda"};
  memkit::layers::memory_resources memory = memkit_test::tracked_resources(tracker);
};

// Logits [B*S, V] on the device for the reference ids, copied to the host.
template <class Model>
std::vector<float> device_logits(device_memory& d, Model& model, const std::vector<std::int32_t>& ids) {
  const std::int64_t N = batch * seq, H = model.config.hidden, V = model.config.vocab;
  memkit::memory_resource& acts = d.tracker.category(memkit::memory_category::activations);
  memkit::buffer<std::int32_t> ids_d(acts, shape{batch, seq});
  memkit::buffer<float> hidden(acts, shape{batch, seq, H}), logits(acts, shape{N, V});
  memkit::layers::copy_in(ids.data(), ids_d.view());
  model.forward_hidden(d.exec, std::as_const(ids_d).view(), hidden.view(), acts);
  namespace la = memkit::linalg;
  la::gemm(d.exec, la::transpose::no, la::transpose::yes, 1.0f,
           la::matrix_ref<const float>{hidden.data(), N, H, H, memkit::memory_kind::device},
           la::matrix_ref<const float>{model.head_weight().value.data(), V, H, H, memkit::memory_kind::device}, 0.0f,
           la::matrix_ref<float>{logits.data(), N, V, V, memkit::memory_kind::device}, *d.memory.workspace);
  d.exec.synchronize();
  return memkit::layers::copy_out(std::as_const(logits).view());
}

struct device_pass_result {
  float loss = 0;
  std::vector<std::string> names;
  std::vector<std::vector<float>> grads;
};

// One forward_backward on the device with next-token targets, the MLP tiled by `chunk` tokens (0: untiled);
// the loss and every registered gradient copied back.
template <class Model>
device_pass_result device_pass(device_memory& d, Model& model, const std::vector<std::int32_t>& ids, std::int64_t chunk) {
  std::vector<std::int32_t> targets(ids.size(), -100);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t s = 0; s + 1 < seq; ++s) targets[b * seq + s] = ids[b * seq + s + 1];
  memkit::memory_resource& acts = d.tracker.category(memkit::memory_category::activations);
  memkit::buffer<std::int32_t> ids_d(acts, shape{batch, seq}), targets_d(acts, shape{batch, seq});
  memkit::buffer<float> loss(acts, shape{1});
  memkit::layers::copy_in(ids.data(), ids_d.view());
  memkit::layers::copy_in(targets.data(), targets_d.view());
  memkit::layers::parameter_registry<float> registry;
  model.register_parameters(registry);
  memkit::layers::zero_grad(d.exec, registry);
  model.set_mlp_token_chunk(chunk);
  model.forward_backward(d.exec, std::as_const(ids_d).view(), std::as_const(targets_d).view(), loss.view(), acts);
  d.exec.synchronize();
  device_pass_result out;
  out.loss = memkit::layers::copy_out(std::as_const(loss).view())[0];
  for (const auto& e : registry.entries()) {
    out.names.push_back(e.name);
    out.grads.push_back(memkit::layers::copy_out(tensor_view<const float>(e.grad)));
  }
  return out;
}

}  // namespace

// The sequence-tiled MLP on the device (tests/host/models_llama_tiled_mlp_test.cpp is the host's): each chunk's
// products are cuBLAS calls with fewer rows, which may pick other kernels than the untiled call, so here the
// tiled run is held to the untiled one within fp32 rounding (the host's is bit-identical outside the MLP's
// weight gradients), and the block's saved bytes to saved_bytes() exactly.
MEMKIT_GPU_TEST_CASE("models on a cuda_executor: the tiled MLP gives the untiled loss and gradients, dense and QLoRA") {
  const std::string name = "llama_llama3_bias";
  memkit::safetensors::reader r(models_dir + name + "/reference.safetensors");
  const std::vector<std::int32_t> ids = r.read_vector<std::int32_t>("ids");
  llama::hf_checkpoint ckpt(models_dir + name, seq);
  const auto compare = [&](device_memory& d, auto& model, const char* what) {
    const device_pass_result plain = device_pass(d, model, ids, 0);
    for (const std::int64_t chunk : {std::int64_t{1}, std::int64_t{7}, batch * seq, std::int64_t{50}}) {
      CAPTURE(chunk);
      const device_pass_result tiled = device_pass(d, model, ids, chunk);
      CHECK(std::abs(tiled.loss - plain.loss) <= 1e-5 * std::abs(plain.loss));
      REQUIRE(tiled.names == plain.names);
      double worst = 0;
      for (std::size_t i = 0; i < plain.grads.size(); ++i) {
        CAPTURE(plain.names[i]);
        const double e = max_diff(tiled.grads[i], plain.grads[i]) / std::max(max_abs(plain.grads[i]), 1e-30);
        worst = std::max(worst, e);
        CHECK(e <= 1e-4);
      }
      MESSAGE(std::string(what) << ", chunk " << chunk << ": device loss " << tiled.loss << " (untiled " << plain.loss
                   << "), worst max |tiled - untiled| / max |untiled| over all gradients " << worst);
    }
    // What a tiled block keeps for its backward: saved_bytes(), to the byte.
    auto& block = model.blocks[0];
    block.mlp_token_chunk = 7;
    const shape in{batch, seq, model.config.hidden};
    memkit::memory_resource& acts = d.tracker.category(memkit::memory_category::activations);
    memkit::buffer<float> x(acts, in), y(acts, in);
    memkit::layers::zero_view(d.exec, x.view());
    memkit::activation_store store(acts);
    block.forward(d.exec, {}, std::as_const(x).view(), y.view(), store);
    d.exec.synchronize();
    CHECK(store.bytes() == block.saved_bytes(in, {}));
    store.clear();
    block.mlp_token_chunk = 0;
  };
  {
    device_memory d;
    auto model = llama::load_causal_lm<float>(ckpt, d.memory, memkit::layers::trainability::bf16_master);
    compare(d, *model, "dense");
  }
  {
    device_memory d;
    llama::lora_load_options options;
    options.lora.rank = 4;
    options.lora.alpha = 8;
    auto model = llama::load_lora_causal_lm<float, memkit::quant::quantized_tensor<memkit::quant::NF4>>(d.exec, ckpt, d.memory,
                                                                                                       options);
    llama::load_peft_adapter(*model, models_dir + name + "/adapter");
    compare(d, *model, "QLoRA");
  }
}

MEMKIT_GPU_TEST_CASE("models on a cuda_executor: fp32 logits equal transformers', LoRA logits PEFT's, QLoRA PEFT + bitsandbytes'") {
  for (const char* name : {"llama_llama3_bias", "llama_tied_bf16", "mistral_window", "qwen2_tied", "qwen3_qknorm"}) {
    CAPTURE(name);
    memkit::safetensors::reader r(models_dir + name + "/reference.safetensors");
    const std::vector<std::int32_t> ids = r.read_vector<std::int32_t>("ids");
    const std::vector<float> ref = r.read_vector<float>("logits_fp32"), lora_ref = r.read_vector<float>("logits_lora_fp32");
    llama::hf_checkpoint ckpt(models_dir + name, seq);
    {
      device_memory d;
      auto model = llama::load_causal_lm<float>(ckpt, d.memory);
      const double err = max_diff(device_logits(d, *model, ids), ref);
      MESSAGE(name << ": device fp32 max |logit - transformers| = " << err);
      CHECK(err <= 1e-4 * max_abs(ref));
    }
    {
      device_memory d;
      llama::lora_load_options options;
      options.lora.rank = 4;
      options.lora.alpha = 8;
      auto model = llama::load_lora_causal_lm<float, float>(d.exec, ckpt, d.memory, options);
      llama::load_peft_adapter(*model, models_dir + name + "/adapter");
      const double err = max_diff(device_logits(d, *model, ids), lora_ref);
      MESSAGE(name << ": device LoRA max |logit - PEFT| = " << err);
      CHECK(err <= 1e-4 * max_abs(lora_ref));
    }
    if (r.find("logits_qlora_fp32") != nullptr) {
      const std::vector<float> qlora_ref = r.read_vector<float>("logits_qlora_fp32");
      for (const std::string& dir : {models_dir + name, models_dir + name + "/bnb4"}) {
        device_memory d;
        llama::lora_load_options options;
        options.lora.rank = 4;
        options.lora.alpha = 8;
        auto model = llama::load_lora_causal_lm<float, memkit::quant::quantized_tensor<memkit::quant::NF4>>(
            d.exec, llama::hf_checkpoint(dir, seq), d.memory, options);
        llama::load_peft_adapter(*model, models_dir + name + "/adapter");
        const double err = max_diff(device_logits(d, *model, ids), qlora_ref);
        MESSAGE(dir << ": device QLoRA max |logit - PEFT + bitsandbytes| = " << err);
        CHECK(err <= 1e-3 * max_abs(qlora_ref));  // the host's bound is 1e-4; quant::matmul tiles differ on the device
      }
    }
  }
}

MEMKIT_GPU_TEST_CASE("models on a cuda_executor: packed documents (offsets in device memory) give the host's hidden states") {
  // Row 0: documents of 5, 1 and 10 tokens; row 1: 9 and 7 (tests/host/models_llama_packed_test.cpp checks the
  // host against each document run alone).
  const std::vector<std::int32_t> offsets{0, 5, 6, 16, /**/ 0, 9, 16, 16};
  for (const char* name : {"llama_llama3_bias", "mistral_window", "qwen3_qknorm"}) {
    CAPTURE(name);
    memkit::safetensors::reader r(models_dir + name + "/reference.safetensors");
    const std::vector<std::int32_t> ids = r.read_vector<std::int32_t>("ids");
    llama::hf_checkpoint ckpt(models_dir + name, seq);
    memkit::layers::memory_resources host;
    host.weights = host.gradients = host.optimizer = host.workspace = &memkit::default_host_resource();
    host.host_threads = 2;
    auto host_model = llama::load_causal_lm<float>(ckpt, host);
    const std::int64_t H = host_model->config.hidden;
    std::vector<float> expected(static_cast<std::size_t>(batch * seq * H));
    host_model->forward_hidden(memkit::host, memkit::host_view(ids.data(), shape{batch, seq}),
                               memkit::host_view(expected.data(), shape{batch, seq, H}), memkit::default_host_resource(),
                               memkit::host_view(offsets.data(), shape{batch, 4}));
    device_memory d;
    auto model = llama::load_causal_lm<float>(ckpt, d.memory);
    memkit::memory_resource& acts = d.tracker.category(memkit::memory_category::activations);
    memkit::buffer<std::int32_t> ids_d(acts, shape{batch, seq}), offsets_d(acts, shape{batch, 4});
    memkit::buffer<float> hidden(acts, shape{batch, seq, H});
    memkit::layers::copy_in(ids.data(), ids_d.view());
    memkit::layers::copy_in(offsets.data(), offsets_d.view());
    model->forward_hidden(d.exec, std::as_const(ids_d).view(), hidden.view(), acts, std::as_const(offsets_d).view());
    d.exec.synchronize();
    const std::vector<float> got = memkit::layers::copy_out(std::as_const(hidden).view());
    const double err = max_diff(got, expected);
    MESSAGE(name << ": packed device vs host max |hidden difference| = " << err);
    CHECK(err <= 1e-4 * max_abs(expected));
  }
}
