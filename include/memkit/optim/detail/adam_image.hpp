// memkit/optim/detail/adam_image.hpp — the pieces of the optimizer states' binary images (adam_state::save/load,
// sharded_adam_state's rank images): field writers and readers, the checksum, and adam_state's image layout
// (the arena without the padding between m and v). Nothing here is API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <istream>
#include <ostream>
#include <span>
#include <string>

#include "memkit/config.hpp"
#include "memkit/core/random.hpp"
#include "memkit/optim/adam_bytes.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace optim {
namespace detail {

template <class T>
void write_pod(std::ostream& out, const T& value) {
  out.write(reinterpret_cast<const char*>(&value), sizeof value);
}
inline void write_string(std::ostream& out, const std::string& text) {
  write_pod(out, static_cast<std::uint32_t>(text.size()));
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
}
// A field of an image; `op` starts the message when the stream ends first.
template <class T>
T read_pod(std::istream& in, const std::string& op) {
  T value{};
  in.read(reinterpret_cast<char*>(&value), sizeof value);
  require(static_cast<std::size_t>(in.gcount()) == sizeof value, op + ": image is truncated");
  return value;
}
inline std::string read_string(std::istream& in, const std::string& op) {
  const auto length = read_pod<std::uint32_t>(in, op);
  require(length < 4096, op + ": image header is corrupt (string of " + std::to_string(length) + " bytes)");
  std::string text(length, '\0');
  in.read(text.data(), length);
  require(static_cast<std::uint32_t>(in.gcount()) == length, op + ": image is truncated");
  return text;
}
// The checksum an image carries after its body: FNV-1a, 8 bytes at a time through mix64, the tail bytewise.
// It detects accidents, not forgery (the loaders validate every value as well).
inline std::uint64_t image_checksum(const void* bytes, std::size_t size) noexcept {
  const auto* data = static_cast<const unsigned char*>(bytes);
  std::uint64_t hash = 0xcbf29ce484222325ull;
  std::size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    std::uint64_t word;
    std::memcpy(&word, data + i, 8);
    hash = mix64(hash ^ word);
  }
  for (; i < size; ++i) hash = (hash ^ data[i]) * 0x100000001b3ull;
  return hash;
}

// A saved adam_state image holds the arena without the padding between m and v (stagger_after): the layout of
// format version 1, written before that padding existed, so those images still load. Per tensor, the image
// has m's segment, then v's segment and the scales, contiguous.
template <class State, int Block>
struct adam_image_layout {
  static std::size_t stagger_of(const adam_tensor_layout& t) noexcept {
    const adam_segment_plan plan = adam_layout<State, Block>::segment_plan(t.size, t.quantized);
    return plan.v - plan.m_bytes;
  }
  static std::size_t image_bytes(std::span<const adam_tensor_layout> tensors, std::size_t arena_bytes) noexcept {
    std::size_t bytes = arena_bytes;
    for (const adam_tensor_layout& t : tensors) bytes -= stagger_of(t);
    return bytes;
  }
  // Copies the arena's bytes to the image's (to_image) or back, skipping each tensor's padding; the first
  // `overhead` bytes (control block and scratch) are the same in both.
  static void relayout(std::span<const adam_tensor_layout> tensors, std::size_t overhead, std::size_t arena_bytes,
                       const std::byte* from, std::byte* to, bool to_image) noexcept {
    std::memcpy(to, from, overhead);
    std::size_t packed = overhead;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const adam_tensor_layout& t = tensors[i];
      const std::size_t end = i + 1 < tensors.size() ? tensors[i + 1].m_offset : arena_bytes;
      const std::size_t pad = stagger_of(t), m_bytes = t.v_offset - t.m_offset - pad, rest = end - t.v_offset;
      const std::size_t m_arena = t.m_offset, v_arena = t.v_offset, m_image = packed, v_image = packed + m_bytes;
      std::memcpy(to + (to_image ? m_image : m_arena), from + (to_image ? m_arena : m_image), m_bytes);
      std::memcpy(to + (to_image ? v_image : v_arena), from + (to_image ? v_arena : v_image), rest);
      packed += m_bytes + rest;
    }
  }
};

}  // namespace detail
}  // namespace optim
MEMKIT_NAMESPACE_END
