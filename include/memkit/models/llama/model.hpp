// memkit/models/llama/model.hpp — the whole decoder: embedding, blocks, final norm, LM head.
//
// causal_lm<T, Linear> owns its parameters (module paths as Hugging Face's LlamaForCausalLM
// names them, so the saved files read like a transformers checkpoint) and hands out what a training loop
// needs: the layer stack for memkit::checkpoint::segment (blocks, then the final norm), the head, the embedding.
// The rotary table is a constant of the model and lives with the weights.
#pragma once

#include "block.hpp"

#include <memkit/loss/fused_linear_cross_entropy.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace memkit::models::llama {

inline std::string layer_path(std::int64_t i) { return "model.layers." + std::to_string(i); }

// The seven projections of block i, in the order decoder_block declares them, with their shapes.
struct projection {
  std::string path;  // e.g. "model.layers.0.self_attn.q_proj"
  std::int64_t in, out;
  bool bias = false;  // the checkpoint has path + ".bias"
};
inline std::vector<projection> projections_of(const model_config& c, std::int64_t i) {
  const std::int64_t h = c.hidden, q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim, f = c.intermediate;
  const std::string p = layer_path(i);
  return {{p + ".self_attn.q_proj", h, q, c.qkv_bias}, {p + ".self_attn.k_proj", h, kv, c.qkv_bias},
          {p + ".self_attn.v_proj", h, kv, c.qkv_bias}, {p + ".self_attn.o_proj", q, h, c.o_bias},
          {p + ".mlp.gate_proj", h, f, c.mlp_bias},     {p + ".mlp.up_proj", h, f, c.mlp_bias},
          {p + ".mlp.down_proj", f, h, c.mlp_bias}};
}

// A dense projection as projections_of describes it (the maker a model of dense_linear layers takes).
template <class T>
layers::dense_linear<T> make_dense_linear(const projection& p, const layers::memory_resources& memory, layers::trainability mode) {
  return layers::dense_linear<T>(p.path + ".weight", p.in, p.out, memory, mode, p.bias);
}

// What forward_backward calls around the parts of the pass, for a caller that must act there (ZeRO stage 3:
// models/llama/stage3.hpp gathers a block's parameters before it runs and releases them after). begin() comes
// before the embedding, end() after its backward; the block calls bracket each block's forward and backward.
template <class H>
concept pass_hooks = requires(H& h, std::int64_t i) {
  h.begin();
  h.end();
  h.before_forward(i);
  h.after_forward(i);
  h.before_backward(i);
  h.after_backward(i);
};
struct no_pass_hooks {
  void begin() {}
  void end() {}
  void before_forward(std::int64_t) {}
  void after_forward(std::int64_t) {}
  void before_backward(std::int64_t) {}
  void after_backward(std::int64_t) {}
};

template <class T, class Linear>
struct causal_lm {
  using value_type = T;
  using block_type = decoder_block<T, Linear>;
  // make_linear(projection, block index, projection index) builds one projection.
  using linear_maker = std::function<Linear(const projection&, std::int64_t, int)>;

  model_config config;
  layers::memory_resources memory;
  token_embedding<T> embed;
  std::unique_ptr<rotary<T>> rope;
  std::vector<block_type> blocks;
  rms_norm<T> final_norm;
  layers::basic_parameter<T> head;  // lm_head.weight [vocab, hidden]; unallocated when config.tie_embeddings

  causal_lm(const model_config& c, const layers::memory_resources& m, layers::trainability mode, const linear_maker& make_linear)
      : config(c), memory(m), embed(c.vocab, c.hidden, m, mode),
        rope(std::make_unique<rotary<T>>(c.head_dim, c.max_positions, c.rope(), *m.weights)),
        final_norm("model.norm.weight", c.hidden, m, mode) {
    if (!c.tie_embeddings) head = layers::basic_parameter<T>("lm_head.weight", shape{c.vocab, c.hidden}, m, mode);
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
                   m,
                   {},
                   {},
                   c.window_of(i)};
      if (c.qk_norm) {
        b.q_norm = rms_norm<T>(layer_path(i) + ".self_attn.q_norm.weight", c.head_dim, m, mode);
        b.k_norm = rms_norm<T>(layer_path(i) + ".self_attn.k_norm.weight", c.head_dim, m, mode);
      }
      b.attn_norm.eps = b.mlp_norm.eps = b.q_norm.eps = b.k_norm.eps = c.norm_eps;
      blocks.push_back(std::move(b));
    }
    final_norm.eps = c.norm_eps;
  }
  causal_lm(const causal_lm&) = delete;
  causal_lm& operator=(const causal_lm&) = delete;

  // Runs every block's MLP over chunks of `tokens` tokens (decoder_block::mlp_token_chunk; 0: untiled).
  void set_mlp_token_chunk(std::int64_t tokens) {
    memkit::require(tokens >= 0, "causal_lm::set_mlp_token_chunk: tokens per chunk must be 0 (untiled) or positive, got " +
                                     std::to_string(tokens));
    for (block_type& b : blocks) b.mlp_token_chunk = tokens;
  }

  // Re-makes the rotary table with `positions` rows, the old one freed first (the two are never held at once),
  // so that one model runs at another longest sequence: train_llama --max-seq-search (#31) keeps the weights,
  // adapters and optimizer state across its trials and re-makes only what depends on the length. The blocks
  // keep pointing at the same `rotary` object.
  void set_max_positions(std::int64_t positions) {
    memkit::require(positions >= 1, "causal_lm::set_max_positions: positions must be at least 1, got " +
                                        std::to_string(positions));
    *rope = rotary<T>{};
    config.max_positions = 0;  // until the new table exists: a failed allocation leaves no stale length
    *rope = rotary<T>(config.head_dim, positions, config.rope(), *memory.weights);
    config.max_positions = positions;
  }

  // The LM head's weight [vocab, hidden]: lm_head.weight, or the embedding when they are tied (its gradient
  // then collects both uses).
  layers::basic_parameter<T>& head_weight() noexcept { return config.tie_embeddings ? embed.weight : head; }
  const layers::basic_parameter<T>& head_weight() const noexcept { return config.tie_embeddings ? embed.weight : head; }

  // The non-projection parameters, in a fixed order: embedding, per block the two norms (and q_norm, k_norm),
  // the final norm, the head unless tied.
  static std::vector<std::pair<std::string, shape>> shared_parameter_shapes(const model_config& c) {
    std::vector<std::pair<std::string, shape>> list{{"model.embed_tokens.weight", shape{c.vocab, c.hidden}}};
    for (std::int64_t i = 0; i < c.layers; ++i) {
      list.emplace_back(layer_path(i) + ".input_layernorm.weight", shape{c.hidden});
      list.emplace_back(layer_path(i) + ".post_attention_layernorm.weight", shape{c.hidden});
      if (c.qk_norm) {
        list.emplace_back(layer_path(i) + ".self_attn.q_norm.weight", shape{c.head_dim});
        list.emplace_back(layer_path(i) + ".self_attn.k_norm.weight", shape{c.head_dim});
      }
    }
    list.emplace_back("model.norm.weight", shape{c.hidden});
    if (!c.tie_embeddings) list.emplace_back("lm_head.weight", shape{c.vocab, c.hidden});
    return list;
  }
  // Bytes of the model's own constants and non-projection parameters (embedding, norms, head, rotary table).
  static std::size_t shared_weight_bytes(const model_config& c) {
    std::size_t bytes = rotary<T>::table_bytes(c.head_dim, c.max_positions);
    for (const auto& [name, dims] : shared_parameter_shapes(c)) bytes += layers::basic_parameter<T>::value_bytes(dims);
    return bytes;
  }
  std::vector<layers::basic_parameter<T>*> shared_parameters() {
    std::vector<layers::basic_parameter<T>*> list{&embed.weight};
    for (block_type& b : blocks) {
      list.push_back(&b.attn_norm.weight);
      list.push_back(&b.mlp_norm.weight);
      if (config.qk_norm) {
        list.push_back(&b.q_norm.weight);
        list.push_back(&b.k_norm.weight);
      }
    }
    list.push_back(&final_norm.weight);
    if (!config.tie_embeddings) list.push_back(&head);
    return list;
  }
  // Every trainable tensor, in the order of shared_parameters() then linears() (each projection's own
  // register_parameters: a dense_linear's weight then bias, a LoRA projection's A then B); frozen ones are
  // skipped. Registry: a layers::parameter_registry<T> (memkit/layers/parameters.hpp).
  template <class Registry>
  void register_parameters(Registry& registry) {
    for (layers::basic_parameter<T>* p : shared_parameters()) registry.add(*p);
    for (Linear* l : linears()) l->register_parameters(registry);
  }
  std::vector<Linear*> linears() {
    std::vector<Linear*> list;
    for (block_type& b : blocks)
      for (Linear* l : {&b.q, &b.k, &b.v, &b.o, &b.gate, &b.up, &b.down}) list.push_back(l);
    return list;
  }

  // Inference: the final hidden states (after the last norm) of `ids` [B, S], each block's saved tensors
  // dropped as soon as it has run. Temporaries come from memory.workspace, saved tensors from `saved`.
  // document_offsets (int32 [B, N + 1], or none()): packed documents, each attended and positioned on its own.
  template <memkit::executor E>
  void forward_hidden(const E& exec, tensor_view<const std::int32_t> ids, tensor_view<T> hidden,
                      memkit::memory_resource& saved,
                      tensor_view<const std::int32_t> document_offsets = tensor_view<const std::int32_t>::none()) {
    const shape& s = ids.shape();
    memkit::require(s.rank == 2, "causal_lm::forward_hidden: ids must be [batch, sequence]");
    const shape hs{s[0], s[1], config.hidden};
    memkit::require(hidden.size() == hs.numel(), "causal_lm::forward_hidden: hidden must be [batch, sequence, hidden]");
    memkit::require(s[1] <= config.max_positions, "causal_lm::forward_hidden: sequence " + std::to_string(s[1]) +
                                                      " is longer than the rotary table (" +
                                                      std::to_string(config.max_positions) + ")");
    memkit::buffer<T> other = memkit::workspace_buffer<T>(exec, *memory.workspace, hs);
    tensor_view<T> x = hidden.reshaped(hs), y = other.view();
    embed.forward(exec, ids, x);
    memkit::activation_store store(saved);
    memkit::forward_context ctx{};
    ctx.document_offsets = document_offsets;
    for (block_type& b : blocks) {
      b.forward(exec, ctx, tensor_view<const T>(x), y, store);
      store.clear();
      std::swap(x, y);
    }
    final_norm.forward(exec, {}, tensor_view<const T>(x), hidden.reshaped(hs), store);
    store.clear();
  }

  // One training pass without activation checkpointing (memkit::checkpoint::segment over the blocks is the
  // memory-saving loop: see examples/train_llama.cpp): the mean next-token loss of `targets` [B, S]
  // (ignore_index -100) through the fused linear cross-entropy into loss [1], and the gradients of every
  // trainable parameter and adapter accumulated. Saved tensors come from `saved`, the per-layer hidden
  // states and their gradients from memory.workspace. document_offsets (int32 [B, N + 1], or none()): packed
  // documents, each attended and positioned on its own (the targets then hold ignore_index at each document's last
  // token: models/tokens.hpp, pack_documents).
  template <memkit::executor E>
  void forward_backward(const E& exec, tensor_view<const std::int32_t> ids, tensor_view<const std::int32_t> targets,
                        tensor_view<float> loss, memkit::memory_resource& saved,
                        const memkit::loss::cross_entropy_options& loss_options = {},
                        tensor_view<const std::int32_t> document_offsets = tensor_view<const std::int32_t>::none()) {
    no_pass_hooks none;
    forward_backward(exec, ids, targets, loss, saved, loss_options, document_offsets, none);
  }
  // The same with `hooks` called around the parts of the pass (no_pass_hooks; ZeRO stage 3: stage3_pass_hooks),
  // without packed documents, or with them.
  template <memkit::executor E, pass_hooks Hooks>
  void forward_backward(const E& exec, tensor_view<const std::int32_t> ids, tensor_view<const std::int32_t> targets,
                        tensor_view<float> loss, memkit::memory_resource& saved,
                        const memkit::loss::cross_entropy_options& loss_options, Hooks& hooks) {
    forward_backward(exec, ids, targets, loss, saved, loss_options, tensor_view<const std::int32_t>::none(), hooks);
  }
  template <memkit::executor E, pass_hooks Hooks>
  void forward_backward(const E& exec, tensor_view<const std::int32_t> ids, tensor_view<const std::int32_t> targets,
                        tensor_view<float> loss, memkit::memory_resource& saved,
                        const memkit::loss::cross_entropy_options& loss_options,
                        tensor_view<const std::int32_t> document_offsets, Hooks& hooks) {
    const shape& s = ids.shape();
    memkit::require(s.rank == 2 && targets.shape() == s, "causal_lm::forward_backward: ids and targets must be [batch, sequence]");
    memkit::require(s[1] <= config.max_positions, "causal_lm::forward_backward: sequence " + std::to_string(s[1]) +
                                                      " is longer than the rotary table (" +
                                                      std::to_string(config.max_positions) + ")");
    const std::int64_t L = config.layers, N = s[0] * s[1], H = config.hidden;
    const shape hs{s[0], s[1], H};
    // Hidden states h_0..h_L, the final normed h, then two gradient buffers used in turn.
    memkit::buffer<T> states = memkit::workspace_buffer<T>(exec, *memory.workspace, shape{(L + 4) * N * H});
    const auto state = [&](std::int64_t i) { return states.view().flat_slice(i * N * H, N * H).reshaped(hs); };
    memkit::activation_store store(saved);
    hooks.begin();
    embed.forward(exec, ids, state(0));
    memkit::forward_context ctx{};
    ctx.document_offsets = document_offsets;
    for (std::int64_t i = 0; i < L; ++i) {
      hooks.before_forward(i);
      blocks[static_cast<std::size_t>(i)].forward(exec, ctx, tensor_view<const T>(state(i)), state(i + 1), store);
      hooks.after_forward(i);
    }
    final_norm.forward(exec, {}, tensor_view<const T>(state(L)), state(L + 1), store);
    layers::basic_parameter<T>& head_param = head_weight();
    tensor_view<T> dy = state(L + 2), dx = state(L + 3);
    memkit::loss::fused_linear_cross_entropy(
        exec, tensor_view<const T>(state(L + 1)).reshaped(shape{N, H}), std::as_const(head_param.value).view(),
        targets.reshaped(shape{N}), loss, dy.reshaped(shape{N, H}),
        head_param.trains() ? head_param.grad.view() : tensor_view<float>::none(), loss_options,
        *memory.workspace);
    final_norm.backward(exec, tensor_view<const T>(dy), dx, store);
    for (std::int64_t i = L - 1; i >= 0; --i) {
      std::swap(dx, dy);
      hooks.before_backward(i);
      blocks[static_cast<std::size_t>(i)].backward(exec, tensor_view<const T>(dy), dx, store);
      hooks.after_backward(i);
    }
    if (embed.weight.trains()) embed.backward(exec, ids, tensor_view<const T>(dx));
    hooks.end();
  }
};

}  // namespace memkit::models::llama
