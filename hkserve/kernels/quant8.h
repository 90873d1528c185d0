// Activations quantized to int8 in blocks of 32 values (absmax / 127, round half to even: llama.cpp's
// Q8_0), shared by hk_w8a8 (qmatmul.cc) and hk_w4a8 (q4matmul.cc).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "problem.h"

namespace hk {

// One block of 32 values (zero past `n`) → int8 q, |q|, and its scale absmax / 127; returns sum(q).
// Compiled for AVX2 (every ISA path has it) so that nearbyint is one vroundps, not a libm call.
__attribute__((target("avx2,fma"))) inline int32_t quantize_block(const float* x, int64_t n, int8_t* q, uint8_t* qa,
                                                            float* d) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  float inv = amax > 0.f ? 127.f / amax : 0.f;
  *d = amax / 127.f;
  int32_t sum = 0;
  for (int64_t i = 0; i < QK; ++i) {
    int32_t v = i < n ? static_cast<int32_t>(std::nearbyint(x[i] * inv)) : 0;
    v = std::max(-127, std::min(127, v));
    q[i] = static_cast<int8_t>(v), qa[i] = static_cast<uint8_t>(v < 0 ? -v : v);
    sum += v;
  }
  return sum;
}

}  // namespace hk
