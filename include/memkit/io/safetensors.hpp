// memkit/io/safetensors.hpp — a strict, header-only safetensors reader and writer.
//
// Format: an 8-byte little-endian header size N, N bytes of UTF-8 JSON
//   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ..., "__metadata__": {"k": "v"}}
// then the raw little-endian tensor bytes; offsets are relative to the end of the header.
//
// The reader validates everything before handing out a byte: the header size against the file, the JSON,
// each dtype, shape and offset pair (end - begin must be the shape's byte size), and that the tensors tile
// the data section exactly, without gaps or overlaps (as the safetensors library requires). Element counts
// and byte sizes are computed with checked arithmetic, so a shape whose size wraps around 64 bits is
// refused rather than taken for a small tensor. A corrupt or
// truncated file gives a memkit::error naming the file and the problem. Opening reads only the header;
// read() fetches just the requested tensor's bytes with pread, so one tensor of a large file costs its size.
// writer collects tensors in memory; stream_writer writes the same bytes for a file larger than memory
// (tensors declared first, then their data a piece at a time).
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <string>
#include <string_view>
#include <sys/stat.h>
#include <type_traits>
#include <unistd.h>
#include <utility>
#include <unordered_set>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/checked_math.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/tensor_view.hpp"
#include "memkit/io/files.hpp"
#include "memkit/io/json.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace safetensors {

// Bytes per element of a safetensors dtype name, or 0 when the name is unknown.
inline std::size_t dtype_size(std::string_view dtype) noexcept {
  struct entry {
    const char* name;
    std::size_t size;
  };
  static constexpr entry table[] = {{"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1},
                                    {"U16", 2},  {"I16", 2}, {"F16", 2}, {"BF16", 2},    {"U32", 4},
                                    {"I32", 4},  {"F32", 4}, {"U64", 8}, {"I64", 8},     {"F64", 8}};
  for (const entry& e : table)
    if (dtype == e.name) return e.size;
  return 0;
}

// The safetensors dtype of a C++ element type.
template <class T>
constexpr const char* dtype_of() noexcept {
  using U = std::remove_const_t<T>;
  if constexpr (std::is_same_v<U, float>) return "F32";
  else if constexpr (std::is_same_v<U, bf16>) return "BF16";
  else if constexpr (std::is_same_v<U, fp16>) return "F16";
  else if constexpr (std::is_same_v<U, double>) return "F64";
  else if constexpr (std::is_same_v<U, std::uint8_t>) return "U8";
  else if constexpr (std::is_same_v<U, std::int8_t>) return "I8";
  else if constexpr (std::is_same_v<U, std::int32_t>) return "I32";
  else if constexpr (std::is_same_v<U, std::int64_t>) return "I64";
  else static_assert(sizeof(U) == 0, "no safetensors dtype for this element type");
}

struct tensor_info {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  // offsets into the data section
  std::uint64_t end = 0;

  std::int64_t numel() const noexcept {
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    return n;
  }
  std::uint64_t bytes() const noexcept { return end - begin; }
};

// The safetensors library refuses headers above 100 MB; so does memkit (a corrupt size would otherwise
// make us allocate whatever the file claims).
inline constexpr std::uint64_t max_header_bytes = 100'000'000;

class reader {
 public:
  // Opens `path` and reads and validates its header (only the header).
  explicit reader(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    require(fd_ >= 0, "safetensors: cannot open '" + path_ + "': " + std::strerror(errno));
    try {
      load_header();
    } catch (...) {
      ::close(fd_);
      throw;
    }
  }
  reader(const reader&) = delete;
  reader& operator=(const reader&) = delete;
  reader(reader&& other) noexcept
      : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)), file_size_(other.file_size_),
        data_start_(other.data_start_), tensors_(std::move(other.tensors_)), by_name_(std::move(other.by_name_)),
        metadata_(std::move(other.metadata_)), metadata_by_key_(std::move(other.metadata_by_key_)) {}
  ~reader() {
    if (fd_ >= 0) ::close(fd_);
  }

  const std::string& path() const noexcept { return path_; }
  // Tensors in file order (sorted by offset).
  const std::vector<tensor_info>& tensors() const noexcept { return tensors_; }
  const std::vector<std::pair<std::string, std::string>>& metadata() const noexcept { return metadata_; }
  // The metadata value under `key`, or null (a binary search: sharded checkpoints keep one entry per tensor).
  const std::string* find_metadata(std::string_view key) const noexcept {
    const std::pair<std::string, std::string>* entry = metadata_by_key_.find(metadata_, key);
    return entry != nullptr ? &entry->second : nullptr;
  }

  const tensor_info* find(std::string_view name) const noexcept {
    // A binary search (#35: 10K modules took 21 s to open with a linear one).
    return by_name_.find(tensors_, name);
  }
  const tensor_info& info(std::string_view name) const {
    const tensor_info* t = find(name);
    require(t != nullptr, "safetensors: '" + path_ + "' has no tensor named '" + std::string(name) + "'");
    return *t;
  }

  // Reads the raw bytes of tensor `name` into host memory `destination` of exactly its size.
  void read_bytes(std::string_view name, void* destination, std::uint64_t bytes) const {
    read_entry_bytes(info(name), destination, bytes);
  }

  // Reads `bytes` bytes of tensor `t` (an entry of this file) starting `offset` bytes into it, into host
  // memory: what a streaming loader reads a large tensor with, a piece at a time.
  void read_range(const tensor_info& t, std::uint64_t offset, void* destination, std::uint64_t bytes) const {
    require(offset <= t.bytes() && bytes <= t.bytes() - offset,
            "safetensors: read of bytes " + std::to_string(offset) + ".." + std::to_string(offset + bytes) + " of tensor '" +
                t.name + "' in '" + path_ + "', which has " + std::to_string(t.bytes()));
    read_at(data_start_ + t.begin + offset, destination, bytes, "tensor '" + t.name + "'");
  }

  // Reads tensor `name` into `out` (host memory), checking dtype and element count.
  template <class T>
  void read(std::string_view name, tensor_view<T> out) const {
    read_entry(info(name), out);
  }

  template <class T>
  std::vector<T> read_vector(std::string_view name) const {
    const tensor_info& t = info(name);
    require_dtype<T>(t);  // before allocating: the element count is only bounded for the tensor's own dtype
    std::vector<T> out(static_cast<std::size_t>(t.numel()));
    read_entry(t, tensor_view<T>(out.data(), shape{static_cast<std::int64_t>(out.size())}, memory_kind::host));
    return out;
  }

 private:
  [[noreturn]] void corrupt(const std::string& problem) const {
    throw error("safetensors: '" + path_ + "' is not a valid safetensors file: " + problem);
  }

  // The reads above, given the tensor's entry (looked up once).
  void read_entry_bytes(const tensor_info& t, void* destination, std::uint64_t bytes) const {
    require(bytes == t.bytes(), "safetensors: tensor '" + t.name + "' in '" + path_ + "' has " +
                                    std::to_string(t.bytes()) + " bytes, the destination " + std::to_string(bytes));
    read_at(data_start_ + t.begin, destination, bytes, "tensor '" + t.name + "'");
  }
  template <class T>
  void require_dtype(const tensor_info& t) const {
    require(t.dtype == dtype_of<T>(), "safetensors: tensor '" + t.name + "' in '" + path_ + "' is " + t.dtype +
                                          ", not " + dtype_of<T>());
  }
  template <class T>
  void read_entry(const tensor_info& t, tensor_view<T> out) const {
    require_dtype<T>(t);
    require(t.numel() == out.size(), "safetensors: tensor '" + t.name + "' in '" + path_ + "' has " +
                                         std::to_string(t.numel()) + " elements, the destination " +
                                         std::to_string(out.size()));
    require(out.where() != memory_kind::device,
            "safetensors: read: destination of '" + t.name + "' is device memory; read into host memory");
    read_entry_bytes(t, out.data(), out.bytes());
  }

  void read_at(std::uint64_t offset, void* destination, std::uint64_t bytes, const std::string& what) const {
    auto* out = static_cast<unsigned char*>(destination);
    std::uint64_t done = 0;
    while (done < bytes) {
      const ssize_t got = ::pread(fd_, out + done, static_cast<std::size_t>(bytes - done),
                                  static_cast<off_t>(offset + done));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) throw error("safetensors: reading " + what + " of '" + path_ + "' failed: " + std::strerror(errno));
      if (got == 0) corrupt("file ends while reading " + what + " (truncated)");
      done += static_cast<std::uint64_t>(got);
    }
  }

  void load_header() {
    struct stat status {};
    require(::fstat(fd_, &status) == 0, "safetensors: cannot stat '" + path_ + "': " + std::strerror(errno));
    file_size_ = static_cast<std::uint64_t>(status.st_size);
    if (file_size_ < 8) corrupt("file is " + std::to_string(file_size_) + " bytes, shorter than the 8-byte header size");
    unsigned char size_bytes[8];
    read_at(0, size_bytes, 8, "the header size");
    std::uint64_t header_size = 0;
    for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | size_bytes[i];
    if (header_size > max_header_bytes)
      corrupt("header size " + std::to_string(header_size) + " exceeds the 100 MB limit");
    if (header_size > file_size_ - 8)
      corrupt("header size " + std::to_string(header_size) + " runs past the end of the " +
              std::to_string(file_size_) + "-byte file (truncated?)");
    std::string header(static_cast<std::size_t>(header_size), '\0');
    read_at(8, header.data(), header_size, "the header");
    if (header.empty() || header[0] != '{') corrupt("header does not start with '{'");
    data_start_ = 8 + header_size;
    const std::uint64_t data_size = file_size_ - data_start_;

    json::value root;
    try {
      root = json::parse(header, "safetensors header");
    } catch (const error& e) {
      corrupt(e.what());
    }
    for (const auto& [name, entry] : root.as_object()) {
      if (name == "__metadata__") {
        if (!entry.is_object()) corrupt("__metadata__ is not an object");
        for (const auto& [key, value] : entry.as_object()) {
          if (!value.is_string()) corrupt("__metadata__ value of '" + key + "' is not a string");
          metadata_.emplace_back(key, value.as_string());
        }
        continue;
      }
      tensors_.push_back(parse_entry(name, entry, data_size));
    }
    std::sort(tensors_.begin(), tensors_.end(),
              [](const tensor_info& a, const tensor_info& b) { return a.begin < b.begin || (a.begin == b.begin && a.end < b.end); });
    std::uint64_t expected = 0;
    for (const tensor_info& t : tensors_) {
      if (t.begin != expected)
        corrupt("tensor '" + t.name + "' starts at data offset " + std::to_string(t.begin) + " but the previous one ends at " +
                std::to_string(expected) + (t.begin < expected ? " (overlap)" : " (gap)"));
      expected = t.end;
    }
    if (expected != data_size)
      corrupt("tensors cover " + std::to_string(expected) + " data bytes but the file holds " +
              std::to_string(data_size) + (expected > data_size ? " (truncated)" : " (trailing bytes)"));
    by_name_.build(tensors_);
    metadata_by_key_.build(metadata_);
  }

  tensor_info parse_entry(const std::string& name, const json::value& entry, std::uint64_t data_size) const {
    if (!entry.is_object()) corrupt("entry '" + name + "' is not an object");
    tensor_info t;
    t.name = name;
    for (const auto& [key, value] : entry.as_object())
      if (key != "dtype" && key != "shape" && key != "data_offsets") corrupt("entry '" + name + "' has unknown field '" + key + "'");
    const json::value* dtype = entry.find("dtype");
    const json::value* dims = entry.find("shape");
    const json::value* offsets = entry.find("data_offsets");
    if (!dtype || !dtype->is_string()) corrupt("entry '" + name + "' lacks a string dtype");
    if (!dims || !dims->is_array()) corrupt("entry '" + name + "' lacks a shape array");
    if (!offsets || !offsets->is_array() || offsets->as_array().size() != 2)
      corrupt("entry '" + name + "' lacks data_offsets [begin, end]");
    t.dtype = dtype->as_string();
    const std::size_t element_size = dtype_size(t.dtype);
    if (element_size == 0) corrupt("entry '" + name + "' has unknown dtype '" + t.dtype + "'");
    // Every partial product must fit int64 (tensor_info::numel and tensor_view count in int64), and the
    // byte size in uint64: 2^61 F64 elements would otherwise be 0 bytes and match an empty range.
    std::int64_t numel = 1;
    for (const json::value& d : dims->as_array()) {
      std::int64_t extent = -1;
      try {
        extent = d.as_int();
      } catch (const error&) {
        corrupt("entry '" + name + "' has a shape extent that is not an integer");
      }
      if (extent < 0) corrupt("entry '" + name + "' has negative extent " + std::to_string(extent));
      const checked<std::int64_t> product = try_mul(numel, extent);
      if (!product) corrupt("entry '" + name + "' has a shape whose element count overflows 64 bits");
      numel = product.value;
      t.shape.push_back(extent);
    }
    const checked<std::uint64_t> byte_size = try_mul(static_cast<std::uint64_t>(numel), std::uint64_t{element_size});
    if (!byte_size) corrupt("entry '" + name + "' has a shape whose byte size overflows 64 bits");
    std::int64_t bounds[2] = {0, 0};
    for (int i = 0; i < 2; ++i) {
      try {
        bounds[i] = offsets->as_array()[static_cast<std::size_t>(i)].as_int();
      } catch (const error&) {
        corrupt("entry '" + name + "' has a data offset that is not an integer");
      }
      if (bounds[i] < 0) corrupt("entry '" + name + "' has a negative data offset");
    }
    t.begin = static_cast<std::uint64_t>(bounds[0]);
    t.end = static_cast<std::uint64_t>(bounds[1]);
    if (t.end < t.begin) corrupt("entry '" + name + "' has data_offsets end before begin");
    if (t.end > data_size)
      corrupt("entry '" + name + "' ends at data offset " + std::to_string(t.end) + " past the " +
              std::to_string(data_size) + " data bytes in the file (truncated?)");
    if (t.end - t.begin != byte_size.value)
      corrupt("entry '" + name + "' spans " + std::to_string(t.end - t.begin) + " bytes but " + t.dtype + " " +
              "of its shape needs " + std::to_string(byte_size.value));
    return t;
  }

  std::string path_;
  int fd_ = -1;
  std::uint64_t file_size_ = 0;
  std::uint64_t data_start_ = 0;
  std::vector<tensor_info> tensors_;
  io::name_index<tensor_info, &tensor_info::name> by_name_;  // for find()
  std::vector<std::pair<std::string, std::string>> metadata_;
  io::name_index<std::pair<std::string, std::string>, &std::pair<std::string, std::string>::first> metadata_by_key_;
};

namespace detail {
// The bytes of a tensor about to be written, after the checks every writer applies (name, dtype, extents,
// and a size that fits 64 bits).
inline std::uint64_t checked_entry_bytes(const std::string& name, const std::string& dtype,
                                         const std::vector<std::int64_t>& dims) {
  require(name != "__metadata__", "safetensors: '__metadata__' is reserved");
  const std::size_t element_size = dtype_size(dtype);
  require(element_size != 0, "safetensors: unknown dtype '" + dtype + "'");
  std::int64_t numel = 1;
  for (std::int64_t d : dims) {
    require(d >= 0, "safetensors: tensor '" + name + "' has negative extent");
    numel = checked_mul(numel, d, "safetensors: element count of the tensor being added");
  }
  return checked_mul(static_cast<std::uint64_t>(numel), std::uint64_t{element_size},
                     "safetensors: byte size of the tensor being added");
}

// The header JSON of `count` tensors in file order (entry(i) gives the i-th's tensor_info and byte size) and
// the metadata, padded with spaces so the data section starts 8-byte aligned.
template <class Entry>
std::string header_json(const std::vector<std::pair<std::string, std::string>>& metadata, std::size_t count,
                        Entry entry) {
  std::string text = "{";
  bool first = true;
  if (!metadata.empty()) {
    text += "\"__metadata__\":{";
    for (std::size_t i = 0; i < metadata.size(); ++i) {
      if (i) text += ',';
      text += json::quote(metadata[i].first);
      text += ':';
      text += json::quote(metadata[i].second);
    }
    text += "}";
    first = false;
  }
  std::uint64_t offset = 0;
  for (std::size_t k = 0; k < count; ++k) {
    const std::pair<const tensor_info&, std::uint64_t> e = entry(k);
    text += first ? "" : ",";
    first = false;
    text += json::quote(e.first.name) + ":{\"dtype\":" + json::quote(e.first.dtype) + ",\"shape\":[";
    for (std::size_t i = 0; i < e.first.shape.size(); ++i) {
      if (i) text += ',';
      text += std::to_string(e.first.shape[i]);
    }
    text += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + e.second) + "]}";
    offset += e.second;
  }
  text += "}";
  while ((8 + text.size()) % 8 != 0) text += ' ';
  return text;
}

// Writes the 8-byte little-endian header size and the header.
inline bool write_header(std::FILE* file, const std::string& head) {
  unsigned char size_bytes[8];
  const std::uint64_t size = head.size();
  for (int i = 0; i < 8; ++i) size_bytes[i] = static_cast<unsigned char>(size >> (8 * i));
  return std::fwrite(size_bytes, 1, 8, file) == 8 && std::fwrite(head.data(), 1, head.size(), file) == head.size();
}
}  // namespace detail

// Collects tensors (host memory, copied on add) and writes one safetensors file.
class writer {
 public:
  void add_bytes(std::string name, std::string dtype, std::vector<std::int64_t> dims, const void* data,
                 std::uint64_t bytes) {
    require(names_.count(name) == 0, "safetensors: tensor '" + name + "' added twice");
    const std::uint64_t needed = detail::checked_entry_bytes(name, dtype, dims);
    require(needed == bytes, "safetensors: tensor '" + name + "' of " + dtype + " needs " + std::to_string(needed) +
                                 " bytes, got " + std::to_string(bytes));
    entry e;
    e.info.name = std::move(name);
    e.info.dtype = std::move(dtype);
    e.info.shape = std::move(dims);
    e.bytes.assign(static_cast<const unsigned char*>(data), static_cast<const unsigned char*>(data) + bytes);
    names_.insert(e.info.name);
    entries_.push_back(std::move(e));
  }

  // Adds a host tensor; `dims` defaults to the view's shape (give it to store another shape of the same size).
  template <class T>
  void add(std::string name, tensor_view<T> values, std::vector<std::int64_t> dims = {}) {
    require(values.where() != memory_kind::device, "safetensors: add '" + name + "': copy device data to the host first");
    if (dims.empty())
      for (int i = 0; i < values.shape().rank; ++i) dims.push_back(values.shape()[i]);
    add_bytes(std::move(name), dtype_of<T>(), std::move(dims), values.data(), values.bytes());
  }

  void add_metadata(std::string key, std::string value) { metadata_.emplace_back(std::move(key), std::move(value)); }

  // The header JSON, padded with spaces so the data section starts 8-byte aligned.
  std::string header() const {
    return detail::header_json(metadata_, entries_.size(), [&](std::size_t i) {
      return std::pair<const tensor_info&, std::uint64_t>(entries_[i].info, entries_[i].bytes.size());
    });
  }

  void write(const std::string& path) const {
    const std::string head = header();
    std::FILE* file = std::fopen(path.c_str(), "wb");
    require(file != nullptr, "safetensors: cannot create '" + path + "': " + std::strerror(errno));
    bool ok = detail::write_header(file, head);
    for (const entry& e : entries_)
      ok = ok && (e.bytes.empty() || std::fwrite(e.bytes.data(), 1, e.bytes.size(), file) == e.bytes.size());
    ok = (std::fclose(file) == 0) && ok;
    require(ok, "safetensors: writing '" + path + "' failed");
  }

 private:
  struct entry {
    tensor_info info;
    std::vector<unsigned char> bytes;
  };
  std::vector<entry> entries_;
  std::unordered_set<std::string> names_;  // of entries_ (a linear duplicate check per add was quadratic)
  std::vector<std::pair<std::string, std::string>> metadata_;
};

// Writes one safetensors file larger than memory: the tensors are declared first (name, dtype, shape), the
// header written by open(), then the data section in declaration order, a piece at a time. The file is
// byte for byte what `writer` writes for the same tensors and metadata added in the same order.
class stream_writer {
 public:
  stream_writer() = default;
  stream_writer(const stream_writer&) = delete;
  stream_writer& operator=(const stream_writer&) = delete;
  ~stream_writer() {
    if (file_ != nullptr) std::fclose(file_);
  }

  void declare(std::string name, std::string dtype, std::vector<std::int64_t> dims) {
    require(file_ == nullptr, "safetensors: declare '" + name + "' after the header was written");
    require(names_.count(name) == 0, "safetensors: tensor '" + name + "' added twice");
    const std::uint64_t bytes = detail::checked_entry_bytes(name, dtype, dims);
    tensor_info info;
    info.name = std::move(name);
    info.dtype = std::move(dtype);
    info.shape = std::move(dims);
    total_ = checked_add(total_, bytes, "safetensors: size of the data section");
    names_.insert(info.name);
    entries_.emplace_back(std::move(info), bytes);
  }
  void add_metadata(std::string key, std::string value) { metadata_.emplace_back(std::move(key), std::move(value)); }
  std::uint64_t data_bytes() const noexcept { return total_; }

  // Creates `path` and writes the header.
  void open(const std::string& path) {
    require(file_ == nullptr, "safetensors: stream_writer opened twice");
    const std::string head = detail::header_json(metadata_, entries_.size(), [&](std::size_t i) {
      return std::pair<const tensor_info&, std::uint64_t>(entries_[i].first, entries_[i].second);
    });
    file_ = std::fopen(path.c_str(), "wb");
    require(file_ != nullptr, "safetensors: cannot create '" + path + "': " + std::strerror(errno));
    path_ = path;
    require(detail::write_header(file_, head), "safetensors: writing '" + path_ + "' failed");
  }
  // The next `bytes` bytes of the data section.
  void write(const void* data, std::uint64_t bytes) {
    require(file_ != nullptr, "safetensors: stream_writer::write before open");
    require(bytes <= total_ - written_, "safetensors: '" + path_ + "': more data than the declared tensors hold");
    require(bytes == 0 || std::fwrite(data, 1, bytes, file_) == bytes, "safetensors: writing '" + path_ + "' failed");
    written_ += bytes;
  }
  // Checks that every declared byte was written and closes the file.
  void close() {
    require(file_ != nullptr, "safetensors: stream_writer::close before open");
    std::FILE* file = std::exchange(file_, nullptr);
    const bool closed = std::fclose(file) == 0;
    require(written_ == total_, "safetensors: '" + path_ + "': " + std::to_string(written_) + " of " +
                                    std::to_string(total_) + " data bytes written");
    require(closed, "safetensors: writing '" + path_ + "' failed");
  }

 private:
  std::vector<std::pair<tensor_info, std::uint64_t>> entries_;
  std::unordered_set<std::string> names_;
  std::vector<std::pair<std::string, std::string>> metadata_;
  std::uint64_t total_ = 0, written_ = 0;
  std::FILE* file_ = nullptr;
  std::string path_;
};

}  // namespace safetensors

MEMKIT_NAMESPACE_END
