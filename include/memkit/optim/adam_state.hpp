// memkit/optim/adam_state.hpp — AdamW optimizer state in 32, 16, 8 or 4 bits, with a fused step on the
// host and on CUDA.
//
//   adam_state<float>             fp32 moments (8 bytes per parameter)
//   adam_state<bf16>              bf16 moments (4 bytes per parameter)
//   adam_state<std::int8_t, B>    blockwise 8-bit moments, B = 256 by default (2048 in the 8-bit
//                                 optimizers paper): m with the signed dynamic map, v with the unsigned
//                                 one, one fp32 absmax per block per moment (~2 bytes per parameter)
//   adam_state<four_bit, B>       blockwise 4-bit moments (torchao's AdamW4bit), B = 128: m with a signed
//                                 dynamic map of 3 exponent bits, v with 16 linear levels (~1 byte)
//
// One state serves a fixed list of parameter tensors, given by their element counts. All of its memory
// is one allocation from the caller's resource, laid out as: a control block (step count, loss scale,
// the last step's outcome), the gradient-norm scratch, then per tensor its moment segments, each
// aligned to 64 bytes, m and v of a large tensor half a 4 KiB page apart modulo 4 KiB (detail::stagger_after).
// bytes_required() predicts that allocation exactly. Tensors smaller than
// options.min_quantized_size keep fp32 moments in a quantized state, as bitsandbytes does.
//
// A step is three passes: a norm pass that reads the gradients once (global L2 norm and non-finite
// detection), a one-thread finalisation that decides apply or skip, the clipping factor and the loss
// scale, and one fused update pass that, per block, dequantizes m and v, updates them and the
// parameter, finds the new absmax and requantizes. On CUDA all three are enqueued on the executor's
// stream and the host never waits; the decision lives in the control block on the device.
//
// Non-finite gradients: if any gradient element of any tensor is NaN or Inf, the whole step is
// skipped: parameters, master weights and moments stay bit-identical, the step count does not advance,
// skipped_steps is incremented, the loss scale (when enabled) backs off, and report() names the first
// tensor with a non-finite gradient. bitsandbytes instead zeroes the moments of the offending elements;
// memkit refuses the step, because a half-applied step cannot be undone and fp16 overflow is routine.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <istream>
#include <ostream>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/device_vector.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/host_threads.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/optim/adam_bytes.hpp"
#include "memkit/optim/adam_math.hpp"
#include "memkit/optim/state_codecs.hpp"

MEMKIT_NAMESPACE_BEGIN

// Options fixed when the state is made (the first one shapes the memory layout).
struct adam_options {
  std::int64_t min_quantized_size = default_min_quantized_size;  // smaller tensors keep fp32 moments in a quantized state
  float max_grad_norm = 0.0f;              // global-norm clipping over all tensors of the step; 0 disables
  loss_scaler_options loss_scaling{};      // dynamic loss scaling for fp16 gradients
  bool stochastic_rounding = true;         // bf16 parameters without a master copy: round stochastically
  std::uint64_t seed = 0;                  // of the stochastic rounding; same seed, same bits
  int host_threads = 1;                    // threads of the host and CPU-offload steps, 0 = all hardware
                                           // threads; the results do not depend on it
};

// One tensor's optimizer state as adam_state stores it, read-only: views into the state's own memory (of
// its memory kind). A quantized tensor has codes and one absmax per block for each moment (value =
// map[code] * absmax[element / block]); a plain tensor (fp32/bf16 states, or a quantized state's tensors
// below min_quantized_size, which keep fp32) has the moments themselves. adam_state::assign takes the same
// struct, filled with host views, to replace the state (importing another optimizer's state).
template <class Plain>
struct adam_tensor_state {
  bool quantized = false;
  tensor_view<const std::uint8_t> m_codes{}, v_codes{};  // [size] (8-bit) or [(size + 1) / 2] (4-bit, two per byte)
  tensor_view<const float> m_absmax{}, v_absmax{};       // [blocks]
  tensor_view<const Plain> m{}, v{};                     // [size]
};

// One parameter tensor of a step: the parameter, its gradient, an optional fp32 master copy (then the
// update is computed on the master and the parameter receives its rounded value) and its group.
template <float_storage P, float_storage G>
struct adam_param {
  tensor_view<P> param;
  tensor_view<const G> grad;
  tensor_view<float> master = tensor_view<float>();  // null unless given; not `{}`, which crashed g++ 12.2 (#34)
  int group = 0;
};

// One parameter tensor of a CPU-offloaded step (adam_state::offload_step, CUDA builds): parameter and
// gradient on the device; the fp32 master weights (the authoritative copy) and two staging buffers in
// pinned host memory. param_staging is unused when P is float (the master is copied back directly).
template <float_storage P, float_storage G>
struct adam_offload_param {
  tensor_view<P> param;
  tensor_view<const G> grad;
  tensor_view<float> master;
  tensor_view<G> grad_staging;
  tensor_view<P> param_staging{};
  int group = 0;
};

// What the last step did, read back from the control block.
struct adam_step_report {
  bool applied = false;
  std::int64_t step = 0;            // steps applied so far
  std::int64_t skipped_steps = 0;
  double grad_norm = 0.0;           // global L2 norm of the unscaled gradients (Inf/NaN when not finite)
  float loss_scale = 1.0f;          // the scale to multiply the next loss by
  std::int64_t first_nonfinite_tensor = -1;

  std::string to_string() const {
    if (applied)
      return "adam step " + std::to_string(step) + " applied (gradient norm " + std::to_string(grad_norm) +
             ", loss scale " + std::to_string(loss_scale) + ")";
    if (first_nonfinite_tensor >= 0)
      return "adam step skipped: tensor " + std::to_string(first_nonfinite_tensor) +
             " has a non-finite gradient; parameters and optimizer state are unchanged (" +
             std::to_string(skipped_steps) + " steps skipped so far, loss scale now " + std::to_string(loss_scale) + ")";
    if (skipped_steps > 0)
      return "adam step skipped: the gradient norm " + std::to_string(grad_norm) +
             " is too large for fp32 moments (g*g would overflow); parameters and optimizer state are unchanged (" +
             std::to_string(skipped_steps) + " steps skipped so far, loss scale now " + std::to_string(loss_scale) + ")";
    return "no adam step has been taken yet";
  }
};

namespace detail {

// Most tensors one kernel launch carries in its argument block.
inline constexpr int tensors_per_launch = 16;

struct adam_tensor_layout {
  std::int64_t size = 0;
  bool quantized = false;
  std::int64_t units = 0;  // quantization blocks, or plain units of plain_unit elements
  std::size_t m_offset = 0, v_offset = 0, m_scale_offset = 0, v_scale_offset = 0;
  std::int64_t first_chunk = 0, chunks = 0;  // gradient-norm chunks
};

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
static_assert(&adam_state_traits<std::int8_t>::tables().m == &int8_maps.m && int8_maps.m == quant::dynamic_map_signed &&
              int8_maps.v == quant::dynamic_map_unsigned, "the buckets are built from the 8-bit state's maps");

// The fused update: dequantize m and v, update them and the parameter, find each block's new absmax (a
// shuffle reduction within the group of lanes; across warps through shared memory for blocks > 256
// elements), requantize. Every element goes through adamw_update and the state's code functions, as on the
// host. No thread returns before the last barrier or shuffle: a block of threads may hold units of several
// tensors, quantized and plain. At least 2 blocks per SM, so up to 128 registers: with the 8-bit buckets'
// shared memory and no such bound, ptxas held the 8-bit bf16 update to 80 registers and spilled (the SASS
// check caught it); the other flavours keep their occupancy (tests/sass/sass_check.py's table).
template <class State, int Block, int Threads, float_storage P, float_storage G>
__global__ void __launch_bounds__(Threads, 2) adam_update_kernel(update_launch<State> batch) {
  using traits = adam_state_traits<State>;
  using geometry = update_geometry<State, Block>;
  static_assert(Threads == geometry::threads);
  constexpr int V = update_vector, L = geometry::lanes, S = geometry::slots;
  constexpr std::int64_t divisor_block = Block > 0 ? Block : 1;
  if (!batch.control->applied) return;  // the finalisation refused the step: touch nothing (the whole grid)
  constexpr int entries = traits::quantized ? launch_tables<State>::entries : 1;
  // 8-bit codes come from the maps' buckets (dynamic_code_bucketed: traits::m_code / v_code's codes in two
  // probes each), staged in shared memory; 4-bit ones from searching the 16-entry tables.
  constexpr bool bucketed = traits::quantized && traits::bits == 8;
  constexpr int m_buckets = bucketed ? static_cast<int>(int8_m_buckets_host.bucket_count) : 4;
  constexpr int v_buckets = bucketed ? static_cast<int>(int8_v_buckets_host.bucket_count) : 4;
  constexpr int thresholds = bucketed ? 257 : 1;
  __shared__ float m_table[entries], v_table[entries];
  __shared__ float m_thresholds[thresholds], v_thresholds[thresholds];
  __shared__ std::uint32_t m_low[m_buckets / 4 + 1], v_low[v_buckets / 4 + 1];  // bytes, staged as words
  __shared__ float warp_max[2][Threads / 32];
  if constexpr (traits::quantized) {
    for (int i = static_cast<int>(threadIdx.x); i < entries; i += Threads) {
      m_table[i] = batch.tables.m[i];
      v_table[i] = batch.tables.v[i];
    }
    if constexpr (bucketed) {
      for (int i = static_cast<int>(threadIdx.x); i < thresholds; i += Threads) {
        m_thresholds[i] = int8_m_buckets.thresholds[i];
        v_thresholds[i] = int8_v_buckets.thresholds[i];
      }
      const auto* m_words = reinterpret_cast<const std::uint32_t*>(int8_m_buckets.low_code);
      const auto* v_words = reinterpret_cast<const std::uint32_t*>(int8_v_buckets.low_code);
      for (int i = static_cast<int>(threadIdx.x); i <= m_buckets / 4; i += Threads) m_low[i] = m_words[i];
      for (int i = static_cast<int>(threadIdx.x); i <= v_buckets / 4; i += Threads) v_low[i] = v_words[i];
    }
    __syncthreads();
  }
  auto m_code_of = [&]([[maybe_unused]] float x) -> unsigned {
    if constexpr (bucketed)
      return dynamic_code_bucketed(m_thresholds, reinterpret_cast<const std::uint8_t*>(m_low), int8_m_buckets_host.first_key,
                                   int8_m_buckets_host.positive, x);
    else if constexpr (traits::quantized) return traits::m_code(m_table, x);
    else return 0u;  // plain moments are not coded
  };
  auto v_code_of = [&]([[maybe_unused]] float x) -> unsigned {
    if constexpr (bucketed)
      return dynamic_code_bucketed(v_thresholds, reinterpret_cast<const std::uint8_t*>(v_low), int8_v_buckets_host.first_key,
                                   int8_v_buckets_host.positive, x);
    else if constexpr (traits::quantized) return traits::v_code(v_table, x);
    else return 0u;  // plain moments are not coded
  };
  const int lane = static_cast<int>(threadIdx.x) % L;
  const std::int64_t unit = static_cast<std::int64_t>(blockIdx.x) * geometry::units_per_block + threadIdx.x / L;
  int t = 0;
  while (t + 1 < batch.count && unit >= batch.tensors[t + 1].unit_begin) ++t;
  const adam_tensor_args& a = batch.tensors[t];
  const std::int64_t local = unit - a.unit_begin;
  const std::int64_t units = a.quantized ? (a.size + divisor_block - 1) / divisor_block : (a.size + plain_unit - 1) / plain_unit;
  const bool active = local < units;
  const adam_coefficients c =
      make_coefficients(a.group, batch.terms[a.terms_slot], batch.control->grad_multiplier);
  const param_access<P, G> access{static_cast<P*>(a.param), static_cast<const G*>(a.grad), a.master,
                                  batch.stochastic_rounding, batch.seed, batch.control->step, a.index, a.first};
  if (active && !a.quantized) {
    using plain = std::conditional_t<traits::quantized, float, typename traits::moment_type>;
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
    const float m_absmax = quantized_unit ? a.m_scale[local] : 0.0f, v_absmax = quantized_unit ? a.v_scale[local] : 0.0f;
    float m_new[S * V], v_new[S * V];
    float m_max = 0.0f, v_max = 0.0f;
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const std::int64_t e0 = static_cast<std::int64_t>(s * L + lane) * V;
      float* m = m_new + s * V;
      float* v = v_new + s * V;
      if (e0 + V <= count) {
        unsigned m_code[V], v_code[V];
        load_codes<traits::bits, V>(m_codes, begin + e0, m_code);
        load_codes<traits::bits, V>(v_codes, begin + e0, v_code);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          m[k] = mul_rn(m_table[m_code[k]], m_absmax);
          v[k] = mul_rn(v_table[v_code[k]], v_absmax);
        }
        if (a.vector) {
          float p[V], g[V];
          load_params<V>(access, begin + e0, p, g);
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
    if (!quantized_unit) return;
    if (lane == 0) {
      a.m_scale[local] = m_max;
      a.v_scale[local] = v_max;
    }
    const float m_inverse = inverse_scale(m_max), v_inverse = inverse_scale(v_max);
    auto* m_out = static_cast<std::uint8_t*>(a.m);
    auto* v_out = static_cast<std::uint8_t*>(a.v);
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const std::int64_t e0 = static_cast<std::int64_t>(s * L + lane) * V;
      const float* m = m_new + s * V;
      const float* v = v_new + s * V;
      if (e0 + V <= count) {
        unsigned m_code[V], v_code[V];
#pragma unroll
        for (int k = 0; k < V; ++k) {
          m_code[k] = m_code_of(mul_rn(m[k], m_inverse));
          v_code[k] = v_code_of(mul_rn(v[k], v_inverse));
        }
        store_codes<traits::bits, V>(m_out, begin + e0, m_code);
        store_codes<traits::bits, V>(v_out, begin + e0, v_code);
      } else if constexpr (traits::bits == 8) {
#pragma unroll
        for (int k = 0; k < V; ++k)
          if (e0 + k < count) {
            m_out[begin + e0 + k] = static_cast<std::uint8_t>(m_code_of(mul_rn(m[k], m_inverse)));
            v_out[begin + e0 + k] = static_cast<std::uint8_t>(v_code_of(mul_rn(v[k], v_inverse)));
          }
      } else {
#pragma unroll
        for (int k = 0; k < V; k += 2) {
          const std::int64_t e = e0 + k;
          if (e >= count) continue;
          const unsigned m_hi = m_code_of(mul_rn(m[k], m_inverse));
          const unsigned v_hi = v_code_of(mul_rn(v[k], v_inverse));
          const unsigned m_lo = e + 1 < count ? m_code_of(mul_rn(m[k + 1], m_inverse)) : 0u;
          const unsigned v_lo = e + 1 < count ? v_code_of(mul_rn(v[k + 1], v_inverse)) : 0u;
          m_out[(begin + e) / 2] = static_cast<std::uint8_t>((m_hi << 4) | m_lo);
          v_out[(begin + e) / 2] = static_cast<std::uint8_t>((v_hi << 4) | v_lo);
        }
      }
    }
  }
}
#endif

}  // namespace detail

template <class State, int Block = adam_state_traits<State>::default_block>
class adam_state : public adam_layout<State, Block> {
  using traits = adam_state_traits<State>;
  using layout = adam_layout<State, Block>;
  using layout::divisor_block;

 public:
  using state_type = State;
  static constexpr bool quantized = traits::quantized;
  static constexpr int block_size = Block;
  using moment_type = typename layout::moment_type;  // float or bf16 for plain states, std::uint8_t codes otherwise
  using plain_moment_type = typename layout::plain_moment_type;

  // The byte functions are adam_layout's (optim/adam_bytes.hpp): quantizes, tensor_bytes, segment_plan,
  // overhead_bytes, bytes_required; and exactly what a state for tensors of these sizes allocates:
  using layout::bytes_required;
  static constexpr std::size_t bytes_required(std::span<const std::int64_t> sizes, const adam_options& options = {}) noexcept {
    return layout::bytes_required(sizes, options.min_quantized_size);
  }
  using layout::overhead_bytes;
  using layout::quantizes;
  using layout::segment_plan;
  using layout::tensor_bytes;

  // The state starts zeroed (step 0) when `exec` has run the initialisation it enqueues here.
  template <executor E>
  adam_state(const E& exec, memory_resource& resource, std::span<const std::int64_t> sizes, adam_options options = {})
      : options_(options) {
    validate(options_.loss_scaling, "adam_state");
    require(options_.min_quantized_size >= 0, "adam_state: min_quantized_size must be >= 0");
    require(options_.max_grad_norm >= 0.0f, "adam_state: max_grad_norm must be >= 0");
    require_host_threads("adam_state", options_.host_threads);
    std::int64_t chunks = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      require(sizes[i] > 0, "adam_state: tensor " + std::to_string(i) + " has " + std::to_string(sizes[i]) +
                                " elements; every tensor needs at least one");
      detail::adam_tensor_layout t;
      t.size = sizes[i];
      t.quantized = quantizes(t.size, options_.min_quantized_size);
      t.units = t.quantized ? (t.size + divisor_block - 1) / divisor_block : (t.size + detail::plain_unit - 1) / detail::plain_unit;
      t.first_chunk = chunks;
      t.chunks = detail::reduction_chunks(t.size);
      chunks += t.chunks;
      layout_.push_back(t);
    }
    total_chunks_ = chunks;
    std::size_t offset = overhead_bytes(chunks);
    for (detail::adam_tensor_layout& t : layout_) {
      offset = segment_plan(t.size, t.quantized).place(t, offset, t.quantized);
    }
    arena_ = buffer<std::byte>(resource, shape{static_cast<std::int64_t>(offset)});
    reset(exec);
  }

  adam_state(const adam_state&) = delete;
  adam_state& operator=(const adam_state&) = delete;
  adam_state(adam_state&&) noexcept = default;
  adam_state& operator=(adam_state&&) noexcept = default;

  // Zeroes the moments and the control block (step 0, initial loss scale).
  template <executor E>
  void reset([[maybe_unused]] const E& exec) {
    require_accessible(exec, arena_view(), "adam_state::reset", "optimizer state");
    adam_control control{};
    control.loss_scale = options_.loss_scaling.enabled ? options_.loss_scaling.initial_scale : 1.0f;
    if constexpr (!E::on_device) {
      std::memset(arena_.data(), 0, arena_.bytes());
      std::memcpy(arena_.data(), &control, sizeof control);
    } else {
#if MEMKIT_HAS_CUDA
      device_reset(exec, control);
#endif
    }
  }

  std::size_t tensor_count() const noexcept { return layout_.size(); }
  std::int64_t size(std::size_t tensor) const { return layout_.at(tensor).size; }
  bool is_quantized(std::size_t tensor) const { return layout_.at(tensor).quantized; }
  std::size_t bytes() const noexcept { return arena_.bytes(); }
  memory_kind where() const noexcept { return arena_.where(); }
  const adam_options& options() const noexcept { return options_; }
  // Changes the clipping threshold for later steps (0 disables clipping).
  void set_max_grad_norm(float max_norm) {
    require(max_norm >= 0.0f && detail::is_finite(max_norm), "adam_state::set_max_grad_norm: need a finite value >= 0");
    options_.max_grad_norm = max_norm;
  }

  // One AdamW step over all tensors of the state, in the order they were given at construction.
  // `gradient_scale` multiplies every gradient (e.g. 1/micro_batches after gradient accumulation), on
  // top of the loss-scale division and the clipping factor, without a separate pass.
  template <executor E, float_storage P, float_storage G>
  void step(const E& exec, std::span<const adam_param<P, G>> params, std::span<const adam_group> groups,
            float gradient_scale = 1.0f) {
    validate_step(exec, params, groups, gradient_scale);
    if constexpr (!E::on_device) host_step(params, groups, gradient_scale);
    else {
#if MEMKIT_HAS_CUDA
      device_step(exec, params, groups, gradient_scale);
#endif
    }
  }
  template <executor E, float_storage P, float_storage G>
  void step(const E& exec, const std::vector<adam_param<P, G>>& params, const std::vector<adam_group>& groups,
            float gradient_scale = 1.0f) {
    step(exec, std::span<const adam_param<P, G>>(params), std::span<const adam_group>(groups), gradient_scale);
  }

  // The control block, copied to the host. On CUDA this waits for the executor's stream (it is a
  // read-back for logging and tests, never part of a step).
  template <executor E>
  adam_control control(const E& exec) const {
    adam_control control{};
    copy_out(exec, &control, 0, sizeof control);
    return control;
  }
  template <executor E>
  adam_step_report report(const E& exec) const {
    const adam_control c = control(exec);
    adam_step_report r;
    r.applied = c.applied != 0;
    r.step = c.step;
    r.skipped_steps = c.skipped_steps;
    r.grad_norm = c.grad_norm;
    r.loss_scale = c.loss_scale;
    if (c.first_nonfinite_chunk >= 0)
      for (std::size_t i = 0; i < layout_.size(); ++i)
        if (c.first_nonfinite_chunk >= layout_[i].first_chunk &&
            c.first_nonfinite_chunk < layout_[i].first_chunk + layout_[i].chunks)
          r.first_nonfinite_tensor = static_cast<std::int64_t>(i);
    return r;
  }
  template <executor E>
  float loss_scale(const E& exec) const {
    return control(exec).loss_scale;
  }

  // The dequantized moments of one tensor, as fp32 on the host (tests and inspection).
  template <executor E>
  void read_moments(const E& exec, std::size_t tensor, std::vector<float>& m, std::vector<float>& v) const {
    require(tensor < layout_.size(), "adam_state::read_moments: tensor " + std::to_string(tensor) + " of " +
                                         std::to_string(layout_.size()));
    std::vector<std::byte> bytes;
    const std::byte* base = arena_.data();
    if (E::on_device || !host_executor::can_access(where())) {
      bytes.resize(arena_.bytes());
      copy_out(exec, bytes.data(), 0, bytes.size());
      base = bytes.data();
    }
    const detail::adam_tensor_layout& t = layout_[tensor];
    m.resize(static_cast<std::size_t>(t.size));
    v.resize(static_cast<std::size_t>(t.size));
    for (std::int64_t i = 0; i < t.size; ++i) {
      m[static_cast<std::size_t>(i)] = load_moment(base, t, i, true);
      v[static_cast<std::size_t>(i)] = load_moment(base, t, i, false);
    }
  }
  // Overwrites one tensor's moments with fp32 values, quantizing them as the step would (host-accessible
  // state only). Tests use it to re-synchronise a reference optimizer.
  void write_moments(std::size_t tensor, std::span<const float> m, std::span<const float> v) {
    require(tensor < layout_.size(), "adam_state::write_moments: no tensor " + std::to_string(tensor));
    require(host_executor::can_access(where()), "adam_state::write_moments: the state is in device memory");
    const detail::adam_tensor_layout& t = layout_[tensor];
    require(static_cast<std::int64_t>(m.size()) == t.size && static_cast<std::int64_t>(v.size()) == t.size,
            "adam_state::write_moments: expected " + std::to_string(t.size) + " values per moment");
    std::byte* base = arena_.data();
    if (!t.quantized) {
      for (std::int64_t i = 0; i < t.size; ++i) {
        store_plain(base, t, i, m[static_cast<std::size_t>(i)], v[static_cast<std::size_t>(i)]);
      }
      return;
    }
    if constexpr (quantized) {
      for (std::int64_t b = 0; b < t.units; ++b) {
        const std::int64_t begin = b * Block, count = std::min<std::int64_t>(Block, t.size - begin);
        quantize_block(base, t, b, m.data() + begin, v.data() + begin, count);
      }
    }
  }

  // ---- The state as it is stored: read-only views, and wholesale replacement (interop) ----

  // Views of tensor `tensor`'s moments, valid while the state lives; they change with every step.
  adam_tensor_state<plain_moment_type> tensor_state(std::size_t tensor) const {
    require(tensor < layout_.size(), "adam_state::tensor_state: tensor " + std::to_string(tensor) + " of " +
                                         std::to_string(layout_.size()));
    return tensor_state_at(arena_.data(), layout_[tensor], where());
  }
  // Views of one tensor's moments in an arena (or an image of one) at `base`.
  static adam_tensor_state<plain_moment_type> tensor_state_at(const std::byte* base, const detail::adam_tensor_layout& t,
                                                               memory_kind kind) {
    adam_tensor_state<plain_moment_type> s;
    s.quantized = t.quantized;
    if (!t.quantized) {
      s.m = {reinterpret_cast<const plain_moment_type*>(base + t.m_offset), shape{t.size}, kind};
      s.v = {reinterpret_cast<const plain_moment_type*>(base + t.v_offset), shape{t.size}, kind};
      return s;
    }
    const std::int64_t codes = traits::bits == 8 ? t.size : (t.size + 1) / 2;
    s.m_codes = {reinterpret_cast<const std::uint8_t*>(base + t.m_offset), shape{codes}, kind};
    s.v_codes = {reinterpret_cast<const std::uint8_t*>(base + t.v_offset), shape{codes}, kind};
    s.m_absmax = {reinterpret_cast<const float*>(base + t.m_scale_offset), shape{t.units}, kind};
    s.v_absmax = {reinterpret_cast<const float*>(base + t.v_scale_offset), shape{t.units}, kind};
    return s;
  }
  // The code tables of a quantized state (256 entries for 8 bits, 16 for 4): m's signed, v's unsigned.
  static std::span<const float> m_map() noexcept
    requires quantized
  {
    return {traits::tables().m.data(), traits::tables().m.size()};
  }
  static std::span<const float> v_map() noexcept
    requires quantized
  {
    return {traits::tables().v.data(), traits::tables().v.size()};
  }
  // Steps applied so far: a view of the counter in the control block (device memory for a device state;
  // control(exec).step reads it back from anywhere).
  tensor_view<const std::int64_t> step_view() const noexcept {
    static_assert(offsetof(adam_control, step) == 0);
    return {reinterpret_cast<const std::int64_t*>(arena_.data()), shape{1}, where()};
  }

  // Replaces every tensor's moments and the step count, e.g. with another optimizer's state: `tensors`
  // (host-accessible views, one per tensor, laid out as tensor_state() shows them) must match the
  // state's layout exactly, quantized tensors with quantized sources. Everything is checked first
  // (sizes, finite absmax >= 0, finite moments, v >= 0); on any mismatch nothing changes. The control
  // block starts afresh with `step` applied steps (no skipped steps, the initial loss scale).
  template <executor E>
  void assign(const E& exec, std::span<const adam_tensor_state<plain_moment_type>> tensors, std::int64_t step) {
    const std::string op = "adam_state::assign";
    require(tensors.size() == layout_.size(), op + ": got " + std::to_string(tensors.size()) + " tensors, the state has " +
                                                  std::to_string(layout_.size()));
    validate_step_count(step, op + ": ");
    for (std::size_t i = 0; i < tensors.size(); ++i) validate_source(op + ": tensor " + std::to_string(i), layout_[i], tensors[i]);
    std::vector<std::byte> image(arena_.bytes(), std::byte{0});
    adam_control control{};
    control.step = step;
    control.loss_scale = options_.loss_scaling.enabled ? options_.loss_scaling.initial_scale : 1.0f;
    std::memcpy(image.data(), &control, sizeof control);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const detail::adam_tensor_layout& t = layout_[i];
      const adam_tensor_state<plain_moment_type>& s = tensors[i];
      auto put = [&](std::size_t offset, const auto& view) { std::memcpy(image.data() + offset, view.data(), view.bytes()); };
      if (!t.quantized) {
        put(t.m_offset, s.m);
        put(t.v_offset, s.v);
      } else {
        put(t.m_offset, s.m_codes);
        put(t.v_offset, s.v_codes);
        put(t.m_scale_offset, s.m_absmax);
        put(t.v_scale_offset, s.v_absmax);
      }
    }
    copy_in(exec, image.data(), image.size());
  }
  template <executor E>
  void assign(const E& exec, const std::vector<adam_tensor_state<plain_moment_type>>& tensors, std::int64_t step) {
    assign(exec, std::span<const adam_tensor_state<plain_moment_type>>(tensors), step);
  }

  // ---- Save / load: a self-describing binary image of the whole state. ----
  static constexpr std::uint32_t format_version = 1;
  static std::string format_name() { return std::string("memkit.adam_state.") + traits::name; }

  template <executor E>
  void save(const E& exec, std::ostream& out) const {
    std::vector<std::byte> arena(arena_.bytes());
    copy_out(exec, arena.data(), 0, arena.size());
    // The gradient-norm scratch is no state: after a step it holds the host's chunk sums or the device's
    // per-group step terms, and the next step overwrites it. Saved as zeros, so a state saves the same bytes
    // whichever executor stepped it.
    const auto [scratch_begin, scratch_end] = scratch_range();
    std::fill(arena.begin() + static_cast<std::ptrdiff_t>(scratch_begin),
              arena.begin() + static_cast<std::ptrdiff_t>(scratch_end), std::byte{0});
    const std::vector<std::byte> bytes = image_of(arena);
    header h = make_header();
    write_string(out, magic);
    write_pod(out, format_version);
    write_string(out, h.name);
    write_pod(out, h.bits);
    write_pod(out, h.block);
    write_pod(out, h.map_fingerprint);
    write_pod(out, h.min_quantized_size);
    write_pod(out, static_cast<std::uint64_t>(layout_.size()));
    for (const auto& t : layout_) write_pod(out, t.size);
    write_pod(out, static_cast<std::uint64_t>(bytes.size()));
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    write_pod(out, checksum(bytes.data(), bytes.size()));
    require(static_cast<bool>(out), "adam_state::save: writing the stream failed");
  }

  // Restores a state saved by save(). Everything is checked (format, version, bit width, block size,
  // maps, threshold, tensor sizes, length, checksum, then every field of the control block and every
  // moment and block scale, as assign() checks them) before a byte of this state changes; any mismatch
  // throws memkit::error naming what differs and leaves the state untouched. The checksum only detects
  // accidents: a forged image can carry a valid one, so the values themselves are validated too.
  template <executor E>
  void load(const E& exec, std::istream& in) {
    const char* op = "adam_state::load";
    const std::string not_an_image = std::string(op) + ": not a memkit adam_state image";
    std::uint32_t magic_length = 0;
    in.read(reinterpret_cast<char*>(&magic_length), sizeof magic_length);
    require(in.gcount() == sizeof magic_length && magic_length == std::strlen(magic), not_an_image);
    std::string file_magic(magic_length, '\0');
    in.read(file_magic.data(), magic_length);
    require(file_magic == magic, not_an_image);
    const auto version = read_pod<std::uint32_t>(in, op);
    require(version == format_version, std::string(op) + ": image has format version " + std::to_string(version) +
                                           ", this build reads version " + std::to_string(format_version));
    const header mine = make_header();
    const std::string name = read_string(in, op);
    require(name == mine.name, std::string(op) + ": image holds '" + name + "' state, this is '" + mine.name + "'");
    const auto bits = read_pod<std::uint32_t>(in, op);
    require(bits == mine.bits, std::string(op) + ": image has " + std::to_string(bits) + "-bit moments, this state " +
                                   std::to_string(mine.bits) + "-bit");
    const auto block = read_pod<std::uint32_t>(in, op);
    require(block == mine.block, std::string(op) + ": image was saved with block size " + std::to_string(block) +
                                     ", this state uses " + std::to_string(mine.block));
    const auto fingerprint = read_pod<std::uint64_t>(in, op);
    require(fingerprint == mine.map_fingerprint,
            std::string(op) + ": the image's quantization maps differ from this build's (fingerprint " +
                std::to_string(fingerprint) + " vs " + std::to_string(mine.map_fingerprint) + ")");
    const auto threshold = read_pod<std::int64_t>(in, op);
    require(threshold == mine.min_quantized_size,
            std::string(op) + ": image was saved with min_quantized_size " + std::to_string(threshold) +
                ", this state uses " + std::to_string(mine.min_quantized_size));
    const auto count = read_pod<std::uint64_t>(in, op);
    require(count == layout_.size(), std::string(op) + ": image has " + std::to_string(count) + " tensors, this state " +
                                         std::to_string(layout_.size()));
    for (std::size_t i = 0; i < layout_.size(); ++i) {
      const auto n = read_pod<std::int64_t>(in, op);
      require(n == layout_[i].size, std::string(op) + ": tensor " + std::to_string(i) + " has " + std::to_string(n) +
                                        " elements in the image, " + std::to_string(layout_[i].size) + " here");
    }
    const auto length = read_pod<std::uint64_t>(in, op);
    const std::size_t expected = image_bytes();
    require(length == expected, std::string(op) + ": image holds " + std::to_string(length) +
                                    " bytes of state, this state has " + std::to_string(expected));
    std::vector<std::byte> bytes(expected);
    in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    require(static_cast<std::size_t>(in.gcount()) == bytes.size(), std::string(op) + ": image is truncated");
    const auto sum = read_pod<std::uint64_t>(in, op);
    require(sum == checksum(bytes.data(), bytes.size()), std::string(op) + ": image checksum does not match (corrupt)");
    const std::vector<std::byte> arena = arena_of(bytes);
    validate_image(op, arena.data());
    copy_in(exec, arena.data(), arena.size());
  }

#if MEMKIT_HAS_CUDA
  // Managed (paged) state: moves the pages to the executor's device ahead of the step; step() does
  // this itself for managed state. Asynchronous on the stream.
  void prefetch(const cuda_executor& exec) const {
    if (where() != memory_kind::managed || arena_.bytes() == 0) return;
    detail::with_device(exec.device, [&] {
      prefetch_to(exec, exec.device);
      return 0;
    });
  }
  // Managed state: moves the pages back to host memory and prefers them there, releasing the device
  // memory until the next prefetch (e.g. while activations of the forward pass need the room).
  void release(const cuda_executor& exec) const {
    if (where() != memory_kind::managed || arena_.bytes() == 0) return;
    detail::with_device(exec.device, [&] {  // exec.stream belongs to exec.device
      prefetch_to(exec, cudaCpuDeviceId);
      return 0;
    });
  }
#endif

#if MEMKIT_HAS_CUDA
  // CPU offload (ZeRO-Offload style): the state and the fp32 master weights live in host memory (pinned
  // for the copies to overlap), the parameters and gradients on the device. Per tensor, in order, the
  // gradient is copied to its pinned staging buffer while the host already works on the tensors that
  // have arrived (norm pass); after the decision, the host updates tensor i (master, state, rounded
  // parameter in the staging buffer) while the copy of tensor i-1's parameter to the device runs.
  // The host waits on events of its own copies, never on the device as a whole; the copies back are
  // left enqueued on the stream. The same element functions as every other path: the results are
  // bit-identical to host_step on the master weights.
  template <float_storage P, float_storage G>
  void offload_step(const cuda_executor& exec, std::span<const adam_offload_param<P, G>> params,
                    std::span<const adam_group> groups, float gradient_scale = 1.0f) {
    validate_offload(exec, params, groups, gradient_scale);
    detail::with_device(exec.device, [&] {
      std::vector<cudaEvent_t> arrived(params.size());
      struct event_guard {
        std::vector<cudaEvent_t>& events;
        ~event_guard() {
          for (cudaEvent_t e : events)
            if (e != nullptr) (void)cudaEventDestroy(e);
        }
      } guard{arrived};
      for (std::size_t i = 0; i < params.size(); ++i) {
        MEMKIT_CUDA_CHECK(cudaEventCreateWithFlags(&arrived[i], cudaEventDisableTiming));
        MEMKIT_CUDA_CHECK(cudaMemcpyAsync(params[i].grad_staging.data(), params[i].grad.data(), params[i].grad.bytes(),
                                          cudaMemcpyDeviceToHost, exec.stream));
        MEMKIT_CUDA_CHECK(cudaEventRecord(arrived[i], exec.stream));
      }
      for (std::size_t i = 0; i < params.size(); ++i) {
        MEMKIT_CUDA_CHECK(cudaEventSynchronize(arrived[i]));
        host_norm(i, static_cast<const G*>(params[i].grad_staging.data()));
      }
      if (!host_finalize(gradient_scale)) return 0;  // skipped: nothing changes, nothing is copied back
      for (std::size_t i = 0; i < params.size(); ++i) {
        const adam_offload_param<P, G>& p = params[i];
        const adam_group& group = groups[static_cast<std::size_t>(p.group)];
        const G* grad = p.grad_staging.data();
        if constexpr (std::is_same_v<P, float>) {
          host_update(i, host_access<float, G>(i, p.master.data(), grad, nullptr), group);
          MEMKIT_CUDA_CHECK(cudaMemcpyAsync(p.param.data(), p.master.data(), p.master.bytes(), cudaMemcpyHostToDevice,
                                            exec.stream));
        } else {
          host_update(i, host_access<P, G>(i, p.param_staging.data(), grad, p.master.data()), group);
          MEMKIT_CUDA_CHECK(cudaMemcpyAsync(p.param.data(), p.param_staging.data(), p.param_staging.bytes(),
                                            cudaMemcpyHostToDevice, exec.stream));
        }
      }
      return 0;
    });
  }
  template <float_storage P, float_storage G>
  void offload_step(const cuda_executor& exec, const std::vector<adam_offload_param<P, G>>& params,
                    const std::vector<adam_group>& groups, float gradient_scale = 1.0f) {
    offload_step(exec, std::span<const adam_offload_param<P, G>>(params), std::span<const adam_group>(groups),
                 gradient_scale);
  }
#endif

  // A view of the whole state allocation (tests use it to check that steps leave it untouched).
  tensor_view<const std::byte> arena_view() const noexcept { return arena_.view(); }
  // The bytes [first, second) of the arena that are the gradient-norm scratch: no state, only each step's
  // leftovers (the host's chunk sums, or a device's per-group step terms). save() writes them as zeros.
  std::pair<std::size_t, std::size_t> scratch_range() const noexcept {
    return {detail::align_segment(sizeof(adam_control)), overhead_bytes(total_chunks_)};
  }

 private:
  static constexpr const char* magic = "memkit-adam-state";

  struct header {
    std::string name;
    std::uint32_t bits, block;
    std::uint64_t map_fingerprint;
    std::int64_t min_quantized_size;
  };
  header make_header() const {
    return {format_name(), static_cast<std::uint32_t>(traits::bits), static_cast<std::uint32_t>(Block),
            traits::map_fingerprint(), options_.min_quantized_size};
  }
  static void write_string(std::ostream& out, const std::string& text) {
    write_pod(out, static_cast<std::uint32_t>(text.size()));
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
  }
  template <class T>
  static void write_pod(std::ostream& out, const T& value) {
    out.write(reinterpret_cast<const char*>(&value), sizeof value);
  }
  static std::string read_string(std::istream& in, const char* op) {
    const auto length = read_pod<std::uint32_t>(in, op);
    require(length < 4096, std::string(op) + ": image header is corrupt (string of " + std::to_string(length) + " bytes)");
    std::string text(length, '\0');
    in.read(text.data(), length);
    require(static_cast<std::uint32_t>(in.gcount()) == length, std::string(op) + ": image is truncated");
    return text;
  }
  template <class T>
  static T read_pod(std::istream& in, const char* op) {
    T value{};
    in.read(reinterpret_cast<char*>(&value), sizeof value);
    require(static_cast<std::size_t>(in.gcount()) == sizeof value, std::string(op) + ": image is truncated");
    return value;
  }
  static std::uint64_t checksum(const std::byte* data, std::size_t size) noexcept {
    std::uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a, 8 bytes at a time through mix64
    std::size_t i = 0;
    for (; i + 8 <= size; i += 8) {
      std::uint64_t word;
      std::memcpy(&word, data + i, 8);
      hash = detail::mix64(hash ^ word);
    }
    for (; i < size; ++i) hash = (hash ^ static_cast<std::uint64_t>(data[i])) * 0x100000001b3ull;
    return hash;
  }

  // A saved image holds the arena without the padding between m and v (detail::stagger_after): the layout of
  // format version 1, written before that padding existed, so those images still load. Per tensor, the image
  // has m's segment, then v's segment and the scales, contiguous.
  std::size_t image_bytes() const noexcept {
    std::size_t bytes = arena_.bytes();
    for (const detail::adam_tensor_layout& t : layout_) bytes -= stagger_of(t);
    return bytes;
  }
  std::size_t stagger_of(const detail::adam_tensor_layout& t) const noexcept {
    const detail::adam_segment_plan plan = segment_plan(t.size, t.quantized);
    return plan.v - plan.m_bytes;
  }
  // Copies the arena's bytes to the image's (to_image) or back, skipping each tensor's padding.
  void relayout(const std::byte* from, std::byte* to, bool to_image) const {
    const std::size_t overhead = overhead_bytes(total_chunks_);
    std::memcpy(to, from, overhead);
    std::size_t packed = overhead;
    for (std::size_t i = 0; i < layout_.size(); ++i) {
      const detail::adam_tensor_layout& t = layout_[i];
      const std::size_t end = i + 1 < layout_.size() ? layout_[i + 1].m_offset : arena_.bytes();
      const std::size_t pad = stagger_of(t), m_bytes = t.v_offset - t.m_offset - pad, rest = end - t.v_offset;
      const std::size_t m_arena = t.m_offset, v_arena = t.v_offset, m_image = packed, v_image = packed + m_bytes;
      std::memcpy(to + (to_image ? m_image : m_arena), from + (to_image ? m_arena : m_image), m_bytes);
      std::memcpy(to + (to_image ? v_image : v_arena), from + (to_image ? v_arena : v_image), rest);
      packed += m_bytes + rest;
    }
  }
  std::vector<std::byte> image_of(const std::vector<std::byte>& arena) const {
    std::vector<std::byte> image(image_bytes());
    relayout(arena.data(), image.data(), true);
    return image;
  }
  std::vector<std::byte> arena_of(const std::vector<std::byte>& image) const {
    std::vector<std::byte> arena(arena_.bytes());  // the padding stays zero, as reset() leaves it
    relayout(image.data(), arena.data(), false);
    return arena;
  }

  template <executor E>
  void copy_out([[maybe_unused]] const E& exec, void* destination, std::size_t offset, std::size_t bytes) const {
    if constexpr (!E::on_device) {
      require(host_executor::can_access(where()),
              "adam_state: the state is in device memory; read it with a cuda_executor");
      std::memcpy(destination, arena_.data() + offset, bytes);
    } else {
#if MEMKIT_HAS_CUDA
      MEMKIT_CUDA_CHECK(cudaMemcpyAsync(destination, arena_.data() + offset, bytes, cudaMemcpyDefault, exec.stream));
      exec.synchronize();
#endif
    }
  }
  template <executor E>
  void copy_in([[maybe_unused]] const E& exec, const void* source, std::size_t bytes) {
    if constexpr (!E::on_device) {
      require(host_executor::can_access(where()),
              "adam_state: the state is in device memory; write it with a cuda_executor");
      std::memcpy(arena_.data(), source, bytes);
    } else {
#if MEMKIT_HAS_CUDA
      MEMKIT_CUDA_CHECK(cudaMemcpyAsync(arena_.data(), source, bytes, cudaMemcpyDefault, exec.stream));
      exec.synchronize();  // `source` is the caller's temporary
#endif
    }
  }

  // ---- per-element access shared by inspection and the host step ----
  float load_moment(const std::byte* base, const detail::adam_tensor_layout& t, std::int64_t i, bool first) const {
    const std::size_t offset = first ? t.m_offset : t.v_offset;
    if (!t.quantized) {
      if constexpr (quantized) return reinterpret_cast<const float*>(base + offset)[i];
      else return to_float(reinterpret_cast<const moment_type*>(base + offset)[i]);
    } else {
      if constexpr (quantized) {
        const float scale = reinterpret_cast<const float*>(base + (first ? t.m_scale_offset : t.v_scale_offset))[i / divisor_block];
        const auto* codes = reinterpret_cast<const std::uint8_t*>(base + offset);
        const unsigned code = detail::load_code<traits::bits>(codes, i);
        const auto& tables = traits::tables();
        return detail::mul_rn(first ? tables.m[code] : tables.v[code], scale);
      }
      return 0.0f;
    }
  }
  void store_plain(std::byte* base, const detail::adam_tensor_layout& t, std::int64_t i, float m, float v) {
    if constexpr (quantized) {
      reinterpret_cast<float*>(base + t.m_offset)[i] = m;
      reinterpret_cast<float*>(base + t.v_offset)[i] = v;
    } else {
      reinterpret_cast<moment_type*>(base + t.m_offset)[i] = from_float<moment_type>(m);
      reinterpret_cast<moment_type*>(base + t.v_offset)[i] = from_float<moment_type>(v);
    }
  }
  // Requantizes one block from fp32 moments: new absmax per moment, then the nearest codes.
  void quantize_block(std::byte* base, const detail::adam_tensor_layout& t, std::int64_t b, const float* m,
                      const float* v, std::int64_t count) {
    quantize_block(base, t, b, m, v, count, block_absmax(m, count), block_absmax(v, count));
  }
  // The block's absmax: the largest magnitude, taken as an integer maximum over bit patterns (exact,
  // so it matches the device's max_abs reduction bit for bit).
  static float block_absmax(const float* values, std::int64_t count) noexcept {
    return detail::bit_cast<float>(detail::max_magnitude_bits(values, count));
  }
  void quantize_block(std::byte* base, const detail::adam_tensor_layout& t, std::int64_t b, const float* m,
                      const float* v, std::int64_t count, float m_max, float v_max) {
    reinterpret_cast<float*>(base + t.m_scale_offset)[b] = m_max;
    reinterpret_cast<float*>(base + t.v_scale_offset)[b] = v_max;
    const float m_inverse = detail::inverse_scale(m_max), v_inverse = detail::inverse_scale(v_max);
    auto* m_codes = reinterpret_cast<std::uint8_t*>(base + t.m_offset);
    auto* v_codes = reinterpret_cast<std::uint8_t*>(base + t.v_offset);
    const std::int64_t begin = b * Block;
    if constexpr (traits::bits == 8) {
      const auto coder = traits::make_host_coder();
      detail::dynamic_codes_indexed(*coder.m_index, m, m_inverse, count, m_codes + begin);
      detail::dynamic_codes_indexed(*coder.v_index, v, v_inverse, count, v_codes + begin);
    } else {
      // Blocks are even-sized and start at even indices, so a byte never straddles two blocks.
      detail::table16_codes(traits::tables().m.data(), m, m_inverse, count, m_codes + begin / 2);
      detail::table16_codes(traits::tables().v.data(), v, v_inverse, count, v_codes + begin / 2);
    }
  }

  // ---- validation: every check happens before anything is written ----
  // One source tensor of assign() against its layout.
  void validate_source(const std::string& which, const detail::adam_tensor_layout& t,
                       const adam_tensor_state<plain_moment_type>& s) const {
    auto expect = [&](const auto& view, std::int64_t count, const char* name) {
      require(view.data() != nullptr || count == 0, which + ": `" + name + "` is null");
      require(view.where() != memory_kind::device, which + ": `" + name + "` is in device memory; give host views");
      require(view.size() == count, which + ": `" + name + "` has " + std::to_string(view.size()) + " elements, expected " +
                                        std::to_string(count));
    };
    if (!t.quantized) {
      require(!s.quantized, which + ": the source is quantized, but this state keeps plain moments for a tensor of " +
                                std::to_string(t.size) + " elements (min_quantized_size " +
                                std::to_string(options_.min_quantized_size) + ")");
      expect(s.m, t.size, "m");
      expect(s.v, t.size, "v");
      validate_moments(adam_moment_kind::first, t.size, [&](std::int64_t i) { return to_float(s.m[i]); },
                       [&](std::int64_t i) { return which + ": m[" + std::to_string(i) + "]"; });
      validate_moments(adam_moment_kind::second, t.size, [&](std::int64_t i) { return to_float(s.v[i]); },
                       [&](std::int64_t i) { return which + ": v[" + std::to_string(i) + "]"; });
      return;
    }
    require(s.quantized, which + ": the source has plain moments, but this state quantizes a tensor of " +
                             std::to_string(t.size) + " elements (min_quantized_size " +
                             std::to_string(options_.min_quantized_size) + ")");
    const std::int64_t codes = traits::bits == 8 ? t.size : (t.size + 1) / 2;
    expect(s.m_codes, codes, "m_codes");
    expect(s.v_codes, codes, "v_codes");
    expect(s.m_absmax, t.units, "m_absmax");
    expect(s.v_absmax, t.units, "v_absmax");
    for (const auto* absmax : {&s.m_absmax, &s.v_absmax})
      validate_moments(adam_moment_kind::block_scale, t.units, [&](std::int64_t b) { return (*absmax)[b]; },
                       [&](std::int64_t b) {
                         return which + ": " + (absmax == &s.m_absmax ? "m" : "v") + "_absmax[" + std::to_string(b) + "]";
                       });
  }

  // The values of a loaded image (host bytes laid out as this state's arena): the control block field by
  // field, then each tensor's moments and scales.
  void validate_image(const char* op, const std::byte* image) const {
    adam_control c{};
    std::memcpy(&c, image, sizeof c);
    validate_control(c, std::string(op) + ": the image's control block has ", total_chunks_, options_.loss_scaling);
    for (std::size_t i = 0; i < layout_.size(); ++i)
      validate_source(std::string(op) + ": the image's tensor " + std::to_string(i), layout_[i],
                      tensor_state_at(image, layout_[i], memory_kind::host));
  }

  // The checks step and offload_step share: tensor count, groups and gradient scale.
  void validate_arguments(const char* op, std::size_t param_count, std::span<const adam_group> groups,
                          float gradient_scale) const {
    require(param_count == layout_.size(), std::string(op) + ": got " + std::to_string(param_count) +
                                               " parameter tensors, the state was made for " +
                                               std::to_string(layout_.size()));
    require(!groups.empty(), std::string(op) + ": no parameter groups given");
    require(gradient_scale > 0.0f && detail::is_finite(gradient_scale),
            std::string(op) + ": gradient_scale must be finite and > 0, got " + format_float(gradient_scale));
    for (std::size_t g = 0; g < groups.size(); ++g) validate(groups[g], std::string(op) + ": group " + std::to_string(g));
  }
  static void require_known_group(const char* op, const std::string& which, int group, std::size_t group_count) {
    require(group >= 0 && static_cast<std::size_t>(group) < group_count,
            std::string(op) + ": " + which + " names group " + std::to_string(group) + " but only " +
                std::to_string(group_count) + " groups were given");
  }
  template <executor E, float_storage P, float_storage G>
  void validate_step(const E& exec, std::span<const adam_param<P, G>> params, std::span<const adam_group> groups,
                     float gradient_scale) const {
    const char* op = "adam_state::step";
    validate_arguments(op, params.size(), groups, gradient_scale);
    require_accessible(exec, arena_view(), op, "optimizer state");
    for (std::size_t i = 0; i < params.size(); ++i) {
      const adam_param<P, G>& p = params[i];
      const std::string which = "tensor " + std::to_string(i);
      require(p.param.size() == layout_[i].size,
              std::string(op) + ": " + which + " has " + std::to_string(p.param.size()) + " elements (shape " +
                  to_string(p.param.shape()) + "), the state was made for " + std::to_string(layout_[i].size));
      require_same_shape(p.param, p.grad, op, (which + " param").c_str(), (which + " grad").c_str());
      require(p.param.data() != nullptr && p.grad.data() != nullptr, std::string(op) + ": " + which + " has a null pointer");
      if (p.master.data() != nullptr) {  // a default view (no master) has a null pointer
        require(!std::is_same_v<P, float>, std::string(op) + ": " + which +
                                               " has fp32 parameters, which are their own master copy; pass no master");
        require_same_shape(p.param, tensor_view<const float>(p.master), op, (which + " param").c_str(),
                           (which + " master").c_str());
      }
      require_known_group(op, which, p.group, groups.size());
      require_accessible(exec, p.param, op, (which + " param").c_str());
      require_accessible(exec, p.grad, op, (which + " grad").c_str());
      if (p.master.data() != nullptr) require_accessible(exec, p.master, op, (which + " master").c_str());
    }
  }

#if MEMKIT_HAS_CUDA
  template <float_storage P, float_storage G>
  void validate_offload(const cuda_executor& exec, std::span<const adam_offload_param<P, G>> params,
                        std::span<const adam_group> groups, float gradient_scale) const {
    const char* op = "adam_state::offload_step";
    require(host_executor::can_access(where()),
            std::string(op) + ": the state is in " + to_string(where()) + " memory; CPU offload keeps it in host memory");
    validate_arguments(op, params.size(), groups, gradient_scale);
    for (std::size_t i = 0; i < params.size(); ++i) {
      const adam_offload_param<P, G>& p = params[i];
      const std::string which = "tensor " + std::to_string(i);
      require(p.param.size() == layout_[i].size, std::string(op) + ": " + which + " has " +
                                                     std::to_string(p.param.size()) + " elements, the state was made for " +
                                                     std::to_string(layout_[i].size));
      require_same_shape(p.param, p.grad, op, (which + " param").c_str(), (which + " grad").c_str());
      require_same_shape(p.param, tensor_view<const float>(p.master), op, (which + " param").c_str(),
                         (which + " master").c_str());
      require_same_shape(p.param, tensor_view<const G>(p.grad_staging), op, (which + " param").c_str(),
                         (which + " grad_staging").c_str());
      if constexpr (!std::is_same_v<P, float>)
        require_same_shape(p.param, tensor_view<const P>(p.param_staging), op, (which + " param").c_str(),
                           (which + " param_staging").c_str());
      require_known_group(op, which, p.group, groups.size());
      require_accessible(exec, p.param, op, (which + " param").c_str());
      require_accessible(exec, p.grad, op, (which + " grad").c_str());
      auto pinned = [&](memory_kind kind, const char* name) {
        require(kind == memory_kind::pinned_host, std::string(op) + ": `" + which + " " + name + "` is in " +
                                                      to_string(kind) +
                                                      " memory; offload buffers must be pinned_host so copies overlap");
      };
      pinned(p.master.where(), "master");
      pinned(p.grad_staging.where(), "grad_staging");
      if constexpr (!std::is_same_v<P, float>) pinned(p.param_staging.where(), "param_staging");
    }
  }
#endif

  // ---- host step ----
  template <float_storage P, float_storage G>
  void host_step(std::span<const adam_param<P, G>> params, std::span<const adam_group> groups, float gradient_scale) {
    for (std::size_t i = 0; i < params.size(); ++i) host_norm(i, params[i].grad.data());
    if (!host_finalize(gradient_scale)) return;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const adam_param<P, G>& p = params[i];
      host_update(i, host_access(i, p.param.data(), p.grad.data(), p.master.data()),
                  groups[static_cast<std::size_t>(p.group)]);
    }
  }

  adam_control& host_control() noexcept { return *reinterpret_cast<adam_control*>(arena_.data()); }
  double* host_chunk_sums() noexcept {
    return reinterpret_cast<double*>(arena_.data() + detail::align_segment(sizeof(adam_control)));
  }

  // The norm pass over one tensor's gradient, in the canonical chunk/lane/tree order.
  template <float_storage G>
  void host_norm(std::size_t tensor, const G* grad) {
    const detail::adam_tensor_layout& t = layout_[tensor];
    detail::run_in_parts(host_parts(t.size), t.chunks, [&](std::int64_t first, std::int64_t last) {
      host_norm_chunks(t, grad, first, last);
    });
  }
  // The number of threads for a tensor of `size` elements: enough work per thread to repay starting it.
  int host_parts(std::int64_t size) const noexcept {
    constexpr std::int64_t min_elements_per_thread = 1 << 17;
    const std::int64_t wanted = resolve_host_threads(options_.host_threads);
    return static_cast<int>(std::max<std::int64_t>(1, std::min(wanted, size / min_elements_per_thread)));
  }
  // detail::lane_sum_of_squares for every lane at once, row by row, for S chunks of `count` elements: each lane
  // adds the same terms in the same order (so the same bits), and the loop over lanes vectorizes. The square of
  // a float held in a double is exact (24-bit mantissas), so g * g needs no rounding barrier (dmul_rn's would
  // stop the vectorization): fused or not, the sum rounds the same exact value.
  template <int S, float_storage G>
  static void lane_sums(const G* const (&chunks)[S], std::int64_t count, double (&lanes)[S][detail::reduction_lanes]) noexcept {
    for (auto& chunk_lanes : lanes)
      for (double& lane : chunk_lanes) lane = 0.0;
    std::int64_t row = 0;
    for (; row + detail::reduction_lanes <= count; row += detail::reduction_lanes)
      for (int s = 0; s < S; ++s)
        for (int lane = 0; lane < detail::reduction_lanes; ++lane) {
          const double g = static_cast<double>(to_float(chunks[s][row + lane]));
          lanes[s][lane] = detail::dadd_rn(lanes[s][lane], g * g);
        }
    for (std::int64_t lane = 0; row + lane < count; ++lane)
      for (int s = 0; s < S; ++s) {
        const double g = static_cast<double>(to_float(chunks[s][row + lane]));
        lanes[s][lane] = detail::dadd_rn(lanes[s][lane], g * g);
      }
  }
  // Chunks [first, last) of a tensor's gradient. Whole chunks go two at a time, one from each half of the
  // range: one thread reading two streams gets closer to the memory bandwidth (Cascade Lake, 1 thread, 16M-64M
  // gradients: 0.70-0.74 against 0.87-0.91 ns/param CPU time one chunk at a time; four streams gained nothing
  // more). Every chunk keeps its own lanes and tree, so its sum has the same bits either way.
  template <float_storage G>
  void host_norm_chunks(const detail::adam_tensor_layout& t, const G* grad, std::int64_t first, std::int64_t last) {
    double* sums = host_chunk_sums() + t.first_chunk;
    const std::int64_t whole_end = std::min(last, t.size / detail::reduction_chunk);  // chunks before it are full
    const std::int64_t pairs = std::max<std::int64_t>(0, whole_end - first) / 2;
    double lanes[2][detail::reduction_lanes];
    for (std::int64_t k = 0; k < pairs; ++k) {
      const std::int64_t a = first + k, b = first + pairs + k;
      const G* const chunks[2] = {grad + a * detail::reduction_chunk, grad + b * detail::reduction_chunk};
      lane_sums<2>(chunks, detail::reduction_chunk, lanes);
      sums[a] = detail::tree_sum(lanes[0]);
      sums[b] = detail::tree_sum(lanes[1]);
    }
    double one[1][detail::reduction_lanes];
    for (std::int64_t c = first + 2 * pairs; c < last; ++c) {
      const std::int64_t begin = c * detail::reduction_chunk;
      const G* const chunk[1] = {grad + begin};
      lane_sums<1>(chunk, std::min(detail::reduction_chunk, t.size - begin), one);
      sums[c] = detail::tree_sum(one[0]);
    }
  }
  bool host_finalize(float gradient_scale) {
    detail::finalize_step(host_control(), host_chunk_sums(), total_chunks_, options_.max_grad_norm,
                          options_.loss_scaling, gradient_scale);
    return host_control().applied != 0;
  }
  template <float_storage P, float_storage G>
  detail::param_access<P, G> host_access(std::size_t tensor, P* param, const G* grad, float* master) {
    return {param, grad, master, options_.stochastic_rounding, options_.seed, host_control().step,
            static_cast<std::int64_t>(tensor)};
  }

  // The fused update of one tensor (after host_finalize applied the step), tile by tile: the tile's
  // parameters, gradients and moments are gathered as fp32 into L1-resident buffers (unless they are
  // fp32 arrays already), updated by detail::adamw_update_array, and written back; a quantized block
  // is one tile, so its new moments are requantized while still in L1.
  // The work is split across host_parts threads in whole units (quantization blocks, or plain units of
  // detail::plain_unit elements); each element is computed by the same code whatever the split.
  template <float_storage P, float_storage G>
  void host_update(std::size_t tensor, const detail::param_access<P, G>& access, const adam_group& group) {
    const detail::adam_tensor_layout& t = layout_[tensor];
    const adam_coefficients c = make_coefficients(group, host_control());
    detail::run_in_parts(host_parts(t.size), t.units, [&](std::int64_t first, std::int64_t last) {
      host_update_units(t, access, c, first, last);
    });
  }
  template <float_storage P, float_storage G>
  void host_update_units(const detail::adam_tensor_layout& t, const detail::param_access<P, G>& access,
                         const adam_coefficients& c, std::int64_t first_unit, std::int64_t last_unit) {
    std::byte* base = arena_.data();
    if (!t.quantized) {
      const std::int64_t begin = first_unit * detail::plain_unit;
      const std::int64_t end = std::min(t.size, last_unit * detail::plain_unit);
      if constexpr (quantized) {
        host_update_plain(access, reinterpret_cast<float*>(base + t.m_offset), reinterpret_cast<float*>(base + t.v_offset),
                          begin, end, c);
      } else {
        host_update_plain(access, reinterpret_cast<moment_type*>(base + t.m_offset),
                          reinterpret_cast<moment_type*>(base + t.v_offset), begin, end, c);
      }
      return;
    }
    if constexpr (quantized) {
      const auto& tables = traits::tables();
      const auto* m_codes = reinterpret_cast<const std::uint8_t*>(base + t.m_offset);
      const auto* v_codes = reinterpret_cast<const std::uint8_t*>(base + t.v_offset);
      const auto* m_scale = reinterpret_cast<const float*>(base + t.m_scale_offset);
      const auto* v_scale = reinterpret_cast<const float*>(base + t.v_scale_offset);
      host_tile tile;
      for (std::int64_t b = first_unit; b < last_unit; ++b) {
        const std::int64_t begin = b * Block, count = std::min<std::int64_t>(Block, t.size - begin);
        detail::lookup_codes<traits::bits>(tables.m.data(), m_codes, begin, count, tile.m);
        detail::lookup_codes<traits::bits>(tables.v.data(), v_codes, begin, count, tile.v);
        const detail::moment_maxima maxima = update_block(access, tile, begin, count, c, m_scale[b], v_scale[b]);
        quantize_block(base, t, b, tile.m, tile.v, count, detail::bit_cast<float>(maxima.m), detail::bit_cast<float>(maxima.v));
      }
    }
  }

  static constexpr std::int64_t host_tile_size = Block > 0 ? Block : 256;
  struct host_tile {
    float p[host_tile_size], g[host_tile_size], m[host_tile_size], v[host_tile_size];
  };

  // Runs update(params, grads) on elements [begin, begin + count) as fp32 arrays: the parameters and gradients
  // themselves when they are fp32 and the parameters are their own master, else tile.p / tile.g, gathered from
  // and written back through `access`. Returns update's result.
  template <float_storage P, float_storage G, class Update>
  static detail::moment_maxima on_fp32_params(const detail::param_access<P, G>& access, host_tile& tile, std::int64_t begin,
                                              std::int64_t count, Update update) {
    if constexpr (std::is_same_v<P, float> && std::is_same_v<G, float>) {
      if (access.master == nullptr) return update(access.param + begin, access.grad + begin);
    }
    for (std::int64_t e = 0; e < count; ++e) tile.p[e] = access.load(begin + e);
    for (std::int64_t e = 0; e < count; ++e) tile.g[e] = to_float(access.grad[begin + e]);
    const detail::moment_maxima result = update(tile.p, static_cast<const float*>(tile.g));
    for (std::int64_t e = 0; e < count; ++e) access.store(begin + e, tile.p[e]);
    return result;
  }

  // Updates elements [begin, begin + count) given their fp32 moments (updated in place).
  template <float_storage P, float_storage G>
  static void update_params(const detail::param_access<P, G>& access, host_tile& tile, float* m, float* v,
                            std::int64_t begin, std::int64_t count, const adam_coefficients& c) {
    on_fp32_params(access, tile, begin, count, [&](float* params, const float* grads) {
      detail::adamw_update_array(params, m, v, grads, count, c);
      return detail::moment_maxima{};
    });
  }

  // The same for one quantized block whose tile.m and tile.v hold the codes' table entries (detail::lookup_codes):
  // scales them by the block's absmax, updates, and returns the new moments' maxima (detail::adamw_update_block).
  template <float_storage P, float_storage G>
  static detail::moment_maxima update_block(const detail::param_access<P, G>& access, host_tile& tile, std::int64_t begin,
                                            std::int64_t count, const adam_coefficients& c, float m_absmax, float v_absmax) {
    return on_fp32_params(access, tile, begin, count, [&](float* params, const float* grads) {
      return detail::adamw_update_block(params, tile.m, tile.v, grads, count, c, m_absmax, v_absmax);
    });
  }

  template <float_storage P, float_storage G, float_storage M>
  static void host_update_plain(const detail::param_access<P, G>& access, M* m, M* v, std::int64_t first,
                                std::int64_t end, const adam_coefficients& c) {
    host_tile tile;
    if constexpr (std::is_same_v<M, float> && std::is_same_v<P, float> && std::is_same_v<G, float>) {
      if (access.master == nullptr) {
        detail::adamw_update_array(access.param + first, m + first, v + first, access.grad + first, end - first, c);
        return;
      }
    }
    for (std::int64_t begin = first; begin < end; begin += host_tile_size) {
      const std::int64_t count = std::min(host_tile_size, end - begin);
      if constexpr (std::is_same_v<M, float>) {
        update_params(access, tile, m + begin, v + begin, begin, count, c);
      } else {
        for (std::int64_t e = 0; e < count; ++e) tile.m[e] = to_float(m[begin + e]);
        for (std::int64_t e = 0; e < count; ++e) tile.v[e] = to_float(v[begin + e]);
        update_params(access, tile, tile.m, tile.v, begin, count, c);
        for (std::int64_t e = 0; e < count; ++e) m[begin + e] = from_float<M>(tile.m[e]);
        for (std::int64_t e = 0; e < count; ++e) v[begin + e] = from_float<M>(tile.v[e]);
      }
    }
  }

#if MEMKIT_HAS_CUDA
  void device_reset(const cuda_executor& exec, const adam_control& control) {
    detail::with_device(exec.device, [&] {
      MEMKIT_CUDA_CHECK(cudaMemsetAsync(arena_.data(), 0, arena_.bytes(), exec.stream));
      detail::adam_set_control_kernel<adam_control><<<1, 1, 0, exec.stream>>>(reinterpret_cast<adam_control*>(arena_.data()), control);
      MEMKIT_CUDA_CHECK(cudaGetLastError());
      return 0;
    });
  }

  template <float_storage P, float_storage G>
  void device_step(const cuda_executor& exec, std::span<const adam_param<P, G>> params,
                   std::span<const adam_group> groups, float gradient_scale) {
    detail::with_device(exec.device, [&] {
      if (where() == memory_kind::managed) migrate(exec, exec.device);  // paged state: bring it in ahead of the kernels
      std::byte* base = arena_.data();
      auto* control = reinterpret_cast<adam_control*>(base);
      double* chunk_sums = reinterpret_cast<double*>(base + detail::align_segment(sizeof(adam_control)));
      constexpr int K = detail::tensors_per_launch;
      for (std::size_t first = 0; first < params.size(); first += K) {
        detail::norm_launch<G> batch{};
        std::int64_t units = 0;
        for (std::size_t j = 0; j < K && first + j < params.size(); ++j) {
          const detail::adam_tensor_layout& t = layout_[first + j];
          batch.grad[j] = params[first + j].grad.data();
          batch.sums[j] = chunk_sums + t.first_chunk;
          batch.size[j] = t.size;
          batch.chunk_begin[j] = units;
          units += t.chunks;
          batch.count = static_cast<int>(j + 1);
        }
        batch.chunk_begin[batch.count] = units;
        detail::adam_norm_kernel<G><<<static_cast<unsigned>(units), detail::reduction_lanes, 0, exec.stream>>>(batch);
        MEMKIT_CUDA_CHECK(cudaGetLastError());
      }
      detail::adam_finalize_kernel<adam_control><<<1, detail::finalize_threads, 0, exec.stream>>>(control, chunk_sums, total_chunks_, options_.max_grad_norm,
                                                               options_.loss_scaling, gradient_scale);
      MEMKIT_CUDA_CHECK(cudaGetLastError());
      // The norm scratch is free once the finalisation has read it: it takes the step's per-group terms.
      auto* terms = reinterpret_cast<adam_step_terms*>(chunk_sums);
      const std::vector<std::int32_t> slots = detail::enqueue_step_terms(
          exec.stream, control, terms, total_chunks_, groups, params.size(),
          [&](std::size_t i) { return params[i].group; });
      constexpr int threads = detail::update_threads<State, Block>();
      for (std::size_t first = 0; first < params.size(); first += K) {
        detail::update_launch<State> batch{};
        if constexpr (quantized) {
          const auto& tables = traits::tables();
          for (int i = 0; i < traits::entries; ++i) {
            batch.tables.m[i] = tables.m[static_cast<std::size_t>(i)];
            batch.tables.v[i] = tables.v[static_cast<std::size_t>(i)];
          }
        }
        batch.control = control;
        batch.terms = terms;
        batch.seed = options_.seed;
        batch.stochastic_rounding = options_.stochastic_rounding;
        std::int64_t units = 0;
        for (std::size_t j = 0; j < K && first + j < params.size(); ++j) {
          const adam_param<P, G>& p = params[first + j];
          const detail::adam_tensor_layout& t = layout_[first + j];
          detail::adam_tensor_args& a = batch.tensors[j];
          a.param = p.param.data();
          a.grad = p.grad.data();
          a.master = p.master.data();
          a.m = base + t.m_offset;
          a.v = base + t.v_offset;
          a.m_scale = t.quantized ? reinterpret_cast<float*>(base + t.m_scale_offset) : nullptr;
          a.v_scale = t.quantized ? reinterpret_cast<float*>(base + t.v_scale_offset) : nullptr;
          a.size = t.size;
          a.unit_begin = units;
          a.index = static_cast<std::int64_t>(first + j);
          a.group = groups[static_cast<std::size_t>(p.group)];
          a.quantized = t.quantized ? 1 : 0;
          a.terms_slot = slots[first + j];
          a.vector = detail::vector_aligned(a.param, a.grad, a.master, a.m, a.v) ? 1 : 0;
          units += t.units;
          batch.count = static_cast<int>(j + 1);
        }
        detail::adam_update_kernel<State, Block, threads, P, G>
            <<<detail::update_blocks<State, Block>(units), threads, 0, exec.stream>>>(batch);
        MEMKIT_CUDA_CHECK(cudaGetLastError());
      }
      return 0;
    });
  }
  // Advises the pages' preferred location (the host after release, none after prefetch), then migrates.
  void prefetch_to(const cuda_executor& exec, int destination) const {
#if CUDART_VERSION >= 13000
    cudaMemLocation location{};
    location.type = destination == cudaCpuDeviceId ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
    location.id = destination == cudaCpuDeviceId ? 0 : destination;
    MEMKIT_CUDA_CHECK(cudaMemAdvise(arena_.data(), arena_.bytes(),
                                    destination == cudaCpuDeviceId ? cudaMemAdviseSetPreferredLocation
                                                                   : cudaMemAdviseUnsetPreferredLocation,
                                    location));
#else
    MEMKIT_CUDA_CHECK(cudaMemAdvise(arena_.data(), arena_.bytes(),
                                    destination == cudaCpuDeviceId ? cudaMemAdviseSetPreferredLocation
                                                                   : cudaMemAdviseUnsetPreferredLocation,
                                    destination));
#endif
    migrate(exec, destination);
  }
  // Enqueues the migration of every page of the state on the executor's stream.
  void migrate(const cuda_executor& exec, int destination) const {
#if CUDART_VERSION >= 13000
    cudaMemLocation location{};
    location.type = destination == cudaCpuDeviceId ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
    location.id = destination == cudaCpuDeviceId ? 0 : destination;
    MEMKIT_CUDA_CHECK(cudaMemPrefetchAsync(arena_.data(), arena_.bytes(), location, 0, exec.stream));
#else
    MEMKIT_CUDA_CHECK(cudaMemPrefetchAsync(arena_.data(), arena_.bytes(), destination, exec.stream));
#endif
  }
#endif

  adam_options options_;
  std::vector<detail::adam_tensor_layout> layout_;
  std::int64_t total_chunks_ = 0;
  buffer<std::byte> arena_;
};

MEMKIT_NAMESPACE_END

