// memkit/distributed/stage3_bytes.hpp — the bytes each rank of the ZeRO stage-3 runtime (distributed/stage3.hpp,
// stage3_parameters) allocates, as constexpr functions of the units' shapes, the rank count, the slots' gather
// buffers and the optimizer flavour, without the runtime's code (what memory_budget includes).
//
//   stage3_unit_shape                 a unit (one layer's tensors): trainable dense sizes, frozen NF4 shapes, slot
//   stage3_bytes                      bytes per tracking category (weights, gradients, optimizer_state)
//   stage3_layout<State, Block>       flat_size / shard_size of a unit, shard_bytes (what a rank keeps),
//                                     buffer_bytes (gather, gradient and staging buffers), bytes_required (all of
//                                     it, per rank), max_bytes_per_rank, gather_workspace_bytes (NF4 staging)
//   decoder_stage3_unit_shapes        the units of a Llama-style decoder from its dimensions (what
//                                     models::llama::stage3_units makes of a model)
//
// stage3_parameters' static byte functions forward here, and its constructor checks that it allocated exactly
// bytes_required; memory_budget's `--runtime memkit --zero 3` terms are these functions of the model's shape.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/distributed/sharded_adam_bytes.hpp"
#include "memkit/distributed/sharded_parameters_bytes.hpp"
#include "memkit/quant/bytes.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace distributed {

// What a unit is made of, for the byte functions: its tensors' element counts, its slot, and whether its
// parameters keep an fp32 master copy (16-bit values trained with layers::trainability::bf16_master).
struct stage3_unit_shape {
  std::vector<std::int64_t> sizes;  // trainable dense tensors (sharded with their optimizer state)
  int slot = 0;
  bool master = false;
  std::vector<std::pair<shape, quant::quant_options>> quantized{};  // frozen NF4 tensors (sharded, gathered)
};

// The bytes one rank allocates, per tracking category (weights: parameter slices and gather buffers;
// gradients: gradient slices, gradient buffers and the reduction's staging; optimizer_state: sharded Adam
// states and master slices). `master` is the part of optimizer_state that is master slices (memory_budget
// reports it as master_weights).
struct stage3_bytes {
  std::size_t weights = 0, gradients = 0, optimizer_state = 0;
  std::size_t master = 0;  // of optimizer_state
  constexpr std::size_t total() const noexcept { return weights + gradients + optimizer_state; }
  constexpr stage3_bytes& operator+=(const stage3_bytes& o) noexcept {
    weights += o.weights, gradients += o.gradients, optimizer_state += o.optimizer_state, master += o.master;
    return *this;
  }
};

// The alignment every memory_resource gives (memkit::default_alignment, memory/resource.hpp; stage3.hpp
// checks they agree): the gathered NF4 tensors' buffers start on it inside a slot's area.
inline constexpr std::size_t stage3_slab_alignment = 256;

// The layout and bytes of a stage3_parameters<W, State, Block>; `value_bytes` = sizeof(W).
template <class State, int Block = optim::adam_moment_format<State>::default_block>
struct stage3_layout {
  using adam = sharded_adam_layout<State, Block>;

  // Elements of a unit's flat dense parameters (0 without any) and of one rank's slice.
  static constexpr std::int64_t flat_size(const stage3_unit_shape& u, int ranks) noexcept {
    return u.sizes.empty() ? 0 : adam::flat_size(u.sizes, ranks);
  }
  static constexpr std::int64_t shard_size(const stage3_unit_shape& u, int ranks) noexcept {
    return u.sizes.empty() ? 0 : adam::shard_size(u.sizes, ranks);
  }
  static constexpr std::size_t aligned(std::size_t bytes) noexcept {
    return (bytes + stage3_slab_alignment - 1) / stage3_slab_alignment * stage3_slab_alignment;
  }
  // Bytes of a unit's gathered NF4 tensors in its slot: codes, block scales (uint8 nested codes with double
  // quantization), group scales and offset; each buffer aligned.
  static constexpr std::size_t quantized_gather_bytes(const stage3_unit_shape& u) noexcept {
    std::size_t bytes = 0;
    for (const auto& [dims, o] : u.quantized) {
      const std::int64_t blocks = quant::block_count(dims.numel(), o.block_size);
      bytes += aligned(static_cast<std::size_t>(quant::code_bytes(quant::format::nf4, dims.numel())));
      bytes += aligned(static_cast<std::size_t>(o.double_quant ? blocks : 4 * blocks));
      if (o.double_quant) bytes += aligned(static_cast<std::size_t>(4 * (quant::nested_group_count(blocks) + 1)));
    }
    return bytes;
  }
  // The workspace a gather takes (and returns before it returns): the largest NF4 tensor's staging.
  static constexpr std::size_t gather_workspace_bytes(std::span<const stage3_unit_shape> units, int ranks) noexcept {
    std::size_t most = 0;
    for (const stage3_unit_shape& u : units)
      for (const auto& [dims, o] : u.quantized)
        most = std::max(most, quantized_gather_workspace_bytes(quant::format::nf4, dims, o, ranks));
    return most;
  }
  // What rank `rank` keeps for one unit between its gathers: its slices and its optimizer state.
  static constexpr stage3_bytes shard_bytes(const stage3_unit_shape& u, std::size_t value_bytes, int rank, int ranks,
                                            std::int64_t min_quantized_size) {
    const auto slice = static_cast<std::size_t>(shard_size(u, ranks));
    stage3_bytes b;
    b.weights = slice * value_bytes;
    for (const auto& [dims, o] : u.quantized) b.weights += quantized_shard_bytes(quant::format::nf4, dims, o, ranks);
    if (u.sizes.empty()) return b;
    b.gradients = slice * sizeof(float);
    b.master = u.master ? slice * sizeof(float) : 0;
    b.optimizer_state = adam::bytes_required(u.sizes, rank, ranks, min_quantized_size) + b.master;
    return b;
  }
  // buffers_per_slot[k]: gather buffers of slot k (1, or 2 to prefetch the next unit while one runs; missing: 1).
  static constexpr int buffers_of(std::span<const int> buffers_per_slot, std::size_t slot) noexcept {
    return slot < buffers_per_slot.size() ? buffers_per_slot[slot] : 1;
  }
  // The buffers made once: per slot its gather buffers (dense values and NF4 area of the slot's largest unit)
  // and one gradient buffer of its largest unit's flat size, and the reduction's staging (the largest unit's
  // flat gradients).
  static constexpr stage3_bytes buffer_bytes(std::span<const stage3_unit_shape> units, std::size_t value_bytes, int ranks,
                                             std::span<const int> buffers_per_slot = {}) {
    std::vector<std::int64_t> slot_flat;
    std::vector<std::size_t> slot_quantized;
    std::int64_t largest = 0;
    for (const stage3_unit_shape& u : units) {
      const auto k = static_cast<std::size_t>(u.slot);
      if (k >= slot_flat.size()) {
        slot_flat.resize(k + 1, 0);
        slot_quantized.resize(k + 1, 0);
      }
      slot_flat[k] = std::max(slot_flat[k], flat_size(u, ranks));
      slot_quantized[k] = std::max(slot_quantized[k], quantized_gather_bytes(u));
      largest = std::max(largest, flat_size(u, ranks));
    }
    stage3_bytes b;
    for (std::size_t k = 0; k < slot_flat.size(); ++k) {
      const auto flat = static_cast<std::size_t>(slot_flat[k]);
      b.weights += static_cast<std::size_t>(buffers_of(buffers_per_slot, k)) * (flat * value_bytes + slot_quantized[k]);
      b.gradients += flat * sizeof(float);
    }
    b.gradients += static_cast<std::size_t>(largest) * sizeof(float);
    return b;
  }
  // Everything rank `rank` of `ranks` allocates (what the constructor takes, held until destruction).
  static constexpr stage3_bytes bytes_required(std::span<const stage3_unit_shape> units, std::size_t value_bytes, int rank,
                                               int ranks, std::int64_t min_quantized_size,
                                               std::span<const int> buffers_per_slot = {}) {
    stage3_bytes b = buffer_bytes(units, value_bytes, ranks, buffers_per_slot);
    for (const stage3_unit_shape& u : units) b += shard_bytes(u, value_bytes, rank, ranks, min_quantized_size);
    return b;
  }
  // Per category, the most any rank allocates (the ranks differ only in their Adam pieces; a budget plans
  // every device for the worst).
  static constexpr stage3_bytes max_bytes_per_rank(std::span<const stage3_unit_shape> units, std::size_t value_bytes,
                                                   int ranks, std::int64_t min_quantized_size,
                                                   std::span<const int> buffers_per_slot = {}) {
    stage3_bytes most;
    for (int r = 0; r < ranks; ++r) {
      const stage3_bytes b = bytes_required(units, value_bytes, r, ranks, min_quantized_size, buffers_per_slot);
      most.weights = std::max(most.weights, b.weights);
      most.gradients = std::max(most.gradients, b.gradients);
      most.optimizer_state = std::max(most.optimizer_state, b.optimizer_state);
      most.master = std::max(most.master, b.master);
    }
    return most;
  }
};

// The workspace distributed::ordered_all_reduce takes for `count` float elements on `ranks` ranks: the padded
// send and staging (ranks * ceil(count / ranks) each) and this rank's sum (how LoRA adapters' gradients, which
// stay replicated under stage 3, are summed).
constexpr std::size_t ordered_all_reduce_workspace_bytes(std::int64_t count, int ranks) noexcept {
  const std::int64_t n = ranks > 0 ? ranks : 1, chunk = (count + n - 1) / n;
  return count == 0 ? 0 : static_cast<std::size_t>(2 * n * chunk + chunk) * sizeof(float);
}

// A Llama-style decoder's dimensions, as far as its stage-3 units depend on them.
struct decoder_stage3_dims {
  std::int64_t vocab = 0, hidden = 0, layers = 0;
  std::int64_t q_width = 0, kv_width = 0;  // heads x head_dim, kv_heads x head_dim
  std::int64_t intermediate = 0;
  std::int64_t qk_norm = 0;  // the per-head q_norm / k_norm width (head_dim), 0: none
  bool qkv_bias = false, o_bias = false, mlp_bias = false, tied_embeddings = false;
};

// The units models::llama::stage3_units makes of such a decoder (the same order: the runtime's flat layout and
// so its per-rank pieces depend on it): unit i < layers, slot 0, block i's trainable input and post-attention
// norms (then q_norm, k_norm), then its projections q, k, v, o, gate, up, down (weight, then bias), dense
// and trainable, or frozen NF4 bases quantized with `*nf4`; unit `layers`, slot 1: the trainable embedding, final
// norm and (untied) LM head. `trains` false: the dense tensors are frozen (QLoRA) and stay whole on every rank,
// not in any unit. `master`: the trainable tensors keep fp32 master copies (16-bit values, bf16_master).
constexpr std::vector<stage3_unit_shape> decoder_stage3_unit_shapes(const decoder_stage3_dims& c, bool trains, bool master,
                                                                    const quant::quant_options* nf4 = nullptr) {
  const std::int64_t h = c.hidden, q = c.q_width, kv = c.kv_width, f = c.intermediate;
  struct projection {
    std::int64_t in, out;
    bool bias;
  };
  const projection projections[] = {{h, q, c.qkv_bias}, {h, kv, c.qkv_bias}, {h, kv, c.qkv_bias}, {q, h, c.o_bias},
                                    {h, f, c.mlp_bias}, {h, f, c.mlp_bias},   {f, h, c.mlp_bias}};
  std::vector<stage3_unit_shape> units;
  for (std::int64_t i = 0; i < c.layers; ++i) {
    stage3_unit_shape u{{}, 0, master && trains, {}};
    if (trains) u.sizes = {h, h};
    if (trains && c.qk_norm > 0) u.sizes.insert(u.sizes.end(), {c.qk_norm, c.qk_norm});
    for (const projection& p : projections) {
      if (nf4 != nullptr) {
        u.quantized.emplace_back(shape{p.out, p.in}, *nf4);
      } else if (trains) {
        u.sizes.push_back(p.out * p.in);
        if (p.bias) u.sizes.push_back(p.out);
      }
    }
    units.push_back(std::move(u));
  }
  stage3_unit_shape outer{{}, 1, master && trains, {}};
  if (trains) outer.sizes = {c.vocab * h, h};
  if (trains && !c.tied_embeddings) outer.sizes.push_back(c.vocab * h);
  units.push_back(std::move(outer));
  return units;
}

}  // namespace distributed
MEMKIT_NAMESPACE_END
