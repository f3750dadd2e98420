// memkit/peft/detail/adapter_bytes.hpp — the byte-level helpers of peft/adapter_file.hpp and peft/writer.hpp:
// safetensors float dtypes decoded element by element, the natural order of module paths, shapes as text,
// and copies between host temporaries and views of any memory kind.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "memkit/config.hpp"
#include "memkit/core/float16.hpp"
#include "memkit/core/tensor_view.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace peft::detail {

inline bool is_float_dtype(std::string_view dtype) { return dtype == "F32" || dtype == "BF16" || dtype == "F16"; }

inline float decode_element(const std::byte* raw, std::string_view dtype, std::int64_t i) {
  if (dtype == "F32") {
    float v;
    std::memcpy(&v, raw + 4 * i, 4);
    return v;
  }
  std::uint16_t bits;
  std::memcpy(&bits, raw + 2 * i, 2);
  return dtype == "BF16" ? to_float(bf16::from_bits(bits)) : to_float(fp16::from_bits(bits));
}

// "Natural" order of module paths: "layers.2" before "layers.10".
inline bool natural_less(std::string_view a, std::string_view b) {
  std::size_t i = 0, j = 0;
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  while (i < a.size() && j < b.size()) {
    if (digit(a[i]) && digit(b[j])) {
      std::size_t ie = i, je = j;
      while (ie < a.size() && digit(a[ie])) ++ie;
      while (je < b.size() && digit(b[je])) ++je;
      std::string_view na = a.substr(i, ie - i), nb = b.substr(j, je - j);
      while (na.size() > 1 && na[0] == '0') na.remove_prefix(1);
      while (nb.size() > 1 && nb[0] == '0') nb.remove_prefix(1);
      if (na.size() != nb.size()) return na.size() < nb.size();
      if (na != nb) return na < nb;
      i = ie;
      j = je;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

inline std::string shape_text(const std::vector<std::int64_t>& dims) {
  std::string text = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) {
    text += i ? ", " : "";  // two appends, not "," + to_string(...): GCC 12 at -O3 warns (-Wrestrict) on that
    text += std::to_string(dims[i]);
  }
  return text + "]";
}

// Copies `bytes` bytes between host memory and memory of kind `where`: into it (to_where, from a host
// temporary) or out of it (into a host temporary).
inline void copy_bytes(void* destination, const void* source, std::size_t bytes, memory_kind where, bool to_where) {
  if (bytes == 0) return;
  if (where != memory_kind::device) {
    std::memcpy(destination, source, bytes);
    return;
  }
#if MEMKIT_HAS_CUDA
  MEMKIT_CUDA_CHECK(cudaMemcpy(destination, source, bytes, to_where ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost));
#else
  throw error(std::string("peft: a ") + (to_where ? "destination" : "source") +
              " is device memory, but this translation unit is built without CUDA");
#endif
}
// Copies host bytes to a destination of any memory kind.
inline void copy_to(void* destination, memory_kind where, const void* source, std::size_t bytes) {
  copy_bytes(destination, source, bytes, where, true);
}
// Copies bytes of a source of any memory kind to host memory.
inline void copy_from(void* destination, const void* source, memory_kind where, std::size_t bytes) {
  copy_bytes(destination, source, bytes, where, false);
}

}  // namespace peft::detail

MEMKIT_NAMESPACE_END
