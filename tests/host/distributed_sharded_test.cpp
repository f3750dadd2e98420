// distributed::sharded_adam_state on one rank (single_communicator), its flat layout and memory for any
// number of ranks, save/load and bad input. tests/mpi runs the same scenario on 2 and 3 MPI ranks.
#include <doctest/doctest.h>
#include <memkit/distributed/communicator.hpp>
#include <memkit/distributed/sharded_adam_state.hpp>
#include <memkit/memory/tracking.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "support/sharded_scenario.hpp"

using memkit::bf16;
using memkit::optim::four_bit;
using memkit::host;
using memkit::distributed::sharded_adam_state;
using memkit::distributed::single_communicator;

namespace {

template <class State, int Block, class P>
void check_one_rank(int stage, bool with_master, int nan_step) {
  CAPTURE(stage);
  CAPTURE(with_master);
  sharded_test::check_like_reference(
      sharded_test::run<State, Block, P>(single_communicator{}, stage, 6, with_master, nan_step), 6, nan_step);
}

template <class State, int Block>
void check_flavour() {
  for (int stage : {1, 2}) {
    check_one_rank<State, Block, float>(stage, false, 3);
    check_one_rank<State, Block, bf16>(stage, false, -1);  // stochastic rounding: the random stream's index
    check_one_rank<State, Block, bf16>(stage, true, -1);
  }
}

// The pieces of every rank cover every tensor exactly once, start on granules, and the per-rank
// bytes add up to adam_state's moments plus one overhead per rank.
template <class State, int Block>
void check_layout(const std::vector<std::int64_t>& sizes, int ranks) {
  using S = sharded_adam_state<State, Block>;
  CAPTURE(ranks);
  std::vector<std::int64_t> covered(sizes.size(), 0);
  std::int64_t chunks = 0;
  for (std::int64_t n : sizes) chunks += memkit::optim::detail::reduction_chunks(n);
  const std::size_t overhead = memkit::optim::adam_state<State, Block>::overhead_bytes(chunks);
  std::size_t moments = 0;
  for (int r = 0; r < ranks; ++r) {
    std::int64_t real = 0;
    const std::size_t bytes = S::plan(sizes, r, ranks, 4096, [&](const memkit::distributed::shard_piece& p) {
      CHECK(p.begin % S::granule == 0);
      CHECK(p.begin == covered[static_cast<std::size_t>(p.tensor)]);  // in order, no gap, no overlap
      covered[static_cast<std::size_t>(p.tensor)] = p.end;
      real += p.count();
      moments += S::piece_bytes(p.count(), p.quantized);
    });
    CHECK(real <= S::shard_size(sizes, ranks));
    CHECK(bytes == S::bytes_required(sizes, r, ranks));
  }
  CHECK(covered == sizes);
  CHECK(S::flat_size(sizes, ranks) % (S::granule * ranks) == 0);
  // One rank holds exactly adam_state's bytes.
  if (ranks == 1) CHECK(moments + overhead == memkit::optim::adam_state<State, Block>::bytes_required(sizes));
}

}  // namespace

TEST_CASE("sharded_adam: one rank steps bit-identically to adam_state, fp32 moments") { check_flavour<float, 0>(); }
TEST_CASE("sharded_adam: one rank steps bit-identically to adam_state, bf16 moments") { check_flavour<bf16, 0>(); }
TEST_CASE("sharded_adam: one rank steps bit-identically to adam_state, 8-bit moments") {
  check_flavour<std::int8_t, 256>();
}
TEST_CASE("sharded_adam: one rank steps bit-identically to adam_state, 4-bit moments") { check_flavour<four_bit, 128>(); }

TEST_CASE("sharded_adam: pieces cover every tensor once, on granule boundaries, for 1..7 ranks") {
  const std::vector<std::int64_t> sizes{5000, 300, 12365, 4096, 9000, 70, 1 << 17, 3};
  for (int ranks = 1; ranks <= 7; ++ranks) {
    check_layout<float, 0>(sizes, ranks);
    check_layout<bf16, 0>(sizes, ranks);
    check_layout<std::int8_t, 256>(sizes, ranks);
    check_layout<four_bit, 128>(sizes, ranks);
  }
}

TEST_CASE("sharded_adam: the tracker measures bytes_required; save and load restore every byte") {
  const std::vector<std::int64_t> sizes{5000, 300, 12365};
  memkit::tracking_resource tracker(memkit::default_host_resource());
  using S = sharded_adam_state<std::int8_t, 256>;
  S state(host, single_communicator{}, tracker.category(memkit::memory_category::optimizer_state), sizes);
  CHECK(tracker.stats(memkit::memory_category::optimizer_state).current_bytes == S::bytes_required(sizes, 0, 1));
  CHECK(state.bytes() == memkit::optim::adam_state<std::int8_t, 256>::bytes_required(sizes));

  std::vector<float> params(static_cast<std::size_t>(state.flat_size()), 0.5f), grads(params.size(), 0.01f);
  for (int s = 0; s < 3; ++s)
    state.step_full_gradients(host, single_communicator{}, memkit::host_view(params), memkit::host_view(grads),
                              sharded_test::groups);
  std::stringstream image;
  state.save(host, image);
  S copy(host, single_communicator{}, memkit::default_host_resource(), sizes);
  copy.load(host, image);
  CHECK(copy.control(host).step == 3);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    std::vector<float> m, v, m2, v2;
    state.read_moments(host, t, m, v);
    copy.read_moments(host, t, m2, v2);
    CHECK(m == m2);
    CHECK(v == v2);
  }

  // A corrupt image, or one of another flavour or shape, is refused and changes nothing.
  const std::string good = image.str();
  std::string corrupt = good;
  corrupt[corrupt.size() / 2] = static_cast<char>(corrupt[corrupt.size() / 2] ^ 0x40);
  std::stringstream bad(corrupt);
  CHECK_THROWS_WITH_AS(copy.load(host, bad), doctest::Contains("checksum"), memkit::error);
  CHECK(copy.control(host).step == 3);
  sharded_adam_state<four_bit, 128> other(host, single_communicator{}, memkit::default_host_resource(), sizes);
  std::stringstream again(good);
  CHECK_THROWS_WITH_AS(other.load(host, again), doctest::Contains("another flavour"), memkit::error);
  sharded_adam_state<std::int8_t, 256> smaller(host, single_communicator{}, memkit::default_host_resource(),
                                               std::vector<std::int64_t>{5000, 300});
  std::stringstream third(good);
  CHECK_THROWS_WITH_AS(smaller.load(host, third), doctest::Contains("tensor count"), memkit::error);
}

TEST_CASE("sharded_adam: bad input is refused before anything changes") {
  const std::vector<std::int64_t> sizes{5000, 300};
  sharded_adam_state<float> state(host, single_communicator{}, memkit::default_host_resource(), sizes);
  std::vector<float> params(static_cast<std::size_t>(state.flat_size()), 0.5f), grads(params.size(), 0.01f);
  std::vector<float> short_grads(params.size() - 1, 0.01f);
  CHECK_THROWS_WITH_AS(state.step_full_gradients(host, single_communicator{}, memkit::host_view(params),
                                                 memkit::host_view(short_grads), sharded_test::groups),
                       doctest::Contains("expected"), memkit::error);
  const std::vector<int> bad_groups{0, 2};
  CHECK_THROWS_WITH_AS(state.step_full_gradients(host, single_communicator{}, memkit::host_view(params),
                                                 memkit::host_view(grads), sharded_test::groups,
                                                 {.tensor_groups = bad_groups}),
                       doctest::Contains("names group 2"), memkit::error);
  std::vector<float> master(static_cast<std::size_t>(state.shard_size()));
  CHECK_THROWS_WITH_AS(state.step_full_gradients(host, single_communicator{}, memkit::host_view(params),
                                                 memkit::host_view(grads), sharded_test::groups, {},
                                                 memkit::host_view(master)),
                       doctest::Contains("own master"), memkit::error);
  CHECK(state.control(host).step == 0);
  CHECK(params[0] == 0.5f);
  CHECK_THROWS_AS(sharded_adam_state<float>(host, single_communicator{}, memkit::default_host_resource(),
                                            std::vector<std::int64_t>{5, 0}),
                  memkit::error);
}

namespace {

// A rank image taken apart: the header before the body, the body, and where the control block starts in it.
struct image_parts {
  std::string head, body;
  std::size_t control_at = 0;
};
template <class S>
image_parts split_image(const std::string& image, std::size_t tensors) {
  std::uint32_t magic_length = 0;
  std::memcpy(&magic_length, image.data(), 4);
  const std::size_t head = 4 + magic_length + 4 + 8;
  image_parts parts{image.substr(0, head), image.substr(head, image.size() - head - 8), 0};
  // name, bits, block, map fingerprint, min_quantized_size, ranks, rank, run id, tensor count, sizes
  parts.control_at = 4 + S::format_name().size() + 4 + 4 + 8 + 8 + 4 + 4 + 8 + 8 + 8 * tensors;
  return parts;
}
// The image with its body replaced and the checksum recomputed (a forgery the checksum cannot catch).
template <class S>
std::string forged(const image_parts& parts) {
  std::string out = parts.head + parts.body;
  const std::uint64_t sum = S::image_checksum(parts.body.data(), parts.body.size());
  out.append(reinterpret_cast<const char*>(&sum), 8);
  return out;
}

}  // namespace

TEST_CASE("sharded_adam: forged images are refused by the checks adam_state::load applies (#35)") {
  using S = sharded_adam_state<float>;
  const std::vector<std::int64_t> sizes{5000, 300};
  S state(host, single_communicator{}, memkit::default_host_resource(), sizes);
  std::vector<float> params(static_cast<std::size_t>(state.flat_size()), 0.5f), grads(params.size(), 0.01f);
  state.step_full_gradients(host, single_communicator{}, memkit::host_view(params), memkit::host_view(grads),
                            sharded_test::groups);
  std::stringstream saved;
  state.save(host, saved);
  const image_parts parts = split_image<S>(saved.str(), sizes.size());
  S target(host, single_communicator{}, memkit::default_host_resource(), sizes);
  auto load_forged = [&](const image_parts& p) {
    std::stringstream in(forged<S>(p));
    target.load(host, in);
  };
  auto with_control = [&](auto change) {
    image_parts p = parts;
    memkit::optim::adam_control c{};
    std::memcpy(&c, p.body.data() + p.control_at, sizeof c);
    change(c);
    std::memcpy(p.body.data() + p.control_at, &c, sizeof c);
    return p;
  };
  // The untouched image, re-checksummed, loads: the forging itself is right.
  load_forged(parts);
  CHECK(target.control(host).step == 1);
  S fresh(host, single_communicator{}, memkit::default_host_resource(), sizes);
  auto refused = [&](const image_parts& p, const char* message) {
    CAPTURE(message);
    std::stringstream in(forged<S>(p));
    CHECK_THROWS_WITH_AS(fresh.load(host, in), doctest::Contains(message), memkit::error);
    CHECK(fresh.control(host).step == 0);  // nothing half-loaded
  };
  refused(with_control([](memkit::optim::adam_control& c) { c.step = std::numeric_limits<std::int64_t>::max(); }),
          "step 9223372036854775807 (must be 0 .. 2^62)");
  refused(with_control([](memkit::optim::adam_control& c) { c.step = -5; }), "step -5");
  refused(with_control([](memkit::optim::adam_control& c) {
            c.loss_scale = std::numeric_limits<float>::quiet_NaN();
            c.grad_norm = -1.0;
          }),
          "grad_norm");
  refused(with_control([](memkit::optim::adam_control& c) { c.loss_scale = std::numeric_limits<float>::quiet_NaN(); }),
          "loss_scale");
  // Moments: a NaN first moment, a negative second moment (the first piece's m then v, fp32).
  const std::size_t moments_at = parts.control_at + sizeof(memkit::optim::adam_control) + 8 + 3 * 8;
  {
    image_parts p = parts;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(p.body.data() + moments_at + 4 * 7, &nan, 4);
    refused(p, "m[7] is nan");
  }
  {
    image_parts p = parts;
    const float negative = -1.0f;
    std::memcpy(p.body.data() + moments_at + 4 * 5000 + 4 * 3, &negative, 4);
    refused(p, "v[3] is -1");
  }
}

TEST_CASE("sharded_adam: a short image claiming a huge body allocates nothing for it (#35)") {
  using S = sharded_adam_state<float>;
  const std::vector<std::int64_t> sizes{5000, 300};
  S state(host, single_communicator{}, memkit::default_host_resource(), sizes);
  std::stringstream saved;
  state.save(host, saved);
  std::string image = saved.str();
  std::uint32_t magic_length = 0;
  std::memcpy(&magic_length, image.data(), 4);
  // Keep the header, claim the largest body the bound allows (the whole unsharded state), end the stream.
  std::string head = image.substr(0, 4 + magic_length + 4 + 8);
  const std::uint64_t claimed = memkit::optim::adam_state<float>::bytes_required(sizes) + (1u << 20);
  std::memcpy(head.data() + 4 + magic_length + 4, &claimed, 8);
  head += "0123456789abcdef0123456789";
  std::stringstream in(head);
  CHECK_THROWS_WITH_AS(state.load(host, in), doctest::Contains("the stream ends after 26"), memkit::error);
}

TEST_CASE("sharded_adam: images carry their run: another run's image is refused, even at the same step (#35)") {
  using S = sharded_adam_state<float>;
  const std::vector<std::int64_t> sizes{5000, 300};
  S run_a(host, single_communicator{}, memkit::default_host_resource(), sizes);
  S run_b(host, single_communicator{}, memkit::default_host_resource(), sizes);
  run_a.set_run_id(0xA11CE);
  run_b.set_run_id(0xB0B);
  std::stringstream image_a, image_b;
  run_a.save(host, image_a);
  run_b.save(host, image_b);
  // Resuming run A: its own image loads, run B's (same step, same control block) does not.
  S resume(host, single_communicator{}, memkit::default_host_resource(), sizes);
  resume.set_run_id(0xA11CE);
  CHECK_THROWS_WITH_AS(resume.load(host, image_b), doctest::Contains("from run 2827, this state belongs to run 659918"),
                       memkit::error);
  resume.load(host, image_a);
  // A state without a run id takes the images'.
  S anonymous(host, single_communicator{}, memkit::default_host_resource(), sizes);
  std::stringstream again(image_a.str());
  anonymous.load(host, again);
  CHECK(anonymous.run_id() == 0xA11CE);
}

namespace {

// Ranks of one process built one after another: broadcast hands rank `root`'s bytes to the ranks built after
// it through `slot` (what a real communicator does at once). Only for construction, save and load.
struct sequential_ranks {
  int r = 0, n = 1;
  std::vector<std::byte>* slot = nullptr;
  int rank() const noexcept { return r; }
  int size() const noexcept { return n; }
  template <class E, class T>
  void all_reduce(const E&, const T*, T*, std::int64_t) const { refuse(); }
  template <class E, class T>
  void reduce_scatter(const E&, const T*, T*, std::int64_t) const { refuse(); }
  template <class E, class T>
  void all_gather(const E&, const T*, T*, std::int64_t) const { refuse(); }
  template <class E, class T>
  void broadcast(const E&, T* data, std::int64_t count, int root) const {
    const std::size_t bytes = static_cast<std::size_t>(count) * sizeof(T);
    if (r == root) slot->assign(reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + bytes);
    else std::memcpy(data, slot->data(), bytes);
  }
  [[noreturn]] static void refuse() { throw memkit::error("sequential_ranks: no collectives"); }
};

// The images of a fresh save on `ranks` ranks, default-constructed (each run draws its own id).
template <class S>
std::vector<std::string> fresh_run_images(const std::vector<std::int64_t>& sizes, int ranks, std::uint64_t* id) {
  std::vector<std::byte> slot;
  std::vector<std::string> images;
  for (int r = 0; r < ranks; ++r) {
    S state(host, sequential_ranks{r, ranks, &slot}, memkit::default_host_resource(), sizes);
    if (r == 0) *id = state.run_id();
    CHECK(state.run_id() == *id);  // every rank of the run holds rank 0's id
    std::stringstream out;
    state.save(host, out);
    images.push_back(out.str());
  }
  return images;
}

}  // namespace

TEST_CASE("sharded_adam: every run draws its own id, and the ranks of two runs at the same step are refused together (#35)") {
  using S = sharded_adam_state<float>;
  const std::vector<std::int64_t> sizes{5000, 300};
  std::uint64_t id_a = 0, id_b = 0;
  const std::vector<std::string> run_a = fresh_run_images<S>(sizes, 2, &id_a), run_b = fresh_run_images<S>(sizes, 2, &id_b);
  CHECK(id_a != 0);
  CHECK(id_b != 0);
  CHECK(id_a != id_b);
  // Same step (0), same control block, same (zero) moments: only the run tells rank 1 of run B from rank 1 of run A.
  S target(host, single_communicator{}, memkit::default_host_resource(), sizes);
  const std::uint64_t target_id = target.run_id();
  const std::vector<std::byte> before(target.arena_view().begin(), target.arena_view().end());
  auto load = [&](const std::string& first, const std::string& second) {
    std::stringstream a(first), b(second);
    std::istream* images[] = {&a, &b};
    target.load(host, std::span<std::istream* const>(images));
  };
  CHECK_THROWS_WITH_AS(load(run_a[0], run_b[1]),
                       doctest::Contains(("image 1: from run " + std::to_string(id_b) + ", image 0 from run " +
                                          std::to_string(id_a) + " (images of different runs)").c_str()),
                       memkit::error);
  CHECK(std::equal(before.begin(), before.end(), target.arena_view().begin()));  // nothing half-loaded
  CHECK(target.run_id() == target_id);
  CHECK_FALSE(target.run_id_bound());
  // The ranks of one run load, and the fresh state joins that run.
  load(run_a[1], run_a[0]);
  CHECK(target.run_id() == id_a);
  CHECK(target.run_id_bound());
  // Now bound to run A: run B's images (same step) are refused, and so are they by a state that has stepped.
  CHECK_THROWS_WITH_AS(load(run_b[0], run_b[1]), doctest::Contains(("this state belongs to run " + std::to_string(id_a)).c_str()),
                       memkit::error);
  CHECK(target.run_id() == id_a);
  S stepped(host, single_communicator{}, memkit::default_host_resource(), sizes);
  std::vector<float> params(static_cast<std::size_t>(stepped.flat_size()), 0.5f), grads(params.size(), 0.01f);
  stepped.step_full_gradients(host, single_communicator{}, memkit::host_view(params), memkit::host_view(grads),
                              sharded_test::groups);
  CHECK(stepped.run_id_bound());
  std::stringstream b0(run_b[0]), b1(run_b[1]);
  std::istream* images_b[] = {&b0, &b1};
  CHECK_THROWS_WITH_AS(stepped.load(host, std::span<std::istream* const>(images_b)),
                       doctest::Contains(("this state belongs to run " + std::to_string(stepped.run_id())).c_str()), memkit::error);
  CHECK(stepped.control(host).step == 1);
  // A given id is deterministic (tests, job ids) and binds at once; 0 is no id.
  S given(host, single_communicator{}, memkit::default_host_resource(), sizes, {}, 42);
  CHECK(given.run_id() == 42);
  CHECK(given.run_id_bound());
  CHECK_THROWS_WITH_AS(given.set_run_id(0), doctest::Contains("0 is not a run id"), memkit::error);
}

TEST_CASE("sharded_adam: images of format version 1 and images naming run 0 are refused, saying why (#35)") {
  using S = sharded_adam_state<float>;
  const std::vector<std::int64_t> sizes{5000, 300};
  S state(host, single_communicator{}, memkit::default_host_resource(), sizes, {}, 7);
  std::stringstream saved;
  state.save(host, saved);
  S target(host, single_communicator{}, memkit::default_host_resource(), sizes);
  {
    std::string image = saved.str();
    std::uint32_t magic_length = 0;
    std::memcpy(&magic_length, image.data(), 4);
    const std::uint32_t version = 1;
    std::memcpy(image.data() + 4 + magic_length, &version, 4);
    std::stringstream in(image);
    CHECK_THROWS_WITH_AS(target.load(host, in),
                         doctest::Contains("format version 1, this build reads 2 (version 1 images name no run"), memkit::error);
  }
  {
    image_parts parts = split_image<S>(saved.str(), sizes.size());
    const std::uint64_t zero = 0;
    std::memcpy(parts.body.data() + parts.control_at - 8 - 8 * sizes.size() - 8, &zero, 8);
    std::stringstream in(forged<S>(parts));
    CHECK_THROWS_WITH_AS(target.load(host, in), doctest::Contains("run id 0"), memkit::error);
  }
  CHECK_FALSE(target.run_id_bound());
}

namespace {

// A one-rank save after two steps, loaded by each rank of four: every rank keeps exactly its shard's moments
// (the body streams through; only this rank's part is kept).
template <class State, int Block>
void check_one_to_four(const memkit::optim::adam_options& options) {
  using S = sharded_adam_state<State, Block>;
  const std::vector<std::int64_t> sizes{5000, 300, 70000};
  S source(host, single_communicator{}, memkit::default_host_resource(), sizes, options);
  std::vector<float> params(static_cast<std::size_t>(source.flat_size()), 0.5f), grads(params.size());
  for (int s = 0; s < 2; ++s) {
    for (std::size_t i = 0; i < grads.size(); ++i) grads[i] = 0.001f * static_cast<float>((i * 7 + s) % 23) - 0.01f;
    source.step_full_gradients(host, single_communicator{}, memkit::host_view(params), memkit::host_view(grads),
                               sharded_test::groups);
  }
  std::stringstream saved;
  source.save(host, saved);
  std::vector<std::byte> slot;
  int mismatches = 0;
  std::int64_t kept = 0;
  for (int r = 0; r < 4; ++r) {
    S rank(host, sequential_ranks{r, 4, &slot}, memkit::default_host_resource(), sizes, options);
    std::stringstream in(saved.str());
    rank.load(host, in);
    CHECK(rank.control(host).step == 2);
    CHECK(rank.run_id() == source.run_id());
    for (const memkit::distributed::shard_piece& p : rank.pieces()) {
      std::vector<float> m, v, ref_m, ref_v;
      rank.read_moments(host, static_cast<std::size_t>(p.tensor), m, v);
      source.read_moments(host, static_cast<std::size_t>(p.tensor), ref_m, ref_v);
      for (std::int64_t j = 0; j < p.count(); ++j)
        if (!sharded_test::same_bits(m[static_cast<std::size_t>(j)], ref_m[static_cast<std::size_t>(p.begin + j)]) ||
            !sharded_test::same_bits(v[static_cast<std::size_t>(j)], ref_v[static_cast<std::size_t>(p.begin + j)]))
          ++mismatches;
      kept += p.count();
    }
  }
  CHECK(mismatches == 0);
  CHECK(kept == 5000 + 300 + 70000);
}

}  // namespace

TEST_CASE("sharded_adam: a one-rank save streams into four ranks, each keeping its shard bit for bit") {
  check_one_to_four<float, memkit::optim::adam_state_traits<float>::default_block>({});
  check_one_to_four<std::int8_t, 256>({.min_quantized_size = 4096});
}
