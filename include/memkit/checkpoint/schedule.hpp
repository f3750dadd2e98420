// memkit/checkpoint/schedule.hpp — activation checkpointing schedules for a stack of N layers: which hidden
// states are kept, which layer forwards are recomputed, and what that costs, all computable at compile time.
//
// A schedule is compiled into a plan: a list of actions over layer steps 0..N-1 and hidden-state positions
// 0..N (position p is the input of step p; position N is the stack's output).
//   store p         keep the hidden state at p as a checkpoint (a "slot")
//   restore p       continue from checkpoint p (it stays kept); restore_last p: and drop it once read
//   advance [p, q)  run steps p..q-1 forward, throwing away what they save
//   tape j          run step j forward, keeping what it saves for its backward
//   backward j      run step j backward
// The first forward_actions actions are the forward pass (they end with the stack's output); the rest are
// the backward pass. segment (checkpoint/segment.hpp) runs a plan on real layers; this header
// runs the same plan on byte counts, which is how the predictions below are exact.
//
// Schedules (the closed forms are in docs/checkpointing.md):
//   none              tape every layer: N layers' saved tensors, nothing recomputed.
//   every_k_layers k  segments of k layers; each keeps its input and is recomputed in backward (N recomputed
//                     forwards); every_layer is k = 1, sqrt is k = ceil(sqrt(N)), one segment is k >= N.
//   binomial c        Griewank's Revolve with c checkpoint slots (the input's included): the fewest forward
//                     evaluations, r*N - C(c+r, c+1) with C(c+r-1, c) < N <= C(c+r, c).
#pragma once

#include <cstdint>
#include <string_view>
#include <type_traits>
#include <vector>

#include "memkit/config.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace checkpoint {

enum class checkpointing : std::uint8_t { none, every_layer, every_k_layers, sqrt, binomial };

constexpr std::string_view to_string(checkpointing kind) noexcept {
  switch (kind) {
    case checkpointing::none: return "none";
    case checkpointing::every_layer: return "every_layer";
    case checkpointing::every_k_layers: return "every_k_layers";
    case checkpointing::sqrt: return "sqrt";
    case checkpointing::binomial: return "binomial";
  }
  return "?";
}

struct schedule {
  checkpointing kind = checkpointing::every_k_layers;
  std::uint64_t every = ~std::uint64_t{0};  // layers per segment (every_k_layers); the default is one segment
  std::uint64_t slots = 4;                  // checkpoints the binomial schedule may keep at once

  static constexpr schedule none() noexcept { return {checkpointing::none, 1, 1}; }
  static constexpr schedule single_segment() noexcept { return {}; }
  static constexpr schedule every_layer() noexcept { return {checkpointing::every_layer, 1, 1}; }
  static constexpr schedule every_k_layers(std::uint64_t k) noexcept {
    return {checkpointing::every_k_layers, k, 1};
  }
  static constexpr schedule sqrt() noexcept { return {checkpointing::sqrt, 1, 1}; }
  static constexpr schedule binomial(std::uint64_t slots) noexcept {
    return {checkpointing::binomial, 1, slots};
  }

  // Empty when the schedule is usable; otherwise what is wrong with it.
  constexpr std::string_view problem() const noexcept {
    if (kind == checkpointing::every_k_layers && every == 0) return "every_k_layers needs at least 1 layer per segment";
    if (kind == checkpointing::binomial && slots == 0) return "the binomial schedule needs at least 1 checkpoint slot";
    return {};
  }
};

// Plans index steps with 32 bits; a stack of more layers is refused.
inline constexpr std::uint64_t max_checkpointed_layers = 0x7fffffff;

// --- closed forms --------------------------------------------------------------------------------------

// C(n, k), saturating at 2^64 - 1 (exact whenever the true value fits).
constexpr std::uint64_t binomial_coefficient(std::uint64_t n, std::uint64_t k) noexcept {
  constexpr std::uint64_t saturated = ~std::uint64_t{0};
  if (k > n) return 0;
  if (k > n - k) k = n - k;
  std::uint64_t result = 1;
  for (std::uint64_t i = 1; i <= k; ++i) {
    // result * (n - k + i) / i stays an integer at every i; split it to avoid overflowing early.
    const std::uint64_t numerator = n - k + i;
    const std::uint64_t g = [](std::uint64_t a, std::uint64_t b) {
      while (b != 0) {
        const std::uint64_t t = a % b;
        a = b;
        b = t;
      }
      return a;
    }(result, i);
    const std::uint64_t reduced = result / g, divisor = i / g;  // divisor divides numerator now
    const std::uint64_t factor = numerator / divisor;
    if (reduced != 0 && factor > saturated / reduced) return saturated;
    result = reduced * factor;
  }
  return result;
}

// beta(c, r) = C(c + r, c): the longest chain c slots reverse with at most r forward evaluations of a step.
constexpr std::uint64_t revolve_reach(std::uint64_t slots, std::uint64_t repetitions) noexcept {
  return binomial_coefficient(slots + repetitions, slots);
}

// The r with beta(c, r-1) < n <= beta(c, r): the most times a step is evaluated forward (n >= 1, c >= 1).
constexpr std::uint64_t revolve_repetitions(std::uint64_t n, std::uint64_t slots) noexcept {
  std::uint64_t r = 0;
  while (revolve_reach(slots, r) < n) ++r;
  return r;
}

// Griewank's minimal number of forward step evaluations that reverse n steps with c slots, not counting
// the one taping evaluation each step needs for its backward: r*n - C(c+r, c+1).
// c = 1 gives n(n-1)/2; c >= n-1 gives n-1. In a training step it is the number of recomputed forwards.
constexpr std::uint64_t revolve_forwards(std::uint64_t n, std::uint64_t slots) noexcept {
  if (n == 0 || slots == 0) return 0;
  const std::uint64_t r = revolve_repetitions(n, slots);
  return r * n - binomial_coefficient(slots + r, slots + 1);
}

// Where an optimal schedule puts its next checkpoint when reversing n >= 2 steps from a kept state with
// c >= 2 slots: an m with m + T(m, c) + T(n-m, c-1) = T(n, c). Any m in
// [beta(c, r-2), beta(c, r-1)] with n - m in [beta(c-1, r-1), beta(c-1, r)] is optimal; this takes the
// largest, so the part reversed first (after m) is the shortest.
constexpr std::uint64_t revolve_split(std::uint64_t n, std::uint64_t slots) noexcept {
  const std::uint64_t r = revolve_repetitions(n, slots);
  const std::uint64_t upper_left = revolve_reach(slots, r - 1);
  const std::uint64_t lower_right = revolve_reach(slots - 1, r - 1);
  const std::uint64_t upper = upper_left < n - lower_right ? upper_left : n - lower_right;
  return upper > 0 ? upper : 1;
}

// Layers per segment of a segment schedule over n layers (0 for none and binomial).
constexpr std::uint64_t segment_length(const schedule& s, std::uint64_t n) noexcept {
  switch (s.kind) {
    case checkpointing::every_layer: return n == 0 ? 0 : 1;
    case checkpointing::every_k_layers: return s.every < n ? s.every : n;
    case checkpointing::sqrt: {
      std::uint64_t k = 0;
      while (k * k < n) ++k;
      return k;
    }
    default: return 0;
  }
}

// Layer forwards a training step runs beyond the N of an uncheckpointed one.
constexpr std::uint64_t recomputed_forwards(const schedule& s, std::uint64_t n) noexcept {
  switch (s.kind) {
    case checkpointing::none: return 0;
    case checkpointing::binomial: return revolve_forwards(n, s.slots);
    default: return n;  // every segment runs once more, the last one included
  }
}

// --- plans ----------------------------------------------------------------------------------------------

enum class checkpoint_op : std::uint8_t { store, restore, restore_last, advance, tape, backward };

struct checkpoint_action {
  checkpoint_op op = checkpoint_op::store;
  std::uint32_t first = 0;  // the step, or the position of store / restore; advance runs [first, last)
  std::uint32_t last = 0;
  // On a restore: the next restore's checkpoint is already kept, so its copy may be fetched now (offload).
  bool prefetch_next = false;
};

struct checkpoint_plan {
  std::vector<checkpoint_action> actions;
  std::size_t forward_actions = 0;  // actions[0, forward_actions) are the forward pass
  std::uint64_t layers = 0;
  std::uint64_t forwards = 0;       // layer forwards run in all, recomputations included
  std::uint64_t most_checkpoints = 0;

  constexpr std::uint64_t recomputed() const noexcept { return forwards - layers; }
};

namespace detail {

constexpr void plan_action(checkpoint_plan& plan, checkpoint_op op, std::uint64_t first, std::uint64_t last = 0) {
  plan.actions.push_back({op, static_cast<std::uint32_t>(first), static_cast<std::uint32_t>(last), false});
  if (op == checkpoint_op::advance) plan.forwards += last - first;
  if (op == checkpoint_op::tape) plan.forwards += 1;
}

constexpr void plan_segments(checkpoint_plan& plan, std::uint64_t n, std::uint64_t k) {
  const std::uint64_t segments = (n + k - 1) / k;
  for (std::uint64_t s = 0; s < segments; ++s) {
    plan_action(plan, checkpoint_op::store, s * k);
    plan_action(plan, checkpoint_op::advance, s * k, s * k + k < n ? s * k + k : n);
  }
  plan.forward_actions = plan.actions.size();
  plan.most_checkpoints = segments;
  for (std::uint64_t s = segments; s-- > 0;) {
    const std::uint64_t begin = s * k, end = begin + k < n ? begin + k : n;
    plan_action(plan, checkpoint_op::restore_last, begin);
    for (std::uint64_t j = begin; j < end; ++j) plan_action(plan, checkpoint_op::tape, j);
    for (std::uint64_t j = end; j-- > begin;) plan_action(plan, checkpoint_op::backward, j);
  }
}

// Revolve, one step reversed per iteration. `held` is the stack of kept checkpoints (positions); the top
// one and the slots left decide the next split. A state is stored only when more than one step will be
// reversed from it: the step right after an advance is taped from the working state instead.
constexpr void plan_binomial(checkpoint_plan& plan, std::uint64_t n, std::uint64_t slots) {
  constexpr std::uint64_t none = ~std::uint64_t{0};
  if (n == 1) {  // a single step is taped directly: nothing to keep
    plan_action(plan, checkpoint_op::tape, 0);
    plan.forward_actions = 1;
    plan_action(plan, checkpoint_op::backward, 0);
    return;
  }
  std::vector<std::uint64_t> held{0};
  plan_action(plan, checkpoint_op::store, 0);
  plan.most_checkpoints = 1;
  std::uint64_t working = 0;  // position of the working state, or none
  std::uint64_t end = n;      // steps >= end are reversed
  auto tape_and_reverse = [&](std::uint64_t step) {
    plan_action(plan, checkpoint_op::tape, step);
    if (plan.forward_actions == 0) plan.forward_actions = plan.actions.size();
    plan_action(plan, checkpoint_op::backward, step);
    end = step;
    working = none;
  };
  while (end > 0) {
    const std::uint64_t s = held.back();
    const std::uint64_t free_slots = slots - held.size() + 1;  // for [s, end), the slot of s included
    if (s == end - 1) {
      plan_action(plan, checkpoint_op::restore_last, s);
      held.pop_back();
      tape_and_reverse(s);
      continue;
    }
    const std::uint64_t target = free_slots == 1 ? end - 1 : s + revolve_split(end - s, free_slots);
    if (working != s) plan_action(plan, checkpoint_op::restore, s);
    if (target > s) plan_action(plan, checkpoint_op::advance, s, target);
    working = target;
    if (target == end - 1) {
      tape_and_reverse(target);
    } else {
      plan_action(plan, checkpoint_op::store, target);
      held.push_back(target);
      if (held.size() > plan.most_checkpoints) plan.most_checkpoints = held.size();
    }
  }
}

// Marks each restore whose successor restore reads a checkpoint that is already kept at that moment.
constexpr void plan_prefetches(checkpoint_plan& plan) {
  std::size_t previous_restore = plan.actions.size();
  std::vector<std::size_t> stored_at(plan.layers + 1, plan.actions.size());
  for (std::size_t i = 0; i < plan.actions.size(); ++i) {
    checkpoint_action& a = plan.actions[i];
    if (a.op == checkpoint_op::store) stored_at[a.first] = i;
    if (a.op != checkpoint_op::restore && a.op != checkpoint_op::restore_last) continue;
    if (previous_restore != plan.actions.size() && stored_at[a.first] < previous_restore)
      plan.actions[previous_restore].prefetch_next = true;
    previous_restore = i;
  }
}

}  // namespace detail

// The plan of `schedule` over `layers` steps. An invalid schedule or more than max_checkpointed_layers
// layers gives an empty plan (check schedule.problem() first).
constexpr checkpoint_plan make_checkpoint_plan(const schedule& schedule, std::uint64_t layers) {
  checkpoint_plan plan;
  plan.layers = layers;
  if (layers == 0 || layers > max_checkpointed_layers || !schedule.problem().empty()) return plan;
  if (schedule.kind == checkpointing::none) {
    for (std::uint64_t j = 0; j < layers; ++j) detail::plan_action(plan, checkpoint_op::tape, j);
    plan.forward_actions = plan.actions.size();
    for (std::uint64_t j = layers; j-- > 0;) detail::plan_action(plan, checkpoint_op::backward, j);
  } else if (schedule.kind == checkpointing::binomial) {
    detail::plan_binomial(plan, layers, schedule.slots);
  } else {
    detail::plan_segments(plan, layers, segment_length(schedule, layers));
  }
  detail::plan_prefetches(plan);
  return plan;
}

// --- running a plan --------------------------------------------------------------------------------------

namespace detail {

// Runs a plan's actions against a backend, deciding for both the real one (checkpoint/segment.hpp) and the
// byte model below which buffer lives when. Backend interface:
//   hidden                     a hidden-state (or gradient) handle; .owned: released by release()
//   caller_input() / caller_output() / caller_grad_output() / caller_grad_input()   the stack's own buffers
//   temporary(p)               a new buffer for position p;        release(h): frees it if owned
//   forward(j, in, out, keep)  runs step j; keep: its saved tensors stay (tape), else they are freed
//   backward(j, dy, dx)        runs step j backward, freeing what it saved
//   offloading()               checkpoints live in host memory
//   keep_copy(p, work)         a new device checkpoint copied from `work` (returns a view of it)
//   keep_adopted(p, work)      `work`'s own buffer becomes checkpoint p (returns a view of it)
//   peek(p) / take(p)          a device checkpoint: a view of it, or the checkpoint itself (owned, dropped)
//   offload(p, work)           a host checkpoint copied from `work`
//   fetch(p, last)             a device copy of host checkpoint p (the prefetched one if any); last: drop p
//   prefetch(p)                start fetching host checkpoint p for the next restore
//   prefetch_beyond()          the plan has no further restore: a backend may fetch what comes after it
//   forward_done()             the forward pass is over (offload: the caller's input may be overwritten)
template <class Backend>
class checkpoint_interpreter {
 public:
  using hidden = typename Backend::hidden;

  constexpr checkpoint_interpreter(const checkpoint_plan& plan, Backend& backend) : plan_(plan), backend_(backend) {}

  constexpr void forward() {
    hidden work = backend_.caller_input();
    for (std::size_t i = 0; i < plan_.forward_actions; ++i) run(i, work, true);
    backend_.release(work);
    backend_.forward_done();
  }

  constexpr void backward() {
    hidden work{};
    grad_ = backend_.caller_grad_output();
    for (std::size_t i = plan_.forward_actions; i < plan_.actions.size(); ++i) run(i, work, false);
    backend_.release(work);
    backend_.release(grad_);
  }

 private:
  // Whether action i's output (position p) is read by the action after it.
  constexpr bool consumed(std::size_t i, std::uint64_t p) const noexcept {
    if (i + 1 >= plan_.actions.size()) return false;
    const checkpoint_action& next = plan_.actions[i + 1];
    return next.first == p && (next.op == checkpoint_op::advance || next.op == checkpoint_op::tape ||
                               next.op == checkpoint_op::store);
  }

  constexpr hidden output_of(std::uint64_t step, bool forward_pass) {
    return forward_pass && step + 1 == plan_.layers ? backend_.caller_output() : backend_.temporary(step + 1);
  }

  constexpr void run(std::size_t i, hidden& work, bool forward_pass) {
    const checkpoint_action& a = plan_.actions[i];
    switch (a.op) {
      case checkpoint_op::store:
        if (backend_.offloading())
          backend_.offload(a.first, work);
        else if (work.owned)
          work = backend_.keep_adopted(a.first, work);
        else
          work = backend_.keep_copy(a.first, work);
        break;
      case checkpoint_op::restore:
      case checkpoint_op::restore_last: {
        const bool last = a.op == checkpoint_op::restore_last;
        backend_.release(work);
        work = backend_.offloading() ? backend_.fetch(a.first, last) : last ? backend_.take(a.first)
                                                                           : backend_.peek(a.first);
        if (backend_.offloading()) {
          std::size_t next = i + 1;
          while (next < plan_.actions.size() && plan_.actions[next].op != checkpoint_op::restore &&
                 plan_.actions[next].op != checkpoint_op::restore_last)
            ++next;
          if (next == plan_.actions.size())
            backend_.prefetch_beyond();
          else if (a.prefetch_next)
            backend_.prefetch(plan_.actions[next].first);
        }
        break;
      }
      case checkpoint_op::advance:
        for (std::uint64_t j = a.first; j < a.last; ++j) {
          hidden out = output_of(j, forward_pass);
          backend_.forward(j, work, out, false);
          backend_.release(work);
          work = static_cast<hidden&&>(out);
        }
        break;
      case checkpoint_op::tape: {
        hidden out = output_of(a.first, forward_pass);
        backend_.forward(a.first, work, out, true);
        backend_.release(work);
        work = static_cast<hidden&&>(out);
        if (!(forward_pass && a.first + 1 == plan_.layers) && !consumed(i, a.first + 1)) backend_.release(work);
        break;
      }
      case checkpoint_op::backward: {
        hidden dx = a.first == 0 ? backend_.caller_grad_input() : backend_.temporary(a.first);
        backend_.backward(a.first, grad_, dx);
        backend_.release(grad_);
        grad_ = static_cast<hidden&&>(dx);
        break;
      }
    }
  }

  const checkpoint_plan& plan_;
  Backend& backend_;
  hidden grad_{};
};

}  // namespace detail

// What step j of a stack costs beyond the hidden states around it, for a step that allocates more while it
// runs than what it keeps (a nested segment: its own cost()): `saved` stays from its forward to
// its backward; forward_peak is the most bytes alive while its forward runs, backward_peak while its
// backward runs (its saved bytes included). A plain layer is {saved, saved, saved}.
struct checkpoint_step_bytes {
  std::uint64_t saved = 0;
  std::uint64_t forward_peak = 0;
  std::uint64_t backward_peak = 0;
};

namespace detail {

// The byte model: runs a plan on byte counts. `hidden_bytes(p)` is the size of the hidden state at
// position p, `saved_bytes(j)` what step j's forward saves (a byte count, or a checkpoint_step_bytes).
//   exact (what segment allocates): hidden states between layers and gradients are buffers of
//     their own, and an advance allocates its saved tensors before throwing them away;
//   autograd-like (memory_budget, PyTorch): hidden states are the saved tensors themselves and a forward
//     without grad saves nothing, so only checkpoints and taped layers count.
// Every moment a layer's backward runs is reported to `on_backward(step, device_bytes)`.
struct checkpoint_bytes_options {
  bool offload = false;
  bool exact = true;
};

template <class HiddenBytes, class SavedBytes, class OnBackward>
class checkpoint_byte_model {
 public:
  struct hidden {
    std::uint64_t bytes = 0;  // device bytes released with it
    bool owned = false;
  };

  constexpr checkpoint_byte_model(HiddenBytes hidden_bytes, SavedBytes saved_bytes, OnBackward on_backward,
                                  checkpoint_bytes_options options)
      : hidden_bytes_(hidden_bytes), saved_bytes_(saved_bytes), on_backward_(on_backward), options_(options) {}

  constexpr hidden caller_input() const noexcept { return {}; }
  constexpr hidden caller_output() const noexcept { return {}; }
  constexpr hidden caller_grad_output() const noexcept { return {}; }
  constexpr hidden caller_grad_input() const noexcept { return {}; }
  constexpr hidden temporary(std::uint64_t p) {
    const std::uint64_t bytes = options_.exact ? hidden_bytes_(p) : 0;
    grow(bytes);
    return {bytes, true};
  }
  constexpr void release(hidden& h) {
    if (h.owned) device_ -= h.bytes;
    h = {};
  }
  constexpr void forward(std::uint64_t step, const hidden&, hidden&, bool keep) {
    const checkpoint_step_bytes b = step_bytes(step);
    if (options_.exact) {
      reach(device_ + (b.forward_peak > b.saved ? b.forward_peak : b.saved));
      if (keep) device_ += b.saved;
    } else if (keep) {
      grow(b.saved);
    }
  }
  constexpr void backward(std::uint64_t step, const hidden&, hidden&) {
    on_backward_(step, device_);
    const checkpoint_step_bytes b = step_bytes(step);
    if (options_.exact && b.backward_peak > b.saved) reach(device_ - b.saved + b.backward_peak);
    device_ -= b.saved;
  }
  constexpr bool offloading() const noexcept { return options_.offload; }
  constexpr hidden keep_copy(std::uint64_t p, hidden&) {
    grow(hidden_bytes_(p));
    return {};
  }
  constexpr hidden keep_adopted(std::uint64_t p, hidden& work) {
    device_ -= work.bytes;
    grow(hidden_bytes_(p));
    return {};
  }
  constexpr hidden peek(std::uint64_t) const noexcept { return {}; }
  constexpr hidden take(std::uint64_t p) const { return {hidden_bytes_(p), true}; }
  constexpr void offload(std::uint64_t p, const hidden&) {
    // Host checkpoints come from a pool that keeps released buffers for reuse.
    const std::uint64_t bytes = hidden_bytes_(p);
    for (pooled& entry : host_pool_)
      if (!entry.in_use && entry.bytes == bytes) {
        entry.in_use = true;
        held_.push_back(&entry - host_pool_.data());
        return;
      }
    host_pool_.push_back({bytes, true});
    held_.push_back(host_pool_.size() - 1);
    host_bytes_ += bytes;
  }
  constexpr hidden fetch(std::uint64_t p, bool last) {
    const std::uint64_t bytes = hidden_bytes_(p);
    if (prefetched_) {
      prefetched_ = false;
    } else {
      grow(bytes);
    }
    if (last) {
      host_pool_[held_.back()].in_use = false;
      held_.pop_back();
    }
    return {bytes, true};
  }
  constexpr void prefetch(std::uint64_t p) {
    grow(hidden_bytes_(p));
    prefetched_ = true;
  }
  constexpr void prefetch_beyond() const noexcept {}
  constexpr void forward_done() noexcept {
    kept_after_forward_ = device_;
    forward_peak_ = phase_peak_;
    phase_peak_ = device_;
  }

  constexpr std::uint64_t device_bytes() const noexcept { return device_; }
  constexpr std::uint64_t peak_device_bytes() const noexcept { return peak_; }
  constexpr std::uint64_t forward_peak_bytes() const noexcept { return forward_peak_; }
  constexpr std::uint64_t backward_peak_bytes() const noexcept { return phase_peak_; }  // once backward ran
  constexpr std::uint64_t host_bytes() const noexcept { return host_bytes_; }
  constexpr std::uint64_t kept_after_forward() const noexcept { return kept_after_forward_; }

 private:
  struct pooled {
    std::uint64_t bytes;
    bool in_use;
  };
  constexpr void grow(std::uint64_t bytes) {
    device_ += bytes;
    reach(device_);
  }
  // `bytes` alive for a moment.
  constexpr void reach(std::uint64_t bytes) {
    if (bytes > peak_) peak_ = bytes;
    if (bytes > phase_peak_) phase_peak_ = bytes;
  }
  constexpr checkpoint_step_bytes step_bytes(std::uint64_t step) {
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(saved_bytes_(step))>, checkpoint_step_bytes>) {
      return saved_bytes_(step);
    } else {
      const std::uint64_t saved = saved_bytes_(step);
      return {saved, saved, saved};
    }
  }

  HiddenBytes hidden_bytes_;
  SavedBytes saved_bytes_;
  OnBackward on_backward_;
  checkpoint_bytes_options options_;
  std::uint64_t device_ = 0, peak_ = 0, host_bytes_ = 0, kept_after_forward_ = 0;
  std::uint64_t forward_peak_ = 0, phase_peak_ = 0;  // phase_peak_: of the phase running (forward, then backward)
  bool prefetched_ = false;
  std::vector<pooled> host_pool_;
  std::vector<std::size_t> held_;  // pool entries of the kept host checkpoints, oldest first
};

struct ignore_backward {
  constexpr void operator()(std::uint64_t, std::uint64_t) const noexcept {}
};

}  // namespace detail

}  // namespace checkpoint
MEMKIT_NAMESPACE_END
