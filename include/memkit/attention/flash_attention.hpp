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
// Every byte is said before it is allocated: forward_workspace_bytes / backward_workspace_bytes are exactly
// what forward / backward take from `workspace`, forward_saved_bytes what a layer keeps for backward, and
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
#include "memkit/core/tensor_view.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"

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

// Bytes forward takes from `workspace` (host: per-thread tiles; CUDA: none). elem_size is q's element size.
constexpr std::size_t forward_workspace_bytes(std::int64_t B, std::int64_t Hq, std::int64_t Hkv, std::int64_t S,
                                              std::int64_t D, std::size_t elem_size, const attention_options& o,
                                              bool on_device = false) noexcept {
  (void)Hkv, (void)elem_size;
  if (on_device || B <= 0 || Hq <= 0 || S <= 0 || D <= 0) return 0;
  const std::int64_t items = B * Hq * detail::tiles_of(S, host_query_tile);
  return static_cast<std::size_t>(detail::host_parts(items, o.host_threads) * detail::forward_part_floats(D)) *
         sizeof(float);
}

// Bytes backward takes from `workspace`: delta fp32 [B, Hq, S], plus per-thread tiles on the host.
constexpr std::size_t backward_workspace_bytes(std::int64_t B, std::int64_t Hq, std::int64_t Hkv, std::int64_t S,
                                               std::int64_t D, std::size_t elem_size, const attention_options& o,
                                               bool on_device = false) noexcept {
  (void)Hkv, (void)elem_size;
  if (B <= 0 || Hq <= 0 || S <= 0 || D <= 0) return 0;
  const std::size_t delta = static_cast<std::size_t>(detail::round_to_16(B * Hq * S)) * sizeof(float);
  if (on_device) return delta;
  const std::int64_t items = B * Hq * detail::tiles_of(S, host_query_tile);
  return delta + static_cast<std::size_t>(detail::host_parts(items, o.host_threads) *
                                          detail::backward_part_floats(D)) * sizeof(float);
}

// What a layer saves from forward for backward: out [B, Hq, S, D] and lse fp32 [B, Hq, S] (plus q, k, v,
// which its caller owns or saves anyway).
constexpr std::size_t forward_saved_bytes(std::int64_t B, std::int64_t Hq, std::int64_t S, std::int64_t D,
                                          std::size_t elem_size) noexcept {
  return static_cast<std::size_t>(B * Hq * S * D) * elem_size + static_cast<std::size_t>(B * Hq * S) * sizeof(float);
}

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
#define MEMKIT_ATTENTION_DISPATCH(NAME, ...) NAME(__VA_ARGS__)
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

}  // namespace attention
MEMKIT_NAMESPACE_END
