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
//
// hk_w8sa16's weight side (A8S below): signed 8-bit groups (model/int4.py's Int8Sym: w = scale * q,
// q in -128..127, a float16 scale per group and column, no min; GGUF's Q4_0/Q5_0/Q8_0 as they are) in
// the same packed bytes, two's complement: `(w << 8) >> 8` and `w >> 8` (arithmetic) give the int16
// weights. Its loops (rows_sym_*) are q4.h's with the float step f += a * (scale * xd) and the scale
// read as float16 (2 bytes a group and column instead of 8 for scale and min).
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

// Signed bytes: a lane sums a group's 32 products, 32 * 128 * 32768 = 2^27 < 2^31, exact.
struct A8S : A8G {
  __attribute__((target("avx512f,avx512bw,avx512vnni"))) static __m512i dot512(__m512i a, __m512i v, const X512& x) {
    a = _mm512_dpwssd_epi32(a, _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8), x.v[0]);
    return _mm512_dpwssd_epi32(a, _mm512_srai_epi16(v, 8), x.v[1]);
  }
  __attribute__((target("avx2"))) static __m256i dot256(__m256i s, __m256i v, const X256& x) {
    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8), x.v[0]));
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_srai_epi16(v, 8), x.v[1]));
  }
};

// Tile t's float16 scales [ng][64] (the packed weight's tile is q4.h's tile4 with A8S::kBytes).
inline const uint16_t* scales16(const Q4Problem& p, const uint16_t* sc16, int64_t t) { return sc16 + t * (p.kp / G4) * NT; }

// Rows r0..r0+R-1 of tile t, AVX-512: per group the integer sums of 64 columns (4 vectors a row), then
// f += a * (scale * xd) on float sums kept in memory, touched once a group.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void rows_sym_512(const Q4Problem& p, const uint16_t* sc16,
                                                                          int64_t t, int64_t r0) {
  const Q4Tile tl = tile4(p, t, A8S::kBytes);
  const uint16_t* sc = scales16(p, sc16, t);
  alignas(64) float acc[R][NT] = {};
  for (int64_t g = 0; g < tl.ng; ++g) {
    __m512i a[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_si512();
    for (int j = 0; j < A8S::kQuads; ++j) {
      A8S::X512 x[R];
      for (int r = 0; r < R; ++r) x[r] = A8S::acts512(p, r0 + r, g, j);
      const uint8_t* q = tl.w + g * A8S::kBytes + j * 256;
      prefetch_256(q);
      for (int c = 0; c < 4; ++c) {
        __m512i v = _mm512_loadu_si512(q + 64 * c);
        for (int r = 0; r < R; ++r) a[r][c] = A8S::dot512(a[r][c], v, x[r]);
      }
    }
    for (int c = 0; c < 4; ++c) {
      __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + g * NT + 16 * c)));
      for (int r = 0; r < R; ++r) {
        __m512 dd = _mm512_mul_ps(s, _mm512_set1_ps(p.xd[(r0 + r) * tl.ng + g]));
        __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][c]), dd, _mm512_load_ps(acc[r] + 16 * c));
        _mm512_store_ps(acc[r] + 16 * c, f);
      }
    }
  }
  for (int r = 0; r < R; ++r) store4(p, r0 + r, t, acc[r]);
}

// Rows r0..r0+R-1 of tile t, AVX2: each group's 2048 bytes in order, 8 vectors of integer sums a row.
template <int R>
__attribute__((target("avx2,fma,f16c"))) void rows_sym_avx2(const Q4Problem& p, const uint16_t* sc16, int64_t t,
                                                           int64_t r0) {
  const Q4Tile tl = tile4(p, t, A8S::kBytes);
  const uint16_t* sc = scales16(p, sc16, t);
  alignas(32) float acc[R][NT] = {};
  for (int64_t g = 0; g < tl.ng; ++g) {
    __m256i s[R][8];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 8; ++i) s[r][i] = _mm256_setzero_si256();
    for (int j = 0; j < A8S::kQuads; ++j) {
      const uint8_t* q = tl.w + g * A8S::kBytes + j * 256;
      prefetch_256(q);
      A8S::X256 x[R];
      for (int r = 0; r < R; ++r) x[r] = A8S::acts256(p, r0 + r, g, j);
      for (int i = 0; i < 8; ++i) {  // columns 8i..8i+7
        __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * i));
        for (int r = 0; r < R; ++r) s[r][i] = A8S::dot256(s[r][i], v, x[r]);
      }
    }
    for (int i = 0; i < 8; ++i) {
      __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g * NT + 8 * i)));
      for (int r = 0; r < R; ++r) {
        __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(p.xd[(r0 + r) * tl.ng + g]));
        __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][i]), dd, _mm256_load_ps(acc[r] + 8 * i));
        _mm256_store_ps(acc[r] + 8 * i, f);
      }
    }
  }
  for (int r = 0; r < R; ++r) store4(p, r0 + r, t, acc[r]);
}

// Rows [r, end) of tile t, in groups that share each weight load (4, then 2, then 1).
inline void run_rows_sym(const Q4Problem& p, const uint16_t* sc16, int64_t isa, int64_t t, int64_t r, int64_t end) {
  if (isa == 2) {
    for (; r + 4 <= end; r += 4) rows_sym_512<4>(p, sc16, t, r);
    for (; r + 2 <= end; r += 2) rows_sym_512<2>(p, sc16, t, r);
    for (; r < end; ++r) rows_sym_512<1>(p, sc16, t, r);
  } else {
    for (; r + 4 <= end; r += 4) rows_sym_avx2<4>(p, sc16, t, r);
    for (; r + 2 <= end; r += 2) rows_sym_avx2<2>(p, sc16, t, r);
    for (; r < end; ++r) rows_sym_avx2<1>(p, sc16, t, r);
  }
}

}  // namespace hk
