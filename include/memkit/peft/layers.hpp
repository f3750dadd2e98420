// memkit/peft/layers.hpp — PEFT adapters bound to lora::lora_linear layers by module path: the config for
// adapters made like a layer (config_for), the lora_options that rebuild a module as PEFT runs it
// (layer_options), and loading and saving a list of layers (layer_at, load_layers, save_layers), each
// checked against the file's or config's rank, scale and bias.
#pragma once

#include <cmath>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/core/units.hpp"
#include "memkit/lora/lora_linear.hpp"
#include "memkit/peft/adapter_file.hpp"
#include "memkit/peft/config.hpp"
#include "memkit/peft/writer.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace peft {

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
