// memkit/distributed/stage3.hpp — ZeRO stage 3 training: parameters, gradients and optimizer state all
// sharded, each layer's parameters gathered whole only while the layer runs.
//
//   ordered_reduce_scatter(exec, comm, send, recv, staging)   reduce_scatter whose sums are added in rank
//                                                             order (bit-reproducible on any rank count)
//   stage3_parameters<W, State, Block>                        the runtime: units (a layer's parameters),
//                                                             gather / release / step, and its byte functions
//
// A unit is the trainable tensors of one layer (layers::basic_parameter<W>, e.g. a decoder block's norms
// and projections). Its tensors are laid out flat as sharded_adam_state lays out tensors (each padded to
// 4096 elements, the unit to ranks * 4096) and rank r keeps slice r of the flat parameters, its master copy
// (bf16_master), its slice of the summed gradients and its sharded_adam_state. In between, the tensors'
// own buffers are empty: basic_parameter::value, master and grad hold nothing, so a layer run without its
// gather fails (the model's layers check that their weights are present).
//
//   gather(exec, comm, unit, with_gradients)   all_gather of the unit's slices into a gather buffer of its
//                                              slot (or the one a prefetch filled); the parameters' `value`
//                                              buffers point into it (and with gradients, `grad` into the
//                                              slot's zeroed gradient buffer)
//   release(exec, comm, unit)                  drops the views; if the gradients were gathered, reduces them
//                                              to their owners (ordered_reduce_scatter) first
//   prefetch(side, comm, unit)                 the same collectives early, on a second stream (events order it)
//   step(exec, comm, groups, scale)            each unit's sharded_adam_state updates its own slice only
//   save(exec, writer) / load(exec, images)    one safetensors file per rank; load re-shards N -> M
//   stage3_layer<Layer, Runtime, C>            a layer that gathers around its forward and backward (what
//                                              checkpoint::segment runs: a recompute gathers again)
//
// Buffers: one gather buffer (or two, buffers_per_slot) and one gradient buffer per slot, sized for the slot's
// largest unit, made at construction and reused: slot 0 holds the decoder blocks (one buffer: one layer's worth,
// one block at a time; two: the next block is prefetched while one runs), another slot a unit that stays
// gathered across the others (the embedding and head, used at both ends of the pass). Gathering into a slot
// whose buffers all hold units is an error. One staging buffer of the largest unit's flat gradients takes the
// all_to_all of the reduction. All of it is said in advance by bytes_required (per category, exact).
//
// Bit-identity with one process: the gradients of rank r are rank r's micro-batch's; the owner adds them in
// rank order (((g0 + g1) + g2) ...), what one process accumulating the micro-batches one after the other
// computes, and the Adam update is sharded_adam_state's (bit-identical to adam_state for the same gradients).
// The gradient norm is global on the host: every unit's chunk sums added in the order one adam_state over all
// the units' tensors adds them, so clipping (max_grad_norm > 0) is bit-identical to one process and a non-finite
// gradient anywhere skips the step of every unit on every rank. On a device each unit decides on its own norm
// (clipping refused there in this version). Each unit's
// gradients are reduced once per step (one backward per unit; no accumulation over micro-steps on one rank).
// On CUDA the collectives and copies are enqueued on the executor's stream, a prefetch on a second stream
// ordered with events (compiled; not yet run on a device). Frozen dense tensors and LoRA adapters are
// not units: they stay whole on every rank (ordered_all_reduce sums replicated gradients in rank order).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/layer.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/distributed/communicator.hpp"
#include "memkit/distributed/sharded_adam_state.hpp"
#include "memkit/distributed/sharded_parameters.hpp"
#include "memkit/distributed/stage3_bytes.hpp"
#include "memkit/layers/parameter.hpp"
#include "memkit/layers/tensor_ops.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/quant/quantized_tensor.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace distributed {

namespace detail {
// out[i] = staging[i] + staging[count + i] + ... in rank order (the order one process would add in).
struct rank_order_sum {
  const float* staging;
  float* out;
  std::int64_t count;
  int ranks;
  MEMKIT_HOST_DEVICE void operator()(std::int64_t i) const {
    float sum = staging[i];
    for (int r = 1; r < ranks; ++r) sum += staging[static_cast<std::int64_t>(r) * count + i];
    out[i] = sum;
  }
};

// `text` as a JSON string (quotes, backslashes and control characters escaped).
inline std::string json_quoted(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      const char* hex = "0123456789abcdef";
      out += "\\u00";
      out += hex[(c >> 4) & 0xf];
      out += hex[c & 0xf];
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// A resource that hands out one address given in advance: how a parameter's buffer<W> is made to point into
// the gather buffer without owning it (deallocation does nothing; the gather buffer owns the bytes).
class placement_resource final : public memory_resource {
 public:
  explicit placement_resource(memory_kind kind) : kind_(kind) {}
  void place(void* at, std::size_t bytes) {
    at_ = at;
    bytes_ = bytes;
  }
  memory_kind kind() const noexcept override { return kind_; }
  const char* name() const noexcept override { return "stage3 gather buffer"; }

 private:
  void* do_allocate(std::size_t bytes, std::size_t) override {
    require(at_ != nullptr && bytes <= bytes_, "stage3: internal error: a view larger than its place in the gather buffer");
    return std::exchange(at_, nullptr);
  }
  void do_deallocate(void*, std::size_t, std::size_t) noexcept override {}
  memory_kind kind_;
  void* at_ = nullptr;
  std::size_t bytes_ = 0;
};

// A bump allocator over a slot's buffer for the gathered quantized tensors (their four buffers each, aligned
// as every resource aligns); reset when the slot is released.
class slab_resource final : public memory_resource {
 public:
  explicit slab_resource(memory_kind kind) : kind_(kind) {}
  void reset(std::byte* base, std::size_t bytes) {
    base_ = base;
    size_ = bytes;
    used_ = 0;
  }
  memory_kind kind() const noexcept override { return kind_; }
  const char* name() const noexcept override { return "stage3 quantized gather buffer"; }

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    const std::size_t at = (used_ + alignment - 1) / alignment * alignment;
    require(base_ != nullptr && at + bytes <= size_, "stage3: internal error: the quantized gather buffer is too small");
    used_ = at + bytes;
    return base_ + at;
  }
  void do_deallocate(void*, std::size_t, std::size_t) noexcept override {}
  memory_kind kind_;
  std::byte* base_ = nullptr;
  std::size_t size_ = 0, used_ = 0;
};
// An event of a slot's buffer on CUDA (gather done on the side stream; buffer free again on the main stream);
// nothing on the host, where a prefetch is done when it returns.
struct buffer_event {
#if MEMKIT_HAS_CUDA
  cudaEvent_t event = nullptr;
  bool recorded = false;
  buffer_event() = default;
  buffer_event(buffer_event&& other) noexcept
      : event(std::exchange(other.event, nullptr)), recorded(std::exchange(other.recorded, false)) {}
  buffer_event& operator=(buffer_event&& other) noexcept {
    std::swap(event, other.event);
    std::swap(recorded, other.recorded);
    return *this;
  }
  ~buffer_event() {
    if (event != nullptr) cudaEventDestroy(event);
  }
  void record(cudaStream_t stream) {
    if (event == nullptr) MEMKIT_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    MEMKIT_CUDA_CHECK(cudaEventRecord(event, stream));
    recorded = true;
  }
  void wait(cudaStream_t stream) const {
    if (recorded) MEMKIT_CUDA_CHECK(cudaStreamWaitEvent(stream, event, 0));
  }
#endif
};
}  // namespace detail

// Sums `send` (ranks * count elements on every rank) over the ranks and leaves elements [rank * count,
// (rank + 1) * count) of the sum in `recv` (count), adding in rank order: one all_to_all into `staging`
// (ranks * count), then each element's ranks added 0, 1, ..., N-1. Same volume as a reduce_scatter, but the
// result does not depend on the library's reduction tree.
template <executor E, class C>
  requires ordered_communicator<C, E>
void ordered_reduce_scatter(const E& exec, const C& comm, tensor_view<const float> send, tensor_view<float> recv,
                            tensor_view<float> staging) {
  const char* op = "ordered_reduce_scatter";
  const std::int64_t count = recv.size(), ranks = comm.size();
  require(send.size() == ranks * count && staging.size() == ranks * count,
          std::string(op) + ": send has " + std::to_string(send.size()) + " and staging " + std::to_string(staging.size()) +
              " elements; " + std::to_string(ranks) + " ranks of " + std::to_string(count) + " need " +
              std::to_string(ranks * count) + " each");
  require_accessible(exec, send, op, "send");
  require_accessible(exec, recv, op, "recv");
  require_accessible(exec, staging, op, "staging");
  if (count == 0) return;
  comm.all_to_all(exec, send.data(), staging.data(), count);
  layers::for_each_index(exec, count, detail::rank_order_sum{staging.data(), recv.data(), count, static_cast<int>(ranks)});
}

// data = the sum over ranks of data, added in rank order on every rank (ordered_reduce_scatter of the padded
// data, then all_gather): for replicated tensors (LoRA adapters' gradients under stage 3).
template <executor E, class C>
  requires ordered_communicator<C, E>
void ordered_all_reduce(const E& exec, const C& comm, tensor_view<float> data, memory_resource& workspace) {
  const std::int64_t count = data.size(), n = comm.size(), chunk = (count + n - 1) / n;
  require_accessible(exec, data, "ordered_all_reduce", "data");
  if (count == 0) return;
  buffer<float> send = workspace_buffer<float>(exec, workspace, shape{n * chunk});
  buffer<float> staging = workspace_buffer<float>(exec, workspace, shape{n * chunk});
  buffer<float> mine = workspace_buffer<float>(exec, workspace, shape{chunk});
  layers::zero_view(exec, send.view());
  layers::copy_view(exec, tensor_view<const float>(data), send.view().flat_slice(0, count));
  ordered_reduce_scatter(exec, comm, tensor_view<const float>(send.view()), mine.view(), staging.view());
  comm.all_gather(exec, mine.data(), send.data(), chunk);
  layers::copy_view(exec, tensor_view<const float>(send.view().flat_slice(0, count)), data);
}

// A unit: the parameters of one layer (trainable, all with or all without master copies) and its slot.
// Either list may be empty (a QLoRA block has only frozen NF4 weights; its adapters are replicated).
template <class W>
struct stage3_unit {
  std::vector<layers::basic_parameter<W>*> parameters;  // trainable dense tensors
  int slot = 0;
  std::vector<int> tensor_groups{};  // the Adam group of each parameter; empty: all in group 0
  std::vector<quant::quantized_tensor<quant::NF4>*> quantized{};  // frozen NF4 tensors
  // Optional: each NF4 tensor's name in checkpoints (save, load, export_consolidated); empty: "stage3.k.nf4.j".
  std::vector<std::string> quantized_names;  // (no default member initializer: gcc 12 under nvcc fails on one)
};

template <class W, class State = float, int Block = optim::adam_state_traits<State>::default_block>
class stage3_parameters {
 public:
  using parameter = layers::basic_parameter<W>;
  using optimizer_type = sharded_adam_state<State, Block>;
  using quantized_type = quant::quantized_tensor<quant::NF4>;
  using quantized_shard = sharded_quantized<quant::NF4>;

  using unit_spec = stage3_unit<W>;

  // ---- byte functions (exact: a tracker measures these): stage3_layout's (distributed/stage3_bytes.hpp) ----
  using layout = stage3_layout<State, Block>;
  static_assert(stage3_slab_alignment == default_alignment, "stage3: the NF4 gather area is laid out at the resources' alignment");
  static std::int64_t flat_size(const stage3_unit_shape& u, int ranks) { return layout::flat_size(u, ranks); }
  static std::int64_t shard_size(const stage3_unit_shape& u, int ranks) { return layout::shard_size(u, ranks); }
  static std::size_t quantized_gather_bytes(const stage3_unit_shape& u) { return layout::quantized_gather_bytes(u); }
  static std::size_t gather_workspace_bytes(std::span<const stage3_unit_shape> units, int ranks) {
    return layout::gather_workspace_bytes(units, ranks);
  }
  static stage3_bytes shard_bytes(const stage3_unit_shape& u, int rank, int ranks, const optim::adam_options& options = {}) {
    return layout::shard_bytes(u, sizeof(W), rank, ranks, options.min_quantized_size);
  }
  static int buffers_of(std::span<const int> buffers_per_slot, std::size_t slot) {
    return layout::buffers_of(buffers_per_slot, slot);
  }
  static stage3_bytes buffer_bytes(std::span<const stage3_unit_shape> units, int ranks, std::span<const int> buffers_per_slot = {}) {
    return layout::buffer_bytes(units, sizeof(W), ranks, buffers_per_slot);
  }
  // Everything rank `rank` of `ranks` allocates (what the constructor takes, held until destruction).
  static stage3_bytes bytes_required(std::span<const stage3_unit_shape> units, int rank, int ranks,
                                     const optim::adam_options& options = {}, std::span<const int> buffers_per_slot = {}) {
    return layout::bytes_required(units, sizeof(W), rank, ranks, options.min_quantized_size, buffers_per_slot);
  }

  // ---- construction ----

  // Takes rank comm.rank()'s slices of the units' tensors (every rank holds the same whole values, in memory
  // `memory` describes) and then empties the tensors' own buffers. Buffers come from memory.weights /
  // gradients / optimizer; a gather's staging from memory.workspace. `run_id`: sharded_adam_state's (0 draws
  // one on rank 0).
  template <executor E, class C>
    requires ordered_communicator<C, E>
  stage3_parameters(const E& exec, const C& comm, const layers::memory_resources& memory, std::vector<unit_spec> units,
                    const optim::adam_options& options = {}, std::uint64_t run_id = 0, std::span<const int> buffers_per_slot = {})
      : rank_(comm.rank()), ranks_(comm.size()), max_grad_norm_(options.max_grad_norm), workspace_(memory.workspace),
        weights_(memory.weights),
        placement_(memory.weights->kind()) {
    const char* op = "stage3_parameters";
    require(!units.empty(), std::string(op) + ": no units");
    for (std::size_t k = 0; k < units.size(); ++k) {
      unit_spec& spec = units[k];
      const std::string which = std::string(op) + ": unit " + std::to_string(k);
      require(spec.slot >= 0 && spec.slot < 64, which + ": slot " + std::to_string(spec.slot));
      require(spec.quantized_names.empty() || spec.quantized_names.size() == spec.quantized.size(),
              which + ": quantized_names has " + std::to_string(spec.quantized_names.size()) + " entries for " +
                  std::to_string(spec.quantized.size()) + " NF4 tensors");
      require(spec.tensor_groups.empty() || spec.tensor_groups.size() == spec.parameters.size(),
              which + ": tensor_groups has " + std::to_string(spec.tensor_groups.size()) + " entries for " +
                  std::to_string(spec.parameters.size()) + " parameters");
      unit u;
      u.spec = std::move(spec);
      u.shape.slot = u.spec.slot;
      u.shape.master = !u.spec.parameters.empty() && u.spec.parameters.front() != nullptr && u.spec.parameters.front()->has_master();
      for (parameter* p : u.spec.parameters) {
        require(p != nullptr, which + ": a null parameter");
        require(p->trains(), which + ": '" + p->name + "' is frozen; a unit's dense tensors are trainable ones");
        require(p->size() > 0 && p->value.data() != nullptr, which + ": '" + p->name + "' holds no values (already sharded?)");
        require(p->has_master() == u.shape.master, which + ": '" + p->name + "' and '" + u.spec.parameters.front()->name +
                                                        "' differ in having a master copy; a unit's parameters must agree");
        u.dims.push_back(p->value.shape());
        u.shape.sizes.push_back(p->size());
      }
      for (quantized_type* q : u.spec.quantized) {
        require(q != nullptr, which + ": a null quantized tensor");
        require(q->numel() > 0 && q->codes().data() != nullptr, which + ": a quantized tensor holds no codes (already sharded?)");
        u.shape.quantized.emplace_back(q->logical_shape(), q->options());
      }
      shapes_.push_back(u.shape);
      units_.push_back(std::move(u));
    }
    for (std::size_t k = 0; k < buffers_per_slot.size(); ++k)
      require(buffers_per_slot[k] == 1 || buffers_per_slot[k] == 2,
              std::string(op) + ": slot " + std::to_string(k) + " asks for " + std::to_string(buffers_per_slot[k]) +
                  " gather buffers; 1, or 2 to prefetch");
    const stage3_bytes planned = bytes_required(shapes_, rank_, ranks_, options, buffers_per_slot);
    std::size_t made = 0;
    for (unit& u : units_) {
      for (quantized_type* q : u.spec.quantized) {
        u.quantized_shards.emplace_back(*q, rank_, ranks_, *memory.weights);
        made += u.quantized_shards.back().bytes();
        *q = quantized_type();  // the whole tensor is the slot's from now on
      }
      if (u.spec.parameters.empty()) continue;
      u.optimizer = std::make_unique<optimizer_type>(exec, comm, *memory.optimizer, u.shape.sizes, options, run_id);
      run_id = u.optimizer->run_id();  // every unit of the run under one id (no second broadcast)
      const shape slice{u.optimizer->shard_size()};
      u.param_shard = buffer<W>(*memory.weights, slice);
      u.grad_shard = buffer<float>(*memory.gradients, slice);
      if (u.shape.master) u.master_shard = buffer<float>(*memory.optimizer, slice);
      made += u.param_shard.bytes() + u.grad_shard.bytes() + (u.shape.master ? u.master_shard.bytes() : 0) + u.optimizer->bytes();
      layers::zero_view(exec, u.grad_shard.view());
      // This rank's slice of the flat layout, from the whole values; padding stays 0.
      std::vector<W> values(static_cast<std::size_t>(slice.numel()), W{});
      std::vector<float> masters(u.shape.master ? values.size() : 0, 0.0f);
      const std::int64_t first = u.optimizer->shard_begin();
      for (std::size_t i = 0; i < u.spec.parameters.size(); ++i) {
        parameter& p = *u.spec.parameters[i];
        const std::int64_t at = u.optimizer->flat_offset(i);
        const std::int64_t begin = std::clamp<std::int64_t>(first - at, 0, p.size());
        const std::int64_t end = std::clamp<std::int64_t>(first + slice.numel() - at, 0, p.size());
        if (begin >= end) continue;
        const std::vector<W> whole = layers::copy_out(std::as_const(p.value).view());
        std::copy(whole.begin() + begin, whole.begin() + end, values.begin() + (at + begin - first));
        if (u.shape.master) {
          const std::vector<float> m = layers::copy_out(std::as_const(p.master).view());
          std::copy(m.begin() + begin, m.begin() + end, masters.begin() + (at + begin - first));
        }
      }
      layers::copy_in(values.data(), u.param_shard.view());
      if (u.shape.master) layers::copy_in(masters.data(), u.master_shard.view());
      for (parameter* p : u.spec.parameters) {  // the whole tensors are the slot's from now on
        p->value = buffer<W>();
        p->master = buffer<float>();
        p->grad = buffer<float>();
      }
    }
    // The slots' buffers and the staging (zero-element buffers allocate nothing).
    std::int64_t largest = 0;
    for (const unit& u : units_) {
      const auto k = static_cast<std::size_t>(u.shape.slot);
      if (k >= slots_.size()) slots_.resize(k + 1);
      slots_[k].flat = std::max(slots_[k].flat, flat_size(u.shape, ranks_));
      slots_[k].quantized_bytes = std::max(slots_[k].quantized_bytes, quantized_gather_bytes(u.shape));
      largest = std::max(largest, flat_size(u.shape, ranks_));
    }
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      slot& s = slots_[k];
      s.grads = buffer<float>(*memory.gradients, shape{s.flat});
      made += s.grads.bytes();
      for (int b = 0; b < buffers_of(buffers_per_slot, k); ++b) {
        gather_buffer g(memory.weights->kind());
        g.values = buffer<W>(*memory.weights, shape{s.flat});
        g.quantized = buffer<std::byte>(*memory.weights, shape{static_cast<std::int64_t>(s.quantized_bytes)});
        made += g.values.bytes() + g.quantized.bytes();
        s.buffers.push_back(std::move(g));
      }
    }
    staging_ = buffer<float>(*memory.gradients, shape{largest});
    made += staging_.bytes();
    require(made == planned.total(), std::string(op) + ": internal error: allocated " + std::to_string(made) +
                                         " bytes, bytes_required says " + std::to_string(planned.total()));
  }

  stage3_parameters(const stage3_parameters&) = delete;
  stage3_parameters& operator=(const stage3_parameters&) = delete;
  // Views still in the tensors point into buffers about to go: they are dropped (no reduction).
  ~stage3_parameters() {
    for (unit& x : units_)
      if (x.gathered || x.held_in >= 0) drop_views(x);
  }

  int rank() const noexcept { return rank_; }
  int ranks() const noexcept { return ranks_; }
  std::size_t unit_count() const noexcept { return units_.size(); }
  std::span<const stage3_unit_shape> unit_shapes() const noexcept { return shapes_; }
  bool gathered(std::size_t u) const { return at(u, "gathered").gathered; }
  // The unit's sharded Adam state (the unit must have dense parameters).
  const optimizer_type& optimizer(std::size_t u) const {
    const unit& x = at(u, "optimizer");
    require(x.optimizer != nullptr, "stage3_parameters::optimizer: unit " + std::to_string(u) + " has no dense parameters");
    return *x.optimizer;
  }
  tensor_view<const W> param_shard(std::size_t u) const { return at(u, "param_shard").param_shard.view(); }
  // This rank's slice of unit u's summed gradients (what the last release with gradients wrote).
  tensor_view<const float> grad_shard(std::size_t u) const { return at(u, "grad_shard").grad_shard.view(); }
  // Gathers so far (a recomputed layer is gathered again: checkpointing's cost in communication).
  std::int64_t gathers() const noexcept { return gathers_; }
  std::int64_t prefetches() const noexcept { return prefetches_; }  // of them, started by prefetch()

  // ---- the loop ----

  // Gathers unit `u`'s tensors into a free buffer of its slot (before the layer's forward, its recompute, its
  // backward), or takes the buffer a prefetch filled; with_gradients: also points the dense parameters'
  // gradients at the slot's zeroed gradient buffer.
  template <executor E, class C>
    requires ordered_communicator<C, E>
  void gather(const E& exec, const C& comm, std::size_t u, bool with_gradients) {
    const char* op = "stage3_parameters::gather";
    check_comm(op, comm);
    unit& x = at(u, op);
    require(!x.gathered, std::string(op) + ": unit " + std::to_string(u) + " is already gathered");
    slot& s = slots_[static_cast<std::size_t>(x.shape.slot)];
    if (x.held_in < 0) {
      fill(exec, comm, u, op);
    } else if constexpr (E::on_device) {
#if MEMKIT_HAS_CUDA
      s.buffers[static_cast<std::size_t>(x.held_in)].ready.wait(exec.stream);  // the prefetch's collectives are done
#endif
    }
    gather_buffer& g = s.buffers[static_cast<std::size_t>(x.held_in)];
    if (x.optimizer) {
      for (std::size_t i = 0; i < x.spec.parameters.size(); ++i) {
        placement_.place(g.values.data() + x.optimizer->flat_offset(i), buffer<W>::bytes_required(x.dims[i]));
        x.spec.parameters[i]->value = buffer<W>(placement_, x.dims[i]);
      }
      if (with_gradients) {
        require(s.gradients_holder < 0, std::string(op) + ": slot " + std::to_string(x.shape.slot) +
                                            "'s gradient buffer holds unit " + std::to_string(s.gradients_holder) +
                                            "'s gradients; release it before gathering unit " + std::to_string(u) + " with gradients");
        layers::zero_view(exec, s.grads.view().flat_slice(0, x.optimizer->flat_size()));
        for (std::size_t i = 0; i < x.spec.parameters.size(); ++i) {
          placement_.place(s.grads.data() + x.optimizer->flat_offset(i), buffer<float>::bytes_required(x.dims[i]));
          x.spec.parameters[i]->grad = buffer<float>(placement_, x.dims[i]);
        }
        s.gradients_holder = static_cast<int>(u);
      }
    }
    for (std::size_t k = 0; k < x.spec.quantized.size(); ++k) *x.spec.quantized[k] = std::move(x.staged[k]);
    x.staged.clear();
    x.gathered = true;
    x.with_gradients = with_gradients && x.optimizer != nullptr;
  }

  // Starts unit `u`'s gather into a free buffer of its slot on `side` (on CUDA a second stream: the collectives
  // overlap the current layer's kernels on the main stream, and gather() on the main stream waits for them
  // with an event; the buffer's previous unit is waited for the same way). On the host it is a gather done
  // early. The unit's tensors appear at gather(); a slot with one buffer has none free while a unit is in it.
  template <executor E, class C>
    requires ordered_communicator<C, E>
  void prefetch(const E& side, const C& comm, std::size_t u) {
    const char* op = "stage3_parameters::prefetch";
    check_comm(op, comm);
    unit& x = at(u, op);
    require(!x.gathered && x.held_in < 0, std::string(op) + ": unit " + std::to_string(u) + " is already gathered or prefetched");
    fill(side, comm, u, op);
    ++prefetches_;
    if constexpr (E::on_device) {
#if MEMKIT_HAS_CUDA
      slots_[static_cast<std::size_t>(x.shape.slot)].buffers[static_cast<std::size_t>(x.held_in)].ready.record(side.stream);
#endif
    }
  }
  bool prefetched(std::size_t u) const {
    const unit& x = at(u, "prefetched");
    return x.held_in >= 0 && !x.gathered;
  }

  // Releases unit `u`'s whole tensors (after the layer's forward or backward). If it was gathered with
  // gradients, first reduces them: rank r's slice of the rank-ordered sum lands in the unit's gradient slice.
  template <executor E, class C>
    requires ordered_communicator<C, E>
  void release(const E& exec, const C& comm, std::size_t u) {
    const char* op = "stage3_parameters::release";
    check_comm(op, comm);
    unit& x = at(u, op);
    require(x.gathered, std::string(op) + ": unit " + std::to_string(u) + " is not gathered");
    slot& s = slots_[static_cast<std::size_t>(x.shape.slot)];
    if (x.with_gradients) {
      const std::int64_t flat = x.optimizer->flat_size();
      ordered_reduce_scatter(exec, comm, tensor_view<const float>(s.grads.view().flat_slice(0, flat)), x.grad_shard.view(),
                             staging_.view().flat_slice(0, flat));
      s.gradients_holder = -1;
      x.reduced = true;
    }
    gather_buffer& g = s.buffers[static_cast<std::size_t>(x.held_in)];
    if constexpr (E::on_device) {
#if MEMKIT_HAS_CUDA
      g.freed.record(exec.stream);  // a later prefetch into this buffer waits for the kernels that read it
#endif
    }
    g.holder = -1;
    drop_views(x);
  }

  // One AdamW step of every unit with dense parameters, on its own slice (every unit released; its
  // gradients reduced this step).
  template <executor E, class C>
    requires ordered_communicator<C, E>
  void step(const E& exec, const C& comm, std::span<const optim::adam_group> groups, float gradient_scale = 1.0f) {
    const char* op = "stage3_parameters::step";
    check_comm(op, comm);
    for (std::size_t u = 0; u < units_.size(); ++u)
      require(!units_[u].gathered && units_[u].held_in < 0, std::string(op) + ": unit " + std::to_string(u) +
                                                                " is still gathered or prefetched; release it first");
    for (std::size_t u = 0; u < units_.size(); ++u)
      require(!units_[u].optimizer || units_[u].reduced,
              std::string(op) + ": unit " + std::to_string(u) +
                  "'s gradients were not reduced since the last step (gather it with gradients for its backward)");
    if constexpr (!E::on_device) {
      // One gradient norm over every unit: each unit's chunk sums (its own chunks' sums of squares, all-reduced
      // exactly), added unit after unit in chunk order, as one adam_state over all the units' tensors adds them.
      // Every unit on every rank decides from that total: one clip factor, and a non-finite sum anywhere skips
      // the step everywhere.
      double total = 0.0;
      std::int64_t first_bad = -1, first_chunk = 0;
      for (unit& x : units_) {
        if (!x.optimizer) continue;
        const std::span<const double> sums =
            x.optimizer->param_shard_chunk_sums(exec, comm, tensor_view<const float>(x.grad_shard.view()));
        optim::detail::add_chunk_sums(sums.data(), static_cast<std::int64_t>(sums.size()), first_chunk, total, first_bad);
        first_chunk += static_cast<std::int64_t>(sums.size());
      }
      for (unit& x : units_) {
        if (!x.optimizer) continue;
        x.reduced = false;
        const sharded_step_options o{.tensor_groups = x.spec.tensor_groups, .gradient_scale = gradient_scale};
        x.optimizer->step_param_shard_with_norm(exec, comm, total, first_bad, x.param_shard.view(),
                                                tensor_view<const float>(x.grad_shard.view()), groups, o,
                                                x.shape.master ? x.master_shard.view() : tensor_view<float>::none());
      }
    } else {
      // On a device each unit's state decides on its own norm (the decision stays on the device); clipping
      // needs the global norm, which is host-only in this version.
      require(max_grad_norm_ == 0.0f, std::string(op) + ": gradient clipping (max_grad_norm " + std::to_string(max_grad_norm_) +
                                          ") under stage 3 needs the global norm, computed on the host only in this "
                                          "version; on a device set max_grad_norm = 0");
      for (unit& x : units_) {
        if (!x.optimizer) continue;
        x.reduced = false;
        const sharded_step_options o{.tensor_groups = x.spec.tensor_groups, .gradient_scale = gradient_scale};
        x.optimizer->step_param_shard(exec, comm, x.param_shard.view(), tensor_view<const float>(x.grad_shard.view()),
                                      groups, o, x.shape.master ? x.master_shard.view() : tensor_view<float>::none());
      }
    }
  }

  // ---- checkpoints: one file per rank, re-sharded on load (N -> M) ----

  // Adds this rank's part to `out` (every unit released). Per unit k with dense parameters: metadata "stage3.k"
  // (element type, sizes, master, the tensors' names and shapes, rank count, rank: what
  // distributed::export_consolidated reads to write each tensor whole), U8 tensors "stage3.k.values" (this
  // rank's parameter slice), "stage3.k.master" (with master copies) and "stage3.k.adam" (the unit's sharded_adam_state image);
  // per NF4 tensor j, sharded_quantized::save under its quantized_names entry (or "stage3.k.nf4.j"). Metadata
  // "stage3" holds the unit count.
  template <executor E>
  void save(const E& exec, safetensors::writer& out) const {
    const char* op = "stage3_parameters::save";
    out.add_metadata("stage3", std::to_string(units_.size()));
    for (std::size_t k = 0; k < units_.size(); ++k) {
      const unit& x = units_[k];
      require(!x.gathered && x.held_in < 0, std::string(op) + ": unit " + std::to_string(k) + " is gathered or prefetched; release it first");
      const std::string name = "stage3." + std::to_string(k);
      for (std::size_t j = 0; j < x.quantized_shards.size(); ++j) x.quantized_shards[j].save(out, quantized_name(x, name, j));
      if (!x.optimizer) continue;
      std::ostringstream image;
      x.optimizer->save(exec, image);
      const std::string bytes = image.str();
      out.add_bytes(name + ".adam", "U8", {static_cast<std::int64_t>(bytes.size())}, bytes.data(), bytes.size());
      std::vector<detail::saved_piece> pieces{
          {".values", reinterpret_cast<const std::uint8_t*>(x.param_shard.data()), x.param_shard.bytes()}};
      if (x.shape.master)
        pieces.push_back({".master", reinterpret_cast<const std::uint8_t*>(x.master_shard.data()), x.master_shard.bytes()});
      detail::save_shard(out, name, layout_json(x) + ",\"ranks\":" + std::to_string(ranks_) + ",\"rank\":" +
                                        std::to_string(rank_) + "}", pieces);
    }
  }

  // Replaces this rank's slices, optimizer states and NF4 shards with those of a save made on any number of
  // ranks: `images` are ALL ranks' files of that save, in any order. Everything is checked against this
  // runtime's units (count, element type, sizes, master copies, NF4 shapes and options, each rank once, every
  // piece's size; the Adam images as sharded_adam_state::load checks them, including the run) before a unit
  // changes; a unit changes only after its own checks.
  template <executor E>
  void load(const E& exec, std::span<const safetensors::reader* const> images) {
    const std::string op = "stage3_parameters::load";
    require(!images.empty() && images.front() != nullptr, op + ": no images");
    for (const unit& x : units_) require(!x.gathered && x.held_in < 0, op + ": a unit is gathered or prefetched; release it first");
    for (const safetensors::reader* image : images) {
      require(image != nullptr, op + ": a null image");
      const std::string* count = nullptr;
      for (const auto& [key, value] : image->metadata())
        if (key == "stage3") count = &value;
      require(count != nullptr && *count == std::to_string(units_.size()),
              op + ": '" + image->path() + "' holds " + (count ? *count : std::string("no")) + " stage-3 units, this model " +
                  std::to_string(units_.size()));
    }
    for (std::size_t k = 0; k < units_.size(); ++k) {
      unit& x = units_[k];
      const std::string name = "stage3." + std::to_string(k);
      if (x.optimizer) {
        const std::string what = op + " (unit " + std::to_string(k) + ")";
        const std::vector<const safetensors::reader*> old = detail::order_images(images, name, what);
        const int old_ranks = static_cast<int>(old.size());
        const std::string expected = layout_json(x) + ",\"ranks\":" + std::to_string(old_ranks);
        for (const safetensors::reader* image : old)
          require(detail::layout_without_rank(*image, name) == expected,
                  what + ": '" + image->path() + "' holds another unit (" + detail::layout_without_rank(*image, name) +
                      "}), not " + expected + "}");
        const std::int64_t old_shard = optimizer_type::shard_size(x.shape.sizes, old_ranks);
        std::vector<const char*> suffixes{".values"};
        std::vector<std::size_t> unit_bytes{sizeof(W)};
        if (x.shape.master) {
          suffixes.push_back(".master");
          unit_bytes.push_back(sizeof(float));
        }
        for (const safetensors::reader* image : old)
          for (std::size_t i = 0; i < suffixes.size(); ++i) {
            const safetensors::tensor_info* t = image->find(name + suffixes[i]);
            require(t != nullptr && t->dtype == "U8" && t->bytes() == static_cast<std::uint64_t>(old_shard) * unit_bytes[i],
                    what + ": '" + image->path() + "': '" + name + suffixes[i] + "' is missing or not " +
                        std::to_string(old_shard * static_cast<std::int64_t>(unit_bytes[i])) + " bytes of U8");
          }
        // The Adam images first: sharded_adam_state::load checks them all before changing the state.
        std::vector<std::istringstream> streams;
        streams.reserve(old.size());
        for (const safetensors::reader* image : old) {
          const safetensors::tensor_info* t = image->find(name + ".adam");
          require(t != nullptr && t->dtype == "U8", what + ": '" + image->path() + "' has no '" + name + ".adam'");
          std::string bytes(static_cast<std::size_t>(t->bytes()), '\0');
          image->read_bytes(name + ".adam", bytes.data(), bytes.size());
          streams.emplace_back(std::move(bytes));
        }
        std::vector<std::istream*> adam_images;
        for (std::istringstream& stream : streams) adam_images.push_back(&stream);
        x.optimizer->load(exec, std::span<std::istream* const>(adam_images));
        x.reduced = false;  // the gradient slices are not saved: a backward comes before the next step
        // The slices: the flat layout's elements [rank * shard, (rank + 1) * shard) from the old slices.
        std::int64_t logical = 0;
        for (std::int64_t n : x.shape.sizes) logical += optimizer_type::padded(n);
        const std::int64_t shard = x.optimizer->shard_size();
        std::vector<std::uint8_t> values(static_cast<std::size_t>(shard) * sizeof(W), 0), masters;
        std::vector<std::uint8_t*> destination{values.data()};
        if (x.shape.master) {
          masters.assign(static_cast<std::size_t>(shard) * sizeof(float), 0);
          destination.push_back(masters.data());
        }
        detail::reshard_pieces(old, name, suffixes, unit_bytes, old_shard, shard, logical, rank_, destination);
        layers::copy_in(reinterpret_cast<const W*>(values.data()), x.param_shard.view());
        if (x.shape.master) layers::copy_in(reinterpret_cast<const float*>(masters.data()), x.master_shard.view());
      }
      for (std::size_t j = 0; j < x.quantized_shards.size(); ++j) {
        quantized_shard loaded = quantized_shard::load(images, quantized_name(x, name, j), rank_, ranks_, *weights_);
        require(loaded.logical_shape() == x.quantized_shards[j].logical_shape() &&
                    loaded.options().block_size == x.quantized_shards[j].options().block_size &&
                    loaded.options().double_quant == x.quantized_shards[j].options().double_quant,
                op + ": NF4 tensor " + std::to_string(j) + " of unit " + std::to_string(k) + " was saved with another shape or options");
        x.quantized_shards[j] = std::move(loaded);
      }
    }
  }

 private:
  struct unit {
    unit_spec spec;
    stage3_unit_shape shape;
    std::vector<memkit::shape> dims;
    std::unique_ptr<optimizer_type> optimizer;  // null without dense parameters
    buffer<W> param_shard;
    buffer<float> grad_shard, master_shard;
    std::vector<quantized_shard> quantized_shards;
    std::vector<quantized_type> staged;  // NF4 tensors gathered by a prefetch, handed over at gather()
    int held_in = -1;                    // the slot's buffer holding the unit (gathered or prefetched), or -1
    bool gathered = false, with_gradients = false;
    bool reduced = false;  // its gradient slice holds this step's reduction
  };
  // The checkpoint name of unit x's NF4 tensor j (`name`: the unit's "stage3.k").
  static std::string quantized_name(const unit& x, const std::string& name, std::size_t j) {
    return x.spec.quantized_names.empty() ? name + ".nf4." + std::to_string(j) : x.spec.quantized_names[j];
  }
  // A unit's saved layout up to its rank count: element type, master copies, sizes, and each tensor's name and
  // shape (what distributed::export_consolidated needs to write the tensors whole under their names).
  static std::string layout_json(const unit& x) {
    const stage3_unit_shape& u = x.shape;
    std::string text = std::string("{\"format\":\"memkit.stage3\",\"dtype\":\"") + safetensors::dtype_of<W>() +
                       "\",\"master\":" + (u.master ? "true" : "false") + ",\"sizes\":[";
    for (std::size_t i = 0; i < u.sizes.size(); ++i) {
      text += i ? "," : "";  // two appends, not "," + to_string(...): GCC 12 at -O3 warns (-Wrestrict) on that
      text += std::to_string(u.sizes[i]);
    }
    text += "],\"names\":[";
    for (std::size_t i = 0; i < x.spec.parameters.size(); ++i) {
      text += i ? "," : "";
      text += detail::json_quoted(x.spec.parameters[i]->name);
    }
    text += "],\"shapes\":[";
    for (std::size_t i = 0; i < x.dims.size(); ++i) {
      text += i ? ",[" : "[";
      for (int d = 0; d < x.dims[i].rank; ++d) {
        text += d ? "," : "";  // two appends, not "," + to_string(...): GCC 12 at -O3 warns (-Wrestrict) on that
        text += std::to_string(x.dims[i].extents[d]);
      }
      text += "]";
    }
    return text + "]";
  }
  // One gather buffer of a slot: the dense values and the NF4 area of the slot's largest unit.
  struct gather_buffer {
    explicit gather_buffer(memory_kind kind) : slab(std::make_unique<detail::slab_resource>(kind)) {}
    buffer<W> values;
    buffer<std::byte> quantized;
    std::unique_ptr<detail::slab_resource> slab;  // the NF4 tensors' buffers in `quantized` (stable address)
    int holder = -1;                              // the unit in it (gathered or prefetched), or -1
    detail::buffer_event ready, freed;
  };
  struct slot {
    std::int64_t flat = 0;
    std::size_t quantized_bytes = 0;
    std::vector<gather_buffer> buffers;
    buffer<float> grads;
    int gradients_holder = -1;  // the unit whose gradients are in `grads`, or -1
  };
  // Claims a free buffer of unit u's slot and runs the unit's collectives into it on `exec`.
  template <executor E, class C>
  void fill(const E& exec, const C& comm, std::size_t u, const char* op) {
    unit& x = units_[u];
    slot& s = slots_[static_cast<std::size_t>(x.shape.slot)];
    int free = -1;
    std::string held;
    for (std::size_t b = 0; b < s.buffers.size(); ++b) {
      if (s.buffers[b].holder < 0 && free < 0) free = static_cast<int>(b);
      if (s.buffers[b].holder >= 0) held += (held.empty() ? "" : ", ") + std::to_string(s.buffers[b].holder);
    }
    require(free >= 0, std::string(op) + ": slot " + std::to_string(x.shape.slot) + " holds unit " + held +
                           "; release it before gathering unit " + std::to_string(u) + " (" + std::to_string(s.buffers.size()) +
                           " buffer" + (s.buffers.size() == 1 ? "" : "s") + " in the slot)");
    gather_buffer& g = s.buffers[static_cast<std::size_t>(free)];
    if constexpr (E::on_device) {
#if MEMKIT_HAS_CUDA
      g.freed.wait(exec.stream);  // the buffer's previous unit's kernels are done with it
#endif
    }
    if (x.optimizer) {
      require_accessible(exec, g.values.view(), op, "gather buffer");
      comm.all_gather(exec, x.param_shard.data(), g.values.data(), x.optimizer->shard_size());
    }
    g.slab->reset(g.quantized.data(), g.quantized.bytes());
    x.staged.clear();
    for (const quantized_shard& shard : x.quantized_shards) {
      x.staged.emplace_back(*g.slab, shard.logical_shape(), shard.options());
      shard.gather(exec, comm, x.staged.back(), *workspace_);
    }
    ++gathers_;
    g.holder = static_cast<int>(u);
    x.held_in = free;
  }
  void drop_views(unit& x) {
    for (parameter* p : x.spec.parameters) {
      p->value = buffer<W>();
      p->grad = buffer<float>();
    }
    for (quantized_type* q : x.spec.quantized) *q = quantized_type();
    x.staged.clear();
    x.gathered = x.with_gradients = false;
    x.held_in = -1;
  }
  unit& at(std::size_t u, const char* op) {
    require(u < units_.size(), std::string(op) + ": no unit " + std::to_string(u) + " (" + std::to_string(units_.size()) + " units)");
    return units_[u];
  }
  const unit& at(std::size_t u, const char* op) const { return const_cast<stage3_parameters*>(this)->at(u, op); }
  template <class C>
  void check_comm(const char* op, const C& comm) const {
    require(comm.size() == ranks_ && comm.rank() == rank_,
            std::string(op) + ": the communicator is rank " + std::to_string(comm.rank()) + " of " +
                std::to_string(comm.size()) + ", the shards are rank " + std::to_string(rank_) + " of " + std::to_string(ranks_));
  }

  int rank_ = 0, ranks_ = 1;
  float max_grad_norm_ = 0.0f;
  std::int64_t gathers_ = 0, prefetches_ = 0;
  memory_resource* workspace_ = nullptr;
  memory_resource* weights_ = nullptr;
  std::vector<unit> units_;
  std::vector<stage3_unit_shape> shapes_;
  std::vector<slot> slots_;
  buffer<float> staging_;
  detail::placement_resource placement_;
};

// A layer whose parameters are stage-3 unit `unit`: its forward gathers them (without gradients) and releases
// them after; its backward gathers them with gradients and releases them after, reducing the gradients. What
// memkit::checkpoint::segment runs, unchanged: a forward it recomputes in backward gathers again.
//   std::vector<stage3_layer<block, runtime_type, C>> wrapped;   // one per block, unit i
//   checkpoint::segment stack(checkpoint::layer_sequence(wrapped, final_norm), options);
template <class Layer, class Runtime, class C>
struct stage3_layer {
  using value_type = typename Layer::value_type;
  Layer* layer = nullptr;
  Runtime* runtime = nullptr;
  const C* comm = nullptr;
  std::size_t unit = 0;

  shape output_shape(const shape& in) const { return layer->output_shape(in); }
  std::size_t saved_bytes(const shape& in, const forward_context& ctx) const { return layer->saved_bytes(in, ctx); }
  std::size_t workspace_bytes(const shape& in) const
    requires requires(const Layer& l) { l.workspace_bytes(in); }
  {
    return layer->workspace_bytes(in);
  }
  template <executor E>
  void forward(const E& exec, const forward_context& ctx, tensor_view<const value_type> x, tensor_view<value_type> y,
               activation_store& store) {
    runtime->gather(exec, *comm, unit, false);
    layer->forward(exec, ctx, x, y, store);
    runtime->release(exec, *comm, unit);
  }
  template <executor E>
  void backward(const E& exec, tensor_view<const value_type> dy, tensor_view<value_type> dx, activation_store& store) {
    runtime->gather(exec, *comm, unit, true);
    layer->backward(exec, dy, dx, store);
    runtime->release(exec, *comm, unit);
  }
  void discard_forward(activation_store& store)
    requires requires(Layer& l) { l.discard_forward(store); }
  {
    layer->discard_forward(store);
  }
};

}  // namespace distributed
MEMKIT_NAMESPACE_END
