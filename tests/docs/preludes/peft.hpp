// What docs/peft_interop.md's blocks use: adapter tensors in host memory.
#pragma once
#include <memkit/memkit.hpp>
inline memkit::buffer<float> A(memkit::default_host_resource(), memkit::shape{8, 64}),
    B(memkit::default_host_resource(), memkit::shape{64, 8}), bias(memkit::default_host_resource(), memkit::shape{64}),
    A2(memkit::default_host_resource(), memkit::shape{8, 64}), B2(memkit::default_host_resource(), memkit::shape{64, 8});
namespace peft = memkit::peft;
extern const peft::adapter_file& adapter;  // the second block's: the first block's adapter
