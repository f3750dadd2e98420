// Run by hand (not a test): g++ -std=c++20 -O1 -I include tests/sass/adam8_bank_model.cpp && ./a.out — the figures in
// docs/cuda.md ("8-bit lookups: the bank-conflict model").
// Bank-conflict model of the 8-bit Adam update's shared-memory lookups (32 banks x 4 bytes): for a warp of 32
// lanes, lane l holding elements 8l..8l+7 of a 256-element block, the wavefronts each LDS takes = the most
// distinct words any bank is asked for (the same word is a broadcast). Moments: m ~ N(0,1)*s, v ~ (N(0,1)*s)^2
// with a per-element scale s (lognormal, sigma 1), normalised by the block's absmax as the update does.
#include <memkit/optim/state_codecs.hpp>
#include <memkit/quant/dynamic_index.hpp>
#include <cmath>
#include <cstdio>
#include <random>
#include <map>
#include <set>
using namespace memkit;
using namespace memkit::optim::detail;
static constexpr dynamic_code_buckets mb = make_dynamic_code_buckets(quant::dynamic_map_signed);
static constexpr dynamic_code_buckets vb = make_dynamic_code_buckets(quant::dynamic_map_unsigned);
int wavefronts32(const unsigned* word) {  // 32 lanes, 4-byte accesses
  std::map<unsigned, std::set<unsigned>> bank;
  for (int l = 0; l < 32; ++l) bank[word[l] % 32].insert(word[l]);
  size_t w = 0; for (auto& [b, s] : bank) w = std::max(w, s.size());
  return (int)w;
}
int wavefronts64(const unsigned* pair) {  // 8-byte accesses: two half-warps, 16 banks pairs each
  int total = 0;
  for (int h = 0; h < 2; ++h) {
    std::map<unsigned, std::set<unsigned>> bank;
    for (int l = 16 * h; l < 16 * h + 16; ++l) bank[pair[l] % 16].insert(pair[l]);
    size_t w = 0; for (auto& [b, s] : bank) w = std::max(w, s.size());
    total += (int)w;
  }
  return total;
}
int main(int argc, char** argv) {
  const double sigma = argc > 1 ? atof(argv[1]) : 1.0;
  std::mt19937 rng(1);
  std::normal_distribution<float> n(0.f, 1.f);
  std::lognormal_distribution<float> scale(0.f, sigma);
  std::uniform_int_distribution<unsigned> uniform(0, 255);
  double deq_m = 0, deq_v = 0, deq_u = 0, low_m = 0, low_v = 0, pair_m = 0, pair_v = 0, rep4 = 0, rep8 = 0; long count = 0;
  for (int block = 0; block < 20000; ++block) {
    float m[256], v[256]; float mmax = 0, vmax = 0;
    for (int i = 0; i < 256; ++i) { float s = scale(rng); float g = n(rng) * s; m[i] = g; v[i] = g * g * (0.5f + std::fabs(n(rng))); mmax = std::max(mmax, std::fabs(m[i])); vmax = std::max(vmax, v[i]); }
    for (int k = 0; k < 8; ++k) {
      unsigned mc[32], vc[32], uc[32], mw[32], vw[32], mp[32], vp[32], r4[32], r8[32];
      for (int l = 0; l < 32; ++l) {
        const float xm = m[8 * l + k] / mmax, xv = v[8 * l + k] / vmax;
        mc[l] = dynamic_code(quant::dynamic_map_signed.data(), xm);
        vc[l] = dynamic_code(quant::dynamic_map_unsigned.data(), xv);
        uc[l] = uniform(rng);
        mw[l] = dynamic_bucket_of(bit_cast<std::uint32_t>(xm), mb.first_key, mb.positive) / 4;
        vw[l] = dynamic_bucket_of(bit_cast<std::uint32_t>(xv), vb.first_key, vb.positive) / 4;
        mp[l] = mb.low_code[dynamic_bucket_of(bit_cast<std::uint32_t>(xm), mb.first_key, mb.positive)];
        vp[l] = vb.low_code[dynamic_bucket_of(bit_cast<std::uint32_t>(xv), vb.first_key, vb.positive)];
        r4[l] = mc[l] * 4 + l % 4;  // 4 interleaved copies: lane l reads copy l % 4
        r8[l] = mc[l] * 8 + l % 8;
      }
      deq_m += wavefronts32(mc); deq_v += wavefronts32(vc); deq_u += wavefronts32(uc);
      low_m += wavefronts32(mw); low_v += wavefronts32(vw); pair_m += wavefronts64(mp); pair_v += wavefronts64(vp);
      rep4 += wavefronts32(r4); rep8 += wavefronts32(r8);
      ++count;
    }
  }
  printf("sigma %.1f: wavefronts per warp-wide LDS (1 = conflict-free; LDS.64 2 = conflict-free)\n", sigma);
  printf("  dequantize m_table[code] %.2f, v_table[code] %.2f, uniform random codes %.2f\n", deq_m / count, deq_v / count, deq_u / count);
  printf("  m with 4 / 8 interleaved copies %.2f / %.2f\n", rep4 / count, rep8 / count);
  printf("  requantize low code (LDS.U8) m %.2f v %.2f; threshold pair (LDS.64) m %.2f v %.2f\n", low_m / count, low_v / count, pair_m / count, pair_v / count);
}
