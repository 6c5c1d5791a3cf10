// int4 weights in row tiles: the products of decode (integer units) and the panels of prefill read one layout.
//
// Layout (shardlm.quant.pack_int4 on the CPU): the rows are taken 16 at a time (a tile; the last one padded with
// zero rows), and each tile's codes are stored group by group (32 columns): codes (tiles, groups, 8, 32) uint8,
// where chunk c of a group holds, in bytes 2i and 2i + 1, row i's columns (2c, 2c + 1) in the low nibbles and
// (16 + 2c, 17 + 2c) in the high ones; scales and zeros (tiles, groups, 2, 16) bfloat16, the tile's 16 scales
// then its 16 zeros. W = (q - 8) * scale + zero, q in 0..15.
//
// Why: in the earlier layout (a row's groups in turn) every (row, group) pair needed its own scale arithmetic and
// a horizontal sum, about fifteen vector instructions per 32 products, and decode ran at a fifth of the memory
// floor. Here a chunk widened to int16 puts row i's two columns in lanes 2i and 2i + 1, so one multiply-add of the
// chunk by a broadcast pair of activation codes (x[2c], x[2c + 1]) adds both products into row i's int32 lane:
// a group of 16 rows is 16 such instructions on AVX-512 (32 on AVX2), with no horizontal sums, and the group's
// scales and zeros are applied to 16 rows at once. Activations are the int16 block codes of qrows.h.
//
// Arithmetic per (weight row, activation row) pair, the same for every batch, tile or thread split: per group,
// isum = sum of q * x codes (exact in int32), then acc += float(isum) * (scale * x_scale) and
// zacc += (zero - 8 * scale) * x_sum; the result is acc + zacc. `Exact` weights (split by input column under
// tensor parallelism: o, down) round each group's term to float and add the terms in double, so a row-parallel
// rank's partial sums, all-reduced in double, give the one-rank result (as in qrows.h); the others keep float
// accumulators with FMA.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "qrows.h"

namespace shardlm {

constexpr int64_t Q4TILE = 16;                         // weight rows a tile holds
constexpr int64_t Q4CHUNKS = QBLOCK / 4;               // 32-byte chunks a (tile, group) holds: 8
constexpr int64_t Q4TILE_BYTES = Q4TILE * QBLOCK / 2;  // one (tile, group)'s codes: 256 bytes
// A tile asks for the codes this far past the group it reads (the tiles are one address stream): 4 KB, 16
// groups, where 8 had taken 1.02-1.07x the batch-1 step time (in-process A/B of the bundled model's int4 rank, three
// runs of paired rounds).
constexpr int64_t Q4AHEAD = 16 * Q4TILE_BYTES;

// An int4 weight in the tiled layout: n real rows, `groups` groups of QBLOCK columns.
struct Int4Tiles {
  const uint8_t* codes;
  const uint16_t* sz;
  int64_t n, groups;

  int64_t tiles() const { return (n + Q4TILE - 1) / Q4TILE; }
  const uint8_t* at(int64_t t, int64_t g) const { return codes + (t * groups + g) * Q4TILE_BYTES; }
  const uint16_t* sz_at(int64_t t, int64_t g) const { return sz + (t * groups + g) * 2 * Q4TILE; }
};

// A pair of activation codes (x[i], x[i + 1]) as one 32-bit value, for a broadcast.
inline int32_t code_pair(const int16_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}

// The four columns (2c, 2c + 1, 16 + 2c, 17 + 2c) chunk c holds for row i: its two bytes.
inline int32_t chunk_code(const uint8_t* chunk, int64_t i, int col) {  // col 0..3 in that order
  const uint8_t byte = chunk[2 * i + (col & 1)];
  return col < 2 ? (byte & 15) : (byte >> 4);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int Q4J = 4;  // activation rows a tile call holds
inline __m512 bf16x16(const uint16_t* p) {  // 16 bfloat16 values as float32
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
inline __m512i madd_pairs(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

// y[j, 16t + i] for the tile's rows i and J activation rows from j0 (rows of y n apart).
template <typename T, bool Exact, int J>
__attribute__((always_inline)) inline void q4_tile(const Int4Tiles& w, const QuantRows& x, T* y, int64_t t,
                                                   int64_t j0) {
  __m512 acc[J], zacc[J];
  __m512d dacc[J][2], dzacc[J][2];
  for (int j = 0; j < J; ++j) {
    acc[j] = zacc[j] = _mm512_setzero_ps();
    dacc[j][0] = dacc[j][1] = dzacc[j][0] = dzacc[j][1] = _mm512_setzero_pd();
  }
  const __m512i low = _mm512_set1_epi16(15);
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* c = w.at(t, g);
    for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(c + Q4AHEAD + 64 * l), _MM_HINT_T0);
    // The group's integer sums in several chains a row of x (low and high nibbles apart; for one row of x, even and
    // odd chunks apart too), added at the group's end: integer sums are exact in any order, and four chains of four
    // multiply-adds wait a quarter as long as one of sixteen. One chain a group had left a batch-1 product waiting
    // on the multiply-adds' latency: 1536 x 576 in cache 9.5 -> 7.1-7.8 us a call (python scratch, hot weights).
    constexpr int K = J == 1 ? 2 : 1;  // chains per nibble half and row of x
    __m512i isum[J], sums[J][2 * K];
    for (int j = 0; j < J; ++j)
      for (int q = 0; q < 2 * K; ++q) sums[j][q] = _mm512_setzero_si512();
    for (int64_t ch = 0; ch < Q4CHUNKS; ++ch) {
      // lanes 2i, 2i + 1: row i's columns (2ch, 2ch + 1) in `lo`, (16 + 2ch, 17 + 2ch) in `hi`
      const __m512i wide = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * ch)));
      const __m512i lo = _mm512_and_si512(wide, low), hi = _mm512_srli_epi16(wide, 4);
      const int q = 2 * static_cast<int>(ch % K);
      for (int j = 0; j < J; ++j) {
        const int16_t* xc = x.codes.data() + (j0 + j) * x.kp + g * QBLOCK;
        sums[j][q] = madd_pairs(sums[j][q], lo, _mm512_set1_epi32(code_pair(xc + 2 * ch)));
        sums[j][q + 1] = madd_pairs(sums[j][q + 1], hi, _mm512_set1_epi32(code_pair(xc + 16 + 2 * ch)));
      }
    }
    for (int j = 0; j < J; ++j) {
      isum[j] = _mm512_add_epi32(sums[j][0], sums[j][1]);
      for (int q = 2; q < 2 * K; ++q) isum[j] = _mm512_add_epi32(isum[j], sums[j][q]);
    }
    const uint16_t* sz = w.sz_at(t, g);
    const __m512 s = bf16x16(sz), m = _mm512_sub_ps(bf16x16(sz + Q4TILE), _mm512_mul_ps(_mm512_set1_ps(8.f), s));
    for (int j = 0; j < J; ++j) {
      const int64_t at = (j0 + j) * x.blocks + g;
      const __m512 f = _mm512_mul_ps(s, _mm512_set1_ps(x.scales[at]));
      if constexpr (Exact) {
        const __m512 term = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[j]), f);
        const __m512d xs = _mm512_set1_pd(static_cast<double>(x.sums[at]));
        dacc[j][0] = _mm512_add_pd(dacc[j][0], _mm512_cvtps_pd(_mm512_castps512_ps256(term)));
        dacc[j][1] = _mm512_add_pd(dacc[j][1], _mm512_cvtps_pd(_mm512_extractf32x8_ps(term, 1)));
        dzacc[j][0] = _mm512_add_pd(dzacc[j][0], _mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(m)), xs));
        dzacc[j][1] = _mm512_add_pd(dzacc[j][1], _mm512_mul_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(m, 1)), xs));
      } else {
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[j]), f, acc[j]);
        zacc[j] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sums[at]), zacc[j]);
      }
    }
  }
  const int64_t rows = std::min(Q4TILE, w.n - t * Q4TILE);
  for (int j = 0; j < J; ++j) {
    T* out = y + (j0 + j) * w.n + t * Q4TILE;
    if constexpr (Exact) {
      alignas(64) double a[16], z[16];
      _mm512_store_pd(a, dacc[j][0]);
      _mm512_store_pd(a + 8, dacc[j][1]);
      _mm512_store_pd(z, dzacc[j][0]);
      _mm512_store_pd(z + 8, dzacc[j][1]);
      for (int64_t i = 0; i < rows; ++i) out[i] = static_cast<T>(a[i] + z[i]);
    } else {
      alignas(64) float a[16];
      _mm512_store_ps(a, _mm512_add_ps(acc[j], zacc[j]));
      for (int64_t i = 0; i < rows; ++i) out[i] = static_cast<T>(a[i]);
    }
  }
}
#elif defined(__AVX2__)
constexpr int Q4J = 2;
inline __m256 bf16x8(const uint16_t* p) { return reinterpret_cast<__m256>(load8<uint16_t>(p)); }  // rows.h
inline __m256i madd_pairs(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}

// The AVX2 form of the tile: the same arithmetic on two halves of eight rows.
template <typename T, bool Exact, int J>
__attribute__((always_inline)) inline void q4_tile(const Int4Tiles& w, const QuantRows& x, T* y, int64_t t,
                                                   int64_t j0) {
  __m256 acc[J][2], zacc[J][2];
  __m256d dacc[J][4], dzacc[J][4];
  for (int j = 0; j < J; ++j)
    for (int h = 0; h < 4; ++h) {
      if (h < 2) acc[j][h] = zacc[j][h] = _mm256_setzero_ps();
      dacc[j][h] = dzacc[j][h] = _mm256_setzero_pd();
    }
  const __m256i low = _mm256_set1_epi16(15);
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* c = w.at(t, g);
    for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(c + Q4AHEAD + 64 * l), _MM_HINT_T0);
    __m256i isum[J][2];
    for (int j = 0; j < J; ++j) isum[j][0] = isum[j][1] = _mm256_setzero_si256();
    for (int64_t ch = 0; ch < Q4CHUNKS; ++ch) {
      __m256i bl[J], bh[J];
      for (int j = 0; j < J; ++j) {
        const int16_t* xc = x.codes.data() + (j0 + j) * x.kp + g * QBLOCK;
        bl[j] = _mm256_set1_epi32(code_pair(xc + 2 * ch));
        bh[j] = _mm256_set1_epi32(code_pair(xc + 16 + 2 * ch));
      }
      for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7
        const __m256i wide =
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 32 * ch + 16 * h)));
        const __m256i lo = _mm256_and_si256(wide, low), hi = _mm256_srli_epi16(wide, 4);
        for (int j = 0; j < J; ++j) isum[j][h] = madd_pairs(madd_pairs(isum[j][h], lo, bl[j]), hi, bh[j]);
      }
    }
    const uint16_t* sz = w.sz_at(t, g);
    for (int h = 0; h < 2; ++h) {
      const __m256 s = bf16x8(sz + 8 * h);
      const __m256 m = _mm256_sub_ps(bf16x8(sz + Q4TILE + 8 * h), _mm256_mul_ps(_mm256_set1_ps(8.f), s));
      for (int j = 0; j < J; ++j) {
        const int64_t at = (j0 + j) * x.blocks + g;
        const __m256 f = _mm256_mul_ps(s, _mm256_set1_ps(x.scales[at]));
        if constexpr (Exact) {
          const __m256 term = _mm256_mul_ps(_mm256_cvtepi32_ps(isum[j][h]), f);
          const __m256d xs = _mm256_set1_pd(static_cast<double>(x.sums[at]));
          dacc[j][2 * h] = _mm256_add_pd(dacc[j][2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(term)));
          dacc[j][2 * h + 1] = _mm256_add_pd(dacc[j][2 * h + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(term, 1)));
          dzacc[j][2 * h] =
              _mm256_add_pd(dzacc[j][2 * h], _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(m)), xs));
          dzacc[j][2 * h + 1] =
              _mm256_add_pd(dzacc[j][2 * h + 1], _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(m, 1)), xs));
        } else {
          acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j][h]), f, acc[j][h]);
          zacc[j][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.sums[at]), zacc[j][h]);
        }
      }
    }
  }
  const int64_t rows = std::min(Q4TILE, w.n - t * Q4TILE);
  for (int j = 0; j < J; ++j) {
    T* out = y + (j0 + j) * w.n + t * Q4TILE;
    if constexpr (Exact) {
      alignas(32) double a[16], z[16];
      for (int h = 0; h < 4; ++h) {
        _mm256_store_pd(a + 4 * h, dacc[j][h]);
        _mm256_store_pd(z + 4 * h, dzacc[j][h]);
      }
      for (int64_t i = 0; i < rows; ++i) out[i] = static_cast<T>(a[i] + z[i]);
    } else {
      alignas(32) float a[16];
      _mm256_store_ps(a, _mm256_add_ps(acc[j][0], zacc[j][0]));
      _mm256_store_ps(a + 8, _mm256_add_ps(acc[j][1], zacc[j][1]));
      for (int64_t i = 0; i < rows; ++i) out[i] = static_cast<T>(a[i]);
    }
  }
}
#else
constexpr int Q4J = 1;
// Without vector units: the same arithmetic, scalar (float FMAs as std::fma, double sums as doubles).
template <typename T, bool Exact, int J>
inline void q4_tile(const Int4Tiles& w, const QuantRows& x, T* y, int64_t t, int64_t j0) {
  const int64_t rows = std::min(Q4TILE, w.n - t * Q4TILE);
  for (int j = 0; j < J; ++j)
    for (int64_t i = 0; i < rows; ++i) {
      float acc = 0.f, zacc = 0.f;
      double dacc = 0.0, dzacc = 0.0;
      for (int64_t g = 0; g < w.groups; ++g) {
        const int16_t* xc = x.codes.data() + (j0 + j) * x.kp + g * QBLOCK;
        int32_t isum = 0;
        for (int64_t ch = 0; ch < Q4CHUNKS; ++ch)
          for (int col = 0; col < 4; ++col)
            isum += chunk_code(w.at(t, g) + 32 * ch, i, col) * xc[(col < 2 ? 2 * ch : 16 + 2 * ch) + (col & 1)];
        const uint16_t* sz = w.sz_at(t, g);
        const float s = bf16_to_float(sz[i]), m = bf16_to_float(sz[Q4TILE + i]) - 8.f * s;
        const int64_t at = (j0 + j) * x.blocks + g;
        const float f = s * x.scales[at];
        if constexpr (Exact) {
          dacc += static_cast<double>(static_cast<float>(isum) * f);
          dzacc += static_cast<double>(m) * static_cast<double>(x.sums[at]);
        } else {
          acc = std::fma(static_cast<float>(isum), f, acc);
          zacc = std::fma(m, x.sums[at], zacc);
        }
      }
      y[(j0 + j) * w.n + t * Q4TILE + i] = static_cast<T>(Exact ? dacc + dzacc : acc + zacc);
    }
}
#endif

// Tiles [lo, hi) of an int4 weight against every quantized activation row (x.kp = the weight's padded width).
template <typename T, bool Exact>
inline void q4_tiles(const Int4Tiles& w, const QuantRows& x, T* y, int64_t b, int64_t lo, int64_t hi) {
  for (int64_t t = lo; t < hi; ++t) {
    int64_t j = 0;
    for (; j + Q4J <= b; j += Q4J) q4_tile<T, Exact, Q4J>(w, x, y, t, j);
    for (; j < b; ++j) q4_tile<T, Exact, 1>(w, x, y, t, j);
  }
}

template <typename T>
inline void q4rows_tiled(const Int4Tiles& w, const QuantRows& x, T* y, int64_t b, int64_t lo, int64_t hi,
                         bool exact) {
  if (exact)
    q4_tiles<T, true>(w, x, y, b, lo, hi);
  else
    q4_tiles<T, false>(w, x, y, b, lo, hi);
}

}  // namespace shardlm
