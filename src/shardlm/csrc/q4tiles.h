// int4 weights in row tiles: the products of decode (integer units) and the panels of prefill read one layout.
//
// Layout (shardlm.quant.pack_int4 on the CPU): the rows are taken 16 at a time (a tile; the last one padded with
// zero rows), and each tile's codes are stored group by group (32 columns): codes (tiles, groups, 4, 64) uint8,
// where line m of a group holds, in bytes 4i .. 4i + 3, row i's columns 4m .. 4m + 3 in the low nibbles and
// 16 + 4m .. 19 + 4m in the high ones; scales and zeros (tiles, groups, 2, 16) bfloat16, the tile's 16 scales then
// its 16 zeros. W = (q - 8) * scale + zero, q in 0..15.
//
// Why: a line's nibbles, masked (low) or shifted and masked (high), are 16 rows' codes as bytes with row i's four
// columns in 32-bit lane i, so one byte dot product (VNNI's vpdpbusd: unsigned bytes times signed bytes, each lane
// adding its four products) against a broadcast of four activation bytes adds four products into each row's lane.
// The activation codes are int16 (qrows.h); each is taken as 256 * high + low (QuantRows::high, a signed byte, and
// low, an unsigned one), so a group's integer sum is 256 * (q . high) + (q . low): q (0..15) is the unsigned
// operand against the high bytes and the signed one against the low bytes. The sum is the same integer as the
// int16 products give, so the arithmetic below (and every result, bit for bit) is that of the earlier layout, whose
// 32-byte chunks widened to int16 took a widening, a mask and a shift a chunk and two int16 dot products per 64
// codes, where a line takes a mask, a shift and a mask and four byte dot products per 128 (the activation codes'
// two bytes are split once a call, split_bytes). The bundled model's int4 products at batch 1 took 0.89x the time
// from the caches and level to 2 % slower from memory at 31 GB/s (bench/products_vs_commit.py --format int4,
// RESULTS.md stop 58). Without VNNI, vpmaddubsw (byte pairs summed to int16), two of them added (at most 4 * 15 * 255: no
// saturation) and vpmaddwd by ones give the same lanes. (Before these tiles, a row's groups lay in turn, every
// (row, group) pair needed its own scale arithmetic and a horizontal sum, and decode ran at a fifth of the memory
// floor; here a group of 16 rows takes its scales and zeros for 16 rows at once, with no horizontal sums.)
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
constexpr int64_t Q4LINES = QBLOCK / 8;                // 64-byte lines a (tile, group) holds: 4
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

// Four activation bytes (of columns c .. c + 3) as one 32-bit value, for a broadcast.
inline int32_t byte_quad(const void* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}
// A pair of activation codes (x[i], x[i + 1]) as one 32-bit value, for a broadcast (the prefill panels, qpanel.h).
inline int32_t code_pair(const int16_t* x) { return byte_quad(x); }

// Row i's code of column col (0..31) in a (tile, group)'s 256 bytes `group`.
inline int32_t tile_code(const uint8_t* group, int64_t i, int64_t col) {
  const uint8_t byte = group[64 * ((col % 16) / 4) + 4 * i + col % 4];
  return col < 16 ? (byte & 15) : (byte >> 4);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int Q4J = 4;  // activation rows a tile call holds
inline __m512 bf16x16(const uint16_t* p) {  // 16 bfloat16 values as float32
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
// acc plus the products of w's and x's int16 lanes, adjacent pairs summed (the prefill panels, qpanel.h).
inline __m512i madd_pairs(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}
// acc plus, in each 32-bit lane, the eight products of a1's and a2's unsigned bytes and b1's and b2's signed bytes
// there (VNNI's dot products; without them, byte pairs summed to int16 (vpmaddubsw: within 2 * 15 * 255, as the
// tiles use it, no saturation), the two added (within 4 * 15 * 255) and their pairs summed to int32).
inline __m512i dot2_u8s8(__m512i acc, __m512i a1, __m512i b1, __m512i a2, __m512i b2) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, a1, b1), a2, b2);
#else
  const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(a1, b1), _mm512_maddubs_epi16(a2, b2));
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
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
  const __m512i nibble = _mm512_set1_epi8(15);
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* c = w.at(t, g);
    for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(c + Q4AHEAD + 64 * l), _MM_HINT_T0);
    // The group's integer sums in several chains a row of x (against the high bytes and against the low bytes; for
    // one row of x, low and high nibbles apart too), added at the group's end: integer sums are exact in any order,
    // and short chains keep a batch-1 product from waiting on the dot products' latency.
    constexpr int K = J == 1 ? 2 : 1;  // chains per byte of x and row of x (one row of x: even and odd lines apart)
    __m512i isum[J], hs[J][K], ls[J][K];
    for (int j = 0; j < J; ++j)
      for (int q = 0; q < K; ++q) hs[j][q] = ls[j][q] = _mm512_setzero_si512();
    for (int64_t m = 0; m < Q4LINES; ++m) {
      // lane i: row i's columns 4m .. 4m + 3 in `lo`, 16 + 4m .. 19 + 4m in `hi`, a byte each
      const __m512i v = _mm512_loadu_si512(c + 64 * m);
      const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      const int q = static_cast<int>(m % K);
      for (int j = 0; j < J; ++j) {
        const int8_t* xh = x.high.data() + (j0 + j) * x.kp + g * QBLOCK + 4 * m;
        const uint8_t* xl = x.low.data() + (j0 + j) * x.kp + g * QBLOCK + 4 * m;
        hs[j][q] = dot2_u8s8(hs[j][q], lo, _mm512_set1_epi32(byte_quad(xh)), hi, _mm512_set1_epi32(byte_quad(xh + 16)));
        ls[j][q] = dot2_u8s8(ls[j][q], _mm512_set1_epi32(byte_quad(xl)), lo, _mm512_set1_epi32(byte_quad(xl + 16)), hi);
      }
    }
    for (int j = 0; j < J; ++j) {  // 256 * (q . high) + (q . low): the int16 codes' sum
      __m512i h = hs[j][0], l = ls[j][0];
      for (int q = 1; q < K; ++q) h = _mm512_add_epi32(h, hs[j][q]), l = _mm512_add_epi32(l, ls[j][q]);
      isum[j] = _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);
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
// The 256-bit dot2_u8s8.
inline __m256i dot2_u8s8(__m256i acc, __m256i a1, __m256i b1, __m256i a2, __m256i b2) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, a1, b1), a2, b2);
#else
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(a1, b1), _mm256_maddubs_epi16(a2, b2));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// The AVX2 form of the tile: the same arithmetic on two halves of eight rows (a line's first and last 32 bytes).
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
  const __m256i nibble = _mm256_set1_epi8(15);
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* c = w.at(t, g);
    for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(c + Q4AHEAD + 64 * l), _MM_HINT_T0);
    __m256i isum[J][2], hs[J][2], ls[J][2];
    for (int j = 0; j < J; ++j)
      for (int h = 0; h < 2; ++h) hs[j][h] = ls[j][h] = _mm256_setzero_si256();
    for (int64_t m = 0; m < Q4LINES; ++m) {
      __m256i bh[J][2], bl[J][2];  // the activation bytes of the line's low and high columns
      for (int j = 0; j < J; ++j) {
        const int64_t at = (j0 + j) * x.kp + g * QBLOCK + 4 * m;
        bh[j][0] = _mm256_set1_epi32(byte_quad(x.high.data() + at));
        bh[j][1] = _mm256_set1_epi32(byte_quad(x.high.data() + at + 16));
        bl[j][0] = _mm256_set1_epi32(byte_quad(x.low.data() + at));
        bl[j][1] = _mm256_set1_epi32(byte_quad(x.low.data() + at + 16));
      }
      for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * m + 32 * h));
        const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        for (int j = 0; j < J; ++j) {
          hs[j][h] = dot2_u8s8(hs[j][h], lo, bh[j][0], hi, bh[j][1]);
          ls[j][h] = dot2_u8s8(ls[j][h], bl[j][0], lo, bl[j][1], hi);
        }
      }
    }
    for (int j = 0; j < J; ++j)
      for (int h = 0; h < 2; ++h) isum[j][h] = _mm256_add_epi32(_mm256_slli_epi32(hs[j][h], 8), ls[j][h]);
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
        for (int64_t col = 0; col < QBLOCK; ++col) isum += tile_code(w.at(t, g), i, col) * xc[col];
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

// Tiles [lo, hi) of an int4 weight against every quantized activation row (x.kp = the weight's padded width; its
// codes split into bytes, split_bytes).
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
