// memkit/models/tokens.hpp — a versioned binary file of token ids (training data), with a validating reader.
//
// Format, all integers little-endian (tools/tokenize.py writes it from text with a Hugging Face tokenizer):
//
//   offset  size  field
//        0     8  magic "MKTOKENS"
//        8     4  uint32 version = 1
//       12     4  uint32 token_width: bytes per id, 2 (uint16) or 4 (uint32)
//       16     4  uint32 vocab_size: 1..2^31-1, and at most 65536 for width 2; every id is below it
//       20     4  uint32 reserved = 0
//       24     8  uint64 count: number of ids, > 0
//       32     count * token_width bytes of ids
//
// The file is exactly 32 + count * token_width bytes: a shorter one is truncated and a longer one has
// trailing bytes, and both are refused. count comes from the file, so it is bounded (max_tokens) and checked
// against the file's size, without wrapping, before anything of its size is allocated. Every error is a
// memkit::error naming the file and the problem.
#pragma once

#include <memkit/config.hpp>
#include <memkit/attention/bytes.hpp>
#include <memkit/core/checked_math.hpp>
#include <memkit/core/tensor_view.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace memkit::models {

inline constexpr char token_file_magic[8] = {'M', 'K', 'T', 'O', 'K', 'E', 'N', 'S'};
inline constexpr std::uint32_t token_file_version = 1;
inline constexpr std::uint64_t token_file_header_bytes = 32;
// Ids are returned as int32, so every id (below vocab_size) must fit one.
inline constexpr std::uint32_t max_token_vocab = 0x7fffffffu;

struct token_file {
  std::uint32_t vocab_size = 0;
  std::vector<std::int32_t> ids;
};

namespace detail {

inline std::uint64_t load_le(const unsigned char* p, int bytes) noexcept {
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

inline void store_le(unsigned char* p, std::uint64_t v, int bytes) noexcept {
  for (int i = 0; i < bytes; ++i, v >>= 8) p[i] = static_cast<unsigned char>(v & 0xff);
}

// Ids are read and written in chunks of this many bytes, so no second buffer of the file's size is needed.
inline constexpr std::size_t token_chunk_bytes = std::size_t{1} << 16;

class token_reader {
 public:
  explicit token_reader(const std::string& path) : path_(path) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    require(fd_ >= 0, "tokens: cannot open '" + path_ + "': " + std::strerror(errno));
  }
  token_reader(const token_reader&) = delete;
  token_reader& operator=(const token_reader&) = delete;
  ~token_reader() { ::close(fd_); }

  [[noreturn]] void corrupt(const std::string& problem) const {
    throw error("tokens: '" + path_ + "' is not a valid token file: " + problem);
  }

  std::uint64_t size() const {
    struct stat status {};
    require(::fstat(fd_, &status) == 0, "tokens: cannot stat '" + path_ + "': " + std::strerror(errno));
    return static_cast<std::uint64_t>(status.st_size);
  }

  void read_at(std::uint64_t offset, unsigned char* out, std::size_t bytes) const {
    std::size_t done = 0;
    while (done < bytes) {
      const ssize_t got = ::pread(fd_, out + done, bytes - done, static_cast<off_t>(offset + done));
      if (got < 0 && errno == EINTR) continue;
      require(got >= 0, "tokens: reading '" + path_ + "' failed: " + std::strerror(errno));
      // The size was checked first, so this is a file shrinking under us.
      if (got == 0) corrupt("file ends at byte " + std::to_string(offset + done) + " (truncated)");
      done += static_cast<std::size_t>(got);
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace detail

// Reads and validates the token file at `path` (see the format above). `max_tokens` bounds the count a file
// may claim, hence what reading it may allocate (4 bytes a token).
inline token_file read_token_file(const std::string& path, std::uint64_t max_tokens = 1ull << 32) {
  detail::token_reader in(path);
  const std::uint64_t file_size = in.size();
  if (file_size < token_file_header_bytes)
    in.corrupt("file is " + std::to_string(file_size) + " bytes, shorter than the 32-byte header (truncated)");

  unsigned char header[token_file_header_bytes];
  in.read_at(0, header, sizeof header);
  if (std::memcmp(header, token_file_magic, sizeof token_file_magic) != 0)
    in.corrupt("bad magic (expected \"MKTOKENS\")");
  const auto version = static_cast<std::uint32_t>(detail::load_le(header + 8, 4));
  const auto width = static_cast<std::uint32_t>(detail::load_le(header + 12, 4));
  const auto vocab = static_cast<std::uint32_t>(detail::load_le(header + 16, 4));
  const auto reserved = static_cast<std::uint32_t>(detail::load_le(header + 20, 4));
  const std::uint64_t count = detail::load_le(header + 24, 8);

  if (version != token_file_version)
    in.corrupt("version " + std::to_string(version) + " is not supported (only version 1)");
  if (width != 2 && width != 4) in.corrupt("token width " + std::to_string(width) + " is not 2 or 4 bytes");
  if (reserved != 0) in.corrupt("reserved field is " + std::to_string(reserved) + ", not 0");
  if (vocab == 0 || vocab > max_token_vocab)
    in.corrupt("vocab_size " + std::to_string(vocab) + " is outside 1.." + std::to_string(max_token_vocab));
  if (width == 2 && vocab > 65536)
    in.corrupt("vocab_size " + std::to_string(vocab) + " does not fit 2-byte ids (at most 65536)");
  if (count == 0) in.corrupt("token count is 0");
  if (count > max_tokens)
    in.corrupt("token count " + std::to_string(count) + " exceeds the limit of " + std::to_string(max_tokens));

  // An overflowing product is a count no file can hold: report it as truncated, like any other too-large count.
  const checked<std::uint64_t> payload = try_mul(count, std::uint64_t{width});
  const checked<std::uint64_t> expected = payload ? try_add(payload.value, token_file_header_bytes)
                                                  : checked<std::uint64_t>{0, true};
  if (!expected || expected.value > file_size)
    in.corrupt("file is " + std::to_string(file_size) + " bytes, too short for " + std::to_string(count) +
               " tokens of " + std::to_string(width) + " bytes (truncated)");
  if (expected.value < file_size)
    in.corrupt(std::to_string(file_size - expected.value) + " trailing bytes after " + std::to_string(count) +
               " tokens of " + std::to_string(width) + " bytes");

  token_file result;
  result.vocab_size = vocab;
  result.ids.resize(static_cast<std::size_t>(count));
  std::vector<unsigned char> chunk(std::min<std::uint64_t>(payload.value, detail::token_chunk_bytes));
  const std::uint64_t per_chunk = chunk.size() / width;
  for (std::uint64_t first = 0; first < count; first += per_chunk) {
    const std::uint64_t n = std::min(per_chunk, count - first);
    in.read_at(token_file_header_bytes + first * width, chunk.data(), static_cast<std::size_t>(n * width));
    for (std::uint64_t i = 0; i < n; ++i) {
      const std::uint64_t id = detail::load_le(chunk.data() + i * width, static_cast<int>(width));
      if (id >= vocab)
        in.corrupt("token " + std::to_string(first + i) + " is id " + std::to_string(id) + ", not below vocab_size " +
                   std::to_string(vocab));
      result.ids[static_cast<std::size_t>(first + i)] = static_cast<std::int32_t>(id);
    }
  }
  return result;
}

// Writes `ids` as a token file: 2-byte ids when vocab_size <= 65536, else 4-byte. Everything is checked before
// the file is opened, so a refused call leaves no file behind, and what is written reads back.
inline void write_token_file(const std::string& path, std::uint32_t vocab_size, const std::vector<std::int32_t>& ids) {
  const std::string where = "tokens: cannot write '" + path + "': ";
  require(vocab_size >= 1 && vocab_size <= max_token_vocab,
          where + "vocab_size " + std::to_string(vocab_size) + " is outside 1.." + std::to_string(max_token_vocab));
  require(!ids.empty(), where + "no ids (a token file holds at least one)");
  for (std::size_t i = 0; i < ids.size(); ++i)
    require(ids[i] >= 0 && static_cast<std::uint32_t>(ids[i]) < vocab_size,
            where + "token " + std::to_string(i) + " is id " + std::to_string(ids[i]) + ", outside [0, " +
                std::to_string(vocab_size) + ")");
  const std::size_t width = vocab_size <= 65536 ? 2 : 4;

  unsigned char header[token_file_header_bytes];
  std::memcpy(header, token_file_magic, sizeof token_file_magic);
  detail::store_le(header + 8, token_file_version, 4);
  detail::store_le(header + 12, width, 4);
  detail::store_le(header + 16, vocab_size, 4);
  detail::store_le(header + 20, 0, 4);
  detail::store_le(header + 24, ids.size(), 8);

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  require(out.is_open(), where + std::strerror(errno));
  out.write(reinterpret_cast<const char*>(header), sizeof header);
  std::vector<unsigned char> chunk(detail::token_chunk_bytes);
  const std::size_t per_chunk = chunk.size() / width;
  for (std::size_t first = 0; first < ids.size() && out; first += per_chunk) {
    const std::size_t n = std::min(per_chunk, ids.size() - first);
    for (std::size_t i = 0; i < n; ++i)
      detail::store_le(chunk.data() + i * width, static_cast<std::uint64_t>(ids[first + i]), static_cast<int>(width));
    out.write(reinterpret_cast<const char*>(chunk.data()), static_cast<std::streamsize>(n * width));
  }
  out.close();
  require(!out.fail(), "tokens: writing '" + path + "' failed");
}

// ---- Packed documents (padding-free training) ----
//
// Documents of different lengths go into rows of one length one after another, each row with its cumulative
// document offsets int32 [rows, N + 1] (attention/bytes.hpp: 0 = o[0] <= ... <= o[N] = row length; repeated
// offsets pad rows with fewer documents). Attention and the rotary positions then treat each document as a
// sequence of its own (forward_context::document_offsets), and the targets below keep the loss inside it.

// Next-token targets of packed rows ids [batch, seq] with offsets [batch, N + 1]: targets[b, i] = ids[b, i + 1]
// when position i + 1 is in i's document, else ignore_index (a document's last token does not predict the next
// document's first). Throws memkit::error for offsets that do not describe the rows.
inline std::vector<std::int32_t> packed_next_token_targets(const std::vector<std::int32_t>& ids,
                                                            const std::vector<std::int32_t>& offsets, std::int64_t batch,
                                                            std::int64_t seq, std::int32_t ignore_index = -100) {
  require(batch > 0 && seq > 0 && static_cast<std::int64_t>(ids.size()) == batch * seq,
          "packed_next_token_targets: ids must hold batch * seq = " + std::to_string(batch * seq) + " tokens");
  require(!offsets.empty() && static_cast<std::int64_t>(offsets.size()) % batch == 0,
          "packed_next_token_targets: offsets must be [batch, documents + 1]");
  const std::int64_t count = static_cast<std::int64_t>(offsets.size()) / batch;
  attention::detail::check_document_offsets("packed_next_token_targets",
                                            host_view(offsets.data(), shape{batch, count}), batch, seq);
  std::vector<std::int32_t> targets(ids.size(), ignore_index);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t d = 0; d + 1 < count; ++d) {
      const std::int64_t begin = offsets[static_cast<std::size_t>(b * count + d)];
      const std::int64_t end = offsets[static_cast<std::size_t>(b * count + d + 1)];
      for (std::int64_t i = begin; i + 1 < end; ++i)
        targets[static_cast<std::size_t>(b * seq + i)] = ids[static_cast<std::size_t>(b * seq + i + 1)];
    }
  return targets;
}

// Rows of packed documents: ids, offsets and next-token targets.
struct packed_rows {
  std::int64_t rows = 0, row_length = 0, offsets_per_row = 0;  // offsets_per_row = most documents in a row + 1
  std::vector<std::int32_t> ids;      // [rows, row_length]
  std::vector<std::int32_t> offsets;  // [rows, offsets_per_row]
  std::vector<std::int32_t> targets;  // [rows, row_length]
  std::size_t documents = 0;          // how many of the given documents were packed (a prefix of them)
};

// Packs `documents` in order into `rows` rows of `row_length` tokens: a document goes into the current row when it
// fits in what is left of it (and the row has a document slot left), else it starts the next row; one longer than a
// row is cut to row_length tokens. Packing stops at the first document no row left can take. The unused tail of a
// row is one more document of pad_id tokens whose targets are all ignore_index (it attends only to itself and adds
// nothing to the loss). offsets_per_row: a fixed [rows, offsets_per_row] layout (at most offsets_per_row - 1
// documents a row, the padding one included; >= 2), as a buffer allocated once needs; 0: as many as the fullest row.
inline packed_rows pack_documents(const std::vector<std::vector<std::int32_t>>& documents, std::int64_t rows,
                                  std::int64_t row_length, std::int32_t pad_id = 0, std::int32_t ignore_index = -100,
                                  std::int64_t offsets_per_row = 0) {
  require(rows > 0 && row_length > 0 && row_length <= 0x7fffffff,
          "pack_documents: rows and row_length must be positive (row_length below 2^31)");
  require(offsets_per_row == 0 || offsets_per_row >= 2,
          "pack_documents: offsets_per_row must be 0 (as needed) or >= 2 (one document a row), got " +
              std::to_string(offsets_per_row));
  const std::int64_t slots = offsets_per_row > 0 ? offsets_per_row - 1 : std::numeric_limits<std::int64_t>::max();
  packed_rows out;
  out.rows = rows;
  out.row_length = row_length;
  out.ids.assign(static_cast<std::size_t>(rows * row_length), pad_id);
  // Each row's document ends (its offsets after the leading 0).
  std::vector<std::vector<std::int32_t>> ends(static_cast<std::size_t>(rows));
  std::int64_t row = 0, used = 0;
  for (const std::vector<std::int32_t>& doc : documents) {
    const std::int64_t length = std::min<std::int64_t>(static_cast<std::int64_t>(doc.size()), row_length);
    if (length > 0) {
      // The documents this row would then hold, with the padding one its tail would need.
      const auto needed = [&](std::int64_t at) {
        return static_cast<std::int64_t>(ends[static_cast<std::size_t>(row)].size()) + 1 + (at + length < row_length ? 1 : 0);
      };
      if (used + length > row_length || needed(used) > slots) {
        if (row + 1 == rows) break;
        ++row;
        used = 0;
      }
      std::copy(doc.begin(), doc.begin() + length, out.ids.begin() + row * row_length + used);
      used += length;
      ends[static_cast<std::size_t>(row)].push_back(static_cast<std::int32_t>(used));
    }
    ++out.documents;
  }
  std::vector<std::int64_t> padding_from(static_cast<std::size_t>(rows), row_length);
  std::size_t most = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    std::vector<std::int32_t>& e = ends[static_cast<std::size_t>(r)];
    const std::int64_t filled = e.empty() ? 0 : e.back();
    if (filled < row_length) {  // the tail: one padding document
      padding_from[static_cast<std::size_t>(r)] = filled;
      e.push_back(static_cast<std::int32_t>(row_length));
    }
    most = std::max(most, e.size() + 1);
  }
  out.offsets_per_row = offsets_per_row > 0 ? offsets_per_row : static_cast<std::int64_t>(most);
  for (const std::vector<std::int32_t>& e : ends) {
    out.offsets.push_back(0);
    out.offsets.insert(out.offsets.end(), e.begin(), e.end());
    out.offsets.insert(out.offsets.end(), static_cast<std::size_t>(out.offsets_per_row) - e.size() - 1,
                       static_cast<std::int32_t>(row_length));
  }
  out.targets = packed_next_token_targets(out.ids, out.offsets, rows, row_length, ignore_index);
  for (std::int64_t r = 0; r < rows; ++r)  // the padding document predicts nothing
    std::fill(out.targets.begin() + r * row_length + padding_from[static_cast<std::size_t>(r)],
              out.targets.begin() + (r + 1) * row_length, ignore_index);
  return out;
}

}  // namespace memkit::models
