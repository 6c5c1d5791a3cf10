// Decode rows with bfloat16 weights on CPUs with avx512_bf16: bf16rows.h's tiles with VDPBF16PS in place of
// widening each 16 weights (a shift and a mask) and fusing them in two FMAs. The tiles, their row and x layouts, the
// prefetches and the lane sums are bf16rows.h's; one instruction a step does what four did.
//
// The arithmetic, on these builds and every tile: x is rounded to bfloat16 once a call of rows_bf16 (a thread's share
// of a product; to nearest, ties to even, as the module path rounds its activations, but for values below float32's
// normal range, which VCVTNEPS2BF16 takes as zero). Each output keeps eight float32 chains; chain m, at each step of 16
// columns from i, fuses w[i + 2m + 1] * x[i + 2m + 1] and then w[i + 2m] * x[i + 2m] (one rounding each; inputs and
// results below float32's normal range flushed to zero: VDPBF16PS); the chains are added in order from zero
// (lane_sums8), then the last k % 16 columns' products (exact in float32) in order. A row's result does not depend
// on the batch or on the tile that computes it. Builds without avx512_bf16 keep bf16rows.h's arithmetic, whose bits
// differ from these by the rounding of x; tests/refs.py `bf16_dot_reference` emulates this one in torch.
#pragma once
#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define SHARDLM_BF16_DOT 1
#include <immintrin.h>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace shardlm {

constexpr bool BF16_DOT = true;

// x's b rows (k columns) rounded to bfloat16: the words at `words` (row j at words + j * k) and, at `floats` (same
// layout), the last k % 16 columns of each row as float32 (what the tails read), in buffers of the calling thread.
struct RoundedRows {
  const uint16_t* words;
  const float* floats;
};
inline RoundedRows rounded_rows(const float* x, int64_t b, int64_t k) {
  thread_local std::vector<uint16_t> words;
  thread_local std::vector<float> floats;
  const int64_t total = b * k;
  words.resize(static_cast<size_t>(total)), floats.resize(static_cast<size_t>(total));
  for (int64_t i = 0; i < total; i += 16) {
    const auto mask = static_cast<__mmask16>(total - i >= 16 ? 0xFFFF : (1u << (total - i)) - 1);
    const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x + i)));
    _mm256_mask_storeu_epi16(words.data() + i, mask, h);
  }
  for (int64_t j = 0; j < b; ++j)
    for (int64_t t = k - k % BF16_STEP; t < k; ++t) floats[j * k + t] = bf16_to_float(words[j * k + t]);
  return {words.data(), floats.data()};
}

// The rounded rows in pairs for tile_dot_pairs, in a buffer of the calling thread from a 64-byte boundary (a pair's
// step is one cache line): pair q's step at column i holds
// row 2q's 16 words, then row 2q + 1's, at out + q * 2 * kk + 2 * i (kk = k - k % 16); an odd last row follows the
// pairs, as it is, at out + (b / 2) * 2 * kk.
inline const uint16_t* word_pairs_of(const uint16_t* xw, int64_t b, int64_t k) {
  thread_local std::vector<uint16_t> store;
  const int64_t kk = k - k % BF16_STEP;
  store.resize(static_cast<size_t>(b * kk + 32));
  uint16_t* base = store.data() + ((64 - reinterpret_cast<uintptr_t>(store.data()) % 64) % 64) / sizeof(uint16_t);
  for (int64_t q = 0; q < b / 2; ++q)
    for (int64_t i = 0; i < kk; i += BF16_STEP) {
      uint16_t* to = base + q * 2 * kk + 2 * i;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                                              xw + 2 * q * k + i)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + 16), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                                                   xw + (2 * q + 1) * k + i)));
    }
  if (b % 2)
    for (int64_t i = 0; i < kk; ++i) base[(b / 2) * 2 * kk + i] = xw[(b - 1) * k + i];
  return base;
}

__attribute__((always_inline)) inline __m512bh words512(__m512i v) { return reinterpret_cast<__m512bh>(v); }
__attribute__((always_inline)) inline __m256bh words256(const uint16_t* p) {
  return reinterpret_cast<__m256bh>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// y[j, r] for R weight rows from r0 and J rows of x (their rounded words at xw, ldx apart; as floats at xf, k apart,
// for the tail), with eight-lane vectors.
template <int R, int J>
inline void tile_dot(const uint16_t* w, int64_t ldw, const uint16_t* xw, int64_t ldx, const float* xf, float* y,
                     int64_t n, int64_t k, int64_t r0, int64_t j0) {
  const int64_t kk = k - k % BF16_STEP;
  __m256 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < kk; i += BF16_STEP) {
    if (J > 1 && j0 == 0) prefetch_next_tile<uint16_t, R>(w, ldw, r0, i);
    __m256bh xv[J];
    for (int j = 0; j < J; ++j) xv[j] = words256(xw + j * ldx + i);
    for (int r = 0; r < R; ++r) {
      const __m256bh wv = words256(w + (r0 + r) * ldw + i);
      for (int j = 0; j < J; ++j) acc[r][j] = _mm256_dpbf16_ps(acc[r][j], wv, xv[j]);
    }
  }
  v8f chains[R * J];  // a copy: the accumulators' own address taken could keep them in memory through the loop
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) chains[r * J + j] = reinterpret_cast<v8f>(acc[r][j]);
  float sums[R * J];
  lane_sums8(chains, R * J, sums);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) {
      float s = sums[r * J + j];
      for (int64_t t = kk; t < k; ++t) s += load<uint16_t>(w, (r0 + r) * ldw + t) * xf[(j0 + j) * k + t];
      y[(j0 + j) * n + r0 + r] = s;
    }
}

// R weight rows from r0 against 2P rows of x from j0 (even), two rows of x a register (their word pairs at xp), each
// weight row's 16 words broadcast to both halves; pass `pass` of `passes` asks for its share of the next tile's
// columns (as tile_bf16_pairs).
template <int R, int P>
inline void tile_dot_pairs(const uint16_t* w, int64_t ldw, const uint16_t* xp, const float* xf, float* y, int64_t n,
                           int64_t k, int64_t r0, int64_t j0, int pass, int passes) {
  const int64_t kk = k - k % BF16_STEP;
  PassAhead<R> ahead(kk, pass, passes);
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  const uint16_t* xq = xp + (j0 / 2) * 2 * kk;
  for (int64_t i = 0; i < kk; i += BF16_STEP) {
    ahead.step(w, ldw, r0);
    __m512bh xv[P];
    for (int p = 0; p < P; ++p) xv[p] = words512(_mm512_loadu_si512(xq + p * 2 * kk + 2 * i));
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = words512(_mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          w + (r0 + r) * ldw + i))));
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], wv, xv[p]);
    }
  }
  finish_pairs<R, P>(acc, w, ldw, xf, y, n, k, r0, j0);
}

// Weight rows [lo, hi) of a bfloat16 weight (rows ldw apart) against the b rows of x: y[j, r] (y has n columns);
// the tile shapes of rows_bf16's AVX-512 branch.
inline void rows_bf16_dot(const uint16_t* w, const float* x, float* y, int64_t n, int64_t k, int64_t b, int64_t lo,
                          int64_t hi, int64_t ldw) {
  const int64_t kk = k - k % BF16_STEP;
  const RoundedRows xr = rounded_rows(x, b, k);
  int64_t r = lo;
  if (b == 1) {  // the rows one after another, as rows.h's float32 rows at batch 1 (a batch-1 bfloat16 step took
                 // 0.725x the time of row pairs of eight side by side on a Zen 4 host; RESULTS.md stop 54)
    for (; r < hi; ++r) tile_dot<1, 1>(w, ldw, xr.words, k, xr.floats, y, n, k, r, 0);
    return;
  }
  const uint16_t* xp = word_pairs_of(xr.words, b, k);
  const int passes = static_cast<int>(b / 8 + (b % 8 >= 4) + (b % 4 >= 2));
  auto against_all = [&](auto rows_tag, int64_t r0) {
    constexpr int R = decltype(rows_tag)::value;
    int64_t j = 0;
    int pass = 0;
    for (; j + 8 <= b; j += 8) tile_dot_pairs<R, 4>(w, ldw, xp, xr.floats, y, n, k, r0, j, pass++, passes);
    if (j + 4 <= b) tile_dot_pairs<R, 2>(w, ldw, xp, xr.floats, y, n, k, r0, j, pass++, passes), j += 4;
    if (j + 2 <= b) tile_dot_pairs<R, 1>(w, ldw, xp, xr.floats, y, n, k, r0, j, pass++, passes), j += 2;
    if (j < b) tile_dot<R, 1>(w, ldw, xp + (b / 2) * 2 * kk, kk, xr.floats, y, n, k, r0, j);
  };
  for (; r + 4 <= hi; r += 4) against_all(std::integral_constant<int, 4>{}, r);
  for (; r < hi; ++r) against_all(std::integral_constant<int, 1>{}, r);
}

}  // namespace shardlm
#else
namespace shardlm {
constexpr bool BF16_DOT = false;
}  // namespace shardlm
#endif
