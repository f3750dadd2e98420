// memkit/distributed/mpi_communicator.hpp — the communicator concept over MPI, for host memory.
//
// Not included by memkit/memkit.hpp, which needs no third-party headers: include it yourself and
// build with MPI (CMake: find_package(MPI COMPONENTS CXX) and link MPI::MPI_CXX; Debian:
// libopenmpi-dev). Without <mpi.h> on the include path this header declares nothing and sets
// MEMKIT_HAS_MPI to 0.
//
// The caller initializes MPI and passes a communicator (MPI_COMM_WORLD or a split of it); memkit
// never calls MPI_Init or MPI_Finalize and does not own the MPI_Comm. Sums are MPI_SUM over
// MPI_FLOAT / MPI_DOUBLE (MPI has no 16-bit float type: convert bf16/fp16 gradients to fp32 first);
// gathers and broadcasts move raw bytes of any trivially copyable type. MPI counts are ints, so one
// call moves at most 2^31-1 elements per rank; larger counts are refused with memkit::error.
#pragma once

#include "memkit/config.hpp"

#if __has_include(<mpi.h>)
#include <mpi.h>

#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "memkit/core/execution.hpp"
#include "memkit/distributed/communicator.hpp"

#define MEMKIT_HAS_MPI 1

MEMKIT_NAMESPACE_BEGIN
namespace distributed {

class mpi_communicator {
 public:
  explicit mpi_communicator(MPI_Comm comm) : comm_(comm) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    require(initialized != 0, "mpi_communicator: MPI is not initialized (call MPI_Init first)");
    require(comm != MPI_COMM_NULL, "mpi_communicator: the communicator is MPI_COMM_NULL");
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  MPI_Comm native() const noexcept { return comm_; }

  template <class T>
  void all_reduce(const host_executor&, const T* send, T* recv, std::int64_t count) const {
    check(MPI_Allreduce(send == recv ? MPI_IN_PLACE : send, recv, to_int(count, "all_reduce"), sum_type<T>(), MPI_SUM,
                        comm_),
          "MPI_Allreduce");
  }
  template <class T>
  void reduce_scatter(const host_executor&, const T* send, T* recv, std::int64_t count) const {
    check(MPI_Reduce_scatter_block(send, recv, to_int(count, "reduce_scatter"), sum_type<T>(), MPI_SUM, comm_),
          "MPI_Reduce_scatter_block");
  }
  template <class T>
  void all_gather(const host_executor&, const T* send, T* recv, std::int64_t count) const {
    static_assert(std::is_trivially_copyable_v<T>, "mpi_communicator::all_gather: T must be trivially copyable");
    const int n = to_int(count, "all_gather");
    byte_type type(sizeof(T));
    const bool in_place = send == recv + static_cast<std::int64_t>(rank_) * count;
    check(MPI_Allgather(in_place ? MPI_IN_PLACE : send, n, type.handle, recv, n, type.handle, comm_), "MPI_Allgather");
  }
  template <class T>
  void all_to_all(const host_executor&, const T* send, T* recv, std::int64_t count) const {
    static_assert(std::is_trivially_copyable_v<T>, "mpi_communicator::all_to_all: T must be trivially copyable");
    require(send != recv, "mpi_communicator::all_to_all: send and recv must not overlap");
    const int n = to_int(count, "all_to_all");
    byte_type type(sizeof(T));
    check(MPI_Alltoall(send, n, type.handle, recv, n, type.handle, comm_), "MPI_Alltoall");
  }
  template <class T>
  void broadcast(const host_executor&, T* data, std::int64_t count, int root) const {
    static_assert(std::is_trivially_copyable_v<T>, "mpi_communicator::broadcast: T must be trivially copyable");
    require(root >= 0 && root < size_, "mpi_communicator::broadcast: root " + std::to_string(root) + " of " +
                                           std::to_string(size_) + " ranks");
    byte_type type(sizeof(T));
    check(MPI_Bcast(data, to_int(count, "broadcast"), type.handle, root, comm_), "MPI_Bcast");
  }

 private:
  template <class T>
  static MPI_Datatype sum_type() {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "mpi_communicator sums float and double only (MPI has no 16-bit float type): reduce fp32 gradients");
    return std::is_same_v<T, float> ? MPI_FLOAT : MPI_DOUBLE;
  }
  // A contiguous datatype of one element's bytes, freed on scope exit.
  struct byte_type {
    MPI_Datatype handle = MPI_DATATYPE_NULL;
    explicit byte_type(std::size_t bytes) {
      check(MPI_Type_contiguous(static_cast<int>(bytes), MPI_BYTE, &handle), "MPI_Type_contiguous");
      check(MPI_Type_commit(&handle), "MPI_Type_commit");
    }
    byte_type(const byte_type&) = delete;
    byte_type& operator=(const byte_type&) = delete;
    ~byte_type() { MPI_Type_free(&handle); }
  };
  static int to_int(std::int64_t count, const char* op) {
    require(count >= 0 && count <= INT_MAX, std::string("mpi_communicator::") + op + ": " + std::to_string(count) +
                                                " elements per rank; one MPI call moves at most " +
                                                std::to_string(INT_MAX));
    return static_cast<int>(count);
  }
  static void check(int status, const char* call) {
    if (status == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING] = {};
    int length = 0;
    MPI_Error_string(status, text, &length);
    throw error(std::string("memkit: ") + call + " failed: " + std::string(text, static_cast<std::size_t>(length)));
  }

  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
};

static_assert(ordered_communicator<mpi_communicator, host_executor>);

}  // namespace distributed
MEMKIT_NAMESPACE_END

#else
#define MEMKIT_HAS_MPI 0
#endif
