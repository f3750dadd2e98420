// memkit/models/tokens.hpp: token files round-trip at both widths, every malformed file is refused with a
// message naming the problem (sizes are checked against the file before anything of their size is
// allocated), and the fixture written by tools/tokenize.py reads back with the ids Python wrote.
#include <memkit/models/tokens.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include <unistd.h>

namespace models = memkit::models;
namespace fs = std::filesystem;

namespace {

// A path unique to this process and call, removed when the object goes.
struct temp_file {
  std::string path;
  temp_file() {
    static std::atomic<int> counter{0};
    path = (fs::temp_directory_path() /
            ("memkit_tokens_" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + ".tokens"))
               .string();
  }
  temp_file(const temp_file&) = delete;
  temp_file& operator=(const temp_file&) = delete;
  ~temp_file() {
    std::error_code ignored;
    fs::remove(path, ignored);
  }
};

void put_le(std::string& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i, v >>= 8) out += static_cast<char>(v & 0xff);
}

struct header_fields {
  std::string magic = "MKTOKENS";
  std::uint32_t version = 1, width = 2, vocab = 100, reserved = 0;
  std::uint64_t count = 3;
};

std::string header_bytes(const header_fields& h) {
  std::string out = h.magic;
  put_le(out, h.version, 4);
  put_le(out, h.width, 4);
  put_le(out, h.vocab, 4);
  put_le(out, h.reserved, 4);
  put_le(out, h.count, 8);
  return out;
}

// A file of `h`'s header followed by `ids` at `h.width` bytes each.
std::string file_bytes(const header_fields& h, const std::vector<std::uint32_t>& ids) {
  std::string out = header_bytes(h);
  for (std::uint32_t id : ids) put_le(out, id, static_cast<int>(h.width));
  return out;
}

void write_raw(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

// The reader's message for a file of `bytes`.
std::string refusal(const std::string& bytes, std::uint64_t max_tokens = 1ull << 32) {
  temp_file f;
  write_raw(f.path, bytes);
  try {
    models::read_token_file(f.path, max_tokens);
  } catch (const memkit::error& e) {
    const std::string message = e.what();
    CHECK(message.find(f.path) != std::string::npos);  // every message names the file
    return message;
  }
  FAIL("the file was accepted");
  return {};
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("token file round trip, 2-byte ids") {
  temp_file f;
  const std::vector<std::int32_t> ids = {0, 1, 255, 256, 40000, 65535, 7};
  models::write_token_file(f.path, 65536, ids);  // the largest vocabulary 2-byte ids hold
  CHECK(fs::file_size(f.path) == 32 + ids.size() * 2);
  const models::token_file back = models::read_token_file(f.path);
  CHECK(back.vocab_size == 65536);
  CHECK(back.ids == ids);
}

TEST_CASE("token file round trip, 4-byte ids") {
  temp_file f;
  // More ids than one 64 KB chunk holds, so the chunked read and write cross chunk boundaries.
  std::vector<std::int32_t> ids(40'000);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>((i * 2654435761u) % 200'000);
  ids[5] = 199'999;
  ids[6] = 65536;
  models::write_token_file(f.path, 200'000, ids);
  CHECK(fs::file_size(f.path) == 32 + ids.size() * 4);
  const models::token_file back = models::read_token_file(f.path);
  CHECK(back.vocab_size == 200'000);
  CHECK(back.ids == ids);

  // The largest vocabulary and id memkit takes: ids are int32.
  models::write_token_file(f.path, 0x7fffffffu, {0x7ffffffe, 0});
  CHECK(models::read_token_file(f.path).ids == std::vector<std::int32_t>{0x7ffffffe, 0});
}

TEST_CASE("malformed token files are refused with a message naming the problem") {
  const header_fields good;
  const std::vector<std::uint32_t> ids = {1, 2, 3};
  {  // the unmodified file is accepted, so each refusal below is the one change's doing
    temp_file f;
    write_raw(f.path, file_bytes(good, ids));
    CHECK(models::read_token_file(f.path).ids == std::vector<std::int32_t>{1, 2, 3});
  }

  SUBCASE("missing file") {
    CHECK_THROWS_WITH_AS(models::read_token_file((fs::temp_directory_path() / "memkit_tokens_no_such_file").string()),
                         doctest::Contains("cannot open"), memkit::error);
  }
  SUBCASE("truncated header") {
    CHECK(contains(refusal(header_bytes(good).substr(0, 20)), "shorter than the 32-byte header"));
    CHECK(contains(refusal(""), "file is 0 bytes"));
  }
  SUBCASE("bad magic") {
    header_fields h = good;
    h.magic = "MKTOKENZ";
    CHECK(contains(refusal(file_bytes(h, ids)), "bad magic"));
  }
  SUBCASE("bad version") {
    header_fields h = good;
    h.version = 2;
    CHECK(contains(refusal(file_bytes(h, ids)), "version 2 is not supported"));
  }
  SUBCASE("bad width") {
    header_fields h = good;
    h.width = 3;
    CHECK(contains(refusal(file_bytes(h, ids)), "token width 3 is not 2 or 4"));
  }
  SUBCASE("reserved nonzero") {
    header_fields h = good;
    h.reserved = 1;
    CHECK(contains(refusal(file_bytes(h, ids)), "reserved field is 1, not 0"));
  }
  SUBCASE("vocab out of range") {
    header_fields h = good;
    h.vocab = 0;
    CHECK(contains(refusal(file_bytes(h, ids)), "vocab_size 0 is outside 1..2147483647"));
    h.width = 4;
    h.vocab = 0x80000000u;  // ids would not fit int32
    CHECK(contains(refusal(file_bytes(h, ids)), "vocab_size 2147483648 is outside"));
  }
  SUBCASE("width 2 with a vocabulary above 65536") {
    header_fields h = good;
    h.vocab = 70000;
    CHECK(contains(refusal(file_bytes(h, ids)), "vocab_size 70000 does not fit 2-byte ids"));
  }
  SUBCASE("count 0") {
    header_fields h = good;
    h.count = 0;
    CHECK(contains(refusal(file_bytes(h, {})), "token count is 0"));
  }
  SUBCASE("count beyond the limit") {
    header_fields h = good;
    h.count = 1ull << 61;
    CHECK(contains(refusal(file_bytes(h, ids)), "token count 2305843009213693952 exceeds the limit of 4294967296"));
    h.count = 3;
    CHECK(contains(refusal(file_bytes(h, ids), 2), "token count 3 exceeds the limit of 2"));
  }
  SUBCASE("count larger than the file holds: refused from the file's size, nothing allocated") {
    // With no limit, 2^61 ids would be 2^62 bytes (a bad_alloc, not a memkit::error, if it were allocated).
    const std::uint64_t no_limit = std::numeric_limits<std::uint64_t>::max();
    header_fields h = good;
    h.count = 1ull << 61;
    CHECK(contains(refusal(file_bytes(h, ids), no_limit), "too short for 2305843009213693952 tokens of 2 bytes (truncated)"));
    // count * width wraps 64 bits (2^62 * 4 = 2^64 = 0): must not pass as an empty payload.
    h.width = 4;
    h.count = 1ull << 62;
    CHECK(contains(refusal(header_bytes(h), no_limit), "too short for 4611686018427387904 tokens of 4 bytes"));
    // Wraps to exactly the file's 3 ids: 2^62 + 3 tokens of 4 bytes is 12 bytes modulo 2^64.
    h.count = (1ull << 62) + 3;
    CHECK(contains(refusal(file_bytes(h, ids), no_limit), "(truncated)"));
    // One id short.
    h = good;
    CHECK(contains(refusal(file_bytes(h, {1, 2})), "file is 36 bytes, too short for 3 tokens of 2 bytes (truncated)"));
  }
  SUBCASE("trailing bytes") {
    CHECK(contains(refusal(file_bytes(good, ids) + "x"), "1 trailing bytes after 3 tokens of 2 bytes"));
    CHECK(contains(refusal(file_bytes(good, {1, 2, 3, 4})), "2 trailing bytes after 3 tokens"));
  }
  SUBCASE("an id at or above vocab_size names its index and id") {
    CHECK(contains(refusal(file_bytes(good, {1, 100, 3})), "token 1 is id 100, not below vocab_size 100"));
    header_fields h = good;
    h.width = 4;
    h.vocab = 100000;
    CHECK(contains(refusal(file_bytes(h, {1, 2, 0xffffffffu})), "token 2 is id 4294967295, not below vocab_size 100000"));
  }
}

TEST_CASE("write_token_file refuses what the reader would, before creating the file") {
  temp_file f;
  CHECK_THROWS_WITH_AS(models::write_token_file(f.path, 100, {1, 100, 3}),
                       doctest::Contains("token 1 is id 100, outside [0, 100)"), memkit::error);
  CHECK_THROWS_WITH_AS(models::write_token_file(f.path, 100, {1, -1}), doctest::Contains("token 1 is id -1"),
                       memkit::error);
  CHECK_THROWS_WITH_AS(models::write_token_file(f.path, 0, {0}), doctest::Contains("vocab_size 0 is outside"),
                       memkit::error);
  CHECK_THROWS_WITH_AS(models::write_token_file(f.path, 0x80000000u, {0}), doctest::Contains("is outside 1..2147483647"),
                       memkit::error);
  CHECK_THROWS_WITH_AS(models::write_token_file(f.path, 100, {}), doctest::Contains("no ids"), memkit::error);
  CHECK_FALSE(fs::exists(f.path));
  CHECK_THROWS_WITH_AS(models::write_token_file("/nonexistent_dir_memkit/x.tokens", 100, {1}),
                       doctest::Contains("cannot write '/nonexistent_dir_memkit/x.tokens'"), memkit::error);
}

TEST_CASE("the fixture written by tools/tokenize.py reads back with Python's ids") {
  // tests/data/tokens/sample.tokens: sample.txt encoded with the BPE tokenizer beside it, with --bos --eos
  // (commands in tests/data/tokens/README.md). The values below are what the Python run printed.
  const std::string path = std::string(MEMKIT_TEST_SOURCE_DIR) + "/tests/data/tokens/sample.tokens";
  const models::token_file sample = models::read_token_file(path);
  CHECK(sample.vocab_size == 300);
  REQUIRE(sample.ids.size() == 84);
  CHECK(fs::file_size(path) == 32 + 84 * 2);  // 2-byte ids: vocab 300 <= 65536
  const std::vector<std::int32_t> first(sample.ids.begin(), sample.ids.begin() + 8);
  CHECK(first == std::vector<std::int32_t>{0, 296, 290, 267, 83, 276, 84, 222});  // <s> (bos id 0), then text
  CHECK(sample.ids.back() == 1);                                                   // </s> (eos id 1)
  CHECK(std::accumulate(sample.ids.begin(), sample.ids.end(), std::int64_t{0}) == 17058);
}
