// Reads a Hugging Face config.json into a memkit::budget::model_config.
// Supported model_type: llama, mistral, qwen2, gemma, phi3 (llama-style) and gpt2.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include <memkit/budget/model.hpp>

#include <memkit/io/json.hpp>

namespace memkit_tools {

using json_value = memkit::json::value;

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

inline std::uint64_t positive_integer(const json_value& config, const char* key, const char* model_type,
                                      dimension kind) {
  const json_value* v = config.find(key);
  if (v == nullptr || v->is_null())
    throw memkit::error(std::string("config.json (model_type ") + model_type + "): missing field '" + key + "'");
  // Integral values written as floats (4096.0) are accepted; fractions are not.
  if (!v->is_number() || v->as_double() != std::floor(v->as_double()))
    throw memkit::error(std::string("config.json: field '") + key + "' must be an integer");
  if (v->as_double() <= 0)
    throw memkit::error(std::string("config.json: field '") + key + "' must be positive, got " + v->number_text());
  const std::uint64_t limit = dimension_limit(kind);
  if (v->as_double() > static_cast<double>(limit))
    throw memkit::error(std::string("config.json: field '") + key + "' is " + v->number_text() +
                        ", more than the largest meaningful value " + std::to_string(limit));
  return static_cast<std::uint64_t>(v->as_double());
}
inline std::uint64_t optional_integer(const json_value& config, const char* key, std::uint64_t fallback,
                                      const char* model_type, dimension kind) {
  const json_value* v = config.find(key);
  if (v == nullptr || v->is_null()) return fallback;
  return positive_integer(config, key, model_type, kind);
}
inline bool optional_bool(const json_value& config, const char* key, bool fallback) {
  const json_value* v = config.find(key);
  if (v == nullptr || v->is_null()) return fallback;
  if (!v->is_bool()) throw memkit::error(std::string("config.json: field '") + key + "' must be true or false");
  return v->as_bool();
}
}  // namespace detail

// `name` must outlive the returned description (it keeps a view of it).
inline memkit::budget::model_config model_from_hf_config(const json_value& config, const std::string& name) {
  using namespace memkit::budget;
  if (!config.is_object()) throw memkit::error("config.json: expected a JSON object");
  const json_value* type_field = config.find("model_type");
  if (type_field == nullptr || !type_field->is_string()) throw memkit::error("config.json: missing field 'model_type'");
  const std::string& type = type_field->as_string();
  const char* t = type.c_str();
  using detail::optional_bool;
  using detail::optional_integer;
  using detail::positive_integer;
  constexpr auto W = detail::dimension::width, D = detail::dimension::depth, H = detail::dimension::heads,
                 V = detail::dimension::vocab, P = detail::dimension::positions;

  model_config m;
  if (type == "gpt2") {
    const std::uint64_t hidden = positive_integer(config, "n_embd", t, W);
    m = gpt2_style(name, hidden, positive_integer(config, "n_layer", t, D), positive_integer(config, "n_head", t, H),
                   positive_integer(config, "vocab_size", t, V), positive_integer(config, "n_positions", t, P));
    m.intermediate = optional_integer(config, "n_inner", 4 * hidden, t, W);
    m.tied_embeddings = optional_bool(config, "tie_word_embeddings", true);
  } else if (type == "llama" || type == "mistral" || type == "qwen2" || type == "gemma" || type == "phi3") {
    const std::uint64_t heads = positive_integer(config, "num_attention_heads", t, H);
    const bool tied_default = type == "gemma";  // transformers' per-model default
    m = llama_style(name, positive_integer(config, "hidden_size", t, W), positive_integer(config, "num_hidden_layers", t, D),
                    heads, optional_integer(config, "num_key_value_heads", heads, t, H),
                    positive_integer(config, "intermediate_size", t, W), positive_integer(config, "vocab_size", t, V),
                    optional_bool(config, "tie_word_embeddings", tied_default),
                    optional_integer(config, "max_position_embeddings", 0, t, P), optional_integer(config, "head_dim", 0, t, W));
    m.qkv_bias = type == "qwen2" || optional_bool(config, "attention_bias", false);
    if (type == "phi3") {
      m.fused_qkv = true;
      m.fused_gate_up = true;
    }
    const json_value* act = config.find("hidden_activation");
    if (act == nullptr || !act->is_string()) act = config.find("hidden_act");
    if (act != nullptr && act->is_string() && act->as_string().rfind("gelu", 0) == 0)
      m.mlp = mlp_kind::geglu;
  } else {
    throw memkit::error("config.json: unsupported model_type '" + type +
                        "' (supported: llama, mistral, qwen2, gemma, phi3, gpt2)");
  }
  if (!m.valid()) throw memkit::error("config.json: " + std::string(m.problem()));
  // Each field within its cap can still multiply out past 64 bits; no real model has 10^15 parameters.
  double parameters = 0;
  memkit::budget::for_each_parameter(m, [&](const memkit::budget::parameter_tensor& t) {
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
