// Integer dot products for int8 and int4 weights: the activation rows are quantized once per call to int8 in
// blocks of 32 (one float scale per block, as llama.cpp's Q8_0 activations), and each weight row's codes
// meet them 32 at a time in the CPU's integer units, so a code is never widened to float.
//
// AVX2: _mm256_maddubs_epi16 multiplies unsigned by signed bytes, so the sign of x moves onto the weight
// (|x| * (w * sign x) = x * w); pairs of products fit int16 (2 * 127 * 127 < 2^15, the codes are
// symmetric in [-127, 127]) and _mm256_madd_epi16 widens them to int32. With AVX-VNNI one instruction
// does both. Each block's int32 sums are scaled by the block's activation scale in float32 and added up in
// double; the row's weight scale multiplies the finished sum. Every (weight row, activation row) pair keeps its
// own accumulators and order, so a row's result does not depend on the batch around it; and since a block's
// terms are the same on every layout and double sums in any order round to the same float (but for a chance
// of about 2^-29 per value), a row-parallel rank's partial sums, added up in double by the all-reduce, give the
// one-rank result: quantized tokens do not depend on the tensor-parallel degree.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "rows.h"

namespace shardlm {

constexpr int64_t QBLOCK = 32;

// b rows of activations as int8 codes in blocks of QBLOCK: codes (b, kp) with zeros past k, scales (b, kp / 32).
struct QuantRows {
  std::vector<int8_t> codes;
  std::vector<int8_t> magnitudes;  // |codes|: the unsigned operand of the byte products
  std::vector<float> scales;
  std::vector<float> sums;  // (b, kp / 32): scale * the block's sum of codes (the int4 zero-point term)
  int64_t kp = 0, blocks = 0;
};

// Quantize b rows of k floats (row stride k): per block, scale = max |x| / 127, code = round(x / scale).
inline void quantize_rows(const float* x, int64_t b, int64_t k, int64_t kp, QuantRows& out) {
  out.kp = kp;
  out.blocks = kp / QBLOCK;
  out.codes.assign(b * kp, 0);
  out.magnitudes.assign(b * kp, 0);
  out.scales.assign(b * out.blocks, 0.f);
  out.sums.assign(b * out.blocks, 0.f);
  for (int64_t j = 0; j < b; ++j)
    for (int64_t blk = 0; blk < out.blocks; ++blk) {
      const int64_t a = blk * QBLOCK, e = std::min(k, a + QBLOCK);
      float amax = 0.f;
      for (int64_t i = a; i < e; ++i) amax = std::max(amax, std::fabs(x[j * k + i]));
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      out.scales[j * out.blocks + blk] = d;
      int32_t total = 0;
      for (int64_t i = a; i < e; ++i) {
        const int8_t c = static_cast<int8_t>(std::nearbyint(x[j * k + i] * inv));
        out.codes[j * kp + i] = c;
        out.magnitudes[j * kp + i] = static_cast<int8_t>(c < 0 ? -c : c);
        total += c;
      }
      out.sums[j * out.blocks + blk] = d * static_cast<float>(total);
    }
}

#if defined(__AVX2__)
// Eight int32 lanes of sum w[i] * x[i] over one block of 32 codes (x given as |x| and x for its sign).
inline __m256i block_dot(__m256i w, __m256i mag, __m256i x) {
  const __m256i signed_w = _mm256_sign_epi8(w, x);  // w * sign(x) (0 where x is 0)
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), mag, signed_w);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), mag, signed_w);
#else
  const __m256i pairs = _mm256_maddubs_epi16(mag, signed_w);  // int16: |x| * (w sign x), adjacent pairs summed
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));       // int32: four products per lane
#endif
}

inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

#endif

// The instructions the int8 dot products were built for (the build is -march=native: this CPU's).
inline std::string int8_units() {
#if defined(__AVX2__) && defined(__AVXVNNI__)
  return "avx-vnni";
#elif defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512-vnni";
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
    const int8_t* xc = x.codes.data() + j * x.kp + blk * QBLOCK;
    for (int64_t i = 0; i < QBLOCK; ++i) acc += static_cast<int32_t>(w[blk * QBLOCK + i]) * xc[i];
    s += static_cast<double>(static_cast<float>(acc) * x.scales[j * x.blocks + blk]);
  }
  return s;
}

#if defined(__AVX2__)
// One block's eight int32 lane sums times their scale (a float product, rounded alike on every layout), added
// to two double accumulators: a row's sum split over tensor-parallel ranks and added up later in double rounds
// as the whole sum does (see `qrows`).
inline void add_block(__m256d& lo, __m256d& hi, __m256i isum, __m256 scale) {
  const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), scale);
  lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(f)));
  hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)));
}

inline double lanes_sum(__m256d lo, __m256d hi) {  // the eight lanes added in order
  alignas(32) double l[8];
  _mm256_store_pd(l, lo);
  _mm256_store_pd(l + 4, hi);
  double s = 0.0;
  for (int i = 0; i < 8; ++i) s += l[i];
  return s;
}
#endif

// y[j, r] = scale[r] * sum_k w[r, k] x[j, k] for R int8 weight rows from r0 and J activation rows from j0,
// accumulated in double and stored as T (float, or double for partial sums that ranks add up).
template <typename T, int R, int J>
inline void qtile(const int8_t* w, int64_t ldw, const float* scale, const QuantRows& x, T* y, int64_t n, int64_t r0,
                  int64_t j0) {
#if defined(__AVX2__)
  __m256d lo[R][J], hi[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) lo[r][j] = hi[r][j] = _mm256_setzero_pd();
  for (int64_t blk = 0; blk < x.blocks; ++blk) {
    __m256i mag[J], xc[J];
    __m256 d[J];
    for (int j = 0; j < J; ++j) {
      const int64_t at = (j0 + j) * x.kp + blk * QBLOCK;
      mag[j] = load32(x.magnitudes.data() + at);
      xc[j] = load32(x.codes.data() + at);
      d[j] = _mm256_set1_ps(x.scales[(j0 + j) * x.blocks + blk]);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i wv = load32(w + (r0 + r) * ldw + blk * QBLOCK);
      for (int j = 0; j < J; ++j) add_block(lo[r][j], hi[r][j], block_dot(wv, mag[j], xc[j]), d[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j)
      y[(j0 + j) * n + r0 + r] = static_cast<T>(static_cast<double>(scale[r0 + r]) * lanes_sum(lo[r][j], hi[r][j]));
#else
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j)
      y[(j0 + j) * n + r0 + r] =
          static_cast<T>(static_cast<double>(scale[r0 + r]) * dot_q8_scalar(w + (r0 + r) * ldw, x, j0 + j));
#endif
}

// Rows [lo, hi) of an int8 weight (rows ldw >= kp apart) against every quantized activation row. Four weight
// rows at a time for one activation row, two by two for more (each pair keeps two double accumulators).
template <typename T>
inline void qrows(const int8_t* w, int64_t ldw, const float* scale, const QuantRows& x, T* y, int64_t n, int64_t b,
                  int64_t lo, int64_t hi) {
  int64_t r = lo;
  if (b == 1)
    for (; r + 4 <= hi; r += 4) qtile<T, 4, 1>(w, ldw, scale, x, y, n, r, 0);
  for (; r + 2 <= hi; r += 2) {
    int64_t j = 0;
    for (; j + 2 <= b; j += 2) qtile<T, 2, 2>(w, ldw, scale, x, y, n, r, j);
    if (j < b) qtile<T, 2, 1>(w, ldw, scale, x, y, n, r, j);
  }
  for (; r < hi; ++r)
    for (int64_t j = 0; j < b; ++j) qtile<T, 1, 1>(w, ldw, scale, x, y, n, r, j);
}

// int4 weights (shardlm.quant.Int4Weight on the CPU): codes (n, kp / 2) two per byte, each group of 32
// columns in 16 bytes, byte i holding column i in its low nibble and column 16 + i in its high one; scale and
// zero per (row, group) as bfloat16 pairs (n, kp / 32, 2); W = (q - 8) * scale + zero, q in 0..15. Over a
// group, sum W x = scale * sum q x + (zero - 8 * scale) * sum x, with x as its block's codes times their
// scale: the codes meet in the byte units (maddubs: q unsigned, x signed, no sign trick needed), the second
// term uses the block's precomputed sum. Accumulated in double as for int8.
inline float group_sum_scalar(const uint8_t* w, const int8_t* xc) {
  int32_t acc = 0;
  for (int i = 0; i < 16; ++i) acc += (w[i] & 15) * xc[i] + (w[i] >> 4) * xc[16 + i];
  return static_cast<float>(acc);
}

template <typename T, int R, int J>
inline void q4tile(const uint8_t* w, const uint16_t* sz, const QuantRows& x, T* y, int64_t n, int64_t r0,
                   int64_t j0) {
  const int64_t groups = x.blocks, ldw = x.kp / 2;
  double zacc[R][J] = {};
#if defined(__AVX2__)
  __m256d lo[R][J], hi[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) lo[r][j] = hi[r][j] = _mm256_setzero_pd();
  const __m128i low = _mm_set1_epi8(15);
#else
  double acc[R][J] = {};
#endif
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* wg = w + (r0 + r) * ldw + g * 16;
      const float s = bf16_to_float(sz[((r0 + r) * groups + g) * 2]);
      const float m = bf16_to_float(sz[((r0 + r) * groups + g) * 2 + 1]) - 8.f * s;
#if defined(__AVX2__)
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wg));
      const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
#endif
      for (int j = 0; j < J; ++j) {
        const int64_t at = (j0 + j) * x.blocks + g;
        const int8_t* xc = x.codes.data() + (j0 + j) * x.kp + g * QBLOCK;
#if defined(__AVX2__)
        const __m256i pairs = _mm256_maddubs_epi16(q, load32(xc));  // int16: 15 * 127 * 2 fits
        add_block(lo[r][j], hi[r][j], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)), _mm256_set1_ps(s * x.scales[at]));
#else
        acc[r][j] += static_cast<double>(s * x.scales[at] * group_sum_scalar(wg, xc));
#endif
        zacc[r][j] += static_cast<double>(m) * x.sums[at];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) {
#if defined(__AVX2__)
      y[(j0 + j) * n + r0 + r] = static_cast<T>(lanes_sum(lo[r][j], hi[r][j]) + zacc[r][j]);
#else
      y[(j0 + j) * n + r0 + r] = static_cast<T>(acc[r][j] + zacc[r][j]);
#endif
    }
}

// Rows [lo, hi) of an int4 weight against every quantized activation row (x.kp = the weight's padded width).
template <typename T>
inline void q4rows(const uint8_t* w, const uint16_t* sz, const QuantRows& x, T* y, int64_t n, int64_t b, int64_t lo,
                   int64_t hi) {
  int64_t r = lo;
  if (b == 1)
    for (; r + 4 <= hi; r += 4) q4tile<T, 4, 1>(w, sz, x, y, n, r, 0);
  for (; r + 2 <= hi; r += 2) {
    int64_t j = 0;
    for (; j + 2 <= b; j += 2) q4tile<T, 2, 2>(w, sz, x, y, n, r, j);
    if (j < b) q4tile<T, 2, 1>(w, sz, x, y, n, r, j);
  }
  for (; r < hi; ++r)
    for (int64_t j = 0; j < b; ++j) q4tile<T, 1, 1>(w, sz, x, y, n, r, j);
}

}  // namespace shardlm
