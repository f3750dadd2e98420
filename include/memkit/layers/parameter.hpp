// memkit/layers/parameter.hpp — one trainable tensor of a hand-written layer, and where its bytes come from.
//
// A parameter is a value in the training dtype (what the forward reads: bf16, or fp32), an optional fp32
// master copy (what AdamW updates when a bf16 model trains in mixed precision; the value then receives its
// rounding) and an fp32 gradient, each a memkit::buffer from the resource of its tracking category
// (memory_resources), so a tracking_resource sees every byte. The buffers are host or device memory, as the
// resources are: values are made on the host and copied in. A layer hands its parameters to a
// parameter_registry (parameters.hpp), which gives them to the optimizer.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/random.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/layers/tensor_ops.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace layers {

// Where a model's memory comes from: one resource per tracking category (tracking_resource::category).
// All host memory, or all device memory (then the workspace resource must be stream-ordered).
struct memory_resources {
  memory_resource* weights = &default_host_resource();
  memory_resource* gradients = &default_host_resource();
  memory_resource* optimizer = &default_host_resource();  // fp32 master weights live here too
  memory_resource* workspace = &default_host_resource();
  int host_threads = 1;  // of every GEMM
  bool on_device() const noexcept { return weights->kind() != memory_kind::host; }
};

enum class trainability : std::uint8_t {
  frozen,         // value only, no gradient
  bf16_master,    // bf16 value, fp32 master copy (AdamW updates the master), fp32 gradient; an fp32 value
                  // needs no master copy and trains in place
  bf16_rounding,  // bf16 value updated in place with stochastic rounding, fp32 gradient
};

// W is the value's element type: the model's training dtype (bf16, or float for fp32 training and for
// parity tests against references that hold a checkpoint's values exactly).
template <class W>
struct basic_parameter {
  using value_type = W;
  static constexpr bool value_is_fp32 = std::is_same_v<W, float>;

  std::string name;
  trainability mode = trainability::frozen;
  buffer<W> value;
  buffer<float> master;  // unallocated unless bf16_master with a 16-bit value
  buffer<float> grad;    // unallocated when frozen

  basic_parameter() = default;
  basic_parameter(std::string name_, shape dims, const memory_resources& memory, trainability mode_)
      : name(std::move(name_)), mode(mode_), value(*memory.weights, dims) {
    if (has_master()) master = buffer<float>(*memory.optimizer, dims);
    if (mode != trainability::frozen) grad = buffer<float>(*memory.gradients, dims);
    zero_grad();
  }

  bool trains() const noexcept { return mode != trainability::frozen; }
  bool has_master() const noexcept { return mode == trainability::bf16_master && !value_is_fp32; }
  std::int64_t size() const noexcept { return value.size(); }
  // The master copy for adam_param (tensor_view<float>::none() when there is none).
  tensor_view<float> master_view() noexcept { return has_master() ? master.view() : tensor_view<float>::none(); }
  // The gradient (tensor_view<float>::none() when frozen).
  tensor_view<float> grad_view() noexcept { return trains() ? grad.view() : tensor_view<float>::none(); }

  // Bytes a parameter of `dims` allocates in each category.
  static constexpr std::size_t value_bytes(const shape& dims) noexcept { return buffer<W>::bytes_required(dims); }
  static constexpr std::size_t master_bytes(const shape& dims, trainability mode) noexcept {
    return mode == trainability::bf16_master && !value_is_fp32 ? buffer<float>::bytes_required(dims) : 0;
  }
  static constexpr std::size_t grad_bytes(const shape& dims, trainability mode) noexcept {
    return mode == trainability::frozen ? 0 : buffer<float>::bytes_required(dims);
  }

  // Sets value (and master) from fp32 values on the host.
  void assign(const float* values) {
    if constexpr (value_is_fp32) {
      copy_in(values, value.view());
    } else {
      std::vector<W> rounded(static_cast<std::size_t>(size()));
      for (std::int64_t i = 0; i < size(); ++i) rounded[static_cast<std::size_t>(i)] = from_float<W>(values[i]);
      copy_in(rounded.data(), value.view());
    }
    if (has_master()) copy_in(values, master.view());
  }
  void fill(float v) {
    const std::vector<float> values(static_cast<std::size_t>(size()), v);
    assign(values.data());
  }
  // Normal(0, stddev) values drawn from (seed, stream) with memkit::random_word (Box-Muller).
  void init_normal(float stddev, std::uint64_t seed, std::uint64_t stream) {
    std::vector<float> values(static_cast<std::size_t>(size()));
    for (std::int64_t i = 0; i < size(); ++i) {
      const float u1 = (static_cast<float>(random_word(seed, stream, 2 * i) >> 8) + 0.5f) * (1.0f / 16777216.0f);
      const float u2 = unit_float(random_word(seed, stream, 2 * i + 1));
      const float z = std::sqrt(-2.0f * std::log(u1)) * std::cos(6.2831853f * u2);
      values[static_cast<std::size_t>(i)] = stddev * z;
    }
    assign(values.data());
  }
  // Setup (synchronous); zero_grad(exec) in the training loop (or layers::zero_grad(exec, registry)).
  void zero_grad() {
    if (!trains()) return;
    const std::vector<float> zeros(static_cast<std::size_t>(grad.size()), 0.0f);
    copy_in(zeros.data(), grad.view());
  }
  template <executor E>
  void zero_grad(const E& exec) {
    if (trains()) zero_view(exec, grad.view());
  }
};

// A bf16 parameter (what the example trains).
using parameter = basic_parameter<bf16>;

}  // namespace layers
MEMKIT_NAMESPACE_END
