// memkit/distributed/sharded_adam_state.hpp — adam_state split across ranks (ZeRO stages 1 and 2).
//
// Each of N ranks keeps the AdamW moments of 1/N of the parameters; the parameters themselves stay
// whole on every rank. The flavours are adam_state's (fp32, bf16, 8-bit, 4-bit moments) with the same
// step arithmetic and codecs, so N ranks produce parameters bit-identical to one adam_state given the
// same (summed) gradients.
//
// The flat layout. Collectives move one contiguous buffer in equal parts per rank, so parameters and
// gradients live in one flat buffer each: tensor i starts at flat_offset(i), each tensor padded to a
// multiple of `granule` = 4096 elements, the total padded to a multiple of N * granule. Rank r owns
// the flat range [r * shard_size, (r + 1) * shard_size): the pieces of the tensors that fall in it.
// Because every piece starts on a multiple of 4096 within its tensor, it holds whole quantization
// blocks (blocks are at most 4096) and whole gradient-norm chunks (adam_state's 4096-element chunks),
// which is what makes the sharded step bit-identical. Padding elements are never read as parameters;
// their gradients are summed along and ignored.
//
// A step:
//   stage 1  step_full_gradients: all-reduce the full gradients (in place), update the own shard,
//            all-gather the parameters.
//   stage 2  step_shard_gradients: the gradients arrive already reduce-scattered (reduce_scatter_
//            gradients, or the caller's own bucketed reduce-scatter), update, all-gather the parameters.
//   stage 3  step_param_shard: the parameters are sharded too (distributed/stage3.hpp): the own slices of
//            the parameters and of the summed gradients are updated, nothing is gathered.
// The gradient norm and the non-finite check are global: each rank computes adam_state's per-chunk
// sums of squares for its own chunks, the chunk sums are all-reduced (every other rank contributes an
// exact 0.0, so the sum is exact in any order), and every rank runs the same finalisation on the same
// numbers: the same clipping factor, and a skip on one rank is a skip on all.
//
// Memory per rank (bytes_required(sizes, rank, ranks), exact): a control block, the gradient-norm
// scratch for ALL chunks (8 bytes per 4096 parameters of the whole model: the all-reduce needs the
// full array), and the moments of the own pieces, each segment aligned to 64 bytes. A rank owns at
// most shard_size elements; the remainder over 1/N of adam_state's bytes is that scratch, up to four
// 64-byte alignments per piece, and the granule padding (docs/sharding.md).
//
// Executors: the host (state in host memory, e.g. over mpi_communicator), or under nvcc a cuda_executor
// (state in device memory, everything enqueued on the stream, e.g. over nccl_communicator): the device
// step launches adam_state's own norm, finalisation and update kernels on the pieces. On the device a
// skipped step still all-gathers (the decision stays on the device; the parameters are unchanged on
// every rank, so the gather rewrites the same values).
#pragma once

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <istream>
#include <ostream>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/distributed/communicator.hpp"
#include "memkit/distributed/detail/sharded_image.hpp"
#include "memkit/distributed/sharded_adam_bytes.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/optim/adam_math.hpp"
#include "memkit/optim/adam_state.hpp"
#include "memkit/optim/detail/adam_checks.hpp"
#include "memkit/optim/detail/adam_image.hpp"
#include "memkit/optim/state_codecs.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace distributed {

struct sharded_step_options {
  std::span<const int> tensor_groups{};  // the group of each tensor; empty: every tensor in group 0
  float gradient_scale = 1.0f;           // multiplies every (summed) gradient, e.g. 1/ranks to average
};

template <class State, int Block = optim::adam_state_traits<State>::default_block>
class sharded_adam_state : public sharded_adam_layout<State, Block> {
  using traits = optim::adam_state_traits<State>;
  using unsharded = optim::adam_state<State, Block>;
  using layout = sharded_adam_layout<State, Block>;

 public:
  using state_type = State;
  static constexpr bool quantized = traits::quantized;
  static constexpr int block_size = Block;
  using moment_type = typename traits::moment_type;
  using plain_moment_type = std::conditional_t<quantized, float, moment_type>;
  using layout::granule;

 private:
  static constexpr std::int64_t divisor_block = Block > 0 ? Block : 1;

 public:
  // The flat layout and the memory per rank are sharded_adam_layout's (distributed/sharded_adam_bytes.hpp):
  // flat_size, shard_size, piece_bytes, plan, bytes_required, max_bytes_per_rank; with options:
  using layout::bytes_required;
  using layout::max_bytes_per_rank;
  static constexpr std::size_t bytes_required(std::span<const std::int64_t> sizes, int rank, int ranks,
                                              const optim::adam_options& options = {}) {
    return layout::bytes_required(sizes, rank, ranks, options.min_quantized_size);
  }
  static constexpr std::size_t max_bytes_per_rank(std::span<const std::int64_t> sizes, int ranks,
                                                  const optim::adam_options& options = {}) {
    return layout::max_bytes_per_rank(sizes, ranks, options.min_quantized_size);
  }
  using layout::flat_size;
  using layout::padded;
  using layout::piece_bytes;
  using layout::plan;
  using layout::shard_size;

  // ---- Construction ----

  // Rank comm.rank() of comm.size() ranks; every rank constructs with the same sizes and options.
  // `run_id` names the training run this state belongs to; every rank image carries it (see load()). 0, the
  // default, draws a fresh random id on rank 0 and broadcasts it (one collective of 8 bytes, only when
  // there is more than one rank); a nonzero id (a job id; a fixed number in tests) is taken as given, with
  // no collective, and must then be the same on every rank.
  template <executor E, class C>
    requires communicator<C, E>
  sharded_adam_state(const E& exec, const C& comm, memory_resource& resource, std::span<const std::int64_t> sizes,
                     optim::adam_options options = {}, std::uint64_t run_id = 0)
      : rank_(comm.rank()), ranks_(comm.size()) {
    optim::detail::validate_adam_options(options, "sharded_adam_state");
    require(ranks_ >= 1 && rank_ >= 0 && rank_ < ranks_, "sharded_adam_state: communicator reports rank " +
                                                             std::to_string(rank_) + " of " + std::to_string(ranks_));
    require(!sizes.empty(), "sharded_adam_state: no tensors");
    for (std::size_t i = 0; i < sizes.size(); ++i)
      require(sizes[i] > 0, "sharded_adam_state: tensor " + std::to_string(i) + " has " + std::to_string(sizes[i]) +
                                " elements; every tensor needs at least one");
    sizes_.assign(sizes.begin(), sizes.end());
    std::int64_t flat = 0, chunks = 0;
    for (std::int64_t n : sizes_) {
      flat_offsets_.push_back(flat);
      optim::detail::adam_tensor_layout t;  // only its chunk range: report() names a tensor by it
      t.size = n;
      t.first_chunk = chunks;
      t.chunks = optim::detail::reduction_chunks(n);
      tensor_chunks_.push_back(t);
      flat += padded(n);
      chunks += optim::detail::reduction_chunks(n);
    }
    flat_size_ = flat_size(sizes, ranks_);
    shard_size_ = flat_size_ / ranks_;
    const std::size_t bytes =
        plan(sizes, rank_, ranks_, options.min_quantized_size, [&](const shard_piece& p) { pieces_.push_back(p); });
    // To the state core, a piece is a tensor of its own (its chunks start at the piece's global first chunk).
    for (const shard_piece& p : pieces_) {
      optim::detail::adam_tensor_layout t;
      t.size = p.count();
      t.quantized = p.quantized;
      t.units = p.quantized ? (t.size + divisor_block - 1) / divisor_block
                            : (t.size + optim::detail::plain_unit - 1) / optim::detail::plain_unit;
      t.m_offset = p.m_offset;
      t.v_offset = p.v_offset;
      t.m_scale_offset = p.m_scale_offset;
      t.v_scale_offset = p.v_scale_offset;
      t.first_chunk = p.first_chunk;
      t.chunks = optim::detail::reduction_chunks(t.size);
      piece_layouts_.push_back(t);
    }
    core_ = core("sharded_adam_state", resource, bytes, chunks, options);
    require_accessible(exec, arena_view(), "sharded_adam_state", "optimizer state");
    run_id_ = run_id != 0 ? run_id : shared_fresh_run_id(exec, comm);
    run_id_bound_ = run_id != 0;
    reset(exec);
  }

  sharded_adam_state(const sharded_adam_state&) = delete;
  sharded_adam_state& operator=(const sharded_adam_state&) = delete;
  sharded_adam_state(sharded_adam_state&&) noexcept = default;
  sharded_adam_state& operator=(sharded_adam_state&&) noexcept = default;

  // Zeroes the moments and the control block (step 0, initial loss scale).
  template <executor E>
  void reset(const E& exec) {
    core_.reset(exec);
  }

  int rank() const noexcept { return rank_; }
  int ranks() const noexcept { return ranks_; }
  std::size_t tensor_count() const noexcept { return sizes_.size(); }
  std::int64_t size(std::size_t tensor) const { return sizes_.at(tensor); }
  std::int64_t flat_size() const noexcept { return flat_size_; }
  std::int64_t shard_size() const noexcept { return shard_size_; }
  std::int64_t shard_begin() const noexcept { return static_cast<std::int64_t>(rank_) * shard_size_; }
  std::int64_t flat_offset(std::size_t tensor) const { return flat_offsets_.at(tensor); }
  std::span<const shard_piece> pieces() const noexcept { return pieces_; }
  std::size_t bytes() const noexcept { return core_.bytes(); }
  memory_kind where() const noexcept { return core_.where(); }
  tensor_view<const std::byte> arena_view() const noexcept { return core_.view(); }
  const optim::adam_options& options() const noexcept { return core_.options(); }
  // The run this state belongs to (never 0), saved in every rank image. load() refuses images of different
  // runs together, and images of another run than this state's once the state is bound to its run: its id
  // was given (constructor, set_run_id), or it has stepped or loaded. A fresh state with a drawn id takes
  // the id of the images it loads (resuming a run in a new process).
  std::uint64_t run_id() const noexcept { return run_id_; }
  bool run_id_bound() const noexcept { return run_id_bound_; }
  void set_run_id(std::uint64_t id) {
    require(id != 0, "sharded_adam_state::set_run_id: 0 is not a run id");
    run_id_ = id;
    run_id_bound_ = true;
  }
  void set_max_grad_norm(float max_norm) { core_.set_max_grad_norm(max_norm); }

  // A view of tensor `tensor` inside a flat buffer (parameters or gradients).
  template <class T>
  tensor_view<T> tensor_in(tensor_view<T> flat, std::size_t tensor) const {
    require(flat.size() == flat_size_, "sharded_adam_state::tensor_in: the flat buffer has " +
                                           std::to_string(flat.size()) + " elements, the layout " +
                                           std::to_string(flat_size_));
    return flat.flat_slice(flat_offset(tensor), size(tensor));
  }

  // ---- Steps ----

  // Stage 2's gradient reduction: sums the ranks' full local gradients and leaves this rank's shard
  // (shard_size elements) in `grad_shard`.
  template <executor E, class C, float_storage G>
    requires communicator<C, E>
  void reduce_scatter_gradients(const E& exec, const C& comm, tensor_view<const G> grads, tensor_view<G> grad_shard) const {
    const char* op = "sharded_adam_state::reduce_scatter_gradients";
    check_comm(op, comm);
    require(grads.size() == flat_size_, std::string(op) + ": grads has " + std::to_string(grads.size()) +
                                            " elements, the flat layout " + std::to_string(flat_size_));
    require(grad_shard.size() == shard_size_, std::string(op) + ": grad_shard has " + std::to_string(grad_shard.size()) +
                                                  " elements, a shard " + std::to_string(shard_size_));
    require_accessible(exec, grads, op, "grads");
    require_accessible(exec, grad_shard, op, "grad_shard");
    comm.reduce_scatter(exec, grads.data(), grad_shard.data(), shard_size_);
  }

  // Stage 1: `grads` (flat_size) holds this rank's gradients and is all-reduced in place (the sum over
  // ranks; options.gradient_scale = 1/ranks averages). `params` (flat_size) is the same on every rank
  // before and after. `master` (optional, shard_size fp32, for 16-bit parameters) is this rank's
  // shard of the master weights.
  template <executor E, class C, float_storage P, float_storage G>
    requires communicator<C, E>
  void step_full_gradients(const E& exec, const C& comm, tensor_view<P> params, tensor_view<G> grads,
                           std::span<const optim::adam_group> groups, const sharded_step_options& options = {},
                           tensor_view<float> master = {}) {
    const char* op = "sharded_adam_state::step_full_gradients";
    validate_step(exec, comm, op, params, tensor_view<const G>(grads), flat_size_, groups, options, master);
    comm.all_reduce(exec, grads.data(), grads.data(), flat_size_);
    step_on(exec, comm, params, 0, true, grads.data(), 0, groups, options, master);
  }

  // Stage 2: `grad_shard` (shard_size) holds this rank's shard of the summed gradients.
  template <executor E, class C, float_storage P, float_storage G>
    requires communicator<C, E>
  void step_shard_gradients(const E& exec, const C& comm, tensor_view<P> params, tensor_view<const G> grad_shard,
                            std::span<const optim::adam_group> groups, const sharded_step_options& options = {},
                            tensor_view<float> master = {}) {
    const char* op = "sharded_adam_state::step_shard_gradients";
    validate_step(exec, comm, op, params, grad_shard, shard_size_, groups, options, master);
    step_on(exec, comm, params, 0, true, grad_shard.data(), shard_begin(), groups, options, master);
  }

  // Stage 3: the parameters are sharded too. `param_shard` (shard_size) is this rank's slice of the flat
  // parameters, `grad_shard` (shard_size) its slice of the summed gradients; only the slice is updated and
  // nothing is gathered (the caller gathers a layer's parameters when it runs: distributed/stage3.hpp).
  template <executor E, class C, float_storage P, float_storage G>
    requires communicator<C, E>
  void step_param_shard(const E& exec, const C& comm, tensor_view<P> param_shard, tensor_view<const G> grad_shard,
                        std::span<const optim::adam_group> groups, const sharded_step_options& options = {},
                        tensor_view<float> master = {}) {
    const char* op = "sharded_adam_state::step_param_shard";
    validate_step(exec, comm, op, param_shard, grad_shard, shard_size_, groups, options, master, shard_size_);
    step_on(exec, comm, param_shard, shard_begin(), false, grad_shard.data(), shard_begin(), groups, options, master);
  }

  // Stage 3 with ONE gradient norm over several states (stage3_parameters on the host: a state per unit), in two
  // calls. param_shard_chunk_sums: the norm pass over this rank's pieces of `grad_shard` and the all-reduce of the
  // chunk sums (exact: one rank contributes each chunk), returned in this state's chunk order. Then the caller
  // adds every state's sums in order with optim::detail::add_chunk_sums (what one adam_state over all the states'
  // tensors adds, in the same order) and calls step_param_shard_with_norm on every state with the total: every
  // state on every rank takes the same decision (clip factor, skip on a non-finite sum anywhere). Host only.
  template <executor E, class C, float_storage G>
    requires communicator<C, E>
  std::span<const double> param_shard_chunk_sums(const E& exec, const C& comm, tensor_view<const G> grad_shard) {
    static_assert(!E::on_device, "sharded_adam_state::param_shard_chunk_sums: host only");
    const char* op = "sharded_adam_state::param_shard_chunk_sums";
    require(comm.size() == ranks_ && comm.rank() == rank_, std::string(op) + ": the communicator is not this state's");
    require(grad_shard.size() == shard_size_, std::string(op) + ": grad_shard has " + std::to_string(grad_shard.size()) +
                                                  " elements, the shard " + std::to_string(shard_size_));
    require_accessible(exec, grad_shard, op, "grad_shard");
    double* sums = core_.host_chunk_sums();
    std::fill(sums, sums + core_.total_chunks(), 0.0);
    for (std::size_t k = 0; k < pieces_.size(); ++k)
      core_.host_norm(piece_layouts_[k], grad_of(pieces_[k], grad_shard.data(), shard_begin()));
    comm.all_reduce(exec, sums, sums, core_.total_chunks());
    return {sums, static_cast<std::size_t>(core_.total_chunks())};
  }
  // The decision from `total` (the sum of squares over all states' chunks) and `first_bad` (the first non-finite
  // chunk, -1: none), then, if it applies, the update of this rank's slice as step_param_shard does. Returns
  // whether the step applied.
  template <executor E, class C, float_storage P, float_storage G>
    requires communicator<C, E>
  bool step_param_shard_with_norm(const E& exec, const C& comm, double total, std::int64_t first_bad,
                                  tensor_view<P> param_shard, tensor_view<const G> grad_shard,
                                  std::span<const optim::adam_group> groups, const sharded_step_options& options = {},
                                  tensor_view<float> master = {}) {
    static_assert(!E::on_device, "sharded_adam_state::step_param_shard_with_norm: host only");
    const char* op = "sharded_adam_state::step_param_shard_with_norm";
    validate_step(exec, comm, op, param_shard, grad_shard, shard_size_, groups, options, master, shard_size_);
    run_id_bound_ = true;
    optim::detail::decide_step(core_.host_control(), total, first_bad, core_.options().max_grad_norm,
                               core_.options().loss_scaling, options.gradient_scale);
    if (core_.host_control().applied == 0) return false;
    for (std::size_t k = 0; k < pieces_.size(); ++k) {
      const shard_piece& p = pieces_[k];
      core_.host_update(piece_layouts_[k],
                        core_.host_access(p.tensor, param_of(p, param_shard, shard_begin()),
                                          grad_of(p, grad_shard.data(), shard_begin()), master_of(p, master), p.begin),
                        groups[static_cast<std::size_t>(group_of(p, options))]);
    }
    return true;
  }

  // Copies this rank's shard of `params` into `master` (fp32): the start of training with master weights.
  // Host-accessible views (copy device parameters to the host first, or convert on the device yourself).
  template <float_storage P>
  void initialize_master(tensor_view<const P> params, tensor_view<float> master) const {
    require(params.size() == flat_size_ && master.size() == shard_size_,
            "sharded_adam_state::initialize_master: need flat_size parameters and a shard_size master");
    require(host_executor::can_access(params.where()) && host_executor::can_access(master.where()),
            "sharded_adam_state::initialize_master: needs host-accessible views");
    for (std::int64_t i = 0; i < shard_size_; ++i) master[i] = to_float(params[shard_begin() + i]);
  }

  // ---- Inspection ----

  // On CUDA this waits for the executor's stream (a read-back for logging and tests).
  template <executor E>
  optim::adam_control control(const E& exec) const {
    return core_.control(exec);
  }
  template <executor E>
  optim::adam_step_report report(const E& exec) const {
    return core_.report(exec, tensor_chunks_);
  }
  // The dequantized moments of this rank's piece of `tensor` (elements [begin, end) of the piece;
  // empty when this rank owns none of it).
  template <executor E>
  void read_moments(const E& exec, std::size_t tensor, std::vector<float>& m, std::vector<float>& v) const {
    require(tensor < sizes_.size(), "sharded_adam_state::read_moments: no tensor " + std::to_string(tensor));
    const std::vector<std::byte> image = host_copy(exec);
    m.clear();
    v.clear();
    for (const shard_piece& p : pieces_) {
      if (p.tensor != static_cast<std::int64_t>(tensor)) continue;
      for (std::int64_t i = 0; i < p.count(); ++i) {
        m.push_back(core::load_moment(image.data(), layout_of(p), i, true));
        v.push_back(core::load_moment(image.data(), layout_of(p), i, false));
      }
    }
  }

  // ---- Save / load per rank, with re-sharding ----
  // The checksum an image carries after its body (tests forge images with it: it catches accidents, not forgery).
  static std::uint64_t image_checksum(const char* data, std::size_t size) noexcept {
    return optim::detail::image_checksum(data, size);
  }

  // Version 2 added the run identity; version 1 images are refused (they cannot say which run they are from).
  static constexpr std::uint32_t format_version = 2;
  static std::string format_name() { return std::string("memkit.sharded_adam_state.") + traits::name; }

  // Writes this rank's image: the layout it was made for, the control block and its pieces' moments.
  template <executor E>
    void save(const E& exec, std::ostream& out) const;

  // Restores the state from the images of ALL ranks of a save, made with any number of ranks (N -> M
  // re-sharding): `images[k]` is any one rank's image, each rank's exactly once. Only the parts that
  // fall in this rank's shard are kept. Everything is checked (format, flavour, block, maps, threshold,
  // tensor sizes, each image's layout, checksums, that all images hold the same step) before a byte of
  // this state changes.
  template <executor E>
    void load(const E& exec, std::span<std::istream* const> images);
  template <executor E>
  void load(const E& exec, std::istream& image) {
    std::istream* one[] = {&image};
    load(exec, std::span<std::istream* const>(one));
  }

 private:
  static constexpr const char* magic = "memkit-sharded-adam-state";

  template <executor E, class C, float_storage P, float_storage G>
  void step_on(const E& exec, const C& comm, tensor_view<P> params, std::int64_t params_begin, bool gather_params,
               const G* grads, std::int64_t grads_begin,
               std::span<const optim::adam_group> groups, const sharded_step_options& options, tensor_view<float> master) {
    run_id_bound_ = true;  // this state now holds a step of its run
    if constexpr (!E::on_device) {
      host_step(exec, comm, params, params_begin, gather_params, grads, grads_begin, groups, options, master);
    } else {
#if MEMKIT_HAS_CUDA
      device_step(exec, comm, params, params_begin, gather_params, grads, grads_begin, groups, options, master);
#endif
    }
  }

  // A new run's id: rank 0 draws it (random_device mixed with the clock; never 0) and, with more than one
  // rank, broadcasts it (through the arena's first bytes on a device executor; reset() follows).
  template <executor E, class C>
  std::uint64_t shared_fresh_run_id(const E& exec, const C& comm) {
    std::uint64_t id = 0;
    if (rank_ == 0) {
      // Entropy from /dev/urandom and the clock, without <random> and <chrono> (together ~50 MB of compiler
      // memory for every user of memkit.hpp).
      std::uint64_t drawn = 0;
      if (std::FILE* urandom = std::fopen("/dev/urandom", "rb")) {
        if (std::fread(&drawn, sizeof drawn, 1, urandom) != 1) drawn = 0;
        std::fclose(urandom);
      }
      timespec clock{};
      ::clock_gettime(CLOCK_MONOTONIC, &clock);
      const auto now = static_cast<std::uint64_t>(clock.tv_sec) * 1000000000ull + static_cast<std::uint64_t>(clock.tv_nsec);
      id = memkit::detail::mix64(drawn ^ memkit::detail::mix64(now));
      if (id == 0) id = 1;
    }
    if (ranks_ > 1) {
      if constexpr (!E::on_device) {
        comm.broadcast(exec, reinterpret_cast<std::byte*>(&id), static_cast<std::int64_t>(sizeof id), 0);
      } else {
        core_.copy_in(exec, &id, sizeof id);
        comm.broadcast(exec, core_.data(), static_cast<std::int64_t>(sizeof id), 0);
        core_.copy_out(exec, &id, 0, sizeof id);
      }
    }
    require(id != 0, "sharded_adam_state: the run id broadcast from rank 0 arrived as 0");
    return id;
  }

  // The whole arena on the host: the arena itself, or a copy (waits for the stream) of device memory.
  template <executor E>
  std::vector<std::byte> host_copy(const E& exec) const {
    std::vector<std::byte> bytes(core_.bytes());
    core_.copy_out(exec, bytes.data(), 0, bytes.size());
    return bytes;
  }
  // The step over this rank's pieces, by the state core both optimizers share (optim/detail/adam_core.hpp): a
  // piece is a tensor to it, with its element offset for the stochastic-rounding stream. Between the norm pass
  // and the decision, the chunk sums are all-reduced (exact: one rank contributes each chunk, the rest 0.0), so
  // every rank takes the same decision; after the update, the parameters are all-gathered.
  template <executor E, class C, float_storage P, float_storage G>
  void host_step(const E& exec, const C& comm, tensor_view<P> params, std::int64_t params_begin, bool gather_params,
                 const G* grads, std::int64_t grads_begin,
                 std::span<const optim::adam_group> groups, const sharded_step_options& options, tensor_view<float> master) {
    double* sums = core_.host_chunk_sums();
    std::fill(sums, sums + core_.total_chunks(), 0.0);
    for (std::size_t k = 0; k < pieces_.size(); ++k) core_.host_norm(piece_layouts_[k], grad_of(pieces_[k], grads, grads_begin));
    comm.all_reduce(exec, sums, sums, core_.total_chunks());
    if (core_.host_finalize(options.gradient_scale)) {  // the same decision on every rank
      for (std::size_t k = 0; k < pieces_.size(); ++k) {
        const shard_piece& p = pieces_[k];
        core_.host_update(piece_layouts_[k],
                          core_.host_access(p.tensor, param_of(p, params, params_begin), grad_of(p, grads, grads_begin),
                                            master_of(p, master), p.begin),
                          groups[static_cast<std::size_t>(group_of(p, options))]);
      }
      if (gather_params) {
        P* flat = params.data();
        comm.all_gather(exec, flat + shard_begin(), flat, shard_size_);
      }
    }
  }

#if MEMKIT_HAS_CUDA
  // On the device a skipped step still all-gathers (the decision stays on the device; the parameters are
  // unchanged on every rank, so the gather rewrites the same values).
  template <class C, float_storage P, float_storage G>
  void device_step(const cuda_executor& exec, const C& comm, tensor_view<P> params, std::int64_t params_begin,
                   bool gather_params, const G* grads,
                   std::int64_t grads_begin, std::span<const optim::adam_group> groups, const sharded_step_options& options,
                   tensor_view<float> master) {
    auto piece = [&](std::size_t k) {
      const shard_piece& p = pieces_[k];
      return optim::detail::adam_step_tensor{&piece_layouts_[k], param_of(p, params, params_begin), grad_of(p, grads, grads_begin),
                                              master_of(p, master), p.tensor, p.begin, group_of(p, options)};
    };
    double* sums = core_.device_chunk_sums();
    memkit::detail::with_device(exec.device, [&] {
      MEMKIT_CUDA_CHECK(cudaMemsetAsync(sums, 0, static_cast<std::size_t>(core_.total_chunks()) * sizeof(double), exec.stream));
      core_.template device_norm<G>(exec, pieces_.size(), piece);
      return 0;
    });
    comm.all_reduce(exec, sums, sums, core_.total_chunks());
    memkit::detail::with_device(exec.device, [&] {
      core_.template device_finalize_and_update<P, G>(exec, options.gradient_scale, groups, pieces_.size(), piece);
      return 0;
    });
    if (!gather_params) return;
    P* flat = params.data();
    comm.all_gather(exec, flat + shard_begin(), flat, shard_size_);
  }
#endif

  // Where a piece's parameters, gradients (which start at flat index grads_begin) and master values are.
  template <float_storage P>
  static P* param_of(const shard_piece& p, tensor_view<P> params, std::int64_t params_begin) noexcept {
    return params.data() + (p.flat + p.begin - params_begin);
  }
  template <float_storage G>
  static const G* grad_of(const shard_piece& p, const G* grads, std::int64_t grads_begin) noexcept {
    return grads + (p.flat + p.begin - grads_begin);
  }
  float* master_of(const shard_piece& p, tensor_view<float> master) const noexcept {
    return master.data() == nullptr ? nullptr : master.data() + (p.flat + p.begin - shard_begin());
  }
  static int group_of(const shard_piece& p, const sharded_step_options& options) noexcept {
    return options.tensor_groups.empty() ? 0 : options.tensor_groups[static_cast<std::size_t>(p.tensor)];
  }
  // The state core's view of a piece (pieces_ and piece_layouts_ run in step).
  const optim::detail::adam_tensor_layout& layout_of(const shard_piece& p) const {
    return piece_layouts_[static_cast<std::size_t>(&p - pieces_.data())];
  }

  // This rank's moments as load() assembled them, checked by the function adam_state checks a loaded image
  // with (validate_moments: finite first moments, finite second moments >= 0, finite block scales >= 0).
  void validate_pieces(const std::string& op, const std::byte* base) const {
    for (const shard_piece& p : pieces_) {
      const std::string which = op + ": tensor " + std::to_string(p.tensor) + " elements " + std::to_string(p.begin) +
                                ".." + std::to_string(p.end);
      if (p.quantized) {
        if constexpr (quantized) {
          const std::int64_t blocks = (p.count() + divisor_block - 1) / divisor_block;
          for (const std::size_t offset : {p.m_scale_offset, p.v_scale_offset})
            optim::validate_moments(
                optim::adam_moment_kind::block_scale, blocks,
                [&](std::int64_t b) {
                  float a;
                  std::memcpy(&a, base + offset + static_cast<std::size_t>(b) * sizeof a, sizeof a);
                  return a;
                },
                [&](std::int64_t b) {
                  return which + ": " + (offset == p.m_scale_offset ? "m" : "v") + " block scale " + std::to_string(b);
                });
        }
        continue;
      }
      optim::validate_moments(optim::adam_moment_kind::first, p.count(), [&](std::int64_t i) { return core::load_moment(base, layout_of(p), i, true); },
                       [&](std::int64_t i) { return which + ": m[" + std::to_string(i) + "]"; });
      optim::validate_moments(optim::adam_moment_kind::second, p.count(), [&](std::int64_t i) { return core::load_moment(base, layout_of(p), i, false); },
                       [&](std::int64_t i) { return which + ": v[" + std::to_string(i) + "]"; });
    }
  }

  // The arena byte ranges of elements [first, first + count) of a piece (first a multiple of the
  // granule, or the whole piece): m, v, then m and v scales when quantized.
  struct segment {
    std::size_t offset, bytes;
  };
  static std::vector<segment> segments(const shard_piece& p, std::int64_t first, std::int64_t count) {
    const auto f = static_cast<std::size_t>(first), n = static_cast<std::size_t>(count);
    if (!p.quantized) {
      const std::size_t e = sizeof(plain_moment_type);
      return {{p.m_offset + f * e, n * e}, {p.v_offset + f * e, n * e}};
    }
    const std::size_t code_first = traits::bits == 8 ? f : f / 2, code_bytes = traits::bits == 8 ? n : (n + 1) / 2;
    const std::size_t block_first = f / divisor_block, blocks = (n + divisor_block - 1) / divisor_block;
    return {{p.m_offset + code_first, code_bytes},
            {p.v_offset + code_first, code_bytes},
            {p.m_scale_offset + block_first * sizeof(float), blocks * sizeof(float)},
            {p.v_scale_offset + block_first * sizeof(float), blocks * sizeof(float)}};
  }

  // ---- validation ----
  template <class C>
  void check_comm(const char* op, const C& comm) const {
    require(comm.size() == ranks_ && comm.rank() == rank_,
            std::string(op) + ": the communicator is rank " + std::to_string(comm.rank()) + " of " +
                std::to_string(comm.size()) + ", the state was made for rank " + std::to_string(rank_) + " of " +
                std::to_string(ranks_));
  }
  template <executor E, class C, float_storage P, float_storage G>
  void validate_step(const E& exec, const C& comm, const char* op, tensor_view<P> params, tensor_view<const G> grads,
                     std::int64_t grads_size, std::span<const optim::adam_group> groups, const sharded_step_options& options,
                     tensor_view<float> master, std::int64_t params_size = -1) const {
    if (params_size < 0) params_size = flat_size_;
    check_comm(op, comm);
    require_accessible(exec, arena_view(), op, "optimizer state");
    const std::string o = op;
    require(params.size() == params_size, o + ": params has " + std::to_string(params.size()) +
                                              " elements, expected " + std::to_string(params_size));
    require(grads.size() == grads_size, o + ": the gradients have " + std::to_string(grads.size()) + " elements, expected " +
                                            std::to_string(grads_size));
    require(params.data() != nullptr && grads.data() != nullptr, o + ": null parameters or gradients");
    if (master.data() != nullptr) {
      require(!std::is_same_v<P, float>, o + ": fp32 parameters are their own master copy; pass no master");
      require(master.size() == shard_size_, o + ": master has " + std::to_string(master.size()) +
                                                " elements, a shard " + std::to_string(shard_size_));
      require_accessible(exec, master, op, "master");
    }
    optim::detail::validate_groups_and_scale(o, groups, options.gradient_scale);
    require(options.tensor_groups.empty() || options.tensor_groups.size() == sizes_.size(),
            o + ": tensor_groups has " + std::to_string(options.tensor_groups.size()) + " entries, the state " +
                std::to_string(sizes_.size()) + " tensors");
    for (std::size_t i = 0; i < options.tensor_groups.size(); ++i)
      require(options.tensor_groups[i] >= 0 && static_cast<std::size_t>(options.tensor_groups[i]) < groups.size(),
              o + ": tensor " + std::to_string(i) + " names group " + std::to_string(options.tensor_groups[i]) +
                  " but only " + std::to_string(groups.size()) + " groups were given");
    require_accessible(exec, params, op, "params");
    require_accessible(exec, grads, op, "gradients");
  }

  // ---- images ----
  // Reads and checks one image's framing (magic, version, body length); returns the body length.
  std::uint64_t read_framing(std::istream& in, const std::string& where) const {
    const auto magic_length = optim::detail::read_pod<std::uint32_t>(in, where);
    require(magic_length == std::strlen(magic), where + ": not a memkit sharded_adam_state image");
    std::string file_magic(magic_length, '\0');
    in.read(file_magic.data(), magic_length);
    require(file_magic == magic, where + ": not a memkit sharded_adam_state image");
    const auto version = optim::detail::read_pod<std::uint32_t>(in, where);
    require(version == format_version,
            where + ": format version " + std::to_string(version) + ", this build reads " + std::to_string(format_version) +
                (version == 1 ? " (version 1 images name no run, so they cannot be told from another run's; not read)" : ""));
    const auto length = optim::detail::read_pod<std::uint64_t>(in, where);
    // No image of these tensors is larger than the whole unsharded state plus its headers.
    const std::uint64_t bound = (1u << 20) + 64 * sizes_.size() + unsharded::bytes_required(sizes_, options());
    require(length <= bound, where + ": image header is corrupt (body of " + std::to_string(length) + " bytes)");
    return length;
  }
  using core = optim::detail::adam_core<State, Block>;
  int rank_ = 0, ranks_ = 1;
  std::uint64_t run_id_ = 0;
  bool run_id_bound_ = false;
  std::vector<std::int64_t> sizes_, flat_offsets_;
  std::vector<optim::detail::adam_tensor_layout> tensor_chunks_;  // whole tensors' chunk ranges
  std::int64_t flat_size_ = 0, shard_size_ = 0;
  std::vector<shard_piece> pieces_;
  std::vector<optim::detail::adam_tensor_layout> piece_layouts_;  // pieces_ as the state core sees them
  core core_;
};

}  // namespace distributed
MEMKIT_NAMESPACE_END

// The bodies of save() and load(): the image format, checked field by field.
#include "memkit/distributed/detail/sharded_adam_state_io.hpp"
