// memkit/attention/detail/common.hpp — what attention's host tiles and CUDA kernels share: the masking and exp2
// math (MEMKIT_HOST_DEVICE, so both sides compute the same bits), the argument checks, the problem geometry,
// the host tile helpers with their instruction-set builds, and (under nvcc) the CUDA tile sizes, the warp
// product and the kernels' common prologue. Not a public header: flash_attention.hpp includes it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "memkit/attention/bytes.hpp"
#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/host_threads.hpp"
#include "memkit/core/host_simd.hpp"
#include "memkit/core/tensor_view.hpp"

#if MEMKIT_HAS_CUDA
#include <mma.h>
#endif

MEMKIT_NAMESPACE_BEGIN
namespace attention::detail {

inline constexpr float log2e = 1.4426950408889634f;
inline constexpr float ln2 = 0.6931471805599453f;
inline constexpr float minus_infinity = -std::numeric_limits<float>::infinity();

// 2^x for x <= 0 (x = -inf gives 0), relative error below 2e-7: round x to n, 2^(x - n) by a degree-6 Taylor
// polynomial on [-0.5, 0.5], 2^n through the exponent bits. Branch-free, so loops over it vectorize.
MEMKIT_HOST_DEVICE inline float exp2_nonpositive(float x) noexcept {
  const float clamped = x < -126.0f ? -126.0f : x;
  const float n = (clamped + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23)
  const float f = clamped - n;
  float p = 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  const std::int32_t bits = (static_cast<std::int32_t>(n) + 127) << 23;
  const float scale = __builtin_bit_cast(float, bits);
  return x < -126.0f ? 0.0f : p * scale;
}

// The keys query row i may see, as [first, last).
MEMKIT_HOST_DEVICE constexpr std::int64_t first_key(std::int64_t i, const attention_options& o) noexcept {
  return o.window > 0 ? (i - o.window + 1 > 0 ? i - o.window + 1 : 0) : 0;
}
MEMKIT_HOST_DEVICE constexpr std::int64_t last_key(std::int64_t i, std::int64_t S, const attention_options& o) noexcept {
  std::int64_t last = o.causal ? i + 1 : S;
  if (o.window > 0 && !o.causal) last = i + o.window < S ? i + o.window : S;
  return last;
}
// The queries that may see key j, as [first, last): the mirror of first_key / last_key.
MEMKIT_HOST_DEVICE constexpr std::int64_t first_query(std::int64_t j, const attention_options& o) noexcept {
  if (o.causal) return j;
  return o.window > 0 ? (j - o.window + 1 > 0 ? j - o.window + 1 : 0) : 0;
}
MEMKIT_HOST_DEVICE constexpr std::int64_t last_query(std::int64_t j, std::int64_t S, const attention_options& o) noexcept {
  return o.window > 0 ? (j + o.window < S ? j + o.window : S) : S;
}

template <class T>
void validate(const char* op, const tensor_view<const T>& q, const tensor_view<const T>& k,
              const tensor_view<const T>& v, const tensor_view<const std::int32_t>& documents,
              const tensor_view<const T>& out, const tensor_view<const float>& lse, const attention_options& o) {
  const std::string who = std::string("attention::") + op;
  require(q.shape().rank == 4, who + ": q must be [batch, heads, seq, head_dim], got " + to_string(q.shape()));
  require(k.shape().rank == 4 && v.shape().rank == 4,
          who + ": k and v must be [batch, kv_heads, seq, head_dim], got " + to_string(k.shape()) + " and " +
              to_string(v.shape()));
  const std::int64_t B = q.shape()[0], Hq = q.shape()[1], S = q.shape()[2], D = q.shape()[3];
  const std::int64_t Hkv = k.shape()[1];
  require(B > 0 && Hq > 0 && D > 0, who + ": q " + to_string(q.shape()) + " has an empty batch, head or head_dim");
  require(S > 0, who + ": sequence length is 0 (q " + to_string(q.shape()) + ")");
  require(Hkv > 0 && Hq % Hkv == 0, who + ": kv heads (" + std::to_string(Hkv) + ") must divide query heads (" +
                                        std::to_string(Hq) + ")");
  require(k.shape()[0] == B && k.shape()[2] == S && k.shape()[3] == D,
          who + ": k " + to_string(k.shape()) + " does not match q " + to_string(q.shape()) +
              " in batch, seq or head_dim");
  require_same_shape(k, v, who.c_str(), "k", "v");
  require_same_shape(q, out, who.c_str(), "q", "out");
  require(lse.shape() == shape{B, Hq, S},
          who + ": lse must be fp32 [" + std::to_string(B) + ", " + std::to_string(Hq) + ", " + std::to_string(S) +
              "], got " + to_string(lse.shape()));
  if (!documents.is_none()) {
    require(documents.shape().rank == 2 && documents.shape()[0] == B && documents.shape()[1] >= 2,
            who + ": document_offsets must be int32 [batch = " + std::to_string(B) + ", documents + 1 >= 2], got " +
                to_string(documents.shape()));
    require(documents.data() != nullptr, who + ": document_offsets has no data (null pointer)");
    // Device memory is not read here (that would synchronize); the kernels clamp each document into its row.
    if (documents.where() != memory_kind::device) check_document_offsets(who, documents, B, S);
  }
  require(o.window >= 0, who + ": window must be >= 0 (0: none), got " + std::to_string(o.window));
  require_host_threads(who, o.host_threads);
  require(std::isfinite(o.scale) && o.scale >= 0, who + ": scale must be finite and >= 0 (0: 1/sqrt(head_dim))");
  for (const void* p : {static_cast<const void*>(q.data()), static_cast<const void*>(k.data()),
                        static_cast<const void*>(v.data()), static_cast<const void*>(out.data()),
                        static_cast<const void*>(lse.data())})
    require(p != nullptr, who + ": a tensor has no data (null pointer)");
}

// validate plus the executor's access to every tensor: forward's q, k, v, out, lse.
template <class T, executor E>
void validate_forward(const E& exec, const tensor_view<const T>& q, const tensor_view<const T>& k,
                      const tensor_view<const T>& v, const tensor_view<const std::int32_t>& documents,
                      const tensor_view<const T>& out, const tensor_view<const float>& lse,
                      const attention_options& o) {
  validate<T>("forward", q, k, v, documents, out, lse, o);
  require_accessible(exec, documents, "attention::forward", "document_offsets");
  require_accessible(exec, q, "attention::forward", "q");
  require_accessible(exec, k, "attention::forward", "k");
  require_accessible(exec, v, "attention::forward", "v");
  require_accessible(exec, out, "attention::forward", "out");
  require_accessible(exec, lse, "attention::forward", "lse");
}

// The same for backward, with dout and the three gradients.
template <class T, executor E>
void validate_backward(const E& exec, const tensor_view<const T>& q, const tensor_view<const T>& k,
                       const tensor_view<const T>& v, const tensor_view<const std::int32_t>& documents,
                       const tensor_view<const T>& out, const tensor_view<const float>& lse,
                       const tensor_view<const T>& dout, const tensor_view<const T>& dq,
                       const tensor_view<const T>& dk, const tensor_view<const T>& dv, const attention_options& o) {
  validate<T>("backward", q, k, v, documents, out, lse, o);
  require_accessible(exec, documents, "attention::backward", "document_offsets");
  require_same_shape(q, dout, "attention::backward", "q", "dout");
  require_same_shape(q, dq, "attention::backward", "q", "dq");
  require_same_shape(k, dk, "attention::backward", "k", "dk");
  require_same_shape(v, dv, "attention::backward", "v", "dv");
  require(dout.data() && dq.data() && dk.data() && dv.data(), "attention::backward: a gradient tensor has no data");
  require_accessible(exec, q, "attention::backward", "q");
  require_accessible(exec, k, "attention::backward", "k");
  require_accessible(exec, v, "attention::backward", "v");
  require_accessible(exec, out, "attention::backward", "out");
  require_accessible(exec, lse, "attention::backward", "lse");
  require_accessible(exec, dout, "attention::backward", "dout");
  require_accessible(exec, dq, "attention::backward", "dq");
  require_accessible(exec, dk, "attention::backward", "dk");
  require_accessible(exec, dv, "attention::backward", "dv");
}

inline float resolved_scale(const attention_options& o, std::int64_t D) noexcept {
  return o.scale > 0 ? o.scale : 1.0f / std::sqrt(static_cast<float>(D));
}

// Which of run_in_parts' ranges starts at `first` (its bounds are count * part / parts).
inline std::int64_t part_starting_at(std::int64_t first, std::int64_t count, std::int64_t parts) noexcept {
  for (std::int64_t part = 0; part < parts; ++part)
    if (count * part / parts == first) return part;
  return 0;
}

// The geometry every host routine shares.
struct problem {
  std::int64_t B, Hq, Hkv, S, D, group;
  float scale;      // softmax scale
  float scale_log2; // scale * log2(e): scores in base 2
  attention_options o;
  const std::int32_t* offsets;   // document offsets [B, offsets_per_row], or null: one document per row
  std::int64_t offsets_per_row;
};

inline problem make_problem(const shape& qs, std::int64_t Hkv, const attention_options& o,
                            const tensor_view<const std::int32_t>& documents) {
  problem p{qs[0], qs[1], Hkv, qs[2], qs[3], qs[1] / Hkv, 0.0f, 0.0f, o, documents.data(),
            documents.is_none() ? 0 : documents.shape()[1]};
  p.scale = resolved_scale(o, p.D);
  p.scale_log2 = p.scale * log2e;
  return p;
}

// rows x D of T starting at `src` into fp32 `dst` (row stride D), optionally multiplied by `factor`.
template <class T>
inline void load_rows(const T* __restrict src, std::int64_t rows, std::int64_t D, float* __restrict dst) noexcept {
  for (std::int64_t e = 0; e < rows * D; ++e) dst[e] = to_float(src[e]);
}
// rows x D of T into fp32 transposed [D, tile] (columns past `rows` untouched).
template <class T>
inline void load_transposed(const T* __restrict src, std::int64_t rows, std::int64_t D, std::int64_t tile,
                            float* __restrict dst) noexcept {
  for (std::int64_t j = 0; j < rows; ++j)
    for (std::int64_t d = 0; d < D; ++d) dst[d * tile + j] = to_float(src[j * D + d]);
}
// row[0..n) = sum_d a[d] * bt[d * tile + j]: a score row against a transposed tile, contiguous inner loop.
inline void row_times_transposed(const float* __restrict a, const float* __restrict bt, std::int64_t D,
                                 std::int64_t tile, std::int64_t n, float* __restrict row) noexcept {
  for (std::int64_t j = 0; j < n; ++j) row[j] = 0.0f;
  for (std::int64_t d = 0; d < D; ++d) {
    const float ad = a[d];
    const float* __restrict b = bt + d * tile;
    for (std::int64_t j = 0; j < n; ++j) row[j] += ad * b[j];
  }
}
// The host's query tile `item` of the (batch, query head, query tile) items: its head row bh = b * Hq + h, first
// query i0 and row count, and the kv head row it reads (b * Hkv + kv head).
struct query_tile_place {
  std::int64_t bh, i0, rows, bkv;
};
inline query_tile_place query_tile_at(const problem& p, std::int64_t item) noexcept {
  const std::int64_t query_tiles = tiles_of(p.S, host_query_tile);
  const std::int64_t bh = item / query_tiles, i0 = (item % query_tiles) * host_query_tile;
  const std::int64_t b = bh / p.Hq, kvh = (bh % p.Hq) / p.group;
  return {bh, i0, std::min(host_query_tile, p.S - i0), b * p.Hkv + kvh};
}
// The keys query i of batch row b sees, [begin, end): the mask within i's document.
inline position_span visible_keys(const problem& p, std::int64_t b, std::int64_t i) noexcept {
  const position_span doc = document_of(p.offsets, p.offsets_per_row, b, i, p.S);
  return {std::max(first_key(i, p.o), doc.begin), std::min(last_key(i, p.S, p.o), doc.end)};
}
// The queries that see key j of batch row b, [begin, end): the mirror, within j's document.
inline position_span visible_queries(const problem& p, std::int64_t b, std::int64_t j) noexcept {
  const position_span doc = document_of(p.offsets, p.offsets_per_row, b, j, p.S);
  return {std::max(first_query(j, p.o), doc.begin), std::min(last_query(j, p.S, p.o), doc.end)};
}
// The columns [lo, hi) of the key tile starting at j0 (cols keys) that query i sees; empty when lo >= hi.
struct key_columns {
  std::int64_t lo, hi;
};
inline key_columns key_columns_of(const problem& p, std::int64_t b, std::int64_t i, std::int64_t j0,
                                  std::int64_t cols) noexcept {
  const position_span keys = visible_keys(p, b, i);
  return {std::max<std::int64_t>(keys.begin - j0, 0), std::min<std::int64_t>(keys.end - j0, cols)};
}
// The host walk of one query tile's keys: every key tile that rows [t.i0, t.i0 + t.rows) of batch row b can see
// (both ends of the visible keys grow with i, so the tiles of [first row's begin, last row's end)), each loaded
// once by load(j0, cols), then row(r, i, cols, lo, hi) for each row r (query i) that sees the columns
// [lo, hi) of it. The forward and the dQ pass share it, so they visit the same keys in the same order.
template <class Load, class Row>
inline void for_each_visible_key_tile(const problem& p, const query_tile_place& t, Load&& load, Row&& row) noexcept {
  const std::int64_t BK = host_key_tile, b = t.bh / p.Hq;
  const std::int64_t j_begin = visible_keys(p, b, t.i0).begin, j_end = visible_keys(p, b, t.i0 + t.rows - 1).end;
  for (std::int64_t j0 = j_begin / BK * BK; j0 < j_end; j0 += BK) {
    const std::int64_t cols = std::min(BK, p.S - j0);
    load(j0, cols);
    for (std::int64_t r = 0; r < t.rows; ++r) {
      const std::int64_t i = t.i0 + r;
      const key_columns c = key_columns_of(p, b, i, j0, cols);
      if (c.lo < c.hi) row(r, i, cols, c.lo, c.hi);
    }
  }
}
// acc[0..D) += w * x[0..D)
inline void axpy(float w, const float* __restrict x, std::int64_t D, float* __restrict acc) noexcept {
  for (std::int64_t d = 0; d < D; ++d) acc[d] += w * x[d];
}

// The three instruction-set builds of each routine: the same C++ compiled with the wider vector units and
// everything it calls inlined into it (flatten), chosen by host_isa_in_use().
#if MEMKIT_X86_DISPATCH
#define MEMKIT_ATTENTION_ISA_VARIANTS(NAME)                                                                     \
  template <class... A>                                                                                         \
  __attribute__((target("avx2,fma"), flatten)) void NAME##_avx2(A... args) noexcept {                           \
    NAME(args...);                                                                                              \
  }                                                                                                             \
  template <class... A>                                                                                         \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma"), flatten)) void NAME##_avx512(          \
      A... args) noexcept {                                                                                     \
    NAME(args...);                                                                                              \
  }
// (forward_pass.hpp and backward_passes.hpp instantiate it for their routines.)
#define MEMKIT_ATTENTION_DISPATCH(NAME, ...)                   \
  switch (host_isa_in_use()) {                                 \
    case host_isa::avx512: NAME##_avx512(__VA_ARGS__); break;  \
    case host_isa::avx2: NAME##_avx2(__VA_ARGS__); break;      \
    default: NAME(__VA_ARGS__); break;                         \
  }
#else
#define MEMKIT_ATTENTION_ISA_VARIANTS(NAME)
#define MEMKIT_ATTENTION_DISPATCH(NAME, ...) NAME(__VA_ARGS__);
#endif

// ---------------------------------------------------------------------------------------------------------------
// CUDA. One CTA owns a tile of rows (queries in forward and the dq pass, keys in the dk/dv pass), one warp per 16
// rows, and walks the tiles of the other side through shared memory. The two products of each step run on the
// tensor cores (WMMA 16x16x16, fp32 accumulation) for bf16 and fp16, and as plain fp32 loops for fp32. Softmax,
// masking and the backward's elementwise step use the same first_key / last_key / exp2_nonpositive as the host.
// Every warp only ever touches its own rows between the block-wide tile loads, so warps synchronize with
// __syncwarp and the block only around loads. All launches go on the executor's stream; nothing synchronizes.
// Limits: head_dim <= 128, and a multiple of 16 for bf16 / fp16 (the MMA shape); mma_head_dims below for the
// opt-in mma kernels.
// ---------------------------------------------------------------------------------------------------------------
#if MEMKIT_HAS_CUDA

template <class T> struct cuda_tiles {
  static constexpr int rows = std::is_same_v<T, float> ? 32 : 64;  // rows a CTA owns (16 per warp)
  static constexpr int forward_cols = 64;                          // key tile of forward
  static constexpr int backward_cols = 32;                         // the other side's tile in backward
  static constexpr int threads = rows / 16 * 32;
};
MEMKIT_HOST_DEVICE constexpr std::int64_t align32(std::int64_t bytes) noexcept { return (bytes + 31) / 32 * 32; }

template <class T> struct mma_type { using type = T; };
template <> struct mma_type<bf16> { using type = __nv_bfloat16; };
template <> struct mma_type<fp16> { using type = __half; };

// C[16 x N] = (accumulate ? C : 0) + A[16 x K] * B, A row-major (lda); B stored [K][N] row-major (ldb), or, when
// b_transposed, stored [N][K] row-major and used transposed. One warp; N and K are multiples of 16.
template <bool b_transposed, class T>
__device__ inline void warp_product(float* C, int ldc, const T* A, int lda, const T* Bm, int ldb, int N, int K,
                                    bool accumulate) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (!std::is_same_v<T, float>) {
    using M = typename mma_type<T>::type;
    namespace w = nvcuda::wmma;
    using b_layout = std::conditional_t<b_transposed, w::col_major, w::row_major>;
    for (int n = 0; n < N; n += 16) {
      w::fragment<w::accumulator, 16, 16, 16, float> acc;
      if (accumulate) w::load_matrix_sync(acc, C + n, ldc, w::mem_row_major);
      else w::fill_fragment(acc, 0.0f);
      for (int k = 0; k < K; k += 16) {
        w::fragment<w::matrix_a, 16, 16, 16, M, w::row_major> a;
        w::fragment<w::matrix_b, 16, 16, 16, M, b_layout> b;
        w::load_matrix_sync(a, reinterpret_cast<const M*>(A) + k, lda);
        w::load_matrix_sync(b, reinterpret_cast<const M*>(Bm) + (b_transposed ? n * ldb + k : k * ldb + n), ldb);
        w::mma_sync(acc, a, b, acc);
      }
      w::store_matrix_sync(C + n, acc, ldc, w::mem_row_major);
    }
    return;
  }
#endif
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int e = lane; e < 16 * N; e += 32) {
    const int r = e / N, c = e % N;
    float sum = 0.0f;
    for (int k = 0; k < K; ++k)
      sum += to_float(A[r * lda + k]) * to_float(b_transposed ? Bm[c * ldb + k] : Bm[k * ldb + c]);
    C[r * ldc + c] = accumulate ? C[r * ldc + c] + sum : sum;
  }
}

// rows x D elements from global `src` (valid rows only; the rest zero) into shared `dst`, by the whole block.
template <class T>
__device__ inline void load_tile(T* dst, const T* src, std::int64_t valid_rows, int rows, int D) {
  for (int e = static_cast<int>(threadIdx.x); e < rows * D; e += static_cast<int>(blockDim.x))
    dst[e] = e / D < valid_rows ? src[e] : from_float<T>(0.0f);
}

struct cuda_problem {
  int B, Hq, Hkv, S, D, group;
  float scale, scale_log2;
  attention_options o;
  const std::int32_t* offsets;  // document offsets [B, offsets_per_row] (device-accessible), or null
  int offsets_per_row;
};
// The keys query i of batch row b sees (forward, dq pass) and the queries that see key j (dk/dv pass), each within
// the document of i (of j): the device twins of visible_keys / visible_queries, with the same bounds.
__device__ inline position_span visible_keys(const cuda_problem& p, std::int64_t b, int i) {
  const position_span doc = document_of(p.offsets, p.offsets_per_row, b, i, p.S);
  const std::int64_t first = first_key(i, p.o), last = last_key(i, p.S, p.o);
  return {first > doc.begin ? first : doc.begin, last < doc.end ? last : doc.end};
}
__device__ inline position_span visible_queries(const cuda_problem& p, std::int64_t b, int j) {
  const position_span doc = document_of(p.offsets, p.offsets_per_row, b, j, p.S);
  const std::int64_t first = first_query(j, p.o), last = last_query(j, p.S, p.o);
  return {first > doc.begin ? first : doc.begin, last < doc.end ? last : doc.end};
}
// What the warp owning the 16 rows from `first` sees: keys (rows are queries) or queries (rows are keys), from its
// first row's begin to its last row's end (both grow with the row). Empty past S. A tile of the other side outside
// it (another document, or masked) is skipped by the warp: it would add exact zeros.
__device__ inline position_span warp_span(const cuda_problem& p, std::int64_t b, int first, int S, bool rows_are_queries) {
  if (first >= S) return {0, 0};
  const int last = first + 15 < S ? first + 15 : S - 1;
  return rows_are_queries ? position_span{visible_keys(p, b, first).begin, visible_keys(p, b, last).end}
                          : position_span{visible_queries(p, b, first).begin, visible_queries(p, b, last).end};
}

// The kernels' common prologue. blockIdx.x = (batch * heads + head) * tiles + tile: the CTA owns `rows` rows of
// one head, starting at `first`.
struct block_tile {
  std::int64_t head;  // batch * heads + head
  int first;
};
template <int R>
__device__ inline block_tile block_tile_of(int S) {
  const int tiles = (S + R - 1) / R;
  return {blockIdx.x / tiles, static_cast<int>(blockIdx.x % tiles) * R};
}
// The kv row (batch * Hkv + kv head) that query row bh = batch * Hq + query head reads.
__device__ inline std::int64_t kv_head_of(const cuda_problem& p, std::int64_t bh) {
  const int kvh = static_cast<int>(bh % p.Hq) / p.group;
  return bh / p.Hq * p.Hkv + kvh;
}
// Carves a CTA's dynamic shared memory into 32-byte-aligned arrays. With no base it only counts: each kernel's
// layout (the *_smem struct beside it) is written once and gives both the kernel's arrays and the launch's bytes.
struct smem_carver {
  unsigned char* base = nullptr;
  std::int64_t used = 0;
  template <class E>
  MEMKIT_HOST_DEVICE E* take(std::int64_t count) {
    E* at = base != nullptr ? reinterpret_cast<E*>(base + used) : nullptr;
    used += align32(count * static_cast<std::int64_t>(sizeof(E)));
    return at;
  }
};
// Shared-memory bytes of layout L for head_dim D (checked against the device's opt-in limit before launching).
template <class L>
std::int64_t smem_bytes(int D) {
  smem_carver count;
  (void)L(count, D);
  return count.used;
}

// The head_dims the mma kernels (attention_kernel::mma, detail/mma_forward.hpp) are instantiated for, bf16 / fp16
// only; every other head_dim up to 128 runs the WMMA kernels, and 256 runs on the mma kernels alone. Listed once:
// the mma dispatch, mma_forward_supports and the messages below read it.
using mma_head_dims = std::integer_sequence<int, 64, 96, 128, 256>;
constexpr bool is_mma_head_dim(std::int64_t D) noexcept {
  return []<int... Ds>(std::int64_t d, std::integer_sequence<int, Ds...>) {
    return ((d == Ds) || ...);
  }(D, mma_head_dims{});
}
// What CUDA runs, for the messages that refuse a head_dim.
inline std::string cuda_head_dims_text() {
  std::string mma;
  [&]<int... Ds>(std::integer_sequence<int, Ds...>) {
    ((mma += (mma.empty() ? "" : ", "), mma += std::to_string(Ds)), ...);
  }(mma_head_dims{});
  return "CUDA runs bf16/fp16 at a multiple of 16 up to 128 and fp32 at any head_dim up to 128 (the WMMA kernels), "
         "and attention_kernel::mma's kernels run bf16/fp16 at " + mma + " (above 128 only with that option)";
}

template <class T>
cuda_problem make_cuda_problem(const shape& qs, std::int64_t Hkv, const attention_options& o,
                               const tensor_view<const std::int32_t>& documents, const char* op) {
  const std::string who = std::string("attention::") + op + " (CUDA)";
  const bool mma = o.kernel == attention_kernel::mma && !std::is_same_v<T, float> && is_mma_head_dim(qs[3]);
  require(qs[3] <= 128 || mma, who + ": head_dim " + std::to_string(qs[3]) + " is above the WMMA kernels' 128. " +
                                   cuda_head_dims_text());
  require(std::is_same_v<T, float> || qs[3] % 16 == 0, who + ": head_dim " + std::to_string(qs[3]) +
                                                           " must be a multiple of 16 for bf16/fp16 (the MMA shape). " +
                                                           cuda_head_dims_text());
  require(qs[2] < (std::int64_t{1} << 30) && qs[0] * qs[1] * qs[2] < (std::int64_t{1} << 31),
          who + ": batch * heads * seq must stay below 2^31 on CUDA");
  const problem h = make_problem(qs, Hkv, o, documents);
  return {static_cast<int>(h.B), static_cast<int>(h.Hq), static_cast<int>(h.Hkv), static_cast<int>(h.S),
          static_cast<int>(h.D), static_cast<int>(h.group), h.scale, h.scale_log2, o, h.offsets,
          static_cast<int>(h.offsets_per_row)};
}

template <class Kernel>
void prepare_smem(const cuda_executor& exec, Kernel kernel, std::int64_t bytes, const char* op) {
  int limit = 0;
  MEMKIT_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, exec.device));
  require(bytes <= limit, std::string("attention::") + op + " (CUDA): the kernel needs " + std::to_string(bytes) +
                              " bytes of shared memory, the device allows " + std::to_string(limit));
  MEMKIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

#endif  // MEMKIT_HAS_CUDA

}  // namespace attention::detail
MEMKIT_NAMESPACE_END
