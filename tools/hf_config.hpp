// Reads a Hugging Face config.json into a memkit::budget::model_config.
//
// Each supported model_type maps its config fields (and transformers' defaults for absent ones) onto the
// switches of model_config, so that parameter_count() equals the released checkpoint's count exactly
// (tests/host/budget_models_test.cpp checks one config per family against the published totals).
// Unknown model types, and fields beyond physically meaningful sizes, are refused with one line.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <string>

#include <memkit/budget/model.hpp>

#include <memkit/io/json.hpp>

namespace memkit_tools {

using json_value = memkit::json::value;

// The model_type values model_from_hf_config understands, for the "unsupported" message and the docs.
inline constexpr const char* supported_model_types =
    "llama, mistral, mixtral, qwen, qwen2, qwen2_moe, qwen3, qwen3_moe, gemma, gemma2, gemma3_text, gemma3, "
    "phi, phi3, gpt2, gpt_neox, stablelm, falcon, olmo, olmo2, olmoe, bert, roberta";

namespace detail {
// Every dimension is capped far above any real model (the largest published ones have hidden ~ 2^14,
// ~ 2^7 layers, vocabularies ~ 2^18, contexts ~ 2^24, ~ 2^9 experts) but low enough that the budget's
// products cannot wrap: a config beyond these is a mistake or an attack, refused with the field named.
enum class dimension : std::uint8_t { width, depth, heads, vocab, positions, experts };
constexpr std::uint64_t dimension_limit(dimension kind) noexcept {
  switch (kind) {
    case dimension::width: return std::uint64_t{1} << 20;      // hidden, intermediate, head_dim
    case dimension::depth: return std::uint64_t{1} << 14;      // layers
    case dimension::heads: return std::uint64_t{1} << 14;      // attention / key-value heads
    case dimension::vocab: return std::uint64_t{1} << 24;      // vocabulary, token types
    case dimension::positions: return std::uint64_t{1} << 27;  // context length / position table
    case dimension::experts: return std::uint64_t{1} << 14;    // experts, experts per token
  }
  return 0;
}

// The fields of one config object, read with the model type named in every message.
class config_fields {
 public:
  config_fields(const json_value& config, std::string model_type) : config_(config), type_(std::move(model_type)) {}

  const json_value* find(std::initializer_list<const char*> keys) const {
    for (const char* key : keys) {
      const json_value* v = config_.find(key);
      if (v != nullptr && !v->is_null()) return v;
    }
    return nullptr;
  }

  // A positive integer under the first of `keys` present (aliases: "hidden_size", "n_embd").
  std::uint64_t integer(std::initializer_list<const char*> keys, dimension kind) const {
    for (const char* key : keys) {
      const json_value* v = config_.find(key);
      if (v != nullptr && !v->is_null()) return checked(key, *v, kind);
    }
    throw memkit::error("config.json (model_type " + type_ + "): missing field '" + *keys.begin() + "'");
  }
  std::uint64_t integer(const char* key, dimension kind) const { return integer({key}, kind); }

  std::uint64_t optional(std::initializer_list<const char*> keys, std::uint64_t fallback, dimension kind) const {
    for (const char* key : keys) {
      const json_value* v = config_.find(key);
      if (v != nullptr && !v->is_null()) return checked(key, *v, kind);
    }
    return fallback;
  }
  std::uint64_t optional(const char* key, std::uint64_t fallback, dimension kind) const {
    return optional({key}, fallback, kind);
  }

  bool flag(const char* key, bool fallback) const {
    const json_value* v = config_.find(key);
    if (v == nullptr || v->is_null()) return fallback;
    if (!v->is_bool()) throw memkit::error(std::string("config.json: field '") + key + "' must be true or false");
    return v->as_bool();
  }

  std::string text(std::initializer_list<const char*> keys, const std::string& fallback) const {
    const json_value* v = find(keys);
    if (v == nullptr) return fallback;
    if (!v->is_string()) throw memkit::error(std::string("config.json: field '") + *keys.begin() + "' must be a string");
    return v->as_string();
  }

  // Layer-selection fields memkit does not model (every block must have the same MLP): refused unless
  // they say "every layer" (`expected`) or are absent / an empty list.
  void require_uniform(const char* key, std::uint64_t expected) const {
    const json_value* v = config_.find(key);
    if (v == nullptr || v->is_null()) return;
    if (v->is_array() && v->as_array().empty()) return;
    if (v->is_number() && v->as_double() == static_cast<double>(expected)) return;
    throw memkit::error("config.json (model_type " + type_ + "): field '" + key +
                        "' mixes dense and expert blocks, which memkit-budget does not model");
  }

  const std::string& type() const noexcept { return type_; }

 private:
  std::uint64_t checked(const char* key, const json_value& v, dimension kind) const {
    // Integral values written as floats (4096.0) are accepted; fractions are not.
    if (!v.is_number() || v.as_double() != std::floor(v.as_double()))
      throw memkit::error(std::string("config.json: field '") + key + "' must be an integer");
    if (v.as_double() <= 0)
      throw memkit::error(std::string("config.json: field '") + key + "' must be positive, got " + v.number_text());
    const std::uint64_t limit = dimension_limit(kind);
    if (v.as_double() > static_cast<double>(limit))
      throw memkit::error(std::string("config.json: field '") + key + "' is " + v.number_text() +
                          ", more than the largest meaningful value " + std::to_string(limit));
    return static_cast<std::uint64_t>(v.as_double());
  }

  const json_value& config_;
  std::string type_;
};

using memkit::budget::model_config;
constexpr auto W = dimension::width, D = dimension::depth, H = dimension::heads, V = dimension::vocab,
               P = dimension::positions, E = dimension::experts;

// The Llama-shaped core most families share: hidden_size, num_hidden_layers, num_attention_heads,
// num_key_value_heads (default: heads), head_dim (default hidden / heads), intermediate_size, vocab_size,
// max_position_embeddings, tie_word_embeddings (`tied_default` is the family's transformers default).
inline model_config llama_core(const config_fields& f, const std::string& name, bool tied_default,
                               bool intermediate_required = true) {
  const std::uint64_t heads = f.integer("num_attention_heads", H);
  return memkit::budget::llama_style(
      name, f.integer("hidden_size", W), f.integer("num_hidden_layers", D), heads,
      f.optional("num_key_value_heads", heads, H),
      intermediate_required ? f.integer("intermediate_size", W) : f.optional("intermediate_size", 0, W),
      f.integer("vocab_size", V), f.flag("tie_word_embeddings", tied_default),
      f.optional("max_position_embeddings", 0, P), f.optional("head_dim", 0, W));
}

// A gated MLP whose activation is a GeLU variant is a GeGLU (Gemma); SiLU makes a SwiGLU.
inline void gated_activation(const config_fields& f, model_config& m) {
  if (f.text({"hidden_activation", "hidden_act"}, "silu").rfind("gelu", 0) == 0) m.mlp = memkit::budget::mlp_kind::geglu;
}

// Experts: count, top-k and width under the family's field names; every block must be an expert block.
inline void experts(const config_fields& f, model_config& m, const char* count_key, const char* width_key) {
  m.experts = f.integer(count_key, E);
  m.experts_per_token = f.integer("num_experts_per_tok", E);
  m.expert_intermediate = f.integer(width_key, W);
  if (m.intermediate == 0) m.intermediate = m.expert_intermediate;
  f.require_uniform("decoder_sparse_step", 1);
  f.require_uniform("mlp_only_layers", 0);
}
}  // namespace detail

// `name` must outlive the returned description (it keeps a view of it).
inline memkit::budget::model_config model_from_hf_config(const json_value& config, const std::string& name) {
  using namespace memkit::budget;
  using namespace detail;
  if (!config.is_object()) throw memkit::error("config.json: expected a JSON object");
  const json_value* type_field = config.find("model_type");
  if (type_field == nullptr || !type_field->is_string()) throw memkit::error("config.json: missing field 'model_type'");
  const std::string& type = type_field->as_string();
  const config_fields f(config, type);

  model_config m;
  if (type == "llama" || type == "mistral" || type == "mixtral") {
    // Llama 2 / 3 / 3.1 / 3.2 / 3.3, Mistral, Mixtral. Llama's attention_bias puts a bias on q, k, v and o.
    m = llama_core(f, name, false);
    if (type == "llama") {
      m.qkv_bias = m.o_bias = f.flag("attention_bias", false);
      m.mlp_bias = f.flag("mlp_bias", false);
    }
    if (type == "mixtral") experts(f, m, "num_local_experts", "intermediate_size");
  } else if (type == "qwen") {
    // Qwen (1): one c_attn with bias, MLP w1/w2 of intermediate_size / 2 each, untied.
    m = llama_core(f, name, false);
    m.head_dim = f.optional("kv_channels", m.hidden / m.heads, W);
    m.intermediate = f.integer("intermediate_size", W) / 2;
    m.fused_qkv = true;
    m.qkv_bias = true;
  } else if (type == "qwen2" || type == "qwen2_moe") {
    m = llama_core(f, name, false, type == "qwen2");
    m.qkv_bias = true;
    if (type == "qwen2_moe") {
      experts(f, m, "num_experts", "moe_intermediate_size");
      m.shared_expert_intermediate = f.optional("shared_expert_intermediate_size", 0, W);
      m.shared_expert_gate = m.shared_expert_intermediate != 0;
    }
  } else if (type == "qwen3" || type == "qwen3_moe") {
    m = llama_core(f, name, false, type == "qwen3");
    m.qkv_bias = m.o_bias = f.flag("attention_bias", false);
    m.qk_norm = qk_norm_kind::per_head;
    if (type == "qwen3_moe") experts(f, m, "num_experts", "moe_intermediate_size");
  } else if (type == "gemma" || type == "gemma2" || type == "gemma3_text") {
    // Gemma 1 / 2 / 3 (text): GeGLU, tied; Gemma 2 and 3 add norms after attention and MLP, 3 q/k norms.
    m = llama_core(f, name, true);
    m.mlp = mlp_kind::geglu;
    gated_activation(f, m);
    m.qkv_bias = m.o_bias = f.flag("attention_bias", false);
    if (type != "gemma") m.norms_per_block = 4;
    if (type == "gemma3_text") m.qk_norm = qk_norm_kind::per_head;
  } else if (type == "gemma3") {
    // Gemma 3 4B / 12B / 27B: the Gemma 3 language model (text_config; absent fields take transformers'
    // Gemma3TextConfig defaults, as the published configs rely on) behind a SigLIP image encoder
    // (vision_config, SiglipVisionConfig defaults) and a projection into the text width.
    const json_value* text_config = config.find("text_config");
    const json_value* vision_config = config.find("vision_config");
    if (text_config == nullptr || !text_config->is_object() || vision_config == nullptr || !vision_config->is_object())
      throw memkit::error("config.json (model_type gemma3): text_config and vision_config must be objects");
    const config_fields t(*text_config, "gemma3 text_config"), v(*vision_config, "gemma3 vision_config");
    m = llama_style(name, t.optional("hidden_size", 2304, W), t.optional("num_hidden_layers", 26, D),
                    t.optional("num_attention_heads", 8, H), t.optional("num_key_value_heads", 4, H),
                    t.optional("intermediate_size", 9216, W), t.optional("vocab_size", 262208, V),
                    f.flag("tie_word_embeddings", t.flag("tie_word_embeddings", true)),
                    t.optional("max_position_embeddings", 131072, P), t.optional("head_dim", 256, W));
    m.mlp = mlp_kind::geglu;
    m.norms_per_block = 4;
    m.qk_norm = qk_norm_kind::per_head;
    m.vision = vision_encoder{v.optional("hidden_size", 768, W), v.optional("num_hidden_layers", 12, D),
                              v.optional("intermediate_size", 3072, W), v.optional("image_size", 224, P),
                              v.optional("patch_size", 16, W), v.optional("num_channels", 3, W)};
    if (v.flag("vision_use_head", false))
      throw memkit::error("config.json (model_type gemma3): vision_use_head is not modeled by memkit-budget");
  } else if (type == "phi3") {
    m = llama_core(f, name, false);
    m.fused_qkv = true;
    m.fused_gate_up = true;
  } else if (type == "phi") {
    // Phi-1 / 1.5 / 2: one LayerNorm feeding attention and MLP in parallel, biases everywhere including
    // the LM head, plain GeLU MLP.
    m = llama_core(f, name, false);
    if (f.flag("qk_layernorm", false))
      throw memkit::error("config.json (model_type phi): qk_layernorm is not modeled by memkit-budget");
    m.mlp = mlp_kind::gelu;
    m.norm = norm_kind::layer;
    m.norms_per_block = 1;
    m.parallel_attention = true;
    m.qkv_bias = m.o_bias = m.mlp_bias = m.lm_head_bias = true;
  } else if (type == "gpt2") {
    const std::uint64_t hidden = f.integer("n_embd", W);
    m = gpt2_style(name, hidden, f.integer("n_layer", D), f.integer("n_head", H), f.integer("vocab_size", V),
                   f.integer("n_positions", P));
    m.intermediate = f.optional("n_inner", 4 * hidden, W);
    m.tied_embeddings = f.flag("tie_word_embeddings", true);
  } else if (type == "gpt_neox") {
    // GPT-NeoX-20B, Pythia: fused qkv, LayerNorms and biases, parallel residual, untied embed_out.
    m = llama_core(f, name, false);
    m.mlp = mlp_kind::gelu;
    m.norm = norm_kind::layer;
    m.fused_qkv = true;
    m.qkv_bias = m.o_bias = f.flag("attention_bias", true);
    m.mlp_bias = true;
    m.parallel_attention = f.flag("use_parallel_residual", true);
  } else if (type == "stablelm") {
    // StableLM-3B-4E1T, StableLM-2: LayerNorms with bias, SwiGLU without, optional q/k/v bias and per-head
    // q/k LayerNorms, optional parallel residual with one norm.
    m = llama_core(f, name, false);
    m.norm = norm_kind::layer;
    m.qkv_bias = f.flag("use_qkv_bias", false);
    if (f.flag("qk_layernorm", false)) m.qk_norm = qk_norm_kind::full_width;
    m.parallel_attention = f.flag("use_parallel_residual", false);
    if (m.parallel_attention) m.norms_per_block = 1;
  } else if (type == "falcon") {
    // Falcon: fused query_key_value (multi-query: one k/v head; the new decoder architecture: grouped),
    // LayerNorms, optional biases, parallel attention, tied LM head.
    const std::uint64_t hidden = f.integer({"hidden_size", "n_embed"}, W);
    const std::uint64_t heads = f.integer({"num_attention_heads", "n_head"}, H);
    const bool new_architecture = f.flag("new_decoder_architecture", false);
    std::uint64_t kv_heads = heads;
    if (new_architecture) kv_heads = f.optional({"num_kv_heads", "n_head_kv"}, heads, H);
    else if (f.flag("multi_query", true)) kv_heads = 1;
    m = llama_style(name, hidden, f.integer({"num_hidden_layers", "n_layer"}, D), heads, kv_heads,
                    f.optional("ffn_hidden_size", 4 * hidden, W), f.integer("vocab_size", V),
                    f.flag("tie_word_embeddings", true), f.optional("max_position_embeddings", 0, P),
                    f.optional("head_dim", 0, W));
    m.mlp = mlp_kind::gelu;
    m.norm = norm_kind::layer;
    m.fused_qkv = true;
    m.qkv_bias = m.o_bias = m.mlp_bias = f.flag("bias", false);
    // As transformers' FalconDecoderLayer: sequential blocks have two norms; parallel ones one, or two
    // (ln_attn, ln_mlp) with num_ln_in_parallel_attn 2, the new architecture's default.
    m.parallel_attention = f.flag("parallel_attn", true);
    const std::uint64_t parallel_norms = f.optional("num_ln_in_parallel_attn", new_architecture ? 2 : 1, D);
    m.norms_per_block = !m.parallel_attention || parallel_norms == 2 ? 2 : 1;
  } else if (type == "olmo" || type == "olmo2" || type == "olmoe") {
    // OLMo: non-parametric LayerNorms. OLMo-2: RMSNorms after attention and MLP, q/k RMSNorms over all
    // heads. OLMoE: OLMo-2-style q/k norms before a 64-expert MLP.
    m = llama_core(f, name, false);
    m.qkv_bias = m.o_bias = f.flag("attention_bias", false);
    if (type == "olmo") m.norm = norm_kind::nonparametric;
    else m.qk_norm = qk_norm_kind::full_width;
    if (type == "olmoe") experts(f, m, "num_experts", "intermediate_size");
  } else if (type == "bert" || type == "roberta") {
    // Encoders: learned positions and token types, an embedding LayerNorm, post-norm blocks with biases
    // everywhere and no final norm, a pooler; the MLM head's decoder is tied to the word embeddings.
    const std::uint64_t heads = f.integer("num_attention_heads", H);
    m = llama_style(name, f.integer("hidden_size", W), f.integer("num_hidden_layers", D), heads, heads,
                    f.integer("intermediate_size", W), f.integer("vocab_size", V), true,
                    f.integer("max_position_embeddings", P));
    m.family = architecture::encoder;
    m.mlp = mlp_kind::gelu;
    m.norm = norm_kind::layer;
    m.final_norm = false;
    m.qkv_bias = m.o_bias = m.mlp_bias = true;
    m.learned_positions = true;
    m.token_types = f.optional("type_vocab_size", 2, V);
    m.embedding_norm = true;
    m.pooler = true;
    // BERT and RoBERTa train with dropout (hidden_dropout_prob, attention_probs_dropout_prob: 0.1 unless
    // the config says otherwise): masks and dropped copies of the attention probabilities and residuals.
    auto probability = [&](const char* key) {
      const json_value* v = f.find({key});
      return v == nullptr ? 0.1 : v->as_double();
    };
    m.dropout = probability("hidden_dropout_prob") > 0 || probability("attention_probs_dropout_prob") > 0;
  } else {
    throw memkit::error("config.json: unsupported model_type '" + type + "' (supported: " + supported_model_types + ")");
  }
  if (!m.valid()) throw memkit::error("config.json: " + std::string(m.problem()));
  // Each field within its cap can still multiply out past 64 bits; no real model has 10^15 parameters.
  double parameters = 0;
  for_each_parameter(m, [&](const parameter_tensor& t) {
    parameters += static_cast<double>(t.rows) * static_cast<double>(t.cols) * static_cast<double>(t.count);
  });
  if (parameters > 1e15) {
    char count[32];
    std::snprintf(count, sizeof count, "%.3g", parameters);
    throw memkit::error(std::string("config.json: the dimensions describe ") + count +
                        " parameters, more than the largest meaningful 1e15");
  }
  return m;
}

}  // namespace memkit_tools
