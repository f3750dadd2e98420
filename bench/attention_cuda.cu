// memkit::attention on a CUDA device: one causal forward + backward in bf16, B=1, H=8 heads, timed with CUDA
// events on a stream. Counters: TFLOP/s of the useful causal flops (2 * 2 * S^2 * D / 2 forward, twice that
// backward), the device bytes beyond q, k, v, out and the gradients (lse + delta) and what a materialized fp32
// attention would hold (eager_attention_bytes). bench/peers/gpu_peers.py times torch's SDPA on the same shapes.
// BM_flash_cuda runs attention_kernel::automatic (the WMMA kernels today), BM_flash_cuda_mma the mma kernels
// (forward, backward's dk/dv and dq passes; head_dim 64 and 128, and 96 and 256 at 4K and 16K), and
// BM_flash_forward_cuda the forward alone with each kernel (kernel:1 = wmma, 2 = mma). Built with MEMKIT_USE_CUDNN
// (CMake -DMEMKIT_USE_CUDNN=ON; ./dev.sh gpu-build with MEMKIT_GPU_CUDNN=1), BM_flash_cuda_cudnn runs
// attention::cudnn (cuDNN's fused attention); its counter cudnn is 1 when cuDNN ran both directions, 0 when the
// row measured the built-in fallback instead.
#include <benchmark/benchmark.h>
#include <memkit/attention/cudnn.hpp>
#include <memkit/attention/flash_attention.hpp>
#include <memkit/memory/resource.hpp>

#include <cstdint>
#include <vector>

#include "support/cuda_timing.hpp"

namespace {

namespace att = memkit::attention;
constexpr std::int64_t heads = 8;

// Forward and backward (forward alone when `backward` is false) with the given kernel, or through cuDNN.
void run_flash(benchmark::State& state, att::attention_kernel kernel, bool backward,
               [[maybe_unused]] bool cudnn = false) {
  const std::int64_t S = state.range(0), D = state.range(1);
  cudaStream_t stream{};
  MEMKIT_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    memkit::device_async_resource device(stream);
    const memkit::shape qs{1, heads, S, D}, ls{1, heads, S};
    memkit::buffer<memkit::bf16> q(device, qs), k(device, qs), v(device, qs), out(device, qs), dout(device, qs),
        dq(device, qs), dk(device, qs), dv(device, qs);
    memkit::buffer<float> lse(device, ls);
    std::vector<memkit::bf16> ones(static_cast<std::size_t>(q.size()), memkit::bf16(0.01f));
    for (auto* b : {&q, &k, &v, &dout})
      MEMKIT_CUDA_CHECK(cudaMemcpyAsync(b->data(), ones.data(), b->bytes(), cudaMemcpyHostToDevice, stream));
    const memkit::cuda_executor exec{0, stream};
    att::attention_options o;
    o.kernel = kernel;
    const att::backward_arguments problem{{.batch = 1, .query_heads = heads, .kv_heads = heads, .sequence = S,
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
                                att::cudnn::path_for<memkit::bf16>(exec, problem, true).uses_cudnn;
      workspace = att::cudnn::workspace_bytes<memkit::bf16>(exec, problem);
    }
#endif
    const double seconds = memkit_bench::time_with_events(state, step, stream);
    const double flops = (backward ? 3.0 : 1.0) * 2.0 * 2.0 * double(S) * double(S) * double(D) / 2 * heads;
    state.counters["TFLOPs"] = flops * double(state.iterations()) / seconds * 1e-12;
    state.counters["extra_MiB"] = double(lse.bytes() + workspace) / (1 << 20);
    state.counters["materialized_MiB"] = double(att::eager_attention_bytes(1, heads, S)) / (1 << 20);
    MEMKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  MEMKIT_CUDA_CHECK(cudaStreamDestroy(stream));
}

void BM_flash_cuda(benchmark::State& state) { run_flash(state, att::attention_kernel::automatic, true); }
void BM_flash_cuda_mma(benchmark::State& state) { run_flash(state, att::attention_kernel::mma, true); }
#if defined(MEMKIT_USE_CUDNN)
void BM_flash_cuda_cudnn(benchmark::State& state) { run_flash(state, att::attention_kernel::automatic, true, true); }
#endif
void BM_flash_forward_cuda(benchmark::State& state) {
  run_flash(state, static_cast<att::attention_kernel>(state.range(2)), false);
}

}  // namespace

int main(int argc, char** argv) {
  return memkit_bench::run_cuda_benchmarks(argc, argv, "memkit_bench_attention_cuda", [] {
    benchmark::RegisterBenchmark("BM_flash_cuda", BM_flash_cuda)
        ->ArgsProduct({{1024, 4096, 16384}, {64, 128}})
        ->ArgNames({"seq", "head_dim"})
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_flash_cuda_mma", BM_flash_cuda_mma)
        ->ArgsProduct({{1024, 4096, 16384}, {64, 128}})
        ->ArgNames({"seq", "head_dim"})
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    // head_dim 96 and 256 (which only the mma kernels run) at two lengths only: ./dev.sh gpu has an 8-minute budget.
    benchmark::RegisterBenchmark("BM_flash_cuda_mma", BM_flash_cuda_mma)
        ->ArgsProduct({{4096, 16384}, {96, 256}})
        ->ArgNames({"seq", "head_dim"})
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
#if defined(MEMKIT_USE_CUDNN)
    benchmark::RegisterBenchmark("BM_flash_cuda_cudnn", BM_flash_cuda_cudnn)
        ->ArgsProduct({{1024, 4096, 16384}, {64, 128}})
        ->ArgNames({"seq", "head_dim"})
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
#endif
    benchmark::RegisterBenchmark("BM_flash_forward_cuda", BM_flash_forward_cuda)
        ->ArgsProduct({{1024, 4096, 16384},
                       {64, 128},
                       {static_cast<int>(att::attention_kernel::wmma), static_cast<int>(att::attention_kernel::mma)}})
        ->ArgNames({"seq", "head_dim", "kernel"})
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  });
}
