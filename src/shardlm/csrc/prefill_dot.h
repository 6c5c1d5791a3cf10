// Prefill attention scores of bfloat16 queries and keys on CPUs with avx512_bf16: prefill_attn.h's score tile with
// VDPBF16PS in place of widening each key and fusing it in an FMA. One instruction takes two head dimensions of
// sixteen keys, where the float tile took one dimension of sixteen keys per FMA.
//
// The arithmetic of a score on these builds: one float32 chain over the head dimension's pairs in order; at pair p
// the hardware fuses q[2p + 1] * k[2p + 1] and then q[2p] * k[2p] (one rounding each; inputs and results below
// float32's normal range flushed to zero: bf16dot.h). q and k are bfloat16 already, so nothing is rounded on the
// way in. A score still depends on its query and key only, not on the batch, the block or where a chunk started.
// Builds without avx512_bf16 keep the float tile, whose bits differ from these by the order of each pair.
#pragma once
#include "bf16dot.h"
#if defined(SHARDLM_BF16_DOT)
#include <immintrin.h>

#include <cstdint>

namespace shardlm {

// Keys of one KV head (t, hd) bfloat16 words -> pairs (hd2, ldk) 32-bit words, hd2 = ceil(hd / 2): pairs[p, c]
// holds k[c, 2p] in its low half and k[c, 2p + 1] in its high half (zero past hd and past t).
inline void key_pairs(const uint16_t* k, int64_t t, int64_t hd, int64_t ldk, uint32_t* pairs) {
  const int64_t hd2 = (hd + 1) / 2;
  for (int64_t c = 0; c < t; ++c)
    for (int64_t p = 0; p < hd2; ++p) {
      const uint32_t lo = k[c * hd + 2 * p], hi = 2 * p + 1 < hd ? k[c * hd + 2 * p + 1] : 0u;
      pairs[p * ldk + c] = lo | (hi << 16);
    }
}

// R query rows (hd2 pairs each, rows hd2 apart) against 32 keys from the pairs' column c: y[r, 0:32] (ldy apart).
// Two vectors of sixteen keys and R broadcast query pairs feed 2 R dot-product steps a pair.
template <int R>
inline void pair_tile(const uint32_t* qp, int64_t hd2, const uint32_t* kp, int64_t ldk, float* y, int64_t ldy) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < hd2; ++p) {
    const __m512bh k0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kp + p * ldk));
    const __m512bh k1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kp + p * ldk + 16));
    for (int r = 0; r < R; ++r) {
      const __m512bh qb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(qp[r * hd2 + p])));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qb, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qb, k1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * ldy, acc[r][0]);
    _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
  }
}

}  // namespace shardlm
#endif
