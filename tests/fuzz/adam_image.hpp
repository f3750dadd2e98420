// adam_state images for tests and the fuzz harness: where the state bytes sit in an image, and the image's
// checksum recomputed after an edit (a forger can do the same, which is why adam_state::load validates
// the values and not only the checksum).
#pragma once

#include <memkit/optim/adam_state.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace memkit_test {

// The checksum adam_state writes after the state bytes (FNV-1a over 8-byte words through mix64).
inline std::uint64_t adam_image_checksum(const unsigned char* data, std::size_t size) {
  std::uint64_t hash = 0xcbf29ce484222325ull;
  std::size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    std::uint64_t word;
    std::memcpy(&word, data + i, 8);
    hash = memkit::detail::mix64(hash ^ word);
  }
  for (; i < size; ++i) hash = (hash ^ static_cast<std::uint64_t>(data[i])) * 0x100000001b3ull;
  return hash;
}

// Rewrites the last 8 bytes of `image` as the checksum of the `state_bytes` bytes before them.
inline void fix_adam_image_checksum(std::string& image, std::size_t state_bytes) {
  if (image.size() < state_bytes + 8) return;
  const auto* state = reinterpret_cast<const unsigned char*>(image.data()) + image.size() - 8 - state_bytes;
  const std::uint64_t sum = adam_image_checksum(state, state_bytes);
  std::memcpy(image.data() + image.size() - 8, &sum, 8);
}

// Offset in the image of the state bytes (the control block comes first).
inline std::size_t adam_image_state_offset(const std::string& image, std::size_t state_bytes) {
  return image.size() - 8 - state_bytes;
}

}  // namespace memkit_test
