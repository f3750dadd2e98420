// memkit/models/llama/stage3.hpp — the decoder trained with ZeRO stage 3 (memkit/distributed/stage3.hpp).
//
//   stage3_units(model)              the model's stage-3 units: one per block (slot 0: one block's parameters
//                                    gathered at a time), then the embedding, final norm and head (slot 1:
//                                    they run at both ends of the pass, so they stay gathered through it)
//   stage3_unit_shapes(config, mode) the same units' sizes without a model (for bytes_required)
//   stage3_pass_hooks{exec, comm, runtime}   causal_lm::forward_backward's hooks: gather before each part
//                                    runs, release after (with the gradients reduced to their owners)
//   all_reduce_adapter_gradients     LoRA adapters are replicated: their gradients summed in rank order
// With checkpoint::segment, wrap each block in distributed::stage3_layer (unit i) instead of the hooks.
//
// A step on every rank, each with its own micro-batch:
//   stage3_pass_hooks hooks{exec, comm, runtime};
//   model.forward_backward(exec, ids, targets, loss, saved, {}, hooks);
//   runtime.step(exec, comm, groups, 1.0f / comm.size());   // the mean over the ranks' micro-batches
// The decoder needs no change beyond those hooks: its layers read their weights' buffers, which the runtime
// fills between gather and release, and a layer run outside them fails with a message naming the weight.
#pragma once

#include "model.hpp"
#include "nf4_lora.hpp"

#include <memkit/distributed/stage3.hpp>

#include <algorithm>
#include <cstddef>
#include <type_traits>
#include <cstdint>
#include <utility>
#include <vector>

namespace memkit::models::llama {

namespace detail {
template <class T>
struct parameter_collector {
  std::vector<layers::basic_parameter<T>*> list;
  void add(layers::basic_parameter<T>& p) {
    if (p.trains()) list.push_back(&p);  // frozen dense tensors stay whole on every rank
  }
};
template <class Linear>
inline constexpr bool is_nf4_projection = false;
template <class T>
inline constexpr bool is_nf4_projection<nf4_lora_linear<T>> = true;
}  // namespace detail

// Units 0..layers-1: block i's trainable norms (input, post-attention, then q_norm, k_norm with qk_norm) and
// its projections q, k, v, o, gate, up, down: dense ones' trainable weight and bias, or NF4 ones' frozen base
// (their LoRA adapters stay replicated: all_reduce_adapter_gradients). Unit `layers`: the trainable embedding,
// final norm and lm_head (empty in QLoRA, where they are frozen and stay whole on every rank). Frozen dense
// tensors are not sharded.
template <class T, class Linear>
std::vector<distributed::stage3_unit<T>> stage3_units(causal_lm<T, Linear>& model) {
  static_assert(std::is_same_v<Linear, layers::dense_linear<T>> || detail::is_nf4_projection<Linear>,
                "stage3_units: projections are dense_linear<T> or nf4_lora_linear<T>");
  std::vector<distributed::stage3_unit<T>> units;
  for (auto& b : model.blocks) {
    detail::parameter_collector<T> c;
    distributed::stage3_unit<T> unit;
    c.add(b.attn_norm.weight);
    c.add(b.mlp_norm.weight);
    if (model.config.qk_norm) {
      c.add(b.q_norm.weight);
      c.add(b.k_norm.weight);
    }
    for (Linear* l : {&b.q, &b.k, &b.v, &b.o, &b.gate, &b.up, &b.down}) {
      if constexpr (detail::is_nf4_projection<Linear>) {
        unit.quantized.push_back(l->base.get());
        unit.quantized_names.push_back(l->path + ".weight");  // the checkpoint's name: exports load in transformers
      }
      else l->register_parameters(c);
    }
    unit.parameters = std::move(c.list);
    units.push_back(std::move(unit));
  }
  detail::parameter_collector<T> outer;
  outer.add(model.embed.weight);
  outer.add(model.final_norm.weight);
  if (!model.config.tie_embeddings) outer.add(model.head);
  units.push_back({std::move(outer.list), 1, {}, {}, {}});
  return units;
}

// The shapes of stage3_units(model) for a model of config `c` whose parameters train with `mode` (frozen:
// none train), without the model (for bytes_required). nf4: the projections are NF4 bases quantized with
// these options (a LoRA / QLoRA model); null: dense projections of mode `mode`.
template <class T>
std::vector<distributed::stage3_unit_shape> stage3_unit_shapes(const model_config& c, layers::trainability mode,
                                                               const memkit::quant::quant_options* nf4 = nullptr) {
  distributed::decoder_stage3_dims d;
  d.vocab = c.vocab, d.hidden = c.hidden, d.layers = c.layers, d.intermediate = c.intermediate;
  d.q_width = c.heads * c.head_dim, d.kv_width = c.kv_heads * c.head_dim, d.qk_norm = c.qk_norm ? c.head_dim : 0;
  d.qkv_bias = c.qkv_bias, d.o_bias = c.o_bias, d.mlp_bias = c.mlp_bias, d.tied_embeddings = c.tie_embeddings;
  return distributed::decoder_stage3_unit_shapes(d, mode != layers::trainability::frozen,
                                                 mode == layers::trainability::bf16_master && !std::is_same_v<T, float>, nf4);
}

// LoRA adapters are replicated under stage 3 (a few MB even for a 70B model): after the pass, every
// adapter's gradients are summed over the ranks, in rank order (distributed::ordered_all_reduce), so every
// rank steps its own copy of the adapters' optimizer identically.
template <memkit::executor E, class C, class T>
void all_reduce_adapter_gradients(const E& exec, const C& comm, causal_lm<T, nf4_lora_linear<T>>& model,
                                  memkit::memory_resource& workspace) {
  for (nf4_lora_linear<T>* l : model.linears()) {
    if (!l->adapted()) continue;
    distributed::ordered_all_reduce(exec, comm, l->grad_A(), workspace);
    distributed::ordered_all_reduce(exec, comm, l->grad_B(), workspace);
  }
}
// The most workspace all_reduce_adapter_gradients takes at once (its largest tensor's).
template <class T>
std::size_t adapter_all_reduce_workspace_bytes(causal_lm<T, nf4_lora_linear<T>>& model, int ranks) {
  std::size_t most = 0;
  for (nf4_lora_linear<T>* l : model.linears())
    if (l->adapted())
      for (std::int64_t n : {l->grad_A().size(), l->grad_B().size()})
        most = std::max(most, distributed::ordered_all_reduce_workspace_bytes(n, ranks));
  return most;
}

// causal_lm::forward_backward's hooks for a runtime built from stage3_units(model): block i is unit i, the
// embedding and head unit `layers` (the last). With `side` (an executor on a second CUDA stream; the host
// executor works too, without overlap), each block's gather also starts the next block's on `side`: unit i+1
// in forward, i-1 in backward. That needs two buffers in slot 0 (buffers_per_slot {2}): two layers' worth.
template <memkit::executor E, class C, class Runtime>
struct stage3_pass_hooks {
  const E& exec;
  const C& comm;
  Runtime& runtime;
  const E* side = nullptr;

  std::size_t outer() const { return runtime.unit_count() - 1; }
  void begin() { runtime.gather(exec, comm, outer(), true); }
  void end() { runtime.release(exec, comm, outer()); }
  void before_forward(std::int64_t i) {
    runtime.gather(exec, comm, static_cast<std::size_t>(i), false);
    if (side != nullptr && static_cast<std::size_t>(i) + 2 < runtime.unit_count())
      runtime.prefetch(*side, comm, static_cast<std::size_t>(i) + 1);
  }
  void after_forward(std::int64_t i) { runtime.release(exec, comm, static_cast<std::size_t>(i)); }
  void before_backward(std::int64_t i) {
    runtime.gather(exec, comm, static_cast<std::size_t>(i), true);
    if (side != nullptr && i > 0) runtime.prefetch(*side, comm, static_cast<std::size_t>(i) - 1);
  }
  void after_backward(std::int64_t i) { runtime.release(exec, comm, static_cast<std::size_t>(i)); }
};
template <memkit::executor E, class C, class Runtime>
stage3_pass_hooks(const E&, const C&, Runtime&) -> stage3_pass_hooks<E, C, Runtime>;
template <memkit::executor E, class C, class Runtime>
stage3_pass_hooks(const E&, const C&, Runtime&, const E*) -> stage3_pass_hooks<E, C, Runtime>;

}  // namespace memkit::models::llama
