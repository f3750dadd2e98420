// memkit/attention/detail/backward_passes.hpp — attention's backward: delta = rowsum(dout * out), then the key pass
// (dk, dv of one key tile) and the query pass (dq of one query tile).
// Each pass is here twice, side by side: the host routine of one tile (fp32 tiles, run over host threads and
// built for three instruction sets) and, under nvcc, the CUDA kernel of one CTA. Both mask with first_key /
// last_key and exponentiate with exp2_nonpositive (detail/common.hpp), so they compute the same softmax.
// Not a public header: flash_attention.hpp includes it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "memkit/attention/detail/common.hpp"
#include "memkit/attention/detail/mma_backward.hpp"
#include "memkit/core/host_threads.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace attention::detail {

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
#if MEMKIT_HAS_CUDA
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
#endif  // MEMKIT_HAS_CUDA

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
  // Queries that can see a key of this tile (both ends grow with the key, documents included).
  const std::int64_t i_begin = visible_queries(p, b, j0).begin, i_end = visible_queries(p, b, j0 + cols - 1).end;
  for (std::int64_t h = kvh * p.group; h < (kvh + 1) * p.group; ++h) {
    const std::int64_t bh = b * p.Hq + h;
    for (std::int64_t i0 = i_begin / BQ * BQ; i0 < i_end; i0 += BQ) {
      const std::int64_t rows = std::min(BQ, S - i0);
      load_rows(q + (bh * S + i0) * D, rows, D, Q);
      load_rows(dout + (bh * S + i0) * D, rows, D, dO);
      for (std::int64_t r = 0; r < rows; ++r) {
        const std::int64_t i = i0 + r;
        const auto [lo, hi] = key_columns_of(p, b, i, j0, cols);
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
MEMKIT_ATTENTION_ISA_VARIANTS(backward_key_item)

#if MEMKIT_HAS_CUDA
// The key pass's shared memory: its key rows K, V, a query tile Q, dO, the transposed scores St, dPt (fp32) and
// Pt, dSt (T), the fp32 dK, dV, and the query tile's lse and delta (2 N floats).
template <class T>
struct key_pass_smem {
  static constexpr int R = cuda_tiles<T>::rows, N = cuda_tiles<T>::backward_cols;
  T* K; T* V; T* Q; T* dO; float* St; float* dPt; T* Pt; T* dSt; float* dK; float* dV; float* lse_tile;
  std::int32_t* seen_by;  // [2 R]: the queries [begin, end) that see each key row (mask and document)
  MEMKIT_HOST_DEVICE key_pass_smem(smem_carver& c, int D)
      : K(c.take<T>(R * D)), V(c.take<T>(R * D)), Q(c.take<T>(N * D)), dO(c.take<T>(N * D)), St(c.take<float>(R * N)),
        dPt(c.take<float>(R * N)), Pt(c.take<T>(R * N)), dSt(c.take<T>(R * N)), dK(c.take<float>(R * D)),
        dV(c.take<float>(R * D)), lse_tile(c.take<float>(2 * N)), seen_by(c.take<std::int32_t>(2 * R)) {}
};

// dK, dV of one key tile, summed over the kv head's query-head group.
template <class T>
__global__ void flash_key_pass_kernel(cuda_problem p, const T* q, const T* k, const T* v, const T* dout,
                                      const float* lse, const float* delta, T* dk, T* dv) {
  using C = cuda_tiles<T>;
  constexpr int R = C::rows, N = C::backward_cols;
  extern __shared__ __align__(32) unsigned char smem[];
  const int D = p.D, S = p.S;
  const block_tile place = block_tile_of<R>(S);
  const std::int64_t bkv = place.head, b = bkv / p.Hkv;
  const int j0 = place.first, kvh = static_cast<int>(bkv % p.Hkv);
  smem_carver carve{smem};
  const auto [K, V, Q, dO, St, dPt, Pt, dSt, dK, dV, lse_tile, seen_by] = key_pass_smem<T>(carve, D);
  float* delta_tile = lse_tile + N;
  for (int r = static_cast<int>(threadIdx.x); r < R; r += static_cast<int>(blockDim.x)) {
    const position_span queries = j0 + r < S ? visible_queries(p, b, j0 + r) : position_span{0, 0};
    seen_by[r] = static_cast<std::int32_t>(queries.begin);
    seen_by[R + r] = static_cast<std::int32_t>(queries.end);
  }
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int w0 = warp * 16;
  load_tile(K, k + (bkv * S + j0) * D, S - j0, R, D);
  load_tile(V, v + (bkv * S + j0) * D, S - j0, R, D);
  for (int e = static_cast<int>(threadIdx.x); e < R * D; e += static_cast<int>(blockDim.x)) dK[e] = dV[e] = 0.0f;
  const int cols = S - j0 < R ? S - j0 : R;
  const int i_begin = static_cast<int>(visible_queries(p, b, j0).begin);
  const int i_end = static_cast<int>(visible_queries(p, b, j0 + cols - 1).end);
  const position_span warp_queries = warp_span(p, b, j0 + w0, S, false);
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
      if (i0 >= warp_queries.end || i0 + N <= warp_queries.begin) continue;  // no key row of this warp is seen
      warp_product<true>(St + w0 * N, N, K + w0 * D, D, Q, D, N, D, false);
      warp_product<true>(dPt + w0 * N, N, V + w0 * D, D, dO, D, N, D, false);
      __syncwarp();
      for (int e = lane; e < 16 * N; e += 32) {
        const int r = w0 + e / N, c = e % N, i = i0 + c;
        const bool valid = i >= seen_by[r] && i < seen_by[R + r];  // empty for rows past S
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
#endif  // MEMKIT_HAS_CUDA

// Backward query pass of one (batch, query head, query tile): dQ.
template <class T>
inline void backward_query_item(const problem& p, const T* q, const T* k, const T* v, const T* dout,
                                const float* lse, const float* delta, T* dq, std::int64_t item,
                                float* scratch) noexcept {
  const std::int64_t D = p.D, S = p.S, BQ = host_query_tile, BK = host_key_tile;
  const query_tile_place tile = query_tile_at(p, item);
  const auto [bh, i0, rows, bkv] = tile;
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
  const T* kh = k + bkv * S * D;
  const T* vh = v + bkv * S * D;
  const auto load = [&](std::int64_t j0, std::int64_t cols) {
    load_transposed(kh + j0 * D, cols, D, BK, Kt);
    load_transposed(vh + j0 * D, cols, D, BK, Vt);
    load_rows(kh + j0 * D, cols, D, K);
  };
  const std::int64_t head_row = bh * S;  // (clang 14 cannot capture the structured binding bh)
  const auto dq_row = [&](std::int64_t r, std::int64_t i, std::int64_t cols, std::int64_t lo, std::int64_t hi) {
    const float lse2 = lse[head_row + i] * log2e, di = delta[head_row + i];
    row_times_transposed(Q + r * D, Kt, D, BK, cols, prob);
    row_times_transposed(dO + r * D, Vt, D, BK, cols, dprob);
    for (std::int64_t j = lo; j < hi; ++j) {
      const float pj = exp2_nonpositive(prob[j] * p.scale_log2 - lse2);
      dprob[j] = pj * (dprob[j] - di) * p.scale;
    }
    for (std::int64_t j = lo; j < hi; ++j) axpy(dprob[j], K + j * D, D, dQ + r * D);
  };
  for_each_visible_key_tile(p, tile, load, dq_row);
  T* dq_out = dq + (bh * S + i0) * D;
  for (std::int64_t e = 0; e < rows * D; ++e) dq_out[e] = from_float<T>(dQ[e]);
}
MEMKIT_ATTENTION_ISA_VARIANTS(backward_query_item)

#if MEMKIT_HAS_CUDA
// The query pass's shared memory: its query rows Q, dO, a key tile K, V, the scores Sc, dP (fp32) and dS (T), the
// fp32 dQ, and the rows' lse and delta (2 R floats).
template <class T>
struct query_pass_smem {
  static constexpr int R = cuda_tiles<T>::rows, N = cuda_tiles<T>::backward_cols;
  T* Q; T* dO; T* K; T* V; float* Sc; float* dP; T* dS; float* dQ; float* lse_tile;
  std::int32_t* sees;  // [2 R]: the keys [begin, end) each query row sees (mask and document)
  MEMKIT_HOST_DEVICE query_pass_smem(smem_carver& c, int D)
      : Q(c.take<T>(R * D)), dO(c.take<T>(R * D)), K(c.take<T>(N * D)), V(c.take<T>(N * D)), Sc(c.take<float>(R * N)),
        dP(c.take<float>(R * N)), dS(c.take<T>(R * N)), dQ(c.take<float>(R * D)), lse_tile(c.take<float>(2 * R)),
        sees(c.take<std::int32_t>(2 * R)) {}
};

// dQ of one query tile.
template <class T>
__global__ void flash_query_pass_kernel(cuda_problem p, const T* q, const T* k, const T* v, const T* dout,
                                        const float* lse, const float* delta, T* dq) {
  using C = cuda_tiles<T>;
  constexpr int R = C::rows, N = C::backward_cols;
  extern __shared__ __align__(32) unsigned char smem[];
  const int D = p.D, S = p.S;
  const block_tile place = block_tile_of<R>(S);
  const std::int64_t bh = place.head, bkv = kv_head_of(p, bh), b = bh / p.Hq;
  const int i0 = place.first;
  smem_carver carve{smem};
  const auto [Q, dO, K, V, Sc, dP, dS, dQ, lse_tile, sees] = query_pass_smem<T>(carve, D);
  float* delta_tile = lse_tile + R;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int w0 = warp * 16;
  load_tile(Q, q + (bh * S + i0) * D, S - i0, R, D);
  load_tile(dO, dout + (bh * S + i0) * D, S - i0, R, D);
  for (int e = static_cast<int>(threadIdx.x); e < R * D; e += static_cast<int>(blockDim.x)) dQ[e] = 0.0f;
  for (int r = static_cast<int>(threadIdx.x); r < R; r += static_cast<int>(blockDim.x)) {
    lse_tile[r] = i0 + r < S ? lse[bh * S + i0 + r] * log2e : 0.0f;
    delta_tile[r] = i0 + r < S ? delta[bh * S + i0 + r] : 0.0f;
    const position_span keys = i0 + r < S ? visible_keys(p, b, i0 + r) : position_span{0, 0};
    sees[r] = static_cast<std::int32_t>(keys.begin);
    sees[R + r] = static_cast<std::int32_t>(keys.end);
  }
  const int last_row = (i0 + R < S ? i0 + R : S) - 1;
  const int j_begin = static_cast<int>(visible_keys(p, b, i0).begin);
  const int j_end = static_cast<int>(visible_keys(p, b, last_row).end);
  const position_span warp_keys = warp_span(p, b, i0 + w0, S, true);
  for (int j0 = j_begin / N * N; j0 < j_end; j0 += N) {
    __syncthreads();
    load_tile(K, k + (bkv * S + j0) * D, S - j0, N, D);
    load_tile(V, v + (bkv * S + j0) * D, S - j0, N, D);
    __syncthreads();
    if (j0 >= warp_keys.end || j0 + N <= warp_keys.begin) continue;  // no row of this warp sees the tile
    warp_product<true>(Sc + w0 * N, N, Q + w0 * D, D, K, D, N, D, false);
    warp_product<true>(dP + w0 * N, N, dO + w0 * D, D, V, D, N, D, false);
    __syncwarp();
    for (int e = lane; e < 16 * N; e += 32) {
      const int r = w0 + e / N, c = e % N, j = j0 + c;
      const bool valid = j >= sees[r] && j < sees[R + r];  // empty for rows past S
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
#endif  // MEMKIT_HAS_CUDA

// backward on the host: delta, then the key pass (dk, dv) and the query pass (dq) over the host threads; delta
// and each thread's backward_part_floats come from `workspace`.
template <class T>
void run_backward(const host_executor&, const tensor_view<const T>& q, const tensor_view<const T>& k,
                  const tensor_view<const T>& v, const tensor_view<const std::int32_t>& documents,
                  const tensor_view<const T>& out, const tensor_view<const float>& lse,
                  const tensor_view<const T>& dout, const tensor_view<T>& dq, const tensor_view<T>& dk,
                  const tensor_view<T>& dv, const attention_options& options, memory_resource& workspace) {
  const problem p = make_problem(q.shape(), k.shape()[1], options, documents);
  const std::int64_t rows = p.B * p.Hq * p.S;
  const std::int64_t query_items = p.B * p.Hq * tiles_of(p.S, host_query_tile);
  const std::int64_t key_items = p.B * p.Hkv * tiles_of(p.S, host_key_tile);
  const std::int64_t parts = host_parts(query_items, options.host_threads);
  const std::int64_t part_floats = backward_part_floats(p.D);
  const std::int64_t delta_floats = round_to_16(rows);
  buffer<float> scratch(workspace, shape{delta_floats + parts * part_floats});
  float* delta = scratch.data();
  float* tiles = delta + delta_floats;
  ::memkit::detail::run_in_parts(static_cast<int>(parts), rows, [&](std::int64_t first, std::int64_t last) {
    delta_rows(dout.data(), out.data(), p.D, first, last, delta);
  });
  const std::int64_t key_parts = std::min(parts, key_items);
  ::memkit::detail::run_in_parts(static_cast<int>(key_parts), key_items, [&](std::int64_t first, std::int64_t last) {
    float* mine = tiles + part_starting_at(first, key_items, key_parts) * part_floats;
    for (std::int64_t item = first; item < last; ++item)
      MEMKIT_ATTENTION_DISPATCH(backward_key_item, p, q.data(), k.data(), v.data(), dout.data(), lse.data(),
                                static_cast<const float*>(delta), dk.data(), dv.data(), item, mine)
  });
  ::memkit::detail::run_in_parts(static_cast<int>(parts), query_items, [&](std::int64_t first, std::int64_t last) {
    float* mine = tiles + part_starting_at(first, query_items, parts) * part_floats;
    for (std::int64_t item = first; item < last; ++item)
      MEMKIT_ATTENTION_DISPATCH(backward_query_item, p, q.data(), k.data(), v.data(), dout.data(), lse.data(),
                                static_cast<const float*>(delta), dq.data(), item, mine)
  });
}

#if MEMKIT_HAS_CUDA
// The mma key pass (dk, dv: one CTA per 64 keys of a kv head; two launches above head_dim 128) and query pass (dq:
// one CTA per 64 queries of a head).
template <class T, int D>
void launch_mma_backward(const cuda_executor& exec, const cuda_problem& p, const T* q, const T* k, const T* v,
                         const T* dout, const float* lse, const float* delta, T* dq, T* dk, T* dv) {
  const std::int64_t key_smem = mma_key_pass_smem_bytes(D, sizeof(T));
  const std::int64_t query_smem = mma_query_pass_smem_bytes(D, sizeof(T));
  prepare_smem(exec, mma_query_pass_kernel<T, D>, query_smem, "backward");
  const std::int64_t tiles = (p.S + mma_tiles::rows - 1) / mma_tiles::rows;
  const auto key_pass = [&](auto kernel) {  // dk and dv in one launch up to head_dim 128, one launch each above
    prepare_smem(exec, kernel, key_smem, "backward");
    kernel<<<static_cast<unsigned>(std::int64_t{p.B} * p.Hkv * tiles), mma_tiles::threads,
             static_cast<std::size_t>(key_smem), exec.stream>>>(p, q, k, v, dout, lse, delta, dk, dv);
    MEMKIT_CUDA_CHECK(cudaGetLastError());
  };
  if constexpr (D <= 128) {
    key_pass(mma_key_pass_kernel<T, D, key_pass_outputs::dk_dv>);
  } else {
    key_pass(mma_key_pass_kernel<T, D, key_pass_outputs::dv>);
    key_pass(mma_key_pass_kernel<T, D, key_pass_outputs::dk>);
  }
  mma_query_pass_kernel<T, D><<<static_cast<unsigned>(std::int64_t{p.B} * p.Hq * tiles), mma_tiles::threads,
                                static_cast<std::size_t>(query_smem), exec.stream>>>(p, q, k, v, dout, lse, delta, dq);
  MEMKIT_CUDA_CHECK(cudaGetLastError());
}

// backward on CUDA: the delta kernel, then the key pass and the query pass, all on exec.stream; delta comes from
// `workspace`, stream-ordered.
template <class T>
void run_backward(const cuda_executor& exec, const tensor_view<const T>& q, const tensor_view<const T>& k,
                  const tensor_view<const T>& v, const tensor_view<const std::int32_t>& documents,
                  const tensor_view<const T>& out, const tensor_view<const float>& lse,
                  const tensor_view<const T>& dout, const tensor_view<T>& dq, const tensor_view<T>& dk,
                  const tensor_view<T>& dv, const attention_options& options, memory_resource& workspace) {
  const cuda_problem p = make_cuda_problem<T>(q.shape(), k.shape()[1], options, documents, "backward");
  using C = cuda_tiles<T>;
  // Decided before the workspace is taken or anything launched: an unaligned head_dim-256 problem is refused here.
  const bool mma = use_mma_kernel<T>(options, p.D,
                                     {q.data(), k.data(), v.data(), dout.data(), dq.data(), dk.data(), dv.data()},
                                     "backward");
  const std::int64_t rows = std::int64_t{p.B} * p.Hq * p.S;
  buffer<float> delta(workspace, shape{round_to_16(rows)}, on_stream{exec.stream});
  require(cuda_executor::can_access(delta.where()), "attention::backward (CUDA): the workspace resource gives " +
                                                        std::string(to_string(delta.where())) + " memory");
  ::memkit::detail::with_device(exec.device, [&] {
    flash_delta_kernel<T><<<static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0, exec.stream>>>(
        dout.data(), out.data(), delta.data(), rows, p.D);
    MEMKIT_CUDA_CHECK(cudaGetLastError());
    const std::int64_t row_tiles = (p.S + C::rows - 1) / C::rows;
    // attention_kernel::mma: both passes in FA2's structure (detail/mma_backward.hpp); the delta kernel stays.
    if constexpr (!std::is_same_v<T, float>) {
      if (mma) {
        with_mma_head_dim(p.D, [&](auto D) {
          launch_mma_backward<T, decltype(D)::value>(exec, p, q.data(), k.data(), v.data(), dout.data(), lse.data(),
                                                     delta.data(), dq.data(), dk.data(), dv.data());
        });
        return 0;
      }
    }
    prepare_smem(exec, flash_key_pass_kernel<T>, smem_bytes<key_pass_smem<T>>(p.D), "backward");
    prepare_smem(exec, flash_query_pass_kernel<T>, smem_bytes<query_pass_smem<T>>(p.D), "backward");
    flash_key_pass_kernel<T><<<static_cast<unsigned>(std::int64_t{p.B} * p.Hkv * row_tiles), C::threads,
                                       static_cast<std::size_t>(smem_bytes<key_pass_smem<T>>(p.D)), exec.stream>>>(
        p, q.data(), k.data(), v.data(), dout.data(), lse.data(), delta.data(), dk.data(), dv.data());
    MEMKIT_CUDA_CHECK(cudaGetLastError());
    flash_query_pass_kernel<T><<<static_cast<unsigned>(std::int64_t{p.B} * p.Hq * row_tiles), C::threads,
                                         static_cast<std::size_t>(smem_bytes<query_pass_smem<T>>(p.D)), exec.stream>>>(
        p, q.data(), k.data(), v.data(), dout.data(), lse.data(), delta.data(), dq.data());
    MEMKIT_CUDA_CHECK(cudaGetLastError());
    return 0;
  });
  // `delta` is released here, on exec.stream: stream-ordered with a device_async_resource (made on any stream, or
  // a tracker over one) without synchronization; a plain device_resource's cudaFree waits for the device instead.
}
#endif  // MEMKIT_HAS_CUDA

}  // namespace attention::detail
MEMKIT_NAMESPACE_END
