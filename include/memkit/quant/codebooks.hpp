// memkit/quant/codebooks.hpp — the 4-bit and 8-bit code tables of bitsandbytes, and the nearest-code rules.
//
// NF4 (QLoRA's normal-float 4-bit), FP4 (bitsandbytes' e2m1 variant) and the signed / unsigned dynamic
// 8-bit maps of the 8-bit optimizers paper. Each table is the exact float32 table bitsandbytes uses, and
// each nearest-code function reproduces bitsandbytes' comparison order and tie rule, so that codes agree
// bit for bit. The lookups are MEMKIT_HOST_DEVICE: the host loops and the CUDA kernels call the same code.
//
// Code tables in device code: a namespace-scope constexpr array cannot be indexed at run time by a kernel,
// so kernels take a table by value (code_table<N>) or read it from memory, and pass a pointer to these
// functions; host code passes the constexpr table's data().
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "memkit/config.hpp"

MEMKIT_NAMESPACE_BEGIN

namespace quant {

// NF4 value of a code (low 4 bits used): code 7 is exactly 0, code 15 is exactly 1.
MEMKIT_HOST_DEVICE constexpr float nf4_value(std::uint8_t code) noexcept {
  // A function-local table: legal in device code, unlike indexing the namespace-scope array.
  constexpr float values[16] = {-1.0f,
                                -0.6961928009986877f,
                                -0.5250730514526367f,
                                -0.39491748809814453f,
                                -0.28444138169288635f,
                                -0.18477343022823334f,
                                -0.09105003625154495f,
                                0.0f,
                                0.07958029955625534f,
                                0.16093020141124725f,
                                0.24611230194568634f,
                                0.33791524171829224f,
                                0.44070982933044434f,
                                0.5626170039176941f,
                                0.7229568362236023f,
                                1.0f};
  return values[code & 0x0f];
}

// The 16 NF4 values, indexed by 4-bit code (the same table as nf4_value, for host code that wants an array).
inline constexpr std::array<float, 16> nf4_codebook = [] {
  std::array<float, 16> values{};
  for (std::size_t code = 0; code < values.size(); ++code) values[code] = nf4_value(static_cast<std::uint8_t>(code));
  return values;
}();

// FP4, indexed by code: bit 3 is the sign, bits 2..0 select a magnitude out of {0, 0.0625, 8, 12, 4, 6, 2, 3},
// normalised by 12 (the largest) with one float32 division, as bitsandbytes builds its quant_map (whose
// entry 8 is +0: its list spells it as the integer -0). Decoding code 8 with fp4_value gives -0.0f, as
// bitsandbytes' kernels do; the two compare equal.
inline constexpr std::array<float, 16> fp4_codebook = {
    0.0f,         0.0625f / 12.0f,  8.0f / 12.0f,  12.0f / 12.0f, 4.0f / 12.0f,  6.0f / 12.0f,
    2.0f / 12.0f, 3.0f / 12.0f,     0.0f,          -0.0625f / 12.0f, -8.0f / 12.0f, -12.0f / 12.0f,
    -4.0f / 12.0f, -6.0f / 12.0f,   -2.0f / 12.0f, -3.0f / 12.0f,
};

// Signed dynamic 8-bit map (bitsandbytes create_dynamic_map(signed=True)): 127 negative values, 0 at index 127,
// 127 positive values and 1.0 at index 255; the smallest is -0.99296875 (there is no -1).
//
// Built per decade i = 0..6 from the bin midpoints of linspace(0.1, 1, 2^i + 1) scaled by 10^(i-6), mirrored,
// plus 0 and 1, sorted. Every step is float32 arithmetic as PyTorch's scalar CPU path performs it: linspace
// as start + step*k below the halfway index and end - step*(steps-1-k) from it, step = (1 - 0.1f)/(steps - 1),
// midpoints (a + b)/2, then float(10^(i-6)) * midpoint. (PyTorch's SIMD linspace can differ from this in the
// last bit of some entries, depending on the CPU; checkpoints carry their map, and loaders use the stored one.)
// The test suite rebuilds both maps with this recipe and checks every entry.
inline constexpr std::array<float, 256> dynamic_map_signed = {
    -0x1.fc6666p-1f, -0x1.f53334p-1f, -0x1.eep-1f, -0x1.e6ccccp-1f,
    -0x1.df999ap-1f, -0x1.d86666p-1f, -0x1.d13334p-1f, -0x1.cap-1f,
    -0x1.c2ccccp-1f, -0x1.bb999ap-1f, -0x1.b46666p-1f, -0x1.ad3334p-1f,
    -0x1.a6p-1f, -0x1.9eccccp-1f, -0x1.97999ap-1f, -0x1.906666p-1f,
    -0x1.893334p-1f, -0x1.82p-1f, -0x1.7acccep-1f, -0x1.73999ap-1f,
    -0x1.6c6666p-1f, -0x1.653334p-1f, -0x1.5ep-1f, -0x1.56cccep-1f,
    -0x1.4f999ap-1f, -0x1.486666p-1f, -0x1.413334p-1f, -0x1.3ap-1f,
    -0x1.32cccep-1f, -0x1.2b999ap-1f, -0x1.246666p-1f, -0x1.1d3334p-1f,
    -0x1.16p-1f, -0x1.0eccccp-1f, -0x1.07999ap-1f, -0x1.006666p-1f,
    -0x1.f26664p-2f, -0x1.e4p-2f, -0x1.d59998p-2f, -0x1.c73332p-2f,
    -0x1.b8ccccp-2f, -0x1.aa6664p-2f, -0x1.9cp-2f, -0x1.8d9998p-2f,
    -0x1.7f3334p-2f, -0x1.70ccccp-2f, -0x1.626664p-2f, -0x1.54p-2f,
    -0x1.459998p-2f, -0x1.373334p-2f, -0x1.28ccccp-2f, -0x1.1a6666p-2f,
    -0x1.0cp-2f, -0x1.fb3332p-3f, -0x1.de6666p-3f, -0x1.c1999ap-3f,
    -0x1.a4ccccp-3f, -0x1.88p-3f, -0x1.6b3332p-3f, -0x1.4e6666p-3f,
    -0x1.31999ap-3f, -0x1.14ccccp-3f, -0x1.fp-4f, -0x1.b66668p-4f,
    -0x1.93d70ap-4f, -0x1.8851eep-4f, -0x1.7ccccep-4f, -0x1.7147aep-4f,
    -0x1.65c29p-4f, -0x1.5a3d7p-4f, -0x1.4eb854p-4f, -0x1.433334p-4f,
    -0x1.37ae16p-4f, -0x1.2c28f6p-4f, -0x1.20a3d6p-4f, -0x1.151ebap-4f,
    -0x1.09999ap-4f, -0x1.fc28f6p-5f, -0x1.e51ebap-5f, -0x1.ce147ap-5f,
    -0x1.b70a4p-5f, -0x1.ap-5f, -0x1.88f5c2p-5f, -0x1.71eb84p-5f,
    -0x1.5ae146p-5f, -0x1.43d70ap-5f, -0x1.2ccccep-5f, -0x1.15c28ep-5f,
    -0x1.fd70a4p-6f, -0x1.cf5c26p-6f, -0x1.a147aep-6f, -0x1.733334p-6f,
    -0x1.451eb8p-6f, -0x1.170a3ep-6f, -0x1.d1eb86p-7f, -0x1.75c29p-7f,
    -0x1.3e76c8p-7f, -0x1.2c083p-7f, -0x1.19999ap-7f, -0x1.072b02p-7f,
    -0x1.e978d4p-8f, -0x1.c49ba6p-8f, -0x1.9fbe78p-8f, -0x1.7ae148p-8f,
    -0x1.56041ap-8f, -0x1.3126e8p-8f, -0x1.0c49bap-8f, -0x1.ced914p-9f,
    -0x1.851eb8p-9f, -0x1.3b645ap-9f, -0x1.e353f8p-10f, -0x1.4fdf3ap-10f,
    -0x1.eecbfep-11f, -0x1.b3d07cp-11f, -0x1.78d5p-11f, -0x1.3dd982p-11f,
    -0x1.02dep-11f, -0x1.8fc504p-12f, -0x1.19ce0ap-12f, -0x1.47ae16p-13f,
    -0x1.743e96p-14f, -0x1.15df66p-14f, -0x1.6f0068p-15f, -0x1.64840cp-16f,
    -0x1.040bfep-17f, -0x1.b43528p-19f, -0x1.27476ep-21f, 0.0f,
    0x1.27476ep-21f, 0x1.b43528p-19f, 0x1.040bfep-17f, 0x1.64840cp-16f,
    0x1.6f0068p-15f, 0x1.15df66p-14f, 0x1.743e96p-14f, 0x1.47ae16p-13f,
    0x1.19ce0ap-12f, 0x1.8fc504p-12f, 0x1.02dep-11f, 0x1.3dd982p-11f,
    0x1.78d5p-11f, 0x1.b3d07cp-11f, 0x1.eecbfep-11f, 0x1.4fdf3ap-10f,
    0x1.e353f8p-10f, 0x1.3b645ap-9f, 0x1.851eb8p-9f, 0x1.ced914p-9f,
    0x1.0c49bap-8f, 0x1.3126e8p-8f, 0x1.56041ap-8f, 0x1.7ae148p-8f,
    0x1.9fbe78p-8f, 0x1.c49ba6p-8f, 0x1.e978d4p-8f, 0x1.072b02p-7f,
    0x1.19999ap-7f, 0x1.2c083p-7f, 0x1.3e76c8p-7f, 0x1.75c29p-7f,
    0x1.d1eb86p-7f, 0x1.170a3ep-6f, 0x1.451eb8p-6f, 0x1.733334p-6f,
    0x1.a147aep-6f, 0x1.cf5c26p-6f, 0x1.fd70a4p-6f, 0x1.15c28ep-5f,
    0x1.2ccccep-5f, 0x1.43d70ap-5f, 0x1.5ae146p-5f, 0x1.71eb84p-5f,
    0x1.88f5c2p-5f, 0x1.ap-5f, 0x1.b70a4p-5f, 0x1.ce147ap-5f,
    0x1.e51ebap-5f, 0x1.fc28f6p-5f, 0x1.09999ap-4f, 0x1.151ebap-4f,
    0x1.20a3d6p-4f, 0x1.2c28f6p-4f, 0x1.37ae16p-4f, 0x1.433334p-4f,
    0x1.4eb854p-4f, 0x1.5a3d7p-4f, 0x1.65c29p-4f, 0x1.7147aep-4f,
    0x1.7ccccep-4f, 0x1.8851eep-4f, 0x1.93d70ap-4f, 0x1.b66668p-4f,
    0x1.fp-4f, 0x1.14ccccp-3f, 0x1.31999ap-3f, 0x1.4e6666p-3f,
    0x1.6b3332p-3f, 0x1.88p-3f, 0x1.a4ccccp-3f, 0x1.c1999ap-3f,
    0x1.de6666p-3f, 0x1.fb3332p-3f, 0x1.0cp-2f, 0x1.1a6666p-2f,
    0x1.28ccccp-2f, 0x1.373334p-2f, 0x1.459998p-2f, 0x1.54p-2f,
    0x1.626664p-2f, 0x1.70ccccp-2f, 0x1.7f3334p-2f, 0x1.8d9998p-2f,
    0x1.9cp-2f, 0x1.aa6664p-2f, 0x1.b8ccccp-2f, 0x1.c73332p-2f,
    0x1.d59998p-2f, 0x1.e4p-2f, 0x1.f26664p-2f, 0x1.006666p-1f,
    0x1.07999ap-1f, 0x1.0eccccp-1f, 0x1.16p-1f, 0x1.1d3334p-1f,
    0x1.246666p-1f, 0x1.2b999ap-1f, 0x1.32cccep-1f, 0x1.3ap-1f,
    0x1.413334p-1f, 0x1.486666p-1f, 0x1.4f999ap-1f, 0x1.56cccep-1f,
    0x1.5ep-1f, 0x1.653334p-1f, 0x1.6c6666p-1f, 0x1.73999ap-1f,
    0x1.7acccep-1f, 0x1.82p-1f, 0x1.893334p-1f, 0x1.906666p-1f,
    0x1.97999ap-1f, 0x1.9eccccp-1f, 0x1.a6p-1f, 0x1.ad3334p-1f,
    0x1.b46666p-1f, 0x1.bb999ap-1f, 0x1.c2ccccp-1f, 0x1.cap-1f,
    0x1.d13334p-1f, 0x1.d86666p-1f, 0x1.df999ap-1f, 0x1.e6ccccp-1f,
    0x1.eep-1f, 0x1.f53334p-1f, 0x1.fc6666p-1f, 0x1p+0f,
};

// Unsigned dynamic 8-bit map (create_dynamic_map(signed=False)): 0 at index 0, 254 positive values from
// linspace(0.1, 1, 2^(i+1) + 1) per decade, and 1.0 at index 255.
inline constexpr std::array<float, 256> dynamic_map_unsigned = {
    0.0f, 0x1.5cf754p-22f, 0x1.a0133p-21f, 0x1.1d367p-19f,
    0x1.2599ecp-18f, 0x1.bc98a2p-18f, 0x1.29cbaap-17f, 0x1.0624dcp-16f,
    0x1.c2e34p-16f, 0x1.3fd0cep-15f, 0x1.9e3p-15f, 0x1.fc8f34p-15f,
    0x1.2d7732p-14f, 0x1.5ca6c8p-14f, 0x1.8bd662p-14f, 0x1.0cb296p-13f,
    0x1.82a994p-13f, 0x1.f8a09p-13f, 0x1.374bc8p-12f, 0x1.724744p-12f,
    0x1.ad42c4p-12f, 0x1.e83e44p-12f, 0x1.119ce2p-11f, 0x1.2f1aap-11f,
    0x1.4c9862p-11f, 0x1.6a162p-11f, 0x1.8793dep-11f, 0x1.a511ap-11f,
    0x1.c28f5ep-11f, 0x1.e00d1cp-11f, 0x1.fd8adcp-11f, 0x1.2b020cp-10f,
    0x1.74bc6ap-10f, 0x1.be76c8p-10f, 0x1.041892p-9f, 0x1.28f5c2p-9f,
    0x1.4dd2fp-9f, 0x1.72b01ep-9f, 0x1.978d4ep-9f, 0x1.bc6a7cp-9f,
    0x1.e147aep-9f, 0x1.03126ep-8f, 0x1.158104p-8f, 0x1.27ef9cp-8f,
    0x1.3a5e34p-8f, 0x1.4cccccp-8f, 0x1.5f3b66p-8f, 0x1.71a9fap-8f,
    0x1.841894p-8f, 0x1.96872ap-8f, 0x1.a8f5c2p-8f, 0x1.bb645cp-8f,
    0x1.cdd2fp-8f, 0x1.e0418ap-8f, 0x1.f2b02p-8f, 0x1.028f5cp-7f,
    0x1.0bc6a8p-7f, 0x1.14fdf2p-7f, 0x1.1e354p-7f, 0x1.276c8ap-7f,
    0x1.30a3d6p-7f, 0x1.39db24p-7f, 0x1.43126ep-7f, 0x1.5eb854p-7f,
    0x1.8ccccep-7f, 0x1.bae146p-7f, 0x1.e8f5c4p-7f, 0x1.0b851ep-6f,
    0x1.228f5cp-6f, 0x1.39999ap-6f, 0x1.50a3d6p-6f, 0x1.67ae16p-6f,
    0x1.7eb852p-6f, 0x1.95c28ep-6f, 0x1.accccep-6f, 0x1.c3d70ap-6f,
    0x1.dae146p-6f, 0x1.f1eb86p-6f, 0x1.047aep-5f, 0x1.1p-5f,
    0x1.1b851ep-5f, 0x1.270a3ep-5f, 0x1.328f5ep-5f, 0x1.3e147ap-5f,
    0x1.49999ap-5f, 0x1.551eb6p-5f, 0x1.60a3d6p-5f, 0x1.6c28f6p-5f,
    0x1.77ae14p-5f, 0x1.833334p-5f, 0x1.8eb85p-5f, 0x1.9a3d7p-5f,
    0x1.a5c29p-5f, 0x1.b147aep-5f, 0x1.bccccep-5f, 0x1.c851eep-5f,
    0x1.d3d70ap-5f, 0x1.df5c2ap-5f, 0x1.eae14ap-5f, 0x1.f66666p-5f,
    0x1.00f5c4p-4f, 0x1.06b852p-4f, 0x1.0c7ae2p-4f, 0x1.123d72p-4f,
    0x1.18p-4f, 0x1.1dc29p-4f, 0x1.23851ep-4f, 0x1.2947aep-4f,
    0x1.2f0a3ep-4f, 0x1.34cccep-4f, 0x1.3a8f5ep-4f, 0x1.4051ecp-4f,
    0x1.46147cp-4f, 0x1.4bd70ap-4f, 0x1.51999ap-4f, 0x1.575c2ap-4f,
    0x1.5d1eb8p-4f, 0x1.62e148p-4f, 0x1.68a3d6p-4f, 0x1.6e6666p-4f,
    0x1.7428f6p-4f, 0x1.79eb86p-4f, 0x1.7fae16p-4f, 0x1.8570a4p-4f,
    0x1.8b3334p-4f, 0x1.90f5c4p-4f, 0x1.96b852p-4f, 0x1.a8p-4f,
    0x1.c4ccccp-4f, 0x1.e1999ap-4f, 0x1.fe6666p-4f, 0x1.0d9998p-3f,
    0x1.1cp-3f, 0x1.2a6668p-3f, 0x1.38ccccp-3f, 0x1.473334p-3f,
    0x1.559998p-3f, 0x1.64p-3f, 0x1.726666p-3f, 0x1.80ccccp-3f,
    0x1.8f3334p-3f, 0x1.9d9998p-3f, 0x1.acp-3f, 0x1.ba6666p-3f,
    0x1.c8ccccp-3f, 0x1.d73334p-3f, 0x1.e5999ap-3f, 0x1.f4p-3f,
    0x1.013334p-2f, 0x1.086666p-2f, 0x1.0f9998p-2f, 0x1.16ccccp-2f,
    0x1.1ep-2f, 0x1.253334p-2f, 0x1.2c6666p-2f, 0x1.339998p-2f,
    0x1.3accccp-2f, 0x1.42p-2f, 0x1.493334p-2f, 0x1.506666p-2f,
    0x1.579998p-2f, 0x1.5eccccp-2f, 0x1.66p-2f, 0x1.6d3332p-2f,
    0x1.746666p-2f, 0x1.7b9998p-2f, 0x1.82ccccp-2f, 0x1.8ap-2f,
    0x1.913332p-2f, 0x1.986666p-2f, 0x1.9f9998p-2f, 0x1.a6ccccp-2f,
    0x1.aep-2f, 0x1.b53332p-2f, 0x1.bc6664p-2f, 0x1.c39998p-2f,
    0x1.caccccp-2f, 0x1.d2p-2f, 0x1.d93332p-2f, 0x1.e06664p-2f,
    0x1.e79998p-2f, 0x1.eeccccp-2f, 0x1.f6p-2f, 0x1.fd3332p-2f,
    0x1.023334p-1f, 0x1.05ccccp-1f, 0x1.096668p-1f, 0x1.0dp-1f,
    0x1.109998p-1f, 0x1.143334p-1f, 0x1.17ccccp-1f, 0x1.1b6668p-1f,
    0x1.1fp-1f, 0x1.22999ap-1f, 0x1.263334p-1f, 0x1.29ccccp-1f,
    0x1.2d6668p-1f, 0x1.31p-1f, 0x1.34999ap-1f, 0x1.383334p-1f,
    0x1.3bccccp-1f, 0x1.3f6668p-1f, 0x1.43p-1f, 0x1.46999ap-1f,
    0x1.4a3334p-1f, 0x1.4dccccp-1f, 0x1.516668p-1f, 0x1.55p-1f,
    0x1.58999ap-1f, 0x1.5c3334p-1f, 0x1.5fccccp-1f, 0x1.636668p-1f,
    0x1.67p-1f, 0x1.6a999ap-1f, 0x1.6e3334p-1f, 0x1.71ccccp-1f,
    0x1.756668p-1f, 0x1.79p-1f, 0x1.7c999ap-1f, 0x1.803334p-1f,
    0x1.83ccccp-1f, 0x1.876668p-1f, 0x1.8bp-1f, 0x1.8e9998p-1f,
    0x1.923334p-1f, 0x1.95ccccp-1f, 0x1.996668p-1f, 0x1.9dp-1f,
    0x1.a09998p-1f, 0x1.a43334p-1f, 0x1.a7ccccp-1f, 0x1.ab6668p-1f,
    0x1.afp-1f, 0x1.b29998p-1f, 0x1.b63334p-1f, 0x1.b9ccccp-1f,
    0x1.bd6668p-1f, 0x1.c1p-1f, 0x1.c49998p-1f, 0x1.c83334p-1f,
    0x1.cbccccp-1f, 0x1.cf6668p-1f, 0x1.d3p-1f, 0x1.d69998p-1f,
    0x1.da3334p-1f, 0x1.ddccccp-1f, 0x1.e16668p-1f, 0x1.e5p-1f,
    0x1.e89998p-1f, 0x1.ec3334p-1f, 0x1.efccccp-1f, 0x1.f36668p-1f,
    0x1.f7p-1f, 0x1.fa9998p-1f, 0x1.fe3334p-1f, 0x1p+0f,
};

// A code table passed by value, e.g. as a kernel argument (device code cannot index the constexpr arrays).
template <int Size>
struct code_table {
  float value[Size];
};

template <std::size_t Size>
constexpr code_table<static_cast<int>(Size)> make_code_table(const std::array<float, Size>& values) noexcept {
  code_table<static_cast<int>(Size)> table{};
  for (std::size_t i = 0; i < Size; ++i) table.value[i] = values[i];
  return table;
}

// --- NF4 ---

// Nearest NF4 code of a normalised value. The thresholds are bitsandbytes' float literals (midpoints of
// adjacent NF4 values, rounded from decimal straight to float; they decide ties, so they are kept digit for
// digit), compared with a strict `>` in its tree order, so an exact tie goes to the lower code.
// NaN fails every comparison and yields code 0 (as in bitsandbytes, where an all-zero block gives 0 * inf).
MEMKIT_HOST_DEVICE constexpr std::uint8_t nearest_nf4(float x) noexcept {
  if (x > 0.03979014977812767f) {
    if (x > 0.3893125355243683f) {
      if (x > 0.6427869200706482f) return x > 0.8614784181118011f ? 15 : 14;
      return x > 0.5016634166240692f ? 13 : 12;
    }
    if (x > 0.2035212516784668f) return x > 0.2920137718319893f ? 11 : 10;
    return x > 0.1202552504837513f ? 9 : 8;
  }
  if (x > -0.33967943489551544f) {
    if (x > -0.13791173323988914f) return x > -0.045525018125772476f ? 7 : 6;
    return x > -0.23460740596055984f ? 5 : 4;
  }
  if (x > -0.6106329262256622f) return x > -0.4599952697753906f ? 3 : 2;
  return x > -0.8480964004993439f ? 1 : 0;
}

// --- FP4 ---

// Nearest FP4 code. The sign bit is set only for x < 0 (so -0.0 gives code 0); the magnitude goes down
// bitsandbytes' tree with its own float thresholds (written with bitsandbytes' digits, e.g. 0.583333 rather
// than 7/12, because the digits decide ties), strict `>` so ties go to the smaller magnitude.
MEMKIT_HOST_DEVICE constexpr std::uint8_t nearest_fp4(float x) noexcept {
  const std::uint8_t sign = x < 0.0f ? 0b1000 : 0;
  const float magnitude = x < 0.0f ? -x : x;
  std::uint8_t code = 0;
  if (magnitude > 0.29166667f) {
    if (magnitude > 0.583333f) code = magnitude > 0.8333333f ? 0b011 : 0b010;
    else code = magnitude > 0.4166667f ? 0b101 : 0b100;
  } else if (magnitude > 0.0859375f) {
    code = magnitude > 0.20833333f ? 0b111 : 0b110;
  } else {
    code = magnitude > 0.00260417f ? 0b001 : 0b000;
  }
  return static_cast<std::uint8_t>(code | sign);
}

// FP4 value of a code (low 4 bits used).
MEMKIT_HOST_DEVICE constexpr float fp4_value(std::uint8_t code) noexcept {
  constexpr float magnitudes[8] = {0.0f,         0.0625f / 12.0f, 8.0f / 12.0f, 12.0f / 12.0f,
                                   4.0f / 12.0f, 6.0f / 12.0f,    2.0f / 12.0f, 3.0f / 12.0f};
  const float magnitude = magnitudes[code & 0b111];
  return (code & 0b1000) ? -magnitude : magnitude;
}

// --- dynamic 8-bit maps ---

// Nearest entry of a sorted 256-entry map (bitsandbytes' dQuantize, non-stochastic). A 7-step binary search
// from index 127 leaves `pivot` and its two bracketing probes; the value then goes to whichever neighbour
// is past the float32 midpoint (a + b) * 0.5f, with a tie staying at `pivot`. Because the comparison
// depends on the search path, this is the rule to reproduce, not merely "nearest entry". NaN yields 0.
MEMKIT_HOST_DEVICE constexpr std::uint8_t nearest_dynamic(const float* map, float x) noexcept {
  int pivot = 127;
  int upper_index = 255;
  int lower_index = 0;
  float upper = 1.0f;
  float lower = -1.0f;
  float probe = map[pivot];
  for (int step = 64; step > 0; step >>= 1) {
    if (x > probe) {
      lower_index = pivot;
      lower = probe;
      pivot += step;
    } else {
      upper_index = pivot;
      upper = probe;
      pivot -= step;
    }
    probe = map[pivot];
  }
  // The search never probes index 255 and reaches index 0 only on its last step: take the ends from the map.
  if (upper_index == 255) upper = map[255];
  if (lower_index == 0) lower = map[0];
  if (x > probe) return static_cast<std::uint8_t>(x > (upper + probe) * 0.5f ? upper_index : pivot);
  return static_cast<std::uint8_t>(x < (lower + probe) * 0.5f ? lower_index : pivot);
}

}  // namespace quant

MEMKIT_NAMESPACE_END
