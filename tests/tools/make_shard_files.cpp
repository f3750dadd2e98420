// Writes the per-rank shard files of a small model (bf16 embedding, NF4 with double quantization, FP4, fp32
// norm) saved on RANKS ranks, and the unsharded export a peer would get, for memkit-consolidate's CTest
// (tests/tools/consolidate_cli.cmake): usage make_shard_files DIR RANKS.
#include <memkit/distributed/sharded_parameters.hpp>
#include <memkit/quant/bnb_checkpoint.hpp>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: make_shard_files DIR RANKS\n");
    return 2;
  }
  const std::string dir = argv[1];
  const int ranks = std::stoi(argv[2]);
  namespace q = memkit::quant;
  namespace dist = memkit::distributed;
  using memkit::shape;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto values = [&](std::int64_t n) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (float& x : v) x = normal(rng);
    return v;
  };
  memkit::memory_resource& r = memkit::default_host_resource();
  std::vector<memkit::bf16> embedding;
  for (float x : values(64 * 16)) embedding.emplace_back(x);
  const memkit::tensor_view<const memkit::bf16> embedding_view(embedding.data(), shape{64, 16}, memkit::memory_kind::host);
  const std::vector<float> w = values(600 * 90), d = values(90 * 77), norm = values(16);
  const auto nf4 = q::quantized_tensor<q::NF4>::quantize(memkit::host, memkit::host_view(w.data(), shape{600, 90}), {64, true}, r);
  const auto fp4 = q::quantized_tensor<q::FP4>::quantize(memkit::host, memkit::host_view(d.data(), shape{90, 77}), {32, false}, r);
  for (int rank = 0; rank < ranks; ++rank) {
    memkit::safetensors::writer out;
    dist::sharded_dense<memkit::bf16>(embedding_view, rank, ranks, r).save(out, "model.embed_tokens.weight");
    dist::sharded_quantized<q::NF4>(nf4, rank, ranks, r).save(out, "model.layers.0.mlp.up_proj.weight");
    dist::sharded_quantized<q::FP4>(fp4, rank, ranks, r).save(out, "model.layers.0.mlp.down_proj.weight");
    dist::sharded_dense<float>(memkit::host_view(norm.data(), shape{16}), rank, ranks, r).save(out, "model.norm.weight");
    out.write(dir + "/rank" + std::to_string(rank) + ".safetensors");
  }
  memkit::safetensors::writer whole;
  whole.add_metadata("format", "pt");
  whole.add("model.embed_tokens.weight", embedding_view);
  q::save_linear4bit(whole, "model.layers.0.mlp.up_proj.weight", nf4);
  q::save_linear4bit(whole, "model.layers.0.mlp.down_proj.weight", fp4);
  whole.add("model.norm.weight", memkit::host_view(norm.data(), shape{16}));
  whole.write(dir + "/expected.safetensors");
  return 0;
}
