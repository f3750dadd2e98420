// memkit's host GEMM against OpenBLAS's cblas_sgemm, in one run: every iteration times one memkit call and
// one OpenBLAS call on the same operands (alternating which goes first), and the benchmark reports both
// rates and the ratio memkit time / OpenBLAS time (median and best of the iterations: the machine may be
// shared, and a ratio of interleaved runs survives load better than two separate figures).
//
// Shapes: squares; LoRA's two thin products (rank 16); and the quantized matmul's dense step (a batch of
// 64 or 512 rows times a 4096 x 4096 weight, the weight transposed). Operands are fp32, or bf16 for memkit
// (converted while packing) against OpenBLAS on the same values in fp32. Each memkit instruction set this
// CPU has runs in turn (limit_host_isa); OpenBLAS uses its own best kernel, named in the context block
// (run with OPENBLAS_CORETYPE=Haswell to compare memkit's AVX2 kernel against OpenBLAS's AVX2 one).
// Threads: memkit's host_threads and openblas_set_num_threads get the same count.
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "memkit/core/float16.hpp"
#include "memkit/core/host_simd.hpp"
#include "memkit/linalg/gemm.hpp"
#include "support/cpu_info.hpp"
#include "support/openblas_spin.hpp"

namespace la = memkit::linalg;

namespace {

struct gemm_case {
  const char* name;
  std::int64_t M, N, K;
  la::transpose op_a, op_b;
};

constexpr gemm_case cases[] = {
    {"square256", 256, 256, 256, la::transpose::no, la::transpose::no},
    {"square1024", 1024, 1024, 1024, la::transpose::no, la::transpose::no},
    {"square2048", 2048, 2048, 2048, la::transpose::no, la::transpose::no},
    {"lora_down_r16", 2048, 16, 4096, la::transpose::no, la::transpose::yes},   // x [2048, 4096] * A^T [4096, 16]
    {"lora_up_r16", 2048, 4096, 16, la::transpose::no, la::transpose::yes},     // h [2048, 16] * B^T [16, 4096]
    {"lora_grad_r16", 16, 4096, 2048, la::transpose::yes, la::transpose::no},   // dB^T-like: h^T [16, 2048] * dy
    {"matmul_b64", 64, 4096, 4096, la::transpose::no, la::transpose::yes},      // x [64, 4096] * W^T
    {"matmul_b512", 512, 4096, 4096, la::transpose::no, la::transpose::yes},
};

template <class T>
std::vector<T> random_values(std::int64_t count, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<T> values(static_cast<std::size_t>(count));
  for (T& v : values) v = memkit::from_float<T>(normal(rng));
  return values;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n == 0 ? 0.0 : n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

template <class T>
void BM_gemm_vs_openblas(benchmark::State& state, gemm_case c, memkit::host_isa isa, int threads) {
  memkit::limit_host_isa(isa);
  openblas_set_num_threads(threads);
  const bool ta = c.op_a == la::transpose::yes, tb = c.op_b == la::transpose::yes;
  const std::int64_t a_rows = ta ? c.K : c.M, a_cols = ta ? c.M : c.K;
  const std::int64_t b_rows = tb ? c.N : c.K, b_cols = tb ? c.K : c.N;
  const auto A = random_values<T>(a_rows * a_cols, 1), B = random_values<T>(b_rows * b_cols, 2);
  std::vector<float> A32(A.size()), B32(B.size());
  std::transform(A.begin(), A.end(), A32.begin(), [](T v) { return memkit::to_float(v); });
  std::transform(B.begin(), B.end(), B32.begin(), [](T v) { return memkit::to_float(v); });
  std::vector<T> C(static_cast<std::size_t>(c.M * c.N));
  std::vector<float> C32(C.size());
  const la::matrix_ref<const T> a{A.data(), a_rows, a_cols, a_cols, memkit::memory_kind::host};
  const la::matrix_ref<const T> b{B.data(), b_rows, b_cols, b_cols, memkit::memory_kind::host};
  const la::matrix_ref<T> out{C.data(), c.M, c.N, c.N, memkit::memory_kind::host};
  const auto run_memkit = [&] {
    la::gemm(memkit::host, c.op_a, c.op_b, 1.0f, a, b, 0.0f, out, memkit::default_host_resource(),
             la::gemm_options{threads});
    benchmark::DoNotOptimize(C.data());
  };
  const auto run_openblas = [&] {
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, static_cast<int>(c.M),
                static_cast<int>(c.N), static_cast<int>(c.K), 1.0f, A32.data(), static_cast<int>(a_cols), B32.data(),
                static_cast<int>(b_cols), 0.0f, C32.data(), static_cast<int>(c.N));
    benchmark::DoNotOptimize(C32.data());
  };
  run_memkit();  // warm both (page faults, thread pools, frequency)
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
      const double seconds = std::chrono::duration<double>(clock::now() - start).count();
      (memkit_turn ? memkit_seconds : openblas_seconds).push_back(seconds);
    }
    memkit_first = !memkit_first;
  }
  const double flops = 2.0 * static_cast<double>(c.M) * static_cast<double>(c.N) * static_cast<double>(c.K);
  const double memkit_median = median(memkit_seconds), openblas_median = median(openblas_seconds);
  const double memkit_best = *std::min_element(memkit_seconds.begin(), memkit_seconds.end());
  const double openblas_best = *std::min_element(openblas_seconds.begin(), openblas_seconds.end());
  state.counters["memkit_GFLOPs"] = flops / memkit_median / 1e9;
  state.counters["openblas_GFLOPs"] = flops / openblas_median / 1e9;
  state.counters["ratio_median"] = memkit_median / openblas_median;  // memkit time / OpenBLAS time
  state.counters["ratio_best"] = memkit_best / openblas_best;
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
  for (const gemm_case& c : cases)
    for (memkit::host_isa isa : isas)
      for (int threads : {1, hardware}) {
        const std::string suffix = std::string("/") + c.name + "/" + memkit::to_string(isa) + "/threads:" +
                                   std::to_string(threads);
        benchmark::RegisterBenchmark(("gemm_f32" + suffix).c_str(), BM_gemm_vs_openblas<float>, c, isa, threads)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
        benchmark::RegisterBenchmark(("gemm_bf16" + suffix).c_str(), BM_gemm_vs_openblas<memkit::bf16>, c, isa, threads)
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
