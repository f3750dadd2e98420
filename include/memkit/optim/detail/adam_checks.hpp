// memkit/optim/detail/adam_checks.hpp — the checks the optimizer states make before anything is written: their
// options, a step's groups, gradient scale and tensors, and moments that enter a state from outside (assign,
// a loaded image). adam_state and sharded_adam_state share them; nothing here is API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/host_threads.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/optim/adam_bytes.hpp"
#include "memkit/optim/adam_math.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace optim {
namespace detail {

// The checks every Adam state makes of its options (`op` names the state in the message).
inline void validate_adam_options(const adam_options& options, const char* op) {
  validate(options.loss_scaling, op);
  require(options.min_quantized_size >= 0, std::string(op) + ": min_quantized_size must be >= 0");
  require(options.max_grad_norm >= 0.0f, std::string(op) + ": max_grad_norm must be >= 0");
  require_host_threads(op, options.host_threads);
}

// ---- the checks of a step's arguments, made before anything is written ----
// The checks of a step's groups and gradient scale (every optimizer state's step makes them).
inline void validate_groups_and_scale(const std::string& op, std::span<const adam_group> groups, float gradient_scale) {
  require(!groups.empty(), std::string(op) + ": no parameter groups given");
  require(gradient_scale > 0.0f && detail::is_finite(gradient_scale),
          std::string(op) + ": gradient_scale must be finite and > 0, got " + format_float(gradient_scale));
  for (std::size_t g = 0; g < groups.size(); ++g) validate(groups[g], std::string(op) + ": group " + std::to_string(g));
}
// The checks adam_state's step and offload_step share: tensor count, groups and gradient scale.
inline void validate_arguments(const char* op, std::size_t param_count, std::span<const adam_tensor_layout> layout,
                               std::span<const adam_group> groups, float gradient_scale) {
  require(param_count == layout.size(), std::string(op) + ": got " + std::to_string(param_count) +
                                            " parameter tensors, the state was made for " +
                                            std::to_string(layout.size()));
  validate_groups_and_scale(op, groups, gradient_scale);
}
inline void require_known_group(const char* op, const std::string& which, int group, std::size_t group_count) {
  require(group >= 0 && static_cast<std::size_t>(group) < group_count,
          std::string(op) + ": " + which + " names group " + std::to_string(group) + " but only " +
              std::to_string(group_count) + " groups were given");
}
// adam_state::step's arguments (Param is adam_param<P, G>) against the state's layout and arena.
template <float_storage P, float_storage G, executor E, class Param>
void validate_step(const E& exec, std::span<const Param> params, std::span<const adam_tensor_layout> layout_,
                   std::span<const adam_group> groups, float gradient_scale, tensor_view<const std::byte> arena) {
  const char* op = "adam_state::step";
  validate_arguments(op, params.size(), layout_, groups, gradient_scale);
  require_accessible(exec, arena, op, "optimizer state");
  for (std::size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    const std::string which = "tensor " + std::to_string(i);
    require(p.param.size() == layout_[i].size,
            std::string(op) + ": " + which + " has " + std::to_string(p.param.size()) + " elements (shape " +
                to_string(p.param.shape()) + "), the state was made for " + std::to_string(layout_[i].size));
    require_same_shape(p.param, p.grad, op, (which + " param").c_str(), (which + " grad").c_str());
    require(p.param.data() != nullptr && p.grad.data() != nullptr, std::string(op) + ": " + which + " has a null pointer");
    if (p.master.data() != nullptr) {  // a default view (no master) has a null pointer
      require(!std::is_same_v<P, float>, std::string(op) + ": " + which +
                                             " has fp32 parameters, which are their own master copy; pass no master");
      require_same_shape(p.param, tensor_view<const float>(p.master), op, (which + " param").c_str(),
                         (which + " master").c_str());
    }
    require_known_group(op, which, p.group, groups.size());
    require_accessible(exec, p.param, op, (which + " param").c_str());
    require_accessible(exec, p.grad, op, (which + " grad").c_str());
    if (p.master.data() != nullptr) require_accessible(exec, p.master, op, (which + " master").c_str());
  }
}

#if MEMKIT_HAS_CUDA
// adam_state::offload_step's arguments (Param is adam_offload_param<P, G>).
template <float_storage P, float_storage G, class Param>
void validate_offload(const cuda_executor& exec, std::span<const Param> params, std::span<const adam_tensor_layout> layout_,
                      std::span<const adam_group> groups, float gradient_scale, memory_kind where) {
  const char* op = "adam_state::offload_step";
  require(host_executor::can_access(where),
          std::string(op) + ": the state is in " + to_string(where) + " memory; CPU offload keeps it in host memory");
  validate_arguments(op, params.size(), layout_, groups, gradient_scale);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    const std::string which = "tensor " + std::to_string(i);
    require(p.param.size() == layout_[i].size, std::string(op) + ": " + which + " has " +
                                                   std::to_string(p.param.size()) + " elements, the state was made for " +
                                                   std::to_string(layout_[i].size));
    require_same_shape(p.param, p.grad, op, (which + " param").c_str(), (which + " grad").c_str());
    require_same_shape(p.param, tensor_view<const float>(p.master), op, (which + " param").c_str(),
                       (which + " master").c_str());
    require_same_shape(p.param, tensor_view<const G>(p.grad_staging), op, (which + " param").c_str(),
                       (which + " grad_staging").c_str());
    if constexpr (!std::is_same_v<P, float>)
      require_same_shape(p.param, tensor_view<const P>(p.param_staging), op, (which + " param").c_str(),
                         (which + " param_staging").c_str());
    require_known_group(op, which, p.group, groups.size());
    require_accessible(exec, p.param, op, (which + " param").c_str());
    require_accessible(exec, p.grad, op, (which + " grad").c_str());
    auto pinned = [&](memory_kind kind, const char* name) {
      require(kind == memory_kind::pinned_host, std::string(op) + ": `" + which + " " + name + "` is in " +
                                                    to_string(kind) +
                                                    " memory; offload buffers must be pinned_host so copies overlap");
    };
    pinned(p.master.where(), "master");
    pinned(p.grad_staging.where(), "grad_staging");
    if constexpr (!std::is_same_v<P, float>) pinned(p.param_staging.where(), "param_staging");
  }
}
#endif

// One tensor's moments entering a state from outside (adam_state::assign, a loaded image; TensorState is
// adam_tensor_state) against its layout in a state of Bits-bit moments.
template <int Bits, class TensorState>
void validate_source(const std::string& which, const adam_tensor_layout& t, const TensorState& s,
                     std::int64_t min_quantized_size) {
  auto expect = [&](const auto& view, std::int64_t count, const char* name) {
    require(view.data() != nullptr || count == 0, which + ": `" + name + "` is null");
    require(view.where() != memory_kind::device, which + ": `" + name + "` is in device memory; give host views");
    require(view.size() == count, which + ": `" + name + "` has " + std::to_string(view.size()) + " elements, expected " +
                                      std::to_string(count));
  };
  if (!t.quantized) {
    require(!s.quantized, which + ": the source is quantized, but this state keeps plain moments for a tensor of " +
                              std::to_string(t.size) + " elements (min_quantized_size " +
                              std::to_string(min_quantized_size) + ")");
    expect(s.m, t.size, "m");
    expect(s.v, t.size, "v");
    validate_moments(adam_moment_kind::first, t.size, [&](std::int64_t i) { return to_float(s.m[i]); },
                     [&](std::int64_t i) { return which + ": m[" + std::to_string(i) + "]"; });
    validate_moments(adam_moment_kind::second, t.size, [&](std::int64_t i) { return to_float(s.v[i]); },
                     [&](std::int64_t i) { return which + ": v[" + std::to_string(i) + "]"; });
    return;
  }
  require(s.quantized, which + ": the source has plain moments, but this state quantizes a tensor of " +
                           std::to_string(t.size) + " elements (min_quantized_size " +
                           std::to_string(min_quantized_size) + ")");
  const std::int64_t codes = Bits == 8 ? t.size : (t.size + 1) / 2;
  expect(s.m_codes, codes, "m_codes");
  expect(s.v_codes, codes, "v_codes");
  expect(s.m_absmax, t.units, "m_absmax");
  expect(s.v_absmax, t.units, "v_absmax");
  for (const auto* absmax : {&s.m_absmax, &s.v_absmax})
    validate_moments(adam_moment_kind::block_scale, t.units, [&](std::int64_t b) { return (*absmax)[b]; },
                     [&](std::int64_t b) {
                       return which + ": " + (absmax == &s.m_absmax ? "m" : "v") + "_absmax[" + std::to_string(b) + "]";
                     });
}

}  // namespace detail
}  // namespace optim
MEMKIT_NAMESPACE_END
