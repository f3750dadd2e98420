// memkit/layers/schedules.hpp — learning-rate schedules for a hand-written training loop.
//
//   layers::cosine_schedule lr{.peak = 3e-4f, .warmup_steps = 100, .total_steps = 1000, .final_fraction = 0.1f};
//   adam.step(exec, params, registry.adam_groups(base, lr(step)));      // step counts from 0
//
// Each schedule warms up linearly over the first warmup_steps steps (step s gets peak * (s + 1) / warmup_steps,
// so the last warmup step reaches the peak), then holds (constant_schedule) or decays from the peak to
// peak * final_fraction at total_steps, linearly (linear_schedule) or along a half cosine (cosine_schedule).
// Steps at or past total_steps keep the final value. All arithmetic is fp32, in a fixed order, so a schedule
// gives the same floats on every compiler that does not reassociate (no -ffast-math).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "memkit/config.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace layers {

namespace detail {
// Steps [0, warmup): peak * (step + 1) / warmup.
constexpr float warmup_value(float peak, std::int64_t step, std::int64_t warmup) noexcept {
  return peak * static_cast<float>(step + 1) / static_cast<float>(warmup);
}
// Where `step` lies in the decay after the warmup: 0 at the first step after it, up to 1 at total_steps.
constexpr float decay_progress(std::int64_t step, std::int64_t warmup, std::int64_t total) noexcept {
  const float progress = static_cast<float>(step - warmup) / static_cast<float>(std::max<std::int64_t>(1, total - warmup));
  return std::min(progress, 1.0f);
}
}  // namespace detail

// The peak after the warmup.
struct constant_schedule {
  float peak = 1e-3f;
  std::int64_t warmup_steps = 0;
  constexpr float operator()(std::int64_t step) const noexcept {
    return step < warmup_steps ? detail::warmup_value(peak, step, warmup_steps) : peak;
  }
};

// From the peak down to peak * final_fraction at total_steps, in a straight line.
struct linear_schedule {
  float peak = 1e-3f;
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 1;
  float final_fraction = 0.0f;
  constexpr float operator()(std::int64_t step) const noexcept {
    if (step < warmup_steps) return detail::warmup_value(peak, step, warmup_steps);
    const float progress = detail::decay_progress(step, warmup_steps, total_steps);
    return peak * (final_fraction + (1.0f - final_fraction) * (1.0f - progress));
  }
};

// From the peak down to peak * final_fraction at total_steps, along a half cosine.
struct cosine_schedule {
  float peak = 1e-3f;
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 1;
  float final_fraction = 0.0f;
  float operator()(std::int64_t step) const noexcept {
    if (step < warmup_steps) return detail::warmup_value(peak, step, warmup_steps);
    const float progress = detail::decay_progress(step, warmup_steps, total_steps);
    return peak * (final_fraction + (1.0f - final_fraction) * 0.5f * (1.0f + std::cos(3.14159265f * progress)));
  }
};

}  // namespace layers
MEMKIT_NAMESPACE_END
