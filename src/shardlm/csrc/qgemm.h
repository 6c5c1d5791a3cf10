// Prefill products with float32 and bfloat16 weights: widen a panel of weight rows to float32 once, multiply it in
// FMA tiles. (int8 and int4 weights: qpanel.h, in the integer units.)
//
// Decode (rows.h) reads each weight once per token and is bound by memory. A prefill of many tokens is bound by
// arithmetic instead. On an Ice Lake host this tiling runs at about the rate of MKL's sgemm; the 12 x 2 tile before
// it ran at about twice MKL's rate on the AMD hosts measured but slower than MKL on the Ice Lake, and this one has not
// run on AMD yet (bench/RESULTS.md, stop 64). Here a panel of PANEL weight rows (16, or 48 with AVX-512) is widened
// to float32 once per call into a thread's buffer laid out [k][PANEL], and a register tile of GEMM_ROWS activation
// rows by PANEL weight rows runs FMAs over k: PANEL_VECS vector loads and GEMM_ROWS broadcasts feed PANEL_VECS *
// GEMM_ROWS FMAs, the panel prefetched ahead. (A pass of a few rows skips the widening: fewrows.h runs the same
// chains over the weight in place.)
//
// Each output keeps one float32 lane whose FMA chain runs over k in order, whatever the number of rows, the
// tile or the panel it falls in: a token's result does not depend on the batch or the chunk around it, nor
// on how many weight rows a column-parallel rank holds.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "rows.h"

namespace shardlm {

// The tile's vectors: 16 floats where the CPU has AVX-512 (32 registers), else 8 (16 registers). Either way an
// output is one lane whose FMA chain runs over k in order, so both give the same numbers, whatever the tile's shape.
// MR is the row count of the prefill attention's tiles (prefill_attn.h); the products' tile is GEMM_ROWS rows by
// PANEL_VECS vectors of weight rows: on AVX-512, 8 x 3 (24 accumulators, 3 vector loads and 8 broadcasts feed 24
// FMAs) ran at 135-167 GFLOP/s on an Ice Lake core whose FMA peak measured 145-196, its panel in the L2 and
// prefetched, where 12 x 2 ran at 107-136 (121-150 prefetched; one core, k 576 and 1536: RESULTS.md, stop 64).
#if defined(__AVX512F__)
typedef float vpf __attribute__((vector_size(64)));
constexpr int MR = 12;  // query rows a prefill attention tile holds (2 * MR accumulators + 2 key vectors)
constexpr int GEMM_ROWS = 8, PANEL_VECS = 3;
inline vpf fma_p(vpf a, vpf b, vpf c) {
  return reinterpret_cast<vpf>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                               reinterpret_cast<__m512>(c)));
}
#else
typedef v8f vpf;
constexpr int MR = 6;
constexpr int GEMM_ROWS = 6, PANEL_VECS = 2;
inline vpf fma_p(vpf a, vpf b, vpf c) { return fma8(a, b, c); }
#endif
constexpr int64_t VL = sizeof(vpf) / sizeof(float);
constexpr int64_t PANEL = PANEL_VECS * VL;  // weight rows a panel holds
constexpr int64_t PANEL_PREFETCH = 32;  // k steps ahead the tile asks for its panel (it streams from the L2)
constexpr int64_t PANEL_CHUNK_BYTES = 512 * 1024;  // panels a thread widens before it runs the rows over them


// *p in every lane: one broadcast load. (`vpf{} + *p` compiled to a scalar add of zero and a register broadcast,
// two extra instructions per row and column of a tile. The sign of a zero x cannot matter: the accumulators
// start at +0 and round-to-nearest never makes them -0.)
inline vpf splat_p(const float* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vpf>(_mm512_set1_ps(*p));
#else
  const float v = *p;
  return vpf{v, v, v, v, v, v, v, v};
#endif
}

inline vpf load_p(const float* p) {
  vpf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}


// Eight rows of eight floats (rows[i] = row i) written as eight columns: out[c * PANEL + i] = rows[i][c].
inline void store_transposed(const v8f* rows, float* out) {
#if defined(__AVX__)
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = reinterpret_cast<__m256>(rows[i]);
  for (int i = 0; i < 8; i += 2) {  // pairs of rows interleaved
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // then quads: lane l of 128-bit half h holds column 4h + l's four values
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {  // rows 0-3 and 4-7 of column c (and c + 4) meet across the 128-bit halves
    _mm256_storeu_ps(out + c * PANEL, _mm256_permute2f128_ps(r[c], r[c + 4], 0x20));
    _mm256_storeu_ps(out + (c + 4) * PANEL, _mm256_permute2f128_ps(r[c], r[c + 4], 0x31));
  }
#else
  for (int i = 0; i < 8; ++i)
    for (int c = 0; c < 8; ++c) out[c * PANEL + i] = rows[i][c];
#endif
}

// Rows [r0, r0 + PANEL) of a weight as floats at out[k * PANEL + r] (rows past n as zeros), eight columns at a time:
// `row8(r, k)` gives row r's columns [k, k + 8).
template <typename Row8>
inline void widen_panel(int64_t kp, int64_t n, int64_t r0, float* out, const Row8& row8) {
  v8f rows[8];
  for (int64_t g = 0; g < PANEL; g += 8)  // eight rows at a time: eight streams from memory, not PANEL
    for (int64_t k = 0; k < kp; k += 8) {
      for (int64_t r = 0; r < 8; ++r) rows[r] = r0 + g + r < n ? row8(r0 + g + r, k) : v8f{};
      store_transposed(rows, out + k * PANEL + g);
    }
}

// A float32 or bfloat16 weight (n, k), rows k apart; columns past k (up to kp, a multiple of 8) as zeros.
template <typename W>
inline void widen_panel_float(const W* w, int64_t k, int64_t kp, int64_t n, int64_t r0, float* out) {
  widen_panel(kp, n, r0, out, [&](int64_t r, int64_t c) {
    if (c + 8 <= k) return load8<W>(w + r * k + c);
    v8f tail{};
    for (int64_t i = c; i < k; ++i) tail[i - c] = load<W>(w + r * k, i);
    return tail;
  });
}

// y[j, c] for R rows of x (rows ldx apart, kp columns) against one widened panel; `cols` of its PANEL outputs are
// kept (the last panel of a weight may be short). Output rows are ldy apart.
template <int R>
inline void panel_tile(const float* x, int64_t ldx, int64_t kp, const float* panel, float* y, int64_t ldy,
                       int64_t cols) {
  vpf acc[R][PANEL_VECS];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < PANEL_VECS; ++v) acc[r][v] = vpf{};
  for (int64_t k = 0; k < kp; ++k) {
    vpf w[PANEL_VECS];
    for (int v = 0; v < PANEL_VECS; ++v) {  // (past the panel's end the prefetch reads the next panel of the chunk)
      __builtin_prefetch(panel + (k + PANEL_PREFETCH) * PANEL + v * VL, 0, 3);
      w[v] = load_p(panel + k * PANEL + v * VL);
    }
    for (int r = 0; r < R; ++r) {
      const vpf xb = splat_p(x + r * ldx + k);  // x[r, k] in every lane
      for (int v = 0; v < PANEL_VECS; ++v) acc[r][v] = fma_p(w[v], xb, acc[r][v]);
    }
  }
  if (cols == PANEL) {  // a whole panel's outputs: PANEL_VECS vector stores a row
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < PANEL_VECS; ++v) std::memcpy(y + r * ldy + v * VL, &acc[r][v], sizeof(vpf));
    return;
  }
  for (int r = 0; r < R; ++r) {  // through arrays: indexing the vectors by a runtime column would keep them in
    float lanes[PANEL];          // memory for the whole loop
    for (int v = 0; v < PANEL_VECS; ++v) std::memcpy(lanes + v * VL, &acc[r][v], sizeof(vpf));
    for (int64_t c = 0; c < cols; ++c) y[r * ldy + c] = lanes[c];
  }
}

// Every row of x (b rows of kp) against panels [p0, p1) of a widened chunk (panel p at chunk + (p - p0) * kp * PANEL).
inline void chunk_rows(const float* x, int64_t b, int64_t kp, const float* chunk, int64_t p0, int64_t p1, float* y,
                       int64_t n) {
  constexpr int64_t rows_block = 48;  // rows of x kept hot while the chunk's panels pass over them
  for (int64_t j0 = 0; j0 < b; j0 += rows_block) {
    const int64_t j1 = std::min(b, j0 + rows_block);
    for (int64_t p = p0; p < p1; ++p) {
      const float* panel = chunk + (p - p0) * kp * PANEL;
      const int64_t c0 = p * PANEL, cols = std::min(PANEL, n - c0);
      int64_t j = j0;
      for (; j + GEMM_ROWS <= j1; j += GEMM_ROWS)
        panel_tile<GEMM_ROWS>(x + j * kp, kp, kp, panel, y + j * n + c0, n, cols);
      // the rows left: in tiles of 4 and 2 before single rows (each row of a single-row tile loads the panel once)
      if (j + 4 <= j1) panel_tile<4>(x + j * kp, kp, kp, panel, y + j * n + c0, n, cols), j += 4;
      if (j + 2 <= j1) panel_tile<2>(x + j * kp, kp, kp, panel, y + j * n + c0, n, cols), j += 2;
      for (; j < j1; ++j) panel_tile<1>(x + j * kp, kp, kp, panel, y + j * n + c0, n, cols);
    }
  }
}

// y (b, n) = x (b, kp) @ W^T for a weight whose panels `widen(r0, out)` writes: threads split the panels, each
// widens a chunk of them at a time into its own buffer and runs every row of x over it.
template <typename Widen>
inline void panel_gemm(const float* x, int64_t b, int64_t kp, int64_t n, float* y, const Widen& widen) {
  const int64_t panels = (n + PANEL - 1) / PANEL;
  const int64_t per_chunk = std::max<int64_t>(1, PANEL_CHUNK_BYTES / (kp * PANEL * 4));
  at::parallel_for(0, panels, 1, [&](int64_t lo, int64_t hi) {
    thread_local std::vector<float, LineAligned<float>> kept;  // every panel widened whole before it is read
    float* chunk = grown(kept, std::min(per_chunk, hi - lo) * kp * PANEL);
    for (int64_t p0 = lo; p0 < hi; p0 += per_chunk) {
      const int64_t p1 = std::min(hi, p0 + per_chunk);
      for (int64_t p = p0; p < p1; ++p) widen(p * PANEL, chunk + (p - p0) * kp * PANEL);
      chunk_rows(x, b, kp, chunk, p0, p1, y, n);
    }
  });
}

}  // namespace shardlm
