// memkit/models/llama/block.hpp — one Llama decoder block as a memkit layer, for any projection type.
//
//   h = x + o(attention(rope(q(n1)), rope(k(n1)), v(n1)))      n1 = attn_norm(x)
//   y = h + down(silu(gate(n2)) * up(n2))                       n2 = mlp_norm(h)
//
// Linear is the projection (dense_linear in pretraining, a LoRA layer over an NF4 base in fine-tuning);
// Attention is memkit's (memkit/attention/flash_attention.hpp): causal, grouped-query, on [B, H, S, D].
// The block is a memkit::layer, so memkit::checkpoint::segment can drop its activations and recompute them. Its
// sub-layers save into the same activation store in forward order and take back in reverse order; the
// block itself saves q, k, v, the attention output and log-sum-exp in the [B, H, S, D] layout attention
// works in. Packed documents (forward_context::document_offsets, int32 [B, N + 1]): attention stays inside each
// document and the rotary positions restart at each document's start; the block then also saves a copy of the
// offsets, for its backward. Its temporaries (normalized inputs, projections, residual sums, their gradients) come from one
// workspace allocation of scratch_bytes(), and the peak workspace is stated by workspace_bytes().
//
// Sequence-tiled MLP (mlp_token_chunk > 0; Unsloth's / Arctic's TiledMLP): gate/up -> SwiGLU -> down run over
// chunks of mlp_token_chunk tokens (rows of the [B*S, hidden] input). The forward keeps none of the MLP's
// [tokens, intermediate] tensors: the block saves the MLP's input n2 alone, and the backward recomputes each
// chunk's gate/up/SwiGLU from it and runs that chunk's backward at once. The MLP's temporaries and the
// sub-layers' saved tensors are then [chunk, intermediate] pieces of the workspace. Every row's math is the
// untiled one (same products, same order along each row), so the output, the loss and every input gradient
// are bit-identical on the host; the gate/up/down weight (or adapter) gradients accumulate chunk by chunk
// (+= per chunk), the same sums in a different order, so they differ from the untiled ones by fp32
// rounding only. The other parameters' gradients are bit-identical.
#pragma once

#include "layers.hpp"

#include <memkit/attention/flash_attention.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

namespace memkit::models::llama {

// A bump allocator over one workspace buffer: a layer takes all its temporaries from one allocation whose
// size it can state in advance (each piece aligned to 64 bytes).
class scratch_arena {
 public:
  static constexpr std::size_t align(std::size_t bytes) noexcept { return (bytes + 63) / 64 * 64; }
  template <class T>
  static constexpr std::size_t bytes_for(const shape& dims) noexcept {
    return align(static_cast<std::size_t>(dims.numel()) * sizeof(T));
  }

  // On a CUDA executor the allocation is stream-ordered on exec.stream (memkit::workspace_buffer).
  template <memkit::executor E>
  scratch_arena(const E& exec, memkit::memory_resource& resource, std::size_t bytes)
      : storage_(memkit::workspace_buffer<std::byte>(exec, resource, shape{static_cast<std::int64_t>(bytes)})) {}
  template <class T>
  tensor_view<T> take(const shape& dims) {
    const std::size_t bytes = bytes_for<T>(dims);
    memkit::require(used_ + bytes <= storage_.bytes(), "scratch_arena: the layer asked for more scratch than it predicted");
    T* data = reinterpret_cast<T*>(storage_.data() + used_);
    used_ += bytes;
    return {data, dims, storage_.where()};
  }

 private:
  memkit::buffer<std::byte> storage_;
  std::size_t used_ = 0;
};

// The decoder's shape and the options in which the Llama-family models of transformers differ
// (config.hpp reads them from a Hugging Face config.json; the defaults are the example's model).
struct model_config {
  std::int64_t vocab = 256;
  std::int64_t hidden = 128;
  std::int64_t layers = 4;
  std::int64_t heads = 4;
  std::int64_t kv_heads = 2;
  std::int64_t head_dim = 32;
  std::int64_t intermediate = 352;
  std::int64_t max_positions = 256;  // rows of the rotary table: the longest sequence the model runs
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  // rope_type "llama3" (Llama 3.1 / 3.2): 0 keeps the default rotary frequencies.
  float rope_llama3_factor = 0.0f;
  float rope_low_freq_factor = 1.0f, rope_high_freq_factor = 4.0f;
  std::int64_t rope_original_max_positions = 8192;
  bool qkv_bias = false;        // q_proj, k_proj, v_proj have a bias (Llama attention_bias, Qwen2)
  bool o_bias = false;          // o_proj has one (Llama attention_bias, Qwen3 attention_bias)
  bool mlp_bias = false;        // gate_proj, up_proj, down_proj have one (Llama mlp_bias)
  bool qk_norm = false;         // RMSNorm over each head of q and k before the rotation (Qwen3)
  bool tie_embeddings = false;  // the LM head is the embedding matrix (no lm_head.weight)
  std::int64_t sliding_window = 0;       // 0: none; else layers from first_sliding_layer on see the last
  std::int64_t first_sliding_layer = 0;  // `sliding_window` keys (Mistral: every layer; Qwen: max_window_layers)

  rope_config rope() const {
    return rope_config{rope_theta, rope_llama3_factor, rope_low_freq_factor, rope_high_freq_factor,
                       rope_original_max_positions};
  }
  // The attention window of layer i (0: the whole causal prefix).
  std::int64_t window_of(std::int64_t layer) const noexcept {
    return sliding_window > 0 && layer >= first_sliding_layer ? sliding_window : 0;
  }
};

namespace detail {
// [B, S, H*D] <-> [B, H, S, D], one row of D elements (row index in the [B, S, H] order: one division per
// row, not per element).
template <class T>
struct heads_row {
  const T* in;
  T* out;
  std::int64_t S, H, D;
  bool split;  // true: [B, S, H*D] -> [B, H, S, D]; false: back
  MEMKIT_HOST_DEVICE void operator()(std::int64_t row) const {
    const std::int64_t h = row % H, s = (row / H) % S, b = row / H / S;
    const std::int64_t tokens_at = row * D, heads_at = ((b * H + h) * S + s) * D;
    const T* from = in + (split ? tokens_at : heads_at);
    T* to = out + (split ? heads_at : tokens_at);
    for (std::int64_t d = 0; d < D; ++d) to[d] = from[d];
  }
};
template <memkit::executor E, class T>
void split_heads(const E& exec, const T* in, T* out, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t D) {
  layers::for_each_index(exec, B * S * H, heads_row<T>{in, out, S, H, D, true});
}
template <memkit::executor E, class T>
void merge_heads(const E& exec, const T* in, T* out, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t D) {
  layers::for_each_index(exec, B * S * H, heads_row<T>{in, out, S, H, D, false});
}
// out = a + b, one element (out may be a).
template <class T>
struct add_element {
  const T* a;
  const T* b;
  T* out;
  MEMKIT_HOST_DEVICE void operator()(std::int64_t i) const { out[i] = narrow<T>(f32(a[i]) + f32(b[i])); }
};
template <memkit::executor E, class T>
void add_into(const E& exec, tensor_view<T> sum, tensor_view<const T> other) {
  layers::for_each_index(exec, sum.size(), add_element<T>{sum.data(), other.data(), sum.data()});
}
template <memkit::executor E, class T>
void add(const E& exec, tensor_view<const T> a, tensor_view<const T> b, tensor_view<T> out) {
  layers::for_each_index(exec, out.size(), add_element<T>{a.data(), b.data(), out.data()});
}
}  // namespace detail

template <class T, class Linear>
struct decoder_block {
  using value_type = T;
  using attention_options = memkit::attention::attention_options;

  model_config config;
  rms_norm<T> attn_norm, mlp_norm;
  Linear q, k, v, o, gate, up, down;
  swiglu<T> act;
  const rotary<T>* rope = nullptr;
  layers::memory_resources memory;
  rms_norm<T> q_norm{}, k_norm{};  // over each head (width head_dim); used when config.qk_norm
  std::int64_t window = 0;         // this layer's sliding window (model_config::window_of)
  // Tokens per chunk of the sequence-tiled MLP; 0: the MLP runs over all tokens at once (see the top of the file).
  std::int64_t mlp_token_chunk = 0;
  // The context of the latest forward: the tiled MLP's backward recomputes each chunk with it (only LoRA
  // dropout reads it, for its masks). checkpoint::segment's recompute and a forward-then-backward loop both
  // leave the right one; two forwards of one block with different contexts before their backwards would not.
  forward_context mlp_context{};

  std::int64_t q_width() const { return config.heads * config.head_dim; }
  std::int64_t kv_width() const { return config.kv_heads * config.head_dim; }
  attention_options attention() const {
    attention_options options{};
    options.host_threads = memory.host_threads;
    options.window = window;
    return options;
  }
  bool on_device() const noexcept { return memory.on_device(); }

  shape output_shape(const shape& in) const { return in; }

  // Per-head views [B, S * heads, head_dim] of q and k, what q_norm and k_norm normalize.
  shape q_head_rows(std::int64_t B, std::int64_t S) const { return shape{B, S * config.heads, config.head_dim}; }
  shape k_head_rows(std::int64_t B, std::int64_t S) const { return shape{B, S * config.kv_heads, config.head_dim}; }

  bool mlp_tiled() const noexcept { return mlp_token_chunk > 0; }
  // Rows of the MLP's [rows, intermediate] temporaries: the chunk, or every token when untiled.
  std::int64_t mlp_rows(const shape& in) const noexcept {
    const std::int64_t rows = in[0] * in[1];
    return mlp_tiled() ? std::min(mlp_token_chunk, rows) : rows;
  }
  // What gate, up, SwiGLU and down save for `rows` tokens (into the block's store untiled; into a chunk's
  // store, from the workspace, when tiled).
  std::size_t mlp_saved_bytes(std::int64_t rows, const forward_context& ctx) const {
    const std::int64_t h = config.hidden, f = config.intermediate;
    return gate.saved_bytes(shape{rows, h}, ctx) + up.saved_bytes(shape{rows, h}, ctx) +
           act.saved_bytes(shape{rows, 2 * f}, ctx) + down.saved_bytes(shape{rows, f}, ctx);
  }

  std::size_t saved_bytes(const shape& in, const forward_context& ctx) const {
    const std::int64_t B = in[0], S = in[1];
    const shape heads{B, config.heads, S, config.head_dim}, kv_heads{B, config.kv_heads, S, config.head_dim};
    const std::size_t head_norms =
        config.qk_norm ? q_norm.saved_bytes(q_head_rows(B, S), ctx) + k_norm.saved_bytes(k_head_rows(B, S), ctx) : 0;
    // Tiled, the MLP keeps only its input n2 [B, S, hidden] for the backward's recompute.
    const std::size_t mlp = mlp_tiled() ? activation_store::bytes_required<T>(in) : mlp_saved_bytes(B * S, ctx);
    return head_norms + attn_norm.saved_bytes(in, ctx) + q.saved_bytes(in, ctx) + k.saved_bytes(in, ctx) + v.saved_bytes(in, ctx) +
           activation_store::bytes_required<T>(heads) + 2 * activation_store::bytes_required<T>(kv_heads) +
           activation_store::bytes_required<T>(heads) + activation_store::bytes_required<float>(shape{B, config.heads, S}) +
           o.saved_bytes(shape{B, S, q_width()}, ctx) + mlp_norm.saved_bytes(in, ctx) + mlp +
           (ctx.document_offsets.is_none() ? 0 : activation_store::bytes_required<std::int32_t>(ctx.document_offsets.shape()));
  }

  // The one scratch allocation of forward and of backward.
  // The MLP's pieces are [mlp_rows, 2f] and [mlp_rows, f]: the whole sequence, or one chunk when tiled.
  std::size_t forward_scratch_bytes(const shape& in) const {
    const std::int64_t B = in[0], S = in[1], f = config.intermediate, m = mlp_rows(in);
    using A = scratch_arena;
    // n1, attn, h, n2, d; q, o_in; k, v; gate|up; a
    return 5 * A::bytes_for<T>(in) + 2 * A::bytes_for<T>(shape{B, S, q_width()}) +
           2 * A::bytes_for<T>(shape{B, S, kv_width()}) + A::bytes_for<T>(shape{m, 2 * f}) + A::bytes_for<T>(shape{m, f});
  }
  std::size_t backward_scratch_bytes(const shape& in) const {
    const std::int64_t B = in[0], S = in[1], f = config.intermediate, m = mlp_rows(in);
    using A = scratch_arena;
    // da; dgu (tiled: the chunk's recomputed a and gate|up, whose memory da and dgu then reuse); dn2, partial,
    // dh, dn1; do_in, dout, dqh, dq; dkh, dvh, dk, dv; with qk_norm dq and dk before it
    const std::int64_t head_norm_grads = config.qk_norm ? 1 : 0;
    return A::bytes_for<T>(shape{m, f}) + A::bytes_for<T>(shape{m, 2 * f}) + 4 * A::bytes_for<T>(in) +
           (4 + head_norm_grads) * A::bytes_for<T>(shape{B, S, q_width()}) +
           (4 + head_norm_grads) * A::bytes_for<T>(shape{B, S, kv_width()});
  }
  // The most the MLP's operations take from the workspace beyond the scratch. Tiled, a projection's workspace
  // comes on top of what the chunk's sub-layers hold at that moment, in the forward and in the backward
  // alike (each saves before its products and holds its tensors through its backward): gate's own, gate's
  // and up's, or all four at down.
  std::size_t mlp_workspace_bytes(const shape& in) const {
    const std::int64_t m = mlp_rows(in), h = config.hidden, f = config.intermediate;
    const shape ms{m, h}, fs{m, f};
    const forward_context ctx{};  // what the sub-layers save does not depend on it
    const std::size_t gate_saved = mlp_tiled() ? gate.saved_bytes(ms, ctx) : 0;
    const std::size_t up_saved = gate_saved + (mlp_tiled() ? up.saved_bytes(ms, ctx) : 0);
    const std::size_t all_saved = mlp_tiled() ? mlp_saved_bytes(m, ctx) : 0;
    return std::max({gate_saved + gate.workspace_bytes(ms), up_saved + up.workspace_bytes(ms),
                     all_saved + down.workspace_bytes(fs)});
  }
  // The most workspace the block holds at once: its scratch plus the largest workspace of one operation.
  std::size_t workspace_bytes(const shape& in) const {
    const std::int64_t B = in[0], S = in[1];
    const shape qs{B, S, q_width()};
    const std::size_t linears = std::max({q.workspace_bytes(in), k.workspace_bytes(in), v.workspace_bytes(in),
                                          o.workspace_bytes(qs), mlp_workspace_bytes(in)});
    const memkit::attention::problem_arguments problem{.batch = B, .query_heads = config.heads, .kv_heads = config.kv_heads,
                                                       .sequence = S, .head_dim = config.head_dim,
                                                       .element_bytes = sizeof(T), .on_device = on_device(),
                                                       .options = attention()};
    const std::size_t fwd = memkit::attention::workspace_bytes(memkit::attention::forward_arguments{problem});
    const std::size_t bwd = memkit::attention::workspace_bytes(memkit::attention::backward_arguments{problem});
    return std::max(forward_scratch_bytes(in) + std::max(linears, fwd), backward_scratch_bytes(in) + std::max(linears, bwd));
  }

  template <memkit::executor E>
  void forward(const E& exec, const forward_context& ctx, tensor_view<const T> x, tensor_view<T> y,
               activation_store& store) {
    const std::int64_t B = x.shape()[0], S = x.shape()[1], f = config.intermediate, rows = B * S;
    const std::int64_t Hq = config.heads, Hkv = config.kv_heads, D = config.head_dim;
    const shape in = x.shape();
    memkit::require(mlp_token_chunk >= 0, "decoder_block: mlp_token_chunk must be 0 (untiled) or a positive number of "
                                          "tokens, got " + std::to_string(mlp_token_chunk));
    // Packed documents: checked before anything runs (host-readable offsets; attention checks them too).
    const tensor_view<const std::int32_t> documents = ctx.document_offsets;
    if (!documents.is_none() && documents.where() != memory_kind::device)
      memkit::attention::detail::check_document_offsets("decoder_block", documents, B, S);
    scratch_arena scratch(exec, *memory.workspace, forward_scratch_bytes(in));

    tensor_view<T> n1 = scratch.take<T>(in);
    attn_norm.forward(exec, ctx, x, n1, store);
    tensor_view<T> qb = scratch.take<T>(shape{B, S, q_width()});
    tensor_view<T> kb = scratch.take<T>(shape{B, S, kv_width()});
    tensor_view<T> vb = scratch.take<T>(shape{B, S, kv_width()});
    q.forward(exec, ctx, n1, qb, store);
    k.forward(exec, ctx, n1, kb, store);
    v.forward(exec, ctx, n1, vb, store);
    if (config.qk_norm) {  // in place: each row is read whole before it is written
      q_norm.forward(exec, ctx, qb.reshaped(q_head_rows(B, S)), qb.reshaped(q_head_rows(B, S)), store);
      k_norm.forward(exec, ctx, kb.reshaped(k_head_rows(B, S)), kb.reshaped(k_head_rows(B, S)), store);
    }
    rope->rotate(exec, qb, qb, 1.0f, documents);
    rope->rotate(exec, kb, kb, 1.0f, documents);
    tensor_view<T> qh = store.save<T>(shape{B, Hq, S, D});
    tensor_view<T> kh = store.save<T>(shape{B, Hkv, S, D});
    tensor_view<T> vh = store.save<T>(shape{B, Hkv, S, D});
    detail::split_heads(exec, qb.data(), qh.data(), B, S, Hq, D);
    detail::split_heads(exec, kb.data(), kh.data(), B, S, Hkv, D);
    detail::split_heads(exec, vb.data(), vh.data(), B, S, Hkv, D);
    tensor_view<T> out = store.save<T>(shape{B, Hq, S, D});
    tensor_view<float> lse = store.save<float>(shape{B, Hq, S});
    memkit::attention::forward<T>(exec, tensor_view<const T>(qh), tensor_view<const T>(kh), tensor_view<const T>(vh),
                                  documents, out, lse, attention(), *memory.workspace);
    // Backward has no forward_context: it finds the offsets it needs (attention, rotary) on top of the store.
    if (!documents.is_none()) layers::copy_view(exec, documents, store.save<std::int32_t>(documents.shape()));
    tensor_view<T> o_in = scratch.take<T>(shape{B, S, q_width()});
    detail::merge_heads(exec, out.data(), o_in.data(), B, S, Hq, D);
    tensor_view<T> attn = scratch.take<T>(in);
    o.forward(exec, ctx, o_in, attn, store);
    tensor_view<T> h = scratch.take<T>(in);
    detail::add<E, T>(exec, x, attn, h);

    tensor_view<T> n2 = scratch.take<T>(in);
    mlp_norm.forward(exec, ctx, h, n2, store);
    const std::int64_t m = mlp_rows(in);
    tensor_view<T> gu = scratch.take<T>(shape{m, 2 * f});
    tensor_view<T> a = scratch.take<T>(shape{m, f});
    tensor_view<T> d = scratch.take<T>(in);
    if (!mlp_tiled()) {
      mlp_forward(exec, ctx, n2, gu, a, d, store);
    } else {
      mlp_context = ctx;
      layers::copy_view(exec, tensor_view<const T>(n2), store.save<T>(in));  // what the backward recomputes from
      const std::int64_t h_width = config.hidden;
      for (std::int64_t r0 = 0, i = 0; r0 < rows; r0 += m, ++i) {
        const std::int64_t mi = std::min(m, rows - r0);
        activation_store chunk(*memory.workspace);  // what the chunk's sub-layers save, dropped with it
        mlp_forward(exec, chunk_context(ctx, i), rows_view(n2, r0, mi, h_width), gu.flat_slice(0, mi * 2 * f),
                    a.flat_slice(0, mi * f), rows_view(d, r0, mi, h_width), chunk);
      }
    }
    detail::add<E, T>(exec, h, d, y);
  }

  template <memkit::executor E>
  void backward(const E& exec, tensor_view<const T> dy, tensor_view<T> dx, activation_store& store) {
    const std::int64_t B = dy.shape()[0], S = dy.shape()[1], f = config.intermediate, rows = B * S;
    const std::int64_t Hq = config.heads, Hkv = config.kv_heads, D = config.head_dim;
    const shape in = dy.shape();
    scratch_arena scratch(exec, *memory.workspace, backward_scratch_bytes(in));

    // MLP
    const std::int64_t m = mlp_rows(in);
    tensor_view<T> da = scratch.take<T>(shape{m, f});
    tensor_view<T> dgu = scratch.take<T>(shape{m, 2 * f});
    tensor_view<T> dn2 = scratch.take<T>(in);
    tensor_view<T> partial = scratch.take<T>(in);
    tensor_view<T> dh = scratch.take<T>(in);
    if (!mlp_tiled()) {
      mlp_backward(exec, dy, da, dgu, dn2, partial, store);
    } else {
      const auto n2 = store.take<T>(in, "decoder_block (the tiled MLP's input)");
      const std::int64_t h_width = config.hidden;
      for (std::int64_t r0 = 0, i = 0; r0 < rows; r0 += m, ++i) {
        const std::int64_t mi = std::min(m, rows - r0);
        activation_store chunk(*memory.workspace);
        // Recompute the chunk: a and gate|up land in da's and dgu's memory (the sub-layers keep their own
        // copies), down's output in dh's rows, which mlp_norm's backward overwrites below.
        tensor_view<T> a_i = da.flat_slice(0, mi * f), gu_i = dgu.flat_slice(0, mi * 2 * f);
        mlp_forward(exec, chunk_context(mlp_context, i), rows_view(n2.view(), r0, mi, h_width), gu_i, a_i,
                    rows_view(dh, r0, mi, h_width), chunk);
        mlp_backward(exec, rows_view(dy, r0, mi, h_width), a_i, gu_i, rows_view(dn2, r0, mi, h_width),
                     rows_view(partial, r0, mi, h_width), chunk);
      }
    }
    mlp_norm.backward(exec, dn2, dh, store);
    detail::add_into<E, T>(exec, dh, dy);

    // attention
    tensor_view<T> do_in = scratch.take<T>(shape{B, S, q_width()});
    o.backward(exec, dh, do_in, store);
    tensor_view<T> dout = scratch.take<T>(shape{B, Hq, S, D});
    detail::split_heads(exec, do_in.data(), dout.data(), B, S, Hq, D);
    saved_tensor<std::int32_t> documents;  // packed documents' offsets, when forward had them
    if (const auto dims = store.last_shape<std::int32_t>())
      documents = store.take<std::int32_t>(*dims, "decoder_block (document offsets)");
    const tensor_view<const std::int32_t> docs =
        documents.dims().rank == 0 ? tensor_view<const std::int32_t>::none() : std::as_const(documents).view();
    const auto lse = store.take<float>(shape{B, Hq, S}, "decoder_block (attention log-sum-exp)");
    const auto out = store.take<T>(shape{B, Hq, S, D}, "decoder_block (attention output)");
    const auto vh = store.take<T>(shape{B, Hkv, S, D}, "decoder_block (v)");
    const auto kh = store.take<T>(shape{B, Hkv, S, D}, "decoder_block (k)");
    const auto qh = store.take<T>(shape{B, Hq, S, D}, "decoder_block (q)");
    tensor_view<T> dqh = scratch.take<T>(shape{B, Hq, S, D});
    tensor_view<T> dkh = scratch.take<T>(shape{B, Hkv, S, D});
    tensor_view<T> dvh = scratch.take<T>(shape{B, Hkv, S, D});
    memkit::attention::backward<T>(exec, {qh.view(), kh.view(), vh.view(), out.view(), lse.view(), docs},
                                   tensor_view<const T>(dout), {dqh, dkh, dvh}, attention(), *memory.workspace);
    tensor_view<T> dq = scratch.take<T>(shape{B, S, q_width()});
    tensor_view<T> dk = scratch.take<T>(shape{B, S, kv_width()});
    tensor_view<T> dv = scratch.take<T>(shape{B, S, kv_width()});
    detail::merge_heads(exec, dqh.data(), dq.data(), B, S, Hq, D);
    detail::merge_heads(exec, dkh.data(), dk.data(), B, S, Hkv, D);
    detail::merge_heads(exec, dvh.data(), dv.data(), B, S, Hkv, D);
    rope->rotate(exec, dq, dq, -1.0f, docs);
    rope->rotate(exec, dk, dk, -1.0f, docs);
    if (config.qk_norm) {  // backward reads dy for the weight gradient after writing dx: not in place
      tensor_view<T> dq_in = scratch.take<T>(shape{B, S, q_width()});
      tensor_view<T> dk_in = scratch.take<T>(shape{B, S, kv_width()});
      k_norm.backward(exec, tensor_view<const T>(dk.reshaped(k_head_rows(B, S))), dk_in.reshaped(k_head_rows(B, S)), store);
      q_norm.backward(exec, tensor_view<const T>(dq.reshaped(q_head_rows(B, S))), dq_in.reshaped(q_head_rows(B, S)), store);
      dq = dq_in;
      dk = dk_in;
    }
    tensor_view<T> dn1 = scratch.take<T>(in);
    v.backward(exec, dv, dn1, store);
    k.backward(exec, dk, partial, store);
    detail::add_into<E, T>(exec, dn1, partial);
    q.backward(exec, dq, partial, store);
    detail::add_into<E, T>(exec, dn1, partial);
    attn_norm.backward(exec, dn1, dx, store);
    if (!dx.is_none()) detail::add_into<E, T>(exec, dx, dh);
  }

  // Rows [r0, r0 + count) of a [.., width] tensor, as [count, width].
  template <class U>
  static tensor_view<U> rows_view(tensor_view<U> t, std::int64_t r0, std::int64_t count, std::int64_t width) {
    return t.flat_slice(r0 * width, count * width).reshaped(shape{count, width});
  }
  // Chunk i of the tiled MLP draws its random streams (LoRA dropout) at counter + i: chunk 0 the untiled
  // stream, the others streams of their own (the next layer's start 2^40 counters further).
  static forward_context chunk_context(const forward_context& ctx, std::int64_t i) {
    return {ctx.seed, ctx.counter + static_cast<std::uint64_t>(i), ctx.training};
  }

  // The MLP over the rows of x [rows, hidden] (or [B, S, hidden]): gu [rows * 2f] (gate then up, planar, what
  // SwiGLU reads), a [rows * f], y [.., hidden]; the sub-layers save into `store`. Untiled the whole sequence
  // into the block's store, tiled one chunk into the chunk's.
  template <memkit::executor E>
  void mlp_forward(const E& exec, const forward_context& ctx, tensor_view<const T> x, tensor_view<T> gu, tensor_view<T> a,
                   tensor_view<T> y, activation_store& store) {
    const std::int64_t f = config.intermediate, rows = layers::rows_of(x.shape());
    const shape fs = layers::with_last(x.shape(), f);
    gate.forward(exec, ctx, x, gu.flat_slice(0, rows * f).reshaped(fs), store);
    up.forward(exec, ctx, x, gu.flat_slice(rows * f, rows * f).reshaped(fs), store);
    act.forward(exec, ctx, gu.reshaped(layers::with_last(x.shape(), 2 * f)), a.reshaped(fs), store);
    down.forward(exec, ctx, a.reshaped(fs), y, store);
  }
  // Its backward for dy [.., hidden]: da [rows * f] and dgu [rows * 2f] are temporaries, dx gets the input
  // gradient, partial [.., hidden] is a temporary; the weight (adapter) gradients accumulate.
  template <memkit::executor E>
  void mlp_backward(const E& exec, tensor_view<const T> dy, tensor_view<T> da, tensor_view<T> dgu, tensor_view<T> dx,
                    tensor_view<T> partial, activation_store& store) {
    const std::int64_t f = config.intermediate, rows = layers::rows_of(dy.shape());
    const shape fs = layers::with_last(dy.shape(), f);
    down.backward(exec, dy, da.reshaped(fs), store);
    act.backward(exec, tensor_view<const T>(da.reshaped(fs)), dgu.reshaped(layers::with_last(dy.shape(), 2 * f)), store);
    up.backward(exec, tensor_view<const T>(dgu.flat_slice(rows * f, rows * f).reshaped(fs)), dx, store);
    gate.backward(exec, tensor_view<const T>(dgu.flat_slice(0, rows * f).reshaped(fs)), partial, store);
    detail::add_into<E, T>(exec, dx, tensor_view<const T>(partial));
  }
};

}  // namespace memkit::models::llama
