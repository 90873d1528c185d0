// hk_w4a16's products and activation quantization: int4 group weights (q4.h) times activations
// quantized per row to int16 in blocks of 128 values (w8a16.h's quantize_rows16: absmax / 32767,
// round half to even), so the activations keep float32's precision where hk_w4a8's int8 blocks of
// 32 moved SmolLM2's perplexity by up to 1.6% (README.md).
//
// The nibbles become int16 without widening instructions: a 16-bit word of a packed line holds the
// bytes of inputs (4j + e, 4j + e + 1) of one column (e = 0 or 2), so `w & 15`, `w >> 8 & 15`,
// `w >> 4 & 15` and `w >> 12` give, per 32-bit lane (one column), the weights of inputs (4j, 4j + 2),
// (4j + 1, 4j + 3), (16 + 4j, 16 + 4j + 2) and (16 + 4j + 1, 16 + 4j + 3): vpdpwssd (AVX-512 VNNI) or
// vpmaddwd (AVX2) multiplies each by the matching pair of activations, which the quantization stores
// in the order x0, x2, x1, x3 per quad so that one 32-bit broadcast reads a pair. A lane sums a
// group's 32 products: 32 * 15 * 32767 < 2^31, exact.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "q4.h"
#include "w8a16.h"

namespace hk {

// The int16 side: per quad j, four broadcast pairs (inputs 4j, 4j + 2 | 4j + 1, 4j + 3 | the same + 16)
// meet the line's four nibble words.
struct A16 {
  static constexpr int kQuads = 4;
  static constexpr int64_t kBytes = GB;
  struct X512 {
    __m512i v[4];
  };
  struct X256 {
    __m256i v[4];
  };
  static void pairs(const Q4Problem& p, int64_t row, int64_t g, int j, int32_t* l) {
    for (int i = 0; i < 4; ++i) l[i] = lane(p.x16, p, row, g, 16 * (i >> 1) + 4 * j + 2 * (i & 1));
  }

  __attribute__((target("avx512f"))) static X512 acts512(const Q4Problem& p, int64_t row, int64_t g, int j) {
    int32_t l[4];
    pairs(p, row, g, j, l);
    return {{_mm512_set1_epi32(l[0]), _mm512_set1_epi32(l[1]), _mm512_set1_epi32(l[2]), _mm512_set1_epi32(l[3])}};
  }
  __attribute__((target("avx512f,avx512bw,avx512vnni"))) static __m512i dot512(__m512i a, __m512i v, const X512& x) {
    const __m512i low = _mm512_set1_epi16(0x0F);
    a = _mm512_dpwssd_epi32(a, _mm512_and_si512(v, low), x.v[0]);
    a = _mm512_dpwssd_epi32(a, _mm512_and_si512(_mm512_srli_epi16(v, 8), low), x.v[1]);
    a = _mm512_dpwssd_epi32(a, _mm512_and_si512(_mm512_srli_epi16(v, 4), low), x.v[2]);
    return _mm512_dpwssd_epi32(a, _mm512_srli_epi16(v, 12), x.v[3]);
  }
  __attribute__((target("avx2"))) static X256 acts256(const Q4Problem& p, int64_t row, int64_t g, int j) {
    int32_t l[4];
    pairs(p, row, g, j, l);
    return {{_mm256_set1_epi32(l[0]), _mm256_set1_epi32(l[1]), _mm256_set1_epi32(l[2]), _mm256_set1_epi32(l[3])}};
  }
  __attribute__((target("avx2"))) static __m256i dot256(__m256i s, __m256i v, const X256& x) {
    const __m256i low = _mm256_set1_epi16(0x0F);
    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_and_si256(v, low), x.v[0]));
    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 8), low), x.v[1]));
    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), x.v[2]));
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_srli_epi16(v, 12), x.v[3]));
  }
  static __m256i sums256(__m256i s) { return s; }  // int32 already
};

// Rows → int16 per 128 values (quantize_rows16), then per group: the quads reordered x0, x2, x1, x3,
// the block's scale and scale * the group's sum of q. Buffers are the calling thread's, reused.
inline void quantize_a16(const float* x, Q4Problem& p) {
  const int64_t ng = p.kp / G4, nb = blocks16(p.kp);
  thread_local std::vector<int16_t> q, x16;
  thread_local std::vector<float> d, xd, xs;
  thread_local std::vector<int32_t> c;  // quantize_rows16's +128 sums, which only hk_w8a16 reads
  q.resize(p.m * p.kp), x16.resize(p.m * p.kp), d.resize(p.m * nb), c.resize(p.m * nb * 2);
  xd.resize(p.m * ng), xs.resize(p.m * ng);
  quantize_rows16(x, p.m, p.k, p.kp, q.data(), d.data(), c.data());
  static constexpr int order[4] = {0, 2, 1, 3};
  for (int64_t r = 0; r < p.m; ++r) {
    for (int64_t g = 0; g < ng; ++g) {
      const int16_t* in = q.data() + r * p.kp + g * G4;
      int16_t* out = x16.data() + r * p.kp + g * G4;
      int32_t sum = 0;
      for (int64_t i = 0; i < G4; ++i) out[i] = in[i / 4 * 4 + order[i % 4]], sum += in[i];
      const int64_t at = r * ng + g;
      xd[at] = d[r * nb + g * G4 / QK16], xs[at] = xd[at] * static_cast<float>(sum);
    }
  }
  p.x16 = x16.data(), p.xd = xd.data(), p.xs = xs.data();
}

}  // namespace hk
