// What docs/loss.md's block uses: hidden [N, H] and head [V, H] in bf16, int32 targets, the outputs.
#pragma once
#include <memkit/memkit.hpp>
inline const memkit::host_executor exec;
inline memkit::tensor_view<const memkit::bf16> hidden, head;
inline memkit::tensor_view<const std::int32_t> targets;
inline memkit::tensor_view<float> loss, d_head;
inline memkit::tensor_view<float> token_losses;            // [N]: reduction none
inline memkit::tensor_view<const float> token_weights;     // [N]: d_loss, the upstream gradient per token
inline memkit::tensor_view<memkit::bf16> d_hidden;
extern const memkit::quant::quantized_tensor<memkit::quant::NF4>& nf4_head;
inline memkit::memory_resource& workspace = memkit::default_host_resource();
