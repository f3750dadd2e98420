// memkit::attention on a CUDA device, issue #29's matrix: bf16, forward alone and forward + backward, causal and
// not, head_dim 64 and 128, seq 1K-32K, shaped as FlashAttention's benchmarks are: batch = 16384 / seq (at least
// 1), heads = 2048 / head_dim, which fills the GPU at every length. Timed with CUDA events on a stream. Counters:
// TFLOP/s in FlashAttention's count (forward 4 B H S^2 D, halved when causal; backward 2.5x forward), the device
// bytes beyond q, k, v, out and the gradients (lse + delta) and what a materialized fp32 attention would hold
// (eager_attention_bytes). bench/gpu/attention_matrix.py holds the same shapes and count for the peers
// (bench/peers/gpu_peers.py: torch's SDPA, flash and cuDNN backends, rows of the same names) and pairs the rows in
// bench/gpu/measure.py; tests/tools/measure_attention_check.py checks that the two agree.
// Every family's arguments start seq, head_dim, causal (run_flash reads them). BM_flash_cuda runs
// attention_kernel::automatic (the WMMA kernels today), BM_flash_cuda_mma the mma kernels (forward, backward's dk/dv
// and dq passes; also head_dim 96 and 256, causal, at 4K and 16K), and BM_flash_forward_cuda the forward alone with
// each kernel (kernel:0 = automatic, 2 = mma). Built with MEMKIT_USE_CUDNN (CMake -DMEMKIT_USE_CUDNN=ON;
// ./dev.sh gpu-build with MEMKIT_GPU_CUDNN=1), BM_flash_cuda_cudnn and BM_flash_forward_cuda_cudnn run
// attention::cudnn (cuDNN's fused attention); their counter cudnn is 1 when cuDNN ran every direction timed, 0 when
// the row measured the built-in fallback instead.
// The whole matrix takes about 160 s at 5 TFLOP/s (docs/attention.md, "Speed (CUDA)"); ./dev.sh gpu runs the
// 32K rows only as far as its time budget allows.
#include <benchmark/benchmark.h>
#include <memkit/attention/cudnn.hpp>
#include <memkit/attention/flash_attention.hpp>
#include <memkit/core/random.hpp>
#include <memkit/memory/resource.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "support/cuda_timing.hpp"

namespace {

namespace att = memkit::attention;
constexpr std::int64_t tokens = 16384, width = 2048;  // batch x seq (at least one sequence), heads x head_dim
const std::vector<std::int64_t> seqs{1024, 2048, 4096, 8192, 16384, 32768};
const std::vector<std::int64_t> head_dims{64, 128};
const std::vector<std::int64_t> extra_seqs{4096, 16384}, extra_head_dims{96, 256};  // mma-only head_dims

// Uniform values in [-1, 1) from memkit::random_word, written on the device: the peers time randn inputs, and
// constant inputs could change the tensor cores' power draw (and so the clocks) against them.
__global__ void fill_uniform(memkit::bf16* out, std::int64_t n, std::uint64_t counter) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n; i += stride)
    out[i] = memkit::bf16(2.0f * memkit::unit_float(memkit::random_word(29, counter, std::uint64_t(i))) - 1.0f);
}

// Forward and backward (forward alone when `backward` is false) with the given kernel, or through cuDNN; arguments
// seq, head_dim, causal (0 or 1) first.
void run_flash(benchmark::State& state, att::attention_kernel kernel, bool backward,
               [[maybe_unused]] bool cudnn = false) {
  const std::int64_t S = state.range(0), D = state.range(1), B = std::max<std::int64_t>(1, tokens / S),
                     heads = width / D;
  cudaStream_t stream{};
  MEMKIT_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    memkit::device_async_resource device(stream);
    const memkit::shape qs{B, heads, S, D}, ls{B, heads, S};
    memkit::buffer<memkit::bf16> q(device, qs), k(device, qs), v(device, qs), out(device, qs), dout(device, qs),
        dq(device, qs), dk(device, qs), dv(device, qs);
    memkit::buffer<float> lse(device, ls);
    std::uint64_t counter = 0;
    for (auto* b : {&q, &k, &v, &dout}) {
      fill_uniform<<<1024, 256, 0, stream>>>(b->data(), b->size(), counter++);
      MEMKIT_CUDA_CHECK(cudaGetLastError());
    }
    const memkit::cuda_executor exec{0, stream};
    att::attention_options o;
    o.kernel = kernel;
    o.causal = state.range(2) != 0;
    const att::backward_arguments problem{{.batch = B, .query_heads = heads, .kv_heads = heads, .sequence = S,
                                            .head_dim = D, .element_bytes = 2, .on_device = true, .options = o}};
    std::size_t workspace = att::workspace_bytes(problem);
    const auto step = [&] {
#if defined(MEMKIT_USE_CUDNN)
      if (cudnn) {
        att::cudnn::forward<memkit::bf16>(exec, q.view(), k.view(), v.view(), out.view(), lse.view(), o, device);
        if (backward)
          att::cudnn::backward<memkit::bf16>(exec, {q.view(), k.view(), v.view(), out.view(), lse.view()},
                                             dout.view(), {dq.view(), dk.view(), dv.view()}, o, device);
        return;
      }
#endif
      att::forward<memkit::bf16>(exec, q.view(), k.view(), v.view(), out.view(), lse.view(), o, device);
      if (backward)
        att::backward<memkit::bf16>(exec, {q.view(), k.view(), v.view(), out.view(), lse.view()}, dout.view(),
                                    {dq.view(), dk.view(), dv.view()}, o, device);
    };
#if defined(MEMKIT_USE_CUDNN)
    if (cudnn) {
      state.counters["cudnn"] = att::cudnn::path_for<memkit::bf16>(exec, problem, false).uses_cudnn &&
                                (!backward || att::cudnn::path_for<memkit::bf16>(exec, problem, true).uses_cudnn);
      workspace = att::cudnn::workspace_bytes<memkit::bf16>(exec, problem);
    }
#endif
    const double seconds = memkit_bench::time_with_events(state, step, stream);
    const double flops = (backward ? 3.5 : 1.0) * 4.0 * double(B * heads) * double(S) * double(S) * double(D) /
                         (o.causal ? 2 : 1);
    state.counters["TFLOPs"] = flops * double(state.iterations()) / seconds * 1e-12;
    state.counters["extra_MiB"] = double(lse.bytes() + workspace) / (1 << 20);
    state.counters["materialized_MiB"] = double(att::eager_attention_bytes(B, heads, S)) / (1 << 20);
    MEMKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  MEMKIT_CUDA_CHECK(cudaStreamDestroy(stream));
}

void BM_flash_cuda(benchmark::State& state) { run_flash(state, att::attention_kernel::automatic, true); }
void BM_flash_cuda_mma(benchmark::State& state) { run_flash(state, att::attention_kernel::mma, true); }
#if defined(MEMKIT_USE_CUDNN)
void BM_flash_cuda_cudnn(benchmark::State& state) { run_flash(state, att::attention_kernel::automatic, true, true); }
void BM_flash_forward_cuda_cudnn(benchmark::State& state) {
  run_flash(state, att::attention_kernel::automatic, false, true);
}
#endif
void BM_flash_forward_cuda(benchmark::State& state) {
  run_flash(state, static_cast<att::attention_kernel>(state.range(3)), false);
}

}  // namespace

int main(int argc, char** argv) {
  return memkit_bench::run_cuda_benchmarks(argc, argv, "memkit_bench_attention_cuda", [] {
    benchmark::RegisterBenchmark("BM_flash_cuda", BM_flash_cuda)
        ->ArgsProduct({seqs, head_dims, {0, 1}})
        ->ArgNames({"seq", "head_dim", "causal"})
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_flash_cuda_mma", BM_flash_cuda_mma)
        ->ArgsProduct({seqs, head_dims, {0, 1}})
        ->ArgNames({"seq", "head_dim", "causal"})
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    // head_dim 96 and 256 (which only the mma kernels run) at two lengths, causal: ./dev.sh gpu has an 8-minute budget.
    benchmark::RegisterBenchmark("BM_flash_cuda_mma", BM_flash_cuda_mma)
        ->ArgsProduct({extra_seqs, extra_head_dims, {1}})
        ->ArgNames({"seq", "head_dim", "causal"})
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
#if defined(MEMKIT_USE_CUDNN)
    benchmark::RegisterBenchmark("BM_flash_cuda_cudnn", BM_flash_cuda_cudnn)
        ->ArgsProduct({seqs, head_dims, {0, 1}})
        ->ArgNames({"seq", "head_dim", "causal"})
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_flash_forward_cuda_cudnn", BM_flash_forward_cuda_cudnn)
        ->ArgsProduct({seqs, head_dims, {0, 1}})
        ->ArgNames({"seq", "head_dim", "causal"})
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
#endif
    benchmark::RegisterBenchmark("BM_flash_forward_cuda", BM_flash_forward_cuda)
        ->ArgsProduct({seqs, head_dims, {0, 1},
                       {static_cast<int>(att::attention_kernel::automatic),
                        static_cast<int>(att::attention_kernel::mma)}})
        ->ArgNames({"seq", "head_dim", "causal", "kernel"})
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  });
}
