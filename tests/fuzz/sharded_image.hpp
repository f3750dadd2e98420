// sharded_adam_state rank images for the fuzz harness and its seeds: the framing (magic, version, body
// length, body, checksum), the checksum recomputed after an edit (a forger can do the same, which is why
// sharded_adam_state::load validates the values and not only the checksum), and a communicator that only
// says "rank r of n", to make the states of a save on several ranks in one process (no collective runs).
#pragma once

#include <memkit/distributed/sharded_adam_state.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace memkit_test {

// Rank `rank` of `ranks`, for construction with a given run id, save and load only: every collective throws.
struct rank_of_communicator {
  int r = 0, n = 1;
  int rank() const noexcept { return r; }
  int size() const noexcept { return n; }
  template <class E, class T>
  void all_reduce(const E&, const T*, T*, std::int64_t) const { refuse(); }
  template <class E, class T>
  void reduce_scatter(const E&, const T*, T*, std::int64_t) const { refuse(); }
  template <class E, class T>
  void all_gather(const E&, const T*, T*, std::int64_t) const { refuse(); }
  template <class E, class T>
  void broadcast(const E&, T*, std::int64_t, int) const { refuse(); }

 private:
  [[noreturn]] static void refuse() { throw memkit::error("rank_of_communicator: no collectives"); }
};

// Where the image starting at `at` in `bytes` ends (header + body + checksum), or 0 when its header or
// claimed body does not fit; when `fix` is set, its checksum is rewritten to match its body.
template <class S>
std::size_t sharded_image_end(std::string& bytes, std::size_t at, bool fix) {
  if (at + 4 > bytes.size()) return 0;
  std::uint32_t magic_length = 0;
  std::memcpy(&magic_length, bytes.data() + at, 4);
  if (magic_length > 64) return 0;
  const std::size_t body = at + 4 + magic_length + 4 + 8;
  if (body > bytes.size()) return 0;
  std::uint64_t length = 0;
  std::memcpy(&length, bytes.data() + body - 8, 8);
  if (length > bytes.size() - body || bytes.size() - body - length < 8) return 0;
  const std::size_t end = body + static_cast<std::size_t>(length) + 8;
  if (fix) {
    const std::uint64_t sum = S::image_checksum(bytes.data() + body, static_cast<std::size_t>(length));
    std::memcpy(bytes.data() + end - 8, &sum, 8);
  }
  return end;
}

}  // namespace memkit_test
