// Activations quantized to int8 in blocks of 32 values (absmax / 127, round half to even: llama.cpp's
// Q8_0), shared by hk_w8a8 (qmatmul.cc) and hk_w4a8 (q4matmul.cc).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "problem.h"

namespace hk {

// 32 int32 lanes (4 vectors, values in -127..127) → 32 int8 in order.
__attribute__((target("avx2"))) inline void store32_i8(const __m256i* v, void* out) {
  __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // undo the lanes' interleave
  _mm256_storeu_si256(static_cast<__m256i*>(out), b);
}

// One block of 32 values (zero past `n`) → int8 q, |q|, and its scale absmax / 127; returns sum(q).
// Vectorized (AVX2, which every ISA path has): as a scalar loop it was ~28% of hk_w4a8's 16-row layers,
// run by the calling thread alone before the tiles. Its results are the scalar loop's: a NaN is skipped
// by the absmax (vmaxps returns its second operand, the running maximum), x * inv rounds half to even
// (vroundps, as nearbyint), a NaN or overflow converts to INT_MIN and clamps to -127 as cvttss2si did.
__attribute__((target("avx2,fma"))) inline int32_t quantize_block(const float* x, int64_t n, int8_t* q, uint8_t* qa,
                                                            float* d) {
  alignas(32) float padded[QK] = {};
  if (n < QK) {
    std::copy(x, x + std::max<int64_t>(n, 0), padded);
    x = padded;
  }
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4], top = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    top = _mm256_max_ps(_mm256_and_ps(v[i], magnitude), top);
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  const float amax = _mm_cvtss_f32(h);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  *d = amax / 127.f;
  __m256i qi[4], qabs[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    qi[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvttps_epi32(r), _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
    qabs[i] = _mm256_abs_epi32(qi[i]);
    sum = _mm256_add_epi32(sum, qi[i]);
  }
  store32_i8(qi, q);
  store32_i8(qabs, qa);
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

}  // namespace hk
