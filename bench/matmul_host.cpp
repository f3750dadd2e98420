// quant::matmul on the host (y = x * dequant(W)^T, W NF4 [4096, 4096], x fp32) against OpenBLAS's cblas_sgemm
// on the dequantized fp32 weight and against a STREAM triad, in one run: every iteration times one memkit
// call, one OpenBLAS call on the same operands and one triad pass (a = b + 3c over 64 MiB arrays, on as
// many threads as the row), rotating which goes first, and the benchmark reports the medians and
// - ratio_to_openblas: memkit time / OpenBLAS time (#17: at most 1.2 at batch 64 and above);
// - fraction_of_4bit_bound: (bytes of W's codes and scales, x and y) / memkit time over the triad's bytes/s
//   (#17: at least 0.5 at batch 1-8 on one thread).
// Batches up to 32 take memkit's fused path (W decoded inside the dot products, up to 8 rows of x per pass),
// larger ones the GEMM path (W decoded into linalg's packed panels). Threads: matmul_config::host_threads
// and openblas_set_num_threads get the same count. Each memkit instruction set this CPU has runs in turn
// (limit_host_isa; MEMKIT_HOST_ISA=avx2 caps the list); OpenBLAS uses its own best kernel, named in the
// context block (OPENBLAS_CORETYPE=Haswell gives it its AVX2 one).
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "memkit/memkit.hpp"
#include "support/cpu_info.hpp"
#include "support/openblas_spin.hpp"

namespace q = memkit::quant;

namespace {

constexpr std::int64_t kN = 4096, kK = 4096;

const q::quantized_tensor<q::NF4>& nf4_weight() {
  static const auto w = [] {
    std::mt19937 rng(2);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    std::vector<float> dense(static_cast<std::size_t>(kN * kK));
    for (float& v : dense) v = normal(rng);
    return q::quantized_tensor<q::NF4>::quantize(memkit::host, memkit::host_view(std::as_const(dense).data(), {kN, kK}),
                                                 {64, false}, memkit::default_host_resource());
  }();
  return w;
}

// One STREAM triad pass a = b + 3c on `threads` threads (memkit's run_in_parts), in seconds.
double timed_triad(int threads) {
  static std::vector<float> a((64u << 20) / sizeof(float)), b(a.size(), 1.0f), c(a.size(), 2.0f);
  const auto start = std::chrono::steady_clock::now();
  memkit::detail::run_in_parts(threads, static_cast<std::int64_t>(a.size()), [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t i = first; i < last; ++i) a[static_cast<std::size_t>(i)] = b[static_cast<std::size_t>(i)] + 3.0f * c[static_cast<std::size_t>(i)];
  });
  benchmark::DoNotOptimize(a.data());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
constexpr double triad_bytes = 3.0 * (64u << 20);

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n == 0 ? 0.0 : n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

void BM_matmul_vs_openblas(benchmark::State& state, std::int64_t M, memkit::host_isa isa, int threads) {
  memkit::limit_host_isa(isa);
  openblas_set_num_threads(threads);
  const auto& w = nf4_weight();
  std::vector<float> dense(static_cast<std::size_t>(kN * kK));
  w.dequantize(memkit::host, memkit::host_view(dense));
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(M * kK)), y(static_cast<std::size_t>(M * kN)), y_blas(y.size());
  for (float& v : x) v = normal(rng);
  q::matmul_config config;
  config.host_threads = threads;
  memkit::host_resource workspace;
  const auto run_memkit = [&] {
    q::matmul(memkit::host, memkit::host_view(std::as_const(x).data(), {M, kK}), w, memkit::host_view(y.data(), {M, kN}),
              config, workspace);
    benchmark::DoNotOptimize(y.data());
  };
  const auto run_openblas = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M), static_cast<int>(kN), static_cast<int>(kK),
                1.0f, x.data(), static_cast<int>(kK), dense.data(), static_cast<int>(kK), 0.0f, y_blas.data(),
                static_cast<int>(kN));
    benchmark::DoNotOptimize(y_blas.data());
  };
  run_memkit();
  run_openblas();
  timed_triad(threads);
  std::vector<double> seconds[3];  // memkit, OpenBLAS, triad
  int first = 0;
  for (auto _ : state) {
    using clock = std::chrono::steady_clock;
    for (int turn = 0; turn < 3; ++turn) {
      const int which = (first + turn) % 3;
      if (which == 2) {
        seconds[2].push_back(timed_triad(threads));
        continue;
      }
      const auto start = clock::now();
      if (which == 0) run_memkit();
      else run_openblas();
      seconds[which].push_back(std::chrono::duration<double>(clock::now() - start).count());
    }
    first = (first + 1) % 3;
  }
  const double memkit_time = median(seconds[0]), openblas_time = median(seconds[1]), triad_time = median(seconds[2]);
  const double flops = 2.0 * static_cast<double>(M) * kN * kK;
  state.counters["memkit_ms"] = memkit_time * 1e3;
  state.counters["openblas_ms"] = openblas_time * 1e3;
  state.counters["ratio_to_openblas"] = memkit_time / openblas_time;
  state.counters["memkit_GFLOPs"] = flops / memkit_time / 1e9;
  // The 4-bit bound: what the product must read and write at least, at the triad's bandwidth.
  const double bytes = static_cast<double>(w.bytes()) + static_cast<double>(x.size() + y.size()) * 4.0;
  state.counters["triad_GBps"] = triad_bytes / triad_time / 1e9;
  state.counters["fraction_of_4bit_bound"] = (bytes / memkit_time) / (triad_bytes / triad_time);
  state.SetLabel(memkit::to_string(memkit::host_isa_in_use()));
  memkit::limit_host_isa(memkit::host_isa::avx512);
}

}  // namespace

int main(int argc, char** argv) {
  memkit_bench::restart_with_short_openblas_spin(argv);
  memkit_bench::add_cpu_context();
  benchmark::AddCustomContext("openblas_core", openblas_get_corename());
  benchmark::AddCustomContext("openblas_thread_timeout", memkit_bench::openblas_thread_timeout());
  std::vector<memkit::host_isa> isas;
  for (memkit::host_isa isa : {memkit::host_isa::avx512, memkit::host_isa::avx2})
    if (isa <= memkit::host_isa_in_use()) isas.push_back(isa);
  if (isas.empty()) isas.push_back(memkit::host_isa::portable);
  const int hardware = static_cast<int>(memkit::hardware_threads());
  for (memkit::host_isa isa : isas)
    for (std::int64_t M : {1, 4, 8, 9, 16, 32, 33, 64, 256, 512})
      for (int threads : {1, hardware}) {
        benchmark::RegisterBenchmark((std::string("matmul_nf4/") + memkit::to_string(isa) + "/batch:" + std::to_string(M) +
                                      "/threads:" + std::to_string(threads)).c_str(),
                                     BM_matmul_vs_openblas, M, isa, threads)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
        if (hardware == 1) break;
      }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
