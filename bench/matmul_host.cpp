// quant::matmul on the host (y = x * dequant(W)^T, W NF4 [4096, 4096], x fp32) against OpenBLAS's cblas_sgemm
// on the dequantized fp32 weight, in one run: every iteration times one memkit call and one OpenBLAS call on
// the same operands (alternating which goes first) and reports both times and their ratio (median of the
// iterations: the machine may be shared). Batches 1-8 take memkit's fused path (W decoded inside the dot
// products) and also report the fraction of the 4-bit bandwidth bound: the bytes of codes, scales, x and y
// over the measured STREAM triad (bench/support/roofline.hpp). Batches of 9 and more take the GEMM path
// (tiles of W dequantized, multiplied by linalg's micro-kernel); #17's target is a ratio of at most 1.2 at
// batch 64 and above. Threads: matmul_config::host_threads and openblas_set_num_threads get the same count.
// MEMKIT_HOST_ISA=avx2 runs memkit's AVX2 kernels (OPENBLAS_CORETYPE=Haswell does the same for OpenBLAS).
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
#include "support/roofline.hpp"

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

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n == 0 ? 0.0 : n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

void BM_matmul_vs_openblas(benchmark::State& state, std::int64_t M, int threads) {
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
              workspace, config);
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
  std::vector<double> memkit_seconds, openblas_seconds;
  bool memkit_first = true;
  for (auto _ : state) {
    using clock = std::chrono::steady_clock;
    for (int turn = 0; turn < 2; ++turn) {
      const bool memkit_turn = (turn == 0) == memkit_first;
      const auto start = clock::now();
      if (memkit_turn) run_memkit();
      else run_openblas();
      (memkit_turn ? memkit_seconds : openblas_seconds).push_back(std::chrono::duration<double>(clock::now() - start).count());
    }
    memkit_first = !memkit_first;
  }
  const double memkit_time = median(memkit_seconds), openblas_time = median(openblas_seconds);
  const double flops = 2.0 * static_cast<double>(M) * kN * kK;
  state.counters["memkit_ms"] = memkit_time * 1e3;
  state.counters["openblas_ms"] = openblas_time * 1e3;
  state.counters["ratio_to_openblas"] = memkit_time / openblas_time;
  state.counters["memkit_GFLOPs"] = flops / memkit_time / 1e9;
  // The 4-bit bound: what a fused kernel must read and write at least, at the measured triad bandwidth.
  const double bytes = static_cast<double>(w.bytes()) + static_cast<double>(x.size() + y.size()) * 4.0;
  state.counters["fraction_of_4bit_bound"] = bytes / memkit_bench::measured_host_bandwidth() / memkit_time;
  state.SetLabel(memkit::to_string(memkit::host_isa_in_use()));
}

}  // namespace

int main(int argc, char** argv) {
  memkit_bench::add_cpu_context();
  benchmark::AddCustomContext("openblas_core", openblas_get_corename());
  const int hardware = static_cast<int>(memkit::hardware_threads());
  for (std::int64_t M : {1, 4, 8, 9, 16, 64, 256, 512})
    for (int threads : {1, hardware}) {
      benchmark::RegisterBenchmark(("matmul_nf4/batch:" + std::to_string(M) + "/threads:" + std::to_string(threads)).c_str(),
                                   BM_matmul_vs_openblas, M, threads)
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
