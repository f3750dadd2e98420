// What docs/attention.md's blocks use: q [B, Hq, S, D], k and v [B, Hkv, S, D], their outputs and gradients,
// packed documents' offsets.
#pragma once
#include <memkit/memkit.hpp>
using memkit::bf16;
inline constexpr std::int64_t B = 1, Hq = 8, Hkv = 2, S = 1024, D = 64;
inline memkit::tensor_view<const bf16> q, k, v, dout;
inline memkit::tensor_view<bf16> out, dq, dk, dv;
inline memkit::tensor_view<float> lse;
inline memkit::tensor_view<const std::int32_t> document_offsets;  // [B, N + 1]: packed documents
inline memkit::memory_resource& workspace = memkit::default_host_resource();
