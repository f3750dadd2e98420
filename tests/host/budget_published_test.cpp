// Mechanisms found while comparing predictions with published peak-memory measurements
// (docs/memory_budget.md). The comparison itself is the generated validation table: the data are
// tests/data/budget_validation/measurements.json, the generator tools/budget_validation.cpp, and the CTest
// test memkit.budget_validation.docs_current fails when a model change moves a prediction and the table
// in the doc is not regenerated.
#include <doctest/doctest.h>

#include <fstream>
#include <sstream>
#include <string>

#include <memkit/budget/estimate.hpp>

#include "hf_config.hpp"

using namespace memkit::budget;

namespace {
constexpr overhead_settings exact{.cuda_context_bytes = 0, .nccl_bytes = 0, .workspace_bytes = 0,
                                  .allocation_granularity = 1, .fragmentation_percent = 0};
}  // namespace

TEST_CASE("budget: bitsandbytes before 0.43.2 kept every 4-bit linear's input") {
  // Its MatMul4Bit saved its input whenever it needed a gradient, so with LoRA dropout (or on linears
  // without an adapter) an NF4 base kept inputs that a 16-bit frozen base does not; current
  // bitsandbytes (the default) keeps none.
  const model_config& m = presets::llama_2_7b;
  training_plan lora{.training = method::lora, .lora = {32, linear_module::q | linear_module::v, true},
                     .micro_batch = 2, .sequence = 512, .overhead = exact};
  training_plan qlora = lora;
  qlora.weights = {weight_format::nf4, 64, false};
  CHECK(block_activation_bytes(m, qlora).saved_bytes == block_activation_bytes(m, lora).saved_bytes);
  qlora.quantized_matmul_keeps_input = true;
  const std::uint64_t T = 1024, h = m.hidden, f = m.intermediate;
  // qkv input, gate/up input, down input; o_proj's input is the attention output, kept either way.
  CHECK(block_activation_bytes(m, qlora).saved_bytes - block_activation_bytes(m, lora).saved_bytes ==
        2 * T * h + 2 * T * h + 2 * T * f);
  // Without dropout on all seven linears the adapters already keep every input: no difference.
  lora.lora = {32, all_linear_modules, false};
  qlora.lora = lora.lora;
  CHECK(block_activation_bytes(m, qlora).saved_bytes == block_activation_bytes(m, lora).saved_bytes);
}

TEST_CASE("budget: BERT read from its config trains with dropout") {
  // Found by the Transformers single-GPU guide's bert-large-uncased runs (docs/memory_budget.md): BERT's
  // hidden and attention-probability dropout (0.1) keep a mask and a dropped copy of every score matrix.
  std::ifstream in(std::string(MEMKIT_TEST_SOURCE_DIR) + "/tests/data/budget_validation/configs/bert-large-uncased.json");
  REQUIRE(in.good());
  std::stringstream text;
  text << in.rdbuf();
  const model_config bert = memkit_tools::model_from_hf_config(memkit::json::parse(text.str(), "bert"), "bert-large");
  CHECK(bert.dropout);
  const training_plan plan{.precision = precision_mode::fp32, .micro_batch = 4, .sequence = 512,
                           .attention = attention_impl::eager, .overhead = exact};
  model_config without = bert;
  without.dropout = false;
  const std::uint64_t scores = 4 * 16 * 512 * 512, T = 4 * 512, h = 1024;
  // Attention: a 1-byte mask and an fp32 dropped copy of the probabilities; two 1-byte residual masks.
  CHECK(block_activation_bytes(bert, plan).saved_bytes - block_activation_bytes(without, plan).saved_bytes ==
        scores + 4 * scores + 2 * T * h);
  // A config that switches dropout off is read as such.
  std::string off = text.str();
  for (const char* key : {"\"hidden_dropout_prob\": 0.1", "\"attention_probs_dropout_prob\": 0.1"}) {
    const std::size_t at = off.find(key);
    REQUIRE(at != std::string::npos);
    off.replace(at, std::string(key).size(), std::string(key).substr(0, std::string(key).size() - 3) + "0.0");
  }
  CHECK_FALSE(memkit_tools::model_from_hf_config(memkit::json::parse(off, "bert"), "bert-large").dropout);
}

TEST_CASE("budget: Lightning's bitsandbytes plugin quantizes the LM head too, from fp16") {
  // lightning/fabric/plugins/precision/bitsandbytes.py (LitGPT's --quantize bnb.nf4): every nn.Linear becomes a
  // 4-bit linear, the untied LM head included, quantized from `weight.to(torch.half)`: bitsandbytes dequantizes
  // to fp16 and MatMul4Bit casts that to bf16, two whole-weight copies. The head (vocab x hidden) is then the
  // largest quantized linear.
  const model_config& m = presets::llama_3_1_8b;
  training_plan plan{.training = method::lora, .weights = {weight_format::nf4, 64, false},
                     .lora = {32, linear_module::q | linear_module::v, true}, .micro_batch = 2, .sequence = 512,
                     .overhead = exact};
  const memory_estimate plain = estimate_memory(m, plan);
  plan.lightning_bnb = true;
  const memory_estimate lightning = estimate_memory(m, plan);
  REQUIRE(lightning.valid());
  const std::uint64_t head = m.vocab * m.hidden;
  const int step = static_cast<int>(step_phase::optimizer_step);
  CHECK(plain.phases[step][category::weights] - lightning.phases[step][category::weights] ==
        2 * head - nf4_bytes(head, 64, false));
  // Workspace: one bf16 copy of the largest MLP weight before; an fp16 and a bf16 copy of the head now.
  const int forward = static_cast<int>(step_phase::forward);
  CHECK(plain.phases[forward][category::workspace] == 2 * m.intermediate * m.hidden);
  CHECK(lightning.phases[forward][category::workspace] == 2 * 2 * head);
  // Not for 16-bit bases.
  plan.weights = {};
  CHECK_FALSE(estimate_memory(m, plan).valid());
}
