// memkit/io/files.hpp — what memkit's file readers and writers share: a text file read whole, a file written
// through a temporary renamed into place, and the name index of a file's entries.
//
// Used by io/safetensors.hpp (the tensor index), peft/ (adapter_config.json, adapter_model.safetensors, the
// module index) and optim/bnb_adam_state.hpp (bitsandbytes optimizer state files).
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

#include "memkit/config.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace io {

// Whether `path` names an existing file or directory. (POSIX stat, not std::filesystem: <filesystem> alone
// adds ~50 MB and ~0.4 s to every translation unit that includes memkit.hpp.)
inline bool path_exists(const std::string& path) noexcept {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0;
}

// `mkdir -p directory`: creates it and its missing parents. Returns "" on success, else why it failed.
inline std::string create_directories(const std::string& directory) {
  if (directory.empty()) return "empty path";
  for (std::size_t end = directory.find('/', 1);; end = directory.find('/', end + 1)) {
    const std::string prefix = directory.substr(0, end);
    if (::mkdir(prefix.c_str(), 0777) != 0 && errno != EEXIST) return std::strerror(errno);
    if (end == std::string::npos) break;
  }
  struct stat info;
  if (::stat(directory.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) return "exists and is not a directory";
  return {};
}

// The whole of the file at `path` as bytes; `what` names the reader in errors (cannot open, read failed).
inline std::string read_text_file(const std::string& path, std::string_view what) {
  std::ifstream in(path, std::ios::binary);
  require(static_cast<bool>(in), std::string(what) + ": cannot open '" + path + "': " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  require(!in.bad(), std::string(what) + ": reading '" + path + "' failed");
  return text.str();
}

// Writes `path` by calling write_to(temporary) for a temporary file in the same directory, renamed into
// place when complete, so a failed write never leaves a truncated file under the final name (the temporary
// is removed when write_to throws or the rename fails). `what` names the writer in errors.
template <class WriteTo>
void write_via_temporary(const std::string& path, std::string_view what, WriteTo write_to) {
  const std::string temporary = path + ".tmp-" + std::to_string(::getpid());
  try {
    write_to(temporary);
  } catch (...) {
    std::remove(temporary.c_str());
    throw;
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const std::string reason = std::strerror(errno);
    std::remove(temporary.c_str());
    throw error(std::string(what) + ": cannot move '" + temporary + "' to '" + path + "': " + reason);
  }
}

// The positions of a vector of entries sorted by their string member Name, for lookups by binary search: a
// file of tens of thousands of entries looked up once per entry would otherwise be quadratic (#35). Built
// once the entries are final; find() takes the same vector.
template <class Item, std::string Item::*Name>
class name_index {
 public:
  void build(const std::vector<Item>& items) {
    order_.resize(items.size());
    for (std::size_t i = 0; i < order_.size(); ++i) order_[i] = i;
    std::sort(order_.begin(), order_.end(), [&](std::size_t a, std::size_t b) { return items[a].*Name < items[b].*Name; });
  }
  const Item* find(const std::vector<Item>& items, std::string_view name) const noexcept {
    const auto at = std::lower_bound(order_.begin(), order_.end(), name,
                                     [&](std::size_t i, std::string_view n) { return items[i].*Name < n; });
    return at != order_.end() && items[*at].*Name == name ? &items[*at] : nullptr;
  }

 private:
  std::vector<std::size_t> order_;  // indices of the entries in name order
};

}  // namespace io

MEMKIT_NAMESPACE_END
