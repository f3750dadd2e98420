// memory_budget against what memkit really allocates: build a small Llama-style model's weights,
// gradients, master copies and optimizer state with memkit's own components through a
// tracking_resource, and compare each category with the calculator's prediction for the same plan.
// The tensor list here is written out by hand from the architecture, independently of the
// calculator's own enumeration.
#include <doctest/doctest.h>
#include <memkit/memkit.hpp>

#include <cstdint>
#include <random>
#include <vector>

using namespace memkit::budget;
using memkit::memory_category;

namespace {

constexpr std::int64_t hidden = 256, layers = 2, heads = 4, kv_heads = 2, ffn = 704, vocab = 1000, rank = 8;
constexpr std::int64_t head_dim = hidden / heads, kv_dim = kv_heads * head_dim;
constexpr model_config tiny = llama_style("tiny", hidden, layers, heads, kv_heads, ffn, vocab, false, 0);

// Every allocation counted exactly: no context, no workspace, no rounding.
constexpr overhead_settings exact_bytes{.cuda_context_bytes = 0, .nccl_bytes = 0, .workspace_bytes = 0,
                                        .allocation_granularity = 1, .fragmentation_percent = 0};

struct linear_shape {
  std::int64_t out, in;
};
// q, k, v, o, gate, up, down of one decoder block.
const std::vector<linear_shape> tiny_block_linears = {{hidden, hidden}, {kv_dim, hidden}, {kv_dim, hidden}, {hidden, hidden},
                                                 {ffn, hidden},    {ffn, hidden},    {hidden, ffn}};

std::vector<float> random_weights(std::int64_t count, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> values(static_cast<std::size_t>(count));
  for (float& v : values) v = normal(rng);
  return values;
}

const memkit::budget::breakdown& step_phase_of(const memory_estimate& e) {
  return e.phases[static_cast<int>(step_phase::optimizer_step)];
}

}  // namespace

TEST_CASE("budget vs tracking_resource: QLoRA with NF4 base, bf16 adapters and 8-bit AdamW") {
  static_assert(parameter_count(tiny) ==
                static_cast<std::uint64_t>(layers * (2 * hidden * hidden + 2 * kv_dim * hidden + 3 * ffn * hidden +
                                                     2 * hidden) +
                                           hidden + 2 * vocab * hidden));
  // The memkit runtime: lora_linear keeps its adapters' gradients in fp32 (lora/lora_linear.hpp).
  const training_plan plan{.runtime = runtime_kind::memkit,
                           .training = method::lora,
                           .weights = {weight_format::nf4, 64, true},
                           .lora = {rank, all_linear_modules, false},
                           .optimizer = optimizer_kind::adamw_8bit,
                           .logits = logits_mode::chunked,
                           .overhead = exact_bytes};
  const memory_estimate predicted = estimate_memory(tiny, plan);
  REQUIRE(predicted.valid());

  memkit::tracking_resource tracker(memkit::default_host_resource(), "tiny-qlora");
  std::mt19937 rng(5);
  std::vector<memkit::quant::quantized_tensor<memkit::quant::NF4>> base;
  std::vector<memkit::buffer<memkit::bf16>> dense, adapters;
  std::vector<memkit::buffer<float>> adapter_grads;
  std::vector<memkit::buffer<float>> masters;
  std::vector<std::int64_t> adapter_sizes;
  auto& weights = tracker.category(memory_category::weights);
  for (int layer = 0; layer < layers; ++layer) {
    for (const linear_shape& linear : tiny_block_linears) {
      const std::vector<float> w = random_weights(linear.out * linear.in, rng);
      base.push_back(memkit::quant::quantized_tensor<memkit::quant::NF4>::quantize(
          memkit::host, memkit::host_view(w.data(), memkit::shape{linear.out, linear.in}), {64, true}, weights));
      for (const memkit::shape adapter : {memkit::shape{rank, linear.in}, memkit::shape{linear.out, rank}}) {
        adapters.emplace_back(weights, adapter);
        adapter_grads.emplace_back(tracker.category(memory_category::gradients), adapter);
        masters.emplace_back(tracker.category(memory_category::other), adapter);  // fp32 master copy
        adapter_sizes.push_back(adapter.numel());
      }
    }
    dense.emplace_back(weights, memkit::shape{hidden});  // input RMSNorm
    dense.emplace_back(weights, memkit::shape{hidden});  // post-attention RMSNorm
  }
  dense.emplace_back(weights, memkit::shape{hidden});         // final norm
  dense.emplace_back(weights, memkit::shape{vocab, hidden});  // token embedding
  dense.emplace_back(weights, memkit::shape{vocab, hidden});  // LM head (untied)
  memkit::optim::adam_state<std::int8_t, 256> adam(memkit::host, tracker.category(memory_category::optimizer_state),
                                            adapter_sizes);

  const auto& step = step_phase_of(predicted);
  CHECK(predicted.trainable_parameters == [&] {
    std::uint64_t total = 0;
    for (std::int64_t n : adapter_sizes) total += static_cast<std::uint64_t>(n);
    return total;
  }());
  CHECK(tracker.stats(memory_category::weights).current_bytes == step[category::weights]);
  CHECK(tracker.stats(memory_category::gradients).current_bytes == step[category::gradients]);
  CHECK(tracker.stats(memory_category::other).current_bytes == step[category::master_weights]);
  CHECK(tracker.stats(memory_category::optimizer_state).current_bytes == step[category::optimizer_state]);
}

TEST_CASE("budget vs tracking_resource: full bf16-mixed training with fp32 AdamW") {
  // The memkit runtime: fp32 gradients (as the example's parameters keep them), adam_state's own bytes.
  const training_plan plan{.runtime = runtime_kind::memkit, .optimizer = optimizer_kind::adamw,
                           .logits = logits_mode::chunked, .overhead = exact_bytes};
  const memory_estimate predicted = estimate_memory(tiny, plan);
  REQUIRE(predicted.valid());

  memkit::tracking_resource tracker(memkit::default_host_resource(), "tiny-full");
  std::vector<memkit::shape> tensors;
  for (int layer = 0; layer < layers; ++layer) {
    for (const linear_shape& linear : tiny_block_linears) tensors.push_back(memkit::shape{linear.out, linear.in});
    tensors.push_back(memkit::shape{hidden});
    tensors.push_back(memkit::shape{hidden});
  }
  tensors.push_back(memkit::shape{hidden});
  tensors.push_back(memkit::shape{vocab, hidden});
  tensors.push_back(memkit::shape{vocab, hidden});

  std::vector<memkit::buffer<memkit::bf16>> weights;
  std::vector<memkit::buffer<float>> gradients, masters;
  std::vector<std::int64_t> sizes;
  for (const memkit::shape& dims : tensors) {
    weights.emplace_back(tracker.category(memory_category::weights), dims);
    gradients.emplace_back(tracker.category(memory_category::gradients), dims);
    masters.emplace_back(tracker.category(memory_category::other), dims);
    sizes.push_back(dims.numel());
  }
  memkit::optim::adam_state<float> adam(memkit::host, tracker.category(memory_category::optimizer_state), sizes);

  const auto& step = step_phase_of(predicted);
  CHECK(predicted.parameters == tracker.stats(memory_category::weights).current_bytes / 2);
  CHECK(tracker.stats(memory_category::weights).current_bytes == step[category::weights]);
  CHECK(tracker.stats(memory_category::gradients).current_bytes == step[category::gradients]);
  CHECK(tracker.stats(memory_category::other).current_bytes == step[category::master_weights]);
  CHECK(tracker.stats(memory_category::optimizer_state).current_bytes == step[category::optimizer_state]);
}
