// Decode attention (one new token per row) that reads the KV memory where it lies: the static
// memory [L, B, S, Hkv, Dh] or the paged pool [L, NB, bs, Hkv, Dh] through each row's block table
// (hkserve/model/paged_memory.py). Only where a position's record lies differs; the arithmetic is
// one code path, so both layouts give the same bits.
//
// XLA's CPU dots need each layer's past keys and values as a contiguous, transposed
// [B, Hkv, W, Dh] copy (and the values concatenated with the new one) before they can multiply:
// at 16 slots those copies and small batched dots were a third of a SmolLM2 step. This kernel takes
// the whole memory [L, B, S, Hkv, Dh], the scan's layer index and each row's past length, and reads
// only the positions each row can see.
//
//   y[b, h, g] = sum_s p_s v_s over the row's visible past s (s < past_len[b], and within the
//   sliding window if any) and the new token, p = softmax(cap(q . k)), as hkserve/model/attention.py.
//
// A (row, kv head)'s arithmetic is the same whatever the batch and whichever work item computes it,
// so a request's result does not depend on the others (batch invariance).
//
// The memory is float32 or bfloat16 (--kv-dtype bf16: HkDecodeAttentionBf16, the same code for 16-bit
// elements, widened exactly as they are loaded); q and the new token's key and value are float32.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "threads.h"
#include "vexp.h"
#include "xla/ffi/api/ffi.h"

namespace {

// 8 memory values at d as float32: float32 as stored, or bfloat16 (uint16 bits) widened exactly in the
// register (its 16 bits the top half of a float32's), so a bf16 memory is read at half the bytes.
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Scores of 8 keys at once: one 8-lane sum per key over d (a multiple of 8), then the 8 sums
// transposed into one vector by a fixed hadd tree. A key's score depends on its own values only (the
// last block is padded with repeats), so it never depends on where its key falls, and a bf16 key
// scores as its widened float32 copy would.
template <typename T>
__attribute__((target("avx2,fma"))) __m256 dot8(const float* q, const T* const* keys, int64_t d) {
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    __m256 qv = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, load8(keys[j] + i), a[j]);
  }
  __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// y[0:d] = sum_i p[i] * rows[i][0:d] + p[n] * last[0:d] (the new token's float32 value), 64 columns at a
// time in registers, rows in order.
template <typename T>
__attribute__((target("avx2,fma"))) void weighted_sum(const float* p, const T* const* rows, int64_t n,
                                                      const float* last, float* y, int64_t d) {
  for (int64_t d0 = 0; d0 < d; d0 += 64) {
    const int chunks = static_cast<int>(std::min<int64_t>(64, d - d0) / 8);
    __m256 o[8];
    for (int c = 0; c < 8; ++c) o[c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      __m256 pv = _mm256_set1_ps(p[i]);
      for (int c = 0; c < chunks; ++c) o[c] = _mm256_fmadd_ps(pv, load8(rows[i] + d0 + 8 * c), o[c]);
    }
    const __m256 pv = _mm256_set1_ps(p[n]);
    for (int c = 0; c < chunks; ++c) o[c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(last + d0 + 8 * c), o[c]);
    for (int c = 0; c < chunks; ++c) _mm256_storeu_ps(y + d0 + 8 * c, o[c]);
  }
}

// x[i] = e^(x[i] - top) for i < n; returns their sum (8 partial sums, then a fixed order).
__attribute__((target("avx2,fma"))) float exp_shifted(float* x, int64_t n, float top) {
  const __m256 t = _mm256_set1_ps(top);
  __m256 sum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 e = hk::exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), t));
    _mm256_storeu_ps(x + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  if (i < n) {  // the tail through the same exp8, so a value never depends on where it falls
    alignas(32) float tail[8] = {};
    std::copy(x + i, x + n, tail);
    _mm256_store_ps(tail, hk::exp8(_mm256_sub_ps(_mm256_load_ps(tail), t)));
    for (int64_t j = 0; j < n - i; ++j) total += (x[i + j] = tail[j]);
  }
  return total;
}

// T: the memory's element, float (float32) or uint16_t (bfloat16 bits); q and the new token stay float32.
template <typename T>
struct Rows {
  int64_t b, h, g, d, s;  // rows, kv heads, query heads per kv head, head dim, memory positions per row
  const float *q, *k_new, *v_new;  // q [B,H,G,D]; new [B,H,D]
  const T *k, *v;                  // memory at the layer [B,S,H,D] or [NB,bs,H,D]
  const int32_t* table = nullptr;  // paged: [B, S / bs] block of each row's bs positions
  int64_t bs = 0;                  // paged: positions per block
  const int32_t* past_len;         // [B]
  int32_t window;                  // > 0: only the last `window` positions, the new one included
  float cap;                       // > 0: cap * tanh(score / cap)
  float* y;                        // [B,H,G,D]
};

template <typename T>
struct Scratch {
  std::vector<const T*> keys, values;  // the visible past keys' and values' rows
  std::vector<float> scores;           // the past's, then the new token's
};

// Where row b's position s lies in the memory, in [H, D] records: its own rows of S, or a block's.
template <typename T>
inline int64_t record(const Rows<T>& r, int64_t b, int64_t s) {
  if (r.table == nullptr) return b * r.s + s;
  return int64_t{r.table[b * (r.s / r.bs) + s / r.bs]} * r.bs + s % r.bs;
}

// The past keys (of the memory's type) are scored 8 at a time, the last block padded with repeats of the
// first; the new token's float32 key alone (8 copies, one lane kept). Every key's score is its own lanes'
// arithmetic, so a float32 memory gives the bits it gave when the new key rode in the past's last block.
template <typename T>
__attribute__((target("avx2,fma"))) void attend(const Rows<T>& r, int64_t item, Scratch<T>& t) {
  const int64_t b = item / r.h, h = item % r.h, stride = r.h * r.d;
  const int64_t len = std::clamp<int64_t>(r.past_len[b], 0, r.s);
  const int64_t lo = r.window > 0 ? std::max<int64_t>(0, len - r.window + 1) : 0;
  const int64_t m = len - lo, padded = (m + 7) / 8 * 8;  // past positions seen, in blocks of 8
  t.keys.resize(padded), t.values.resize(m);
  for (int64_t s = lo; s < len; ++s) {
    const int64_t at = record(r, b, s) * stride + h * r.d;
    t.keys[s - lo] = r.k + at, t.values[s - lo] = r.v + at;
  }
  if (m > 0) std::fill(t.keys.begin() + m, t.keys.end(), t.keys[0]);
  const float* k_new = r.k_new + (b * r.h + h) * r.d;
  const float* const news[8] = {k_new, k_new, k_new, k_new, k_new, k_new, k_new, k_new};
  t.scores.resize(padded + 8);
  for (int64_t g = 0; g < r.g; ++g) {
    const float* q = r.q + ((b * r.h + h) * r.g + g) * r.d;
    for (int64_t i = 0; i < padded; i += 8) _mm256_storeu_ps(t.scores.data() + i, dot8(q, t.keys.data() + i, r.d));
    alignas(32) float own[8];
    _mm256_store_ps(own, dot8(q, news, r.d));
    t.scores[m] = own[0];
    float top = -INFINITY;
    for (int64_t i = 0; i <= m; ++i) {
      float& x = t.scores[i];
      if (r.cap > 0.f) x = r.cap * std::tanh(x / r.cap);
      top = std::max(top, x);
    }
    float total = exp_shifted(t.scores.data(), m + 1, top);
    for (int64_t i = 0; i <= m; ++i) t.scores[i] /= total;
    weighted_sum(t.scores.data(), t.values.data(), m, r.v_new + (b * r.h + h) * r.d,
                 r.y + ((b * r.h + h) * r.g + g) * r.d, r.d);
  }
}

template <typename T>
void run(ffi::ThreadPool& pool, const Rows<T>& r, int64_t threads) {
  threads = hk::call_threads(pool, threads);
  // With rows enough for the threads, a row's kv heads are one work item: its positions are then read
  // in the memory's own order, each position's heads side by side ([S, H, D] of that row), where an
  // item per (row, head) read every third 256 bytes of it (SmolLM2: 3 kv heads of 64 values). 30
  // layers at 16 rows and 56 positions, alternating builds: 2.19 and 1.88 ms instead of 2.74 and 2.05.
  // Fewer rows (batch 1) keep an item per (row, head), so that the heads still spread over threads.
  const int64_t heads = r.b >= 2 * threads ? r.h : 1;
  hk::parallel_tiles(pool, r.b * r.h / heads, threads, [&r, heads](int64_t item) {
    thread_local Scratch<T> scratch;
    for (int64_t i = item * heads; i < (item + 1) * heads; ++i) attend(r, i, scratch);
  });
}

// table [B, MB] int32: MB = 0 for the static memory [L, B, S, H, D]; else the memory is a paged pool
// [L, NB, bs, H, D], and every block a row can see (its positions < past_len) must be a pool block.
// KV: the memory's dtype, F32 or BF16 (one handler each, so XLA checks the buffers' types at the call).
template <ffi::DataType KV>
ffi::Error decode_attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                            ffi::Buffer<ffi::F32> v_new, ffi::Buffer<KV> k, ffi::Buffer<KV> v,
                            ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> past_len,
                            ffi::Buffer<ffi::S32> window, ffi::ResultBuffer<ffi::F32> y, float cap, int64_t threads) {
  auto qd = q.dimensions(), md = k.dimensions(), td = table.dimensions();
  if (qd.size() != 4 || md.size() != 5 || v.element_count() != k.element_count() || md[3] != qd[1] ||
      md[4] != qd[3] || qd[3] % 16 || k_new.element_count() != qd[0] * qd[1] * qd[3] ||
      v_new.element_count() != k_new.element_count() || past_len.element_count() != qd[0] ||
      layer.element_count() != 1 || window.element_count() != 1 || td.size() != 2 || td[0] != qd[0] ||
      (td[1] == 0 && md[1] != qd[0]))
    return ffi::Error::InvalidArgument(
        "hk decode attention: q [B,H,G,D] (D a multiple of 16), new k/v [B,H,D], memory [L,B,S,H,D] with table "
        "[B,0] or a pool [L,NB,bs,H,D] with table [B,MB], past_len [B], layer and window scalars");
  int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= md[0]) return ffi::Error::InvalidArgument("hk decode attention: layer index out of range");
  using T = ffi::NativeType<KV>;
  Rows<T> r{qd[0], qd[1], qd[2], qd[3], md[2]};
  const int64_t at = l * md[1] * md[2] * md[3] * md[4];
  r.q = q.typed_data(), r.k_new = k_new.typed_data(), r.v_new = v_new.typed_data();
  r.k = k.typed_data() + at, r.v = v.typed_data() + at, r.past_len = past_len.typed_data();
  r.window = window.typed_data()[0], r.cap = cap, r.y = y->typed_data();
  if (td[1] > 0) {  // paged
    r.bs = md[2], r.s = td[1] * r.bs, r.table = table.typed_data();
    for (int64_t b = 0; b < r.b; ++b) {
      const int64_t held = (std::clamp<int64_t>(r.past_len[b], 0, r.s) + r.bs - 1) / r.bs;
      for (int64_t j = 0; j < held; ++j)
        if (r.table[b * td[1] + j] < 0 || r.table[b * td[1] + j] >= md[1])
          return ffi::Error::InvalidArgument("hk decode attention: a row's past lies in a block outside the pool");
    }
  }
  run(pool, r, threads);
  return ffi::Error::Success();
}

template <ffi::DataType KV>
auto binding() {
  return ffi::Ffi::Bind()
      .template Ctx<ffi::ThreadPool>()
      .template Arg<ffi::Buffer<ffi::F32>>()  // q
      .template Arg<ffi::Buffer<ffi::F32>>()  // k_new
      .template Arg<ffi::Buffer<ffi::F32>>()  // v_new
      .template Arg<ffi::Buffer<KV>>()        // k memory
      .template Arg<ffi::Buffer<KV>>()        // v memory
      .template Arg<ffi::Buffer<ffi::S32>>()  // block table ([B, 0]: none)
      .template Arg<ffi::Buffer<ffi::S32>>()  // layer
      .template Arg<ffi::Buffer<ffi::S32>>()  // past_len
      .template Arg<ffi::Buffer<ffi::S32>>()  // window
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<float>("cap")
      .template Attr<int64_t>("threads");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HkDecodeAttention, decode_attention<ffi::F32>, binding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HkDecodeAttentionBf16, decode_attention<ffi::BF16>, binding<ffi::BF16>());
