// distributed::export_consolidated: the per-rank shard files of a small model (dense bf16 / fp32, NF4 and FP4
// with and without double quantization) become one safetensors file byte for byte equal to the unsharded
// tensors written by safetensors::writer and quant::save_linear4bit, on 1, 2, 3 and 5 ranks, through one copy
// buffer (the tracked peak); missing, mixed, forged and non-finite rank files are refused with no output left.
// distributed::consolidated_export writes the same file from live shards gathered tensor by tensor (ranks as
// threads over an in-process communicator), each rank's tracked peak its bytes_required.
#include <memkit/distributed/consolidate.hpp>
#include <memkit/memory/tracking.hpp>

#include <doctest/doctest.h>

#include "support/thread_communicator.hpp"

#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

namespace dist = memkit::distributed;
namespace q = memkit::quant;
namespace st = memkit::safetensors;
using memkit::shape;

namespace {

std::string temp_path(const std::string& stem) {
  return "/tmp/memkit_export_" + stem + "_" + std::to_string(::getpid()) + ".safetensors";
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

bool exists(const std::string& path) { return memkit::io::path_exists(path); }

std::vector<float> values(std::int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = normal(rng);
  return v;
}

// A small model: every kind of tensor the export handles, in checkpoint order.
struct model {
  std::vector<memkit::bf16> embedding;  // [50, 24] bf16
  q::quantized_tensor<q::NF4> q_proj;   // [1000, 700] NF4, double quantization: 43 nested groups, the last partial
  q::quantized_tensor<q::FP4> down;     // [301, 129] FP4, block 128, fp32 scales: an odd element count
  q::quantized_tensor<q::NF4> tiny;     // [5, 7] NF4, double quantization: one unit, most ranks empty
  std::vector<float> norm;              // [37] fp32

  model()
      : q_proj(q::quantized_tensor<q::NF4>::quantize(memkit::host, memkit::host_view(values(700000, 1).data(), shape{1000, 700}),
                                                    {64, true}, memkit::default_host_resource())),
        down(q::quantized_tensor<q::FP4>::quantize(memkit::host, memkit::host_view(values(301 * 129, 2).data(), shape{301, 129}),
                                                  {128, false}, memkit::default_host_resource())),
        tiny(q::quantized_tensor<q::NF4>::quantize(memkit::host, memkit::host_view(values(35, 3).data(), shape{5, 7}),
                                                  {64, true}, memkit::default_host_resource())),
        norm(values(37, 4)) {
    for (float x : values(50 * 24, 5)) embedding.emplace_back(x);
  }

  // Rank `rank` of `ranks`: every tensor's shard saved into one file.
  void save_rank(const std::string& path, int rank, int ranks) const {
    memkit::memory_resource& r = memkit::default_host_resource();
    st::writer out;
    dist::sharded_dense<memkit::bf16>(memkit::tensor_view<const memkit::bf16>(embedding.data(), shape{50, 24}, memkit::memory_kind::host),
                                      rank, ranks, r).save(out, "model.embed_tokens.weight");
    dist::sharded_quantized<q::NF4>(q_proj, rank, ranks, r).save(out, "model.layers.0.self_attn.q_proj.weight");
    dist::sharded_quantized<q::FP4>(down, rank, ranks, r).save(out, "model.layers.0.mlp.down_proj.weight");
    dist::sharded_quantized<q::NF4>(tiny, rank, ranks, r).save(out, "model.layers.0.tiny.weight");
    dist::sharded_dense<float>(memkit::host_view(norm.data(), shape{37}), rank, ranks, r).save(out, "model.norm.weight");
    out.write(path);
  }

  // The unsharded export: what a peer would get from the whole model.
  void write_reference(const std::string& path) const {
    st::writer out;
    out.add_metadata("format", "pt");
    out.add("model.embed_tokens.weight", memkit::tensor_view<const memkit::bf16>(embedding.data(), shape{50, 24}, memkit::memory_kind::host));
    q::save_linear4bit(out, "model.layers.0.self_attn.q_proj.weight", q_proj);
    q::save_linear4bit(out, "model.layers.0.mlp.down_proj.weight", down);
    q::save_linear4bit(out, "model.layers.0.tiny.weight", tiny);
    out.add("model.norm.weight", memkit::host_view(norm.data(), shape{37}));
    out.write(path);
  }
};

// The rank files of one save, removed at scope exit, and readers over them.
struct saved {
  std::vector<std::string> paths;
  std::vector<std::unique_ptr<st::reader>> readers;
  saved(const model& m, int ranks, const std::string& stem) {
    for (int r = 0; r < ranks; ++r) {
      paths.push_back(temp_path(stem + "_rank" + std::to_string(r)));
      m.save_rank(paths.back(), r, ranks);
    }
    for (auto it = paths.rbegin(); it != paths.rend(); ++it) readers.push_back(std::make_unique<st::reader>(*it));  // any order
  }
  ~saved() {
    readers.clear();
    for (const std::string& p : paths) std::remove(p.c_str());
  }
  std::vector<const st::reader*> all() const {
    std::vector<const st::reader*> out;
    for (const auto& r : readers) out.push_back(r.get());
    return out;
  }
};

// Ranks as threads (tests/support/thread_communicator.hpp, shared with the stage-3 tests).
using thread_group = memkit_test::thread_ranks;

// Runs the export and returns its error, or "" when it succeeded.
std::string export_error(std::span<const st::reader* const> files, const std::string& path,
                         const dist::consolidate_options& o = {}) {
  try {
    dist::export_consolidated(files, path, o, memkit::default_host_resource());
  } catch (const memkit::error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("export_consolidated: shards of 1, 2, 3 and 5 ranks become the unsharded checkpoint, byte for byte") {
  const model m;
  const std::string reference = temp_path("reference");
  m.write_reference(reference);
  const std::string expected = file_bytes(reference);
  REQUIRE(expected.size() > 200000);
  for (const int ranks : {1, 2, 3, 5}) {
    CAPTURE(ranks);
    const saved files(m, ranks, "bytes");
    const std::string out = temp_path("out");
    memkit::tracking_resource tracker(memkit::default_host_resource(), "export");
    dist::consolidate_options o;
    o.chunk_bytes = 1000;  // smaller than most pieces and not a divisor of any: chunk boundaries everywhere
    const std::vector<const st::reader*> all = files.all();
    const dist::consolidate_report report =
        dist::export_consolidated(all, out, o, tracker.category(memkit::memory_category::workspace));
    CHECK(file_bytes(out) == expected);
    CHECK(report.tensors == 5);
    CHECK(report.ranks == ranks);
    // One copy buffer: the whole model (report.data_bytes) never in memory.
    CHECK(tracker.peak_bytes() == dist::consolidate_workspace_bytes(o));
    CHECK(report.data_bytes > 200 * tracker.peak_bytes());
    // A peer's loader reads it back: the 4-bit weight equals the tensor the shards were made from.
    const st::reader back(out);
    const auto q_proj = q::load_linear4bit<q::NF4>(back, "model.layers.0.self_attn.q_proj.weight", memkit::default_host_resource());
    CHECK(std::equal(q_proj.codes().begin(), q_proj.codes().end(), m.q_proj.codes().begin()));
    std::remove(out.c_str());
  }
  std::remove(reference.c_str());
}

TEST_CASE("export_consolidated: missing, repeated, mixed and forged rank files are refused before any output") {
  const model m;
  const saved three(m, 3, "three");
  const std::vector<const st::reader*> all = three.all();
  const std::string out = temp_path("refused");
  // A missing rank, a rank given twice.
  const std::vector<const st::reader*> two(all.begin(), all.begin() + 2);
  CHECK(export_error(two, out).find("was saved by 3 ranks, but 2 images were given") != std::string::npos);
  const std::vector<const st::reader*> twice{all[0], all[1], all[1]};
  CHECK(export_error(twice, out).find("appears twice") != std::string::npos);
  // Another model's rank file: one tensor of another shape, or another set of tensors.
  {
    model other;
    other.norm = values(38, 6);
    const std::string path = temp_path("other");
    st::writer w;
    dist::sharded_dense<float>(memkit::host_view(other.norm.data(), shape{38}), 1, 3, memkit::default_host_resource()).save(w, "model.norm.weight");
    dist::sharded_dense<memkit::bf16>(memkit::tensor_view<const memkit::bf16>(m.embedding.data(), shape{50, 24}, memkit::memory_kind::host),
                                      1, 3, memkit::default_host_resource()).save(w, "model.embed_tokens.weight");
    w.write(path);
    const st::reader partial(path);
    const std::vector<const st::reader*> mixed{all[0], &partial, all[2]};
    CHECK(export_error(mixed, out).find("hold shards of different tensors (files of different models?)") != std::string::npos);
    std::remove(path.c_str());
    // Rank 1 of a model whose norm has 38 elements, every other tensor as in `m`.
    st::writer w2;
    memkit::memory_resource& r = memkit::default_host_resource();
    dist::sharded_dense<memkit::bf16>(memkit::tensor_view<const memkit::bf16>(m.embedding.data(), shape{50, 24}, memkit::memory_kind::host),
                                      1, 3, r).save(w2, "model.embed_tokens.weight");
    dist::sharded_quantized<q::NF4>(m.q_proj, 1, 3, r).save(w2, "model.layers.0.self_attn.q_proj.weight");
    dist::sharded_quantized<q::FP4>(m.down, 1, 3, r).save(w2, "model.layers.0.mlp.down_proj.weight");
    dist::sharded_quantized<q::NF4>(m.tiny, 1, 3, r).save(w2, "model.layers.0.tiny.weight");
    dist::sharded_dense<float>(memkit::host_view(other.norm.data(), shape{38}), 1, 3, r).save(w2, "model.norm.weight");
    w2.write(path);
    const st::reader reshaped(path);
    const std::vector<const st::reader*> mixed_shape{all[0], &reshaped, all[2]};
    CHECK(export_error(mixed_shape, out).find("hold different layouts of 'model.norm.weight'") != std::string::npos);
    std::remove(path.c_str());
  }
  // Forged files: a piece shorter than its layout says, a layout claiming 2^40 elements over small pieces,
  // more than 2^40, a format bitsandbytes has no layout for. Nothing is allocated from the claimed sizes.
  const auto forged = [&](const std::string& layout, std::uint64_t piece_bytes, const std::string& suffix) {
    const std::string path = temp_path("forged");
    st::writer w;
    const std::vector<std::uint8_t> bytes(piece_bytes, 0);
    w.add_bytes("w" + suffix, "U8", {static_cast<std::int64_t>(piece_bytes)}, bytes.data(), piece_bytes);
    w.add_metadata("w", layout);
    w.write(path);
    const st::reader r(path);
    const std::vector<const st::reader*> one{&r};
    memkit::tracking_resource tracker(memkit::default_host_resource(), "forged");
    std::string message;
    try {
      dist::export_consolidated(one, out, {}, tracker);
    } catch (const memkit::error& e) {
      message = e.what();
    }
    CHECK(tracker.peak_bytes() == 0);
    std::remove(path.c_str());
    return message;
  };
  CHECK(forged(R"({"format":"F32","shape":[37],"ranks":1,"rank":0})", 147, ".values")
            .find("'w.values' is missing or not 148 bytes of U8, as its layout implies") != std::string::npos);
  CHECK(forged(R"({"format":"F32","shape":[1099511627776],"ranks":1,"rank":0})", 148, ".values")
            .find("is missing or not 4398046511104 bytes of U8") != std::string::npos);
  CHECK(forged(R"({"format":"F32","shape":[1099511627776,2],"ranks":1,"rank":0})", 148, ".values")
            .find("more than 2^40 elements") != std::string::npos);
  CHECK(forged(R"({"format":"int8","shape":[64],"block_size":64,"double_quant":false,"offset_bits":0,"ranks":1,"rank":0})",
               64, ".codes")
            .find("format 'int8' has no bitsandbytes 4-bit layout") != std::string::npos);
  CHECK(forged(R"({"format":"nf4","shape":[64],"block_size":48,"double_quant":false,"offset_bits":0,"ranks":1,"rank":0})",
               32, ".codes")
            .find("block size is not a power of two in 32..4096") != std::string::npos);
  CHECK(forged(R"({"format":"nf4","shape":[64],"block_size":64,"double_quant":true,"offset_bits":2143289344,"ranks":1,"rank":0})",
               32, ".codes")
            .find("the double-quantization offset is not finite") != std::string::npos);  // a NaN's bits
  CHECK(export_error(all, out, dist::consolidate_options{.chunk_bytes = 6}).find("chunk_bytes must be a positive multiple of 4") !=
        std::string::npos);
  CHECK_FALSE(exists(out));
}

TEST_CASE("export_consolidated: a non-finite scale found while writing leaves no file behind") {
  model m;
  m.down.absmax()[7] = std::numeric_limits<float>::quiet_NaN();  // what save_linear4bit refuses too
  const saved files(m, 2, "nan");
  const std::string out = temp_path("nan_out");
  const std::vector<const st::reader*> all = files.all();
  CHECK(export_error(all, out).find("'model.layers.0.mlp.down_proj.weight.scales' holds a non-finite scale") != std::string::npos);
  CHECK_FALSE(exists(out));
  CHECK_FALSE(exists(out + ".tmp-" + std::to_string(::getpid())));
}

TEST_CASE("consolidated_export: live shards gathered tensor by tensor write the same file; each rank's peak is bytes_required") {
  const model m;
  const std::string reference = temp_path("live_reference");
  m.write_reference(reference);
  const std::string expected = file_bytes(reference);
  for (const int ranks : {1, 2, 3}) {
    CAPTURE(ranks);
    const std::string out = temp_path("live_out");
    thread_group group(ranks);
    std::vector<int> ok(static_cast<std::size_t>(ranks), 0);
    group.run([&](const thread_group::communicator& comm) {
      memkit::memory_resource& r = memkit::default_host_resource();
      const int rank = comm.rank();
      const dist::sharded_dense<memkit::bf16> embedding(
          memkit::tensor_view<const memkit::bf16>(m.embedding.data(), shape{50, 24}, memkit::memory_kind::host), rank, ranks, r);
      const dist::sharded_quantized<q::NF4> q_proj(m.q_proj, rank, ranks, r);
      const dist::sharded_quantized<q::FP4> down(m.down, rank, ranks, r);
      const dist::sharded_quantized<q::NF4> tiny(m.tiny, rank, ranks, r);
      const dist::sharded_dense<float> norm(memkit::host_view(m.norm.data(), shape{37}), rank, ranks, r);
      dist::consolidate_options o;
      o.chunk_bytes = 1000;
      dist::consolidated_export<memkit::host_executor, thread_group::communicator> exporter(memkit::host, comm, o);
      exporter.add("model.embed_tokens.weight", embedding);
      exporter.add("model.layers.0.self_attn.q_proj.weight", q_proj);
      exporter.add("model.layers.0.mlp.down_proj.weight", down);
      exporter.add("model.layers.0.tiny.weight", tiny);
      exporter.add("model.norm.weight", norm);
      memkit::tracking_resource tracker(memkit::default_host_resource(), "live export");
      const dist::consolidate_report report = exporter.write(out, tracker.category(memkit::memory_category::weights),
                                                             tracker.category(memkit::memory_category::workspace),
                                                             tracker.category(memkit::memory_category::other));
      // The largest tensor whole (q_proj) and its gather's staging, and on the writer the copy buffer.
      const std::size_t largest = q::quantized_tensor<q::NF4>::bytes_required(shape{1000, 700}, {64, true}) +
                                  dist::sharded_quantized<q::NF4>::gather_workspace_bytes(shape{1000, 700}, {64, true}, ranks);
      const bool peak = exporter.bytes_required() == largest &&
                        tracker.peak_bytes() == largest + (rank == 0 ? dist::consolidate_workspace_bytes(o) : 0);
      ok[static_cast<std::size_t>(rank)] = peak && report.tensors == 5 && tracker.current_bytes() == 0 ? 1 : 0;
    });
    CHECK(ok == std::vector<int>(static_cast<std::size_t>(ranks), 1));
    CHECK(file_bytes(out) == expected);
    std::remove(out.c_str());
  }
  std::remove(reference.c_str());
}

TEST_CASE("consolidated_export: a non-finite gathered scale stops every rank and leaves no file") {
  model m;
  m.down.absmax()[3] = std::numeric_limits<float>::infinity();
  const std::string out = temp_path("live_nan");
  thread_group group(2);
  std::vector<std::string> errors(2);
  group.run([&](const thread_group::communicator& comm) {
    const dist::sharded_quantized<q::FP4> down(m.down, comm.rank(), 2, memkit::default_host_resource());
    dist::consolidated_export<memkit::host_executor, thread_group::communicator> exporter(memkit::host, comm);
    exporter.add("down", down);
    try {
      exporter.write(out, memkit::default_host_resource(), memkit::default_host_resource(), memkit::default_host_resource());
    } catch (const memkit::error& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const std::string& e : errors) CHECK(e.find("tensor 'down' has a non-finite value in block 3") != std::string::npos);
  CHECK_FALSE(exists(out));
}
