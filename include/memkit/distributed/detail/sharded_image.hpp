// memkit/distributed/detail/sharded_image.hpp — sharded_adam_state's rank images: appending fields to a body,
// and reading a body from its stream field by field, hashed as it goes. Nothing here is API.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <istream>
#include <string>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/random.hpp"
#include "memkit/optim/detail/adam_image.hpp"

MEMKIT_NAMESPACE_BEGIN
namespace distributed {
namespace detail {

template <class T>
inline void put(std::string& out, const T& value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof value);
}
inline void put_string(std::string& out, const std::string& text) {
  put(out, static_cast<std::uint32_t>(text.size()));
  out.append(text);
}
// An image's body read from its stream in order, hashed as it goes (the checksum after it is compared at
// the end). Nothing is allocated from the length the header claims: fields are read one by one, moments
// stream through a buffer of at most 1 MiB and only this rank's part is kept (in load()'s staging), so
// loading a whole unsharded save on one of many ranks needs no more memory than that rank's state, and a
// 41-byte image claiming gigabytes fails after 41 bytes.
struct body_stream {
  body_stream(std::istream& in, std::uint64_t body_length, const std::string& name)
      : stream(in), length(body_length), where(name) {}
  std::istream& stream;
  std::uint64_t length;
  const std::string& where;
  std::uint64_t at = 0;
  std::uint64_t hash = 0xcbf29ce484222325ull;
  unsigned char carry[8] = {};
  std::size_t carried = 0;
  std::vector<char> buffer;

  void take(char* destination, std::size_t n) {
    require(n <= length - at, where + ": image body is truncated");
    stream.read(destination, static_cast<std::streamsize>(n));
    const auto got = static_cast<std::size_t>(stream.gcount());
    require(got == n, where + ": image is truncated (the header says " + std::to_string(length) +
                          " bytes, the stream ends after " + std::to_string(at + got) + ")");
    at += n;
    // checksum() over the body, one piece at a time: whole 8-byte words through mix64, the tail bytewise.
    const auto* p = reinterpret_cast<const unsigned char*>(destination);
    while (n > 0) {
      if (carried == 0 && n >= 8) {
        std::uint64_t word;
        std::memcpy(&word, p, 8);
        hash = memkit::detail::mix64(hash ^ word);
        p += 8;
        n -= 8;
        continue;
      }
      carry[carried++] = *p++;
      --n;
      if (carried == 8) {
        std::uint64_t word;
        std::memcpy(&word, carry, 8);
        hash = memkit::detail::mix64(hash ^ word);
        carried = 0;
      }
    }
  }
  // `n` bytes through the buffer: see(offset in these n, data, count) for each piece.
  template <class See>
  void stream_through(std::uint64_t n, See see) {
    require(n <= length - at, where + ": image body is truncated");
    constexpr std::uint64_t piece = std::uint64_t{1} << 20;
    if (n > 0 && buffer.empty()) buffer.resize(static_cast<std::size_t>(std::min(piece, length)));
    for (std::uint64_t done = 0; done < n;) {
      const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(buffer.size(), n - done));
      take(buffer.data(), want);
      see(static_cast<std::size_t>(done), buffer.data(), want);
      done += want;
    }
  }
  template <class T>
  T pod() {
    T value{};
    take(reinterpret_cast<char*>(&value), sizeof value);
    return value;
  }
  std::string string() {
    const auto n = pod<std::uint32_t>();
    require(n < 4096, where + ": image header is corrupt");
    std::string text(n, '\0');
    take(text.data(), n);
    return text;
  }
  // After the body: the checksum must match.
  void verify() {
    std::uint64_t sum = hash;
    for (std::size_t i = 0; i < carried; ++i) sum = (sum ^ carry[i]) * 0x100000001b3ull;
    require(optim::detail::read_pod<std::uint64_t>(stream, where) == sum, where + ": image checksum does not match (corrupt)");
  }
  // After a field was refused: the rest of the body and the checksum, so a damaged image says so.
  void drain_and_verify() {
    stream_through(length - at, [](std::size_t, const char*, std::size_t) {});
    verify();
  }
};

}  // namespace detail
}  // namespace distributed
MEMKIT_NAMESPACE_END
