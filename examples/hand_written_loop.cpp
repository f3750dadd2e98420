// A training loop written by hand from memkit's layers/ pieces: a dense layer learns a fixed linear map.
#include <memkit/memkit.hpp>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

int main() {
  namespace ml = memkit::layers;
  using memkit::shape;
  constexpr std::int64_t batch = 64, in = 16, out = 4, steps = 300;

  // The model: y = x W^T + b in fp32 on the host (memory_resources{}: every tensor from the default host
  // resource). A trainable fp32 value is its own master copy.
  const ml::memory_resources memory;
  ml::dense_linear<float> layer("linear.weight", in, out, memory, ml::trainability::bf16_master, /*with_bias=*/true);
  layer.weight.init_normal(0.02f, /*seed=*/1, /*stream=*/1);

  // Its parameters, registered by the layer: weight decay on matrices, none on the bias.
  ml::parameter_registry<float> params({{.name = "decay", .weight_decay = 0.01f}, {.name = "no_decay", .weight_decay = 0.0f}},
                                       [](const std::string&, const shape& s) { return s.rank == 2 ? 0 : 1; });
  layer.register_parameters(params);
  memkit::optim::adam_state<float> adam(memkit::host, memkit::default_host_resource(), params.sizes());
  const auto adam_params = params.adam_params();
  const memkit::optim::adam_group adam_base{};  // betas and eps; lr and weight decay come from the schedule and the groups
  const ml::cosine_schedule lr{.peak = 3e-2f, .warmup_steps = 30, .total_steps = steps, .final_fraction = 0.1f};

  // The data: one batch of inputs and the targets of a fixed linear map.
  std::vector<float> x(batch * in), target(batch * out, 0.0f), y(batch * out), dy(batch * out);
  for (std::int64_t i = 0; i < batch * in; ++i)
    x[i] = 2.0f * memkit::unit_float(memkit::random_word(7, 0, static_cast<std::uint64_t>(i))) - 1.0f;
  for (std::int64_t r = 0; r < batch; ++r)
    for (std::int64_t o = 0; o < out; ++o) {
      target[r * out + o] = 0.1f * static_cast<float>(o);
      for (std::int64_t i = 0; i < in; ++i) target[r * out + o] += 0.5f * static_cast<float>((i + o) % 3 - 1) * x[r * in + i];
    }
  const auto x_view = memkit::host_view(x).reshaped(shape{batch, in});
  const auto y_view = memkit::host_view(y).reshaped(shape{batch, out});
  const auto dy_view = memkit::host_view(dy).reshaped(shape{batch, out});

  memkit::activation_store store(memkit::default_host_resource());  // what the forward saves for the backward
  float first = 0.0f, loss = 0.0f;
  for (std::int64_t step = 0; step < steps; ++step) {
    ml::zero_grad(memkit::host, params);
    layer.forward(memkit::host, {}, x_view, y_view, store);
    // Mean squared error and its gradient, by hand.
    loss = 0.0f;
    for (std::int64_t i = 0; i < batch * out; ++i) {
      const float d = y[i] - target[i];
      loss += d * d / static_cast<float>(batch * out);
      dy[i] = 2.0f * d / static_cast<float>(batch * out);
    }
    layer.backward(memkit::host, dy_view, memkit::tensor_view<float>::none(), store);  // no input gradient
    adam.step(memkit::host, adam_params, params.adam_groups(adam_base, lr(step)));
    if (step == 0) first = loss;
    if (step % 100 == 0 || step + 1 == steps)
      std::printf("step %3lld  loss %.6f  lr %.2e\n", static_cast<long long>(step), loss, lr(step));
  }
  std::printf("loss %.6f -> %.6f\n", first, loss);
  return loss < first / 100.0f ? 0 : 1;
}
