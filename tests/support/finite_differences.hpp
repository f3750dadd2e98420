// Central finite differences of a scalar objective, checked against an analytic gradient: the loss tests' check of
// d_hidden and d_head (host and reduction none) in one place.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace memkit_test {

// For every `stride`-th element i of (p.*values): (objective(p with element +h) - objective(p with element -h)) / 2h
// must be within 2e-4 + 2e-2 |fd| of analytic[i]. Returns the largest |fd - analytic[i]| seen.
template <class Problem, class Objective, class Gradient>
double check_central_differences(const Problem& p, std::vector<float> Problem::*values, std::size_t stride, float h,
                                 const Objective& objective, const std::vector<Gradient>& analytic) {
  REQUIRE(analytic.size() == (p.*values).size());
  double worst = 0;
  for (std::size_t i = 0; i < (p.*values).size(); i += stride) {
    Problem plus = p, minus = p;
    (plus.*values)[i] += h;
    (minus.*values)[i] -= h;
    const double fd = (objective(plus) - objective(minus)) / (2.0 * h);
    const double difference = std::fabs(fd - static_cast<double>(analytic[i]));
    CAPTURE(i);
    CHECK(difference <= 2e-4 + 2e-2 * std::fabs(fd));
    worst = std::max(worst, difference);
  }
  return worst;
}

}  // namespace memkit_test
