// Integer dot products for int8 weights (int4 ones: q4tiles.h, on the same activation codes): the activation rows
// are quantized once per call to int16 in blocks of 32 (one float scale per block, max |x| / 32767), and each
// weight row's codes, widened to int16, meet them 32 at a time in the CPU's integer units (AVX2 _mm256_madd_epi16:
// 16 products a vector, adjacent pairs summed to int32), so a code is never converted to float. int16 rather than
// int8 activations (llama.cpp's Q8_0 choice): int8 ones cost the bundled model 2.3 % more perplexity than bfloat16
// ones (measured), int16 ones are finer than bfloat16. Each block's int32 sums are scaled by the block's activation scale in float32; the
// row's weight scale multiplies the finished sum. Every (weight row, activation row) pair keeps its own
// accumulators and order, so a row's result does not depend on the batch around it. Weights whose rows tensor
// parallelism splits (o and down projections; `exact`) take one term a block: the block's 32 products summed in
// int32 (exact), times the block's activation scale in float, added in double (`exact_rows`, qexact.h). A block's
// term is the same on every layout and every build (vector or scalar), and double sums in any order round to the same
// float (but for a chance of about 2^-29 per value), so a row-parallel rank's partial sums, all-reduced in
// double, give the one-rank result, and quantized tokens do not depend on the tensor-parallel degree. The others
// keep float lane accumulators (one rank always adds a whole row in the same order): on 256-bit builds one chain of
// eight lanes, one multiply-add a block; on 512-bit builds two chains of sixteen, one multiply-add a pair of blocks
// (qpairs.h), added at the end (qtile). Both hold the blocks' column quads, scaled in different orders, so the two
// kinds of build round the float-summed products differently (each batch-invariant; the `exact` ones alike).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "rows.h"

namespace shardlm {

constexpr int64_t QBLOCK = 32;

// LineAligned (the allocator from cache lines) is in rows.h.

// b rows of activations as int16 codes in blocks of QBLOCK: codes (b, kp) with zeros past k, scales (b, kp / 32).
struct QuantRows {
  std::vector<int16_t, LineAligned<int16_t>> codes;
  std::vector<float> scales;
  std::vector<float> sums;  // (b, kp / 32): scale * the block's sum of codes (the int4 zero-point term)
  // (b, kp) each code's high byte (code >> 8, signed) and low byte (code & 255): the int4 tiles' byte dot products
  // (q4tiles.h) take a code as 256 * high + low. Filled by split_bytes, only for int4 weights.
  std::vector<int8_t> high;
  std::vector<uint8_t> low;
  int64_t kp = 0, blocks = 0;
  bool interleaved = false;  // codes in qexact.h's interleaved order (for an exact weight whose codes are)
  // codes in pairs of blocks (qpairs.h's pair_rows: the float-summed rows of a 512-bit build), with each row's chunk
  // scale vectors (b, chunks, 16)
  bool paired = false;
  std::vector<float, LineAligned<float>> pair_scales;
};

// x's codes as their two bytes (QuantRows::high and low), for the int4 tiles.
inline void split_bytes(QuantRows& x) {
  const size_t n = x.codes.size();
  x.high.resize(n);
  x.low.resize(n);
  size_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (; i + 32 <= n; i += 32) {  // vpmovwb keeps each int16's low byte
    const __m512i v = _mm512_loadu_si512(x.codes.data() + i);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x.high.data() + i), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x.low.data() + i), _mm512_cvtepi16_epi8(v));
  }
#endif
  for (; i < n; ++i) {
    x.high[i] = static_cast<int8_t>(x.codes[i] >> 8);
    x.low[i] = static_cast<uint8_t>(x.codes[i] & 255);
  }
}

constexpr int64_t IGROUP_BLOCKS = 16;              // blocks an interleaved group holds (qexact.h)
constexpr int64_t IGROUP = IGROUP_BLOCKS * QBLOCK;  // its columns: 512

// The interleaved group of m blocks (16, or 8, 4 or 2 in a row's tail) that block blk of a row of `blocks` starts at:
// whole groups of 16 from block 0, then the tail's blocks (blocks % 16) in groups of 8, 4 and 2 where its count has
// that bit, a last odd block alone (m = 1). Sets first and m.
inline void igroup_of(int64_t blk, int64_t blocks, int64_t& first, int64_t& m) {
  first = blk / IGROUP_BLOCKS * IGROUP_BLOCKS;
  m = IGROUP_BLOCKS;
  if (first + IGROUP_BLOCKS <= blocks) return;
  for (m = IGROUP_BLOCKS / 2; m >= 1; m /= 2) {
    if ((blocks - first) < m) continue;
    if (blk < first + m) return;
    first += m;
  }
}

// The position of column c in a row of kp interleaved codes (kp a multiple of QBLOCK; qexact.h): in a group of m
// blocks, chunk t (pairs t c .. t c + c - 1, c = 16 / m) of block l sits at chunk t m + l (an m x m transpose of
// chunks; with m = 16, pair i of block l at pair 16 i + l). The map is its own inverse.
inline int64_t interleaved_column(int64_t c, int64_t kp) {
  int64_t first, m;
  igroup_of(c / QBLOCK, kp / QBLOCK, first, m);
  const int64_t chunk = IGROUP_BLOCKS / m, l = c / QBLOCK - first, pair = (c % QBLOCK) / 2;
  const int64_t t = pair / chunk, j = pair % chunk;
  return first * QBLOCK + 2 * (IGROUP_BLOCKS * t + chunk * l + j) + c % 2;
}

// The position of column c in a row of kp paired codes (kp a multiple of QBLOCK; qpairs.h): in each whole pair of
// blocks, half h (16 columns) of block l sits at half 2 h + l. The map is its own inverse.
inline int64_t paired_column(int64_t c, int64_t kp) {
  const int64_t base = c / (2 * QBLOCK) * (2 * QBLOCK), i = c - base;
  if (base + 2 * QBLOCK > kp) return c;  // an odd last block
  return base + (i % QBLOCK) / 16 * QBLOCK + i / QBLOCK * 16 + i % 16;
}

// 32767 / amax, the factor that turns a block's values into codes; 0 for a block of zeros, and for one whose max is
// so small (below about 1e-34) that the factor would overflow to infinity (its codes are then 0, not undefined casts).
inline float code_factor(float amax) {
  const float inv = 32767.f / amax;
  return amax > 0.f && inv <= std::numeric_limits<float>::max() ? inv : 0.f;
}

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
  const __m512 inv = _mm512_set1_ps(code_factor(amax));
  const __m512i clo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), chi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), _mm512_cvtepi32_epi16(clo));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 16), _mm512_cvtepi32_epi16(chi));
  scale = d;
  sum = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(clo, chi)));
  return true;
}
#endif

// One row of k floats quantized in blocks of QBLOCK: per block, scale = max |x| / 32767, code = round(x / scale);
// codes[kp] with zeros past k, scales and sums[kp / 32] (sums: scale * the block's sum of codes).
inline void quantize_row(const float* x, int64_t k, int64_t kp, int16_t* codes, float* scales, float* sums) {
  std::fill(codes + std::min(k, kp), codes + kp, int16_t{0});
  for (int64_t blk = 0; blk < kp / QBLOCK; ++blk) {
    const int64_t a = blk * QBLOCK, e = std::min(k, a + QBLOCK);
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (e - a == QBLOCK && quantize_block32(x + a, codes + a, scales[blk], sums[blk])) continue;
#endif
    float amax = 0.f;
    bool finite = true;
    for (int64_t i = a; i < e; ++i) {
      amax = std::max(amax, std::fabs(x[i]));
      finite = finite && std::isfinite(x[i]);
    }
    // a NaN or infinite input: codes 0 and a NaN scale carry it into the result (no undefined int16 cast)
    const float d = finite ? amax / 32767.f : std::numeric_limits<float>::quiet_NaN();
    const float inv = finite ? code_factor(amax) : 0.f;
    scales[blk] = d;
    int32_t total = 0;
    for (int64_t i = a; i < e; ++i) {
      const int16_t c = finite ? static_cast<int16_t>(std::nearbyint(x[i] * inv)) : 0;
      codes[i] = c;
      total += c;
    }
    sums[blk] = d * static_cast<float>(total);
  }
}

// out sized for b rows of kp columns (every element is written by quantize_range).
inline void size_rows(QuantRows& out, int64_t b, int64_t kp) {
  out.kp = kp;
  out.blocks = kp / QBLOCK;
  out.interleaved = out.paired = false;
  out.codes.resize(b * kp);
  out.scales.resize(b * out.blocks);
  out.sums.resize(b * out.blocks);
}

// Rows [lo, hi) of x (k floats a row) quantized into out (sized by size_rows), each row's k columns placed at
// [pad_left, pad_left + k) of out.kp, zeros around them (an int4 slice whose columns start inside a group).
inline void quantize_range(const float* x, int64_t lo, int64_t hi, int64_t k, int64_t pad_left, QuantRows& out) {
  const int64_t kp = out.kp;
  std::vector<float> padded(pad_left > 0 ? kp : 0, 0.f);  // a row's columns moved right by pad_left
  for (int64_t j = lo; j < hi; ++j) {
    const float* row = x + j * k;
    if (pad_left > 0) row = padded.data(), std::copy(x + j * k, x + (j + 1) * k, padded.begin() + pad_left);
    quantize_row(row, pad_left > 0 ? kp : k, kp, out.codes.data() + j * kp, out.scales.data() + j * out.blocks,
                 out.sums.data() + j * out.blocks);
  }
}

// Quantize b rows of k floats (row stride k) into out: (b, kp) codes, (b, kp / 32) scales and sums.
inline void quantize_rows(const float* x, int64_t b, int64_t k, int64_t kp, QuantRows& out) {
  size_rows(out, b, kp);
  quantize_range(x, 0, b, k, 0, out);
}

#if defined(__AVX2__)
// The quantized tiles with weight rows side by side ask for the rows PREFETCH_ROWS ahead of the ones they multiply:
// with codes a quarter or an eighth of float32's bytes per multiply, the hardware prefetcher alone left the loop
// waiting on memory (int8 1536 x 576 from DRAM: 82 us without, 45 us with 16 rows ahead; 8, 32 and 64 were no better).
constexpr int64_t PREFETCH_ROWS = 16;
// An int8 tile of one activation row on a 512-bit build walks its weight rows one after another (row_sums) and asks
// for the line STREAM_AHEAD bytes past the one it reads (stream_prefetch); so do the exact rows (qexact.h) on every
// vector build, EXACT_AHEAD (12 KB) past. Into L2 (prefetcht1) on AMD: on a Zen 4 host the L1 hint (prefetcht0) 4 KB
// ahead had held such a stream near 30 GB/s on two threads, no faster than no hint, where the L2 hint ran 1.15-1.45x
// faster over 138-276 MB of int8 rows from memory (scratch C++, 2026-11-29), and a batch-1 int8 decode step took
// 0.81-0.91x the time in-process (four A/B runs, RESULTS.md stop 55). Into L1 on Intel builds (SHARDLM_L1_AHEAD, as
// rows.h's float rows): on the Ice Lake host a batch-1 int8 step took 0.95-0.96x the L2 hint's time (in-process A/B,
// stop 67). The int4 tiles (q4tiles.h) keep their L1 hint: with the L2 one a batch-1 step took 0.89-1.04x the time,
// no clear change. A hint never faults, so it may pass the weight's end. (STREAM_AHEAD and stream_prefetch: rows.h.)

// A block of 32 weight codes as two vectors of 16 int16 (columns 0-15 and 16-31).
struct Codes16 {
  __m256i lo, hi;
};

inline Codes16 widen_int8(const int8_t* w) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1))};
}
// A block whose columns 0-15 and 16-31 lie apart (paired weights, qpairs.h).
inline Codes16 widen_halves(const int8_t* lo, const int8_t* hi) {
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))),
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)))};
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

// One pair without vector units: the same blocks, the same scaling, scalar (interleaved codes read where each of
// a block's columns sits; `paired_w`: the weight's codes in the paired order, x's natural).
inline double dot_q8_scalar(const int8_t* w, const QuantRows& x, int64_t j, bool paired_w = false) {
  double s = 0.0;
  const int16_t* xc = x.codes.data() + j * x.kp;
  for (int64_t blk = 0; blk < x.blocks; ++blk) {
    int32_t acc = 0;
    for (int64_t c = blk * QBLOCK; c < (blk + 1) * QBLOCK; ++c) {
      const int64_t at = x.interleaved ? interleaved_column(c, x.kp) : c;
      acc += static_cast<int32_t>(w[paired_w ? paired_column(c, x.kp) : at]) * xc[at];
    }
    s += static_cast<double>(static_cast<float>(acc) * x.scales[j * x.blocks + blk]);
  }
  return s;
}

#if defined(__AVX2__)
// A (weight row, activation row) pair's running sum over blocks, for weights no rank splits: each block's eight
// int32 lanes times the block's scale, added in eight float lanes (one FMA a block).
struct FloatSums {
  using Lane = __m256;
  static constexpr int kLanes = 1;  // vectors a pair holds
  static void zero(Lane* a) { a[0] = _mm256_setzero_ps(); }
  static void add(Lane& a, __m256i isum, __m256 scale) { a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, a); }
  static Lane total(const Lane* a) { return a[0]; }
};
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// With AVX-512 a block of 32 codes is one vector of 32 int16 and meets the activation block in one multiply-add
// (16 int32 lanes, adjacent pairs summed): four instructions a (row, block) where the 256-bit form takes seven.
// The exact sums (qexact.h) take these; the float-summed rows take a pair of blocks at a time (qpairs.h).
struct Codes32 {
  __m512i v;
};
inline Codes32 widen_int8_32(const int8_t* w) {
  return {_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)))};
}
inline __m512i block_dot32(const Codes32& w, const int16_t* x) {
  return _mm512_madd_epi16(w.v, _mm512_loadu_si512(x));
}
#define SHARDLM_Q8_WIDE 1
#endif

}  // namespace shardlm

#include "qpairs.h"  // the float-summed rows of a 512-bit build, a pair of blocks at a time

namespace shardlm {

// A block's codes widened, its int32 lanes against an activation block, a scale in every lane: in 512-bit
// vectors with AVX-512, else 256-bit ones.
#if defined(SHARDLM_Q8_WIDE)
inline Codes32 widen_block(const int8_t* w) { return widen_int8_32(w); }
inline __m512i dot_block(const Codes32& w, const int16_t* x) { return block_dot32(w, x); }
inline __m512 broadcast_scale(float d) { return _mm512_set1_ps(d); }
#elif defined(__AVX2__)
inline Codes16 widen_block(const int8_t* w) { return widen_int8(w); }
inline __m256i dot_block(const Codes16& w, const int16_t* x) { return block_dot(w, x); }
inline __m256 broadcast_scale(float d) { return _mm256_set1_ps(d); }
#endif

#if defined(__AVX2__) && !defined(SHARDLM_Q8_WIDE)
using PairSums = FloatSums;

// One block (blk) of the R x J pairs into chain C, the R weight rows side by side: the block's codes widened once for
// the J activation rows, every row asking for its row PREFETCH_ROWS on.
// Weights in the paired order (qpairs.h) have the block's halves 32 bytes apart in its pair, 16 in an odd last block.
template <int R, int J, int C, bool PairedW>
__attribute__((always_inline)) inline void tile_block(const int8_t* w, int64_t ldw, const QuantRows& x, int64_t r0,
                                                      int64_t j0, int64_t blk,
                                                      PairSums::Lane (&acc)[R][J][PairSums::kLanes]) {
  decltype(broadcast_scale(0.f)) d[J];
  for (int j = 0; j < J; ++j) d[j] = broadcast_scale(x.scales[(j0 + j) * x.blocks + blk]);
  const bool in_pair = PairedW && blk / 2 * 2 + 1 < x.blocks;
  const int64_t at = in_pair ? blk / 2 * 2 * QBLOCK + blk % 2 * 16 : blk * QBLOCK, gap = in_pair ? 32 : 16;
  for (int r = 0; r < R; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (r0 + r + PREFETCH_ROWS) * ldw + at), _MM_HINT_T0);
    const int8_t* row = w + (r0 + r) * ldw;
    const auto wv = PairedW ? widen_halves(row + at, row + at + gap) : widen_block(row + at);
    for (int j = 0; j < J; ++j)
      PairSums::add(acc[r][j][C], dot_block(wv, x.codes.data() + (j0 + j) * x.kp + blk * QBLOCK), d[j]);
  }
}
// The R x J pairs' chains over every block: block blk goes to chain blk % kLanes.
template <int R, int J, bool PairedW>
__attribute__((always_inline)) inline void tile_sums(const int8_t* w, int64_t ldw, const QuantRows& x, int64_t r0,
                                                     int64_t j0, PairSums::Lane (&acc)[R][J][PairSums::kLanes]) {
  constexpr int odd = PairSums::kLanes - 1;  // the odd blocks' chain (with AVX2 the one chain)
  int64_t blk = 0;
  for (; blk + 2 <= x.blocks; blk += 2) {
    tile_block<R, J, 0, PairedW>(w, ldw, x, r0, j0, blk, acc);
    tile_block<R, J, odd, PairedW>(w, ldw, x, r0, j0, blk + 1, acc);
  }
  if (blk < x.blocks) tile_block<R, J, 0, PairedW>(w, ldw, x, r0, j0, blk, acc);
}

#endif

// y[j, r] = scale[r] * sum_k w[r, k] x[j, k] for R int8 weight rows from r0 and J activation rows from j0, summed
// in float lanes (weights no rank splits): per pair, block terms in float chains (a 512-bit build's two, a pair of
// blocks a term: qpairs.h; a 256-bit build's one, PairSums), the chains added, then the lanes in order (lane_sums8).
template <typename T, int R, int J, bool PairedW>
__attribute__((always_inline)) inline void qtile(const int8_t* w, int64_t ldw, const float* scale,
                                                 const QuantRows& x, T* y, int64_t n, int64_t r0, int64_t j0) {
#if defined(SHARDLM_Q8_WIDE) || defined(__AVX2__)
  float sums[R * J];  // (r, j): the lanes added in order from zero (lane_sums8, eight pairs at a time)
#endif
#if defined(SHARDLM_Q8_WIDE)
  __m512 acc[R][J][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j][0] = acc[r][j][1] = _mm512_setzero_ps();
  if constexpr (J == 1)
    pair_row_sums<R, PairedW>(w, ldw, x, r0, j0, acc);
  else
    pair_tile_sums<R, J, PairedW>(w, ldw, x, r0, j0, acc);
  v8f low[R * J], high[R * J];  // lanes 0-7 and 8-15
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) halves_of(_mm512_add_ps(acc[r][j][0], acc[r][j][1]), low[r * J + j], high[r * J + j]);
  float first[R * J];
  lane_sums8(low, R * J, first);
  lane_sums8(high, R * J, sums, first);
#elif defined(__AVX2__)
  using P = PairSums;
  typename P::Lane acc[R][J][P::kLanes];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) P::zero(acc[r][j]);
  tile_sums<R, J, PairedW>(w, ldw, x, r0, j0, acc);
  v8f lanes[R * J];  // a copy, as in bf16rows.h's tile_bf16: the accumulators' own address stays untaken
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) lanes[r * J + j] = reinterpret_cast<v8f>(P::total(acc[r][j]));
  lane_sums8(lanes, R * J, sums);
#endif
#if defined(SHARDLM_Q8_WIDE) || defined(__AVX2__)
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) y[(j0 + j) * n + r0 + r] = static_cast<T>(scale[r0 + r] * sums[r * J + j]);
#else
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j)
      y[(j0 + j) * n + r0 + r] =
          static_cast<T>(static_cast<double>(scale[r0 + r]) * dot_q8_scalar(w + (r0 + r) * ldw, x, j0 + j, PairedW));
#endif
}

}  // namespace shardlm

#include "qexact.h"  // the `exact` sums: after the blocks and dot products they use

namespace shardlm {

// (The tiles are forced inline into `tile_rows`: called through the Int8Tiles functor, GCC kept them
// out of line and batch-8 int8 ran 12 % slower, measured.)
// Every row in [lo, hi) against every activation row, in tiles `tile.run<R, J>(r0, j0)`: eight rows for one
// activation row, four by two for more.
template <typename Tile>
inline void tile_rows(const Tile& tile, int64_t b, int64_t lo, int64_t hi) {
  int64_t r = lo;
  if (b == 1)
    for (; r + 8 <= hi; r += 8) tile.template run<8, 1>(r, 0);
  for (; r + 4 <= hi; r += 4) {
    int64_t j = 0;
    for (; j + 2 <= b; j += 2) tile.template run<4, 2>(r, j);
    if (j < b) tile.template run<4, 1>(r, j);
  }
  for (; r < hi; ++r)
    for (int64_t j = 0; j < b; ++j) tile.template run<1, 1>(r, j);
}

template <typename T>
struct Int8Tiles {
  const int8_t* w;
  int64_t ldw;
  const float* scale;
  const QuantRows& x;
  T* y;
  int64_t n;
  bool paired;  // the weight's codes in the paired order (qpairs.h)
  template <int R, int J>
  void run(int64_t r0, int64_t j0) const {
    if (paired)
      qtile<T, R, J, true>(w, ldw, scale, x, y, n, r0, j0);
    else
      qtile<T, R, J, false>(w, ldw, scale, x, y, n, r0, j0);
  }
};

// x's activation codes in the order an int8 weight's sums read them: interleaved where its codes are (summed exact),
// paired for the float lanes of a 512-bit build (ready_for_float_rows), else natural.
inline void order_rows_for(QuantRows& x, int64_t b, bool interleaved, bool exact) {
  if (interleaved)
    interleave_rows(x, b);
  else if (!exact)
    ready_for_float_rows(x, b);
}

// Rows [lo, hi) of an int8 weight (rows ldw >= kp apart) against every quantized activation row; `exact`: one
// double term a block (see the top of this file); `paired`: the weight's codes in the paired order (qpairs.h; summed
// in float lanes only).
template <typename T>
inline void qrows(const int8_t* w, int64_t ldw, const float* scale, const QuantRows& x, T* y, int64_t n, int64_t b,
                  int64_t lo, int64_t hi, bool exact, bool paired = false) {
  if (float_rows_paired() ? exact == x.paired : x.paired)
    throw std::logic_error(exact ? "qrows: exact sums read natural or interleaved codes, got paired ones"
                                 : "qrows: the float-summed rows read paired codes (ready_for_float_rows)");
  if (exact && paired) throw std::logic_error("qrows: paired weight codes are summed in float lanes only");
  if (exact)
    exact_rows<T>(w, ldw, scale, x, y, n, b, lo, hi);
  else
    tile_rows(Int8Tiles<T>{w, ldw, scale, x, y, n, paired}, b, lo, hi);
}

}  // namespace shardlm
