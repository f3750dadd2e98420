// The readers under test take a path: fuzz inputs are written to an anonymous in-memory file
// (memfd_create) and opened through /proc/self/fd, so nothing touches the disk.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_target.hpp"

class memory_file {
 public:
  memory_file(const std::uint8_t* data, std::size_t size) {
    fd_ = ::memfd_create("memkit-fuzz", MFD_CLOEXEC);
    MEMKIT_FUZZ_CHECK(fd_ >= 0);
    std::size_t done = 0;
    while (done < size) {
      const ssize_t wrote = ::write(fd_, data + done, size - done);
      MEMKIT_FUZZ_CHECK(wrote > 0);
      done += static_cast<std::size_t>(wrote);
    }
  }
  memory_file(const memory_file&) = delete;
  memory_file& operator=(const memory_file&) = delete;
  ~memory_file() { ::close(fd_); }
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_ = -1;
};
