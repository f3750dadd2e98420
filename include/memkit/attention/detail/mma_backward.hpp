// memkit/attention/detail/mma_backward.hpp — backward's key pass (dK, dV) and query pass (dQ) in FlashAttention-2's
// structure, for attention_kernel::mma: the same tiles and instructions as the mma forward (detail/mma_forward.hpp).
// The delta kernel (delta = rowsum(dO * O), FA2's preprocessing pass) stays the one of backward_passes.hpp. Not a
// public header: backward_passes.hpp includes it.
//
// FA2 computes dK, dV per key tile and adds dQ with fp32 atomics from the same loop. Here dQ has its own pass: each
// gradient is accumulated in fp32 registers by the one CTA that owns its tile, walking the other side's tiles in a
// fixed order, so no atomics and no fp32 dQ buffer — dq, dk, dv are deterministic (bit-identical run to run) and
// the workspace stays delta alone — at the price of computing the scores a second time (both passes do). That is
// the trade today's kernels make; an atomic dQ would be the thing to measure against once a GPU can.
// Same mathematics as the WMMA passes and the host: P = exp2(scale log2e q.k - lse log2e) on the visible pairs,
// dS = P (dP - delta) scale; P and dS rounded to T for their products.
#pragma once

#include <cstdint>
#include <type_traits>

#include "memkit/attention/detail/common.hpp"
#include "memkit/attention/detail/mma_forward.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace attention::detail {

#if MEMKIT_HAS_CUDA

// Shared memory of the mma query pass: Q and dO [rows][D + pad], K and V [2 buffers][cols][D + pad].
MEMKIT_HOST_DEVICE constexpr std::int64_t mma_query_pass_smem_bytes(int D, std::int64_t element_bytes) noexcept {
  return (2 * std::int64_t{mma_tiles::rows} + 4 * mma_tiles::cols) * (D + mma_tiles::pad) * element_bytes;
}

// dQ of one CTA: 64 query rows of one head, 16 per warp, against the key tiles its rows see. Q and dO stay in
// shared memory (their fragments are re-read by ldmatrix per tile, which keeps the registers for dQ, S and dP).
template <class T, int D>
__global__ void __launch_bounds__(mma_tiles::threads)
    mma_query_pass_kernel(cuda_problem p, const T* q, const T* k, const T* v, const T* dout, const float* lse,
                          const float* delta, T* dq) {
  constexpr int R = mma_tiles::rows, N = mma_tiles::cols, LD = D + mma_tiles::pad;
  constexpr int KS = D <= 128 ? N : N / 2;  // keys per S / dP step
  constexpr int dk = D / 16, on = D / 8, sn = KS / 8;
  extern __shared__ __align__(32) unsigned char smem[];  // ldmatrix and cp.async need 16
  T* Qs = reinterpret_cast<T*>(smem);
  T* dOs = Qs + R * LD;
  T* Ks = dOs + R * LD;  // [2][N][LD]
  T* Vs = Ks + 2 * N * LD;
  const int S = p.S;
  const block_tile place = block_tile_of<R>(S);
  const std::int64_t bh = place.head, bkv = kv_head_of(p, bh), b = bh / p.Hq;
  const int i0 = place.first;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int g = lane / 4, t = lane % 4;
  const T* kh = k + bkv * S * D;
  const T* vh = v + bkv * S * D;

  const int last_row = (i0 + R < S ? i0 + R : S) - 1;
  const int j_begin = static_cast<int>(visible_keys(p, b, i0).begin) / N * N;
  const int j_end = static_cast<int>(visible_keys(p, b, last_row).end);
  cp_async_tile<T, D>(Qs, q + bh * S * D, i0, R, S);
  cp_async_tile<T, D>(dOs, dout + bh * S * D, i0, R, S);
  if (j_begin < j_end) {
    cp_async_tile<T, D>(Ks, kh, j_begin, N, S);
    cp_async_tile<T, D>(Vs, vh, j_begin, N, S);
  }
  cp_async_commit();

  const int row0 = i0 + warp * 16 + g, row1 = row0 + 8;
  const position_span see0 = row0 < S ? visible_keys(p, b, row0) : position_span{0, 0};
  const position_span see1 = row1 < S ? visible_keys(p, b, row1) : position_span{0, 0};
  const position_span warp_keys = warp_span(p, b, i0 + warp * 16, S, true);
  const int lo0 = static_cast<int>(see0.begin), hi0 = static_cast<int>(see0.end);
  const int lo1 = static_cast<int>(see1.begin), hi1 = static_cast<int>(see1.end);
  const float lse0 = row0 < S ? lse[bh * S + row0] * log2e : 0.0f, lse1 = row1 < S ? lse[bh * S + row1] * log2e : 0.0f;
  const float delta0 = row0 < S ? delta[bh * S + row0] : 0.0f, delta1 = row1 < S ? delta[bh * S + row1] : 0.0f;
  const fragment_offset qw = a_fragment<LD>(lane, warp * 16, 0);
  const T* Qw = Qs + qw.row + qw.lane;  // this lane's ldmatrix row of Q / dO
  const T* dOw = dOs + qw.row + qw.lane;

  float dqa[on][4];
#pragma unroll
  for (int n = 0; n < on; ++n) dqa[n][0] = dqa[n][1] = dqa[n][2] = dqa[n][3] = 0.0f;

  int buffer = 0;
  for (int j0 = j_begin; j0 < j_end; j0 += N, buffer ^= 1) {
    if (j0 + N < j_end) {
      cp_async_tile<T, D>(Ks + (buffer ^ 1) * N * LD, kh, j0 + N, N, S);
      cp_async_tile<T, D>(Vs + (buffer ^ 1) * N * LD, vh, j0 + N, N, S);
    }
    cp_async_commit();
    cp_async_wait<1>();  // Q, dO and this tile landed; the next tile may be in flight
    __syncthreads();
    const T* Kt = Ks + buffer * N * LD;
    const T* Vt = Vs + buffer * N * LD;
    if (j0 < warp_keys.end && j0 + N > warp_keys.begin) {
      // The tile's keys KS at a time (all 64 up to head_dim 128; halves above, where dQ takes D / 2 registers).
      for (int h = 0; h < N; h += KS) {
        const T* Kh = Kt + h * LD;
        // S = Q K^T and dP = dO V^T: K and V are [key][d], B column-major, ldmatrix without transpose.
        float sc[sn][4], dp[sn][4];
#pragma unroll
        for (int n = 0; n < sn; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) sc[n][e] = dp[n][e] = 0.0f;
        mma_shared_rows_by_tile2<T, LD, dk>(sc, Qw, Kh, dp, dOw, Vt + h * LD, lane);
        // dS = P (dP - delta) scale on the visible keys, rounded to T, as A fragments of dQ += dS K.
        const bool full = j0 >= lo0 && j0 >= lo1 && j0 + N <= hi0 && j0 + N <= hi1;
        std::uint32_t dsa[sn / 2][4];
#pragma unroll
        for (int n = 0; n < sn; ++n) {
          float ds[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int j = j0 + h + n * 8 + 2 * t + (e & 1);
            const bool upper = e < 2;
            const bool visible = full || (upper ? (j >= lo0 && j < hi0) : (j >= lo1 && j < hi1));
            const float pr = visible ? exp2_nonpositive(sc[n][e] * p.scale_log2 - (upper ? lse0 : lse1)) : 0.0f;
            ds[e] = pr * (dp[n][e] - (upper ? delta0 : delta1)) * p.scale;
          }
          dsa[n / 2][(n % 2) * 2 + 0] = pack2<T>(ds[0], ds[1]);
          dsa[n / 2][(n % 2) * 2 + 1] = pack2<T>(ds[2], ds[3]);
        }
        // dQ += dS K: K is [key][d], B (key x d) row-major: ldmatrix.trans.
        mma_rows_by_tile<T, true, LD>(dqa, dsa, Kh, lane);
      }
    }
    __syncthreads();  // the buffer is refilled by the next iteration's copy
  }
  cp_async_wait<0>();

  store_accumulator_rows<T, D>(dq, bh * S, dqa, row0, row1, S, t);
}

// Shared memory of the mma key pass: K and V [rows][D + pad], Q and dO [2 buffers][cols][D + pad], and the query
// tiles' lse (base 2) and delta [2 buffers][2][cols] floats.
MEMKIT_HOST_DEVICE constexpr std::int64_t mma_key_pass_smem_bytes(int D, std::int64_t element_bytes) noexcept {
  return (2 * std::int64_t{mma_tiles::rows} + 4 * mma_tiles::cols) * (D + mma_tiles::pad) * element_bytes +
         4 * std::int64_t{mma_tiles::cols} * 4;
}

// What one launch of the key pass produces: dK and dV together (head_dim <= 128), or, above, one of them per launch:
// dK and dV together would take D registers per thread for their accumulators alone. The dV launch computes S^T
// only, the dK launch S^T and dP^T, so splitting costs one more S^T product.
enum class key_pass_outputs : int { dk_dv, dv, dk };

// The key pass's S^T = K Q^T and, when dK is wanted (std::true_type), dP^T = V dO^T. Overloads rather than an
// `if constexpr` in the kernel, which changed the PTX of the kernels at head_dim 64 and 128 (CUDA 13.0).
template <class T, int LD, int ks, int nb, int dpt_blocks>
__device__ MEMKIT_FORCEINLINE void key_pass_scores(std::true_type, float (&st)[nb][4], const T* Kw, const T* Qh,
                                                   float (&dpt)[dpt_blocks][4], const T* Vw, const T* dOh, int lane) {
  mma_shared_rows_by_tile2<T, LD, ks>(st, Kw, Qh, dpt, Vw, dOh, lane);
}
template <class T, int LD, int ks, int nb, int dpt_blocks>
__device__ MEMKIT_FORCEINLINE void key_pass_scores(std::false_type, float (&st)[nb][4], const T* Kw, const T* Qh,
                                                   float (&)[dpt_blocks][4], const T*, const T*, int lane) {
  mma_shared_rows_by_tile<T, LD, ks>(st, Kw, Qh, lane);
}

// dK, dV of one CTA: 64 key rows of one kv head, 16 per warp, against every query tile of the kv head's query-head
// group that sees them (the (head, tile) items walked in order, the next one in flight). Thread (g, t) holds key
// rows g and g + 8 of its warp's 16. dK and dV are accumulated in fp32 registers by this CTA alone: no atomics.
// Same mathematics as the WMMA key pass: P^T = exp2(K.Q scale log2e - lse log2e) on the queries that see the key,
// rounded to T for dV += P^T dO; dS^T = P^T (dP^T - delta) scale rounded to T for dK += dS^T Q.
template <class T, int D, key_pass_outputs outputs = key_pass_outputs::dk_dv>
__global__ void __launch_bounds__(mma_tiles::threads)
    mma_key_pass_kernel(cuda_problem p, const T* q, const T* k, const T* v, const T* dout, const float* lse,
                        const float* delta, T* dk, T* dv) {
  constexpr int R = mma_tiles::rows, N = mma_tiles::cols, LD = D + mma_tiles::pad;
  constexpr int QS = D <= 128 ? N : N / 2;  // queries per S^T / dP^T step (halves where dK or dV takes D / 2 registers)
  constexpr int dk_steps = D / 16, on = D / 8, sn = QS / 8;
  constexpr bool want_dk = outputs != key_pass_outputs::dv, want_dv = outputs != key_pass_outputs::dk;
  extern __shared__ __align__(32) unsigned char smem[];  // ldmatrix and cp.async need 16
  T* Ks = reinterpret_cast<T*>(smem);
  T* Vs = Ks + R * LD;
  T* Qs = Vs + R * LD;   // [2][N][LD]
  T* dOs = Qs + 2 * N * LD;
  float* rows_of = reinterpret_cast<float*>(dOs + 2 * N * LD);  // [2][lse2 N, delta N]
  const int S = p.S;
  const block_tile place = block_tile_of<R>(S);
  const std::int64_t bkv = place.head, b = bkv / p.Hkv;
  const int j0 = place.first, kvh = static_cast<int>(bkv % p.Hkv);
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int g = lane / 4, t = lane % 4;

  const int last_key = (j0 + R < S ? j0 + R : S) - 1;
  const int i_start = static_cast<int>(visible_queries(p, b, j0).begin) / N * N;
  const int i_end = static_cast<int>(visible_queries(p, b, last_key).end);
  const int tiles = i_end > i_start ? (i_end - i_start + N - 1) / N : 0;
  const int items = tiles * p.group;
  // Item n: query head kvh * group + n / tiles, query tile i_start + (n % tiles) N. Brings its Q, dO (cp.async) and
  // its rows' lse, delta (plain loads, visible after the next barrier) into buffer `to`.
  const auto bring = [&](int n, int to) {
    const std::int64_t bh = b * p.Hq + kvh * p.group + n / tiles;
    const int i0 = i_start + (n % tiles) * N;
    cp_async_tile<T, D>(Qs + to * N * LD, q + bh * S * D, i0, N, S);
    cp_async_tile<T, D>(dOs + to * N * LD, dout + bh * S * D, i0, N, S);
    for (int c = static_cast<int>(threadIdx.x); c < N; c += mma_tiles::threads) {
      const bool valid = i0 + c < S;
      rows_of[to * 2 * N + c] = valid ? lse[bh * S + i0 + c] * log2e : 0.0f;
      rows_of[to * 2 * N + N + c] = valid ? delta[bh * S + i0 + c] : 0.0f;
    }
  };
  cp_async_tile<T, D>(Ks, k + bkv * S * D, j0, R, S);
  if constexpr (want_dk) cp_async_tile<T, D>(Vs, v + bkv * S * D, j0, R, S);  // V only for dP^T
  if (items > 0) bring(0, 0);
  cp_async_commit();

  const int key0 = j0 + warp * 16 + g, key1 = key0 + 8;
  const position_span by0 = key0 < S ? visible_queries(p, b, key0) : position_span{0, 0};
  const position_span by1 = key1 < S ? visible_queries(p, b, key1) : position_span{0, 0};
  const position_span warp_queries = warp_span(p, b, j0 + warp * 16, S, false);
  const int lo0 = static_cast<int>(by0.begin), hi0 = static_cast<int>(by0.end);
  const int lo1 = static_cast<int>(by1.begin), hi1 = static_cast<int>(by1.end);
  const fragment_offset kw = a_fragment<LD>(lane, warp * 16, 0);
  const T* Kw = Ks + kw.row + kw.lane;  // this lane's ldmatrix row of K / V
  [[maybe_unused]] const T* Vw = Vs + kw.row + kw.lane;

  [[maybe_unused]] float dka[want_dk ? on : 1][4], dva[want_dv ? on : 1][4];
#pragma unroll
  for (int n = 0; n < on; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (want_dk) dka[n][e] = 0.0f;
      if constexpr (want_dv) dva[n][e] = 0.0f;
    }

  for (int n_item = 0, buffer = 0; n_item < items; ++n_item, buffer ^= 1) {
    if (n_item + 1 < items) bring(n_item + 1, buffer ^ 1);
    cp_async_commit();
    cp_async_wait<1>();  // K, V and this item landed; the next item may be in flight
    __syncthreads();
    const int i0 = i_start + (n_item % tiles) * N;
    const T* Qt = Qs + buffer * N * LD;
    const T* dOt = dOs + buffer * N * LD;
    const float* lse2 = rows_of + buffer * 2 * N;
    const float* delta_t = lse2 + N;
    if (i0 < warp_queries.end && i0 + N > warp_queries.begin) {
      for (int h = 0; h < N; h += QS) {
        const T* Qh = Qt + h * LD;
        const T* dOh = dOt + h * LD;
        // S^T = K Q^T and dP^T = V dO^T: Q and dO are [query][d], B column-major, ldmatrix without transpose.
        float st[sn][4];
        [[maybe_unused]] float dpt[want_dk ? sn : 1][4];
#pragma unroll
        for (int n = 0; n < sn; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            st[n][e] = 0.0f;
            if constexpr (want_dk) dpt[n][e] = 0.0f;
          }
        key_pass_scores<T, LD, dk_steps>(std::bool_constant<want_dk>{}, st, Kw, Qh, dpt, Vw, dOh, lane);
        const bool full = i0 >= lo0 && i0 >= lo1 && i0 + N <= hi0 && i0 + N <= hi1;  // every query sees both keys
        [[maybe_unused]] std::uint32_t pa[sn / 2][4], dsa[sn / 2][4];
#pragma unroll
        for (int n = 0; n < sn; ++n) {
          float pr[4], ds[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = h + n * 8 + 2 * t + (e & 1), i = i0 + c;
            const bool upper = e < 2;
            const bool visible = full || (upper ? (i >= lo0 && i < hi0) : (i >= lo1 && i < hi1));
            pr[e] = visible ? exp2_nonpositive(st[n][e] * p.scale_log2 - lse2[c]) : 0.0f;
            if constexpr (want_dk) ds[e] = pr[e] * (dpt[n][e] - delta_t[c]) * p.scale;
          }
          if constexpr (want_dv) {
            pa[n / 2][(n % 2) * 2 + 0] = pack2<T>(pr[0], pr[1]);
            pa[n / 2][(n % 2) * 2 + 1] = pack2<T>(pr[2], pr[3]);
          }
          if constexpr (want_dk) {
            dsa[n / 2][(n % 2) * 2 + 0] = pack2<T>(ds[0], ds[1]);
            dsa[n / 2][(n % 2) * 2 + 1] = pack2<T>(ds[2], ds[3]);
          }
        }
        // dV += P^T dO and dK += dS^T Q: dO and Q are [query][d], B (query x d) row-major: ldmatrix.trans.
        if constexpr (want_dk && want_dv) mma_rows_by_tile2<T, true, LD>(dva, pa, dOh, dka, dsa, Qh, lane);
        else if constexpr (want_dv) mma_rows_by_tile<T, true, LD>(dva, pa, dOh, lane);
        else mma_rows_by_tile<T, true, LD>(dka, dsa, Qh, lane);
      }
    }
    __syncthreads();  // the buffer is refilled by the next iteration's copy
  }
  cp_async_wait<0>();

  // dK and dV stored together: they share each address (two store_accumulator_rows calls recompute it, +80 to +168
  // integer instructions in the SASS).
  if constexpr (want_dk && want_dv) {
#pragma unroll
    for (int n = 0; n < on; ++n) {
      const int d = n * 8 + 2 * t;
      if (key0 < S) {
        dk[(bkv * S + key0) * D + d] = from_float<T>(dka[n][0]);
        dk[(bkv * S + key0) * D + d + 1] = from_float<T>(dka[n][1]);
        dv[(bkv * S + key0) * D + d] = from_float<T>(dva[n][0]);
        dv[(bkv * S + key0) * D + d + 1] = from_float<T>(dva[n][1]);
      }
      if (key1 < S) {
        dk[(bkv * S + key1) * D + d] = from_float<T>(dka[n][2]);
        dk[(bkv * S + key1) * D + d + 1] = from_float<T>(dka[n][3]);
        dv[(bkv * S + key1) * D + d] = from_float<T>(dva[n][2]);
        dv[(bkv * S + key1) * D + d + 1] = from_float<T>(dva[n][3]);
      }
    }
  } else if constexpr (want_dv) {
    store_accumulator_rows<T, D>(dv, bkv * S, dva, key0, key1, S, t);
  } else {
    store_accumulator_rows<T, D>(dk, bkv * S, dka, key0, key1, S, t);
  }
}

#endif  // MEMKIT_HAS_CUDA

}  // namespace attention::detail
MEMKIT_NAMESPACE_END
