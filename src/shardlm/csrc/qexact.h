// The `exact` sums of int8 weights (the o and down projections, whose rows tensor parallelism splits; see the top
// of qrows.h): each block's int32 sum of products, times the block's activation scale in float, added in double.
//
// Interleaved codes. Finishing a block's sum had taken a horizontal reduction of its lanes (lane_sums: a transpose,
// about 45 shuffles and adds for sixteen blocks), and the exact products ran at 0.6x the float-summed ones' rate
// from the caches. A rank therefore keeps such a weight's codes interleaved (`interleave_codes`): in each group of
// IGROUP columns (sixteen blocks of 32) from column 0, the codes of column pair i of block l sit at pair position
// 16 i + l (a 16 x 16 transpose of two-byte pairs), and the activation codes are interleaved alike after they are
// quantized (`interleave_rows`). Then the 32 codes at bytes [32 i, 32 i + 32) of a group hold pair i of all sixteen
// blocks, so the integer multiply-adds of the group's sixteen loads add up, lane l, to block l's sum: no reduction
// left, the same integers, and the same terms added in the same order as the natural layout's, bit for bit. A row's
// tail (the blocks past its last whole group) is interleaved alike in groups of 8, 4 and 2 blocks (chunks of 2, 4
// and 8 pairs, transpose_groups), so its block sums too take a few shuffles where one horizontal sum a block took
// more (a last odd block stays). Scratch C++ benchmark of 2 threads over a 2.4 MB weight from
// the caches (2026-11-29): interleaved 102 GB/s, natural 62 GB/s, the float-summed rows 75 GB/s.
// Included by qrows.h after the blocks, dot products and QuantRows it uses.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace shardlm {

// In a row of `units` units (of `unit` values each; a pair of columns a unit, units a multiple of 16), each group of
// m blocks (igroup_of: whole groups of 16, then 8, 4 and 2 in the tail) turned into the interleaved order: its
// m x m chunks of 16 / m units transposed, in place and its own inverse. Codes take units of a pair
// (interleave_codes), widened prefill panels units of a pair's QPANEL words (qpanel_parts.h's deinterleave_panel).
template <typename T>
inline void transpose_groups(T* v, int64_t units, int64_t unit) {
  constexpr int64_t side = IGROUP_BLOCKS;  // units a block holds (its 16 pairs)
  const int64_t blocks = units / side;
  int64_t first, m;
  for (int64_t blk = 0; blk < blocks; blk = first + m) {
    igroup_of(blk, blocks, first, m);
    const int64_t chunk = side / m, at = first * side;  // units a chunk holds; the group's first unit
    for (int64_t l = 0; l < m; ++l)
      for (int64_t t = l + 1; t < m; ++t)  // chunk t of block l <-> chunk l of block t
        std::swap_ranges(v + (at + (l * m + t) * chunk) * unit, v + (at + (l * m + t + 1) * chunk) * unit,
                         v + (at + (t * m + l) * chunk) * unit);
  }
}

// Each row of rows x kp codes (one or two bytes each) from the natural order to the interleaved one, or back.
template <typename C>
inline void interleave_codes(C* v, int64_t rows, int64_t kp) {
  for (int64_t r = 0; r < rows; ++r) transpose_groups(v + r * kp, kp / 2, 2);
}

// x's activation codes interleaved for a weight whose codes are (decode.h's quantize_for).
inline void interleave_rows(QuantRows& x, int64_t b) {
  interleave_codes(x.codes.data(), b, x.kp);
  x.interleaved = true;
}

#if defined(SHARDLM_Q8_WIDE)
// Lane i of the result = the sum of v[i]'s sixteen int32 lanes (integer adds, exact in any order): a transpose
// and add in four rounds, 45 instructions for sixteen blocks where one horizontal sum a block takes more.
__attribute__((always_inline)) inline __m512i lane_sums(const __m512i* v) {
  __m512i t[8], u[4];
  for (int i = 0; i < 8; ++i)  // each 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of a = v[2i], b = v[2i+1]
    t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // each 128-bit lane: that lane's sums of v[4i], ..., v[4i+3]
    u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                            _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
  // the four 128-bit lanes added: lanes (0, 2) and (1, 3) of two vectors at a time
  const __m512i w0 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x88), _mm512_shuffle_i32x4(u[0], u[1], 0xDD));
  const __m512i w1 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], 0x88), _mm512_shuffle_i32x4(u[2], u[3], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(w0, w1, 0x88), _mm512_shuffle_i32x4(w0, w1, 0xDD));
}
constexpr int EXACT_GROUP = 16;  // blocks whose integer sums one lane_sums call finishes
inline int32_t lane_sum(__m512i v) { return _mm512_reduce_add_epi32(v); }
// acc[0], acc[1] += v's lanes 0-7, 8-15 as doubles.
inline void add_as_doubles(__m512d* acc, __m512 v) {
  acc[0] = _mm512_add_pd(acc[0], _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
  acc[1] = _mm512_add_pd(acc[1], _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
}
// Block terms float(sums) * scales added into a pair's double lanes.
inline void add_terms(__m512d* acc, __m512i sums, const float* scales) {
  add_as_doubles(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_loadu_ps(scales)));
}
inline double lanes_total(const __m512d* acc) { return _mm512_reduce_add_pd(_mm512_add_pd(acc[0], acc[1])); }
using ExactLanes = __m512d;
using BlockSums = __m512i;
#elif defined(__AVX2__)
// Lane i of the result = the sum of v[i]'s eight int32 lanes (integer adds, exact in any order).
__attribute__((always_inline)) inline __m256i lane_sums(const __m256i* v) {
  const __m256i h0 = _mm256_hadd_epi32(v[0], v[1]), h1 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i h2 = _mm256_hadd_epi32(v[4], v[5]), h3 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i s0 = _mm256_hadd_epi32(h0, h1), s1 = _mm256_hadd_epi32(h2, h3);  // [v0..v3 | v0..v3] half sums
  return _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31));
}
constexpr int EXACT_GROUP = 8;
inline int32_t lane_sum(__m256i v) {
  const __m128i q = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i p = _mm_add_epi32(q, _mm_unpackhi_epi64(q, q));
  return _mm_cvtsi128_si32(_mm_add_epi32(p, _mm_shuffle_epi32(p, 1)));
}
// acc[0], acc[1] += v's lanes 0-3, 4-7 as doubles.
inline void add_as_doubles(__m256d* acc, __m256 v) {
  acc[0] = _mm256_add_pd(acc[0], _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
  acc[1] = _mm256_add_pd(acc[1], _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}
inline void add_terms(__m256d* acc, __m256i sums, const float* scales) {
  add_as_doubles(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_loadu_ps(scales)));
}
inline double lanes_total(const __m256d* acc) {
  alignas(32) double l[4];
  _mm256_store_pd(l, _mm256_add_pd(acc[0], acc[1]));
  return (l[0] + l[1]) + (l[2] + l[3]);
}
using ExactLanes = __m256d;
using BlockSums = __m256i;
#endif

#if defined(SHARDLM_Q8_WIDE)
// An interleaved group's sixteen block sums, lane l = block l: the group's sixteen 32-code loads (or a tail group's
// `loads`) multiply-added with the activation codes in two chains (integer adds: exact in any order). `ahead` (or
// null): asked for a line a step.
__attribute__((always_inline)) inline __m512i interleaved_sums(const int8_t* w, const int16_t* x, const int8_t* ahead,
                                                               int64_t loads = IGROUP_BLOCKS) {
  __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
  auto add_pair = [&](__m512i& acc, int64_t i) {
    const __m512i wv = widen_int8_32(w + i * QBLOCK).v, xv = _mm512_loadu_si512(x + i * QBLOCK);
#if defined(__AVX512VNNI__)
    acc = _mm512_dpwssd_epi32(acc, wv, xv);
#else
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(wv, xv));
#endif
  };
  for (int64_t i = 0; i < loads; i += 2) {  // loads: 16, or a tail group's 8, 4 or 2
    if (ahead != nullptr) stream_prefetch(ahead + i * QBLOCK);
    add_pair(even, i);
    add_pair(odd, i + 1);
  }
  return _mm512_add_epi32(even, odd);
}
// The block sums of an interleaved tail group of m blocks (8, 4 or 2) into sums[0 .. m): its m loads multiply-added
// lane by lane (lane k then holds pairs of block k / c, c = 16 / m), then each run of c lanes added across.
template <int M>
__attribute__((always_inline)) inline void tail_sums(const int8_t* w, const int16_t* x, const int8_t* ahead,
                                                     int32_t* sums) {
  __m512i v = interleaved_sums(w, x, ahead, M);
  constexpr int64_t chunk = IGROUP_BLOCKS / M;
  v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_CDAB));  // runs of 2
  if constexpr (chunk >= 4) v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_BADC));  // of 4
  if constexpr (chunk >= 8) v = _mm512_add_epi32(v, _mm512_shuffle_i32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));  // of 8
  alignas(64) int32_t lanes[16];
  _mm512_store_si512(lanes, v);
  for (int64_t l = 0; l < M; ++l) sums[l] = lanes[l * chunk];
}
// The group's terms into acc: one add_terms of the sixteen sums, as the natural layout's lane_sums gives them.
__attribute__((always_inline)) inline void add_interleaved(ExactLanes* acc, const int8_t* w, const int16_t* x,
                                                           const float* ds, const int8_t* ahead) {
  add_terms(acc, interleaved_sums(w, x, ahead), ds);
}
#elif defined(__AVX2__)
// With AVX2 the same group in two halves: a load's first sixteen codes are pair i of blocks 0-7, the rest of blocks
// 8-15; their terms go in as two groups of EXACT_GROUP (8), as the natural layout's do.
// The first `loads` 32-code loads of an interleaved group multiply-added lane by lane: their first sixteen codes'
// pair sums into low, the rest into high.
__attribute__((always_inline)) inline void half_sums(const int8_t* w, const int16_t* x, int64_t loads,
                                                     const int8_t* ahead, __m256i& low, __m256i& high) {
  low = high = _mm256_setzero_si256();
  for (int64_t i = 0; i < loads; ++i) {
    if (ahead != nullptr && i % 2 == 0) stream_prefetch(ahead + i * QBLOCK);
    const Codes16 wv = widen_int8(w + i * QBLOCK);
    const __m256i* xv = reinterpret_cast<const __m256i*>(x + i * QBLOCK);
    low = _mm256_add_epi32(low, _mm256_madd_epi16(wv.lo, _mm256_loadu_si256(xv)));
    high = _mm256_add_epi32(high, _mm256_madd_epi16(wv.hi, _mm256_loadu_si256(xv + 1)));
  }
}
__attribute__((always_inline)) inline void add_interleaved(ExactLanes* acc, const int8_t* w, const int16_t* x,
                                                           const float* ds, const int8_t* ahead) {
  __m256i low, high;
  half_sums(w, x, IGROUP_BLOCKS, ahead, low, high);
  add_terms(acc, low, ds);
  add_terms(acc, high, ds + EXACT_GROUP);
}
// The block sums of an interleaved tail group of m blocks (8, 4 or 2) into sums[0 .. m), as the AVX-512 form: lane k
// of a load's sixteen pair sums (low half, then high) holds pairs of block k / c, c = 16 / m.
template <int M>
__attribute__((always_inline)) inline void tail_sums(const int8_t* w, const int16_t* x, const int8_t* ahead,
                                                     int32_t* sums) {
  __m256i low, high;
  half_sums(w, x, M, ahead, low, high);
  // pair sums of lanes (2i, 2i + 1): [low 0-1, 2-3, high 0-1, 2-3 | low 4-5, 6-7, high 4-5, 6-7]
  const __m256i two = _mm256_hadd_epi32(low, high);
  if constexpr (M == 8) {  // lane k's block is k / 2: blocks 0, 1, 4, 5 | 2, 3, 6, 7, put in order
    const __m256i order = _mm256_permutevar8x32_epi32(two, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums), order);
    return;
  }
  alignas(32) int32_t four[8];  // sums of lanes 4i .. 4i + 3: [low 0-3, high 0-3, ., . | low 4-7, high 4-7, ., .]
  _mm256_store_si256(reinterpret_cast<__m256i*>(four), _mm256_hadd_epi32(two, two));
  if constexpr (M == 4) {  // block k / 4
    sums[0] = four[0], sums[1] = four[4], sums[2] = four[1], sums[3] = four[5];
  } else {  // M == 2: block k / 8, low then high
    sums[0] = four[0] + four[4], sums[1] = four[1] + four[5];
  }
}
#endif

#if defined(SHARDLM_Q8_WIDE) || defined(__AVX2__)
// An interleaved tail group of M blocks from block blk, where that many are left: its terms added to s one at a time
// in block order, blk moved past it.
template <int M>
__attribute__((always_inline)) inline void add_tail(const int8_t* w, const int16_t* xc, const float* ds, int64_t blocks,
                                                    const int8_t* ahead, int64_t& blk, double& s) {
  if (blocks - blk < M) return;
  int32_t sums[M];
  tail_sums<M>(w + blk * QBLOCK, xc + blk * QBLOCK, ahead != nullptr ? ahead + blk * QBLOCK : nullptr, sums);
  for (int l = 0; l < M; ++l) s += static_cast<double>(static_cast<float>(sums[l]) * ds[blk + l]);
  blk += M;
}

// One (weight row, activation row) pair of an `exact` weight: dot_q8_scalar's block terms, float(the block's int32
// sum) * its scale, added in double; EXACT_GROUP blocks' integer sums finished together, or with interleaved codes
// (x.interleaved) a whole group's at once. `ahead` (or null): w's bytes EXACT_AHEAD on (the weight's rows lie one
// after another, so one address stream), asked for a cache line at a time.
__attribute__((always_inline)) inline double exact_pair(const int8_t* w, const QuantRows& x, int64_t j,
                                                        const int8_t* ahead) {
  const int16_t* xc = x.codes.data() + j * x.kp;
  const float* ds = x.scales.data() + j * x.blocks;
  ExactLanes acc[2] = {};
  int64_t blk = 0;
  if (x.interleaved)
    for (; blk + IGROUP_BLOCKS <= x.blocks; blk += IGROUP_BLOCKS)
      add_interleaved(acc, w + blk * QBLOCK, xc + blk * QBLOCK, ds + blk,
                      ahead != nullptr ? ahead + blk * QBLOCK : nullptr);
  for (; !x.interleaved && blk + EXACT_GROUP <= x.blocks; blk += EXACT_GROUP) {
    BlockSums v[EXACT_GROUP];
    for (int i = 0; i < EXACT_GROUP; ++i) {
      if (ahead != nullptr && i % 2 == 0)
        stream_prefetch(ahead + (blk + i) * QBLOCK);
      v[i] = dot_block(widen_block(w + (blk + i) * QBLOCK), xc + (blk + i) * QBLOCK);
    }
    add_terms(acc, lane_sums(v), ds + blk);
  }
  // With AVX2 (EXACT_GROUP 8) a tail of 8 or more natural blocks went through the loop above, its terms into acc;
  // an interleaved tail group of 8 gives the same sums into the same lanes.
  if constexpr (EXACT_GROUP == 8) {
    if (x.interleaved && x.blocks - blk >= 8) {
      int32_t sums[8];
      tail_sums<8>(w + blk * QBLOCK, xc + blk * QBLOCK, ahead != nullptr ? ahead + blk * QBLOCK : nullptr, sums);
      BlockSums v;
      std::memcpy(&v, sums, sizeof(v));
      add_terms(acc, v, ds + blk);
      blk += 8;
    }
  }
  double s = lanes_total(acc);
  // The rest one term a block, in order: an interleaved tail's groups of 8, 4 and 2 get their blocks' sums together
  // (tail_sums), where the natural codes take a horizontal sum a block.
  if (x.interleaved) {
    add_tail<8>(w, xc, ds, x.blocks, ahead, blk, s);
    add_tail<4>(w, xc, ds, x.blocks, ahead, blk, s);
    add_tail<2>(w, xc, ds, x.blocks, ahead, blk, s);
  }
  for (; blk < x.blocks; ++blk) {
    if (ahead != nullptr && blk % 2 == 0)
      stream_prefetch(ahead + blk * QBLOCK);
    const int32_t isum = lane_sum(dot_block(widen_block(w + blk * QBLOCK), xc + blk * QBLOCK));
    s += static_cast<double>(static_cast<float>(isum) * ds[blk]);
  }
  return s;
}
#else
inline double exact_pair(const int8_t* w, const QuantRows& x, int64_t j, const int8_t*) {
  return dot_q8_scalar(w, x, j);
}
#endif

// Rows [lo, hi) of an `exact` weight against every activation row (see the top of this file): a pair at a time,
// the first activation row's pass asking for the bytes EXACT_AHEAD on (where it had asked for the row PREFETCH_ROWS
// on, every product summed exact at batch 1 took 1.04-1.07x the time from memory: bench/products_vs_commit.py
// --exact, RESULTS.md stop 53). 12 KB, not row_sums' STREAM_AHEAD: in a fused int8 step, where the VM read 60-66
// GB/s, the down products took 0.69-0.74 ms a token at 4 KB (36-39 GB/s), 0.66-0.68 at 8 KB and 0.61-0.67 at 12 KB
// (40-44 GB/s), level at 35 GB/s (bench/step_phases.py, RESULTS.md stop 60).
#if defined(__AVX2__)
constexpr int64_t EXACT_AHEAD = 3 * STREAM_AHEAD;
#endif
template <typename T>
inline void exact_rows(const int8_t* w, int64_t ldw, const float* scale, const QuantRows& x, T* y, int64_t n,
                       int64_t b, int64_t lo, int64_t hi) {
  for (int64_t r = lo; r < hi; ++r)
    for (int64_t j = 0; j < b; ++j) {
#if defined(__AVX2__)
      const int8_t* ahead = j == 0 ? w + r * ldw + EXACT_AHEAD : nullptr;
#else
      const int8_t* ahead = nullptr;
#endif
      y[j * n + r] = static_cast<T>(static_cast<double>(scale[r]) * exact_pair(w + r * ldw, x, j, ahead));
    }
}


}  // namespace shardlm
