// What every int8 product kernel of qmatmul.cc reads: the packed weight's tile size, the
// activation blocks, the prefetch distance, and one call's operands (Problem).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace hk {

constexpr int QK = 32;  // activation block of w8a8
// Activation block of w8a16. An int32 lane sums (w + 128) * q over half a block's inputs: 64 * 255 *
// 32767 < 2^31, so 128 is as long as a block can be; 16 bits leave SmolLM2's perplexity where the
// float32 activations have it even with one scale per row (4.4834 vs 4.4836, simulated in XLA).
constexpr int QK16 = 128;
constexpr int NT = 64;  // output columns per packed tile
// Prefetch distance in bytes: each loop asks for the weight lines this far ahead of the ones it reads.
// The hardware prefetcher alone left hk_w8a32 at ~7 GB/s per core on the 2-core Xeon VM (its loop is
// long per cache line); asking 4 KiB ahead made SmolLM2's batch-1 matmuls 1.7x faster (README.md).
constexpr int PF = 4096;

inline void prefetch_128(const uint8_t* q) {  // the AVX2 paths read a tile's 256-byte rows in halves
  for (int i = 0; i < 2; ++i) _mm_prefetch(reinterpret_cast<const char*>(q + PF + 64 * i), _MM_HINT_T0);
}

inline void prefetch_256(const uint8_t* q) {
  for (int i = 0; i < 4; ++i) _mm_prefetch(reinterpret_cast<const char*>(q + PF + 64 * i), _MM_HINT_T0);
}

struct Problem {
  int64_t m, k, n, kp, np;  // rows, inputs, outputs, padded inputs, padded outputs
  const uint8_t* w;         // packed [np/64][kp/4][64][4]
  const float* scale;       // [n]
  float* y;                 // [m, n]
  // w8a8: quantized rows
  const int8_t* xq;   // [m, kp]
  const uint8_t* xa;  // [m, kp] |xq| (AVX2's vpmaddubsw needs an unsigned operand)
  const float* d;     // [m, kp/32] block scales
  const float* c;     // [m] 128 * sum over blocks of d_b * sum(xq in b)
  // w8a16: int16 rows, a scale per block of 128 and, per block, 128 * the sum of the q that meet
  // the weights' even int32 lanes (inputs 4i, 4i+1) and odd ones (4i+2, 4i+3): the +128 offset
  // taken back exactly, in the integers, before a block's sums turn float
  const int16_t* x16;  // [m, kp]
  const float* d16;    // [m, nb16]
  const int32_t* c16;  // [m, nb16, 2]
  // w8a32: zero-padded float rows
  const float* xf;  // [m, kp]
};

inline void store_tile(const Problem& p, int64_t row, int64_t col0, const float* acc) {
  int64_t cols = std::min<int64_t>(NT, p.n - col0);
  float* out = p.y + row * p.n + col0;
  for (int64_t j = 0; j < cols; ++j) out[j] = acc[j] * p.scale[col0 + j];
}

inline int64_t blocks16(int64_t kp) { return (kp + QK16 - 1) / QK16; }

}  // namespace hk
