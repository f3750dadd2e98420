// memkit/optim/detail/adam_core.hpp — the state core adam_state and distributed::sharded_adam_state both hold:
// the arena (control block, gradient-norm scratch, moments), its reset and copies, the control read-back,
// and one step's three passes over any list of tensors (adam_state's tensors, a rank's pieces of them), on the
// host and, under nvcc, on a CUDA stream side by side. The classes only say which tensors, and what happens
// between the passes (sharded_adam_state all-reduces the chunk sums and all-gathers the parameters).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
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
#include "memkit/optim/detail/adam_checks.hpp"
#include "memkit/optim/detail/adam_kernels.hpp"
#include "memkit/optim/detail/adam_simd.hpp"
#include "memkit/optim/state_codecs.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace optim {
namespace detail {

// One tensor of a device step: its layout in the arena, its parameter, gradient and (optional) master pointers,
// its stochastic-rounding stream (index, and the element of the tensor at param[0]) and its group.
struct adam_step_tensor {
  const adam_tensor_layout* layout = nullptr;
  void* param = nullptr;
  const void* grad = nullptr;
  float* master = nullptr;
  std::int64_t index = 0, first = 0;
  int group = 0;
};

template <class State, int Block>
class adam_core {
  using traits = adam_state_traits<State>;
  using layout = adam_layout<State, Block>;
  static constexpr bool quantized = traits::quantized;
  using moment_type = typename layout::moment_type;
  static constexpr std::int64_t divisor_block = layout::divisor_block;

 public:
  adam_core() = default;
  // An arena of `bytes` from `resource` with a scratch of `total_chunks` chunk sums; the options are checked.
  // `name` ("adam_state", "sharded_adam_state") starts the messages of the checks made here.
  adam_core(const char* name, memory_resource& resource, std::size_t bytes, std::int64_t total_chunks,
            const adam_options& options)
      : name_(name), options_((validate_adam_options(options, name), options)), total_chunks_(total_chunks),
        arena_(resource, shape{static_cast<std::int64_t>(bytes)}) {}

  const adam_options& options() const noexcept { return options_; }
  std::int64_t total_chunks() const noexcept { return total_chunks_; }
  std::byte* data() noexcept { return arena_.data(); }
  const std::byte* data() const noexcept { return arena_.data(); }
  std::size_t bytes() const noexcept { return arena_.bytes(); }
  memory_kind where() const noexcept { return arena_.where(); }
  tensor_view<const std::byte> view() const noexcept { return arena_.view(); }
  // The scratch's bytes [first, second): no state, only each step's leftovers.
  std::pair<std::size_t, std::size_t> scratch_range() const noexcept {
    return {align_segment(sizeof(adam_control)), layout::overhead_bytes(total_chunks_)};
  }

  void set_max_grad_norm(float max_norm) {
    require(max_norm >= 0.0f && is_finite(max_norm), std::string(name_) + "::set_max_grad_norm: need a finite value >= 0");
    options_.max_grad_norm = max_norm;
  }

  // Zeroes the moments and the control block (step 0, initial loss scale).
  template <executor E>
  void reset([[maybe_unused]] const E& exec) {
    require_accessible(exec, view(), (std::string(name_) + "::reset").c_str(), "optimizer state");
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

  // The control block, copied to the host (on CUDA this waits for the stream).
  template <executor E>
  adam_control control(const E& exec) const {
    adam_control control{};
    copy_out(exec, &control, 0, sizeof control);
    return control;
  }
  // The last step's report; tensors[i] is tensor i's layout (the tensor with the first non-finite chunk is named).
  template <executor E>
  adam_step_report report(const E& exec, std::span<const adam_tensor_layout> tensors) const {
    const adam_control c = control(exec);
    adam_step_report r;
    r.applied = c.applied != 0;
    r.step = c.step;
    r.skipped_steps = c.skipped_steps;
    r.grad_norm = c.grad_norm;
    r.loss_scale = c.loss_scale;
    if (c.first_nonfinite_chunk >= 0)
      for (std::size_t i = 0; i < tensors.size(); ++i)
        if (c.first_nonfinite_chunk >= tensors[i].first_chunk &&
            c.first_nonfinite_chunk < tensors[i].first_chunk + tensors[i].chunks)
          r.first_nonfinite_tensor = static_cast<std::int64_t>(i);
    return r;
  }

  template <executor E>
  void copy_out([[maybe_unused]] const E& exec, void* destination, std::size_t offset, std::size_t bytes) const {
    if constexpr (!E::on_device) {
      require(host_executor::can_access(where()),
              std::string(name_) + ": the state is in device memory; read it with a cuda_executor");
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
              std::string(name_) + ": the state is in device memory; write it with a cuda_executor");
      std::memcpy(arena_.data(), source, bytes);
    } else {
#if MEMKIT_HAS_CUDA
      MEMKIT_CUDA_CHECK(cudaMemcpyAsync(arena_.data(), source, bytes, cudaMemcpyDefault, exec.stream));
      exec.synchronize();  // `source` is the caller's temporary
#endif
    }
  }


  // ---- per-element access shared by inspection and the host step ----
  static float load_moment(const std::byte* base, const adam_tensor_layout& t, std::int64_t i, bool first) {
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
  static void store_plain(std::byte* base, const adam_tensor_layout& t, std::int64_t i, float m, float v) {
    if constexpr (quantized) {
      reinterpret_cast<float*>(base + t.m_offset)[i] = m;
      reinterpret_cast<float*>(base + t.v_offset)[i] = v;
    } else {
      reinterpret_cast<moment_type*>(base + t.m_offset)[i] = from_float<moment_type>(m);
      reinterpret_cast<moment_type*>(base + t.v_offset)[i] = from_float<moment_type>(v);
    }
  }
  // Requantizes one block from fp32 moments: new absmax per moment, then the nearest codes.
  static void quantize_block(std::byte* base, const adam_tensor_layout& t, std::int64_t b, const float* m,
                      const float* v, std::int64_t count) {
    quantize_block(base, t, b, m, v, count, block_absmax(m, count), block_absmax(v, count));
  }
  // The block's absmax: the largest magnitude, taken as an integer maximum over bit patterns (exact,
  // so it matches the device's max_abs reduction bit for bit).
  static float block_absmax(const float* values, std::int64_t count) noexcept {
    return detail::bit_cast<float>(detail::max_magnitude_bits(values, count));
  }
  static void quantize_block(std::byte* base, const adam_tensor_layout& t, std::int64_t b, const float* m,
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


  // ---- the host step: norm pass, decision, update, each over one tensor at a time ----
  adam_control& host_control() noexcept { return *reinterpret_cast<adam_control*>(arena_.data()); }
  double* host_chunk_sums() noexcept { return reinterpret_cast<double*>(arena_.data() + align_segment(sizeof(adam_control))); }


  // The norm pass over one tensor's gradient, in the canonical chunk/lane/tree order: the sums of its chunks
  // go to the scratch from t.first_chunk on.
  template <float_storage G>
  void host_norm(const adam_tensor_layout& t, const G* grad) {
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
  void host_norm_chunks(const adam_tensor_layout& t, const G* grad, std::int64_t first, std::int64_t last) {
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
  // The decision (apply or skip, clipping, loss scale) from the chunk sums; true when the step applies.
  bool host_finalize(float gradient_scale) {
    detail::finalize_step(host_control(), host_chunk_sums(), total_chunks_, options_.max_grad_norm,
                          options_.loss_scaling, gradient_scale);
    return host_control().applied != 0;
  }
  // Where tensor `index`'s values come from and go to; `first` is the tensor's element at `param[0]` (a piece's
  // begin), which with `index` picks the stochastic-rounding stream.
  template <float_storage P, float_storage G>
  param_access<P, G> host_access(std::int64_t index, P* param, const G* grad, float* master, std::int64_t first = 0) {
    return {param, grad, master, options_.stochastic_rounding, options_.seed, host_control().step, index, first};
  }

  // The fused update of one tensor (after host_finalize applied the step), tile by tile: the tile's
  // parameters, gradients and moments are gathered as fp32 into L1-resident buffers (unless they are
  // fp32 arrays already), updated by detail::adamw_update_array, and written back; a quantized block
  // is one tile, so its new moments are requantized while still in L1.
  // The work is split across host_parts threads in whole units (quantization blocks, or plain units of
  // detail::plain_unit elements); each element is computed by the same code whatever the split.
  template <float_storage P, float_storage G>
  void host_update(const adam_tensor_layout& t, const param_access<P, G>& access, const adam_group& group) {
    const adam_coefficients c = make_coefficients(group, host_control());
    detail::run_in_parts(host_parts(t.size), t.units, [&](std::int64_t first, std::int64_t last) {
      host_update_units(t, access, c, first, last);
    });
  }
  template <float_storage P, float_storage G>
  void host_update_units(const adam_tensor_layout& t, const param_access<P, G>& access,
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
  static detail::moment_maxima on_fp32_params(const param_access<P, G>& access, host_tile& tile, std::int64_t begin,
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
  static void update_params(const param_access<P, G>& access, host_tile& tile, float* m, float* v,
                            std::int64_t begin, std::int64_t count, const adam_coefficients& c) {
    on_fp32_params(access, tile, begin, count, [&](float* params, const float* grads) {
      detail::adamw_update_array(params, m, v, grads, count, c);
      return detail::moment_maxima{};
    });
  }

  // The same for one quantized block whose tile.m and tile.v hold the codes' table entries (detail::lookup_codes):
  // scales them by the block's absmax, updates, and returns the new moments' maxima (detail::adamw_update_block).
  template <float_storage P, float_storage G>
  static detail::moment_maxima update_block(const param_access<P, G>& access, host_tile& tile, std::int64_t begin,
                                            std::int64_t count, const adam_coefficients& c, float m_absmax, float v_absmax) {
    return on_fp32_params(access, tile, begin, count, [&](float* params, const float* grads) {
      return detail::adamw_update_block(params, tile.m, tile.v, grads, count, c, m_absmax, v_absmax);
    });
  }

  template <float_storage P, float_storage G, float_storage M>
  static void host_update_plain(const param_access<P, G>& access, M* m, M* v, std::int64_t first,
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
  // ---- the device step: the same three passes as kernels on the executor's stream ----
  void device_reset(const cuda_executor& exec, const adam_control& control) {
    detail::with_device(exec.device, [&] {
      MEMKIT_CUDA_CHECK(cudaMemsetAsync(arena_.data(), 0, arena_.bytes(), exec.stream));
      detail::adam_set_control_kernel<adam_control><<<1, 1, 0, exec.stream>>>(reinterpret_cast<adam_control*>(arena_.data()), control);
      MEMKIT_CUDA_CHECK(cudaGetLastError());
      return 0;
    });
  }

  // Managed (paged) arena: advises the pages' preferred location (the host after release, none after prefetch), then migrates.
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
  adam_control* device_control() noexcept { return reinterpret_cast<adam_control*>(arena_.data()); }
  double* device_chunk_sums() noexcept { return host_chunk_sums(); }

  // The norm pass over `count` tensors (tensor_of(i) -> adam_step_tensor): each tensor's chunk sums into the
  // scratch from its layout's first_chunk.
  template <float_storage G, class TensorOf>
  void device_norm(const cuda_executor& exec, std::size_t count, TensorOf&& tensor_of) {
    constexpr int K = tensors_per_launch;
    double* sums = device_chunk_sums();
    for (std::size_t first = 0; first < count; first += K) {
      norm_launch<G> batch{};
      std::int64_t units = 0;
      for (std::size_t j = 0; j < K && first + j < count; ++j) {
        const adam_step_tensor s = tensor_of(first + j);
        batch.grad[j] = static_cast<const G*>(s.grad);
        batch.sums[j] = sums + s.layout->first_chunk;
        batch.size[j] = s.layout->size;
        batch.chunk_begin[j] = units;
        units += s.layout->chunks;
        batch.count = static_cast<int>(j + 1);
      }
      batch.chunk_begin[batch.count] = units;
      adam_norm_kernel<G><<<static_cast<unsigned>(units), reduction_lanes, 0, exec.stream>>>(batch);
      MEMKIT_CUDA_CHECK(cudaGetLastError());
    }
  }
  // The decision and the update pass over `count` tensors: the finalisation reads the chunk sums, the scratch
  // then takes the step's per-group terms, and the update kernels apply them (or do nothing on a skip).
  template <float_storage P, float_storage G, class TensorOf>
  void device_finalize_and_update(const cuda_executor& exec, float gradient_scale, std::span<const adam_group> groups,
                                  std::size_t count, TensorOf&& tensor_of) {
    std::byte* base = arena_.data();
    adam_control* control = device_control();
    double* chunk_sums = device_chunk_sums();
    adam_finalize_kernel<adam_control><<<1, finalize_threads, 0, exec.stream>>>(
        control, chunk_sums, total_chunks_, options_.max_grad_norm, options_.loss_scaling, gradient_scale);
    MEMKIT_CUDA_CHECK(cudaGetLastError());
    // The norm scratch is free once the finalisation has read it: it takes the step's per-group terms.
    auto* terms = reinterpret_cast<adam_step_terms*>(chunk_sums);
    const std::vector<std::int32_t> slots = enqueue_step_terms(exec.stream, control, terms, total_chunks_, groups, count,
                                                               [&](std::size_t i) { return tensor_of(i).group; });
    constexpr int K = tensors_per_launch;
    constexpr int threads = update_threads<State, Block>();
    for (std::size_t first = 0; first < count; first += K) {
      update_launch<State> batch{};
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
      for (std::size_t j = 0; j < K && first + j < count; ++j) {
        const adam_step_tensor s = tensor_of(first + j);
        const adam_tensor_layout& t = *s.layout;
        adam_tensor_args& a = batch.tensors[j];
        a.param = s.param;
        a.grad = s.grad;
        a.master = s.master;
        a.m = base + t.m_offset;
        a.v = base + t.v_offset;
        a.m_scale = t.quantized ? reinterpret_cast<float*>(base + t.m_scale_offset) : nullptr;
        a.v_scale = t.quantized ? reinterpret_cast<float*>(base + t.v_scale_offset) : nullptr;
        a.size = t.size;
        a.unit_begin = units;
        a.index = s.index;
        a.first = s.first;
        a.group = groups[static_cast<std::size_t>(s.group)];
        a.quantized = t.quantized ? 1 : 0;
        a.terms_slot = slots[first + j];
        a.vector = vector_aligned(a.param, a.grad, a.master, a.m, a.v) ? 1 : 0;
        units += t.units;
        batch.count = static_cast<int>(j + 1);
      }
      if (options_.device_prefetch_update)
        adam_update_kernel<State, Block, threads, P, G, true><<<update_blocks<State, Block>(units), threads, 0, exec.stream>>>(batch);
      else
        adam_update_kernel<State, Block, threads, P, G, false><<<update_blocks<State, Block>(units), threads, 0, exec.stream>>>(batch);
      MEMKIT_CUDA_CHECK(cudaGetLastError());
    }
  }
#endif

 private:
  const char* name_ = "adam_state";
  adam_options options_;
  std::int64_t total_chunks_ = 0;
  buffer<std::byte> arena_;
};

}  // namespace detail
}  // namespace optim
MEMKIT_NAMESPACE_END
