// memkit/loss/detail/common.hpp — what the loss's host and CUDA paths share: the math of one token's row
// (MEMKIT_HOST_DEVICE), the argument and access checks, and the empty batch's zero loss.
// Not a public header: fused_linear_cross_entropy.hpp includes it.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/host_threads.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/loss/bytes.hpp"
#include "memkit/memory/resource.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace loss::detail {

// The math of one token's row, shared by the host loops and the CUDA kernels.
struct row_math {
  float softcap = 0, z_loss = 0, smoothing = 0;
  std::int64_t vocab = 1;

  // The logit the softmax sees.
  MEMKIT_HOST_DEVICE float capped(float raw) const noexcept { return softcap > 0 ? softcap * tanhf(raw / softcap) : raw; }
  // loss_i from lse = log sum exp z, the target's z and the row's sum of z.
  MEMKIT_HOST_DEVICE float token_loss(float lse, float z_target, float z_sum) const noexcept {
    float loss = lse - (1.0f - smoothing) * z_target;
    if (smoothing > 0) loss -= smoothing / static_cast<float>(vocab) * z_sum;
    if (z_loss > 0) loss += z_loss * lse * lse;
    return loss;
  }
  // d loss_i / d raw logit j, times `scale` (1 / counted tokens). z is the capped logit.
  MEMKIT_HOST_DEVICE float gradient(float z, float lse, bool is_target, float scale) const noexcept {
    const float p = expf(z - lse);
    float g = p * (1.0f + 2.0f * z_loss * lse) - (is_target ? 1.0f - smoothing : 0.0f) -
              smoothing / static_cast<float>(vocab);
    if (softcap > 0) {
      const float t = z / softcap;  // tanh(raw / cap): d z / d raw = 1 - tanh^2
      g *= 1.0f - t * t;
    }
    return g * scale;
  }
};

// The running max and sum of exp(z - max) of a row's softmax, formed in one read (the device's two-pass row kernel,
// #30) instead of a max pass and then an exp pass. When the max grows the sum is rescaled by exp(old - new): one
// more rounding per rescale, which the host test (loss_online_softmax_test) bounds against a double reference.
// From the empty state (-inf, 0) a first value v gives (v, 1); a row of -inf gives NaN (exp(-inf - -inf)), as the
// two-pass form does.
struct online_softmax {
  float max = -INFINITY, sum = 0.0f;

  MEMKIT_HOST_DEVICE void add(float value) noexcept {
    if (value > max) {
      sum *= expf(max - value);
      max = value;
    }
    sum += expf(value - max);
  }
  // Four values with at most one rescale: their max first.
  MEMKIT_HOST_DEVICE void add4(float a, float b, float c, float d) noexcept {
    const float top = fmaxf(fmaxf(a, b), fmaxf(c, d));
    if (top > max) {
      sum *= expf(max - top);
      max = top;
    }
    sum += expf(a - max) + expf(b - max) + expf(c - max) + expf(d - max);
  }
  // Another state joins this one (a state whose max is -inf adds nothing). Symmetric: merging a into b and b
  // into a give the same bits, as a shuffle tree needs.
  MEMKIT_HOST_DEVICE void merge(float other_max, float other_sum) noexcept {
    const float top = fmaxf(max, other_max);
    if (top == -INFINITY) {
      sum += other_sum;
      return;
    }
    sum = sum * expf(max - top) + other_sum * expf(other_max - top);
    max = top;
  }
  MEMKIT_HOST_DEVICE float lse() const noexcept { return max + logf(sum); }
};

inline row_math make_row_math(const cross_entropy_options& options, std::int64_t V) {
  return {options.logit_softcap, options.z_loss, options.label_smoothing, V};
}

// An output the caller does not want: a default-constructed view (rank 0, no data) or one with no elements.
struct loss_dims {
  std::int64_t N, H, V;
};

template <class T, class Td>
loss_dims check_arguments(const char* operation, const tensor_view<const T>& hidden, const shape& head_shape,
                          const tensor_view<const std::int32_t>& targets, const tensor_view<const float>& d_loss,
                          const tensor_view<float>& loss, const tensor_view<Td>& d_hidden,
                          const tensor_view<float>& d_head, const cross_entropy_options& options) {
  const std::string op(operation);
  require(hidden.shape().rank == 2, op + ": `hidden` must be [tokens, hidden], has shape " + to_string(hidden.shape()));
  require(head_shape.rank == 2, op + ": `head` must be [vocab, hidden], has shape " + to_string(head_shape));
  const std::int64_t N = hidden.shape()[0], H = hidden.shape()[1], V = head_shape[0];
  require(head_shape[1] == H, op + ": `head` has shape " + to_string(head_shape) + " but `hidden` " +
                                  to_string(hidden.shape()) + " needs [vocab, " + std::to_string(H) + "]");
  require(V > 0, op + ": the vocabulary is empty (`head` has shape " + to_string(head_shape) + ")");
  require(targets.shape() == shape{N}, op + ": `targets` has shape " + to_string(targets.shape()) + " but needs [" +
                                           std::to_string(N) + "], one id per token of `hidden`");
  const bool per_token = options.reduction == reduction_mode::none;
  require(options.reduction == reduction_mode::mean || per_token, op + ": reduction must be mean or none");
  if (per_token) {
    require(loss.shape() == shape{N}, op + ": with reduction none `loss` must be [" + std::to_string(N) +
                                          "], one float per token, has shape " + to_string(loss.shape()));
    require(!d_loss.is_none() || (d_hidden.is_none() && d_head.is_none()),
            op + ": with reduction none the gradients need `d_loss` [" + std::to_string(N) +
                "], the upstream gradient of each token's loss (pass none() for d_hidden and d_head to get the losses "
                "alone)");
    require(d_loss.is_none() || d_loss.shape() == shape{N},
            op + ": `d_loss` has shape " + to_string(d_loss.shape()) + " but needs [" + std::to_string(N) + "]");
  } else {
    require(loss.size() == 1, op + ": `loss` must hold 1 float, has shape " + to_string(loss.shape()));
    require(d_loss.is_none(), op + ": `d_loss` (per-token upstream gradients) goes with reduction none; the mean's "
                                   "gradient is that of the mean");
  }
  require(d_hidden.is_none() || d_hidden.shape() == hidden.shape(),
          op + ": `d_hidden` has shape " + to_string(d_hidden.shape()) + " but `hidden` has shape " +
              to_string(hidden.shape()) + " (pass tensor_view::none() to skip it)");
  require(d_head.is_none() || d_head.shape() == head_shape,
          op + ": `d_head` has shape " + to_string(d_head.shape()) + " but `head` has shape " + to_string(head_shape) +
              " (pass tensor_view::none() for a frozen head)");
  const auto has_data = [&](const void* data, std::int64_t size, const char* name) {
    require(size == 0 || data != nullptr, op + ": `" + name + "` has elements but no data pointer");
  };
  has_data(hidden.data(), hidden.size(), "hidden");
  has_data(targets.data(), targets.size(), "targets");
  has_data(loss.data(), loss.size(), "loss");
  if (!d_loss.is_none()) has_data(d_loss.data(), d_loss.size(), "d_loss");
  if (!d_hidden.is_none()) has_data(d_hidden.data(), d_hidden.size(), "d_hidden");
  if (!d_head.is_none()) has_data(d_head.data(), d_head.size(), "d_head");
  require(options.label_smoothing >= 0 && options.label_smoothing <= 1,
          op + ": label_smoothing must be in [0, 1], got " + std::to_string(options.label_smoothing));
  require(options.logit_softcap >= 0 && std::isfinite(options.logit_softcap),
          op + ": logit_softcap must be >= 0 and finite, got " + std::to_string(options.logit_softcap));
  require(options.z_loss >= 0 && std::isfinite(options.z_loss),
          op + ": z_loss must be >= 0 and finite, got " + std::to_string(options.z_loss));
  require_host_threads(op, options.host_threads);
  return {N, H, V};
}

template <executor E, class T>
void check_access(const E& exec, const char* operation, const tensor_view<const T>& hidden,
                  const tensor_view<const std::int32_t>& targets, const tensor_view<const float>& d_loss,
                  const tensor_view<float>& loss, const tensor_view<T>& d_hidden, const tensor_view<float>& d_head) {
  require_accessible(exec, hidden, operation, "hidden");
  require_accessible(exec, targets, operation, "targets");
  if (!d_loss.is_none()) require_accessible(exec, d_loss, operation, "d_loss");
  require_accessible(exec, loss, operation, "loss");
  if (!d_hidden.is_none()) require_accessible(exec, d_hidden, operation, "d_hidden");
  if (!d_head.is_none()) require_accessible(exec, d_head, operation, "d_head");
}

// The loss of an empty batch: the mean's 0 (reduction none has no element to write).
template <class T>
void zero_loss(const host_executor&, const tensor_view<float>& loss) {
  if (loss.size() == 1) loss[0] = 0.0f;
}
#if MEMKIT_HAS_CUDA
template <class T>
void zero_loss(const cuda_executor& exec, const tensor_view<float>& loss) {
  if (loss.size() != 1) return;
  ::memkit::detail::with_device(exec.device, [&] {
    MEMKIT_CUDA_CHECK(cudaMemsetAsync(loss.data(), 0, sizeof(float), exec.stream));
    return 0;
  });
}
#endif

}  // namespace loss::detail
MEMKIT_NAMESPACE_END
