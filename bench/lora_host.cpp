// lora_linear on the host: one forward + backward (with the input gradient) against the obvious baseline, a
// dense trainable linear of the same shape (y = x W^T, dW = dy^T x, dx = dy W on linalg::gemm), for a dense
// fp32 base and an NF4 base (block 64, double quantization), rank 16. Reports the step time, the GEMM rate of
// the step's products, and what a tracking_resource measured: bytes saved for backward, gradient bytes, and
// the weights' bytes (frozen base + adapters, or the trainable weight).
//
// Arguments: in, out, tokens (batch * sequence). Every hardware thread is used (memkit's host threads).
// The large shapes run one iteration each: on a 2-core machine a 4096 x 11008 x 4096-token step takes seconds.
#include <benchmark/benchmark.h>
#include <memkit/lora/lora_linear.hpp>
#include <memkit/memory/tracking.hpp>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "support/cpu_info.hpp"

namespace {

namespace la = memkit::linalg;
namespace q = memkit::quant;
using memkit::activation_store;
using memkit::memory_category;
using memkit::shape;
using memkit::tensor_view;

std::vector<float> random_values(std::int64_t count, unsigned seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-scale, scale);
  std::vector<float> v(static_cast<std::size_t>(count));
  for (float& x : v) x = uniform(rng);
  return v;
}

constexpr std::int64_t rank = 16;

// The baseline: every weight trains. Saves its input, accumulates dW, writes dx.
struct dense_linear {
  std::int64_t in, out;
  memkit::buffer<float> weight, grad;
  memkit::memory_resource* workspace;
  int threads;

  void forward(tensor_view<const float> x, tensor_view<float> y, activation_store& store) const {
    const std::int64_t M = x.size() / in;
    tensor_view<float> kept = store.save<float>(x.shape());
    std::memcpy(kept.data(), x.data(), x.bytes());
    la::gemm(memkit::host, la::transpose::no, la::transpose::yes, 1.0f, la::as_matrix(x, M, in),
             la::as_matrix(tensor_view<const float>(weight.view()), out, in), 0.0f, la::as_matrix(y, M, out), *workspace,
             {threads});
  }
  void backward(tensor_view<const float> dy, tensor_view<float> dx, activation_store& store) {
    const std::int64_t M = dy.size() / out;
    memkit::saved_tensor<float> x = store.take<float>(shape{M, in});
    la::gemm(memkit::host, la::transpose::yes, la::transpose::no, 1.0f, la::as_matrix(dy, M, out),
             la::as_matrix(tensor_view<const float>(x.view()), M, in), 1.0f, la::as_matrix(grad.view(), out, in),
             *workspace, {threads});
    la::gemm(memkit::host, la::transpose::no, la::transpose::no, 1.0f, la::as_matrix(dy, M, out),
             la::as_matrix(tensor_view<const float>(weight.view()), out, in), 0.0f, la::as_matrix(dx, M, in), *workspace,
             {threads});
  }
};

enum class variant { dense_trainable, lora_dense_base, lora_nf4_base };

void BM_step(benchmark::State& state, variant which) {
  const std::int64_t in = state.range(0), out = state.range(1), M = state.range(2);
  const int threads = static_cast<int>(memkit::hardware_threads());
  memkit::tracking_resource tracker(memkit::default_host_resource(), "lora-bench");
  auto& weights = tracker.category(memory_category::weights);
  auto& gradients = tracker.category(memory_category::gradients);
  auto& workspace = tracker.category(memory_category::workspace);
  const std::vector<float> w = random_values(in * out, 1, 0.02f);
  const std::vector<float> x = random_values(M * in, 2, 1.0f), dy = random_values(M * out, 3, 1.0f);
  std::vector<float> y(static_cast<std::size_t>(M * out)), dx(static_cast<std::size_t>(M * in));
  activation_store store(tracker.category(memory_category::activations));
  const auto xv = memkit::host_view(x.data(), {M, in});
  const auto yv = memkit::host_view(y.data(), {M, out});
  const auto dyv = memkit::host_view(dy.data(), {M, out});
  const auto dxv = memkit::host_view(dx.data(), {M, in});
  const memkit::lora::lora_options options{.rank = rank, .alpha = 32.0, .dropout = 0.05f, .host_threads = threads};
  const memkit::forward_context ctx{1, 0, true};

  memkit::buffer<float> dense_base;
  q::quantized_tensor<q::NF4> nf4;
  std::unique_ptr<dense_linear> baseline;
  std::unique_ptr<memkit::lora::lora_linear<float>> lora_dense;
  std::unique_ptr<memkit::lora::lora_linear<q::quantized_tensor<q::NF4>>> lora_nf4;
  switch (which) {
    case variant::dense_trainable:
      baseline = std::make_unique<dense_linear>(
          dense_linear{in, out, memkit::buffer<float>(weights, {out, in}), memkit::buffer<float>(gradients, {out, in}),
                       &workspace, threads});
      std::memcpy(baseline->weight.data(), w.data(), w.size() * sizeof(float));
      std::memset(baseline->grad.data(), 0, baseline->grad.bytes());
      break;
    case variant::lora_dense_base:
      dense_base = memkit::buffer<float>(weights, {out, in});
      std::memcpy(dense_base.data(), w.data(), w.size() * sizeof(float));
      lora_dense = std::make_unique<memkit::lora::lora_linear<float>>(dense_base.view(), options, weights, gradients, workspace);
      break;
    case variant::lora_nf4_base:
      nf4 = q::quantized_tensor<q::NF4>::quantize(memkit::host, memkit::host_view(w.data(), {out, in}), {64, true}, weights);
      lora_nf4 = std::make_unique<memkit::lora::lora_linear<q::quantized_tensor<q::NF4>>>(&nf4, options, weights, gradients, workspace);
      break;
  }
  std::size_t saved = 0;
  for (auto _ : state) {
    tracker.reset_peak();
    switch (which) {
      case variant::dense_trainable:
        baseline->forward(xv, yv, store);
        saved = store.bytes();
        baseline->backward(dyv, dxv, store);
        break;
      case variant::lora_dense_base:
        lora_dense->forward(memkit::host, ctx, xv, yv, store);
        saved = store.bytes();
        lora_dense->backward(memkit::host, dyv, dxv, store);
        break;
      case variant::lora_nf4_base:
        lora_nf4->forward(memkit::host, ctx, xv, yv, store);
        saved = store.bytes();
        lora_nf4->backward(memkit::host, dyv, dxv, store);
        break;
    }
    benchmark::DoNotOptimize(dx.data());
  }
  // Multiply-adds of the step: the dense linear's three M x out x in products; LoRA's two base products
  // (y and dx) plus its rank-r ones.
  const double base = 2.0 * static_cast<double>(M) * static_cast<double>(in) * static_cast<double>(out);
  const double adapter = 2.0 * static_cast<double>(M) * static_cast<double>(rank) * static_cast<double>(in + out);
  const double flops = which == variant::dense_trainable ? 3.0 * base : 2.0 * base + 3.0 * adapter;
  state.counters["GFLOPs"] = benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["saved_MiB"] = static_cast<double>(saved) / (1 << 20);
  state.counters["activation_peak_MiB"] =
      static_cast<double>(tracker.stats(memory_category::activations).peak_bytes) / (1 << 20);
  state.counters["gradient_MiB"] = static_cast<double>(tracker.stats(memory_category::gradients).current_bytes) / (1 << 20);
  state.counters["weights_MiB"] = static_cast<double>(tracker.stats(memory_category::weights).current_bytes) / (1 << 20);
  state.counters["workspace_peak_MiB"] =
      static_cast<double>(tracker.stats(memory_category::workspace).peak_bytes) / (1 << 20);
}

}  // namespace

int main(int argc, char** argv) {
  memkit_bench::add_cpu_context();
  benchmark::AddCustomContext("lora_rank", std::to_string(rank));
  struct step_shape {
    std::int64_t in, out, tokens;
  };
  const step_shape shapes[] = {{512, 512, 64},      // small: the test suite's smoke run
                               {4096, 4096, 512},  {4096, 4096, 4096}, {4096, 11008, 512}, {4096, 11008, 4096}};
  for (const step_shape& s : shapes)
    for (const auto& [name, which] : {std::pair{"dense_trainable", variant::dense_trainable},
                                      std::pair{"lora_dense_base", variant::lora_dense_base},
                                      std::pair{"lora_nf4_base", variant::lora_nf4_base}}) {
      auto* b = benchmark::RegisterBenchmark(name, BM_step, which)
                    ->Args({s.in, s.out, s.tokens})
                    ->ArgNames({"in", "out", "tokens"})
                    ->UseRealTime()
                    ->Unit(benchmark::kMillisecond);
      if (s.in * s.out * s.tokens > (std::int64_t{1} << 30)) b->Iterations(1);
    }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
