// Prefill products with int8 and int4 weights in the integer units: panels of int16 weight pairs against int16
// activation codes.
//
// A prefill is bound by arithmetic. Widened to float32 (as qgemm.h does for float weights), quantized weights ran
// at float32's speed: one FMA, 16 products, per 512-bit instruction. The integer dot product of two int16 vectors
// (VNNI's vpdpwssd) does 32 per instruction at about the same rate on this VM (a scratch loop of 12 chains: 7.2
// against 7.7 G instructions/s a core). So the activation rows are quantized as decode quantizes them (qrows.h:
// int16 codes in blocks of 32, one float scale a block), and a panel of QPANEL weight rows is widened once per
// call to int16 and laid out in pairs: word [p][i] holds row i's columns 2p and 2p + 1, so one vector is QVL rows'
// pair p and meets an activation row's pair p broadcast to every lane. A register tile of a few activation rows by
// QPANEL weight rows sums a block's 32 columns in int32 (exact in any order), then applies the block's scales in
// float32 lanes: one chain per output over the blocks in order, whatever the batch, tile or panel, the same on
// every build (the scalar build calls std::fma).
//
// Per output:
// - int8: acc += float(isum) * x_scale over the blocks, times the row's scale at the end (decode's qrows.h tiles
//   keep sixteen float lanes a row instead and add them at the end, so plain int8 prefill and decode differ in the
//   last bits). `exact` weights (o and down projections, whose rows tensor parallelism splits by input column):
//   qrows.h's terms float(isum) * x_scale added in double, so a row-parallel rank's partial sums add up to the
//   one-rank result; these equal decode's (gemv_int8) exact sums but for double sums in another order (about 2^-29
//   a value).
// - int4 (q4tiles.h): acc += float(isum) * (scale * x_scale) and zacc += m * x_sum (m = zero - 8 * scale), the
//   result acc + zacc: decode's numbers bit for bit. `exact`: both kinds of term in one double sum (decode's exact
//   sums but for double sums in another order).
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qpanel_parts.h"

namespace shardlm {

// A widened panel: the int16 pairs of QPANEL weight rows and, for int4, each group's scales and m terms
// (qpanel_parts.h), or for int8 the rows' scales (global rows, indexed by output).
struct QPanel {
  const int32_t* words;
  const float* s = nullptr;  // int4: [groups][QPANEL]
  const float* m = nullptr;
  const double* md = nullptr;  // int4: m as doubles (Exact)
  const float* scale = nullptr;  // int8: one a weight row
};

#if !defined(SHARDLM_QPANEL_VEC)
// Without vector units: qpanel_tile's arithmetic, scalar (float FMAs as std::fma, double sums as doubles).
template <bool Exact, bool Q4, int R>
inline void qpanel_tile_scalar(const QuantRows& x, int64_t j0, const QPanel& panel, float (&sums)[R][QPANEL],
                               double (&totals)[R][QPANEL]) {
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < QPANEL; ++c) {
      float acc = 0.f, zacc = 0.f;
      double dacc = 0.0;
      for (int64_t blk = 0; blk < x.blocks; ++blk) {
        const int64_t at = (j0 + r) * x.blocks + blk;
        const int16_t* xc = x.codes.data() + (j0 + r) * x.kp + blk * QBLOCK;
        int32_t isum = 0;
        for (int64_t p = 0; p < QPAIRS; ++p) {
          const int32_t word = panel.words[(blk * QPAIRS + p) * QPANEL + c];
          isum += static_cast<int16_t>(word & 0xFFFF) * xc[2 * p] + static_cast<int16_t>(word >> 16) * xc[2 * p + 1];
        }
        const float f = Q4 ? panel.s[blk * QPANEL + c] * x.scales[at] : x.scales[at];
        if constexpr (Exact) {
          dacc += static_cast<double>(static_cast<float>(isum) * f);
          if constexpr (Q4) dacc += static_cast<double>(panel.m[blk * QPANEL + c]) * static_cast<double>(x.sums[at]);
        } else {
          acc = std::fma(static_cast<float>(isum), f, acc);
          if constexpr (Q4) zacc = std::fma(panel.m[blk * QPANEL + c], x.sums[at], zacc);
        }
      }
      sums[r][c] = Q4 ? acc + zacc : acc;
      totals[r][c] = dacc;
    }
}
#endif

// A tile's finished sums into y (rows n apart): int8 times the row scales (in float, or in double for `Exact`),
// int4 as they are.
template <typename T, bool Exact, bool Q4, int R>
inline void store_tile(const QPanel& panel, const float (&sums)[R][QPANEL], const double (&totals)[R][QPANEL], T* y,
                       int64_t n, int64_t c0, int64_t cols) {
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      if constexpr (Q4)
        y[r * n + c] = static_cast<T>(Exact ? totals[r][c] : sums[r][c]);
      else if constexpr (Exact)
        y[r * n + c] = static_cast<T>(static_cast<double>(panel.scale[c0 + c]) * totals[r][c]);
      else
        y[r * n + c] = static_cast<T>(panel.scale[c0 + c] * sums[r][c]);
    }
}

// int4's zacc of the tile's R activation rows (from j0) and both lane halves of a panel, added to sums (each row's
// acc, stored): m * x_sum over the blocks in order, one float FMA chain a lane (q4tiles.h's), run after the integer
// sums rather than beside them, so that a tile's int32 sums and float accumulators alone hold the registers (with
// zacc beside them a 6-row tile needed 39 of AVX-512's 32). The 2R chains go side by side, each its own order: one
// chain at a time, each FMA waiting on the last, had made an int4 tile 1.4x slower than an int8 one (one thread,
// hot panels, scratch C++, stop 67).
template <typename V, int R>
inline void add_zero_terms(const QuantRows& x, int64_t j0, const QPanel& panel, float (&sums)[R][QPANEL]) {
  typename V::F zacc[R][2];
  for (int r = 0; r < R; ++r) zacc[r][0] = zacc[r][1] = V::fzero();
  for (int64_t blk = 0; blk < x.blocks; ++blk) {
    const typename V::F m0 = V::loadf(panel.m + blk * QPANEL), m1 = V::loadf(panel.m + blk * QPANEL + QVL);
    for (int r = 0; r < R; ++r) {
      const typename V::F xs = V::splatf(x.sums[(j0 + r) * x.blocks + blk]);
      zacc[r][0] = V::fma(m0, xs, zacc[r][0]);
      zacc[r][1] = V::fma(m1, xs, zacc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) V::store(sums[r] + h * QVL, V::add(V::loadf(sums[r] + h * QVL), zacc[r][h]));
}

// The outputs of R activation rows (from j0) against one widened panel (weight rows c0 .. c0 + cols), output rows n
// apart. int8 (Q4 false): float sums times the row scales, or (`Exact`) double sums of the block terms times the
// row scales. int4: acc + zacc in float, as q4tiles.h's q4_tile computes them, or (`Exact`) both kinds of block
// term in one double sum.
template <typename T, bool Exact, bool Q4, int R>
inline void qpanel_tile(const QuantRows& x, int64_t j0, const QPanel& panel, T* y, int64_t n, int64_t c0,
                        int64_t cols) {
  float sums[R][QPANEL];      // !Exact: each output's float result before the int8 row scale
  double totals[R][QPANEL];   // Exact: each output's double sum (int4: both sums added)
#if defined(SHARDLM_QPANEL_VEC)
  using V = QVec;
  using F = typename V::F;
  F acc[R][2];
  typename V::D dacc[Exact ? R : 1][4];  // Exact: the double sums, in registers
  for (int r = 0; r < R; ++r) {
    acc[r][0] = acc[r][1] = V::fzero();
    if constexpr (Exact) dacc[r][0] = dacc[r][1] = dacc[r][2] = dacc[r][3] = V::dzero();
  }
  for (int64_t blk = 0; blk < x.blocks; ++blk) {
    typename V::I isum[R][2];
    for (int r = 0; r < R; ++r) isum[r][0] = isum[r][1] = V::zero();
    const int32_t* words = panel.words + blk * QPAIRS * QPANEL;
#pragma GCC unroll 16
    for (int64_t p = 0; p < QPAIRS; ++p) {  // (GCC copied the accumulators each pair when the loop stayed rolled)
      const typename V::I w0 = V::load(words + p * QPANEL), w1 = V::load(words + p * QPANEL + QVL);
      for (int r = 0; r < R; ++r) {  // activation row j0 + r's pair p in every lane
        const typename V::I xb = V::splat(x.codes.data() + (j0 + r) * x.kp + blk * QBLOCK + 2 * p);
        isum[r][0] = V::dot(isum[r][0], w0, xb);
        isum[r][1] = V::dot(isum[r][1], w1, xb);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (j0 + r) * x.blocks + blk;
      const F d = V::splatf(x.scales[at]);
      for (int h = 0; h < 2; ++h) {
        F f = d;  // what the block's integer sum is multiplied by
        if constexpr (Q4) f = V::mul(V::loadf(panel.s + blk * QPANEL + h * QVL), d);
        if constexpr (Exact) {
          V::add_to(dacc[r] + 2 * h, V::mul(V::to_float(isum[r][h]), f));
          if constexpr (Q4)
            V::add_products(dacc[r] + 2 * h, panel.md + blk * QPANEL + h * QVL,
                            V::splatd(static_cast<double>(x.sums[at])));  // products of two floats: exact
        } else {
          acc[r][h] = V::fma(V::to_float(isum[r][h]), f, acc[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (Exact) {
      std::memcpy(totals[r], dacc[r], sizeof(totals[r]));
    } else {
      for (int h = 0; h < 2; ++h) V::store(sums[r] + h * QVL, acc[r][h]);
    }
  }
  if constexpr (Q4 && !Exact) add_zero_terms<V, R>(x, j0, panel, sums);
#else
  qpanel_tile_scalar<Exact, Q4, R>(x, j0, panel, sums, totals);
#endif
  store_tile<T, Exact, Q4, R>(panel, sums, totals, y + j0 * n + c0, n, c0, cols);
}

// Every activation row against panels [p0, p1) of a widened chunk (`panel_at(p)`).
template <typename T, bool Exact, bool Q4, typename PanelAt>
inline void qpanel_rows(const QuantRows& x, int64_t b, int64_t p0, int64_t p1, T* y, int64_t n,
                        const PanelAt& panel_at) {
  constexpr int64_t rows_block = 48;  // activation rows kept hot while the chunk's panels pass over them
  constexpr int rows = qpanel_rows_for(Exact, Q4);
  for (int64_t j0 = 0; j0 < b; j0 += rows_block) {
    const int64_t j1 = std::min(b, j0 + rows_block);
    for (int64_t p = p0; p < p1; ++p) {
      const QPanel panel = panel_at(p);
      const int64_t c0 = p * QPANEL, cols = std::min(QPANEL, n - c0);
      int64_t j = j0;
      for (; j + rows <= j1; j += rows) qpanel_tile<T, Exact, Q4, rows>(x, j, panel, y, n, c0, cols);
      if constexpr (rows > 2)
        if (j + 2 <= j1) qpanel_tile<T, Exact, Q4, 2>(x, j, panel, y, n, c0, cols), j += 2;
      for (; j < j1; ++j) qpanel_tile<T, Exact, Q4, 1>(x, j, panel, y, n, c0, cols);
    }
  }
}

// y (b, n) = the quantized rows x against a weight of n rows, int8 (`w8` (n, x.kp) codes and `scale` one a row;
// `interleaved`: codes in qexact.h's order, `paired`: in qpairs.h's, turned back as they are widened) or int4 (`w4`,
// row tiles): threads split the panels, each widens a chunk of them at a time into its own buffers and runs every
// activation row over it.
template <typename T, bool Q4>
inline void qpanel_gemm(const int8_t* w8, const float* scale, const Int4Tiles* w4, int64_t n, const QuantRows& x,
                        int64_t b, bool exact, T* y, bool interleaved = false, bool paired = false) {
  if (b == 0) return;
  const int64_t kp = x.kp, panels = (n + QPANEL - 1) / QPANEL;
  const int64_t words = kp / 2 * QPANEL, floats = Q4 ? x.blocks * QPANEL : 0;
  const int64_t per_chunk = std::max<int64_t>(1, QPANEL_CHUNK_BYTES / (words * 4));
  at::parallel_for(0, panels, 1, [&](int64_t lo, int64_t hi) {
    const int64_t count = std::min(per_chunk, hi - lo);
    // the thread's kept buffers (rows.h grown), every value of a chunk's panels written before it is read
    thread_local std::vector<int32_t, LineAligned<int32_t>> kept_words;
    thread_local std::vector<float, LineAligned<float>> kept_s, kept_m;
    thread_local std::vector<double, LineAligned<double>> kept_md;
    int32_t* chunk = grown(kept_words, count * words);
    float *s = grown(kept_s, count * floats), *m = grown(kept_m, count * floats);
    double* md = grown(kept_md, count * floats);
    for (int64_t p0 = lo; p0 < hi; p0 += per_chunk) {
      const int64_t p1 = std::min(hi, p0 + per_chunk);
      for (int64_t p = p0; p < p1; ++p) {
        int32_t* out = chunk + (p - p0) * words;
        if constexpr (Q4)
          widen_qpanel_int4(*w4, p * QPANEL, out, s + (p - p0) * floats, m + (p - p0) * floats, md + (p - p0) * floats);
        else
          widen_qpanel(w8, kp, n, p * QPANEL, out);
        if (!Q4 && interleaved) deinterleave_panel(out, kp);
        if (!Q4 && paired) pair_blocks(out, kp / 2, QPANEL);  // the exchange is its own inverse
      }
      const auto panel_at = [&](int64_t p) {
        const int64_t i = p - p0;
        return QPanel{chunk + i * words, Q4 ? s + i * floats : nullptr, Q4 ? m + i * floats : nullptr,
                      Q4 ? md + i * floats : nullptr, scale};
      };
      if (exact)
        qpanel_rows<T, true, Q4>(x, b, p0, p1, y, n, panel_at);
      else
        qpanel_rows<T, false, Q4>(x, b, p0, p1, y, n, panel_at);
    }
  });
}

}  // namespace shardlm
