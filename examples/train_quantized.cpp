// train_quantized: memkit's components in one small training loop, on the host.
//
//   1. At compile time, memory_budget checks that QLoRA fine-tuning of Llama-3.1-8B fits a 24 GB
//      RTX 4090 (change the plan and watch the build fail with the numbers).
//   2. A frozen 4-bit NF4 projection (quantized_tensor, double-quantized scales) feeds a trainable
//      fp32 layer updated with blockwise 8-bit AdamW (adam_state<int8, 256>). The forward pass uses the
//      dequantizing matmul, which never materializes the full fp32 weight.
//   3. Every byte goes through a tracking_resource, and each component's bytes_required() prediction
//      is printed next to what was really allocated.
#include <memkit/memkit.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace budget = memkit::budget;

// QLoRA r=16 on all linear layers, micro-batch 2 x 2048 tokens, activation checkpointing.
constexpr budget::training_plan qlora_plan{.training = budget::method::lora,
                                           .weights = {budget::weight_format::nf4, 64, true},
                                           .micro_batch = 2,
                                           .sequence = 2048,
                                           .checkpoint = budget::checkpointing::every_layer};
static_assert(memkit::fits(budget::presets::llama_3_1_8b, qlora_plan, budget::presets::rtx_4090),
              "QLoRA of Llama-3.1-8B must fit a 24 GB card");

int main() {
  const budget::memory_estimate plan = budget::estimate_memory(budget::presets::llama_3_1_8b, qlora_plan);
  const std::string_view gpu = budget::presets::rtx_4090.name;
  std::printf("memory_budget: Llama-3.1-8B QLoRA r=16, 2 x 2048, checkpointing: peak %s on a %.*s with %s\n\n",
              memkit::format_bytes(plan.peak_device_bytes).c_str(), static_cast<int>(gpu.size()), gpu.data(),
              memkit::format_bytes(budget::presets::rtx_4090.memory_bytes).c_str());

  constexpr std::int64_t batch = 64, features = 512, hidden = 256, outputs = 64, steps = 300;
  memkit::tracking_resource tracker(memkit::default_host_resource(), "train_quantized");
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto randn = [&](std::int64_t count, float scale) {
    std::vector<float> v(static_cast<std::size_t>(count));
    for (float& x : v) x = scale * normal(rng);
    return v;
  };

  // Frozen base: a random projection, quantized to NF4 (block 64, double quantization).
  const memkit::quant::quant_options nf4{64, true};
  const std::vector<float> projection = randn(hidden * features, 1.0f / std::sqrt(float(features)));
  const auto base = memkit::quant::quantized_tensor<memkit::quant::NF4>::quantize(
      memkit::host, memkit::host_view(projection.data(), memkit::shape{hidden, features}), nf4,
      tracker.category(memkit::memory_category::weights), "base.weight");

  // Trainable head and its 8-bit AdamW state; a hidden "teacher" head makes the targets.
  memkit::buffer<float> head(tracker.category(memkit::memory_category::weights), memkit::shape{outputs, hidden});
  memkit::buffer<float> head_grad(tracker.category(memkit::memory_category::gradients), memkit::shape{outputs, hidden});
  for (float& w : head.view()) w = 0.0f;
  const std::vector<float> teacher = randn(outputs * hidden, 1.0f / std::sqrt(float(hidden)));
  const std::vector<std::int64_t> sizes{outputs * hidden};
  memkit::adam_state<std::int8_t, 256> adam(memkit::host, tracker.category(memkit::memory_category::optimizer_state),
                                            sizes);
  const std::vector<memkit::adam_group> groups{{.lr = 3e-3f, .weight_decay = 0.0f}};

  memkit::buffer<float> features_out(tracker.category(memkit::memory_category::activations),
                                     memkit::shape{batch, hidden});
  auto& workspace = tracker.category(memkit::memory_category::workspace);
  for (std::int64_t step = 1; step <= steps; ++step) {
    const std::vector<float> x = randn(batch * features, 1.0f);
    // h = x * dequant(W)^T, through the tiled dequantizing matmul.
    memkit::quant::matmul(memkit::host, memkit::tensor_view<const float>(memkit::host_view(x.data(), {batch, features})),
                          base, features_out.view(), workspace);
    const float* h = features_out.data();
    // Mean squared error against the teacher, and its gradient with respect to the head.
    double loss = 0.0;
    for (float& g : head_grad.view()) g = 0.0f;
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t o = 0; o < outputs; ++o) {
        float prediction = 0.0f, target = 0.0f;
        for (std::int64_t k = 0; k < hidden; ++k) {
          prediction += head.data()[o * hidden + k] * h[b * hidden + k];
          target += teacher[o * hidden + k] * h[b * hidden + k];
        }
        const float error = prediction - target;
        loss += double(error) * error / double(batch * outputs);
        for (std::int64_t k = 0; k < hidden; ++k)
          head_grad.data()[o * hidden + k] += 2.0f * error * h[b * hidden + k] / float(batch * outputs);
      }
    }
    const std::vector<memkit::adam_param<float, float>> params{{head.view(), head_grad.view()}};
    adam.step(memkit::host, params, groups);
    if (step == 1 || step % 50 == 0) std::printf("step %3lld  loss %.6f\n", static_cast<long long>(step), loss);
  }

  std::printf("\n%s\n", tracker.report().c_str());
  std::printf("predicted before allocating, and allocated:\n");
  std::printf("  NF4 base weight       %8zu B predicted  %8zu B allocated\n",
              memkit::quant::quantized_tensor<memkit::quant::NF4>::bytes_required(memkit::shape{hidden, features}, nf4),
              base.bytes());
  std::printf("  8-bit AdamW state     %8zu B predicted  %8zu B allocated\n",
              memkit::adam_state<std::int8_t, 256>::bytes_required(sizes), adam.bytes());
  std::printf("  (fp32 AdamW would take %zu B)\n", memkit::adam_state<float>::bytes_required(sizes));
  return 0;
}
