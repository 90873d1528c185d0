// hk_w8a16's products and activation quantization: int8 weights (packed, qmatmul.cc) made int16 in
// registers (AVX-512: widened; AVX2: each 16-bit word split into its bytes), times activations
// quantized per row to int16 in blocks of 128 (absmax / 32767, round half to even); vpdpwssd
// (AVX-512 VNNI) or vpmaddwd (AVX2) sums two products per int32 lane.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "problem.h"

namespace hk {

// Row `row`'s +128 offsets of block b as one 64-bit pattern: the even int32 lanes' in the low half,
// the odd lanes' in the high half (Problem::c16).
inline int64_t offsets(const Problem& p, int64_t row, int64_t nb, int64_t b) {
  const int32_t* c = p.c16 + (row * nb + b) * 2;
  return static_cast<int64_t>(static_cast<uint32_t>(c[0]) | static_cast<uint64_t>(static_cast<uint32_t>(c[1])) << 32);
}

// Even int32 lanes of a widened weight vector meet inputs 4i, 4i+1 and odd ones 4i+2, 4i+3 of the same
// column (8 columns a 512-bit vector): (lane 2j) + (lane 2j+1) is column j's sum.
inline void sum_lane_pairs(const float* lanes, float* out, int cols) {
  for (int j = 0; j < cols; ++j) out[j] = lanes[2 * j] + lanes[2 * j + 1];
}

// Rows r0..r0+R-1 of tile t, int16 activations: each 32-byte line of a 256-byte weight row (8 columns
// x 4 inputs) widens to 16 bits, and vpdpwssd multiplies it by the row's 4 inputs broadcast as one
// 64-bit pattern. A block's int32 sums, less the offset, scale into float32 sums kept in memory
// (touched once a block: the registers hold the weights and the integer sums).
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void a16_rows_512(const Problem& p, int64_t t, int64_t r0) {
  const uint8_t* wt = p.w + t * p.kp * NT;
  const int64_t nb = blocks16(p.kp);
  alignas(64) float f[R][8][16] = {};
  for (int64_t b = 0; b < nb; ++b) {
    __m512i a[R][8];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 8; ++i) a[r][i] = _mm512_setzero_si512();
    for (int64_t g = b * (QK16 / 4), end = std::min(p.kp, (b + 1) * QK16) / 4; g < end; ++g) {
      const uint8_t* q = wt + g * 256;
      prefetch_256(q);
      __m512i w[8];
      for (int i = 0; i < 8; ++i)
        w[i] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * i)));
      for (int r = 0; r < R; ++r) {
        int64_t x4;
        std::memcpy(&x4, p.x16 + (r0 + r) * p.kp + g * 4, 8);
        __m512i xb = _mm512_set1_epi64(x4);
        for (int i = 0; i < 8; ++i) a[r][i] = _mm512_dpwssd_epi32(a[r][i], w[i], xb);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512i cv = _mm512_set1_epi64(offsets(p, r0 + r, nb, b));
      __m512 dv = _mm512_set1_ps(p.d16[(r0 + r) * nb + b]);
      for (int i = 0; i < 8; ++i) {
        __m512 s = _mm512_cvtepi32_ps(_mm512_sub_epi32(a[r][i], cv));
        _mm512_store_ps(f[r][i], _mm512_fmadd_ps(s, dv, _mm512_load_ps(f[r][i])));
      }
    }
  }
  float acc[NT];
  for (int r = 0; r < R; ++r) {
    sum_lane_pairs(&f[r][0][0], acc, NT);
    store_tile(p, r0 + r, t * NT, acc);
  }
}

// Row `row`'s int16 inputs 4g..4g+3 as the two 32-bit pairs (x0, x2) and (x1, x3): what the low and
// the high bytes of a weight lane's 16-bit words meet (a16_rows_avx2).
inline void pairs16(const Problem& p, int64_t row, int64_t g, int32_t* even, int32_t* odd) {
  uint16_t x[4];
  std::memcpy(x, p.x16 + row * p.kp + g * 4, 8);
  *even = static_cast<int32_t>(x[0] | static_cast<uint32_t>(x[2]) << 16);
  *odd = static_cast<int32_t>(x[1] | static_cast<uint32_t>(x[3]) << 16);
}

// As a16_rows_512 with 256-bit vectors, each 256-byte weight row read in order as 8 lines of 8 columns
// x 4 inputs. No widening shuffle: a lane's 16-bit words hold inputs (4g, 4g+1) and (4g+2, 4g+3) of one
// column, so `w & 255` and `w >> 8` are the int16 weights of inputs (4g, 4g+2) and (4g+1, 4g+3), which
// vpmaddwd multiplies by those pairs of the row's activations (pairs16): an int32 lane is one column's
// sum (over a block: 128 * 255 * 32767 < 2^31, exact). vpmovzxbw runs on one port of Zen's and was the
// bound of the widening loop (kernels/README.md). The integer sums stay in registers where they fit.
template <int R>
__attribute__((target("avx2,fma"))) void a16_rows_avx2(const Problem& p, int64_t t, int64_t r0, float (*acc)[NT]) {
  const uint8_t* wt = p.w + t * p.kp * NT;
  const int64_t nb = blocks16(p.kp);
  const __m256i low = _mm256_set1_epi16(0xFF);
  alignas(32) float f[R][8][8] = {};
  for (int64_t b = 0; b < nb; ++b) {
    __m256i a[R][8];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 8; ++i) a[r][i] = _mm256_setzero_si256();
    for (int64_t g = b * (QK16 / 4), end = std::min(p.kp, (b + 1) * QK16) / 4; g < end; ++g) {
      const uint8_t* q = wt + g * 256;
      prefetch_256(q);
      __m256i xe[R], xo[R];
      for (int r = 0; r < R; ++r) {
        int32_t even, odd;
        pairs16(p, r0 + r, g, &even, &odd);
        xe[r] = _mm256_set1_epi32(even), xo[r] = _mm256_set1_epi32(odd);
      }
      for (int i = 0; i < 8; ++i) {  // columns 8i..8i+7
        __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * i));
        __m256i we = _mm256_and_si256(v, low), wo = _mm256_srli_epi16(v, 8);
        for (int r = 0; r < R; ++r)
          a[r][i] = _mm256_add_epi32(a[r][i], _mm256_add_epi32(_mm256_madd_epi16(we, xe[r]), _mm256_madd_epi16(wo, xo[r])));
      }
    }
    for (int r = 0; r < R; ++r) {
      const int32_t* c = p.c16 + ((r0 + r) * nb + b) * 2;
      __m256i cv = _mm256_set1_epi32(c[0] + c[1]);
      __m256 dv = _mm256_set1_ps(p.d16[(r0 + r) * nb + b]);
      for (int i = 0; i < 8; ++i) {
        __m256 s = _mm256_cvtepi32_ps(_mm256_sub_epi32(a[r][i], cv));
        _mm256_store_ps(f[r][i], _mm256_fmadd_ps(s, dv, _mm256_load_ps(f[r][i])));
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(acc[r], &f[r][0][0], NT * sizeof(float));
}

// Rows → int16 blocks of 128 (zero past k): q = round-half-even(x * (32767 / absmax)), the scale
// absmax / 32767, and 128 * the sums of q at inputs 4i, 4i+1 and at 4i+2, 4i+3 (see Problem::c16).
// Vectorized: it runs on the calling thread before the products start, for every call (a scalar
// loop took ~25-50 us of an ~80 us 16-row down_proj). vcvtps2dq rounds half to even, as nearbyint.
__attribute__((target("avx2,fma"))) inline void quantize_rows16(const float* x, int64_t m, int64_t k, int64_t kp, int16_t* q,
                                                          float* d, int32_t* c) {
  const int64_t nb = blocks16(kp);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i even = _mm256_setr_epi32(-1, -1, 0, 0, -1, -1, 0, 0);  // inputs 4i, 4i+1 of 8
  alignas(32) float xb[QK16];
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      int64_t lo = b * QK16, len = std::min(kp, lo + QK16) - lo, n = std::max<int64_t>(0, std::min(k, lo + len) - lo);
      std::memcpy(xb, x + r * k + lo, n * sizeof(float));
      std::memset(xb + n, 0, (len - n) * sizeof(float));  // len is a multiple of 32 (kp is)
      __m256 amax = _mm256_setzero_ps();
      for (int64_t i = 0; i < len; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_load_ps(xb + i)));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, amax);
      float top = *std::max_element(lanes, lanes + 8);
      __m256 inv = _mm256_set1_ps(top > 0.f ? 32767.f / top : 0.f);
      __m256i se = _mm256_setzero_si256(), so = _mm256_setzero_si256();
      int16_t* out = q + r * kp + lo;
      for (int64_t i = 0; i < len; i += 16) {
        // |x * inv| <= 32767 up to rounding, so the saturating pack only reorders
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(xb + i), inv));
        __m256i z = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(xb + i + 8), inv));
        se = _mm256_add_epi32(se, _mm256_add_epi32(_mm256_and_si256(a, even), _mm256_and_si256(z, even)));
        so = _mm256_add_epi32(so, _mm256_add_epi32(_mm256_andnot_si256(even, a), _mm256_andnot_si256(even, z)));
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, z), 0xD8);  // packs works per 128 bits
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), packed);
      }
      alignas(32) int32_t e8[8], o8[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(e8), se);
      _mm256_store_si256(reinterpret_cast<__m256i*>(o8), so);
      int32_t sums[2] = {0, 0};
      for (int j = 0; j < 8; ++j) sums[0] += e8[j], sums[1] += o8[j];
      d[r * nb + b] = top / 32767.f;
      c[(r * nb + b) * 2] = 128 * sums[0], c[(r * nb + b) * 2 + 1] = 128 * sums[1];
    }
  }
}

}  // namespace hk
