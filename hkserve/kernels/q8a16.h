// hk_w8ga16's weight side: 8-bit groups (model/int4.py's Int8Group: w = scale * q + min per group of 32
// inputs and column, q in 0..255; what GGUF's Q5_0/Q5_1/Q5_K/Q8_0 blocks map into exactly) times the
// int16 activations of hk_w4a16 (q4a16.h's quantize_a16: per row, blocks of 128, each quad stored
// x0, x2, x1, x3). The loops, the float step per group (scale, min) and the threads are q4.h's.
//
// Packed layout (kernels/pack4.py pack8), per 64-column tile and group, 2048 bytes: 8 input quads j,
// each 4 column quarters, each 16 columns x 4 inputs (4j + e, a byte each). A 16-bit word of a line
// holds inputs (4j + e, 4j + e + 1) of one column (e = 0 or 2), so `w & 255` and `w >> 8` give, per
// 32-bit lane, the weights of inputs (4j, 4j + 2) and (4j + 1, 4j + 3): the activation pairs of
// quantize_a16's order. A lane sums a group's 32 products: 32 * 255 * 32767 < 2^31, exact.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "q4.h"

namespace hk {

struct A8G {
  static constexpr int kQuads = 8;
  static constexpr int64_t kBytes = 2048;
  struct X512 {
    __m512i v[2];
  };
  struct X256 {
    __m256i v[2];
  };
  __attribute__((target("avx512f"))) static X512 acts512(const Q4Problem& p, int64_t row, int64_t g, int j) {
    return {{_mm512_set1_epi32(lane(p.x16, p, row, g, 4 * j)), _mm512_set1_epi32(lane(p.x16, p, row, g, 4 * j + 2))}};
  }
  __attribute__((target("avx512f,avx512bw,avx512vnni"))) static __m512i dot512(__m512i a, __m512i v, const X512& x) {
    a = _mm512_dpwssd_epi32(a, _mm512_and_si512(v, _mm512_set1_epi16(0xFF)), x.v[0]);
    return _mm512_dpwssd_epi32(a, _mm512_srli_epi16(v, 8), x.v[1]);
  }
  __attribute__((target("avx2"))) static X256 acts256(const Q4Problem& p, int64_t row, int64_t g, int j) {
    return {{_mm256_set1_epi32(lane(p.x16, p, row, g, 4 * j)), _mm256_set1_epi32(lane(p.x16, p, row, g, 4 * j + 2))}};
  }
  __attribute__((target("avx2"))) static __m256i dot256(__m256i s, __m256i v, const X256& x) {
    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0xFF)), x.v[0]));
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_srli_epi16(v, 8), x.v[1]));
  }
  static __m256i sums256(__m256i s) { return s; }  // int32 already
};

}  // namespace hk
