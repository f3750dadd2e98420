// tests/sass/hot_kernels.cu — one instantiation of each hot memkit kernel, compiled (never run) by
// tests/sass/sass_check.py for sm_80 and sm_90 so that the SASS of exactly these kernels can be read.
// The instantiations are the ones the library launches (same template arguments and block sizes); the
// script's table (KERNELS) names each and the rules it must satisfy.
#include "memkit/attention/flash_attention.hpp"
#include "memkit/loss/fused_linear_cross_entropy.hpp"
#include "memkit/optim/adam_state.hpp"
#include "memkit/optim/grad_accumulation.hpp"
#include "memkit/quant/blockwise.hpp"
#include "memkit/quant/matmul.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace optim::detail {
// Adam: the norm pass, and the update kernel of each state flavour (fp32 parameters and gradients, and
// bf16 parameters with bf16 gradients, the mixed-precision case).
template __global__ void adam_norm_kernel<float>(norm_launch<float>);
template __global__ void adam_norm_kernel<bf16>(norm_launch<bf16>);
template __global__ void adam_update_kernel<std::int8_t, 256, update_threads<std::int8_t, 256>(), float, float, true>(
    update_launch<std::int8_t>);
template __global__ void adam_update_kernel<std::int8_t, 256, update_threads<std::int8_t, 256>(), bf16, bf16, true>(
    update_launch<std::int8_t>);
template __global__ void adam_update_kernel<four_bit, 128, update_threads<four_bit, 128>(), float, float, true>(
    update_launch<four_bit>);
template __global__ void adam_update_kernel<four_bit, 128, update_threads<four_bit, 128>(), bf16, bf16, true>(
    update_launch<four_bit>);
template __global__ void adam_update_kernel<float, 0, update_threads<float, 0>(), float, float, true>(update_launch<float>);
template __global__ void adam_update_kernel<bf16, 0, update_threads<bf16, 0>(), bf16, bf16, true>(update_launch<bf16>);
// The previous update kernel (adam_options::device_prefetch_update = false), kept for the benchmark's comparison.
template __global__ void adam_update_kernel<std::int8_t, 256, update_threads<std::int8_t, 256>(), float, float, false>(
    update_launch<std::int8_t>);
template __global__ void adam_update_kernel<std::int8_t, 256, update_threads<std::int8_t, 256>(), bf16, bf16, false>(
    update_launch<std::int8_t>);
template __global__ void adam_update_kernel<four_bit, 128, update_threads<four_bit, 128>(), float, float, false>(
    update_launch<four_bit>);
template __global__ void adam_update_kernel<four_bit, 128, update_threads<four_bit, 128>(), bf16, bf16, false>(
    update_launch<four_bit>);
template __global__ void adam_update_kernel<float, 0, update_threads<float, 0>(), float, float, false>(update_launch<float>);
template __global__ void adam_update_kernel<bf16, 0, update_threads<bf16, 0>(), bf16, bf16, false>(update_launch<bf16>);
template __global__ void accumulate_kernel<float, bf16>(float*, const bf16*, std::int64_t, bool);
}  // namespace optim::detail

namespace quant::detail {
template __global__ void quantize_kernel<format::nf4, bf16>(const bf16*, std::int64_t, std::int64_t, std::uint8_t*,
                                                            float*, code_table<256>);
template __global__ void quantize_kernel<format::fp4, float>(const float*, std::int64_t, std::int64_t, std::uint8_t*,
                                                             float*, code_table<256>);
template __global__ void quantize_kernel<format::int8, float>(const float*, std::int64_t, std::int64_t, std::uint8_t*,
                                                              float*, code_table<256>);
template __global__ void dequantize_kernel<format::int8, float>(const std::uint8_t*, block_scales, std::int64_t,
                                                                std::int64_t, std::int64_t, float*, code_table<256>,
                                                                code_table<256>);
template __global__ void dequantize_kernel<format::nf4, bf16>(const std::uint8_t*, block_scales, std::int64_t,
                                                              std::int64_t, std::int64_t, bf16*, code_table<256>,
                                                              code_table<256>);
template __global__ void dequantize_vector_kernel<format::nf4, bf16, dequantize_unroll_plain>(
    const std::uint8_t*, block_scales, std::int64_t, std::int64_t, std::int64_t, bf16*, code_table<256>, code_table<256>);
template __global__ void dequantize_vector_kernel<format::nf4, bf16, dequantize_unroll_nested>(
    const std::uint8_t*, block_scales, std::int64_t, std::int64_t, std::int64_t, bf16*, code_table<256>, code_table<256>);
template __global__ void dequantize_vector_kernel<format::int8, float, dequantize_unroll_plain>(
    const std::uint8_t*, block_scales, std::int64_t, std::int64_t, std::int64_t, float*, code_table<256>, code_table<256>);
template __global__ void fused_gemv_kernel<format::nf4, bf16, device_fused_rows>(
    const bf16*, const std::uint8_t*, block_scales, std::int64_t, std::int64_t, std::int64_t, std::int64_t, bf16*,
    code_table<256>, code_table<256>);
template __global__ void fused_gemv_kernel<format::fp4, fp16, device_fused_rows>(
    const fp16*, const std::uint8_t*, block_scales, std::int64_t, std::int64_t, std::int64_t, std::int64_t, fp16*,
    code_table<256>, code_table<256>);
template __global__ void fused_gemv_shuffle_kernel<format::nf4, bf16, device_fused_rows>(
    const bf16*, const std::uint8_t*, block_scales, std::int64_t, std::int64_t, std::int64_t, std::int64_t, bf16*,
    code_table<256>);
template __global__ void fused_gemv_shuffle_kernel<format::fp4, fp16, device_fused_rows>(
    const fp16*, const std::uint8_t*, block_scales, std::int64_t, std::int64_t, std::int64_t, std::int64_t, fp16*,
    code_table<256>);
template __global__ void fused_gemv_t_kernel<format::nf4, bf16, device_fused_rows>(
    const bf16*, const std::uint8_t*, block_scales, std::int64_t, std::int64_t, std::int64_t, std::int64_t, bf16*,
    code_table<256>, code_table<256>);
template __global__ void fused_gemv_t_tiled_kernel<format::nf4, bf16, device_fused_rows>(
    const bf16*, const std::uint8_t*, block_scales, std::int64_t, std::int64_t, std::int64_t, std::int64_t, bf16*,
    float*, std::int64_t, code_table<256>, code_table<256>);
template __global__ void fused_gemv_t_tiled_kernel<format::int8, float, device_fused_rows>(
    const float*, const std::uint8_t*, block_scales, std::int64_t, std::int64_t, std::int64_t, std::int64_t, float*,
    float*, std::int64_t, code_table<256>, code_table<256>);
template __global__ void gemv_t_reduce_kernel<bf16>(const float*, std::int64_t, std::int64_t, bf16*);
}  // namespace quant::detail
namespace loss::detail {
// The fused loss's row pass: the classic kernel (row_pass = classic, the default) and the staged pass's two
// kernels (a row staged in shared memory; two reads for rows past it), for fp32 hidden (the gradient written over
// the logits) and bf16 (a separate 16-bit gradient).
template __global__ void logit_rows_kernel<float>(float*, float*, std::int64_t, std::int64_t, const std::int32_t*,
                                                  std::int64_t, row_math, const int*, float*, const float*, bool);
template __global__ void logit_rows_kernel<bf16>(float*, bf16*, std::int64_t, std::int64_t, const std::int32_t*,
                                                 std::int64_t, row_math, const int*, float*, const float*, bool);
template __global__ void logit_rows_staged_kernel<float>(const float*, float*, std::int64_t, std::int64_t,
                                                         const std::int32_t*, std::int64_t, row_math, const int*, float*,
                                                         const float*, bool, bool);
template __global__ void logit_rows_staged_kernel<bf16>(const float*, bf16*, std::int64_t, std::int64_t,
                                                        const std::int32_t*, std::int64_t, row_math, const int*, float*,
                                                        const float*, bool, bool);
template __global__ void logit_rows_two_pass_kernel<float>(const float*, float*, std::int64_t, std::int64_t,
                                                           const std::int32_t*, std::int64_t, row_math, const int*,
                                                           float*, const float*, bool, bool);
template __global__ void logit_rows_two_pass_kernel<bf16>(const float*, bf16*, std::int64_t, std::int64_t,
                                                          const std::int32_t*, std::int64_t, row_math, const int*,
                                                          float*, const float*, bool, bool);
}  // namespace loss::detail
namespace attention::detail {
// Attention: the forward mma kernel (attention_kernel::mma) at every head_dim it runs (mma_head_dims), and the WMMA
// kernel that `automatic` still picks, kept here so the check shows which of the mma rules it breaks.
template __global__ void mma_forward_kernel<bf16, 256>(cuda_problem, const bf16*, const bf16*, const bf16*, bf16*,
                                                       float*);
template __global__ void mma_forward_kernel<bf16, 128>(cuda_problem, const bf16*, const bf16*, const bf16*, bf16*,
                                                       float*);
template __global__ void mma_forward_kernel<bf16, 96>(cuda_problem, const bf16*, const bf16*, const bf16*, bf16*,
                                                     float*);
template __global__ void mma_forward_kernel<bf16, 64>(cuda_problem, const bf16*, const bf16*, const bf16*, bf16*,
                                                      float*);
template __global__ void flash_forward_kernel<bf16>(cuda_problem, const bf16*, const bf16*, const bf16*, bf16*,
                                                    float*);
// Backward's key pass (dk, dv) and dq pass: the mma ones and the WMMA ones.
// Above head_dim 128 the key pass runs twice, dV then dK (key_pass_outputs).
template __global__ void mma_key_pass_kernel<bf16, 256, key_pass_outputs::dv>(cuda_problem, const bf16*, const bf16*,
                                                                             const bf16*, const bf16*, const float*,
                                                                             const float*, bf16*, bf16*);
template __global__ void mma_key_pass_kernel<bf16, 256, key_pass_outputs::dk>(cuda_problem, const bf16*, const bf16*,
                                                                             const bf16*, const bf16*, const float*,
                                                                             const float*, bf16*, bf16*);
template __global__ void mma_key_pass_kernel<bf16, 128>(cuda_problem, const bf16*, const bf16*, const bf16*,
                                                        const bf16*, const float*, const float*, bf16*, bf16*);
template __global__ void mma_key_pass_kernel<bf16, 96>(cuda_problem, const bf16*, const bf16*, const bf16*,
                                                      const bf16*, const float*, const float*, bf16*, bf16*);
template __global__ void mma_key_pass_kernel<bf16, 64>(cuda_problem, const bf16*, const bf16*, const bf16*,
                                                       const bf16*, const float*, const float*, bf16*, bf16*);
template __global__ void flash_key_pass_kernel<bf16>(cuda_problem, const bf16*, const bf16*, const bf16*, const bf16*,
                                                     const float*, const float*, bf16*, bf16*);
template __global__ void mma_query_pass_kernel<bf16, 256>(cuda_problem, const bf16*, const bf16*, const bf16*,
                                                          const bf16*, const float*, const float*, bf16*);
template __global__ void mma_query_pass_kernel<bf16, 128>(cuda_problem, const bf16*, const bf16*, const bf16*,
                                                          const bf16*, const float*, const float*, bf16*);
template __global__ void mma_query_pass_kernel<bf16, 96>(cuda_problem, const bf16*, const bf16*, const bf16*,
                                                        const bf16*, const float*, const float*, bf16*);
template __global__ void mma_query_pass_kernel<bf16, 64>(cuda_problem, const bf16*, const bf16*, const bf16*,
                                                         const bf16*, const float*, const float*, bf16*);
template __global__ void flash_query_pass_kernel<bf16>(cuda_problem, const bf16*, const bf16*, const bf16*,
                                                       const bf16*, const float*, const float*, bf16*);
}  // namespace attention::detail
MEMKIT_NAMESPACE_END
