// distributed::sharded_quantized / sharded_dense over MPI (CTest runs this binary with mpirun -np 2 and -np 3):
// every rank quantizes the same tensor, keeps its shard, and gathers the whole tensor back bit for bit.
#include <doctest/doctest.h>
#include <memkit/distributed/mpi_communicator.hpp>
#include <memkit/distributed/sharded_parameters.hpp>
#include <memkit/memory/tracking.hpp>
#include <mpi.h>

#include <cstring>
#include <random>
#include <vector>

namespace {

const memkit::distributed::mpi_communicator& comm_world() {
  static const memkit::distributed::mpi_communicator comm(MPI_COMM_WORLD);
  return comm;
}

bool all_ranks(bool mine) {
  int local = mine ? 1 : 0, all = 0;
  MPI_Allreduce(&local, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

template <class A, class B>
bool same(memkit::tensor_view<A> a, memkit::tensor_view<B> b) {
  return a.bytes() == b.bytes() && (a.bytes() == 0 || std::memcmp(a.data(), b.data(), a.bytes()) == 0);
}

template <memkit::quant::format F>
void round_trip(const memkit::quant::quant_options& options) {
  using tensor = memkit::quant::quantized_tensor<F>;
  using sharded = memkit::distributed::sharded_quantized<F>;
  const memkit::shape dims{513, 300};  // partial last block and group; not a multiple of 2 or 3 ranks' units
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(dims.numel()));
  for (float& x : v) x = normal(rng);
  const tensor whole = tensor::quantize(memkit::host, memkit::host_view(v.data(), dims), options, memkit::default_host_resource());
  memkit::tracking_resource tracker(memkit::default_host_resource(), "shard");
  const sharded shard(whole, comm_world().rank(), comm_world().size(), tracker.category(memkit::memory_category::weights));
  const bool kept = tracker.current_bytes() == sharded::shard_bytes(dims, options, comm_world().size());
  tensor gathered(memkit::default_host_resource(), dims, options);
  shard.gather(memkit::host, comm_world(), gathered, tracker.category(memkit::memory_category::workspace));
  const bool equal = same(whole.codes(), gathered.codes()) &&
                     (options.double_quant ? same(whole.nested_codes(), gathered.nested_codes()) &&
                                                 same(whole.nested_group_absmax(), gathered.nested_group_absmax()) &&
                                                 same(whole.offset_view(), gathered.offset_view())
                                           : same(whole.absmax(), gathered.absmax()));
  CHECK(all_ranks(kept));
  CHECK(all_ranks(equal));
}

}  // namespace

TEST_CASE("sharded parameters over MPI: NF4 / FP4 / int8 shards gather back bit for bit") {
  CAPTURE(comm_world().size());
  round_trip<memkit::quant::NF4>({64, true});
  round_trip<memkit::quant::NF4>({64, false});
  round_trip<memkit::quant::FP4>({128, true});
  round_trip<memkit::quant::INT8>({256, false});
}

TEST_CASE("sharded parameters over MPI: a dense tensor's shards gather back") {
  const memkit::shape dims{101, 7};
  std::vector<float> v(static_cast<std::size_t>(dims.numel()));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) * 0.25f;
  const memkit::distributed::sharded_dense<float> shard(memkit::host_view(v.data(), dims), comm_world().rank(),
                                                        comm_world().size(), memkit::default_host_resource());
  std::vector<float> back(v.size());
  shard.gather(memkit::host, comm_world(), memkit::host_view(back.data(), dims), memkit::default_host_resource());
  CHECK(all_ranks(back == v));
}
