// memkit/models/llama/load.hpp — a Hugging Face checkpoint directory into the decoder.
//
//   hf_checkpoint ckpt(dir);                            // config.json + model.safetensors, or the sharded
//                                                       // model-0000k-of-0000n.safetensors + its index
//   auto model = load_causal_lm<float>(ckpt, memory);   // dense projections in the training dtype
//
// Every expected tensor (from the config) is checked against the files' headers before anything is
// allocated: a missing, extra, misshapen or wrongly typed tensor is one error naming the key and both
// values. The values then stream in one piece (loading_chunk_bytes) at a time: read, converted from the
// file's dtype (F32, BF16, F16) to the training dtype, checked finite, copied where the weights live. The
// model is returned only when every tensor has arrived, so an error leaves nothing half-loaded; the peak
// while loading is the model plus two staging pieces (loading_peak_bytes says it before loading).
#pragma once

#include "config.hpp"
#include "model.hpp"

#include "nf4_lora.hpp"

#include <memkit/io/json.hpp>
#include <memkit/io/safetensors.hpp>
#include <memkit/peft/layers.hpp>
#include <memkit/quant/bnb_checkpoint.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace memkit::models::llama {

// The elements of one staging piece: what the loader reads, converts and copies at a time.
inline constexpr std::int64_t loading_chunk_elements = std::int64_t{1} << 18;

class hf_checkpoint {
 public:
  // Opens dir/config.json and the weights' headers (not their data). `max_sequence` sizes the rotary table
  // (0: max_position_embeddings).
  explicit hf_checkpoint(const std::string& dir, std::int64_t max_sequence = 0) : dir_(dir) {
    namespace fs = std::filesystem;
    const std::string config_path = (fs::path(dir) / "config.json").string();
    const json::value root = read_json_file(config_path, std::streamoff{16} << 20, "config");
    config_ = config_from_hf(root, max_sequence, config_path);
    quantization_ = quantization_from_hf(root, config_path);
    const fs::path single = fs::path(dir) / "model.safetensors", index = fs::path(dir) / "model.safetensors.index.json";
    if (fs::exists(index)) {
      open_sharded(index);
    } else {
      require(fs::exists(single), dir + ": no model.safetensors or model.safetensors.index.json");
      files_.emplace_back(single.string());
      for (const safetensors::tensor_info& t : files_.back().tensors()) where_.emplace(t.name, 0);
    }
  }

  const std::string& dir() const noexcept { return dir_; }
  const model_config& config() const noexcept { return config_; }
  // A bitsandbytes 4-bit checkpoint (its projections are NF4 Linear4bit weights): loads only into a QLoRA model.
  bool prequantized() const noexcept { return quantization_.bnb_nf4; }
  std::size_t file_count() const noexcept { return files_.size(); }

  // The tensor's header entry and the file that holds it; null when the checkpoint has no such tensor.
  const safetensors::tensor_info* find(const std::string& name) const {
    const auto at = where_.find(name);
    return at == where_.end() ? nullptr : files_[at->second].find(name);
  }
  const safetensors::reader& file_of(const std::string& name) const { return files_[where_.at(name)]; }
  std::vector<std::string> names() const {
    std::vector<std::string> list;
    list.reserve(where_.size());
    for (const auto& [name, file] : where_) list.push_back(name);
    return list;
  }

 private:
  // model.safetensors.index.json: {"weight_map": {tensor: file}}. Shard names are plain file names in the
  // same directory; each tensor is in exactly the shard the map names, and every shard tensor is mapped.
  void open_sharded(const std::filesystem::path& index) {
    const json::value root = read_json_file(index.string(), std::streamoff{64} << 20, "shard index");
    const json::value* map = root.is_object() ? root.find("weight_map") : nullptr;
    require(map != nullptr && map->is_object(), index.string() + ": no weight_map object");
    std::map<std::string, std::size_t> file_index;
    for (const auto& [tensor, file] : map->as_object()) {
      require(file.is_string(), index.string() + ": weight_map['" + tensor + "'] is not a file name");
      const std::string& name = file.as_string();
      require(!name.empty() && name.find('/') == std::string::npos && name.find('\\') == std::string::npos &&
                  name != "." && name != "..",
              index.string() + ": weight_map['" + tensor + "'] = '" + name + "' is not a file name in the checkpoint's directory");
      auto [at, added] = file_index.emplace(name, files_.size());
      if (added) files_.emplace_back((index.parent_path() / name).string());
      require(where_.emplace(tensor, at->second).second, index.string() + ": tensor '" + tensor + "' is mapped twice");
    }
    for (const auto& [tensor, file] : where_)
      require(files_[file].find(tensor) != nullptr,
              index.string() + ": maps '" + tensor + "' to " + files_[file].path() + ", which does not hold it");
    for (std::size_t k = 0; k < files_.size(); ++k)
      for (const safetensors::tensor_info& t : files_[k].tensors()) {
        const auto at = where_.find(t.name);
        require(at != where_.end() && at->second == k,
                files_[k].path() + ": holds '" + t.name + "', which the index does not map to it");
      }
  }

  std::string dir_;
  model_config config_;
  checkpoint_quantization quantization_;
  std::vector<safetensors::reader> files_;
  std::map<std::string, std::size_t> where_;  // tensor name -> index into files_
};

// Every tensor a model of `c` reads from a checkpoint, with its shape: the shared parameters
// (causal_lm::shared_parameter_shapes) and each projection's weight [out, in] and bias [out].
template <class T>
std::vector<std::pair<std::string, shape>> checkpoint_tensors(const model_config& c) {
  std::vector<std::pair<std::string, shape>> list = causal_lm<T, layers::dense_linear<T>>::shared_parameter_shapes(c);
  for (std::int64_t i = 0; i < c.layers; ++i)
    for (const projection& p : projections_of(c, i)) {
      list.emplace_back(p.path + ".weight", shape{p.out, p.in});
      if (p.bias) list.emplace_back(p.path + ".bias", shape{p.out});
    }
  return list;
}

namespace detail {

inline std::string dims_text(const std::vector<std::int64_t>& dims) {
  std::string s = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) {
    s += i ? ", " : "";  // two appends, not "," + to_string(...): GCC 12 at -O3 warns (-Wrestrict) on that
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

// Tensors a checkpoint may carry that the model does not read (transformers drops them too): the rotary
// frequencies some older Llama conversions saved.
inline bool ignorable_tensor(const std::string& name) {
  const std::string suffix = ".rotary_emb.inv_freq";
  return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Whether a LoRA base type is quant::quantized_tensor<NF4> (what a bitsandbytes NF4 checkpoint loads into).
template <class Base>
constexpr bool is_nf4() {
  if constexpr (requires { Base::quant_format; }) return Base::quant_format == memkit::quant::format::nf4;
  else return false;
}

inline float source_to_float(const std::byte* p, const std::string& dtype) {
  if (dtype == "F32") {
    float v;
    std::memcpy(&v, p, 4);
    return v;
  }
  std::uint16_t bits;
  std::memcpy(&bits, p, 2);
  return dtype == "BF16" ? bf16_bits_to_float(bits) : fp16_bits_to_float(bits);
}

}  // namespace detail

// Checks the checkpoint's tensors against what a model of its config reads, from the headers alone: one
// error naming the first problem's key and both values.
template <class T>
void check_checkpoint_tensors(const hf_checkpoint& ckpt) {
  const model_config& c = ckpt.config();
  const std::vector<std::pair<std::string, shape>> expected = checkpoint_tensors<T>(c);
  std::map<std::string, bool> wanted;
  std::vector<std::string> quantized;  // weights whose companion tensors (W.absmax, W.quant_state...) belong too
  if (ckpt.prequantized())
    for (std::int64_t i = 0; i < c.layers; ++i)
      for (const projection& p : projections_of(c, i)) quantized.push_back(p.path + ".weight");
  for (const auto& [name, dims] : expected) {
    wanted.emplace(name, true);
    if (std::find(quantized.begin(), quantized.end(), name) != quantized.end()) {
      // A bitsandbytes 4-bit weight: its JSON quant_state gives the logical shape (and is checked whole).
      const std::string where = ckpt.dir() + ": tensor '" + name + "'";
      require(ckpt.find(name) != nullptr, where + " " + memkit::to_string(dims) + " (bitsandbytes 4-bit) is missing");
      const auto header = memkit::quant::detail::read_linear4bit_state<memkit::quant::format::nf4>(ckpt.file_of(name), name, where);
      if (header.dims != dims)
        throw memkit::error(where + " is " + memkit::to_string(header.dims) + " (bitsandbytes quant_state), config.json implies " +
                            memkit::to_string(dims));
      continue;
    }
    const safetensors::tensor_info* t = ckpt.find(name);
    if (t == nullptr)
      throw memkit::error(ckpt.dir() + ": tensor '" + name + "' " + memkit::to_string(dims) +
                          " is missing (config.json implies it" +
                          (name == "lm_head.weight" ? std::string(": tie_word_embeddings is false") : std::string()) + ")");
    const std::vector<std::int64_t> want(dims.extents, dims.extents + dims.rank);
    if (t->shape != want)
      throw memkit::error(ckpt.dir() + ": tensor '" + name + "' is " + detail::dims_text(t->shape) + " in " +
                          ckpt.file_of(name).path() + ", config.json implies " + memkit::to_string(dims));
    if (t->dtype != "F32" && t->dtype != "BF16" && t->dtype != "F16")
      throw memkit::error(ckpt.dir() + ": tensor '" + name + "' is " + t->dtype + " (supported: F32, BF16, F16)");
  }
  const auto companion = [&](const std::string& name) {
    const std::size_t dot = name.find(".weight.");
    return dot != std::string::npos && wanted.count(name.substr(0, dot + 7)) &&
           std::find(quantized.begin(), quantized.end(), name.substr(0, dot + 7)) != quantized.end();
  };
  for (const std::string& name : ckpt.names())
    if (!wanted.count(name) && !detail::ignorable_tensor(name) && !companion(name))
      throw memkit::error(ckpt.dir() + ": tensor '" + name + "' is not part of a " + std::to_string(c.layers) +
                          "-layer model of this config" +
                          (name == "lm_head.weight" ? std::string(" (tie_word_embeddings is true)") : std::string()));
}

// The host staging read_tensor_into holds while it reads a tensor of `elements` into W (with an fp32 master
// copy when `master`).
template <class W>
constexpr std::size_t reading_staging_bytes(std::int64_t elements, bool master = false) noexcept {
  const std::int64_t piece = std::min(loading_chunk_elements, std::max<std::int64_t>(elements, 1));
  return memkit::buffer<std::byte>::bytes_required(shape{piece * 4}) + memkit::buffer<W>::bytes_required(shape{piece}) +
         (master ? memkit::buffer<float>::bytes_required(shape{piece}) : 0);
}

// Reads tensor `name` of the checkpoint into `to` (host or device memory, the element type W), converted
// from the file's dtype one staging piece at a time through host buffers from `staging`; `master`, when
// not empty, receives the fp32 values too. A non-finite value is an error naming the key and the element.
template <class W>
void read_tensor_into(const hf_checkpoint& ckpt, const std::string& name, tensor_view<W> to,
                      memkit::memory_resource& staging, tensor_view<float> master = tensor_view<float>::none()) {
  const safetensors::tensor_info* entry = ckpt.find(name);
  require(entry != nullptr, ckpt.dir() + ": has no tensor '" + name + "'");
  const safetensors::tensor_info& t = *entry;
  const safetensors::reader& file = ckpt.file_of(name);
  require(t.numel() == to.size(), name + ": the checkpoint's size differs from the destination's");
  const bool with_master = !master.is_none();
  const std::size_t source_size = safetensors::dtype_size(t.dtype);
  const std::int64_t piece = std::min(loading_chunk_elements, std::max<std::int64_t>(to.size(), 1));
  memkit::buffer<std::byte> raw(staging, shape{piece * static_cast<std::int64_t>(sizeof(float))});
  memkit::buffer<W> converted(staging, shape{piece});
  memkit::buffer<float> fp32(staging, shape{with_master ? piece : 0});
  for (std::int64_t at = 0; at < to.size(); at += piece) {
    const std::int64_t n = std::min(piece, to.size() - at);
    file.read_range(t, static_cast<std::uint64_t>(at) * source_size, raw.data(), static_cast<std::uint64_t>(n) * source_size);
    for (std::int64_t i = 0; i < n; ++i) {
      const float v = detail::source_to_float(raw.data() + i * static_cast<std::int64_t>(source_size), t.dtype);
      if (!std::isfinite(v))
        throw memkit::error(file.path() + ": tensor '" + name + "' element " + std::to_string(at + i) + " is " +
                            (std::isnan(v) ? "NaN" : "infinite"));
      converted.data()[i] = memkit::from_float<W>(v);
      if (with_master) fp32.data()[i] = v;
    }
    layers::copy_in(converted.data(), to.flat_slice(at, n));
    if (with_master) layers::copy_in(fp32.data(), master.flat_slice(at, n));
  }
}

// Reads tensor `name` into `p`: its value, and its fp32 master copy when it has one.
template <class W>
void load_parameter(const hf_checkpoint& ckpt, const std::string& name, layers::basic_parameter<W>& p,
                    memkit::memory_resource& staging) {
  read_tensor_into(ckpt, name, p.value.view(), staging,
                   p.has_master() ? p.master.view() : tensor_view<float>::none());
}

// What a dense model of `c` allocates in all (values, fp32 master copies, gradients, the rotary table).
template <class T>
std::size_t dense_model_bytes(const model_config& c, layers::trainability mode) {
  std::size_t bytes = rotary<T>::table_bytes(c.head_dim, c.max_positions);
  for (const auto& [name, dims] : checkpoint_tensors<T>(c))
    bytes += layers::basic_parameter<T>::value_bytes(dims) + layers::basic_parameter<T>::master_bytes(dims, mode) +
             layers::basic_parameter<T>::grad_bytes(dims, mode);
  return bytes;
}

// The staging load_causal_lm holds beyond the model while it loads the largest tensor (raw source piece,
// converted piece, fp32 master piece when the parameters keep one).
template <class T>
std::size_t loading_staging_bytes(const model_config& c, layers::trainability mode) {
  std::int64_t largest = 1;
  for (const auto& [name, dims] : checkpoint_tensors<T>(c)) largest = std::max(largest, dims.numel());
  return reading_staging_bytes<T>(largest, layers::basic_parameter<T>::master_bytes(shape{1}, mode) > 0);
}

// The most load_causal_lm allocates at once, said before loading: the model plus the staging.
template <class T>
std::size_t loading_peak_bytes(const model_config& c, layers::trainability mode) {
  return dense_model_bytes<T>(c, mode) + loading_staging_bytes<T>(c, mode);
}

// Where the loaders' host staging pieces come from: the workspace resource when it is host memory (so a
// tracker counts them); for a device model, page-locked host memory under nvcc (each piece is copied up from
// it without the driver's extra bounce), else the default host resource.
inline memkit::memory_resource& host_staging(const layers::memory_resources& memory) {
  if (memory.workspace->kind() == memkit::memory_kind::host) return *memory.workspace;
#if MEMKIT_HAS_CUDA
  static memkit::pinned_host_resource pinned;
  return pinned;
#else
  return memkit::default_host_resource();
#endif
}

// Builds the dense model of the checkpoint's config in `memory` and loads every tensor. Staging buffers come
// from memory.workspace when it is host memory, else from the default host resource.
template <class T>
std::unique_ptr<causal_lm<T, layers::dense_linear<T>>> load_causal_lm(const hf_checkpoint& ckpt, const layers::memory_resources& memory,
                                                               layers::trainability mode = layers::trainability::frozen) {
  require(!ckpt.prequantized(), ckpt.dir() + ": a bitsandbytes 4-bit checkpoint loads into a QLoRA model "
                                             "(load_lora_causal_lm with an NF4 base), not a dense one");
  check_checkpoint_tensors<T>(ckpt);
  using model_type = causal_lm<T, layers::dense_linear<T>>;
  auto model = std::make_unique<model_type>(ckpt.config(), memory, mode, [&](const projection& p, std::int64_t, int) {
    return make_dense_linear<T>(p, memory, mode);
  });
  memkit::memory_resource& staging = host_staging(memory);
  for (layers::basic_parameter<T>* p : model->shared_parameters()) load_parameter(ckpt, p->name, *p, staging);
  for (layers::dense_linear<T>* l : model->linears()) {
    load_parameter(ckpt, l->weight.name, l->weight, staging);
    if (l->has_bias()) load_parameter(ckpt, l->bias.name, l->bias, staging);
  }
  return model;
}

// ---- LoRA and QLoRA over a checkpoint ----

// A copy of a quantized tensor in `resource`'s memory (bitsandbytes files are read on the host; a device
// model gets the copy).
template <memkit::quant::format F>
memkit::quant::quantized_tensor<F> copy_quantized(const memkit::quant::quantized_tensor<F>& from, memkit::memory_resource& resource) {
  memkit::quant::quantized_tensor<F> to(resource, from.logical_shape(), from.options());
  const auto copy = [](auto target, auto source) {
    memkit::require(target.bytes() == source.bytes(), "copy_quantized: tensors of different layouts");
    if (target.empty()) return;
    if (target.where() == memkit::memory_kind::host && source.where() == memkit::memory_kind::host) {
      std::memcpy(static_cast<void*>(target.data()), source.data(), source.bytes());
      return;
    }
#if MEMKIT_HAS_CUDA
    MEMKIT_CUDA_CHECK(cudaMemcpy(target.data(), source.data(), source.bytes(), cudaMemcpyDefault));
#else
    throw memkit::error("copy_quantized: device memory in a build without CUDA");
#endif
  };
  copy(to.codes(), from.codes());
  copy(to.absmax(), from.absmax());
  copy(to.nested_codes(), from.nested_codes());
  copy(to.nested_group_absmax(), from.nested_group_absmax());
  copy(to.offset_view(), from.offset_view());
  to.set_nested_map(from.nested_map());
  return to;
}

struct lora_load_options {
  memkit::lora::lora_options lora{};                   // rank, alpha, rsLoRA, dropout, init, init_seed
  memkit::quant::quant_options quant{64, true};         // an NF4 base: block 64, double quantization (QLoRA's)
  // The projections that get an adapter, by name; the others are the frozen base alone.
  std::vector<std::string> targets{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  // When set, the adapters are the file's: each module it holds gets its rank, alpha, rsLoRA and dropout
  // (peft::layer_options), the projections it does not hold none, whatever `targets` says.
  const memkit::peft::adapter_file* adapter = nullptr;
};

// The LoRA options of projection `p` (rank 0: no adapter).
inline memkit::lora::lora_options projection_lora_options(const lora_load_options& options, const projection& p) {
  memkit::lora::lora_options lora = options.lora;
  if (options.adapter != nullptr) {
    if (options.adapter->find(p.path) == nullptr) lora.rank = 0;
    else lora = memkit::peft::layer_options(*options.adapter, p.path, options.lora);
    return lora;
  }
  const std::string name = p.path.substr(p.path.rfind('.') + 1);
  if (std::find(options.targets.begin(), options.targets.end(), name) == options.targets.end()) lora.rank = 0;
  return lora;
}

// A LoRA model of `config`: every projection's weight frozen as Base (quant::quantized_tensor<NF4> is
// quantized from T values as it is filled: QLoRA; T keeps it dense), its bias (when the family has one)
// frozen, an adapter of options.lora on each of the seven projections (A drawn from (init_seed, projection),
// B zero), the embedding, norms and head frozen in T. fill(name, view) writes the tensor `name` (a
// checkpoint key) into a view of T in the model's memory. An NF4 projection is filled into a workspace
// buffer of T and quantized from there on `exec`, so the peak while building is the quantized model plus
// the largest projection in T plus quantize_into's workspace, never the whole 16-bit model.
template <class T, class Base, memkit::executor E, class Fill>
std::unique_ptr<causal_lm<T, lora_projection<T, Base>>> build_lora_causal_lm(const E& exec, const model_config& config,
                                                                              const layers::memory_resources& memory,
                                                                              const lora_load_options& options, Fill&& fill) {
  return build_lora_causal_lm<T, Base>(exec, config, memory, options, fill, nullptr);
}
// The same with `prequantized(key)` giving each projection's NF4 base ready-made (a bitsandbytes checkpoint).
template <class T, class Base, memkit::executor E, class Fill, class Prequantized>
std::unique_ptr<causal_lm<T, lora_projection<T, Base>>> build_lora_causal_lm(const E& exec, const model_config& config,
                                                                              const layers::memory_resources& memory,
                                                                              const lora_load_options& options, Fill&& fill,
                                                                              Prequantized&& prequantized) {
  using projection_type = lora_projection<T, Base>;
  using model_type = causal_lm<T, projection_type>;
  auto model = std::make_unique<model_type>(
      config, memory, layers::trainability::frozen, [&](const projection& p, std::int64_t i, int k) {
        typename projection_type::base_type base;
        const std::string key = p.path + ".weight";
        if constexpr (projection_type::quantized_base && !std::is_same_v<std::decay_t<Prequantized>, std::nullptr_t>) {
          base = prequantized(key, shape{p.out, p.in});
        } else if constexpr (projection_type::quantized_base) {
          memkit::buffer<T> dense = memkit::workspace_buffer<T>(exec, *memory.workspace, shape{p.out, p.in});
          fill(key, dense.view());
          base = Base(*memory.weights, shape{p.out, p.in}, options.quant);
          base.quantize_into(exec, std::as_const(dense).view(), key.c_str(), *memory.workspace);
        } else {
          base = memkit::buffer<T>(*memory.weights, shape{p.out, p.in});
          fill(key, base.view());
        }
        std::unique_ptr<memkit::buffer<T>> bias;
        if (p.bias) {
          bias = std::make_unique<memkit::buffer<T>>(*memory.weights, shape{p.out});
          fill(p.path + ".bias", bias->view());
        }
        memkit::lora::lora_options lora = projection_lora_options(options, p);
        lora.init_seed = memkit::random_word(options.lora.init_seed, static_cast<std::uint64_t>(i * 7 + k), 0);
        lora.host_threads = memory.host_threads;
        lora.matmul.host_threads = memory.host_threads;  // the quantized base's products too (their default is 1)
        return projection_type(p.path, std::move(base), lora, memory, std::move(bias));
      });
  for (layers::basic_parameter<T>* p : model->shared_parameters()) fill(p->name, p->value.view());
  return model;
}

// The most load_lora_causal_lm allocates at once from a 16-bit checkpoint, said before loading: it walks
// the order the model is built in (embedding, rotary table, final norm, head; then per block its norms and,
// per projection, the dense staging in T with the reader's pieces, the base next to it while it is quantized,
// the bias, the adapter and its gradients; then the values of the shared parameters, read last).
template <class T, class Base>
std::size_t lora_loading_peak_bytes(const model_config& c, const lora_load_options& options) {
  using projection_type = lora_projection<T, Base>;
  std::size_t live = 0, peak = 0;
  const auto at = [&](std::size_t transient) { peak = std::max(peak, live + transient); };
  const auto value = [](const shape& s) { return memkit::buffer<T>::bytes_required(s); };
  live += value(shape{c.vocab, c.hidden}) + rotary<T>::table_bytes(c.head_dim, c.max_positions) + value(shape{c.hidden});
  if (!c.tie_embeddings) live += value(shape{c.vocab, c.hidden});
  at(0);
  for (std::int64_t i = 0; i < c.layers; ++i) {
    live += 2 * value(shape{c.hidden});
    for (const projection& p : projections_of(c, i)) {
      const shape w{p.out, p.in};
      if constexpr (projection_type::quantized_base) {
        const std::size_t dense = value(w), base = Base::bytes_required(w, options.quant);
        at(dense + reading_staging_bytes<T>(w.numel()));
        at(dense + base + memkit::quant::workspace_bytes(memkit::quant::quantize_arguments{Base::quant_format, w, options.quant}));
        live += base;
      } else {
        at(value(w) + reading_staging_bytes<T>(w.numel()));
        live += value(w);
      }
      if (p.bias) {
        at(value(shape{p.out}) + reading_staging_bytes<T>(p.out));
        live += value(shape{p.out});
      }
      const std::int64_t rank = projection_lora_options(options, p).rank;
      live += projection_type::parameter_bytes(p.in, p.out, rank) + projection_type::gradient_bytes(p.in, p.out, rank);
      at(0);
    }
    if (c.qk_norm) live += 2 * value(shape{c.head_dim});
  }
  for (const auto& [name, dims] : causal_lm<T, projection_type>::shared_parameter_shapes(c)) at(reading_staging_bytes<T>(dims.numel()));
  return peak;
}

// The LoRA / QLoRA model of a checkpoint (build_lora_causal_lm filled from its tensors, checked first).
template <class T, class Base, memkit::executor E>
std::unique_ptr<causal_lm<T, lora_projection<T, Base>>> load_lora_causal_lm(const E& exec, const hf_checkpoint& ckpt,
                                                                             const layers::memory_resources& memory,
                                                                             const lora_load_options& options) {
  check_checkpoint_tensors<T>(ckpt);
  memkit::memory_resource& staging = host_staging(memory);
  const auto fill = [&](const std::string& name, tensor_view<T> to) { read_tensor_into(ckpt, name, to, staging); };
  if (!ckpt.prequantized()) return build_lora_causal_lm<T, Base>(exec, ckpt.config(), memory, options, fill);
  if constexpr (detail::is_nf4<Base>()) {
    // bitsandbytes' tensors read as they are (load_linear4bit checks each against its quant_state), on the
    // host; a device model gets a copy.
    return build_lora_causal_lm<T, Base>(exec, ckpt.config(), memory, options, fill, [&](const std::string& key, const shape&) {
      if (memory.weights->kind() != memkit::memory_kind::device)
        return memkit::quant::load_linear4bit<memkit::quant::format::nf4>(ckpt.file_of(key), key, *memory.weights);
      return copy_quantized(memkit::quant::load_linear4bit<memkit::quant::format::nf4>(ckpt.file_of(key), key, staging),
                            *memory.weights);
    });
  } else {
    throw memkit::error(ckpt.dir() + ": a bitsandbytes NF4 checkpoint loads into a QLoRA model with an NF4 base, "
                        "not LoRA over a dense or another quantized base");
  }
}

// Random values for a model built without a checkpoint (benchmarks and tests at real sizes): norm weights
// 1, biases 0, every matrix uniform with standard deviation `stddev` drawn from (seed, the tensor's name),
// one staging piece at a time (uniform, not normal: a billion draws stay cheap, and no test depends on the
// shape of the distribution).
struct random_weights {
  std::uint64_t seed = 0;
  float stddev = 0.02f;
  memkit::memory_resource* staging = &memkit::default_host_resource();
  // The staging it holds while it fills a tensor of `elements` of T.
  template <class T>
  static constexpr std::size_t staging_bytes(std::int64_t elements) noexcept {
    return memkit::buffer<T>::bytes_required(shape{std::min(loading_chunk_elements, std::max<std::int64_t>(elements, 1))});
  }
  template <class T>
  void operator()(const std::string& name, tensor_view<T> to) const {
    const bool norm = name.find("norm.weight") != std::string::npos, bias = name.size() > 5 &&
                                                                             name.compare(name.size() - 5, 5, ".bias") == 0;
    std::uint64_t stream = 1469598103934665603ull;  // FNV-1a of the name: each tensor its own stream
    for (unsigned char c : name) stream = (stream ^ c) * 1099511628211ull;
    const std::int64_t piece = std::min(loading_chunk_elements, std::max<std::int64_t>(to.size(), 1));
    memkit::buffer<T> values(*staging, shape{piece});
    for (std::int64_t at = 0; at < to.size(); at += piece) {
      const std::int64_t n = std::min(piece, to.size() - at);
      for (std::int64_t i = 0; i < n; ++i) {
        float v = norm ? 1.0f : 0.0f;
        if (!norm && !bias) {
          const float u = memkit::unit_float(memkit::random_word(seed, stream, static_cast<std::uint64_t>(at + i)));
          v = stddev * 1.7320508f * (2.0f * u - 1.0f);  // uniform on [-sqrt(3) s, sqrt(3) s]
        }
        values.data()[i] = memkit::from_float<T>(v);
      }
      layers::copy_in(values.data(), to.flat_slice(at, n));
    }
  }
};

// Writes the model with each adapter merged into its projection (dequant(W) + scale B A, in the training
// dtype T) as a checkpoint directory `dir`: config_json copied as config.json, every tensor in
// model.safetensors under transformers' names (biases and the shared parameters as they are). transformers
// (or load_causal_lm) loads it as the fine-tuned dense model. The safetensors writer holds the tensors in
// host memory until it writes them; each merged projection passes through one workspace buffer.
template <memkit::executor E, class T, class Base>
void save_merged(const E& exec, causal_lm<T, lora_projection<T, Base>>& model, const std::string& config_json,
                 const std::string& dir) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  fs::copy_file(config_json, fs::path(dir) / "config.json", fs::copy_options::overwrite_existing);
  safetensors::writer out;
  out.add_metadata("format", "pt");
  const auto add = [&](const std::string& name, tensor_view<const T> values) {
    const std::vector<T> host = layers::copy_out(values);
    out.add(name, tensor_view<const T>(host.data(), values.shape(), memkit::memory_kind::host));
  };
  for (layers::basic_parameter<T>* p : model.shared_parameters()) add(p->name, std::as_const(p->value).view());
  for (lora_projection<T, Base>* l : model.linears()) {
    memkit::buffer<T> merged = memkit::workspace_buffer<T>(exec, *model.memory.workspace, l->weight_shape());
    if (l->adapted()) l->layer->merged_weight(exec, merged.view());
    else if constexpr (lora_projection<T, Base>::quantized_base) l->base->dequantize(exec, merged.view());
    else layers::copy_view(exec, std::as_const(*l->base).view(), merged.view());
    add(l->path + ".weight", std::as_const(merged).view());
    if (l->bias) add(l->path + ".bias", std::as_const(*l->bias).view());
  }
  out.write((fs::path(dir) / "model.safetensors").string());
}

// Loads a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) into the model's adapted
// projections, all or nothing: the file must hold exactly those modules, each with the layer's rank and
// scale (build the model with lora_load_options::adapter pointing at the same file to get them).
template <class T, class Base>
void load_peft_adapter(causal_lm<T, lora_projection<T, Base>>& model, const memkit::peft::adapter_file& file,
                       const memkit::peft::load_options& options = {}) {
  std::vector<memkit::peft::layer_at<typename lora_projection<T, Base>::layer_type>> layers;
  std::vector<std::string> paths;
  for (lora_projection<T, Base>* l : model.linears()) {
    paths.push_back(l->path);
    if (!l->adapted()) {
      require(file.find(l->path) == nullptr, "peft adapter '" + file.weights().path() + "': adapts '" + l->path +
                                                 "', which this model built without an adapter (build it with "
                                                 "lora_load_options::adapter = &file)");
      continue;
    }
    layers.push_back({l->path, &*l->layer});
  }
  for (const memkit::peft::lora_module& m : file.modules())
    require(std::find(paths.begin(), paths.end(), m.path) != paths.end(),
            "peft adapter '" + file.weights().path() + "': module '" + m.path + "' is not one of the model's projections");
  memkit::peft::load_layers(file, layers, options);
}
template <class T, class Base>
void load_peft_adapter(causal_lm<T, lora_projection<T, Base>>& model, const std::string& directory,
                       const memkit::peft::load_options& options = {}) {
  load_peft_adapter(model, memkit::peft::adapter_file(directory), options);
}

}  // namespace memkit::models::llama
