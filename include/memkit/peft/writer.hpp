// memkit/peft/writer.hpp — writing a PEFT LoRA adapter directory: adapter_writer collects modules (tensor
// views, lora_tensors or lora::lora_linear layers), checks each against the lora_config, and writes
// adapter_model.safetensors and adapter_config.json exactly as PEFT's save_pretrained does, so that
// PeftModel.from_pretrained loads them. peft/adapter_file.hpp reads them back.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/rounded_math.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/core/units.hpp"
#include "memkit/io/files.hpp"
#include "memkit/io/safetensors.hpp"
#include "memkit/lora/lora_linear.hpp"
#include "memkit/peft/adapter_file.hpp"
#include "memkit/peft/config.hpp"
#include "memkit/peft/detail/adapter_bytes.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace peft {

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
                      tensor_view<const T> bias = {});
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
  void write(const std::string& directory) const;

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

// ---- implementation ----

template <float_storage T>
adapter_writer& adapter_writer::add(const std::string& path, tensor_view<const T> A, tensor_view<const T> B,
                                    tensor_view<const T> bias) {
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

inline void adapter_writer::write(const std::string& directory) const {
  require(!pending_.empty(), "peft::adapter_writer::write: no modules were added");
  const std::string failed = io::create_directories(directory);
  require(failed.empty(), "peft::adapter_writer::write: cannot create '" + directory + "': " + failed);
  safetensors::writer out;
  out.add_metadata("format", "pt");  // what PEFT's save_pretrained writes
  std::vector<const pending*> order;
  for (const pending& p : pending_) order.push_back(&p);
  std::sort(order.begin(), order.end(), [](const pending* a, const pending* b) { return detail::natural_less(a->path, b->path); });
  for (const pending* p : order)
    for (const tensor& t : p->tensors)
      out.add_bytes(std::string(key_prefix) + p->path + t.suffix, t.dtype, t.dims, t.bytes.data(), t.bytes.size());
  io::write_via_temporary(directory + "/" + weights_file_name, "peft",
                          [&](const std::string& temporary) { out.write(temporary); });
  write_lora_config(directory + "/" + config_file_name, config_);
}

}  // namespace peft

MEMKIT_NAMESPACE_END
