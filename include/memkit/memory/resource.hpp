// memkit/memory/resource.hpp — where memkit's buffers come from.
//
// A memory_resource hands out aligned bytes of one memory kind. memkit ships one per kind:
//   host_resource          pageable host memory (always available)
//   pinned_host_resource   page-locked host memory (cudaMallocHost)        [nvcc only]
//   device_resource        device memory (cudaMalloc)                        [nvcc only]
//   device_async_resource  stream-ordered device memory (cudaMallocAsync)   [nvcc only]
//   managed_resource       managed memory, paged on demand (cudaMallocManaged) [nvcc only]
// Components never allocate behind the caller's back: they take a resource, usually a
// tracking_resource category (memory/tracking.hpp), so every byte is accounted for.
//
// Stream-ordered allocation (allocate_on / deallocate_on, docs/cuda.md "Workspace"): a CUDA operation takes
// its temporary memory on the stream its kernels run on, so the release is ordered after them without a
// synchronizing cudaFree. device_async_resource (and a tracking_resource over one) honours the stream;
// every other resource ignores it and allocates as allocate() does.
#pragma once

#include <cstddef>
#include <new>
#include <string>

#include "memkit/config.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/core/units.hpp"

MEMKIT_NAMESPACE_BEGIN

// 256 bytes is what cudaMalloc guarantees, and enough for any vector load or TMA descriptor, so a
// kernel may assume it for every buffer memkit hands out, on host and device alike.
inline constexpr std::size_t default_alignment = 256;

// An allocation that could not be satisfied. The message says how many bytes were asked for and
// from where; a tracking_resource adds the category and what it held at the time.
class out_of_memory : public error {
 public:
  out_of_memory(const std::string& message, std::size_t requested_bytes)
      : error(message), requested_bytes_(requested_bytes) {}
  std::size_t requested_bytes() const noexcept { return requested_bytes_; }

 private:
  std::size_t requested_bytes_;
};

// A CUDA stream as memory resources see it: a cudaStream_t, held as void* so that memory_resource is the same
// class under g++ and nvcc. `on_stream{exec.stream}`.
struct on_stream {
  void* stream = nullptr;
};

class memory_resource {
 public:
  virtual ~memory_resource() = default;

  // Zero bytes yields nullptr; anything else is non-null or throws (out_of_memory, or memkit::error
  // for an alignment that is not a power of two or that the resource cannot honour).
  void* allocate(std::size_t bytes, std::size_t alignment = default_alignment) {
    require(alignment != 0 && (alignment & (alignment - 1)) == 0,
            std::string(name()) + ": alignment " + std::to_string(alignment) + " is not a power of two");
    if (bytes == 0) return nullptr;
    return do_allocate(bytes, alignment);
  }
  // Must receive the same bytes and alignment the allocation was made with.
  void deallocate(void* pointer, std::size_t bytes, std::size_t alignment = default_alignment) noexcept {
    if (pointer != nullptr) do_deallocate(pointer, bytes, alignment);
  }

  // Whether allocate_on / deallocate_on are ordered with the work on the stream they name (no waiting):
  // true for device_async_resource and for a tracking_resource (or one of its categories) over one.
  bool stream_ordered() const noexcept { return is_stream_ordered(); }
  // Stream-ordered allocation: the memory may be used by work enqueued on `where.stream` after this call,
  // and handed back with deallocate_on on the same stream as soon as that work is enqueued. A resource that
  // is not stream-ordered ignores the stream (its deallocate may then have to wait for the device, as
  // cudaFree does).
  void* allocate_on(on_stream where, std::size_t bytes, std::size_t alignment = default_alignment) {
    require(alignment != 0 && (alignment & (alignment - 1)) == 0,
            std::string(name()) + ": alignment " + std::to_string(alignment) + " is not a power of two");
    if (bytes == 0) return nullptr;
    return do_allocate_on(where, bytes, alignment);
  }
  void deallocate_on(on_stream where, void* pointer, std::size_t bytes,
                     std::size_t alignment = default_alignment) noexcept {
    if (pointer != nullptr) do_deallocate_on(where, pointer, bytes, alignment);
  }

  virtual memory_kind kind() const noexcept = 0;
  virtual const char* name() const noexcept = 0;

 protected:
  virtual void* do_allocate(std::size_t bytes, std::size_t alignment) = 0;
  virtual void do_deallocate(void* pointer, std::size_t bytes, std::size_t alignment) noexcept = 0;
  // Stream-ordered resources override all three; the defaults ignore the stream.
  virtual bool is_stream_ordered() const noexcept { return false; }
  virtual void* do_allocate_on(on_stream, std::size_t bytes, std::size_t alignment) {
    return do_allocate(bytes, alignment);
  }
  virtual void do_deallocate_on(on_stream, void* pointer, std::size_t bytes, std::size_t alignment) noexcept {
    do_deallocate(pointer, bytes, alignment);
  }

  [[noreturn]] void throw_out_of_memory(std::size_t bytes, const std::string& detail) const {
    throw out_of_memory(std::string("memkit: out of memory: ") + name() + " could not allocate " +
                            format_bytes(bytes) + " (" + std::to_string(bytes) + " bytes)" +
                            (detail.empty() ? "" : ": " + detail),
                        bytes);
  }
};

class host_resource final : public memory_resource {
 public:
  memory_kind kind() const noexcept override { return memory_kind::host; }
  const char* name() const noexcept override { return "host_resource"; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    try {
      return ::operator new(bytes, std::align_val_t{alignment});
    } catch (const std::bad_alloc&) {
      throw_out_of_memory(bytes, "operator new failed");
    }
  }
  void do_deallocate(void* pointer, std::size_t, std::size_t alignment) noexcept override {
    ::operator delete(pointer, std::align_val_t{alignment});
  }
};

// The process-wide host resource components use when the caller names none.
inline host_resource& default_host_resource() noexcept {
  static host_resource resource;
  return resource;
}

namespace detail {
// CUDA operations take their workspace stream-ordered on their executor's stream (docs/cuda.md, "Workspace"):
// this refuses a resource whose release would be a cudaFree, which waits for the whole device.
inline void require_stream_ordered(const memory_resource& workspace, const char* operation) {
  require(workspace.stream_ordered(),
          std::string(operation) + " (CUDA): the workspace resource (" + workspace.name() +
              ") is not stream-ordered; pass a device_async_resource, or a tracking_resource category over one, "
              "so that the workspace is allocated and released on the executor's stream without synchronizing "
              "the device");
}
}  // namespace detail

#if MEMKIT_HAS_CUDA
namespace detail {
// Base of the CUDA resources: maps CUDA's out-of-memory to out_of_memory and any other failure
// to cuda_error, and refuses alignments above the 256 bytes CUDA's allocators guarantee.
class cuda_resource_base : public memory_resource {
 protected:
  void check_allocation(cudaError_t code, std::size_t bytes, std::size_t alignment, const char* call) const {
    if (code == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      throw_out_of_memory(bytes, std::string(call) + ": " + cudaGetErrorString(code));
    }
    detail::cuda_check(code, call, __FILE__, __LINE__);
    (void)alignment;
  }
  void require_alignment(std::size_t alignment) const {
    require(alignment <= default_alignment, std::string(name()) + ": alignment " + std::to_string(alignment) +
                                                " exceeds the 256 bytes CUDA allocations guarantee");
  }
};

// Runs a callable with `device` current, restoring the caller's device afterwards.
template <class F>
auto with_device(int device, F&& body) {
  int previous = 0;
  MEMKIT_CUDA_CHECK(cudaGetDevice(&previous));
  if (previous != device) MEMKIT_CUDA_CHECK(cudaSetDevice(device));
  struct restore {
    int device, previous;
    ~restore() {
      if (device != previous) (void)cudaSetDevice(previous);
    }
  } guard{device, previous};
  return body();
}
}  // namespace detail

class device_resource final : public detail::cuda_resource_base {
 public:
  explicit device_resource(int device = 0) : device_(device) {}
  int device() const noexcept { return device_; }
  memory_kind kind() const noexcept override { return memory_kind::device; }
  const char* name() const noexcept override { return "device_resource"; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    require_alignment(alignment);
    return detail::with_device(device_, [&] {
      void* pointer = nullptr;
      check_allocation(cudaMalloc(&pointer, bytes), bytes, alignment, "cudaMalloc");
      return pointer;
    });
  }
  void do_deallocate(void* pointer, std::size_t, std::size_t) noexcept override { (void)cudaFree(pointer); }

 private:
  int device_;
};

// Stream-ordered device memory (cudaMallocAsync / cudaFreeAsync from the device's default memory pool), never
// synchronizing the device. allocate_on / deallocate_on order each allocation on the stream they name: memkit's
// CUDA operations pass their executor's stream, so their workspace is allocated and released in the order of
// the kernels that use it, whatever stream this resource was made with. allocate / deallocate (buffers that
// outlive an operation: weights, state) order on the resource's own `stream`; use such memory on another
// stream only after that stream waits for this one (an event), as for any stream-ordered allocation.
class device_async_resource final : public detail::cuda_resource_base {
 public:
  explicit device_async_resource(cudaStream_t stream, int device = 0) : stream_(stream), device_(device) {}
  cudaStream_t stream() const noexcept { return stream_; }
  int device() const noexcept { return device_; }
  memory_kind kind() const noexcept override { return memory_kind::device; }
  const char* name() const noexcept override { return "device_async_resource"; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    return allocate_ordered(stream_, bytes, alignment);
  }
  void do_deallocate(void* pointer, std::size_t, std::size_t) noexcept override {
    (void)cudaFreeAsync(pointer, stream_);
  }
  bool is_stream_ordered() const noexcept override { return true; }
  void* do_allocate_on(on_stream where, std::size_t bytes, std::size_t alignment) override {
    return allocate_ordered(static_cast<cudaStream_t>(where.stream), bytes, alignment);
  }
  void do_deallocate_on(on_stream where, void* pointer, std::size_t, std::size_t) noexcept override {
    (void)cudaFreeAsync(pointer, static_cast<cudaStream_t>(where.stream));
  }

 private:
  void* allocate_ordered(cudaStream_t stream, std::size_t bytes, std::size_t alignment) {
    require_alignment(alignment);
    return detail::with_device(device_, [&] {
      void* pointer = nullptr;
      check_allocation(cudaMallocAsync(&pointer, bytes, stream), bytes, alignment, "cudaMallocAsync");
      return pointer;
    });
  }

 private:
  cudaStream_t stream_;
  int device_;
};

class pinned_host_resource final : public detail::cuda_resource_base {
 public:
  memory_kind kind() const noexcept override { return memory_kind::pinned_host; }
  const char* name() const noexcept override { return "pinned_host_resource"; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    require_alignment(alignment);
    void* pointer = nullptr;
    check_allocation(cudaMallocHost(&pointer, bytes), bytes, alignment, "cudaMallocHost");
    return pointer;
  }
  void do_deallocate(void* pointer, std::size_t, std::size_t) noexcept override { (void)cudaFreeHost(pointer); }
};

// Managed memory for state that may be paged out of the device (paged optimizers). Callers
// prefetch it before use (cudaMemPrefetchAsync) and may advise it back to the host when idle.
class managed_resource final : public detail::cuda_resource_base {
 public:
  memory_kind kind() const noexcept override { return memory_kind::managed; }
  const char* name() const noexcept override { return "managed_resource"; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    require_alignment(alignment);
    void* pointer = nullptr;
    check_allocation(cudaMallocManaged(&pointer, bytes, cudaMemAttachGlobal), bytes, alignment, "cudaMallocManaged");
    return pointer;
  }
  void do_deallocate(void* pointer, std::size_t, std::size_t) noexcept override { (void)cudaFree(pointer); }
};
#endif

MEMKIT_NAMESPACE_END
