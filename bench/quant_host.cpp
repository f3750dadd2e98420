// Host quantization throughput and the quantized matmul against the dense 16-bit one.
//
// Quantize / dequantize: 16 Mi values, bytes moved = input read + codes and scales written (or the
// reverse), reported as bytes/s and as a fraction of the measured STREAM-triad roofline (all cores).
// Each benchmark thread runs memkit's (single-threaded) host operation on its own slice.
// BM_*_vs_triad: the same operation interleaved, iteration by iteration, with a STREAM triad over this
// thread's own arrays of as many floats as it quantizes (so both see the same machine load), reporting
// fraction_of_triad = (operation bytes/s) / (triad bytes/s): #17's target is >= 0.70 on one thread.
// Matmul: y = x * W^T with W [4096, 4096]; the NF4 path reads 4.1 bits per weight, the dense baseline
// reads bf16 weights with the same fp32 dot product, so the comparison isolates the weight format.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "memkit/memkit.hpp"
#include "support/cpu_info.hpp"
#include "support/interleaved.hpp"
#include "support/roofline.hpp"

namespace q = memkit::quant;

namespace {

constexpr std::int64_t kValues = std::int64_t{1} << 24;
constexpr std::int64_t kBlock = 64;

template <class T>
const std::vector<T>& normal_input() {
  static const std::vector<T> values = [] {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<T> out(static_cast<std::size_t>(kValues));
    for (T& v : out) v = memkit::from_float<T>(normal(rng));
    return out;
  }();
  return values;
}

// This benchmark thread's share of the kValues inputs, cut at boundaries of `block` values: first index and count.
std::pair<std::int64_t, std::int64_t> thread_share(const benchmark::State& state, std::int64_t block) {
  const std::int64_t begin = kValues * state.thread_index() / state.threads() / block * block;
  const std::int64_t end = kValues * (state.thread_index() + 1) / state.threads() / block * block;
  return {begin, end - begin};
}

// Bytes/s, values/s and the roofline fraction of one thread's loop over `n` values; call right after the loop.
void report_throughput(benchmark::State& state, std::int64_t n, double bytes, const memkit_bench::roofline_timer& timer) {
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["values_per_s"] = benchmark::Counter(static_cast<double>(n) * static_cast<double>(state.iterations()),
                                                      benchmark::Counter::kIsRate);
  timer.finish(state, bytes);
}

// One benchmark thread's quantize / dequantize case: its slice of the input, the codes and absmax of that
// slice (already filled, so dequantize has something to read) and the bytes one operation moves.
template <q::format F, class T, std::int64_t Block = kBlock>
struct quant_case {
  std::int64_t begin, n;
  std::vector<std::uint8_t> codes;
  std::vector<float> absmax;
  std::vector<T> out;  // dequantize's output
  double bytes;

  explicit quant_case(const benchmark::State& state)
      : begin(thread_share(state, Block).first), n(thread_share(state, Block).second),
        codes(static_cast<std::size_t>(q::code_bytes(F, n))),
        absmax(static_cast<std::size_t>(q::block_count(n, Block))),
        bytes(static_cast<double>(n * sizeof(T) + codes.size() + absmax.size() * 4)) {
    q::quantize_blockwise(memkit::host, F, memkit::host_view(normal_input<float>().data() + begin, {n}), Block,
                          memkit::host_view(codes), memkit::host_view(absmax));
  }
  void quantize() {
    q::quantize_blockwise(memkit::host, F, memkit::host_view(normal_input<T>().data() + begin, {n}), Block,
                          memkit::host_view(codes), memkit::host_view(absmax));
  }
  void dequantize() {
    if (out.empty()) out.resize(static_cast<std::size_t>(n));
    q::dequantize_blockwise(memkit::host, F, memkit::host_view(std::as_const(codes).data(), {static_cast<std::int64_t>(codes.size())}),
                            memkit::host_view(std::as_const(absmax).data(), {static_cast<std::int64_t>(absmax.size())}),
                            Block, 0, memkit::host_view(out));
  }
};

// quantize (Dequantize false) or dequantize, bytes/s against the all-core triad.
template <q::format F, class T, bool Dequantize>
void BM_quant_op(benchmark::State& state) {
  quant_case<F, T> c(state);
  const memkit_bench::roofline_timer timer(memkit_bench::measured_host_bandwidth());
  for (auto _ : state) {
    if constexpr (Dequantize) c.dequantize();
    else c.quantize();
    benchmark::ClobberMemory();
  }
  report_throughput(state, c.n, c.bytes, timer);
}
template <q::format F, class T>
void BM_quantize(benchmark::State& state) {
  BM_quant_op<F, T, false>(state);
}
template <q::format F, class T>
void BM_dequantize(benchmark::State& state) {
  BM_quant_op<F, T, true>(state);
}

// The same operation interleaved with a triad a = b + 3c over this thread's own arrays of as many floats.
template <q::format F, class T, bool Dequantize, std::int64_t Block = kBlock>
void BM_quant_op_vs_triad(benchmark::State& state) {
  quant_case<F, T, Block> c(state);
  const auto n = static_cast<std::size_t>(c.n);
  std::vector<float> a(n), b(n, 1.0f), d(n, 2.0f);
  auto triad = [&] {
    float* out = a.data();
    const float* x = b.data();
    const float* y = d.data();
    for (std::size_t i = 0; i < n; ++i) out[i] = x[i] + 3.0f * y[i];
  };
  auto op = [&] {
    if constexpr (Dequantize) c.dequantize();
    else c.quantize();
  };
  triad();
  op();
  const memkit_bench::interleaved_seconds t = memkit_bench::time_interleaved(state, op, triad, CLOCK_THREAD_CPUTIME_ID);
  const double triad_bytes = 12.0 * static_cast<double>(n);
  state.counters["ns_per_value"] = benchmark::Counter(t.first / static_cast<double>(n) * 1e9, benchmark::Counter::kAvgThreads);
  state.counters["op_GBps"] = c.bytes / t.first / 1e9;
  state.counters["triad_GBps"] = triad_bytes / t.second / 1e9;
  state.counters["fraction_of_triad"] = benchmark::Counter((c.bytes / t.first) / (triad_bytes / t.second),
                                                           benchmark::Counter::kAvgThreads);
  // The same from this thread's CPU times (steadier on a loaded machine).
  state.counters["cpu_fraction_of_triad"] = benchmark::Counter((c.bytes / t.first_cpu) / (triad_bytes / t.second_cpu),
                                                               benchmark::Counter::kAvgThreads);
  state.SetLabel(memkit::to_string(memkit::host_isa_in_use()));
}
template <q::format F, class T>
void BM_quantize_vs_triad(benchmark::State& state) {
  BM_quant_op_vs_triad<F, T, false>(state);
}
// Block: the int8 rows also run at 256 and 4096 values per block (bitsandbytes' quantize_blockwise default).
template <q::format F, class T, std::int64_t Block = kBlock>
void BM_dequantize_vs_triad(benchmark::State& state) {
  BM_quant_op_vs_triad<F, T, true, Block>(state);
}

constexpr std::int64_t kN = 4096, kK = 4096;

const q::quantized_tensor<q::NF4>& nf4_weight() {
  static const auto w = [] {
    std::mt19937 rng(2);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    std::vector<float> dense(static_cast<std::size_t>(kN * kK));
    for (float& v : dense) v = normal(rng);
    return q::quantized_tensor<q::NF4>::quantize(memkit::host, memkit::host_view(std::as_const(dense).data(), {kN, kK}),
                                                 {64, true}, memkit::default_host_resource());
  }();
  return w;
}

void BM_matmul_nf4(benchmark::State& state) {
  const std::int64_t M = state.range(0);
  const auto& w = nf4_weight();
  std::vector<memkit::bf16> x(static_cast<std::size_t>(M * kK), memkit::bf16(0.5f)), y(static_cast<std::size_t>(M * kN));
  memkit::host_resource workspace;
  const memkit_bench::roofline_timer timer(memkit_bench::measured_host_bandwidth());
  for (auto _ : state) {
    q::matmul(memkit::host, memkit::host_view(std::as_const(x).data(), {M, kK}), w, memkit::host_view(y.data(), {M, kN}),
              q::matmul_config{}, workspace);
    benchmark::ClobberMemory();
  }
  const double bytes = static_cast<double>(w.bytes() + x.size() * 2 + y.size() * 2);
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["GFLOPs"] = benchmark::Counter(2.0 * M * kN * kK * static_cast<double>(state.iterations()),
                                                benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
  timer.finish(state, bytes);
}

// The dense baseline: bf16 weights, the same fp32 dot product, no dequantization.
void BM_matmul_dense_bf16(benchmark::State& state) {
  const std::int64_t M = state.range(0);
  std::vector<memkit::bf16> w(static_cast<std::size_t>(kN * kK));
  {
    std::vector<float> row(static_cast<std::size_t>(kN * kK));
    nf4_weight().dequantize(memkit::host, memkit::host_view(row));
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = memkit::bf16(row[i]);
  }
  std::vector<float> x(static_cast<std::size_t>(M * kK), 0.5f);
  std::vector<memkit::bf16> y(static_cast<std::size_t>(M * kN));
  const memkit_bench::roofline_timer timer(memkit_bench::measured_host_bandwidth());
  for (auto _ : state) {
    for (std::int64_t m = 0; m < M; ++m)
      for (std::int64_t n = 0; n < kN; ++n)
        y[static_cast<std::size_t>(m * kN + n)] =
            memkit::bf16(q::detail::dot(w.data() + n * kK, x.data() + m * kK, kK));
    benchmark::ClobberMemory();
  }
  const double bytes = static_cast<double>(w.size() * 2 + x.size() * 2 + y.size() * 2);
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["GFLOPs"] = benchmark::Counter(2.0 * M * kN * kK * static_cast<double>(state.iterations()),
                                                benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
  timer.finish(state, bytes);
}

}  // namespace

BENCHMARK(BM_quantize<q::NF4, float>)->ThreadRange(1, 2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_quantize<q::NF4, memkit::bf16>)->ThreadRange(1, 2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_quantize<q::FP4, memkit::bf16>)->Threads(1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_quantize<q::INT8, float>)->Threads(1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_dequantize<q::NF4, memkit::bf16>)->ThreadRange(1, 2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_dequantize<q::NF4, float>)->ThreadRange(1, 2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_dequantize<q::FP4, memkit::bf16>)->Threads(1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_dequantize<q::INT8, memkit::bf16>)->Threads(1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_quantize_vs_triad<q::NF4, float>)->ThreadRange(1, 2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_quantize_vs_triad<q::NF4, memkit::bf16>)->ThreadRange(1, 2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_quantize_vs_triad<q::FP4, memkit::bf16>)->Threads(1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_quantize_vs_triad<q::INT8, float>)->Threads(1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_quantize_vs_triad<q::INT8, memkit::bf16>)->Threads(1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_dequantize_vs_triad<q::NF4, memkit::bf16>)->ThreadRange(1, 2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_dequantize_vs_triad<q::NF4, float>)->Threads(1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_dequantize_vs_triad<q::INT8, memkit::bf16>)->Threads(1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_dequantize_vs_triad<q::INT8, memkit::bf16, 256>)->Threads(1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_dequantize_vs_triad<q::INT8, memkit::bf16, 4096>)->Threads(1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_matmul_nf4)->Arg(1)->Arg(8)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_matmul_dense_bf16)->Arg(1)->Arg(8)->UseRealTime()->Unit(benchmark::kMillisecond);
int main(int argc, char** argv) {
  memkit_bench::add_cpu_context();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
