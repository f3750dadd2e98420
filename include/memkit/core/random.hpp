// memkit/core/random.hpp — counter-based random numbers, the same on the host and on CUDA devices.
//
// Every random number memkit draws (stochastic rounding in the optimizer, dropout masks, initialization)
// is a pure function of (seed, counter, index): no generator state to carry, split across threads or
// restore, so a recomputed forward (activation checkpointing) draws exactly the same numbers, and the
// host and a kernel agree bit for bit.
#pragma once

#include <cstdint>

#include "memkit/config.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace detail {

// SplitMix64's finaliser: a counter-based generator, so the random bits of element i at step t do not
// depend on how the elements are split among threads.
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE constexpr std::uint64_t mix64(std::uint64_t z) noexcept {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// 32 random bits for element `index` of `tensor` at optimizer step `step`.
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE constexpr std::uint32_t random_bits(std::uint64_t seed, std::int64_t step,
                                                                         std::int64_t tensor,
                                                                         std::int64_t index) noexcept {
  const std::uint64_t key = mix64(seed ^ mix64(static_cast<std::uint64_t>(step) * 0x100000001b3ull +
                                                static_cast<std::uint64_t>(tensor)));
  return static_cast<std::uint32_t>(mix64(key + static_cast<std::uint64_t>(index)) >> 32);
}

}  // namespace detail

// 32 random bits for element `index` of the stream (seed, counter), e.g. a forward_context's.
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE constexpr std::uint32_t random_word(std::uint64_t seed, std::uint64_t counter,
                                                                         std::uint64_t index) noexcept {
  const std::uint64_t key = detail::mix64(seed ^ detail::mix64(counter));
  return static_cast<std::uint32_t>(detail::mix64(key + index) >> 32);
}

// The top 24 bits of a random word as a float uniform in [0, 1), exactly representable.
MEMKIT_HOST_DEVICE MEMKIT_FORCEINLINE constexpr float unit_float(std::uint32_t bits) noexcept {
  return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f);
}

MEMKIT_NAMESPACE_END
