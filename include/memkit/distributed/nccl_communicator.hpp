// memkit/distributed/nccl_communicator.hpp — the communicator concept over NCCL, on CUDA streams.
//
// Not included by memkit/memkit.hpp: include it in a .cu file and link NCCL (libnccl, which ships
// with the CUDA stack; CMake: find_library(... nccl) next to the CUDA toolkit). It declares
// nccl_communicator only under nvcc with <nccl.h> on the include path, and sets MEMKIT_HAS_NCCL to 1
// then, 0 otherwise.
//
// The caller creates the ncclComm_t (ncclCommInitRank / ncclCommInitAll) and keeps ownership; memkit
// never destroys it. Every collective is enqueued on the executor's stream on the executor's device
// (which must be the communicator's device) and returns at once, like every memkit CUDA operation.
// Sums over float, double, fp16 and bf16; gathers and broadcasts move raw bytes of any trivially
// copyable type. All buffers are device (or managed) memory.
#pragma once

#include "memkit/config.hpp"

#if MEMKIT_HAS_CUDA && __has_include(<nccl.h>)
#include <nccl.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "memkit/core/execution.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/distributed/communicator.hpp"
#include "memkit/memory/resource.hpp"

#define MEMKIT_HAS_NCCL 1

MEMKIT_NAMESPACE_BEGIN
namespace distributed {

class nccl_communicator {
 public:
  explicit nccl_communicator(ncclComm_t comm) : comm_(comm) {
    require(comm != nullptr, "nccl_communicator: the communicator is null");
    check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
    check(ncclCommCount(comm_, &size_), "ncclCommCount");
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  ncclComm_t native() const noexcept { return comm_; }

  template <class T>
  void all_reduce(const cuda_executor& exec, const T* send, T* recv, std::int64_t count) const {
    on(exec, [&] {
      return ncclAllReduce(send, recv, static_cast<std::size_t>(count), sum_type<T>(), ncclSum, comm_, exec.stream);
    }, "ncclAllReduce");
  }
  template <class T>
  void reduce_scatter(const cuda_executor& exec, const T* send, T* recv, std::int64_t count) const {
    on(exec, [&] {
      return ncclReduceScatter(send, recv, static_cast<std::size_t>(count), sum_type<T>(), ncclSum, comm_, exec.stream);
    }, "ncclReduceScatter");
  }
  // In place when send == recv + rank * count (NCCL's own in-place rule).
  template <class T>
  void all_gather(const cuda_executor& exec, const T* send, T* recv, std::int64_t count) const {
    static_assert(std::is_trivially_copyable_v<T>, "nccl_communicator::all_gather: T must be trivially copyable");
    on(exec, [&] {
      return ncclAllGather(send, recv, static_cast<std::size_t>(count) * sizeof(T), ncclUint8, comm_, exec.stream);
    }, "ncclAllGather");
  }
  // Point to point in one group (NCCL 2.7+): rank r's block i goes to rank i's block r.
  template <class T>
  void all_to_all(const cuda_executor& exec, const T* send, T* recv, std::int64_t count) const {
    static_assert(std::is_trivially_copyable_v<T>, "nccl_communicator::all_to_all: T must be trivially copyable");
    const std::size_t bytes = static_cast<std::size_t>(count) * sizeof(T);
    on(exec, [&] {
      ncclResult_t status = ncclGroupStart();
      for (int peer = 0; peer < size_ && status == ncclSuccess; ++peer) {
        status = ncclSend(reinterpret_cast<const std::uint8_t*>(send) + peer * bytes, bytes, ncclUint8, peer, comm_, exec.stream);
        if (status == ncclSuccess)
          status = ncclRecv(reinterpret_cast<std::uint8_t*>(recv) + peer * bytes, bytes, ncclUint8, peer, comm_, exec.stream);
      }
      const ncclResult_t ended = ncclGroupEnd();
      return status != ncclSuccess ? status : ended;
    }, "ncclSend/ncclRecv (all_to_all)");
  }
  template <class T>
  void broadcast(const cuda_executor& exec, T* data, std::int64_t count, int root) const {
    static_assert(std::is_trivially_copyable_v<T>, "nccl_communicator::broadcast: T must be trivially copyable");
    require(root >= 0 && root < size_, "nccl_communicator::broadcast: root " + std::to_string(root) + " of " +
                                           std::to_string(size_) + " ranks");
    on(exec, [&] {
      return ncclBroadcast(data, data, static_cast<std::size_t>(count) * sizeof(T), ncclUint8, root, comm_, exec.stream);
    }, "ncclBroadcast");
  }

 private:
  template <class T>
  static ncclDataType_t sum_type() {
    if constexpr (std::is_same_v<T, float>) return ncclFloat32;
    else if constexpr (std::is_same_v<T, double>) return ncclFloat64;
    else if constexpr (std::is_same_v<T, fp16>) return ncclFloat16;
    else {
      static_assert(std::is_same_v<T, bf16>, "nccl_communicator sums float, double, fp16 and bf16");
      return ncclBfloat16;
    }
  }
  template <class Call>
  static void on(const cuda_executor& exec, Call&& call, const char* name) {
    ::memkit::detail::with_device(exec.device, [&] {
      check(call(), name);
      return 0;
    });
  }
  static void check(ncclResult_t status, const char* call) {
    if (status == ncclSuccess) return;
    throw error(std::string("memkit: ") + call + " failed: " + ncclGetErrorString(status));
  }

  ncclComm_t comm_;
  int rank_ = 0, size_ = 1;
};

static_assert(ordered_communicator<nccl_communicator, cuda_executor>);

}  // namespace distributed
MEMKIT_NAMESPACE_END

#else
#define MEMKIT_HAS_NCCL 0
#endif
