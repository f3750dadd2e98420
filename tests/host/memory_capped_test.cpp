// capped_resource: a memory cap that refuses, with out_of_memory, any allocation past N bytes (#31).
#include <memkit/memory/buffer.hpp>
#include <memkit/memory/capped.hpp>
#include <memkit/memory/tracking.hpp>

#include <doctest/doctest.h>

#include <string>

TEST_CASE("capped_resource: allocations up to the cap pass, the one past it is refused, frees make room again") {
  memkit::capped_resource cap(memkit::default_host_resource(), 1000);
  CHECK(cap.kind() == memkit::memory_kind::host);
  void* a = cap.allocate(600);
  void* b = cap.allocate(400);  // exactly the cap
  CHECK(cap.used() == 1000);
  try {
    (void)cap.allocate(1);
    FAIL("allocated past the cap");
  } catch (const memkit::out_of_memory& e) {
    CHECK(e.requested_bytes() == 1);
    CHECK(std::string(e.what()).find("capped_resource could not allocate 1 B (1 bytes): the cap is 1000 B and 1000 B "
                                     "are in use, so 0 B are left") != std::string::npos);
  }
  CHECK(cap.used() == 1000);  // the refused request took nothing
  cap.deallocate(a, 600);
  void* c = cap.allocate(500);
  CHECK(cap.used() == 900);
  CHECK(cap.peak() == 1000);
  cap.deallocate(b, 400);
  cap.deallocate(c, 500);
  CHECK(cap.used() == 0);
  CHECK(cap.allocate(0) == nullptr);  // nothing asked, nothing counted
}

TEST_CASE("capped_resource: under a tracker, a cap at a run's measured peak lets that run through and no more") {
  memkit::capped_resource cap(memkit::default_host_resource(), 3 * memkit::buffer<float>::bytes_required(memkit::shape{100}));
  memkit::tracking_resource tracker(cap, "capped");
  memkit::memory_resource& weights = tracker.category(memkit::memory_category::weights);
  memkit::buffer<float> x(weights, memkit::shape{100}), y(weights, memkit::shape{100}), z(weights, memkit::shape{100});
  CHECK(tracker.current_bytes() == cap.cap());
  CHECK_THROWS_AS(memkit::buffer<float>(weights, memkit::shape{1}), memkit::out_of_memory);
  CHECK(tracker.current_bytes() == cap.cap());  // the tracker did not count the refused buffer
  // A request so large that used + bytes would wrap is refused too.
  CHECK_THROWS_AS((void)cap.allocate(~std::size_t{0} - 10), memkit::out_of_memory);
}
