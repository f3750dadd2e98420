// The nvcc build of the main example (memkit_example_train_llama_cuda): train_llama.cpp with its CUDA path
// (--device cuda / auto). A separate binary because nvcc builds memkit's host code without the x86 SIMD
// dispatch (core/host_simd.hpp), so the host default stays with the g++ build, memkit_example_train_llama.
#include "train_llama.cpp"
