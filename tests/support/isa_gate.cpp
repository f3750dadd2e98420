// Linked into the test binaries built for a wider x86 target than the baseline (memkit.host.avx2,
// memkit.host.avx512). It is compiled for the baseline, and runs before any other static initializer,
// which could already use the wider instructions: on a CPU without them the binary prints why and
// exits 77, which CTest reports as Skipped.
#include <cstdio>
#include <cstdlib>

#ifndef MEMKIT_TEST_REQUIRED_ISA
#error "define MEMKIT_TEST_REQUIRED_ISA, e.g. \"avx512f\""
#endif

namespace {

__attribute__((constructor(101))) void require_isa() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports(MEMKIT_TEST_REQUIRED_ISA)) {
    std::printf("memkit: SKIPPED: this CPU has no %s, the instruction set these tests were built for\n",
                MEMKIT_TEST_REQUIRED_ISA);
    std::fflush(stdout);
    std::_Exit(77);
  }
  std::printf("memkit: tests built for and running with %s\n", MEMKIT_TEST_REQUIRED_ISA);
}

}  // namespace
