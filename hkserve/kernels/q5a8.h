// hk_w5sa8: hk_w5sa16's signed 5-bit groups (q5a16.h: pack5's nibbles and high-bit plane, a float16 scale
// per group and column, w = scale * (q - 16)) times hk_w4a8's int8 activations (quant8.h: per row, blocks
// of 32 = the weight's groups; llama.cpp's Q5_0 x Q8_0). On AVX2 hk_w5sa16 is arithmetic-bound (vpmaddwd:
// 16 products an instruction); vpmaddubsw takes 32, so a line's 64 weights need two instead of four, and
// the merge of nibbles and fifth bits is the same one: q5a16.h's words a = (v & 0x0F0F) | (G & 0x1010)
// and b = (v >> 4 & 0x0F0F) | (G << 4 & 0x1010), read as bytes, are q of inputs 4j + e and 16 + 4j + e of
// a column's lane, the order of hk_w4a8's broadcast quads (A8). AVX-512 runs q5a16.h's rows_q5_512 with
// this side (Q5A8): each merge one vpternlogd and a mask of 0x1F per byte, then vpdpbusd (64 products an
// instruction, int32 sums) where hk_w5sa16 splits the words for four vpdpwssd.
//
// vpmaddubsw takes q (0..31) as its unsigned side and the activations (-127..127) as the signed one: a
// pair's sum is at most 2 * 31 * 127 = 7874, so two quads' four products add in int16 (31496 < 2^15)
// before vpmaddwd widens them; the group's sum of the other two quads is widened apart. The -16 is taken
// back per group in the integers as hk_w5sa16 does (sum (q - 16) x = sum q x - 16 * sum x, the row's exact
// int8 sum over the group), and the float step is hk_w5sa16's, f += a * (scale * xd).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "q4.h"
#include "q5a16.h"
#include "q8a16.h"

namespace hk {

// A row's int8 activations at group g, broadcast per quad j: inputs 4j..4j+3 (l) and 16 + 4j.. (h).
struct X8 {
  __m256i l[4], h[4];
};

__attribute__((target("avx2"))) inline X8 acts8(const Q4Problem& p, int64_t row, int64_t g) {
  X8 x;
  for (int j = 0; j < 4; ++j) {
    x.l[j] = _mm256_set1_epi32(lane(p.xq, p, row, g, 4 * j));
    x.h[j] = _mm256_set1_epi32(lane(p.xq, p, row, g, 16 + 4 * j));
  }
  return x;
}

// Line I (columns 8I..8I+7, quarter I / 2) of a group's four quads into R rows' int32 sums s: per quad the
// merged q bytes (made once for all rows) meet each row's two broadcast quads.
template <int I, int R>
__attribute__((target("avx2"))) inline void line5a8(const uint8_t* q, const uint8_t* hg, const X8* x, __m256i* s) {
  constexpr int C = I / 2;
  const __m256i nib = _mm256_set1_epi16(0x0F0F), fifth = _mm256_set1_epi16(0x1010), ones = _mm256_set1_epi16(1);
  __m256i half[R][2];  // int16 sums of quads 0-1 and 2-3
  for (int r = 0; r < R; ++r) half[r][0] = half[r][1] = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 256 * j + 32 * I));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hg + 64 * j + 32 * (I & 1)));
    const __m256i g = C ? _mm256_srli_epi16(h, C) : h;
    const __m256i a = _mm256_or_si256(_mm256_and_si256(v, nib), _mm256_and_si256(g, fifth));
    const __m256i b = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib),
                                      _mm256_and_si256(_mm256_slli_epi16(g, 4), fifth));
    for (int r = 0; r < R; ++r) {
      __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(a, x[r].l[j]), _mm256_maddubs_epi16(b, x[r].h[j]));
      half[r][j / 2] = _mm256_add_epi16(half[r][j / 2], t);
    }
  }
  for (int r = 0; r < R; ++r)
    s[r] = _mm256_add_epi32(_mm256_madd_epi16(half[r][0], ones), _mm256_madd_epi16(half[r][1], ones));
}

// Line I's float step for R rows: f += (s - 16 * the row's group sum) * (scale * xd).
template <int I, int R>
__attribute__((target("avx2,fma,f16c"))) inline void step5a8(const Q4Problem& p, const uint8_t* q, const uint8_t* hg,
                                                            const X8* x, const uint16_t* sc, const int32_t* xsum,
                                                            int64_t ng, int64_t g, int64_t r0, float (*acc)[NT]) {
  __m256i s[R];
  line5a8<I, R>(q, hg, x, s);
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g * NT + 8 * I)));
  for (int r = 0; r < R; ++r) {
    const int64_t at = (r0 + r) * ng + g;
    const __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(p.xd[at]));
    const __m256i a = _mm256_sub_epi32(s[r], _mm256_set1_epi32(16 * xsum[at]));
    _mm256_store_ps(acc[r] + 8 * I, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), dd, _mm256_load_ps(acc[r] + 8 * I)));
  }
}

// Rows r0..r0+R-1 of tile t: per group the rows' activations broadcast once, then the 8 lines, each
// through all four quads to its columns' float sums (kept in memory, touched once a group).
template <int R>
__attribute__((target("avx2,fma,f16c"))) void rows_q5a8_avx2(const Q4Problem& p, const uint8_t* high,
                                                            const uint16_t* sc16, const int32_t* xsum, int64_t t,
                                                            int64_t r0) {
  const Q4Tile tl = tile4(p, t, GB);
  const uint16_t* sc = scales16(p, sc16, t);
  alignas(32) float acc[R][NT] = {};
  for (int64_t g = 0; g < tl.ng; ++g) {
    const uint8_t *q = tl.w + g * GB, *hg = high + (t * tl.ng + g) * kQ5High;
    for (int j = 0; j < 4; ++j) prefetch_256(q + 256 * j);
    X8 x[R];
    for (int r = 0; r < R; ++r) x[r] = acts8(p, r0 + r, g);
    step5a8<0, R>(p, q, hg, x, sc, xsum, tl.ng, g, r0, acc);
    step5a8<1, R>(p, q, hg, x, sc, xsum, tl.ng, g, r0, acc);
    step5a8<2, R>(p, q, hg, x, sc, xsum, tl.ng, g, r0, acc);
    step5a8<3, R>(p, q, hg, x, sc, xsum, tl.ng, g, r0, acc);
    step5a8<4, R>(p, q, hg, x, sc, xsum, tl.ng, g, r0, acc);
    step5a8<5, R>(p, q, hg, x, sc, xsum, tl.ng, g, r0, acc);
    step5a8<6, R>(p, q, hg, x, sc, xsum, tl.ng, g, r0, acc);
    step5a8<7, R>(p, q, hg, x, sc, xsum, tl.ng, g, r0, acc);
  }
  for (int r = 0; r < R; ++r) store4(p, r0 + r, t, acc[r]);
}

// The AVX-512 side of rows_q5_512: a row's int8 quads broadcast (l: inputs 4j.., h: 16 + 4j..), and line C
// of a quad merged (vpternlogd 0xE4: (v & 0x0F) | (G & 0xF0) per byte, then & 0x1F) into vpdpbusd.
struct Q5A8 {
  struct X512 {
    __m512i l, h;
  };
  __attribute__((target("avx512f"))) static X512 acts512(const Q4Problem& p, int64_t row, int64_t g, int j) {
    return {_mm512_set1_epi32(lane(p.xq, p, row, g, 4 * j)), _mm512_set1_epi32(lane(p.xq, p, row, g, 16 + 4 * j))};
  }
  template <int C>
  __attribute__((target("avx512f,avx512bw,avx512vnni"))) static __m512i dot(__m512i acc, __m512i v, __m512i h,
                                                                            const X512& x) {
    const __m512i nib = _mm512_set1_epi8(0x0F), five = _mm512_set1_epi8(0x1F);
    const __m512i g = C ? _mm512_srli_epi16(h, C) : h;
    const __m512i a = _mm512_and_si512(_mm512_ternarylogic_epi32(v, g, nib, 0xE4), five);
    const __m512i b =
        _mm512_and_si512(_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), _mm512_slli_epi16(g, 4), nib, 0xE4), five);
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, a, x.l), b, x.h);
  }
};

// Rows [r, end) of tile t on ISA path `isa`, in groups that share each weight load (4, then 2, then 1).
// `high` and `sc16` start at the call's layer, as p.w does.
inline void run_rows_q5a8(const Q4Problem& p, const uint8_t* high, const uint16_t* sc16, const int32_t* xsum,
                          int64_t isa, int64_t t, int64_t r, int64_t end) {
  if (isa == 2) {
    for (; r + 4 <= end; r += 4) rows_q5_512<4, Q5A8>(p, high, sc16, xsum, t, r);
    for (; r + 2 <= end; r += 2) rows_q5_512<2, Q5A8>(p, high, sc16, xsum, t, r);
    for (; r < end; ++r) rows_q5_512<1, Q5A8>(p, high, sc16, xsum, t, r);
  } else {
    for (; r + 4 <= end; r += 4) rows_q5a8_avx2<4>(p, high, sc16, xsum, t, r);
    for (; r + 2 <= end; r += 2) rows_q5a8_avx2<2>(p, high, sc16, xsum, t, r);
    for (; r < end; ++r) rows_q5a8_avx2<1>(p, high, sc16, xsum, t, r);
  }
}

}  // namespace hk
