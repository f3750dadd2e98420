// memkit/checkpoint/cost.hpp — what a checkpoint schedule costs, predicted before anything runs: the same
// plan (schedule.hpp) interpreted over byte counts instead of tensors. checkpoint_cost_of is exact against a
// tracking_resource for checkpoint::segment; trace_checkpointing is memory_budget's view.
#pragma once

#include <cstdint>
#include <vector>

#include "memkit/checkpoint/schedule.hpp"
#include "memkit/config.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace checkpoint {

// --- predictions ----------------------------------------------------------------------------------------

// What a schedule costs on a stack, on top of the caller's input, output and gradient buffers.
struct checkpoint_cost {
  std::uint64_t recomputed_forwards = 0;
  std::uint64_t checkpoints = 0;   // most checkpoints kept at once
  std::uint64_t saved_bytes = 0;   // device bytes kept from the forward pass to the backward pass
  std::uint64_t peak_bytes = 0;    // most device activation bytes alive at once, in forward or backward
  std::uint64_t host_bytes = 0;    // pinned host bytes of offloaded checkpoints
  std::uint64_t forward_peak_bytes = 0;   // peak_bytes of the forward pass alone
  std::uint64_t backward_peak_bytes = 0;  // peak_bytes of the backward pass alone (saved_bytes included)
};

// The cost of `schedule` over `layers` layers whose hidden state at position p (0..layers) takes
// hidden_bytes(p) bytes and whose step j saves saved_bytes(j) bytes (or returns a checkpoint_step_bytes), as
// segment runs it: peak_bytes is exactly what a tracking_resource sees. Invalid input gives a zero
// cost.
template <class HiddenBytes, class SavedBytes>
constexpr checkpoint_cost checkpoint_cost_of(const schedule& schedule, std::uint64_t layers,
                                             HiddenBytes hidden_bytes, SavedBytes saved_bytes,
                                             bool offload = false) {
  const checkpoint_plan plan = make_checkpoint_plan(schedule, layers);
  if (plan.actions.empty()) return {};
  detail::checkpoint_byte_model model(hidden_bytes, saved_bytes, detail::ignore_backward{},
                                      detail::checkpoint_bytes_options{offload, true});
  detail::checkpoint_interpreter run(plan, model);
  run.forward();
  const std::uint64_t kept = model.kept_after_forward();
  run.backward();
  return {plan.recomputed(), plan.most_checkpoints, kept, model.peak_device_bytes(), model.host_bytes(),
          model.forward_peak_bytes(), model.backward_peak_bytes()};
}

// A stack of identical layers: every hidden state takes `hidden` bytes and every layer saves `saved`.
struct uniform_layer_bytes {
  std::uint64_t hidden = 0;
  std::uint64_t saved = 0;
};

constexpr checkpoint_cost checkpoint_cost_of(const schedule& schedule, std::uint64_t layers,
                                             uniform_layer_bytes bytes, bool offload = false) {
  return checkpoint_cost_of(
      schedule, layers, [bytes](std::uint64_t) { return bytes.hidden; },
      [bytes](std::uint64_t) { return bytes.saved; }, offload);
}

// memory_budget's view (autograd-like, see detail::checkpoint_byte_model): the checkpoints and taped
// layers a stack of `layers` identical layers keeps, each checkpoint `checkpoint_bytes`, each taped layer
// `layer_bytes`. at_backward(i) gives the bytes alive while layer i runs backward.
struct checkpoint_trace {
  std::uint64_t after_forward = 0;  // device bytes kept at the end of the forward pass
  std::uint64_t host_bytes = 0;     // offloaded checkpoints
  std::vector<std::uint64_t> backward_bytes;
  constexpr std::uint64_t at_backward(std::uint64_t layer) const { return backward_bytes[layer]; }
};

constexpr checkpoint_trace trace_checkpointing(const schedule& schedule, std::uint64_t layers,
                                               std::uint64_t checkpoint_bytes, std::uint64_t layer_bytes,
                                               bool offload = false) {
  checkpoint_trace trace;
  const checkpoint_plan plan = make_checkpoint_plan(schedule, layers);
  if (plan.actions.empty()) return trace;
  trace.backward_bytes.assign(layers, 0);
  auto record = [&trace](std::uint64_t step, std::uint64_t bytes) { trace.backward_bytes[step] = bytes; };
  detail::checkpoint_byte_model model([checkpoint_bytes](std::uint64_t) { return checkpoint_bytes; },
                                      [layer_bytes](std::uint64_t) { return layer_bytes; }, record,
                                      detail::checkpoint_bytes_options{offload, false});
  detail::checkpoint_interpreter run(plan, model);
  run.forward();
  trace.after_forward = model.kept_after_forward();
  run.backward();
  trace.host_bytes = model.host_bytes();
  return trace;
}

}  // namespace checkpoint
MEMKIT_NAMESPACE_END
