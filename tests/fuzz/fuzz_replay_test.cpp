// The fuzz targets as a plain replay driver: every stored input of tests/fuzz/corpus/<target>/ and
// tests/fuzz/regressions/<target>/ runs through its target in the normal test suite (under g++, and under
// clang with ASan + UBSan), so each test run re-checks what fuzzing found and what it was seeded with.
// Reproduce one input: memkit_host_tests -tc="fuzz replay: <target>" with MEMKIT_FUZZ_REPLAY=<file>.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

int memkit_fuzz_json(const std::uint8_t* data, std::size_t size);
int memkit_fuzz_safetensors(const std::uint8_t* data, std::size_t size);
int memkit_fuzz_hf_config(const std::uint8_t* data, std::size_t size);
int memkit_fuzz_bnb_linear4bit(const std::uint8_t* data, std::size_t size);
int memkit_fuzz_adam_state(const std::uint8_t* data, std::size_t size);
int memkit_fuzz_bnb_adam_state(const std::uint8_t* data, std::size_t size);
int memkit_fuzz_sharded_adam_state(const std::uint8_t* data, std::size_t size);
int memkit_fuzz_peft_adapter(const std::uint8_t* data, std::size_t size);
int memkit_fuzz_consolidate(const std::uint8_t* data, std::size_t size);

namespace {

std::vector<std::filesystem::path> stored_inputs(const std::string& target) {
  std::vector<std::filesystem::path> inputs;
  if (const char* one = std::getenv("MEMKIT_FUZZ_REPLAY")) {
    inputs.emplace_back(one);
    return inputs;
  }
  const std::filesystem::path root = std::filesystem::path(MEMKIT_TEST_SOURCE_DIR) / "tests" / "fuzz";
  for (const char* kind : {"corpus", "regressions"}) {
    const std::filesystem::path dir = root / kind / target;
    if (!std::filesystem::is_directory(dir)) continue;
    for (const auto& entry : std::filesystem::directory_iterator(dir))
      if (entry.is_regular_file() && entry.path().filename() != "README.md") inputs.push_back(entry.path());
  }
  std::sort(inputs.begin(), inputs.end());
  return inputs;
}

void replay(const std::string& target, int (*run)(const std::uint8_t*, std::size_t), std::size_t at_least) {
  const std::vector<std::filesystem::path> inputs = stored_inputs(target);
  REQUIRE(inputs.size() >= (std::getenv("MEMKIT_FUZZ_REPLAY") ? 1 : at_least));
  for (const auto& path : inputs) {
    std::ifstream file(path, std::ios::binary);
    REQUIRE(file.good());
    const std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    // A crash or failed invariant aborts: the last line on stderr names the input.
    std::fprintf(stderr, "fuzz replay %s: %s\n", target.c_str(), path.filename().c_str());
    CHECK(run(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()) == 0);
  }
  MESSAGE(target << ": " << inputs.size() << " stored inputs replayed");
}

}  // namespace

TEST_CASE("fuzz replay: json") { replay("json", memkit_fuzz_json, 20); }
TEST_CASE("fuzz replay: safetensors") { replay("safetensors", memkit_fuzz_safetensors, 6); }
TEST_CASE("fuzz replay: hf_config") { replay("hf_config", memkit_fuzz_hf_config, 6); }
TEST_CASE("fuzz replay: bnb_linear4bit") { replay("bnb_linear4bit", memkit_fuzz_bnb_linear4bit, 7); }
TEST_CASE("fuzz replay: adam_state") { replay("adam_state", memkit_fuzz_adam_state, 6); }
TEST_CASE("fuzz replay: bnb_adam_state") { replay("bnb_adam_state", memkit_fuzz_bnb_adam_state, 4); }
TEST_CASE("fuzz replay: sharded_adam_state") { replay("sharded_adam_state", memkit_fuzz_sharded_adam_state, 4); }
TEST_CASE("fuzz replay: peft_adapter") { replay("peft_adapter", memkit_fuzz_peft_adapter, 6); }
TEST_CASE("fuzz replay: consolidate") { replay("consolidate", memkit_fuzz_consolidate, 4); }
