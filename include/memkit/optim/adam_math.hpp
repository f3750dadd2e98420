// memkit/optim/adam_math.hpp — the per-element AdamW arithmetic shared by the host loop and the CUDA kernels.
//
// Everything here is MEMKIT_HOST_DEVICE and written so that the host and the device round every
// operation the same way: products and sums go through mul_rn/add_rn, which on the device are the
// explicitly rounded intrinsics nvcc never fuses into an FMA, and on the host products that the
// compiler cannot fuse either, whatever the flags (core/rounded_math.hpp). Division and square root
// are IEEE correctly rounded on both sides. Powers of beta are taken by repeated squaring in double,
// so no libm pow (whose last bit differs between glibc and CUDA) is involved.
#pragma once

#include <cstdint>
#include <string>

#include "memkit/config.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/random.hpp"
#include "memkit/core/rounded_math.hpp"
#include "memkit/core/units.hpp"
#include "memkit/optim/adam_bytes.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace optim {

// Hyperparameters of one parameter group, with PyTorch's AdamW defaults.
struct adam_group {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-2f;  // decoupled: p *= 1 - lr * weight_decay before the Adam update
};

inline void validate(const adam_group& group, const std::string& where) {
  require(group.lr >= 0.0f && detail::is_finite(group.lr), where + ": lr must be finite and >= 0, got " + format_float(group.lr));
  require(group.beta1 >= 0.0f && group.beta1 < 1.0f, where + ": beta1 must be in [0, 1), got " + format_float(group.beta1));
  require(group.beta2 >= 0.0f && group.beta2 < 1.0f, where + ": beta2 must be in [0, 1), got " + format_float(group.beta2));
  require(group.eps >= 0.0f && detail::is_finite(group.eps), where + ": eps must be finite and >= 0, got " + format_float(group.eps));
  require(group.weight_decay >= 0.0f && detail::is_finite(group.weight_decay),
          where + ": weight_decay must be finite and >= 0, got " + format_float(group.weight_decay));
}

// Dynamic loss scaling for fp16 training (the policy of PyTorch's GradScaler): the loss is multiplied by
// `scale` before backward; a step whose gradients are all finite counts as good, and after
// `growth_interval` good steps in a row the scale grows; a step with a non-finite gradient is skipped
// and the scale backs off at once.
struct loss_scaler_options {
  bool enabled = false;
  float initial_scale = 65536.0f;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  std::int32_t growth_interval = 2000;
  float min_scale = 1.0f / 65536.0f;  // a floor, so repeated overflow cannot drive the scale to zero
  float max_scale = 16777216.0f;      // 2^24: above this fp16 gradients of ordinary size overflow anyway
};

inline void validate(const loss_scaler_options& options, const std::string& where) {
  if (!options.enabled) return;
  require(options.initial_scale > 0.0f && detail::is_finite(options.initial_scale),
          where + ": loss scaling initial_scale must be finite and > 0, got " + format_float(options.initial_scale));
  require(options.growth_factor >= 1.0f,
          where + ": loss scaling growth_factor must be >= 1, got " + format_float(options.growth_factor));
  require(options.backoff_factor > 0.0f && options.backoff_factor < 1.0f,
          where + ": loss scaling backoff_factor must be in (0, 1), got " + format_float(options.backoff_factor));
  require(options.growth_interval >= 1,
          where + ": loss scaling growth_interval must be >= 1, got " + std::to_string(options.growth_interval));
  require(options.min_scale > 0.0f && options.min_scale <= options.max_scale,
          where + ": loss scaling needs 0 < min_scale <= max_scale, got min_scale " + format_float(options.min_scale) +
              " and max_scale " + format_float(options.max_scale));
}

// Options fixed when the state is made (the first one shapes the memory layout).
struct adam_options {
  std::int64_t min_quantized_size = default_min_quantized_size;  // smaller tensors keep fp32 moments in a quantized state
  float max_grad_norm = 0.0f;              // global-norm clipping over all tensors of the step; 0 disables
  loss_scaler_options loss_scaling{};      // dynamic loss scaling for fp16 gradients
  bool stochastic_rounding = true;         // bf16 parameters without a master copy: round stochastically
  std::uint64_t seed = 0;                  // of the stochastic rounding; same seed, same bits
  int host_threads = 1;                    // threads of the host and CPU-offload steps, 0 = all hardware
                                           // threads; the results do not depend on it
  bool device_prefetch_update = false;     // CUDA: true runs the update kernel that issues a unit's loads before any
                                           // dependent read (#30). Same bits by construction, but it has not run on
                                           // a GPU yet: the default stays the verified kernel until a GPU run of
                                           // tests/cuda/adam_cuda_test.cu and bench/adam_cuda.cu has passed
};

// What the last step did, read back from the control block.
struct adam_step_report {
  bool applied = false;
  std::int64_t step = 0;            // steps applied so far
  std::int64_t skipped_steps = 0;
  double grad_norm = 0.0;           // global L2 norm of the unscaled gradients (Inf/NaN when not finite)
  float loss_scale = 1.0f;          // the scale to multiply the next loss by
  std::int64_t first_nonfinite_tensor = -1;

  std::string to_string() const {
    if (applied)
      return "adam step " + std::to_string(step) + " applied (gradient norm " + std::to_string(grad_norm) +
             ", loss scale " + std::to_string(loss_scale) + ")";
    if (first_nonfinite_tensor >= 0)
      return "adam step skipped: tensor " + std::to_string(first_nonfinite_tensor) +
             " has a non-finite gradient; parameters and optimizer state are unchanged (" +
             std::to_string(skipped_steps) + " steps skipped so far, loss scale now " + std::to_string(loss_scale) + ")";
    if (skipped_steps > 0)
      return "adam step skipped: the gradient norm " + std::to_string(grad_norm) +
             " is too large for fp32 moments (g*g would overflow); parameters and optimizer state are unchanged (" +
             std::to_string(skipped_steps) + " steps skipped so far, loss scale now " + std::to_string(loss_scale) + ")";
    return "no adam step has been taken yet";
  }
};

namespace detail {

// base^exponent by repeated squaring in double: exact operation order, so host and device agree.
MEMKIT_HOST_DEVICE inline double power(double base, std::int64_t exponent) noexcept {
  double result = 1.0;
  while (exponent > 0) {
    if (exponent & 1) result = dmul_rn(result, base);
    base = dmul_rn(base, base);
    exponent >>= 1;
  }
  return result;
}

}  // namespace detail

// float -> bf16 with stochastic rounding: adds 16 random bits below bf16's mantissa and truncates, so
// the value rounds away from zero with probability equal to the discarded fraction. Unbiased on
// average, which is what lets bf16 weights take updates far smaller than their own rounding step.
MEMKIT_HOST_DEVICE constexpr bf16 bf16_stochastic_round(float value, std::uint32_t random) noexcept {
  const std::uint32_t u = detail::bit_cast<std::uint32_t>(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16::from_bits(0x7fffu);  // NaN stays NaN
  if ((u & 0x7fffffffu) == 0x7f800000u) return bf16::from_bits(static_cast<std::uint16_t>(u >> 16));
  return bf16::from_bits(static_cast<std::uint16_t>((u + (random & 0xffffu)) >> 16));
}


// The one set of checks for anything that enters an Adam state from outside: adam_state::load and
// assign, the bitsandbytes import (optim::load_bnb_adam_state) and sharded_adam_state::load all call these
// functions, and no other copy of the rules exists. Each throws memkit::error naming the field and its value.

// No run takes 2^62 steps; the bound leaves room to keep counting without overflow (the next step adds one).
inline constexpr std::int64_t adam_max_steps = std::int64_t{1} << 62;

// A step (or skipped-step) count: 0 .. 2^62. `where` prefixes the message ("adam_state::assign: ").
inline void validate_step_count(std::int64_t count, const std::string& where, const char* field = "step") {
  require(count >= 0 && count <= adam_max_steps,
          where + field + " " + std::to_string(count) + " (must be 0 .. 2^62)");
}

// Moments: `locate(i)` names element i ("tensor 0: m[3]", "'state.2.state1' element 3"); the value is
// read through `value(i)`. First moments must be finite; second moments finite and >= 0; block scales
// (the absmax of a quantized block) finite and >= 0.
enum class adam_moment_kind { first, second, block_scale };
template <class Value, class Locate>
void validate_moments(adam_moment_kind kind, std::int64_t count, const Value& value, const Locate& locate) {
  for (std::int64_t i = 0; i < count; ++i) {
    const float x = value(i);
    const bool ok = kind == adam_moment_kind::first ? detail::is_finite(x) : detail::is_finite(x) && x >= 0.0f;
    if (!ok)
      throw error(locate(i) + " is " + format_float(x) +
                  (kind == adam_moment_kind::first    ? "; first moments must be finite"
                   : kind == adam_moment_kind::second ? "; second moments must be finite and >= 0"
                                                      : "; block scales must be finite and >= 0"));
  }
}

// Every field of a control block read from an image: `where` names it ("...: the control block has "),
// `total_chunks` is the state's gradient-norm chunk count, `scaler` its loss-scaling options.
inline void validate_control(const adam_control& c, const std::string& where, std::int64_t total_chunks,
                             const loss_scaler_options& scaler) {
  validate_step_count(c.step, where, "step");
  validate_step_count(c.skipped_steps, where, "skipped_steps");
  require(c.first_nonfinite_chunk >= -1 && c.first_nonfinite_chunk < (total_chunks > 1 ? total_chunks : 1),
          where + "first_nonfinite_chunk " + std::to_string(c.first_nonfinite_chunk) + " (must be -1 .. " +
              std::to_string(total_chunks - 1) + ")");
  require(c.applied == 0 || c.applied == 1, where + "applied " + std::to_string(c.applied) + " (must be 0 or 1)");
  // grad_norm is Inf or NaN after a skipped step; never negative. grad_multiplier is recomputed by the next
  // step, but an applied step's was finite.
  require(!(c.grad_norm < 0.0), where + "grad_norm " + std::to_string(c.grad_norm) + " (must not be negative)");
  require(c.applied == 0 || (detail::is_finite(c.grad_norm) && c.first_nonfinite_chunk == -1 &&
                             detail::is_finite(c.grad_multiplier) && c.grad_multiplier >= 0.0f),
          where + "applied 1 with grad_norm " + std::to_string(c.grad_norm) + ", first_nonfinite_chunk " +
              std::to_string(c.first_nonfinite_chunk) + " and grad_multiplier " + format_float(c.grad_multiplier) +
              " (an applied step has a finite norm and multiplier and no non-finite chunk)");
  require(detail::is_finite(c.loss_scale) && c.loss_scale > 0.0f,
          where + "loss_scale " + format_float(c.loss_scale) + " (must be finite and > 0)");
  if (scaler.enabled) {
    require(c.loss_scale >= scaler.min_scale && c.loss_scale <= scaler.max_scale,
            where + "loss_scale " + format_float(c.loss_scale) + " outside this state's [min_scale " +
                format_float(scaler.min_scale) + ", max_scale " + format_float(scaler.max_scale) + "]");
    require(c.good_steps >= 0 && c.good_steps < scaler.growth_interval,
            where + "good_steps " + std::to_string(c.good_steps) + " (must be 0 .. growth_interval - 1 = " +
                std::to_string(scaler.growth_interval - 1) + ")");
  } else {
    require(c.good_steps >= 0, where + "good_steps " + std::to_string(c.good_steps) + " (must be >= 0)");
  }
}

// The per-step scalars of one group, derived from its hyperparameters and the step count.
struct adam_coefficients {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float decay;                  // 1 - lr * weight_decay
  float step_size;              // lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
  float grad_multiplier;
};

// The two coefficients that depend on the step count t: computed in double (beta^t by repeated squaring),
// rounded to float once. Once per group and step: on the host in the step, on the device by one thread
// after the step's finalisation (adam_step_terms_kernel), so the update kernels carry no FP64 math.
struct adam_step_terms {
  float step_size;              // lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
};

MEMKIT_HOST_DEVICE inline adam_step_terms make_step_terms(const adam_group& group, std::int64_t step) noexcept {
  const double t_bias1 = detail::dadd_rn(1.0, -detail::power(group.beta1, step));
  const double t_bias2 = detail::dadd_rn(1.0, -detail::power(group.beta2, step));
  return {static_cast<float>(static_cast<double>(group.lr) / t_bias1), static_cast<float>(detail::dsqrt_rn(t_bias2))};
}

// The rest in fp32 (the same operations wherever it runs).
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE adam_coefficients make_coefficients(const adam_group& group, adam_step_terms terms,
                                                                          float grad_multiplier) noexcept {
  adam_coefficients c{};
  c.beta1 = group.beta1;
  c.one_minus_beta1 = detail::sub_rn(1.0f, group.beta1);
  c.beta2 = group.beta2;
  c.one_minus_beta2 = detail::sub_rn(1.0f, group.beta2);
  c.eps = group.eps;
  c.decay = detail::sub_rn(1.0f, detail::mul_rn(group.lr, group.weight_decay));
  c.step_size = terms.step_size;
  c.bias_correction2_sqrt = terms.bias_correction2_sqrt;
  c.grad_multiplier = grad_multiplier;
  return c;
}

MEMKIT_HOST_DEVICE inline adam_coefficients make_coefficients(const adam_group& group, const adam_control& control) noexcept {
  return make_coefficients(group, make_step_terms(group, control.step), control.grad_multiplier);
}

// One AdamW element update, PyTorch's order: decoupled decay, moments, bias-corrected step.
//   p <- p * (1 - lr*wd);  m <- b1*m + (1-b1)*g;  v <- b2*v + (1-b2)*g^2
//   p <- p - lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
// `gradient` is the raw stored gradient; the loss-scale and clipping multiplier is applied here.
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE void adamw_update(float& param, float& m, float& v, float gradient,
                                                        const adam_coefficients& c) noexcept {
  using namespace detail;
  const float g = mul_rn(gradient, c.grad_multiplier);
  param = mul_rn(param, c.decay);
  m = add_rn(mul_rn(c.beta1, m), mul_rn(c.one_minus_beta1, g));
  v = add_rn(mul_rn(c.beta2, v), mul_rn(mul_rn(c.one_minus_beta2, g), g));
  const float denominator = add_rn(div_rn(sqrt_rn(v), c.bias_correction2_sqrt), c.eps);
  param = sub_rn(param, mul_rn(c.step_size, div_rn(m, denominator)));
}

namespace detail {

// One loss-scaler update; shared by dynamic_loss_scaler (host) and the step's finalisation (device).
MEMKIT_HOST_DEVICE inline void update_loss_scale(float& scale, std::int32_t& good_steps, bool finite,
                                                 const loss_scaler_options& options) noexcept {
  if (!options.enabled) return;
  if (!finite) {
    const float reduced = mul_rn(scale, options.backoff_factor);
    scale = reduced < options.min_scale ? options.min_scale : reduced;
    good_steps = 0;
    return;
  }
  if (++good_steps >= options.growth_interval) {
    const float grown = mul_rn(scale, options.growth_factor);
    scale = grown > options.max_scale ? options.max_scale : grown;
    good_steps = 0;
  }
}

template <float_storage G>
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE double lane_sum_of_squares(const G* chunk, std::int64_t count, int lane) noexcept {
  double sum = 0.0;
  for (std::int64_t i = lane; i < count; i += reduction_lanes) {
    const double g = static_cast<double>(to_float(chunk[i]));
    sum = dadd_rn(sum, dmul_rn(g, g));
  }
  return sum;
}

// In-place tree over `lanes` partial sums; on the host the whole tree runs in this loop.
MEMKIT_HOST_DEVICE inline double tree_sum(double* lanes) noexcept {
  for (int stride = reduction_lanes / 2; stride > 0; stride /= 2)
    for (int l = 0; l < stride; ++l) lanes[l] = dadd_rn(lanes[l], lanes[l + stride]);
  return lanes[0];
}

// Adds chunk sums [first, first + count) to `total` in index order (the one order host and device share),
// noting the first that is not finite. The sums are of squares (>= 0, or NaN / +Inf), and finite ones
// cannot overflow a double (at most 2^63 chunks of 4096 values below 2^128 squared), so the total turns
// non-finite exactly where a non-finite sum is added: the chain itself has no test in it, and only then
// is the range searched. A test per element kept the device's single adding thread from loading ahead:
// 445 us for 18,320 sums on an H200, a quarter of a 75M-parameter step.
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE void add_chunk_sums(const double* sums, std::int64_t count, std::int64_t first,
                                                          double& total, std::int64_t& first_bad) noexcept {
  constexpr int ahead = 8;  // loads issued before their adds
  std::int64_t c = 0;
  for (; c + ahead <= count; c += ahead) {
    double next[ahead];
    for (int k = 0; k < ahead; ++k) next[k] = sums[c + k];
    for (int k = 0; k < ahead; ++k) total = dadd_rn(total, next[k]);
  }
  for (; c < count; ++c) total = dadd_rn(total, sums[c]);
  if (first_bad >= 0 || is_finite(total)) return;
  c = 0;
  while (c < count && is_finite(sums[c])) ++c;
  first_bad = first + c;  // c < count: a sum of this range turned the total non-finite
}

// Turns the total of the chunk sums of squares into the step's decision: apply or skip, the clipping
// factor, the step count and the loss scale. Runs once per step (host, or one device thread).
MEMKIT_HOST_DEVICE inline void decide_step(adam_control& control, double total, std::int64_t first_bad,
                                           float max_grad_norm, const loss_scaler_options& scaler,
                                           float gradient_scale) noexcept {
  const bool finite = first_bad < 0;
  // The gradient the update uses is stored * gradient_scale / loss_scale; the norm is that gradient's.
  const double multiplier =
      scaler.enabled ? static_cast<double>(gradient_scale) / static_cast<double>(control.loss_scale) : gradient_scale;
  const double norm = dmul_rn(dsqrt_rn(total), multiplier);
  double clip = 1.0;
  if (finite && max_grad_norm > 0.0f && norm > static_cast<double>(max_grad_norm))
    clip = static_cast<double>(max_grad_norm) / dadd_rn(norm, 1e-6);  // torch.nn.utils.clip_grad_norm_'s rule
  // A finite gradient can still be too large for the fp32 moments: once (1-b2)*g*g overflows, v is Inf
  // for good and the parameter never moves again (or, quantized, its block turns NaN). Every |g| is at
  // most the norm, so a norm (after clipping) with norm^2 <= FLT_MAX / 2 keeps g*g and v finite; a step
  // above that is refused like a non-finite one (first_nonfinite_chunk stays -1 to tell them apart).
  constexpr double largest_safe_norm_squared = 3.4028234663852886e38 / 2.0;
  const double applied_norm = dmul_rn(norm, clip);
  const bool safe = finite && dmul_rn(applied_norm, applied_norm) <= largest_safe_norm_squared;
  control.grad_norm = norm;
  control.first_nonfinite_chunk = first_bad;
  control.grad_multiplier = static_cast<float>(dmul_rn(multiplier, clip));
  control.applied = safe ? 1 : 0;
  if (safe) ++control.step;
  else ++control.skipped_steps;
  update_loss_scale(control.loss_scale, control.good_steps, safe, scaler);
}

// The host's finalisation: all chunk sums in order, then the decision.
inline void finalize_step(adam_control& control, const double* chunk_sums, std::int64_t chunks, float max_grad_norm,
                          const loss_scaler_options& scaler, float gradient_scale) noexcept {
  double total = 0.0;
  std::int64_t first_bad = -1;
  add_chunk_sums(chunk_sums, chunks, 0, total, first_bad);
  decide_step(control, total, first_bad, max_grad_norm, scaler, gradient_scale);
}

}  // namespace detail

// A loss scaler for training loops that manage their own step (the adam_state keeps its own copy of
// this logic next to its state, so its device steps never wait for the host).
class dynamic_loss_scaler {
 public:
  explicit dynamic_loss_scaler(loss_scaler_options options = {.enabled = true}) : options_(options) {
    validate(options_, "dynamic_loss_scaler");
    scale_ = options_.enabled ? options_.initial_scale : 1.0f;
  }
  float scale() const noexcept { return scale_; }
  float inverse_scale() const noexcept { return 1.0f / scale_; }
  // Records one step's outcome; returns whether the step should be applied.
  bool update(bool gradients_finite) noexcept {
    detail::update_loss_scale(scale_, good_steps_, gradients_finite, options_);
    return gradients_finite;
  }
  std::int32_t good_steps() const noexcept { return good_steps_; }

 private:
  loss_scaler_options options_;
  float scale_ = 1.0f;
  std::int32_t good_steps_ = 0;
};

}  // namespace optim
MEMKIT_NAMESPACE_END
