// GPU test cases: tagged with the "gpu" suite, run only when a CUDA device is present
// (see test_main.cpp). Use MEMKIT_GPU_TEST_CASE for anything that touches a device.
#pragma once

#include <doctest/doctest.h>

#define MEMKIT_GPU_TEST_CASE(name) TEST_CASE(name * doctest::test_suite("gpu"))
