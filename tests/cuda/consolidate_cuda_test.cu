// distributed::consolidated_export on a CUDA device (suite "gpu"): shards in device memory gathered through
// single_communicator with a cuda_executor, copied out to the file a chunk at a time; the file is byte for
// byte the host export of the same tensors (safetensors::writer + quant::save_linear4bit).
#include <memkit/distributed/communicator.hpp>
#include <memkit/distributed/consolidate.hpp>
#include <memkit/memory/resource.hpp>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

#include "support/gpu_test.hpp"
#include "support/test_values.hpp"

namespace {
std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}
}  // namespace

MEMKIT_GPU_TEST_CASE("consolidated_export: device shards gathered on one rank write the host export's bytes") {
  namespace dist = memkit::distributed;
  namespace q = memkit::quant;
  using memkit::shape;
  const std::vector<float> w = memkit_test::standard_normal(1000 * 700, 21), norm = memkit_test::standard_normal(37, 22);
  const auto nf4 = q::quantized_tensor<q::NF4>::quantize(memkit::host, memkit::host_view(w.data(), shape{1000, 700}), {64, true},
                                                         memkit::default_host_resource());
  const std::string reference = "/tmp/memkit_cuda_export_reference_" + std::to_string(::getpid()) + ".safetensors";
  const std::string out = "/tmp/memkit_cuda_export_" + std::to_string(::getpid()) + ".safetensors";
  {
    memkit::safetensors::writer whole;
    whole.add_metadata("format", "pt");
    q::save_linear4bit(whole, "up", nf4);
    whole.add("norm", memkit::host_view(norm.data(), shape{37}));
    whole.write(reference);
  }
  memkit::device_resource device;
  const memkit::cuda_executor exec = memkit::cuda_executor::legacy_default_stream();
  const dist::single_communicator one;
  // Shards made from host tensors into device memory (the constructors copy with cudaMemcpy).
  const dist::sharded_quantized<q::NF4> up(nf4, 0, 1, device);
  const dist::sharded_dense<float> norm_shard(memkit::host_view(norm.data(), shape{37}), 0, 1, device);
  dist::consolidate_options options;
  options.chunk_bytes = 4096;
  dist::consolidated_export<memkit::cuda_executor, dist::single_communicator> exporter(exec, one, options);
  exporter.add("up", up);
  exporter.add("norm", norm_shard);
  const dist::consolidate_report report = exporter.write(out, device, device, memkit::default_host_resource());
  CHECK(report.tensors == 2);
  CHECK(file_bytes(out) == file_bytes(reference));
  std::remove(out.c_str());
  std::remove(reference.c_str());
}
