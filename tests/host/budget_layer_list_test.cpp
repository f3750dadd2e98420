// budget::layer_list: a small MLP described by its layers' protocol arguments (layers::dense_linear_arguments,
// lora::forward_arguments / backward_arguments) and parameter bytes, predicted at compile time and checked
// against a tracking_resource while the real layers run a forward and a backward.
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <vector>

#include "memkit/budget/layer_list.hpp"
#include "memkit/core/units.hpp"
#include "memkit/layers/dense_linear.hpp"
#include "memkit/lora/lora_linear.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/tracking.hpp"
#include "memkit/optim/adam_bytes.hpp"
#include "memkit/optim/adam_state.hpp"
#include "support/tracked_memory.hpp"

namespace {

namespace budget = memkit::budget;
namespace ml = memkit::layers;
using memkit::memory_category;
using memkit::shape;

// x [rows, 64] -> up (dense, trained, bias) -> [rows, 96] -> mid (LoRA rank 8 over a frozen fp32 base, dropout)
// -> [rows, 80] -> down (dense, trained) -> [rows, 32].
constexpr std::int64_t in = 64, hidden = 96, mid = 80, out = 32, rank = 8;
constexpr memkit::lora::lora_options lora_options{.rank = rank, .alpha = 16.0, .dropout = 0.1f};

// The trained tensors in the order the optimizer gets them: up.weight, up.bias, mid A, mid B, down.weight.
constexpr std::array<std::int64_t, 5> trained_sizes{hidden * in, hidden, rank * hidden, mid * rank, out * mid};

constexpr budget::layer_list mlp_budget(std::int64_t rows, bool on_device, int host_threads) {
  using value = ml::basic_parameter<float>;
  using lora_layer = memkit::lora::lora_linear<float>;
  const ml::dense_linear_options dense{.host_threads = host_threads};
  memkit::lora::lora_options options = lora_options;
  options.host_threads = host_threads;

  budget::layer_list model;
  model.add({.weights = value::value_bytes(shape{hidden, in}) + value::value_bytes(shape{hidden}),
             .gradients = value::grad_bytes(shape{hidden, in}, ml::trainability::bf16_master) +
                          value::grad_bytes(shape{hidden}, ml::trainability::bf16_master)},
            ml::dense_linear_arguments<float>{.rows = rows, .in = in, .out = hidden, .bias = true, .on_device = on_device,
                                              .options = dense});
  const memkit::lora::forward_arguments<float> forward{.tokens = rows, .in = hidden, .out = mid, .rank = rank,
                                                       .on_device = on_device, .options = options};
  // A training forward with p > 0 applied dropout; dx is wanted.
  const memkit::lora::backward_arguments<float> backward{forward, /*dropout=*/true, /*input_grad=*/true};
  model.add({.weights = memkit::buffer<float>::bytes_required(shape{mid, hidden}) + lora_layer::parameter_bytes(hidden, mid, rank),
             .gradients = lora_layer::gradient_bytes(hidden, mid, rank, false)},
            forward, backward);
  model.add({.weights = value::value_bytes(shape{out, mid}),
             .gradients = value::grad_bytes(shape{out, mid}, ml::trainability::bf16_master)},
            ml::dense_linear_arguments<float>{.rows = rows, .in = mid, .out = out, .on_device = on_device, .options = dense});
  // AdamW over every trained tensor: a "layer" with no operations, only optimizer state.
  model.add({.optimizer_state = memkit::optim::adam_layout<float>::bytes_required(
                                 trained_sizes, memkit::optim::default_min_quantized_size)});
  return model;
}

// Usable in a static_assert: the whole model at 4096 tokens on a device (cuBLAS keeps its own workspace).
constexpr budget::layer_list on_device = mlp_budget(4096, true, 1);
static_assert(on_device.size() == 4);
static_assert(on_device.bytes()[budget::category::activations] ==
              4096 * in * 4 + memkit::lora::saved_activation_bytes(4096, hidden, rank, 4).total() + 4096 * mid * 4);
// lora's backward on CUDA: the held down-projection gradient [tokens, r] and one 256-row chunk of the masked
// input gradient (T = float); cuBLAS takes nothing from the workspace.
static_assert(on_device.bytes()[budget::category::workspace] == 4096 * rank * 4 + 256 * hidden * 4);
static_assert(on_device.fits(16 * memkit::MiB));
static_assert(!on_device.fits(on_device.total() - 1));

TEST_CASE("budget::layer_list predicts a small MLP's weights, gradients, optimizer state, activations and workspace") {
  for (const int threads : {1, 2})
    for (const std::int64_t rows : {std::int64_t{7}, std::int64_t{300}}) {
      CAPTURE(threads);
      CAPTURE(rows);
      const budget::breakdown want = mlp_budget(rows, false, threads).bytes();

      memkit::tracking_resource tracker(memkit::default_host_resource(), "mlp");
      const ml::memory_resources memory = memkit_test::tracked_resources(tracker, threads);

      const auto values = [](std::int64_t n, float scale) {
        std::vector<float> v(static_cast<std::size_t>(n));
        for (std::size_t i = 0; i < v.size(); ++i) v[i] = scale * static_cast<float>(static_cast<int>(i % 13) - 6);
        return v;
      };
      ml::dense_linear<float> up("up.weight", in, hidden, memory, ml::trainability::bf16_master, true);
      up.weight.assign(values(hidden * in, 0.01f).data());
      up.bias.assign(values(hidden, 0.1f).data());
      memkit::buffer<float> base(tracker.category(memory_category::weights), shape{mid, hidden});
      const std::vector<float> base_values = values(mid * hidden, 0.02f);
      for (std::int64_t i = 0; i < base.size(); ++i) base.view()[i] = base_values[static_cast<std::size_t>(i)];
      memkit::lora::lora_options options = lora_options;
      options.host_threads = threads;
      memkit::lora::lora_linear<float> lora(base.view(), memkit::tensor_view<float>::none(), options,
                                            tracker.category(memory_category::weights),
                                            tracker.category(memory_category::gradients),
                                            tracker.category(memory_category::workspace));
      ml::dense_linear<float> down("down.weight", mid, out, memory, ml::trainability::bf16_master);
      down.weight.assign(values(out * mid, 0.01f).data());
      memkit::optim::adam_state<float> adam(memkit::host, tracker.category(memory_category::optimizer_state),
                                            trained_sizes);

      CHECK(tracker.stats(memory_category::weights).current_bytes == want[budget::category::weights]);
      CHECK(tracker.stats(memory_category::gradients).current_bytes == want[budget::category::gradients]);
      CHECK(tracker.stats(memory_category::optimizer_state).current_bytes == want[budget::category::optimizer_state]);

      std::vector<float> x = values(rows * in, 0.05f), h1(static_cast<std::size_t>(rows * hidden)),
                         h2(static_cast<std::size_t>(rows * mid)), y(static_cast<std::size_t>(rows * out));
      std::vector<float> dy = values(rows * out, 0.03f), dh2(h2.size()), dh1(h1.size());
      const auto view = [](std::vector<float>& v, std::int64_t r, std::int64_t c) {
        return memkit::host_view(v.data(), {r, c});
      };
      const auto cview = [](const std::vector<float>& v, std::int64_t r, std::int64_t c) {
        return memkit::host_view(v.data(), {r, c});
      };
      const memkit::forward_context ctx{1, 2, true};
      memkit::activation_store store(tracker.category(memory_category::activations));
      tracker.reset_peak();
      up.forward(memkit::host, ctx, cview(x, rows, in), view(h1, rows, hidden), store);
      lora.forward(memkit::host, ctx, cview(h1, rows, hidden), view(h2, rows, mid), store);
      down.forward(memkit::host, ctx, cview(h2, rows, mid), view(y, rows, out), store);
      // Every saved tensor is alive when the last forward returns: the activations are exactly the prediction.
      CHECK(tracker.stats(memory_category::activations).current_bytes == want[budget::category::activations]);
      CHECK(tracker.stats(memory_category::activations).peak_bytes == want[budget::category::activations]);
      down.backward(memkit::host, cview(dy, rows, out), view(dh2, rows, mid), store);
      lora.backward(memkit::host, cview(dh2, rows, mid), view(dh1, rows, hidden), store);
      up.backward(memkit::host, cview(dh1, rows, hidden), memkit::tensor_view<float>::none(), store);
      CHECK(store.empty());
      CHECK(tracker.stats(memory_category::activations).current_bytes == 0);
      // The workspace's peak over the step is the largest of the operations' workspace_bytes.
      CHECK(tracker.stats(memory_category::workspace).peak_bytes == want[budget::category::workspace]);
      CHECK(tracker.stats(memory_category::workspace).current_bytes == 0);
    }
}

}  // namespace
