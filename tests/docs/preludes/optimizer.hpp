// What docs/optimizer.md's blocks use: an executor, a tracker, and bf16 parameters with gradients and fp32
// master copies for a [4096, 4096] weight and a [4096] bias.
#pragma once
#include <memkit/memkit.hpp>
inline const memkit::host_executor exec;
inline memkit::tracking_resource tracker(memkit::default_host_resource(), "train");
inline memkit::memory_resource& resource = memkit::default_host_resource();
inline std::vector<std::int64_t> sizes{4096 * 4096, 4096};
extern memkit::buffer<memkit::bf16> &w, &dw, &b, &db;
extern memkit::buffer<float> &w_master, &b_master;
