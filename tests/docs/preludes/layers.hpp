// What docs/layers.md's dense_linear block uses: bf16 activations and weights, fp32 gradients.
#pragma once
#include <memkit/memkit.hpp>
inline const memkit::host_executor exec;
inline std::int64_t tokens = 4096;
inline memkit::tensor_view<const memkit::bf16> x, weight, bias, dy;
inline memkit::tensor_view<memkit::bf16> y, dx;
inline memkit::tensor_view<float> weight_grad, bias_grad;
inline const memkit::layers::dense_linear_options options{};
inline memkit::memory_resource& workspace = memkit::default_host_resource();
