// hk_w5sa16's weight side: signed 5-bit groups (model/int4.py's Int5Sym: w = scale * (q - 16), q in
// 0..31, a float16 scale per group of 32 inputs and column, no min; GGUF's Q5_0 blocks as they are) times
// the int16 activations of hk_w4a16 (q4a16.h's quantize_a16: per row, blocks of 128, each quad stored
// x0, x2, x1, x3). Tiles, items and threads are q4.h's / q4matmul.cc's.
//
// Packed layout (kernels/pack4.py pack5), per 64-column tile and group: q's low nibbles exactly as pack4
// lays out int4 (w: 1024 bytes, 4 input quads j x 4 column quarters c x 16 columns x 4 inputs e, input
// 4j + e in a byte's low nibble, 16 + 4j + e in its high one), and q's high bits (high: 256 bytes,
// 64 per quad j): 32 16-bit words, word 2l + h (l: the column inside a quarter, h: the lane's low
// or high word) holding the high bits of columns 16c + l, c = 0..3, at the inputs of that word's four
// nibbles: a line's word v holds in bits 0-3, 8-11, 4-7, 12-15 (A16's unpacks k = 0, 1, 2, 3) inputs
// 4j + 2h, 4j + 2h + 1, 16 + 4j + 2h, 16 + 4j + 2h + 1, whose high bits sit in bits c + 4, c + 12, c and
// c + 8 of H. So with G = H >> c two masks merge two nibbles and their fifth bits at once:
// a = (v & 0x0F0F) | (G & 0x1010) holds q of unpacks 0 and 1 in its bytes, b = (v >> 4 & 0x0F0F) |
// (G << 4 & 0x1010) those of 2 and 3, and `a & 0xFF`, `a >> 8`, `b & 0xFF`, `b >> 8` are the four q
// words (AVX-512: each merge one vpternlogd, then masks of 0x1F), which vpdpwssd (AVX2: vpmaddwd) meets
// with the activation pairs: ~12 instructions a line besides them where OR-ing each fifth bit took ~18. The
// -16 is taken back per group in the integers: sum (q - 16) x = sum q x - 16 * sum x, the row's exact
// int16 sum over the group (a lane: 32 * 31 * 32767 < 2^31). The float step is hk_w8sa16's,
// f += a * (scale * xd), the scale widened from float16 in the register.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "q4.h"
#include "q8a16.h"

namespace hk {

constexpr int64_t kQ5High = 256;  // high-bit bytes per (tile, group), beside GB nibble bytes

// Each row's exact integer sum of its int16 activations per group [m, kp/32] (the -16's partner).
inline const int32_t* group_sums16(const Q4Problem& p) {
  const int64_t ng = p.kp / G4;
  thread_local std::vector<int32_t> sums;
  sums.resize(p.m * ng);
  for (int64_t r = 0; r < p.m; ++r)
    for (int64_t g = 0; g < ng; ++g) {
      const int16_t* x = p.x16 + r * p.kp + g * G4;
      int32_t s = 0;
      for (int64_t i = 0; i < G4; ++i) s += x[i];
      sums[r * ng + g] = s;
    }
  return sums.data();
}

// One line (quarter C of a quad) into a row's sums: the four q words (module comment) times the row's
// four pairs. vpternlogd 0xE4: (A & C) | (B & ~C), C the nibble mask; the bits it lets through from G
// besides the fifth ones are masked off after.
template <int C>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline __m512i dot5_512(__m512i acc, __m512i v, __m512i h,
                                                                                 const A16::X512& x) {
  const __m512i nib = _mm512_set1_epi16(0x0F0F), five = _mm512_set1_epi16(0x1F);
  const __m512i g = C ? _mm512_srli_epi16(h, C) : h;
  const __m512i a = _mm512_ternarylogic_epi32(v, g, nib, 0xE4);
  const __m512i b = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), _mm512_slli_epi16(g, 4), nib, 0xE4);
  acc = _mm512_dpwssd_epi32(acc, _mm512_and_si512(a, five), x.v[0]);
  acc = _mm512_dpwssd_epi32(acc, _mm512_and_si512(_mm512_srli_epi16(a, 8), five), x.v[1]);
  acc = _mm512_dpwssd_epi32(acc, _mm512_and_si512(b, five), x.v[2]);
  return _mm512_dpwssd_epi32(acc, _mm512_and_si512(_mm512_srli_epi16(b, 8), five), x.v[3]);
}

template <int C>
__attribute__((target("avx2"))) inline __m256i dot5_256(__m256i s, __m256i v, __m256i h, const A16::X256& x) {
  const __m256i nib = _mm256_set1_epi16(0x0F0F), fifth = _mm256_set1_epi16(0x1010), low = _mm256_set1_epi16(0xFF);
  const __m256i g = C ? _mm256_srli_epi16(h, C) : h;
  const __m256i a = _mm256_or_si256(_mm256_and_si256(v, nib), _mm256_and_si256(g, fifth));
  const __m256i b = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib),
                                    _mm256_and_si256(_mm256_slli_epi16(g, 4), fifth));
  s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_and_si256(a, low), x.v[0]));
  s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_srli_epi16(a, 8), x.v[1]));
  s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_and_si256(b, low), x.v[2]));
  return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_srli_epi16(b, 8), x.v[3]));
}

// hk_w5sa16's activation side of rows_q5_512: the int16 pairs (A16) and dot5_512 (hk_w5sa8's: q5a8.h).
struct Q5A16 {
  using X512 = A16::X512;
  __attribute__((target("avx512f"))) static X512 acts512(const Q4Problem& p, int64_t row, int64_t g, int j) {
    return A16::acts512(p, row, g, j);
  }
  template <int C>
  __attribute__((target("avx512f,avx512bw,avx512vnni"))) static __m512i dot(__m512i acc, __m512i v, __m512i h,
                                                                            const X512& x) {
    return dot5_512<C>(acc, v, h, x);
  }
};

// Rows r0..r0+R-1 of tile t, AVX-512: per group the integer sums of 64 columns (4 vectors a row; P: the
// activations' side), less 16 * the row's group sum, then f += a * (scale * xd) on float sums in memory.
template <int R, class P = Q5A16>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void rows_q5_512(const Q4Problem& p, const uint8_t* high,
                                                                         const uint16_t* sc16, const int32_t* xsum,
                                                                         int64_t t, int64_t r0) {
  const Q4Tile tl = tile4(p, t, GB);
  const uint16_t* sc = scales16(p, sc16, t);
  alignas(64) float acc[R][NT] = {};
  for (int64_t g = 0; g < tl.ng; ++g) {
    __m512i a[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_si512();
    const uint8_t* hg = high + (t * tl.ng + g) * kQ5High;
    for (int j = 0; j < 4; ++j) {
      typename P::X512 x[R];
      for (int r = 0; r < R; ++r) x[r] = P::acts512(p, r0 + r, g, j);
      const uint8_t* q = tl.w + g * GB + j * 256;
      prefetch_256(q);
      __m512i h = _mm512_loadu_si512(hg + 64 * j);
      __m512i v0 = _mm512_loadu_si512(q), v1 = _mm512_loadu_si512(q + 64);
      __m512i v2 = _mm512_loadu_si512(q + 128), v3 = _mm512_loadu_si512(q + 192);
      for (int r = 0; r < R; ++r) {
        a[r][0] = P::template dot<0>(a[r][0], v0, h, x[r]);
        a[r][1] = P::template dot<1>(a[r][1], v1, h, x[r]);
        a[r][2] = P::template dot<2>(a[r][2], v2, h, x[r]);
        a[r][3] = P::template dot<3>(a[r][3], v3, h, x[r]);
      }
    }
    for (int c = 0; c < 4; ++c) {
      __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + g * NT + 16 * c)));
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * tl.ng + g;
        __m512i q = _mm512_sub_epi32(a[r][c], _mm512_set1_epi32(16 * xsum[at]));
        __m512 dd = _mm512_mul_ps(s, _mm512_set1_ps(p.xd[at]));
        __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), dd, _mm512_load_ps(acc[r] + 16 * c));
        _mm512_store_ps(acc[r] + 16 * c, f);
      }
    }
  }
  for (int r = 0; r < R; ++r) store4(p, r0 + r, t, acc[r]);
}

// Line i (columns 8i..8i+7: quarter i / 2) of a quad into a row's sums, AVX2.
template <int I>
__attribute__((target("avx2"))) inline __m256i line5_256(__m256i s, const uint8_t* q, const uint8_t* hi,
                                                        const A16::X256& x) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * I));
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + 32 * (I & 1)));
  return dot5_256<I / 2>(s, v, h, x);
}

// Rows r0..r0+R-1 of tile t, AVX2: each group's lines in order, 8 vectors of integer sums a row.
template <int R>
__attribute__((target("avx2,fma,f16c"))) void rows_q5_avx2(const Q4Problem& p, const uint8_t* high,
                                                          const uint16_t* sc16, const int32_t* xsum, int64_t t,
                                                          int64_t r0) {
  const Q4Tile tl = tile4(p, t, GB);
  const uint16_t* sc = scales16(p, sc16, t);
  alignas(32) float acc[R][NT] = {};
  for (int64_t g = 0; g < tl.ng; ++g) {
    __m256i s[R][8];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 8; ++i) s[r][i] = _mm256_setzero_si256();
    const uint8_t* hg = high + (t * tl.ng + g) * kQ5High;
    for (int j = 0; j < 4; ++j) {
      const uint8_t *q = tl.w + g * GB + j * 256, *hi = hg + 64 * j;
      prefetch_256(q);
      A16::X256 x[R];
      for (int r = 0; r < R; ++r) x[r] = A16::acts256(p, r0 + r, g, j);
      for (int r = 0; r < R; ++r) {
        s[r][0] = line5_256<0>(s[r][0], q, hi, x[r]);
        s[r][1] = line5_256<1>(s[r][1], q, hi, x[r]);
        s[r][2] = line5_256<2>(s[r][2], q, hi, x[r]);
        s[r][3] = line5_256<3>(s[r][3], q, hi, x[r]);
        s[r][4] = line5_256<4>(s[r][4], q, hi, x[r]);
        s[r][5] = line5_256<5>(s[r][5], q, hi, x[r]);
        s[r][6] = line5_256<6>(s[r][6], q, hi, x[r]);
        s[r][7] = line5_256<7>(s[r][7], q, hi, x[r]);
      }
    }
    for (int i = 0; i < 8; ++i) {
      __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g * NT + 8 * i)));
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * tl.ng + g;
        __m256i q = _mm256_sub_epi32(s[r][i], _mm256_set1_epi32(16 * xsum[at]));
        __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(p.xd[at]));
        __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), dd, _mm256_load_ps(acc[r] + 8 * i));
        _mm256_store_ps(acc[r] + 8 * i, f);
      }
    }
  }
  for (int r = 0; r < R; ++r) store4(p, r0 + r, t, acc[r]);
}

// Rows [r, end) of tile t, in groups that share each weight load (4, then 2, then 1).
// `high` and `sc16` start at the call's layer, as p.w does.
inline void run_rows_q5(const Q4Problem& p, const uint8_t* high, const uint16_t* sc16, const int32_t* xsum,
                        int64_t isa, int64_t t, int64_t r, int64_t end) {
  if (isa == 2) {
    for (; r + 4 <= end; r += 4) rows_q5_512<4>(p, high, sc16, xsum, t, r);
    for (; r + 2 <= end; r += 2) rows_q5_512<2>(p, high, sc16, xsum, t, r);
    for (; r < end; ++r) rows_q5_512<1>(p, high, sc16, xsum, t, r);
  } else {
    for (; r + 4 <= end; r += 4) rows_q5_avx2<4>(p, high, sc16, xsum, t, r);
    for (; r + 2 <= end; r += 2) rows_q5_avx2<2>(p, high, sc16, xsum, t, r);
    for (; r < end; ++r) rows_q5_avx2<1>(p, high, sc16, xsum, t, r);
  }
}

}  // namespace hk
