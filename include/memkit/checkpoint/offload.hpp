// memkit/checkpoint/offload.hpp — checkpoints kept in host memory between a forward pass and its backward
// pass, and brought back to the device just before they are needed.
//
// One offload serves every segment of a model (segment_options::offload). Its
// checkpoints form one last-in, first-out stack, so while a segment runs backward the checkpoint the next
// restore needs — of this segment or of the segment before it — is already on its way back.
//
// On CUDA the copies run on a side stream the offload owns, overlapped with the compute stream and ordered
// against it with events only (never a synchronization):
//   keep:  compute --ready--> side: device -> host copy --copied--> compute waits before the source is reused
//   fetch: compute allocates --allocated--> side: host -> device copy --arrived--> compute waits before reading
// The host memory must be pinned (pinned_host_resource) for the copies to overlap. On the host executor the
// same steps run with memcpy and any host resource. Host buffers are pooled by size: the second training step
// allocates nothing, and a buffer is never freed while a copy may still read it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace checkpoint {

namespace detail {

// A process-wide id for each segment (its checkpoints' owner in an offload; it survives moves).
inline std::uint64_t next_checkpoint_owner() noexcept {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

// A copy in stream order on `exec` (memcpy on the host).
inline void copy_bytes(const host_executor&, void* destination, const void* source, std::size_t bytes) {
  if (bytes != 0) std::memcpy(destination, source, bytes);
}
#if MEMKIT_HAS_CUDA
inline void copy_bytes(const cuda_executor& exec, void* destination, const void* source, std::size_t bytes) {
  if (bytes != 0) MEMKIT_CUDA_CHECK(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDefault, exec.stream));
}
#endif

}  // namespace detail

// Which checkpoint: the segment (its id), the pass that kept it and the hidden-state position.
struct checkpoint_key {
  std::uint64_t owner = 0;
  std::uint64_t pass = 0;
  std::uint64_t position = 0;
  friend constexpr bool operator==(const checkpoint_key&, const checkpoint_key&) = default;
};

class offload {
 public:
  // `host_memory`: where checkpoints are kept (pinned_host_resource, or a tracking category over one, for
  // CUDA executors; any host-accessible resource for the host executor).
  explicit offload(memory_resource& host_memory) : host_(&host_memory) {}
  offload(const offload&) = delete;
  offload& operator=(const offload&) = delete;
  ~offload() {
#if MEMKIT_HAS_CUDA
    // Copies may still read the pooled buffers: let them finish before the buffers go.
    if (side_.stream != nullptr) {
      (void)cudaStreamSynchronize(side_.stream);
      prefetched_ = {};
      pool_.clear();
      (void)cudaEventDestroy(side_.ready);
      (void)cudaEventDestroy(side_.copied);
      (void)cudaEventDestroy(side_.allocated);
      (void)cudaEventDestroy(side_.arrived);
      (void)cudaStreamDestroy(side_.stream);
    }
#endif
  }

  memory_resource& host_memory() const noexcept { return *host_; }
  std::size_t kept() const noexcept { return kept_.size(); }  // checkpoints held now
  std::size_t host_bytes() const noexcept {                   // host bytes pooled (held or free)
    std::size_t total = 0;
    for (const pooled& p : pool_) total += p.storage.bytes();
    return total;
  }
#if MEMKIT_HAS_CUDA
  cudaStream_t side_stream() const noexcept { return side_.stream; }
#endif

  // Frees the pooled host buffers no checkpoint holds. On CUDA it first waits for the side stream: call it
  // between training steps, not inside one.
  void release_unused() {
#if MEMKIT_HAS_CUDA
    if (side_.stream != nullptr) MEMKIT_CUDA_CHECK(cudaStreamSynchronize(side_.stream));
#endif
    std::vector<pooled> in_use;
    std::vector<std::size_t> moved_to(pool_.size(), 0);
    for (std::size_t i = 0; i < pool_.size(); ++i)
      if (pool_[i].in_use) {
        moved_to[i] = in_use.size();
        in_use.push_back(std::move(pool_[i]));
      }
    for (kept_checkpoint& k : kept_) k.pool_index = moved_to[k.pool_index];
    pool_ = std::move(in_use);
  }

  // --- used by segment ---

  // Starts copying `bytes` at `source` (stream-ordered on `exec`) into a host checkpoint. The source may be
  // overwritten or freed only after wait_for_copies(exec).
  template <executor E>
  void keep(const E& exec, const void* source, std::size_t bytes, const checkpoint_key& key) {
    std::size_t index = pool_.size();
    for (std::size_t i = 0; i < pool_.size(); ++i)
      if (!pool_[i].in_use && pool_[i].storage.bytes() == bytes) {
        index = i;
        break;
      }
    if (index == pool_.size()) {
      if constexpr (E::on_device)
        require(host_->kind() == memory_kind::pinned_host,
                std::string("checkpoint::offload: device checkpoints are copied to host memory asynchronously, which "
                            "needs pinned host memory; its resource gives ") +
                    to_string(host_->kind()) + " memory (use a pinned_host_resource)");
      else
        require(E::can_access(host_->kind()), std::string("checkpoint::offload: the host executor cannot reach ") +
                                                  to_string(host_->kind()) + " memory");
      pool_.push_back({buffer<std::byte>(*host_, shape{static_cast<std::int64_t>(bytes)}), false});
    }
    pool_[index].in_use = true;
    copy_out(exec, pool_[index].storage.data(), source, bytes);
    kept_.push_back({index, key, bytes});
  }

  // Exec's stream waits until every copy out of device memory started so far has finished.
  template <executor E>
  void wait_for_copies(const E& exec) {
#if MEMKIT_HAS_CUDA
    if constexpr (E::on_device)
      if (side_.stream != nullptr) MEMKIT_CUDA_CHECK(cudaStreamWaitEvent(exec.stream, side_.copied, 0));
#endif
    (void)exec;
  }

  // A copy of checkpoint `key` in `device` memory, ready in exec's stream order: the prefetched one when
  // it is that checkpoint. last: the checkpoint is dropped (it must be the most recent one kept).
  template <executor E>
  buffer<std::byte> fetch(const E& exec, memory_resource& device, const checkpoint_key& key, bool last) {
    const std::size_t index = find(key);
    require(!last || index + 1 == kept_.size(),
            "checkpoint::offload: a checkpoint was brought back out of order: segments must run backward in the "
            "reverse order of their forward passes");
    buffer<std::byte> copy;
    if (prefetched_.storage.data() != nullptr && prefetched_.key == key) {
      copy = std::move(prefetched_.storage);
      prefetched_ = {};
    } else {
      discard_prefetch(exec);
      copy = copy_in(exec, device, index);
    }
    wait_arrival(exec);
    if (last) {
      pool_[kept_.back().pool_index].in_use = false;
      kept_.pop_back();
    }
    return copy;
  }

  // Starts bringing checkpoint `key` back, for the fetch that will ask for it next.
  template <executor E>
  void prefetch(const E& exec, memory_resource& device, const checkpoint_key& key) {
    const std::size_t index = find(key);
    discard_prefetch(exec);
    prefetched_.storage = copy_in(exec, device, index);
    prefetched_.key = key;
  }

  // Starts bringing back the most recent checkpoint (the next one a backward will ask for), if any.
  template <executor E>
  void prefetch_latest(const E& exec, memory_resource& device) {
    if (!kept_.empty() && prefetched_.storage.data() == nullptr) prefetch(exec, device, kept_.back().key);
  }

  // Drops every checkpoint of one segment pass (after a failure inside it).
  template <executor E>
  void forget(const E& exec, std::uint64_t owner, std::uint64_t pass) {
    if (prefetched_.key.owner == owner && prefetched_.key.pass == pass) discard_prefetch(exec);
    drop_kept(owner, pass);
  }

  // The same without an executor (a segment discarding a forward, or destroyed with a backward pending):
  // a copy still bringing one of these checkpoints back is waited for (on CUDA, the side stream
  // synchronizes) before its device buffer is freed.
  void forget(std::uint64_t owner, std::uint64_t pass) noexcept {
    if (prefetched_.storage.data() != nullptr && prefetched_.key.owner == owner && prefetched_.key.pass == pass) {
#if MEMKIT_HAS_CUDA
      if (side_.stream != nullptr) (void)cudaStreamSynchronize(side_.stream);
#endif
      prefetched_ = {};
    }
    drop_kept(owner, pass);
  }

 private:
  struct pooled {
    buffer<std::byte> storage;
    bool in_use = false;
  };
  struct kept_checkpoint {
    std::size_t pool_index;
    checkpoint_key key;
    std::size_t bytes;
  };
  struct prefetched_copy {
    buffer<std::byte> storage;
    checkpoint_key key;
  };

  void drop_kept(std::uint64_t owner, std::uint64_t pass) noexcept {
    for (std::size_t i = kept_.size(); i-- > 0;)
      if (kept_[i].key.owner == owner && kept_[i].key.pass == pass) {
        pool_[kept_[i].pool_index].in_use = false;
        kept_.erase(kept_.begin() + static_cast<std::ptrdiff_t>(i));
      }
  }

  std::size_t find(const checkpoint_key& key) const {
    for (std::size_t i = kept_.size(); i-- > 0;)
      if (kept_[i].key == key) return i;
    throw error("checkpoint::offload: no checkpoint is kept for hidden state " + std::to_string(key.position) +
                " of this segment (its backward ran twice, or its forward used another offload)");
  }

  template <executor E>
  void copy_out(const E& exec, void* host_destination, const void* source, std::size_t bytes) {
    if constexpr (E::on_device) {
#if MEMKIT_HAS_CUDA
      ensure_side_stream(exec);
      MEMKIT_CUDA_CHECK(cudaEventRecord(side_.ready, exec.stream));
      MEMKIT_CUDA_CHECK(cudaStreamWaitEvent(side_.stream, side_.ready, 0));
      MEMKIT_CUDA_CHECK(cudaMemcpyAsync(host_destination, source, bytes, cudaMemcpyDeviceToHost, side_.stream));
      MEMKIT_CUDA_CHECK(cudaEventRecord(side_.copied, side_.stream));
#endif
    } else {
      detail::copy_bytes(exec, host_destination, source, bytes);
    }
  }

  template <executor E>
  buffer<std::byte> copy_in(const E& exec, memory_resource& device, std::size_t index) {
    const kept_checkpoint& k = kept_[index];
    buffer<std::byte> copy(device, shape{static_cast<std::int64_t>(k.bytes)});
    if constexpr (E::on_device) {
#if MEMKIT_HAS_CUDA
      ensure_side_stream(exec);
      // The allocation is ordered on the compute stream: the side stream writes only after it.
      MEMKIT_CUDA_CHECK(cudaEventRecord(side_.allocated, exec.stream));
      MEMKIT_CUDA_CHECK(cudaStreamWaitEvent(side_.stream, side_.allocated, 0));
      MEMKIT_CUDA_CHECK(cudaMemcpyAsync(copy.data(), pool_[k.pool_index].storage.data(), k.bytes,
                                        cudaMemcpyHostToDevice, side_.stream));
      MEMKIT_CUDA_CHECK(cudaEventRecord(side_.arrived, side_.stream));
#endif
    } else {
      detail::copy_bytes(exec, copy.data(), pool_[k.pool_index].storage.data(), k.bytes);
    }
    return copy;
  }

  template <executor E>
  void wait_arrival(const E& exec) {
#if MEMKIT_HAS_CUDA
    if constexpr (E::on_device) MEMKIT_CUDA_CHECK(cudaStreamWaitEvent(exec.stream, side_.arrived, 0));
#endif
    (void)exec;
  }

  // Frees an unclaimed prefetched copy once the side stream is done writing it.
  template <executor E>
  void discard_prefetch(const E& exec) {
    if (prefetched_.storage.data() == nullptr) return;
    wait_arrival(exec);
    prefetched_ = {};
  }

#if MEMKIT_HAS_CUDA
  void ensure_side_stream(const cuda_executor& exec) {
    if (side_.stream != nullptr) {
      require(side_.device == exec.device, "checkpoint::offload: used on device " + std::to_string(exec.device) +
                                               " after device " + std::to_string(side_.device) +
                                               "; use one offload per device");
      return;
    }
    ::memkit::detail::with_device(exec.device, [&] {
      MEMKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&side_.stream, cudaStreamNonBlocking));
      for (cudaEvent_t* event : {&side_.ready, &side_.copied, &side_.allocated, &side_.arrived})
        MEMKIT_CUDA_CHECK(cudaEventCreateWithFlags(event, cudaEventDisableTiming));
      return 0;
    });
    side_.device = exec.device;
  }
  struct side_state {
    int device = -1;
    cudaStream_t stream = nullptr;
    cudaEvent_t ready = nullptr, copied = nullptr, allocated = nullptr, arrived = nullptr;
  };
  side_state side_;
#endif

  memory_resource* host_;
  std::vector<pooled> pool_;
  std::vector<kept_checkpoint> kept_;
  prefetched_copy prefetched_;
};

}  // namespace checkpoint
MEMKIT_NAMESPACE_END
