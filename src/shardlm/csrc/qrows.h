// Integer dot products for int8 weights (int4 ones: q4tiles.h, on the same activation codes): the activation rows
// are quantized once per call to int16 in blocks of 32 (one float scale per block, max |x| / 32767), and each
// weight row's codes, widened to int16,
// meet them 32 at a time in the CPU's integer units (AVX2 _mm256_madd_epi16: 16 products a vector, adjacent
// pairs summed to int32), so a code is never converted to float. int16 rather than int8 activations (llama.cpp's
// Q8_0 choice): int8 ones cost the bundled model 2.3 % more perplexity than bfloat16 ones (measured), int16 ones
// are finer than bfloat16. Each block's int32 sums are scaled by the block's activation scale in float32; the
// row's weight scale multiplies the finished sum. Every (weight row, activation row) pair keeps its own
// accumulators and order, so a row's result does not depend on the batch around it. Weights whose rows tensor
// parallelism splits (o and down projections; `exact`) add their block terms in double: a block's terms are the
// same on every layout and double sums in any order round to the same float (but for a chance of about 2^-29
// per value), so a row-parallel rank's partial sums, all-reduced in double, give the one-rank result, and
// quantized tokens do not depend on the tensor-parallel degree. The others keep float accumulators (faster;
// one rank always adds a whole row in the same order).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "rows.h"

namespace shardlm {

constexpr int64_t QBLOCK = 32;

// b rows of activations as int16 codes in blocks of QBLOCK: codes (b, kp) with zeros past k, scales (b, kp / 32).
struct QuantRows {
  std::vector<int16_t> codes;
  std::vector<float> scales;
  std::vector<float> sums;  // (b, kp / 32): scale * the block's sum of codes (the int4 zero-point term)
  int64_t kp = 0, blocks = 0;
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
// One whole block of 32 finite values as quantize_rows' scalar loop quantizes it, sixteen lanes at a time: the
// same max |x| (exact in any order), the same products x * inv rounded to nearest even (the conversion's rounding
// is nearbyint's), the same codes and sum. False, with nothing written, when a value is NaN or infinite (the
// scalar loop handles those). The scalar loop had been 2-3 % of a batch-1 int4 step, on every thread (perf).
inline bool quantize_block32(const float* x, int16_t* codes, float& scale, float& sum) {
  const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
  const __m512 alo = _mm512_abs_ps(lo), ahi = _mm512_abs_ps(hi);
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  if ((_mm512_cmp_ps_mask(alo, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(ahi, inf, _CMP_LT_OQ)) != 0xFFFF) return false;
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(alo, ahi));
  const float d = amax / 32767.f;
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
  const __m512i clo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), chi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), _mm512_cvtepi32_epi16(clo));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 16), _mm512_cvtepi32_epi16(chi));
  scale = d;
  sum = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(clo, chi)));
  return true;
}
#endif

// Quantize b rows of k floats (row stride k): per block, scale = max |x| / 32767, code = round(x / scale).
inline void quantize_rows(const float* x, int64_t b, int64_t k, int64_t kp, QuantRows& out) {
  out.kp = kp;
  out.blocks = kp / QBLOCK;
  out.codes.assign(b * kp, 0);
  out.scales.assign(b * out.blocks, 0.f);
  out.sums.assign(b * out.blocks, 0.f);
  for (int64_t j = 0; j < b; ++j)
    for (int64_t blk = 0; blk < out.blocks; ++blk) {
      const int64_t a = blk * QBLOCK, e = std::min(k, a + QBLOCK);
#if defined(__AVX512F__) && defined(__AVX512BW__)
      if (e - a == QBLOCK && quantize_block32(x + j * k + a, out.codes.data() + j * kp + a,
                                              out.scales[j * out.blocks + blk], out.sums[j * out.blocks + blk]))
        continue;
#endif
      float amax = 0.f;
      bool finite = true;
      for (int64_t i = a; i < e; ++i) {
        amax = std::max(amax, std::fabs(x[j * k + i]));
        finite = finite && std::isfinite(x[j * k + i]);
      }
      // a NaN or infinite input: codes 0 and a NaN scale carry it into the result (no undefined int16 cast)
      const float d = finite ? amax / 32767.f : std::numeric_limits<float>::quiet_NaN();
      const float inv = finite && amax > 0.f ? 32767.f / amax : 0.f;
      out.scales[j * out.blocks + blk] = d;
      int32_t total = 0;
      for (int64_t i = a; i < e; ++i) {
        const int16_t c = finite ? static_cast<int16_t>(std::nearbyint(x[j * k + i] * inv)) : 0;
        out.codes[j * kp + i] = c;
        total += c;
      }
      out.sums[j * out.blocks + blk] = d * static_cast<float>(total);
    }
}

#if defined(__AVX2__)
// The quantized tiles ask for the weight rows PREFETCH_ROWS ahead of the ones they multiply: with codes a
// quarter or an eighth of float32's bytes per multiply, the hardware prefetcher alone left the loop waiting on
// memory (int8 1536 x 576 from DRAM: 82 us without, 45 us with 16 rows ahead; 8, 32 and 64 were no better).
constexpr int64_t PREFETCH_ROWS = 16;
// A block of 32 weight codes as two vectors of 16 int16 (columns 0-15 and 16-31).
struct Codes16 {
  __m256i lo, hi;
};

inline Codes16 widen_int8(const int8_t* w) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1))};
}

// Eight int32 lanes of sum w[i] * x[i] over one block of 32 (int16 products, adjacent pairs summed). With VNNI
// (AVX512-VNNI or AVX-VNNI) the second half's products are added by the dot-product instruction itself: one
// instruction fewer per block, the same integers (neither form saturates).
inline __m256i block_dot(const Codes16& w, const int16_t* x) {
  const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(_mm256_madd_epi16(w.lo, xl), w.hi, xh);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(w.lo, xl), w.hi, xh);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(w.lo, xl), _mm256_madd_epi16(w.hi, xh));
#endif
}
#endif

// The instructions the integer dot products were built for (the build is -march=native: this CPU's): with
// AVX-512, int8 rows multiply-add in avx512bw and int4 tiles (q4tiles.h) in VNNI's dot products where present.
inline std::string int8_units() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return "avx512bw+avx512vnni";
#elif defined(__AVX512F__) && defined(__AVX512BW__)
  return "avx512bw";
#elif defined(__AVX2__) && defined(__AVXVNNI__)
  return "avx2+avxvnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

// One pair without vector units: the same blocks, the same scaling, scalar.
inline double dot_q8_scalar(const int8_t* w, const QuantRows& x, int64_t j) {
  double s = 0.0;
  for (int64_t blk = 0; blk < x.blocks; ++blk) {
    int32_t acc = 0;
    const int16_t* xc = x.codes.data() + j * x.kp + blk * QBLOCK;
    for (int64_t i = 0; i < QBLOCK; ++i) acc += static_cast<int32_t>(w[blk * QBLOCK + i]) * xc[i];
    s += static_cast<double>(static_cast<float>(acc) * x.scales[j * x.blocks + blk]);
  }
  return s;
}

#if defined(__AVX2__)
// A (weight row, activation row) pair's running sum over blocks: each block's eight int32 lane sums times the
// block's scale (a float product, rounded alike on every layout), added in eight lanes.
// FloatSums: float lanes, one FMA a block; for weights no rank splits (one rank always adds a row's blocks in
// the same order). DoubleSums: double lanes; a row's sum split over tensor-parallel ranks and added up later
// in double rounds as the whole sum does (the `exact` weights).
struct FloatSums {
  using Lane = __m256;
  static constexpr int kLanes = 1;  // vectors a pair holds
  static void zero(Lane* a) { a[0] = _mm256_setzero_ps(); }
  static void add(Lane* a, __m256i isum, __m256 scale) {
    a[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, a[0]);
  }
  static float total(const Lane* a) {  // the eight lanes added in order
    alignas(32) float l[8];
    _mm256_store_ps(l, a[0]);
    float s = 0.f;
    for (int i = 0; i < 8; ++i) s += l[i];
    return s;
  }
};

struct DoubleSums {
  using Lane = __m256d;
  static constexpr int kLanes = 2;
  static void zero(Lane* a) { a[0] = a[1] = _mm256_setzero_pd(); }
  static void add(Lane* a, __m256i isum, __m256 scale) {
    const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), scale);
    a[0] = _mm256_add_pd(a[0], _mm256_cvtps_pd(_mm256_castps256_ps128(f)));
    a[1] = _mm256_add_pd(a[1], _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)));
  }
  static double total(const Lane* a) {  // the eight lanes added in order
    alignas(32) double l[8];
    _mm256_store_pd(l, a[0]);
    _mm256_store_pd(l + 4, a[1]);
    double s = 0.0;
    for (int i = 0; i < 8; ++i) s += l[i];
    return s;
  }
};
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// With AVX-512 a block of 32 codes is one vector of 32 int16 and meets the activation block in one multiply-add
// (16 int32 lanes, adjacent pairs summed): four instructions a (row, block) where the 256-bit form takes seven.
// The lanes then hold pairs, not the 256-bit form's quads, so an AVX-512 build rounds int8 sums differently
// from an AVX2 one (each is batch-invariant and tensor-parallel-exact on its own).
struct Codes32 {
  __m512i v;
};
inline Codes32 widen_int8_32(const int8_t* w) {
  return {_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)))};
}
inline __m512i block_dot32(const Codes32& w, const int16_t* x) {
  return _mm512_madd_epi16(w.v, _mm512_loadu_si512(x));
}
struct FloatSums16 {
  using Lane = __m512;
  static constexpr int kLanes = 1;
  static void zero(Lane* a) { a[0] = _mm512_setzero_ps(); }
  static void add(Lane* a, __m512i isum, __m512 scale) { a[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, a[0]); }
  static float total(const Lane* a) {  // the sixteen lanes added in order
    alignas(64) float l[16];
    _mm512_store_ps(l, a[0]);
    float s = 0.f;
    for (int i = 0; i < 16; ++i) s += l[i];
    return s;
  }
};
struct DoubleSums16 {
  using Lane = __m512d;
  static constexpr int kLanes = 2;
  static void zero(Lane* a) { a[0] = a[1] = _mm512_setzero_pd(); }
  static void add(Lane* a, __m512i isum, __m512 scale) {
    const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), scale);
    a[0] = _mm512_add_pd(a[0], _mm512_cvtps_pd(_mm512_castps512_ps256(f)));
    a[1] = _mm512_add_pd(a[1], _mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1)));
  }
  static double total(const Lane* a) {
    alignas(64) double l[16];
    _mm512_store_pd(l, a[0]);
    _mm512_store_pd(l + 8, a[1]);
    double s = 0.0;
    for (int i = 0; i < 16; ++i) s += l[i];
    return s;
  }
};
#define SHARDLM_Q8_WIDE 1
#endif

// The accumulator type of a tile: double for `exact` weights, float otherwise.
template <bool Exact>
using SumScalar = std::conditional_t<Exact, double, float>;

// y[j, r] = scale[r] * sum_k w[r, k] x[j, k] for R int8 weight rows from r0 and J activation rows from j0, stored
// as T (float, or double for partial sums that ranks add up).
template <typename T, bool Exact, int R, int J>
__attribute__((always_inline)) inline void qtile(const int8_t* w, int64_t ldw, const float* scale,
                                                 const QuantRows& x, T* y, int64_t n, int64_t r0, int64_t j0) {
  using S = SumScalar<Exact>;
#if defined(SHARDLM_Q8_WIDE)
  using P = std::conditional_t<Exact, DoubleSums16, FloatSums16>;
  typename P::Lane acc[R][J][P::kLanes];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) P::zero(acc[r][j]);
  for (int64_t blk = 0; blk < x.blocks; ++blk) {
    __m512 d[J];
    for (int j = 0; j < J; ++j) d[j] = _mm512_set1_ps(x.scales[(j0 + j) * x.blocks + blk]);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (r0 + r + PREFETCH_ROWS) * ldw + blk * QBLOCK), _MM_HINT_T0);
      const Codes32 wv = widen_int8_32(w + (r0 + r) * ldw + blk * QBLOCK);
      for (int j = 0; j < J; ++j)
        P::add(acc[r][j], block_dot32(wv, x.codes.data() + (j0 + j) * x.kp + blk * QBLOCK), d[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j)
      y[(j0 + j) * n + r0 + r] = static_cast<T>(static_cast<S>(scale[r0 + r]) * P::total(acc[r][j]));
#elif defined(__AVX2__)
  using P = std::conditional_t<Exact, DoubleSums, FloatSums>;
  typename P::Lane acc[R][J][P::kLanes];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) P::zero(acc[r][j]);
  for (int64_t blk = 0; blk < x.blocks; ++blk) {
    __m256 d[J];
    for (int j = 0; j < J; ++j) d[j] = _mm256_set1_ps(x.scales[(j0 + j) * x.blocks + blk]);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (r0 + r + PREFETCH_ROWS) * ldw + blk * QBLOCK), _MM_HINT_T0);
      const Codes16 wv = widen_int8(w + (r0 + r) * ldw + blk * QBLOCK);
      for (int j = 0; j < J; ++j)
        P::add(acc[r][j], block_dot(wv, x.codes.data() + (j0 + j) * x.kp + blk * QBLOCK), d[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j)
      y[(j0 + j) * n + r0 + r] = static_cast<T>(static_cast<S>(scale[r0 + r]) * P::total(acc[r][j]));
#else
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j)
      y[(j0 + j) * n + r0 + r] =
          static_cast<T>(static_cast<double>(scale[r0 + r]) * dot_q8_scalar(w + (r0 + r) * ldw, x, j0 + j));
#endif
}

// (The tiles are forced inline into `tile_rows`: called through the Int8Tiles functor, GCC kept them
// out of line and batch-8 int8 ran 12 % slower, measured.)
// Every row in [lo, hi) against every activation row, in tiles `tile.run<R, J>(r0, j0)`: `Exact` tiles hold two
// double vectors a pair, so four weight rows for one activation row and two by two for more; float ones eight
// rows for one activation row and four by two.
template <bool Exact, typename Tile>
inline void tile_rows(const Tile& tile, int64_t b, int64_t lo, int64_t hi) {
  constexpr int single = Exact ? 4 : 8, paired = Exact ? 2 : 4;
  int64_t r = lo;
  if (b == 1)
    for (; r + single <= hi; r += single) tile.template run<single, 1>(r, 0);
  for (; r + paired <= hi; r += paired) {
    int64_t j = 0;
    for (; j + 2 <= b; j += 2) tile.template run<paired, 2>(r, j);
    if (j < b) tile.template run<paired, 1>(r, j);
  }
  for (; r < hi; ++r)
    for (int64_t j = 0; j < b; ++j) tile.template run<1, 1>(r, j);
}

template <typename T, bool Exact>
struct Int8Tiles {
  const int8_t* w;
  int64_t ldw;
  const float* scale;
  const QuantRows& x;
  T* y;
  int64_t n;
  template <int R, int J>
  void run(int64_t r0, int64_t j0) const { qtile<T, Exact, R, J>(w, ldw, scale, x, y, n, r0, j0); }
};

// Rows [lo, hi) of an int8 weight (rows ldw >= kp apart) against every quantized activation row; `exact`: sums
// in double (see the top of this file).
template <typename T>
inline void qrows(const int8_t* w, int64_t ldw, const float* scale, const QuantRows& x, T* y, int64_t n, int64_t b,
                  int64_t lo, int64_t hi, bool exact) {
  if (exact)
    tile_rows<true>(Int8Tiles<T, true>{w, ldw, scale, x, y, n}, b, lo, hi);
  else
    tile_rows<false>(Int8Tiles<T, false>{w, ldw, scale, x, y, n}, b, lo, hi);
}

}  // namespace shardlm
