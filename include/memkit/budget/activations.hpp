// memkit/budget/activations.hpp — the tensors a transformer block saves for backward, one by one.
//
// Each entry is a tensor autograd keeps alive from a block's forward to its backward (the list is
// documented in docs/memory_model.md). With the Llama family's Hugging Face defaults
// (fp32_norm_and_softmax) the fp32 copies made by RMSNorm and softmax are among them. For a GPT-2
// block with dropout, eager attention and 16-bit activations the list reproduces Korthikanti et al.'s
// s*b*h*(34 + 5*a*s/h) plus the LayerNorms' per-row statistics.
#pragma once

#include <cstdint>
#include <string_view>

#include "memkit/attention/bytes.hpp"
#include "memkit/budget/model.hpp"
#include "memkit/budget/plan.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/linalg/gemm_bytes.hpp"
#include "memkit/lora/bytes.hpp"
#include "memkit/loss/bytes.hpp"
#include "memkit/quant/bytes.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace budget {

struct saved_tensor {
  std::string_view name;
  std::uint64_t bytes = 0;
};

struct block_activations {
  saved_tensor items[48]{};
  int count = 0;
  std::uint64_t saved_bytes = 0;         // kept from the block's forward to its backward
  std::uint64_t forward_transient = 0;   // largest temporary alive inside the block's forward
  std::uint64_t backward_transient = 0;  // gradient temporaries alive inside the block's backward
  // memkit runtime: the backward in phases (MLP, o_proj, attention, q/k/v projections), each with the saved
  // bytes already released when it starts and its temporaries: a phase's largest operation runs after the
  // later layers' saved tensors are gone. backward_transient is the largest of the phase transients.
  static constexpr int backward_phase_count = 4;
  std::uint64_t backward_released[backward_phase_count]{};
  std::uint64_t backward_phase_transient[backward_phase_count]{};
  // memkit runtime: the forward in the same phases (MLP, o_proj, attention, q/k/v projections), each with the
  // block's saved bytes not yet saved when it runs and its temporaries. forward_transient is the largest.
  std::uint64_t forward_unsaved[backward_phase_count]{};
  std::uint64_t forward_phase_transient[backward_phase_count]{};
  // memkit runtime: the temporaries come from the workspace resource (and include the block's operations'
  // own workspace), so they count as workspace, not activations.
  bool transients_in_workspace = false;

  constexpr void add(std::string_view name, std::uint64_t bytes) noexcept {
    if (bytes == 0) return;
    items[count++] = saved_tensor{name, bytes};
    saved_bytes += bytes;
  }
};

constexpr std::uint64_t round_up(std::uint64_t bytes, std::uint64_t granularity) noexcept {
  return granularity <= 1 ? bytes : (bytes + granularity - 1) / granularity * granularity;
}
constexpr std::uint64_t max_of(std::uint64_t a, std::uint64_t b) noexcept { return a > b ? a : b; }

namespace detail {
// Does autograd keep this linear layer's input? Its weight gradient needs it (full training) and so
// does a LoRA adapter reading it directly; with LoRA dropout the adapter keeps its own dropped copy.
// bitsandbytes before 0.43.2 saved a 4-bit matmul's input whenever it needed a gradient, although
// the backward only uses the weight: with `quantized_matmul_keeps_input` a frozen NF4/FP4 linear
// keeps its input too.
// memkit's lora_linear keeps its own copy of the adapter's input and its frozen base keeps nothing.
// PEFT's fp32 adapters (lora_settings::fp32_adapters) keep their own fp32 copies, not the 16-bit input.
constexpr bool keeps_linear_input(const training_plan& plan, module_set modules) noexcept {
  if (!plan.lora_training()) return true;
  if (plan.memkit_runtime()) return false;
  const bool four_bit = plan.weights.format == weight_format::nf4 || plan.weights.format == weight_format::fp4;
  if (four_bit && plan.quantized_matmul_keeps_input) return true;
  return contains(plan.lora.targets, modules) && !plan.lora.dropout && !plan.lora.fp32_adapters;
}
}  // namespace detail

// memkit runtime: is the block one memkit_block_activation_bytes models (below)? A Llama-style block —
// RMSNorm, rotary, separate q/k/v and gate/up projections, a dense gated MLP, no dropout or extra norms.
constexpr bool memkit_block_modelled(const model_config& m, const training_plan& plan) noexcept {
  return plan.memkit_runtime() && m.family == architecture::llama && m.gated_mlp() && !m.moe() && !m.fused_qkv &&
         !m.fused_gate_up && !m.dropout && !m.parallel_attention && m.norm == norm_kind::rms &&
         m.norms_per_block == 2 && m.qk_norm == qk_norm_kind::none && m.rotary();
}
constexpr block_activations memkit_block_activation_bytes(const model_config& m, const training_plan& plan) noexcept;

// The saved tensors of one block for `plan`'s micro-batch and sequence.
constexpr block_activations block_activation_bytes(const model_config& m, const training_plan& plan) noexcept {
  if (memkit_block_modelled(m, plan)) return memkit_block_activation_bytes(m, plan);
  block_activations a;
  const std::uint64_t g = plan.overhead.allocation_granularity;
  const std::uint64_t e = plan.stream_bytes();
  const std::uint64_t b = plan.micro_batch, s = plan.sequence, T = b * s;
  const std::uint64_t h = m.hidden, H = m.heads, d = m.head_dim, f = m.intermediate;
  const bool llama = !m.is_gpt2();
  const bool upcast = llama && plan.fp32_norm_and_softmax && e == 2 && !plan.memkit_runtime();
  const bool eager = plan.attention == attention_impl::eager;
  const std::uint64_t qkv_e = eager ? e : plan.activation_bytes();  // attention kernels take 16-bit q, k, v
  const bool norms_train = !plan.lora_training();
  auto add = [&](std::string_view name, std::uint64_t bytes) { a.add(name, round_up(bytes, g)); };

  auto norm = [&](std::string_view input, std::string_view stats, std::string_view normalized) {
    add(input, (upcast ? 4 : e) * T * h);
    add(stats, (llama ? 4 : 8) * T);  // rstd (RMSNorm) or mean and rstd (LayerNorm), fp32 per row
    if (upcast && norms_train) add(normalized, e * T * h);  // bf16 normalized value, for the weight's gradient
  };
  // LoRA on the linears of this block: the A output (read by B) and, with dropout, a mask and dropped input.
  // The dropped input and the A output are lora_linear's own saved tensors (lora/bytes.hpp); the 1-byte
  // mask is PEFT's (nn.Dropout keeps it; lora_linear draws it again in backward instead).
  auto lora = [&](module_set modules, std::uint64_t in, std::string_view dropped, std::string_view mask,
                  std::string_view down_projection) {
    if (!plan.lora_training() || !contains(plan.lora.targets, modules)) return;
    const lora::saved_bytes_parts adapter = lora::saved_activation_bytes(
        static_cast<std::int64_t>(T), static_cast<std::int64_t>(in), static_cast<std::int64_t>(plan.lora.rank), e);
    if (plan.memkit_runtime()) {
      // lora_linear saves dropout(x) (a copy, with or without dropout), its down-projection and the
      // 32-byte record of the dropout stream; the mask is drawn again in backward.
      add(dropped, adapter.adapter_input);
      add(down_projection, adapter.adapter_output);
      add("lora.dropout_record", adapter.record);
      return;
    }
    if (plan.lora.fp32_adapters) {
      // PEFT with fp32 adapters (peft/tuners/lora/layer.py, Linear.forward): x = x.to(lora_A.weight.dtype)
      // for each adapter on its own, so q, k and v each keep an fp32 copy of the same input; lora_A keeps
      // dropout(x) in fp32 (with dropout nn.Dropout keeps its mask too), lora_B the fp32 [T, r] A output.
      const lora::saved_bytes_parts fp32 = lora::saved_activation_bytes(
          static_cast<std::int64_t>(T), static_cast<std::int64_t>(in), static_cast<std::int64_t>(plan.lora.rank), 4);
      add(plan.lora.dropout ? dropped : std::string_view{"lora.input_fp32"}, fp32.adapter_input);
      if (plan.lora.dropout) add(mask, T * in);
      add(down_projection, fp32.adapter_output);
      return;
    }
    if (plan.lora.dropout) {
      add(dropped, adapter.adapter_input);
      add(mask, T * in);
    }
    add(down_projection, adapter.adapter_output);
  };
  const block_linears linears = linears_of(m);
  auto lora_all = [&](module_set which) {
    for (int i = 0; i < linears.count; ++i) {
      const linear_layer& l = linears.items[i];
      if ((l.modules & which) == 0) continue;
      lora(l.modules, l.in, "lora.dropout_output", "lora.dropout_mask", "lora.a_output");
    }
  };
  const module_set qkv = linear_module::q | linear_module::k | linear_module::v;
  const auto o = static_cast<module_set>(linear_module::o);
  const module_set gate_up = linear_module::gate | linear_module::up;
  const auto down = static_cast<module_set>(linear_module::down);

  // --- attention ---
  norm(llama ? "attn_norm.input" : "ln_1.input", llama ? "attn_norm.rstd" : "ln_1.statistics",
       "attn_norm.normalized");
  if (detail::keeps_linear_input(plan, qkv)) add("qkv_proj.input", e * T * h);
  lora_all(qkv);
  // q/k norms (Qwen3, Gemma 3, OLMo-2: RMSNorm; StableLM-2: LayerNorm) on the projections' outputs, per head or
  // over all heads: like the block's norms, an RMSNorm in Hugging Face's code keeps its fp32 upcast input and
  // fp32 1/rms per row (and its bf16 normalized output when its weight trains); a LayerNorm its input, mean and
  // rstd. Measured on an H200 (tests/data/budget_measured): Qwen3-0.6B's LoRA rows were 7% low without them.
  if (m.qk_norm != qk_norm_kind::none) {
    const bool rms = !m.layer_norm();
    const bool per_head = m.qk_norm == qk_norm_kind::per_head;
    auto qk_norm = [&](std::string_view input, std::string_view stats, std::string_view normalized,
                       std::uint64_t heads) {
      add(input, (rms && upcast ? 4 : e) * T * heads * d);
      add(stats, (rms ? 4 : 8) * T * (per_head ? heads : 1));
      if (rms && upcast && norms_train) add(normalized, e * T * heads * d);
    };
    qk_norm("q_norm.input", "q_norm.rstd", "q_norm.normalized", H);
    qk_norm("k_norm.input", "k_norm.rstd", "k_norm.normalized", m.kv_heads);
  }
  const std::uint64_t kv_kept = eager ? H : m.kv_heads;  // eager attention repeats k and v to every head
  add("q", qkv_e * T * H * d);
  add("k", qkv_e * T * kv_kept * d);
  add("v", qkv_e * T * kv_kept * d);
  const std::uint64_t scores = b * H * s * s;
  if (eager) {
    if (upcast) {
      add("attention.softmax_fp32", 4 * scores);
      add("attention.probabilities", e * scores);
    } else {
      add("attention.softmax", e * scores);
    }
    if (m.dropout) {
      add("attention.dropout_mask", scores);
      add("attention.dropout_output", e * scores);
    }
    if (detail::keeps_linear_input(plan, o)) add("o_proj.input", e * T * H * d);
  } else {
    // What memkit::attention's forward saves: out (also o_proj's input) and the fp32 log-sum-exp per row.
    add("attention.output", qkv_e * T * H * d);
    add("attention.logsumexp", attention::saved_bytes(attention::forward_arguments{{
                                   .batch = static_cast<std::int64_t>(b), .query_heads = static_cast<std::int64_t>(H),
                                   .sequence = static_cast<std::int64_t>(s), .head_dim = static_cast<std::int64_t>(d),
                                   .element_bytes = qkv_e}}) -
                                   qkv_e * T * H * d);
  }
  lora_all(o);
  if (m.dropout) add("attention.residual_dropout_mask", T * h);

  // --- MLP ---
  norm(llama ? "mlp_norm.input" : "ln_2.input", llama ? "mlp_norm.rstd" : "ln_2.statistics", "mlp_norm.normalized");
  if (m.gated_mlp()) {
    if (detail::keeps_linear_input(plan, gate_up)) add("gate_up_proj.input", e * T * h);
    lora_all(gate_up);
    add("gate_proj.output", e * T * f);  // activation input
    add("activation.output", e * T * f);
    add("up_proj.output", e * T * f);
    if (detail::keeps_linear_input(plan, down)) add("down_proj.input", e * T * f);
  } else {
    if (detail::keeps_linear_input(plan, static_cast<module_set>(linear_module::up))) add("c_fc.input", e * T * h);
    lora_all(static_cast<module_set>(linear_module::up));
    add("gelu.input", e * T * f);
    if (detail::keeps_linear_input(plan, down)) add("mlp.c_proj.input", e * T * f);
  }
  lora_all(down);
  if (m.dropout) add("mlp.residual_dropout_mask", T * h);

  // Temporaries: eager attention's raw and scaled/masked scores; the fp32 RMSNorm intermediates.
  if (eager) a.forward_transient = 2 * e * scores;
  if (upcast) a.forward_transient = max_of(a.forward_transient, 2 * 4 * T * h);
  // Backward: the incoming and outgoing hidden-state gradients, plus the larger of the attention and
  // MLP gradient temporaries.
  std::uint64_t attention_grads =
      eager ? (2 * e + (upcast ? 4 : e) + (m.dropout ? e : 0)) * scores
            : e * T * (H + 2 * m.kv_heads) * d +  // dq, dk, dv and memkit::attention's backward workspace
                  attention::workspace_bytes(attention::backward_arguments{{
                      .batch = static_cast<std::int64_t>(b), .query_heads = static_cast<std::int64_t>(H),
                      .kv_heads = static_cast<std::int64_t>(m.kv_heads), .sequence = static_cast<std::int64_t>(s),
                      .head_dim = static_cast<std::int64_t>(d), .element_bytes = e, .on_device = true}});
  std::uint64_t mlp_grads = m.gated_mlp() ? 3 * e * T * f : 2 * e * T * f;
  if (upcast) mlp_grads = max_of(mlp_grads, 3 * 4 * T * h);
  a.backward_transient = 2 * e * T * h + max_of(attention_grads, mlp_grads);
  return a;
}

namespace detail {
// Losses that compute the hidden states' gradient during forward and so keep no lm_head input:
// memkit's fused_linear_cross_entropy and Liger's fused linear cross-entropy.
constexpr bool loss_grad_in_forward(const training_plan& plan) noexcept {
  return plan.logits == logits_mode::fused || (plan.memkit_runtime() && plan.logits == logits_mode::chunked);
}

// Base storage and activation type of a memkit block's linears, for the component's workspace functions.
template <class F>
constexpr auto with_base_type(const training_plan& plan, F&& f) noexcept {
  switch (plan.weights.format) {
    case weight_format::nf4: return f(static_cast<quant::quantized_tensor<quant::NF4>*>(nullptr));
    case weight_format::fp4: return f(static_cast<quant::quantized_tensor<quant::FP4>*>(nullptr));
    case weight_format::int8: return f(static_cast<quant::quantized_tensor<quant::INT8>*>(nullptr));
    case weight_format::fp32: return f(static_cast<float*>(nullptr));
    case weight_format::fp16: return f(static_cast<fp16*>(nullptr));
    case weight_format::bf16: break;
  }
  return f(static_cast<bf16*>(nullptr));
}
}  // namespace detail

// memkit runtime: the most one linear layer of a block takes from the workspace — a lora_linear's forward
// or backward (lora/lora_linear.hpp's workspace_bytes of forward_arguments / backward_arguments: the held
// down-projection gradient and, over a quantized base, quant::matmul's dequantized tile of rows and its fp32
// input-gradient accumulator), or a frozen quantized linear without adapter (quant::workspace_bytes of its matmul_arguments).
// On a device, dense products run on cuBLAS, whose own workspace is the overhead's `workspace_bytes`; on the
// host (plan.host_threads > 0) every product is a linalg::gemm whose per-thread packing is workspace too, so a
// trained dense linear takes the most of its forward (x W^T), weight gradient (dy^T x, fp32) and input
// gradient (dy W) products.
// `which`: only the linears of these modules (a block's phase); `tokens`: rows per call (0: the plan's tokens;
// the tiled MLP's chunk).
constexpr std::uint64_t memkit_linear_workspace_bytes(const model_config& m, const training_plan& plan,
                                                      module_set which = all_linear_modules,
                                                      std::uint64_t tokens_per_call = 0) noexcept {
  const bool on_host = plan.on_host();
  if (!plan.lora_training() && !on_host) return 0;
  const bool on_device = !on_host;
  const std::uint64_t e = plan.activation_bytes();
  const bool half_is_fp16 = plan.precision == precision_mode::fp16_mixed;
  const linalg::gemm_options gemm{static_cast<int>(plan.host_threads)};
  const block_linears linears = linears_of(m);
  std::uint64_t peak = 0;
  for (int i = 0; i < linears.count; ++i) {
    const linear_layer& l = linears.items[i];
    if ((l.modules & which) == 0) continue;
    const std::uint64_t rows = tokens_per_call > 0 ? tokens_per_call : plan.tokens();
    const auto tokens = static_cast<std::int64_t>(rows * l.tokens_per_copy_num / l.tokens_per_copy_den);
    const auto in = static_cast<std::int64_t>(l.in), out = static_cast<std::int64_t>(l.out);
    const auto rank = static_cast<std::int64_t>(plan.lora.rank);
    const std::int64_t block = plan.weights.format == weight_format::int8 ? in
                                                                          : static_cast<std::int64_t>(plan.weights.block_size);
    const bool adapter = plan.lora_training() && contains(plan.lora.targets, l.modules);
    auto of = [&]<class Base, class T>(Base*, T*) -> std::uint64_t {
      if (!plan.lora_training()) {  // a trained dense linear on the host: weights of the activations' type
        return max_of(linalg::gemm_workspace_bytes<T, T, T>(tokens, out, in, gemm),
                      max_of(linalg::gemm_workspace_bytes<T, T, float>(out, in, tokens, gemm),
                             linalg::gemm_workspace_bytes<T, T, T>(tokens, in, out, gemm)));
      }
      if (adapter) {
        lora::lora_options options;
        options.host_threads = static_cast<int>(plan.host_threads);
        options.matmul.host_threads = static_cast<int>(plan.host_threads);  // as memkit/models/llama sets it
        const lora::forward_arguments<Base, T> forward{.tokens = tokens, .in = in, .out = out, .rank = rank,
                                                       .on_device = on_device, .options = options, .block_size = block};
        const lora::backward_arguments<Base, T> backward{forward, plan.lora.dropout, /*input_grad=*/true};
        return max_of(lora::workspace_bytes(forward), lora::workspace_bytes(backward));
      }
      if constexpr (lora::base_traits<Base>::quantized) {
        constexpr quant::format F = lora::base_traits<Base>::format;
        quant::matmul_config matmul;
        matmul.host_threads = static_cast<int>(plan.host_threads);
        const quant::matmul_arguments forward{quant::matmul_kind::forward, F, block, tokens, out, in, sizeof(T),
                                              on_device, matmul};
        quant::matmul_arguments input_grad = forward;
        input_grad.kind = quant::matmul_kind::input_grad;
        return max_of(quant::workspace_bytes(forward), quant::workspace_bytes(input_grad));
      } else {
        if (on_device) return 0;
        return max_of(linalg::gemm_workspace_bytes<T, Base, T>(tokens, out, in, gemm),
                      linalg::gemm_workspace_bytes<T, Base, T>(tokens, in, out, gemm));
      }
    };
    const std::uint64_t bytes = detail::with_base_type(plan, [&](auto* base) -> std::uint64_t {
      if (e == 4) return of(base, static_cast<float*>(nullptr));
      if (half_is_fp16) return of(base, static_cast<fp16*>(nullptr));
      return of(base, static_cast<bf16*>(nullptr));
    });
    peak = max_of(peak, bytes);
  }
  return peak;
}

// memkit runtime: one Llama-style block as memkit's layers run it (core/layer.hpp's layer concept;
// memkit/models/llama/block.hpp is this block, built from memkit::attention, lora_linear and the example's
// RMSNorm / rotary / SwiGLU layers). Every layer saves its own tensors into the activation store, none
// shares another's:
//   RMSNorm (x2)            its input and the fp32 1/rms per row
//   a trained dense linear  its own copy of its input (q, k, v, gate and up each keep one)
//   lora_linear             lora::saved_activation_bytes: its own dropout(x) copy, the [T, r]
//                           down-projection, the 32-byte dropout record; the frozen base keeps nothing
//   attention               q, k, v in [B, H, S, D] (k, v at the kv heads: never expanded) and
//                           memkit::attention's output and fp32 log-sum-exp
//   SwiGLU                  its input: the gate and up outputs, [T, 2f]
//   rotary                  nothing (its cos/sin table is a constant of the model)
// The block's temporaries come from the workspace, each its own 64-byte-aligned piece of one allocation:
//   forward   the two normalized inputs, q, k, v, the attention output in [B, S, H*D] (o's input), o's
//             output, the residual sum, gate|up, the SwiGLU output and down's output;
//   backward  the SwiGLU and gate|up gradients, four hidden-width gradients (dn2, dh, dn1 and a partial
//             sum), and four each of the q-width and kv-width ones (merged/split heads of dq, dk, dv, do);
// on top of which one operation's own workspace: the largest of any linear's (memkit_linear_workspace_bytes)
// and memkit::attention's forward (host: per-thread tiles) or backward (delta, host tiles) workspace.
// Tiled MLP (plan.mlp_token_chunk = c > 0, decoder_block::mlp_token_chunk): the block saves the MLP's input
// [T, h] instead of gate's, up's, SwiGLU's and down's tensors; gate|up and the SwiGLU output (and in backward
// their gradients) are [min(c, T), .] scratch pieces; each chunk's sub-layers save into a store on the
// workspace, so an MLP projection's workspace (at min(c, T) rows) comes on top of what the chunk holds then:
// gate's saved tensors, gate's and up's, or all four at down (decoder_block::mlp_workspace_bytes).
constexpr block_activations memkit_block_activation_bytes(const model_config& m, const training_plan& plan) noexcept {
  block_activations a;
  a.transients_in_workspace = true;
  const std::uint64_t g = plan.overhead.allocation_granularity;
  const std::uint64_t e = plan.activation_bytes();
  const std::uint64_t b = plan.micro_batch, s = plan.sequence, T = b * s;
  const std::uint64_t h = m.hidden, Hq = m.heads, Hkv = m.kv_heads, d = m.head_dim, f = m.intermediate;
  const std::uint64_t qw = Hq * d, kvw = Hkv * d;
  auto add = [&](std::string_view name, std::uint64_t bytes) { a.add(name, round_up(bytes, g)); };
  auto linear = [&](linear_module module, std::uint64_t in, std::string_view input) {
    if (!plan.lora_training()) {
      add(input, e * T * in);
      return;
    }
    if (!contains(plan.lora.targets, static_cast<module_set>(module))) return;
    const lora::saved_bytes_parts adapter = lora::saved_activation_bytes(
        static_cast<std::int64_t>(T), static_cast<std::int64_t>(in), static_cast<std::int64_t>(plan.lora.rank), e);
    add("lora.dropout_output", adapter.adapter_input);
    add("lora.a_output", adapter.adapter_output);
    add("lora.dropout_record", adapter.record);
  };
  add("attn_norm.input", e * T * h);
  add("attn_norm.rstd", 4 * T);
  linear(linear_module::q, h, "q_proj.input");
  linear(linear_module::k, h, "k_proj.input");
  linear(linear_module::v, h, "v_proj.input");
  const std::uint64_t saved_to_qkv = a.saved_bytes;  // the backward's phases release in reverse order
  add("q", e * T * qw);
  add("k", e * T * kvw);
  add("v", e * T * kvw);
  add("attention.output", e * T * qw);
  const attention::problem_arguments attention_problem{
      .batch = static_cast<std::int64_t>(b), .query_heads = static_cast<std::int64_t>(Hq),
      .kv_heads = static_cast<std::int64_t>(Hkv), .sequence = static_cast<std::int64_t>(s),
      .head_dim = static_cast<std::int64_t>(d), .element_bytes = e, .on_device = !plan.on_host(),
      .options = {.host_threads = static_cast<int>(plan.host_threads)}};
  add("attention.logsumexp", attention::saved_bytes(attention::forward_arguments{attention_problem}) - e * T * qw);
  const std::uint64_t saved_to_attention = a.saved_bytes;
  linear(linear_module::o, qw, "o_proj.input");
  const std::uint64_t saved_to_o = a.saved_bytes;
  add("mlp_norm.input", e * T * h);
  add("mlp_norm.rstd", 4 * T);
  const module_set mlp = linear_module::gate | linear_module::up | static_cast<module_set>(linear_module::down);
  const bool tiled = plan.mlp_token_chunk > 0;
  const std::uint64_t mlp_rows = tiled && plan.mlp_token_chunk < T ? plan.mlp_token_chunk : T;
  std::uint64_t mlp_workspace = memkit_linear_workspace_bytes(m, plan, mlp);
  if (!tiled) {
    linear(linear_module::gate, h, "gate_proj.input");
    linear(linear_module::up, h, "up_proj.input");
    add("swiglu.input", e * T * 2 * f);
    linear(linear_module::down, f, "down_proj.input");
  } else {
    add("mlp.input", e * T * h);
    // What one chunk's sub-layers save (into the workspace), as `linear` above counts it for T tokens.
    auto chunk_saved = [&](linear_module module, std::uint64_t in) -> std::uint64_t {
      if (!plan.lora_training()) return round_up(e * mlp_rows * in, g);
      if (!contains(plan.lora.targets, static_cast<module_set>(module))) return 0;
      const lora::saved_bytes_parts adapter = lora::saved_activation_bytes(
          static_cast<std::int64_t>(mlp_rows), static_cast<std::int64_t>(in), static_cast<std::int64_t>(plan.lora.rank), e);
      return round_up(adapter.adapter_input, g) + round_up(adapter.adapter_output, g) + round_up(adapter.record, g);
    };
    auto chunk_workspace = [&](linear_module module) {
      return round_up(memkit_linear_workspace_bytes(m, plan, static_cast<module_set>(module), mlp_rows), g);
    };
    const std::uint64_t gate_saved = chunk_saved(linear_module::gate, h);
    const std::uint64_t up_saved = gate_saved + chunk_saved(linear_module::up, h);
    const std::uint64_t all_saved = up_saved + round_up(e * mlp_rows * 2 * f, g) + chunk_saved(linear_module::down, f);
    mlp_workspace = max_of(max_of(gate_saved + chunk_workspace(linear_module::gate), up_saved + chunk_workspace(linear_module::up)),
                           all_saved + chunk_workspace(linear_module::down));
  }

  auto piece_of = [&](std::uint64_t rows, std::uint64_t width) { return round_up((e * rows * width + 63) / 64 * 64, g); };
  auto piece = [&](std::uint64_t width) { return piece_of(T, width); };
  const std::uint64_t mlp_pieces = piece_of(mlp_rows, 2 * f) + piece_of(mlp_rows, f);  // gate|up and a (da, dgu)
  const std::uint64_t forward_scratch = 5 * piece(h) + 2 * piece(qw) + 2 * piece(kvw) + mlp_pieces;
  const std::uint64_t backward_scratch = mlp_pieces + 4 * piece(h) + 4 * piece(qw) + 4 * piece(kvw);
  const auto attention_linears = static_cast<module_set>(all_linear_modules & ~mlp);
  const std::uint64_t linears = max_of(memkit_linear_workspace_bytes(m, plan, attention_linears), mlp_workspace);
  const std::uint64_t attention_forward = attention::workspace_bytes(attention::forward_arguments{attention_problem});
  const std::uint64_t attention_backward = attention::workspace_bytes(attention::backward_arguments{attention_problem});
  a.forward_transient = forward_scratch + round_up(max_of(linears, attention_forward), g);
  a.backward_transient = backward_scratch + round_up(max_of(linears, attention_backward), g);
  // The phases of memkit/models/llama/block.hpp's backward: the MLP (down, SwiGLU, up, gate, mlp_norm), o_proj,
  // attention, then q/k/v and attn_norm; each starts once the phases before it have released their saved tensors.
  const module_set qkv = linear_module::q | linear_module::k | static_cast<module_set>(linear_module::v);
  const std::uint64_t phase_workspace[block_activations::backward_phase_count] = {
      mlp_workspace, memkit_linear_workspace_bytes(m, plan, static_cast<module_set>(linear_module::o)),
      attention_backward, memkit_linear_workspace_bytes(m, plan, qkv)};
  const std::uint64_t released[block_activations::backward_phase_count] = {
      0, a.saved_bytes - saved_to_o, a.saved_bytes - saved_to_attention, a.saved_bytes - saved_to_qkv};
  // The forward's phases run with the saved tensors of the block so far: q/k/v's workspace once the projections
  // have saved theirs, attention once q, k, v, its output and log-sum-exp are saved, o_proj's after its input,
  // the MLP's with everything saved (the tiled MLP saves its input before its chunks).
  const std::uint64_t forward_workspace[block_activations::backward_phase_count] = {
      mlp_workspace, phase_workspace[1], attention_forward, phase_workspace[3]};
  for (int i = 0; i < block_activations::backward_phase_count; ++i) {
    a.backward_released[i] = released[i];
    a.backward_phase_transient[i] = backward_scratch + round_up(phase_workspace[i], g);
    a.forward_unsaved[i] = released[i];
    a.forward_phase_transient[i] = forward_scratch + round_up(forward_workspace[i], g);
  }
  return a;
}

// Activations saved outside the blocks: rotary tables, embedding dropout, the final norm and the
// LM head's input.
constexpr std::uint64_t model_level_activation_bytes(const model_config& m, const training_plan& plan) noexcept {
  const std::uint64_t g = plan.overhead.allocation_granularity;
  const std::uint64_t e = plan.stream_bytes();
  const std::uint64_t T = plan.tokens(), h = m.hidden;
  const bool llama = !m.is_gpt2();
  const bool upcast = llama && plan.fp32_norm_and_softmax && e == 2 && !plan.memkit_runtime();
  std::uint64_t total = 0;
  if (llama) total += 2 * round_up(e * T * m.head_dim, g);  // cos and sin
  if (m.dropout) total += round_up(T * h, g);                // embedding dropout mask
  total += round_up((upcast ? 4 : e) * T * h, g) + round_up((llama ? 4 : 8) * T, g);  // final norm
  if (!plan.lora_training()) {
    if (upcast) total += round_up(e * T * h, g);
    if (!detail::loss_grad_in_forward(plan)) total += round_up(e * T * h, g);  // lm_head input
  } else if (plan.lightning_bnb && plan.quantized_matmul_keeps_input && !m.tied_embeddings) {
    total += round_up(e * T * h, g);  // the quantized LM head's MatMul4Bit keeps its input (bitsandbytes < 0.43.2)
  }
  return total;
}

// Logits and cross-entropy, in three moments: the most alive during the loss's forward, what stays
// alive into backward, and the most alive during its backward.
struct logits_bytes {
  std::uint64_t forward_peak = 0;
  std::uint64_t saved = 0;
  std::uint64_t backward_peak = 0;
  // PyTorch's caching allocator at the loss's backward peak: the segments it holds for the loss, live or
  // cached. A [tokens, vocab] tensor of 10 MiB or more gets a segment of its own, and a freed one serves a
  // later request of another size only if it is larger; the difference to backward_peak is reserved, not
  // allocated.
  std::uint64_t reserved_at_backward_peak = 0;
};

constexpr logits_bytes logits_activation_bytes(const model_config& m, const training_plan& plan) noexcept {
  const std::uint64_t e = plan.activation_bytes();
  const std::uint64_t TV = plan.tokens() * m.vocab;
  logits_bytes l;
  switch (plan.logits) {
    case logits_mode::fp32:
      if (e == 4) {
        l.forward_peak = TV * (4 + 4);  // logits (`.float()` returns them), log-softmax
        l.saved = TV * 4;               // the log-softmax (below: nothing keeps the logits)
        l.backward_peak = TV * (4 + 4 + 4);
        // The logits' freed segment takes nll_loss's gradient; log_softmax's gradient needs a new one.
        l.reserved_at_backward_peak = l.backward_peak;
      } else {
        // transformers' ForCausalLMLoss: `logits.float()`, then cross_entropy (log_softmax + nll_loss).
        l.forward_peak = TV * (e + 4 + 4);  // 16-bit logits, their fp32 copy, fp32 log-softmax
        // Only the log-softmax (saved by log_softmax and nll_loss) outlives forward: nothing saves the 16-bit
        // logits (the frozen or trained head's backward needs its input, not its output; the upcast's backward
        // saves nothing), and the loop keeps the loss, not the model's output (the Trainer's compute_loss
        // returns `outputs["loss"]`; torchtune `del logits` before backward), so the 16-bit logits and the fp32
        // copy are freed when the loss returns. Measured on an H200 (tests/data/budget_measured): counting the
        // 16-bit logits into backward predicted Qwen2.5-0.5B (vocabulary 151,936) 2 x T x V bytes too high.
        l.saved = TV * 4;
        l.backward_peak = TV * (4 + 4 + 4);  // + nll_loss's gradient and log_softmax's gradient, both fp32
        // The fp32 copy's freed segment takes nll_loss's gradient, log_softmax's gradient a new one; the 16-bit
        // logits' freed segment is too small for either and stays cached (it takes their 16-bit gradient).
        l.reserved_at_backward_peak = TV * (e + 4 + 4 + 4);
      }
      break;
    case logits_mode::half:
      l.forward_peak = TV * 2 * e;
      l.saved = TV * 2 * e;
      l.backward_peak = TV * 4 * e;
      break;
    case logits_mode::chunked:
      if (!plan.memkit_runtime()) {
        // torchtune's CEWithChunkedOutputLoss: the output projection runs on `logits_output_chunks` chunks of
        // the sequence and every 16-bit chunk is kept (they are the model's output, and the loss's backward
        // needs them). The recipes torch.compile the per-chunk cross-entropy (training.compile_loss), so the
        // fp32 upcast is fused into the kernel: it keeps an fp32 log-sum-exp per token, and its backward
        // writes one chunk's 16-bit logits gradient at a time. (Uncompiled, each chunk's fp32 log-softmax
        // would be kept for backward: close to `fp32`.)
        const std::uint64_t chunks = plan.logits_output_chunks < plan.sequence ? plan.logits_output_chunks : plan.sequence;
        const std::uint64_t chunk_tokens = plan.micro_batch * ((plan.sequence + chunks - 1) / chunks);
        const std::uint64_t chunk = chunk_tokens * m.vocab;
        l.forward_peak = TV * e + 4 * plan.tokens();
        l.saved = l.forward_peak;
        l.backward_peak = l.saved + e * chunk;
        break;
      }
      [[fallthrough]];
    case logits_mode::fused:
      if (!plan.memkit_runtime()) {
        // Liger's LigerFusedLinearCrossEntropy (liger_kernel/ops/fused_linear_cross_entropy.py): tokens in
        // chunks of next_power_of_2(ceil(T / ceil(V / H))) (at most T), so a chunk's logits are about T x H
        // values; each chunk's 16-bit logits become their gradient in place and are multiplied into
        // grad_input [T, H] (16-bit) during forward; fp32 per-token losses [T]. Full training also allocates
        // the head's gradient [V, H] in forward. Backward only scales grad_input.
        const std::uint64_t T = plan.tokens(), H = m.hidden, V = m.vocab;
        const std::uint64_t factor = (V + H - 1) / H;
        std::uint64_t rows = (T + factor - 1) / factor, chunk_tokens = 1;
        while (chunk_tokens < rows) chunk_tokens *= 2;
        if (chunk_tokens > T) chunk_tokens = T;
        const std::uint64_t head_grad = plan.lora_training() ? 0 : plan.gradient_bytes() * V * H;
        l.forward_peak = e * chunk_tokens * V + e * T * H + 4 * T + head_grad;
        l.saved = e * T * H;
        l.backward_peak = e * T * H;
        break;
      }
      {
      // memkit's loss::fused_linear_cross_entropy on a device, its chunk budget set to hold
      // logits_chunk_tokens tokens: its exact workspace (one chunk's fp32 logits and 16-bit gradient, the
      // per-token losses), plus the gradient of the hidden states it produces in forward.
      const std::uint64_t chunk = (plan.logits_chunk_tokens < plan.tokens() ? plan.logits_chunk_tokens : plan.tokens());
      loss::cross_entropy_options options;
      options.chunk_bytes = loss::detail::chunk_row_bytes(static_cast<std::int64_t>(m.vocab), e, true) * chunk;
      l.forward_peak = loss::workspace_bytes(loss::fused_linear_cross_entropy_arguments{
                           .tokens = static_cast<std::int64_t>(plan.tokens()), .hidden = static_cast<std::int64_t>(m.hidden),
                           .vocab = static_cast<std::int64_t>(m.vocab), .hidden_element_bytes = e,
                           .head_grad = !plan.lora_training(), .on_device = true, .options = options}) +
                       e * plan.tokens() * m.hidden;
      l.saved = e * plan.tokens() * m.hidden;
      l.backward_peak = l.saved;
      break;
      }
    case logits_mode::cut: {
      // Cut Cross-Entropy (apple/ml-cross-entropy, cce.py): forward computes the fp32 log-sum-exp per token
      // [T] and the target logits [T] without any logits in memory, plus the fp32 average logit per vocabulary
      // entry [V] for gradient filtering (filter_eps "auto"); it saves its input e [T, H] (with LoRA nothing
      // else keeps it), lse and the averages. Backward adds an int32 vocabulary ordering [V] and de [T, H].
      const std::uint64_t T = plan.tokens(), H = m.hidden, V = m.vocab;
      const std::uint64_t input = plan.lora_training() ? e * T * H : 0;
      l.forward_peak = input + 8 * T + 4 * V;
      l.saved = input + 4 * T + 4 * V;
      l.backward_peak = l.saved + 4 * V + e * T * H;
      break;
    }
  }
  const std::uint64_t g = plan.overhead.allocation_granularity;
  l.forward_peak = round_up(l.forward_peak, g);
  l.saved = round_up(l.saved, g);
  l.backward_peak = round_up(l.backward_peak, g);
  l.reserved_at_backward_peak = max_of(round_up(l.reserved_at_backward_peak, g), l.backward_peak);
  return l;
}

}  // namespace budget
MEMKIT_NAMESPACE_END
