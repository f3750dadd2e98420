// memkit/budget/layer_list.hpp — memory_budget for any model: a list of layers, each given by the arguments of
// its operations (the component protocol's byte functions) and the bytes of its parameters.
//
//   budget::layer_list model;
//   model.add({.weights = w, .gradients = g, .optimizer_state = s},       // the layer's parameter bytes
//             layers::dense_linear_arguments<float>{.rows = 512, .in = 64, .out = 96});
//   model.add({...}, lora_forward_args, lora_backward_args);              // any memkit::operation_arguments
//   static_assert(model.fits(80 * GiB));                                   // all of it constexpr
//
// The prediction is that of a forward over every layer followed by a backward in reverse order (the step of a
// hand-written training loop without checkpointing):
//   weights, gradients, optimizer_state  the sums of the layers' parameter bytes, allocated up front;
//   activations                          the sum of every operation's saved_bytes: what the forward pass keeps
//                                        for the backward, all alive when the last forward returns;
//   workspace                            the largest workspace_bytes of any operation: every call returns its
//                                        workspace before the next one starts.
// bytes() gives them as a budget::breakdown (budget/breakdown.hpp, the categories of budget::estimate), total()
// their sum, fits(capacity) whether the sum is at most `capacity`. Nothing else is counted: the tensors a loop
// passes between the layers (inputs, outputs, their gradients), a CUDA context, the caching allocator's slack.
// Pass every operation a layer runs (a lora_linear's forward_arguments and backward_arguments; a dense_linear's
// one dense_linear_arguments covers both of its passes): a backward's saved_bytes is 0, its workspace counts.
#pragma once

#include <cstdint>

#include "memkit/budget/breakdown.hpp"
#include "memkit/config.hpp"
#include "memkit/core/protocol.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace budget {

// What a layer's parameters hold for the whole run: the values (a frozen base included), their gradients and
// the optimizer's state for them (e.g. optim::adam_layout<S>::tensor_bytes of the trained elements).
struct parameter_bytes {
  std::uint64_t weights = 0;
  std::uint64_t gradients = 0;
  std::uint64_t optimizer_state = 0;
};

class layer_list {
 public:
  // Appends a layer: its parameters and the arguments of the operations it runs in a step.
  template <operation_arguments... Operations>
  constexpr layer_list& add(const parameter_bytes& parameters, const Operations&... operations) noexcept {
    parameters_.weights += parameters.weights;
    parameters_.gradients += parameters.gradients;
    parameters_.optimizer_state += parameters.optimizer_state;
    (add_operation(saved_bytes(operations), workspace_bytes(operations)), ...);
    ++layers_;
    return *this;
  }

  constexpr int size() const noexcept { return layers_; }

  // The step's bytes by category (weights, gradients, optimizer_state, activations, workspace; the rest 0).
  constexpr breakdown bytes() const noexcept {
    breakdown b;
    b[category::weights] = parameters_.weights;
    b[category::gradients] = parameters_.gradients;
    b[category::optimizer_state] = parameters_.optimizer_state;
    b[category::activations] = activations_;
    b[category::workspace] = workspace_;
    return b;
  }
  constexpr std::uint64_t total() const noexcept { return bytes().total(); }
  constexpr bool fits(std::uint64_t capacity_bytes) const noexcept { return total() <= capacity_bytes; }

 private:
  constexpr void add_operation(std::uint64_t saved, std::uint64_t workspace) noexcept {
    activations_ += saved;
    if (workspace > workspace_) workspace_ = workspace;
  }

  parameter_bytes parameters_{};
  std::uint64_t activations_ = 0;
  std::uint64_t workspace_ = 0;
  int layers_ = 0;
};

}  // namespace budget
MEMKIT_NAMESPACE_END
