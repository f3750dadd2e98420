// memkit/optim/detail/adam_kernels.hpp — the CUDA kernels of the AdamW step (norm pass, finalisation, step
// terms, fused update). Each calls the same MEMKIT_HOST_DEVICE element functions (optim/adam_math.hpp,
// optim/state_codecs.hpp) as the host loop in detail/adam_core.hpp, which launches them; nothing here is API.
// Without nvcc this header declares only the kernels' argument structs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/optim/adam_bytes.hpp"
#include "memkit/optim/adam_math.hpp"
#include "memkit/optim/state_codecs.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace optim {
namespace detail {

// Most tensors one kernel launch carries in its argument block.
inline constexpr int tensors_per_launch = 16;

// Type-erased per-tensor arguments of the kernels (pointers are re-typed inside the typed kernel).
struct adam_tensor_args {
  void* param;
  const void* grad;
  float* master;
  void* m;
  void* v;
  float* m_scale;
  float* v_scale;
  std::int64_t size;
  std::int64_t unit_begin;  // first work unit of this tensor within the launch
  std::int64_t index;       // tensor index within the state (the stochastic-rounding stream)
  std::int64_t first;       // the tensor index of element 0 (dist::sharded_adam_state steps pieces of tensors)
  adam_group group;
  std::int32_t quantized;
  std::int32_t terms_slot;  // the slot of this tensor's group in the step's terms (CUDA: enqueue_step_terms)
  std::int32_t vector;      // 1 when param, grad, master and moments are 16-byte aligned (16-byte accesses)
};

#if MEMKIT_HAS_CUDA
// ---- CUDA kernels: each calls the same element functions as the host loop ----

// Code tables of a quantized state, passed by value in the kernel arguments.
template <class State, bool Quantized = adam_state_traits<State>::quantized>
struct launch_tables {
  static constexpr int entries = 1;
  float m[1], v[1];
};
template <class State>
struct launch_tables<State, true> {
  static constexpr int entries = adam_state_traits<State>::entries;
  float m[entries], v[entries];
};

template <class G>
struct norm_launch {
  const G* grad[tensors_per_launch];
  double* sums[tensors_per_launch];
  std::int64_t size[tensors_per_launch];
  std::int64_t chunk_begin[tensors_per_launch + 1];
  int count;
};

// One block of reduction_lanes threads per chunk. The chunk is staged in shared memory with 16-byte loads
// (a lane's elements l, l + lanes, ... are not contiguous, so lanes cannot load their own), then each lane
// adds its elements in the canonical order of lane_sum_of_squares, and the lanes are added as tree_sum adds
// them: two levels through shared memory, the last six by shuffles, which pair the same lanes. The same
// bits as the host loop.
template <class G>
__global__ void __launch_bounds__(reduction_lanes) adam_norm_kernel(norm_launch<G> batch) {
  static_assert(reduction_lanes == 256 && reduction_chunk % reduction_lanes == 0);
  constexpr int per_vector = 16 / static_cast<int>(sizeof(G));
  __shared__ uint4 staged_words[reduction_chunk * sizeof(G) / 16];
  __shared__ double lanes[reduction_lanes];
  const std::int64_t unit = blockIdx.x;
  int t = 0;
  while (t + 1 < batch.count && unit >= batch.chunk_begin[t + 1]) ++t;
  const std::int64_t chunk = unit - batch.chunk_begin[t];
  const std::int64_t begin = chunk * reduction_chunk;
  const std::int64_t remaining = batch.size[t] - begin;
  const int count = static_cast<int>(remaining < reduction_chunk ? remaining : reduction_chunk);
  const int lane = static_cast<int>(threadIdx.x);
  const G* __restrict__ source = batch.grad[t] + begin;
  G* staged = reinterpret_cast<G*>(staged_words);
  const bool aligned = (reinterpret_cast<std::uintptr_t>(source) & 15u) == 0;
  if (aligned && count == reduction_chunk) {  // a whole chunk: all of a lane's loads in flight at once
    constexpr int per_lane = static_cast<int>(reduction_chunk) / per_vector / reduction_lanes;
    uint4 words[per_lane];
#pragma unroll
    for (int k = 0; k < per_lane; ++k) words[k] = __ldg(reinterpret_cast<const uint4*>(source) + lane + k * reduction_lanes);
#pragma unroll
    for (int k = 0; k < per_lane; ++k) staged_words[lane + k * reduction_lanes] = words[k];
  } else {  // a tensor's last chunk
    const int vectors = aligned ? count / per_vector : 0;
#pragma unroll 1
    for (int i = lane; i < vectors; i += reduction_lanes) staged_words[i] = __ldg(reinterpret_cast<const uint4*>(source) + i);
#pragma unroll 1
    for (int i = vectors * per_vector + lane; i < count; i += reduction_lanes) staged[i] = source[i];
  }
  __syncthreads();
  lanes[lane] = lane_sum_of_squares(static_cast<const G*>(staged), count, lane);
  __syncthreads();
  if (lane < 128) lanes[lane] = dadd_rn(lanes[lane], lanes[lane + 128]);
  __syncthreads();
  if (lane < 64) lanes[lane] = dadd_rn(lanes[lane], lanes[lane + 64]);
  __syncthreads();
  if (lane < 32) {
    double sum = dadd_rn(lanes[lane], lanes[lane + 32]);
#pragma unroll
    for (int stride = 16; stride > 0; stride >>= 1) sum = dadd_rn(sum, __shfl_down_sync(0xffffffffu, sum, stride));
    if (lane == 0) batch.sums[t][chunk] = sum;
  }
}

// The finalisation on the device. The sum stays one serial chain in index order (the host's bits), but the
// chunk sums reach it through shared memory, staged a tile at a time by the whole CTA: one thread reading them
// from global memory waited a full load latency per chunk (1.55 ms for 18,320 chunks on an H200).
inline constexpr int finalize_threads = 512;
inline constexpr int finalize_tile = 4096;  // doubles: 32 KiB of shared memory
// Kernels in a header are templates so that every translation unit may instantiate them (one definition).
template <class Control = adam_control>
__global__ void __launch_bounds__(finalize_threads)
adam_finalize_kernel(Control* control, const double* __restrict__ sums, std::int64_t chunks, float max_grad_norm,
                     loss_scaler_options scaler, float gradient_scale) {
  __shared__ double staged[finalize_tile];
  double total = 0.0;
  std::int64_t first_bad = -1;
  for (std::int64_t first = 0; first < chunks; first += finalize_tile) {
    const std::int64_t count = chunks - first < finalize_tile ? chunks - first : finalize_tile;
    for (std::int64_t i = threadIdx.x; i < count; i += blockDim.x) staged[i] = sums[first + i];
    __syncthreads();
    if (threadIdx.x == 0) add_chunk_sums(staged, count, first, total, first_bad);
    __syncthreads();
  }
  if (threadIdx.x == 0) decide_step(*control, total, first_bad, max_grad_norm, scaler, gradient_scale);
}

template <class Control = adam_control>
__global__ void adam_set_control_kernel(Control* control, Control value) {
  *control = value;
}

// The step's bias-correction terms of up to 32 groups, one thread each, after the finalisation has
// counted the step: the FP64 of make_step_terms runs here, once per group and step, not in the updates.
inline constexpr int step_terms_per_launch = 32;
struct step_terms_launch {
  adam_group groups[step_terms_per_launch];
  int count;
};
template <class Control = adam_control>
__global__ void adam_step_terms_kernel(const Control* control, step_terms_launch batch, adam_step_terms* terms) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < batch.count) terms[i] = make_step_terms(batch.groups[i], control->step);
}

// Enqueues the step terms of every group some tensor uses into `terms` (the gradient-norm scratch, free once
// the finalisation has read it: one 8-byte slot per used group, in order of first use) and returns each
// tensor's slot. group_of(i) is tensor i's group.
template <class GroupOf>
std::vector<std::int32_t> enqueue_step_terms(cudaStream_t stream, const adam_control* control, adam_step_terms* terms,
                                             std::int64_t slots, std::span<const adam_group> groups,
                                             std::size_t tensors, GroupOf&& group_of) {
  static_assert(sizeof(adam_step_terms) == sizeof(double));
  std::vector<std::int32_t> slot_of_group(groups.size(), -1), slot_of_tensor(tensors, 0);
  std::vector<std::size_t> used;
  for (std::size_t i = 0; i < tensors; ++i) {
    const auto g = static_cast<std::size_t>(group_of(i));
    if (slot_of_group[g] < 0) {
      slot_of_group[g] = static_cast<std::int32_t>(used.size());
      used.push_back(g);
    }
    slot_of_tensor[i] = slot_of_group[g];
  }
  require(static_cast<std::int64_t>(used.size()) <= slots, "adam step: more groups in use than scratch slots");
  for (std::size_t first = 0; first < used.size(); first += step_terms_per_launch) {
    step_terms_launch batch{};
    for (std::size_t j = 0; j < step_terms_per_launch && first + j < used.size(); ++j) {
      batch.groups[j] = groups[used[first + j]];
      batch.count = static_cast<int>(j + 1);
    }
    adam_step_terms_kernel<adam_control><<<1, step_terms_per_launch, 0, stream>>>(control, batch, terms + first);
    MEMKIT_CUDA_CHECK(cudaGetLastError());
  }
  return slot_of_tensor;
}

template <class State>
struct update_launch {
  adam_tensor_args tensors[tensors_per_launch];
  launch_tables<State> tables;
  const adam_control* control;
  const adam_step_terms* terms;  // indexed by adam_tensor_args::terms_slot
  std::uint64_t seed;
  int count;
  bool stochastic_rounding;
};

// Kernel arguments must fit the 4 KiB every CUDA architecture accepts.
static_assert(sizeof(update_launch<std::int8_t>) <= 4096 && sizeof(update_launch<four_bit>) <= 4096 &&
              sizeof(update_launch<float>) <= 4096 && sizeof(norm_launch<float>) <= 4096 &&
              sizeof(step_terms_launch) <= 4096);

// The update kernel's geometry. Each thread takes update_vector consecutive elements at a time (two
// 16-byte loads of fp32 parameters, gradients and moments; 8 or 4 bytes of codes); a work unit (a
// quantization block, or plain_unit elements of fp32/bf16 moments) belongs to a group of `lanes` threads,
// and a block of `threads` threads takes threads / lanes units. Quantized blocks of up to 256 elements
// are one group within a warp (the block's absmax is a shuffle reduction); larger blocks take 256 lanes
// and `slots` vectors per lane.
inline constexpr int update_vector = 8;
template <class State, int Block>
struct update_geometry {
  using traits = adam_state_traits<State>;
  static constexpr int threads = 256;
  static constexpr int lanes =
      !traits::quantized ? threads : (Block / update_vector < threads ? Block / update_vector : threads);
  static constexpr int units_per_block = threads / lanes;
  static constexpr int slots = traits::quantized ? Block / update_vector / lanes : 1;
};

template <class State, int Block>
constexpr int update_threads() noexcept {
  return update_geometry<State, Block>::threads;
}
// CUDA blocks of a launch over `units` work units.
template <class State, int Block>
constexpr unsigned update_blocks(std::int64_t units) noexcept {
  constexpr int per_block = update_geometry<State, Block>::units_per_block;
  return static_cast<unsigned>((units + per_block - 1) / per_block);
}

// param_access::load / store for N consecutive elements (16-byte aligned arrays).
template <int N, float_storage P, float_storage G>
MEMKIT_DEVICE MEMKIT_FORCEINLINE void load_params(const param_access<P, G>& access, std::int64_t i, float* p, float* g) {
  if (access.master != nullptr) load_floats<float, N>(access.master + i, p);
  else load_floats<P, N>(access.param + i, p);
  load_floats<G, N, true>(access.grad + i, g);
}
template <int N, float_storage P, float_storage G>
MEMKIT_DEVICE MEMKIT_FORCEINLINE void store_params(const param_access<P, G>& access, std::int64_t i, const float* p) {
  if (access.master != nullptr) store_bits<float, N>(access.master + i, [&](int k) { return __float_as_uint(p[k]); });
  store_bits<P, N>(access.param + i, [&](int k) { return storage_bits(access.rounded(i + k, p[k])); });
}

// N codes of elements [i, i + N) (8-bit: N bytes; 4-bit: N / 2 bytes, the even element in the high nibble).
template <int Bits, int N>
MEMKIT_DEVICE MEMKIT_FORCEINLINE void load_codes(const std::uint8_t* __restrict__ codes, std::int64_t i, unsigned* out) {
  static_assert(N == 8);
  if constexpr (Bits == 8) {
    const uint2 raw = *reinterpret_cast<const uint2*>(codes + i);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      out[k] = (raw.x >> (8 * k)) & 0xffu;
      out[4 + k] = (raw.y >> (8 * k)) & 0xffu;
    }
  } else {
    const std::uint32_t raw = *reinterpret_cast<const std::uint32_t*>(codes + (i >> 1));
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      out[2 * b] = (raw >> (8 * b + 4)) & 0x0fu;
      out[2 * b + 1] = (raw >> (8 * b)) & 0x0fu;
    }
  }
}
template <int Bits, int N>
MEMKIT_DEVICE MEMKIT_FORCEINLINE void store_codes(std::uint8_t* __restrict__ codes, std::int64_t i, const unsigned* in) {
  static_assert(N == 8);
  if constexpr (Bits == 8) {
    uint2 raw{0u, 0u};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      raw.x |= in[k] << (8 * k);
      raw.y |= in[4 + k] << (8 * k);
    }
    *reinterpret_cast<uint2*>(codes + i) = raw;
  } else {
    std::uint32_t raw = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) raw |= ((in[2 * b] << 4) | in[2 * b + 1]) << (8 * b);
    *reinterpret_cast<std::uint32_t*>(codes + (i >> 1)) = raw;
  }
}

// The 8-bit maps' buckets for the update kernel: built at compile time (make_dynamic_code_buckets throws, and
// so fails to compile, on a map it cannot serve), the constexpr copies give the sizes, the device copies
// the values. `static`: each translation unit holds its own copy (whole-program CUDA shares no device
// symbols across units), 10 KiB.
inline constexpr dynamic_code_buckets int8_m_buckets_host = make_dynamic_code_buckets(quant::dynamic_map_signed);
inline constexpr dynamic_code_buckets int8_v_buckets_host = make_dynamic_code_buckets(quant::dynamic_map_unsigned);
static __device__ const dynamic_code_buckets int8_m_buckets = int8_m_buckets_host;
static __device__ const dynamic_code_buckets int8_v_buckets = int8_v_buckets_host;
// The 4-bit maps' midpoints, which the update's lanes hold for count_below16's shuffled probes (device copies of the
// constants, as for the buckets).
static __device__ const midpoints16 int4_m_midpoints_device = int4_m_midpoints;
static __device__ const midpoints16 int4_v_midpoints_device = int4_v_midpoints;
static_assert(&adam_state_traits<four_bit>::tables() == &int4_maps, "the midpoints are the 4-bit state's maps'");
static_assert(&adam_state_traits<std::int8_t>::tables().m == &int8_maps.m && int8_maps.m == quant::dynamic_map_signed &&
              int8_maps.v == quant::dynamic_map_unsigned, "the buckets are built from the 8-bit state's maps");

// The fused update: dequantize m and v, update them and the parameter, find each block's new absmax (a
// shuffle reduction within the group of lanes; across warps through shared memory for blocks > 256
// elements), requantize. Every element goes through adamw_update and the state's code functions, as on the
// host. No thread returns before the last barrier or shuffle: a block of threads may hold units of several
// tensors, quantized and plain. At least 2 blocks per SM, so up to 128 registers: with the 8-bit buckets'
// shared memory and no such bound, ptxas held the 8-bit bf16 update to 80 registers and spilled (the SASS
// check caught it); the other flavours keep their occupancy (tests/sass/sass_check.py's table).
//
// Prefetch (the default launch, #30): every global load of a thread's unit (parameters, gradients, master
// weights, moments or codes and block scales) is issued before the kernel reads the control block and the
// step terms, and a plain unit's two vectors per lane are loaded together before any math. Without it (the
// previous kernel, kept for bench/adam_cuda.cu's comparison) a block first waited for the control block,
// then for the terms (two dependent loads), and then held one vector per lane in flight: ncu saw too few
// bytes in flight in the update on an H200 (docs/cuda.md). Reading before the skip test writes nothing; the
// per-element math is the same calls either way, so the bits are.
template <class State, int Block, int Threads, float_storage P, float_storage G, bool Prefetch = true>
__global__ void __launch_bounds__(Threads, 2) adam_update_kernel(update_launch<State> batch) {
  using traits = adam_state_traits<State>;
  using geometry = update_geometry<State, Block>;
  static_assert(Threads == geometry::threads);
  constexpr int V = update_vector, L = geometry::lanes, S = geometry::slots;
  constexpr std::int64_t divisor_block = Block > 0 ? Block : 1;
  if constexpr (!Prefetch)
    if (!batch.control->applied) return;  // the finalisation refused the step: touch nothing (the whole grid)
  constexpr int entries = traits::quantized ? launch_tables<State>::entries : 1;
  // 8-bit codes come from the maps' buckets (dynamic_code_bucketed: traits::code's codes in two
  // probes each), staged in shared memory; 4-bit ones from searching the 16-entry tables.
  constexpr bool bucketed = traits::quantized && traits::bits == 8;
  // Prefetch, 4-bit: the tables and their midpoints live in registers (a lane of each warp holds one entry of m's
  // or v's, and one midpoint, read by shuffles) and the new codes come from count_below16 (constant_code): no
  // shared loads per element. The shared tables remain for a tensor's last, partial block.
  constexpr bool register_tables = Prefetch && traits::quantized && traits::bits == 4;
  constexpr int m_buckets = bucketed ? static_cast<int>(int8_m_buckets_host.bucket_count) : 4;
  constexpr int v_buckets = bucketed ? static_cast<int>(int8_v_buckets_host.bucket_count) : 4;
  // Prefetch reads a probe's two thresholds as one pair (one 8-byte shared load instead of two 4-byte ones).
  constexpr int thresholds = bucketed && !Prefetch ? 257 : 1, pairs = bucketed && Prefetch ? 256 : 1;
  __shared__ float m_table[entries], v_table[entries];
  __shared__ float m_thresholds[thresholds], v_thresholds[thresholds];
  __shared__ dynamic_threshold_pair m_pairs[pairs], v_pairs[pairs];
  __shared__ std::uint32_t m_low[m_buckets / 4 + 1], v_low[v_buckets / 4 + 1];  // bytes, staged as words
  __shared__ float warp_max[2][Threads / 32];
  // Prefetch stages the tables after issuing the unit's loads, so that they overlap the staging.
  auto stage_tables = [&] {
    if constexpr (traits::quantized) {
      for (int i = static_cast<int>(threadIdx.x); i < entries; i += Threads) {
        m_table[i] = batch.tables.m[i];
        v_table[i] = batch.tables.v[i];
      }
      if constexpr (bucketed) {
        if constexpr (Prefetch) {
          for (int i = static_cast<int>(threadIdx.x); i < pairs; i += Threads) {
            m_pairs[i] = {int8_m_buckets.thresholds[i], int8_m_buckets.thresholds[i + 1]};
            v_pairs[i] = {int8_v_buckets.thresholds[i], int8_v_buckets.thresholds[i + 1]};
          }
        } else {
          for (int i = static_cast<int>(threadIdx.x); i < thresholds; i += Threads) {
            m_thresholds[i] = int8_m_buckets.thresholds[i];
            v_thresholds[i] = int8_v_buckets.thresholds[i];
          }
        }
        const auto* m_words = reinterpret_cast<const std::uint32_t*>(int8_m_buckets.low_code);
        const auto* v_words = reinterpret_cast<const std::uint32_t*>(int8_v_buckets.low_code);
        for (int i = static_cast<int>(threadIdx.x); i <= m_buckets / 4; i += Threads) m_low[i] = m_words[i];
        for (int i = static_cast<int>(threadIdx.x); i <= v_buckets / 4; i += Threads) v_low[i] = v_words[i];
      }
      __syncthreads();
    }
  };
  if constexpr (!Prefetch) stage_tables();
  // The code of x in m's map (first = std::true_type) or v's (std::false_type).
  auto code_of = [&]([[maybe_unused]] auto first, [[maybe_unused]] float x) -> unsigned {
    [[maybe_unused]] constexpr bool m = decltype(first)::value;
    if constexpr (bucketed && Prefetch)
      return dynamic_code_bucketed(m ? m_pairs : v_pairs, reinterpret_cast<const std::uint8_t*>(m ? m_low : v_low),
                                   m ? int8_m_buckets_host.first_key : int8_v_buckets_host.first_key,
                                   m ? int8_m_buckets_host.positive : int8_v_buckets_host.positive, x);
    else if constexpr (bucketed)
      return dynamic_code_bucketed(m ? m_thresholds : v_thresholds, reinterpret_cast<const std::uint8_t*>(m ? m_low : v_low),
                                   m ? int8_m_buckets_host.first_key : int8_v_buckets_host.first_key,
                                   m ? int8_m_buckets_host.positive : int8_v_buckets_host.positive, x);
    else if constexpr (traits::quantized) return traits::code(m ? m_table : v_table, x);
    else return 0u;  // plain moments are not coded
  };
  auto m_code_of = [&](float x) { return code_of(std::true_type{}, x); };
  auto v_code_of = [&](float x) { return code_of(std::false_type{}, x); };
  const int lane = static_cast<int>(threadIdx.x) % L;
  const std::int64_t unit = static_cast<std::int64_t>(blockIdx.x) * geometry::units_per_block + threadIdx.x / L;
  int t = 0;
  while (t + 1 < batch.count && unit >= batch.tensors[t + 1].unit_begin) ++t;
  const adam_tensor_args& a = batch.tensors[t];
  const std::int64_t local = unit - a.unit_begin;
  const std::int64_t units = a.quantized ? (a.size + divisor_block - 1) / divisor_block : (a.size + plain_unit - 1) / plain_unit;
  const bool active = local < units;
  using plain = std::conditional_t<traits::quantized, float, typename traits::moment_type>;
  // Prefetch: a plain state's unit (R vectors per lane), or a quantized unit's codes, scales, parameters and
  // gradients (one slot), all loaded here, before the control block is read. The plain tensors of a quantized
  // state (below min_quantized_size) keep the previous loop: with a quantized block's lanes a plain unit
  // would be 16 vectors per lane, more registers than the kernel has.
  constexpr bool prefetch_plain = Prefetch && !traits::quantized;
  constexpr int R = static_cast<int>(plain_unit) / (L * V);
  static_assert(traits::quantized || plain_unit % (L * V) == 0);
  constexpr int RP = prefetch_plain ? R : 1, SP = Prefetch && traits::quantized ? S : 1;
  float pre_p[RP][V], pre_g[RP][V], pre_m[RP][V], pre_v[RP][V];
  unsigned pre_m_code[SP][V], pre_v_code[SP][V];
  if constexpr (register_tables)  // lanes without a block still take part in the shuffles below: code 0
#pragma unroll
    for (int s = 0; s < SP; ++s)
#pragma unroll
      for (int k = 0; k < V; ++k) pre_m_code[s][k] = pre_v_code[s][k] = 0u;
  float pre_m_absmax = 0.0f, pre_v_absmax = 0.0f;
  if constexpr (Prefetch) {
    const param_access<P, G> loads{static_cast<P*>(a.param), static_cast<const G*>(a.grad), a.master, false, 0, 0, 0, 0};
    if (prefetch_plain && active && a.vector) {
      const std::int64_t begin = local * plain_unit;
      const std::int64_t count = a.size - begin < plain_unit ? a.size - begin : plain_unit;
#pragma unroll
      for (int r = 0; r < RP; ++r) {
        const std::int64_t e = static_cast<std::int64_t>(r * L + lane) * V;
        if (e + V > count) continue;
        load_params<V>(loads, begin + e, pre_p[r], pre_g[r]);
        load_floats<plain, V>(static_cast<const plain*>(a.m) + begin + e, pre_m[r]);
        load_floats<plain, V>(static_cast<const plain*>(a.v) + begin + e, pre_v[r]);
      }
    }
    if constexpr (traits::quantized) {
      if (active && a.quantized) {
        const std::int64_t begin = local * Block;
        const std::int64_t count = a.size - begin < Block ? a.size - begin : Block;
        pre_m_absmax = a.m_scale[local];
        pre_v_absmax = a.v_scale[local];
#pragma unroll
        for (int s = 0; s < S; ++s) {
          const std::int64_t e0 = static_cast<std::int64_t>(s * L + lane) * V;
          if (e0 + V > count) continue;
          load_codes<traits::bits, V>(static_cast<const std::uint8_t*>(a.m), begin + e0, pre_m_code[s]);
          load_codes<traits::bits, V>(static_cast<const std::uint8_t*>(a.v), begin + e0, pre_v_code[s]);
          if (a.vector && S == 1) load_params<V>(loads, begin + e0, pre_p[0], pre_g[0]);
        }
      }
    }
    stage_tables();
    if (!batch.control->applied) return;  // the finalisation refused the step: write nothing (the whole grid)
  }
  const adam_coefficients c =
      make_coefficients(a.group, batch.terms[a.terms_slot], batch.control->grad_multiplier);
  const param_access<P, G> access{static_cast<P*>(a.param), static_cast<const G*>(a.grad), a.master,
                                  batch.stochastic_rounding, batch.seed, batch.control->step, a.index, a.first};
  if (prefetch_plain && active) {
    auto* m = static_cast<plain*>(a.m);
    auto* v = static_cast<plain*>(a.v);
    const std::int64_t begin = local * plain_unit;
    const std::int64_t count = a.size - begin < plain_unit ? a.size - begin : plain_unit;
    std::int64_t scalar_from = 0;
    if (a.vector) {
#pragma unroll
      for (int r = 0; r < RP; ++r) {
        const std::int64_t e = static_cast<std::int64_t>(r * L + lane) * V;
        if (e + V > count) continue;
#pragma unroll
        for (int k = 0; k < V; ++k) adamw_update(pre_p[r][k], pre_m[r][k], pre_v[r][k], pre_g[r][k], c);
        store_floats<plain, V>(m + begin + e, pre_m[r]);
        store_floats<plain, V>(v + begin + e, pre_v[r]);
        store_params<V>(access, begin + e, pre_p[r]);
      }
      scalar_from = count / V * V;
    }
    for (std::int64_t e = scalar_from + lane; e < count; e += L) update_plain_element(access, m, v, begin + e, c);
  }
  if (!prefetch_plain && active && !a.quantized) {
    const std::int64_t begin = local * plain_unit;
    const std::int64_t count = a.size - begin < plain_unit ? a.size - begin : plain_unit;
    auto* m = static_cast<plain*>(a.m);
    auto* v = static_cast<plain*>(a.v);
    std::int64_t scalar_from = 0;
    if (a.vector) {
      for (std::int64_t e = static_cast<std::int64_t>(lane) * V; e + V <= count; e += static_cast<std::int64_t>(L) * V) {
        const std::int64_t i = begin + e;
        float p[V], g[V], mv[V], vv[V];
        load_params<V>(access, i, p, g);
        load_floats<plain, V>(m + i, mv);
        load_floats<plain, V>(v + i, vv);
#pragma unroll
        for (int k = 0; k < V; ++k) adamw_update(p[k], mv[k], vv[k], g[k], c);
        store_floats<plain, V>(m + i, mv);
        store_floats<plain, V>(v + i, vv);
        store_params<V>(access, i, p);
      }
      scalar_from = count / V * V;
    }
    for (std::int64_t e = scalar_from + lane; e < count; e += L) update_plain_element(access, m, v, begin + e, c);
  }
  if constexpr (traits::quantized) {
    const bool quantized_unit = active && a.quantized;
    const auto* m_codes = static_cast<const std::uint8_t*>(a.m);
    const auto* v_codes = static_cast<const std::uint8_t*>(a.v);
    const std::int64_t begin = local * Block;
    const std::int64_t count = !quantized_unit ? 0 : a.size - begin < Block ? a.size - begin : Block;
    float m_absmax = pre_m_absmax, v_absmax = pre_v_absmax;
    if constexpr (!Prefetch) {
      m_absmax = quantized_unit ? a.m_scale[local] : 0.0f;
      v_absmax = quantized_unit ? a.v_scale[local] : 0.0f;
    }
    float m_new[S * V], v_new[S * V];
    float m_max = 0.0f, v_max = 0.0f;
    // register_tables: lane l of a warp holds m's entry l (l < 16) or v's entry l - 16, and every lane reads
    // its codes' values with one shuffle each (the index is the code, or the code + 16), outside any branch
    // (a shuffle needs the whole warp). The values are the tables' own, so the bits are unchanged.
    constexpr int RV = register_tables ? SP : 1;
    float table_m[RV][V], table_v[RV][V];
    if constexpr (register_tables) {
      static_assert(launch_tables<State>::entries == 16);
      const int warp_lane = static_cast<int>(threadIdx.x) % 32;
      const float entry = warp_lane < 16 ? batch.tables.m[warp_lane] : batch.tables.v[warp_lane - 16];
#pragma unroll
      for (int s = 0; s < RV; ++s)
#pragma unroll
        for (int k = 0; k < V; ++k) {
          table_m[s][k] = __shfl_sync(0xffffffffu, entry, static_cast<int>(pre_m_code[s][k]));
          table_v[s][k] = __shfl_sync(0xffffffffu, entry, static_cast<int>(pre_v_code[s][k] | 16u));
        }
    }
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const std::int64_t e0 = static_cast<std::int64_t>(s * L + lane) * V;
      float* m = m_new + s * V;
      float* v = v_new + s * V;
      if (e0 + V <= count) {
        unsigned m_code[V], v_code[V];
        if constexpr (Prefetch) {
#pragma unroll
          for (int k = 0; k < V; ++k) {
            m_code[k] = pre_m_code[s][k];
            v_code[k] = pre_v_code[s][k];
          }
        } else {
          load_codes<traits::bits, V>(m_codes, begin + e0, m_code);
          load_codes<traits::bits, V>(v_codes, begin + e0, v_code);
        }
#pragma unroll
        for (int k = 0; k < V; ++k) {
          if constexpr (register_tables) {
            m[k] = mul_rn(table_m[s][k], m_absmax);
            v[k] = mul_rn(table_v[s][k], v_absmax);
          } else {
            m[k] = mul_rn(m_table[m_code[k]], m_absmax);
            v[k] = mul_rn(v_table[v_code[k]], v_absmax);
          }
        }
        if (a.vector) {
          float p[V], g[V];
          if (Prefetch && S == 1) {
#pragma unroll
            for (int k = 0; k < V; ++k) {
              p[k] = pre_p[0][k];
              g[k] = pre_g[0][k];
            }
          } else {
            load_params<V>(access, begin + e0, p, g);
          }
#pragma unroll
          for (int k = 0; k < V; ++k) adamw_update(p[k], m[k], v[k], g[k], c);
          store_params<V>(access, begin + e0, p);
        } else {
#pragma unroll
          for (int k = 0; k < V; ++k) update_element(access, m[k], v[k], begin + e0 + k, c);
        }
#pragma unroll
        for (int k = 0; k < V; ++k) {
          m_max = max_abs(m_max, m[k]);
          v_max = max_abs(v_max, v[k]);
        }
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          m[k] = v[k] = 0.0f;
          const std::int64_t e = e0 + k;
          if (e < count) {
            m[k] = mul_rn(m_table[load_code<traits::bits>(m_codes, begin + e)], m_absmax);
            v[k] = mul_rn(v_table[load_code<traits::bits>(v_codes, begin + e)], v_absmax);
            update_element(access, m[k], v[k], begin + e, c);
            m_max = max_abs(m_max, m[k]);
            v_max = max_abs(v_max, v[k]);
          }
        }
      }
    }
    // The block's absmax: max is exact and order-free, so any reduction order gives the host's value.
#pragma unroll
    for (int offset = (L < 32 ? L : 32) / 2; offset > 0; offset >>= 1) {
      m_max = max_abs(m_max, __shfl_xor_sync(0xffffffffu, m_max, offset));
      v_max = max_abs(v_max, __shfl_xor_sync(0xffffffffu, v_max, offset));
    }
    if constexpr (L > 32) {
      const int warp = static_cast<int>(threadIdx.x) / 32;
      if (threadIdx.x % 32 == 0) {
        warp_max[0][warp] = m_max;
        warp_max[1][warp] = v_max;
      }
      __syncthreads();
      const int first_warp = static_cast<int>(threadIdx.x) / L * (L / 32);
#pragma unroll
      for (int w = 0; w < L / 32; ++w) {
        m_max = max_abs(m_max, warp_max[0][first_warp + w]);
        v_max = max_abs(v_max, warp_max[1][first_warp + w]);
      }
    }
    const float m_inverse = inverse_scale(m_max), v_inverse = inverse_scale(v_max);
    // register_tables: every lane finds its new codes here, before any lane returns (a shuffle needs the whole
    // warp; a lane without a block codes zeros): count_below16 compares with two of the midpoints as constants,
    // then with two read by shuffles from the lanes holding them (lane j: m's midpoint j, lane 16 + j: v's).
    unsigned m_new_code[RV * V], v_new_code[RV * V];
    if constexpr (register_tables) {
      const int warp_lane = static_cast<int>(threadIdx.x) % 32, j = warp_lane % 16;
      const float midpoint = j == 15 ? 0.0f : warp_lane < 16 ? int4_m_midpoints_device.t[j] : int4_v_midpoints_device.t[j];
      const auto m_probe = [midpoint](unsigned k) { return __shfl_sync(0xffffffffu, midpoint, static_cast<int>(k)); };
      const auto v_probe = [midpoint](unsigned k) { return __shfl_sync(0xffffffffu, midpoint, static_cast<int>(k | 16u)); };
#pragma unroll
      for (int i = 0; i < RV * V; ++i) {
        m_new_code[i] = traits::template constant_code<true>(mul_rn(m_new[i], m_inverse), m_probe);
        v_new_code[i] = traits::template constant_code<false>(mul_rn(v_new[i], v_inverse), v_probe);
      }
    }
    // The new code of element i (s * V + k) of this lane's values.
    auto m_requant = [&](int i) -> unsigned {
      if constexpr (register_tables) return m_new_code[i];
      else return m_code_of(mul_rn(m_new[i], m_inverse));
    };
    auto v_requant = [&](int i) -> unsigned {
      if constexpr (register_tables) return v_new_code[i];
      else return v_code_of(mul_rn(v_new[i], v_inverse));
    };
    if (!quantized_unit) return;
    if (lane == 0) {
      a.m_scale[local] = m_max;
      a.v_scale[local] = v_max;
    }
    auto* m_out = static_cast<std::uint8_t*>(a.m);
    auto* v_out = static_cast<std::uint8_t*>(a.v);
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const std::int64_t e0 = static_cast<std::int64_t>(s * L + lane) * V;
      if (e0 + V <= count) {
        unsigned m_code[V], v_code[V];
#pragma unroll
        for (int k = 0; k < V; ++k) {
          m_code[k] = m_requant(s * V + k);
          v_code[k] = v_requant(s * V + k);
        }
        store_codes<traits::bits, V>(m_out, begin + e0, m_code);
        store_codes<traits::bits, V>(v_out, begin + e0, v_code);
      } else if constexpr (traits::bits == 8) {
#pragma unroll
        for (int k = 0; k < V; ++k)
          if (e0 + k < count) {
            m_out[begin + e0 + k] = static_cast<std::uint8_t>(m_requant(s * V + k));
            v_out[begin + e0 + k] = static_cast<std::uint8_t>(v_requant(s * V + k));
          }
      } else {
#pragma unroll
        for (int k = 0; k < V; k += 2) {
          const std::int64_t e = e0 + k;
          if (e >= count) continue;
          const unsigned m_hi = m_requant(s * V + k);
          const unsigned v_hi = v_requant(s * V + k);
          const unsigned m_lo = e + 1 < count ? m_requant(s * V + k + 1) : 0u;
          const unsigned v_lo = e + 1 < count ? v_requant(s * V + k + 1) : 0u;
          m_out[(begin + e) / 2] = static_cast<std::uint8_t>((m_hi << 4) | m_lo);
          v_out[(begin + e) / 2] = static_cast<std::uint8_t>((v_hi << 4) | v_lo);
        }
      }
    }
  }
}
#endif

}  // namespace detail

}  // namespace optim
MEMKIT_NAMESPACE_END
