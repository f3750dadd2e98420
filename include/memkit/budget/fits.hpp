// memkit/budget/fits.hpp — `static_assert(memkit::fits(model, plan, gpu))`, with the numbers in the error.
//
// fits() compares the step's device figure (allocated + the caching allocator's slack + CUDA context and
// NCCL: what nvidia-smi shows; budget/allocator.hpp) with the GPU's memory; check_fit(..., metric) compares
// another figure. It is an ordinary constexpr predicate at run time. In a constant expression that does
// not fit it stops compilation on purpose, in a way that makes the compiler print the figures:
//   g++:    array subscript value 'NEEDED_MIB' is outside the bounds of array 'heap []' of type
//           'memkit::budget::diagnostic::device_mib_with_largest_category<memkit::budget::category::X> [AVAILABLE_MIB]'
//   clang:  in call to 'training_step_does_not_fit(NEEDED_BYTES, AVAILABLE_BYTES, X, LARGEST_BYTES)'
// i.e. MiB needed (rounded up) as the index, MiB available (rounded down) as the array bound, and the
// largest category in the element type. An invalid model or plan fails the same way, with the
// problem named by the type. To get `false` instead of an error in a constant expression, use
// check_fit(...).fits.
#pragma once

#include <cstdint>
#include <type_traits>

#include "memkit/budget/estimate.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace budget {

namespace diagnostic {
template <category Largest>
struct device_mib_with_largest_category {
  char unused = 0;
};
struct model_or_plan_is_invalid_see_check_fit_problem {
  char unused = 0;
};

template <category Largest>
constexpr void report_as(std::uint64_t needed_mib, std::uint64_t available_mib) {
  // Reading past the end of an array of `available_mib` elements at index `needed_mib` is not a
  // constant expression, and the compiler's message quotes both numbers and the element type.
  auto* device_memory_in_mib = new device_mib_with_largest_category<Largest>[available_mib]();
  const char value = device_memory_in_mib[needed_mib].unused;
  delete[] device_memory_in_mib;
  (void)value;
}

constexpr void training_step_does_not_fit(std::uint64_t needed_bytes, std::uint64_t available_bytes,
                                          category largest, std::uint64_t largest_bytes) {
  (void)largest_bytes;  // shown by clang's call trace
  const std::uint64_t needed_mib = (needed_bytes + MiB - 1) / MiB;
  const std::uint64_t available_mib = available_bytes / MiB;
  switch (largest) {
    case category::weights: report_as<category::weights>(needed_mib, available_mib); break;
    case category::gradients: report_as<category::gradients>(needed_mib, available_mib); break;
    case category::master_weights: report_as<category::master_weights>(needed_mib, available_mib); break;
    case category::optimizer_state: report_as<category::optimizer_state>(needed_mib, available_mib); break;
    case category::activations: report_as<category::activations>(needed_mib, available_mib); break;
    case category::logits: report_as<category::logits>(needed_mib, available_mib); break;
    case category::workspace: report_as<category::workspace>(needed_mib, available_mib); break;
    case category::overhead: report_as<category::overhead>(needed_mib, available_mib); break;
  }
}

constexpr void model_or_plan_is_invalid() {
  auto* problem = new model_or_plan_is_invalid_see_check_fit_problem[1]();
  const char value = problem[1].unused;
  delete[] problem;
  (void)value;
}
}  // namespace diagnostic

constexpr bool fits(const model_config& m, const training_plan& p, const gpu_spec& gpu) {
  const fit_report report = check_fit(m, p, gpu);
  if (report.fits) return true;
  if (std::is_constant_evaluated()) {
    if (!report.estimate.valid()) {
      diagnostic::model_or_plan_is_invalid();
    } else {
      const breakdown& device = report.estimate.device;
      diagnostic::training_step_does_not_fit(report.estimate.peak_device_bytes, report.available_bytes,
                                             device.largest(), device[device.largest()]);
    }
  }
  return false;
}

}  // namespace budget

using budget::fits;

MEMKIT_NAMESPACE_END
