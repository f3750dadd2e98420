// memkit/budget/memkit_step.hpp — memkit runtime, Llama-style models: the moments of one training step as
// a memkit training loop runs it (examples/train_llama.cpp is one), each from the components' own byte
// functions.
//
// The loop owns four hidden-state buffers for the whole run: the embedding's output (the layer stack's
// input), the stack's output (the loss's input), the loss's gradient of it (loss::fused_linear_cross_entropy
// computes it during forward) and, when the embedding trains, the gradient into the embedding. The stack is
// memkit::checkpoint::segment over the blocks and the final RMSNorm; what it holds at every moment is checkpoint/
// schedule.hpp's exact byte model (memkit::checkpoint::segment::cost), run here on memkit_block_activation_bytes's
// saved tensors. The block's temporaries and its operations' workspace, and the loss's chunk buffers, come
// from the workspace resource. Gradients (fp32) and the optimizer state are allocated up front.
//
// The moments compared, per phase:
//   forward         every layer's forward (what the stack holds, that layer's saved tensors, its forward
//                   temporaries), and the loss on top of what the forward pass kept;
//   backward        every recomputed forward and every layer's backward (with its gradient temporaries);
//   optimizer_step  persistent state, gradients and the loop's buffers (adam_state works in place).
#pragma once

#include <algorithm>
#include <cstdint>

#include "memkit/budget/activations.hpp"
#include "memkit/budget/plan.hpp"
#include "memkit/checkpoint/schedule.hpp"
#include "memkit/loss/bytes.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace budget {

namespace detail {

// checkpoint_byte_model that also reports, at each layer's forward, the bytes alive once that layer has
// saved everything it saves (the model frees them again at once when the layer's tensors are not kept).
template <class Hidden, class Saved, class OnBackward, class OnForward>
class memkit_stack_model : public ::memkit::checkpoint::detail::checkpoint_byte_model<Hidden, Saved, OnBackward> {
  using base = ::memkit::checkpoint::detail::checkpoint_byte_model<Hidden, Saved, OnBackward>;

 public:
  constexpr memkit_stack_model(Hidden hidden, Saved saved, OnBackward on_backward, OnForward on_forward, bool offload)
      : base(hidden, saved, on_backward, ::memkit::checkpoint::detail::checkpoint_bytes_options{offload, true}),
        saved_(saved), on_forward_(on_forward) {}
  constexpr void forward(std::uint64_t step, const typename base::hidden& in, typename base::hidden& out, bool keep) {
    on_forward_(step, base::device_bytes() + saved_(step));
    base::forward(step, in, out, keep);
  }

 private:
  Saved saved_;
  OnForward on_forward_;
};

}  // namespace detail

// The largest moment of each phase (0 forward, 1 backward, 2 optimizer step, as estimate.hpp's step_phase):
// activations (the loop's buffers and what the stack holds) and the workspace on top of the persistent one
// (a layer's temporaries, or the loss's chunk buffers).
struct memkit_step_moments {
  std::uint64_t activations[3]{};
  std::uint64_t workspace[3]{};
  // The loss's tokens per chunk: logits_chunk_tokens (at most the micro-batch and loss::max_chunk_tokens), or
  // with a memory_cap the largest chunk the memory left at the loss point holds, up to that (0: not even one
  // token's chunk fits; the step is then costed with a one-token chunk, over the cap).
  std::uint64_t loss_chunk_tokens = 0;
  std::uint64_t loss_held_bytes = 0;  // what the step holds when the loss starts (held_outside included)
  std::uint64_t host_bytes = 0;       // offloaded checkpoints (the blocks' and the final norm's inputs)
};

// `held_outside`: the bytes the step holds besides activations and workspace (weights, gradients, optimizer
// state): with p.memory_cap, what is left for the loss is the cap minus these, the loop's buffers and what
// the stack keeps after forward.
constexpr memkit_step_moments memkit_step_activations(const model_config& m, const training_plan& p,
                                                      std::uint64_t held_outside = 0) {
  memkit_step_moments out;
  const std::uint64_t g = p.overhead.allocation_granularity;
  const std::uint64_t e = p.activation_bytes();
  const std::uint64_t T = p.tokens(), L = m.layers;
  const std::uint64_t hidden = round_up(e * T * m.hidden, g);
  const bool embedding_trains = !p.lora_training();
  const std::uint64_t loop_buffers = (embedding_trains ? 4 : 3) * hidden;

  const block_activations block = memkit_block_activation_bytes(m, p);
  const std::uint64_t norm_saved = round_up(e * T * m.hidden, g) + round_up(4 * T, g);  // final RMSNorm: x, 1/rms
  auto saved = [&](std::uint64_t step) { return step < L ? block.saved_bytes : norm_saved; };
  auto backward_temporaries = [&](std::uint64_t step) { return step < L ? block.backward_transient : 0; };

  // The loss: loss::fused_linear_cross_entropy with chunks of logits_chunk_tokens tokens' fp32 logits, or
  // under a memory cap the chunk loss::chunk_tokens_within gives for the memory left once the forward pass
  // is done (computed below, where the stack model knows what it keeps).
  const bool on_device = !p.on_host();
  loss::fused_linear_cross_entropy_arguments loss_args{
      .tokens = static_cast<std::int64_t>(T), .hidden = static_cast<std::int64_t>(m.hidden),
      .vocab = static_cast<std::int64_t>(m.vocab), .hidden_element_bytes = e, .head_grad = embedding_trains,
      .on_device = on_device};
  loss_args.options.host_threads = static_cast<int>(p.host_threads);
  const auto loss_workspace_for = [&](std::uint64_t chunk) {
    loss::fused_linear_cross_entropy_arguments a = loss_args;
    a.options.chunk_bytes = loss::chunk_bytes_for(static_cast<std::int64_t>(chunk), a.vocab, e, on_device);
    return round_up(loss::workspace_bytes(a), g);
  };

  bool backward_pass = false;
  constexpr int forward_phase = 0, backward_phase = 1, optimizer_phase = 2;
  auto moment = [&](int i, std::uint64_t stack, std::uint64_t workspace) {
    if (loop_buffers + stack + workspace > out.activations[i] + out.workspace[i]) {
      out.activations[i] = loop_buffers + stack;
      out.workspace[i] = workspace;
    }
  };
  auto on_forward = [&](std::uint64_t step, std::uint64_t bytes) {
    const int phase = backward_pass ? backward_phase : forward_phase;
    if (step >= L) {
      moment(phase, bytes, 0);  // the final norm: no temporaries
      return;
    }
    // A block's forward in its phases: each phase's operation runs before the later phases have saved theirs.
    for (int i = 0; i < block_activations::backward_phase_count; ++i)
      moment(phase, bytes - block.forward_unsaved[i], block.forward_phase_transient[i]);
  };
  auto on_backward = [&](std::uint64_t step, std::uint64_t bytes) {
    if (step >= L) {
      moment(backward_phase, bytes, backward_temporaries(step));
      return;
    }
    // A block's backward in its phases: each phase's operations run once the later phases' saved tensors
    // are released (memkit_block_activation_bytes).
    for (int i = 0; i < block_activations::backward_phase_count; ++i)
      moment(backward_phase, bytes - block.backward_released[i], block.backward_phase_transient[i]);
  };
  const ::memkit::checkpoint::checkpoint_plan plan = ::memkit::checkpoint::make_checkpoint_plan(p.checkpoint_schedule_of(), L + 1);
  detail::memkit_stack_model model([hidden](std::uint64_t) { return hidden; }, saved, on_backward, on_forward,
                                  p.offload_checkpoints);
  ::memkit::checkpoint::detail::checkpoint_interpreter run(plan, model);
  run.forward();
  const auto most_chunk = static_cast<std::uint64_t>(loss::max_chunk_tokens(static_cast<std::int64_t>(m.vocab)));
  std::uint64_t chunk = std::min<std::uint64_t>({p.logits_chunk_tokens, T, most_chunk});
  const std::uint64_t held = held_outside + loop_buffers + model.kept_after_forward();
  out.loss_held_bytes = held;
  if (p.memory_cap != 0) {
    // The workspace is rounded to the allocation granularity: ask for what is left in whole units.
    const std::uint64_t left = held < p.memory_cap ? (p.memory_cap - held) / g * g : 0;
    chunk = static_cast<std::uint64_t>(loss::chunk_tokens_within(loss_args, left, static_cast<std::int64_t>(chunk)));
  }
  out.loss_chunk_tokens = chunk;
  moment(forward_phase, model.kept_after_forward(), loss_workspace_for(chunk > 0 ? chunk : 1));
  backward_pass = true;
  run.backward();
  moment(optimizer_phase, 0, 0);
  out.host_bytes = model.host_bytes();
  return out;
}

}  // namespace budget
MEMKIT_NAMESPACE_END
