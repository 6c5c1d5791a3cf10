// The parts of the integer prefill panels (qpanel.h): activation rows quantized by threads, weights widened to
// panels of int16 pairs (int8 codes through a 16 x 16 transpose; int4 row tiles as they lie, q4tiles.h), and the
// vector operations the tiles use, 512 or 256 bits wide.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "q4tiles.h"
#include "qrows.h"

namespace shardlm {

// The activation rows a register tile holds, so that its accumulators, two weight vectors and a broadcast fit the
// registers: per row two int32 vectors and two float (int4: four) or four double accumulators. (Measured at 512
// rows on AVX-512: fewer rows, no spills, ran slower than these, whose weight loads serve more rows.)
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t QVL = 16;  // int32 lanes a vector
constexpr int qpanel_rows_for(bool exact, bool q4) { return exact ? (q4 ? 4 : 6) : 6; }  // 32 registers
#elif defined(__AVX2__)
constexpr int64_t QVL = 8;
constexpr int qpanel_rows_for(bool, bool) { return 1; }  // 16 registers: one row fits every kind, and ran fastest
// (a haswell build on this Zen 5, 512 rows: int8 0.51-0.59x float32's time with one row, 0.58-0.67x with 2-3)
#else
constexpr int64_t QVL = 8;
constexpr int qpanel_rows_for(bool, bool) { return 4; }
#endif
constexpr int64_t QPANEL = 2 * QVL;  // weight rows a panel holds
constexpr int64_t QPAIRS = QBLOCK / 2;  // column pairs a block holds
constexpr int64_t QPANEL_CHUNK_BYTES = 256 * 1024;  // panels a thread widens before it runs the rows over them

// b activation rows of k floats quantized as decode quantizes them (qrows.h's quantize_rows; decode.h's
// quantize_padded: the k columns at [pad_left, pad_left + k) of kp, zeros around them), threads splitting the rows.
inline void quantize_rows_parallel(const float* x, int64_t b, int64_t k, int64_t pad_left, int64_t kp,
                                   QuantRows& out) {
  size_rows(out, b, kp);
  at::parallel_for(0, b, 16, [&](int64_t lo, int64_t hi) { quantize_range(x, lo, hi, k, pad_left, out); });
}

// The word of two int16 columns: the first in the low half, as the integer multiply-add pairs them.
inline int32_t pair_word(int16_t first, int16_t second) {
  return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(first)) |
                              (static_cast<uint32_t>(static_cast<uint16_t>(second)) << 16));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// r[i] = sixteen int32 of row i -> r[c] = column c of the sixteen rows (a 16 x 16 transpose in four rounds).
inline void transpose16(__m512i* r) {
  __m512i a[16], t[16];
  for (int i = 0; i < 16; i += 2) {  // 128-bit lane l: rows i, i + 1 at columns 4l, 4l + 1 (lo) and 4l + 2, 4l + 3
    a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // t[i + c], lane l: column 4l + c of rows i .. i + 3
    t[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    t[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    t[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    t[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4l + c gathers lane l of t[c], t[4 + c], t[8 + c], t[12 + c]
    const __m512i e0 = _mm512_shuffle_i32x4(t[c], t[4 + c], 0x44), e1 = _mm512_shuffle_i32x4(t[c], t[4 + c], 0xEE);
    const __m512i e2 = _mm512_shuffle_i32x4(t[8 + c], t[12 + c], 0x44);
    const __m512i e3 = _mm512_shuffle_i32x4(t[8 + c], t[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(e0, e2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(e0, e2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(e1, e3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(e1, e3, 0xDD);
  }
}
#endif

// Rows [r0, r0 + QPANEL) of an int8 weight (rows kp apart; rows past n as zeros) as int16 pairs:
// out[p * QPANEL + i] = (w[r0 + i, 2p], w[r0 + i, 2p + 1]).
inline void widen_qpanel(const int8_t* w, int64_t kp, int64_t n, int64_t r0, int32_t* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (int64_t g = 0; g < QPANEL; g += 16)
    for (int64_t blk = 0; blk < kp / QBLOCK; ++blk) {
      __m512i rows[16];  // row i's 32 codes as 16 pairs; then pair p of the 16 rows
      for (int64_t i = 0; i < 16; ++i)
        rows[i] = r0 + g + i < n ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                                       reinterpret_cast<const __m256i*>(w + (r0 + g + i) * kp + blk * QBLOCK)))
                                 : _mm512_setzero_si512();
      transpose16(rows);
      for (int64_t p = 0; p < QPAIRS; ++p)
        _mm512_storeu_si512(out + (blk * QPAIRS + p) * QPANEL + g, rows[p]);
    }
#else
  for (int64_t i = 0; i < QPANEL; ++i)
    for (int64_t p = 0; p < kp / 2; ++p)
      out[p * QPANEL + i] = r0 + i < n ? pair_word(w[(r0 + i) * kp + 2 * p], w[(r0 + i) * kp + 2 * p + 1]) : 0;
#endif
}

// A panel widened from interleaved int8 codes (qexact.h) back to the natural order of its pairs: the codes' own
// transpose (every group of m blocks, tails included) in units of a pair's QPANEL words.
inline void deinterleave_panel(int32_t* out, int64_t kp) { transpose_groups(out, kp / 2, QPANEL); }

// Rows [r0, r0 + QPANEL) of an int4 weight in q4tiles.h's row tiles (tiles past the weight's as zeros): the codes
// q (0..15) as int16 pairs, out[p * QPANEL + i] as widen_qpanel lays them out, and per group g and row i the scale
// s[g * QPANEL + i] and m[g * QPANEL + i] = zero - 8 * scale (md: m as a double), so that a group's product is
// s * (q codes . x codes) * x scale + m * x sum, as q4tiles.h computes it. Line m's low nibbles hold the pairs 2m
// and 2m + 1 of 16 rows (row i's in bytes 4i .. 4i + 3), its high nibbles the pairs 8 + 2m and 9 + 2m.
inline void widen_qpanel_int4(const Int4Tiles& w, int64_t r0, int32_t* out, float* s, float* m, double* md) {
  for (int64_t part = 0; part < QPANEL; part += Q4TILE) {
    const int64_t t = (r0 + part) / Q4TILE;
    for (int64_t g = 0; g < w.groups; ++g) {
      int32_t* words = out + g * QPAIRS * QPANEL + part;
      const bool real = t < w.tiles();
      for (int64_t i = 0; i < Q4TILE; ++i) {
        const uint16_t* sz = real ? w.sz_at(t, g) : nullptr;
        const float scale = real ? bf16_to_float(sz[i]) : 0.f;
        s[g * QPANEL + part + i] = scale;
        m[g * QPANEL + part + i] = real ? bf16_to_float(sz[Q4TILE + i]) - 8.f * scale : 0.f;
        md[g * QPANEL + part + i] = m[g * QPANEL + part + i];
      }
#if defined(__AVX512F__) && defined(__AVX512BW__)
      const __m512i nibble = _mm512_set1_epi8(15);
      const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
      for (int64_t line = 0; line < Q4LINES; ++line) {
        const __m512i v = real ? _mm512_loadu_si512(w.at(t, g) + 64 * line) : _mm512_setzero_si512();
        const __m512i halves[2] = {_mm512_and_si512(v, nibble), _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble)};
        for (int h = 0; h < 2; ++h) {
          // rows 0-7 and 8-15 as int16, four columns a row: as int32, word 2i + e is row i's pair 2 * line + e
          const __m512i rows0 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(halves[h]));
          const __m512i rows8 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(halves[h], 1));
          const int64_t p = 8 * h + 2 * line;
          _mm512_storeu_si512(words + p * QPANEL, _mm512_permutex2var_epi32(rows0, even, rows8));
          _mm512_storeu_si512(words + (p + 1) * QPANEL, _mm512_permutex2var_epi32(rows0, odd, rows8));
        }
      }
#else
      for (int64_t p = 0; p < QPAIRS; ++p)
        for (int64_t i = 0; i < Q4TILE; ++i)
          words[p * QPANEL + i] =
              real ? pair_word(tile_code(w.at(t, g), i, 2 * p), tile_code(w.at(t, g), i, 2 * p + 1)) : 0;
#endif
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct QVec {  // 512-bit vectors
  using I = __m512i;
  using F = __m512;
  static I zero() { return _mm512_setzero_si512(); }
  static I load(const int32_t* p) { return _mm512_loadu_si512(p); }
  static I splat(const int16_t* p) { return _mm512_set1_epi32(code_pair(p)); }  // the pair p[0], p[1]
  static I dot(I acc, I w, I x) { return madd_pairs(acc, w, x); }  // q4tiles.h: VNNI's dot product where present
  static F fzero() { return _mm512_setzero_ps(); }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static F splatf(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  using D = __m512d;
  static D dzero() { return _mm512_setzero_pd(); }
  static void add_to(D* t, F v) { add_as_doubles(t, v); }  // qrows.h
  static D splatd(double v) { return _mm512_set1_pd(v); }
  static void add_products(D* t, const double* v, D c) {  // t[0], t[1] += v[0 .. 16) times c
    t[0] = _mm512_fmadd_pd(_mm512_loadu_pd(v), c, t[0]);
    t[1] = _mm512_fmadd_pd(_mm512_loadu_pd(v + 8), c, t[1]);
  }
};
#define SHARDLM_QPANEL_VEC 1
#elif defined(__AVX2__)
struct QVec {  // 256-bit vectors
  using I = __m256i;
  using F = __m256;
  static I zero() { return _mm256_setzero_si256(); }
  static I load(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I splat(const int16_t* p) { return _mm256_set1_epi32(code_pair(p)); }
  static I dot(I acc, I w, I x) { return madd_pairs(acc, w, x); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static F splatf(float v) { return _mm256_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  using D = __m256d;
  static D dzero() { return _mm256_setzero_pd(); }
  static void add_to(D* t, F v) { add_as_doubles(t, v); }
  static D splatd(double v) { return _mm256_set1_pd(v); }
  static void add_products(D* t, const double* v, D c) {  // t[0], t[1] += v[0 .. 8) times c
    t[0] = _mm256_fmadd_pd(_mm256_loadu_pd(v), c, t[0]);
    t[1] = _mm256_fmadd_pd(_mm256_loadu_pd(v + 4), c, t[1]);
  }
};
#define SHARDLM_QPANEL_VEC 1
#endif

}  // namespace shardlm
