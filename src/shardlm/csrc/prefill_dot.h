// Prefill attention of bfloat16 queries, keys and values on CPUs with avx512_bf16: prefill_attn.h's two FMA tiles
// with VDPBF16PS in place of widening each key or value and fusing it in an FMA. One instruction takes two head
// dimensions (scores) or two keys (values) of sixteen columns, where an FMA took one.
//
// The arithmetic on these builds (bits differ from builds without avx512_bf16, which keep the float tiles):
// - A score is one float32 chain over the head dimension's pairs in order; at pair p the hardware fuses
//   q[2p + 1] * k[2p + 1] and then q[2p] * k[2p] (one rounding each; inputs and results below float32's normal range
//   flushed to zero: bf16dot.h). q and k are bfloat16 already, so nothing is rounded on the way in.
// - The softmax is prefill_attn.h's, in float32. Its weights are then rounded to bfloat16 (torch's CPU flash
//   attention likewise rounds its exponentials to bfloat16 before their product with bfloat16 values), and an
//   output column is one float32 chain over the row's keys in pairs from its own first key, each pair fusing the
//   second key's product and then the first's.
// So a row's result depends on its query and the keys and values it may see, not on the batch, the block, its
// padding or where a chunk of its prompt started.
#pragma once
#include "bf16dot.h"
#if defined(SHARDLM_BF16_DOT)
#include <immintrin.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace shardlm {

// y[r, 0:32] = the R rows' dot products over `steps` pairs: x's pairs (rows ldx apart) against two vectors of
// sixteen columns of b's pairs (steps ldb apart), 2 R dot-product steps a pair; rows whose bit in `store` is clear
// are not written. Scores: x the queries' pairs, b the keys' (y one score a key). Values: x the weights' pairs, b
// the values' (y one output a head column).
template <int R>
inline void pair_tile(const uint32_t* x, int64_t ldx, int64_t steps, const uint32_t* b, int64_t ldb, float* y,
                      int64_t ldy, uint32_t store = ~0u) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < steps; ++p) {
    const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + p * ldb));
    const __m512bh b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + p * ldb + 16));
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r * ldx + p])));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, b1);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (!(store >> r & 1u)) continue;
    _mm512_storeu_ps(y + r * ldy, acc[r][0]);
    _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
  }
}

// Rows of q (m of them, hd bfloat16 words each, hd apart) -> pairs (R, hd2) for pair_tile, hd2 = ceil(hd / 2):
// pair p of a row holds its word 2p in the low half and 2p + 1 in the high half; zero past hd and for rows past m.
inline void query_pairs(const uint16_t* q, int64_t m, int64_t hd, int R, std::vector<uint32_t>& out) {
  const int64_t hd2 = (hd + 1) / 2;
  out.assign(static_cast<size_t>(R * hd2), 0u);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t p = 0; p < hd2; ++p) {
      const uint32_t lo = q[r * hd + 2 * p], hi = 2 * p + 1 < hd ? q[r * hd + 2 * p + 1] : 0u;
      out[r * hd2 + p] = lo | (hi << 16);
    }
}

// The KV heads of k and v (heads, t, hd) bfloat16 as pairs of words for pair_tile. Keys (hd2, ldk) a head: pair
// [p, c] holds k[c, 2p] low and k[c, 2p + 1] high (zero past hd and past t). Values twice, paired from key 0 and
// from key 1 ((t / 2 + 1, hdp) a head each): pair [i, d] from key e holds v[e + 2i, d] low and v[e + 2i + 1, d]
// high (zero past t and past hd).
struct PairKV {  // keys, vals: the pairs; hd2 pairs a key, ldk keys a pair row, np value pairs a head
  std::vector<uint32_t> keys, vals[2];
  int64_t hd2, ldk, hdp, np;
  PairKV(const uint16_t* k, const uint16_t* v, int64_t heads, int64_t t, int64_t hd, int64_t ldk_, int64_t hdp_)
      : hd2((hd + 1) / 2), ldk(ldk_), hdp(hdp_), np(t / 2 + 1) {
    keys.assign(static_cast<size_t>(heads * hd2 * ldk), 0u);
    for (auto& vp : vals) vp.assign(static_cast<size_t>(heads * np * hdp), 0u);
    const auto word = [&](const uint16_t* x, int64_t row, int64_t col) -> uint32_t {
      return row < t && col < hd ? x[row * hd + col] : 0u;
    };
    at::parallel_for(0, heads, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t g = lo; g < hi; ++g) {
        const uint16_t *kg = k + g * t * hd, *vg = v + g * t * hd;
        for (int64_t c = 0; c < t; ++c)
          for (int64_t p = 0; p < hd2; ++p)
            keys[(g * hd2 + p) * ldk + c] = word(kg, c, 2 * p) | word(kg, c, 2 * p + 1) << 16;
        for (int64_t e = 0; e < 2; ++e)
          for (int64_t i = 0; i < np; ++i)
            for (int64_t d = 0; d < hdp; ++d)
              vals[e][(g * np + i) * hdp + d] = word(vg, e + 2 * i, d) | word(vg, e + 2 * i + 1, d) << 16;
      }
    });
  }

  // The R rows' scores (their pairs qw, (R, hd2)) against keys c .. c + 32 of KV head g: y[r, 0:32].
  template <int R>
  void scores(const uint32_t* qw, int64_t g, int64_t c, float* y, int64_t ldy) const {
    pair_tile<R>(qw, hd2, hd2, keys.data() + g * hd2 * ldk + c, ldk, y, ldy);
  }

  // out (R, hdp) = the block's softmax weights (S[r, c - c0], rows ldS apart, zero outside each row's keys [lo[r],
  // hi[r]); m real rows) times KV head g's values. A row's weights are rounded to bfloat16 (to nearest, ties to
  // even; below float32's normal range as zero) and paired from its own first key: the rows whose first key is even
  // take the values paired from key 0, the others those from key 1 (one pass each). A pass pairs from the least
  // first key of its rows, so the pairs before a row's own first key add zeros: a row's output depends on its own
  // weights only, whatever the block, its padding or the chunk it came in.
  template <int R>
  void values(const float* S, int64_t ldS, int64_t c0, const int64_t* lo, const int64_t* hi, int64_t m, int64_t g,
              std::vector<uint32_t>& pw, float* out) const {
    std::fill(out, out + R * hdp, 0.f);
    for (int64_t e = 0; e < 2; ++e) {
      uint32_t rows = 0;
      int64_t a = std::numeric_limits<int64_t>::max(), z = 0;  // the pass's keys [a, z)
      for (int64_t r = 0; r < m; ++r)
        if (lo[r] < hi[r] && (lo[r] & 1) == e) rows |= 1u << r, a = std::min(a, lo[r]), z = std::max(z, hi[r]);
      if (rows == 0) continue;
      const int64_t steps = (z - a + 1) / 2, ldp = (steps + 15) / 16 * 16;
      pw.resize(static_cast<size_t>(R * ldp));
      for (int r = 0; r < R; ++r) {
        if (!(rows >> r & 1u)) continue;
        const float* from = S + r * ldS + (a - c0);  // its loads end within the row: z - c0 + 31 <= ldS
        for (int64_t i = 0; i < steps; i += 16) {
          const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(from + 2 * i + 16), _mm512_loadu_ps(from + 2 * i));
          _mm512_storeu_si512(pw.data() + r * ldp + i, reinterpret_cast<__m512i>(w));
        }
      }
      const uint32_t* vp = vals[e].data() + (g * np + (a - e) / 2) * hdp;  // the pair of keys a, a + 1
      for (int64_t d = 0; d < hdp; d += 32) pair_tile<R>(pw.data(), ldp, steps, vp + d, hdp, out + d, hdp, rows);
    }
  }
};

}  // namespace shardlm
#endif
