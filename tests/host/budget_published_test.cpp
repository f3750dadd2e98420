// Predictions next to published peak-memory measurements of real training runs
// (docs/memory_budget.md). The rows pin memkit's predictions, so a model change that moves them is
// noticed and the documented errors stay true.
#include <doctest/doctest.h>

#include <cmath>

#include <memkit/budget/estimate.hpp>

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

TEST_CASE("budget: LitGPT config-hub runs next to their published peaks") {
  // config_hub/finetune/README.md: bf16-true, max_seq_length 512, one A10G, peak =
  // torch.cuda.max_memory_allocated. LitGPT: SDPA (flash), bf16 cross-entropy over the logits, no
  // activation checkpointing, torch AdamW on bf16 adapters, lora_dropout > 0, bitsandbytes < 0.43.2.
  struct published {
    const model_config& model;
    bool quantized;
    module_set targets;
    std::uint64_t rank, micro_batch, grad_accum;
    bool full;
    double measured_gb, predicted_gb;
  };
  const module_set qv = linear_module::q | linear_module::v;
  const published runs[] = {
      {presets::llama_2_7b, false, qv, 32, 2, 4, false, 19.77, 19.64},
      {presets::llama_2_7b, true, qv, 32, 2, 4, false, 13.68, 11.75},
      {presets::llama_3_1_8b, false, qv, 32, 1, 8, false, 19.73, 19.96},
      {presets::llama_3_1_8b, true, qv, 32, 2, 4, false, 17.41, 14.75},
      {presets::mistral_7b, false, qv, 32, 2, 4, false, 20.66, 20.82},
      {presets::mistral_7b, true, qv, 32, 2, 4, false, 14.29, 12.38},
      {presets::tinyllama_1_1b, false, all_linear_modules, 32, 4, 8, true, 14.10, 13.86},
      {presets::tinyllama_1_1b, false, all_linear_modules, 32, 8, 1, false, 13.50, 14.25},
      {presets::tinyllama_1_1b, true, all_linear_modules, 32, 8, 1, false, 16.24, 14.64},
      {presets::gemma_2b, false, all_linear_modules, 8, 2, 3, false, 12.62, 11.64},
  };
  int within_10_percent = 0;
  for (const published& run : runs) {
    CAPTURE(run.model.name);
    CAPTURE(run.measured_gb);
    training_plan plan{.training = run.full ? method::full : method::lora,
                       .lora = {run.rank, run.targets, true},
                       .precision = precision_mode::bf16,
                       .optimizer = optimizer_kind::adamw_bf16,
                       .micro_batch = run.micro_batch,
                       .sequence = 512,
                       .grad_accum = run.grad_accum,
                       .logits = logits_mode::half};
    if (run.quantized) {
      plan.weights = {weight_format::nf4, 64, false};
      plan.quantized_matmul_keeps_input = true;  // LitGPT then pinned bitsandbytes before 0.43.2
    }
    const double predicted_gb = static_cast<double>(estimate_memory(run.model, plan).peak_device_bytes) / 1e9;
    CHECK(predicted_gb == doctest::Approx(run.predicted_gb).epsilon(0.002));
    if (std::abs(predicted_gb - run.measured_gb) <= 0.10 * run.measured_gb) ++within_10_percent;
  }
  // The documented count: all 16-bit runs within 10%; the QLoRA runs 10-16% low (see the doc).
  CHECK(within_10_percent == 7);
}

TEST_CASE("budget: torchtune's Llama-2-7B LoRA run next to its published peak") {
  // torchtune docs, QLoRA tutorial: LoRA on q,v r=8, bf16, batch 2, Alpaca (max_seq_len 512),
  // activation checkpointing, fp32 logits; 15.57 GB peak *reserved* (an upper bound of allocated).
  const training_plan plan{.training = method::lora, .lora = {8, linear_module::q | linear_module::v, false},
                           .precision = precision_mode::bf16, .optimizer = optimizer_kind::adamw_bf16,
                           .micro_batch = 2, .sequence = 512, .grad_accum = 64,
                           .checkpoint = checkpointing::every_layer};
  const double predicted_gb = static_cast<double>(estimate_memory(presets::llama_2_7b, plan).peak_device_bytes) / 1e9;
  CHECK(predicted_gb == doctest::Approx(14.83).epsilon(0.002));
  CHECK(predicted_gb < 15.57);
  CHECK(predicted_gb > 0.9 * 15.57);
}
