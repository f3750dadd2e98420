// loss::fused_linear_cross_entropy on CUDA: chunked (the default 32 MiB budget, and 256 MiB and 1 GiB: every
// chunk reads and writes the whole fp32 head gradient, so fewer chunks move fewer bytes) against the same call
// with one chunk holding every token's logits (the materialized baseline: cuBLAS for all [N, V] logits, the softmax
// kernel, cuBLAS for both gradients). Device time per call (CUDA events), GFLOP/s of the three products and
// the peak workspace bytes of each (tracking_resource). bf16 hidden and head, fp32 d_head. Rows ending in
// `_staged` run the staged row pass (cross_entropy_options::row_pass, #30: the row staged once in shared memory
// for Llama 2's 32,000 logits, two reads for Llama 3's 128,256) in the same binary run as the classic rows.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "memkit/loss/fused_linear_cross_entropy.hpp"
#include "memkit/memory/tracking.hpp"
#include "support/cpu_info.hpp"
#include "support/cuda_timing.hpp"

namespace ls = memkit::loss;
using memkit::bf16;

namespace {

struct loss_case {
  const char* name;
  std::int64_t N, H, V;
};

constexpr loss_case cases[] = {
    {"llama2_7b", 8192, 4096, 32000},
    {"llama3_8b", 8192, 4096, 128256},
};

// chunk_mib: the chunk budget in MiB; 0 for the default, -1 for one chunk of every token (materialized), -8 for
// an eighth of the materialized chunk (#30's target: at most 1.2x the materialized time at 1/8 of its memory).
void BM_loss_cuda(benchmark::State& state, loss_case c, int chunk_mib, ls::device_row_pass row_pass) {
  const bool materialized = chunk_mib == -1;
  const auto [name, N, H, V] = c;
  memkit::device_resource device(0);
  memkit::buffer<bf16> hidden(device, memkit::shape{N, H}), head(device, memkit::shape{V, H}), d_hidden(device, memkit::shape{N, H});
  memkit::buffer<float> d_head(device, memkit::shape{V, H}), loss(device, memkit::shape{1});
  memkit::buffer<std::int32_t> targets(device, memkit::shape{N});
  MEMKIT_CUDA_CHECK(cudaMemset(hidden.data(), 0, hidden.bytes()));
  MEMKIT_CUDA_CHECK(cudaMemset(head.data(), 0, head.bytes()));
  MEMKIT_CUDA_CHECK(cudaMemset(d_head.data(), 0, d_head.bytes()));
  MEMKIT_CUDA_CHECK(cudaMemset(targets.data(), 0, targets.bytes()));
  ls::cross_entropy_options options;
  options.row_pass = row_pass;
  if (materialized) options.chunk_bytes = ls::detail::chunk_row_bytes(V, sizeof(bf16), true) * static_cast<std::size_t>(N);
  else if (chunk_mib == -8) options.chunk_bytes = ls::detail::chunk_row_bytes(V, sizeof(bf16), true) * static_cast<std::size_t>(N) / 8;
  else if (chunk_mib > 0) options.chunk_bytes = static_cast<std::size_t>(chunk_mib) << 20;
  memkit::tracking_resource workspace(device, "loss");
  const memkit::cuda_executor exec = memkit::cuda_executor::legacy_default_stream(0);
  const double seconds = memkit_bench::time_with_events(state, [&] {
    ls::fused_linear_cross_entropy(exec, std::as_const(hidden).view(), std::as_const(head).view(),
                                   std::as_const(targets).view(), loss.view(), d_hidden.view(), d_head.view(), options,
                                   workspace);
  });
  const double flops = 3.0 * 2.0 * static_cast<double>(N) * static_cast<double>(V) * static_cast<double>(H);
  state.counters["GFLOPs"] = flops * static_cast<double>(state.iterations()) / seconds / 1e9;
  state.counters["peak_workspace_MiB"] = static_cast<double>(workspace.peak_bytes()) / (1 << 20);
}

// A frozen head (no d_head, as in LoRA / QLoRA fine-tuning) at an eighth of the materialized chunk: dense bf16,
// or NF4 with double quantization (#30: the quantized head at the dense head's targets). Two products per
// token (logits and d_hidden), so GFLOP/s counts 2 x 2 N V H.
void BM_loss_cuda_frozen_head(benchmark::State& state, loss_case c, bool nf4) {
  const auto [name, N, H, V] = c;
  memkit::device_resource device(0);
  memkit::buffer<bf16> hidden(device, memkit::shape{N, H}), head(device, memkit::shape{V, H}), d_hidden(device, memkit::shape{N, H});
  memkit::buffer<float> loss(device, memkit::shape{1});
  memkit::buffer<std::int32_t> targets(device, memkit::shape{N});
  MEMKIT_CUDA_CHECK(cudaMemset(hidden.data(), 0, hidden.bytes()));
  MEMKIT_CUDA_CHECK(cudaMemset(head.data(), 0, head.bytes()));
  MEMKIT_CUDA_CHECK(cudaMemset(targets.data(), 0, targets.bytes()));
  ls::cross_entropy_options options;
  options.chunk_bytes = ls::detail::chunk_row_bytes(V, sizeof(bf16), true) * static_cast<std::size_t>(N) / 8;
  memkit::tracking_resource workspace(device, "loss");
  const memkit::cuda_executor exec = memkit::cuda_executor::legacy_default_stream(0);
  const memkit::tensor_view<float> no_head_grad;
  double seconds = 0;
  if (nf4) {
    const auto quantized = memkit::quant::quantized_tensor<memkit::quant::NF4>::quantize(
        exec, std::as_const(head).view(), {64, true}, device);
    seconds = memkit_bench::time_with_events(state, [&] {
      ls::fused_linear_cross_entropy(exec, std::as_const(hidden).view(), quantized, std::as_const(targets).view(),
                                     loss.view(), d_hidden.view(), no_head_grad, options, workspace);
    });
  } else {
    seconds = memkit_bench::time_with_events(state, [&] {
      ls::fused_linear_cross_entropy(exec, std::as_const(hidden).view(), std::as_const(head).view(),
                                     std::as_const(targets).view(), loss.view(), d_hidden.view(), no_head_grad, options,
                                     workspace);
    });
  }
  const double flops = 2.0 * 2.0 * static_cast<double>(N) * static_cast<double>(V) * static_cast<double>(H);
  state.counters["GFLOPs"] = flops * static_cast<double>(state.iterations()) / seconds / 1e9;
  state.counters["peak_workspace_MiB"] = static_cast<double>(workspace.peak_bytes()) / (1 << 20);
}

}  // namespace

int main(int argc, char** argv) {
  memkit_bench::add_cpu_context();
  return memkit_bench::run_cuda_benchmarks(argc, argv, "memkit_bench_loss_cuda", [] {
    const std::pair<int, const char*> variants[] = {
        {0, "/fused"}, {-8, "/fused_eighth"}, {256, "/fused_chunk_256MiB"}, {1024, "/fused_chunk_1GiB"}, {-1, "/materialized"}};
    for (const loss_case& c : cases) {
      for (const auto& [chunk_mib, suffix] : variants)
        benchmark::RegisterBenchmark((std::string("loss_bf16/") + c.name + suffix).c_str(), BM_loss_cuda, c, chunk_mib,
                                     ls::device_row_pass::classic)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      // The staged row pass at the default budget (174 / 43 rows per chunk), the issue's eighth and materialized.
      for (const auto& [chunk_mib, suffix] : {variants[0], variants[1], variants[4]})
        benchmark::RegisterBenchmark((std::string("loss_bf16/") + c.name + suffix + "_staged").c_str(), BM_loss_cuda, c,
                                     chunk_mib, ls::device_row_pass::staged)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      for (const bool nf4 : {false, true})
        benchmark::RegisterBenchmark((std::string("loss_bf16/") + c.name + (nf4 ? "/nf4_head_eighth" : "/frozen_head_eighth")).c_str(),
                                     BM_loss_cuda_frozen_head, c, nf4)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
    }
  });
}
