// The float-summed int8 rows (weights no rank splits: q, k, v, gate, up, an untied or quantized head) on 512-bit
// builds, a pair of blocks at a time. A chunk of 64 columns (blocks A = 2l and B = 2l + 1) meets the activation codes
// in one multiply-add and one dot product: the codes are held as [A 0-15, B 0-15, A 16-31, B 16-31] (pair_rows, once
// a call) and the weight's 64 codes are widened into that order, so lanes 0-7 of the int32 result hold block A's
// column quads (columns 2i, 2i + 1, 16 + 2i, 17 + 2i: the 256-bit builds' lanes) and lanes 8-15 block B's. One
// conversion and one FMA by the chunk's scale vector [A's activation scale x 8, B's x 8] (pair_scales) then add both
// blocks to a float chain, where a block at a time had taken two of each. Chunk l goes to chain l % 2; the chains are
// added at the end, then the sixteen lanes in order from zero (qtile). An odd last block is a chunk alone: its quads
// in lanes 0-7, zeros times a zero scale in lanes 8-15. Each (weight row, activation row) pair's terms are the same in
// any tile or batch, so a row's result does not depend on the batch around it.
// A CPU rank holds these weights' codes paired (shardlm.quant Int8Weight.pair); codes in their natural order (layers
// streamed from disk, direct calls) have each chunk's two 32-byte halves exchanged in registers, one shuffle a vector,
// and give the same bits. Scratch C++ of 2 threads over one layer's 576-column int8 rows from L2 (2026-11-29): a block
// at a time 79-80 GB/s, chunks of paired codes 100, of natural ones 85. In-process (bench/step_vs_commit.py against
// 2b639fe, RESULTS.md stop 59): int8 decode steps 0.90-0.92x the time at batch 1 when the VM read 34-36 GB/s (level
// at 23-31), 0.81-0.87x at 4 rows and 0.77-0.85x at 8; prefill level.
// Included by qrows.h after the blocks, dot products and QuantRows it uses.
#pragma once
#include <algorithm>
#include <cstdint>

namespace shardlm {

constexpr int64_t PAIR_HALF = QBLOCK / 4;  // column pairs in half a block (8); a chunk holds four halves

// In a row of `units` column pairs (of `unit` values each), each whole pair of blocks from block 0 turned into the
// paired order: the pair's second and third halves (A 16-31, B 0-15) exchanged, in place and its own inverse. An odd
// last block stays.
template <typename T>
inline void pair_blocks(T* v, int64_t units, int64_t unit) {
  for (int64_t at = 0; at + 4 * PAIR_HALF <= units; at += 4 * PAIR_HALF)
    std::swap_ranges(v + (at + PAIR_HALF) * unit, v + (at + 2 * PAIR_HALF) * unit, v + (at + 2 * PAIR_HALF) * unit);
}

// Each row of rows x kp codes (one or two bytes each) from the natural order to the paired one, or back.
template <typename C>
inline void pair_codes(C* v, int64_t rows, int64_t kp) {
  for (int64_t r = 0; r < rows; ++r) pair_blocks(v + r * kp, kp / 2, 2);
}

// x's activation codes in the paired order, and each row's chunk scale vectors (pair_scales: (b, chunks, 16), chunk
// l's lanes 0-7 block 2l's scale, lanes 8-15 block 2l + 1's, zero past the last block).
inline void pair_rows(QuantRows& x, int64_t b) {
  pair_codes(x.codes.data(), b, x.kp);
  const int64_t chunks = (x.blocks + 1) / 2;
  x.pair_scales.assign(b * chunks * 16, 0.f);
  for (int64_t j = 0; j < b; ++j)
    for (int64_t blk = 0; blk < x.blocks; ++blk) {
      float* lanes = x.pair_scales.data() + (j * chunks + blk / 2) * 16 + blk % 2 * 8;
      std::fill(lanes, lanes + 8, x.scales[j * x.blocks + blk]);
    }
  x.paired = true;
}

// Whether the float-summed rows read paired activation codes: on a 512-bit build.
constexpr bool float_rows_paired() {
#if defined(SHARDLM_Q8_WIDE)
  return true;
#else
  return false;
#endif
}

// x made ready for the float-summed rows: paired where they read it so (float_rows_paired), else left natural.
inline void ready_for_float_rows(QuantRows& x, int64_t b) {
  if (float_rows_paired()) pair_rows(x, b);
}

#if defined(SHARDLM_Q8_WIDE)
// A chunk's 64 weight codes widened to int16 in the paired order: lo [A 0-15, B 0-15], hi [A 16-31, B 16-31].
struct ChunkCodes {
  __m512i lo, hi;
};

template <bool PairedW>
__attribute__((always_inline)) inline ChunkCodes widen_chunk(const int8_t* w) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
  if constexpr (PairedW) return {_mm512_cvtepi8_epi16(a), _mm512_cvtepi8_epi16(b)};
  return {_mm512_cvtepi8_epi16(_mm256_permute2x128_si256(a, b, 0x20)),
          _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(a, b, 0x31))};
}

// A chunk's sixteen int32 lanes against paired activation codes x: lanes 0-7 block A's quads, 8-15 block B's.
__attribute__((always_inline)) inline __m512i chunk_dot(const ChunkCodes& w, const int16_t* x) {
  const __m512i xl = _mm512_loadu_si512(x), xh = _mm512_loadu_si512(x + 32);
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(_mm512_madd_epi16(w.lo, xl), w.hi, xh);
#else
  return _mm512_add_epi32(_mm512_madd_epi16(w.lo, xl), _mm512_madd_epi16(w.hi, xh));
#endif
}

// An odd last block alone (natural in either order): its quads in lanes 0-7, zeros in lanes 8-15.
__attribute__((always_inline)) inline __m512i lone_dot(const int8_t* w, const int16_t* x) {
  return _mm512_zextsi256_si512(block_dot(widen_int8(w), x));
}

// chain += float(isum) * the chunk's scale vector.
__attribute__((always_inline)) inline void chain_add(__m512& chain, __m512i isum, const float* lanes) {
  chain = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_loadu_ps(lanes), chain);
}

// Chunk l of the R x J pairs into chain C, the R weight rows side by side: each row's codes widened once for the J
// activation rows, every row asking for its row PREFETCH_ROWS on. Lone: l is an odd last block.
template <int R, int J, int C, bool PairedW, bool Lone>
__attribute__((always_inline)) inline void tile_chunk(const int8_t* w, int64_t ldw, const QuantRows& x, int64_t r0,
                                                      int64_t j0, int64_t l, __m512 (&acc)[R][J][2]) {
  const int64_t chunks = (x.blocks + 1) / 2, at = l * 2 * QBLOCK;
  for (int r = 0; r < R; ++r) {
    const int8_t* row = w + (r0 + r) * ldw;
    _mm_prefetch(reinterpret_cast<const char*>(row + PREFETCH_ROWS * ldw + at), _MM_HINT_T0);
    if constexpr (Lone) {
      const Codes16 wv = widen_int8(row + at);
      for (int j = 0; j < J; ++j)
        chain_add(acc[r][j][C], _mm512_zextsi256_si512(block_dot(wv, x.codes.data() + (j0 + j) * x.kp + at)),
                  x.pair_scales.data() + ((j0 + j) * chunks + l) * 16);
    } else {
      const ChunkCodes wv = widen_chunk<PairedW>(row + at);
      for (int j = 0; j < J; ++j)
        chain_add(acc[r][j][C], chunk_dot(wv, x.codes.data() + (j0 + j) * x.kp + at),
                  x.pair_scales.data() + ((j0 + j) * chunks + l) * 16);
    }
  }
}

// The R x J pairs' two chains over every chunk: chunk l into chain l % 2.
template <int R, int J, bool PairedW>
__attribute__((always_inline)) inline void pair_tile_sums(const int8_t* w, int64_t ldw, const QuantRows& x,
                                                          int64_t r0, int64_t j0, __m512 (&acc)[R][J][2]) {
  const int64_t whole = x.blocks / 2;
  int64_t l = 0;
  for (; l + 2 <= whole; l += 2) {
    tile_chunk<R, J, 0, PairedW, false>(w, ldw, x, r0, j0, l, acc);
    tile_chunk<R, J, 1, PairedW, false>(w, ldw, x, r0, j0, l + 1, acc);
  }
  if (l < whole) tile_chunk<R, J, 0, PairedW, false>(w, ldw, x, r0, j0, l, acc);
  if (x.blocks % 2 == 0) return;
  if (whole % 2)
    tile_chunk<R, J, 1, PairedW, true>(w, ldw, x, r0, j0, whole, acc);
  else
    tile_chunk<R, J, 0, PairedW, true>(w, ldw, x, r0, j0, whole, acc);
}

// How far ahead the one-row loop asks for the weight's lines (into L2, stream_prefetch): twice the block-at-a-time
// loop's STREAM_AHEAD. This loop takes fewer instructions a line, so at 4 KB the lines came too late: from memory
// (2 threads, 75 MB of int8 rows, the same pages in each order) it ran 0.94-0.96x the block-at-a-time loop's speed
// at 4 KB, 0.77x at 2 KB, and 1.09-1.12x at 8 KB (2026-11-29).
constexpr int64_t PAIR_AHEAD = 2 * STREAM_AHEAD;

// The same chains for one activation row (j0), the weight rows one after another: the weight is read as one address
// stream, each row asking for the line STREAM_AHEAD bytes on, where the rows side by side read R streams at once
// (measured before the chunks, a block at a time: 0.84x the time of side-by-side rows from memory and 0.95x from the
// caches in scratch C++; 0.83-0.995x a batch-1 int8 decode step in-process). Each pair's chains get pair_tile_sums'
// terms in the same order, bit for bit; only the order of the weight rows differs.
template <int R, bool PairedW>
__attribute__((always_inline)) inline void pair_row_sums(const int8_t* w, int64_t ldw, const QuantRows& x, int64_t r0,
                                                         int64_t j0, __m512 (&acc)[R][1][2]) {
  const int16_t* xc = x.codes.data() + j0 * x.kp;
  const int64_t whole = x.blocks / 2;
  const float* lanes = x.pair_scales.data() + j0 * ((x.blocks + 1) / 2) * 16;  // (chunks, 16)
  for (int r = 0; r < R; ++r) {
    const int8_t* row = w + (r0 + r) * ldw;
    __m512 even = acc[r][0][0], odd = acc[r][0][1];  // a row's chains in registers through its chunks
    auto add_chunk = [&](__m512& chain, int64_t l) {  // a chunk (a cache line) a step
      stream_prefetch(row + l * 2 * QBLOCK + PAIR_AHEAD);
      chain_add(chain, chunk_dot(widen_chunk<PairedW>(row + l * 2 * QBLOCK), xc + l * 2 * QBLOCK), lanes + l * 16);
    };
    int64_t l = 0;
    for (; l + 2 <= whole; l += 2) add_chunk(even, l), add_chunk(odd, l + 1);
    if (l < whole) add_chunk(even, l);
    if (x.blocks % 2) {  // a branch, where a reference to one of the chains would keep both in memory
      const __m512i isum = lone_dot(row + whole * 2 * QBLOCK, xc + whole * 2 * QBLOCK);
      if (whole % 2)
        chain_add(odd, isum, lanes + whole * 16);
      else
        chain_add(even, isum, lanes + whole * 16);
    }
    acc[r][0][0] = even, acc[r][0][1] = odd;
  }
}
#endif

}  // namespace shardlm
