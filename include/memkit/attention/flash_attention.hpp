// memkit/attention/flash_attention.hpp — memory-efficient scaled-dot-product attention (FlashAttention).
//
// q [B, Hq, S, D], k and v [B, Hkv, S, D] with Hq % Hkv == 0 (grouped-query attention: query head h reads kv head
// h / (Hq / Hkv); k and v are never expanded), out [B, Hq, S, D], lse fp32 [B, Hq, S]. Causal or not, with an
// optional sliding window: query i sees key j when (not causal or j <= i) and (window == 0 or |i - j| < window).
//
// The algorithm: a tile of queries meets the key tiles one at a time, keeping each row's running maximum and
// sum, so the [S, S] scores never exist. Forward saves only out and each row's log-sum-exp; backward
// recomputes the tile scores from them, with delta = rowsum(dout * out). Memory is O(S): the workspace is a few
// tiles per thread plus delta. Backward runs two passes so no two threads ever write the same element: one over
// key tiles (dk, dv: a kv head's tile sums over its whole query-head group) and one over query tiles (dq).
// dq, dk and dv are overwritten, not accumulated.
//
// Every byte is said before it is allocated: workspace_bytes(forward_arguments / backward_arguments) is exactly
// what forward / backward take from `workspace`, saved_bytes(forward_arguments) what a layer keeps for backward, and
// eager_attention_bytes what a materialized attention (scores as an fp32 [B, Hq, S, S] matrix) would hold.
//
// Host: fp32 tiles (K and V transposed so every inner loop is a contiguous multiply-add), a vectorizable exp2,
// compiled for AVX-512, AVX2 and plain x86-64 and chosen at run time (core/host_simd.hpp); threads over
// (batch, head, tile) with core/host_threads.hpp. CUDA (under nvcc): see the second half of this header.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/host_simd.hpp"
#include "memkit/core/host_threads.hpp"
#include "memkit/core/protocol.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"

#if MEMKIT_HAS_CUDA
#include <mma.h>
#endif

MEMKIT_NAMESPACE_BEGIN
namespace attention {

struct attention_options {
  bool causal = true;
  std::int64_t window = 0;  // 0: no sliding window; else query i sees keys with |i - j| < window
  float scale = 0;          // 0: 1 / sqrt(head_dim)
  int host_threads = 0;     // 0: every hardware thread
};

// Host tile sizes: a 64 x 64 fp32 score tile and 64-row K/V tiles (D = 128: 32 KiB each) stay in L1/L2.
inline constexpr std::int64_t host_query_tile = 64;
inline constexpr std::int64_t host_key_tile = 64;

namespace detail {

constexpr std::int64_t tiles_of(std::int64_t count, std::int64_t tile) noexcept { return (count + tile - 1) / tile; }
constexpr std::int64_t round_to_16(std::int64_t floats) noexcept { return (floats + 15) / 16 * 16; }

// The threads the host path runs: the option's count (all hardware threads for 0), never more than the items.
// Not a constant expression for host_threads == 0 (the hardware is asked at run time).
constexpr std::int64_t host_parts(std::int64_t items, int host_threads) noexcept {
  const std::int64_t threads = host_threads > 0 ? host_threads : hardware_threads();
  return std::max<std::int64_t>(1, std::min(threads, items));
}

// fp32 scratch of one thread: forward keeps Q, O (query tile), K^T, V (key tile), one score row, m and l.
constexpr std::int64_t forward_part_floats(std::int64_t D) noexcept {
  return round_to_16(2 * host_query_tile * D + 2 * host_key_tile * D + host_key_tile + 2 * host_query_tile);
}
// Backward: the key pass keeps K^T, V^T, dK, dV (key tile), Q, dO (query tile); the query pass K^T, V^T, K
// (key tile), Q, dO, dQ (query tile); both three score rows and lse, delta of the query tile.
constexpr std::int64_t backward_part_floats(std::int64_t D) noexcept {
  return round_to_16(4 * host_key_tile * D + 3 * host_query_tile * D + 3 * host_key_tile + 2 * host_query_tile);
}

}  // namespace detail

// --- The component protocol (docs/architecture.md): the problem of one call, and three byte functions. ---

// q [B, Hq, S, D], k and v [B, Hkv, S, D] of element_bytes each (4: fp32, 2: bf16 / fp16).
struct problem_arguments {
  std::int64_t batch = 0, query_heads = 0, kv_heads = 0, sequence = 0, head_dim = 0;
  std::size_t element_bytes = 2;
  bool on_device = false;
  attention_options options{};
};
struct forward_arguments : problem_arguments {};
struct backward_arguments : problem_arguments {};

namespace detail {
constexpr bool no_work(const problem_arguments& a) noexcept {
  return a.batch <= 0 || a.query_heads <= 0 || a.sequence <= 0 || a.head_dim <= 0;
}
constexpr std::int64_t host_items(const problem_arguments& a) noexcept {
  return a.batch * a.query_heads * tiles_of(a.sequence, host_query_tile);
}
}  // namespace detail

// Bytes forward takes from `workspace` (host: per-thread tiles; CUDA: none).
constexpr std::size_t workspace_bytes(const forward_arguments& a) noexcept {
  if (a.on_device || detail::no_work(a)) return 0;
  return static_cast<std::size_t>(detail::host_parts(detail::host_items(a), a.options.host_threads) *
                                  detail::forward_part_floats(a.head_dim)) *
         sizeof(float);
}
// What forward leaves for backward, in tensors the caller holds: out [B, Hq, S, D] and lse fp32 [B, Hq, S]
// (plus q, k, v, which its caller owns or saves anyway).
constexpr std::size_t saved_bytes(const forward_arguments& a) noexcept {
  const std::int64_t rows = a.batch * a.query_heads * a.sequence;
  return static_cast<std::size_t>(rows * a.head_dim) * a.element_bytes + static_cast<std::size_t>(rows) * sizeof(float);
}
// Forward allocates nothing it keeps: out and lse are the caller's.
constexpr std::size_t bytes_required(const forward_arguments& a) noexcept { return workspace_bytes(a); }

// Bytes backward takes from `workspace`: delta fp32 [B, Hq, S], plus per-thread tiles on the host.
constexpr std::size_t workspace_bytes(const backward_arguments& a) noexcept {
  if (detail::no_work(a)) return 0;
  const std::size_t delta =
      static_cast<std::size_t>(detail::round_to_16(a.batch * a.query_heads * a.sequence)) * sizeof(float);
  if (a.on_device) return delta;
  return delta + static_cast<std::size_t>(detail::host_parts(detail::host_items(a), a.options.host_threads) *
                                          detail::backward_part_floats(a.head_dim)) *
                     sizeof(float);
}
constexpr std::size_t saved_bytes(const backward_arguments&) noexcept { return 0; }
constexpr std::size_t bytes_required(const backward_arguments& a) noexcept { return workspace_bytes(a); }

// What a materialized (eager) attention holds at its peak besides q, k, v, out and their gradients: the fp32
// probabilities [B, Hq, S, S] saved by forward, and the fp32 gradient of the scores in backward.
constexpr std::size_t eager_attention_bytes(std::int64_t B, std::int64_t Hq, std::int64_t S) noexcept {
  return 2 * static_cast<std::size_t>(B * Hq * S * S) * sizeof(float);
}

namespace detail {

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

template <class T>
void validate(const char* op, const tensor_view<const T>& q, const tensor_view<const T>& k,
              const tensor_view<const T>& v, const tensor_view<const T>& out, const tensor_view<const float>& lse,
              const attention_options& o) {
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
  require(o.window >= 0, who + ": window must be >= 0 (0: none), got " + std::to_string(o.window));
  require_host_threads(who, o.host_threads);
  require(std::isfinite(o.scale) && o.scale >= 0, who + ": scale must be finite and >= 0 (0: 1/sqrt(head_dim))");
  for (const void* p : {static_cast<const void*>(q.data()), static_cast<const void*>(k.data()),
                        static_cast<const void*>(v.data()), static_cast<const void*>(out.data()),
                        static_cast<const void*>(lse.data())})
    require(p != nullptr, who + ": a tensor has no data (null pointer)");
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
};

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
// acc[0..D) += w * x[0..D)
inline void axpy(float w, const float* __restrict x, std::int64_t D, float* __restrict acc) noexcept {
  for (std::int64_t d = 0; d < D; ++d) acc[d] += w * x[d];
}

// Forward of one (batch, query head, query tile).
template <class T>
inline void forward_item(const problem& p, const T* q, const T* k, const T* v, T* out, float* lse, std::int64_t item,
                         float* scratch) noexcept {
  const std::int64_t D = p.D, S = p.S, BQ = host_query_tile, BK = host_key_tile;
  const std::int64_t query_tiles = tiles_of(S, BQ);
  const std::int64_t bh = item / query_tiles, i0 = (item % query_tiles) * BQ;
  const std::int64_t rows = std::min(BQ, S - i0);
  const std::int64_t b = bh / p.Hq, kvh = (bh % p.Hq) / p.group;
  float* Q = scratch;
  float* O = Q + BQ * D;
  float* Kt = O + BQ * D;
  float* V = Kt + BK * D;
  float* row = V + BK * D;
  float* m = row + BK;
  float* l = m + BQ;
  load_rows(q + (bh * S + i0) * D, rows, D, Q);
  for (std::int64_t e = 0; e < rows * D; ++e) {
    Q[e] *= p.scale_log2;
    O[e] = 0.0f;
  }
  for (std::int64_t r = 0; r < rows; ++r) m[r] = minus_infinity, l[r] = 0.0f;
  const T* kh = k + (b * p.Hkv + kvh) * S * D;
  const T* vh = v + (b * p.Hkv + kvh) * S * D;
  const std::int64_t j_begin = first_key(i0, p.o), j_end = last_key(i0 + rows - 1, S, p.o);
  for (std::int64_t j0 = j_begin / BK * BK; j0 < j_end; j0 += BK) {
    const std::int64_t cols = std::min(BK, S - j0);
    load_transposed(kh + j0 * D, cols, D, BK, Kt);
    load_rows(vh + j0 * D, cols, D, V);
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t i = i0 + r;
      const std::int64_t lo = std::max<std::int64_t>(first_key(i, p.o) - j0, 0);
      const std::int64_t hi = std::min<std::int64_t>(last_key(i, S, p.o) - j0, cols);
      if (lo >= hi) continue;
      row_times_transposed(Q + r * D, Kt, D, BK, cols, row);
      float tile_max = minus_infinity;
      for (std::int64_t j = lo; j < hi; ++j) tile_max = std::max(tile_max, row[j]);
      const float m_new = std::max(m[r], tile_max);
      const float correction = exp2_nonpositive(m[r] - m_new);
      float sum = 0.0f;
      for (std::int64_t j = lo; j < hi; ++j) {
        row[j] = exp2_nonpositive(row[j] - m_new);
        sum += row[j];
      }
      float* o_row = O + r * D;
      if (correction != 1.0f)
        for (std::int64_t d = 0; d < D; ++d) o_row[d] *= correction;
      for (std::int64_t j = lo; j < hi; ++j) axpy(row[j], V + j * D, D, o_row);
      l[r] = l[r] * correction + sum;
      m[r] = m_new;
    }
  }
  T* o_out = out + (bh * S + i0) * D;
  for (std::int64_t r = 0; r < rows; ++r) {
    const float inv = 1.0f / l[r];
    for (std::int64_t d = 0; d < D; ++d) o_out[r * D + d] = from_float<T>(O[r * D + d] * inv);
    lse[bh * S + i0 + r] = (m[r] + std::log2(l[r])) * ln2;
  }
}

// Backward key pass of one (batch, kv head, key tile): dK and dV summed over the query heads of the group.
template <class T>
inline void backward_key_item(const problem& p, const T* q, const T* k, const T* v, const T* dout,
                              const float* lse, const float* delta, T* dk, T* dv, std::int64_t item,
                              float* scratch) noexcept {
  const std::int64_t D = p.D, S = p.S, BQ = host_query_tile, BK = host_key_tile;
  const std::int64_t key_tiles = tiles_of(S, BK);
  const std::int64_t bkv = item / key_tiles, j0 = (item % key_tiles) * BK;
  const std::int64_t cols = std::min(BK, S - j0);
  const std::int64_t b = bkv / p.Hkv, kvh = bkv % p.Hkv;
  float* Kt = scratch;
  float* Vt = Kt + BK * D;
  float* dK = Vt + BK * D;
  float* dV = dK + BK * D;
  float* Q = dV + BK * D;
  float* dO = Q + BQ * D;
  float* prob = dO + BQ * D;
  float* dprob = prob + BK;
  load_transposed(k + (bkv * S + j0) * D, cols, D, BK, Kt);
  load_transposed(v + (bkv * S + j0) * D, cols, D, BK, Vt);
  for (std::int64_t e = 0; e < BK * D; ++e) dK[e] = 0.0f, dV[e] = 0.0f;
  // Queries that can see a key of this tile.
  std::int64_t i_begin = 0, i_end = S;
  if (p.o.causal) i_begin = j0;
  if (p.o.window > 0) {
    i_end = std::min(S, j0 + cols - 1 + p.o.window);
    if (!p.o.causal) i_begin = std::max<std::int64_t>(0, j0 - p.o.window + 1);
  }
  for (std::int64_t h = kvh * p.group; h < (kvh + 1) * p.group; ++h) {
    const std::int64_t bh = b * p.Hq + h;
    for (std::int64_t i0 = i_begin / BQ * BQ; i0 < i_end; i0 += BQ) {
      const std::int64_t rows = std::min(BQ, S - i0);
      load_rows(q + (bh * S + i0) * D, rows, D, Q);
      load_rows(dout + (bh * S + i0) * D, rows, D, dO);
      for (std::int64_t r = 0; r < rows; ++r) {
        const std::int64_t i = i0 + r;
        const std::int64_t lo = std::max<std::int64_t>(first_key(i, p.o) - j0, 0);
        const std::int64_t hi = std::min<std::int64_t>(last_key(i, S, p.o) - j0, cols);
        if (lo >= hi) continue;
        const float lse2 = lse[bh * S + i] * log2e, di = delta[bh * S + i];
        row_times_transposed(Q + r * D, Kt, D, BK, cols, prob);
        row_times_transposed(dO + r * D, Vt, D, BK, cols, dprob);
        for (std::int64_t j = lo; j < hi; ++j) {
          prob[j] = exp2_nonpositive(prob[j] * p.scale_log2 - lse2);
          dprob[j] = prob[j] * (dprob[j] - di) * p.scale;  // d(score) times the scale: dK = dS^T Q * scale
        }
        for (std::int64_t j = lo; j < hi; ++j) {
          axpy(prob[j], dO + r * D, D, dV + j * D);
          axpy(dprob[j], Q + r * D, D, dK + j * D);
        }
      }
    }
  }
  T* dk_out = dk + (bkv * S + j0) * D;
  T* dv_out = dv + (bkv * S + j0) * D;
  for (std::int64_t e = 0; e < cols * D; ++e) {
    dk_out[e] = from_float<T>(dK[e]);
    dv_out[e] = from_float<T>(dV[e]);
  }
}

// Backward query pass of one (batch, query head, query tile): dQ.
template <class T>
inline void backward_query_item(const problem& p, const T* q, const T* k, const T* v, const T* dout,
                                const float* lse, const float* delta, T* dq, std::int64_t item,
                                float* scratch) noexcept {
  const std::int64_t D = p.D, S = p.S, BQ = host_query_tile, BK = host_key_tile;
  const std::int64_t query_tiles = tiles_of(S, BQ);
  const std::int64_t bh = item / query_tiles, i0 = (item % query_tiles) * BQ;
  const std::int64_t rows = std::min(BQ, S - i0);
  const std::int64_t b = bh / p.Hq, kvh = (bh % p.Hq) / p.group;
  float* Kt = scratch;
  float* Vt = Kt + BK * D;
  float* K = Vt + BK * D;
  float* Q = K + BK * D;
  float* dO = Q + BQ * D;
  float* dQ = dO + BQ * D;
  float* prob = dQ + BQ * D;
  float* dprob = prob + BK;
  load_rows(q + (bh * S + i0) * D, rows, D, Q);
  load_rows(dout + (bh * S + i0) * D, rows, D, dO);
  for (std::int64_t e = 0; e < rows * D; ++e) dQ[e] = 0.0f;
  const T* kh = k + (b * p.Hkv + kvh) * S * D;
  const T* vh = v + (b * p.Hkv + kvh) * S * D;
  const std::int64_t j_begin = first_key(i0, p.o), j_end = last_key(i0 + rows - 1, S, p.o);
  for (std::int64_t j0 = j_begin / BK * BK; j0 < j_end; j0 += BK) {
    const std::int64_t cols = std::min(BK, S - j0);
    load_transposed(kh + j0 * D, cols, D, BK, Kt);
    load_transposed(vh + j0 * D, cols, D, BK, Vt);
    load_rows(kh + j0 * D, cols, D, K);
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t i = i0 + r;
      const std::int64_t lo = std::max<std::int64_t>(first_key(i, p.o) - j0, 0);
      const std::int64_t hi = std::min<std::int64_t>(last_key(i, S, p.o) - j0, cols);
      if (lo >= hi) continue;
      const float lse2 = lse[bh * S + i] * log2e, di = delta[bh * S + i];
      row_times_transposed(Q + r * D, Kt, D, BK, cols, prob);
      row_times_transposed(dO + r * D, Vt, D, BK, cols, dprob);
      for (std::int64_t j = lo; j < hi; ++j) {
        const float pj = exp2_nonpositive(prob[j] * p.scale_log2 - lse2);
        dprob[j] = pj * (dprob[j] - di) * p.scale;
      }
      for (std::int64_t j = lo; j < hi; ++j) axpy(dprob[j], K + j * D, D, dQ + r * D);
    }
  }
  T* dq_out = dq + (bh * S + i0) * D;
  for (std::int64_t e = 0; e < rows * D; ++e) dq_out[e] = from_float<T>(dQ[e]);
}

// delta[row] = sum_d dout[row, d] * out[row, d] for rows [first, last).
template <class T>
inline void delta_rows(const T* dout, const T* out, std::int64_t D, std::int64_t first, std::int64_t last,
                       float* delta) noexcept {
  for (std::int64_t r = first; r < last; ++r) {
    float sum = 0.0f;
    for (std::int64_t d = 0; d < D; ++d) sum += to_float(dout[r * D + d]) * to_float(out[r * D + d]);
    delta[r] = sum;
  }
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
MEMKIT_ATTENTION_ISA_VARIANTS(forward_item)
MEMKIT_ATTENTION_ISA_VARIANTS(backward_key_item)
MEMKIT_ATTENTION_ISA_VARIANTS(backward_query_item)
#undef MEMKIT_ATTENTION_ISA_VARIANTS
#define MEMKIT_ATTENTION_DISPATCH(NAME, ...)                   \
  switch (host_isa_in_use()) {                                 \
    case host_isa::avx512: NAME##_avx512(__VA_ARGS__); break;  \
    case host_isa::avx2: NAME##_avx2(__VA_ARGS__); break;      \
    default: NAME(__VA_ARGS__); break;                         \
  }
#else
#define MEMKIT_ATTENTION_DISPATCH(NAME, ...) NAME(__VA_ARGS__);
#endif

inline problem make_problem(const shape& qs, std::int64_t Hkv, const attention_options& o) {
  problem p{qs[0], qs[1], Hkv, qs[2], qs[3], qs[1] / Hkv, 0.0f, 0.0f, o};
  p.scale = resolved_scale(o, p.D);
  p.scale_log2 = p.scale * log2e;
  return p;
}

}  // namespace detail

// out = softmax(scale * q k^T + mask) v per head; lse = the log-sum-exp of each row's scaled scores.
template <float_storage T>
void forward(const host_executor& exec, tensor_view<const std::type_identity_t<T>> q,
             tensor_view<const std::type_identity_t<T>> k, tensor_view<const std::type_identity_t<T>> v,
             tensor_view<T> out, tensor_view<float> lse, const attention_options& options,
             memory_resource& workspace) {
  detail::validate<T>("forward", q, k, v, out, lse, options);
  require_accessible(exec, q, "attention::forward", "q");
  require_accessible(exec, k, "attention::forward", "k");
  require_accessible(exec, v, "attention::forward", "v");
  require_accessible(exec, out, "attention::forward", "out");
  require_accessible(exec, lse, "attention::forward", "lse");
  const detail::problem p = detail::make_problem(q.shape(), k.shape()[1], options);
  const std::int64_t items = p.B * p.Hq * detail::tiles_of(p.S, host_query_tile);
  const std::int64_t parts = detail::host_parts(items, options.host_threads);
  const std::int64_t part_floats = detail::forward_part_floats(p.D);
  buffer<float> scratch(workspace, shape{parts * part_floats});
  float* base = scratch.data();
  ::memkit::detail::run_in_parts(static_cast<int>(parts), items, [&](std::int64_t first, std::int64_t last) {
    float* mine = base + detail::part_starting_at(first, items, parts) * part_floats;
    for (std::int64_t item = first; item < last; ++item)
      MEMKIT_ATTENTION_DISPATCH(detail::forward_item, p, q.data(), k.data(), v.data(), out.data(), lse.data(), item,
                                mine)
  });
}

// Gradients of forward's out with respect to q, k and v, given dout. out and lse are forward's; dq, dk, dv are
// overwritten (dk, dv hold the sum over each kv head's query-head group).
template <float_storage T>
void backward(const host_executor& exec, tensor_view<const std::type_identity_t<T>> q,
              tensor_view<const std::type_identity_t<T>> k, tensor_view<const std::type_identity_t<T>> v,
              tensor_view<const std::type_identity_t<T>> out, tensor_view<const float> lse,
              tensor_view<const std::type_identity_t<T>> dout, tensor_view<T> dq, tensor_view<T> dk,
              tensor_view<T> dv, const attention_options& options, memory_resource& workspace) {
  detail::validate<T>("backward", q, k, v, out, lse, options);
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
  const detail::problem p = detail::make_problem(q.shape(), k.shape()[1], options);
  const std::int64_t rows = p.B * p.Hq * p.S;
  const std::int64_t query_items = p.B * p.Hq * detail::tiles_of(p.S, host_query_tile);
  const std::int64_t key_items = p.B * p.Hkv * detail::tiles_of(p.S, host_key_tile);
  const std::int64_t parts = detail::host_parts(query_items, options.host_threads);
  const std::int64_t part_floats = detail::backward_part_floats(p.D);
  const std::int64_t delta_floats = detail::round_to_16(rows);
  buffer<float> scratch(workspace, shape{delta_floats + parts * part_floats});
  float* delta = scratch.data();
  float* tiles = delta + delta_floats;
  ::memkit::detail::run_in_parts(static_cast<int>(parts), rows, [&](std::int64_t first, std::int64_t last) {
    detail::delta_rows(dout.data(), out.data(), p.D, first, last, delta);
  });
  const std::int64_t key_parts = std::min(parts, key_items);
  ::memkit::detail::run_in_parts(static_cast<int>(key_parts), key_items, [&](std::int64_t first, std::int64_t last) {
    float* mine = tiles + detail::part_starting_at(first, key_items, key_parts) * part_floats;
    for (std::int64_t item = first; item < last; ++item)
      MEMKIT_ATTENTION_DISPATCH(detail::backward_key_item, p, q.data(), k.data(), v.data(), dout.data(), lse.data(),
                                static_cast<const float*>(delta), dk.data(), dv.data(), item, mine)
  });
  ::memkit::detail::run_in_parts(static_cast<int>(parts), query_items, [&](std::int64_t first, std::int64_t last) {
    float* mine = tiles + detail::part_starting_at(first, query_items, parts) * part_floats;
    for (std::int64_t item = first; item < last; ++item)
      MEMKIT_ATTENTION_DISPATCH(detail::backward_query_item, p, q.data(), k.data(), v.data(), dout.data(), lse.data(),
                                static_cast<const float*>(delta), dq.data(), item, mine)
  });
}

// ---------------------------------------------------------------------------------------------------------------
// CUDA. One CTA owns a tile of rows (queries in forward and the dq pass, keys in the dk/dv pass), one warp per 16
// rows, and walks the tiles of the other side through shared memory. The two products of each step run on the
// tensor cores (WMMA 16x16x16, fp32 accumulation) for bf16 and fp16, and as plain fp32 loops for fp32. Softmax,
// masking and the backward's elementwise step use the same first_key / last_key / exp2_nonpositive as the host.
// Every warp only ever touches its own rows between the block-wide tile loads, so warps synchronize with
// __syncwarp and the block only around loads. All launches go on the executor's stream; nothing synchronizes.
// Limits: head_dim <= 128, and a multiple of 16 for bf16 / fp16 (the MMA shape).
// ---------------------------------------------------------------------------------------------------------------
#if MEMKIT_HAS_CUDA
namespace detail {

template <class T> struct cuda_tiles {
  static constexpr int rows = std::is_same_v<T, float> ? 32 : 64;  // rows a CTA owns (16 per warp)
  static constexpr int forward_cols = 64;                          // key tile of forward
  static constexpr int backward_cols = 32;                         // the other side's tile in backward
  static constexpr int threads = rows / 16 * 32;
};
MEMKIT_HOST_DEVICE constexpr std::int64_t align32(std::int64_t bytes) noexcept { return (bytes + 31) / 32 * 32; }

// Shared-memory bytes of each kernel (checked against the device's opt-in limit before launching).
template <class T> constexpr std::int64_t cuda_forward_smem(std::int64_t D) noexcept {
  using C = cuda_tiles<T>;
  const std::int64_t e = sizeof(T), R = C::rows, N = C::forward_cols;
  return align32(R * D * e) + 2 * align32(N * D * e) + align32(R * N * 4) + align32(R * N * e) + align32(R * D * 4) +
         align32(3 * R * 4);
}
template <class T> constexpr std::int64_t cuda_key_pass_smem(std::int64_t D) noexcept {
  using C = cuda_tiles<T>;
  const std::int64_t e = sizeof(T), R = C::rows, N = C::backward_cols;
  return 2 * align32(R * D * e) + 2 * align32(N * D * e) + 2 * align32(R * N * 4) + 2 * align32(R * N * e) +
         2 * align32(R * D * 4) + align32(2 * N * 4);
}
template <class T> constexpr std::int64_t cuda_query_pass_smem(std::int64_t D) noexcept {
  using C = cuda_tiles<T>;
  const std::int64_t e = sizeof(T), R = C::rows, N = C::backward_cols;
  return 2 * align32(R * D * e) + 2 * align32(N * D * e) + 2 * align32(R * N * 4) + align32(R * N * e) +
         align32(R * D * 4) + align32(2 * R * 4);
}

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
};

template <class T>
__global__ void flash_forward_kernel(cuda_problem p, const T* q, const T* k, const T* v, T* out, float* lse) {
  using C = cuda_tiles<T>;
  constexpr int R = C::rows, N = C::forward_cols;
  extern __shared__ __align__(32) unsigned char smem[];
  const int D = p.D, S = p.S;
  const int tiles = (S + R - 1) / R;
  const std::int64_t bh = blockIdx.x / tiles;
  const int i0 = static_cast<int>(blockIdx.x % tiles) * R;
  const int kvh = static_cast<int>(bh % p.Hq) / p.group;
  const std::int64_t bkv = bh / p.Hq * p.Hkv + kvh;
  unsigned char* cursor = smem;
  auto take = [&](std::int64_t bytes) { unsigned char* at = cursor; cursor += align32(bytes); return at; };
  T* Q = reinterpret_cast<T*>(take(R * D * sizeof(T)));
  T* K = reinterpret_cast<T*>(take(N * D * sizeof(T)));
  T* V = reinterpret_cast<T*>(take(N * D * sizeof(T)));
  float* Sc = reinterpret_cast<float*>(take(R * N * 4));
  T* P = reinterpret_cast<T*>(take(R * N * sizeof(T)));
  float* O = reinterpret_cast<float*>(take(R * D * 4));
  float* m = reinterpret_cast<float*>(take(3 * R * 4));
  float* l = m + R;
  float* correction = l + R;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int w0 = warp * 16;
  load_tile(Q, q + (bh * S + i0) * D, S - i0, R, D);
  for (int e = static_cast<int>(threadIdx.x); e < R * D; e += static_cast<int>(blockDim.x)) O[e] = 0.0f;
  for (int r = static_cast<int>(threadIdx.x); r < R; r += static_cast<int>(blockDim.x)) m[r] = minus_infinity, l[r] = 0;
  const int last_row = (i0 + R < S ? i0 + R : S) - 1;
  const int j_begin = static_cast<int>(first_key(i0, p.o)), j_end = static_cast<int>(last_key(last_row, S, p.o));
  for (int j0 = j_begin / N * N; j0 < j_end; j0 += N) {
    __syncthreads();  // the previous tile's K and V are no longer read
    load_tile(K, k + (bkv * S + j0) * D, S - j0, N, D);
    load_tile(V, v + (bkv * S + j0) * D, S - j0, N, D);
    __syncthreads();
    warp_product<true>(Sc + w0 * N, N, Q + w0 * D, D, K, D, N, D, false);
    __syncwarp();
    // Two lanes per row, 32 columns each.
    const int r = w0 + lane / 2, c0 = (lane % 2) * (N / 2);
    const int i = i0 + r;
    const int lo = static_cast<int>(first_key(i, p.o)) - j0, hi = static_cast<int>(last_key(i, S, p.o)) - j0;
    float row_max = minus_infinity;
    for (int c = c0; c < c0 + N / 2; ++c)
      if (i < S && c >= lo && c < hi) row_max = fmaxf(row_max, Sc[r * N + c] * p.scale_log2);
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
    const float m_old = m[r];
    const float m_new = fmaxf(m_old, row_max);
    float sum = 0.0f;
    for (int c = c0; c < c0 + N / 2; ++c) {
      const bool valid = i < S && c >= lo && c < hi && m_new != minus_infinity;
      const float pc = valid ? exp2_nonpositive(Sc[r * N + c] * p.scale_log2 - m_new) : 0.0f;
      P[r * N + c] = from_float<T>(pc);
      sum += pc;  // unrounded, as the host sums: lse is the fp32 log-sum-exp, not that of 16-bit weights
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    __syncwarp();
    if (lane % 2 == 0) {
      const float corr = m_new == minus_infinity ? 1.0f : exp2_nonpositive(m_old - m_new);
      correction[r] = corr;
      l[r] = l[r] * corr + sum;
      m[r] = m_new;
    }
    __syncwarp();
    for (int e = lane; e < 16 * D; e += 32) O[w0 * D + e] *= correction[w0 + e / D];
    __syncwarp();
    warp_product<false>(O + w0 * D, D, P + w0 * N, N, V, D, D, N, true);
  }
  __syncwarp();
  for (int e = lane; e < 16 * D; e += 32) {
    const int r = w0 + e / D, i = i0 + r;
    if (i < S) out[(bh * S + i) * D + e % D] = from_float<T>(O[w0 * D + e] / l[r]);
  }
  if (lane < 16 && i0 + w0 + lane < S)
    lse[bh * S + i0 + w0 + lane] = (m[w0 + lane] + log2f(l[w0 + lane])) * ln2;
}

template <class T>
__global__ void flash_delta_kernel(const T* dout, const T* out, float* delta, std::int64_t rows, int D) {
  const std::int64_t row = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= rows) return;
  float sum = 0.0f;
  for (int d = lane; d < D; d += 32) sum += to_float(dout[row * D + d]) * to_float(out[row * D + d]);
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) delta[row] = sum;
}

// dK, dV of one key tile, summed over the kv head's query-head group.
template <class T>
__global__ void flash_key_pass_kernel(cuda_problem p, const T* q, const T* k, const T* v, const T* dout,
                                      const float* lse, const float* delta, T* dk, T* dv) {
  using C = cuda_tiles<T>;
  constexpr int R = C::rows, N = C::backward_cols;
  extern __shared__ __align__(32) unsigned char smem[];
  const int D = p.D, S = p.S;
  const int tiles = (S + R - 1) / R;
  const std::int64_t bkv = blockIdx.x / tiles;
  const int j0 = static_cast<int>(blockIdx.x % tiles) * R;
  const std::int64_t b = bkv / p.Hkv;
  const int kvh = static_cast<int>(bkv % p.Hkv);
  unsigned char* cursor = smem;
  auto take = [&](std::int64_t bytes) { unsigned char* at = cursor; cursor += align32(bytes); return at; };
  T* K = reinterpret_cast<T*>(take(R * D * sizeof(T)));
  T* V = reinterpret_cast<T*>(take(R * D * sizeof(T)));
  T* Q = reinterpret_cast<T*>(take(N * D * sizeof(T)));
  T* dO = reinterpret_cast<T*>(take(N * D * sizeof(T)));
  float* St = reinterpret_cast<float*>(take(R * N * 4));
  float* dPt = reinterpret_cast<float*>(take(R * N * 4));
  T* Pt = reinterpret_cast<T*>(take(R * N * sizeof(T)));
  T* dSt = reinterpret_cast<T*>(take(R * N * sizeof(T)));
  float* dK = reinterpret_cast<float*>(take(R * D * 4));
  float* dV = reinterpret_cast<float*>(take(R * D * 4));
  float* lse_tile = reinterpret_cast<float*>(take(2 * N * 4));
  float* delta_tile = lse_tile + N;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int w0 = warp * 16;
  load_tile(K, k + (bkv * S + j0) * D, S - j0, R, D);
  load_tile(V, v + (bkv * S + j0) * D, S - j0, R, D);
  for (int e = static_cast<int>(threadIdx.x); e < R * D; e += static_cast<int>(blockDim.x)) dK[e] = dV[e] = 0.0f;
  const int cols = S - j0 < R ? S - j0 : R;
  int i_begin = 0, i_end = S;
  if (p.o.causal) i_begin = j0;
  if (p.o.window > 0) {
    i_end = static_cast<int>(j0 + cols - 1 + p.o.window < S ? j0 + cols - 1 + p.o.window : S);
    if (!p.o.causal) i_begin = static_cast<int>(j0 - p.o.window + 1 > 0 ? j0 - p.o.window + 1 : 0);
  }
  for (int h = kvh * p.group; h < (kvh + 1) * p.group; ++h) {
    const std::int64_t bh = b * p.Hq + h;
    for (int i0 = i_begin / N * N; i0 < i_end; i0 += N) {
      __syncthreads();
      load_tile(Q, q + (bh * S + i0) * D, S - i0, N, D);
      load_tile(dO, dout + (bh * S + i0) * D, S - i0, N, D);
      for (int c = static_cast<int>(threadIdx.x); c < N; c += static_cast<int>(blockDim.x)) {
        lse_tile[c] = i0 + c < S ? lse[bh * S + i0 + c] * log2e : 0.0f;
        delta_tile[c] = i0 + c < S ? delta[bh * S + i0 + c] : 0.0f;
      }
      __syncthreads();
      warp_product<true>(St + w0 * N, N, K + w0 * D, D, Q, D, N, D, false);
      warp_product<true>(dPt + w0 * N, N, V + w0 * D, D, dO, D, N, D, false);
      __syncwarp();
      for (int e = lane; e < 16 * N; e += 32) {
        const int r = w0 + e / N, c = e % N, j = j0 + r, i = i0 + c;
        const bool valid = i < S && j < S && j >= first_key(i, p.o) && j < last_key(i, S, p.o);
        const float pr = valid ? exp2_nonpositive(St[r * N + c] * p.scale_log2 - lse_tile[c]) : 0.0f;
        Pt[r * N + c] = from_float<T>(pr);
        dSt[r * N + c] = from_float<T>(pr * (dPt[r * N + c] - delta_tile[c]) * p.scale);
      }
      __syncwarp();
      warp_product<false>(dV + w0 * D, D, Pt + w0 * N, N, dO, D, D, N, true);
      warp_product<false>(dK + w0 * D, D, dSt + w0 * N, N, Q, D, D, N, true);
    }
  }
  __syncwarp();
  for (int e = lane; e < 16 * D; e += 32) {
    const int j = j0 + w0 + e / D;
    if (j < S) {
      dk[(bkv * S + j) * D + e % D] = from_float<T>(dK[w0 * D + e]);
      dv[(bkv * S + j) * D + e % D] = from_float<T>(dV[w0 * D + e]);
    }
  }
}

// dQ of one query tile.
template <class T>
__global__ void flash_query_pass_kernel(cuda_problem p, const T* q, const T* k, const T* v, const T* dout,
                                        const float* lse, const float* delta, T* dq) {
  using C = cuda_tiles<T>;
  constexpr int R = C::rows, N = C::backward_cols;
  extern __shared__ __align__(32) unsigned char smem[];
  const int D = p.D, S = p.S;
  const int tiles = (S + R - 1) / R;
  const std::int64_t bh = blockIdx.x / tiles;
  const int i0 = static_cast<int>(blockIdx.x % tiles) * R;
  const int kvh = static_cast<int>(bh % p.Hq) / p.group;
  const std::int64_t bkv = bh / p.Hq * p.Hkv + kvh;
  unsigned char* cursor = smem;
  auto take = [&](std::int64_t bytes) { unsigned char* at = cursor; cursor += align32(bytes); return at; };
  T* Q = reinterpret_cast<T*>(take(R * D * sizeof(T)));
  T* dO = reinterpret_cast<T*>(take(R * D * sizeof(T)));
  T* K = reinterpret_cast<T*>(take(N * D * sizeof(T)));
  T* V = reinterpret_cast<T*>(take(N * D * sizeof(T)));
  float* Sc = reinterpret_cast<float*>(take(R * N * 4));
  float* dP = reinterpret_cast<float*>(take(R * N * 4));
  T* dS = reinterpret_cast<T*>(take(R * N * sizeof(T)));
  float* dQ = reinterpret_cast<float*>(take(R * D * 4));
  float* lse_tile = reinterpret_cast<float*>(take(2 * R * 4));
  float* delta_tile = lse_tile + R;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int w0 = warp * 16;
  load_tile(Q, q + (bh * S + i0) * D, S - i0, R, D);
  load_tile(dO, dout + (bh * S + i0) * D, S - i0, R, D);
  for (int e = static_cast<int>(threadIdx.x); e < R * D; e += static_cast<int>(blockDim.x)) dQ[e] = 0.0f;
  for (int r = static_cast<int>(threadIdx.x); r < R; r += static_cast<int>(blockDim.x)) {
    lse_tile[r] = i0 + r < S ? lse[bh * S + i0 + r] * log2e : 0.0f;
    delta_tile[r] = i0 + r < S ? delta[bh * S + i0 + r] : 0.0f;
  }
  const int last_row = (i0 + R < S ? i0 + R : S) - 1;
  const int j_begin = static_cast<int>(first_key(i0, p.o)), j_end = static_cast<int>(last_key(last_row, S, p.o));
  for (int j0 = j_begin / N * N; j0 < j_end; j0 += N) {
    __syncthreads();
    load_tile(K, k + (bkv * S + j0) * D, S - j0, N, D);
    load_tile(V, v + (bkv * S + j0) * D, S - j0, N, D);
    __syncthreads();
    warp_product<true>(Sc + w0 * N, N, Q + w0 * D, D, K, D, N, D, false);
    warp_product<true>(dP + w0 * N, N, dO + w0 * D, D, V, D, N, D, false);
    __syncwarp();
    for (int e = lane; e < 16 * N; e += 32) {
      const int r = w0 + e / N, c = e % N, i = i0 + r, j = j0 + c;
      const bool valid = i < S && j < S && j >= first_key(i, p.o) && j < last_key(i, S, p.o);
      const float pr = valid ? exp2_nonpositive(Sc[r * N + c] * p.scale_log2 - lse_tile[r]) : 0.0f;
      dS[r * N + c] = from_float<T>(pr * (dP[r * N + c] - delta_tile[r]) * p.scale);
    }
    __syncwarp();
    warp_product<false>(dQ + w0 * D, D, dS + w0 * N, N, K, D, D, N, true);
  }
  __syncwarp();
  for (int e = lane; e < 16 * D; e += 32) {
    const int i = i0 + w0 + e / D;
    if (i < S) dq[(bh * S + i) * D + e % D] = from_float<T>(dQ[w0 * D + e]);
  }
}

template <class T>
cuda_problem make_cuda_problem(const shape& qs, std::int64_t Hkv, const attention_options& o, const char* op) {
  const std::string who = std::string("attention::") + op + " (CUDA)";
  require(qs[3] <= 128, who + ": head_dim " + std::to_string(qs[3]) + " is above the CUDA kernel's 128");
  require(std::is_same_v<T, float> || qs[3] % 16 == 0,
          who + ": head_dim " + std::to_string(qs[3]) + " must be a multiple of 16 for bf16/fp16 (the MMA shape)");
  require(qs[2] < (std::int64_t{1} << 30) && qs[0] * qs[1] * qs[2] < (std::int64_t{1} << 31),
          who + ": batch * heads * seq must stay below 2^31 on CUDA");
  const problem h = make_problem(qs, Hkv, o);
  return {static_cast<int>(h.B), static_cast<int>(h.Hq), static_cast<int>(h.Hkv), static_cast<int>(h.S),
          static_cast<int>(h.D), static_cast<int>(h.group), h.scale, h.scale_log2, o};
}

template <class Kernel>
void prepare_smem(const cuda_executor& exec, Kernel kernel, std::int64_t bytes, const char* op) {
  int limit = 0;
  MEMKIT_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, exec.device));
  require(bytes <= limit, std::string("attention::") + op + " (CUDA): the kernel needs " + std::to_string(bytes) +
                              " bytes of shared memory, the device allows " + std::to_string(limit));
  MEMKIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

}  // namespace detail

template <float_storage T>
void forward(const cuda_executor& exec, tensor_view<const std::type_identity_t<T>> q,
             tensor_view<const std::type_identity_t<T>> k, tensor_view<const std::type_identity_t<T>> v,
             tensor_view<T> out, tensor_view<float> lse, const attention_options& options, memory_resource& workspace) {
  (void)workspace;  // forward needs none on the device
  detail::validate<T>("forward", q, k, v, out, lse, options);
  require_accessible(exec, q, "attention::forward", "q");
  require_accessible(exec, k, "attention::forward", "k");
  require_accessible(exec, v, "attention::forward", "v");
  require_accessible(exec, out, "attention::forward", "out");
  require_accessible(exec, lse, "attention::forward", "lse");
  const detail::cuda_problem p = detail::make_cuda_problem<T>(q.shape(), k.shape()[1], options, "forward");
  using C = detail::cuda_tiles<T>;
  const std::int64_t smem = detail::cuda_forward_smem<T>(p.D);
  ::memkit::detail::with_device(exec.device, [&] {
    detail::prepare_smem(exec, detail::flash_forward_kernel<T>, smem, "forward");
    const std::int64_t blocks = std::int64_t{p.B} * p.Hq * ((p.S + C::rows - 1) / C::rows);
    detail::flash_forward_kernel<T><<<static_cast<unsigned>(blocks), C::threads, static_cast<std::size_t>(smem),
                                      exec.stream>>>(p, q.data(), k.data(), v.data(), out.data(), lse.data());
    MEMKIT_CUDA_CHECK(cudaGetLastError());
    return 0;
  });
}

template <float_storage T>
void backward(const cuda_executor& exec, tensor_view<const std::type_identity_t<T>> q,
              tensor_view<const std::type_identity_t<T>> k, tensor_view<const std::type_identity_t<T>> v,
              tensor_view<const std::type_identity_t<T>> out, tensor_view<const float> lse,
              tensor_view<const std::type_identity_t<T>> dout, tensor_view<T> dq, tensor_view<T> dk,
              tensor_view<T> dv, const attention_options& options, memory_resource& workspace) {
  detail::validate<T>("backward", q, k, v, out, lse, options);
  require_same_shape(q, dout, "attention::backward", "q", "dout");
  require_same_shape(q, dq, "attention::backward", "q", "dq");
  require_same_shape(k, dk, "attention::backward", "k", "dk");
  require_same_shape(v, dv, "attention::backward", "v", "dv");
  require(dout.data() && dq.data() && dk.data() && dv.data(), "attention::backward: a gradient tensor has no data");
  for (const auto& [where, name] : {std::pair{q.where(), "q"}, std::pair{k.where(), "k"}, std::pair{v.where(), "v"},
                                    std::pair{out.where(), "out"}, std::pair{lse.where(), "lse"},
                                    std::pair{dout.where(), "dout"}, std::pair{dq.where(), "dq"},
                                    std::pair{dk.where(), "dk"}, std::pair{dv.where(), "dv"}})
    require(cuda_executor::can_access(where), std::string("attention::backward: `") + name + "` is in " +
                                                  to_string(where) + " memory, which the cuda executor cannot access");
  const detail::cuda_problem p = detail::make_cuda_problem<T>(q.shape(), k.shape()[1], options, "backward");
  using C = detail::cuda_tiles<T>;
  const std::int64_t rows = std::int64_t{p.B} * p.Hq * p.S;
  buffer<float> delta(workspace, shape{detail::round_to_16(rows)}, on_stream{exec.stream});
  require(cuda_executor::can_access(delta.where()), "attention::backward (CUDA): the workspace resource gives " +
                                                        std::string(to_string(delta.where())) + " memory");
  ::memkit::detail::with_device(exec.device, [&] {
    detail::prepare_smem(exec, detail::flash_key_pass_kernel<T>, detail::cuda_key_pass_smem<T>(p.D), "backward");
    detail::prepare_smem(exec, detail::flash_query_pass_kernel<T>, detail::cuda_query_pass_smem<T>(p.D), "backward");
    detail::flash_delta_kernel<T><<<static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0, exec.stream>>>(
        dout.data(), out.data(), delta.data(), rows, p.D);
    MEMKIT_CUDA_CHECK(cudaGetLastError());
    const std::int64_t row_tiles = (p.S + C::rows - 1) / C::rows;
    detail::flash_key_pass_kernel<T><<<static_cast<unsigned>(std::int64_t{p.B} * p.Hkv * row_tiles), C::threads,
                                       static_cast<std::size_t>(detail::cuda_key_pass_smem<T>(p.D)), exec.stream>>>(
        p, q.data(), k.data(), v.data(), dout.data(), lse.data(), delta.data(), dk.data(), dv.data());
    MEMKIT_CUDA_CHECK(cudaGetLastError());
    detail::flash_query_pass_kernel<T><<<static_cast<unsigned>(std::int64_t{p.B} * p.Hq * row_tiles), C::threads,
                                         static_cast<std::size_t>(detail::cuda_query_pass_smem<T>(p.D)), exec.stream>>>(
        p, q.data(), k.data(), v.data(), dout.data(), lse.data(), delta.data(), dq.data());
    MEMKIT_CUDA_CHECK(cudaGetLastError());
    return 0;
  });
  // `delta` is released here, on exec.stream: stream-ordered with a device_async_resource (made on any stream, or
  // a tracker over one) without synchronization; a plain device_resource's cudaFree waits for the device instead.
}
#endif  // MEMKIT_HAS_CUDA

}  // namespace attention
MEMKIT_NAMESPACE_END
