// memory_budget's memkit runtime models memkit/models/llama/block.hpp: for the example's block (bf16, 2 host
// threads; pretraining with dense_linear and QLoRA with LoRA over NF4), untiled and with the sequence-tiled MLP
// at chunks that do and do not divide the tokens, the budget's saved bytes, its largest temporaries and its
// MLP forward and backward phases equal the decoder_block's own byte functions (saved_bytes, workspace_bytes,
// forward/backward_scratch_bytes + mlp_workspace_bytes), which models_llama_tiled_mlp_test holds to the
// tracked peak.
#include <memkit/memkit.hpp>
#include <memkit/models/llama/load.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>

namespace llama = memkit::models::llama;
namespace budget = memkit::budget;

namespace {

constexpr std::int64_t batch = 4, seq = 64, tokens = batch * seq;

budget::training_plan plan_of(bool qlora, std::int64_t chunk) {
  budget::training_plan p{.runtime = budget::runtime_kind::memkit,
                          .precision = budget::precision_mode::bf16_mixed,
                          .micro_batch = batch,
                          .sequence = seq,
                          .checkpoint = budget::checkpointing::every_layer,
                          .logits = budget::logits_mode::chunked,
                          .fp32_norm_and_softmax = false,
                          .host_threads = 2,
                          .overhead = budget::host_overhead};
  if (qlora) {
    p.training = budget::method::lora;
    p.weights = {budget::weight_format::nf4, 64, true};
    p.lora.rank = 8;
    p.precision = budget::precision_mode::bf16;
  }
  p.mlp_token_chunk = static_cast<std::uint64_t>(chunk);
  return p;
}

template <class Block>
void compare(Block& block, bool qlora) {
  const llama::model_config& c = block.config;
  const budget::model_config m = budget::llama_style("block", c.hidden, 1, c.heads, c.kv_heads, c.intermediate, c.vocab,
                                                     false, c.max_positions);
  const memkit::shape in{batch, seq, c.hidden};
  for (const std::int64_t chunk : {std::int64_t{0}, std::int64_t{1}, std::int64_t{100}, tokens, std::int64_t{300}}) {
    CAPTURE(chunk);
    block.mlp_token_chunk = chunk;
    const budget::training_plan p = plan_of(qlora, chunk);
    REQUIRE(budget::memkit_block_modelled(m, p));
    const budget::block_activations a = budget::block_activation_bytes(m, p);
    CHECK(a.saved_bytes == block.saved_bytes(in, {}));
    CHECK(std::max(a.forward_transient, a.backward_transient) == block.workspace_bytes(in));
    CHECK(a.backward_phase_transient[0] == block.backward_scratch_bytes(in) + block.mlp_workspace_bytes(in));
    // The forward's MLP phase runs with every saved tensor of the block saved (tiled: n2 before the chunks).
    CHECK(a.forward_unsaved[0] == 0);
    CHECK(a.forward_phase_transient[0] == block.forward_scratch_bytes(in) + block.mlp_workspace_bytes(in));
  }
  // Tiling keeps less: at 100 tokens a chunk the block saves the MLP input instead of four [256, .] tensors.
  block.mlp_token_chunk = 0;
  const std::size_t untiled = block.saved_bytes(in, {});
  block.mlp_token_chunk = 100;
  CHECK(block.saved_bytes(in, {}) < untiled);
  block.mlp_token_chunk = 0;
}

memkit::layers::memory_resources host_memory() {
  memkit::layers::memory_resources memory;
  memory.host_threads = 2;
  return memory;
}

}  // namespace

TEST_CASE("budget memkit runtime: the example's block, untiled and tiled, has the decoder_block's own bytes") {
  llama::model_config c;  // the example's model (hidden 128, MLP 352, 4 heads / 2 kv heads), one layer
  c.layers = 1;
  const memkit::layers::memory_resources memory = host_memory();
  const auto mode = memkit::layers::trainability::bf16_master;
  llama::causal_lm<memkit::bf16, memkit::layers::dense_linear<memkit::bf16>> dense(
      c, memory, mode, [&](const llama::projection& p, std::int64_t, int) { return llama::make_dense_linear<memkit::bf16>(p, memory, mode); });
  compare(dense.blocks[0], false);

  llama::lora_load_options options;
  options.lora.rank = 8;
  options.quant = {64, true};
  auto qlora = llama::build_lora_causal_lm<memkit::bf16, memkit::quant::quantized_tensor<memkit::quant::NF4>>(
      memkit::host, c, memory, options, llama::random_weights{1, 0.02f});
  compare(qlora->blocks[0], true);
}

TEST_CASE("budget: a tiled MLP outside memkit's Llama block is refused") {
  budget::training_plan p = plan_of(false, 64);
  p.runtime = budget::runtime_kind::pytorch;
  const budget::memory_estimate e = budget::estimate_memory(budget::presets::smollm2_360m, p);
  CHECK(!e.valid());
  CHECK(std::string(e.problem).find("mlp_token_chunk (the sequence-tiled MLP) is modelled for memkit's Llama-style block only") !=
        std::string::npos);
}
