// What the grouped kernels of q4matmul.cc share (hk_w4a8, hk_w4a16, hk_w8ga16): the packed weight's group
// and tile, one call's operands (Q4Problem) and the loops over a tile's groups and rows. The weight's
// and activations' side is a policy A (q4matmul.cc's A8, q4a16.h's A16, q8a16.h's A8G): A::kQuads input
// quads of A::kBytes per (tile, group); A::acts512/acts256 broadcast a row's activations for quad j,
// A::dot512/dot256 add one 64-byte (32-byte) line's products into exact integer sums per column,
// A::sums256 widens the AVX2 sums to int32.
//
// Packed layout (kernels/pack4.py), per 64-column tile t and group g, 1024 bytes: 4 input quads j,
// each 4 column quarters c, each 16 columns x 4 inputs; a byte holds input 4j + e of the group in its
// low nibble and input 16 + 4j + e in its high one. Scales and mins: [N/64][K/32][64] float32.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "problem.h"

namespace hk {

constexpr int64_t G4 = 32;    // inputs per group (= QK, hk_w4a8's activation block)
constexpr int64_t GB = 1024;  // packed bytes per (tile, group): 64 columns x 32 nibbles

struct Q4Problem {
  int64_t m, k, n, kp, np;  // rows, inputs, outputs, padded inputs (whole groups), padded outputs
  const uint8_t* w;         // [np/64][kp/32][1024]
  const float* sc;          // [np/64][kp/32][64]
  const float* mn;          // [np/64][kp/32][64]
  const int8_t* xq;         // hk_w4a8: [m, kp] int8 activations
  const int16_t* x16;       // hk_w4a16: [m, kp] int16 activations, each quad in the order x0, x2, x1, x3
  const float* xd;          // [m, kp/32] the activations' scale at each group
  const float* xs;          // [m, kp/32] xd * the group's sum of activations (what the mins multiply)
  float* y;                 // [m, n]
};

// Tile t's packed groups, scales and mins.
struct Q4Tile {
  int64_t ng;             // groups
  const uint8_t* w;       // [ng][bytes]
  const float *sc, *mn;   // [ng][64]
};

inline Q4Tile tile4(const Q4Problem& p, int64_t t, int64_t bytes = GB) {
  const int64_t ng = p.kp / G4;
  return {ng, p.w + t * ng * bytes, p.sc + t * ng * NT, p.mn + t * ng * NT};
}

// 4 bytes of a row's quantized activations (4 int8 or 2 int16) at input `at` of group g, as one lane.
template <typename T>
inline int32_t lane(const T* x, const Q4Problem& p, int64_t row, int64_t g, int64_t at) {
  int32_t v;
  std::memcpy(&v, x + row * p.kp + g * G4 + at, 4);
  return v;
}

inline void store4(const Q4Problem& p, int64_t row, int64_t t, const float* acc) {
  int64_t cols = std::min<int64_t>(NT, p.n - t * NT);
  std::memcpy(p.y + row * p.n + t * NT, acc, cols * sizeof(float));
}

// Group g's exact integer sums a (16 columns, from column `col` of the tile's scales) into the row's
// float sums: f += a * (scale * xd) + min * xs, one order whatever the batch.
__attribute__((target("avx512f"))) inline __m512 group_512(const Q4Problem& p, const Q4Tile& q, int64_t col, int64_t at,
                                                           __m512i a, __m512 f) {
  __m512 dd = _mm512_mul_ps(_mm512_loadu_ps(q.sc + col), _mm512_set1_ps(p.xd[at]));
  f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), dd, f);
  return _mm512_fmadd_ps(_mm512_loadu_ps(q.mn + col), _mm512_set1_ps(p.xs[at]), f);
}

__attribute__((target("avx2,fma"))) inline __m256 group_avx2(const Q4Problem& p, const Q4Tile& q, int64_t col, int64_t at,
                                                             __m256i a, __m256 f) {
  __m256 dd = _mm256_mul_ps(_mm256_loadu_ps(q.sc + col), _mm256_set1_ps(p.xd[at]));
  f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), dd, f);
  return _mm256_fmadd_ps(_mm256_loadu_ps(q.mn + col), _mm256_set1_ps(p.xs[at]), f);
}

// Rows r0..r0+R-1 of tile t, C of the tile's four 16-column quarters a pass: per group, integer sums per
// column (16 columns a vector), then group_512's float step into float sums that stay in registers over
// the groups (R x C of each; four rows' 4 x 4 spill: hk_w4a8 takes the tile in two halves). The
// rows share each weight load and its unpacking. A column's arithmetic is the same instruction sequence
// whatever R and C: a row's bits do not depend on its row group.
template <class A, int R, int C>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void rows_512(const Q4Problem& p, int64_t t, int64_t r0) {
  const Q4Tile tl = tile4(p, t, A::kBytes);
  alignas(64) float acc[R][NT];
  for (int c0 = 0; c0 < 4; c0 += C) {
    __m512 f[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) f[r][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < tl.ng; ++g) {
      __m512i a[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) a[r][c] = _mm512_setzero_si512();
      for (int j = 0; j < A::kQuads; ++j) {
        typename A::X512 x[R];
        for (int r = 0; r < R; ++r) x[r] = A::acts512(p, r0 + r, g, j);
        const uint8_t* q = tl.w + g * A::kBytes + j * 256;
        if (c0 == 0) prefetch_256(q);
        for (int c = 0; c < C; ++c) {
          __m512i v = _mm512_loadu_si512(q + 64 * (c0 + c));
          for (int r = 0; r < R; ++r) a[r][c] = A::dot512(a[r][c], v, x[r]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
          f[r][c] = group_512(p, tl, g * NT + 16 * (c0 + c), (r0 + r) * tl.ng + g, a[r][c], f[r][c]);
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) _mm512_store_ps(acc[r] + 16 * (c0 + c), f[r][c]);
  }
  for (int r = 0; r < R; ++r) store4(p, r0 + r, t, acc[r]);
}

// Rows r0..r0+R-1 of tile t, AVX2, each group's 1024 bytes read in order: per input quad j a row's
// activations are broadcast once for all 64 columns (8 vectors of integer sums a row), and the float
// sums wait in memory, touched once a group. Reading a 16-column quarter of the tile a pass instead
// (the registers' fit) was 1.5x slower at batch 1 and 1.15x at 16 rows (README.md).
template <class A, int R>
__attribute__((target("avx2,fma"))) void rows_avx2(const Q4Problem& p, int64_t t, int64_t r0) {
  const Q4Tile tl = tile4(p, t, A::kBytes);
  alignas(32) float acc[R][NT] = {};
  for (int64_t g = 0; g < tl.ng; ++g) {
    __m256i s[R][8];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 8; ++i) s[r][i] = _mm256_setzero_si256();
    for (int j = 0; j < A::kQuads; ++j) {
      const uint8_t* q = tl.w + g * A::kBytes + j * 256;
      prefetch_256(q);
      typename A::X256 x[R];
      for (int r = 0; r < R; ++r) x[r] = A::acts256(p, r0 + r, g, j);
      for (int i = 0; i < 8; ++i) {  // columns 8i..8i+7
        __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * i));
        for (int r = 0; r < R; ++r) s[r][i] = A::dot256(s[r][i], v, x[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < 8; ++i) {
        __m256 f = _mm256_load_ps(acc[r] + 8 * i);
        f = group_avx2(p, tl, g * NT + 8 * i, (r0 + r) * tl.ng + g, A::sums256(s[r][i]), f);
        _mm256_store_ps(acc[r] + 8 * i, f);
      }
    }
  }
  for (int r = 0; r < R; ++r) store4(p, r0 + r, t, acc[r]);
}

// Rows [r, end) of tile t on ISA path `isa`, in groups that share each weight load (4, then 2, then 1);
// C4: the column quarters a pass of four rows on AVX-512 (hk_w4a8: 2, its float sums then stay in
// registers; int16 activations: 4, their broadcasts cost more than the spilled float sums).
template <class A, int C4 = 4>
void run_rows(const Q4Problem& p, int64_t isa, int64_t t, int64_t r, int64_t end) {
  if (isa == 2) {
    for (; r + 4 <= end; r += 4) rows_512<A, 4, C4>(p, t, r);
    for (; r + 2 <= end; r += 2) rows_512<A, 2, 4>(p, t, r);
    for (; r < end; ++r) rows_512<A, 1, 4>(p, t, r);
  } else {
    for (; r + 4 <= end; r += 4) rows_avx2<A, 4>(p, t, r);
    for (; r + 2 <= end; r += 2) rows_avx2<A, 2>(p, t, r);
    for (; r < end; ++r) rows_avx2<A, 1>(p, t, r);
  }
}

}  // namespace hk
