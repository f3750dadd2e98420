#include <doctest/doctest.h>

#include <memkit/budget/component_bytes.hpp>
#include <memkit/budget/presets.hpp>

using namespace memkit::budget;

// Published totals (model cards / counting the released checkpoints); tied embeddings once.
TEST_CASE("budget: every preset's exact parameter count") {
  struct expected {
    const model_config& model;
    std::uint64_t parameters;
  };
  const expected table[] = {
      {presets::llama_2_7b, 6'738'415'616ull},    {presets::llama_2_13b, 13'015'864'320ull},
      {presets::llama_2_70b, 68'976'648'192ull},  {presets::llama_3_1_8b, 8'030'261'248ull},
      {presets::llama_3_1_70b, 70'553'706'496ull}, {presets::llama_3_2_1b, 1'235'814'400ull},
      {presets::llama_3_2_3b, 3'212'749'824ull},  {presets::mistral_7b, 7'241'732'096ull},
      {presets::qwen2_5_0_5b, 494'032'768ull},    {presets::qwen2_5_1_5b, 1'543'714'304ull},
      {presets::qwen2_5_7b, 7'615'616'512ull},    {presets::gemma_2b, 2'506'172'416ull},
      {presets::phi_3_mini, 3'821'079'552ull},    {presets::tinyllama_1_1b, 1'100'048'384ull},
      {presets::smollm2_135m, 134'515'008ull},    {presets::smollm2_360m, 361'821'120ull},
      {presets::smollm2_1_7b, 1'711'376'384ull},  {presets::gpt2_124m, 124'439'808ull},
      {presets::gpt2_355m, 354'823'168ull},       {presets::gpt2_774m, 774'030'080ull},
      {presets::gpt2_1_5b, 1'557'611'200ull},
  };
  CHECK(std::size(table) == std::size(presets::all_models));
  for (const expected& e : table) {
    CAPTURE(e.model.name);
    CHECK(e.model.valid());
    CHECK(parameter_count(e.model) == e.parameters);
    REQUIRE(find_model_preset(e.model.name) != nullptr);
    CHECK(parameter_count(*find_model_preset(e.model.name)) == e.parameters);
  }
}

TEST_CASE("budget: closed-form Llama count matches the tensor walk") {
  // REFERENCE.md: per layer h*H*d + 2*h*kv*d + H*d*h + 3*h*ffn + 2*h; total L*layer + vocab*h*(1|2) + h.
  for (const model_config& m : presets::all_models) {
    if (m.is_gpt2()) continue;
    CAPTURE(m.name);
    const std::uint64_t h = m.hidden, d = m.head_dim;
    std::uint64_t layer = h * m.heads * d + 2 * h * m.kv_heads * d + m.heads * d * h + 3 * h * m.intermediate + 2 * h;
    if (m.qkv_bias) layer += m.heads * d + 2 * m.kv_heads * d;
    CHECK(parameter_count(m) == m.layers * layer + m.vocab * h * (m.tied_embeddings ? 1 : 2) + h);
  }
}

TEST_CASE("budget: LoRA trainable counts") {
  CHECK(lora_parameter_count(presets::llama_3_1_8b, 16, all_linear_modules) == 41'943'040ull);
  // q and v only, r = 8 on Llama-2-7B: 2 * 32 layers * 8 * (4096 + 4096) = 4,194,304 (PEFT's printout).
  CHECK(lora_parameter_count(presets::llama_2_7b, 8, linear_module::q | linear_module::v) == 4'194'304ull);
  // A fused projection gets one adapter: Phi-3's qkv_proj is 3072 -> 9216.
  CHECK(lora_parameter_count(presets::phi_3_mini, 1, static_cast<module_set>(linear_module::q)) ==
        32ull * (3072 + 9216));
  // GPT-2's c_attn answers to q, k and v together.
  CHECK(lora_parameter_count(presets::gpt2_124m, 4, attention_modules) == 12ull * 4 * ((768 + 2304) + (768 + 768)));
}

TEST_CASE("budget: constexpr presets") {
  static_assert(parameter_count(presets::llama_2_7b) == 6'738'415'616ull);
  static_assert(find_gpu_preset("h100-80gb")->memory_bytes == 81559 * memkit::MiB);
  static_assert(find_model_preset("no-such-model") == nullptr);
  CHECK(find_gpu_preset("b200")->memory_bytes == presets::b200.memory_bytes);
  CHECK(find_gpu_preset("v100") == nullptr);
}

TEST_CASE("budget: NF4 and optimizer-state byte formulas") {
  // 4 + 8/64 + 32/(64*256) = 4.127 bits per parameter at block 64 with double quantization.
  const std::uint64_t n = 64ull * 256 * 1000;
  const double bits_dq = 8.0 * static_cast<double>(nf4_bytes(n, 64, true)) / static_cast<double>(n);
  CHECK(bits_dq == doctest::Approx(4.127).epsilon(0.001));
  const double bits = 8.0 * static_cast<double>(nf4_bytes(n, 64, false)) / static_cast<double>(n);
  CHECK(bits == doctest::Approx(4.5).epsilon(0.001));
  CHECK(nf4_bytes(65, 64, false) == 33 + 2 * 4);  // odd tail pads a nibble, partial block has an absmax
  CHECK(nf4_bytes(65, 64, true) == 33 + 2 + 2 * 4);  // two code bytes, one nested absmax and the offset
  // 8-bit Adam: two 1-byte states + fp32 absmax per 256; small tensors keep 2 x fp32. Segments are
  // aligned to 64 bytes.
  CHECK(adam_8bit_state_bytes(4096) == 2 * (4096 + 16 * 4));
  CHECK(adam_8bit_state_bytes(4095) == 2 * 16384);  // 4095 x fp32 = 16380, padded to 16384
  CHECK(adam_4bit_state_bytes(4096) == 2 * (2048 + 32 * 4));
  CHECK(adam_fp32_state_bytes(1000) == 2 * 4032);  // 4000 padded to 4032
  CHECK(adam_bf16_state_bytes(4096) == 2 * 8192);
  CHECK(int8_bytes(4096 * 11008, 4096) == 4096ull * 11008 + 11008 * 4);
}
