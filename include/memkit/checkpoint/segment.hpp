// memkit/checkpoint/segment.hpp — activation checkpointing for a sequence of hand-written layers.
//
// segment wraps layers (memkit::layer_sequence(a, b, c), or a std::vector / std::span of one layer
// type, or both mixed: layer_sequence(embedding, std::span(blocks), norm)) and is itself a layer, so a training
// loop calls it like any other:
//
//   std::vector<decoder_block> blocks = ...;
//   memkit::segment stack(blocks, {.schedule = memkit::schedule::binomial(4)});
//   stack.forward(exec, ctx, x, y, store);    // keeps checkpoints, not every block's activations
//   ...loss...
//   stack.backward(exec, dy, dx, store);      // recomputes from the checkpoints, then runs each backward
//
// The default schedule is one segment: forward keeps only the input; backward recomputes every layer. The
// recomputation uses the forward's own forward_context, so dropout masks are identical and the gradients
// are bit-identical to running the layers without checkpointing. Inner layer i draws its randomness from
// ctx.for_layer(first_layer + i): give a segment the index of its first layer in the whole stack and pass the
// stack's context, and it reproduces the uncheckpointed loop exactly.
//
// Memory: checkpoints are saved in the activation store (charged to its resource) or, with
// segment_options::offload, kept in host memory. Hidden states between the layers and the gradients
// between their backwards are buffers from the store's resource, freed as soon as they are consumed.
// cost(in, ctx) predicts, before anything runs, exactly what that resource will see (checkpoint/schedule.hpp).
//
// Segments nest: an outer segment that runs an inner one's forward without keeping it discards that pass
// (memkit::discard_forward), and its cost() counts what the inner ones allocate while they run.
//
// Misuse is an error, never a silent wrong gradient: backward before forward or twice, or with another store
// than its forward, a layer whose forward saves other bytes than its saved_bytes() says or whose
// recomputation saves something else than its first forward did, a backward that does not take back what its
// forward saved. A segment destroyed with backwards pending frees what their forwards kept.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "memkit/core/layer.hpp"
#include "memkit/checkpoint/offload.hpp"
#include "memkit/checkpoint/cost.hpp"
#include "memkit/checkpoint/schedule.hpp"
#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/memory/buffer.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace checkpoint {

namespace detail {

// A part of a layer sequence: one layer (kept as a pointer, so assigning a sequence rebinds it instead of
// assigning the layers) or a span of layers of one type.
template <class Part>
struct layer_part;
template <class L>
struct layer_part<L&> {
  using layer_type = L;
  using stored = L*;
  static constexpr stored keep(L& layer) noexcept { return &layer; }
  static constexpr std::size_t count(stored) noexcept { return 1; }
  static constexpr L& at(stored layer, std::size_t) noexcept { return *layer; }
};
template <class L, std::size_t Extent>
struct layer_part<std::span<L, Extent>> {
  using layer_type = L;
  using stored = std::span<L, Extent>;
  static constexpr stored keep(std::span<L, Extent> layers) noexcept { return layers; }
  static constexpr std::size_t count(stored layers) noexcept { return layers.size(); }
  static constexpr L& at(stored layers, std::size_t i) noexcept { return layers[i]; }
};

// What memkit::layer_sequence() keeps of each argument.
template <class A>
struct part_of {
  using type = A&;
};
template <class L, std::size_t Extent>
struct part_of<std::span<L, Extent>> {
  using type = std::span<L, Extent>;
};
template <class L, class Allocator>
struct part_of<std::vector<L, Allocator>> {
  using type = std::span<L>;
};
template <class L, std::size_t N>
struct part_of<std::array<L, N>> {
  using type = std::span<L, N>;
};

template <class Part>
using part_layer = typename layer_part<Part>::layer_type;

// How many segment steps this thread is inside: a segment run as a step of another one is nested.
inline thread_local int segment_steps_running = 0;
struct inside_segment_step {
  inside_segment_step() noexcept { ++segment_steps_running; }
  ~inside_segment_step() { --segment_steps_running; }
  inside_segment_step(const inside_segment_step&) = delete;
  inside_segment_step& operator=(const inside_segment_step&) = delete;
};

}  // namespace detail

// A sequence of layers whose activations pass from one to the next, by reference (the layers must outlive
// it). Parts are single layers (L&) or spans of layers of one type.
template <class... Parts>
class layer_list {
  static_assert(sizeof...(Parts) > 0, "memkit::checkpoint::layer_sequence: give at least one layer");
  using first_part = std::tuple_element_t<0, std::tuple<Parts...>>;

 public:
  static_assert(requires { typename detail::part_layer<first_part>::value_type; },
                "memkit::checkpoint::layer_sequence: a layer needs `using value_type = ...;` (see memkit::explain_layer)");
  using value_type = typename detail::part_layer<first_part>::value_type;
  static_assert((std::is_same_v<typename detail::part_layer<Parts>::value_type, value_type> && ...),
                "memkit::checkpoint::layer_sequence: every layer of a sequence must have the same value_type (each one's output is the "
                "next one's input)");
  static_assert((!std::is_const_v<detail::part_layer<Parts>> && ...),
                "memkit::checkpoint::layer_sequence: layers are run forward and backward, so they cannot be const");

  // Whether every layer runs on executor E (memkit::explain_layer<L, E>() says what a layer misses).
  template <class E>
  static constexpr bool runs_on = (layer<detail::part_layer<Parts>, E> && ...);

  template <class... Args>
    requires(sizeof...(Args) == sizeof...(Parts) && std::is_constructible_v<std::tuple<Parts...>, Args&&...>)
  constexpr layer_list(Args&&... parts) : parts_(detail::layer_part<Parts>::keep(std::forward<Args>(parts))...) {}

  constexpr std::size_t size() const noexcept {
    return std::apply([](const auto&... part) { return (detail::layer_part<Parts>::count(part) + ...); }, parts_);
  }

  // Calls f(layer) with the layer at `index` (its own type).
  template <class F>
  constexpr void visit(std::size_t index, F&& f) const {
    visit_parts(index, f, std::index_sequence_for<Parts...>{});
  }

 private:
  template <class F, std::size_t... I>
  constexpr void visit_parts(std::size_t index, F& f, std::index_sequence<I...>) const {
    (void)(visit_part<I>(index, f) || ...);
  }
  template <std::size_t I, class F>
  constexpr bool visit_part(std::size_t& index, F& f) const {
    using part = detail::layer_part<std::tuple_element_t<I, std::tuple<Parts...>>>;
    const std::size_t n = part::count(std::get<I>(parts_));
    if (index >= n) {
      index -= n;
      return false;
    }
    f(part::at(std::get<I>(parts_), index));
    return true;
  }

  std::tuple<typename detail::layer_part<Parts>::stored...> parts_;
};

// layer_sequence(a, b, std::span(blocks), blocks_vector, ...): a sequence of single layers and ranges of layers.
template <class... Args>
constexpr auto layer_sequence(Args&&... args) {
  return layer_list<typename detail::part_of<std::remove_reference_t<Args>>::type...>(std::forward<Args>(args)...);
}

struct segment_options {
  checkpoint::schedule schedule = checkpoint::schedule::single_segment();
  std::uint64_t first_layer = 0;           // inner layer i uses ctx.for_layer(first_layer + i)
  checkpoint::offload* offload = nullptr;  // keep checkpoints in host memory instead of the store
};

template <class List>
class segment {
 public:
  using value_type = typename List::value_type;

  explicit segment(List layers, segment_options options = {})
      : layers_(std::move(layers)), options_(options) {
    const std::string_view problem = options_.schedule.problem();
    require(problem.empty(), "checkpoint::segment: " + std::string(problem));
    require(layers_.size() > 0, "checkpoint::segment: no layers to run");
    require(layers_.size() <= max_checkpointed_layers,
            "checkpoint::segment: " + std::to_string(layers_.size()) + " layers is more than a plan indexes");
    plan_ = make_checkpoint_plan(options_.schedule, layers_.size());
  }
  // A moved-from segment keeps its layers and plan (it still works) but no pending passes, and takes a new
  // id, so checkpoints it offloads later cannot be mistaken for the moved passes'.
  segment(segment&& other)
      : layers_(other.layers_), options_(other.options_), plan_(other.plan_), passes_(std::move(other.passes_)),
        next_pass_(other.next_pass_), id_(std::exchange(other.id_, detail::next_checkpoint_owner())) {
    other.passes_.clear();
  }
  segment& operator=(segment&& other) {
    if (this != &other) {
      drop_pending();
      layers_ = other.layers_;
      options_ = other.options_;
      plan_ = other.plan_;
      passes_ = std::move(other.passes_);
      other.passes_.clear();
      next_pass_ = other.next_pass_;
      id_ = std::exchange(other.id_, detail::next_checkpoint_owner());
    }
    return *this;
  }
  // A segment destroyed with backwards pending frees what their forwards kept: their tensors in the store
  // (if it still exists) and their offloaded checkpoints (the offload must outlive the segment).
  ~segment() { drop_pending(); }

  std::size_t size() const noexcept { return layers_.size(); }
  const segment_options& options() const noexcept { return options_; }
  const checkpoint_plan& plan() const noexcept { return plan_; }
  std::size_t pending_backwards() const noexcept { return passes_.size(); }

  shape output_shape(const shape& in) const {
    shape s = in;
    for (std::size_t j = 0; j < size(); ++j) layers_.visit(j, [&](const auto& layer) { s = layer.output_shape(s); });
    return s;
  }

  // Exactly what forward() leaves in the store for backward (checkpoints and taped layers; with offload,
  // only taped layers).
  std::size_t saved_bytes(const shape& in, const forward_context& ctx) const { return cost(in, ctx).saved_bytes; }

  // The schedule's cost on this stack for input shape `in`: recomputed forwards, device activation bytes
  // (the peak is what the store's resource sees on top of the caller's x, y, dy, dx) and host bytes.
  checkpoint_cost cost(const shape& in, const forward_context& ctx) const {
    const sizes s = sizes_for(in, ctx);
    return checkpoint_cost_of(
        options_.schedule, size(), [&s](std::uint64_t p) { return s.hidden_bytes[p]; },
        [&s](std::uint64_t j) { return checkpoint_step_bytes{s.saved[j], s.forward_peak[j], s.backward_peak[j]}; },
        options_.offload != nullptr);
  }

  template <executor E>
    requires(List::template runs_on<E>)
  void forward(const E& exec, const forward_context& ctx, tensor_view<const value_type> x, tensor_view<value_type> y,
               activation_store& store) {
    const char* operation = "checkpoint::segment::forward";
    require_accessible(exec, x, operation, "x");
    require_accessible(exec, y, operation, "y");
    pass p{.id = next_pass_++, .ctx = ctx, .shapes = sizes_for(x.shape(), ctx), .store = store.ref(),
           .first_mark = store.mark()};
    p.tensors.assign(size(), unevaluated);
    require(y.shape() == p.shapes.shapes.back(), std::string(operation) + ": y has shape " + to_string(y.shape()) +
                                                     " but the layers output " + to_string(p.shapes.shapes.back()));
    runner<E> run(*this, exec, store, p);
    run.x = x;
    run.y = y;
    try {
      detail::checkpoint_interpreter interpreter(plan_, run);
      interpreter.forward();
    } catch (...) {
      abandon(exec, p, store);
      throw;
    }
    p.last_mark = store.mark();
    passes_.push_back(std::move(p));
  }

  // dx may be tensor_view::none() (no input gradient needed).
  template <executor E>
    requires(List::template runs_on<E>)
  void backward(const E& exec, tensor_view<const value_type> dy, tensor_view<value_type> dx, activation_store& store) {
    const char* operation = "checkpoint::segment::backward";
    require(!passes_.empty(), std::string(operation) +
                                  ": no forward pass to go back through (backward before forward, or twice?)");
    const activation_store* const saved_in = passes_.back().store.get();
    if (saved_in == nullptr) {  // that pass can never run backward: drop it
      drop(passes_.back());
      passes_.pop_back();
      throw error(std::string(operation) + ": the activation_store the forward saved its tensors in no longer exists");
    }
    require(saved_in == &store, std::string(operation) +
                                    ": given another activation_store than the one its forward saved its tensors in "
                                    "(give forward and backward the same store)");
    require_accessible(exec, dy, operation, "dy");
    require_accessible(exec, dx, operation, "dx");
    const sizes& shapes = passes_.back().shapes;
    require(dy.shape() == shapes.shapes.back(), std::string(operation) + ": dy has shape " + to_string(dy.shape()) +
                                                    " but the forward's output has shape " +
                                                    to_string(shapes.shapes.back()));
    require(dx.is_none() || dx.shape() == shapes.shapes.front(),
            std::string(operation) + ": dx has shape " + to_string(dx.shape()) + " but the forward's input has shape " +
                to_string(shapes.shapes.front()));
    pass p = std::move(passes_.back());
    passes_.pop_back();
    p.backward_mark = store.mark();
    runner<E> run(*this, exec, store, p);
    run.dy = dy;
    run.dx = dx;
    try {
      detail::checkpoint_interpreter interpreter(plan_, run);
      interpreter.backward();
    } catch (...) {
      abandon(exec, p, store);
      throw;
    }
  }

  // Forgets the most recent forward pass, whose backward will not run (a forward without gradients, or one
  // an outer segment runs without keeping it): frees its tensors in `store` and its offloaded checkpoints.
  // Callers that run layers generically use memkit::discard_forward(layer, store, entries).
  void discard_forward(activation_store& store) {
    const char* operation = "checkpoint::segment::discard_forward";
    require(!passes_.empty(), std::string(operation) + ": no forward pass to discard");
    require(passes_.back().store.get() == &store,
            std::string(operation) + ": given another activation_store than the one its forward saved its tensors in");
    drop(passes_.back());
    passes_.pop_back();
  }

 private:
  static constexpr std::uint32_t unevaluated = ~std::uint32_t{0};

  struct sizes {
    std::vector<shape> shapes;               // hidden state at positions 0..N
    std::vector<std::uint64_t> hidden_bytes;  // their bytes
    std::vector<std::uint64_t> saved;         // what each step's forward saves (its saved_bytes())
    std::vector<std::uint64_t> forward_peak;  // the most bytes alive while it runs forward, saved included
    std::vector<std::uint64_t> backward_peak; // ... backward (a nested segment's cost(); else saved)
  };

  static constexpr std::uint64_t no_mark = ~std::uint64_t{0};

  struct pass {
    std::uint64_t id = 0;
    forward_context ctx{};
    sizes shapes{};
    activation_store_ref store{};        // where it saved its tensors
    std::uint64_t first_mark = 0;        // the store's mark when the forward began
    std::uint64_t last_mark = no_mark;   // ... when it ended
    std::uint64_t backward_mark = no_mark;  // ... when the backward began
    std::vector<std::uint32_t> tensors{};  // tensors each step's first forward saved
    std::vector<std::uint32_t> taped{};    // steps whose forward is kept and whose backward has not run, in order
  };

  forward_context context_of(const forward_context& ctx, std::size_t step) const {
    return ctx.for_layer(options_.first_layer + step);
  }

  sizes sizes_for(const shape& in, const forward_context& ctx) const {
    sizes s;
    s.shapes.reserve(size() + 1);
    s.shapes.push_back(in);
    for (std::size_t j = 0; j < size(); ++j)
      layers_.visit(j, [&](const auto& layer) {
        const forward_context layer_ctx = context_of(ctx, j);
        if constexpr (requires {
                        { layer.cost(s.shapes.back(), layer_ctx) } -> std::same_as<checkpoint_cost>;
                      }) {
          // A nested segment: what it allocates while it runs, beyond what it keeps.
          const checkpoint_cost inner = layer.cost(s.shapes.back(), layer_ctx);
          s.saved.push_back(inner.saved_bytes);
          s.forward_peak.push_back(inner.forward_peak_bytes);
          s.backward_peak.push_back(inner.backward_peak_bytes);
        } else {
          s.saved.push_back(layer.saved_bytes(s.shapes.back(), layer_ctx));
          s.forward_peak.push_back(s.saved.back());
          s.backward_peak.push_back(s.saved.back());
        }
        s.shapes.push_back(layer.output_shape(s.shapes.back()));
      });
    for (const shape& dims : s.shapes) s.hidden_bytes.push_back(activation_store::bytes_required<value_type>(dims));
    return s;
  }

  // Lets the layers of the pass's kept forwards whose backward has not run (nested segments) forget them,
  // latest first.
  void discard_taped(pass& p, activation_store& store) noexcept {
    for (std::size_t i = p.taped.size(); i-- > 0;) {
      try {
        layers_.visit(p.taped[i], [&](auto& layer) {
          if constexpr (requires { layer.discard_forward(store); }) layer.discard_forward(store);
        });
      } catch (...) {  // it had forgotten that forward already
      }
    }
    p.taped.clear();
  }

  // Frees what a pending pass keeps, without an executor (discard_forward, the destructor).
  void drop(pass& p) noexcept {
    if (activation_store* store = p.store.get()) {
      discard_taped(p, *store);
      store->release_between(p.first_mark, p.last_mark);
    }
    if (options_.offload != nullptr) options_.offload->forget(id_, p.id);
  }
  void drop_pending() noexcept {
    while (!passes_.empty()) {
      drop(passes_.back());
      passes_.pop_back();
    }
  }

  // After a failure: free what this pass keeps, so a retry starts clean.
  template <class E>
  void abandon(const E& exec, pass& p, activation_store& store) noexcept {
    discard_taped(p, store);
    store.release_between(p.first_mark, p.last_mark);  // what its forward saved
    store.release_between(p.backward_mark);            // what its backward saved
    if (options_.offload != nullptr) {
      try {
        options_.offload->forget(exec, id_, p.id);
      } catch (...) {
      }
    }
  }

  // The real backend of the plan interpreter (detail::checkpoint_interpreter in schedule.hpp).
  template <class E>
  class runner {
   public:
    using T = value_type;
    struct hidden {
      T* data = nullptr;
      memory_kind where = memory_kind::host;
      buffer<std::byte> storage;  // an owned buffer
      saved_tensor<T> slot;       // an owned checkpoint taken from the store
      bool owned = false;
      // An offload copy reads this memory: the compute stream waits for it before the memory is freed or
      // given back, also when a failure unwinds the pass.
      checkpoint::offload* copy_pending = nullptr;
      const E* exec = nullptr;

      hidden() = default;
      hidden(hidden&& other) noexcept { take_from(other); }
      hidden& operator=(hidden&& other) noexcept {
        if (this != &other) {
          wait_for_copy();
          storage = buffer<std::byte>();
          slot = saved_tensor<T>();
          take_from(other);
        }
        return *this;
      }
      ~hidden() { wait_for_copy(); }

     private:
      void wait_for_copy() noexcept {
        if (copy_pending == nullptr) return;
        try {
          copy_pending->wait_for_copies(*exec);
        } catch (...) {  // a failing stream: nothing left to order against
        }
        copy_pending = nullptr;
      }
      void take_from(hidden& other) noexcept {
        data = std::exchange(other.data, nullptr);
        where = other.where;
        storage = std::move(other.storage);
        slot = std::move(other.slot);
        owned = std::exchange(other.owned, false);
        copy_pending = std::exchange(other.copy_pending, nullptr);
        exec = other.exec;
      }
    };

    runner(segment& segment, const E& exec, activation_store& store, pass& p)
        : segment_(segment), exec_(exec), store_(store), pass_(p) {}

    tensor_view<const T> x{}, dy{};
    tensor_view<T> y{}, dx{};

    hidden caller_input() { return view_of(x); }
    hidden caller_output() { return view_of(y); }
    hidden caller_grad_output() { return view_of(dy); }
    hidden caller_grad_input() { return view_of(dx); }

    hidden temporary(std::uint64_t p) {
      hidden h;
      h.storage = buffer<std::byte>(store_.resource(), shape{static_cast<std::int64_t>(bytes(p))});
      h.data = reinterpret_cast<T*>(h.storage.data());
      h.where = h.storage.where();
      h.owned = true;
      return h;
    }
    void release(hidden& h) { h = hidden{}; }

    void forward(std::uint64_t step, const hidden& in, hidden& out, bool keep) {
      const std::size_t entries = store_.size(), held = store_.bytes();
      segment_.layers_.visit(step, [&](auto& layer) {
        const detail::inside_segment_step nested;
        layer.forward(exec_, segment_.context_of(pass_.ctx, step), const_view(in, step), view(out, step + 1), store_);
      });
      require(store_.size() >= entries, "checkpoint::segment: layer " + std::to_string(step) +
                                            "'s forward took tensors out of the store it was given");
      check_saved(step, store_.size() - entries, store_.bytes() - held);
      if (keep)
        pass_.taped.push_back(static_cast<std::uint32_t>(step));
      else  // a nested segment forgets this forward too
        segment_.layers_.visit(step, [&](auto& layer) { ::memkit::discard_forward(layer, store_, entries); });
    }

    void backward(std::uint64_t step, const hidden& grad_out, hidden& grad_in) {
      const std::size_t entries = store_.size();
      if (!pass_.taped.empty() && pass_.taped.back() == step) pass_.taped.pop_back();
      segment_.layers_.visit(step, [&](auto& layer) {
        const detail::inside_segment_step nested;
        // Step 0 writes the caller's dx as given (it may be none: no input gradient wanted).
        layer.backward(exec_, const_view(grad_out, step + 1), step == 0 ? dx : view(grad_in, step), store_);
      });
      const std::uint32_t saved = pass_.tensors[step];
      require(store_.size() + saved == entries,
              "checkpoint::segment: layer " + std::to_string(step) + "'s backward took " +
                  std::to_string(entries >= store_.size() ? entries - store_.size() : 0) +
                  " tensors from the store but its forward saved " + std::to_string(saved));
    }

    bool offloading() const noexcept { return segment_.options_.offload != nullptr; }

    hidden keep_copy(std::uint64_t p, hidden& work) {
      tensor_view<T> kept = store_.save<T>(pass_.shapes.shapes[p]);
      detail::copy_bytes(exec_, kept.data(), work.data, bytes(p));
      return view_of(kept);
    }
    hidden keep_adopted(std::uint64_t p, hidden& work) {
      tensor_view<T> kept = store_.adopt<T>(std::move(work.storage), pass_.shapes.shapes[p]);
      work = hidden{};
      return view_of(kept);
    }
    hidden peek(std::uint64_t p) {
      return view_of(store_.peek<T>(pass_.shapes.shapes[p], "checkpoint::segment (a checkpoint)"));
    }
    hidden take(std::uint64_t p) {
      hidden h;
      h.slot = store_.take<T>(pass_.shapes.shapes[p], "checkpoint::segment (a checkpoint)");
      h.data = h.slot.view().data();
      h.where = h.slot.view().where();
      h.owned = true;
      return h;
    }
    void offload(std::uint64_t p, hidden& work) {
      segment_.options_.offload->keep(exec_, work.data, bytes(p), key(p));
      work.copy_pending = segment_.options_.offload;
      work.exec = &exec_;
    }
    hidden fetch(std::uint64_t p, bool last) {
      hidden h;
      h.storage = segment_.options_.offload->fetch(exec_, store_.resource(), key(p), last);
      h.data = reinterpret_cast<T*>(h.storage.data());
      h.where = h.storage.where();
      h.owned = true;
      return h;
    }
    void prefetch(std::uint64_t p) { segment_.options_.offload->prefetch(exec_, store_.resource(), key(p)); }
    // In a loop of segments, the next one's checkpoint. Not in a nested segment: the outer segment's plan
    // decides what comes back next (and its cost() predicts it).
    void prefetch_beyond() {
      if (detail::segment_steps_running == 0) segment_.options_.offload->prefetch_latest(exec_, store_.resource());
    }
    void forward_done() {
      if (offloading()) segment_.options_.offload->wait_for_copies(exec_);
    }

   private:
    std::uint64_t bytes(std::uint64_t p) const { return pass_.shapes.hidden_bytes[p]; }
    checkpoint_key key(std::uint64_t p) const { return {segment_.id_, pass_.id, p}; }

    template <class U>
    static hidden view_of(tensor_view<U> v) {
      hidden h;
      h.data = const_cast<T*>(v.data());  // the caller's x and dy are only read
      h.where = v.where();
      return h;
    }
    tensor_view<T> view(const hidden& h, std::uint64_t p) const { return {h.data, pass_.shapes.shapes[p], h.where}; }
    tensor_view<const T> const_view(const hidden& h, std::uint64_t p) const {
      return {h.data, pass_.shapes.shapes[p], h.where};
    }

    void check_saved(std::uint64_t step, std::size_t tensors, std::size_t saved_bytes) {
      const std::string layer = "checkpoint::segment: layer " + std::to_string(step);
      std::uint32_t& first = pass_.tensors[step];
      if (first == unevaluated) {
        require(saved_bytes == pass_.shapes.saved[step],
                layer + "'s forward saved " + std::to_string(saved_bytes) + " bytes but its saved_bytes() says " +
                    std::to_string(pass_.shapes.saved[step]) + ": a layer must report exactly what it saves");
        first = static_cast<std::uint32_t>(tensors);
        return;
      }
      require(saved_bytes == pass_.shapes.saved[step] && tensors == first,
              layer + "'s recomputed forward saved " + std::to_string(saved_bytes) + " bytes in " +
                  std::to_string(tensors) + " tensors, but its first forward saved " +
                  std::to_string(pass_.shapes.saved[step]) + " bytes in " + std::to_string(first) +
                  ": a recomputation must repeat the forward exactly (same input and forward_context, no layer "
                  "state changed between forward and backward)");
    }

    segment& segment_;
    const E& exec_;
    activation_store& store_;
    pass& pass_;
  };

  List layers_;
  segment_options options_;
  checkpoint_plan plan_;
  std::vector<pass> passes_;
  std::uint64_t next_pass_ = 0;
  std::uint64_t id_ = detail::next_checkpoint_owner();
};

template <class... Parts>
segment(layer_list<Parts...>, segment_options = {}) -> segment<layer_list<Parts...>>;
template <class L, class Allocator>
segment(std::vector<L, Allocator>&, segment_options = {}) -> segment<layer_list<std::span<L>>>;
template <class L, std::size_t Extent>
segment(std::span<L, Extent>, segment_options = {}) -> segment<layer_list<std::span<L, Extent>>>;

}  // namespace checkpoint
MEMKIT_NAMESPACE_END
