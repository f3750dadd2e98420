// memkit/memory/capped.hpp — a memory cap: a resource that refuses any allocation that would take what it
// has handed out past N bytes, with memkit's out_of_memory error.
//
// It holds a run to "a 24 GB GPU" on a bigger device, or to a device's size on the host: put it between the
// real resource and everything else (typically under a tracking_resource, whose report then names the
// category that asked). Bytes are counted as requested (as a tracking_resource counts them), so a cap equal
// to a tracker's measured peak lets exactly that run through. Stream-ordered allocations pass through in
// order to a stream-ordered upstream. Thread-safe.
#pragma once

#include <cstddef>
#include <mutex>
#include <string>

#include "memkit/config.hpp"
#include "memkit/core/units.hpp"
#include "memkit/memory/resource.hpp"

MEMKIT_NAMESPACE_BEGIN

class capped_resource final : public memory_resource {
 public:
  capped_resource(memory_resource& upstream, std::size_t cap_bytes) : upstream_(upstream), cap_(cap_bytes) {}
  capped_resource(const capped_resource&) = delete;
  capped_resource& operator=(const capped_resource&) = delete;

  std::size_t cap() const noexcept { return cap_; }
  std::size_t used() const {
    std::lock_guard lock(mutex_);
    return used_;
  }
  std::size_t peak() const {
    std::lock_guard lock(mutex_);
    return peak_;
  }
  memory_resource& upstream() const noexcept { return upstream_; }

  memory_kind kind() const noexcept override { return upstream_.kind(); }
  const char* name() const noexcept override { return "capped_resource"; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    reserve(bytes);
    try {
      return upstream_.allocate(bytes, alignment);
    } catch (...) {
      release(bytes);
      throw;
    }
  }
  void do_deallocate(void* pointer, std::size_t bytes, std::size_t alignment) noexcept override {
    upstream_.deallocate(pointer, bytes, alignment);
    release(bytes);
  }
  bool is_stream_ordered() const noexcept override { return upstream_.stream_ordered(); }
  void* do_allocate_on(on_stream where, std::size_t bytes, std::size_t alignment) override {
    reserve(bytes);
    try {
      return upstream_.allocate_on(where, bytes, alignment);
    } catch (...) {
      release(bytes);
      throw;
    }
  }
  void do_deallocate_on(on_stream where, void* pointer, std::size_t bytes, std::size_t alignment) noexcept override {
    upstream_.deallocate_on(where, pointer, bytes, alignment);
    release(bytes);
  }

 private:
  void reserve(std::size_t bytes) {
    std::lock_guard lock(mutex_);
    if (bytes > cap_ - used_)  // used_ <= cap_ always: no wrap
      throw_out_of_memory(bytes, "the cap is " + format_bytes(cap_) + " and " + format_bytes(used_) +
                                     " are in use, so " + format_bytes(cap_ - used_) + " are left");
    used_ += bytes;
    if (used_ > peak_) peak_ = used_;
  }
  void release(std::size_t bytes) noexcept {
    std::lock_guard lock(mutex_);
    used_ -= bytes;
  }

  memory_resource& upstream_;
  const std::size_t cap_;
  mutable std::mutex mutex_;
  std::size_t used_ = 0, peak_ = 0;
};

MEMKIT_NAMESPACE_END
