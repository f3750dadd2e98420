// The memory of a test that measures layers and models against their byte functions: memory_resources whose
// weights, gradients, optimizer state and workspace are the tracker's categories of those names.
#pragma once

#include <memkit/layers/parameter.hpp>
#include <memkit/memory/tracking.hpp>

#include <string>
#include <utility>

namespace memkit_test {

inline memkit::layers::memory_resources tracked_resources(memkit::tracking_resource& tracker, int host_threads = 1) {
  memkit::layers::memory_resources memory;
  memory.weights = &tracker.category(memkit::memory_category::weights);
  memory.gradients = &tracker.category(memkit::memory_category::gradients);
  memory.optimizer = &tracker.category(memkit::memory_category::optimizer_state);
  memory.workspace = &tracker.category(memkit::memory_category::workspace);
  memory.host_threads = host_threads;
  return memory;
}

// A tracker over the host heap and its resources (2 GEMM threads), activations in their own category.
struct tracked_memory {
  memkit::tracking_resource tracker;
  memkit::layers::memory_resources memory = tracked_resources(tracker, 2);
  explicit tracked_memory(std::string label) : tracker(memkit::default_host_resource(), std::move(label)) {}
  memkit::memory_resource& activations() { return tracker.category(memkit::memory_category::activations); }
};

}  // namespace memkit_test
