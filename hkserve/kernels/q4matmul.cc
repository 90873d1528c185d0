// hk_w4a8 and hk_w4a16: int4 weights in groups of 32 inputs with a float32 scale and min per (group, column)
// (hkserve/model/int4.py; GGUF's Q4_0/Q4_1/Q4_K map into it exactly) times activations quantized per
// row to int8 in blocks of the same 32 inputs (quant8.h, llama.cpp's Q8_0; hk_w4a16: int16 per 128,
// q4a16.h), called as FFI custom calls from the jitted steps. Below, hk_w4a8's products.
//
// Per row, group g and column n: y += dx_g * (d_gn * sum_i q_in * xq_i + m_gn * sum_i xq_i), with
// q in 0..15 the unsigned side of vpdpbusd (AVX-512 VNNI) or vpmaddubsw (AVX2): the nibbles need no
// offset and no sign trick. Integer sums are exact; the float accumulation per column runs in one
// order whatever the batch, the row group or the thread.
//
// The packed layout, the operands and the loops: q4.h; this file holds hk_w4a8's activation side (A8),
// hk_w4a16's is q4a16.h (A16); hk_w8ga16 (8-bit groups, int16 activations) is q8a16.h's A8G. All share
// the validation, threads and items below.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "q4.h"
#include "q4a16.h"
#include "q5a16.h"
#include "q5a8.h"
#include "q8a16.h"
#include "quant8.h"
#include "threads.h"
#include "xla/ffi/api/ffi.h"

namespace {

using hk::G4, hk::GB, hk::Q4Problem;

// The int8 side: per quad j, inputs 4j..4j+3 and 16+4j.. broadcast, times the line's low and high
// nibbles as the unsigned operand; AVX2 adds a group's 8 vpmaddubsw results in int16 (at most
// 8 * 2 * 15 * 127 = 30480 < 2^15) before one vpmaddwd widens them.
struct A8 {
  static constexpr int kQuads = 4;
  static constexpr int64_t kBytes = GB;
  struct X512 {
    __m512i l, h;
  };
  struct X256 {
    __m256i l, h;
  };
  __attribute__((target("avx512f"))) static X512 acts512(const Q4Problem& p, int64_t row, int64_t g, int j) {
    return {_mm512_set1_epi32(hk::lane(p.xq, p, row, g, 4 * j)), _mm512_set1_epi32(hk::lane(p.xq, p, row, g, 16 + 4 * j))};
  }
  __attribute__((target("avx512f,avx512bw,avx512vnni"))) static __m512i dot512(__m512i a, __m512i v, const X512& x) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    a = _mm512_dpbusd_epi32(a, _mm512_and_si512(v, low), x.l);
    return _mm512_dpbusd_epi32(a, _mm512_and_si512(_mm512_srli_epi16(v, 4), low), x.h);
  }
  __attribute__((target("avx2"))) static X256 acts256(const Q4Problem& p, int64_t row, int64_t g, int j) {
    return {_mm256_set1_epi32(hk::lane(p.xq, p, row, g, 4 * j)), _mm256_set1_epi32(hk::lane(p.xq, p, row, g, 16 + 4 * j))};
  }
  __attribute__((target("avx2"))) static __m256i dot256(__m256i s, __m256i v, const X256& x) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_and_si256(v, low), x.l));
    return _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), x.h));
  }
  __attribute__((target("avx2"))) static __m256i sums256(__m256i s) { return _mm256_madd_epi16(s, _mm256_set1_epi16(1)); }
};

// Rows → int8 per group of 32 (quant8.h), the calling thread's buffers reused; returns each row's exact
// integer sum per group [m, kp/32] (hk_w5sa8's -16 partner; hk_w4a8 reads its float form xs).
const int32_t* quantize_a8(const float* x, Q4Problem& p) {
  const int64_t ng = p.kp / G4;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, xs;
  thread_local std::vector<int32_t> sums;
  thread_local std::vector<uint8_t> scratch(G4);  // |q|, which only hk_w8a8's AVX2 path reads
  xq.resize(p.m * p.kp), xd.resize(p.m * ng), xs.resize(p.m * ng), sums.resize(p.m * ng);
  for (int64_t r = 0; r < p.m; ++r) {
    for (int64_t g = 0; g < ng; ++g) {
      int64_t lo = g * G4, n = std::max<int64_t>(0, std::min<int64_t>(G4, p.k - lo)), at = r * ng + g;
      sums[at] = hk::quantize_block(x + r * p.k + lo, n, xq.data() + r * p.kp + lo, scratch.data(), &xd[at]);
      xs[at] = xd[at] * static_cast<float>(sums[at]);
    }
  }
  p.xq = xq.data(), p.xd = xd.data(), p.xs = xs.data();
  return sums.data();
}

// The kernels of this file: the weight's bits and the activations' (q4.h's policies).
enum class Kind { w4a8, w4a16, w8ga16 };

// x [M, K], w [(L,) N/64, K/32, bytes], scale [(L,) N/64, K/32, 64] (and min: q4call), y [M, N]: checks
// the shapes, sets p's sizes, weight and output, and *at to the layer's offset in (tile, group) units;
// "" or why not. With a leading L, `layer` (the scan's index, an int32 in host memory) picks the layer,
// read in place (as hk_w8a16's stacks).
template <class D>
std::string grouped_problem(Q4Problem& p, D xd, D wd, D sd, D yd, ffi::Buffer<ffi::S32>& layer, const uint8_t* w,
                            float* y, int64_t bytes, int64_t isa, int64_t* at) {
  size_t lead = wd.size() - 3;  // 0: one weight, 1: a layer stack
  bool same = sd.size() == wd.size();
  for (size_t i = 0; same && i < lead + 2; ++i) same = sd[i] == wd[i];
  if (xd.size() != 2 || (wd.size() != 3 && wd.size() != 4) || !same || wd[lead + 2] != bytes || sd[lead + 2] != hk::NT ||
      yd.size() != 2 || yd[0] != xd[0] || layer.element_count() != 1)
    return "x must be [M, K], w [(L,) N/64, K/32, " + std::to_string(bytes) + "], scale [(L,) N/64, K/32, 64], y [M, N]";
  int64_t layers = lead ? wd[0] : 1, l = layer.typed_data()[0];
  if (l < 0 || l >= layers) return "layer index out of range";
  p.m = xd[0], p.k = xd[1], p.n = yd[1], p.kp = wd[lead + 1] * G4, p.np = wd[lead] * hk::NT;
  if (p.kp < p.k || p.kp - p.k >= G4 || p.np < p.n || p.np - p.n >= hk::NT) return "packed weight does not fit x and y";
  if (isa != 1 && isa != 2) return "isa must be 1 (AVX2) or 2 (AVX-512 VNNI)";
  *at = l * (p.np / hk::NT) * (p.kp / G4);
  p.w = w + *at * bytes, p.y = y;
  return "";
}

// Items are (tile, group of rows), as hk_w8a16's: few tiles for the threads split 16+ rows by 8.
// rows(t, r, end) computes rows [r, end) of tile t.
template <class Rows>
void run_items(ffi::ThreadPool& pool, const Q4Problem& p, int64_t threads, const Rows& rows) {
  threads = hk::call_threads(pool, threads);
  int64_t tiles = p.np / hk::NT;
  int64_t span = tiles < 8 * threads && p.m >= 16 ? 8 : p.m, groups = (p.m + span - 1) / span;
  hk::parallel_tiles(pool, tiles * groups, threads, [&p, &rows, span, groups](int64_t item) {
    int64_t r = item % groups * span;
    rows(item / groups, r, std::min(p.m, r + span));
  });
}

// w [(L,) N/64, K/32, B] (B: 1024 for int4, 2048 for 8-bit groups) with scale and min [(L,) N/64, K/32,
// 64] float32 (grouped_problem). `name` heads the errors.
ffi::Error q4call(const char* name, Kind kind, ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                  ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> mins, ffi::Buffer<ffi::S32> layer,
                  ffi::ResultBuffer<ffi::F32> y, int64_t isa, int64_t threads) {
  auto sd = scale.dimensions(), md = mins.dimensions();
  bool same = md.size() == sd.size();
  for (size_t i = 0; same && i < sd.size(); ++i) same = md[i] == sd[i];
  Q4Problem p{};
  int64_t at = 0;
  std::string why = same ? grouped_problem(p, x.dimensions(), w.dimensions(), sd, y->dimensions(), layer, w.typed_data(),
                                           y->typed_data(), kind == Kind::w8ga16 ? hk::A8G::kBytes : GB, isa, &at)
                         : "scale and min must have one shape";
  if (!why.empty()) return ffi::Error::InvalidArgument(std::string(name) + ": " + why);
  p.sc = scale.typed_data() + at * hk::NT, p.mn = mins.typed_data() + at * hk::NT;
  if (p.m == 0) return ffi::Error::Success();
  if (kind == Kind::w4a8)
    quantize_a8(x.typed_data(), p);
  else
    hk::quantize_a16(x.typed_data(), p);
  run_items(pool, p, threads, [&p, kind, isa](int64_t t, int64_t r, int64_t end) {
    if (kind == Kind::w4a8)
      hk::run_rows<A8, 2>(p, isa, t, r, end);
    else if (kind == Kind::w4a16)
      hk::run_rows<hk::A16>(p, isa, t, r, end);
    else
      hk::run_rows<hk::A8G>(p, isa, t, r, end);
  });
  return ffi::Error::Success();
}

ffi::Error w4a8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> scale,
                ffi::Buffer<ffi::F32> mins, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int64_t isa,
                int64_t threads) {
  return q4call("hk_w4a8", Kind::w4a8, pool, x, w, scale, mins, layer, y, isa, threads);
}

ffi::Error w4a16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> scale,
                 ffi::Buffer<ffi::F32> mins, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int64_t isa,
                 int64_t threads) {
  return q4call("hk_w4a16", Kind::w4a16, pool, x, w, scale, mins, layer, y, isa, threads);
}

ffi::Error w8ga16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> scale,
                  ffi::Buffer<ffi::F32> mins, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int64_t isa,
                  int64_t threads) {
  return q4call("hk_w8ga16", Kind::w8ga16, pool, x, w, scale, mins, layer, y, isa, threads);
}

// hk_w8sa16: signed 8-bit groups (q8a16.h's A8S) with a float16 scale and no min: w [(L,) N/64, K/32,
// 2048], scale [(L,) N/64, K/32, 64] float16 (grouped_problem).
ffi::Error w8sa16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F16> scale,
                  ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int64_t isa, int64_t threads) {
  Q4Problem p{};
  int64_t at = 0;
  std::string why = grouped_problem(p, x.dimensions(), w.dimensions(), scale.dimensions(), y->dimensions(), layer,
                                    w.typed_data(), y->typed_data(), hk::A8S::kBytes, isa, &at);
  if (!why.empty()) return ffi::Error::InvalidArgument("hk_w8sa16: " + why);
  const uint16_t* sc16 = scale.typed_data() + at * hk::NT;
  if (p.m == 0) return ffi::Error::Success();
  hk::quantize_a16(x.typed_data(), p);
  run_items(pool, p, threads,
            [&p, sc16, isa](int64_t t, int64_t r, int64_t end) { hk::run_rows_sym(p, sc16, isa, t, r, end); });
  return ffi::Error::Success();
}

// hk_w5sa16 and hk_w5sa8: signed 5-bit groups (q5a16.h) with a float16 scale and no min: w [(L,) N/64,
// K/32, 1024] (the low nibbles), high [(L,) N/64, K/32, 256] (the high bits), scale [(L,) N/64, K/32, 64]
// float16; activations int16 per 128 (hk_w5sa16) or int8 per 32 (`a8`: hk_w5sa8, q5a8.h).
ffi::Error q5call(const std::string& name, bool a8, ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                  ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::U8> high, ffi::Buffer<ffi::F16> scale,
                  ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int64_t isa, int64_t threads) {
  Q4Problem p{};
  int64_t at = 0;
  auto wd = w.dimensions(), hd = high.dimensions();
  bool same = hd.size() == wd.size() && hd.size() > 0 && hd[hd.size() - 1] == hk::kQ5High;
  for (size_t i = 0; same && i + 1 < wd.size(); ++i) same = hd[i] == wd[i];
  std::string why = same ? grouped_problem(p, x.dimensions(), wd, scale.dimensions(), y->dimensions(), layer,
                                           w.typed_data(), y->typed_data(), GB, isa, &at)
                         : "high must be w's shape with 256 bytes a group";
  if (!why.empty()) return ffi::Error::InvalidArgument(name + ": " + why);
  const uint8_t* hi = high.typed_data() + at * hk::kQ5High;
  const uint16_t* sc16 = scale.typed_data() + at * hk::NT;
  if (p.m == 0) return ffi::Error::Success();
  if (a8) {
    const int32_t* xsum = quantize_a8(x.typed_data(), p);
    run_items(pool, p, threads, [&p, hi, sc16, xsum, isa](int64_t t, int64_t r, int64_t end) {
      hk::run_rows_q5a8(p, hi, sc16, xsum, isa, t, r, end);
    });
    return ffi::Error::Success();
  }
  hk::quantize_a16(x.typed_data(), p);
  const int32_t* xsum = hk::group_sums16(p);
  run_items(pool, p, threads, [&p, hi, sc16, xsum, isa](int64_t t, int64_t r, int64_t end) {
    hk::run_rows_q5(p, hi, sc16, xsum, isa, t, r, end);
  });
  return ffi::Error::Success();
}

ffi::Error w5sa16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::U8> high,
                  ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int64_t isa,
                  int64_t threads) {
  return q5call("hk_w5sa16", false, pool, x, w, high, scale, layer, y, isa, threads);
}

ffi::Error w5sa8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::U8> high,
                 ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int64_t isa,
                 int64_t threads) {
  return q5call("hk_w5sa8", true, pool, x, w, high, scale, layer, y, isa, threads);
}

}  // namespace

#define HK_Q4_BINDING                   \
  ffi::Ffi::Bind()                      \
      .Ctx<ffi::ThreadPool>()           \
      .Arg<ffi::Buffer<ffi::F32>>()     \
      .Arg<ffi::Buffer<ffi::U8>>()      \
      .Arg<ffi::Buffer<ffi::F32>>()     \
      .Arg<ffi::Buffer<ffi::F32>>()     \
      .Arg<ffi::Buffer<ffi::S32>>()     \
      .Ret<ffi::Buffer<ffi::F32>>()     \
      .Attr<int64_t>("isa")             \
      .Attr<int64_t>("threads")

XLA_FFI_DEFINE_HANDLER_SYMBOL(HkW4A8, w4a8, HK_Q4_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(HkW4A16, w4a16, HK_Q4_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(HkW8GA16, w8ga16, HK_Q4_BINDING);
// The signed forms' operands after x and the packed bytes (hk_w5sa16 has its high bits between).
#define HK_SYM_TAIL                     \
  .Arg<ffi::Buffer<ffi::F16>>()         \
      .Arg<ffi::Buffer<ffi::S32>>()     \
      .Ret<ffi::Buffer<ffi::F32>>()     \
      .Attr<int64_t>("isa")             \
      .Attr<int64_t>("threads")

XLA_FFI_DEFINE_HANDLER_SYMBOL(HkW8SA16, w8sa16,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::U8>>()
                                  HK_SYM_TAIL);
#define HK_Q5_BINDING \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::U8>>()
XLA_FFI_DEFINE_HANDLER_SYMBOL(HkW5SA16, w5sa16, HK_Q5_BINDING HK_SYM_TAIL);
XLA_FFI_DEFINE_HANDLER_SYMBOL(HkW5SA8, w5sa8, HK_Q5_BINDING HK_SYM_TAIL);
