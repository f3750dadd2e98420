// The doctest main for memkit's test binaries (kept in a host .cpp, as doctest wants under nvcc).
//
// Test cases in the "gpu" suite need a CUDA device. A normal run excludes them and says so; a run
// with --memkit-gpu-suite runs only them, or, when no device is usable, prints how many were
// skipped and why, and exits 77 so CTest reports the test as Skipped instead of Passed.
// --memkit-gpu-probe runs nothing: it prints how many GPU cases there are and whether they can run.
// Cases in the "scale" suite check accuracy or memory at full size (seconds each at -O2, minutes under the
// sanitizers' -O0 / -O1); a sanitized build (MEMKIT_TEST_SANITIZED) leaves them out and says how many: the
// same code runs at small sizes in its other cases, and the scale cases run in the g++ build's memkit.host.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#if defined(MEMKIT_TEST_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace {

int count_test_cases_in_suite(const char* suite) {
  int count = 0;
  for (const doctest::detail::TestCase& test_case : doctest::detail::getRegisteredTests())
    if (std::strcmp(test_case.m_test_suite, suite) == 0) ++count;
  return count;
}

int count_gpu_test_cases() { return count_test_cases_in_suite("gpu"); }

// Empty when a device is usable, else the reason there is none.
std::string why_no_cuda_device() {
#if defined(MEMKIT_TEST_WITH_CUDA)
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess) return std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status);
  if (devices == 0) return "cudaGetDeviceCount reported 0 devices";
  return {};
#else
  return "this test binary was built without CUDA";
#endif
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args;
  bool gpu_suite = false, gpu_probe = false;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--memkit-gpu-suite") == 0) gpu_suite = true;
    else if (std::strcmp(argv[i], "--memkit-gpu-probe") == 0) gpu_probe = true;
    else args.push_back(argv[i]);
  }
  if (gpu_probe) {
    const std::string reason = why_no_cuda_device();
    if (reason.empty()) std::printf("memkit: %d GPU test cases will run on the CUDA device\n", count_gpu_test_cases());
    else std::printf("memkit: %d GPU test cases will be SKIPPED: no usable CUDA device (%s)\n", count_gpu_test_cases(),
                     reason.c_str());
    return 0;
  }

  doctest::Context context(static_cast<int>(args.size()), args.data());
  const int gpu_cases = count_gpu_test_cases();
  if (gpu_suite) {
    const std::string reason = why_no_cuda_device();
    if (!reason.empty()) {
      std::printf("memkit: SKIPPED %d GPU test cases: no usable CUDA device (%s)\n", gpu_cases, reason.c_str());
      return 77;
    }
    context.setOption("test-suite", "gpu");
  } else {
#if defined(MEMKIT_TEST_SANITIZED)
    context.setOption("test-suite-exclude", "gpu,scale");
    if (const int scale_cases = count_test_cases_in_suite("scale"); scale_cases > 0)
      std::printf("memkit: %d full-size (\"scale\") test cases are not in this sanitized run; they run in memkit.host\n",
                  scale_cases);
#else
    context.setOption("test-suite-exclude", "gpu");
#endif
    if (gpu_cases > 0)
      std::printf("memkit: %d GPU test cases are not in this run; they run in the memkit.gpu test\n", gpu_cases);
  }
  return context.run();
}
