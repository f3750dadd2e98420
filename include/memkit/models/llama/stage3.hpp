// memkit/models/llama/stage3.hpp — the decoder trained with ZeRO stage 3 (memkit/distributed/stage3.hpp).
//
//   stage3_units(model)              the model's stage-3 units: one per block (slot 0: one block's parameters
//                                    gathered at a time), then the embedding, final norm and head (slot 1:
//                                    they run at both ends of the pass, so they stay gathered through it)
//   stage3_unit_shapes(config, mode) the same units' sizes without a model (for bytes_required)
//   stage3_pass_hooks{exec, comm, runtime}   causal_lm::forward_backward's hooks: gather before each part
//                                    runs, release after (with the gradients reduced to their owners)
//
// A step on every rank, each with its own micro-batch:
//   stage3_pass_hooks hooks{exec, comm, runtime};
//   model.forward_backward(exec, ids, targets, loss, saved, {}, hooks);
//   runtime.step(exec, comm, groups, 1.0f / comm.size());   // the mean over the ranks' micro-batches
// The decoder needs no change beyond those hooks: its layers read their weights' buffers, which the runtime
// fills between gather and release, and a layer run outside them fails with a message naming the weight.
#pragma once

#include "model.hpp"

#include <memkit/distributed/stage3.hpp>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace memkit::models::llama {

namespace detail {
template <class T>
struct parameter_collector {
  std::vector<layers::basic_parameter<T>*> list;
  void add(layers::basic_parameter<T>& p) { list.push_back(&p); }
};
}  // namespace detail

// Units 0..layers-1: block i's norms (input, post-attention, then q_norm, k_norm with qk_norm) and its
// projections q, k, v, o, gate, up, down (weight, then bias where there is one). Unit `layers`: the
// embedding, the final norm, lm_head unless tied. Every parameter must train (full fine-tuning).
template <class T>
std::vector<distributed::stage3_unit<T>> stage3_units(causal_lm<T, layers::dense_linear<T>>& model) {
  std::vector<distributed::stage3_unit<T>> units;
  for (auto& b : model.blocks) {
    detail::parameter_collector<T> c;
    c.add(b.attn_norm.weight);
    c.add(b.mlp_norm.weight);
    if (model.config.qk_norm) {
      c.add(b.q_norm.weight);
      c.add(b.k_norm.weight);
    }
    for (layers::dense_linear<T>* l : {&b.q, &b.k, &b.v, &b.o, &b.gate, &b.up, &b.down}) l->register_parameters(c);
    units.push_back({std::move(c.list), 0, {}});
  }
  std::vector<layers::basic_parameter<T>*> outer{&model.embed.weight, &model.final_norm.weight};
  if (!model.config.tie_embeddings) outer.push_back(&model.head);
  units.push_back({std::move(outer), 1, {}});
  return units;
}

// The sizes of stage3_units(model) for a model of config `c` trained with `mode` (master copies with
// trainability::bf16_master and 16-bit T).
template <class T>
std::vector<distributed::stage3_unit_shape> stage3_unit_shapes(const model_config& c, layers::trainability mode) {
  const bool master = mode == layers::trainability::bf16_master && !std::is_same_v<T, float>;
  std::vector<distributed::stage3_unit_shape> units;
  for (std::int64_t i = 0; i < c.layers; ++i) {
    distributed::stage3_unit_shape u{{c.hidden, c.hidden}, 0, master};
    if (c.qk_norm) u.sizes.insert(u.sizes.end(), {c.head_dim, c.head_dim});
    for (const projection& p : projections_of(c, i)) {
      u.sizes.push_back(p.out * p.in);
      if (p.bias) u.sizes.push_back(p.out);
    }
    units.push_back(std::move(u));
  }
  distributed::stage3_unit_shape outer{{c.vocab * c.hidden, c.hidden}, 1, master};
  if (!c.tie_embeddings) outer.sizes.push_back(c.vocab * c.hidden);
  units.push_back(std::move(outer));
  return units;
}

// causal_lm::forward_backward's hooks for a runtime built from stage3_units(model): block i is unit i, the
// embedding and head unit `layers` (the last).
template <memkit::executor E, class C, class Runtime>
struct stage3_pass_hooks {
  const E& exec;
  const C& comm;
  Runtime& runtime;

  std::size_t outer() const { return runtime.unit_count() - 1; }
  void begin() { runtime.gather(exec, comm, outer(), true); }
  void end() { runtime.release(exec, comm, outer()); }
  void before_forward(std::int64_t i) { runtime.gather(exec, comm, static_cast<std::size_t>(i), false); }
  void after_forward(std::int64_t i) { runtime.release(exec, comm, static_cast<std::size_t>(i)); }
  void before_backward(std::int64_t i) { runtime.gather(exec, comm, static_cast<std::size_t>(i), true); }
  void after_backward(std::int64_t i) { runtime.release(exec, comm, static_cast<std::size_t>(i)); }
};
template <memkit::executor E, class C, class Runtime>
stage3_pass_hooks(const E&, const C&, Runtime&) -> stage3_pass_hooks<E, C, Runtime>;

}  // namespace memkit::models::llama
