// Decode rows with bfloat16 weights: sixteen columns a step, each 32-bit word of the weight two bfloat16 values.
//
// A float32 weight's tile (rows.h) loads eight columns and runs one FMA a vector. A bfloat16 one had to widen each
// eight values first (zero-extend to 32 bits, shift, and on AVX-512 a broadcast to both halves), and at batch 1 on
// an AVX-512 host that arithmetic, not the memory, set the pace once the read bandwidth passed ~60 GB/s (71 % of
// the floor at 75 GB/s, bench/floor_share.py). Here a step reads 16 columns as eight words: word m holds columns
// 2m (low half) and 2m + 1 (high half), so `word << 16` is column 2m as a float32 and `word & 0xFFFF0000` column
// 2m + 1: two instructions widen sixteen values. With AVX-512 one 512-bit register holds two weight rows' words
// (batch 1) or one row's words twice (two rows of x a register, as rows.h's tile_pairs). One thread, 1536 x 576
// from the caches: batch 1 28.2-28.4 -> 20.3-21.6 us, 4 rows 47.3-47.9 -> 35.7-35.9, 16 rows 134.0-134.1 ->
// 118.5-119.8 (bench/RESULTS.md, stop 47).
//
// The arithmetic, on every build without avx512_bf16 and every tile: each output keeps eight float32 chains over k;
// chain m, at each step of 16 columns from i, fuses w[i + 2m] * x[i + 2m] and then w[i + 2m + 1] * x[i + 2m + 1]
// (one rounding each); the chains are added in order from zero (lane_sums8), then the last k % 16 columns' rounded
// products in order. x is laid out once a call with each step's even columns before its odd ones (`split_of`), or,
// for the 512-bit pair tiles, two rows of it interleaved by eight (`split_pairs_of`). A row's result does not depend
// on the batch or on the tile that computes it; AVX-512 and AVX2 builds give the same bits (a build without FMA
// rounds each product before its add), and tests/refs.py `float_rows_reference` emulates the chains in torch. Builds
// with avx512_bf16 run these tiles with bfloat16 dot products and x rounded to bfloat16 (bf16dot.h).
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "rows.h"

namespace shardlm {

constexpr int64_t BF16_STEP = 16;  // columns a step

// Columns 2m (even) and 2m + 1 (odd) of the eight words at p, as float32 lanes m.
inline void bf16_halves(const uint16_t* p, v8f& even, v8f& odd) {
  v8u32 words;
  std::memcpy(&words, p, sizeof(words));
  even = reinterpret_cast<v8f>(words << 16);
  odd = reinterpret_cast<v8f>(words & 0xFFFF0000u);
}

// x's b rows (k columns) as the tiles read them, in a buffer of the calling thread: row j at out + j * kk (kk = k -
// k % 16), each step's eight even columns, then its eight odd ones.
inline const float* split_of(const float* x, int64_t b, int64_t k) {
  thread_local std::vector<float> buf;
  const int64_t kk = k - k % BF16_STEP;
  buf.resize(static_cast<size_t>(b * kk));
  for (int64_t j = 0; j < b; ++j)
    for (int64_t i = 0; i < kk; i += BF16_STEP)
      for (int64_t m = 0; m < 8; ++m) {
        buf[j * kk + i + m] = x[j * k + i + 2 * m];
        buf[j * kk + i + 8 + m] = x[j * k + i + 2 * m + 1];
      }
  return buf.data();
}

// y[j, r] for R weight rows from r0 and J rows of x (their split rows at xs, lds apart; the original rows at x, for
// the tail), with eight-lane vectors.
template <int R, int J>
inline void tile_bf16(const uint16_t* w, int64_t ldw, const float* x, const float* xs, int64_t lds, float* y,
                      int64_t n, int64_t k, int64_t r0, int64_t j0) {
  const int64_t kk = k - k % BF16_STEP;
  v8f acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = v8f{};
  for (int64_t i = 0; i < kk; i += BF16_STEP) {
    if (j0 == 0) prefetch_next_tile<uint16_t, R>(w, ldw, r0, i);
    v8f xe[J], xo[J];
    for (int j = 0; j < J; ++j) xe[j] = load8<float>(xs + j * lds + i), xo[j] = load8<float>(xs + j * lds + i + 8);
    for (int r = 0; r < R; ++r) {
      v8f we, wo;
      bf16_halves(w + (r0 + r) * ldw + i, we, wo);
      for (int j = 0; j < J; ++j) acc[r][j] = fma8(wo, xo[j], fma8(we, xe[j], acc[r][j]));
    }
  }
  v8f chains[R * J];  // a copy: the accumulators' own address taken could keep them in memory through the loop
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) chains[r * J + j] = acc[r][j];
  float sums[R * J];  // (r, j): the chains added in order from zero, eight pairs at a time
  lane_sums8(chains, R * J, sums);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) {
      float s = sums[r * J + j];
      for (int64_t t = kk; t < k; ++t) s += load<uint16_t>(w, (r0 + r) * ldw + t) * x[(j0 + j) * k + t];
      y[(j0 + j) * n + r0 + r] = s;
    }
}

#if defined(__AVX512F__)
// Sixteen lanes as two groups of eight: per group, the weight row's last columns' rounded products added to its
// lane sum, then y. `sums[q]` is group q's lane sum; group q is weight row r0 + wrow[q] with x row xrow[q].
template <int G>
inline void finish_groups(const float* sums, const int* wrow, const int64_t* xrow, const uint16_t* w, int64_t ldw,
                          const float* x, float* y, int64_t n, int64_t k, int64_t r0) {
  const int64_t kk = k - k % BF16_STEP;
  for (int q = 0; q < G; ++q) {
    float s = sums[q];
    for (int64_t t = kk; t < k; ++t) s += load<uint16_t>(w, (r0 + wrow[q]) * ldw + t) * x[xrow[q] * k + t];
    y[xrow[q] * n + r0 + wrow[q]] = s;
  }
}

// The next tile's R rows (from r0 + R) asked for in address order, `per` cache lines at each of the tile's `steps`
// steps, where the rows lie one after another (ldw == k): the memory sees one stream, not R streams side by side as
// prefetch_next_tile asks for them (the tile itself still reads its rows side by side: the arithmetic is unchanged).
// Else `per` is 0 and step() asks row by row (prefetch_next_tile). At batch 1 on an AVX-512 host with the memory at
// 44-49 GB/s (sum()), the bundled model's bfloat16 products from memory took 0.86-0.93 of the row-by-row time and a
// decode step 0.88-0.89 (paired in-process A/B); where that host read at 75 GB/s and its cores ran slower (the
// products bound by their arithmetic) 1.00-1.03; from the caches 1.01-1.05 (bench/RESULTS.md, stop 50). An
// address, not a pointer: the hint may pass the weight's end and never faults.
template <int R>
struct NextTileInOrder {
  const uint16_t* w;
  int64_t ldw, r0;
  uintptr_t next = 0;
  int64_t per = 0;
  NextTileInOrder(const uint16_t* w_, int64_t ldw_, int64_t k, int64_t r0_, int64_t steps) : w(w_), ldw(ldw_), r0(r0_) {
    if (ldw != k || steps <= 0) return;
    const uintptr_t base = reinterpret_cast<uintptr_t>(w);
    next = (base + (r0 + R) * ldw * sizeof(uint16_t)) & ~uintptr_t{63};
    const uintptr_t end = base + (r0 + 2 * R) * ldw * sizeof(uint16_t);
    per = (static_cast<int64_t>((end - next + 63) / 64) + steps - 1) / steps;
  }
  // At the step from column i.
  __attribute__((always_inline)) void step(int64_t i) {
    if (per == 0) return prefetch_next_tile<uint16_t, R>(w, ldw, r0, i);
    for (int64_t c = 0; c < per; ++c, next += 64) __builtin_prefetch(reinterpret_cast<const void*>(next), 0, 3);
  }
};

// A batch-1 row-pair tile's sums to y: acc[p] holds the eight chains of weight rows r0 + 2p (low half) and
// r0 + 2p + 1 (high half); the last k % 16 columns from x's row. (bf16dot.h's tiles end alike.)
template <int R>
__attribute__((always_inline)) inline void finish_rowpairs(const __m512 (&acc)[R / 2], const uint16_t* w, int64_t ldw,
                                                           const float* x, float* y, int64_t k, int64_t r0) {
  const int64_t kk = k - k % BF16_STEP;
  if constexpr (R == 8) {
    if (kk == k) {  // no tail columns: tile_pairs' transposes (rows.h) sum the chains in place
      const __m512 zero = _mm512_setzero_ps();
      const __m512 group[8] = {acc[0], acc[1], acc[2], acc[3], zero, zero, zero, zero};
      // pair_lane_sums puts row r's sum at element 4 (r % 2) + r / 2; back to row order
      const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
      _mm256_storeu_ps(y + r0, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, pair_lane_sums(group))));
      return;
    }
  }
  v8f halves[R];  // weight row r0 + r's eight chains
  for (int p = 0; p < R / 2; ++p) halves_of(acc[p], halves[2 * p], halves[2 * p + 1]);
  float sums[R];
  lane_sums8(halves, R, sums);
  int wrow[R];
  int64_t xrow[R] = {};
  for (int r = 0; r < R; ++r) wrow[r] = r;
  finish_groups<R>(sums, wrow, xrow, w, ldw, x, y, 0, k, r0);
}

// Batch 1: weight rows r0 + 2p and r0 + 2p + 1 in the two halves of register p (R rows, R / 2 registers), x's
// split row broadcast to both halves. Tiles of 8 rows: 16 were faster from the caches but ~9 % slower from memory
// (sixteen rows streamed at once and the next sixteen asked for; bench/RESULTS.md).
template <int R>
inline void tile_bf16_rowpairs(const uint16_t* w, int64_t ldw, const float* x, const float* xs, float* y,
                               int64_t k, int64_t r0) {
  const int64_t kk = k - k % BF16_STEP;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[R / 2];
  for (int p = 0; p < R / 2; ++p) acc[p] = _mm512_setzero_ps();
  NextTileInOrder<R> ahead(w, ldw, k, r0, kk / BF16_STEP);
  for (int64_t i = 0; i < kk; i += BF16_STEP) {
    ahead.step(i);
    __m512 xe = _mm512_broadcast_f32x8(_mm256_loadu_ps(xs + i));
    __m512 xo = _mm512_broadcast_f32x8(_mm256_loadu_ps(xs + i + 8));
    asm("" : "+v"(xe), "+v"(xo));  // one broadcast each a step, not one per FMA
    for (int p = 0; p < R / 2; ++p) {
      const uint16_t* row = w + (r0 + 2 * p) * ldw + i;
      const __m512i words = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + ldw)), 1);
      const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
      const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(words, high));
      acc[p] = _mm512_fmadd_ps(wo, xo, _mm512_fmadd_ps(we, xe, acc[p]));
    }
  }
  finish_rowpairs<R>(acc, w, ldw, x, y, k, r0);
}

// x's rows split (as split_of) and interleaved pairwise by eight for tile_bf16_pairs, in a buffer of the calling
// thread from a 64-byte boundary: pair q's step at column i holds 8 even columns of row 2q, 8 of row 2q + 1, then
// their odd columns, at out + q * 2 * kk + 2 * i; an odd last row follows the pairs, split, at out + (b / 2) * 2 * kk.
inline const float* split_pairs_of(const float* x, int64_t b, int64_t k) {
  thread_local std::vector<float> buf;
  const int64_t kk = k - k % BF16_STEP;
  buf.resize(static_cast<size_t>(b * kk + 16));
  float* base = buf.data() + ((64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64) / sizeof(float);
  const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t q = 0; q < b / 2; ++q)
    for (int64_t i = 0; i < kk; i += BF16_STEP) {
      const __m512 a = _mm512_permutexvar_ps(order, _mm512_loadu_ps(x + 2 * q * k + i));  // even | odd of row 2q
      const __m512 c = _mm512_permutexvar_ps(order, _mm512_loadu_ps(x + (2 * q + 1) * k + i));
      float* to = base + q * 2 * kk + 2 * i;
      _mm512_storeu_ps(to, _mm512_shuffle_f32x4(a, c, 0x44));  // a's even, c's even
      _mm512_storeu_ps(to + 16, _mm512_shuffle_f32x4(a, c, 0xEE));  // a's odd, c's odd
    }
  if (b % 2) {
    float* to = base + (b / 2) * 2 * kk;
    for (int64_t i = 0; i < kk; i += BF16_STEP)
      _mm512_storeu_ps(to + i, _mm512_permutexvar_ps(order, _mm512_loadu_ps(x + (b - 1) * k + i)));
  }
  return base;
}

// Pass `pass` of `passes` over a tile of R rows (a tile of many x rows reads its weight rows once a pass) asks for
// its share of the next tile's columns, a line of each next row every `passes` steps, so the memory keeps streaming
// through every pass (as tile_pairs, rows.h).
template <int R>
struct PassAhead {
  int64_t at;
  int wait = 0, passes;
  PassAhead(int64_t kk, int pass, int passes_) : at(pass * (kk / passes_ / BF16_STEP * BF16_STEP)), passes(passes_) {}
  __attribute__((always_inline)) void step(const uint16_t* w, int64_t ldw, int64_t r0) {
    if (++wait < passes) return;
    wait = 0;
    prefetch_next_tile<uint16_t, R>(w, ldw, r0, at);
    at += BF16_STEP;
  }
};

// A pair tile's sums to y: acc[r][p] holds the eight chains of weight row r0 + r with x rows j0 + 2p (low half) and
// j0 + 2p + 1 (high half); the last k % 16 columns from x's rows. (bf16dot.h's tiles end alike.)
template <int R, int P>
__attribute__((always_inline)) inline void finish_pairs(const __m512 (&acc)[R][P], const uint16_t* w, int64_t ldw,
                                                        const float* x, float* y, int64_t n, int64_t k, int64_t r0,
                                                        int64_t j0) {
  const int64_t kk = k - k % BF16_STEP;
  if constexpr (R == 4 && P % 2 == 0) {
    if (kk == k) {  // no tail columns: the sums go straight to y, through tile_pairs' transposes (rows.h)
      for (int p = 0; p < P; p += 2) {
        const __m512 group[8] = {acc[0][p], acc[1][p], acc[2][p], acc[3][p],
                                 acc[0][p + 1], acc[1][p + 1], acc[2][p + 1], acc[3][p + 1]};
        store_sums4(pair_lane_sums(group), y, n, r0, j0 + 2 * p);
      }
      return;
    }
  }
  v8f halves[R * P * 2];  // (r, p, h): the eight chains of weight row r with x row j0 + 2p + h
  int wrow[R * P * 2];
  int64_t xrow[R * P * 2];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) {
      const int q = (r * P + p) * 2;
      halves_of(acc[r][p], halves[q], halves[q + 1]);
      wrow[q] = wrow[q + 1] = r, xrow[q] = j0 + 2 * p, xrow[q + 1] = j0 + 2 * p + 1;
    }
  float sums[R * P * 2];
  lane_sums8(halves, R * P * 2, sums);
  finish_groups<R * P * 2>(sums, wrow, xrow, w, ldw, x, y, n, k, r0);
}

// R weight rows from r0 against 2P rows of x from j0 (even), two rows of x a register: weight row r's words
// broadcast to both halves. Pass `pass` of `passes` asks for its share of the next tile's columns (as tile_pairs).
template <int R, int P>
inline void tile_bf16_pairs(const uint16_t* w, int64_t ldw, const float* x, const float* xp, float* y, int64_t n,
                            int64_t k, int64_t r0, int64_t j0, int pass, int passes) {
  const int64_t kk = k - k % BF16_STEP;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  PassAhead<R> ahead(kk, pass, passes);
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  const float* xq = xp + (j0 / 2) * 2 * kk;
  for (int64_t i = 0; i < kk; i += BF16_STEP) {
    ahead.step(w, ldw, r0);
    __m512 xe[P], xo[P];
    for (int p = 0; p < P; ++p) {
      __m512 e = _mm512_loadu_ps(xq + p * 2 * kk + 2 * i), o = _mm512_loadu_ps(xq + p * 2 * kk + 2 * i + 16);
      asm("" : "+v"(e), "+v"(o));  // loaded once, not folded into each of the R FMAs (see tile_pairs)
      xe[p] = e, xo[p] = o;
    }
    for (int r = 0; r < R; ++r) {
      const __m512i words = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          w + (r0 + r) * ldw + i)));
      const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
      const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(words, high));
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(wo, xo[p], _mm512_fmadd_ps(we, xe[p], acc[r][p]));
    }
  }
  finish_pairs<R, P>(acc, w, ldw, x, y, n, k, r0, j0);
}
#endif

}  // namespace shardlm
#include "bf16dot.h"  // avx512_bf16 builds: rows_bf16_dot (after the tiles, prefetches and sums it reuses)
namespace shardlm {

// Weight rows [lo, hi) of a bfloat16 weight (rows ldw apart) against the b rows of x: y[j, r] (y has n columns).
inline void rows_bf16(const uint16_t* w, const float* x, float* y, int64_t n, int64_t k, int64_t b, int64_t lo,
                      int64_t hi, int64_t ldw) {
#if defined(SHARDLM_BF16_DOT)
  rows_bf16_dot(w, x, y, n, k, b, lo, hi, ldw);
  return;
#endif
  const int64_t kk = k - k % BF16_STEP;
  int64_t r = lo;
#if defined(__AVX512F__)
  if (b == 1) {
    const float* xs = split_of(x, 1, k);
    for (; r + 8 <= hi; r += 8) tile_bf16_rowpairs<8>(w, ldw, x, xs, y, k, r);
    if (r + 4 <= hi) tile_bf16_rowpairs<4>(w, ldw, x, xs, y, k, r), r += 4;
    for (; r < hi; ++r) tile_bf16<1, 1>(w, ldw, x, xs, kk, y, n, k, r, 0);
    return;
  }
  const float* xp = split_pairs_of(x, b, k);
  const int passes = static_cast<int>(b / 8 + (b % 8 >= 4) + (b % 4 >= 2));
  auto against_all = [&](auto rows_tag, int64_t r0) {
    constexpr int R = decltype(rows_tag)::value;
    int64_t j = 0;
    int pass = 0;
    for (; j + 8 <= b; j += 8) tile_bf16_pairs<R, 4>(w, ldw, x, xp, y, n, k, r0, j, pass++, passes);
    if (j + 4 <= b) tile_bf16_pairs<R, 2>(w, ldw, x, xp, y, n, k, r0, j, pass++, passes), j += 4;
    if (j + 2 <= b) tile_bf16_pairs<R, 1>(w, ldw, x, xp, y, n, k, r0, j, pass++, passes), j += 2;
    if (j < b) tile_bf16<R, 1>(w, ldw, x, xp + (b / 2) * 2 * kk, kk, y, n, k, r0, j);
  };
#else
  const float* xs = split_of(x, b, k);
  if (b == 1)
    for (; r + 8 <= hi; r += 8) tile_bf16<8, 1>(w, ldw, x, xs, kk, y, n, k, r, 0);
  auto against_all = [&](auto rows_tag, int64_t r0) {
    constexpr int R = decltype(rows_tag)::value;
    int64_t j = 0;
    for (; j + 2 <= b; j += 2) tile_bf16<R, 2>(w, ldw, x, xs + j * kk, kk, y, n, k, r0, j);
    if (j < b) tile_bf16<R, 1>(w, ldw, x, xs + j * kk, kk, y, n, k, r0, j);
  };
#endif
  for (; r + 4 <= hi; r += 4) against_all(std::integral_constant<int, 4>{}, r);
  for (; r < hi; ++r) against_all(std::integral_constant<int, 1>{}, r);
}

}  // namespace shardlm
