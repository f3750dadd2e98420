// examples/llama/model.hpp — the whole decoder: embedding, blocks, final norm, LM head.
//
// causal_lm<T, Linear> owns its parameters (module paths as Hugging Face's LlamaForCausalLM
// names them, so the saved files read like a transformers checkpoint) and hands out what a training loop
// needs: the layer stack for checkpoint_segment (blocks, then the final norm), the head, the embedding.
// The rotary table is a constant of the model and lives with the weights.
#pragma once

#include "block.hpp"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace llama {

inline std::string layer_path(std::int64_t i) { return "model.layers." + std::to_string(i); }

// The seven projections of block i, in the order decoder_block declares them, with their shapes.
struct projection {
  std::string path;  // e.g. "model.layers.0.self_attn.q_proj"
  std::int64_t in, out;
};
inline std::vector<projection> projections_of(const model_config& c, std::int64_t i) {
  const std::int64_t h = c.hidden, q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim, f = c.intermediate;
  const std::string p = layer_path(i);
  return {{p + ".self_attn.q_proj", h, q},   {p + ".self_attn.k_proj", h, kv}, {p + ".self_attn.v_proj", h, kv},
          {p + ".self_attn.o_proj", q, h},   {p + ".mlp.gate_proj", h, f},     {p + ".mlp.up_proj", h, f},
          {p + ".mlp.down_proj", f, h}};
}

template <class T, class Linear>
struct causal_lm {
  using block_type = decoder_block<T, Linear>;
  // make_linear(projection, block index, projection index) builds one projection.
  using linear_maker = std::function<Linear(const projection&, std::int64_t, int)>;

  model_config config;
  memory_resources memory;
  token_embedding embed;
  std::unique_ptr<rotary<T>> rope;
  std::vector<block_type> blocks;
  rms_norm<T> final_norm;
  parameter head;  // lm_head.weight [vocab, hidden], untied

  causal_lm(const model_config& c, const memory_resources& m, trainability mode, const linear_maker& make_linear)
      : config(c), memory(m), embed(c.vocab, c.hidden, m, mode),
        rope(std::make_unique<rotary<T>>(c.head_dim, c.max_positions, c.rope_theta, *m.weights)),
        final_norm("model.norm.weight", c.hidden, m, mode),
        head("lm_head.weight", shape{c.vocab, c.hidden}, m, mode) {
    blocks.reserve(static_cast<std::size_t>(c.layers));
    for (std::int64_t i = 0; i < c.layers; ++i) {
      const std::vector<projection> p = projections_of(c, i);
      block_type b{c,
                   rms_norm<T>(layer_path(i) + ".input_layernorm.weight", c.hidden, m, mode),
                   rms_norm<T>(layer_path(i) + ".post_attention_layernorm.weight", c.hidden, m, mode),
                   make_linear(p[0], i, 0),
                   make_linear(p[1], i, 1),
                   make_linear(p[2], i, 2),
                   make_linear(p[3], i, 3),
                   make_linear(p[4], i, 4),
                   make_linear(p[5], i, 5),
                   make_linear(p[6], i, 6),
                   {},
                   rope.get(),
                   m};
      b.attn_norm.eps = b.mlp_norm.eps = c.norm_eps;
      blocks.push_back(std::move(b));
    }
    final_norm.eps = c.norm_eps;
  }
  causal_lm(const causal_lm&) = delete;
  causal_lm& operator=(const causal_lm&) = delete;

  // Bytes of the model's own constants and non-projection parameters (embedding, norms, head, rotary table).
  static std::size_t shared_weight_bytes(const model_config& c) {
    return parameter::value_bytes(shape{c.vocab, c.hidden}) * 2 +
           parameter::value_bytes(shape{c.hidden}) * static_cast<std::size_t>(2 * c.layers + 1) +
           rotary<T>::table_bytes(c.head_dim, c.max_positions);
  }
  // The non-projection parameters, in a fixed order (embedding, per block the two norms, final norm, head).
  std::vector<parameter*> shared_parameters() {
    std::vector<parameter*> list{&embed.weight};
    for (block_type& b : blocks) {
      list.push_back(&b.attn_norm.weight);
      list.push_back(&b.mlp_norm.weight);
    }
    list.push_back(&final_norm.weight);
    list.push_back(&head);
    return list;
  }
  std::vector<Linear*> linears() {
    std::vector<Linear*> list;
    for (block_type& b : blocks)
      for (Linear* l : {&b.q, &b.k, &b.v, &b.o, &b.gate, &b.up, &b.down}) list.push_back(l);
    return list;
  }
};

}  // namespace llama
