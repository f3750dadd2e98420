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
//
// This header is the state and its API (namespace memkit::optim). adam_options, adam_group and
// adam_step_report are in optim/adam_math.hpp with the per-element math; the constexpr layout
// (adam_layout, which adam_state derives its byte functions from) in optim/adam_bytes.hpp; the step itself in
// optim/detail/adam_core.hpp (host loop and kernel launches), detail/adam_kernels.hpp (CUDA) and
// detail/adam_simd.hpp (host vector loops).
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
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/optim/adam_bytes.hpp"
#include "memkit/optim/adam_math.hpp"
#include "memkit/optim/detail/adam_checks.hpp"
#include "memkit/optim/detail/adam_core.hpp"
#include "memkit/optim/detail/adam_image.hpp"
#include "memkit/optim/state_codecs.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace optim {

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


template <class State, int Block = adam_state_traits<State>::default_block>
class adam_state : public adam_layout<State, Block> {
  using traits = adam_state_traits<State>;
  using layout = adam_layout<State, Block>;
  using layout::divisor_block;
  using core = detail::adam_core<State, Block>;

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
  {
    detail::validate_adam_options(options, "adam_state");
    std::int64_t chunks = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      require(sizes[i] > 0, "adam_state: tensor " + std::to_string(i) + " has " + std::to_string(sizes[i]) +
                                " elements; every tensor needs at least one");
      detail::adam_tensor_layout t;
      t.size = sizes[i];
      t.quantized = quantizes(t.size, options.min_quantized_size);
      t.units = t.quantized ? (t.size + divisor_block - 1) / divisor_block : (t.size + detail::plain_unit - 1) / detail::plain_unit;
      t.first_chunk = chunks;
      t.chunks = detail::reduction_chunks(t.size);
      chunks += t.chunks;
      layout_.push_back(t);
    }
    std::size_t offset = overhead_bytes(chunks);
    for (detail::adam_tensor_layout& t : layout_) {
      offset = segment_plan(t.size, t.quantized).place(t, offset, t.quantized);
    }
    core_ = core("adam_state", resource, offset, chunks, options);
    reset(exec);
  }

  adam_state(const adam_state&) = delete;
  adam_state& operator=(const adam_state&) = delete;
  adam_state(adam_state&&) noexcept = default;
  adam_state& operator=(adam_state&&) noexcept = default;

  // Zeroes the moments and the control block (step 0, initial loss scale).
  template <executor E>
  void reset(const E& exec) {
    core_.reset(exec);
  }

  std::size_t tensor_count() const noexcept { return layout_.size(); }
  std::int64_t size(std::size_t tensor) const { return layout_.at(tensor).size; }
  bool is_quantized(std::size_t tensor) const { return layout_.at(tensor).quantized; }
  std::size_t bytes() const noexcept { return core_.bytes(); }
  memory_kind where() const noexcept { return core_.where(); }
  const adam_options& options() const noexcept { return core_.options(); }
  // Changes the clipping threshold for later steps (0 disables clipping).
  void set_max_grad_norm(float max_norm) { core_.set_max_grad_norm(max_norm); }

  // One AdamW step over all tensors of the state, in the order they were given at construction.
  // `gradient_scale` multiplies every gradient (e.g. 1/micro_batches after gradient accumulation), on
  // top of the loss-scale division and the clipping factor, without a separate pass.
  template <executor E, float_storage P, float_storage G>
  void step(const E& exec, std::span<const adam_param<P, G>> params, std::span<const adam_group> groups,
            float gradient_scale = 1.0f) {
    detail::validate_step<P, G>(exec, params, std::span<const detail::adam_tensor_layout>(layout_), groups, gradient_scale,
                                arena_view());
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
    return core_.control(exec);
  }
  template <executor E>
  adam_step_report report(const E& exec) const {
    return core_.report(exec, layout_);
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
    const std::byte* base = core_.data();
    if (E::on_device || !host_executor::can_access(where())) {
      bytes.resize(core_.bytes());
      core_.copy_out(exec, bytes.data(), 0, bytes.size());
      base = bytes.data();
    }
    const detail::adam_tensor_layout& t = layout_[tensor];
    m.resize(static_cast<std::size_t>(t.size));
    v.resize(static_cast<std::size_t>(t.size));
    for (std::int64_t i = 0; i < t.size; ++i) {
      m[static_cast<std::size_t>(i)] = core::load_moment(base, t, i, true);
      v[static_cast<std::size_t>(i)] = core::load_moment(base, t, i, false);
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
    std::byte* base = core_.data();
    if (!t.quantized) {
      for (std::int64_t i = 0; i < t.size; ++i) {
        core::store_plain(base, t, i, m[static_cast<std::size_t>(i)], v[static_cast<std::size_t>(i)]);
      }
      return;
    }
    if constexpr (quantized) {
      for (std::int64_t b = 0; b < t.units; ++b) {
        const std::int64_t begin = b * Block, count = std::min<std::int64_t>(Block, t.size - begin);
        core::quantize_block(base, t, b, m.data() + begin, v.data() + begin, count);
      }
    }
  }

  // ---- The state as it is stored: read-only views, and wholesale replacement (interop) ----

  // Views of tensor `tensor`'s moments, valid while the state lives; they change with every step.
  adam_tensor_state<plain_moment_type> tensor_state(std::size_t tensor) const {
    require(tensor < layout_.size(), "adam_state::tensor_state: tensor " + std::to_string(tensor) + " of " +
                                         std::to_string(layout_.size()));
    return tensor_state_at(core_.data(), layout_[tensor], where());
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
    return {reinterpret_cast<const std::int64_t*>(core_.data()), shape{1}, where()};
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
    for (std::size_t i = 0; i < tensors.size(); ++i) detail::validate_source<traits::bits>(op + ": tensor " + std::to_string(i), layout_[i], tensors[i], options().min_quantized_size);
    std::vector<std::byte> image(core_.bytes(), std::byte{0});
    adam_control control{};
    control.step = step;
    control.loss_scale = options().loss_scaling.enabled ? options().loss_scaling.initial_scale : 1.0f;
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
    core_.copy_in(exec, image.data(), image.size());
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
    std::vector<std::byte> arena(core_.bytes());
    core_.copy_out(exec, arena.data(), 0, arena.size());
    // The gradient-norm scratch is no state: after a step it holds the host's chunk sums or the device's
    // per-group step terms, and the next step overwrites it. Saved as zeros, so a state saves the same bytes
    // whichever executor stepped it.
    const auto [scratch_begin, scratch_end] = scratch_range();
    std::fill(arena.begin() + static_cast<std::ptrdiff_t>(scratch_begin),
              arena.begin() + static_cast<std::ptrdiff_t>(scratch_end), std::byte{0});
    const std::vector<std::byte> bytes = image_of(arena);
    header h = make_header();
    detail::write_string(out, magic);
    detail::write_pod(out, format_version);
    detail::write_string(out, h.name);
    detail::write_pod(out, h.bits);
    detail::write_pod(out, h.block);
    detail::write_pod(out, h.map_fingerprint);
    detail::write_pod(out, h.min_quantized_size);
    detail::write_pod(out, static_cast<std::uint64_t>(layout_.size()));
    for (const auto& t : layout_) detail::write_pod(out, t.size);
    detail::write_pod(out, static_cast<std::uint64_t>(bytes.size()));
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    detail::write_pod(out, detail::image_checksum(bytes.data(), bytes.size()));
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
    const auto version = detail::read_pod<std::uint32_t>(in, op);
    require(version == format_version, std::string(op) + ": image has format version " + std::to_string(version) +
                                           ", this build reads version " + std::to_string(format_version));
    const header mine = make_header();
    const std::string name = detail::read_string(in, op);
    require(name == mine.name, std::string(op) + ": image holds '" + name + "' state, this is '" + mine.name + "'");
    const auto bits = detail::read_pod<std::uint32_t>(in, op);
    require(bits == mine.bits, std::string(op) + ": image has " + std::to_string(bits) + "-bit moments, this state " +
                                   std::to_string(mine.bits) + "-bit");
    const auto block = detail::read_pod<std::uint32_t>(in, op);
    require(block == mine.block, std::string(op) + ": image was saved with block size " + std::to_string(block) +
                                     ", this state uses " + std::to_string(mine.block));
    const auto fingerprint = detail::read_pod<std::uint64_t>(in, op);
    require(fingerprint == mine.map_fingerprint,
            std::string(op) + ": the image's quantization maps differ from this build's (fingerprint " +
                std::to_string(fingerprint) + " vs " + std::to_string(mine.map_fingerprint) + ")");
    const auto threshold = detail::read_pod<std::int64_t>(in, op);
    require(threshold == mine.min_quantized_size,
            std::string(op) + ": image was saved with min_quantized_size " + std::to_string(threshold) +
                ", this state uses " + std::to_string(mine.min_quantized_size));
    const auto count = detail::read_pod<std::uint64_t>(in, op);
    require(count == layout_.size(), std::string(op) + ": image has " + std::to_string(count) + " tensors, this state " +
                                         std::to_string(layout_.size()));
    for (std::size_t i = 0; i < layout_.size(); ++i) {
      const auto n = detail::read_pod<std::int64_t>(in, op);
      require(n == layout_[i].size, std::string(op) + ": tensor " + std::to_string(i) + " has " + std::to_string(n) +
                                        " elements in the image, " + std::to_string(layout_[i].size) + " here");
    }
    const auto length = detail::read_pod<std::uint64_t>(in, op);
    const std::size_t expected = image_bytes();
    require(length == expected, std::string(op) + ": image holds " + std::to_string(length) +
                                    " bytes of state, this state has " + std::to_string(expected));
    std::vector<std::byte> bytes(expected);
    in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    require(static_cast<std::size_t>(in.gcount()) == bytes.size(), std::string(op) + ": image is truncated");
    const auto sum = detail::read_pod<std::uint64_t>(in, op);
    require(sum == detail::image_checksum(bytes.data(), bytes.size()), std::string(op) + ": image checksum does not match (corrupt)");
    const std::vector<std::byte> arena = arena_of(bytes);
    validate_image(op, arena.data());
    core_.copy_in(exec, arena.data(), arena.size());
  }

#if MEMKIT_HAS_CUDA
  // Managed (paged) state: moves the pages to the executor's device ahead of the step; step() does
  // this itself for managed state. Asynchronous on the stream.
  void prefetch(const cuda_executor& exec) const {
    if (where() != memory_kind::managed || core_.bytes() == 0) return;
    detail::with_device(exec.device, [&] {
      core_.prefetch_to(exec, exec.device);
      return 0;
    });
  }
  // Managed state: moves the pages back to host memory and prefers them there, releasing the device
  // memory until the next prefetch (e.g. while activations of the forward pass need the room).
  void release(const cuda_executor& exec) const {
    if (where() != memory_kind::managed || core_.bytes() == 0) return;
    detail::with_device(exec.device, [&] {  // exec.stream belongs to exec.device
      core_.prefetch_to(exec, cudaCpuDeviceId);
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
    detail::validate_offload<P, G>(exec, params, std::span<const detail::adam_tensor_layout>(layout_), groups, gradient_scale,
                                   where());
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
        core_.host_norm(layout_[i], static_cast<const G*>(params[i].grad_staging.data()));
      }
      if (!core_.host_finalize(gradient_scale)) return 0;  // skipped: nothing changes, nothing is copied back
      for (std::size_t i = 0; i < params.size(); ++i) {
        const adam_offload_param<P, G>& p = params[i];
        const adam_group& group = groups[static_cast<std::size_t>(p.group)];
        const G* grad = p.grad_staging.data();
        if constexpr (std::is_same_v<P, float>) {
          core_.host_update(layout_[i], core_.template host_access<float, G>(index(i), p.master.data(), grad, nullptr), group);
          MEMKIT_CUDA_CHECK(cudaMemcpyAsync(p.param.data(), p.master.data(), p.master.bytes(), cudaMemcpyHostToDevice,
                                            exec.stream));
        } else {
          core_.host_update(layout_[i], core_.template host_access<P, G>(index(i), p.param_staging.data(), grad, p.master.data()), group);
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
  tensor_view<const std::byte> arena_view() const noexcept { return core_.view(); }
  // The bytes [first, second) of the arena that are the gradient-norm scratch: no state, only each step's
  // leftovers (the host's chunk sums, or a device's per-group step terms). save() writes them as zeros.
  std::pair<std::size_t, std::size_t> scratch_range() const noexcept {
    return core_.scratch_range();
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
            traits::map_fingerprint(), options().min_quantized_size};
  }
  using image_layout = detail::adam_image_layout<State, Block>;
  std::size_t image_bytes() const noexcept { return image_layout::image_bytes(layout_, core_.bytes()); }
  std::vector<std::byte> image_of(const std::vector<std::byte>& arena) const {
    std::vector<std::byte> image(image_bytes());
    image_layout::relayout(layout_, overhead_bytes(core_.total_chunks()), core_.bytes(), arena.data(), image.data(), true);
    return image;
  }
  std::vector<std::byte> arena_of(const std::vector<std::byte>& image) const {
    std::vector<std::byte> arena(core_.bytes());  // the padding stays zero, as reset() leaves it
    image_layout::relayout(layout_, overhead_bytes(core_.total_chunks()), core_.bytes(), image.data(), arena.data(), false);
    return arena;
  }

  // ---- validation: every check happens before anything is written ----
  // The values of a loaded image (host bytes laid out as this state's arena): the control block field by
  // field, then each tensor's moments and scales.
  void validate_image(const char* op, const std::byte* image) const {
    adam_control c{};
    std::memcpy(&c, image, sizeof c);
    validate_control(c, std::string(op) + ": the image's control block has ", core_.total_chunks(), options().loss_scaling);
    for (std::size_t i = 0; i < layout_.size(); ++i)
      detail::validate_source<traits::bits>(std::string(op) + ": the image's tensor " + std::to_string(i), layout_[i],
                                            tensor_state_at(image, layout_[i], memory_kind::host), options().min_quantized_size);
  }

  // ---- host step ----
  template <float_storage P, float_storage G>
  void host_step(std::span<const adam_param<P, G>> params, std::span<const adam_group> groups, float gradient_scale) {
    for (std::size_t i = 0; i < params.size(); ++i) core_.host_norm(layout_[i], params[i].grad.data());
    if (!core_.host_finalize(gradient_scale)) return;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const adam_param<P, G>& p = params[i];
      core_.host_update(layout_[i], core_.host_access(index(i), p.param.data(), p.grad.data(), p.master.data()),
                        groups[static_cast<std::size_t>(p.group)]);
    }
  }
  static std::int64_t index(std::size_t tensor) noexcept { return static_cast<std::int64_t>(tensor); }

#if MEMKIT_HAS_CUDA
  // The same passes as kernels on the executor's stream; the host never waits.
  template <float_storage P, float_storage G>
  void device_step(const cuda_executor& exec, std::span<const adam_param<P, G>> params,
                   std::span<const adam_group> groups, float gradient_scale) {
    detail::with_device(exec.device, [&] {
      if (where() == memory_kind::managed) core_.migrate(exec, exec.device);  // paged state: bring it in ahead of the kernels
      auto tensor = [&](std::size_t i) {
        const adam_param<P, G>& p = params[i];
        return detail::adam_step_tensor{&layout_[i], p.param.data(), p.grad.data(), p.master.data(), index(i), 0, p.group};
      };
      core_.template device_norm<G>(exec, params.size(), tensor);
      core_.template device_finalize_and_update<P, G>(exec, gradient_scale, groups, params.size(), tensor);
      return 0;
    });
  }

#endif

  std::vector<detail::adam_tensor_layout> layout_;
  core core_;
};

}  // namespace optim
MEMKIT_NAMESPACE_END

