// memkit/models/llama/config.hpp — a Hugging Face config.json as a model_config, for the families whose math
// the decoder implements exactly: llama, mistral, qwen2, qwen3.
//
// Every field the math depends on is read with transformers' default for that family when absent; anything
// the decoder does not implement (another model_type, an activation other than silu, a RoPE type other than
// default / llama3, partial rotary, a layer pattern it cannot express, a quantization_config other than
// bitsandbytes 4-bit NF4) is refused
// with one line naming the field and what is supported. Sizes are bounded before anything is allocated.
#pragma once

#include "block.hpp"

#include <memkit/config.hpp>
#include <memkit/io/json.hpp>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <initializer_list>
#include <sstream>
#include <string>

namespace memkit::models::llama {

inline constexpr const char* supported_model_types = "llama, mistral, qwen2, qwen3";

namespace detail {

// Far above any released model (hidden ~2^14, ~2^7 layers, vocabularies ~2^18), low enough that no size
// product in the decoder wraps: a config beyond these is a mistake or an attack.
inline constexpr double max_width = double(1 << 20), max_count = double(1 << 14), max_vocab = double(1 << 24),
                        max_positions = double(1 << 27);

class config_reader {
 public:
  config_reader(const json::value& root, std::string where) : root_(root), where_(std::move(where)) {}

  const json::value* find(const char* key) const {
    const json::value* v = root_.find(key);
    return v == nullptr || v->is_null() ? nullptr : v;
  }
  [[noreturn]] void fail(const std::string& what) const { throw memkit::error(where_ + ": " + what); }

  std::int64_t integer(const char* key, double limit, std::int64_t fallback = -1) const {
    const json::value* v = find(key);
    if (v == nullptr) {
      if (fallback < 0) fail(std::string("missing field '") + key + "'");
      return fallback;
    }
    if (!v->is_number() || v->as_double() != std::floor(v->as_double()))
      fail(std::string("field '") + key + "' must be an integer");
    if (v->as_double() <= 0 || v->as_double() > limit)
      fail(std::string("field '") + key + "' is " + v->number_text() + ", outside 1.." + std::to_string(std::int64_t(limit)));
    return static_cast<std::int64_t>(v->as_double());
  }
  double number(const json::value& object, const char* key, double fallback, bool positive = true) const {
    const json::value* v = object.find(key);
    if (v == nullptr || v->is_null()) return fallback;
    if (!v->is_number() || !std::isfinite(v->as_double()) || (positive && v->as_double() <= 0))
      fail(std::string("field '") + key + "' must be a" + (positive ? " positive" : "") + " finite number");
    return v->as_double();
  }
  double number(const char* key, double fallback) const { return number(root_, key, fallback); }
  bool flag(const char* key, bool fallback) const {
    const json::value* v = find(key);
    if (v == nullptr) return fallback;
    if (!v->is_bool()) fail(std::string("field '") + key + "' must be true or false");
    return v->as_bool();
  }
  std::string text(const json::value& object, const char* key, const std::string& fallback) const {
    const json::value* v = object.find(key);
    if (v == nullptr || v->is_null()) return fallback;
    if (!v->is_string()) fail(std::string("field '") + key + "' must be a string");
    return v->as_string();
  }
  std::string text(const char* key, const std::string& fallback) const { return text(root_, key, fallback); }

 private:
  const json::value& root_;
  std::string where_;
};

}  // namespace detail

// `max_sequence` sizes the rotary table (model_config::max_positions): the longest sequence the model will
// run; 0 takes the config's max_position_embeddings. `where` names the file in messages.
inline model_config config_from_hf(const json::value& root, std::int64_t max_sequence = 0,
                                   const std::string& where = "config.json") {
  if (!root.is_object()) throw memkit::error(where + ": not a JSON object");
  const json::value* type_value = root.find("model_type");
  if (type_value == nullptr || !type_value->is_string())
    throw memkit::error(where + ": no model_type (supported: " + supported_model_types + ")");
  const std::string type = type_value->as_string();
  if (type != "llama" && type != "mistral" && type != "qwen2" && type != "qwen3")
    throw memkit::error(where + ": model_type '" + type + "' is not supported (supported: " + supported_model_types + ")");
  const detail::config_reader f(root, where + " (model_type " + type + ")");

  const std::string act = f.text("hidden_act", "silu");
  if (act != "silu") f.fail("hidden_act '" + act + "' is not supported (supported: silu)");

  model_config c;
  c.hidden = f.integer("hidden_size", detail::max_width);
  c.layers = f.integer("num_hidden_layers", detail::max_count);
  c.heads = f.integer("num_attention_heads", detail::max_count);
  c.kv_heads = f.integer("num_key_value_heads", detail::max_count, c.heads);
  c.intermediate = f.integer("intermediate_size", detail::max_width);
  c.vocab = f.integer("vocab_size", detail::max_vocab);
  // Qwen3's head_dim defaults to 128; the others derive it from the hidden size.
  const std::int64_t derived_head_dim = type == "qwen3" ? 128 : c.hidden / c.heads;
  c.head_dim = f.integer("head_dim", detail::max_width, derived_head_dim);
  if (type != "qwen3" && f.find("head_dim") == nullptr && c.hidden % c.heads != 0)
    f.fail("hidden_size " + std::to_string(c.hidden) + " is not a multiple of num_attention_heads " + std::to_string(c.heads));
  if (c.heads % c.kv_heads != 0)
    f.fail("num_attention_heads " + std::to_string(c.heads) + " is not a multiple of num_key_value_heads " +
           std::to_string(c.kv_heads));
  if (c.head_dim % 2 != 0) f.fail("head_dim " + std::to_string(c.head_dim) + " is odd (the rotation pairs its halves)");
  const std::int64_t max_positions = f.integer("max_position_embeddings", detail::max_positions, 0);
  c.max_positions = max_sequence > 0 ? max_sequence : max_positions;
  if (c.max_positions <= 0) f.fail("no max_position_embeddings, and no sequence length was given");
  if (static_cast<double>(c.max_positions) > detail::max_positions) f.fail("the sequence length is too long");
  c.norm_eps = static_cast<float>(f.number("rms_norm_eps", 1e-6));
  c.tie_embeddings = f.flag("tie_word_embeddings", false);

  // Biases: Llama's attention_bias covers q, k, v and o; Qwen2 has q, k, v biases always; Qwen3's covers all four.
  if (type == "llama") {
    c.qkv_bias = c.o_bias = f.flag("attention_bias", false);
    c.mlp_bias = f.flag("mlp_bias", false);
  } else if (type == "qwen2") {
    c.qkv_bias = true;
  } else if (type == "qwen3") {
    c.qkv_bias = c.o_bias = f.flag("attention_bias", false);
    c.qk_norm = true;
  }

  // RoPE: transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; older files rope_theta and
  // rope_scaling {type | rope_type, factor, ...}.
  const json::value* rope = f.find("rope_parameters");
  if (rope == nullptr) rope = f.find("rope_scaling");
  if (rope != nullptr && !rope->is_object()) f.fail("rope_parameters / rope_scaling must be an object");
  c.rope_theta = static_cast<float>(rope != nullptr ? f.number(*rope, "rope_theta", f.number("rope_theta", 10000.0))
                                                    : f.number("rope_theta", 10000.0));
  if (rope != nullptr) {
    const std::string rope_type = f.text(*rope, "rope_type", f.text(*rope, "type", "default"));
    if (f.number(*rope, "partial_rotary_factor", 1.0) != 1.0 || f.number("partial_rotary_factor", 1.0) != 1.0)
      f.fail("partial_rotary_factor other than 1 is not supported");
    if (rope_type == "llama3") {
      c.rope_llama3_factor = static_cast<float>(f.number(*rope, "factor", 0.0));
      if (c.rope_llama3_factor <= 0.0f) f.fail("rope type llama3 needs a positive factor");
      c.rope_low_freq_factor = static_cast<float>(f.number(*rope, "low_freq_factor", 0.0));
      c.rope_high_freq_factor = static_cast<float>(f.number(*rope, "high_freq_factor", 0.0));
      if (c.rope_low_freq_factor <= 0.0f || c.rope_high_freq_factor <= c.rope_low_freq_factor)
        f.fail("rope type llama3 needs 0 < low_freq_factor < high_freq_factor");
      const double original = f.number(*rope, "original_max_position_embeddings", static_cast<double>(max_positions));
      if (original <= 0 || original > detail::max_positions || original != std::floor(original))
        f.fail("rope type llama3 needs an integer original_max_position_embeddings");
      c.rope_original_max_positions = static_cast<std::int64_t>(original);
    } else if (rope_type != "default") {
      f.fail("rope type '" + rope_type + "' is not supported (supported: default, llama3)");
    }
  }

  // Sliding windows. Mistral: every layer when sliding_window is set (its default is 4096). Qwen2 / Qwen3:
  // layers from max_window_layers on when use_sliding_window is true, or as layer_types lists them.
  const json::value* window = f.find("sliding_window");
  const auto window_size = [&] {
    if (!window->is_number() || window->as_double() <= 0 || window->as_double() != std::floor(window->as_double()))
      f.fail("field 'sliding_window' must be a positive integer or null");
    return static_cast<std::int64_t>(std::min(window->as_double(), detail::max_positions));
  };
  if (type == "mistral") {
    if (f.find("layer_types") != nullptr) f.fail("layer_types is not supported for mistral (transformers reads it as Ministral)");
    const json::value* present = root.find("sliding_window");
    c.sliding_window = present == nullptr ? 4096 : (window == nullptr ? 0 : window_size());
  } else if (type == "qwen2" || type == "qwen3") {
    const bool use = f.flag("use_sliding_window", false);
    const std::int64_t size = use ? (window == nullptr ? 0 : window_size()) : 0;
    std::int64_t first = size > 0 ? std::min(f.integer("max_window_layers", detail::max_count, 28), c.layers) : c.layers;
    if (const json::value* types = f.find("layer_types")) {
      if (!types->is_array() || static_cast<std::int64_t>(types->as_array().size()) != c.layers)
        f.fail("layer_types must list num_hidden_layers entries");
      first = c.layers;
      for (std::int64_t i = 0; i < c.layers; ++i) {
        const json::value& t = types->as_array()[static_cast<std::size_t>(i)];
        const std::string kind = t.is_string() ? t.as_string() : std::string("(not a string)");
        if (kind != "full_attention" && kind != "sliding_attention")
          f.fail("layer_types[" + std::to_string(i) + "] is '" + kind + "' (supported: full_attention, sliding_attention)");
        if (kind == "sliding_attention" && first == c.layers) first = i;
        if (kind == "full_attention" && first < c.layers)
          f.fail("layer_types: sliding layers must all come after the full-attention ones");
      }
      if (first < c.layers && size == 0) f.fail("layer_types names sliding_attention layers but no sliding window is in use");
    }
    c.sliding_window = first < c.layers ? size : 0;
    c.first_sliding_layer = first;
  }
  return c;
}

// A config.json's quantization_config: what transformers wrote when it saved a bitsandbytes 4-bit model
// (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")). Only that form is read: its
// projections load straight into a QLoRA model's NF4 bases (load.hpp).
struct checkpoint_quantization {
  bool bnb_nf4 = false;  // the seven projections of every block are bitsandbytes NF4 Linear4bit weights
};

inline checkpoint_quantization quantization_from_hf(const json::value& root, const std::string& where = "config.json") {
  checkpoint_quantization q;
  const json::value* qc = root.is_object() ? root.find("quantization_config") : nullptr;
  if (qc == nullptr || qc->is_null()) return q;
  const detail::config_reader f(*qc, where + " (quantization_config)");
  if (!qc->is_object()) f.fail("not an object");
  const std::string method = f.text("quant_method", "");
  if (method != "bitsandbytes")
    f.fail("quant_method '" + method + "' is not supported (supported: bitsandbytes with load_in_4bit and nf4)");
  if (f.flag("load_in_8bit", false)) f.fail("load_in_8bit: 8-bit bitsandbytes checkpoints are not supported (supported: 4-bit nf4)");
  if (!f.flag("load_in_4bit", false)) f.fail("load_in_4bit is not true (supported: bitsandbytes 4-bit nf4)");
  const std::string type = f.text("bnb_4bit_quant_type", "fp4");
  if (type != "nf4") f.fail("bnb_4bit_quant_type '" + type + "' is not supported (supported: nf4)");
  const std::string storage = f.text("bnb_4bit_quant_storage", "uint8");
  if (storage != "uint8") f.fail("bnb_4bit_quant_storage '" + storage + "' is not supported (supported: uint8)");
  if (const json::value* skip = f.find("llm_int8_skip_modules")) {
    if (!skip->is_array()) f.fail("llm_int8_skip_modules must be a list");
    for (const json::value& m : skip->as_array()) {
      const std::string name = m.is_string() ? m.as_string() : std::string();
      if (name != "lm_head")
        f.fail("llm_int8_skip_modules lists '" + name + "': only lm_head may stay unquantized (the QLoRA model "
               "quantizes all seven projections)");
    }
  }
  q.bnb_nf4 = true;
  return q;
}

inline json::value read_json_file(const std::string& path, std::streamoff limit, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw memkit::error(path + ": cannot open the model's " + what);
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  if (size < 0 || size > limit) throw memkit::error(path + ": too large for a " + std::string(what));
  in.seekg(0);
  std::string text(static_cast<std::size_t>(size), '\0');
  in.read(text.data(), size);
  if (!in) throw memkit::error(path + ": read failed");
  return json::parse(text, path);
}

// Reads and checks `path` (a config.json; at most 16 MiB).
inline model_config read_hf_config(const std::string& path, std::int64_t max_sequence = 0) {
  return config_from_hf(read_json_file(path, std::streamoff{16} << 20, "config"), max_sequence, path);
}

}  // namespace memkit::models::llama
