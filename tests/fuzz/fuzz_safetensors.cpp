// Fuzz target: safetensors::reader on an arbitrary file. Invariants for every file it accepts: each
// tensor's byte range lies inside the file, its byte count is its element count times the dtype size, and
// reading it (as raw bytes, and as a vector when memkit has its element type) succeeds.
#include <memkit/io/safetensors.hpp>

#include <cstdint>
#include <vector>

#include "fuzz_file.hpp"

MEMKIT_FUZZ_TARGET(safetensors) {
  const memory_file file(data, size);
  try {
    const memkit::safetensors::reader in(file.path());
    for (const auto& t : in.tensors()) {
      MEMKIT_FUZZ_CHECK(t.begin <= t.end && t.end <= size);
      MEMKIT_FUZZ_CHECK(t.numel() >= 0);
      MEMKIT_FUZZ_CHECK(static_cast<std::uint64_t>(t.numel()) * memkit::safetensors::dtype_size(t.dtype) == t.bytes());
      std::vector<unsigned char> raw(t.bytes());
      in.read_bytes(t.name, raw.data(), raw.size());
      if (t.dtype == "F32") MEMKIT_FUZZ_CHECK(in.read_vector<float>(t.name).size() == static_cast<std::size_t>(t.numel()));
      if (t.dtype == "U8") MEMKIT_FUZZ_CHECK(in.read_vector<std::uint8_t>(t.name) == raw);
      // Asking for the wrong element type is refused before anything is allocated.
      if (t.dtype != "F64") {
        bool refused = false;
        try {
          (void)in.read_vector<double>(t.name);
        } catch (const memkit::error&) {
          refused = true;
        }
        MEMKIT_FUZZ_CHECK(refused);
      }
    }
  } catch (const memkit::error&) {
  }
  return 0;
}
