// memkit/distributed/communicator.hpp — the collectives sharded training needs, behind one small concept.
//
// memkit does not launch processes or own a transport: the caller brings an initialized communicator
// of an existing library and wraps it (distributed/mpi_communicator.hpp for MPI on host memory,
// distributed/nccl_communicator.hpp for NCCL on CUDA streams), or implements the concept over their own.
// Every operation takes the executor first, like every memkit operation: on CUDA it is enqueued on
// the executor's stream and returns at once; on the host it returns when the data is there.
//
//   rank(), size()                                  this process's rank in [0, size)
//   all_reduce(exec, send, recv, count)             recv[i] = sum over ranks of send[i]; send == recv allowed
//   reduce_scatter(exec, send, recv, count)         send has size*count elements; rank r receives the sum
//                                                   of elements [r*count, (r+1)*count)
//   all_gather(exec, send, recv, count)             recv[r*count + i] = send of rank r [i]; in place when
//                                                   send == recv + rank*count
//   broadcast(exec, data, count, root)              every rank gets root's data
//   all_to_all(exec, send, recv, count)             (ordered_communicator) send and recv have size*count
//                                                   elements; recv[r*count + i] = send of rank r [rank*count + i]
//
// reduce_scatter and all_reduce add in whatever order the library picks (a tree, a ring), so with three or
// more ranks the sums are not reproducible bit for bit. ordered_reduce_scatter (below) is the reduction stage 3
// uses: all_to_all, then each rank adds its column in rank order 0, 1, ..., N-1, the order one process
// accumulating the ranks' gradients one after the other uses.
//
// Reductions are sums; a communicator must support them for float and double (the gradients, and the
// gradient-norm partial sums), and gather/broadcast for any trivially copyable element type.
// All ranks must call the same collectives in the same order, as with the underlying libraries.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace distributed {

template <class C, class E>
concept communicator = executor<E> && requires(const C& c, const E& exec, const float* f_in, float* f_out,
                                                const double* d_in, double* d_out, const std::byte* b_in,
                                                std::byte* b_out, std::int64_t count, int root) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.all_reduce(exec, f_in, f_out, count);
  c.all_reduce(exec, d_in, d_out, count);
  c.reduce_scatter(exec, f_in, f_out, count);
  c.all_gather(exec, b_in, b_out, count);
  c.all_gather(exec, f_in, f_out, count);
  c.broadcast(exec, b_out, count, root);
};

// One process alone: the collectives are copies. For single-process training with the sharded state
// (which then behaves as adam_state), and for tests of code written against the concept.
struct single_communicator {
  static constexpr int rank() noexcept { return 0; }
  static constexpr int size() noexcept { return 1; }

  template <executor E, class T>
  void all_reduce(const E& exec, const T* send, T* recv, std::int64_t count) const {
    copy(exec, send, recv, count);
  }
  template <executor E, class T>
  void reduce_scatter(const E& exec, const T* send, T* recv, std::int64_t count) const {
    copy(exec, send, recv, count);
  }
  template <executor E, class T>
  void all_gather(const E& exec, const T* send, T* recv, std::int64_t count) const {
    copy(exec, send, recv, count);
  }
  template <executor E, class T>
  void all_to_all(const E& exec, const T* send, T* recv, std::int64_t count) const {
    copy(exec, send, recv, count);
  }
  template <executor E, class T>
  void broadcast(const E&, T*, std::int64_t, int root) const {
    require(root == 0, "single_communicator::broadcast: root " + std::to_string(root) + " of 1 rank");
  }

 private:
  template <executor E, class T>
  static void copy([[maybe_unused]] const E& exec, const T* from, T* to, std::int64_t count) {
    if (from == to || count == 0) return;
    if constexpr (!E::on_device) {
      std::memmove(to, from, static_cast<std::size_t>(count) * sizeof(T));
    } else {
#if MEMKIT_HAS_CUDA
      MEMKIT_CUDA_CHECK(cudaMemcpyAsync(to, from, static_cast<std::size_t>(count) * sizeof(T), cudaMemcpyDefault,
                                        exec.stream));
#endif
    }
  }
};

// A communicator that also moves each rank's i-th block to rank i (what ordered_reduce_scatter needs).
template <class C, class E>
concept ordered_communicator = communicator<C, E> && requires(const C& c, const E& exec, const float* f_in, float* f_out,
                                                                std::int64_t count) {
  c.all_to_all(exec, f_in, f_out, count);
};

static_assert(communicator<single_communicator, host_executor>);
static_assert(ordered_communicator<single_communicator, host_executor>);

}  // namespace distributed
MEMKIT_NAMESPACE_END
