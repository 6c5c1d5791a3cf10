// Integer dot products for int8 and int4 weights: the activation rows are quantized once per call to int16 in
// blocks of 32 (one float scale per block, max |x| / 32767), and each weight row's codes, widened to int16,
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
// A block of 32 weight codes as two vectors of 16 int16 (columns 0-15 and 16-31).
struct Codes16 {
  __m256i lo, hi;
};

inline Codes16 widen_int8(const int8_t* w) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1))};
}

inline Codes16 widen_nibbles(const uint8_t* w) {  // 16 bytes: low nibbles columns 0-15, high ones 16-31
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w)), low = _mm_set1_epi8(15);
  return {_mm256_cvtepu8_epi16(_mm_and_si128(raw, low)),
          _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low))};
}

// Eight int32 lanes of sum w[i] * x[i] over one block of 32 (int16 products, adjacent pairs summed).
inline __m256i block_dot(const Codes16& w, const int16_t* x) {
  const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
  return _mm256_add_epi32(_mm256_madd_epi16(w.lo, xl), _mm256_madd_epi16(w.hi, xh));
}
#endif

// The instructions the integer dot products were built for (the build is -march=native: this CPU's).
inline std::string int8_units() {
#if defined(__AVX2__)
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
    __m256 d[J];
    for (int j = 0; j < J; ++j) d[j] = _mm256_set1_ps(x.scales[(j0 + j) * x.blocks + blk]);
    for (int r = 0; r < R; ++r) {
      const Codes16 wv = widen_int8(w + (r0 + r) * ldw + blk * QBLOCK);
      for (int j = 0; j < J; ++j)
        add_block(lo[r][j], hi[r][j], block_dot(wv, x.codes.data() + (j0 + j) * x.kp + blk * QBLOCK), d[j]);
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

#if defined(__AVX2__)
inline float lanes_sumf(__m256 v) {  // the eight lanes added in order
  alignas(32) float l[8];
  _mm256_store_ps(l, v);
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += l[i];
  return s;
}
#endif

// qtile with float accumulators: for weights whose rows are never split over ranks (column-parallel ones),
// where one rank always adds a row's blocks in the same order. Faster: one FMA per block and pair.
template <typename T, int R, int J>
inline void qtile_float(const int8_t* w, int64_t ldw, const float* scale, const QuantRows& x, T* y, int64_t n,
                        int64_t r0, int64_t j0) {
#if defined(__AVX2__)
  __m256 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < x.blocks; ++blk) {
    __m256 d[J];
    for (int j = 0; j < J; ++j) d[j] = _mm256_set1_ps(x.scales[(j0 + j) * x.blocks + blk]);
    for (int r = 0; r < R; ++r) {
      const Codes16 wv = widen_int8(w + (r0 + r) * ldw + blk * QBLOCK);
      for (int j = 0; j < J; ++j) {
        const __m256i isum = block_dot(wv, x.codes.data() + (j0 + j) * x.kp + blk * QBLOCK);
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), d[j], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) y[(j0 + j) * n + r0 + r] = static_cast<T>(scale[r0 + r] * lanes_sumf(acc[r][j]));
#else
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j)
      y[(j0 + j) * n + r0 + r] = static_cast<T>(scale[r0 + r] * dot_q8_scalar(w + (r0 + r) * ldw, x, j0 + j));
#endif
}

// Rows [lo, hi) of an int8 weight (rows ldw >= kp apart) against every quantized activation row. `exact`
// (a row-parallel weight): double accumulators, four weight rows at a time for one activation row, two by two
// for more; otherwise float ones, eight rows for one activation row, four by two for more.
template <typename T>
inline void qrows(const int8_t* w, int64_t ldw, const float* scale, const QuantRows& x, T* y, int64_t n, int64_t b,
                  int64_t lo, int64_t hi, bool exact) {
  int64_t r = lo;
  if (exact) {
    if (b == 1)
      for (; r + 4 <= hi; r += 4) qtile<T, 4, 1>(w, ldw, scale, x, y, n, r, 0);
    for (; r + 2 <= hi; r += 2) {
      int64_t j = 0;
      for (; j + 2 <= b; j += 2) qtile<T, 2, 2>(w, ldw, scale, x, y, n, r, j);
      if (j < b) qtile<T, 2, 1>(w, ldw, scale, x, y, n, r, j);
    }
    for (; r < hi; ++r)
      for (int64_t j = 0; j < b; ++j) qtile<T, 1, 1>(w, ldw, scale, x, y, n, r, j);
    return;
  }
  if (b == 1)
    for (; r + 8 <= hi; r += 8) qtile_float<T, 8, 1>(w, ldw, scale, x, y, n, r, 0);
  for (; r + 4 <= hi; r += 4) {
    int64_t j = 0;
    for (; j + 2 <= b; j += 2) qtile_float<T, 4, 2>(w, ldw, scale, x, y, n, r, j);
    if (j < b) qtile_float<T, 4, 1>(w, ldw, scale, x, y, n, r, j);
  }
  for (; r < hi; ++r)
    for (int64_t j = 0; j < b; ++j) qtile_float<T, 1, 1>(w, ldw, scale, x, y, n, r, j);
}

// int4 weights (shardlm.quant.Int4Weight on the CPU): codes (n, kp / 2) two per byte, each group of 32
// columns in 16 bytes, byte i holding column i in its low nibble and column 16 + i in its high one; scale and
// zero per (row, group) as bfloat16 pairs (n, kp / 32, 2); W = (q - 8) * scale + zero, q in 0..15. Over a
// group, sum W x = scale * sum q x + (zero - 8 * scale) * sum x, with x as its block's codes times their
// scale: the codes, widened to int16, meet x's in the integer units, the second term uses the block's
// precomputed sum. Accumulated as for int8.
inline float group_sum_scalar(const uint8_t* w, const int16_t* xc) {
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
#else
  double acc[R][J] = {};
#endif
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* wg = w + (r0 + r) * ldw + g * 16;
      const float s = bf16_to_float(sz[((r0 + r) * groups + g) * 2]);
      const float m = bf16_to_float(sz[((r0 + r) * groups + g) * 2 + 1]) - 8.f * s;
#if defined(__AVX2__)
      const Codes16 q = widen_nibbles(wg);
#endif
      for (int j = 0; j < J; ++j) {
        const int64_t at = (j0 + j) * x.blocks + g;
        const int16_t* xc = x.codes.data() + (j0 + j) * x.kp + g * QBLOCK;
#if defined(__AVX2__)
        add_block(lo[r][j], hi[r][j], block_dot(q, xc), _mm256_set1_ps(s * x.scales[at]));
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

// q4tile with float accumulators (see qtile_float).
template <typename T, int R, int J>
inline void q4tile_float(const uint8_t* w, const uint16_t* sz, const QuantRows& x, T* y, int64_t n, int64_t r0,
                         int64_t j0) {
  const int64_t groups = x.blocks, ldw = x.kp / 2;
  float zacc[R][J] = {};
#if defined(__AVX2__)
  __m256 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm256_setzero_ps();
#else
  float acc[R][J] = {};
#endif
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* wg = w + (r0 + r) * ldw + g * 16;
      const float s = bf16_to_float(sz[((r0 + r) * groups + g) * 2]);
      const float m = bf16_to_float(sz[((r0 + r) * groups + g) * 2 + 1]) - 8.f * s;
#if defined(__AVX2__)
      const Codes16 q = widen_nibbles(wg);
#endif
      for (int j = 0; j < J; ++j) {
        const int64_t at = (j0 + j) * x.blocks + g;
        const int16_t* xc = x.codes.data() + (j0 + j) * x.kp + g * QBLOCK;
#if defined(__AVX2__)
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(q, xc)), _mm256_set1_ps(s * x.scales[at]), acc[r][j]);
#else
        acc[r][j] += s * x.scales[at] * group_sum_scalar(wg, xc);  // float, like the vector path
#endif
        zacc[r][j] += m * x.sums[at];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) {
#if defined(__AVX2__)
      y[(j0 + j) * n + r0 + r] = static_cast<T>(lanes_sumf(acc[r][j]) + zacc[r][j]);
#else
      y[(j0 + j) * n + r0 + r] = static_cast<T>(acc[r][j] + zacc[r][j]);
#endif
    }
}

// Rows [lo, hi) of an int4 weight against every quantized activation row (x.kp = the weight's padded width);
// `exact` as for qrows.
template <typename T>
inline void q4rows(const uint8_t* w, const uint16_t* sz, const QuantRows& x, T* y, int64_t n, int64_t b, int64_t lo,
                   int64_t hi, bool exact) {
  int64_t r = lo;
  if (exact) {
    if (b == 1)
      for (; r + 4 <= hi; r += 4) q4tile<T, 4, 1>(w, sz, x, y, n, r, 0);
    for (; r + 2 <= hi; r += 2) {
      int64_t j = 0;
      for (; j + 2 <= b; j += 2) q4tile<T, 2, 2>(w, sz, x, y, n, r, j);
      if (j < b) q4tile<T, 2, 1>(w, sz, x, y, n, r, j);
    }
    for (; r < hi; ++r)
      for (int64_t j = 0; j < b; ++j) q4tile<T, 1, 1>(w, sz, x, y, n, r, j);
    return;
  }
  if (b == 1)
    for (; r + 8 <= hi; r += 8) q4tile_float<T, 8, 1>(w, sz, x, y, n, r, 0);
  for (; r + 4 <= hi; r += 4) {
    int64_t j = 0;
    for (; j + 2 <= b; j += 2) q4tile_float<T, 4, 2>(w, sz, x, y, n, r, j);
    if (j < b) q4tile_float<T, 4, 1>(w, sz, x, y, n, r, j);
  }
  for (; r < hi; ++r)
    for (int64_t j = 0; j < b; ++j) q4tile_float<T, 1, 1>(w, sz, x, y, n, r, j);
}

}  // namespace shardlm
