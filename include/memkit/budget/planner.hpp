// memkit/budget/planner.hpp — which techniques make a training run fit, and how big it can get.
//
// plan_ladder() walks, cheapest in speed first, each rung adding one technique to the last rung that
// lowered the peak:
//   1 bf16            full training, bf16 weights and gradients, fp32 master weights, AdamW   (x1.0)
//   2 8-bit optimizer + blockwise 8-bit AdamW (bitsandbytes: same speed as 32-bit AdamW)      (x1.0)
//   3 step in bwd     + the optimizer step fused into backward (torchtune optimizer_in_bwd):
//                       one gradient alive instead of all; needs gradient accumulation 1       (x1.0)
//   4 fused loss      + linear and cross-entropy fused, the logits never held (Liger)        (x1.0)
//   5 checkpointing   + activation checkpointing of every layer: one more forward            (x1.33)
//   6 micro-batch     + the largest smaller micro-batch that fits, gradient accumulation keeping the
//                       effective batch (micro-batch 1 when none fits; the step leaves backward) (~x1.1)
//   7 QLoRA           NF4 base (block 64, double quantization), LoRA r=16 on all seven linears,
//                       AdamW on the adapters, checkpointing, micro-batch chosen as in 6       (x1.33 x1.3)
//   8 CPU offload     + optimizer state and base weights on the host, streamed per layer   (PCIe traffic)
// A technique that does not lower the peak is not applied: its rung says "no effect" and why, and the
// next rung builds on the last one that helped. Every rung reports its estimate, its speed factor and
// whether it fits; the first that fits is chosen. The workload (micro-batch, sequence, gradient
// accumulation, attention, GPUs, ZeRO, overheads, runtime) comes from the caller's plan.
// The speed factors are rough (docs/memory_budget.md, "The planner's ladder", says where each comes from).
#pragma once

#include <cstdint>
#include <string_view>

#include "memkit/budget/estimate.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace budget {

namespace detail {
// Bisection on [good, bad): `fits(good)` holds and `fits(bad)` does not (or bad is past the limit).
// Returns the largest value that fits, assuming fitting is monotone.
template <class Fits>
constexpr std::uint64_t largest_fitting(Fits&& fits, std::uint64_t good, std::uint64_t bad) {
  while (bad - good > 1) {
    const std::uint64_t mid = good + (bad - good) / 2;
    (fits(mid) ? good : bad) = mid;
  }
  return good;
}
}  // namespace detail

// The largest micro-batch (or sequence) for which `plan` fits `gpu`; 0 when even 1 does not.
// A micro-batch has no natural bound (the limit is far above any that fits), so doubling from 1
// brackets it before the bisection.
// `which` is the figure held against the GPU's memory (budget/allocator.hpp; device by default).
constexpr std::uint64_t max_micro_batch(const model_config& m, training_plan plan, const gpu_spec& gpu,
                                        std::uint64_t limit = 1u << 20, metric which = metric::device) noexcept {
  auto fits_with = [&](std::uint64_t batch) {
    plan.micro_batch = batch;
    return check_fit(m, plan, gpu, which).fits;
  };
  if (!fits_with(1)) return 0;
  std::uint64_t good = 1, bad = 2;
  while (bad <= limit && fits_with(bad)) {
    good = bad;
    bad *= 2;
  }
  if (bad > limit) bad = limit + 1;
  return detail::largest_fitting(fits_with, good, bad);
}

// The longest sequence that fits, up to the model's max_positions (its trained context). That bound
// is tried first, then [1, bound) is bisected.
constexpr std::uint64_t max_sequence(const model_config& m, training_plan plan, const gpu_spec& gpu,
                                     metric which = metric::device) noexcept {
  const std::uint64_t limit = m.max_positions != 0 ? m.max_positions : (1u << 22);
  auto fits_with = [&](std::uint64_t sequence) {
    plan.sequence = sequence;
    return check_fit(m, plan, gpu, which).fits;
  };
  if (!fits_with(1)) return 0;
  if (fits_with(limit)) return limit;
  return detail::largest_fitting(fits_with, 1, limit);
}

enum class rung_kind : std::uint8_t {
  bf16,
  optimizer_8bit,
  optimizer_in_backward,
  fused_loss,
  checkpointing,
  smaller_micro_batch,
  qlora,
  cpu_offload
};
inline constexpr int rung_count = 8;

constexpr std::string_view to_string(rung_kind r) noexcept {
  switch (r) {
    case rung_kind::bf16: return "bf16";
    case rung_kind::optimizer_8bit: return "+ 8-bit AdamW";
    case rung_kind::optimizer_in_backward: return "+ optimizer step in backward";
    case rung_kind::fused_loss: return "+ fused linear cross-entropy";
    case rung_kind::checkpointing: return "+ activation checkpointing";
    case rung_kind::smaller_micro_batch: return "+ smaller micro-batch";
    case rung_kind::qlora: return "QLoRA";
    case rung_kind::cpu_offload: return "+ CPU offload";
  }
  return "?";
}

// --- Speed: rough factors on the time of a training step (docs/memory_budget.md). ---
namespace speed {
// Full recomputation runs every layer's forward twice; a forward is about a third of forward + backward
// (backward computes two products per forward product): (1 + 2 + 1) / (1 + 2).
inline constexpr double recompute = 4.0 / 3.0;
// bitsandbytes' 8-bit blockwise AdamW runs at the speed of 32-bit AdamW (Dettmers et al. 2022, "8-bit
// Optimizers via Block-wise Quantization"); the step is a small share of a training step anyway.
inline constexpr double optimizer_8bit = 1.0;
// The optimizer step in backward does the same updates, one parameter at a time as its gradient is ready.
inline constexpr double optimizer_in_backward = 1.0;
// Liger's fused linear cross-entropy does the same products as the unfused head and loss, chunk by chunk.
inline constexpr double fused_loss = 1.0;
// Smaller micro-batches with accumulation do the same work in more, smaller kernels: a rough 10%.
inline constexpr double smaller_micro_batch = 1.1;
// NF4 weights are dequantized in every forward and backward product: a rough 30% over 16-bit LoRA.
inline constexpr double nf4_dequantization = 1.3;
// Host <-> device copies: PCIe 4.0 x16 moves about 25 GB/s in practice (32 GB/s theoretical); the
// transfers are counted as not overlapped with compute, an upper bound on their cost.
inline constexpr double pcie_bytes_per_second = 25e9;
// Share of the GPU's dense bf16 tensor throughput a training step achieves (model FLOPs utilization).
inline constexpr double model_flops_utilization = 0.4;

// Dense bf16 (fp16 on the T4) tensor-core throughput with fp32 accumulation, from the vendors' data sheets
// (without sparsity); 100 TFLOP/s for a GPU not listed.
constexpr double dense_tflops(std::string_view gpu) noexcept {
  struct entry {
    std::string_view name;
    double tflops;
  };
  constexpr entry table[] = {{"t4", 65},      {"l4", 121},        {"a10", 125},       {"rtx3090", 71},
                             {"rtx4090", 165}, {"a100-40gb", 312}, {"a100-80gb", 312}, {"h100-80gb", 989},
                             {"h200", 989},    {"b200", 2250}};
  for (const entry& e : table)
    if (e.name == gpu) return e.tflops;
  return 100;
}

// Compute of one optimizer step in FLOPs: 2 per parameter and token for the forward, 2 for the input
// gradient, 2 more for the weight gradient of trained weights (LoRA: only the adapters'), and one more
// forward where the layers are recomputed.
constexpr double step_flops(const model_config& m, const training_plan& p) noexcept {
  const double parameters = static_cast<double>(parameter_count(m));
  const double tokens = static_cast<double>(p.tokens() * p.grad_accum);
  const double trained = p.lora_training() ? 0.0 : parameters;
  double flops = (4.0 * parameters + 2.0 * trained) * tokens;
  if (p.checkpoint != checkpointing::none) flops += 2.0 * parameters * tokens;
  return flops;
}

// Bytes a step moves between host and device with CPU offload: gradients down and updated weights up
// once per step; with the parameters offloaded, every layer's weights up again for each forward,
// recomputation and backward of every micro-batch.
constexpr std::uint64_t offload_traffic_bytes(const memory_estimate& e, const training_plan& p) noexcept {
  if (p.placement != optimizer_placement::host) return 0;
  const std::uint64_t trainable = e.trainable_parameters;
  std::uint64_t bytes = trainable * (p.gradient_bytes() + p.activation_bytes());
  if (p.offload_parameters) {
    const std::uint64_t passes = 2 + (p.checkpoint != checkpointing::none ? 1 : 0);
    bytes += passes * p.grad_accum * e.host[category::weights];
  }
  return bytes;
}
}  // namespace speed

struct ladder_rung {
  rung_kind kind = rung_kind::bf16;
  training_plan plan{};
  memory_estimate estimate{};
  bool fits = false;
  bool effective = true;    // false: the technique did not lower the peak and was not applied
  std::string_view reason;  // why not, when !effective
  double speed_factor = 1.0;      // this rung's own rough cost on step time
  double total_speed_factor = 1.0;  // the plan's, against the bf16 rung
  std::uint64_t host_traffic_bytes = 0;  // per optimizer step, with CPU offload
};

struct ladder {
  ladder_rung rungs[rung_count]{};
  int first_fit = -1;  // index of the first rung that fits, -1 when none does
  std::uint64_t available_bytes = 0;
  constexpr const ladder_rung* chosen() const noexcept { return first_fit < 0 ? nullptr : &rungs[first_fit]; }
};

namespace detail {
// Largest micro-batch <= the workload's that fits, keeping micro_batch * grad_accum at least the
// workload's effective batch.
// The optimizer step in backward needs gradient accumulation 1: when a smaller micro-batch needs
// accumulation, the search runs again with the step after backward.
constexpr training_plan shrink_micro_batch(const model_config& m, training_plan plan, const gpu_spec& gpu) noexcept {
  const std::uint64_t effective = plan.micro_batch * plan.grad_accum;
  std::uint64_t batch = max_micro_batch(m, plan, gpu, plan.micro_batch);
  if (batch == 0) batch = 1;
  if (plan.optimizer_in_backward && ceil_div(effective, batch) > 1) {
    plan.optimizer_in_backward = false;
    batch = max_micro_batch(m, plan, gpu, plan.micro_batch);
    if (batch == 0) batch = 1;
  }
  plan.micro_batch = batch;
  plan.grad_accum = ceil_div(effective, batch);
  return plan;
}

// Why `kind` did not lower the peak of `before` (the last effective rung's estimate).
constexpr std::string_view no_effect_reason(rung_kind kind, const training_plan& before, const memory_estimate& e,
                                            bool fits) noexcept {
  const bool at_step = e.peak_phase == step_phase::optimizer_step;
  switch (kind) {
    case rung_kind::optimizer_8bit:
      if (before.optimizer == optimizer_kind::none) return "no optimizer state to shrink";
      return "the optimizer state does not set the peak";
    case rung_kind::optimizer_in_backward:
      if (before.memkit_runtime()) return "memkit's adam_state steps once after backward";
      if (before.grad_accum > 1) return "it needs gradient accumulation 1 (the workload accumulates)";
      if (before.placement == optimizer_placement::host) return "the optimizer runs on the host";
      if (!at_step) return "the gradients are not what sets the peak";
      return "one gradient and its step temporaries cost as much as the step did";
    case rung_kind::fused_loss:
      if (loss_grad_in_forward(before)) return "the loss is fused already";
      if (at_step) return "the peak is the optimizer step, where no logits are alive";
      return "the logits are not part of the peak";
    case rung_kind::checkpointing:
      if (before.checkpoint != checkpointing::none) return "the layers are checkpointed already";
      if (at_step) return "the peak is the optimizer step, where no activations are alive";
      return "the saved activations are not what sets the peak";
    case rung_kind::smaller_micro_batch:
      if (before.micro_batch == 1) return "the micro-batch is already 1";
      if (fits) return "the plan already fits at its micro-batch";
      if (at_step) return "the peak is the optimizer step, which does not depend on the micro-batch";
      return "no smaller micro-batch lowers the peak";
    case rung_kind::qlora: return "QLoRA needs more than the full-training rungs here";
    case rung_kind::cpu_offload: return "offloading does not lower the device peak here";
    case rung_kind::bf16: break;
  }
  return "";
}
// The workload with every memory technique the ladder chooses turned off: bf16 mixed precision, plain AdamW
// on the device, nothing offloaded, the step after the backward. Each starting point sets the rest.
constexpr training_plan without_techniques(training_plan p) noexcept {
  p.precision = precision_mode::bf16_mixed;
  p.optimizer = optimizer_kind::adamw;
  p.placement = optimizer_placement::device;
  p.offload_parameters = false;
  p.optimizer_in_backward = false;
  p.offload_checkpoints = false;
  return p;
}
}  // namespace detail

constexpr ladder plan_ladder(const model_config& m, const gpu_spec& gpu, const training_plan& workload) noexcept {
  ladder out;
  out.available_bytes = gpu.memory_bytes;
  training_plan base = detail::without_techniques(workload);
  base.training = method::full;
  base.weights = weight_storage{weight_format::bf16};
  base.checkpoint = checkpointing::none;
  if (base.memkit_runtime() && (base.logits == logits_mode::fp32 || base.logits == logits_mode::half ||
                                base.logits == logits_mode::cut))
    base.logits = logits_mode::chunked;  // memkit's loss is the fused one

  const double tflops = speed::dense_tflops(gpu.name);
  auto compute_seconds = [&](const training_plan& p) {
    return speed::step_flops(m, p) / (tflops * 1e12 * speed::model_flops_utilization);
  };

  training_plan current = base;  // the last plan that lowered the peak
  memory_estimate current_estimate{};
  double current_speed = 1.0;
  auto settle = [&](int i, rung_kind kind, const training_plan& candidate, double factor) {
    ladder_rung& r = out.rungs[i];
    r.kind = kind;
    const memory_estimate e = estimate_memory(m, candidate);
    const bool first = i == 0;
    // QLoRA and offload change the method; they are kept whenever they are valid and lower the peak.
    r.effective = first || (e.valid() && e.peak_device_bytes < current_estimate.peak_device_bytes);
    if (r.effective) {
      if (kind == rung_kind::cpu_offload) {
        r.host_traffic_bytes = speed::offload_traffic_bytes(e, candidate);
        const double compute = compute_seconds(candidate);
        factor = compute > 0 ? 1.0 + static_cast<double>(r.host_traffic_bytes) / speed::pcie_bytes_per_second / compute
                             : 1.0;
      }
      current = candidate;
      current_estimate = e;
      current_speed *= factor;
      r.speed_factor = factor;
    } else {
      r.reason = detail::no_effect_reason(kind, current, current_estimate,
                                          current_estimate.peak_device_bytes <= gpu.memory_bytes);
      r.speed_factor = 1.0;
    }
    r.plan = current;
    r.estimate = current_estimate;
    r.total_speed_factor = current_speed;
    r.fits = current_estimate.valid() && current_estimate.peak_device_bytes <= gpu.memory_bytes;
    if (r.fits && out.first_fit < 0) out.first_fit = i;
  };

  settle(0, rung_kind::bf16, base, 1.0);
  training_plan p = current;
  p.optimizer = optimizer_kind::adamw_8bit;
  settle(1, rung_kind::optimizer_8bit, p, speed::optimizer_8bit);
  p = current;
  p.optimizer_in_backward = true;
  settle(2, rung_kind::optimizer_in_backward, p, speed::optimizer_in_backward);
  p = current;
  p.logits = logits_mode::fused;
  settle(3, rung_kind::fused_loss, p, speed::fused_loss);
  p = current;
  p.checkpoint = checkpointing::every_layer;
  settle(4, rung_kind::checkpointing, p, speed::recompute);
  p = detail::shrink_micro_batch(m, current, gpu);
  settle(5, rung_kind::smaller_micro_batch, p, speed::smaller_micro_batch);

  // QLoRA starts again from the workload's batch, with the loss chosen above.
  training_plan q = detail::without_techniques(workload);
  q.training = method::lora;
  q.weights = weight_storage{weight_format::nf4, 64, true};
  q.lora = lora_settings{16, all_linear_modules, false};
  q.checkpoint = checkpointing::every_layer;
  q.logits = current.logits;
  q = detail::shrink_micro_batch(m, q, gpu);
  // Against the bf16 rung: recomputation and dequantization (and whatever micro-batch it needed).
  const double qlora_total = speed::recompute * speed::nf4_dequantization *
                             (q.micro_batch < workload.micro_batch ? speed::smaller_micro_batch : 1.0);
  settle(6, rung_kind::qlora, q, qlora_total / current_speed);
  q = current;
  if (q.lora_training()) {
    q.placement = optimizer_placement::host;
    q.offload_parameters = true;
    q = detail::shrink_micro_batch(m, q, gpu);
  }
  settle(7, rung_kind::cpu_offload, q, 1.0);
  if (!q.lora_training() && !out.rungs[7].effective) out.rungs[7].reason = "offload follows QLoRA, which had no effect";
  return out;
}

}  // namespace budget
MEMKIT_NAMESPACE_END
