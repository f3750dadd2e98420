// Activation checkpointing on the host: one training step (forward + backward) of a stack of residual MLP
// blocks, y = x + W2 gelu(W1 x), under each schedule, against the obvious baseline, no checkpointing.
// Reports the step time, the peak activation bytes a tracking_resource measured (and the prediction, which
// must be equal), the recomputed block forwards, and for offloaded schedules the host bytes.
//
// Arguments: layers, tokens, hidden width (the MLP is 4x wider). The GEMMs are linalg::gemm's host path on
// one thread; the step is compute-bound, so the time is the schedule's recomputation, not memory traffic.
#include <benchmark/benchmark.h>
#include <memkit/memkit.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

using memkit::activation_store;
using memkit::forward_context;
using memkit::shape;
using memkit::tensor_view;
namespace la = memkit::linalg;

// y = x + W2 gelu(W1 x) over rows of x; saves x and the pre-activation W1 x.
struct mlp_block {
  using value_type = float;
  std::int64_t d = 0, f = 0;
  std::vector<float> w1, w2, w1_grad, w2_grad;

  mlp_block(std::int64_t width, std::uint32_t seed) : d(width), f(4 * width) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(float(width)));
    for (std::int64_t i = 0; i < d * f; ++i) w1.push_back(normal(rng)), w2.push_back(0.5f * normal(rng));
    w1_grad.assign(d * f, 0.0f);
    w2_grad.assign(d * f, 0.0f);
  }

  static float gelu(float u) { return 0.5f * u * (1.0f + std::tanh(0.7978845608f * (u + 0.044715f * u * u * u))); }
  static float gelu_grad(float u) {
    const float t = std::tanh(0.7978845608f * (u + 0.044715f * u * u * u));
    return 0.5f * (1.0f + t) + 0.5f * u * (1.0f - t * t) * 0.7978845608f * (1.0f + 3.0f * 0.044715f * u * u);
  }

  shape output_shape(const shape& s) const { return s; }
  std::size_t saved_bytes(const shape& s, const forward_context&) const {
    return activation_store::bytes_required<float>(s) + activation_store::bytes_required<float>({s[0], f});
  }
  void forward(const memkit::host_executor& exec, const forward_context&, tensor_view<const float> x,
               tensor_view<float> y, activation_store& store) {
    const std::int64_t rows = x.shape()[0];
    tensor_view<float> kept_x = store.save<float>(x.shape());
    tensor_view<float> u = store.save<float>({rows, f});
    std::memcpy(kept_x.data(), x.data(), x.bytes());
    la::gemm(exec, la::transpose::no, la::transpose::yes, 1.0f, la::as_matrix(x, rows, d), matrix(w1, f, d), 0.0f,
             la::as_matrix(u, rows, f), memkit::default_host_resource());
    std::vector<float> g(u.size());
    for (std::int64_t i = 0; i < u.size(); ++i) g[i] = gelu(u[i]);
    std::memcpy(y.data(), x.data(), x.bytes());
    la::gemm(exec, la::transpose::no, la::transpose::yes, 1.0f, la::matrix_ref<const float>{g.data(), rows, f, f,
                                                                                            memkit::memory_kind::host},
             matrix(w2, d, f), 1.0f, la::as_matrix(y, rows, d), memkit::default_host_resource());
  }
  void backward(const memkit::host_executor& exec, tensor_view<const float> dy, tensor_view<float> dx,
                activation_store& store) {
    const std::int64_t rows = dy.shape()[0];
    memkit::saved_tensor<float> u = store.take<float>({rows, f}, "mlp_block");
    memkit::saved_tensor<float> x = store.take<float>({rows, d}, "mlp_block");
    std::vector<float> g(u.view().size()), du(u.view().size());
    for (std::int64_t i = 0; i < u.view().size(); ++i) g[i] = gelu(u.view()[i]);
    const la::matrix_ref<const float> g_matrix{g.data(), rows, f, f, memkit::memory_kind::host};
    la::gemm(exec, la::transpose::yes, la::transpose::no, 1.0f, la::as_matrix(dy, rows, d), g_matrix, 1.0f,
             mutable_matrix(w2_grad, d, f), memkit::default_host_resource());
    la::gemm(exec, la::transpose::no, la::transpose::no, 1.0f, la::as_matrix(dy, rows, d), matrix(w2, d, f), 0.0f,
             la::matrix_ref<float>{du.data(), rows, f, f, memkit::memory_kind::host}, memkit::default_host_resource());
    for (std::int64_t i = 0; i < u.view().size(); ++i) du[i] *= gelu_grad(u.view()[i]);
    const la::matrix_ref<const float> du_matrix{du.data(), rows, f, f, memkit::memory_kind::host};
    la::gemm(exec, la::transpose::yes, la::transpose::no, 1.0f, du_matrix,
             la::as_matrix(tensor_view<const float>(x.view()), rows, d), 1.0f, mutable_matrix(w1_grad, f, d),
             memkit::default_host_resource());
    std::memcpy(dx.data(), dy.data(), dy.bytes());
    la::gemm(exec, la::transpose::no, la::transpose::no, 1.0f, du_matrix, matrix(w1, f, d), 1.0f,
             la::as_matrix(dx, rows, d), memkit::default_host_resource());
  }

  static la::matrix_ref<const float> matrix(const std::vector<float>& m, std::int64_t rows, std::int64_t cols) {
    return {m.data(), rows, cols, cols, memkit::memory_kind::host};
  }
  static la::matrix_ref<float> mutable_matrix(std::vector<float>& m, std::int64_t rows, std::int64_t cols) {
    return {m.data(), rows, cols, cols, memkit::memory_kind::host};
  }
};
static_assert(memkit::layer<mlp_block, memkit::host_executor>);

void BM_checkpointed_step(benchmark::State& state, memkit::checkpoint::schedule schedule, bool offload) {
  const std::int64_t layers = state.range(0), tokens = state.range(1), width = state.range(2);
  std::vector<mlp_block> blocks;
  for (std::int64_t i = 0; i < layers; ++i) blocks.emplace_back(width, static_cast<std::uint32_t>(i));
  memkit::tracking_resource device(memkit::default_host_resource(), "activations");
  memkit::tracking_resource host(memkit::default_host_resource(), "offloaded");
  memkit::checkpoint::offload offloaded(host.category(memkit::memory_category::activations));
  activation_store store(device.category(memkit::memory_category::activations));
  memkit::checkpoint::segment stack(blocks, {.schedule = schedule, .offload = offload ? &offloaded : nullptr});
  const shape in{tokens, width};
  std::vector<float> x(in.numel()), y(in.numel()), dy(in.numel()), dx(in.numel());
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : x) v = normal(rng);
  for (float& v : dy) v = 0.01f * normal(rng);
  const forward_context ctx{7, 0, true};
  for (auto _ : state) {
    stack.forward(memkit::host, ctx, memkit::host_view<const float>(x.data(), in), memkit::host_view(y.data(), in),
                  store);
    stack.backward(memkit::host, memkit::host_view<const float>(dy.data(), in), memkit::host_view(dx.data(), in),
                   store);
    benchmark::DoNotOptimize(dx.data());
  }
  const memkit::checkpoint::checkpoint_cost cost = stack.cost(in, ctx);
  if (device.peak_bytes() != cost.peak_bytes || host.peak_bytes() != cost.host_bytes)
    state.SkipWithError("measured activation bytes differ from the prediction");
  state.counters["peak_MiB"] = static_cast<double>(device.peak_bytes()) / (1 << 20);
  state.counters["predicted_MiB"] = static_cast<double>(cost.peak_bytes) / (1 << 20);
  state.counters["host_MiB"] = static_cast<double>(host.peak_bytes()) / (1 << 20);
  state.counters["recomputed"] = static_cast<double>(cost.recomputed_forwards);
  state.counters["forwards_per_layer"] =
      static_cast<double>(layers + static_cast<std::int64_t>(cost.recomputed_forwards)) / static_cast<double>(layers);
}

const auto shapes = [](benchmark::internal::Benchmark* b) {
  b->Args({16, 256, 128})->Args({2, 16, 16})->Unit(benchmark::kMillisecond)->UseRealTime();
};
BENCHMARK_CAPTURE(BM_checkpointed_step, none, memkit::checkpoint::schedule::none(), false)->Apply(shapes);
BENCHMARK_CAPTURE(BM_checkpointed_step, every_layer, memkit::checkpoint::schedule::every_layer(), false)->Apply(shapes);
BENCHMARK_CAPTURE(BM_checkpointed_step, every_layer_offload, memkit::checkpoint::schedule::every_layer(), true)->Apply(shapes);
BENCHMARK_CAPTURE(BM_checkpointed_step, every_4, memkit::checkpoint::schedule::every_k_layers(4), false)->Apply(shapes);
BENCHMARK_CAPTURE(BM_checkpointed_step, sqrt, memkit::checkpoint::schedule::sqrt(), false)->Apply(shapes);
BENCHMARK_CAPTURE(BM_checkpointed_step, sqrt_offload, memkit::checkpoint::schedule::sqrt(), true)->Apply(shapes);
BENCHMARK_CAPTURE(BM_checkpointed_step, single_segment, memkit::checkpoint::schedule::single_segment(), false)->Apply(shapes);
BENCHMARK_CAPTURE(BM_checkpointed_step, binomial_1, memkit::checkpoint::schedule::binomial(1), false)->Apply(shapes);
BENCHMARK_CAPTURE(BM_checkpointed_step, binomial_2, memkit::checkpoint::schedule::binomial(2), false)->Apply(shapes);
BENCHMARK_CAPTURE(BM_checkpointed_step, binomial_4, memkit::checkpoint::schedule::binomial(4), false)->Apply(shapes);
BENCHMARK_CAPTURE(BM_checkpointed_step, binomial_8, memkit::checkpoint::schedule::binomial(8), false)->Apply(shapes);
BENCHMARK_CAPTURE(BM_checkpointed_step, binomial_16, memkit::checkpoint::schedule::binomial(16), false)->Apply(shapes);

}  // namespace

BENCHMARK_MAIN();
