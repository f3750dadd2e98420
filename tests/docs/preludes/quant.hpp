// What docs/quantization.md's matmul block uses: activations x [M, K] and dy [M, N], an NF4 weight [N, K].
#pragma once
#include <memkit/memkit.hpp>
inline const memkit::host_executor exec;
inline constexpr std::int64_t M = 8, N = 4096, K = 4096;
inline memkit::tensor_view<const memkit::bf16> x, dy;
inline memkit::tensor_view<memkit::bf16> y, dx;
extern const memkit::quant::quantized_tensor<memkit::quant::NF4>& w;
inline memkit::memory_resource& workspace = memkit::default_host_resource();
