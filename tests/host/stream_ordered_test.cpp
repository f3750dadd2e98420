// Stream-ordered allocation (docs/cuda.md, "Workspace"): allocate_on / deallocate_on reach the resource with
// their stream through trackers and buffers, resources that are not stream-ordered say so, and the per-stream
// lookup behind the cuBLAS workspaces keeps one entry per (device, stream). All without CUDA: the stream is
// an opaque handle here, and the resource a host-memory stand-in that records what it was asked.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "memkit/core/cublas.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"
#include "memkit/memory/tracking.hpp"

namespace {
// Host memory, claiming to be stream-ordered; records every call with its stream.
class recording_resource final : public memkit::memory_resource {
 public:
  struct call {
    void* pointer;
    void* stream;
    std::size_t bytes;
  };
  std::vector<call> ordered_allocations, ordered_releases;
  int plain_allocations = 0, plain_releases = 0;

  memkit::memory_kind kind() const noexcept override { return memkit::memory_kind::host; }
  const char* name() const noexcept override { return "recording_resource"; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    ++plain_allocations;
    return upstream_.allocate(bytes, alignment);
  }
  void do_deallocate(void* pointer, std::size_t bytes, std::size_t alignment) noexcept override {
    ++plain_releases;
    upstream_.deallocate(pointer, bytes, alignment);
  }
  bool is_stream_ordered() const noexcept override { return true; }
  void* do_allocate_on(memkit::on_stream where, std::size_t bytes, std::size_t alignment) override {
    void* pointer = upstream_.allocate(bytes, alignment);
    ordered_allocations.push_back({pointer, where.stream, bytes});
    return pointer;
  }
  void do_deallocate_on(memkit::on_stream where, void* pointer, std::size_t bytes,
                        std::size_t alignment) noexcept override {
    ordered_releases.push_back({pointer, where.stream, bytes});
    upstream_.deallocate(pointer, bytes, alignment);
  }

 private:
  memkit::host_resource upstream_;
};

void* fake_stream(std::uintptr_t id) { return reinterpret_cast<void*>(id); }
}  // namespace

TEST_CASE("stream-ordered allocation: a tracker and a buffer pass the stream through, allocation and release") {
  recording_resource upstream;
  memkit::tracking_resource tracker(upstream, "ordered");
  memkit::memory_resource& workspace = tracker.category(memkit::memory_category::workspace);
  CHECK(upstream.stream_ordered());
  CHECK(tracker.stream_ordered());
  CHECK(workspace.stream_ordered());
  {
    memkit::buffer<float> tile(workspace, memkit::shape{100}, memkit::on_stream{fake_stream(0x51)});
    REQUIRE(upstream.ordered_allocations.size() == 1);
    CHECK(upstream.ordered_allocations[0].pointer == tile.data());
    CHECK(upstream.ordered_allocations[0].stream == fake_stream(0x51));
    CHECK(tracker.stats(memkit::memory_category::workspace).current_bytes == 400);
    // Moving the buffer moves its stream: the release happens once, on the allocation's stream.
    memkit::buffer<float> moved = std::move(tile);
    memkit::buffer<float> other(workspace, memkit::shape{8}, memkit::on_stream{fake_stream(0x52)});
    other = std::move(moved);  // releases `other`'s own allocation on 0x52
    REQUIRE(upstream.ordered_releases.size() == 1);
    CHECK(upstream.ordered_releases[0].stream == fake_stream(0x52));
    CHECK(upstream.ordered_releases[0].bytes == 32);
  }
  REQUIRE(upstream.ordered_releases.size() == 2);
  CHECK(upstream.ordered_releases[1].pointer == upstream.ordered_allocations[0].pointer);
  CHECK(upstream.ordered_releases[1].stream == fake_stream(0x51));
  CHECK(upstream.ordered_releases[1].bytes == 400);
  CHECK(tracker.current_bytes() == 0);
  CHECK(tracker.stats(memkit::memory_category::workspace).peak_bytes == 432);
  // Nothing went through the plain, unordered calls.
  CHECK(upstream.plain_allocations == 0);
  CHECK(upstream.plain_releases == 0);
  // A plain buffer from the same tracker stays plain.
  { memkit::buffer<float> weights(tracker.category(memkit::memory_category::weights), memkit::shape{4}); }
  CHECK(upstream.plain_allocations == 1);
  CHECK(upstream.plain_releases == 1);
}

TEST_CASE("stream-ordered allocation: other resources say they are not, ignore the stream, and are refused as CUDA workspace") {
  memkit::host_resource heap;
  memkit::tracking_resource tracker(heap, "plain");
  CHECK_FALSE(heap.stream_ordered());
  CHECK_FALSE(tracker.stream_ordered());
  CHECK_FALSE(tracker.category(memkit::memory_category::workspace).stream_ordered());
  {
    memkit::buffer<double> b(tracker.category(memkit::memory_category::workspace), memkit::shape{3},
                             memkit::on_stream{fake_stream(0x9)});
    CHECK(b.data() != nullptr);
    CHECK(tracker.current_bytes() == 24);
  }
  CHECK(tracker.current_bytes() == 0);
  CHECK(heap.allocate_on(memkit::on_stream{}, 0) == nullptr);
  CHECK_THROWS_WITH_AS(memkit::detail::require_stream_ordered(tracker.category(memkit::memory_category::workspace),
                                                              "quant::matmul"),
                       doctest::Contains("quant::matmul (CUDA): the workspace resource (workspace) is not stream-ordered"),
                       memkit::error);
  recording_resource ordered;
  memkit::tracking_resource ordered_tracker(ordered, "ordered");
  CHECK_NOTHROW(memkit::detail::require_stream_ordered(ordered_tracker.category(memkit::memory_category::workspace),
                                                       "quant::matmul"));
}

TEST_CASE("cuBLAS workspaces: one per (device, stream), made once; the size cuBLAS recommends per architecture") {
  memkit::detail::per_stream_cache<int> cache;
  int made = 0;
  auto make = [&] { return ++made; };
  const int a = cache.get(0, fake_stream(1), make);
  const int b = cache.get(0, fake_stream(2), make);  // a second stream on the same device: its own workspace
  const int a_again = cache.get(0, fake_stream(1), make);
  const int other_device = cache.get(1, fake_stream(1), make);
  CHECK(a == 1);
  CHECK(b == 2);
  CHECK(a_again == 1);
  CHECK(other_device == 3);
  CHECK(made == 3);
  CHECK(cache.size() == 3);
  CHECK(memkit::detail::cublas_workspace_bytes(8) == 4u << 20);   // Ampere / Ada: 4 MiB
  CHECK(memkit::detail::cublas_workspace_bytes(9) == 32u << 20);  // Hopper: 32 MiB
  CHECK(memkit::detail::cublas_workspace_bytes(10) == 32u << 20);
}
