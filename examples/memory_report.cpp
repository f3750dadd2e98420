// memory_report: allocate the memory of a small mixed-precision training setup through a
// tracking_resource and print what it holds.
#include <memkit/memkit.hpp>

#include <cstdio>

int main() {
  using memkit::memory_category;
  memkit::tracking_resource tracker(memkit::default_host_resource(), "tiny-mlp");

  // A 2-layer MLP, 1024 -> 4096 -> 1024, trained with bf16 weights, fp32 master weights and Adam.
  const std::int64_t parameters = 2 * 1024 * 4096;
  const std::int64_t batch = 32;
  memkit::buffer<memkit::bf16> weights(tracker.category(memory_category::weights), memkit::shape{parameters});
  memkit::buffer<memkit::bf16> gradients(tracker.category(memory_category::gradients), memkit::shape{parameters});
  memkit::buffer<float> master(tracker.category(memory_category::optimizer_state), memkit::shape{parameters});
  memkit::buffer<float> adam_m(tracker.category(memory_category::optimizer_state), memkit::shape{parameters});
  memkit::buffer<float> adam_v(tracker.category(memory_category::optimizer_state), memkit::shape{parameters});
  {
    // Activations live only through forward and backward: the peak counts them, the end does not.
    memkit::buffer<memkit::bf16> hidden(tracker.category(memory_category::activations), memkit::shape{batch, 4096});
    memkit::buffer<memkit::bf16> input(tracker.category(memory_category::activations), memkit::shape{batch, 1024});
    std::printf("%s\n", tracker.report().c_str());
  }
  std::printf("after the step, activations are released:\n%s\n", tracker.report().c_str());
  std::printf("bytes per parameter held: %.1f (bf16 weights + bf16 grads + fp32 master + fp32 m, v)\n",
              static_cast<double>(tracker.current_bytes()) / static_cast<double>(parameters));
  return 0;
}
