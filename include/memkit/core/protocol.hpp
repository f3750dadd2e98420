// The component protocol (docs/architecture.md): every operation has an arguments struct (shapes, element
// sizes, options; no pointers) and three constexpr byte functions found by argument-dependent lookup.
// operation_arguments<A> checks that a type has them; memory_budget and tests use it to treat every
// operation alike.
#pragma once

#include <concepts>
#include <cstddef>

#include "memkit/config.hpp"

MEMKIT_NAMESPACE_BEGIN

template <class A>
concept operation_arguments = requires(const A& args) {
  { workspace_bytes(args) } -> std::same_as<std::size_t>;
  { saved_bytes(args) } -> std::same_as<std::size_t>;
  { bytes_required(args) } -> std::same_as<std::size_t>;
};

MEMKIT_NAMESPACE_END
