// int8 matrix products for XLA's CPU backend, called as FFI custom calls from the jitted steps.
//
// Weights are packed once at load (hkserve/kernels/pack.py) as uint8 w + 128 in the layout
// [N_pad/64][K_pad/4][64][4]: tile t holds output columns 64t..64t+63, and each 4-byte lane holds
// 4 consecutive inputs of one column, which is what vpdpbusd consumes. K_pad is a multiple of 32
// (the activation block), N_pad of 64; padding is zero weight (128 stored).
//
//   hk_w8a8:  y = scale * (x8 . w), x quantized on the fly per row in blocks of 32 values
//             (absmax / 127, round half to even, as llama.cpp's Q8_0). vpdpbusd multiplies the
//             unsigned w + 128 by signed x8, so the offset costs 128 * sum(x8) per block: a per-row
//             constant folded in at the end, no extra weight bytes.
//   hk_w8a16: y = scale * (x16 . w), x quantized on the fly per row to int16 in blocks of 128
//             values (absmax / 32767, round half to even), products by vpdpwssd on the weights
//             widened to 16 bits: two int16 products per int32 lane, twice the multiply-adds of
//             hk_w8a32's float32 FMAs per instruction, and exact integer sums within a block
//             (w8a16.h). The default (--kernels auto).
//   hk_w8a32: y = scale * (x . w), float32 activations, int8 weights widened in registers.
//
// Attribute isa: 2 = AVX-512 VNNI, 1 = AVX2 (vpmaddubsw/vpmaddwd for w8a8, vpmaddwd for w8a16). Work is split by
// output tiles over XLA's own intra-op thread pool: the calling thread works too and never waits
// for a helper that has not started, so a busy pool costs parallelism, never a stall.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "problem.h"
#include "quant8.h"
#include "threads.h"
#include "w8a16.h"
#include "xla/ffi/api/ffi.h"

namespace {

using hk::NT, hk::QK, hk::Problem, hk::blocks16, hk::prefetch_128, hk::prefetch_256, hk::store_tile;
using hk::a16_rows_512, hk::a16_rows_avx2, hk::quantize_block, hk::quantize_rows16;

// ---------------------------------------------------------------- AVX-512 VNNI

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void a8_rows_512(const Problem& p, int64_t t, int64_t r0) {
  const uint8_t* wt = p.w + t * p.kp * NT;
  __m512 f[R][4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) f[r][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.kp / QK; ++b) {
    __m512i a[R][4];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) a[r][i] = _mm512_setzero_si512();
    for (int g = 0; g < QK / 4; ++g) {
      const uint8_t* q = wt + (b * (QK / 4) + g) * 256;
      prefetch_256(q);
      __m512i w0 = _mm512_loadu_si512(q), w1 = _mm512_loadu_si512(q + 64);
      __m512i w2 = _mm512_loadu_si512(q + 128), w3 = _mm512_loadu_si512(q + 192);
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, p.xq + (r0 + r) * p.kp + b * QK + g * 4, 4);
        __m512i xb = _mm512_set1_epi32(x4);
        a[r][0] = _mm512_dpbusd_epi32(a[r][0], w0, xb);
        a[r][1] = _mm512_dpbusd_epi32(a[r][1], w1, xb);
        a[r][2] = _mm512_dpbusd_epi32(a[r][2], w2, xb);
        a[r][3] = _mm512_dpbusd_epi32(a[r][3], w3, xb);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512 dv = _mm512_set1_ps(p.d[(r0 + r) * (p.kp / QK) + b]);
      for (int i = 0; i < 4; ++i) f[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][i]), dv, f[r][i]);
    }
  }
  alignas(64) float acc[NT];
  for (int r = 0; r < R; ++r) {
    __m512 cv = _mm512_set1_ps(p.c[r0 + r]);
    for (int i = 0; i < 4; ++i) _mm512_store_ps(acc + 16 * i, _mm512_sub_ps(f[r][i], cv));
    store_tile(p, r0 + r, t * NT, acc);
  }
}

template <int R>
__attribute__((target("avx512f,avx512bw"))) void a32_rows_512(const Problem& p, int64_t t, int64_t r0) {
  const uint8_t* wt = p.w + t * p.kp * NT;
  const __m512i flip = _mm512_set1_epi32(static_cast<int32_t>(0x80808080u));
  __m512 f[R][4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) f[r][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.kp / 4; ++g) {
    const uint8_t* q = wt + g * 256;
    prefetch_256(q);
    for (int i = 0; i < 4; ++i) {
      __m512i v = _mm512_xor_si512(_mm512_loadu_si512(q + 64 * i), flip);  // back to int8 lanes
      __m512 w[4] = {
          _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24)),
          _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24)),
          _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 8), 24)),
          _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24)),
      };
      for (int r = 0; r < R; ++r) {
        const float* x = p.xf + (r0 + r) * p.kp + g * 4;
        for (int e = 0; e < 4; ++e) f[r][i] = _mm512_fmadd_ps(w[e], _mm512_set1_ps(x[e]), f[r][i]);
      }
    }
  }
  alignas(64) float acc[NT];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < 4; ++i) _mm512_store_ps(acc + 16 * i, f[r][i]);
    store_tile(p, r0 + r, t * NT, acc);
  }
}

// ---------------------------------------------------------------- AVX2 (32-column halves of a tile)

template <int R>
__attribute__((target("avx2,fma"))) void a8_rows_avx2(const Problem& p, int64_t t, int64_t r0, float (*acc)[NT]) {
  const uint8_t* wt = p.w + t * p.kp * NT;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 f[R][4];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) f[r][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < p.kp / QK; ++b) {
      __m256i a[R][4];
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 4; ++i) a[r][i] = _mm256_setzero_si256();
      for (int g = 0; g < QK / 4; ++g) {
        const uint8_t* q = wt + (b * (QK / 4) + g) * 256 + h * 128;
        prefetch_128(q);
        __m256i w[4];
        for (int i = 0; i < 4; ++i)
          w[i] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * i)), flip);
        for (int r = 0; r < R; ++r) {
          int32_t s4, u4;
          std::memcpy(&s4, p.xq + (r0 + r) * p.kp + b * QK + g * 4, 4);
          std::memcpy(&u4, p.xa + (r0 + r) * p.kp + b * QK + g * 4, 4);
          __m256i xs = _mm256_set1_epi32(s4), xu = _mm256_set1_epi32(u4);
          for (int i = 0; i < 4; ++i) {
            // |x| * (w * sign(x)): at most 2 * 127 * 127, so vpmaddubsw cannot saturate
            __m256i prod = _mm256_maddubs_epi16(xu, _mm256_sign_epi8(w[i], xs));
            a[r][i] = _mm256_add_epi32(a[r][i], _mm256_madd_epi16(prod, ones));
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        __m256 dv = _mm256_set1_ps(p.d[(r0 + r) * (p.kp / QK) + b]);
        for (int i = 0; i < 4; ++i) f[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][i]), dv, f[r][i]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(acc[r] + h * 32 + 8 * i, f[r][i]);
  }
}

template <int R>
__attribute__((target("avx2,fma"))) void a32_rows_avx2(const Problem& p, int64_t t, int64_t r0, float (*acc)[NT]) {
  const uint8_t* wt = p.w + t * p.kp * NT;
  const __m256i flip = _mm256_set1_epi32(static_cast<int32_t>(0x80808080u));
  for (int h = 0; h < 2; ++h) {
    __m256 f[R][4];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) f[r][i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < p.kp / 4; ++g) {
      const uint8_t* q = wt + g * 256 + h * 128;
      prefetch_128(q);
      for (int i = 0; i < 4; ++i) {
        __m256i v = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * i)), flip);
        __m256 w[4] = {
            _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24)),
            _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24)),
            _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 8), 24)),
            _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 24)),
        };
        for (int r = 0; r < R; ++r) {
          const float* x = p.xf + (r0 + r) * p.kp + g * 4;
          for (int e = 0; e < 4; ++e) f[r][i] = _mm256_fmadd_ps(w[e], _mm256_set1_ps(x[e]), f[r][i]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(acc[r] + h * 32 + 8 * i, f[r][i]);
  }
}

template <int R, int A>
void rows_avx2(const Problem& p, int64_t t, int64_t r0) {
  float acc[R][NT];
  if constexpr (A == 1) {
    a8_rows_avx2<R>(p, t, r0, acc);  // signed products: no offset to take back
  } else if constexpr (A == 2) {
    a16_rows_avx2<R>(p, t, r0, acc);
  } else {
    a32_rows_avx2<R>(p, t, r0, acc);
  }
  for (int r = 0; r < R; ++r) store_tile(p, r0 + r, t * NT, acc[r]);
}

// One output tile for every row: rows in groups that share each weight load. A: the activations,
// 1 int8 (w8a8), 2 int16 (w8a16), 0 float32 (w8a32). Rows [r, end) of tile t.
template <int ISA, int A>
void run_tile(const Problem& p, int64_t t, int64_t r, int64_t end) {
  if (ISA == 2) {
    constexpr int G = A == 0 ? 4 : 2;  // rows per weight load: what the 32 registers hold
    if constexpr (A == 1) {
      for (; r + G <= end; r += G) a8_rows_512<G>(p, t, r);
      for (; r < end; ++r) a8_rows_512<1>(p, t, r);
    } else if constexpr (A == 2) {
      for (; r + G <= end; r += G) a16_rows_512<G>(p, t, r);
      for (; r < end; ++r) a16_rows_512<1>(p, t, r);
    } else {
      for (; r + G <= end; r += G) a32_rows_512<G>(p, t, r);
      for (; r < end; ++r) a32_rows_512<1>(p, t, r);
    }
  } else {
    for (; r + 2 <= end; r += 2) rows_avx2<2, A>(p, t, r);
    for (; r < end; ++r) rows_avx2<1, A>(p, t, r);
  }
}

// ---------------------------------------------------------------- activations

__attribute__((target("avx2,fma"))) void quantize_rows(const float* x, int64_t m, int64_t k, int64_t kp, int8_t* xq,
                                                        uint8_t* xa, float* d, float* c) {
  for (int64_t r = 0; r < m; ++r) {
    float corr = 0.f;
    for (int64_t b = 0; b < kp / QK; ++b) {
      int64_t lo = b * QK, n = std::max<int64_t>(0, std::min<int64_t>(QK, k - lo)), at = r * kp + lo;
      int64_t db = r * (kp / QK) + b;
      int32_t sum = quantize_block(x + r * k + lo, n, xq + at, xa + at, d + db);
      corr += d[db] * static_cast<float>(sum);
    }
    c[r] = 128.f * corr;
  }
}

// w is one packed weight [N/64, K/4, 64, 4] with scale [N], or a scanned layer stack of them
// [L, N/64, K/4, 64, 4] with scale [L, N], of which `layer` (an int32 scalar in host memory, the
// scan's index) is read in place: slicing it out in XLA would copy every layer's weight every step.
template <int A>
ffi::Error matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> scale,
                  ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int64_t isa, int64_t threads) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions();
  size_t lead = wd.size() - 4;  // 0: one weight, 1: a layer stack
  if (xd.size() != 2 || (wd.size() != 4 && wd.size() != 5) || wd[lead + 2] != NT || wd[lead + 3] != 4 ||
      sd.size() != lead + 1 || (lead && sd[0] != wd[0]) || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "hk matmul: x must be [M, K], w packed [(L,) N/64, K/4, 64, 4], scale [(L,) N], layer a scalar");
  int64_t layers = lead ? wd[0] : 1, l = layer.typed_data()[0];
  if (l < 0 || l >= layers) return ffi::Error::InvalidArgument("hk matmul: layer index out of range");
  Problem p{};
  p.m = xd[0], p.k = xd[1], p.n = sd[lead], p.kp = wd[lead + 1] * 4, p.np = wd[lead] * NT;
  if (p.kp % QK || p.kp < p.k || p.kp - p.k >= QK || p.np < p.n || p.np - p.n >= NT)
    return ffi::Error::InvalidArgument("hk matmul: packed weight does not fit x and scale");
  if (isa != 1 && isa != 2) return ffi::Error::InvalidArgument("hk matmul: isa must be 1 (AVX2) or 2 (AVX-512 VNNI)");
  p.w = w.typed_data() + l * p.np * p.kp, p.scale = scale.typed_data() + l * p.n, p.y = y->typed_data();
  if (p.m == 0) return ffi::Error::Success();
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<uint8_t> xa;
  thread_local std::vector<int16_t> x16;
  thread_local std::vector<int32_t> c16;
  thread_local std::vector<float> xf, d, c;
  if (A == 1) {
    xq.resize(p.m * p.kp), xa.resize(p.m * p.kp), d.resize(p.m * p.kp / QK), c.resize(p.m);
    quantize_rows(x.typed_data(), p.m, p.k, p.kp, xq.data(), xa.data(), d.data(), c.data());
    p.xq = xq.data(), p.xa = xa.data(), p.d = d.data(), p.c = c.data();
  } else if (A == 2) {
    int64_t nb = blocks16(p.kp);
    x16.resize(p.m * p.kp), d.resize(p.m * nb), c16.resize(p.m * nb * 2);
    quantize_rows16(x.typed_data(), p.m, p.k, p.kp, x16.data(), d.data(), c16.data());
    p.x16 = x16.data(), p.d16 = d.data(), p.c16 = c16.data();
  } else {
    xf.assign(p.m * p.kp, 0.f);
    for (int64_t r = 0; r < p.m; ++r) std::memcpy(xf.data() + r * p.kp, x.typed_data() + r * p.k, p.k * sizeof(float));
    p.xf = xf.data();
  }
  // threads 0: XLA's pool, batch-1 decode included: on a quiet 2-core machine two threads read the
  // weights in about half the time of one (hkserve/kernels/README.md); within the cap while other
  // processes hold cores.
  threads = hk::call_threads(pool, threads);
  // Work items are (tile, group of rows). A product of few tiles for its threads (at SmolLM2's sizes
  // k and v have 3, q, o and down 9) splits its rows too, 8 a group, so that both threads get equal
  // shares; otherwise a tile's rows stay together and its weights are read once. A row's arithmetic is
  // the same in any group (batch invariance).
  int64_t tiles = p.np / NT;
  int64_t span = tiles < 8 * threads && p.m >= 16 ? 8 : p.m, groups = (p.m + span - 1) / span;
  auto body = [&p, isa, span, groups](int64_t item) {
    int64_t t = item / groups, r = item % groups * span, end = std::min(p.m, r + span);
    isa == 2 ? run_tile<2, A>(p, t, r, end) : run_tile<1, A>(p, t, r, end);
  };
  // A tile with all the rows (one group): tiles in runs of adjacent ones where they are many (the head).
  hk::parallel_runs(pool, tiles * groups, groups == 1 ? hk::tile_run(tiles, p.kp * NT, threads) : 1, threads, body);
  return ffi::Error::Success();
}

}  // namespace

// The three targets share one signature: x, packed w, scale, layer → y; attributes isa, threads.
#define HK_MATMUL_TARGET(name, activations)                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, matmul<activations>,    \
                                ffi::Ffi::Bind()              \
                                    .Ctx<ffi::ThreadPool>()   \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::Buffer<ffi::U8>>()  \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Ret<ffi::Buffer<ffi::F32>>() \
                                    .Attr<int64_t>("isa")     \
                                    .Attr<int64_t>("threads"));

HK_MATMUL_TARGET(HkW8A8, 1)
HK_MATMUL_TARGET(HkW8A16, 2)
HK_MATMUL_TARGET(HkW8A32, 0)

// The cap on the pool threads of calls that leave their count to the pool (0: none); see threads.h.
extern "C" void hk_set_thread_cap(int cap) { hk::thread_cap().store(std::max(0, cap)); }
extern "C" int hk_thread_cap() { return hk::thread_cap().load(); }

// What this CPU (and its OS) can run: 2 = AVX-512 VNNI, 1 = AVX2 + FMA, 0 = neither.
extern "C" int hk_cpu_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni"))
    return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}
