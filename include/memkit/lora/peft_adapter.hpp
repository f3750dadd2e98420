// memkit/lora/peft_adapter.hpp — LoRA adapters in PEFT's files, read and written exactly as PEFT does.
//
// A PEFT LoRA adapter is a directory with two files:
//   adapter_config.json         the LoraConfig: r, lora_alpha, target_modules, lora_dropout, use_rslora, bias,
//                               rank_pattern, alpha_pattern, base_model_name_or_path, task_type, peft_type, ...
//   adapter_model.safetensors   per adapted module M (its path in the base model, e.g.
//                               "model.layers.0.self_attn.q_proj"):
//                                 base_model.model.M.lora_A.weight     [r, in]
//                                 base_model.model.M.lora_B.weight     [out, r]
//                                 base_model.model.M.base_layer.bias   [out]   when the bias trains
//                               and, with bias "all", base_model.model.N.bias of modules N without LoRA.
// The API works on named tensor views and the config struct; no model object is involved. Reading checks
// the config against the file (every module targeted, every rank and shape as the config says, biases as
// its `bias` says) before any tensor is read, and load() fills its destinations all or nothing. Fields of
// the config memkit does not interpret are kept verbatim and written back, so an adapter loaded, trained
// and saved again keeps them. Features memkit's LoRA layer cannot represent (DoRA, LoRA biases, embedding
// adapters, modules_to_save, ...) are refused with the field or key at fault, never silently dropped.
#pragma once

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <unistd.h>
#include <utility>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/rounded_math.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/core/units.hpp"
#include "memkit/io/json.hpp"
#include "memkit/io/safetensors.hpp"
#include "memkit/lora/lora_linear.hpp"
#include "memkit/lora/module_pattern.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace peft {

inline constexpr const char* config_file_name = "adapter_config.json";
inline constexpr const char* weights_file_name = "adapter_model.safetensors";
// PEFT's wrapper (PeftModel.base_model = LoraModel, LoraModel.model = the user's model) prefixes every key.
inline constexpr std::string_view key_prefix = "base_model.model.";

// Which modules a pattern field selects: absent (JSON null), a regex the whole module path must match
// (PEFT's string form, matched by module_pattern: no backtracking, the subset module_pattern.hpp lists), or a
// list of names, each matching the path itself or its last dotted components.
struct module_selector {
  bool present = false;
  std::string regex;               // used when non-empty
  std::vector<std::string> names;  // used otherwise
  module_pattern compiled;         // regex, compiled (matching() does it; a hand-made selector compiles per match)
  std::vector<std::string> sorted_names;  // names, sorted (of() does it; a hand-made selector compares each name)

  static module_selector of(std::vector<std::string> list) {
    std::vector<std::string> sorted = list;
    std::sort(sorted.begin(), sorted.end());
    return {true, {}, std::move(list), {}, std::move(sorted)};
  }
  static module_selector matching(std::string pattern, const std::string& what = "module_selector") {
    module_pattern compiled(pattern, what);
    return {true, std::move(pattern), {}, std::move(compiled), {}};
  }

  bool matches(std::string_view path) const {
    if (!present) return false;
    if (!regex.empty()) {
      if (compiled.text() == regex && !compiled.empty()) return compiled.full_match(path);
      return module_pattern(regex, "module_selector").full_match(path);
    }
    // The path itself and each of its dotted suffixes ("layers.0.q_proj", "0.q_proj", "q_proj"), looked up in
    // the names: a suffix walk, so a list of 40,000 names costs a few lookups per path, not 40,000 compares.
    if (!sorted_names.empty() && sorted_names.size() == names.size()) {
      for (std::size_t at = 0;;) {
        if (std::binary_search(sorted_names.begin(), sorted_names.end(), path.substr(at), std::less<>())) return true;
        const std::size_t dot = path.find('.', at);
        if (dot == std::string_view::npos) return false;
        at = dot + 1;
      }
    }
    for (const std::string& name : names)
      if (path == name || (path.size() > name.size() && path.ends_with(name) && path[path.size() - name.size() - 1] == '.'))
        return true;
    return false;
  }
};

// adapter_config.json of a LoRA adapter. Defaults are LoraConfig's.
struct lora_config {
  std::int64_t r = 8;
  double lora_alpha = 8.0;
  double lora_dropout = 0.0;
  module_selector target_modules;  // which modules carry an adapter
  module_selector exclude_modules;
  std::vector<std::int64_t> layers_to_transform;  // empty: every layer
  std::vector<std::string> layers_pattern;        // the names before the layer index ("layers", "h", ...)
  bool use_rslora = false;                         // scale alpha / sqrt(r) instead of alpha / r
  std::string bias = "none";                       // "none", "all" or "lora_only": which biases train
  std::string base_model_name_or_path;             // "" is JSON null
  std::string task_type;                           // "" is JSON null; "CAUSAL_LM", "SEQ_CLS", ...
  bool fan_in_fan_out = false;                     // the base weight is stored [in, out] (GPT-2's Conv1D)
  bool inference_mode = true;
  std::vector<std::pair<std::string, std::int64_t>> rank_pattern;  // module pattern -> r
  std::vector<std::pair<std::string, double>> alpha_pattern;       // module pattern -> lora_alpha
  // Every other field of the file (peft_version, init_lora_weights, ...) as JSON text, written back as is.
  std::vector<std::pair<std::string, std::string>> other_fields;

  // PEFT's get_pattern_key: the first pattern key P with re.match(r"(.*\.)?(P)$", module).
  template <class V>
  static const V* pattern_value(const std::vector<std::pair<std::string, V>>& patterns, std::string_view module) {
    for (const auto& [key, value] : patterns)
      if (pattern_key(key).full_match(module)) return &value;
    return nullptr;
  }
  // The pattern PEFT builds from a rank_pattern / alpha_pattern key.
  static module_pattern pattern_key(const std::string& key) {
    return module_pattern("(.*\\.)?(" + key + ")", "adapter_config.json: rank_pattern / alpha_pattern key \"" + key + "\"");
  }
  std::int64_t rank_for(std::string_view module) const {
    const std::int64_t* r_override = pattern_value(rank_pattern, module);
    return r_override ? *r_override : r;
  }
  double alpha_for(std::string_view module) const {
    const double* alpha_override = pattern_value(alpha_pattern, module);
    return alpha_override ? *alpha_override : lora_alpha;
  }
  // The factor of the adapter's product: alpha / r, or alpha / sqrt(r) with rsLoRA.
  double scale_for(std::string_view module) const {
    const double rank = static_cast<double>(rank_for(module));
    return alpha_for(module) / (use_rslora ? std::sqrt(rank) : rank);
  }
  // Whether PEFT puts an adapter on the module at `path` (its check_target_module_exists).
  bool targets(std::string_view path) const {
    if (exclude_modules.matches(path) || !target_modules.present) return false;
    if (!target_modules.regex.empty()) return target_modules.matches(path);
    const std::vector<std::string>& names = target_modules.names;
    if (names.size() == 1 && names[0] == "all-linear") return true;  // PEFT expands it to every Linear layer
    if (std::find(names.begin(), names.end(), path) != names.end()) return true;  // named exactly: no layer filter
    if (!target_modules.matches(path)) return false;
    if (layers_to_transform.empty()) return true;
    const std::int64_t layer = layer_index(path);
    return layer >= 0 && std::find(layers_to_transform.begin(), layers_to_transform.end(), layer) != layers_to_transform.end();
  }
  // The first layer index in `path`, or -1: PEFT's re.match(r".*\.[^.]*\.(\d+)\.") (the first all-digit
  // component after at least two others, not the last one), or with layers_pattern P,
  // re.match(r"^(?:.*\.)?P\.(\d+)\.") for each P in turn. Indices past int64 are a memkit::error naming the path.
  std::int64_t layer_index(std::string_view path) const {
    std::vector<std::string_view> parts;
    for (std::size_t at = 0;;) {
      const std::size_t dot = path.find('.', at);
      parts.push_back(path.substr(at, dot == std::string_view::npos ? std::string_view::npos : dot - at));
      if (dot == std::string_view::npos) break;
      at = dot + 1;
    }
    auto digits = [](std::string_view part) {
      return !part.empty() && part.find_first_not_of("0123456789") == std::string_view::npos;
    };
    auto index_of = [&](std::string_view part) {
      std::int64_t value = 0;
      const auto [end, problem] = std::from_chars(part.data(), part.data() + part.size(), value);
      if (problem != std::errc() || end != part.data() + part.size())
        throw error("peft: module path '" + std::string(path) + "' has the layer index " + std::string(part) +
                    ", which does not fit 64 bits");
      return value;
    };
    if (layers_pattern.empty()) {
      for (std::size_t k = 2; k + 1 < parts.size(); ++k)
        if (digits(parts[k])) return index_of(parts[k]);
      return -1;
    }
    for (const std::string& pattern : layers_pattern) {
      const module_pattern compiled(pattern, "adapter_config.json: layers_pattern \"" + pattern + "\"");
      // P spans components [first, last) (it may hold dots), starting the path or after a dot; then digits.
      for (std::size_t first = 0; first < parts.size(); ++first) {
        std::size_t begin = static_cast<std::size_t>(parts[first].data() - path.data());
        for (std::size_t last = first + 1; last + 1 < parts.size(); ++last) {
          const std::size_t end = static_cast<std::size_t>(parts[last - 1].data() - path.data()) + parts[last - 1].size();
          if (digits(parts[last]) && compiled.full_match(path.substr(begin, end - begin))) return index_of(parts[last]);
        }
      }
    }
    return -1;
  }
};

namespace detail {

[[noreturn]] inline void config_error(std::string_view what, const std::string& problem) {
  throw error(std::string(what) + ": " + problem);
}

// A Python float as json.dumps writes it: always with a '.' or an exponent ("0.0", "16.0", "1e-05").
inline std::string python_float(double v) {
  std::string text = json::number(v);
  if (text.find_first_of(".eEn") == std::string::npos) text += ".0";
  return text;
}
// lora_alpha and alpha_pattern values: integers as integers (PEFT users mostly give ints), others as floats.
inline std::string alpha_text(double v) {
  if (v == std::floor(v) && std::fabs(v) < 9.0e15) return std::to_string(static_cast<std::int64_t>(v));
  return python_float(v);
}

// json.dumps(value, indent=2, sort_keys=True) of a parsed value, at nesting `depth`.
inline void dump(const json::value& v, int depth, std::string& out) {
  const std::string pad(static_cast<std::size_t>(2 * (depth + 1)), ' '), close(static_cast<std::size_t>(2 * depth), ' ');
  switch (v.type()) {
    case json::value::kind::null: out += "null"; return;
    case json::value::kind::boolean: out += v.as_bool() ? "true" : "false"; return;
    case json::value::kind::number: out += v.number_text(); return;
    case json::value::kind::string: out += json::quote(v.as_string()); return;
    case json::value::kind::array: {
      if (v.as_array().empty()) {
        out += "[]";
        return;
      }
      out += "[\n";
      for (std::size_t i = 0; i < v.as_array().size(); ++i) {
        out += pad;
        dump(v.as_array()[i], depth + 1, out);
        out += i + 1 < v.as_array().size() ? ",\n" : "\n";
      }
      out += close + "]";
      return;
    }
    case json::value::kind::object: {
      if (v.as_object().empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, json::value>*> members;
      for (const auto& member : v.as_object()) members.push_back(&member);
      std::sort(members.begin(), members.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out += "{\n";
      for (std::size_t i = 0; i < members.size(); ++i) {
        out += pad + json::quote(members[i]->first) + ": ";
        dump(members[i]->second, depth + 1, out);
        out += i + 1 < members.size() ? ",\n" : "\n";
      }
      out += close + "}";
      return;
    }
  }
}
inline std::string dump(const json::value& v, int depth = 0) {
  std::string out;
  dump(v, depth, out);
  return out;
}

inline std::string read_text_file(const std::string& path, std::string_view what) {
  std::ifstream in(path, std::ios::binary);
  require(static_cast<bool>(in), std::string(what) + ": cannot open '" + path + "': " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  require(!in.bad(), std::string(what) + ": reading '" + path + "' failed");
  return text.str();
}

// Writes `path` through a temporary file in the same directory, renamed into place when complete, so a
// failed write never leaves a truncated file under the final name.
template <class WriteTo>
void write_via_temporary(const std::string& path, WriteTo write_to) {
  const std::string temporary = path + ".tmp-" + std::to_string(::getpid());
  try {
    write_to(temporary);
  } catch (...) {
    std::remove(temporary.c_str());
    throw;
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const std::string reason = std::strerror(errno);
    std::remove(temporary.c_str());
    throw error("peft: cannot move '" + temporary + "' to '" + path + "': " + reason);
  }
}

inline module_selector parse_selector(const json::value& v, std::string_view what, const char* field) {
  if (v.is_null()) return {};
  if (v.is_string()) return module_selector::matching(v.as_string(), std::string(what) + ": field \"" + field + "\"");
  require(v.is_array(), std::string(what) + ": field \"" + field + "\" must be null, a string or a list of strings, got " +
                            json::value::kind_name(v.type()));
  std::vector<std::string> names;
  for (const json::value& item : v.as_array()) {
    require(item.is_string(), std::string(what) + ": field \"" + field + "\" lists " + json::value::kind_name(item.type()) +
                                  ", not a module name");
    names.push_back(item.as_string());
  }
  return module_selector::of(std::move(names));
}

inline std::string selector_json(const module_selector& s, int depth) {
  if (!s.present) return "null";
  if (!s.regex.empty()) return json::quote(s.regex);
  std::vector<json::value> items;  // in the given order (PEFT writes its set in iteration order)
  for (const std::string& name : s.names) items.push_back(json::value::make_string(name));
  return dump(json::value::make_array(std::move(items)), depth);
}

}  // namespace detail

// Parses adapter_config.json text; `what` names it in errors. Rejects a config memkit cannot honour.
inline lora_config parse_lora_config(std::string_view text, std::string_view what = config_file_name) {
  const json::value root = json::parse(text, what);
  require(root.is_object(), std::string(what) + ": the config is not a JSON object");
  lora_config c;
  auto type_error = [&](const std::string& field, const char* expected, const json::value& v) {
    detail::config_error(what, "field \"" + field + "\" must be " + expected + ", got " + json::value::kind_name(v.type()) +
                                   (v.is_number() ? " " + v.number_text() : v.is_string() ? " \"" + v.as_string() + "\"" : ""));
  };
  auto as_int = [&](const std::string& field, const json::value& v) -> std::int64_t {
    if (!v.is_number() || v.number_text().find_first_of(".eE") != std::string::npos) type_error(field, "an integer", v);
    return v.as_int();
  };
  auto as_number = [&](const std::string& field, const json::value& v) -> double {
    if (!v.is_number()) type_error(field, "a number", v);
    const double d = v.as_double();
    if (!std::isfinite(d)) type_error(field, "a finite number", v);
    return d;
  };
  auto as_bool = [&](const std::string& field, const json::value& v) -> bool {
    if (!v.is_bool()) type_error(field, "true or false", v);
    return v.as_bool();
  };
  auto as_optional_string = [&](const std::string& field, const json::value& v) -> std::string {
    if (v.is_null()) return {};
    if (!v.is_string()) type_error(field, "a string or null", v);
    return v.as_string();
  };
  // Fields whose non-default values describe adapters memkit's LoRA layer does not have.
  auto refuse_unless_default = [&](const std::string& field, const json::value& v) {
    const bool is_default = v.is_null() || (v.is_bool() && !v.as_bool()) || (v.is_array() && v.as_array().empty()) ||
                            (v.is_object() && v.as_object().empty());
    if (!is_default)
      detail::config_error(what, "field \"" + field + "\" is " + detail::dump(v) +
                                     "; memkit reads plain LoRA adapters of Linear layers, which need it null/false/empty");
  };
  static const char* unsupported[] = {"use_dora",         "lora_bias",          "modules_to_save",
                                      "trainable_token_indices", "target_parameters", "layer_replication",
                                      "use_qalora",       "alora_invocation_tokens"};
  bool saw_peft_type = false;
  for (const auto& [name, v] : root.as_object()) {
    if (name == "peft_type") {
      saw_peft_type = true;
      if (!v.is_string() || v.as_string() != "LORA")
        detail::config_error(what, "field \"peft_type\" is " + detail::dump(v) + "; memkit reads LoRA adapters (\"LORA\")");
    } else if (name == "r") {
      c.r = as_int(name, v);
      if (c.r <= 0) detail::config_error(what, "field \"r\" must be a positive integer, got " + std::to_string(c.r));
    } else if (name == "lora_alpha") {
      c.lora_alpha = as_number(name, v);
    } else if (name == "lora_dropout") {
      c.lora_dropout = as_number(name, v);
      if (!(c.lora_dropout >= 0.0 && c.lora_dropout < 1.0))
        detail::config_error(what, "field \"lora_dropout\" must be in [0, 1), got " + v.number_text());
    } else if (name == "target_modules") {
      c.target_modules = detail::parse_selector(v, what, "target_modules");
    } else if (name == "exclude_modules") {
      c.exclude_modules = detail::parse_selector(v, what, "exclude_modules");
    } else if (name == "layers_to_transform") {
      if (v.is_null()) continue;
      if (v.is_number()) c.layers_to_transform.push_back(as_int(name, v));
      else if (v.is_array())
        for (const json::value& item : v.as_array()) c.layers_to_transform.push_back(as_int(name, item));
      else type_error(name, "null, an integer or a list of integers", v);
    } else if (name == "layers_pattern") {
      const module_selector s = detail::parse_selector(v, what, "layers_pattern");
      if (!s.regex.empty()) c.layers_pattern.push_back(s.regex);
      else c.layers_pattern = s.names;
      // Every item compiles now (a list item was compiled only when first used, escaping as std::regex_error).
      for (const std::string& item : c.layers_pattern)
        (void)module_pattern(item, std::string(what) + ": field \"layers_pattern\" item \"" + item + "\"");
    } else if (name == "use_rslora") {
      c.use_rslora = as_bool(name, v);
    } else if (name == "bias") {
      if (!v.is_string() || (v.as_string() != "none" && v.as_string() != "all" && v.as_string() != "lora_only"))
        detail::config_error(what, "field \"bias\" must be \"none\", \"all\" or \"lora_only\", got " + detail::dump(v));
      c.bias = v.as_string();
    } else if (name == "base_model_name_or_path") {
      c.base_model_name_or_path = as_optional_string(name, v);
    } else if (name == "task_type") {
      c.task_type = as_optional_string(name, v);
    } else if (name == "fan_in_fan_out") {
      c.fan_in_fan_out = as_bool(name, v);
    } else if (name == "inference_mode") {
      c.inference_mode = as_bool(name, v);
    } else if (name == "rank_pattern" || name == "alpha_pattern") {
      if (v.is_null()) continue;
      if (!v.is_object()) type_error(name, "an object", v);
      for (const auto& [pattern, value] : v.as_object()) {
        (void)lora_config::pattern_key(pattern);  // compiles, or names the key and what is wrong with it
        if (name == "rank_pattern") {
          const std::int64_t rank = as_int(name + "." + pattern, value);
          if (rank <= 0)
            detail::config_error(what, "field \"rank_pattern\" gives \"" + pattern + "\" rank " + std::to_string(rank) +
                                           "; ranks must be positive");
          c.rank_pattern.emplace_back(pattern, rank);
        } else {
          c.alpha_pattern.emplace_back(pattern, as_number(name + "." + pattern, value));
        }
      }
    } else {
      // `field` copies the binding: clang before 16 cannot capture structured bindings in a lambda.
      const std::string& field = name;
      if (std::find_if(std::begin(unsupported), std::end(unsupported), [&](const char* u) { return field == u; }) !=
          std::end(unsupported))
        refuse_unless_default(name, v);
      c.other_fields.emplace_back(name, detail::dump(v, 1));
    }
  }
  if (!saw_peft_type) detail::config_error(what, "missing field \"peft_type\" (\"LORA\")");
  if (!c.target_modules.present)
    detail::config_error(what, "field \"target_modules\" is missing or null; memkit needs to know which modules carry LoRA");
  return c;
}

inline lora_config read_lora_config(const std::string& path) {
  return parse_lora_config(detail::read_text_file(path, "peft::read_lora_config"), path);
}

// adapter_config.json text as PEFT writes it: json.dumps(indent=2, sort_keys=True).
inline std::string to_json(const lora_config& c) {
  std::vector<std::pair<std::string, std::string>> fields = c.other_fields;
  auto set = [&](const std::string& name, std::string text) {
    for (auto& field : fields)
      if (field.first == name) {
        field.second = std::move(text);
        return;
      }
    fields.emplace_back(name, std::move(text));
  };
  auto string_or_null = [](const std::string& s) { return s.empty() ? std::string("null") : json::quote(s); };
  set("peft_type", "\"LORA\"");
  set("r", std::to_string(c.r));
  set("lora_alpha", detail::alpha_text(c.lora_alpha));
  set("lora_dropout", detail::python_float(c.lora_dropout));
  set("target_modules", detail::selector_json(c.target_modules, 1));
  set("exclude_modules", detail::selector_json(c.exclude_modules, 1));
  if (c.layers_to_transform.empty()) {
    set("layers_to_transform", "null");
  } else {
    std::vector<json::value> items;
    for (std::int64_t layer : c.layers_to_transform) items.push_back(json::value::make_number(std::to_string(layer)));
    set("layers_to_transform", detail::dump(json::value::make_array(std::move(items)), 1));
  }
  if (c.layers_pattern.empty()) {
    set("layers_pattern", "null");
  } else {
    std::vector<json::value> items;
    for (const std::string& p : c.layers_pattern) items.push_back(json::value::make_string(p));
    set("layers_pattern", detail::dump(json::value::make_array(std::move(items)), 1));
  }
  set("use_rslora", c.use_rslora ? "true" : "false");
  set("bias", json::quote(c.bias));
  set("base_model_name_or_path", string_or_null(c.base_model_name_or_path));
  set("task_type", string_or_null(c.task_type));
  set("fan_in_fan_out", c.fan_in_fan_out ? "true" : "false");
  set("inference_mode", c.inference_mode ? "true" : "false");
  std::vector<std::pair<std::string, json::value>> ranks, alphas;
  for (const auto& [pattern, rank] : c.rank_pattern) ranks.emplace_back(pattern, json::value::make_number(std::to_string(rank)));
  for (const auto& [pattern, alpha] : c.alpha_pattern)
    alphas.emplace_back(pattern, json::value::make_number(detail::alpha_text(alpha)));
  set("rank_pattern", detail::dump(json::value::make_object(std::move(ranks)), 1));
  set("alpha_pattern", detail::dump(json::value::make_object(std::move(alphas)), 1));
  for (const char* off : {"use_dora", "lora_bias"})
    set(off, "false");
  std::sort(fields.begin(), fields.end());
  std::string text = "{\n";
  for (std::size_t i = 0; i < fields.size(); ++i)
    text += "  " + json::quote(fields[i].first) + ": " + fields[i].second + (i + 1 < fields.size() ? ",\n" : "\n");
  return text + "}";
}

inline void write_lora_config(const std::string& path, const lora_config& config) {
  const std::string text = to_json(config);
  detail::write_via_temporary(path, [&](const std::string& temporary) {
    std::ofstream out(temporary, std::ios::binary);
    out << text;
    out.close();
    require(static_cast<bool>(out), "peft::write_lora_config: writing '" + temporary + "' failed");
  });
}

// The tensors of one module: destinations of load() (T mutable) or sources of a save (T const).
// A is [r, in], B is [out, r], bias [out]; tensor_view<T>::none() (a default view) is absent: no
// bias, or, for a module with only a bias (bias "all", a module without LoRA), no A and B.
template <class T>
struct lora_tensors {
  std::string path;  // the module's path in the base model, e.g. "model.layers.0.self_attn.q_proj"
  tensor_view<T> A{};
  tensor_view<T> B{};
  tensor_view<T> bias{};
};

// One module as an adapter file holds it.
struct lora_module {
  std::string path;
  std::int64_t rank = 0;  // 0: a bias-only module
  std::int64_t in_features = 0, out_features = 0;
  bool has_bias = false;
  std::string dtype;  // "F32", "BF16" or "F16"; A, B and bias share it
  double alpha = 0.0, scale = 0.0;

  std::string a_key() const { return std::string(key_prefix) + path + ".lora_A.weight"; }
  std::string b_key() const { return std::string(key_prefix) + path + ".lora_B.weight"; }
  // PEFT wraps the original layer as `base_layer`; a module without LoRA keeps its own name.
  std::string bias_key() const {
    return std::string(key_prefix) + path + (rank > 0 ? ".base_layer.bias" : ".bias");
  }
};

struct load_options {
  // Convert narrowing dtypes (F32 into bf16/fp16, BF16 <-> F16) by rounding; otherwise such a load is an
  // error. Widening (BF16 or F16 into float) is exact and always allowed.
  bool allow_rounding = false;
};

namespace detail {

inline bool is_float_dtype(std::string_view dtype) { return dtype == "F32" || dtype == "BF16" || dtype == "F16"; }

inline float decode_element(const std::byte* raw, std::string_view dtype, std::int64_t i) {
  if (dtype == "F32") {
    float v;
    std::memcpy(&v, raw + 4 * i, 4);
    return v;
  }
  std::uint16_t bits;
  std::memcpy(&bits, raw + 2 * i, 2);
  return dtype == "BF16" ? to_float(bf16::from_bits(bits)) : to_float(fp16::from_bits(bits));
}

// "Natural" order of module paths: "layers.2" before "layers.10".
inline bool natural_less(std::string_view a, std::string_view b) {
  std::size_t i = 0, j = 0;
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  while (i < a.size() && j < b.size()) {
    if (digit(a[i]) && digit(b[j])) {
      std::size_t ie = i, je = j;
      while (ie < a.size() && digit(a[ie])) ++ie;
      while (je < b.size() && digit(b[je])) ++je;
      std::string_view na = a.substr(i, ie - i), nb = b.substr(j, je - j);
      while (na.size() > 1 && na[0] == '0') na.remove_prefix(1);
      while (nb.size() > 1 && nb[0] == '0') nb.remove_prefix(1);
      if (na.size() != nb.size()) return na.size() < nb.size();
      if (na != nb) return na < nb;
      i = ie;
      j = je;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

inline std::string shape_text(const std::vector<std::int64_t>& dims) {
  std::string text = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

// Copies `bytes` host bytes to a destination of any memory kind.
inline void copy_to(void* destination, memory_kind where, const void* source, std::size_t bytes) {
  if (bytes == 0) return;
  if (where != memory_kind::device) {
    std::memcpy(destination, source, bytes);
    return;
  }
#if MEMKIT_HAS_CUDA
  MEMKIT_CUDA_CHECK(cudaMemcpy(destination, source, bytes, cudaMemcpyHostToDevice));
#else
  throw error("peft: a destination is device memory, but this translation unit is built without CUDA");
#endif
}
inline void copy_from(void* destination, const void* source, memory_kind where, std::size_t bytes) {
  if (bytes == 0) return;
  if (where != memory_kind::device) {
    std::memcpy(destination, source, bytes);
    return;
  }
#if MEMKIT_HAS_CUDA
  MEMKIT_CUDA_CHECK(cudaMemcpy(destination, source, bytes, cudaMemcpyDeviceToHost));
#else
  throw error("peft: a source is device memory, but this translation unit is built without CUDA");
#endif
}

}  // namespace detail

// A PEFT adapter directory, opened and checked. Opening reads the config and the safetensors header
// only; load() reads the tensors.
class adapter_file {
 public:
  explicit adapter_file(const std::string& directory)
      : adapter_file(directory + "/" + config_file_name, weights_in(directory)) {}
  adapter_file(const std::string& config_path, const std::string& weights_path)
      : config_(read_lora_config(config_path)), weights_(weights_path) {
    index_modules();
  }

  const lora_config& config() const noexcept { return config_; }
  const safetensors::reader& weights() const noexcept { return weights_; }
  // Every module of the file in natural path order (layers.2 before layers.10).
  const std::vector<lora_module>& modules() const noexcept { return modules_; }
  const lora_module* find(std::string_view path) const noexcept {
    const auto at = std::lower_bound(by_path_.begin(), by_path_.end(), path,
                                     [&](std::size_t i, std::string_view p) { return modules_[i].path < p; });
    return at != by_path_.end() && modules_[*at].path == path ? &modules_[*at] : nullptr;
  }
  const lora_module& module(std::string_view path) const {
    const lora_module* m = find(path);
    if (m != nullptr) return *m;
    std::string known;
    for (std::size_t i = 0; i < modules_.size() && i < 8; ++i) known += (i ? ", " : "") + modules_[i].path;
    if (modules_.size() > 8) known += ", ... (" + std::to_string(modules_.size()) + " in all)";
    throw error(where() + ": no adapter for module '" + std::string(path) + "' (key '" + std::string(key_prefix) +
                std::string(path) + ".lora_A.weight'); the file has: " + known);
  }

  // Loads the listed modules into the destination views, all or nothing: every destination is checked
  // against the file (present, shapes, the bias as the file has it, dtypes), every tensor is read into
  // host temporaries and checked finite, and only then are the destinations written.
  template <float_storage T>
  void load(std::span<const lora_tensors<T>> destinations, const load_options& options = {}) const {
    struct pending {
      tensor_view<T> destination;
      std::vector<T> values;
    };
    std::vector<pending> staged;
    std::vector<std::string_view> listed;
    for (const lora_tensors<T>& dest : destinations) listed.push_back(dest.path);
    std::sort(listed.begin(), listed.end());
    if (const auto twice = std::adjacent_find(listed.begin(), listed.end()); twice != listed.end())
      throw error(where() + ": module '" + std::string(*twice) + "' is listed twice");
    for (std::size_t d = 0; d < destinations.size(); ++d) {
      const lora_tensors<T>& dest = destinations[d];
      const lora_module& m = module(dest.path);
      if (m.rank > 0) {
        stage(staged, m.a_key(), dest.A, {m.rank, m.in_features}, options, "A");
        stage(staged, m.b_key(), dest.B, {m.out_features, m.rank}, options, "B");
      } else {
        require(dest.A.is_none() && dest.B.is_none(), where() + ": module '" + dest.path +
                                                      "' has only a bias in the file (bias \"all\"), no lora_A/lora_B");
      }
      if (m.has_bias) {
        stage(staged, m.bias_key(), dest.bias, {m.out_features}, options, "bias");
      } else {
        require(dest.bias.is_none(), where() + ": module '" + dest.path + "': a bias destination of shape " +
                                       to_string(dest.bias.shape()) + " was given, but the file has no '" + m.bias_key() +
                                       "' (config bias \"" + config_.bias + "\")");
      }
    }
    for (pending& p : staged)
      detail::copy_to(p.destination.data(), p.destination.where(), p.values.data(), p.values.size() * sizeof(T));
  }
  template <float_storage T>
  void load(const std::vector<lora_tensors<T>>& destinations, const load_options& options = {}) const {
    load(std::span<const lora_tensors<T>>(destinations), options);
  }

  // Reads one tensor of the file by its full key into host values of type T (checked finite).
  template <float_storage T>
  std::vector<T> read(const std::string& key, const load_options& options = {}) const {
    const safetensors::tensor_info& info = weights_.info(key);
    return convert<T>(info, options);
  }

 private:
  std::string where() const { return "peft adapter '" + weights_.path() + "'"; }

  // The weights file of an adapter directory; a pickled adapter_model.bin (PEFT's safe_serialization=False)
  // is named as such, since memkit reads safetensors only.
  static std::string weights_in(const std::string& directory) {
    const std::string path = directory + "/" + weights_file_name;
    std::error_code ec;
    if (!std::filesystem::exists(path, ec) && std::filesystem::exists(directory + "/adapter_model.bin", ec))
      throw error("peft adapter '" + directory + "': has adapter_model.bin (a pickle) but no " + weights_file_name +
                  "; memkit reads safetensors: save with save_pretrained(..., safe_serialization=True)");
    return path;
  }

  template <float_storage T, class Pending>
  void stage(std::vector<Pending>& staged, const std::string& key, tensor_view<T> destination,
             std::vector<std::int64_t> dims, const load_options& options, const char* role) const {
    const safetensors::tensor_info& info = weights_.info(key);
    const shape expected = dims.size() == 1 ? shape{dims[0]} : shape{dims[0], dims[1]};
    require(destination.shape() == expected, where() + ": '" + key + "' has shape " + detail::shape_text(info.shape) +
                                                 " in the file, but the " + role + " destination has shape " +
                                                 to_string(destination.shape()));
    require(destination.data() != nullptr, where() + ": the " + std::string(role) + " destination of '" + key + "' is null");
    staged.push_back({destination, convert<T>(info, options)});
  }

  template <float_storage T>
  std::vector<T> convert(const safetensors::tensor_info& info, const load_options& options) const {
    const std::string_view from = info.dtype;
    const std::string_view to = dtype_name<T>();
    const bool widening = to == "F32";
    require(from == to || widening || options.allow_rounding,
            where() + ": '" + info.name + "' is " + info.dtype + " in the file, the destination " + std::string(to) +
                ": converting would round (pass load_options{.allow_rounding = true} to accept that)");
    std::vector<std::byte> raw(info.bytes());
    weights_.read_bytes(info.name, raw.data(), raw.size());
    std::vector<T> values(static_cast<std::size_t>(info.numel()));
    for (std::int64_t i = 0; i < info.numel(); ++i) {
      const float v = detail::decode_element(raw.data(), from, i);
      if (!memkit::detail::is_finite(v))
        throw error(where() + ": '" + info.name + "' holds " + format_float(v) + " at element " + std::to_string(i) + " (flat index)");
      values[static_cast<std::size_t>(i)] = from_float<T>(v);
    }
    return values;
  }

  const safetensors::tensor_info& expect_matrix(const std::string& key) const {
    const safetensors::tensor_info& t = weights_.info(key);
    require(t.shape.size() == 2, where() + ": '" + key + "' has shape " + detail::shape_text(t.shape) +
                                     " (rank " + std::to_string(t.shape.size()) + "); a LoRA weight has rank 2");
    require(t.numel() > 0, where() + ": '" + key + "' is empty (shape " + detail::shape_text(t.shape) + ")");
    return t;
  }

  // Sorts the keys into modules and checks every one against the others and against the config.
  void index_modules() {
    struct parts {
      const safetensors::tensor_info *a = nullptr, *b = nullptr, *bias = nullptr;
      bool own_bias = false;  // "M.bias" of a module without LoRA
    };
    std::vector<std::pair<std::string, parts>> found;
    std::unordered_map<std::string, std::size_t> found_at;  // path -> index in found (was a linear search)
    auto entry = [&](const std::string& path) -> parts& {
      const auto [at, inserted] = found_at.emplace(path, found.size());
      if (inserted) found.emplace_back(path, parts{});
      return found[at->second].second;
    };
    auto strip = [](std::string_view key, std::string_view suffix, std::string& path) {
      if (!key.ends_with(suffix) || key.size() == suffix.size()) return false;
      path = std::string(key.substr(0, key.size() - suffix.size()));
      return true;
    };
    for (const safetensors::tensor_info& t : weights_.tensors()) {
      const std::string_view key = t.name;
      require(key.starts_with(key_prefix), where() + ": key '" + t.name + "' does not start with '" +
                                               std::string(key_prefix) + "'; not a PEFT adapter file?");
      const std::string_view rest = key.substr(key_prefix.size());
      auto refuse = [&](const char* feature) {
        throw error(where() + ": key '" + t.name + "' is " + feature +
                    "; memkit reads plain LoRA adapters of Linear layers (lora_A/lora_B weights and trained biases)");
      };
      if (rest.find("lora_magnitude_vector") != std::string_view::npos) refuse("a DoRA magnitude vector");
      if (rest.find("lora_embedding_") != std::string_view::npos) refuse("an embedding adapter");
      if (rest.find("modules_to_save") != std::string_view::npos) refuse("a modules_to_save copy");
      if (rest.ends_with(".lora_B.bias")) refuse("a LoRA bias (lora_bias=True)");
      if (rest.find(".lora_A.") != std::string_view::npos && !rest.ends_with(".lora_A.weight"))
        refuse("a lora_A tensor with an adapter name or another suffix (save with save_pretrained, which strips it)");
      if (rest.find(".lora_B.") != std::string_view::npos && !rest.ends_with(".lora_B.weight"))
        refuse("a lora_B tensor with an adapter name or another suffix (save with save_pretrained, which strips it)");
      std::string path;
      require(detail::is_float_dtype(t.dtype), where() + ": '" + t.name + "' is " + t.dtype + "; adapter tensors are F32, BF16 or F16");
      if (strip(rest, ".lora_A.weight", path)) entry(path).a = &t;
      else if (strip(rest, ".lora_B.weight", path)) entry(path).b = &t;
      else if (strip(rest, ".base_layer.bias", path)) entry(path).bias = &t;
      else if (strip(rest, ".bias", path)) {
        parts& e = entry(path);
        e.bias = &t;
        e.own_bias = true;
      } else refuse("not a LoRA weight or bias");
    }
    for (const auto& [path, e] : found) {
      lora_module m;
      m.path = path;
      if (e.own_bias) {
        require(e.a == nullptr && e.b == nullptr,
                where() + ": module '" + path + "' has lora_A/lora_B and its bias under '" + e.bias->name +
                    "'; PEFT stores the bias of an adapted module as '" + std::string(key_prefix) + path + ".base_layer.bias'");
        require(config_.bias == "all", where() + ": '" + e.bias->name + "' is the bias of a module without LoRA, which PEFT "
                                                 "saves only with bias \"all\"; adapter_config.json says bias \"" +
                                                 config_.bias + "\"");
      } else {
        if (e.a == nullptr)
          throw error(where() + ": missing key '" + m.a_key() + "' (the file has '" + (e.b ? e.b : e.bias)->name + "')");
        if (e.b == nullptr) throw error(where() + ": missing key '" + m.b_key() + "' (the file has '" + e.a->name + "')");
        const safetensors::tensor_info& a = expect_matrix(m.a_key());
        const safetensors::tensor_info& b = expect_matrix(m.b_key());
        require(a.shape[0] == b.shape[1], where() + ": '" + a.name + "' has shape " + detail::shape_text(a.shape) +
                                              " (rank " + std::to_string(a.shape[0]) + ") but '" + b.name + "' has shape " +
                                              detail::shape_text(b.shape) + " (rank " + std::to_string(b.shape[1]) + ")");
        require(a.dtype == b.dtype, where() + ": '" + a.name + "' is " + a.dtype + " but '" + b.name + "' is " + b.dtype);
        m.rank = a.shape[0];
        m.in_features = a.shape[1];
        m.out_features = b.shape[0];
        m.dtype = a.dtype;
        require(config_.targets(path), where() + ": module '" + path + "' has an adapter in the file but adapter_config.json's "
                                                 "target_modules " + detail::selector_json(config_.target_modules, 0) +
                                                 " (with exclude_modules / layers_to_transform) does not select it");
        const std::int64_t configured = config_.rank_for(path);
        require(configured == m.rank,
                where() + ": adapter_config.json gives module '" + path + "' rank " + std::to_string(configured) +
                    (configured == config_.r ? " (r)" : " (rank_pattern)") + ", but '" + a.name + "' has shape " +
                    detail::shape_text(a.shape) + " (rank " + std::to_string(m.rank) + ")");
        m.alpha = config_.alpha_for(path);
        m.scale = config_.scale_for(path);
      }
      if (e.bias != nullptr) {
        require(config_.bias != "none", where() + ": the file has the bias '" + e.bias->name +
                                            "' but adapter_config.json says bias \"none\" (no bias trains)");
        require(e.bias->shape.size() == 1, where() + ": '" + e.bias->name + "' has shape " + detail::shape_text(e.bias->shape) +
                                               "; a bias has rank 1");
        require(e.bias->shape[0] > 0, where() + ": '" + e.bias->name + "' is empty (shape " +
                                          detail::shape_text(e.bias->shape) + "); a bias has one value per output feature");
        if (m.rank > 0) {
          require(e.bias->shape[0] == m.out_features,
                  where() + ": '" + e.bias->name + "' has shape " + detail::shape_text(e.bias->shape) + " but '" +
                      m.b_key() + "' has " + std::to_string(m.out_features) + " output features");
          require(e.bias->dtype == m.dtype, where() + ": '" + e.bias->name + "' is " + e.bias->dtype + " but '" +
                                                m.a_key() + "' is " + m.dtype);
        } else {
          m.out_features = e.bias->shape[0];
          m.dtype = e.bias->dtype;
        }
        m.has_bias = true;
      }
      modules_.push_back(std::move(m));
    }
    std::sort(modules_.begin(), modules_.end(),
              [](const lora_module& a, const lora_module& b) { return detail::natural_less(a.path, b.path); });
    by_path_.resize(modules_.size());
    for (std::size_t i = 0; i < by_path_.size(); ++i) by_path_[i] = i;
    std::sort(by_path_.begin(), by_path_.end(), [&](std::size_t a, std::size_t b) { return modules_[a].path < modules_[b].path; });
  }

  lora_config config_;
  safetensors::reader weights_;
  std::vector<lora_module> modules_;
  std::vector<std::size_t> by_path_;  // indices of modules_ in path order, for find()
};

// Collects modules and writes an adapter directory PEFT loads with PeftModel.from_pretrained.
class adapter_writer {
 public:
  explicit adapter_writer(lora_config config) : config_(std::move(config)) {
    require(config_.target_modules.present, "peft::adapter_writer: the config has no target_modules");
  }
  const lora_config& config() const noexcept { return config_; }

  // Adds one module's tensors (copied now): A [r, in], B [out, r], and the bias [out] when it trains.
  // Checked against the config: the module must be targeted, its rank the config's (r or rank_pattern), a
  // bias only when the config's bias is not "none". Values must be finite.
  template <float_storage T>
  adapter_writer& add(const std::string& path, tensor_view<const T> A, tensor_view<const T> B,
                      tensor_view<const T> bias = {}) {
    const std::string op = "peft::adapter_writer::add('" + path + "')";
    require(!path.empty() && path.front() != '.' && path.back() != '.', op + ": not a module path");
    require(path.find("lora_") == std::string::npos && !path.ends_with(".base_layer"),
            op + ": give the module's path in the base model, not a PEFT parameter name");
    require(added_.count(path) == 0, op + ": the module was added twice");
    pending p;
    p.path = path;
    if (!A.is_none() || !B.is_none()) {
      require(A.shape().rank == 2 && B.shape().rank == 2,
              op + ": A and B must be matrices, got shapes " + to_string(A.shape()) + " and " + to_string(B.shape()));
      require(A.shape()[0] == B.shape()[1], op + ": A has shape " + to_string(A.shape()) + " (rank " +
                                                std::to_string(A.shape()[0]) + ") but B has shape " +
                                                to_string(B.shape()) + " (rank " + std::to_string(B.shape()[1]) + ")");
      require(A.size() > 0 && B.size() > 0, op + ": A and B must not be empty");
      require(config_.targets(path), op + ": the config's target_modules " + detail::selector_json(config_.target_modules, 0) +
                                         " do not select this module, so PEFT would not load its adapter");
      const std::int64_t configured = config_.rank_for(path);
      require(configured == A.shape()[0], op + ": the config gives rank " + std::to_string(configured) +
                                              (configured == config_.r ? " (r)" : " (rank_pattern)") + " but A has shape " +
                                              to_string(A.shape()) + "; set r or rank_pattern to match");
      p.tensors.push_back(take(op, ".lora_A.weight", A));
      p.tensors.push_back(take(op, ".lora_B.weight", B));
      if (!bias.is_none()) {
        require(bias.shape() == shape{B.shape()[0]}, op + ": bias has shape " + to_string(bias.shape()) + ", expected [" +
                                                         std::to_string(B.shape()[0]) + "] (B's output features)");
        p.tensors.push_back(take(op, ".base_layer.bias", bias));
      }
    } else {
      require(!bias.is_none(), op + ": nothing to save (no A, B or bias)");
      require(config_.bias == "all", op + ": a bias without LoRA weights is saved by PEFT only with bias \"all\"; the "
                                          "config says \"" + config_.bias + "\"");
      require(bias.shape().rank == 1, op + ": bias has shape " + to_string(bias.shape()) + "; a bias has rank 1");
      p.tensors.push_back(take(op, ".bias", bias));
    }
    if (!bias.is_none())
      require(config_.bias != "none", op + ": a bias was given but the config says bias \"none\" (PEFT would ignore it)");
    pending_.push_back(std::move(p));
    added_.insert(path);  // only once every check passed: a refused add leaves the writer as it was
    return *this;
  }
  template <float_storage T>
  adapter_writer& add(const lora_tensors<const T>& module) {
    return add<T>(module.path, module.A, module.B, module.bias);
  }
  template <float_storage T>
  adapter_writer& add(const lora_tensors<T>& module) requires(!std::is_const_v<T>) {
    return add<T>(module.path, tensor_view<const T>(module.A), tensor_view<const T>(module.B),
                  tensor_view<const T>(module.bias));
  }

  // Adds a lora_linear (lora/lora_linear.hpp) as module `path`: its A and B, and its bias when the bias
  // trains. Its rank and scale must be what the config gives this module (r / rank_pattern, lora_alpha /
  // alpha_pattern, use_rslora), or PEFT would run a different layer.
  template <class Base, float_storage T>
  adapter_writer& add(const std::string& path, const lora::lora_linear<Base, T>& layer) {
    const std::string op = "peft::adapter_writer::add('" + path + "')";
    const double configured = config_.scale_for(path);
    require(std::fabs(configured - layer.scale()) <= 1e-6 * std::fabs(configured),
            op + ": the layer's scale is " + format_float(layer.scale()) + " but the config gives this module " +
                format_float(static_cast<float>(configured)) + " (lora_alpha " + detail::alpha_text(config_.alpha_for(path)) +
                ", rank " + std::to_string(config_.rank_for(path)) + (config_.use_rslora ? ", rsLoRA)" : ")"));
    const tensor_view<const T> bias = layer.options().train_bias ? tensor_view<const T>(layer.bias()) : tensor_view<const T>::none();
    return add<T>(path, layer.lora_A(), layer.lora_B(), bias);
  }

  // Writes adapter_model.safetensors and adapter_config.json into `directory` (created if needed), each
  // through a temporary file renamed into place.
  void write(const std::string& directory) const {
    require(!pending_.empty(), "peft::adapter_writer::write: no modules were added");
    std::error_code ec;
    std::filesystem::create_directories(directory, ec);
    require(!ec, "peft::adapter_writer::write: cannot create '" + directory + "': " + ec.message());
    safetensors::writer out;
    out.add_metadata("format", "pt");  // what PEFT's save_pretrained writes
    std::vector<const pending*> order;
    for (const pending& p : pending_) order.push_back(&p);
    std::sort(order.begin(), order.end(), [](const pending* a, const pending* b) { return detail::natural_less(a->path, b->path); });
    for (const pending* p : order)
      for (const tensor& t : p->tensors)
        out.add_bytes(std::string(key_prefix) + p->path + t.suffix, t.dtype, t.dims, t.bytes.data(), t.bytes.size());
    detail::write_via_temporary(directory + "/" + weights_file_name, [&](const std::string& temporary) { out.write(temporary); });
    write_lora_config(directory + "/" + config_file_name, config_);
  }

 private:
  struct tensor {
    std::string suffix, dtype;
    std::vector<std::int64_t> dims;
    std::vector<std::byte> bytes;
  };
  struct pending {
    std::string path;
    std::vector<tensor> tensors;
  };

  template <float_storage T>
  static tensor take(const std::string& op, const char* suffix, tensor_view<const T> values) {
    require(values.data() != nullptr, op + ": " + (suffix + 1) + " is null");
    tensor t{suffix, dtype_name<T>(), {}, std::vector<std::byte>(values.bytes())};
    for (int i = 0; i < values.shape().rank; ++i) t.dims.push_back(values.shape()[i]);
    detail::copy_from(t.bytes.data(), values.data(), values.where(), values.bytes());
    for (std::int64_t i = 0; i < values.size(); ++i) {
      T v;
      std::memcpy(&v, t.bytes.data() + static_cast<std::size_t>(i) * sizeof(T), sizeof(T));
      if (!memkit::detail::is_finite(to_float(v)))
        throw error(op + ": " + (suffix + 1) + " holds " + format_float(to_float(v)) + " at element " + std::to_string(i));
    }
    return t;
  }

  lora_config config_;
  std::vector<pending> pending_;
  std::unordered_set<std::string> added_;  // the paths in pending_ (a linear check per add was quadratic)
};

// --- lora_linear layers by module path ---

// A config for adapters made like `layer` on the modules `target_modules` selects: r, lora_alpha, lora_dropout,
// use_rslora, and bias "lora_only" when the layer's bias trains ("none" otherwise).
template <class Base, float_storage T>
lora_config config_for(const lora::lora_linear<Base, T>& layer, module_selector target_modules) {
  lora_config c;
  c.r = layer.rank();
  c.lora_alpha = layer.options().alpha;
  c.lora_dropout = static_cast<double>(layer.options().dropout);
  c.use_rslora = layer.options().use_rslora;
  c.bias = layer.options().train_bias ? "lora_only" : "none";
  c.target_modules = std::move(target_modules);
  return c;
}

// The lora_options that rebuild module `path` of `file` as PEFT runs it: rank, alpha, rsLoRA, dropout, and
// train_bias when the file trains its bias; the other fields from `base`.
inline lora::lora_options layer_options(const adapter_file& file, std::string_view path, lora::lora_options base = {}) {
  const lora_module& m = file.module(path);
  require(m.rank > 0, "peft: module '" + std::string(path) + "' has only a bias in the file, no LoRA weights");
  base.rank = m.rank;
  base.alpha = m.alpha;
  base.use_rslora = file.config().use_rslora;
  base.dropout = static_cast<float>(file.config().lora_dropout);
  base.train_bias = m.has_bias;
  return base;
}

// A layer and the module path it stands for.
template <class Layer>
struct layer_at {
  std::string path;
  Layer* layer = nullptr;
};

// Loads the listed layers' A, B (and bias, when the file has one: the layer must have a bias view) from
// `file`, all or nothing: every layer is checked against its module (rank, scale, bias) and the file's
// tensors against the layers' shapes before any layer is written.
template <class Base, float_storage T>
void load_layers(const adapter_file& file, std::span<const layer_at<lora::lora_linear<Base, T>>> layers,
                 const load_options& options = {}) {
  std::vector<lora_tensors<T>> destinations;
  for (const auto& [path, layer] : layers) {
    require(layer != nullptr, "peft::load_layers: the layer for '" + path + "' is null");
    const lora_module& m = file.module(path);
    const std::string op = "peft::load_layers('" + path + "')";
    require(m.rank == layer->rank(), op + ": the file's adapter has rank " + std::to_string(m.rank) +
                                         " but the layer has rank " + std::to_string(layer->rank()));
    require(std::fabs(m.scale - layer->scale()) <= 1e-6 * std::fabs(m.scale),
            op + ": the file's scale is " + format_float(static_cast<float>(m.scale)) + " (lora_alpha " +
                detail::alpha_text(m.alpha) + (file.config().use_rslora ? ", rsLoRA" : "") + ") but the layer's is " +
                format_float(layer->scale()) + "; build the layer with peft::layer_options(file, path)");
    require(!m.has_bias || layer->has_bias(),
            op + ": the file trains this module's bias ('" + m.bias_key() + "') but the layer has no bias view");
    destinations.push_back({path, layer->lora_A(), layer->lora_B(), m.has_bias ? layer->bias() : tensor_view<T>::none()});
  }
  file.load(std::span<const lora_tensors<T>>(destinations), options);
}
template <class Base, float_storage T>
void load_layers(const adapter_file& file, const std::vector<layer_at<lora::lora_linear<Base, T>>>& layers,
                 const load_options& options = {}) {
  load_layers(file, std::span<const layer_at<lora::lora_linear<Base, T>>>(layers), options);
}

// Writes the listed layers as a PEFT adapter directory with `config` (see adapter_writer::add for the checks).
template <class Base, float_storage T>
void save_layers(const std::string& directory, const lora_config& config,
                 const std::vector<layer_at<const lora::lora_linear<Base, T>>>& layers) {
  adapter_writer writer(config);
  for (const auto& [path, layer] : layers) {
    require(layer != nullptr, "peft::save_layers: the layer for '" + path + "' is null");
    writer.add(path, *layer);
  }
  writer.write(directory);
}

}  // namespace peft

MEMKIT_NAMESPACE_END
