// CUDA quantization throughput and the quantized matmul against cuBLAS on dense bf16 weights.
//
// Quantize / dequantize 256 Mi values (bytes moved = values + codes + scales), timed with CUDA events,
// reported as bytes/s and as a fraction of the measured device-to-device copy bandwidth (the roofline a
// memory-bound kernel can reach). Matmul: y = x * W^T, W [8192, 8192], NF4 with double quantization,
// against cublasGemmEx on the same weights in bf16, for batch 1, 8 (fused kernel) and 256 (tiles + cuBLAS);
// and the input gradient dx = dy * W for batch 1 and 8 (the fused tiled kernel). Bytes moved: W's codes and
// scales plus the activations, so the fraction shown is of the 4-bit-weight roofline.
#include <benchmark/benchmark.h>
#include <memkit/memkit.hpp>

#include <random>
#include <vector>

#include "support/cuda_timing.hpp"

namespace q = memkit::quant;

namespace {

constexpr std::int64_t kValues = std::int64_t{1} << 28;
constexpr std::int64_t kBlock = 64;

template <class Body>
void run_timed(benchmark::State& state, Body&& body, double bytes) {
  const double seconds = memkit_bench::time_with_events(state, body);
  memkit_bench::report_device_throughput(state, bytes, seconds, memkit_bench::measured_device_bandwidth());
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

constexpr std::int64_t kN = 8192, kK = 8192;

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

void BM_cuda_matmul_nf4(benchmark::State& state) {
  nf4_matmul_case c(state.range(0), kK, kN);
  memkit::device_async_resource workspace(c.gpu.stream);  // stream-ordered: no cudaFree in the timed loop
  run_timed(state, [&] { q::matmul(c.gpu, c.input(), c.w, c.out.view(), workspace); }, c.bytes);
}

// dx = dy * W for the fused small-batch input gradient (the tiled kernel, W's rows split over blocks).
void BM_cuda_matmul_input_grad_nf4(benchmark::State& state) {
  nf4_matmul_case c(state.range(0), kN, kK);
  memkit::device_async_resource workspace(c.gpu.stream);  // the split kernel's partial sums, stream-ordered
  run_timed(state, [&] { q::matmul_input_grad(c.gpu, c.input(), c.w, c.out.view(), workspace); }, c.bytes);
}

void BM_cuda_matmul_dense_bf16(benchmark::State& state) {
  const std::int64_t M = state.range(0);
  memkit::device_resource device;
  memkit::buffer<memkit::bf16> w(device, {kN, kK}), x(device, {M, kK}), y(device, {M, kN});
  fill_normalish<<<1024, 256>>>(w.data(), kN * kK);
  MEMKIT_CUDA_CHECK(cudaGetLastError());
  fill_normalish<<<1024, 256>>>(x.data(), M * kK);
  MEMKIT_CUDA_CHECK(cudaGetLastError());
  cublasHandle_t handle;
  memkit::detail::cublas_check(cublasCreate(&handle), "cublasCreate");
  const float one = 1.0f, zero = 0.0f;
  const double bytes = static_cast<double>(w.bytes() + x.bytes() + y.bytes());
  run_timed(state,
            [&] {
              memkit::detail::cublas_check(
                  cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(kN), static_cast<int>(M),
                               static_cast<int>(kK), &one, w.data(), CUDA_R_16BF, static_cast<int>(kK), x.data(),
                               CUDA_R_16BF, static_cast<int>(kK), &zero, y.data(), CUDA_R_16BF, static_cast<int>(kN),
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                  "cublasGemmEx");
            },
            bytes);
  cublasDestroy(handle);
}

}  // namespace

int main(int argc, char** argv) {
  return memkit_bench::run_cuda_benchmarks(argc, argv, "memkit_bench_quant_cuda", [] {
    benchmark::RegisterBenchmark("BM_cuda_quantize/nf4", BM_cuda_quantize<q::NF4>)->UseManualTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_cuda_quantize/int8", BM_cuda_quantize<q::INT8>)->UseManualTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_cuda_dequantize/nf4", BM_cuda_dequantize<q::NF4>)->UseManualTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_cuda_dequantize/fp4", BM_cuda_dequantize<q::FP4>)->UseManualTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_cuda_dequantize/int8", BM_cuda_dequantize<q::INT8>)->UseManualTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_cuda_dequantize/nf4_double_quant", BM_cuda_dequantize_nf4_double_quant)->UseManualTime()->Unit(benchmark::kMillisecond);
    for (int m : {1, 8})
      benchmark::RegisterBenchmark("BM_cuda_matmul_input_grad_nf4", BM_cuda_matmul_input_grad_nf4)->Arg(m)->UseManualTime()->Unit(benchmark::kMicrosecond);
    for (int m : {1, 8, 256}) {
      benchmark::RegisterBenchmark("BM_cuda_matmul_nf4", BM_cuda_matmul_nf4)->Arg(m)->UseManualTime()->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark("BM_cuda_matmul_dense_bf16", BM_cuda_matmul_dense_bf16)->Arg(m)->UseManualTime()->Unit(benchmark::kMicrosecond);
    }
  });
}
