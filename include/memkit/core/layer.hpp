// memkit/core/layer.hpp — what a hand-written layer offers so that a C++ training loop (and
// memkit::checkpoint::segment) can run its forward and backward, and where it keeps what its backward needs.
//
// There is no autograd: a layer's forward writes its output and saves, into an activation_store, exactly
// the tensors its backward will need; its backward takes them back (last saved, first taken), writes the
// input gradient and accumulates its own parameter gradients. Everything saved comes from the store's
// memory resource, so a tracking_resource charges it to "activations".
//
// Randomness (dropout) comes only from the forward_context: the same context gives the same masks, which
// is what lets activation checkpointing recompute a forward bit for bit.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/execution.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/memory/buffer.hpp"
#include "memkit/memory/resource.hpp"

MEMKIT_NAMESPACE_BEGIN

// The random state and mode of one forward pass. A layer draws its random numbers from (seed, counter)
// alone; a stack gives each of its layers its own counter with for_layer().
struct forward_context {
  std::uint64_t seed = 0;     // randomness of this training step
  std::uint64_t counter = 0;  // where this layer's random stream starts
  bool training = true;       // false: no dropout
  // Packed documents of this batch: int32 [batch, N + 1] cumulative offsets per row (attention/bytes.hpp), read
  // by the layers that mix positions (attention, rotary positions); none(): each row is one sequence.
  tensor_view<const std::int32_t> document_offsets{};

  constexpr forward_context for_layer(std::uint64_t index) const noexcept {
    // Counters 2^40 apart: a layer may draw up to 2^40 random words without overlapping the next one.
    return {seed, counter + (index << 40), training, document_offsets};
  }
};

namespace detail {
// One address per type: identifies a saved tensor's element type without RTTI.
template <class T>
inline constexpr char type_tag = 0;
}  // namespace detail

// A tensor saved for backward, owned by whoever took it from the store; freed when it is destroyed.
template <class T>
class saved_tensor {
 public:
  saved_tensor() = default;
  explicit saved_tensor(buffer<std::byte>&& storage, shape dims) : storage_(std::move(storage)), shape_(dims) {}

  tensor_view<T> view() noexcept { return {reinterpret_cast<T*>(storage_.data()), shape_, storage_.where()}; }
  tensor_view<const T> view() const noexcept {
    return {reinterpret_cast<const T*>(storage_.data()), shape_, storage_.where()};
  }
  const shape& dims() const noexcept { return shape_; }

 private:
  buffer<std::byte> storage_;
  shape shape_{};
};

class activation_store;

// Refers to an activation_store that may be moved or destroyed meanwhile (what an owner of saved tensors
// that can outlive the store keeps, e.g. a memkit::checkpoint::segment with a pending backward).
class activation_store_ref {
 public:
  activation_store_ref() = default;
  // The store now (after any moves), or null once it is destroyed.
  activation_store* get() const noexcept {
    const std::shared_ptr<activation_store*> self = self_.lock();
    return self ? *self : nullptr;
  }

 private:
  friend class activation_store;
  explicit activation_store_ref(const std::shared_ptr<activation_store*>& self) : self_(self) {}
  std::weak_ptr<activation_store*> self_;
};

// A last-in, first-out store of the tensors forward passes save for their backward passes.
class activation_store {
 public:
  explicit activation_store(memory_resource& resource) : resource_(&resource) {}
  activation_store(activation_store&& other) noexcept
      : resource_(other.resource_), entries_(std::move(other.entries_)), held_bytes_(std::exchange(other.held_bytes_, 0)),
        next_serial_(other.next_serial_), self_(std::move(other.self_)) {
    other.entries_.clear();
    if (self_) *self_ = this;
  }
  activation_store& operator=(activation_store&& other) noexcept {
    if (this != &other) {
      resource_ = other.resource_;
      entries_ = std::move(other.entries_);
      other.entries_.clear();
      held_bytes_ = std::exchange(other.held_bytes_, 0);
      next_serial_ = other.next_serial_;
      self_ = std::move(other.self_);  // references to this store's old contents expire
      if (self_) *self_ = this;
    }
    return *this;
  }
  activation_store(const activation_store&) = delete;
  activation_store& operator=(const activation_store&) = delete;
  ~activation_store() = default;  // its activation_store_refs expire

  // A reference that follows this store through moves and reads null once it is destroyed.
  activation_store_ref ref() {
    if (!self_) self_ = std::make_shared<activation_store*>(this);
    return activation_store_ref(self_);
  }

  // Bytes a saved tensor of `dims` elements of T takes (what a layer's saved_bytes() adds up).
  template <class T>
  static constexpr std::size_t bytes_required(const shape& dims) noexcept {
    return buffer<T>::bytes_required(dims);
  }

  // Allocates a tensor to save (contents uninitialized: the forward fills it) and returns a view of it.
  template <class T>
  tensor_view<T> save(shape dims) {
    entry saved{buffer<std::byte>(*resource_, shape{static_cast<std::int64_t>(bytes_required<T>(dims))}), dims,
                &detail::type_tag<T>, sizeof(T), next_serial_++};
    T* data = reinterpret_cast<T*>(saved.storage.data());
    const memory_kind where = saved.storage.where();
    entries_.push_back(std::move(saved));
    held_bytes_ += bytes_required<T>(dims);
    return {data, dims, where};
  }

  // Saves a tensor that already sits in `storage` (a buffer the caller filled, e.g. a layer's output that
  // becomes a checkpoint) without copying it. `storage` must hold exactly bytes_required<T>(dims).
  template <class T>
  tensor_view<T> adopt(buffer<std::byte>&& storage, shape dims) {
    require(storage.bytes() == bytes_required<T>(dims),
            "activation_store::adopt: a buffer of " + std::to_string(storage.bytes()) + " bytes cannot hold shape " +
                to_string(dims) + " of " + std::to_string(sizeof(T)) + "-byte elements");
    T* data = reinterpret_cast<T*>(storage.data());
    const memory_kind where = storage.where();
    entries_.push_back(entry{std::move(storage), dims, &detail::type_tag<T>, sizeof(T), next_serial_++});
    held_bytes_ += bytes_required<T>(dims);
    return {data, dims, where};
  }

  // Takes back the most recently saved tensor not yet taken. Throws memkit::error, and takes nothing,
  // when the store is empty or that tensor is not `expected` elements of T: a backward that does not
  // match its forward is reported, never run on the wrong bytes.
  template <class T>
  saved_tensor<T> take(const shape& expected, const char* who = "activation_store") {
    require(!entries_.empty(), std::string(who) + ": backward asked for a saved tensor of shape " +
                                   to_string(expected) + " but nothing is saved (backward before forward, or twice?)");
    entry& last = entries_.back();
    require(last.type == &detail::type_tag<T> && last.dims == expected,
            std::string(who) + ": the last saved tensor has shape " + to_string(last.dims) + " of " +
                std::to_string(last.element_bytes) + "-byte elements, but backward asked for shape " +
                to_string(expected) + " of " + std::to_string(sizeof(T)) + "-byte elements" +
                (last.type == &detail::type_tag<T> ? "" : " of another type"));
    held_bytes_ -= bytes_required<T>(last.dims);
    saved_tensor<T> taken(std::move(last.storage), last.dims);
    entries_.pop_back();
    return taken;
  }

  // The most recently saved tensor, left in the store; checked like take().
  template <class T>
  tensor_view<const T> peek(const shape& expected, const char* who = "activation_store") const {
    require(!entries_.empty(), std::string(who) + ": asked for a saved tensor of shape " + to_string(expected) +
                                   " but nothing is saved");
    const entry& last = entries_.back();
    require(last.type == &detail::type_tag<T> && last.dims == expected,
            std::string(who) + ": the last saved tensor has shape " + to_string(last.dims) + " of " +
                std::to_string(last.element_bytes) + "-byte elements, not shape " + to_string(expected) + " of " +
                std::to_string(sizeof(T)) + "-byte elements" + (last.type == &detail::type_tag<T> ? "" : " of another type"));
    return {reinterpret_cast<const T*>(last.storage.data()), last.dims, last.storage.where()};
  }

  // The shape of the most recently saved tensor when it holds elements of T, else none (also when empty): how a
  // backward finds out whether its forward saved an optional tensor.
  template <class T>
  std::optional<shape> last_shape() const noexcept {
    if (entries_.empty() || entries_.back().type != &detail::type_tag<T>) return std::nullopt;
    return entries_.back().dims;
  }

  std::size_t size() const noexcept { return entries_.size(); }
  bool empty() const noexcept { return entries_.empty(); }
  std::size_t bytes() const noexcept { return held_bytes_; }  // bytes of the tensors held now
  memory_resource& resource() const noexcept { return *resource_; }
  // Frees everything still held (e.g. after a forward whose backward will not run).
  void clear() noexcept {
    entries_.clear();
    held_bytes_ = 0;
  }
  // Frees the tensors saved after the first `count` (e.g. those of a forward whose backward will not run).
  void release_to(std::size_t count) noexcept {
    if (count >= entries_.size()) return;
    const auto first = entries_.begin() + static_cast<std::ptrdiff_t>(count);
    for (auto it = first; it != entries_.end(); ++it) held_bytes_ -= it->storage.bytes();
    entries_.erase(first, entries_.end());
  }
  // Where the store is now: every tensor saved later has a mark at or above it (marks are never reused).
  std::uint64_t mark() const noexcept { return next_serial_; }
  // Frees the tensors saved from mark `from` up to (not including) mark `to` that are still held, wherever
  // they sit in the stack (e.g. those of one forward pass when later passes saved more on top).
  void release_between(std::uint64_t from, std::uint64_t to = ~std::uint64_t{0}) noexcept {
    auto first = entries_.end();
    while (first != entries_.begin() && std::prev(first)->serial >= from) --first;
    auto last = first;
    while (last != entries_.end() && last->serial < to) {
      held_bytes_ -= last->storage.bytes();
      ++last;
    }
    entries_.erase(first, last);
  }

 private:
  struct entry {
    buffer<std::byte> storage;
    shape dims;
    const char* type;
    std::size_t element_bytes;
    std::uint64_t serial;  // its mark
  };
  memory_resource* resource_;
  std::vector<entry> entries_;
  std::size_t held_bytes_ = 0;
  std::uint64_t next_serial_ = 0;
  std::shared_ptr<activation_store*> self_;  // what activation_store_refs follow (made on first ref())
};

// A trainable (or frozen) layer from activations of value_type to activations of value_type.
//   output_shape(in)         the output's shape for an input of shape `in`
//   saved_bytes(in, ctx)     exactly the bytes forward(…, ctx, x of shape in, …) saves in the store
//   forward(exec, ctx, x, y, store)   writes y, saves what backward needs
//   backward(exec, dy, dx, store)     takes it back, writes dx (skipped when dx is tensor_view::none()), accumulates
//                                     parameter gradients into the layer's own gradient tensors
// Optional: discard_forward(store)   forgets its most recent forward, whose backward will not run, and frees
//                                     what it keeps of it (a layer that keeps state of a forward outside the
//                                     store has it: memkit::checkpoint::segment's pending pass and offloaded
//                                     checkpoints). Callers use memkit::discard_forward below.
template <class L, class E>
concept layer = executor<E> && requires(L& l, const L& cl, const E& exec, const forward_context& ctx,
                                        const shape& in, activation_store& store,
                                        tensor_view<const typename L::value_type> x,
                                        tensor_view<typename L::value_type> y) {
  typename L::value_type;
  { cl.output_shape(in) } -> std::same_as<shape>;
  { cl.saved_bytes(in, ctx) } -> std::convertible_to<std::size_t>;
  l.forward(exec, ctx, x, y, store);
  l.backward(exec, x, y, store);  // (dy, dx): dy has the output's shape, dx the input's
};

// Undoes `layer`'s most recent forward, whose backward will not run (a forward without gradients, the
// forward an outer memkit::checkpoint::segment runs without keeping it): frees what it saved (every tensor after the
// first `entries`, the store's size() before that forward) and lets the layer drop what it keeps of it
// elsewhere (layer.discard_forward(store), when it has one).
template <class L>
void discard_forward(L& layer, activation_store& store, std::size_t entries) {
  if constexpr (requires { layer.discard_forward(store); }) layer.discard_forward(store);
  store.release_to(entries);
}

// Says which requirement of layer<L, E> a type misses, one static_assert per requirement, where the
// concept alone only says it is not satisfied:
//   static_assert(memkit::explain_layer<my_layer, memkit::host_executor>());
template <class L, class E>
constexpr bool explain_layer() {
  static_assert(executor<E>, "memkit::layer<L, E>: E is not an executor (memkit::host_executor or cuda_executor)");
  static_assert(requires { typename L::value_type; },
                "memkit::layer: the layer needs `using value_type = ...;` (the element type of its activations)");
  if constexpr (requires { typename L::value_type; }) {
    using T = typename L::value_type;
    static_assert(requires(const L& l, const shape& in) {
      { l.output_shape(in) } -> std::same_as<shape>;
    }, "memkit::layer: the layer needs `memkit::shape output_shape(const memkit::shape& in) const`");
    static_assert(requires(const L& l, const shape& in, const forward_context& ctx) {
      { l.saved_bytes(in, ctx) } -> std::convertible_to<std::size_t>;
    }, "memkit::layer: the layer needs `std::size_t saved_bytes(const memkit::shape& in, const memkit::forward_context& "
       "ctx) const` (exactly the bytes its forward saves in the store)");
    static_assert(requires(L& l, const E& exec, const forward_context& ctx, tensor_view<const T> x, tensor_view<T> y,
                           activation_store& store) { l.forward(exec, ctx, x, y, store); },
                  "memkit::layer: the layer needs `void forward(const E& exec, const memkit::forward_context& ctx, "
                  "memkit::tensor_view<const value_type> x, memkit::tensor_view<value_type> y, memkit::activation_store& "
                  "store)` for this executor E");
    static_assert(requires(L& l, const E& exec, tensor_view<const T> dy, tensor_view<T> dx, activation_store& store) {
      l.backward(exec, dy, dx, store);
    }, "memkit::layer: the layer needs `void backward(const E& exec, memkit::tensor_view<const value_type> dy, "
       "memkit::tensor_view<value_type> dx, memkit::activation_store& store)` for this executor E");
  }
  return layer<L, E>;
}

MEMKIT_NAMESPACE_END
