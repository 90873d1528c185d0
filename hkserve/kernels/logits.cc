// What sampling reads of a whole vocabulary row, in one kernel over XLA's thread pool.
//
// A greedy decode step needs of the logits x [B, V] (and the requests' logit_bias [B, V]) only
//   row_max[b]   = max_v x[b, v]                                    (NaN if the row has a NaN)
//   log_total[b] = log sum_v exp(x[b, v] - row_max[b])              (NaN unless row_max is finite)
//   greedy[b]    = the first v of the largest x[b, v] + bias[b, v]  (V - 1 if the row has a NaN)
//   chunk_max[b, c] = max x[b, v] over v in [c * chunk, (c + 1) * chunk)  (NaN if that chunk has one)
// (the chosen token's logprob is x - row_max - log_total; the chunk maxima are the first stage of
// sampling.top_k, the reported top logprobs, which XLA ran as one more single-threaded pass over [B, V]:
// 0.08 ms of Gemma 3's 7.9 ms batch-1 step, V = 262,144). XLA's CPU backend ran these as five
// passes over [B, V], each on one thread: at 16 slots of SmolLM2 (V = 49152) about 1.2 ms of a 14.6 ms
// step. Here a row is read twice (max and argmax, then the exponentials of vexp.h; it stays in L2
// between) and rows are split over the pool's threads. Each row's arithmetic is fixed (8 lanes, a
// fixed lane order, the sum in double), so a row's results do not depend on the batch (batch
// invariance).
// AVX2 + FMA: every machine the matrix kernels run on has it.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "threads.h"
#include "vexp.h"
#include "xla/ffi/api/ffi.h"

namespace {

// Lanes past the row's end: -inf values (they never win) with an index past every real one.
__attribute__((target("avx2,fma"))) inline __m256 load_tail(const float* p, int64_t n) {
  alignas(32) float tmp[8];
  for (int i = 0; i < 8; ++i) tmp[i] = i < n ? p[i] : -std::numeric_limits<float>::infinity();
  return _mm256_load_ps(tmp);
}

struct Row {
  float row_max, log_total;
  int32_t greedy;
};

// The largest of a vector's 8 lanes (NaN lanes are not seen: the caller tracks them).
__attribute__((target("avx2,fma"))) inline float max_lane(__m256 m) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// One row's statistics; its chunk maxima into chunk_max[ceil(v / chunk)] (chunk a multiple of 8).
__attribute__((target("avx2,fma"))) Row row_stats(const float* x, const float* bias, int64_t v, int64_t chunk,
                                                  float* chunk_max) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  __m256 vmax = _mm256_set1_ps(-inf), best = _mm256_set1_ps(-inf), unordered = _mm256_setzero_ps();
  __m256i best_at = _mm256_set1_epi32(std::numeric_limits<int32_t>::max());
  __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i eight = _mm256_set1_epi32(8);
  for (int64_t c0 = 0; c0 < v; c0 += chunk) {
    __m256 cmax = _mm256_set1_ps(-inf), cnan = _mm256_setzero_ps();
    for (int64_t i = c0, end = std::min(v, c0 + chunk); i < end; i += 8, at = _mm256_add_epi32(at, eight)) {
      __m256 xv = i + 8 <= v ? _mm256_loadu_ps(x + i) : load_tail(x + i, v - i);
      __m256 bv = i + 8 <= v ? _mm256_loadu_ps(bias + i) : load_tail(bias + i, v - i);
      __m256 y = _mm256_add_ps(xv, bv);
      cnan = _mm256_or_ps(cnan, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
      vmax = _mm256_max_ps(vmax, xv);
      cmax = _mm256_max_ps(cmax, xv);
      // Strictly greater, or the lane's first value (-inf too): each lane keeps its first largest.
      __m256 take = _mm256_or_ps(_mm256_cmp_ps(y, best, _CMP_GT_OQ),
                                 _mm256_castsi256_ps(_mm256_cmpeq_epi32(best_at, _mm256_set1_epi32(INT32_MAX))));
      take = _mm256_and_ps(take, _mm256_cmp_ps(y, y, _CMP_ORD_Q));
      best = _mm256_blendv_ps(best, y, take);
      best_at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_at), _mm256_castsi256_ps(at), take));
    }
    chunk_max[c0 / chunk] = _mm256_movemask_ps(cnan) ? nan : max_lane(cmax);
    unordered = _mm256_or_ps(unordered, cnan);
  }
  alignas(32) float m[8], b[8];
  alignas(32) int32_t a[8];
  _mm256_store_ps(m, vmax), _mm256_store_ps(b, best), _mm256_store_si256(reinterpret_cast<__m256i*>(a), best_at);
  if (_mm256_movemask_ps(unordered)) return {nan, nan, static_cast<int32_t>(v - 1)};
  Row out{m[0], 0.f, a[0]};
  for (int i = 1; i < 8; ++i) {
    out.row_max = std::max(out.row_max, m[i]);
    if (b[i] > b[0] || (b[i] == b[0] && a[i] < a[0])) b[0] = b[i], a[0] = a[i];
  }
  out.greedy = a[0];
  if (!std::isfinite(out.row_max)) return {out.row_max, nan, out.greedy};
  const __m256 mv = _mm256_set1_ps(out.row_max);
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  for (int64_t i = 0; i < v; i += 8) {
    __m256 xv = i + 8 <= v ? _mm256_loadu_ps(x + i) : load_tail(x + i, v - i);
    // exp8 takes values below -87 as -87: tail lanes (-inf) add e^-87 each, as -inf logits do, below
    // what a double sum of at least 1 (the maximum's own term) can hold.
    __m256 e = hk::exp8(_mm256_sub_ps(xv, mv));
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double s[4];
  _mm256_store_pd(s, _mm256_add_pd(s0, s1));
  out.log_total = static_cast<float>(std::log((s[0] + s[1]) + (s[2] + s[3])));
  return out;
}

ffi::Error logit_stats(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> bias,
                       ffi::ResultBuffer<ffi::F32> row_max, ffi::ResultBuffer<ffi::F32> log_total,
                       ffi::ResultBuffer<ffi::S32> greedy, ffi::ResultBuffer<ffi::F32> chunk_max, int64_t chunk,
                       int64_t threads) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || bias.dimensions().size() != 2 || bias.dimensions()[0] != xd[0] ||
      bias.dimensions()[1] != xd[1] || xd[1] < 1 || xd[1] > INT32_MAX - 8)
    return ffi::Error::InvalidArgument("hk logit stats: x and bias must both be [B, V] with 1 <= V < 2^31 - 8");
  const int64_t rows = xd[0], v = xd[1], chunks = chunk > 0 ? (v + chunk - 1) / chunk : 0;
  auto cd = chunk_max->dimensions();
  if (chunk < 8 || chunk % 8 || cd.size() != 2 || cd[0] != rows || cd[1] != chunks)
    return ffi::Error::InvalidArgument("hk logit stats: chunk must be a multiple of 8 and chunk_max [B, ceil(V / chunk)]");
  const float *xp = x.typed_data(), *bp = bias.typed_data();
  float *mp = row_max->typed_data(), *lp = log_total->typed_data();
  int32_t* gp = greedy->typed_data();
  float* cp = chunk_max->typed_data();
  hk::parallel_tiles(pool, rows, hk::call_threads(pool, threads), [=](int64_t r) {
    Row out = row_stats(xp + r * v, bp + r * v, v, chunk, cp + r * chunks);
    mp[r] = out.row_max, lp[r] = out.log_total, gp[r] = out.greedy;
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HkLogitStats, logit_stats,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [B, V]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias [B, V]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // row_max [B]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // log_total [B]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // greedy [B]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // chunk_max [B, ceil(V / chunk)]
                                  .Attr<int64_t>("chunk")
                                  .Attr<int64_t>("threads"));
