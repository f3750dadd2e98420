// A program that uses memkit the way a consumer would; built by each consumption test.
#include <memkit/memkit.hpp>

#include <cstdio>

int main() {
  memkit::tracking_resource tracker(memkit::default_host_resource(), "consumer");
  memkit::buffer<memkit::bf16> weights(tracker.category(memkit::memory_category::weights), memkit::shape{64, 64});
  weights.data()[0] = memkit::bf16(1.5f);
  const bool ok = static_cast<float>(weights.data()[0]) == 1.5f && tracker.current_bytes() == 64 * 64 * 2;
  std::printf("memkit %d.%d.%d consumer: %s\n", memkit::version.major, memkit::version.minor, memkit::version.patch,
              ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
