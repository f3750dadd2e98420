// memkit/budget/model.hpp — a constexpr description of a transformer and its parameters.
//
// One description covers the families memkit budgets for; each differs from a Llama block in a few
// switches, all of which change the parameter count exactly as the released checkpoints have it:
//   norms:     RMSNorm (weight), LayerNorm (weight + bias), non-parametric (OLMo), how many per block
//              (1 when attention and MLP read one norm in parallel: Phi-2, Falcon-7B; 4 for Gemma-2/3's
//              sandwich norms), q/k norms (per head: Qwen3, Gemma-3; full width: OLMo-2, StableLM-2);
//   biases:    on q/k/v (Qwen, GPT-2, BERT ...), the attention output, the MLP, the LM head (Phi-2);
//   MLP:       gated (SwiGLU / GeGLU) or plain GeLU; mixture of experts (router, all experts' weights,
//              top-k routed per token, optional shared expert with its own sigmoid gate);
//   positions: rotary (no parameters) or a learned table (GPT-2, BERT, with BERT's token types);
//   encoders:  BERT: embedding LayerNorm, post-norm blocks without a final norm, a pooler, tied MLM head;
//   fused projections (Phi-3's qkv_proj and gate_up_proj, GPT-2's c_attn) change LoRA shapes, not counts.
// Everything here is constexpr so the budget can be computed, and asserted, at compile time.
#pragma once

#include <cstdint>
#include <string_view>

#include "memkit/config.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace budget {

// Which conventions the activation model follows: Llama-style (RMSNorm upcast to fp32, rotary), GPT-2
// (LayerNorm, learned positions, dropout) or a bidirectional encoder (BERT).
enum class architecture : std::uint8_t { llama, gpt2, encoder };
enum class mlp_kind : std::uint8_t { swiglu, geglu, gelu };
enum class norm_kind : std::uint8_t {
  rms,            // weight only
  layer,          // LayerNorm: weight and bias
  layer_no_bias,  // LayerNorm with bias=False (weight only)
  nonparametric,  // no parameters at all (OLMo-1)
};
enum class qk_norm_kind : std::uint8_t {
  none,
  per_head,    // one RMSNorm(head_dim) applied to every head: head_dim weights each for q and k
  full_width,  // over all heads: q_width + kv_width weights (OLMo-2; StableLM-2's per-head LayerNorms)
};

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

// A ViT image encoder in front of the language model (Gemma 3's SigLIP): conv patch embedding, learned
// positions, pre-norm blocks with biases everywhere, a final LayerNorm, and a projection (with an RMSNorm)
// into the language model's width. Its weights are loaded, and counted, for text fine-tuning too.
struct vision_encoder {
  std::uint64_t hidden = 0;  // 0: no image encoder
  std::uint64_t layers = 0;
  std::uint64_t intermediate = 0;
  std::uint64_t image_size = 0;
  std::uint64_t patch_size = 0;
  std::uint64_t channels = 3;
  constexpr std::uint64_t patches() const noexcept {
    return patch_size == 0 ? 0 : (image_size / patch_size) * (image_size / patch_size);
  }
};

struct model_config {
  std::string_view name;
  architecture family = architecture::llama;
  mlp_kind mlp = mlp_kind::swiglu;
  std::uint64_t hidden = 0;
  std::uint64_t layers = 0;
  std::uint64_t heads = 0;
  std::uint64_t kv_heads = 0;
  std::uint64_t head_dim = 0;      // hidden / heads unless the model says otherwise (Gemma, Llama-3.2)
  std::uint64_t intermediate = 0;  // MLP width of a dense block (Mixtral: also each expert's, see below)
  std::uint64_t vocab = 0;
  std::uint64_t max_positions = 0;  // learned position table size (gpt2, BERT) or the trained context (rotary)
  bool tied_embeddings = false;
  bool qkv_bias = false;        // Qwen, GPT-2, GPT-NeoX, BERT, Phi-2, StableLM-2
  bool fused_qkv = false;       // one qkv_proj (Phi-3, GPT-2's c_attn, GPT-NeoX, Falcon, Qwen-1)
  bool fused_gate_up = false;   // one gate_up_proj (Phi-3)
  bool dropout = false;         // GPT-2 trains with dropout; the llama family does not

  // Norms and biases (defaults: a Llama block).
  norm_kind norm = norm_kind::rms;
  std::uint8_t norms_per_block = 2;  // 1: parallel attention and MLP on one norm; 4: Gemma-2/3
  bool final_norm = true;            // false for post-norm encoders (BERT)
  qk_norm_kind qk_norm = qk_norm_kind::none;
  bool o_bias = false;         // attention output projection
  bool mlp_bias = false;       // every MLP projection (GPT-2, GPT-NeoX, Phi-2, BERT, Falcon-RW)
  bool lm_head_bias = false;   // Phi-2
  bool parallel_attention = false;  // attention and MLP read the same input (GPT-NeoX, Phi-2, Falcon)

  // Positions and encoder parts.
  bool learned_positions = false;  // a max_positions x hidden table (GPT-2, BERT)
  std::uint64_t token_types = 0;   // BERT's token-type embeddings
  bool embedding_norm = false;     // a norm right after the embeddings (BERT)
  bool pooler = false;             // BERT's pooler: dense hidden -> hidden with bias

  // Mixture of experts: every block's MLP is `experts` gated MLPs of width `expert_intermediate` behind a
  // router (Linear hidden -> experts, no bias); each token goes to `experts_per_token` of them. Memory
  // holds all experts; activations exist for the routed ones only. Qwen-MoE adds a shared expert every
  // token goes through, scaled by a sigmoid gate (Linear hidden -> 1).
  std::uint64_t experts = 0;  // 0: dense MLP
  std::uint64_t experts_per_token = 0;
  std::uint64_t expert_intermediate = 0;
  std::uint64_t shared_expert_intermediate = 0;  // 0: no shared expert
  bool shared_expert_gate = false;

  vision_encoder vision{};

  constexpr bool is_gpt2() const noexcept { return family == architecture::gpt2; }
  constexpr bool is_encoder() const noexcept { return family == architecture::encoder; }
  constexpr bool moe() const noexcept { return experts != 0; }
  constexpr bool gated_mlp() const noexcept { return mlp != mlp_kind::gelu; }
  constexpr bool rotary() const noexcept { return !learned_positions; }
  // LayerNorm keeps a mean and an rstd per row; RMSNorm only an rstd; OLMo-1's non-parametric LayerNorm both.
  constexpr bool layer_norm() const noexcept { return norm != norm_kind::rms; }
  constexpr std::uint64_t q_width() const noexcept { return heads * head_dim; }
  constexpr std::uint64_t kv_width() const noexcept { return kv_heads * head_dim; }
  // Width of the MLP intermediate activations one token produces: the routed experts' plus the shared
  // expert's for a mixture of experts, the dense MLP width otherwise.
  constexpr std::uint64_t mlp_activation_width() const noexcept {
    return moe() ? experts_per_token * expert_intermediate + shared_expert_intermediate : intermediate;
  }
  // Parameters of one norm (weight, and bias for LayerNorm).
  constexpr std::uint64_t norm_tensors() const noexcept {
    return norm == norm_kind::nonparametric ? 0 : norm == norm_kind::layer ? 2 : 1;
  }

  // Empty when the description is usable, otherwise what is wrong with it.
  constexpr std::string_view problem() const noexcept {
    if (hidden == 0) return "hidden size must be positive";
    if (layers == 0) return "number of layers must be positive";
    if (heads == 0) return "number of attention heads must be positive";
    if (kv_heads == 0 || heads % kv_heads != 0) return "key/value heads must divide the attention heads";
    if (head_dim == 0) return "head_dim must be positive";
    if (intermediate == 0 && !moe()) return "intermediate (MLP) size must be positive";
    if (vocab == 0) return "vocabulary size must be positive";
    if (learned_positions && max_positions == 0) return "learned positions need max_positions (n_positions)";
    if (moe() && (expert_intermediate == 0 || experts_per_token == 0 || experts_per_token > experts))
      return "a mixture of experts needs expert_intermediate and 1 <= experts_per_token <= experts";
    if (moe() && !gated_mlp()) return "experts are gated MLPs";
    if (norms_per_block == 0) return "a block needs at least one norm";
    if (vision.hidden != 0 && (vision.layers == 0 || vision.intermediate == 0 || vision.patches() == 0))
      return "an image encoder needs layers, intermediate size and at least one patch";
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
  m.norm = norm_kind::layer;
  m.qkv_bias = true;
  m.o_bias = true;
  m.mlp_bias = true;
  m.learned_positions = true;
  return m;
}

// One linear layer of a block: its shape, bias, which LoRA target names map onto it (a fused qkv
// projection answers to q, k and v; a router to none), and how many copies a block has (one per expert).
// `tokens_per_copy_num / tokens_per_copy_den`: the share of a micro-batch's tokens each copy sees on
// average (experts_per_token / experts for a routed expert, 1 otherwise).
struct linear_layer {
  module_set modules = 0;
  std::uint64_t in = 0;
  std::uint64_t out = 0;
  bool bias = false;
  std::uint64_t copies = 1;
  std::uint64_t tokens_per_copy_num = 1;
  std::uint64_t tokens_per_copy_den = 1;
  constexpr std::uint64_t weight_elements() const noexcept { return in * out; }
};

struct block_linears {
  linear_layer items[12]{};
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
  if (m.fused_qkv) {
    add(qkv, m.hidden, m.q_width() + 2 * m.kv_width(), m.qkv_bias);
  } else {
    add(static_cast<module_set>(linear_module::q), m.hidden, m.q_width(), m.qkv_bias);
    add(static_cast<module_set>(linear_module::k), m.hidden, m.kv_width(), m.qkv_bias);
    add(static_cast<module_set>(linear_module::v), m.hidden, m.kv_width(), m.qkv_bias);
  }
  add(o, m.q_width(), m.hidden, m.o_bias);
  auto gated_mlp = [&](std::uint64_t width, std::uint64_t copies, std::uint64_t share_num, std::uint64_t share_den) {
    const auto first = list.count;
    if (m.fused_gate_up) {
      add(static_cast<module_set>(gate | up), m.hidden, 2 * width, m.mlp_bias);
    } else {
      add(gate, m.hidden, width, m.mlp_bias);
      add(up, m.hidden, width, m.mlp_bias);
    }
    add(down, width, m.hidden, m.mlp_bias);
    for (int i = first; i < list.count; ++i) {
      list.items[i].copies = copies;
      list.items[i].tokens_per_copy_num = share_num;
      list.items[i].tokens_per_copy_den = share_den;
    }
  };
  if (m.moe()) {
    add(0, m.hidden, m.experts, false);  // router
    gated_mlp(m.expert_intermediate, m.experts, m.experts_per_token, m.experts);
    if (m.shared_expert_intermediate != 0) gated_mlp(m.shared_expert_intermediate, 1, 1, 1);
    if (m.shared_expert_gate) add(0, m.hidden, 1, false);
  } else if (m.gated_mlp()) {
    gated_mlp(m.intermediate, 1, 1, 1);
  } else {
    add(up, m.hidden, m.intermediate, m.mlp_bias);    // c_fc, fc1, dense_h_to_4h, intermediate.dense
    add(down, m.intermediate, m.hidden, m.mlp_bias);  // c_proj, fc2, dense_4h_to_h, output.dense
  }
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
  if (m.learned_positions) visit(parameter_tensor{tensor_role::position_embedding, m.max_positions, m.hidden, 1});
  if (m.token_types != 0) visit(parameter_tensor{tensor_role::position_embedding, m.token_types, m.hidden, 1});
  if (m.embedding_norm && m.norm_tensors() != 0)
    visit(parameter_tensor{tensor_role::norm, m.hidden, 1, m.norm_tensors()});
  if (m.norm_tensors() != 0)
    visit(parameter_tensor{tensor_role::norm, m.hidden, 1, L * m.norms_per_block * m.norm_tensors(), 0, true});
  switch (m.qk_norm) {
    case qk_norm_kind::none: break;
    case qk_norm_kind::per_head: visit(parameter_tensor{tensor_role::norm, m.head_dim, 1, 2 * L, 0, true}); break;
    case qk_norm_kind::full_width:
      visit(parameter_tensor{tensor_role::norm, m.q_width(), 1, L, 0, true});
      visit(parameter_tensor{tensor_role::norm, m.kv_width(), 1, L, 0, true});
      break;
  }
  const block_linears linears = linears_of(m);
  for (int i = 0; i < linears.count; ++i) {
    const linear_layer& layer = linears.items[i];
    visit(parameter_tensor{tensor_role::linear_weight, layer.out, layer.in, L * layer.copies, layer.modules, true});
    if (layer.bias)
      visit(parameter_tensor{tensor_role::linear_bias, layer.out, 1, L * layer.copies, layer.modules, true});
  }
  if (m.final_norm && m.norm_tensors() != 0) visit(parameter_tensor{tensor_role::norm, m.hidden, 1, m.norm_tensors()});
  if (m.pooler) {
    visit(parameter_tensor{tensor_role::linear_weight, m.hidden, m.hidden, 1});
    visit(parameter_tensor{tensor_role::linear_bias, m.hidden, 1, 1});
  }
  if (!m.tied_embeddings) visit(parameter_tensor{tensor_role::lm_head, m.vocab, m.hidden, 1});
  if (m.lm_head_bias) visit(parameter_tensor{tensor_role::lm_head, m.vocab, 1, 1});
  if (m.vision.hidden != 0) {
    const vision_encoder& v = m.vision;
    const std::uint64_t VL = v.layers;
    visit(parameter_tensor{tensor_role::linear_weight, v.hidden, v.channels * v.patch_size * v.patch_size, 1});
    visit(parameter_tensor{tensor_role::linear_bias, v.hidden, 1, 1});
    visit(parameter_tensor{tensor_role::position_embedding, v.patches(), v.hidden, 1});
    visit(parameter_tensor{tensor_role::norm, v.hidden, 1, 2 * 2 * VL + 2});  // two LayerNorms a block, the last
    visit(parameter_tensor{tensor_role::linear_weight, v.hidden, v.hidden, 4 * VL});  // q, k, v, out
    visit(parameter_tensor{tensor_role::linear_bias, v.hidden, 1, 4 * VL});
    visit(parameter_tensor{tensor_role::linear_weight, v.intermediate, v.hidden, VL});  // fc1
    visit(parameter_tensor{tensor_role::linear_bias, v.intermediate, 1, VL});
    visit(parameter_tensor{tensor_role::linear_weight, v.hidden, v.intermediate, VL});  // fc2
    visit(parameter_tensor{tensor_role::linear_bias, v.hidden, 1, VL});
    visit(parameter_tensor{tensor_role::norm, v.hidden, 1, 1});                       // projector's RMSNorm
    visit(parameter_tensor{tensor_role::linear_weight, m.hidden, v.hidden, 1});       // into the text width
  }
}

// LoRA adapters: for each targeted linear, A [r, in] and B [out, r]. A fused linear gets one adapter;
// every expert gets its own (PEFT wraps each expert's nn.Linear).
template <class Visitor>
constexpr void for_each_lora_parameter(const model_config& m, std::uint64_t rank, module_set targets,
                                       Visitor&& visit) {
  const block_linears linears = linears_of(m);
  for (int i = 0; i < linears.count; ++i) {
    const linear_layer& layer = linears.items[i];
    if (!contains(targets, layer.modules)) continue;
    visit(parameter_tensor{tensor_role::lora_a, rank, layer.in, m.layers * layer.copies, layer.modules, true});
    visit(parameter_tensor{tensor_role::lora_b, layer.out, rank, m.layers * layer.copies, layer.modules, true});
  }
}

constexpr std::uint64_t parameter_count(const model_config& m) {
  std::uint64_t total = 0;
  for_each_parameter(m, [&](const parameter_tensor& t) { total += t.total_elements(); });
  return total;
}

// Parameters one token passes through: everything except the experts it is not routed to (for a dense
// model, parameter_count). Mixtral-8x7B: 46.7B in memory, 12.9B active.
constexpr std::uint64_t active_parameter_count(const model_config& m) {
  std::uint64_t idle = 0;
  const block_linears linears = linears_of(m);
  for (int i = 0; i < linears.count; ++i) {
    const linear_layer& layer = linears.items[i];
    if (layer.tokens_per_copy_den == 1) continue;
    const std::uint64_t idle_copies = layer.copies - layer.copies * layer.tokens_per_copy_num / layer.tokens_per_copy_den;
    idle += m.layers * idle_copies * (layer.weight_elements() + (layer.bias ? layer.out : 0));
  }
  return parameter_count(m) - idle;
}

constexpr std::uint64_t lora_parameter_count(const model_config& m, std::uint64_t rank, module_set targets) {
  std::uint64_t total = 0;
  for_each_lora_parameter(m, rank, targets, [&](const parameter_tensor& t) { total += t.total_elements(); });
  return total;
}

}  // namespace budget
MEMKIT_NAMESPACE_END
