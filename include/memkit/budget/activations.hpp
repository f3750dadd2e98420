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

#include "memkit/attention/flash_attention.hpp"
#include "memkit/budget/model.hpp"
#include "memkit/budget/plan.hpp"
#include "memkit/lora/lora_memory.hpp"
#include "memkit/loss/fused_linear_cross_entropy.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace budget {

struct saved_tensor {
  std::string_view name;
  std::uint64_t bytes = 0;
};

struct block_activations {
  saved_tensor items[40]{};
  int count = 0;
  std::uint64_t saved_bytes = 0;         // kept from the block's forward to its backward
  std::uint64_t forward_transient = 0;   // largest temporary alive inside the block's forward
  std::uint64_t backward_transient = 0;  // gradient temporaries alive inside the block's backward

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
constexpr bool keeps_linear_input(const training_plan& plan, module_set modules) noexcept {
  if (!plan.lora_training()) return true;
  const bool four_bit = plan.weights.format == weight_format::nf4 || plan.weights.format == weight_format::fp4;
  if (four_bit && plan.quantized_matmul_keeps_input) return true;
  return contains(plan.lora.targets, modules) && !plan.lora.dropout;
}
}  // namespace detail

// The saved tensors of one block for `plan`'s micro-batch and sequence.
constexpr block_activations block_activation_bytes(const model_config& m, const training_plan& plan) noexcept {
  block_activations a;
  const std::uint64_t g = plan.overhead.allocation_granularity;
  const std::uint64_t e = plan.stream_bytes();
  const std::uint64_t b = plan.micro_batch, s = plan.sequence, T = b * s;
  const std::uint64_t h = m.hidden, H = m.heads, d = m.head_dim, f = m.intermediate;
  const bool llama = !m.is_gpt2();
  const bool upcast = llama && plan.fp32_norm_and_softmax && e == 2;
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
  // The dropped input and the A output are lora_linear's own saved tensors (lora/lora_memory.hpp); the 1-byte
  // mask is PEFT's (nn.Dropout keeps it; lora_linear draws it again in backward instead).
  auto lora = [&](module_set modules, std::uint64_t in, std::string_view dropped, std::string_view mask,
                  std::string_view down_projection) {
    if (!plan.lora_training() || !contains(plan.lora.targets, modules)) return;
    const lora::saved_bytes_parts adapter = lora::saved_activation_bytes(
        static_cast<std::int64_t>(T), static_cast<std::int64_t>(in), static_cast<std::int64_t>(plan.lora.rank), e);
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
    add("attention.logsumexp", attention::forward_saved_bytes(b, H, s, d, qkv_e) - qkv_e * T * H * d);
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
                  attention::backward_workspace_bytes(b, H, m.kv_heads, s, d, e, {}, /*on_device=*/true);
  std::uint64_t mlp_grads = m.gated_mlp() ? 3 * e * T * f : 2 * e * T * f;
  if (upcast) mlp_grads = max_of(mlp_grads, 3 * 4 * T * h);
  a.backward_transient = 2 * e * T * h + max_of(attention_grads, mlp_grads);
  return a;
}

// Activations saved outside the blocks: rotary tables, embedding dropout, the final norm and the
// LM head's input.
constexpr std::uint64_t model_level_activation_bytes(const model_config& m, const training_plan& plan) noexcept {
  const std::uint64_t g = plan.overhead.allocation_granularity;
  const std::uint64_t e = plan.stream_bytes();
  const std::uint64_t T = plan.tokens(), h = m.hidden;
  const bool llama = !m.is_gpt2();
  const bool upcast = llama && plan.fp32_norm_and_softmax && e == 2;
  std::uint64_t total = 0;
  if (llama) total += 2 * round_up(e * T * m.head_dim, g);  // cos and sin
  if (m.dropout) total += round_up(T * h, g);                // embedding dropout mask
  total += round_up((upcast ? 4 : e) * T * h, g) + round_up((llama ? 4 : 8) * T, g);  // final norm
  if (!plan.lora_training()) {
    if (upcast) total += round_up(e * T * h, g);
    if (plan.logits != logits_mode::chunked) total += round_up(e * T * h, g);  // lm_head input
  }
  return total;
}

// Logits and cross-entropy, in three moments: the most alive during the loss's forward, what stays
// alive into backward, and the most alive during its backward.
struct logits_bytes {
  std::uint64_t forward_peak = 0;
  std::uint64_t saved = 0;
  std::uint64_t backward_peak = 0;
};

constexpr logits_bytes logits_activation_bytes(const model_config& m, const training_plan& plan) noexcept {
  const std::uint64_t e = plan.activation_bytes();
  const std::uint64_t TV = plan.tokens() * m.vocab;
  logits_bytes l;
  switch (plan.logits) {
    case logits_mode::fp32:
      if (e == 4) {
        l.forward_peak = TV * (4 + 4);   // logits, log-softmax
        l.saved = TV * (4 + 4);
        l.backward_peak = TV * (4 + 4 + 4);
      } else {
        l.forward_peak = TV * (e + 4 + 4);  // 16-bit logits, their fp32 copy, fp32 log-softmax
        l.saved = TV * (e + 4);             // the 16-bit logits stay in the output; log-softmax for backward
        l.backward_peak = TV * (e + 4 + 4 + 4);  // + gradient of the log-probabilities and of the fp32 logits
      }
      break;
    case logits_mode::half:
      l.forward_peak = TV * 2 * e;
      l.saved = TV * 2 * e;
      l.backward_peak = TV * 4 * e;
      break;
    case logits_mode::chunked: {
      // memkit's loss::fused_linear_cross_entropy on a device, its chunk budget set to hold
      // logits_chunk_tokens tokens: its exact workspace (one chunk's fp32 logits and 16-bit gradient, the
      // per-token losses), plus the gradient of the hidden states it produces in forward.
      const std::uint64_t chunk = (plan.logits_chunk_tokens < plan.tokens() ? plan.logits_chunk_tokens : plan.tokens());
      loss::cross_entropy_options options;
      options.chunk_bytes = loss::detail::chunk_row_bytes(static_cast<std::int64_t>(m.vocab), e, true) * chunk;
      l.forward_peak = loss::fused_linear_cross_entropy_workspace_bytes(
                           static_cast<std::int64_t>(plan.tokens()), static_cast<std::int64_t>(m.hidden),
                           static_cast<std::int64_t>(m.vocab), e, options,
                           {.on_device = true, .head_grad = !plan.lora_training()}) +
                       e * plan.tokens() * m.hidden;
      l.saved = e * plan.tokens() * m.hidden;
      l.backward_peak = l.saved;
      break;
    }
  }
  const std::uint64_t g = plan.overhead.allocation_granularity;
  l.forward_peak = round_up(l.forward_peak, g);
  l.saved = round_up(l.saved, g);
  l.backward_peak = round_up(l.backward_peak, g);
  return l;
}

}  // namespace budget
MEMKIT_NAMESPACE_END
