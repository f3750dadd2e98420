// memory_budget's memkit runtime on the host, for examples/train_llama's shortened run (--short: hidden 128,
// 2 layers, 4 heads / 2 kv heads, MLP 352, byte vocabulary, 4 x 64 tokens, 2 host threads): the block's saved
// tensors, its workspace temporaries, the checkpointed stack and the peak, hand-computed from what
// memkit/models/llama/block.hpp allocates. The example's --check (CTest memkit.example.train_llama_short) holds the
// same prediction to the tracking_resource's measured peak within 2%.
#include <doctest/doctest.h>
#include <memkit/memkit.hpp>

#include <algorithm>
#include <cstdint>
#include <utility>

namespace {
using namespace memkit::budget;

constexpr std::uint64_t T = 4 * 64, e = 2, h = 128, f = 352, qw = 128, kvw = 64, L = 2;
constexpr std::uint64_t H = e * T * h;  // one hidden state: 65,536 bytes

const model_config example = llama_style("memkit-example", h, L, 4, 2, f, 256, false, 256);

training_plan short_run(bool qlora) {
  training_plan p{.runtime = runtime_kind::memkit,
                  .precision = precision_mode::bf16_mixed,
                  .optimizer = optimizer_kind::adamw_8bit,
                  .micro_batch = 4,
                  .sequence = 64,
                  .grad_accum = 2,
                  .checkpoint = checkpointing::every_layer,
                  .logits = logits_mode::chunked,
                  .logits_chunk_tokens = 256,
                  .fp32_norm_and_softmax = false,
                  .host_threads = 2,
                  .overhead = host_overhead};
  if (qlora) {
    p.training = method::lora;
    p.weights = {weight_format::nf4, 64, true};
    p.lora.rank = 8;
    p.precision = precision_mode::bf16;  // bf16 adapters with stochastic rounding, no master copy
  }
  return p;
}

// The largest workspace one operation of the block takes on the host (2 threads), from the components.
std::uint64_t dense_linear_workspace() {
  const memkit::linalg::gemm_options g{2};
  std::uint64_t peak = 0;
  for (auto [in, out] : {std::pair<std::int64_t, std::int64_t>{128, 128}, {128, 64}, {128, 352}, {352, 128}}) {
    peak = std::max<std::uint64_t>(peak, memkit::linalg::gemm_workspace_bytes<memkit::bf16, memkit::bf16, memkit::bf16>(256, out, in, g));
    peak = std::max<std::uint64_t>(peak, memkit::linalg::gemm_workspace_bytes<memkit::bf16, memkit::bf16, float>(out, in, 256, g));
    peak = std::max<std::uint64_t>(peak, memkit::linalg::gemm_workspace_bytes<memkit::bf16, memkit::bf16, memkit::bf16>(256, in, out, g));
  }
  return peak;
}
memkit::attention::attention_options two_threads() {
  memkit::attention::attention_options o{};
  o.host_threads = 2;
  return o;
}
}  // namespace

TEST_CASE("budget memkit runtime: the example's block saves what memkit/models/llama/block.hpp saves") {
  const block_activations full = block_activation_bytes(example, short_run(false));
  // attn_norm x + fp32 1/rms; q, k, v each their own copy of n1; q, k, v in heads; attention out + fp32 lse
  // [4, 4, 64]; o's copy of its input; mlp_norm; gate and up copies; SwiGLU's input [T, 2f]; down's input.
  const std::uint64_t full_saved = (H + 4 * T) + 3 * H + e * T * (qw + 2 * kvw) + (e * T * qw + 4 * 4 * 4 * 64) +
                                   e * T * qw + (H + 4 * T) + 2 * H + e * T * 2 * f + e * T * f;
  CHECK(full_saved == 1267712);
  CHECK(full.saved_bytes == full_saved);
  // Forward scratch: n1, attn, h, n2, d; q, o_in; k, v; gate|up; SwiGLU out. Backward: da; dgu; dn2, partial,
  // dh, dn1; do_in, dout, dqh, dq; dkh, dvh, dk, dv. (Every piece a multiple of 64 bytes already.)
  const std::uint64_t forward_scratch = 5 * H + 2 * e * T * qw + 2 * e * T * kvw + e * T * 2 * f + e * T * f;
  const std::uint64_t backward_scratch = e * T * f + e * T * 2 * f + 4 * H + 4 * e * T * qw + 4 * e * T * kvw;
  CHECK(forward_scratch == 1064960);
  CHECK(backward_scratch == 1196032);
  CHECK(full.transients_in_workspace);
  const std::uint64_t linears = dense_linear_workspace();
  const memkit::attention::problem_arguments attention{
      .batch = 4, .query_heads = 4, .kv_heads = 2, .sequence = 64, .head_dim = 32, .options = two_threads()};
  const std::uint64_t attention_forward = memkit::attention::workspace_bytes(memkit::attention::forward_arguments{attention});
  const std::uint64_t attention_backward = memkit::attention::workspace_bytes(memkit::attention::backward_arguments{attention});
  CHECK(full.forward_transient == forward_scratch + std::max(linears, attention_forward));
  CHECK(full.backward_transient == backward_scratch + std::max(linears, attention_backward));

  // QLoRA: no linear keeps its input; each of the 7 lora_linears its own bf16 copy, [T, 8] and a 32-byte record.
  const block_activations qlora = block_activation_bytes(example, short_run(true));
  const std::uint64_t adapters = 6 * (H + e * T * 8 + 32) + (e * T * f + e * T * 8 + 32);
  CHECK(qlora.saved_bytes == full_saved - (3 * H + e * T * qw + 2 * H + e * T * f) + adapters);
}

TEST_CASE("budget memkit runtime: the example's shortened pretraining peak, hand-computed") {
  const memory_estimate est = estimate_memory(example, short_run(false));
  REQUIRE(est.valid());
  // Weights: embedding and head 256 x 128, 5 norms, 2 blocks of projections, the fp32 rotary table.
  const std::uint64_t projections = 128 * 128 + 2 * 64 * 128 + 128 * 128 + 3 * 352 * 128;  // 184,320 per block
  const std::uint64_t parameters = 2 * 256 * 128 + 5 * 128 + L * projections;
  CHECK(est.device[category::weights] == 2 * parameters + 4 * 2 * 256 * 16);  // 902,400
  CHECK(est.device[category::weights] == 902400);
  CHECK(est.device[category::gradients] == 4 * parameters);
  CHECK(est.device[category::master_weights] == 4 * parameters);
  // The peak: block 1's backward. The loop's 4 buffers (embedding output, stack output, loss gradient,
  // embedding gradient); memkit::checkpoint::segment's copies of blocks 0 and 1's inputs and the incoming gradient
  // dy, its dx; block 1's recomputed saved tensors; the backward scratch plus the largest operation workspace.
  CHECK(est.peak_phase == step_phase::backward);
  const block_activations block = block_activation_bytes(example, short_run(false));
  CHECK(est.device[category::activations] == 4 * H + 3 * H + block.saved_bytes);  // 1,726,464
  CHECK(est.device[category::activations] == 1726464);
  CHECK(est.device[category::workspace] == block.backward_transient);
  CHECK(est.device[category::logits] == 0);
  CHECK(est.device[category::overhead] == 0);
}

TEST_CASE("budget memkit runtime: the example's shortened QLoRA peak, hand-computed") {
  const memory_estimate est = estimate_memory(example, short_run(true));
  REQUIRE(est.valid());
  CHECK(est.device[category::master_weights] == 0);  // stochastic rounding
  // 7 adapters per block, A [8, in] and B [out, 8], fp32 gradients.
  const std::uint64_t lora = 8 * (6 * 128 + 352) + 8 * (128 + 64 + 64 + 128 + 352 + 352 + 128);
  CHECK(est.device[category::gradients] == 4 * L * lora);  // 149,504
  CHECK(est.peak_phase == step_phase::backward);
  const block_activations block = block_activation_bytes(example, short_run(true));
  // Three loop buffers: the embedding does not train.
  CHECK(est.device[category::activations] == 3 * H + 3 * H + block.saved_bytes);
  CHECK(est.device[category::workspace] == block.backward_transient);
}
