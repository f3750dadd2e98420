// memkit/peft/config.hpp — adapter_config.json of a PEFT LoRA adapter: lora_config, which modules it selects
// (target_modules, exclude_modules, layers_to_transform / layers_pattern) and each module's rank and alpha
// (r / rank_pattern, lora_alpha / alpha_pattern), read and written exactly as PEFT does.
//
// A PEFT LoRA adapter is a directory with two files (peft/peft.hpp includes everything):
//   adapter_config.json         the LoraConfig: r, lora_alpha, target_modules, lora_dropout, use_rslora, bias,
//                               rank_pattern, alpha_pattern, base_model_name_or_path, task_type, peft_type, ...
//                               (this header)
//   adapter_model.safetensors   the lora_A / lora_B weights per adapted module (peft/adapter_file.hpp reads
//                               the directory, peft/writer.hpp writes it, peft/layers.hpp binds it to
//                               lora::lora_linear layers)
// Reading refuses a config memkit cannot honour (DoRA, LoRA biases, modules_to_save, ...) with the field at
// fault, never silently dropping it. Fields of the config memkit does not interpret are kept verbatim and
// written back, so an adapter loaded, trained and saved again keeps them. The patterns of target_modules,
// rank_pattern and alpha_pattern are matched by peft::module_pattern (peft/module_pattern.hpp), without
// backtracking.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/io/files.hpp"
#include "memkit/io/json.hpp"
#include "memkit/peft/module_pattern.hpp"

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
  std::int64_t layer_index(std::string_view path) const;
};

// Parses adapter_config.json text; `what` names it in errors. Rejects a config memkit cannot honour.
inline lora_config parse_lora_config(std::string_view text, std::string_view what = config_file_name);
// Reads and parses the adapter_config.json at `path`.
inline lora_config read_lora_config(const std::string& path);

// adapter_config.json text as PEFT writes it: json.dumps(indent=2, sort_keys=True).
inline std::string to_json(const lora_config& c);
// Writes to_json(config) to `path` through a temporary file renamed into place.
inline void write_lora_config(const std::string& path, const lora_config& config);

// ---- implementation ----

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

inline std::int64_t lora_config::layer_index(std::string_view path) const {
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

inline lora_config parse_lora_config(std::string_view text, std::string_view what) {
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
  return parse_lora_config(io::read_text_file(path, "peft::read_lora_config"), path);
}

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
  io::write_via_temporary(path, "peft", [&](const std::string& temporary) {
    std::ofstream out(temporary, std::ios::binary);
    out << text;
    out.close();
    require(static_cast<bool>(out), "peft::write_lora_config: writing '" + temporary + "' failed");
  });
}

}  // namespace peft

MEMKIT_NAMESPACE_END
