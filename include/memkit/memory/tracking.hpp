// memkit/memory/tracking.hpp — a resource adaptor that counts bytes by training-memory category.
//
// tracking_resource wraps any memory_resource and records current and peak bytes, in total and
// per category (weights, gradients, optimizer state, activations, workspace, other). Hand a
// component `tracker.category(memory_category::optimizer_state)` and its allocations are charged
// there. It is the runtime counterpart of memory_budget's prediction, and tests compare the two.
// Thread-safe: allocations from several threads are counted under one mutex. Stream-ordered allocation
// (allocate_on / deallocate_on) passes through to the upstream: a tracker over a device_async_resource is
// stream-ordered too.
#pragma once

#include <array>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>

#include "memkit/config.hpp"
#include "memkit/memory/resource.hpp"

MEMKIT_NAMESPACE_BEGIN

enum class memory_category : std::uint8_t { weights, gradients, optimizer_state, activations, workspace, other };
inline constexpr int memory_category_count = 6;

constexpr const char* to_string(memory_category category) noexcept {
  switch (category) {
    case memory_category::weights: return "weights";
    case memory_category::gradients: return "gradients";
    case memory_category::optimizer_state: return "optimizer_state";
    case memory_category::activations: return "activations";
    case memory_category::workspace: return "workspace";
    case memory_category::other: return "other";
  }
  return "unknown";
}

struct memory_stats {
  std::size_t current_bytes = 0;   // bytes live now
  std::size_t peak_bytes = 0;      // most bytes live at once since construction or reset_peak()
  std::size_t live_allocations = 0;
  std::size_t total_allocations = 0;  // allocations ever made
};

class tracking_resource final : public memory_resource {
 public:
  explicit tracking_resource(memory_resource& upstream, std::string label = "tracker")
      : upstream_(upstream), label_(std::move(label)) {
    for (int i = 0; i < memory_category_count; ++i) categories_[i].init(*this, static_cast<memory_category>(i));
  }
  tracking_resource(const tracking_resource&) = delete;
  tracking_resource& operator=(const tracking_resource&) = delete;

  // Destroying a tracker with live allocations would leave their release uncounted: report it.
  ~tracking_resource() override {
    if (!live_.empty())
      std::fprintf(stderr, "memkit: tracking_resource '%s' destroyed with %zu live allocations (%zu bytes)\n",
                   label_.c_str(), live_.size(), total_.current_bytes);
  }

  // A resource that allocates from the upstream and charges `category`.
  memory_resource& category(memory_category category) noexcept {
    return categories_[static_cast<int>(category)];
  }

  memory_stats total() const {
    std::lock_guard lock(mutex_);
    return total_;
  }
  memory_stats stats(memory_category category) const {
    std::lock_guard lock(mutex_);
    return per_category_[static_cast<int>(category)];
  }
  std::size_t current_bytes() const { return total().current_bytes; }
  std::size_t peak_bytes() const { return total().peak_bytes; }

  // Starts a new high-water mark from what is live now, e.g. at the start of a training step.
  void reset_peak() {
    std::lock_guard lock(mutex_);
    total_.peak_bytes = total_.current_bytes;
    for (auto& s : per_category_) s.peak_bytes = s.current_bytes;
  }

  // A fixed-width table: one row per category that was ever used, then the total.
  std::string report() const {
    std::lock_guard lock(mutex_);
    std::string text = "memkit memory report: " + label_ + " (" + upstream_.name() + ", " +
                       to_string(upstream_.kind()) + " memory)\n";
    char row[160];
    std::snprintf(row, sizeof row, "  %-16s %14s %14s %8s\n", "category", "current", "peak", "live");
    text += row;
    for (int i = 0; i < memory_category_count; ++i) {
      const memory_stats& s = per_category_[i];
      if (s.total_allocations == 0) continue;
      std::snprintf(row, sizeof row, "  %-16s %14s %14s %8zu\n", to_string(static_cast<memory_category>(i)),
                    format_bytes(s.current_bytes).c_str(), format_bytes(s.peak_bytes).c_str(), s.live_allocations);
      text += row;
    }
    std::snprintf(row, sizeof row, "  %-16s %14s %14s %8zu\n", "total", format_bytes(total_.current_bytes).c_str(),
                  format_bytes(total_.peak_bytes).c_str(), total_.live_allocations);
    return text + row;
  }

  memory_kind kind() const noexcept override { return upstream_.kind(); }
  const char* name() const noexcept override { return "tracking_resource"; }
  memory_resource& upstream() const noexcept { return upstream_; }
  const std::string& label() const noexcept { return label_; }

 protected:
  // Allocating from the tracker itself charges `other`.
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    return allocate_in(memory_category::other, bytes, alignment);
  }
  void do_deallocate(void* pointer, std::size_t bytes, std::size_t alignment) noexcept override {
    deallocate_in(pointer, bytes, alignment);
  }
  bool is_stream_ordered() const noexcept override { return upstream_.stream_ordered(); }
  void* do_allocate_on(on_stream where, std::size_t bytes, std::size_t alignment) override {
    return allocate_in(memory_category::other, bytes, alignment, &where);
  }
  void do_deallocate_on(on_stream where, void* pointer, std::size_t bytes, std::size_t alignment) noexcept override {
    deallocate_in(pointer, bytes, alignment, &where);
  }

 private:
  class category_resource final : public memory_resource {
   public:
    void init(tracking_resource& owner, memory_category category) {
      owner_ = &owner;
      category_ = category;
    }
    memory_kind kind() const noexcept override { return owner_->kind(); }
    const char* name() const noexcept override { return to_string(category_); }

   protected:
    void* do_allocate(std::size_t bytes, std::size_t alignment) override {
      return owner_->allocate_in(category_, bytes, alignment);
    }
    void do_deallocate(void* pointer, std::size_t bytes, std::size_t alignment) noexcept override {
      owner_->deallocate_in(pointer, bytes, alignment);
    }
    bool is_stream_ordered() const noexcept override { return owner_->stream_ordered(); }
    void* do_allocate_on(on_stream where, std::size_t bytes, std::size_t alignment) override {
      return owner_->allocate_in(category_, bytes, alignment, &where);
    }
    void do_deallocate_on(on_stream where, void* pointer, std::size_t bytes, std::size_t alignment) noexcept override {
      owner_->deallocate_in(pointer, bytes, alignment, &where);
    }

   private:
    tracking_resource* owner_ = nullptr;
    memory_category category_ = memory_category::other;
  };

  struct live_record {
    std::size_t bytes;
    memory_category category;
  };

  // `where`: the stream of a stream-ordered allocation (allocate_on), passed on to the upstream.
  void* allocate_in(memory_category category, std::size_t bytes, std::size_t alignment,
                    const on_stream* where = nullptr) {
    void* pointer = nullptr;
    try {
      pointer = where != nullptr ? upstream_.allocate_on(*where, bytes, alignment) : upstream_.allocate(bytes, alignment);
    } catch (const out_of_memory& failure) {
      throw out_of_memory(failure_message(category, bytes, failure.what()), bytes);
    }
    std::lock_guard lock(mutex_);
    live_.emplace(pointer, live_record{bytes, category});
    charge(total_, bytes);
    charge(per_category_[static_cast<int>(category)], bytes);
    return pointer;
  }

  void deallocate_in(void* pointer, std::size_t bytes, std::size_t alignment, const on_stream* where = nullptr) noexcept {
    {
      std::lock_guard lock(mutex_);
      auto found = live_.find(pointer);
      if (found == live_.end() || found->second.bytes != bytes) {
        // Releasing memory this tracker did not hand out (or with the wrong size) is heap corruption
        // waiting to happen; stop here, where the bug is, rather than later.
        std::fprintf(stderr, "memkit: tracking_resource '%s': deallocate(%p, %zu) does not match a live allocation\n",
                     label_.c_str(), pointer, bytes);
        std::abort();
      }
      release(total_, bytes);
      release(per_category_[static_cast<int>(found->second.category)], bytes);
      live_.erase(found);
    }
    if (where != nullptr)
      upstream_.deallocate_on(*where, pointer, bytes, alignment);
    else
      upstream_.deallocate(pointer, bytes, alignment);
  }

  static void charge(memory_stats& s, std::size_t bytes) {
    s.current_bytes += bytes;
    if (s.current_bytes > s.peak_bytes) s.peak_bytes = s.current_bytes;
    ++s.live_allocations;
    ++s.total_allocations;
  }
  static void release(memory_stats& s, std::size_t bytes) {
    s.current_bytes -= bytes;
    --s.live_allocations;
  }

  std::string failure_message(memory_category category, std::size_t bytes, const char* upstream_message) const {
    std::lock_guard lock(mutex_);
    std::string text = "memkit: out of memory: requested " + format_bytes(bytes) + " (" + std::to_string(bytes) +
                       " bytes) for " + to_string(category) + " from tracker '" + label_ + "'; it held " +
                       format_bytes(total_.current_bytes) + " (peak " + format_bytes(total_.peak_bytes) + ")";
    const char* separator = ": ";
    for (int i = 0; i < memory_category_count; ++i) {
      if (per_category_[i].current_bytes == 0) continue;
      text += separator;
      text += std::string(to_string(static_cast<memory_category>(i))) + " " + format_bytes(per_category_[i].current_bytes);
      separator = ", ";
    }
    return text + ". Upstream said: " + upstream_message;
  }

  memory_resource& upstream_;
  std::string label_;
  std::array<category_resource, memory_category_count> categories_{};
  mutable std::mutex mutex_;
  memory_stats total_{};
  std::array<memory_stats, memory_category_count> per_category_{};
  std::unordered_map<void*, live_record> live_;
};

MEMKIT_NAMESPACE_END
