// CUDA quantization throughput and the quantized matmul against cuBLAS on dense bf16 weights.
// BM_cuda_matmul_nf4_vs_dense: Llama-8B layer shapes at M = 1,024 and 8,192, NF4 and dense in the same loop.
//
// Quantize / dequantize 256 Mi values (bytes moved = values + codes + scales), timed with CUDA events,
// reported as bytes/s and as a fraction of the measured device-to-device copy bandwidth (the roofline a
// memory-bound kernel can reach). Matmul: y = x * W^T, W [8192, 8192], NF4 with double quantization,
// against cublasGemmEx on the same weights in bf16, for batch 1, 8 (fused kernel) and 256 (tiles + cuBLAS);
// and the input gradient dx = dy * W for batch 1 and 8 (the fused tiled kernel). Bytes moved: W's codes and
// scales plus the activations, so the fraction shown is of the 4-bit-weight roofline.
#include <benchmark/benchmark.h>
#include <memkit/memkit.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <random>
#include <utility>
#include <vector>

#include "support/cuda_timing.hpp"

namespace q = memkit::quant;

namespace {

constexpr std::int64_t kValues = std::int64_t{1} << 28;
constexpr std::int64_t kBlock = 64;
constexpr std::int64_t kN = 8192, kK = 8192;  // the matmul rows' W [kN, kK]

// Returns the device seconds of the timed iterations.
template <class Body>
double run_timed(benchmark::State& state, Body&& body, double bytes) {
  const double seconds = memkit_bench::time_with_events(state, body);
  memkit_bench::report_device_throughput(state, bytes, seconds, memkit_bench::measured_device_bandwidth());
  return seconds;
}

// TFLOP/s of an [M, n] x [n, k] product per timed iteration.
void report_tflops(benchmark::State& state, std::int64_t M, double seconds) {
  state.counters["TFLOPs"] = 2.0 * double(M) * double(kN) * double(kK) * double(state.iterations()) / seconds * 1e-12;
}

__global__ void fill_normalish(memkit::bf16* out, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n; i += std::int64_t{gridDim.x} * blockDim.x) {
    const unsigned h = static_cast<unsigned>(i) * 2654435761u;
    out[i] = memkit::bf16((static_cast<float>(h >> 8) / 16777216.0f - 0.5f) * 4.0f);
  }
}

// kValues filled bf16 values in device memory, what the quantize / dequantize rows start from.
memkit::buffer<memkit::bf16> filled_values(memkit::device_resource& device) {
  memkit::buffer<memkit::bf16> values(device, {kValues});
  fill_normalish<<<1024, 256>>>(values.data(), kValues);
  MEMKIT_CUDA_CHECK(cudaGetLastError());
  return values;
}

template <q::format F>
void BM_cuda_quantize(benchmark::State& state) {
  memkit::device_resource device;
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  memkit::buffer<memkit::bf16> input = filled_values(device);
  memkit::buffer<std::uint8_t> codes(device, {q::code_bytes(F, kValues)});
  memkit::buffer<float> absmax(device, {q::block_count(kValues, kBlock)});
  const double bytes = static_cast<double>(input.bytes() + codes.bytes() + absmax.bytes());
  run_timed(state, [&] { q::quantize_blockwise(gpu, F, input.view(), kBlock, codes.view(), absmax.view()); }, bytes);
}

template <q::format F>
void BM_cuda_dequantize(benchmark::State& state) {
  memkit::device_resource device;
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  memkit::buffer<memkit::bf16> values = filled_values(device);
  memkit::buffer<std::uint8_t> codes(device, {q::code_bytes(F, kValues)});
  memkit::buffer<float> absmax(device, {q::block_count(kValues, kBlock)});
  q::quantize_blockwise(gpu, F, values.view(), kBlock, codes.view(), absmax.view());
  const double bytes = static_cast<double>(values.bytes() + codes.bytes() + absmax.bytes());
  run_timed(state,
            [&] {
              q::dequantize_blockwise(gpu, F, memkit::tensor_view<const std::uint8_t>(codes.view()),
                                      memkit::tensor_view<const float>(absmax.view()), kBlock, 0, values.view());
            },
            bytes);
}

// The QLoRA layout: NF4 with double-quantized scales (one byte per block plus one fp32 per 256 blocks).
void BM_cuda_dequantize_nf4_double_quant(benchmark::State& state) {
  memkit::device_resource device;
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  memkit::buffer<memkit::bf16> values = filled_values(device);
  const auto w = q::quantized_tensor<q::NF4>::quantize(gpu, memkit::tensor_view<const memkit::bf16>(values.view()),
                                                       {kBlock, true}, device);
  const double bytes = static_cast<double>(values.bytes() + w.bytes());
  run_timed(state, [&] { w.dequantize(gpu, values.view()); }, bytes);
}

// What the NF4 matmul benchmarks share: the weight W [kN, kK] (NF4, double quantization, from the same filled
// bf16 values), a filled input of [M, in_cols], an output of [M, out_cols], and the bytes one call moves.
struct nf4_matmul_case {
  memkit::device_resource device;
  memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  q::quantized_tensor<q::NF4> w;
  memkit::buffer<memkit::bf16> in, out;
  double bytes;

  nf4_matmul_case(std::int64_t M, std::int64_t in_cols, std::int64_t out_cols)
      : w(make_weight(gpu, device)), in(device, {M, in_cols}), out(device, {M, out_cols}),
        bytes(static_cast<double>(w.bytes() + in.bytes() + out.bytes())) {
    fill_normalish<<<1024, 256>>>(in.data(), M * in_cols);
    MEMKIT_CUDA_CHECK(cudaGetLastError());
  }
  static q::quantized_tensor<q::NF4> make_weight(const memkit::cuda_executor& gpu, memkit::device_resource& device) {
    memkit::buffer<memkit::bf16> dense(device, {kN, kK});
    fill_normalish<<<1024, 256>>>(dense.data(), kN * kK);
    MEMKIT_CUDA_CHECK(cudaGetLastError());
    return q::quantized_tensor<q::NF4>::quantize(gpu, dense.view(), {64, true}, device);
  }
  memkit::tensor_view<const memkit::bf16> input() const { return in.view(); }
};

// tile_floats: the config's device_tile_floats (0: the default, one tile of all of W here). shuffle_gemv false:
// the previous fused kernel (codebook in shared memory), for the comparison at M = 1 and 8 (#30).
void BM_cuda_matmul_nf4(benchmark::State& state, std::int64_t tile_floats, bool shuffle_gemv) {
  nf4_matmul_case c(state.range(0), kK, kN);
  memkit::device_async_resource workspace(c.gpu.stream);  // stream-ordered: no cudaFree in the timed loop
  q::matmul_config config;
  if (tile_floats > 0) config.device_tile_floats = tile_floats;
  config.device_gemv_shuffle = shuffle_gemv;
  report_tflops(state, c.in.shape()[0],
                run_timed(state, [&] { q::matmul(c.gpu, c.input(), c.w, c.out.view(), config, workspace); }, c.bytes));
}

// dx = dy * W: the fused small-batch kernels, or the dequantized tiles and cuBLAS.
void BM_cuda_matmul_input_grad_nf4(benchmark::State& state, std::int64_t tile_floats) {
  nf4_matmul_case c(state.range(0), kN, kK);
  memkit::device_async_resource workspace(c.gpu.stream);  // the split kernel's partial sums, stream-ordered
  q::matmul_config config;
  if (tile_floats > 0) config.device_tile_floats = tile_floats;
  report_tflops(state, c.in.shape()[0],
                run_timed(state, [&] { q::matmul_input_grad(c.gpu, c.input(), c.w, c.out.view(), config, workspace); }, c.bytes));
}

// The dense bf16 product, cublasGemmEx: y = x * W^T (input_grad false) or dx = dy * W (true), W [n, k]
// row-major. Row-major [rows, cols] is column-major [cols, rows], so y^T = (W^T)^T-op * x^T and dx^T = W^T * dy^T.
void dense_bf16_product(cublasHandle_t handle, bool input_grad, std::int64_t M, std::int64_t N, std::int64_t K,
                        const memkit::bf16* w, const memkit::bf16* x, memkit::bf16* y) {
  const float one = 1.0f, zero = 0.0f;
  const int n = static_cast<int>(N), k = static_cast<int>(K), m = static_cast<int>(M);
  memkit::detail::cublas_check(
      input_grad ? cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, k, m, n, &one, w, CUDA_R_16BF, k, x, CUDA_R_16BF, n,
                                &zero, y, CUDA_R_16BF, k, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
                 : cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, CUDA_R_16BF, k, x, CUDA_R_16BF, k,
                                &zero, y, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

// The dense bf16 peer of both NF4 products on W [kN, kK].
void BM_cuda_matmul_dense_bf16(benchmark::State& state, bool input_grad) {
  const std::int64_t M = state.range(0);
  memkit::device_resource device;
  memkit::buffer<memkit::bf16> w(device, {kN, kK}), x(device, {M, input_grad ? kN : kK}), y(device, {M, input_grad ? kK : kN});
  fill_normalish<<<1024, 256>>>(w.data(), kN * kK);
  MEMKIT_CUDA_CHECK(cudaGetLastError());
  fill_normalish<<<1024, 256>>>(x.data(), x.size());
  MEMKIT_CUDA_CHECK(cudaGetLastError());
  cublasHandle_t handle;
  memkit::detail::cublas_check(cublasCreate(&handle), "cublasCreate");
  const double bytes = static_cast<double>(w.bytes() + x.bytes() + y.bytes());
  const double seconds =
      run_timed(state, [&] { dense_bf16_product(handle, input_grad, M, kN, kK, w.data(), x.data(), y.data()); }, bytes);
  report_tflops(state, M, seconds);
  cublasDestroy(handle);
}

// #30's training shapes: the NF4 product (forward, or input gradient when input_grad) and the dense bf16 cuBLAS
// product of the same W [N, K] and M, timed alternately in the same iterations (same clocks, same process), with
// the default matmul_config (the device tile holds each of these W whole: one dequantize per weight per call).
// Args: M, K, N. Manual time: memkit's; counters: dense_ms (cuBLAS, per call) and ratio = memkit / dense (the
// target is 1.25 at most).
void BM_cuda_matmul_nf4_vs_dense(benchmark::State& state, bool input_grad) {
  const std::int64_t M = state.range(0), K = state.range(1), N = state.range(2);
  memkit::device_resource device;
  const memkit::cuda_executor gpu = memkit::cuda_executor::legacy_default_stream();
  memkit::buffer<memkit::bf16> dense(device, {N, K}), in(device, {M, input_grad ? N : K}), out(device, {M, input_grad ? K : N});
  fill_normalish<<<1024, 256>>>(dense.data(), N * K);
  MEMKIT_CUDA_CHECK(cudaGetLastError());
  fill_normalish<<<1024, 256>>>(in.data(), in.size());
  MEMKIT_CUDA_CHECK(cudaGetLastError());
  const auto w = q::quantized_tensor<q::NF4>::quantize(gpu, memkit::tensor_view<const memkit::bf16>(dense.view()), {64, true}, device);
  memkit::device_async_resource workspace(gpu.stream);
  const q::matmul_config config;
  const memkit::tensor_view<const memkit::bf16> input = in.view();
  cublasHandle_t handle;
  memkit::detail::cublas_check(cublasCreate(&handle), "cublasCreate");
  auto quantized = [&] {
    if (input_grad) q::matmul_input_grad(gpu, input, w, out.view(), config, workspace);
    else q::matmul(gpu, input, w, out.view(), config, workspace);
  };
  auto reference = [&] { dense_bf16_product(handle, input_grad, M, N, K, dense.data(), in.data(), out.data()); };
  memkit_bench::event_timer timer;
  quantized();  // warm-up: cuBLAS' heuristics, the pool's first mapping of the tile
  reference();
  double memkit_seconds = 0.0, dense_seconds = 0.0;
  for (auto _ : state) {
    const double seconds = timer.seconds(quantized);
    dense_seconds += timer.seconds(reference);
    state.SetIterationTime(seconds);
    memkit_seconds += seconds;
  }
  cublasDestroy(handle);
  const double iterations = static_cast<double>(state.iterations());
  state.counters["dense_ms"] = dense_seconds / iterations * 1e3;
  state.counters["ratio"] = memkit_seconds / dense_seconds;
  state.counters["TFLOPs"] = 2.0 * double(M) * double(N) * double(K) * iterations / memkit_seconds * 1e-12;
  state.counters["dense_TFLOPs"] = 2.0 * double(M) * double(N) * double(K) * iterations / dense_seconds * 1e-12;
}

}  // namespace

int main(int argc, char** argv) {
  // The device's default memory pool keeps freed memory (release threshold at its maximum, as PyTorch's caching
  // allocator does) instead of returning it at each synchronization, so the tiled path's workspace, allocated
  // again by each call, is not mapped again by each call: with the default threshold (0) and a synchronization
  // per call, mapping the 128 MiB tile cost ~110 us per call on an H200 (docs/cuda.md).
  // MEMKIT_BENCH_KEEP_POOL=0 measures with the default threshold.
  if (const char* keep = std::getenv("MEMKIT_BENCH_KEEP_POOL"); keep == nullptr || keep[0] != '0') {
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, 0) == cudaSuccess) {
      std::uint64_t threshold = UINT64_MAX;
      MEMKIT_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
      std::printf("memkit_bench_quant_cuda: the default memory pool keeps freed memory (MEMKIT_BENCH_KEEP_POOL=0: it does not)\n");
    }
  }
  return memkit_bench::run_cuda_benchmarks(argc, argv, "memkit_bench_quant_cuda", [] {
    benchmark::RegisterBenchmark("BM_cuda_quantize/nf4", BM_cuda_quantize<q::NF4>)->UseManualTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_cuda_quantize/int8", BM_cuda_quantize<q::INT8>)->UseManualTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_cuda_dequantize/nf4", BM_cuda_dequantize<q::NF4>)->UseManualTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_cuda_dequantize/fp4", BM_cuda_dequantize<q::FP4>)->UseManualTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_cuda_dequantize/int8", BM_cuda_dequantize<q::INT8>)->UseManualTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_cuda_dequantize/nf4_double_quant", BM_cuda_dequantize_nf4_double_quant)->UseManualTime()->Unit(benchmark::kMillisecond);
    // Batch 1 and 8: the fused kernels; 256: the tiled path; 1,024 and 4,096 tokens: training shapes (#30's
    // target: within 1.25x of dense bf16).
    for (int m : {1, 8, 256, 1024, 4096}) {
      benchmark::RegisterBenchmark("BM_cuda_matmul_nf4", BM_cuda_matmul_nf4, 0, true)->Arg(m)->UseManualTime()->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark("BM_cuda_matmul_dense_bf16", BM_cuda_matmul_dense_bf16, false)->Arg(m)->UseManualTime()->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark("BM_cuda_matmul_input_grad_nf4", BM_cuda_matmul_input_grad_nf4, 0)->Arg(m)->UseManualTime()->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark("BM_cuda_matmul_input_grad_dense_bf16", BM_cuda_matmul_dense_bf16, true)->Arg(m)->UseManualTime()->Unit(benchmark::kMicrosecond);
    }
    // Llama-3-8B's layer shapes (K x N: attention 4096 x 4096, MLP up 4096 x 14336, down 14336 x 4096) at M = 1,024
    // and 8,192 tokens, each NF4 product beside dense bf16 in the same iterations: 12 rows, about 0.2 s each.
    for (const bool input_grad : {false, true})
      for (const auto& [K, N] : std::initializer_list<std::pair<int, int>>{{4096, 4096}, {4096, 14336}, {14336, 4096}})
        for (int m : {1024, 8192})
          benchmark::RegisterBenchmark(input_grad ? "BM_cuda_matmul_nf4_vs_dense/input_grad" : "BM_cuda_matmul_nf4_vs_dense/forward",
                                       BM_cuda_matmul_nf4_vs_dense, input_grad)
              ->Args({m, K, N})->ArgNames({"M", "K", "N"})->UseManualTime()->Unit(benchmark::kMicrosecond);
    // The previous fused kernel, side by side with the shuffle-codebook one above.
    for (int m : {1, 8})
      benchmark::RegisterBenchmark("BM_cuda_matmul_nf4_shared_codebook", BM_cuda_matmul_nf4, 0, false)->Arg(m)->UseManualTime()->Unit(benchmark::kMicrosecond);
    // The tiled path with 32 MiB tiles (2^24 values, the default before whole-W tiles): four tiles of W here.
    for (int m : {256, 1024, 4096}) {
      benchmark::RegisterBenchmark("BM_cuda_matmul_nf4_tile24", BM_cuda_matmul_nf4, std::int64_t{1} << 24, true)->Arg(m)->UseManualTime()->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark("BM_cuda_matmul_input_grad_nf4_tile24", BM_cuda_matmul_input_grad_nf4, std::int64_t{1} << 24)->Arg(m)->UseManualTime()->Unit(benchmark::kMicrosecond);
    }
  });
}
