// memkit/budget/planner.hpp — which techniques make a training run fit, and how big it can get.
//
// plan_ladder() walks, cumulatively:
//   1 bf16            full training, bf16 weights and gradients, fp32 master weights, AdamW
//   2 checkpointing   + activation checkpointing of every layer
//   3 8-bit optimizer + blockwise 8-bit AdamW
//   4 micro-batch     + the largest smaller micro-batch that fits, gradient accumulation keeping the
//                       effective batch (micro-batch 1 when none fits)
//   5 QLoRA           NF4 base (block 64, double quantization), LoRA r=16 on all seven linears,
//                       AdamW on the adapters, checkpointing, micro-batch chosen as in 4
//   6 CPU offload     + optimizer state and base weights on the host, streamed per layer
// and reports every rung's estimate and the first that fits. The workload (micro-batch, sequence,
// gradient accumulation, attention, logits, GPUs, ZeRO, overheads) comes from the caller's plan.
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

enum class rung_kind : std::uint8_t { bf16, checkpointing, optimizer_8bit, smaller_micro_batch, qlora, cpu_offload };
inline constexpr int rung_count = 6;

constexpr std::string_view to_string(rung_kind r) noexcept {
  switch (r) {
    case rung_kind::bf16: return "bf16";
    case rung_kind::checkpointing: return "+ activation checkpointing";
    case rung_kind::optimizer_8bit: return "+ 8-bit AdamW";
    case rung_kind::smaller_micro_batch: return "+ smaller micro-batch";
    case rung_kind::qlora: return "QLoRA";
    case rung_kind::cpu_offload: return "+ CPU offload";
  }
  return "?";
}

struct ladder_rung {
  rung_kind kind = rung_kind::bf16;
  training_plan plan{};
  memory_estimate estimate{};
  bool fits = false;
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
constexpr training_plan shrink_micro_batch(const model_config& m, training_plan plan, const gpu_spec& gpu) noexcept {
  const std::uint64_t effective = plan.micro_batch * plan.grad_accum;
  std::uint64_t batch = max_micro_batch(m, plan, gpu, plan.micro_batch);
  if (batch == 0) batch = 1;
  plan.micro_batch = batch;
  plan.grad_accum = ceil_div(effective, batch);
  return plan;
}
}  // namespace detail

constexpr ladder plan_ladder(const model_config& m, const gpu_spec& gpu, const training_plan& workload) noexcept {
  ladder out;
  out.available_bytes = gpu.memory_bytes;
  training_plan p = workload;
  p.training = method::full;
  p.weights = weight_storage{weight_format::bf16};
  p.precision = precision_mode::bf16_mixed;
  p.optimizer = optimizer_kind::adamw;
  p.placement = optimizer_placement::device;
  p.offload_parameters = false;
  p.checkpoint = checkpointing::none;

  training_plan plans[rung_count]{};
  plans[0] = p;
  p.checkpoint = checkpointing::every_layer;
  plans[1] = p;
  p.optimizer = optimizer_kind::adamw_8bit;
  plans[2] = p;
  plans[3] = detail::shrink_micro_batch(m, p, gpu);
  training_plan q = workload;
  q.training = method::lora;
  q.weights = weight_storage{weight_format::nf4, 64, true};
  q.lora = lora_settings{16, all_linear_modules, false};
  q.precision = precision_mode::bf16_mixed;
  q.optimizer = optimizer_kind::adamw;
  q.placement = optimizer_placement::device;
  q.offload_parameters = false;
  q.checkpoint = checkpointing::every_layer;
  plans[4] = detail::shrink_micro_batch(m, q, gpu);
  q.placement = optimizer_placement::host;
  q.offload_parameters = true;
  plans[5] = detail::shrink_micro_batch(m, q, gpu);

  for (int i = 0; i < rung_count; ++i) {
    ladder_rung& r = out.rungs[i];
    r.kind = static_cast<rung_kind>(i);
    r.plan = plans[i];
    const fit_report fit = check_fit(m, plans[i], gpu);
    r.estimate = fit.estimate;
    r.fits = fit.fits;
    if (r.fits && out.first_fit < 0) out.first_fit = i;
  }
  return out;
}

}  // namespace budget
MEMKIT_NAMESPACE_END
