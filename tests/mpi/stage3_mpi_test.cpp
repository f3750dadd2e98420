// ZeRO stage 3 over MPI (CTest runs this binary with mpirun -np 2 and -np 3): the Llama decoder trained with
// its blocks gathered and released around each pass, gradients reduced to their owners in rank order, equals
// one process training the whole model on all ranks' micro-batches, bit for bit; each rank's tracker holds
// exactly stage3_parameters::bytes_required; ordered_reduce_scatter adds in rank order.
#include <doctest/doctest.h>
#include <memkit/distributed/mpi_communicator.hpp>
#include <memkit/distributed/stage3.hpp>
#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "support/stage3_scenario.hpp"

namespace {

const memkit::distributed::mpi_communicator& stage3_world() {
  static const memkit::distributed::mpi_communicator comm(MPI_COMM_WORLD);
  return comm;
}

}  // namespace

TEST_CASE("mpi stage3: the decoder trains bit-identically to one process, each rank's memory as predicted") {
  const auto& comm = stage3_world();
  CAPTURE(comm.rank());
  CAPTURE(comm.size());
  for (const bool prefetch : {false, true}) {
    CAPTURE(prefetch);
    const auto out = stage3_test::run(comm, 3, prefetch);
    CHECK(out.prefetches == (prefetch ? 3 * 2 * (stage3_test::config().layers - 1) : 0));
    stage3_test::check_like_one_process(out, 3);
    std::printf("memkit: stage3%s rank %d of %d: weights %zu, gradients %zu, optimizer %zu bytes (tracker peaks = bytes_required)\n",
                prefetch ? " (prefetch)" : "", comm.rank(), comm.size(), out.peak_weights, out.peak_gradients, out.peak_optimizer);
  }
}

TEST_CASE("mpi stage3: clipping by the global norm equals one process; a NaN on the last rank skips every unit everywhere") {
  const auto& comm = stage3_world();
  CAPTURE(comm.rank());
  CAPTURE(comm.size());
  constexpr float clip = 1e-3f;  // far below the gradients' norm: every step clips
  const auto out = stage3_test::run(comm, 2, comm.size() == 3, clip);
  INFO(out.first_problem);
  CHECK(out.param_mismatches == 0);
  CHECK(out.loss_mismatches == 0);
  CHECK(out.grad_norm > 10 * clip);
  CHECK(stage3_test::same_bits(out.grad_norm, out.reference_grad_norm));
  CHECK(out.norm_disagreements == 0);
  const auto skip = stage3_test::run_nonfinite(comm, comm.size() - 1, 0);
  CHECK(skip.applied_units == 0);
  CHECK(skip.skipped_units == stage3_test::config().layers + 1);
  CHECK(skip.changed == 0);
  CHECK(skip.nan_placed == (comm.rank() == comm.size() - 1 ? 1 : 0));
}

TEST_CASE("mpi stage3: QLoRA adapters over sharded NF4 bases train bit-identically to one process") {
  const auto& comm = stage3_world();
  CAPTURE(comm.rank());
  CAPTURE(comm.size());
  const auto out = stage3_test::run_qlora(comm, 3);
  stage3_test::check_like_one_process(out, 3);
  std::printf("memkit: stage3 QLoRA rank %d of %d: NF4 shards + gather buffer %zu bytes, workspace peak %zu (tracker = prediction)\n",
              comm.rank(), comm.size(), out.peak_weights, out.peak_workspace);
}

// Trained on `old_ranks` ranks and saved, loaded on `new_ranks` and trained on: bit-identical to one process
// that ran old_ranks micro-batches per step, then new_ranks.
static void check_stage3_resharding(int old_ranks, int new_ranks) {
  const int rank = stage3_world().rank();
  CAPTURE(old_ranks);
  CAPTURE(new_ranks);
  CAPTURE(rank);
  char dir[256] = {};
  if (rank == 0) {
    const auto path = std::filesystem::temp_directory_path() / ("memkit-stage3-" + std::to_string(::getpid()));
    std::filesystem::create_directories(path);
    std::snprintf(dir, sizeof dir, "%s", path.c_str());
  }
  stage3_world().broadcast(memkit::host, dir, static_cast<std::int64_t>(sizeof dir), 0);
  std::vector<std::string> files;
  for (int r = 0; r < old_ranks; ++r) files.push_back(std::string(dir) + "/rank-" + std::to_string(r) + ".safetensors");
  const int steps = 2;
  MPI_Comm old_comm = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, rank < old_ranks ? 0 : MPI_UNDEFINED, rank, &old_comm);
  if (old_comm != MPI_COMM_NULL) {
    const memkit::distributed::mpi_communicator comm(old_comm);
    stage3_test::train_and_save(comm, steps, files[static_cast<std::size_t>(comm.rank())]);
    MPI_Comm_free(&old_comm);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Comm new_comm = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, rank < new_ranks ? 0 : MPI_UNDEFINED, rank, &new_comm);
  if (new_comm != MPI_COMM_NULL) {
    const memkit::distributed::mpi_communicator comm(new_comm);
    const auto out = stage3_test::load_and_continue(comm, files, old_ranks, steps);
    INFO(out.first_problem);
    CHECK(out.steps == steps);
    CHECK(out.loss_mismatches == 0);
    CHECK(out.param_mismatches == 0);
    CHECK(out.optimizer_steps == 2 * steps);
    if (old_ranks > 1) {  // one rank's file missing: refused by name before anything changes
      auto model = stage3_test::make_model(memkit::layers::memory_resources{});
      memkit::distributed::stage3_parameters<float> runtime(memkit::host, comm, memkit::layers::memory_resources{},
                                                            memkit::models::llama::stage3_units(*model), stage3_test::adam_options(), 0x5745);
      std::vector<memkit::safetensors::reader> readers;
      for (std::size_t r = 0; r + 1 < files.size(); ++r) readers.emplace_back(files[r]);
      std::vector<const memkit::safetensors::reader*> images;
      for (const auto& r : readers) images.push_back(&r);
      CHECK_THROWS_WITH_AS(runtime.load(memkit::host, images), doctest::Contains("all ranks of one save are needed"), memkit::error);
    }
    MPI_Comm_free(&new_comm);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("mpi stage3: a run saved on every rank, consolidated, is byte for byte the one-process model's export") {
  const auto& comm = stage3_world();
  const int rank = comm.rank();
  char dir[512] = {};
  if (rank == 0) {
    const auto path = std::filesystem::temp_directory_path() / ("memkit-stage3-export-" + std::to_string(::getpid()));
    std::filesystem::create_directories(path);
    std::snprintf(dir, sizeof dir, "%s", path.c_str());
  }
  comm.broadcast(memkit::host, dir, static_cast<std::int64_t>(sizeof dir), 0);
  std::vector<std::string> files;
  for (int r = 0; r < comm.size(); ++r) files.push_back(std::string(dir) + "/rank-" + std::to_string(r) + ".safetensors");
  stage3_test::train_and_save(comm, 2, files[static_cast<std::size_t>(rank)]);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) {  // offline: one process reads every rank's file
    CHECK(stage3_test::consolidated_export_problem(files, 2, dir) == "");
    std::filesystem::remove_all(dir);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("mpi stage3: re-sharding on load (2 -> 3 and 3 -> 2 on three ranks) resumes bit-identically") {
  const int n = stage3_world().size();
  check_stage3_resharding(n - 1, n);
  check_stage3_resharding(n, n - 1);
}

TEST_CASE("mpi stage3: ordered_reduce_scatter adds the ranks in order") {
  const auto& comm = stage3_world();
  const int n = comm.size(), r = comm.rank();
  // Rank 0 sends 1, the others 2^-24 each: added in rank order, each small term rounds away (1 + 2^-24 = 1);
  // any other order adds the small terms first and, on 3 ranks, their sum 2^-23 survives.
  const std::int64_t count = 5;
  std::vector<float> send(static_cast<std::size_t>(n * count), r == 0 ? 1.0f : 0x1p-24f), recv(count), staging(send.size());
  memkit::distributed::ordered_reduce_scatter(memkit::host, comm, memkit::host_view(std::as_const(send)),
                                              memkit::host_view(recv), memkit::host_view(staging));
  for (float x : recv) CHECK(x == 1.0f);
  std::vector<float> received(send.size());
  for (std::int64_t i = 0; i < n * count; ++i) send[static_cast<std::size_t>(i)] = static_cast<float>(100 * r + i);
  comm.all_to_all(memkit::host, send.data(), received.data(), count);
  for (int from = 0; from < n; ++from)
    for (std::int64_t i = 0; i < count; ++i)
      CHECK(received[static_cast<std::size_t>(from * count + i)] == static_cast<float>(100 * from + r * count + i));
}
