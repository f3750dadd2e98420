// memkit/budget/model.hpp — a constexpr description of a decoder-only transformer and its parameters.
//
// Two families cover the models memkit budgets for:
//   llama-style: RMSNorm, gated MLP (SwiGLU or GeGLU), rotary positions, grouped-query attention,
//                optional q/k/v bias (Qwen2), explicit head_dim (Gemma), optionally fused qkv / gate_up
//                projections (Phi-3) which change LoRA shapes but not the parameter count;
//   gpt2-style:  LayerNorm with bias, GeLU MLP (4h), learned positions, biases on every linear, dropout.
// Everything here is constexpr so the budget can be computed, and asserted, at compile time.
#pragma once

#include <cstdint>
#include <string_view>

#include "memkit/config.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace budget {

enum class architecture : std::uint8_t { llama, gpt2 };
enum class mlp_kind : std::uint8_t { swiglu, geglu, gelu };

// The seven linear layers LoRA can target, as a bit set (PEFT's q_proj ... down_proj).
enum class linear_module : std::uint8_t { q = 1, k = 2, v = 4, o = 8, gate = 16, up = 32, down = 64 };
using module_set = std::uint8_t;
inline constexpr module_set all_linear_modules = 127;
inline constexpr module_set attention_modules = 15;  // q, k, v, o
constexpr module_set operator|(linear_module a, linear_module b) noexcept {
  return static_cast<module_set>(static_cast<module_set>(a) | static_cast<module_set>(b));
}
constexpr module_set operator|(module_set a, linear_module b) noexcept {
  return static_cast<module_set>(a | static_cast<module_set>(b));
}
constexpr bool contains(module_set set, module_set modules) noexcept { return (set & modules) != 0; }

struct model_config {
  std::string_view name;
  architecture family = architecture::llama;
  mlp_kind mlp = mlp_kind::swiglu;
  std::uint64_t hidden = 0;
  std::uint64_t layers = 0;
  std::uint64_t heads = 0;
  std::uint64_t kv_heads = 0;
  std::uint64_t head_dim = 0;      // hidden / heads unless the model says otherwise (Gemma, Llama-3.2)
  std::uint64_t intermediate = 0;  // MLP width
  std::uint64_t vocab = 0;
  std::uint64_t max_positions = 0;  // learned position table size (gpt2) or the trained context (rotary)
  bool tied_embeddings = false;
  bool qkv_bias = false;        // Qwen2
  bool fused_qkv = false;       // one qkv_proj (Phi-3, GPT-2's c_attn)
  bool fused_gate_up = false;   // one gate_up_proj (Phi-3)
  bool dropout = false;         // GPT-2 trains with dropout; the llama family does not

  constexpr bool is_gpt2() const noexcept { return family == architecture::gpt2; }
  constexpr bool gated_mlp() const noexcept { return mlp != mlp_kind::gelu; }
  constexpr std::uint64_t q_width() const noexcept { return heads * head_dim; }
  constexpr std::uint64_t kv_width() const noexcept { return kv_heads * head_dim; }

  // Empty when the description is usable, otherwise what is wrong with it.
  constexpr std::string_view problem() const noexcept {
    if (hidden == 0) return "hidden size must be positive";
    if (layers == 0) return "number of layers must be positive";
    if (heads == 0) return "number of attention heads must be positive";
    if (kv_heads == 0 || heads % kv_heads != 0) return "key/value heads must divide the attention heads";
    if (head_dim == 0) return "head_dim must be positive";
    if (intermediate == 0) return "intermediate (MLP) size must be positive";
    if (vocab == 0) return "vocabulary size must be positive";
    if (is_gpt2() && max_positions == 0) return "gpt2-style models need max_positions (n_positions)";
    return {};
  }
  constexpr bool valid() const noexcept { return problem().empty(); }
};

// A Llama-style decoder. head_dim 0 means hidden / heads.
constexpr model_config llama_style(std::string_view name, std::uint64_t hidden, std::uint64_t layers,
                                   std::uint64_t heads, std::uint64_t kv_heads, std::uint64_t intermediate,
                                   std::uint64_t vocab, bool tied, std::uint64_t max_positions,
                                   std::uint64_t head_dim = 0) noexcept {
  model_config m;
  m.name = name;
  m.family = architecture::llama;
  m.mlp = mlp_kind::swiglu;
  m.hidden = hidden;
  m.layers = layers;
  m.heads = heads;
  m.kv_heads = kv_heads;
  m.head_dim = head_dim != 0 ? head_dim : (heads != 0 ? hidden / heads : 0);
  m.intermediate = intermediate;
  m.vocab = vocab;
  m.tied_embeddings = tied;
  m.max_positions = max_positions;
  return m;
}

// A GPT-2-style decoder: MLP width 4h, tied embeddings, learned positions, biases everywhere.
constexpr model_config gpt2_style(std::string_view name, std::uint64_t hidden, std::uint64_t layers,
                                  std::uint64_t heads, std::uint64_t vocab = 50257,
                                  std::uint64_t max_positions = 1024) noexcept {
  model_config m;
  m.name = name;
  m.family = architecture::gpt2;
  m.mlp = mlp_kind::gelu;
  m.hidden = hidden;
  m.layers = layers;
  m.heads = heads;
  m.kv_heads = heads;
  m.head_dim = heads != 0 ? hidden / heads : 0;
  m.intermediate = 4 * hidden;
  m.vocab = vocab;
  m.max_positions = max_positions;
  m.tied_embeddings = true;
  m.fused_qkv = true;
  m.dropout = true;
  return m;
}

// One linear layer of a block: its shape, bias, and which LoRA target names map onto it
// (a fused qkv projection answers to q, k and v).
struct linear_layer {
  module_set modules = 0;
  std::uint64_t in = 0;
  std::uint64_t out = 0;
  bool bias = false;
  constexpr std::uint64_t weight_elements() const noexcept { return in * out; }
};

struct block_linears {
  linear_layer items[7]{};
  int count = 0;
};

// The linear layers of one block, in execution order.
constexpr block_linears linears_of(const model_config& m) noexcept {
  block_linears list;
  auto add = [&](module_set modules, std::uint64_t in, std::uint64_t out, bool bias) {
    list.items[list.count++] = linear_layer{modules, in, out, bias};
  };
  const module_set qkv = linear_module::q | linear_module::k | linear_module::v;
  const auto o = static_cast<module_set>(linear_module::o);
  const auto gate = static_cast<module_set>(linear_module::gate);
  const auto up = static_cast<module_set>(linear_module::up);
  const auto down = static_cast<module_set>(linear_module::down);
  if (m.is_gpt2()) {
    add(qkv, m.hidden, 3 * m.hidden, true);             // c_attn
    add(o, m.hidden, m.hidden, true);                   // attn.c_proj
    add(up, m.hidden, m.intermediate, true);            // mlp.c_fc
    add(down, m.intermediate, m.hidden, true);          // mlp.c_proj
    return list;
  }
  if (m.fused_qkv) {
    add(qkv, m.hidden, m.q_width() + 2 * m.kv_width(), m.qkv_bias);
  } else {
    add(static_cast<module_set>(linear_module::q), m.hidden, m.q_width(), m.qkv_bias);
    add(static_cast<module_set>(linear_module::k), m.hidden, m.kv_width(), m.qkv_bias);
    add(static_cast<module_set>(linear_module::v), m.hidden, m.kv_width(), m.qkv_bias);
  }
  add(o, m.q_width(), m.hidden, false);
  if (m.fused_gate_up) {
    add(static_cast<module_set>(gate | up), m.hidden, 2 * m.intermediate, false);
  } else {
    add(gate, m.hidden, m.intermediate, false);
    add(up, m.hidden, m.intermediate, false);
  }
  add(down, m.intermediate, m.hidden, false);
  return list;
}

// What a parameter tensor is, which decides how it is stored and trained.
enum class tensor_role : std::uint8_t {
  token_embedding,
  position_embedding,
  lm_head,
  norm,            // norm weight or bias
  linear_weight,   // a block's projection weight (quantized by QLoRA)
  linear_bias,
  lora_a,
  lora_b,
};

// `count` identical tensors of rows x cols (cols 1 for vectors).
struct parameter_tensor {
  tensor_role role;
  std::uint64_t rows;
  std::uint64_t cols;
  std::uint64_t count;
  module_set modules = 0;  // for linear weights and LoRA factors
  bool per_block = false;  // one of each per transformer block (count is a multiple of the layers)
  constexpr std::uint64_t elements() const noexcept { return rows * cols; }
  constexpr std::uint64_t total_elements() const noexcept { return rows * cols * count; }
};

// Calls visit(parameter_tensor) for every base-model parameter tensor (tied embeddings once).
template <class Visitor>
constexpr void for_each_parameter(const model_config& m, Visitor&& visit) {
  const std::uint64_t L = m.layers;
  visit(parameter_tensor{tensor_role::token_embedding, m.vocab, m.hidden, 1});
  if (m.is_gpt2()) visit(parameter_tensor{tensor_role::position_embedding, m.max_positions, m.hidden, 1});
  const std::uint64_t norm_tensors_per_block = m.is_gpt2() ? 4 : 2;  // LayerNorm has a bias
  visit(parameter_tensor{tensor_role::norm, m.hidden, 1, L * norm_tensors_per_block, 0, true});
  const block_linears linears = linears_of(m);
  for (int i = 0; i < linears.count; ++i) {
    const linear_layer& layer = linears.items[i];
    visit(parameter_tensor{tensor_role::linear_weight, layer.out, layer.in, L, layer.modules, true});
    if (layer.bias) visit(parameter_tensor{tensor_role::linear_bias, layer.out, 1, L, layer.modules, true});
  }
  visit(parameter_tensor{tensor_role::norm, m.hidden, 1, m.is_gpt2() ? 2u : 1u});  // final norm
  if (!m.tied_embeddings) visit(parameter_tensor{tensor_role::lm_head, m.vocab, m.hidden, 1});
}

// LoRA adapters: for each targeted linear, A [r, in] and B [out, r]. A fused linear gets one adapter.
template <class Visitor>
constexpr void for_each_lora_parameter(const model_config& m, std::uint64_t rank, module_set targets,
                                       Visitor&& visit) {
  const block_linears linears = linears_of(m);
  for (int i = 0; i < linears.count; ++i) {
    const linear_layer& layer = linears.items[i];
    if (!contains(targets, layer.modules)) continue;
    visit(parameter_tensor{tensor_role::lora_a, rank, layer.in, m.layers, layer.modules, true});
    visit(parameter_tensor{tensor_role::lora_b, layer.out, rank, m.layers, layer.modules, true});
  }
}

constexpr std::uint64_t parameter_count(const model_config& m) {
  std::uint64_t total = 0;
  for_each_parameter(m, [&](const parameter_tensor& t) { total += t.total_elements(); });
  return total;
}

constexpr std::uint64_t lora_parameter_count(const model_config& m, std::uint64_t rank, module_set targets) {
  std::uint64_t total = 0;
  for_each_lora_parameter(m, rank, targets, [&](const parameter_tensor& t) { total += t.total_elements(); });
  return total;
}

}  // namespace budget
MEMKIT_NAMESPACE_END
