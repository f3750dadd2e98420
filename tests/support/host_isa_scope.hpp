// tests/support/host_isa_scope.hpp — running a check under each host instruction set this CPU has.
// The dispatched host kernels (core/host_simd.hpp) take the widest path the process allows; capping it with
// limit_host_isa makes them take each narrower path in turn, all in one test binary.
#pragma once

#include <memkit/core/host_simd.hpp>

#include <doctest/doctest.h>

#include <initializer_list>

namespace memkit_test {

// Caps the host kernels at `cap` for its lifetime and restores the previous cap, also when a check throws.
class host_isa_cap {
 public:
  explicit host_isa_cap(memkit::host_isa cap) noexcept : previous_(memkit::limit_host_isa(cap)) {}
  ~host_isa_cap() { memkit::limit_host_isa(previous_); }
  host_isa_cap(const host_isa_cap&) = delete;
  host_isa_cap& operator=(const host_isa_cap&) = delete;

 private:
  memkit::host_isa previous_;
};

inline constexpr std::initializer_list<memkit::host_isa> every_host_isa = {
    memkit::host_isa::portable, memkit::host_isa::avx2, memkit::host_isa::avx512};

// Runs check(isa) once for each of `isas` this process can run, capped to it, its name captured for failures.
template <class Check>
void on_each_host_isa(Check&& check, std::initializer_list<memkit::host_isa> isas = every_host_isa) {
  for (const memkit::host_isa isa : isas) {
    if (isa > memkit::detail::process_host_isa()) continue;
    CAPTURE(memkit::to_string(isa));
    const host_isa_cap cap(isa);
    check(isa);
  }
}

}  // namespace memkit_test
