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

// Offset of the state bytes in an image save() wrote (its header read as load() reads it), or 0 when the
// header does not fit in `image`.
inline std::size_t adam_image_payload_offset(const std::string& image) {
  std::size_t at = 0;
  const auto skip_string = [&] {
    std::uint32_t length = 0;
    if (at + 4 > image.size()) return false;
    std::memcpy(&length, image.data() + at, 4);
    at += 4 + length;
    return at <= image.size();
  };
  if (!skip_string()) return 0;  // magic
  at += 4;                       // format version
  if (!skip_string()) return 0;  // state name
  at += 4 + 4 + 8 + 8;           // bits, block, map fingerprint, min_quantized_size
  std::uint64_t tensors = 0;
  if (at + 8 > image.size()) return 0;
  std::memcpy(&tensors, image.data() + at, 8);
  at += 8;
  if (tensors > image.size() / 8) return 0;
  at += 8 * static_cast<std::size_t>(tensors) + 8;  // the tensor sizes, then the state bytes' length
  return at <= image.size() ? at : 0;
}

// What save() writes after loading `image` (up to `length` bytes of it): the same bytes, except the
// gradient-norm scratch, which is saved as zeros (with the checksum to match).
template <class State>
std::string adam_image_as_saved(const std::string& image, std::size_t length, const State& state) {
  std::string expected = image.substr(0, length);
  const std::size_t payload = adam_image_payload_offset(expected);
  const auto [scratch_begin, scratch_end] = state.scratch_range();
  if (payload == 0 || payload + scratch_end + 8 > expected.size()) return expected;
  std::memset(expected.data() + payload + scratch_begin, 0, scratch_end - scratch_begin);
  fix_adam_image_checksum(expected, expected.size() - 8 - payload);
  return expected;
}

}  // namespace memkit_test
