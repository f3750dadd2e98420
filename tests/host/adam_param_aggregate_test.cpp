// The documented two-member adam_param{param, grad} in a translation unit of its own that also builds a
// shape{0} view: g++ 12.2 was reported (issue 34) to crash on this with an internal compiler error in
// nothrow_spec_p while adam_param's `master` had a redundant `{}` default member initializer. This file
// includes nothing else of memkit, so no other code instantiates tensor_view<float> first; it must compile,
// and the omitted members must come out as a null master (a default view: absent) and group 0.
#include <doctest/doctest.h>
#include <memkit/optim/adam_state.hpp>

#include <vector>

TEST_CASE("adam_param: the two-member aggregate form beside a shape{0} view compiles and leaves master null") {
  float p[4] = {1, 2, 3, 4}, g[4] = {};
  memkit::tensor_view<float> param(p, memkit::shape{4}, memkit::memory_kind::host);
  memkit::tensor_view<const float> grad(g, memkit::shape{4}, memkit::memory_kind::host);
  memkit::tensor_view<float> empty(nullptr, memkit::shape{0}, memkit::memory_kind::host);
  memkit::optim::adam_param<float, float> one{param, grad};
  std::vector<memkit::optim::adam_param<float, float>> list{{param, grad}, {param, grad, empty, 1}};
  CHECK(one.master.data() == nullptr);
  CHECK(one.group == 0);
  CHECK(list[0].master.data() == nullptr);
  CHECK(list[1].group == 1);
  CHECK(empty.empty());
  static_assert(std::is_aggregate_v<memkit::optim::adam_param<float, float>>);
}
