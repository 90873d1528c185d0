// e^x for 8 floats at once (AVX2 + FMA), shared by the kernels that need exponentials of values minus
// their maximum (attention.cc's softmax, logits.cc's log-sum-exp).
#pragma once

#include <immintrin.h>

namespace hk {

// e^x for 8 values (x <= 0 here: scores minus their maximum), Cephes' expf: x = n ln2 + r, a degree-6
// polynomial in r, times 2^n; ~1 ulp. std::exp is a libm call per score, which made the kernel
// slower than XLA's vectorized softmax.
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));  // e^-87 is still a normal float; below it ~0 anyway
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

}  // namespace hk
