#include <doctest/doctest.h>
#include <memkit/core/float16.hpp>
#include <memkit/memory/buffer.hpp>
#include <memkit/memory/resource.hpp>
#include <memkit/memory/tracking.hpp>

#include <cstdint>
#include <string>
#include <thread>
#include <vector>

using memkit::memory_category;

namespace {

// A host resource with a hard capacity, to provoke out-of-memory deterministically.
class capped_resource final : public memkit::memory_resource {
 public:
  explicit capped_resource(std::size_t capacity) : capacity_(capacity) {}
  memkit::memory_kind kind() const noexcept override { return memkit::memory_kind::host; }
  const char* name() const noexcept override { return "capped_resource"; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    if (used_ + bytes > capacity_) throw_out_of_memory(bytes, "capacity exhausted");
    used_ += bytes;
    return memkit::default_host_resource().allocate(bytes, alignment);
  }
  void do_deallocate(void* pointer, std::size_t bytes, std::size_t alignment) noexcept override {
    used_ -= bytes;
    memkit::default_host_resource().deallocate(pointer, bytes, alignment);
  }

 private:
  std::size_t capacity_, used_ = 0;
};

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("host_resource: alignment, zero-byte requests and bad alignment") {
  auto& resource = memkit::default_host_resource();
  for (std::size_t alignment : {std::size_t{16}, std::size_t{256}, std::size_t{4096}}) {
    void* p = resource.allocate(1000, alignment);
    CHECK(reinterpret_cast<std::uintptr_t>(p) % alignment == 0);
    resource.deallocate(p, 1000, alignment);
  }
  void* default_aligned = resource.allocate(3);
  CHECK(reinterpret_cast<std::uintptr_t>(default_aligned) % memkit::default_alignment == 0);
  resource.deallocate(default_aligned, 3);
  CHECK(resource.allocate(0) == nullptr);
  CHECK_THROWS_WITH_AS(resource.allocate(64, 48), "host_resource: alignment 48 is not a power of two", memkit::error);
  CHECK(resource.kind() == memkit::memory_kind::host);
}

// Not under ASan (MEMKIT_TEST_SANITIZED): its operator new aborts on a 4 EiB request instead of throwing, whatever
// allocator_may_return_null says; the g++ build runs this case.
#if !defined(MEMKIT_TEST_SANITIZED)
TEST_CASE("host_resource: an impossible request raises out_of_memory naming the size") {
  const std::size_t absurd = std::size_t{1} << 62;
  try {
    (void)memkit::default_host_resource().allocate(absurd);
    FAIL("allocating 4 EiB succeeded");
  } catch (const memkit::out_of_memory& failure) {
    CHECK(failure.requested_bytes() == absurd);
    CHECK(contains(failure.what(), "host_resource could not allocate"));
    CHECK(contains(failure.what(), std::to_string(absurd) + " bytes"));
  }
}
#endif

TEST_CASE("tracking_resource: current and peak bytes, in total and per category") {
  memkit::tracking_resource tracker(memkit::default_host_resource(), "unit");
  auto& weights = tracker.category(memory_category::weights);
  auto& activations = tracker.category(memory_category::activations);

  void* w = weights.allocate(1000);
  void* a1 = activations.allocate(300);
  void* a2 = activations.allocate(200);
  CHECK(tracker.current_bytes() == 1500);
  CHECK(tracker.stats(memory_category::activations).current_bytes == 500);
  CHECK(tracker.stats(memory_category::activations).live_allocations == 2);

  activations.deallocate(a1, 300);
  CHECK(tracker.current_bytes() == 1200);
  CHECK(tracker.peak_bytes() == 1500);
  CHECK(tracker.stats(memory_category::activations).peak_bytes == 500);
  CHECK(tracker.stats(memory_category::weights).peak_bytes == 1000);
  CHECK(tracker.stats(memory_category::gradients).total_allocations == 0);

  tracker.reset_peak();
  CHECK(tracker.peak_bytes() == 1200);
  CHECK(tracker.stats(memory_category::activations).peak_bytes == 200);

  void* other = tracker.allocate(64);  // the tracker itself charges "other"
  CHECK(tracker.stats(memory_category::other).current_bytes == 64);
  tracker.deallocate(other, 64);

  const std::string report = tracker.report();
  CHECK(contains(report, "memkit memory report: unit (host_resource, host memory)"));
  CHECK(contains(report, "weights"));
  CHECK(contains(report, "activations"));
  CHECK(contains(report, "other"));
  CHECK_FALSE(contains(report, "gradients"));  // never used: no row
  CHECK(contains(report, "1000 B"));

  activations.deallocate(a2, 200);
  weights.deallocate(w, 1000);
  CHECK(tracker.current_bytes() == 0);
  CHECK(tracker.total().total_allocations == 4);
}

TEST_CASE("tracking_resource: out of memory says what was asked, for what, and what was held") {
  capped_resource small(10000);
  memkit::tracking_resource tracker(small, "train");
  memkit::buffer<float> weights(tracker.category(memory_category::weights), memkit::shape{1000});
  memkit::buffer<float> grads(tracker.category(memory_category::gradients), memkit::shape{500});
  try {
    memkit::buffer<float> state(tracker.category(memory_category::optimizer_state), memkit::shape{2000});
    FAIL("allocation beyond the cap succeeded");
  } catch (const memkit::out_of_memory& failure) {
    const std::string message = failure.what();
    CHECK(failure.requested_bytes() == 8000);
    CHECK(contains(message, "requested 7.81 KiB (8000 bytes) for optimizer_state from tracker 'train'"));
    CHECK(contains(message, "it held 5.86 KiB"));
    CHECK(contains(message, "weights 3.91 KiB, gradients 1.95 KiB"));
    CHECK(contains(message, "capped_resource could not allocate"));
  }
  // Nothing was charged for the failed request.
  CHECK(tracker.current_bytes() == 6000);
  CHECK(tracker.stats(memory_category::optimizer_state).total_allocations == 0);
}

TEST_CASE("tracking_resource: counts stay exact under concurrent allocation") {
  memkit::tracking_resource tracker(memkit::default_host_resource());
  auto work = [&](memory_category category) {
    for (int i = 0; i < 2000; ++i) {
      void* p = tracker.category(category).allocate(128);
      tracker.category(category).deallocate(p, 128);
    }
  };
  std::thread first(work, memory_category::activations), second(work, memory_category::workspace);
  first.join();
  second.join();
  CHECK(tracker.current_bytes() == 0);
  CHECK(tracker.total().total_allocations == 4000);
  CHECK(tracker.peak_bytes() >= 128);
  CHECK(tracker.peak_bytes() <= 256);
}

TEST_CASE("buffer: predicts its bytes, owns its memory, moves without double release") {
  memkit::tracking_resource tracker(memkit::default_host_resource());
  const memkit::shape dims{128, 64};
  static_assert(memkit::buffer<memkit::bf16>::bytes_required(memkit::shape{128, 64}) == 128 * 64 * 2);
  {
    memkit::buffer<memkit::bf16> first(tracker.category(memory_category::weights), dims);
    CHECK(tracker.current_bytes() == memkit::buffer<memkit::bf16>::bytes_required(dims));
    CHECK(first.view().where() == memkit::memory_kind::host);
    CHECK(first.view().shape() == dims);
    CHECK(reinterpret_cast<std::uintptr_t>(first.data()) % memkit::default_alignment == 0);

    memkit::buffer<memkit::bf16> second = std::move(first);
    CHECK(first.data() == nullptr);
    CHECK(second.size() == 128 * 64);
    memkit::buffer<memkit::bf16> third;
    third = std::move(second);
    CHECK(tracker.total().live_allocations == 1);
    third = memkit::buffer<memkit::bf16>(tracker.category(memory_category::weights), memkit::shape{2});
    CHECK(tracker.current_bytes() == 4);  // the old allocation was released on assignment
  }
  CHECK(tracker.current_bytes() == 0);
  memkit::buffer<float> empty(tracker, memkit::shape{0});
  CHECK(empty.data() == nullptr);
}

TEST_CASE("format_bytes: binary units") {
  CHECK(memkit::format_bytes(0) == "0 B");
  CHECK(memkit::format_bytes(1023) == "1023 B");
  CHECK(memkit::format_bytes(1536) == "1.50 KiB");
  CHECK(memkit::format_bytes(80ull * memkit::GiB) == "80.00 GiB");
}
