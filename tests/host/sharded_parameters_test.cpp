// distributed::sharded_dense / sharded_quantized (ZeRO-3's parameter shards): the layout, the bytes each rank
// keeps and stages, and gather rebuilding the tensor bit for bit — on 1 rank (single_communicator) and on 2,
// 3 and 5 ranks run as threads over a small in-process communicator (the MPI runs are tests/mpi).
#include <memkit/distributed/sharded_parameters.hpp>
#include <memkit/memory/tracking.hpp>

#include <doctest/doctest.h>

#include "support/thread_communicator.hpp"

#include <filesystem>
#include <unistd.h>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

namespace dist = memkit::distributed;
using memkit::shape;

namespace {

// Ranks as threads (tests/support/thread_communicator.hpp, shared with the stage-3 tests).
using thread_group = memkit_test::thread_ranks;

std::vector<float> values(std::int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = normal(rng);
  return v;
}

template <class T>
bool same_bytes(memkit::tensor_view<T> a, memkit::tensor_view<T> b) {
  return a.bytes() == b.bytes() && (a.bytes() == 0 || std::memcmp(a.data(), b.data(), a.bytes()) == 0);
}

template <memkit::quant::format F>
bool same_tensor(const memkit::quant::quantized_tensor<F>& a, const memkit::quant::quantized_tensor<F>& b) {
  if (!a.options().double_quant) return same_bytes(a.codes(), b.codes()) && same_bytes(a.absmax(), b.absmax());
  return same_bytes(a.codes(), b.codes()) && same_bytes(a.nested_codes(), b.nested_codes()) &&
         same_bytes(a.nested_group_absmax(), b.nested_group_absmax()) && same_bytes(a.offset_view(), b.offset_view());
}

}  // namespace

TEST_CASE("sharded parameters: the layout gives every rank the same whole units, padding the last") {
  const dist::shard_layout l = dist::make_shard_layout(1000, 64, 3);  // 16 units -> 6 per rank
  CHECK(l.units_per_rank == 6);
  CHECK(l.shard_elements() == 384);
  CHECK((l.first(0) == 0 && l.count(0) == 384));
  CHECK((l.first(1) == 384 && l.count(1) == 384));
  CHECK((l.first(2) == 768 && l.count(2) == 232));
  const dist::shard_layout tiny = dist::make_shard_layout(100, 64, 4);  // 2 units on 4 ranks: two empty shards
  CHECK(tiny.units_per_rank == 1);
  CHECK((tiny.count(0) == 64 && tiny.count(1) == 36 && tiny.count(2) == 0 && tiny.count(3) == 0));
  // Double quantization shards whole nested groups (256 blocks) so each rank's group scales are its own.
  const shape w{4096, 1000};
  CHECK(dist::sharded_quantized<memkit::quant::NF4>::layout_of(w, {64, true}, 2).unit == 64 * 256);
  CHECK(dist::sharded_quantized<memkit::quant::NF4>::layout_of(w, {64, false}, 2).unit == 64);
}

TEST_CASE("sharded parameters: gather rebuilds a quantized tensor bit for bit, on 1, 2, 3 and 5 ranks") {
  for (const bool nested : {false, true})
    for (const int ranks : {1, 2, 3, 5}) {
      // 1000 x 700: 10937.5 blocks of 64 (the last partial), 43 nested groups, not a multiple of any rank count.
      const shape dims{1000, 700};
      const memkit::quant::quant_options options{64, nested};
      const std::vector<float> v = values(dims.numel(), 7);
      using nf4 = memkit::quant::quantized_tensor<memkit::quant::NF4>;
      const nf4 whole = nf4::quantize(memkit::host, memkit::host_view(v.data(), dims), options, memkit::default_host_resource());
      CAPTURE(nested);
      CAPTURE(ranks);
      thread_group group(ranks);
      std::vector<int> ok(static_cast<std::size_t>(ranks), 0);
      group.run([&](const thread_group::communicator& comm) {
        memkit::tracking_resource tracker(memkit::default_host_resource(), "shard");
        const dist::sharded_quantized<memkit::quant::NF4> shard(whole, comm.rank(), comm.size(),
                                                               tracker.category(memkit::memory_category::weights));
        const bool kept = tracker.current_bytes() == dist::sharded_quantized<memkit::quant::NF4>::shard_bytes(dims, options, ranks);
        nf4 gathered(memkit::default_host_resource(), dims, options);
        tracker.reset_peak();
        const std::size_t before = tracker.current_bytes();
        shard.gather(memkit::host, comm, gathered, tracker.category(memkit::memory_category::workspace));
        const bool staged = tracker.peak_bytes() - before ==
                            dist::sharded_quantized<memkit::quant::NF4>::gather_workspace_bytes(dims, options, ranks);
        ok[static_cast<std::size_t>(comm.rank())] = kept && staged && same_tensor(whole, gathered) ? 1 : 0;
      });
      for (int r = 0; r < ranks; ++r) CHECK(ok[static_cast<std::size_t>(r)] == 1);
      // Each rank keeps about 1/ranks of the tensor.
      const double share = double(dist::sharded_quantized<memkit::quant::NF4>::shard_bytes(dims, options, ranks)) /
                           double(nf4::bytes_required(dims, options));
      CHECK(share <= 1.0 / ranks + 0.05);
    }
}

TEST_CASE("sharded parameters: a dense tensor's shards gather back; misuse is refused") {
  const shape dims{37, 11};
  const std::vector<float> v = values(dims.numel(), 3);
  thread_group group(3);
  std::vector<int> ok(3, 0);
  group.run([&](const thread_group::communicator& comm) {
    const dist::sharded_dense<float> shard(memkit::host_view(v.data(), dims), comm.rank(), comm.size(),
                                           memkit::default_host_resource());
    std::vector<float> back(v.size());
    shard.gather(memkit::host, comm, memkit::host_view(back.data(), dims), memkit::default_host_resource());
    ok[static_cast<std::size_t>(comm.rank())] = back == v ? 1 : 0;
  });
  CHECK(ok == std::vector<int>{1, 1, 1});

  const dist::single_communicator one;
  const dist::sharded_dense<float> shard(memkit::host_view(v.data(), dims), 0, 1, memkit::default_host_resource());
  std::vector<float> wrong(5);
  CHECK_THROWS_WITH_AS(shard.gather(memkit::host, one, memkit::host_view(wrong.data(), shape{5}), memkit::default_host_resource()),
                       doctest::Contains("`whole` has shape [5], the tensor [37, 11]"), memkit::error);
  const dist::sharded_dense<float> of_two(memkit::host_view(v.data(), dims), 1, 2, memkit::default_host_resource());
  std::vector<float> back(v.size());
  CHECK_THROWS_WITH_AS(of_two.gather(memkit::host, one, memkit::host_view(back.data(), dims), memkit::default_host_resource()),
                       doctest::Contains("the shard is rank 1 of 2, the communicator rank 0 of 1"), memkit::error);
  CHECK_THROWS_WITH_AS(dist::sharded_dense<float>(memkit::host_view(v.data(), dims), 2, 2, memkit::default_host_resource()),
                       doctest::Contains("sharded_dense: rank 2 of 2 ranks"), memkit::error);
  using nf4 = memkit::quant::quantized_tensor<memkit::quant::NF4>;
  const std::vector<float> w = values(4096, 5);
  const nf4 whole = nf4::quantize(memkit::host, memkit::host_view(w.data(), shape{64, 64}), {64, true}, memkit::default_host_resource());
  const dist::sharded_quantized<memkit::quant::NF4> q(whole, 0, 1, memkit::default_host_resource());
  nf4 other(memkit::default_host_resource(), shape{64, 64}, {64, false});
  CHECK_THROWS_WITH_AS(q.gather(memkit::host, one, other, memkit::default_host_resource()),
                       doctest::Contains("`whole` is [64, 64] (block 64), the sharded tensor [64, 64] (block 64, double quantization)"),
                       memkit::error);
}

TEST_CASE("sharded parameters: shards saved on N ranks load on M ranks and gather back bit for bit (N -> M)") {
  namespace fs = std::filesystem;
  using nf4 = memkit::quant::quantized_tensor<memkit::quant::NF4>;
  using sharded = dist::sharded_quantized<memkit::quant::NF4>;
  const shape dims{1000, 700};
  const std::vector<float> v = values(dims.numel(), 9);
  for (const bool nested : {true, false})
    for (const std::pair<int, int>& counts : {std::pair{2, 3}, std::pair{3, 2}, std::pair{1, 5}, std::pair{4, 1}}) {
      const int n = counts.first, m = counts.second;  // (named variables: clang 14 cannot capture bindings)
      CAPTURE(nested);
      CAPTURE(n);
      CAPTURE(m);
      const memkit::quant::quant_options options{64, nested};
      const nf4 whole = nf4::quantize(memkit::host, memkit::host_view(v.data(), dims), options, memkit::default_host_resource());
      const fs::path dir = fs::temp_directory_path() / ("memkit_shards_" + std::to_string(::getpid()));
      fs::create_directories(dir);
      std::vector<std::string> files;
      for (int r = 0; r < n; ++r) {
        memkit::safetensors::writer out;
        sharded(whole, r, n, memkit::default_host_resource()).save(out, "layers.0.q_proj.weight");
        files.push_back((dir / ("rank" + std::to_string(r) + ".safetensors")).string());
        out.write(files.back());
      }
      std::vector<memkit::safetensors::reader> readers;
      for (auto it = files.rbegin(); it != files.rend(); ++it) readers.emplace_back(*it);  // any order
      std::vector<const memkit::safetensors::reader*> images;
      for (const auto& r : readers) images.push_back(&r);
      thread_group group(m);
      std::vector<int> ok(static_cast<std::size_t>(m), 0);
      group.run([&](const thread_group::communicator& comm) {
        const sharded shard = sharded::load(images, "layers.0.q_proj.weight", comm.rank(), comm.size(),
                                            memkit::default_host_resource());
        nf4 gathered(memkit::default_host_resource(), dims, options);
        shard.gather(memkit::host, comm, gathered, memkit::default_host_resource());
        ok[static_cast<std::size_t>(comm.rank())] = same_tensor(whole, gathered) ? 1 : 0;
      });
      CHECK(ok == std::vector<int>(static_cast<std::size_t>(m), 1));
      // Misuse: not every rank's file, another tensor's name, another format.
      if (n > 1) {
        const std::vector<const memkit::safetensors::reader*> some(images.begin(), images.end() - 1);
        CHECK_THROWS_WITH_AS(sharded::load(some, "layers.0.q_proj.weight", 0, 1, memkit::default_host_resource()),
                             doctest::Contains("images were given (all ranks of one save are needed)"), memkit::error);
      }
      CHECK_THROWS_WITH_AS(sharded::load(images, "layers.0.k_proj.weight", 0, 1, memkit::default_host_resource()),
                           doctest::Contains("holds no shard of 'layers.0.k_proj.weight'"), memkit::error);
      CHECK_THROWS_WITH_AS(dist::sharded_quantized<memkit::quant::FP4>::load(images, "layers.0.q_proj.weight", 0, 1,
                                                                             memkit::default_host_resource()),
                           doctest::Contains("saved as nf4, loading as fp4"), memkit::error);
      readers.clear();
      fs::remove_all(dir);
    }
}

TEST_CASE("sharded parameters: dense shards saved on 3 ranks load on 2 (and 1 on 4) and gather back") {
  namespace fs = std::filesystem;
  const shape dims{37, 11};
  const std::vector<float> v = values(dims.numel(), 13);
  for (const std::pair<int, int>& counts : {std::pair{3, 2}, std::pair{1, 4}}) {
    const int n = counts.first, m = counts.second;
    CAPTURE(n);
    CAPTURE(m);
    const fs::path dir = fs::temp_directory_path() / ("memkit_dense_shards_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    std::vector<memkit::safetensors::reader> readers;
    for (int r = 0; r < n; ++r) {
      memkit::safetensors::writer out;
      dist::sharded_dense<float>(memkit::host_view(v.data(), dims), r, n, memkit::default_host_resource()).save(out, "norm.weight");
      const std::string file = (dir / ("rank" + std::to_string(r) + ".safetensors")).string();
      out.write(file);
      readers.emplace_back(file);
    }
    std::vector<const memkit::safetensors::reader*> images;
    for (const auto& r : readers) images.push_back(&r);
    thread_group group(m);
    std::vector<int> ok(static_cast<std::size_t>(m), 0);
    group.run([&](const thread_group::communicator& comm) {
      const auto shard = dist::sharded_dense<float>::load(images, "norm.weight", dims, comm.rank(), comm.size(),
                                                          memkit::default_host_resource());
      std::vector<float> back(v.size());
      shard.gather(memkit::host, comm, memkit::host_view(back.data(), dims), memkit::default_host_resource());
      ok[static_cast<std::size_t>(comm.rank())] = back == v ? 1 : 0;
    });
    CHECK(ok == std::vector<int>(static_cast<std::size_t>(m), 1));
    CHECK_THROWS_WITH_AS(dist::sharded_dense<float>::load(images, "norm.weight", shape{11, 37}, 0, 1, memkit::default_host_resource()),
                         doctest::Contains("holds another tensor"), memkit::error);
    CHECK_THROWS_WITH_AS(dist::sharded_dense<memkit::bf16>::load(images, "norm.weight", dims, 0, 1, memkit::default_host_resource()),
                         doctest::Contains("\"format\":\"F32\""), memkit::error);
    readers.clear();
    fs::remove_all(dir);
  }
}
