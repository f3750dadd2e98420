// memkit/peft/adapter_file.hpp — reading a PEFT LoRA adapter directory: adapter_file opens and checks it,
// load() fills named tensor views with its modules' weights.
//
// A PEFT LoRA adapter is a directory with two files:
//   adapter_config.json         the LoraConfig (peft/config.hpp: lora_config)
//   adapter_model.safetensors   per adapted module M (its path in the base model, e.g.
//                               "model.layers.0.self_attn.q_proj"):
//                                 base_model.model.M.lora_A.weight     [r, in]
//                                 base_model.model.M.lora_B.weight     [out, r]
//                                 base_model.model.M.base_layer.bias   [out]   when the bias trains
//                               and, with bias "all", base_model.model.N.bias of modules N without LoRA.
// The API works on named tensor views and the config struct; no model object is involved (peft/layers.hpp
// binds modules to lora::lora_linear layers). Opening checks the config against the file (every module
// targeted, every rank and shape as the config says, biases as its `bias` says) before any tensor is read,
// and load() fills its destinations all or nothing. Features memkit's LoRA layer cannot represent (DoRA,
// LoRA biases, embedding adapters, modules_to_save, ...) are refused with the key at fault, never silently
// dropped.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/rounded_math.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/core/units.hpp"
#include "memkit/io/files.hpp"
#include "memkit/io/safetensors.hpp"
#include "memkit/peft/config.hpp"
#include "memkit/peft/detail/adapter_bytes.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace peft {

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
  // The module at `path`, or null; module(path) throws naming the modules the file has.
  const lora_module* find(std::string_view path) const noexcept { return by_path_.find(modules_, path); }
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
  void load(std::span<const lora_tensors<T>> destinations, const load_options& options = {}) const;
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
    if (!io::path_exists(path) && io::path_exists(directory + "/adapter_model.bin"))
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
  void index_modules();

  lora_config config_;
  safetensors::reader weights_;
  std::vector<lora_module> modules_;
  io::name_index<lora_module, &lora_module::path> by_path_;  // for find()
};

// ---- implementation ----

template <float_storage T>
void adapter_file::load(std::span<const lora_tensors<T>> destinations, const load_options& options) const {
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

inline void adapter_file::index_modules() {
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
  by_path_.build(modules_);
}

}  // namespace peft

MEMKIT_NAMESPACE_END
