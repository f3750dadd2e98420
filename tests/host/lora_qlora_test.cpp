// A short QLoRA fine-tune on the host: an NF4 base (double-quantized, block 64), a LoRA adapter with dropout,
// 8-bit AdamW (bitsandbytes' layout, block 256). The loss must fall, and every byte the tracker counts must be
// what lora_linear, quantized_tensor and adam_state said they would take, category by category.
#include <doctest/doctest.h>

#include <memkit/optim/adam_state.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "lora_support.hpp"

using namespace lora_test;
using memkit::activation_store;
using memkit::forward_context;
using memkit::memory_category;
using memkit::tracking_resource;

TEST_CASE("lora_linear: a QLoRA fine-tune (NF4 base, LoRA with dropout, 8-bit AdamW) learns, in predicted memory") {
  using layer_type = lora_linear<q::quantized_tensor<q::NF4>, float>;
  const std::int64_t in = 128, out = 128, rank = 32, tokens = 96, steps = 60;
  const q::quant_options nf4{64, true};
  const lora_options options{.rank = rank, .alpha = 32.0, .dropout = 0.05f, .init_seed = 3};

  tracking_resource tracker(memkit::default_host_resource(), "qlora");
  auto& weights = tracker.category(memory_category::weights);
  base_weight<q::quantized_tensor<q::NF4>, float> base(in, out, false, 101, weights, nf4);
  layer_type layer(base.ref(), options, weights, tracker.category(memory_category::gradients),
                   tracker.category(memory_category::workspace));
  memkit::optim::adam_state<std::int8_t, 256> adam(memkit::host, tracker.category(memory_category::optimizer_state),
                                            layer.parameter_sizes());
  CHECK(adam.is_quantized(0));  // A and B both have 4096 elements: 8-bit moments, as bitsandbytes keeps them
  CHECK(adam.is_quantized(1));

  // What each category must hold, from the components' own functions.
  const std::size_t weight_bytes = q::quantized_tensor<q::NF4>::bytes_required(shape{out, in}, nf4) +
                                   layer_type::parameter_bytes(in, out, rank);
  const std::size_t gradient_bytes = layer_type::gradient_bytes(in, out, rank, false);
  const std::size_t optimizer_bytes = memkit::optim::adam_state<std::int8_t, 256>::bytes_required(layer.parameter_sizes());
  // The protocol's arguments of the two passes, from the layer (NF4 blocks of 64; dropout on; no dx).
  const auto forward = layer.forward_arguments(tokens);
  const auto backward = layer.backward_arguments(tokens, /*dropout=*/true, /*input_grad=*/false);
  static_assert(memkit::operation_arguments<decltype(forward)> && memkit::operation_arguments<decltype(backward)>);
  const std::size_t saved_bytes = memkit::lora::saved_bytes(forward);
  CHECK(saved_bytes == memkit::lora::saved_activation_bytes(tokens, in, rank, sizeof(float)).total());
  const std::size_t workspace_bytes = std::max(memkit::lora::workspace_bytes(forward), memkit::lora::workspace_bytes(backward));

  // The target: the frozen base plus a rank-4 change the adapter has to find.
  std::vector<double> target_weight(base.effective.begin(), base.effective.end());
  const std::vector<float> u = memkit_test::uniform_values(out * 4, 102), v = memkit_test::uniform_values(4 * in, 103);
  for (std::int64_t o = 0; o < out; ++o)
    for (std::int64_t i = 0; i < in; ++i)
      for (std::int64_t k = 0; k < 4; ++k)
        target_weight[static_cast<std::size_t>(o * in + i)] +=
            0.1 * u[static_cast<std::size_t>(o * 4 + k)] * v[static_cast<std::size_t>(k * in + i)];

  const std::vector<memkit::optim::adam_group> groups{{.lr = 5e-3f, .weight_decay = 0.0f}};
  std::vector<float> y(static_cast<std::size_t>(tokens * out)), dy(y.size()), target(y.size());
  std::vector<double> losses;
  activation_store store(tracker.category(memory_category::activations));
  for (std::int64_t step = 0; step < steps; ++step) {
    const std::vector<float> x = memkit_test::uniform_values(tokens * in, 200 + static_cast<unsigned>(step));
    for (std::int64_t t = 0; t < tokens; ++t)
      for (std::int64_t o = 0; o < out; ++o) {
        double s = 0.0;
        for (std::int64_t i = 0; i < in; ++i)
          s += x[static_cast<std::size_t>(t * in + i)] * target_weight[static_cast<std::size_t>(o * in + i)];
        target[static_cast<std::size_t>(t * out + o)] = static_cast<float>(s);
      }
    tracker.reset_peak();
    const forward_context ctx{17, static_cast<std::uint64_t>(step), true};
    layer.forward(host, ctx, host_view(x.data(), {tokens, in}), host_view(y.data(), {tokens, out}), store);
    double loss = 0.0;  // mean squared error over the outputs, and its gradient
    for (std::size_t i = 0; i < y.size(); ++i) {
      const double diff = static_cast<double>(y[i]) - target[i];
      loss += diff * diff / static_cast<double>(y.size());
      dy[i] = static_cast<float>(2.0 * diff / static_cast<double>(y.size()));
    }
    losses.push_back(loss);
    layer.zero_grad();
    layer.backward(host, host_view(dy.data(), {tokens, out}), memkit::tensor_view<float>::none(), store);
    const std::vector<memkit::optim::adam_param<float, float>> params{{layer.lora_A(), layer.grad_A()},
                                                               {layer.lora_B(), layer.grad_B()}};
    adam.step(host, params, groups);
    REQUIRE(adam.report(host).applied);

    CAPTURE(step);
    CHECK(tracker.stats(memory_category::weights).peak_bytes == weight_bytes);
    CHECK(tracker.stats(memory_category::gradients).peak_bytes == gradient_bytes);
    CHECK(tracker.stats(memory_category::optimizer_state).peak_bytes == optimizer_bytes);
    CHECK(tracker.stats(memory_category::activations).peak_bytes == saved_bytes);
    CHECK(tracker.stats(memory_category::activations).current_bytes == 0);
    CHECK(tracker.stats(memory_category::workspace).peak_bytes == workspace_bytes);
    CHECK(tracker.stats(memory_category::other).peak_bytes == 0);
  }
  MESSAGE("QLoRA loss: step 0 " << losses.front() << ", step " << steps - 1 << " " << losses.back());
  CHECK(losses.back() < 0.1 * losses.front());
  CHECK(tracker.stats(memory_category::weights).current_bytes == weight_bytes);
}
