// loss::fused_linear_cross_entropy on the host against the materialized reference (all [N, V] fp32 logits at
// once, then softmax and the two gradient products: what a loop without the fused loss does), in one run:
// every iteration times one fused call and one materialized call on the same operands, alternating which
// goes first, and reports both times, their ratio (fused / materialized; median of the iterations) and the
// peak workspace bytes each took (tracking_resource). Loss and both gradients (d_hidden, d_head) every time.
// Shapes: a Llama-2-sized vocabulary (32000) and a Llama-3-sized one (128256) with small hidden sizes so an
// iteration takes seconds on a laptop-class CPU, plus a tiny one for the test suite's smoke run.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "../tests/support/loss_reference.hpp"
#include "memkit/loss/fused_linear_cross_entropy.hpp"
#include "memkit/memory/tracking.hpp"
#include "support/cpu_info.hpp"

namespace ls = memkit::loss;
using memkit::bf16;
using memkit::host;
using memkit::host_view;

namespace {

struct loss_case {
  const char* name;
  std::int64_t N, H, V;
};

constexpr loss_case cases[] = {
    {"small", 256, 64, 4096},
    {"vocab32000", 2048, 256, 32000},
    {"vocab128256", 1024, 128, 128256},
};

std::vector<bf16> values(std::int64_t count, std::uint32_t seed) {
  std::vector<bf16> out(static_cast<std::size_t>(count));
  std::uint32_t state = seed;
  for (bf16& v : out) {
    state = state * 1664525u + 1013904223u;
    v = memkit::from_float<bf16>(static_cast<float>(state >> 8) / 16777216.0f - 0.5f);
  }
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void BM_fused_vs_materialized(benchmark::State& state, loss_case c, int threads) {
  const auto [name, N, H, V] = c;
  const std::vector<bf16> hidden = values(N * H, 1), head = values(V * H, 2);
  std::vector<std::int32_t> targets(static_cast<std::size_t>(N));
  for (std::int64_t i = 0; i < N; ++i) targets[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((i * 7919) % V);
  std::vector<bf16> d_hidden(static_cast<std::size_t>(N * H));
  std::vector<float> d_head(static_cast<std::size_t>(V * H), 0.0f);
  const ls::cross_entropy_options options{.host_threads = threads};
  memkit::tracking_resource fused_workspace(memkit::default_host_resource(), "fused");
  memkit::tracking_resource materialized_workspace(memkit::default_host_resource(), "materialized");
  float loss = 0;
  const auto fused = [&] {
    ls::fused_linear_cross_entropy(host, host_view(hidden.data(), {N, H}), host_view(head.data(), {V, H}),
                                   host_view(targets.data(), {N}), host_view(&loss, {1}), host_view(d_hidden.data(), {N, H}),
                                   host_view(d_head.data(), {V, H}), options, fused_workspace);
  };
  const auto materialized = [&] {
    loss = memkit_test::materialized_cross_entropy(hidden.data(), head.data(), targets.data(), N, H, V, d_hidden.data(),
                                                   d_head.data(), materialized_workspace, threads);
  };
  const auto seconds = [](auto&& body) {
    const auto start = std::chrono::steady_clock::now();
    body();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  std::vector<double> fused_times, materialized_times;
  bool fused_first = true;
  for (auto _ : state) {
    double f = 0, m = 0;
    if (fused_first) {
      f = seconds(fused);
      m = seconds(materialized);
    } else {
      m = seconds(materialized);
      f = seconds(fused);
    }
    fused_first = !fused_first;
    fused_times.push_back(f);
    materialized_times.push_back(m);
    state.SetIterationTime(f);
    benchmark::DoNotOptimize(loss);
  }
  const double flops = 3.0 * 2.0 * static_cast<double>(N) * static_cast<double>(V) * static_cast<double>(H);
  const double fused_median = median(fused_times), materialized_median = median(materialized_times);
  state.counters["fused_ms"] = fused_median * 1e3;
  state.counters["materialized_ms"] = materialized_median * 1e3;
  state.counters["time_ratio"] = fused_median / materialized_median;  // fused time / materialized time
  state.counters["fused_GFLOPs"] = flops / fused_median / 1e9;
  state.counters["fused_peak_MiB"] = static_cast<double>(fused_workspace.peak_bytes()) / (1 << 20);
  state.counters["materialized_peak_MiB"] = static_cast<double>(materialized_workspace.peak_bytes()) / (1 << 20);
  state.counters["peak_ratio"] =
      static_cast<double>(fused_workspace.peak_bytes()) / static_cast<double>(materialized_workspace.peak_bytes());
}

}  // namespace

int main(int argc, char** argv) {
  memkit_bench::add_cpu_context();
  const int hardware = static_cast<int>(memkit::hardware_threads());
  for (const loss_case& c : cases)
    benchmark::RegisterBenchmark((std::string("loss_bf16/") + c.name + "/threads:" + std::to_string(hardware)).c_str(),
                                 BM_fused_vs_materialized, c, hardware)
        ->UseManualTime()
        ->Iterations(c.N * c.V > 4096 * 256 ? 3 : 5)
        ->Unit(benchmark::kMillisecond);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
