// ZeRO stage 3 over MPI (CTest runs this binary with mpirun -np 2 and -np 3): the Llama decoder trained with
// its blocks gathered and released around each pass, gradients reduced to their owners in rank order, equals
// one process training the whole model on all ranks' micro-batches, bit for bit; each rank's tracker holds
// exactly stage3_parameters::bytes_required; ordered_reduce_scatter adds in rank order.
#include <doctest/doctest.h>
#include <memkit/distributed/mpi_communicator.hpp>
#include <memkit/distributed/stage3.hpp>
#include <mpi.h>

#include <cstdio>
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
  const auto out = stage3_test::run(comm, 3);
  INFO(out.first_problem);
  CHECK(out.steps == 3);
  CHECK(out.loss_mismatches == 0);
  CHECK(out.param_mismatches == 0);
  CHECK(out.changed > 1000);
  CHECK(out.peak_weights == out.predicted_weights);
  CHECK(out.peak_gradients == out.predicted_gradients);
  CHECK(out.peak_optimizer == out.predicted_optimizer);
  CHECK(out.current_total == out.predicted_weights + out.predicted_gradients + out.predicted_optimizer);
  std::printf("memkit: stage3 rank %d of %d: weights %zu, gradients %zu, optimizer %zu bytes (tracker peaks = bytes_required)\n",
              comm.rank(), comm.size(), out.peak_weights, out.peak_gradients, out.peak_optimizer);
}

TEST_CASE("mpi stage3: QLoRA adapters over sharded NF4 bases train bit-identically to one process") {
  const auto& comm = stage3_world();
  CAPTURE(comm.rank());
  CAPTURE(comm.size());
  const auto out = stage3_test::run_qlora(comm, 3);
  INFO(out.first_problem);
  CHECK(out.steps == 3);
  CHECK(out.loss_mismatches == 0);
  CHECK(out.adapter_mismatches == 0);
  CHECK(out.base_mismatches == 0);
  CHECK(out.changed > 1000);
  CHECK(out.peak_weights == out.predicted_weights);
  CHECK(out.peak_workspace == out.predicted_workspace);
  CHECK(out.peak_gradients == 0);
  CHECK(out.peak_optimizer == 0);
  std::printf("memkit: stage3 QLoRA rank %d of %d: NF4 shards + gather buffer %zu bytes, workspace peak %zu (tracker = prediction)\n",
              comm.rank(), comm.size(), out.peak_weights, out.peak_workspace);
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
