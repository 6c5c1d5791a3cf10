// Prefill products of a few rows (a short prompt, a few chunks) with a float32 or bfloat16 weight read in place.
//
// The panel kernel (qgemm.h) first widens each panel of weight rows into a [k][PANEL] buffer: a copy of the whole
// weight on every call. For a pass of hundreds of rows that copy is small beside the arithmetic; for a 64-token
// prompt it was as long as the arithmetic itself (35 % of the pass in widen_panel, 32 % in the tiles; perf,
// bundled model). Here the few rows of x are laid out instead, columns by blocks of VL rows ([block][k][VL]: a few
// hundred KB at most), and each weight row is read where it lies, one value at a time broadcast to every lane: a
// register tile of R weight rows by JB blocks of x rows runs R * JB FMAs per weight column.
//
// Each output is one float32 lane whose FMA chain runs over k in order from +0, its terms w[r, c] * x[j, c]: the
// very chain of the panel tiles (their padding columns add 0 * 0 to a sum that is never -0, which changes no
// bit), so a row's result is the same whichever kernel the number of rows in its pass picks.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qgemm.h"
#include "rows.h"

namespace shardlm {

// Passes of up to this many rows take few_rows_gemm. With AVX-512 (VL 16) eight blocks of x rows: tiles of 12 weight
// rows by two blocks swept over the blocks while the rows stay in L1, each sweep asking for its share of the next
// rows, took the bundled model's 30 layers of products (from memory) in 39.7 ms at 64 rows, 56.0 at 96 and 73.2 at
// 128 against the panels' 52.8, 61.4 and 74.5; 160 rows 90.9 against 89.6 (python bench/few_rows.py,
// bench/RESULTS.md). An AVX2 build (VL 8; timed on the same AVX-512 host) also wins through eight blocks: 32 rows
// 34.0 against 46.8 ms, 64 rows 65.6 against 71.5.
constexpr int64_t FEW_ROWS = 8 * VL;
#if defined(__AVX512F__)
constexpr int FEW_R1 = 12, FEW_R2 = 12;  // one block: 12 accumulators + 1 row vector + 1 broadcast; two: 24 + 2 + 1
#else
constexpr int FEW_R1 = 8, FEW_R2 = 4;  // one block: 8 + 1 + 1 of 16 registers; two: 8 + 2 + 1
#endif

// *p (float32, or bfloat16 bits) as a float in every lane.
template <typename W>
inline vpf splat_w(const W* p) {
  const float v = load<W>(p, 0);
  return splat_p(&v);
}

// xt[(blk * k + c) * VL + l] = x[blk * VL + l, c] for the b rows of x (k columns), zeros past row b.
inline std::vector<float> rows_by_blocks(const float* x, int64_t b, int64_t k) {
  const int64_t blocks = (b + VL - 1) / VL;
  std::vector<float> xt(static_cast<size_t>(blocks * k * VL), 0.f);
  at::parallel_for(0, k, 256, [&](int64_t c0, int64_t c1) {
    for (int64_t blk = 0; blk < blocks; ++blk)
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t l = 0; l < VL && blk * VL + l < b; ++l) xt[(blk * k + c) * VL + l] = x[(blk * VL + l) * k + c];
  });
  return xt;
}

// y[j, r] for weight rows [r0, r0 + R) and x rows of blocks [jb0, jb0 + JB): one FMA chain per output over k.
// Sweep `sweep` of the `sweeps` these weight rows make over the blocks asks the cache for its share of the next R
// rows' columns (prefetch_next_tile: a line of each row per cache line of columns, 16 float32 or 32 bfloat16 ones),
// spread over the sweep, so that memory streams through every sweep, the ones from L1 too (30 layers from memory:
// 16 rows 19.1-20.5 -> 14.3-14.5 ms, 64 rows 44.0-44.6 -> 38.9-39.8; bench/few_rows.py, builds alternating). It
// changes no arithmetic.
template <typename W, int R, int JB>
inline void few_rows_tile(const float* xt, int64_t k, const W* w, int64_t r0, int64_t jb0, float* y, int64_t n,
                          int64_t b, int sweep, int sweeps) {
  vpf acc[R][JB];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < JB; ++q) acc[r][q] = vpf{};
  const int64_t share = (k + sweeps - 1) / sweeps;
  int64_t ahead = sweep * share;  // the next tile's columns [ahead, ahead_end) are this sweep's to ask for
  const int64_t ahead_end = std::min(k, ahead + share);
  int wait = 0;
  for (int64_t c = 0; c < k; ++c) {
    if (++wait == sweeps) {  // one column of the share every `sweeps` columns: the share spreads over the sweep
      wait = 0;
      if (ahead < ahead_end) prefetch_next_tile<W, R>(w, k, r0, ahead++);  // only at a line's first column
    }
    vpf xv[JB];
    for (int q = 0; q < JB; ++q) {
      vpf v = load_p(xt + ((jb0 + q) * k + c) * VL);
#if defined(__AVX__)
      asm("" : "+v"(v));  // one load into a register, not one folded into each of the R FMAs (see rows.h)
#endif
      xv[q] = v;
    }
    for (int r = 0; r < R; ++r) {
      const vpf wb = splat_w<W>(w + (r0 + r) * k + c);
      for (int q = 0; q < JB; ++q) acc[r][q] = fma_p(wb, xv[q], acc[r][q]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < JB; ++q) {
      float lanes[VL];
      std::memcpy(lanes, &acc[r][q], sizeof(lanes));
      for (int64_t l = 0; l < VL; ++l) {
        const int64_t j = (jb0 + q) * VL + l;
        if (j < b) y[j * n + r0 + r] = lanes[l];
      }
    }
}

// Weight rows [r0, r0 + R) against every block of x rows, JB blocks at a time (the rows stay in L1 meanwhile).
template <typename W, int R, int JB>
inline void few_rows_weight_rows(const float* xt, int64_t k, const W* w, int64_t r0, float* y, int64_t n, int64_t b) {
  const int64_t blocks = (b + VL - 1) / VL;
  const int sweeps = static_cast<int>(blocks / JB + blocks % JB);
  int sweep = 0;
  int64_t q = 0;
  for (; q + JB <= blocks; q += JB) few_rows_tile<W, R, JB>(xt, k, w, r0, q, y, n, b, sweep++, sweeps);
  for (; q < blocks; ++q) few_rows_tile<W, R, 1>(xt, k, w, r0, q, y, n, b, sweep++, sweeps);
}

// Weight rows [lo, hi) in tiles of R rows by JB blocks of x rows, the last rows one at a time.
template <typename W, int R, int JB>
inline void few_rows_range(const float* xt, int64_t k, const W* w, int64_t lo, int64_t hi, float* y, int64_t n,
                           int64_t b) {
  int64_t r = lo;
  for (; r + R <= hi; r += R) few_rows_weight_rows<W, R, JB>(xt, k, w, r, y, n, b);
  for (; r < hi; ++r) few_rows_weight_rows<W, 1, JB>(xt, k, w, r, y, n, b);
}

// y (b, n) = x (b, k) @ w^T for a float32 or bfloat16 weight (n, k) in place; b <= FEW_ROWS is where it pays.
// One block of x rows takes tiles of FEW_R1 weight rows; more blocks, tiles of FEW_R2 rows by two blocks swept over
// all of them (a last odd block alone). A tile of 6 weight rows by one block had kept six FMA chains in flight, too
// few to fill two FMA units of four cycles' latency (a 16-row pass of the bundled model's 30 layers took 33.6 ms; 12
// rows by one block, 15.6 ms in a scratch form); 6 by 4 blocks read four x vectors from L2 per column (64 rows: 56.7
// ms against 44.5 for 12 by 2, swept). Every tile runs the same chains, so the bits do not change.
template <typename W>
inline void few_rows_gemm(const float* x, int64_t b, int64_t k, const W* w, int64_t n, float* y) {
  const std::vector<float> xt = rows_by_blocks(x, b, k);
  const int64_t blocks = (b + VL - 1) / VL;
  at::parallel_for(0, n, 48, [&](int64_t lo, int64_t hi) {
    if (blocks == 1)
      few_rows_range<W, FEW_R1, 1>(xt.data(), k, w, lo, hi, y, n, b);
    else
      few_rows_range<W, FEW_R2, 2>(xt.data(), k, w, lo, hi, y, n, b);
  });
}

}  // namespace shardlm
