// memkit::attention on the host against the obvious baseline, a materialized attention: one forward + backward
// of causal self-attention, fp32, B=1, H=4 heads. The baseline builds each head's [S, S] scores with memkit's
// packed GEMM (linalg::gemm), softmaxes them in place, keeps the probabilities of every head for backward (as
// autograd does) and runs the backward as four more GEMMs. Both use the same threads. Counters: GFLOP/s (the
// useful causal flops, 2 * 2 * S^2 * D / 2 forward and twice that backward), the bytes each holds beyond q, k,
// v, out and the gradients (flash: lse + workspace, as predicted; materialized: the fp32 probabilities and the
// score gradient), and their ratio. The CPU is named in the context block.
#include <benchmark/benchmark.h>
#include <memkit/attention/flash_attention.hpp>
#include <memkit/linalg/gemm.hpp>
#include <memkit/memory/tracking.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "support/cpu_info.hpp"

namespace {

namespace att = memkit::attention;
namespace la = memkit::linalg;

constexpr std::int64_t heads = 4;

std::vector<float> normal_values(std::int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = normal(rng);
  return v;
}

struct inputs {
  std::int64_t S, D;
  std::vector<float> q, k, v, dout, out, dq, dk, dv, lse;
  inputs(std::int64_t s, std::int64_t d)
      : S(s), D(d), q(normal_values(heads * s * d, 1)), k(normal_values(heads * s * d, 2)),
        v(normal_values(heads * s * d, 3)), dout(normal_values(heads * s * d, 4)), out(q.size()), dq(q.size()),
        dk(q.size()), dv(q.size()), lse(static_cast<std::size_t>(heads * s)) {}
  memkit::tensor_view<float> t(std::vector<float>& x) { return memkit::host_view(x.data(), memkit::shape{1, heads, S, D}); }
};

double causal_flops(std::int64_t S, std::int64_t D) { return 3.0 * 2.0 * 2.0 * double(S) * double(S) * D / 2 * heads; }

void BM_flash(benchmark::State& state) {
  inputs in(state.range(0), state.range(1));
  att::attention_options o;
  o.host_threads = static_cast<int>(state.range(2));
  memkit::tracking_resource tracker(memkit::default_host_resource());
  for (auto _ : state) {
    att::forward<float>(memkit::host, in.t(in.q), in.t(in.k), in.t(in.v), in.t(in.out),
                        memkit::host_view(in.lse.data(), memkit::shape{1, heads, in.S}), o, tracker);
    att::backward<float>(memkit::host,
                         {in.t(in.q), in.t(in.k), in.t(in.v), in.t(in.out),
                          memkit::host_view(in.lse.data(), memkit::shape{1, heads, in.S})},
                         in.t(in.dout), {in.t(in.dq), in.t(in.dk), in.t(in.dv)}, o, tracker);
    benchmark::DoNotOptimize(in.dq.data());
  }
  const double held = double(tracker.peak_bytes() + in.lse.size() * sizeof(float));
  state.counters["GFLOPs"] = benchmark::Counter(causal_flops(in.S, in.D) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["extra_MiB"] = held / (1 << 20);
  state.counters["materialized_MiB"] = double(att::eager_attention_bytes(1, heads, in.S)) / (1 << 20);
  state.counters["bytes_ratio"] = held / double(att::eager_attention_bytes(1, heads, in.S));
}

// The materialized baseline described above.
void BM_materialized(benchmark::State& state) {
  inputs in(state.range(0), state.range(1));
  const std::int64_t S = in.S, D = in.D;
  const int threads = static_cast<int>(state.range(2));
  const la::gemm_options g{threads};
  auto& ws = memkit::default_host_resource();
  const float scale = 1.0f / std::sqrt(float(D));
  std::vector<float> probabilities(static_cast<std::size_t>(heads * S * S)), dscores(static_cast<std::size_t>(S * S));
  auto m = [](float* p, std::int64_t r, std::int64_t c) { return la::matrix_ref<float>{p, r, c, c, memkit::memory_kind::host}; };
  auto cm = [](const float* p, std::int64_t r, std::int64_t c) {
    return la::matrix_ref<const float>{p, r, c, c, memkit::memory_kind::host};
  };
  for (auto _ : state) {
    for (std::int64_t h = 0; h < heads; ++h) {
      const std::int64_t o = h * S * D;
      float* P = probabilities.data() + h * S * S;
      la::gemm(memkit::host, la::transpose::no, la::transpose::yes, scale, cm(&in.q[o], S, D), cm(&in.k[o], S, D), 0.0f,
               m(P, S, S), ws, g);
      memkit::detail::run_in_parts(threads, S, [&](std::int64_t first, std::int64_t last) {
        for (std::int64_t i = first; i < last; ++i) {
          float* row = P + i * S;
          float mx = row[0];
          for (std::int64_t j = 1; j <= i; ++j) mx = std::max(mx, row[j]);
          float sum = 0;
          for (std::int64_t j = 0; j <= i; ++j) sum += (row[j] = std::exp(row[j] - mx));
          for (std::int64_t j = 0; j <= i; ++j) row[j] /= sum;
          for (std::int64_t j = i + 1; j < S; ++j) row[j] = 0;
        }
      });
      la::gemm(memkit::host, la::transpose::no, la::transpose::no, 1.0f, cm(P, S, S), cm(&in.v[o], S, D), 0.0f,
               m(&in.out[o], S, D), ws, g);
    }
    for (std::int64_t h = 0; h < heads; ++h) {
      const std::int64_t o = h * S * D;
      const float* P = probabilities.data() + h * S * S;
      la::gemm(memkit::host, la::transpose::no, la::transpose::yes, 1.0f, cm(&in.dout[o], S, D), cm(&in.v[o], S, D),
               0.0f, m(dscores.data(), S, S), ws, g);
      memkit::detail::run_in_parts(threads, S, [&](std::int64_t first, std::int64_t last) {
        for (std::int64_t i = first; i < last; ++i) {
          float dot = 0;
          for (std::int64_t j = 0; j <= i; ++j) dot += P[i * S + j] * dscores[i * S + j];
          for (std::int64_t j = 0; j < S; ++j) dscores[i * S + j] = P[i * S + j] * (dscores[i * S + j] - dot) * scale;
        }
      });
      la::gemm(memkit::host, la::transpose::yes, la::transpose::no, 1.0f, cm(P, S, S), cm(&in.dout[o], S, D), 0.0f,
               m(&in.dv[o], S, D), ws, g);
      la::gemm(memkit::host, la::transpose::no, la::transpose::no, 1.0f, cm(dscores.data(), S, S), cm(&in.k[o], S, D),
               0.0f, m(&in.dq[o], S, D), ws, g);
      la::gemm(memkit::host, la::transpose::yes, la::transpose::no, 1.0f, cm(dscores.data(), S, S), cm(&in.q[o], S, D),
               0.0f, m(&in.dk[o], S, D), ws, g);
    }
    benchmark::DoNotOptimize(in.dq.data());
  }
  state.counters["GFLOPs"] = benchmark::Counter(causal_flops(S, D) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["extra_MiB"] = double(att::eager_attention_bytes(1, heads, S)) / (1 << 20);
}

void shapes(benchmark::internal::Benchmark* b) {
  for (std::int64_t S : {512, 2048})
    for (std::int64_t D : {64, 128})
      for (std::int64_t threads : {1, 2}) b->Args({S, D, threads});
  b->ArgNames({"seq", "head_dim", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_flash)->Apply(shapes);
BENCHMARK(BM_materialized)->Apply(shapes);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  memkit_bench::add_cpu_context();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
