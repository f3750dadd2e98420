// memkit/optim/bnb_adam_state.hpp — bitsandbytes' AdamW8bit optimizer state into and out of adam_state.
//
// bitsandbytes keeps, per parameter, blockwise 8-bit moments with block 256 — state1 (m) as uint8 codes of
// the signed dynamic map qmap1, state2 (v) as codes of the unsigned map qmap2, one fp32 absmax per block
// in absmax1/absmax2 — and fp32 state1/state2 for parameters below min_8bit_size (4096). That is
// adam_state<std::int8_t, 256> with min_quantized_size 4096, code for code: memkit's maps are
// bitsandbytes' maps (checked on every import, up to torch's rounding: see bnb_map_tolerance), so a state
// moves across without requantization.
// tools/bnb_optimizer_state.py converts a torch optimizer state_dict into this safetensors layout and back:
//
//   state.<i>.step      I64 []           steps taken (bitsandbytes counts per parameter; memkit needs one count)
//   state.<i>.state1    U8 | F32 [shape]  the parameter's shape; U8 codes, or F32 values for 32-bit state
//   state.<i>.state2    U8 | F32 [shape]
//   state.<i>.absmax1   F32 [blocks]      8-bit only
//   state.<i>.absmax2   F32 [blocks]
//   state.<i>.qmap1     F32 [256]         8-bit only
//   state.<i>.qmap2     F32 [256]
//   __metadata__        format "memkit.bnb_optimizer_state", version "1", block_size "256",
//                       param_groups (JSON: lr, betas, eps, weight_decay, params, ...), param_names (optional)
//
// Parameter i of the file is tensor i of the adam_state (the order of the optimizer's param_groups).
// adam_state<float> takes a file whose states are all 32-bit (bitsandbytes' Adam/AdamW with optim_bits 32).
// Loading checks everything before the state changes; every error names the key and both values.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/units.hpp"
#include "memkit/io/files.hpp"
#include "memkit/io/json.hpp"
#include "memkit/io/safetensors.hpp"
#include "memkit/optim/adam_state.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace optim {

inline constexpr const char* bnb_optimizer_state_format = "memkit.bnb_optimizer_state";
inline constexpr const char* bnb_optimizer_state_version = "1";
inline constexpr std::int64_t bnb_optimizer_block_size = 256;  // bitsandbytes' blockwise optimizers, fixed
// How far a file's qmap entry may be from memkit's and still count as the same map. bitsandbytes builds
// its maps with torch.linspace, whose vectorized path rounds some entries differently on some CPUs (42
// signed and 31 unsigned entries 1-2 ulps off memkit's on an AVX-512 EPYC); the codes then mean values
// that differ by that much, far below the 8-bit quantization step, and are taken over unchanged.
inline constexpr float bnb_map_tolerance = 1e-6f;

// What a file says besides the moments: the groups' hyperparameters, which group each tensor is in,
// names, shapes and the step. Export takes it back (edit groups to hand back a changed learning rate).
struct bnb_adam_state_info {
  std::vector<adam_group> groups;                   // lr, betas, eps, weight_decay of each param_group
  std::vector<int> group_of_tensor;                 // the group of each tensor
  std::vector<std::string> names;                   // param_names, or empty
  std::vector<std::vector<std::int64_t>> shapes;    // each parameter's shape (state1's); empty: 1-D on export
  std::int64_t step = 0;
  std::string param_groups_json;                    // the file's param_groups verbatim: other fields survive export
};

namespace detail {

template <class State, int Block>
constexpr bool bnb_compatible() noexcept {
  return (std::is_same_v<State, std::int8_t> && Block == bnb_optimizer_block_size) || std::is_same_v<State, float>;
}

// The shortest decimal that reads back as the same float, in Python's float spelling ("0.002", "1e-08").
inline std::string float_text(float v) {
  char text[48];
  for (int digits = 1; digits <= 9; ++digits) {
    std::snprintf(text, sizeof text, "%.*g", digits, static_cast<double>(v));
    if (std::strtof(text, nullptr) == v) break;
  }
  std::string out = text;
  if (out.find_first_of(".eEn") == std::string::npos) out += ".0";
  return out;
}

// json.dumps' default (compact, ", " and ": ") spelling of a value, members in their order.
inline void dump_compact(const json::value& v, std::string& out) {
  switch (v.type()) {
    case json::value::kind::null: out += "null"; return;
    case json::value::kind::boolean: out += v.as_bool() ? "true" : "false"; return;
    case json::value::kind::number: out += v.number_text(); return;
    case json::value::kind::string: out += json::quote(v.as_string()); return;
    case json::value::kind::array:
      out += '[';
      for (std::size_t i = 0; i < v.as_array().size(); ++i) {
        if (i) out += ", ";
        dump_compact(v.as_array()[i], out);
      }
      out += ']';
      return;
    case json::value::kind::object:
      out += '{';
      for (std::size_t i = 0; i < v.as_object().size(); ++i) {
        if (i) out += ", ";
        out += json::quote(v.as_object()[i].first) + ": ";
        dump_compact(v.as_object()[i].second, out);
      }
      out += '}';
      return;
  }
}

// A float field: the original text when it denotes the same float (so 0.002 stays "0.002"), else the shortest.
inline json::value float_field(float value, const json::value* original) {
  if (original != nullptr && original->is_number() && static_cast<float>(original->as_double()) == value) return *original;
  return json::value::make_number(float_text(value));
}

template <class T>
std::vector<T> read_exactly(const safetensors::reader& in, const std::string& key, const char* dtype, std::int64_t numel,
                            const std::string& where, const std::string& expectation) {
  const safetensors::tensor_info* t = in.find(key);
  require(t != nullptr, where + ": missing key '" + key + "'");
  require(t->dtype == dtype, where + ": '" + key + "' is " + t->dtype + ", expected " + dtype);
  require(t->numel() == numel, where + ": '" + key + "' has " + std::to_string(t->numel()) + " elements, expected " +
                                   std::to_string(numel) + " (" + expectation + ")");
  return in.read_vector<T>(key);
}

inline std::string dims_text(const std::vector<std::int64_t>& dims) {
  std::string text = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) {
    text += i ? ", " : "";  // two appends, not "," + to_string(...): GCC 12 at -O3 warns (-Wrestrict) on that
    text += std::to_string(dims[i]);
  }
  return text + "]";
}

}  // namespace detail

// Reads a file of the layout above into `state` (all or nothing) and returns what else it says.
template <executor E, class State, int Block>
bnb_adam_state_info load_bnb_adam_state(const E& exec, adam_state<State, Block>& state, const std::string& path) {
  static_assert(detail::bnb_compatible<State, Block>(),
                "bitsandbytes' AdamW8bit layout is adam_state<std::int8_t, 256> (or adam_state<float> for 32-bit state)");
  using state_type = adam_state<State, Block>;
  using plain = typename state_type::plain_moment_type;
  const safetensors::reader in(path);
  const std::string where = "load_bnb_adam_state: '" + path + "'";
  auto meta = [&](const char* key) -> const std::string* {
    for (const auto& [k, v] : in.metadata())
      if (k == key) return &v;
    return nullptr;
  };
  const std::string* format = meta("format");
  require(format != nullptr && *format == bnb_optimizer_state_format,
          where + ": metadata format is " + (format ? "\"" + *format + "\"" : std::string("missing")) + ", expected \"" +
              bnb_optimizer_state_format + "\" (convert a torch state_dict with tools/bnb_optimizer_state.py)");
  const std::string* version = meta("version");
  require(version != nullptr && *version == bnb_optimizer_state_version,
          where + ": metadata version is " + (version ? "\"" + *version + "\"" : std::string("missing")) +
              ", this build reads \"" + bnb_optimizer_state_version + "\"");
  const std::string* block = meta("block_size");
  require(block != nullptr && *block == std::to_string(bnb_optimizer_block_size),
          where + ": metadata block_size is " + (block ? "\"" + *block + "\"" : std::string("missing")) +
              "; bitsandbytes' blockwise optimizers use 256");
  const std::string* groups_text = meta("param_groups");
  require(groups_text != nullptr, where + ": metadata lacks param_groups");

  bnb_adam_state_info info;
  info.param_groups_json = *groups_text;
  const std::size_t count = state.tensor_count();
  info.group_of_tensor.assign(count, -1);
  try {
    const json::value groups = json::parse(*groups_text, "param_groups");
    require(groups.is_array() && !groups.as_array().empty(), "param_groups must be a non-empty list");
    std::size_t seen = 0;
    for (std::size_t g = 0; g < groups.as_array().size(); ++g) {
      const json::value& group = groups.as_array()[g];
      const std::string which = "param_groups[" + std::to_string(g) + "]";
      require(group.is_object(), which + " is not an object");
      // A number's conversion errors ("outside the range of a double", "not an integer") name the field.
      auto as_double = [&](const json::value& v, const std::string& field) {
        require(v.is_number(), which + "." + field + " is " + json::value::kind_name(v.type()) + ", not a number");
        try {
          return v.as_double();
        } catch (const error& e) {
          throw error(which + "." + field + ": " + e.what());
        }
      };
      auto number = [&](const char* field) {
        const json::value* v = group.find(field);
        require(v != nullptr, which + "." + field + " is missing");
        return static_cast<float>(as_double(*v, field));
      };
      adam_group hyper;
      hyper.lr = number("lr");
      hyper.eps = number("eps");
      hyper.weight_decay = number("weight_decay");
      const json::value* betas = group.find("betas");
      require(betas != nullptr && betas->is_array() && betas->as_array().size() == 2,
              which + ".betas must be a list of two numbers" +
                  (betas && betas->is_array() && betas->as_array().size() == 3 ? " (three betas: AdEMAMix, not AdamW)" : ""));
      hyper.beta1 = static_cast<float>(as_double(betas->as_array()[0], "betas[0]"));
      hyper.beta2 = static_cast<float>(as_double(betas->as_array()[1], "betas[1]"));
      if (const json::value* alpha = group.find("alpha"); alpha != nullptr && !alpha->is_null())
        require(as_double(*alpha, "alpha") == 0.0, which + ".alpha is " + alpha->number_text() + " (AdEMAMix), not AdamW's 0");
      validate(hyper, which);
      const json::value* params = group.find("params");
      require(params != nullptr && params->is_array(), which + ".params must be a list of parameter indices");
      for (std::size_t k = 0; k < params->as_array().size(); ++k) {
        const json::value& p = params->as_array()[k];
        const std::string field = which + ".params[" + std::to_string(k) + "]";
        require(p.is_number(), field + " is " + json::value::kind_name(p.type()) + "; params lists parameter indices");
        std::int64_t index = 0;
        try {
          index = p.as_int();
        } catch (const error& e) {
          throw error(field + ": " + e.what());
        }
        require(index >= 0 && static_cast<std::size_t>(index) < count,
                which + " lists parameter " + std::to_string(index) + ", but the adam_state has " + std::to_string(count) +
                    " tensors");
        require(info.group_of_tensor[static_cast<std::size_t>(index)] < 0,
                which + " lists parameter " + std::to_string(index) + " a second time");
        info.group_of_tensor[static_cast<std::size_t>(index)] = static_cast<int>(g);
        ++seen;
      }
      info.groups.push_back(hyper);
    }
    require(seen == count, "param_groups list " + std::to_string(seen) + " parameters, the adam_state has " +
                               std::to_string(count) + " tensors");
    if (const std::string* names = meta("param_names")) {
      const json::value list = json::parse(*names, "param_names");
      require(list.is_array() && list.as_array().size() == count,
              "param_names must list " + std::to_string(count) + " names");
      for (std::size_t i = 0; i < list.as_array().size(); ++i) {
        require(list.as_array()[i].is_string(), "param_names[" + std::to_string(i) + "] is not a string");
        info.names.push_back(list.as_array()[i].as_string());
      }
    }
  } catch (const error& e) {
    throw error(where + ": " + e.what());
  }

  // Every key must be one of the layout's.
  for (const safetensors::tensor_info& t : in.tensors()) {
    const std::string& key = t.name;
    const std::size_t dot = key.find('.', 6);
    bool known = key.rfind("state.", 0) == 0 && dot != std::string::npos && dot > 6;
    if (known) {
      const std::string index = key.substr(6, dot - 6), field = key.substr(dot + 1);
      // A parameter index in its one spelling: digits, no leading zero ('state.01.step' would be skipped).
      known = index.find_first_not_of("0123456789") == std::string::npos && (index == "0" || index[0] != '0') &&
              (field == "step" || field == "state1" || field == "state2" || field == "absmax1" || field == "absmax2" ||
               field == "qmap1" || field == "qmap2");
      // At most 18 digits (never past 2^63, so stoull cannot throw): a longer index is out of range anyway.
      if (known)
        require(index.size() <= 18 && std::stoull(index) < count,
                where + ": key '" + key + "' names parameter " + index + ", but the adam_state has " +
                    std::to_string(count) + " tensors");
    }
    require(known, where + ": unexpected key '" + key + "' (AdamW's state is step, state1, state2, absmax1, absmax2, qmap1, "
                           "qmap2 per parameter; max_unorm or another optimizer?)");
  }

  struct staged {
    std::vector<std::uint8_t> m_codes, v_codes;
    std::vector<float> m_absmax, v_absmax;
    std::vector<plain> m, v;
  };
  std::vector<staged> tensors(count);
  for (std::size_t i = 0; i < count; ++i) {
    const std::string prefix = "state." + std::to_string(i) + ".";
    const std::int64_t size = state.size(i);
    const std::vector<std::int64_t> step =
        detail::read_exactly<std::int64_t>(in, prefix + "step", "I64", 1, where, "a scalar step count");
    if (i == 0) info.step = step[0];
    require(step[0] == info.step, where + ": '" + prefix + "step' is " + std::to_string(step[0]) + " but 'state.0.step' is " +
                                      std::to_string(info.step) + "; memkit keeps one step count for all tensors");
    validate_step_count(step[0], where + ": '" + prefix + "step': ");
    const safetensors::tensor_info* s1 = in.find(prefix + "state1");
    require(s1 != nullptr, where + ": missing key '" + prefix + "state1' (a parameter without state never took a step; "
                                                                 "memkit's state needs every tensor)");
    info.shapes.push_back(s1->shape);
    require(s1->numel() == size, where + ": '" + s1->name + "' has " + std::to_string(s1->numel()) + " elements (shape " +
                                     detail::dims_text(s1->shape) + "), tensor " + std::to_string(i) +
                                     " of the adam_state has " + std::to_string(size));
    const bool eight_bit = s1->dtype == "U8";
    require(eight_bit || s1->dtype == "F32", where + ": '" + s1->name + "' is " + s1->dtype + ", expected U8 (8-bit state) or F32 (32-bit)");
    const std::int64_t threshold = state.options().min_quantized_size;
    if (eight_bit != state.is_quantized(i))
      throw error(where + ": '" + s1->name + "' is " + s1->dtype + " (" + (eight_bit ? "8-bit" : "32-bit") +
                  " state), but this adam_state keeps " + (state.is_quantized(i) ? "8-bit" : "fp32") + " moments for tensor " +
                  std::to_string(i) + " (" + std::to_string(size) + " elements, min_quantized_size " +
                  std::to_string(threshold) + "; bitsandbytes' min_8bit_size must equal it)");
    const safetensors::tensor_info* s2 = in.find(prefix + "state2");
    require(s2 != nullptr, where + ": missing key '" + prefix + "state2'");
    require(s2->dtype == s1->dtype && s2->shape == s1->shape,
            where + ": '" + s2->name + "' is " + s2->dtype + " " + detail::dims_text(s2->shape) + " but '" + s1->name + "' is " +
                s1->dtype + " " + detail::dims_text(s1->shape));
    staged& t = tensors[i];
    if (!eight_bit) {
      for (const char* field : {"absmax1", "absmax2", "qmap1", "qmap2"})
        require(in.find(prefix + field) == nullptr, where + ": '" + prefix + field + "' belongs to 8-bit state, but '" +
                                                        s1->name + "' is F32");
      const std::vector<float> m = in.read_vector<float>(prefix + "state1"), v = in.read_vector<float>(prefix + "state2");
      validate_moments(adam_moment_kind::first, size, [&](std::int64_t e) { return m[static_cast<std::size_t>(e)]; },
                       [&](std::int64_t e) { return where + ": '" + prefix + "state1' element " + std::to_string(e); });
      validate_moments(adam_moment_kind::second, size, [&](std::int64_t e) { return v[static_cast<std::size_t>(e)]; },
                       [&](std::int64_t e) { return where + ": '" + prefix + "state2' element " + std::to_string(e); });
      t.m.assign(m.begin(), m.end());
      t.v.assign(v.begin(), v.end());
      continue;
    }
    if constexpr (state_type::quantized) {
      const std::int64_t blocks = (size + bnb_optimizer_block_size - 1) / bnb_optimizer_block_size;
      const std::string per_block = "one per block of 256 of " + std::to_string(size) + " elements";
      t.m_absmax = detail::read_exactly<float>(in, prefix + "absmax1", "F32", blocks, where, per_block);
      t.v_absmax = detail::read_exactly<float>(in, prefix + "absmax2", "F32", blocks, where, per_block);
      for (const char* field : {"qmap1", "qmap2"}) {
        const bool first = field[4] == '1';
        const std::vector<float> map = detail::read_exactly<float>(in, prefix + field, "F32", 256, where, "a 256-entry map");
        const std::span<const float> mine = first ? state_type::m_map() : state_type::v_map();
        for (std::size_t c = 0; c < 256; ++c)
          if (!(std::fabs(map[c] - mine[c]) <= bnb_map_tolerance * std::fabs(mine[c])))
            throw error(where + ": '" + prefix + field + "' entry " + std::to_string(c) + " is " + format_float(map[c], 9) +
                        ", memkit's " + (first ? "signed" : "unsigned") + " dynamic map has " + format_float(mine[c], 9) +
                        " (more than a rounding apart: a custom map cannot be taken over code for code)");
      }
      for (const std::vector<float>* absmax : {&t.m_absmax, &t.v_absmax})
        validate_moments(adam_moment_kind::block_scale, blocks,
                         [&](std::int64_t b) { return (*absmax)[static_cast<std::size_t>(b)]; }, [&](std::int64_t b) {
                           return where + ": '" + prefix + (absmax == &t.m_absmax ? "absmax1" : "absmax2") + "' block " +
                                  std::to_string(b);
                         });
      t.m_codes = in.read_vector<std::uint8_t>(prefix + "state1");
      t.v_codes = in.read_vector<std::uint8_t>(prefix + "state2");
    }
  }
  std::vector<adam_tensor_state<plain>> sources(count);
  for (std::size_t i = 0; i < count; ++i) {
    staged& t = tensors[i];
    adam_tensor_state<plain>& s = sources[i];
    s.quantized = state.is_quantized(i);
    auto view = [](const auto& values) {
      using T = std::remove_cvref_t<decltype(values[0])>;
      return tensor_view<const T>(values.data(), shape{static_cast<std::int64_t>(values.size())}, memory_kind::host);
    };
    if (s.quantized) {
      s.m_codes = view(t.m_codes);
      s.v_codes = view(t.v_codes);
      s.m_absmax = view(t.m_absmax);
      s.v_absmax = view(t.v_absmax);
    } else {
      s.m = view(t.m);
      s.v = view(t.v);
    }
  }
  state.assign(exec, sources, info.step);
  return info;
}

namespace detail {
// Host copies of a state's views (a device state is read back through the executor's stream).
template <executor E, class T>
std::vector<T> host_copy([[maybe_unused]] const E& exec, tensor_view<const T> view) {
  std::vector<T> out(static_cast<std::size_t>(view.size()));
  if (view.where() != memory_kind::device) {
    std::memcpy(out.data(), view.data(), view.bytes());
    return out;
  }
#if MEMKIT_HAS_CUDA
  if constexpr (E::on_device) exec.synchronize();
  MEMKIT_CUDA_CHECK(cudaMemcpy(out.data(), view.data(), view.bytes(), cudaMemcpyDeviceToHost));
#else
  throw error("save_bnb_adam_state: the state is in device memory, but this translation unit is built without CUDA");
#endif
  return out;
}
}  // namespace detail

// Writes `state` in the layout above. `info` gives the groups (hyperparameters), the group of each
// tensor, and optionally names, shapes (each tensor's parameter shape, which bitsandbytes' CPU update
// needs; 1-D when empty) and the original param_groups JSON, whose other fields are kept.
template <executor E, class State, int Block>
void save_bnb_adam_state(const E& exec, const adam_state<State, Block>& state, const std::string& path,
                     const bnb_adam_state_info& info) {
  static_assert(detail::bnb_compatible<State, Block>(),
                "bitsandbytes' AdamW8bit layout is adam_state<std::int8_t, 256> (or adam_state<float> for 32-bit state)");
  using state_type = adam_state<State, Block>;
  const std::string op = "save_bnb_adam_state('" + path + "')";
  const std::size_t count = state.tensor_count();
  require(info.group_of_tensor.size() == count, op + ": group_of_tensor has " + std::to_string(info.group_of_tensor.size()) +
                                                    " entries, the state has " + std::to_string(count) + " tensors");
  require(!info.groups.empty(), op + ": no parameter groups");
  for (std::size_t i = 0; i < count; ++i)
    require(info.group_of_tensor[i] >= 0 && static_cast<std::size_t>(info.group_of_tensor[i]) < info.groups.size(),
            op + ": tensor " + std::to_string(i) + " is in group " + std::to_string(info.group_of_tensor[i]) + " of " +
                std::to_string(info.groups.size()));
  require(info.names.empty() || info.names.size() == count, op + ": " + std::to_string(info.names.size()) + " names for " +
                                                                std::to_string(count) + " tensors");
  require(info.shapes.empty() || info.shapes.size() == count, op + ": " + std::to_string(info.shapes.size()) +
                                                                  " shapes for " + std::to_string(count) + " tensors");

  // param_groups: the original groups' fields, with memkit's hyperparameters and membership.
  std::vector<json::value> originals;
  if (!info.param_groups_json.empty()) {
    const json::value parsed = json::parse(info.param_groups_json, "param_groups");
    if (parsed.is_array() && parsed.as_array().size() == info.groups.size()) originals = parsed.as_array();
  }
  std::vector<json::value> groups;
  for (std::size_t g = 0; g < info.groups.size(); ++g) {
    const adam_group& hyper = info.groups[g];
    validate(hyper, op + ": group " + std::to_string(g));
    const json::value* original = g < originals.size() && originals[g].is_object() ? &originals[g] : nullptr;
    auto old = [&](const char* field) { return original ? original->find(field) : nullptr; };
    const json::value* old_betas = old("betas");
    const bool betas_kept = old_betas && old_betas->is_array() && old_betas->as_array().size() == 2;
    std::vector<json::value> params;
    for (std::size_t i = 0; i < count; ++i)
      if (static_cast<std::size_t>(info.group_of_tensor[i]) == g) params.push_back(json::value::make_number(std::to_string(i)));
    std::vector<std::pair<std::string, json::value>> members = {
        {"lr", detail::float_field(hyper.lr, old("lr"))},
        {"betas", json::value::make_array({detail::float_field(hyper.beta1, betas_kept ? &old_betas->as_array()[0] : nullptr),
                                           detail::float_field(hyper.beta2, betas_kept ? &old_betas->as_array()[1] : nullptr)})},
        {"eps", detail::float_field(hyper.eps, old("eps"))},
        {"weight_decay", detail::float_field(hyper.weight_decay, old("weight_decay"))}};
    if (original)
      for (const auto& [field, value] : original->as_object())
        if (field != "lr" && field != "betas" && field != "eps" && field != "weight_decay" && field != "params")
          members.emplace_back(field, value);
    members.emplace_back("params", json::value::make_array(std::move(params)));
    groups.push_back(json::value::make_object(std::move(members)));
  }

  safetensors::writer out;
  out.add_metadata("format", bnb_optimizer_state_format);
  out.add_metadata("version", bnb_optimizer_state_version);
  out.add_metadata("block_size", std::to_string(bnb_optimizer_block_size));
  std::string groups_text;
  detail::dump_compact(json::value::make_array(std::move(groups)), groups_text);
  out.add_metadata("param_groups", groups_text);
  if (!info.names.empty()) {
    std::vector<json::value> names;
    for (const std::string& n : info.names) names.push_back(json::value::make_string(n));
    std::string names_text;
    detail::dump_compact(json::value::make_array(std::move(names)), names_text);
    out.add_metadata("param_names", names_text);
  }
  const std::int64_t step = state.control(exec).step;
  for (std::size_t i = 0; i < count; ++i) {
    const std::string prefix = "state." + std::to_string(i) + ".";
    std::vector<std::int64_t> dims = info.shapes.empty() ? std::vector<std::int64_t>{state.size(i)} : info.shapes[i];
    std::int64_t numel = 1;
    for (std::int64_t d : dims) numel *= d;
    require(numel == state.size(i), op + ": shape " + detail::dims_text(dims) + " of tensor " + std::to_string(i) + " has " +
                                        std::to_string(numel) + " elements, the state " + std::to_string(state.size(i)));
    out.add_bytes(prefix + "step", "I64", {}, &step, sizeof step);
    const auto s = state.tensor_state(i);
    if (!s.quantized) {
      const std::vector<float> m = detail::host_copy(exec, s.m), v = detail::host_copy(exec, s.v);
      out.add(prefix + "state1", host_view(m.data(), shape{state.size(i)}), dims);
      out.add(prefix + "state2", host_view(v.data(), shape{state.size(i)}), dims);
      continue;
    }
    if constexpr (state_type::quantized) {
      const std::vector<std::uint8_t> m = detail::host_copy(exec, s.m_codes), v = detail::host_copy(exec, s.v_codes);
      const std::vector<float> m_absmax = detail::host_copy(exec, s.m_absmax), v_absmax = detail::host_copy(exec, s.v_absmax);
      out.add(prefix + "state1", host_view(m.data(), shape{state.size(i)}), dims);
      out.add(prefix + "state2", host_view(v.data(), shape{state.size(i)}), dims);
      out.add(prefix + "absmax1", host_view(m_absmax.data(), shape{static_cast<std::int64_t>(m_absmax.size())}));
      out.add(prefix + "absmax2", host_view(v_absmax.data(), shape{static_cast<std::int64_t>(v_absmax.size())}));
      out.add(prefix + "qmap1", tensor_view<const float>(state_type::m_map().data(), shape{256}, memory_kind::host));
      out.add(prefix + "qmap2", tensor_view<const float>(state_type::v_map().data(), shape{256}, memory_kind::host));
    }
  }
  io::write_via_temporary(path, op, [&](const std::string& temporary) { out.write(temporary); });
}

}  // namespace optim

MEMKIT_NAMESPACE_END
