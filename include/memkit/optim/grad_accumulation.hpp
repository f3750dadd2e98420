// memkit/optim/grad_accumulation.hpp — summing micro-batch gradients into one gradient buffer.
//
// Each micro-batch's gradient is added into the accumulation buffer (the first one overwrites it, so
// no zeroing pass is needed). The average's 1/micro_batches is applied once, by the optimizer step
// (adam_state::step's gradient_scale multiplies it into the update), not by a pass of its own.
// Accumulate in fp32 when micro-batches are many: a bf16 sum loses the small contributions.
#pragma once

#include <cstdint>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/memory/resource.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace optim {

namespace detail {
template <float_storage A, float_storage G>
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE void accumulate_element(A* sum, const G* micro, std::int64_t i, bool first) noexcept {
  const float value = to_float(micro[i]);
  sum[i] = from_float<A>(first ? value : to_float(sum[i]) + value);
}

#if MEMKIT_HAS_CUDA
template <float_storage A, float_storage G>
__global__ void accumulate_kernel(A* sum, const G* micro, std::int64_t count, bool first) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    accumulate_element(sum, micro, i, first);
}
#endif
}  // namespace detail

// sum = micro (first) or sum + micro, elementwise, computed in fp32 and stored as A.
template <executor E, float_storage A, float_storage G>
void accumulate_gradient([[maybe_unused]] const E& exec, tensor_view<A> sum, tensor_view<const G> micro, bool first) {
  const char* op = "accumulate_gradient";
  require_same_shape(sum, micro, op, "sum", "micro");
  require_accessible(exec, sum, op, "sum");
  require_accessible(exec, micro, op, "micro");
  if (sum.empty()) return;
  if constexpr (!E::on_device) {
    for (std::int64_t i = 0; i < sum.size(); ++i) detail::accumulate_element(sum.data(), micro.data(), i, first);
  } else {
#if MEMKIT_HAS_CUDA
    constexpr int threads = 256;
    memkit::detail::with_device(exec.device, [&] {  // the kernel runs on the current device: make it exec's
      detail::accumulate_kernel<<<memkit::detail::grid_for(sum.size(), threads), threads, 0, exec.stream>>>(
          sum.data(), micro.data(), sum.size(), first);
      MEMKIT_CUDA_CHECK(cudaGetLastError());
      return 0;
    });
#endif
  }
}

// Counts the micro-batches of one optimizer step and gives the step its scale.
//   for each micro-batch: backward into a scratch gradient, then
//       accumulate_gradient(exec, grad, micro_grad, accumulation.first()); accumulation.add();
//   state.step(exec, params, groups, accumulation.step_scale()); accumulation.reset();
class gradient_accumulation {
 public:
  bool first() const noexcept { return micro_batches_ == 0; }
  void add() noexcept { ++micro_batches_; }
  int micro_batches() const noexcept { return micro_batches_; }
  // 1/micro_batches: the mean gradient. Throws before any micro-batch was added.
  float step_scale() const {
    require(micro_batches_ > 0, "gradient_accumulation::step_scale: no micro-batch was accumulated");
    return 1.0f / static_cast<float>(micro_batches_);
  }
  void reset() noexcept { micro_batches_ = 0; }

 private:
  int micro_batches_ = 0;
};

}  // namespace optim
MEMKIT_NAMESPACE_END
