// hk_w4a8: int4 weights in groups of 32 inputs with a float32 scale and min per (group, column)
// (hkserve/model/int4.py; GGUF's Q4_0/Q4_1/Q4_K map into it exactly) times activations quantized per
// row to int8 in blocks of the same 32 inputs (quant8.h, llama.cpp's Q8_0), called as an FFI custom
// call from the jitted steps.
//
// Per row, group g and column n: y += dx_g * (d_gn * sum_i q_in * xq_i + m_gn * sum_i xq_i), with
// q in 0..15 the unsigned side of vpdpbusd (AVX-512 VNNI) or vpmaddubsw (AVX2): the nibbles need no
// offset and no sign trick. Integer sums are exact (AVX2: 8 vpmaddubsw pairs per int16 lane, at most
// 8 * 2 * 15 * 127 = 30480 < 2^15); the float accumulation per column runs in one order whatever the
// batch, the row group or the thread.
//
// Packed layout (kernels/pack4.py), per 64-column tile t and group g, 1024 bytes: 4 input quads j,
// each 4 column quarters c, each 16 columns x 4 inputs; a byte holds input 4j + e of the group in its
// low nibble and input 16 + 4j + e in its high one, so a 64-byte line gives two vpdpbusd operands
// (v & 15, v >> 4 & 15). Scales and mins: [N/64][K/32][64] float32, read with the tile's group.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "problem.h"
#include "quant8.h"
#include "threads.h"
#include "xla/ffi/api/ffi.h"

namespace {

constexpr int64_t G4 = 32;    // inputs per group (= hk::QK, the activation block)
constexpr int64_t GB = 1024;  // packed bytes per (tile, group): 64 columns x 32 nibbles

struct Q4Problem {
  int64_t m, k, n, kp, np;  // rows, inputs, outputs, padded inputs (whole groups), padded outputs
  const uint8_t* w;         // [np/64][kp/32][1024]
  const float* sc;          // [np/64][kp/32][64]
  const float* mn;          // [np/64][kp/32][64]
  const int8_t* xq;         // [m, kp] int8 activations
  const float* xd;          // [m, kp/32] block scales absmax / 127
  const float* xs;          // [m, kp/32] xd * sum of the block's xq (what the mins multiply)
  float* y;                 // [m, n]
};

void store(const Q4Problem& p, int64_t row, int64_t t, const float* acc) {
  int64_t cols = std::min<int64_t>(hk::NT, p.n - t * hk::NT);
  std::memcpy(p.y + row * p.n + t * hk::NT, acc, cols * sizeof(float));
}

int32_t quad(const Q4Problem& p, int64_t row, int64_t g, int64_t at) {  // 4 int8 inputs as one lane
  int32_t v;
  std::memcpy(&v, p.xq + row * p.kp + g * G4 + at, 4);
  return v;
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void rows_512(const Q4Problem& p, int64_t t, int64_t r0) {
  const int64_t ng = p.kp / G4;
  const uint8_t* wt = p.w + t * ng * GB;
  const float *sc = p.sc + t * ng * hk::NT, *mn = p.mn + t * ng * hk::NT;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 f[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) f[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m512i a[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      __m512i xl[R], xh[R];
      for (int r = 0; r < R; ++r) {
        xl[r] = _mm512_set1_epi32(quad(p, r0 + r, g, 4 * j));
        xh[r] = _mm512_set1_epi32(quad(p, r0 + r, g, 16 + 4 * j));
      }
      const uint8_t* q = wt + g * GB + j * 256;
      hk::prefetch_256(q);
      for (int c = 0; c < 4; ++c) {
        __m512i v = _mm512_loadu_si512(q + 64 * c);
        __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          a[r][c] = _mm512_dpbusd_epi32(a[r][c], lo, xl[r]);
          a[r][c] = _mm512_dpbusd_epi32(a[r][c], hi, xh[r]);
        }
      }
    }
    for (int c = 0; c < 4; ++c) {
      __m512 d = _mm512_loadu_ps(sc + g * hk::NT + 16 * c), m = _mm512_loadu_ps(mn + g * hk::NT + 16 * c);
      for (int r = 0; r < R; ++r) {
        int64_t at = (r0 + r) * ng + g;
        __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(p.xd[at]));
        f[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][c]), dd, f[r][c]);
        f[r][c] = _mm512_fmadd_ps(m, _mm512_set1_ps(p.xs[at]), f[r][c]);
      }
    }
  }
  alignas(64) float acc[hk::NT];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < 4; ++c) _mm512_store_ps(acc + 16 * c, f[r][c]);
    store(p, r0 + r, t, acc);
  }
}

// As rows_512 one 16-column quarter at a time (each 64-byte line: two 8-column halves), with
// vpmaddubsw's int16 pair sums added over the group's 8 operands before one vpmaddwd widens them.
template <int R>
__attribute__((target("avx2,fma"))) void rows_avx2(const Q4Problem& p, int64_t t, int64_t r0, float (*acc)[hk::NT]) {
  const int64_t ng = p.kp / G4;
  const uint8_t* wt = p.w + t * ng * GB;
  const float *sc = p.sc + t * ng * hk::NT, *mn = p.mn + t * ng * hk::NT;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int c = 0; c < 4; ++c) {
    __m256 f[R][2];
    for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
      __m256i s[R][2];
      for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const uint8_t* q = wt + g * GB + j * 256 + 64 * c;
        _mm_prefetch(reinterpret_cast<const char*>(q + hk::PF), _MM_HINT_T0);
        for (int e = 0; e < 2; ++e) {
          __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * e));
          __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int r = 0; r < R; ++r) {
            __m256i xl = _mm256_set1_epi32(quad(p, r0 + r, g, 4 * j));
            __m256i xh = _mm256_set1_epi32(quad(p, r0 + r, g, 16 + 4 * j));
            s[r][e] = _mm256_add_epi16(s[r][e], _mm256_maddubs_epi16(lo, xl));
            s[r][e] = _mm256_add_epi16(s[r][e], _mm256_maddubs_epi16(hi, xh));
          }
        }
      }
      for (int e = 0; e < 2; ++e) {
        const int64_t col = g * hk::NT + 16 * c + 8 * e;
        __m256 d = _mm256_loadu_ps(sc + col), m = _mm256_loadu_ps(mn + col);
        for (int r = 0; r < R; ++r) {
          int64_t at = (r0 + r) * ng + g;
          __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(p.xd[at]));
          __m256i sum = _mm256_madd_epi16(s[r][e], ones);
          f[r][e] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), dd, f[r][e]);
          f[r][e] = _mm256_fmadd_ps(m, _mm256_set1_ps(p.xs[at]), f[r][e]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int e = 0; e < 2; ++e) _mm256_storeu_ps(acc[r] + 16 * c + 8 * e, f[r][e]);
  }
}

template <int R>
void avx2_tile(const Q4Problem& p, int64_t t, int64_t r0) {
  float acc[R][hk::NT];
  rows_avx2<R>(p, t, r0, acc);
  for (int r = 0; r < R; ++r) store(p, r0 + r, t, acc[r]);
}

// Rows [r, end) of tile t, in pairs that share each weight load.
void run_tile(const Q4Problem& p, int64_t isa, int64_t t, int64_t r, int64_t end) {
  if (isa == 2) {
    for (; r + 2 <= end; r += 2) rows_512<2>(p, t, r);
    for (; r < end; ++r) rows_512<1>(p, t, r);
  } else {
    for (; r + 2 <= end; r += 2) avx2_tile<2>(p, t, r);
    for (; r < end; ++r) avx2_tile<1>(p, t, r);
  }
}

void quantize(const float* x, Q4Problem& p, std::vector<int8_t>& xq, std::vector<float>& xd, std::vector<float>& xs) {
  const int64_t ng = p.kp / G4;
  thread_local std::vector<uint8_t> scratch(G4);  // |q|, which only hk_w8a8's AVX2 path reads
  xq.resize(p.m * p.kp), xd.resize(p.m * ng), xs.resize(p.m * ng);
  for (int64_t r = 0; r < p.m; ++r) {
    for (int64_t g = 0; g < ng; ++g) {
      int64_t lo = g * G4, n = std::max<int64_t>(0, std::min<int64_t>(G4, p.k - lo)), at = r * ng + g;
      int32_t sum = hk::quantize_block(x + r * p.k + lo, n, xq.data() + r * p.kp + lo, scratch.data(), &xd[at]);
      xs[at] = xd[at] * static_cast<float>(sum);
    }
  }
  p.xq = xq.data(), p.xd = xd.data(), p.xs = xs.data();
}

// w [(L,) N/64, K/32, 1024] with scale and min [(L,) N/64, K/32, 64]; with a leading L, `layer` (the
// scan's index, an int32 in host memory) picks the layer, read in place (as hk_w8a16's stacks).
ffi::Error w4a8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> scale,
                ffi::Buffer<ffi::F32> mins, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int64_t isa,
                int64_t threads) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  size_t lead = wd.size() - 3;  // 0: one weight, 1: a layer stack
  bool same = sd.size() == wd.size() && mins.dimensions().size() == wd.size();
  for (size_t i = 0; same && i < sd.size(); ++i) same = mins.dimensions()[i] == sd[i] && (i == lead + 2 || sd[i] == wd[i]);
  if (xd.size() != 2 || (wd.size() != 3 && wd.size() != 4) || !same || wd[lead + 2] != GB || sd[lead + 2] != hk::NT ||
      yd.size() != 2 || yd[0] != xd[0] || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "hk_w4a8: x must be [M, K], w [(L,) N/64, K/32, 1024], scale and min [(L,) N/64, K/32, 64], y [M, N]");
  int64_t layers = lead ? wd[0] : 1, l = layer.typed_data()[0];
  if (l < 0 || l >= layers) return ffi::Error::InvalidArgument("hk_w4a8: layer index out of range");
  Q4Problem p{};
  p.m = xd[0], p.k = xd[1], p.n = yd[1], p.kp = wd[lead + 1] * G4, p.np = wd[lead] * hk::NT;
  if (p.kp < p.k || p.kp - p.k >= G4 || p.np < p.n || p.np - p.n >= hk::NT)
    return ffi::Error::InvalidArgument("hk_w4a8: packed weight does not fit x and y");
  if (isa != 1 && isa != 2) return ffi::Error::InvalidArgument("hk_w4a8: isa must be 1 (AVX2) or 2 (AVX-512 VNNI)");
  const int64_t per_layer = p.np / hk::NT * (p.kp / G4);
  p.w = w.typed_data() + l * per_layer * GB, p.y = y->typed_data();
  p.sc = scale.typed_data() + l * per_layer * hk::NT, p.mn = mins.typed_data() + l * per_layer * hk::NT;
  if (p.m == 0) return ffi::Error::Success();
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xdv, xsv;
  quantize(x.typed_data(), p, xq, xdv, xsv);
  threads = hk::call_threads(pool, threads);
  // Items are (tile, group of rows), as hk_w8a16's: few tiles for the threads split 16+ rows by 8.
  int64_t tiles = p.np / hk::NT;
  int64_t span = tiles < 8 * threads && p.m >= 16 ? 8 : p.m, groups = (p.m + span - 1) / span;
  auto body = [&p, isa, span, groups](int64_t item) {
    int64_t t = item / groups, r = item % groups * span;
    run_tile(p, isa, t, r, std::min(p.m, r + span));
  };
  hk::parallel_tiles(pool, tiles * groups, threads, body);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HkW4A8, w4a8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("threads"));
