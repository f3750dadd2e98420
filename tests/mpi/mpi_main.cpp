// The doctest main of the MPI tests: every rank runs every test case (they call collectives, so all
// ranks must), and the run fails on every rank if it failed on any.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include <cstdio>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  doctest::Context context(argc, argv);
  const int local = context.run() != 0 ? 1 : 0;
  int failed = 0;
  MPI_Allreduce(&local, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0)
    std::printf("memkit: MPI tests on %d ranks: %s\n", size, failed ? "FAILED on at least one rank" : "passed on every rank");
  MPI_Finalize();
  return failed;
}
