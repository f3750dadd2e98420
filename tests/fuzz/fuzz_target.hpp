// One fuzz target = one function `int memkit_fuzz_<name>(const std::uint8_t* data, std::size_t size)`.
//
// Built two ways (tests/fuzz/CMakeLists.txt):
//   - with clang's libFuzzer (./dev.sh fuzz): MEMKIT_FUZZ_TARGET(name) also defines LLVMFuzzerTestOneInput;
//   - as a plain replay driver (every ./dev.sh test): replay_main.cpp runs each stored input of
//     tests/fuzz/corpus/<name>/ and tests/fuzz/regressions/<name>/ through the same function.
// A target returns 0. Bad input must end in memkit::error (caught here); any other exception, a crash, a
// sanitizer report or a failed MEMKIT_FUZZ_CHECK is a finding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

// An invariant that must hold for every input; on failure the input is a finding (abort, so libFuzzer
// saves it and the replay driver stops with the file's name).
#define MEMKIT_FUZZ_CHECK(condition)                                                         \
  do {                                                                                       \
    if (!(condition)) {                                                                      \
      std::fprintf(stderr, "memkit fuzz: invariant failed at %s:%d: %s\n", __FILE__, __LINE__, \
                   #condition);                                                              \
      std::abort();                                                                          \
    }                                                                                        \
  } while (0)

#if defined(MEMKIT_FUZZ_LIBFUZZER)
#define MEMKIT_FUZZ_TARGET(name)                                                   \
  int memkit_fuzz_##name(const std::uint8_t* data, std::size_t size);              \
  extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) { \
    return memkit_fuzz_##name(data, size);                                         \
  }                                                                                \
  int memkit_fuzz_##name(const std::uint8_t* data, std::size_t size)
#else
#define MEMKIT_FUZZ_TARGET(name) int memkit_fuzz_##name(const std::uint8_t* data, std::size_t size)
#endif
