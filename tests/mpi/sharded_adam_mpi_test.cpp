// distributed::sharded_adam_state over MPI (run by CTest with mpirun -np 2 and -np 3): stages 1 and 2 of every
// flavour bit-identical to one adam_state, the same skip on every rank, re-sharding N -> M on load,
// and the per-rank memory measured by a tracker.
#include <doctest/doctest.h>
#include <memkit/distributed/mpi_communicator.hpp>
#include <memkit/distributed/sharded_adam_state.hpp>
#include <memkit/memory/tracking.hpp>
#include <mpi.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "support/sharded_scenario.hpp"

using memkit::bf16;
using memkit::optim::four_bit;
using memkit::host;
using memkit::distributed::mpi_communicator;
using memkit::distributed::sharded_adam_state;

namespace {

const mpi_communicator& world() {
  static const mpi_communicator comm(MPI_COMM_WORLD);
  return comm;
}

// Whether a condition holds on every rank (each rank checks its own part; all must agree).
bool on_every_rank(bool mine) {
  int local = mine ? 1 : 0, all = 0;
  MPI_Allreduce(&local, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

template <class State, int Block, class P>
void check_ranks(int stage, bool with_master, int nan_step) {
  CAPTURE(stage);
  CAPTURE(with_master);
  CAPTURE(world().rank());
  CAPTURE(world().size());
  sharded_test::check_like_reference(sharded_test::run<State, Block, P>(world(), stage, 6, with_master, nan_step), 6,
                                     nan_step);
}

template <class State, int Block>
void check_flavour() {
  for (int stage : {1, 2}) {
    check_ranks<State, Block, float>(stage, false, 3);  // the last rank's NaN skips step 3 on every rank
    check_ranks<State, Block, bf16>(stage, false, -1);  // stochastic rounding of each piece at its tensor index
    check_ranks<State, Block, bf16>(stage, true, -1);   // sharded fp32 master weights
  }
}

// Training with `old_ranks` ranks (stage 2), saving per rank, loading into `new_ranks` ranks and going
// on (stage 1): the parameters and moments follow one adam_state through all the steps.
template <class State, int Block>
void check_resharding(int old_ranks, int new_ranks) {
  using S = sharded_adam_state<State, Block>;
  const auto& sizes = sharded_test::sizes;
  const int rank = world().rank();
  CAPTURE(old_ranks);
  CAPTURE(new_ranks);
  CAPTURE(rank);
  // A directory every rank knows: rank 0's choice, broadcast.
  char dir[256] = {};
  if (rank == 0) {
    const auto path = std::filesystem::temp_directory_path() / ("memkit-reshard-" + std::to_string(::getpid()));
    std::filesystem::create_directories(path);
    std::snprintf(dir, sizeof dir, "%s", path.c_str());
  }
  world().broadcast(host, dir, static_cast<std::int64_t>(sizeof dir), 0);
  auto image_path = [&](int r) { return std::string(dir) + "/rank-" + std::to_string(r) + ".img"; };

  memkit::optim::adam_options options;
  options.max_grad_norm = 0.02f;
  memkit::optim::adam_state<State, Block> reference(host, memkit::default_host_resource(), sizes, options);
  std::vector<std::vector<float>> ref_params(sizes.size()), ref_grads(sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i)
    for (float x : memkit_test::standard_normal(sizes[i], 2000 + static_cast<unsigned>(i))) ref_params[i].push_back(0.1f * x);
  auto reference_step = [&](int s, int ranks) {
    std::vector<memkit::optim::adam_param<float, float>> params;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      ref_grads[i].assign(static_cast<std::size_t>(sizes[i]), 0.0f);
      for (std::int64_t j = 0; j < sizes[i]; ++j)
        for (int r = 0; r < ranks; ++r) ref_grads[i][static_cast<std::size_t>(j)] += sharded_test::local_gradient(s, i, j, r);
      params.push_back({memkit::host_view(ref_params[i]), memkit::host_view(std::as_const(ref_grads[i])), {},
                        sharded_test::tensor_groups[i]});
    }
    reference.step(host, params, sharded_test::groups, 1.0f / static_cast<float>(ranks));
  };
  auto fill_gradients = [&](const S& state, std::vector<float>& grads, int s) {
    std::fill(grads.begin(), grads.end(), 0.0f);
    for (std::size_t i = 0; i < sizes.size(); ++i)
      for (std::int64_t j = 0; j < sizes[i]; ++j)
        grads[static_cast<std::size_t>(state.flat_offset(i) + j)] = sharded_test::local_gradient(s, i, j, rank);
  };
  int mismatches = 0;
  auto compare = [&](const S& state, const std::vector<float>& flat) {
    for (std::size_t i = 0; i < sizes.size(); ++i)
      for (std::int64_t j = 0; j < sizes[i]; ++j)
        if (!sharded_test::same_bits(flat[static_cast<std::size_t>(state.flat_offset(i) + j)],
                                     ref_params[i][static_cast<std::size_t>(j)]))
          ++mismatches;
  };
  const int steps = 3;

  // Phase 1: the first old_ranks ranks train and save.
  MPI_Comm old_comm = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, rank < old_ranks ? 0 : MPI_UNDEFINED, rank, &old_comm);
  std::vector<float> flat;
  if (old_comm != MPI_COMM_NULL) {
    const mpi_communicator comm(old_comm);
    S state(host, comm, memkit::default_host_resource(), sizes, options);
    flat.assign(static_cast<std::size_t>(state.flat_size()), 0.0f);
    for (std::size_t i = 0; i < sizes.size(); ++i)
      std::copy(ref_params[i].begin(), ref_params[i].end(), flat.begin() + state.flat_offset(i));
    std::vector<float> grads(flat.size()), shard(static_cast<std::size_t>(state.shard_size()));
    const memkit::distributed::sharded_step_options step_options{sharded_test::tensor_groups, 1.0f / static_cast<float>(old_ranks)};
    for (int s = 0; s < steps; ++s) {
      fill_gradients(state, grads, s);
      state.reduce_scatter_gradients(host, comm, memkit::host_view(std::as_const(grads)), memkit::host_view(shard));
      state.step_shard_gradients(host, comm, memkit::host_view(flat), memkit::host_view(std::as_const(shard)),
                                 sharded_test::groups, step_options);
    }
    std::ofstream out(image_path(comm.rank()), std::ios::binary);
    state.save(host, out);
    MPI_Comm_free(&old_comm);
  }
  for (int s = 0; s < steps; ++s) reference_step(s, old_ranks);
  if (!flat.empty()) compare(S(host, memkit::distributed::single_communicator{}, memkit::default_host_resource(), sizes), flat);
  MPI_Barrier(MPI_COMM_WORLD);

  // Phase 2: the first new_ranks ranks load every old image and go on.
  MPI_Comm new_comm = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, rank < new_ranks ? 0 : MPI_UNDEFINED, rank, &new_comm);
  if (new_comm != MPI_COMM_NULL) {
    const mpi_communicator comm(new_comm);
    S state(host, comm, memkit::default_host_resource(), sizes, options);
    std::vector<std::unique_ptr<std::ifstream>> files;
    std::vector<std::istream*> images;
    for (int r = old_ranks - 1; r >= 0; --r) {  // any order: each image says whose it is
      files.push_back(std::make_unique<std::ifstream>(image_path(r), std::ios::binary));
      images.push_back(files.back().get());
    }
    state.load(host, std::span<std::istream* const>(images));
    CHECK(state.control(host).step == steps);
    // The parameters come from rank 0 (a checkpoint would give them too).
    std::vector<float> params(static_cast<std::size_t>(state.flat_size()), 0.0f);
    if (comm.rank() == 0) std::copy(flat.begin(), flat.begin() + std::min(flat.size(), params.size()), params.begin());
    comm.broadcast(host, params.data(), state.flat_size(), 0);
    std::vector<float> grads(params.size());
    const memkit::distributed::sharded_step_options step_options{sharded_test::tensor_groups, 1.0f / static_cast<float>(new_ranks)};
    for (int s = steps; s < 2 * steps; ++s) {
      fill_gradients(state, grads, s);
      state.step_full_gradients(host, comm, memkit::host_view(params), memkit::host_view(grads), sharded_test::groups,
                                step_options);
      reference_step(s, new_ranks);
    }
    compare(state, params);
    int moment_mismatches = 0;
    for (const memkit::distributed::shard_piece& p : state.pieces()) {
      std::vector<float> m, v, ref_m, ref_v;
      state.read_moments(host, static_cast<std::size_t>(p.tensor), m, v);
      reference.read_moments(host, static_cast<std::size_t>(p.tensor), ref_m, ref_v);
      for (std::int64_t j = 0; j < p.count(); ++j)
        if (!sharded_test::same_bits(m[static_cast<std::size_t>(j)], ref_m[static_cast<std::size_t>(p.begin + j)]) ||
            !sharded_test::same_bits(v[static_cast<std::size_t>(j)], ref_v[static_cast<std::size_t>(p.begin + j)]))
          ++moment_mismatches;
    }
    CHECK(moment_mismatches == 0);
    CHECK(state.control(host).step == 2 * steps);
    MPI_Comm_free(&new_comm);
  }
  CHECK(mismatches == 0);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) std::filesystem::remove_all(dir);
}

template <class State, int Block>
void check_resharding_both_ways() {
  const int n = world().size();
  check_resharding<State, Block>(n - 1, n);  // 1 -> 2 on two ranks, 2 -> 3 on three
  check_resharding<State, Block>(n, n - 1);  // 2 -> 1, 3 -> 2
}

// Each rank's tracker measures bytes_required for its rank; the ranks' moments together are adam_state's
// give or take the alignment and m/v stagger of each piece (at most four 64-byte alignments plus a 4 KiB
// stagger per piece: adam_state::segment_plan); print the figures.
template <class State, int Block>
void check_memory(const char* name) {
  using S = sharded_adam_state<State, Block>;
  using A = memkit::optim::adam_state<State, Block>;
  const std::vector<std::int64_t> sizes{4096 * 300 + 11, 1000, 4096 * 200, 777, 4096 * 100 + 5, 4096 * 64};
  const int rank = world().rank(), ranks = world().size();
  memkit::tracking_resource tracker(memkit::default_host_resource());
  S state(host, world(), tracker.category(memkit::memory_category::optimizer_state), sizes);
  const std::size_t measured = tracker.stats(memkit::memory_category::optimizer_state).current_bytes;
  CHECK(measured == S::bytes_required(sizes, rank, ranks));
  CHECK(measured <= S::max_bytes_per_rank(sizes, ranks));

  std::int64_t chunks = 0;
  for (std::int64_t n : sizes) chunks += memkit::optim::detail::reduction_chunks(n);
  const std::size_t overhead = A::overhead_bytes(chunks), whole = A::bytes_required(sizes);
  const double moments = static_cast<double>(measured - overhead);
  double all_moments = 0, local = moments;
  MPI_Allreduce(&local, &all_moments, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  double pieces = static_cast<double>(state.pieces().size()), all_pieces = 0;
  MPI_Allreduce(&pieces, &all_pieces, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  constexpr double stagger = 4096;  // less than a page between m and v of a large piece or tensor
  CHECK(all_moments >= static_cast<double>(whole - overhead) - stagger * static_cast<double>(sizes.size()));
  CHECK(all_moments <= static_cast<double>(whole - overhead) + (4 * 64 + stagger) * all_pieces);
  std::printf("memkit: %s rank %d of %d: state %zu bytes (tracker), adam_state %zu bytes, 1/N %.0f, remainder %+.0f "
              "(control+norm scratch %zu)\n",
              name, rank, ranks, measured, whole, static_cast<double>(whole) / ranks,
              static_cast<double>(measured) - static_cast<double>(whole) / ranks, overhead);
}

}  // namespace

TEST_CASE("mpi sharded_adam: fp32 moments, stages 1 and 2, bit-identical to adam_state") { check_flavour<float, 0>(); }
TEST_CASE("mpi sharded_adam: bf16 moments, stages 1 and 2, bit-identical to adam_state") { check_flavour<bf16, 0>(); }
TEST_CASE("mpi sharded_adam: 8-bit moments, stages 1 and 2, bit-identical to adam_state") {
  check_flavour<std::int8_t, 256>();
}
TEST_CASE("mpi sharded_adam: 4-bit moments, stages 1 and 2, bit-identical to adam_state") {
  check_flavour<four_bit, 128>();
}

TEST_CASE("mpi sharded_adam: re-sharding on load resumes bit-identically") {
  check_resharding_both_ways<float, 0>();
  check_resharding_both_ways<bf16, 0>();
  check_resharding_both_ways<std::int8_t, 256>();
  check_resharding_both_ways<four_bit, 128>();
}

TEST_CASE("mpi sharded_adam: each rank's tracker measures its predicted share") {
  check_memory<float, 0>("fp32");
  check_memory<bf16, 0>("bf16");
  check_memory<std::int8_t, 256>("int8");
  check_memory<four_bit, 128>("4-bit");
}

TEST_CASE("mpi communicator: all_reduce, reduce_scatter, all_gather and broadcast") {
  const auto& comm = world();
  const int n = comm.size(), r = comm.rank();
  std::vector<double> values(6);
  for (int i = 0; i < 6; ++i) values[static_cast<std::size_t>(i)] = r * 10 + i;
  comm.all_reduce(host, values.data(), values.data(), 6);
  for (int i = 0; i < 6; ++i) CHECK(values[static_cast<std::size_t>(i)] == 10.0 * n * (n - 1) / 2 + n * i);
  std::vector<float> send(static_cast<std::size_t>(2 * n)), recv(2);
  for (int i = 0; i < 2 * n; ++i) send[static_cast<std::size_t>(i)] = static_cast<float>(i + r);
  comm.reduce_scatter(host, send.data(), recv.data(), 2);
  CHECK(recv[0] == static_cast<float>(n * (2 * r) + n * (n - 1) / 2));
  std::vector<bf16> gathered(static_cast<std::size_t>(3 * n));
  for (int i = 0; i < 3; ++i) gathered[static_cast<std::size_t>(3 * r + i)] = bf16(static_cast<float>(r + 1));
  comm.all_gather(host, gathered.data() + 3 * r, gathered.data(), 3);  // in place
  for (int i = 0; i < 3 * n; ++i) CHECK(memkit::to_float(gathered[static_cast<std::size_t>(i)]) == static_cast<float>(i / 3 + 1));
  std::int64_t word = r == n - 1 ? 42 : 0;
  comm.broadcast(host, &word, 1, n - 1);
  CHECK(on_every_rank(word == 42));
}
