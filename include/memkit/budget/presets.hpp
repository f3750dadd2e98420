// memkit/budget/presets.hpp — published model configurations and GPUs, by name.
//
// Model shapes are the published config.json values (hidden_size, num_hidden_layers,
// num_attention_heads, num_key_value_heads, head_dim, intermediate_size, vocab_size,
// tie_word_embeddings, max_position_embeddings / n_positions). The tests pin each one's exact
// parameter count against the published total.
// GPU memory is what the driver reports as total (nvidia-smi's MiB figure), not the marketing GB;
// the CUDA context and allocator overheads are part of the training plan, not of the GPU.
#pragma once

#include <cstdint>
#include <string_view>

#include "memkit/budget/model.hpp"
#include "memkit/core/units.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace budget {

namespace presets {

inline constexpr model_config llama_2_7b = llama_style("llama-2-7b", 4096, 32, 32, 32, 11008, 32000, false, 4096);
inline constexpr model_config llama_2_13b = llama_style("llama-2-13b", 5120, 40, 40, 40, 13824, 32000, false, 4096);
inline constexpr model_config llama_2_70b = llama_style("llama-2-70b", 8192, 80, 64, 8, 28672, 32000, false, 4096);
inline constexpr model_config llama_3_1_8b =
    llama_style("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256, false, 131072);
inline constexpr model_config llama_3_1_70b =
    llama_style("llama-3.1-70b", 8192, 80, 64, 8, 28672, 128256, false, 131072);
inline constexpr model_config llama_3_2_1b =
    llama_style("llama-3.2-1b", 2048, 16, 32, 8, 8192, 128256, true, 131072, 64);
inline constexpr model_config llama_3_2_3b =
    llama_style("llama-3.2-3b", 3072, 28, 24, 8, 8192, 128256, true, 131072, 128);
inline constexpr model_config mistral_7b = llama_style("mistral-7b", 4096, 32, 32, 8, 14336, 32000, false, 32768);

constexpr model_config qwen2(std::string_view name, std::uint64_t hidden, std::uint64_t layers, std::uint64_t heads,
                             std::uint64_t kv_heads, std::uint64_t intermediate, std::uint64_t vocab, bool tied,
                             std::uint64_t max_positions) noexcept {
  model_config m = llama_style(name, hidden, layers, heads, kv_heads, intermediate, vocab, tied, max_positions);
  m.qkv_bias = true;
  return m;
}
inline constexpr model_config qwen2_5_0_5b = qwen2("qwen2.5-0.5b", 896, 24, 14, 2, 4864, 151936, true, 32768);
inline constexpr model_config qwen2_5_1_5b = qwen2("qwen2.5-1.5b", 1536, 28, 12, 2, 8960, 151936, true, 32768);
inline constexpr model_config qwen2_5_7b = qwen2("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, false, 131072);

constexpr model_config gemma(std::string_view name, std::uint64_t hidden, std::uint64_t layers, std::uint64_t heads,
                             std::uint64_t kv_heads, std::uint64_t head_dim, std::uint64_t intermediate,
                             std::uint64_t vocab, std::uint64_t max_positions) noexcept {
  model_config m = llama_style(name, hidden, layers, heads, kv_heads, intermediate, vocab, true, max_positions, head_dim);
  m.mlp = mlp_kind::geglu;
  return m;
}
inline constexpr model_config gemma_2b = gemma("gemma-2b", 2048, 18, 8, 1, 256, 16384, 256000, 8192);

constexpr model_config phi3(std::string_view name, std::uint64_t hidden, std::uint64_t layers, std::uint64_t heads,
                            std::uint64_t kv_heads, std::uint64_t intermediate, std::uint64_t vocab,
                            std::uint64_t max_positions) noexcept {
  model_config m = llama_style(name, hidden, layers, heads, kv_heads, intermediate, vocab, false, max_positions);
  m.fused_qkv = true;
  m.fused_gate_up = true;
  return m;
}
inline constexpr model_config phi_3_mini = phi3("phi-3-mini", 3072, 32, 32, 32, 8192, 32064, 4096);

inline constexpr model_config tinyllama_1_1b =
    llama_style("tinyllama-1.1b", 2048, 22, 32, 4, 5632, 32000, false, 2048);
inline constexpr model_config smollm2_135m = llama_style("smollm2-135m", 576, 30, 9, 3, 1536, 49152, true, 8192);
inline constexpr model_config smollm2_360m = llama_style("smollm2-360m", 960, 32, 15, 5, 2560, 49152, true, 8192);
inline constexpr model_config smollm2_1_7b = llama_style("smollm2-1.7b", 2048, 24, 32, 32, 8192, 49152, true, 8192);

inline constexpr model_config gpt2_124m = gpt2_style("gpt2-124m", 768, 12, 12);
inline constexpr model_config gpt2_355m = gpt2_style("gpt2-355m", 1024, 24, 16);
inline constexpr model_config gpt2_774m = gpt2_style("gpt2-774m", 1280, 36, 20);
inline constexpr model_config gpt2_1_5b = gpt2_style("gpt2-1.5b", 1600, 48, 25);

inline constexpr model_config all_models[] = {
    llama_2_7b,   llama_2_13b,  llama_2_70b,  llama_3_1_8b, llama_3_1_70b, llama_3_2_1b, llama_3_2_3b,
    mistral_7b,   qwen2_5_0_5b, qwen2_5_1_5b, qwen2_5_7b,   gemma_2b,      phi_3_mini,   tinyllama_1_1b,
    smollm2_135m, smollm2_360m, smollm2_1_7b, gpt2_124m,    gpt2_355m,     gpt2_774m,    gpt2_1_5b,
};

}  // namespace presets

// A GPU as the budget sees it: the device memory the driver reports.
struct gpu_spec {
  std::string_view name;
  std::uint64_t memory_bytes = 0;
};

namespace presets {
inline constexpr gpu_spec t4{"t4", 15360 * MiB};
inline constexpr gpu_spec l4{"l4", 23034 * MiB};
inline constexpr gpu_spec a10{"a10", 23028 * MiB};
inline constexpr gpu_spec rtx_3090{"rtx3090", 24576 * MiB};
inline constexpr gpu_spec rtx_4090{"rtx4090", 24564 * MiB};
inline constexpr gpu_spec a100_40gb{"a100-40gb", 40960 * MiB};
inline constexpr gpu_spec a100_80gb{"a100-80gb", 81920 * MiB};
inline constexpr gpu_spec h100_80gb{"h100-80gb", 81559 * MiB};
inline constexpr gpu_spec h200{"h200", 143771 * MiB};
inline constexpr gpu_spec b200{"b200", 183359 * MiB};

inline constexpr gpu_spec all_gpus[] = {t4, l4, a10, rtx_3090, rtx_4090, a100_40gb, a100_80gb, h100_80gb, h200, b200};
}  // namespace presets

// Preset lookup by name ("llama-3.1-8b", "h100-80gb"); nullptr when unknown.
constexpr const model_config* find_model_preset(std::string_view name) noexcept {
  for (const model_config& m : presets::all_models)
    if (m.name == name) return &m;
  return nullptr;
}
constexpr const gpu_spec* find_gpu_preset(std::string_view name) noexcept {
  for (const gpu_spec& g : presets::all_gpus)
    if (g.name == name) return &g;
  return nullptr;
}

}  // namespace budget
MEMKIT_NAMESPACE_END
